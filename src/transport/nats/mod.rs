//! The NATS JetStream transport (async-nats): a static set of durable pull consumers as the
//! [`Source`], one consumer per owned partition as the [`PartitionInput`], and JetStream
//! publishes with `Nats-Msg-Id` de-duplication as the [`Sink`]; the `[nats]` section itself is
//! `crate::config::nats`.
//!
//! Files, by concern: [`consumer`] (the static source and one durable pull consumer per
//! partition; the check at assignment that the stream reaches the stored offset),
//! [`producer`] (the sink, and [`publish_upload`] for `settle loadgen --nats` and the tests),
//! [`changelog`] (the changelog streams, their reader, and the fence),
//! [`streams`] (streams created or checked at start, [`read_stream`] for tools and tests),
//! [`tier_counts`] (the KV bucket where instances exchange their tier counts),
//! [`overrides`] (the KV bucket of the tenant overrides); this file holds the connection and what they share.
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
//! at start and never revokes. A partition's state moves through its changelog stream
//! ([`changelog`]): a new owner (after a re-scale, or on a new data dir) restores the store
//! from it before reading input, and claims the partition there; a second process writing
//! the same partition (two instances with one index, an old owner during a rolling re-scale)
//! is fenced at its next changelog append and stops that partition. With
//! `nats.changelog-stream = ""` there is neither: two instances must then never share an index.
//!
//! # Offsets and acks
//!
//! The offset of a message is its **stream sequence** (global to the stream, so a
//! partition's offsets have gaps: "next offset" is the last applied sequence + 1). Partition
//! `p` is read by the durable pull consumer `<nats.consumer-prefix>-<p>` (filter
//! `<prefix>.<p>`, ack policy "all", `nats.ack-wait`, `nats.max-ack-pending`). A message is
//! acked only in [`PartitionInput::commit`], i.e. once the batch it belongs to is durable in
//! the partition store; until then its ack subject is held. A commit sends ONE ack, for the
//! last message below the committed offset: under ack policy "all" it acknowledges every
//! message of the consumer at or below that stream sequence (what a commit covers), where an
//! ack per message cost the server and the client one message each (issue 37, BENCHMARKS
//! "NATS: the observer was the slow tail; one ack per commit"). A consumer left with explicit acks by an older settle is re-created at the
//! position by the next bind (its config differs).
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
use super::Error;
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
use async_nats::jetstream::{self, stream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub mod actions;
pub mod batch;
pub mod changelog;
pub mod consumer;
pub mod overrides;
pub mod producer;
pub mod streams;
pub mod tier_counts;

pub use actions::NatsActions;
pub use consumer::{NatsInput, NatsSource};
pub use overrides::OverridesBucket;
pub use producer::{publish_upload, NatsSink};
pub use streams::{ensure_input_stream, ensure_streams, read_stream, StreamRecord};
pub use tier_counts::TierCountsBucket;

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
            ack_policy: AckPolicy::All,
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
    if let Some(token) = config.token_value() {
        options = options.token(token.0.clone());
    }
    if let (Some(user), Some(password)) = (&config.user, config.password_value()) {
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
        .map_err(|e| fatal(format!("cannot connect to {}: {e}", config.servers_shown())))
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
