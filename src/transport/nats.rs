//! The NATS JetStream transport (async-nats): a static set of durable pull consumers as the
//! [`Source`], one consumer per owned partition as the [`PartitionInput`], and JetStream
//! publishes with `Nats-Msg-Id` de-duplication as the [`Sink`]. Also the `settle run` entry
//! point on NATS ([`run`], [`run_until`]) and the tooling `settle loadgen --nats` and the
//! tests use ([`publish_upload`], [`read_stream`]).
//!
//! # Subjects and partitions
//!
//! * **Input**: stream `nats.input-stream` (`SETTLE_UPLOADS`) with subjects
//!   `<nats.input-subject-prefix>.*`; partition `p` is the subject `<prefix>.<p>`
//!   (`settle.uploads.3`), `p` in `0..nats.partitions`. A producer computes the partition from
//!   the session key `tenant/session` with [`partition_for_key`] (32-bit FNV-1a of the key's
//!   UTF-8 bytes, modulo `nats.partitions`; the same hash as the memory transport), so all
//!   uploads of one session land in one partition (SEMANTICS §2). The message body is the
//!   upload record; header [`KEY_HEADER`] (`settle-key`) may carry the session key, and when
//!   present it must equal `tenant/session` (like a Kafka record key). The partition count
//!   must never change once data flows (it moves keys, like Kafka partitions).
//! * **Output**: stream `nats.output-stream` (`SETTLE_READY`) holds every tier's `topic` (used
//!   as a subject), `tiers.events-topic` and `nats.dead-letter-subject`. Ready records carry
//!   headers `Nats-Msg-Id` = `settle-emission-id` = the emission id and `settle-key` = the
//!   session key. JetStream drops a re-published emission whose id it saw within the stream's
//!   `duplicate-window` (`nats.duplicate-window`), so a crash between publish and outbox
//!   delete yields no duplicate on the subject (SEMANTICS §6).
//! * Both streams are created at start if missing, with `nats.storage`, `nats.replicas`,
//!   `nats.max-age` and `nats.duplicate-window`. An existing stream is used as it is, but
//!   must cover the subjects settle needs (checked at start: the error names the subject).
//!
//! # Ownership (no group protocol)
//!
//! Static assignment: instance `nats.instance` of `nats.instances` owns the partitions `p`
//! with `p mod instances == instance` ([`owned_partitions`]). The source hands them out once
//! at start and never revokes. Two instances must never share an index (two writers of a
//! partition would both emit its rounds); a restarted instance takes its partitions back.
//!
//! # Offsets and acks
//!
//! The offset of a message is its **stream sequence** (global to the stream, so a
//! partition's offsets have gaps: "next offset" is the last applied sequence + 1). Partition
//! `p` is read by the durable pull consumer `<nats.consumer-prefix>-<p>` (filter
//! `<prefix>.<p>`, explicit ack, `nats.ack-wait`, `nats.max-ack-pending`). A message is
//! acked only in [`PartitionInput::commit`], i.e. once the batch it belongs to is durable in
//! the partition store; until then its ack subject is held.
//!
//! When an input binds to its consumer (at start, after `seek` to the stored offset, and
//! after a fetch failed) it keeps the consumer only if it has nothing outstanding
//! (`num_ack_pending == 0`) and has not delivered past the position; otherwise it deletes
//! and re-creates it at the position (deliver policy "by start sequence"), so messages a
//! crashed process fetched but never applied come back at once, not after `ack-wait`. A gap
//! in the consumer sequence of the messages received (deliveries lost in transit, e.g. a
//! fetch cut by a disconnect) triggers the same rebind. A redelivered message below the
//! position is not handed out again (acked at once if already durable).
//!
//! # Fetching
//!
//! Every fetch is a no-wait pull request for up to `runtime.batch-size` messages: the server
//! answers at once with what it has, then "no messages". A poll that finds nothing asks
//! again every 20 ms until its wait (at most `runtime.idle-tick`) is over, so a new upload
//! reaches its partition within about 20 ms, and an idle partition costs the server about 50
//! small requests per second. Pull requests held open by the server are not used: a 2.9
//! server was seen to let one expire without answering (the client then waited 5 s and took
//! the silence for "caught up"), and a message delivered to an abandoned request would only
//! come back after `ack-wait`.
//!
//! # Caught up and event time (SEMANTICS §3)
//!
//! Every JetStream message says how many messages of its consumer are still pending after
//! it; a partition is caught up when that count is 0 after the last record handed out, or
//! when a fetch found nothing. Event time is the message's JetStream timestamp (the time the
//! server stored it: broker append time).
//!
//! # Failures
//!
//! The client reconnects forever with backoff (connection events are logged once each).
//! Requests that time out or find no responder (server away, JetStream restarting) are
//! [`Error::Unavailable`]: fetches, publishes and acks are retried by the runtime; a publish
//! whose ack was lost is re-sent with the same `Nats-Msg-Id` and de-duplicated. A message
//! larger than the server's max payload, and streams that exist without the needed subjects,
//! are [`Error::Fatal`]. Nothing the server acknowledged is lost: uploads are in the input
//! stream until settle's store has them, emissions in the store's outbox until JetStream
//! acknowledged them.

use super::{
    Error, InputBatch, InputRecord, PartitionInput, ReadyMessage, Sink, Source, SourceEvent,
};
use crate::codec::EMISSION_ID_HEADER;
use crate::config::Config;
use crate::engine::Engine;
use crate::runtime::{shutdown_on_signals, RunSummary, Runtime, RuntimeOptions, SystemClock};
use crate::tiers::TiersConfig;
use anyhow::Context as _;
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use async_nats::{HeaderMap, Subject};
use bytes::Bytes;
use futures::StreamExt;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use crate::config::nats::{
    owned_partitions, subject_matches, NatsConfig, NatsConfigError, Secret, Storage,
};

const TRANSPORT: &str = "nats";

/// Header carrying the session key `tenant/session` on uploads (optional; checked against
/// the record when present, SEMANTICS §2) and on ready records and dead letters.
pub const KEY_HEADER: &str = "settle-key";

/// Header of a dead letter: the record's JetStream timestamp, ms since the Unix epoch
/// (decimal; the dead letter gets a timestamp of its own). The other dead-letter headers
/// are the Kafka transport's (`settle-dlq-reason`, `settle-dlq-source-topic` = the input
/// stream, `settle-dlq-source-partition`, `settle-dlq-source-offset` = the stream sequence).
pub const DLQ_SOURCE_TIMESTAMP_HEADER: &str = "settle-dlq-source-timestamp";

/// Bound on one request to the server (stream and consumer management, one fetch).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a poll with nothing to read asks the server again (module docs: fetching).
const IDLE_FETCH_INTERVAL: Duration = Duration::from_millis(20);

/// Most messages asked for in one pull request.
const MAX_FETCH: usize = 10_000;

// ---------------------------------------------------------------------------------------------
// Configuration: the `[nats]` section is `crate::config::nats`; what JetStream gets from it

/// The JetStream settings `settle` derives from `[nats]`.
trait JetStreamSettings {
    /// Settings of a stream settle creates, named `name`, holding `subjects`.
    fn stream_config(&self, name: &str, subjects: Vec<String>) -> stream::Config;
    /// The durable consumer of `partition`, delivering from `start` (a stream sequence;
    /// `None` or ≤ 1: from the first message).
    fn consumer_config(&self, partition: i32, start: Option<u64>) -> pull::Config;
}

impl JetStreamSettings for NatsConfig {
    fn stream_config(&self, name: &str, subjects: Vec<String>) -> stream::Config {
        stream::Config {
            name: name.to_owned(),
            subjects,
            storage: match self.storage {
                Storage::File => stream::StorageType::File,
                Storage::Memory => stream::StorageType::Memory,
            },
            num_replicas: self.replicas as usize,
            max_age: self.max_age,
            duplicate_window: self.duplicate_window,
            ..stream::Config::default()
        }
    }

    fn consumer_config(&self, partition: i32, start: Option<u64>) -> pull::Config {
        pull::Config {
            durable_name: Some(self.consumer_name(partition)),
            filter_subject: self.input_subject(partition),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            max_ack_pending: i64::from(self.max_ack_pending),
            deliver_policy: match start {
                Some(s) if s > 1 => DeliverPolicy::ByStartSequence { start_sequence: s },
                _ => DeliverPolicy::All,
            },
            ..pull::Config::default()
        }
    }
}

/// The input partition of session key `key` (`tenant/session`, UTF-8 bytes) among
/// `partitions`: 32-bit FNV-1a of the key modulo `partitions` (offset basis `0x811c9dc5`,
/// prime `0x01000193`; the memory transport's hash). Producers publish the upload to
/// `<input-subject-prefix>.<partition>`. Example: `acme/build-42` (hash `0xcc5db871`) of 8 partitions → 1.
pub fn partition_for_key(key: &[u8], partitions: u32) -> i32 {
    super::memory::partition_for_key(key, partitions.clamp(1, i32::MAX as u32) as i32)
}

// ---------------------------------------------------------------------------------------------
// Connection and streams

/// Connects with the `[nats]` settings: reconnects forever with the client's backoff,
/// connecting in the background if the server is not there yet (requests then fail with
/// [`Error::Unavailable`] until it is). Connection events are logged.
///
/// Errors: [`Error::Fatal`] when the credentials file cannot be read or the URLs are bad.
pub async fn connect(config: &NatsConfig) -> Result<async_nats::Client, Error> {
    let away = Arc::new(AtomicBool::new(false));
    let mut options = async_nats::ConnectOptions::new()
        .name("settle")
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(CALL_TIMEOUT)
        .request_timeout(Some(CALL_TIMEOUT))
        .event_callback(move |event| {
            let away = Arc::clone(&away);
            async move { log_event(&event, &away) }
        });
    if let Some(path) = &config.credentials_file {
        options = options
            .credentials_file(path)
            .await
            .map_err(|e| fatal(format!("nats.credentials-file {}: {e}", path.display())))?;
    }
    if let Some(token) = &config.token {
        options = options.token(token.0.clone());
    }
    if let (Some(user), Some(password)) = (&config.user, &config.password) {
        options = options.user_and_password(user.clone(), password.0.clone());
    }
    if config.tls_required {
        options = options.require_tls(true);
    }
    if let Some(ca) = &config.tls_ca_file {
        options = options.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&config.tls_cert_file, &config.tls_key_file) {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    options
        .connect(config.server_list())
        .await
        .map_err(|e| fatal(format!("cannot connect to {}: {e}", config.servers)))
}

/// Logs a connection event; while disconnected, the failed reconnect attempts only at debug
/// level (one warning per outage, one line when it ends).
fn log_event(event: &async_nats::Event, away: &AtomicBool) {
    use async_nats::Event;
    match event {
        Event::Connected if away.swap(false, Ordering::Relaxed) => {
            tracing::warn!("nats: reconnected")
        }
        Event::Connected => tracing::info!("nats: connected"),
        Event::Disconnected => {
            away.store(true, Ordering::Relaxed);
            tracing::warn!("nats: disconnected; reconnecting with backoff")
        }
        Event::ClientError(e) if away.load(Ordering::Relaxed) => {
            tracing::debug!(error = %e, "nats: reconnect attempt failed")
        }
        Event::ClientError(e) => tracing::warn!(error = %e, "nats: client error"),
        Event::ServerError(e) => tracing::warn!(error = %e, "nats: server error"),
        other => tracing::info!(event = %other, "nats"),
    }
}

/// A JetStream context on `client` whose requests and publish acks time out after 5 s and
/// which allows `in_flight` unacknowledged publishes (more wait).
pub fn jetstream(client: async_nats::Client, in_flight: usize) -> jetstream::Context {
    jetstream::ContextBuilder::new()
        .timeout(CALL_TIMEOUT)
        .max_ack_inflight(in_flight.max(1))
        .backpressure_on_inflight(true)
        .build(client)
}

fn fatal(reason: String) -> Error {
    Error::Fatal {
        transport: TRANSPORT,
        reason,
    }
}

fn unavailable(reason: String) -> Error {
    Error::Unavailable {
        transport: TRANSPORT,
        reason,
    }
}

/// Creates the input stream (`<prefix>.*`) and the output stream (tier, tier-events and
/// dead-letter subjects) if missing; checks that existing ones cover those subjects.
///
/// Errors: [`Error::Unavailable`] when the server does not answer; [`Error::Fatal`] when it
/// refuses a stream (the message says why) or an existing stream lacks a subject.
pub async fn ensure_streams(
    js: &jetstream::Context,
    config: &NatsConfig,
    tiers: &TiersConfig,
) -> Result<(), Error> {
    ensure_stream(
        js,
        config.stream_config(&config.input_stream, vec![config.input_pattern()]),
        "nats.input-stream",
    )
    .await?;
    ensure_stream(
        js,
        config.stream_config(&config.output_stream, config.output_subjects(tiers)),
        "nats.output-stream",
    )
    .await
}

/// Creates the input stream of `config` if missing (what `settle loadgen --nats` needs).
///
/// Errors: as [`ensure_streams`].
pub async fn ensure_input_stream(
    js: &jetstream::Context,
    config: &NatsConfig,
) -> Result<(), Error> {
    ensure_stream(
        js,
        config.stream_config(&config.input_stream, vec![config.input_pattern()]),
        "nats.input-stream",
    )
    .await
}

async fn ensure_stream(
    js: &jetstream::Context,
    wanted: stream::Config,
    key: &str,
) -> Result<(), Error> {
    use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
    let name = wanted.name.clone();
    let existing = match js.get_stream(&name).await {
        Ok(s) => Some(s.cached_info().config.subjects.clone()),
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(j) if j.code() == 404 => None,
            GetStreamErrorKind::JetStream(j) => {
                return Err(fatal(format!("stream {name} ({key}): {j}")))
            }
            _ => return Err(unavailable(format!("stream {name}: {e}"))),
        },
    };
    let Some(subjects) = existing else {
        return match js.create_stream(wanted.clone()).await {
            Ok(_) => {
                tracing::info!(stream = %name, subjects = ?wanted.subjects, "nats: stream created");
                Ok(())
            }
            Err(e) => match e.kind() {
                CreateStreamErrorKind::JetStream(j) => Err(fatal(format!(
                    "cannot create stream {name} ({key}) with subjects {:?}: {j}",
                    wanted.subjects
                ))),
                _ => Err(unavailable(format!("cannot create stream {name}: {e}"))),
            },
        };
    };
    for s in &wanted.subjects {
        if !subjects.iter().any(|p| subject_matches(p, s)) {
            return Err(fatal(format!(
                "stream {name} ({key}) exists without subject {s:?} (its subjects: {subjects:?}): \
                 add the subject to the stream or change the settle config"
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Source

/// [`Source`] of the static assignment: at the first call it creates the streams if missing
/// and hands out one [`NatsInput`] per owned partition; then it never changes anything.
pub struct NatsSource {
    js: jetstream::Context,
    config: Arc<NatsConfig>,
    tiers: TiersConfig,
    assigned: bool,
}

impl NatsSource {
    /// A source over `js` for the partitions `config` assigns to this instance; the streams
    /// are those of `config` and `tiers`.
    pub fn new(js: jetstream::Context, config: &NatsConfig, tiers: &TiersConfig) -> Self {
        NatsSource {
            js,
            config: Arc::new(config.clone()),
            tiers: tiers.clone(),
            assigned: false,
        }
    }
}

impl Source for NatsSource {
    type Input = NatsInput;

    async fn next_event(&mut self) -> Result<Option<SourceEvent<NatsInput>>, Error> {
        if self.assigned {
            // Static assignment: nothing ever changes. Pending (not ending) keeps the runtime
            // quiet until shutdown drops this future.
            std::future::pending::<()>().await;
        }
        ensure_streams(&self.js, &self.config, &self.tiers).await?;
        let inputs: Vec<NatsInput> = self
            .config
            .owned_partitions()
            .into_iter()
            .map(|p| NatsInput::new(self.js.clone(), Arc::clone(&self.config), p))
            .collect();
        tracing::info!(
            stream = %self.config.input_stream,
            instance = self.config.instance,
            instances = self.config.instances,
            partitions = ?self.config.owned_partitions(),
            "nats: partitions assigned (static)"
        );
        self.assigned = true;
        Ok(Some(SourceEvent::Assigned(inputs)))
    }
}

// ---------------------------------------------------------------------------------------------
// Partition input

/// [`PartitionInput`] of one partition: its durable pull consumer, the position, and the
/// ack subjects of messages handed out and not yet durable (module docs: offsets and acks).
pub struct NatsInput {
    js: jetstream::Context,
    config: Arc<NatsConfig>,
    partition: i32,
    /// The bound consumer; `None`: bind before the next fetch.
    consumer: Option<PullConsumer>,
    /// Consumer sequence of the last delivery received from the bound consumer.
    seen: u64,
    /// Next stream sequence to hand out; `None` until known (bind, seek).
    position: Option<u64>,
    /// Stream sequences below this are durable in the store (acked or to be acked).
    committed: u64,
    /// Ack subjects of messages handed out and not yet committed, by stream sequence.
    acks: VecDeque<(u64, Subject)>,
    /// Pending count of the last fetch that told it: messages after the last one handed
    /// out (`PartitionInput::lag`).
    lag: Option<u64>,
    /// Redeliveries below the position dropped since the last poll returned
    /// (`InputBatch::skipped`).
    skipped: u64,
}

/// How a fetch ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FetchEnd {
    /// The server has nothing more for the consumer right now.
    Drained,
    /// As many messages as asked for came; the last one's pending count says the rest.
    Full,
    /// Stopped on an error or a gap; nothing is known about what is left.
    Broken,
}

impl NatsInput {
    fn new(js: jetstream::Context, config: Arc<NatsConfig>, partition: i32) -> Self {
        NatsInput {
            js,
            config,
            partition,
            consumer: None,
            seen: 0,
            position: None,
            committed: 0,
            acks: VecDeque::new(),
            lag: None,
            skipped: 0,
        }
    }

    fn durable(&self) -> String {
        self.config.consumer_name(self.partition)
    }

    /// Binds to the partition's durable consumer, keeping it when it has nothing
    /// outstanding and has not delivered past the position, re-creating it at the position
    /// otherwise (module docs).
    async fn bind(&mut self) -> Result<(), Error> {
        use async_nats::jetstream::context::ConsumerInfoErrorKind;
        let stream = self
            .js
            .get_stream_no_info(&self.config.input_stream)
            .await
            .map_err(|e| fatal(format!("stream {}: {e}", self.config.input_stream)))?;
        let name = self.durable();
        let info = match stream.consumer_info(&name).await {
            Ok(info) => Some(info),
            Err(e) => match e.kind() {
                ConsumerInfoErrorKind::NotFound => None,
                _ => return Err(unavailable(format!("consumer {name}: {e}"))),
            },
        };
        let wanted = self.config.consumer_config(self.partition, self.position);
        let keep = info.as_ref().filter(|i| {
            let c = &i.config;
            c.filter_subject == wanted.filter_subject
                && c.ack_policy == AckPolicy::Explicit
                && c.ack_wait == wanted.ack_wait
                && c.max_ack_pending == wanted.max_ack_pending
                && i.num_ack_pending == 0
                && self
                    .position
                    .is_none_or(|p| i.delivered.stream_sequence < p)
        });
        let consumer = match keep {
            Some(i) => {
                tracing::debug!(
                    partition = self.partition,
                    consumer = %name,
                    delivered = i.delivered.consumer_sequence,
                    delivered_stream = i.delivered.stream_sequence,
                    ack_floor = i.ack_floor.stream_sequence,
                    position = ?self.position,
                    "nats: consumer kept"
                );
                self.seen = i.delivered.consumer_sequence;
                let start = *self.position.get_or_insert(i.ack_floor.stream_sequence + 1);
                self.committed = self.committed.max(start);
                PullConsumer::new(wanted, i.clone(), self.js.clone())
            }
            None => {
                // Where to start: the position, else after what the old consumer had acked.
                let start = self
                    .position
                    .or_else(|| info.as_ref().map(|i| i.ack_floor.stream_sequence + 1))
                    .unwrap_or(1);
                if info.is_some() {
                    if let Err(e) = stream.delete_consumer(&name).await {
                        return Err(unavailable(format!("cannot delete consumer {name}: {e}")));
                    }
                }
                let consumer = stream
                    .create_consumer(self.config.consumer_config(self.partition, Some(start)))
                    .await
                    .map_err(|e| unavailable(format!("cannot create consumer {name}: {e}")))?;
                tracing::info!(
                    partition = self.partition,
                    consumer = %name,
                    start_sequence = start,
                    "nats: consumer (re)created at the position"
                );
                self.seen = 0;
                self.position = Some(start);
                self.committed = self.committed.max(start);
                // Acks for the old consumer are moot: the new one starts after them.
                self.acks.clear();
                consumer
            }
        };
        self.consumer = Some(consumer);
        Ok(())
    }

    /// Asks for up to `max` messages with a no-wait pull request (the server answers at once
    /// with what it has); appends the new ones to `out` and records their acks.
    async fn fetch(
        &mut self,
        out: &mut Vec<InputRecord>,
        max: usize,
        pending: &mut Option<u64>,
    ) -> Result<FetchEnd, Error> {
        let Some(consumer) = self.consumer.clone() else {
            return Ok(FetchEnd::Broken);
        };
        let deadline = Instant::now() + CALL_TIMEOUT;
        let mut batch = match consumer.fetch().max_messages(max).messages().await {
            Ok(b) => b,
            Err(e) => {
                self.consumer = None;
                return Err(unavailable(format!("fetch: {e}")));
            }
        };
        let mut received = 0;
        loop {
            let next = match tokio::time::timeout_at(deadline, batch.next()).await {
                Ok(next) => next,
                Err(_) => {
                    // Deliveries may be under way to an inbox that is about to go away.
                    self.consumer = None;
                    return self.broken(out, "fetch timed out".to_owned());
                }
            };
            let message = match next {
                None => {
                    if received < max {
                        *pending = Some(0);
                        return Ok(FetchEnd::Drained);
                    }
                    return Ok(FetchEnd::Full);
                }
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    let text = e.to_string();
                    if text.contains("MaxAckPending") {
                        // Too much handed out and not yet committed: the next commit frees it.
                        return Ok(FetchEnd::Broken);
                    }
                    self.consumer = None;
                    return self.broken(out, format!("fetch: {text}"));
                }
            };
            received += 1;
            let info = match message.info() {
                Ok(i) => (
                    i.stream_sequence,
                    i.consumer_sequence,
                    i.pending,
                    (i.published.unix_timestamp_nanos() / 1_000_000) as i64,
                ),
                Err(e) => {
                    self.consumer = None;
                    return self.broken(out, format!("message without JetStream metadata: {e}"));
                }
            };
            let (sseq, cseq, left, timestamp_ms) = info;
            if cseq != self.seen + 1 {
                tracing::warn!(
                    partition = self.partition,
                    expected = self.seen + 1,
                    got = cseq,
                    "nats: deliveries were lost in transit; rebinding the consumer"
                );
                self.consumer = None;
                return Ok(FetchEnd::Broken);
            }
            self.seen = cseq;
            *pending = Some(left);
            let message = message.message;
            let position = self.position.unwrap_or(0);
            if sseq < position {
                // A redelivery of something handed out before: counted, and logged once per
                // poll (`NatsInput::poll`).
                self.skipped += 1;
                if sseq < self.committed {
                    if let Some(reply) = message.reply {
                        // Not fatal for this fetch: unacked, it comes back after ack-wait.
                        if let Err(e) = self.send_ack(reply).await {
                            tracing::debug!(partition = self.partition, sseq, error = %e, "nats: ack of a redelivery failed");
                        }
                    }
                }
                continue;
            }
            if let Some(reply) = message.reply {
                self.acks.push_back((sseq, reply));
            }
            self.position = Some(sseq + 1);
            let key = message
                .headers
                .as_ref()
                .and_then(|h| h.get(KEY_HEADER))
                .map(|v| v.as_str().as_bytes().to_vec());
            out.push(InputRecord {
                partition: self.partition,
                offset: sseq as i64,
                key,
                payload: message.payload.to_vec(),
                timestamp_ms,
            });
        }
    }

    /// Ends a fetch that failed: the records received so far are good (contiguous); an error
    /// only when there are none.
    fn broken(&self, out: &[InputRecord], reason: String) -> Result<FetchEnd, Error> {
        tracing::debug!(partition = self.partition, reason, "nats: fetch cut short");
        if out.is_empty() {
            Err(unavailable(reason))
        } else {
            Ok(FetchEnd::Broken)
        }
    }

    /// Fails with [`Error::started_over`] when the input stream's last sequence is below
    /// `next - 1`, the last sequence the store applied for this partition: the stream was
    /// deleted and re-created (or lost), and a consumer created at `next` would skip every
    /// new message of the partition below it. JetStream's stream state is exact (no
    /// watermark lag), so one look decides.
    ///
    /// Errors: [`Error::Unavailable`] when the server does not answer (the runtime retries the
    /// seek); [`Error::Fatal`] as above.
    async fn check_stream_end(&self, next: u64) -> Result<(), Error> {
        let stream_name = &self.config.input_stream;
        let stream = self
            .js
            .get_stream(stream_name)
            .await
            .map_err(|e| unavailable(format!("stream {stream_name}: {e}")))?;
        let end = stream.cached_info().state.last_sequence + 1;
        if next > end {
            return Err(Error::started_over(
                TRANSPORT,
                stream_name,
                self.partition,
                end as i64,
                next as i64,
            ));
        }
        Ok(())
    }

    /// Publishes one ack (`+ACK` is an empty body on a JetStream ack subject).
    async fn send_ack(&self, reply: Subject) -> Result<(), Error> {
        let client = self.js.client();
        match tokio::time::timeout(CALL_TIMEOUT, client.publish(reply, Bytes::new())).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(unavailable(format!("ack: {e}"))),
            Err(_) => Err(unavailable("ack timed out".to_owned())),
        }
    }
}

impl PartitionInput for NatsInput {
    fn topic(&self) -> &str {
        &self.config.input_stream
    }

    fn partition(&self) -> i32 {
        self.partition
    }

    async fn seek(&mut self, next_offset: i64) -> Result<(), Error> {
        let next = next_offset.max(1) as u64;
        self.check_stream_end(next).await?;
        self.position = Some(next);
        self.committed = next;
        self.acks.clear();
        self.consumer = None;
        self.bind().await?;
        tracing::debug!(
            partition = self.partition,
            next_offset,
            "nats: input positioned"
        );
        Ok(())
    }

    async fn poll(&mut self, max: usize, wait: Duration) -> Result<InputBatch, Error> {
        if self.consumer.is_none() {
            self.bind().await?;
        }
        let max = max.clamp(1, MAX_FETCH);
        let deadline = Instant::now() + wait;
        let mut records = Vec::new();
        let mut pending = None;
        let end = loop {
            let end = self.fetch(&mut records, max, &mut pending).await?;
            let now = Instant::now();
            if !records.is_empty() || end != FetchEnd::Drained || now >= deadline {
                break end;
            }
            tokio::time::sleep((deadline - now).min(IDLE_FETCH_INTERVAL)).await;
        };
        if records.is_empty() && end == FetchEnd::Broken {
            // Too much delivered and not yet committed (or a rebind is due): do not spin.
            tokio::time::sleep(wait.min(Duration::from_millis(50))).await;
        }
        let caught_up = end != FetchEnd::Broken && pending == Some(0);
        tracing::trace!(
            partition = self.partition,
            records = records.len(),
            first = records.first().map(|r| r.offset),
            last = records.last().map(|r| r.offset),
            ?end,
            ?pending,
            ?wait,
            "nats: poll"
        );
        if pending.is_some() {
            self.lag = pending;
        }
        let skipped = std::mem::take(&mut self.skipped);
        if skipped > 0 {
            tracing::info!(
                partition = self.partition,
                skipped,
                position = ?self.position,
                "nats: redeliveries below the partition's next offset dropped as applied already (settle_input_skipped_total)"
            );
        }
        Ok(InputBatch {
            records,
            caught_up,
            skipped,
        })
    }

    fn lag(&self) -> Option<u64> {
        self.lag
    }

    async fn commit(&mut self, next_offset: i64) -> Result<(), Error> {
        let next = next_offset.max(0) as u64;
        self.committed = self.committed.max(next);
        while let Some((seq, _)) = self.acks.front() {
            if *seq >= next {
                break;
            }
            let Some((seq, reply)) = self.acks.pop_front() else {
                break;
            };
            if let Err(e) = self.send_ack(reply.clone()).await {
                self.acks.push_front((seq, reply));
                return Err(e);
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Sink

/// [`Sink`] over JetStream publishes: ready records to their message's subject (the tier's
/// topic) with `Nats-Msg-Id` = `settle-emission-id` = the emission id and `settle-key`;
/// dead letters to `nats.dead-letter-subject` with the original payload, key header and the
/// `settle-dlq-*` headers (`Nats-Msg-Id` = `dlq:<stream>:<sequence>`, so a dead letter
/// re-sent after a crash is dropped as a duplicate too). Cheap to clone.
#[derive(Clone)]
pub struct NatsSink {
    js: jetstream::Context,
    input_stream: Arc<str>,
    dead_letter_subject: Arc<str>,
}

impl NatsSink {
    /// A sink publishing through `js` for the streams of `config`.
    pub fn new(js: jetstream::Context, config: &NatsConfig) -> Self {
        NatsSink {
            js,
            input_stream: config.input_stream.as_str().into(),
            dead_letter_subject: config.dead_letter_subject.as_str().into(),
        }
    }

    async fn send(&self, subject: String, headers: HeaderMap, payload: Bytes) -> Result<(), Error> {
        let publish = PublishMessage::build().headers(headers).payload(payload);
        let ack = self
            .js
            .send_publish(subject.clone(), publish)
            .await
            .map_err(|e| classify_publish(&subject, &e))?;
        ack.await.map_err(|e| classify_publish(&subject, &e))?;
        Ok(())
    }
}

/// Retryable unless the message can never be accepted (too large, bad subject).
fn classify_publish(subject: &str, e: &async_nats::error::Error<PublishErrorKind>) -> Error {
    match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => fatal(format!("publish to {subject}: {e}")),
        PublishErrorKind::StreamNotFound => unavailable(format!(
            "publish to {subject}: no stream holds this subject (or JetStream is down)"
        )),
        _ => unavailable(format!("publish to {subject}: {e}")),
    }
}

impl Sink for NatsSink {
    async fn publish(&self, message: ReadyMessage) -> Result<(), Error> {
        let mut headers = HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            message.emission_id.as_str(),
        );
        headers.insert(EMISSION_ID_HEADER, message.emission_id.as_str());
        headers.insert(KEY_HEADER, message.key.as_str());
        self.send(message.topic, headers, message.payload.into())
            .await
    }

    async fn dead_letter(&self, record: &InputRecord, reason: &str) -> Result<(), Error> {
        use super::kafka::{
            DLQ_REASON_HEADER, DLQ_SOURCE_OFFSET_HEADER, DLQ_SOURCE_PARTITION_HEADER,
            DLQ_SOURCE_TOPIC_HEADER,
        };
        let mut headers = HeaderMap::new();
        let id = format!("dlq:{}:{}", self.input_stream, record.offset);
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
        headers.insert(DLQ_REASON_HEADER, reason);
        headers.insert(DLQ_SOURCE_TOPIC_HEADER, &*self.input_stream);
        headers.insert(
            DLQ_SOURCE_PARTITION_HEADER,
            record.partition.to_string().as_str(),
        );
        headers.insert(DLQ_SOURCE_OFFSET_HEADER, record.offset.to_string().as_str());
        headers.insert(
            DLQ_SOURCE_TIMESTAMP_HEADER,
            record.timestamp_ms.to_string().as_str(),
        );
        if let Some(key) = &record.key {
            // Header values are one line of text: a key that is not UTF-8 is shown lossily.
            let key = String::from_utf8_lossy(key).replace(['\r', '\n'], " ");
            headers.insert(KEY_HEADER, key.as_str());
        }
        self.send(
            self.dead_letter_subject.to_string(),
            headers,
            Bytes::copy_from_slice(&record.payload),
        )
        .await
    }
}

// ---------------------------------------------------------------------------------------------
// `settle run` on NATS

/// Runs settle on NATS JetStream until `shutdown` is cancelled: the partition runtime
/// ([`Runtime::run`]) over a [`NatsSource`] (the partitions `nats` assigns to this instance)
/// and a [`NatsSink`], stores under `config.store.data-dir`, the debounce policies of
/// `config`, each emission to its tenant's tier subject and tier changes to the events
/// subject of `tiers`. Must run inside a tokio runtime.
///
/// Errors: an invalid `[nats]` section or tier subject (the message names the key), an
/// unreadable credentials file, or a fatal source error (a stream that cannot be created or
/// lacks a subject). Partitions that failed are in the summary.
pub async fn run_until(
    config: &Config,
    nats: &NatsConfig,
    tiers: &TiersConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<RunSummary> {
    nats.validate()?;
    nats.check_output_subjects(tiers)?;
    let client = connect(nats).await?;
    let mut options = RuntimeOptions::from_config(config);
    options.tiers = tiers.clone();
    let partitions = nats.owned_partitions().len().max(1);
    let js = jetstream(client, options.publish_window.max(1) * partitions * 2);
    let runtime = Runtime::new(
        Engine::new(config.policy_table()),
        NatsSink::new(js.clone(), nats),
        SystemClock,
        options,
    )?;
    // Admin endpoints (`crate::admin`) until the runtime has stopped.
    let admin = crate::admin::AdminServer::start_for(&config.admin, &runtime).await?;
    let watch = tokio::spawn(crate::runtime::progress::watch(
        runtime.status(),
        shutdown.clone(),
    ));
    let summary = runtime
        .run(NatsSource::new(js, nats, tiers), shutdown)
        .await;
    watch.abort();
    if let Some(admin) = admin {
        admin.stop().await;
    }
    Ok(summary?)
}

/// `settle run` on NATS: builds a tokio runtime, runs [`run_until`] until SIGINT/SIGTERM (a
/// second signal exits at once), then reports failed partitions.
///
/// Errors: as [`run_until`]; also when a partition failed (the message names it and why).
pub fn run(config: &Config, nats: &NatsConfig, tiers: &TiersConfig) -> anyhow::Result<()> {
    crate::runtime::block_on(async {
        let shutdown = CancellationToken::new();
        let signals =
            shutdown_on_signals(shutdown.clone()).context("cannot install signal handlers")?;
        let summary = run_until(config, nats, tiers, shutdown).await;
        signals.abort();
        if let Some((p, reason)) = summary?.failed().first() {
            anyhow::bail!("partition {p} failed: {reason}");
        }
        Ok(())
    })?
}

// ---------------------------------------------------------------------------------------------
// Tooling: producing uploads, reading streams back

/// Publishes one upload for session key `key` (`tenant/session`) to its partition's subject
/// `<prefix>.<partition_for_key(key)>` with header `settle-key` (and `Nats-Msg-Id` =
/// `msg_id` if given, so JetStream drops a retried publish it already stored), and returns
/// the partition and the publish-ack future (await it for the stream sequence). The message
/// is handed to the client in call order, so uploads of one session keep their order.
///
/// Errors: the client refused the message (too large, connection closed, too many publishes
/// awaiting their acks past the timeout).
pub async fn publish_upload(
    js: &jetstream::Context,
    prefix: &str,
    partitions: u32,
    key: &str,
    json: &[u8],
    msg_id: Option<&str>,
) -> anyhow::Result<(i32, PublishAckFuture)> {
    let partition = partition_for_key(key.as_bytes(), partitions);
    let mut headers = HeaderMap::new();
    headers.insert(KEY_HEADER, key);
    if let Some(id) = msg_id {
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    }
    let publish = PublishMessage::build()
        .headers(headers)
        .payload(Bytes::copy_from_slice(json));
    let ack = js
        .send_publish(format!("{prefix}.{partition}"), publish)
        .await
        .with_context(|| format!("publish {key}"))?;
    Ok((partition, ack))
}

/// One message read back by [`read_stream`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamRecord {
    /// Its subject.
    pub subject: String,
    /// Its stream sequence.
    pub sequence: u64,
    /// Its JetStream timestamp (ms since the epoch).
    pub timestamp_ms: i64,
    /// Headers (name, first value) in no particular order.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub payload: Vec<u8>,
}

impl StreamRecord {
    /// The value of header `name`, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The partition of an input message (the last token of its subject), if numeric.
    pub fn partition(&self) -> Option<i32> {
        self.subject.rsplit('.').next()?.parse().ok()
    }
}

/// Reads the messages of stream `stream` on subjects matching `filter` from the beginning
/// (an ephemeral consumer, deleted afterwards) in sequence order, until none is left and at
/// least `min_records` were read, or until `timeout`.
///
/// Errors: the stream does not exist or the server does not answer.
pub async fn read_stream(
    js: &jetstream::Context,
    stream: &str,
    filter: &str,
    min_records: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<StreamRecord>> {
    let s = js
        .get_stream(stream)
        .await
        .with_context(|| format!("stream {stream}"))?;
    let consumer: PullConsumer = s
        .create_consumer(pull::Config {
            filter_subject: filter.to_owned(),
            ack_policy: AckPolicy::None,
            inactive_threshold: Duration::from_secs(60),
            ..pull::Config::default()
        })
        .await
        .with_context(|| format!("reader of {stream}"))?;
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    loop {
        let mut batch = consumer
            .fetch()
            .max_messages(MAX_FETCH)
            .messages()
            .await
            .context("fetch")?;
        let before = out.len();
        while let Ok(Some(next)) = tokio::time::timeout_at(deadline, batch.next()).await {
            let m = next.map_err(|e| anyhow::anyhow!("reading {stream}: {e}"))?;
            let (sequence, timestamp_ms) = {
                let info = m.info().map_err(|e| anyhow::anyhow!("{e}"))?;
                (
                    info.stream_sequence,
                    (info.published.unix_timestamp_nanos() / 1_000_000) as i64,
                )
            };
            let m = m.message;
            out.push(StreamRecord {
                subject: m.subject.to_string(),
                sequence,
                timestamp_ms,
                headers: m
                    .headers
                    .iter()
                    .flat_map(|h| h.iter())
                    .filter_map(|(k, v)| Some((k.to_string(), v.first()?.as_str().to_owned())))
                    .collect(),
                payload: m.payload.to_vec(),
            });
        }
        let drained = out.len() == before;
        if (drained && out.len() >= min_records) || Instant::now() >= deadline {
            break;
        }
        if drained {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let name = consumer.cached_info().name.clone();
    let _ = s.delete_consumer(&name).await;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_hash_is_fnv1a() {
        // FNV-1a 32 of "acme/build-42" is 0xcc5db871; mod 8 = 1.
        assert_eq!(partition_for_key(b"acme/build-42", 8), 1);
        assert_eq!(partition_for_key(b"", 1), 0);
        for key in ["a/b", "tenant-0001/mix-7", "x/y/z"] {
            let p = partition_for_key(key.as_bytes(), 5);
            assert!((0..5).contains(&p));
            assert_eq!(
                p,
                crate::transport::memory::partition_for_key(key.as_bytes(), 5)
            );
        }
    }
}
