//! The changelog on JetStream (ARCHITECTURE "changelog"; SEMANTICS §6 "Single writer"): the
//! NATS side of [`Sink::changelog`](crate::transport::Sink::changelog),
//! [`append_changes`](crate::transport::Sink::append_changes) and
//! [`read_changelog`](crate::transport::Sink::read_changelog), and the fence that keeps two
//! processes from both writing one partition.
//!
//! # Layout
//!
//! One stream per input partition: `<nats.changelog-stream>-<p>` (`SETTLE_CHANGELOG-3`) with
//! subjects `<nats.changelog-subject-prefix>.<p>.*`. **An append is one message per
//! [`batch::BATCH_MAX_BYTES`] of changes** on subject `<prefix>.<p>.batch-<sequence>` (the
//! sequence it is expected to land at, so every message has a subject of its own), body =
//! the changes in write order ([`batch`]: key, put or delete, value). JetStream charges
//! about 10 µs of server CPU per message whatever its size, so one message per flush
//! instead of one per changed key is what lets settle keep up with its input on NATS
//! (BENCHMARKS "NATS changelog batches"). Its **stream sequence is the changelog offset** of
//! every change it holds: offsets grow per message, the checkpoint of a store is the
//! sequence after the last message it holds, and a restore applies a message whole.
//!
//! Streams written by settle before batches hold one message per store key on
//! `<prefix>.<p>.<hex(key)>` (lowercase hex of `store::changelog_key`), a delete as an empty
//! body with header [`TOMBSTONE_HEADER`], compacted by JetStream's
//! `max-msgs-per-subject = 1`. The reader still reads them, and the first snapshot purges
//! them. settle creates the streams if missing (`nats.storage`, `nats.replicas`,
//! `nats.duplicate-window`, `max-msgs-per-subject = 1`; no `max-age`: a record must live as
//! long as its key).
//!
//! # Compaction
//!
//! Batches are not compacted by the server. Once `nats.changelog-snapshot-kib` of changes
//! were appended since the last snapshot, and at least twice that snapshot's size
//! ([`NatsChangelog::snapshot_due`]), the partition task appends its whole store
//! (`PartitionStore::snapshot_changes`) as a snapshot: its first message has header
//! [`SNAPSHOT_HEADER`]. Once the snapshot is acknowledged, the stream is purged below its
//! first message: what remains is the snapshot and the appends after it, which is what a
//! restore needs. A store whose checkpoint lies below a purge has lost the tombstones of
//! what was purged: its reader says so ([`ChangelogReader::restarts_from_snapshot`]) and
//! the restore wipes it and reads from the snapshot.
//!
//! # Fencing by the log
//!
//! Every append carries `Nats-Expected-Last-Sequence` = the last sequence this process
//! knows of the partition's stream (learned by the restore's read, then advanced by its own
//! appends). The messages of one append are pipelined, so each after the first also carries
//! `Nats-Expected-Last-Msg-Id` = its predecessor's id: once one is refused, the next cannot
//! land by accident on top of another writer's records whose sequence numbers it happens to
//! expect (found by the same-index test: a refused first message, the second accepted). JetStream refuses the message when anybody else appended meanwhile, so of two
//! processes writing one partition (two instances given the same `nats.instance`, or an old
//! owner still running after a re-scale) only the one that appended last keeps going: the
//! other's next append fails with [`Error::Fenced`], and its partition stops publishing,
//! appending and acking input (the runtime publishes an emission and acks an upload only
//! once the changelog append that holds it is acknowledged: [`Sink::fences_by_changelog`]).
//! A new owner claims the partition at the end of its restore by appending its writer record
//! (`meta\0writer`); if another writer appended after the restore's read, the claim is
//! refused and the restore reads the rest and claims again (`runtime::restore`).
//!
//! # Bound to its input
//!
//! The writer record (`meta\0writer`, part of every append) carries headers
//! [`INPUT_STREAM_HEADER`] (`nats.input-stream`) and [`INPUT_PARTITIONS_HEADER`]
//! (`nats.partitions`). Before a restore reads a partition's stream, the last writer record
//! is looked up: one that names another input stream or partition count is refused with a
//! fatal error saying which input the changelog records, which one this deployment reads and
//! which setting to change ([`check_binding`]), so a deployment pointed at another's
//! changelog (two deployments on one account sharing `nats.changelog-stream`) stops instead
//! of restoring foreign state. A stream without such headers (written by an older settle)
//! is adopted. The stream names themselves default to the deployment's identity
//! (`NatsConfig::changelog`).
//!
//! Each message also has `Nats-Msg-Id` = `cl:<process id>:<sequence>`: a publish retried after
//! a lost ack is dropped as a duplicate (or, past the duplicate window, refused as
//! out-of-sequence and then recognised as this process's own by reading the message back).
//!
//! # Order
//!
//! The appends of one partition go through one task, in call order; the messages of one
//! append are sent back to back (one round trip for all of them) and acknowledged in order.
//! Appends queued while one is on the wire go out together (each with messages of its own,
//! at most 8 192 changes in all): after a broker pause the queue drains in one round trip
//! instead of one per flush. A failed append fails every later one of that partition (and every append it went
//! out with): the stream then holds a prefix of the store's writes, as the Kafka changelog's
//! idempotent producer guarantees.

use super::batch;
use super::{fatal, unavailable, NatsConfig, CALL_TIMEOUT, TRANSPORT};
use crate::store::changelog::writer_of;
use crate::store::Change;
use crate::transport::{ChangelogReader, Error};
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use async_nats::HeaderMap;
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::StreamExt;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Header of a changelog message that records a delete (value `1`, empty body).
pub const TOMBSTONE_HEADER: &str = "settle-tombstone";

/// Header of a changelog's writer record (`meta\0writer`, part of every append): the input
/// stream the changelog records (`nats.input-stream`). A restore refuses a changelog whose
/// writer record names another input ([`check_binding`]).
pub const INPUT_STREAM_HEADER: &str = "settle-input-stream";

/// Header of a changelog's writer record: the input's partition count (`nats.partitions`,
/// decimal) when it was written.
pub const INPUT_PARTITIONS_HEADER: &str = "settle-input-partitions";

/// Header of the first message of a snapshot (value `1`): the stream is purged below it once
/// the whole snapshot is acknowledged (module docs: Compaction).
pub const SNAPSHOT_HEADER: &str = "settle-snapshot";

/// The last subject token of a batch message: `batch-<sequence>`.
const BATCH_TOKEN: &str = "batch-";

/// Most messages one reader fetch asks for.
const READ_FETCH: usize = 5_000;

/// A read that receives nothing for this long while the stream says more is there reports the
/// changelog unavailable (the restore retries from its checkpoint).
const READ_STALL: Duration = Duration::from_secs(30);

/// The changelog side of the NATS sink (module docs). Cheap to clone.
#[derive(Clone)]
pub(crate) struct NatsChangelog {
    inner: Arc<Inner>,
}

struct Inner {
    js: jetstream::Context,
    /// The stream name prefix ([`NatsConfig::changelog`]).
    name: String,
    /// The subject prefix ([`NatsConfig::changelog_subject_prefix`]).
    subject_prefix: String,
    config: NatsConfig,
    /// `cl:<random>`: the `Nats-Msg-Id` prefix of this process's appends.
    msg_id_prefix: String,
    partitions: Mutex<HashMap<i32, Arc<PartitionLog>>>,
}

/// One partition's append queue and what this process knows of its stream.
struct PartitionLog {
    jobs: mpsc::UnboundedSender<Job>,
    state: Arc<Mutex<LogState>>,
}

#[derive(Default)]
struct LogState {
    /// The stream's last sequence as this process knows it: set by reads, advanced by
    /// appends; `None` before either (the append task asks the stream then).
    last: Option<u64>,
    /// Set by a failed append; every later append fails with it until the next read.
    failed: Option<Error>,
    /// Batch body bytes appended since the last snapshot was handed in (module docs:
    /// Compaction).
    since_snapshot: u64,
    /// Body bytes of the last snapshot (0: none by this process yet).
    last_snapshot: u64,
    /// A snapshot is queued or on the wire.
    snapshot_in_flight: bool,
}

struct Job {
    changes: Vec<Change>,
    /// The changes are the whole store: the stream is purged below them once acknowledged.
    snapshot: bool,
    done: oneshot::Sender<Result<i64, Error>>,
}

impl NatsChangelog {
    /// The changelog of `config` (`None` when `nats.changelog-stream` is `""`).
    pub(crate) fn new(js: jetstream::Context, config: &NatsConfig) -> Option<Self> {
        let name = config.changelog()?;
        Some(NatsChangelog {
            inner: Arc::new(Inner {
                js,
                name,
                subject_prefix: config.changelog_subject_prefix(),
                config: config.clone(),
                msg_id_prefix: format!("cl:{:016x}", rand::random::<u64>()),
                partitions: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The stream name prefix (`nats.changelog-stream`).
    pub(crate) fn name(&self) -> &str {
        &self.inner.name
    }

    fn log(&self, partition: i32) -> Arc<PartitionLog> {
        let mut map = self.inner.partitions.lock().expect("changelog map lock");
        Arc::clone(map.entry(partition).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let state = Arc::new(Mutex::new(LogState::default()));
            tokio::spawn(append_task(
                Arc::clone(&self.inner),
                partition,
                Arc::clone(&state),
                rx,
            ));
            Arc::new(PartitionLog { jobs: tx, state })
        }))
    }

    /// See `Sink::append_changes`; `snapshot`: `changes` are the partition's whole store
    /// (`Sink::append_snapshot`): once acknowledged, the stream is purged below them.
    pub(crate) fn append(
        &self,
        partition: i32,
        changes: &[Change],
        snapshot: bool,
    ) -> Result<BoxFuture<'static, Result<i64, Error>>, Error> {
        if changes.is_empty() {
            return Err(fatal("empty changelog append".into()));
        }
        let log = self.log(partition);
        let (done, result) = oneshot::channel();
        if snapshot {
            log.state
                .lock()
                .expect("changelog state lock")
                .snapshot_in_flight = true;
        }
        log.jobs
            .send(Job {
                changes: changes.to_vec(),
                snapshot,
                done,
            })
            .map_err(|_| fatal("the changelog append task stopped".into()))?;
        Ok(Box::pin(async move {
            result
                .await
                .unwrap_or_else(|_| Err(fatal("the changelog append task stopped".into())))
        }))
    }

    /// See `Sink::changelog_snapshot_due`: at least `nats.changelog-snapshot-kib` MiB and
    /// twice the last snapshot were appended to `partition` since that snapshot, and no
    /// snapshot is on its way (module docs: Compaction).
    pub(crate) fn snapshot_due(&self, partition: i32) -> bool {
        let map = self.inner.partitions.lock().expect("changelog map lock");
        let Some(log) = map.get(&partition) else {
            return false;
        };
        let s = log.state.lock().expect("changelog state lock");
        let floor = u64::from(self.inner.config.changelog_snapshot_kib) << 10;
        !s.snapshot_in_flight
            && s.failed.is_none()
            && s.since_snapshot >= floor.max(2 * s.last_snapshot)
    }

    /// See `Sink::read_changelog`: creates the partition's stream if missing, fails with
    /// [`Error::changelog_started_over`] when it ends below `from`, and opens a reader from
    /// `from` to the stream's end as of now. The read also tells the appends of this process
    /// where the stream ends (module docs: fencing).
    pub(crate) async fn read(
        &self,
        partition: i32,
        from: i64,
    ) -> Result<Box<dyn ChangelogReader>, Error> {
        let mut stream = ensure_stream(&self.inner.js, &self.inner.config, partition).await?;
        self.check_input(&stream, partition).await?;
        let info = tokio::time::timeout(CALL_TIMEOUT, stream.info())
            .await
            .map_err(|_| {
                unavailable(format!(
                    "changelog stream info of partition {partition}: timed out"
                ))
            })?
            .map_err(|e| {
                unavailable(format!(
                    "changelog stream info of partition {partition}: {e}"
                ))
            })?;
        let last = info.state.last_sequence;
        let first = info.state.first_sequence;
        let name = info.config.name.clone();
        let end = last as i64 + 1;
        if from > end {
            return Err(Error::changelog_started_over(
                TRANSPORT, &name, partition, end, from,
            ));
        }
        // Purged past the checkpoint: the store lacks what was purged, tombstones included
        // (module docs: Compaction). Per-key compaction (the older layout) also moves the
        // first sequence up, but keeps tombstones: only a snapshot start says "purged".
        let compacted = from > 0
            && (from as u64) < first
            && last > 0
            && stream
                .get_raw_message(first)
                .await
                .map_err(|e| unavailable(format!("changelog {name} sequence {first}: {e}")))?
                .headers
                .get(SNAPSHOT_HEADER)
                .is_some();
        let log = self.log(partition);
        {
            let mut s = log.state.lock().expect("changelog state lock");
            s.last = Some(last);
            s.failed = None;
        }
        let consumer = if from >= end || last == 0 {
            None
        } else {
            let c: PullConsumer = stream
                .create_consumer(pull::Config {
                    ack_policy: AckPolicy::None,
                    deliver_policy: if from > 1 {
                        DeliverPolicy::ByStartSequence {
                            start_sequence: from as u64,
                        }
                    } else {
                        DeliverPolicy::All
                    },
                    inactive_threshold: Duration::from_secs(60),
                    ..pull::Config::default()
                })
                .await
                .map_err(|e| unavailable(format!("changelog reader of {name}: {e}")))?;
            Some(c)
        };
        Ok(Box::new(NatsChangelogReader {
            stream,
            consumer,
            state: log.state.clone(),
            end,
            done: from >= end || last == 0,
            compacted,
            read: (0, 0),
        }))
    }
}

impl NatsChangelog {
    /// Reads the last writer record of `partition`'s changelog `stream` and refuses a
    /// changelog of another input ([`check_binding`]). A stream without one (new) or whose
    /// writer record has no input headers (written by an older settle) is adopted.
    ///
    /// Errors: [`Error::Fatal`] from [`check_binding`]; [`Error::Unavailable`] when the
    /// server does not answer.
    async fn check_input(&self, stream: &stream::Stream, partition: i32) -> Result<(), Error> {
        use async_nats::jetstream::stream::LastRawMessageErrorKind;
        // Batches name the input on every message that holds the writer record: the last
        // message usually does. A stream of the per-key layout has it on the writer's subject.
        let last = stream.cached_info().state.last_sequence;
        if last > 0 {
            if let Ok(Ok(m)) =
                tokio::time::timeout(CALL_TIMEOUT, stream.get_raw_message(last)).await
            {
                if let Some(input) = m.headers.get(INPUT_STREAM_HEADER) {
                    return check_binding(
                        &self.inner.config,
                        &stream.cached_info().config.name,
                        Some(input.as_str()),
                        m.headers.get(INPUT_PARTITIONS_HEADER).map(|v| v.as_str()),
                    );
                }
            }
        }
        let subject = record_subject(
            &self.inner.subject_prefix,
            partition,
            &crate::store::changelog::writer_key(),
        );
        let found = tokio::time::timeout(
            CALL_TIMEOUT,
            stream.get_last_raw_message_by_subject(&subject),
        )
        .await
        .map_err(|_| {
            unavailable(format!(
                "changelog writer record of partition {partition}: timed out"
            ))
        })?;
        let headers = match found {
            Ok(m) => m.headers,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(()),
            Err(e) => {
                return Err(unavailable(format!(
                    "changelog writer record of partition {partition}: {e}"
                )))
            }
        };
        check_binding(
            &self.inner.config,
            &stream.cached_info().config.name,
            headers.get(INPUT_STREAM_HEADER).map(|v| v.as_str()),
            headers.get(INPUT_PARTITIONS_HEADER).map(|v| v.as_str()),
        )
    }
}

/// Whether changelog `stream`, whose writer record names input stream `input` and partition
/// count `partitions` (its headers; `None` when absent: written by a settle that did not
/// record them, adopted), records the input `config` reads.
///
/// Errors: [`Error::Fatal`] saying which input the changelog records, which one this
/// deployment reads, and which setting to change.
pub(crate) fn check_binding(
    config: &NatsConfig,
    stream: &str,
    input: Option<&str>,
    partitions: Option<&str>,
) -> Result<(), Error> {
    if let Some(input) = input.filter(|i| *i != config.input_stream) {
        return Err(fatal(format!(
            "changelog stream {stream} records input stream {input}, but this deployment reads \
             input stream {}: it is another deployment's changelog, and restoring it would mix \
             their state. Give this deployment its own changelog: remove nats.changelog-stream \
             and nats.changelog-subject-prefix from the config (the defaults are derived from \
             nats.input-stream and nats.consumer-prefix) or set them to names no other \
             deployment uses",
            config.input_stream
        )));
    }
    if let Some(n) = partitions.filter(|n| n.parse::<u32>().ok() != Some(config.partitions)) {
        return Err(fatal(format!(
            "changelog stream {stream} records input stream {} with {n} partitions, but \
             nats.partitions is {}: the partition count must not change once data flows (it \
             moves sessions between partitions); set nats.partitions back to {n}",
            config.input_stream, config.partitions
        )));
    }
    Ok(())
}

/// The changelog stream of `partition`, created if missing; an existing one must keep one
/// message per subject.
///
/// Errors: [`Error::Unavailable`] when the server does not answer; [`Error::Fatal`] when it
/// refuses the stream or the existing one keeps more than one message per subject.
async fn ensure_stream(
    js: &jetstream::Context,
    config: &NatsConfig,
    partition: i32,
) -> Result<stream::Stream, Error> {
    use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
    let name = config.changelog_stream_name(partition);
    match js.get_stream(&name).await {
        Ok(s) => {
            let per_subject = s.cached_info().config.max_messages_per_subject;
            if per_subject != 1 {
                return Err(fatal(format!(
                    "changelog stream {name} keeps {per_subject} messages per subject, not 1: \
                     it would grow without bound and restores would apply stale values; \
                     recreate it (nats stream rm {name}) and settle creates it right"
                )));
            }
            Ok(s)
        }
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(j) if j.code() == 404 => {
                let wanted = stream::Config {
                    name: name.clone(),
                    subjects: vec![config.changelog_subjects(partition)],
                    storage: match config.storage {
                        super::Storage::File => stream::StorageType::File,
                        super::Storage::Memory => stream::StorageType::Memory,
                    },
                    num_replicas: config.replicas as usize,
                    max_messages_per_subject: 1,
                    duplicate_window: config.duplicate_window,
                    ..stream::Config::default()
                };
                match js.create_stream(wanted).await {
                    Ok(s) => {
                        tracing::info!(stream = %name, partition, "nats: changelog stream created");
                        Ok(s)
                    }
                    Err(e) => match e.kind() {
                        CreateStreamErrorKind::JetStream(j) => {
                            Err(fatal(format!("cannot create changelog stream {name}: {j}")))
                        }
                        _ => Err(unavailable(format!(
                            "cannot create changelog stream {name}: {e}"
                        ))),
                    },
                }
            }
            GetStreamErrorKind::JetStream(j) => Err(fatal(format!("changelog stream {name}: {j}"))),
            _ => Err(unavailable(format!("changelog stream {name}: {e}"))),
        },
    }
}

/// The subject of changelog record `key` of `partition`: `<prefix>.<p>.<hex(key)>`.
pub(crate) fn record_subject(prefix: &str, partition: i32, key: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(prefix.len() + 12 + key.len() * 2);
    s.push_str(prefix);
    s.push('.');
    s.push_str(&partition.to_string());
    s.push('.');
    for b in key {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 15)]));
    }
    s
}

/// The record key of changelog subject `subject` (its last token, hex), if well formed.
pub(crate) fn record_key(subject: &str) -> Option<Vec<u8>> {
    let token = subject.rsplit('.').next()?.as_bytes();
    if token.len() % 2 != 0 {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    token
        .chunks(2)
        .map(|p| Some(nibble(p[0])? << 4 | nibble(p[1])?))
        .collect()
}

/// Sends the jobs of one partition in order (module docs). Ends when the changelog is dropped.
async fn append_task(
    inner: Arc<Inner>,
    partition: i32,
    state: Arc<Mutex<LogState>>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) {
    while let Some(first) = jobs.recv().await {
        // Every append queued meanwhile goes out with this one: one round trip for all of
        // them (module docs: Order). Appended one job per round trip, a broker pause of
        // S ms left S / flush-interval jobs queued, drained one round trip each.
        let mut batch = vec![first];
        let mut count = batch[0].changes.len();
        while count < COALESCE_MAX_CHANGES {
            match jobs.try_recv() {
                Ok(job) => {
                    count += job.changes.len();
                    batch.push(job);
                }
                Err(_) => break,
            }
        }
        let failed = state.lock().expect("changelog state lock").failed.clone();
        let plan = Plan::of(&batch);
        let result = match failed {
            Some(e) => Err(e),
            None => append_job(&inner, partition, &state, &plan).await,
        };
        {
            let mut s = state.lock().expect("changelog state lock");
            match &result {
                Err(e) => s.failed = Some(e.clone()),
                Ok(_) => {
                    s.since_snapshot += plan.bytes_after_snapshot();
                    if let Some(bytes) = plan.snapshot_bytes() {
                        s.last_snapshot = bytes;
                    }
                }
            }
            if plan.snapshot_start.is_some() {
                s.snapshot_in_flight = false;
            }
        }
        if let (Ok(end), Some(start)) = (&result, plan.snapshot_start) {
            // The snapshot's first message: what is below it is no longer needed.
            let first = *end as u64 - (plan.messages.len() - start) as u64;
            purge_below(&inner, partition, first).await;
        }
        let results = job_results(&result, &plan.per_job);
        for (job, r) in batch.into_iter().zip(results) {
            let _ = job.done.send(r);
        }
    }
}

/// Most changelog messages of one partition sent and not yet acknowledged (`append_job`).
/// The JetStream context the changelog publishes through must allow at least this many
/// acks in flight per partition that appends through it (`max_ack_inflight`), or appends of
/// several partitions could wait on each other's permits forever.
pub const APPEND_WINDOW: usize = 256;

/// Most changes one coalesced append takes (`append_task`).
const COALESCE_MAX_CHANGES: usize = 8_192;

/// The messages of one coalesced append: each job's changes cut into batch bodies
/// ([`batch::split`]), no body shared by two jobs.
struct Plan {
    /// Batch bodies in append order; `true` for the first body of a snapshot.
    messages: Vec<(Bytes, bool)>,
    /// Messages of each job, in job order.
    per_job: Vec<usize>,
    /// Index (in `messages`) of the first message of the last snapshot job, if any.
    snapshot_start: Option<usize>,
    /// Whether a message holds the writer record (`meta\0writer`).
    writer: Vec<bool>,
}

impl Plan {
    fn of(jobs: &[Job]) -> Plan {
        let mut plan = Plan {
            messages: Vec::new(),
            per_job: Vec::with_capacity(jobs.len()),
            snapshot_start: None,
            writer: Vec::new(),
        };
        for job in jobs {
            let bodies = batch::split(&job.changes, batch::BATCH_MAX_BYTES);
            plan.per_job.push(bodies.len());
            if job.snapshot {
                plan.snapshot_start = Some(plan.messages.len());
            }
            for (i, (body, range)) in bodies.into_iter().enumerate() {
                plan.writer
                    .push(job.changes[range].iter().any(|c| writer_of(c).is_some()));
                plan.messages
                    .push((Bytes::from(body), job.snapshot && i == 0));
            }
        }
        plan
    }

    /// Body bytes of the messages from the last snapshot on (all of them without one).
    fn bytes_after_snapshot(&self) -> u64 {
        let from = self.snapshot_start.unwrap_or(0);
        self.messages[from..]
            .iter()
            .map(|(b, _)| b.len() as u64)
            .sum()
    }

    /// Body bytes of the last snapshot job, if there is one.
    fn snapshot_bytes(&self) -> Option<u64> {
        let start = self.snapshot_start?;
        let mut at = 0;
        for n in &self.per_job {
            if at == start {
                let bytes = self.messages[at..at + n].iter();
                return Some(bytes.map(|(b, _)| b.len() as u64).sum());
            }
            at += n;
        }
        None
    }
}

/// Purges `partition`'s changelog stream below sequence `first` (the first message of an
/// acknowledged snapshot). A failure is logged and left: the next snapshot purges again.
async fn purge_below(inner: &Inner, partition: i32, first: u64) {
    let purged = async {
        let s = ensure_stream(&inner.js, &inner.config, partition).await?;
        s.purge()
            .sequence(first)
            .await
            .map_err(|e| unavailable(format!("purge: {e}")))
    };
    match tokio::time::timeout(CALL_TIMEOUT, purged).await {
        Ok(Ok(r)) => tracing::info!(
            partition,
            below = first,
            purged = r.purged,
            "nats: changelog compacted: purged below the snapshot"
        ),
        Ok(Err(e)) => {
            tracing::warn!(partition, below = first, error = %e, "nats: changelog purge failed; the next snapshot purges again")
        }
        Err(_) => {
            tracing::warn!(
                partition,
                below = first,
                "nats: changelog purge timed out; the next snapshot purges again"
            )
        }
    }
}

/// The result of each job of a coalesced append: the changelog offset after that job's last
/// message (`end` minus the messages of the jobs after it), or the append's error for all.
/// `per_job`: each job's message count.
fn job_results(result: &Result<i64, Error>, per_job: &[usize]) -> Vec<Result<i64, Error>> {
    match result {
        Ok(end) => {
            let mut after = *end;
            let mut out: Vec<Result<i64, Error>> = per_job
                .iter()
                .rev()
                .map(|n| {
                    let here = after;
                    after -= *n as i64;
                    Ok(here)
                })
                .collect();
            out.reverse();
            out
        }
        Err(e) => per_job.iter().map(|_| Err(e.clone())).collect(),
    }
}

/// Appends the messages of `plan` after the last known sequence; returns the sequence after
/// the last one.
async fn append_job(
    inner: &Inner,
    partition: i32,
    state: &Mutex<LogState>,
    plan: &Plan,
) -> Result<i64, Error> {
    let known = state.lock().expect("changelog state lock").last;
    let mut last = match known {
        Some(l) => l,
        None => stream_last(inner, partition).await?,
    };
    let prefix = &inner.subject_prefix;
    let n = plan.messages.len();
    let subject = |after: u64| format!("{prefix}.{partition}.{BATCH_TOKEN}{}", after + 1);
    let build = |i: usize, after: u64, previous: Option<String>| {
        let (body, snapshot) = &plan.messages[i];
        message(
            inner,
            body.clone(),
            *snapshot,
            plan.writer[i],
            after,
            previous,
        )
    };
    // Pipelined, at most APPEND_WINDOW unacknowledged (an unawaited ack future holds one of
    // the context's `max_ack_inflight` permits: sending more than it allows before awaiting
    // any would wait forever), the acks taken in order; the first failure is looked at alone.
    // The first expects the stream's last sequence; each next one also expects its
    // predecessor's id as the stream's last message id, so once one is refused (another
    // writer appended) none after it can land on top of the other writer's records by
    // matching their sequence numbers.
    let start = last;
    let mut i = 0;
    let mut sent = 0;
    let mut window: VecDeque<PublishAckFuture> = VecDeque::with_capacity(APPEND_WINDOW);
    let mut broken = false;
    loop {
        if !broken && window.len() < APPEND_WINDOW && sent < n {
            let after = start + sent as u64;
            let previous = (sent > 0).then(|| msg_id(inner, after));
            match inner
                .js
                .send_publish(subject(after), build(sent, after, previous))
                .await
            {
                Ok(ack) => {
                    window.push_back(ack);
                    sent += 1;
                }
                Err(_) => broken = true,
            }
            continue;
        }
        let Some(ack) = window.pop_front() else { break };
        match ack.await {
            Ok(a) if a.sequence == last + 1 => {
                last = a.sequence;
                state.lock().expect("changelog state lock").last = Some(last);
                i += 1;
            }
            Ok(a) => return Err(misplaced(inner, partition, a.sequence, last + 1)),
            Err(_) => break,
        }
    }
    // Acks not awaited after a failure release their permits when dropped.
    drop(window);
    // What is left (a publish or an ack failed): one at a time, retried while the server is
    // away, each checked against what the stream holds.
    let mut backoff = crate::transport::Backoff::new(Duration::from_secs(5));
    while i < n {
        // The same message as the first attempt (same expected sequence, same id); one at a
        // time, each after the one before it is confirmed, so the sequence alone fences.
        let m = build(i, last, None);
        let sent = match inner.js.send_publish(subject(last), m).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match sent {
            Ok(a) if a.sequence == last + 1 => {
                last = a.sequence;
                state.lock().expect("changelog state lock").last = Some(last);
                i += 1;
                backoff.reset();
            }
            Ok(a) => return Err(misplaced(inner, partition, a.sequence, last + 1)),
            Err(e)
                if matches!(
                    e.kind(),
                    PublishErrorKind::WrongLastSequence | PublishErrorKind::WrongLastMessageId
                ) =>
            {
                // Our own earlier attempt may have landed (its ack was lost): then the stream
                // holds our message at last + 1.
                if own_message_at(inner, partition, last + 1, &msg_id(inner, last + 1)).await? {
                    last += 1;
                    state.lock().expect("changelog state lock").last = Some(last);
                    i += 1;
                    continue;
                }
                return Err(Error::Fenced {
                    transport: TRANSPORT,
                    reason: format!(
                        "changelog {} of partition {partition} was appended to by another \
                         process after sequence {last}: another instance owns this partition \
                         now (two instances with the same nats.instance, or this one is left \
                         over from before a re-scale)",
                        inner.config.changelog_stream_name(partition)
                    ),
                });
            }
            Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                return Err(fatal(format!(
                    "changelog batch of {} bytes on {}: {e}",
                    plan.messages[i].0.len(),
                    subject(last)
                )))
            }
            Err(e) => {
                tracing::debug!(partition, error = %e, "nats: changelog append failed; retrying");
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    }
    Ok(last as i64 + 1)
}

/// An append acknowledged at sequence `got` instead of `want` (cannot happen while the
/// expected-sequence headers hold; fatal rather than a silent gap).
fn misplaced(inner: &Inner, partition: i32, got: u64, want: u64) -> Error {
    fatal(format!(
        "changelog {}: append acknowledged at sequence {got}, expected {want}",
        inner.config.changelog_stream_name(partition)
    ))
}

fn msg_id(inner: &Inner, seq: u64) -> String {
    format!("{}:{seq}", inner.msg_id_prefix)
}

/// The batch message of `body` expected to land at `after + 1`, right after the message
/// with id `previous` when given (`Nats-Expected-Last-Msg-Id`); `snapshot`: the first of a
/// snapshot ([`SNAPSHOT_HEADER`]); `writer`: it holds the writer record, so it names the
/// input it records ([`INPUT_STREAM_HEADER`], [`INPUT_PARTITIONS_HEADER`]).
fn message(
    inner: &Inner,
    body: Bytes,
    snapshot: bool,
    writer: bool,
    after: u64,
    previous: Option<String>,
) -> PublishMessage {
    let mut headers = HeaderMap::new();
    headers.insert(
        async_nats::header::NATS_EXPECTED_LAST_SEQUENCE,
        after.to_string().as_str(),
    );
    if let Some(id) = previous {
        headers.insert(
            async_nats::header::NATS_EXPECTED_LAST_MESSAGE_ID,
            id.as_str(),
        );
    }
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        msg_id(inner, after + 1).as_str(),
    );
    if writer {
        headers.insert(INPUT_STREAM_HEADER, inner.config.input_stream.as_str());
        headers.insert(
            INPUT_PARTITIONS_HEADER,
            inner.config.partitions.to_string().as_str(),
        );
    }
    if snapshot {
        headers.insert(SNAPSHOT_HEADER, "1");
    }
    PublishMessage::build().headers(headers).payload(body)
}

/// The last sequence of `partition`'s changelog stream (0: empty).
async fn stream_last(inner: &Inner, partition: i32) -> Result<u64, Error> {
    let mut s = ensure_stream(&inner.js, &inner.config, partition).await?;
    let info = s.info().await.map_err(|e| {
        unavailable(format!(
            "changelog stream info of partition {partition}: {e}"
        ))
    })?;
    Ok(info.state.last_sequence)
}

/// Whether the message at `seq` of `partition`'s stream has `Nats-Msg-Id` `id`.
async fn own_message_at(inner: &Inner, partition: i32, seq: u64, id: &str) -> Result<bool, Error> {
    let s = ensure_stream(&inner.js, &inner.config, partition).await?;
    match s.get_raw_message(seq).await {
        Ok(m) => Ok(m
            .headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .is_some_and(|v| v.as_str() == id)),
        // Gone (compacted by a later write of the same key) or never there: not ours to claim.
        Err(_) => Ok(false),
    }
}

/// Appends the changes of the changelog message on `subject` at sequence `seq` to `out`:
/// a batch ([`batch`]) gives all of its changes, each at `seq`; a record of the per-key
/// layout (module docs: Layout) gives one.
///
/// Errors: [`Error::Fatal`] when the message is not a settle record (another subject, a
/// damaged batch).
fn decode_message(
    subject: &str,
    headers: Option<&HeaderMap>,
    payload: &[u8],
    seq: u64,
    out: &mut Vec<(i64, Change)>,
) -> Result<(), Error> {
    let token = subject.rsplit('.').next().unwrap_or_default();
    if token.starts_with(BATCH_TOKEN) {
        let changes = batch::decode(payload).map_err(|e| {
            fatal(format!(
                "changelog message on {subject} (sequence {seq}) is not a settle batch: {e}"
            ))
        })?;
        out.extend(changes.into_iter().map(|c| (seq as i64, c)));
        return Ok(());
    }
    let key = record_key(subject).ok_or_else(|| {
        fatal(format!(
            "changelog message on {subject} (sequence {seq}) is not a settle record"
        ))
    })?;
    let tombstone = headers.and_then(|h| h.get(TOMBSTONE_HEADER)).is_some();
    out.push((
        seq as i64,
        Change {
            key,
            value: (!tombstone).then(|| payload.to_vec()),
        },
    ));
    Ok(())
}

/// Reads one partition's changelog stream from a sequence to its end as of the open.
struct NatsChangelogReader {
    stream: stream::Stream,
    consumer: Option<PullConsumer>,
    state: Arc<Mutex<LogState>>,
    /// Sequence after the last message as of the open (records past it may be read too).
    end: i64,
    done: bool,
    /// The stream was purged past the reader's start (module docs: Compaction).
    compacted: bool,
    /// Messages and changes read so far: a fetch asks for about as many messages as hold
    /// the changes wanted (a batch holds thousands, a record of the per-key layout one).
    read: (u64, u64),
}

impl NatsChangelogReader {
    /// Messages one fetch asks for to bring about `wanted` changes (at least 1, at most
    /// [`READ_FETCH`]).
    fn fetch_size(&self, wanted: usize) -> usize {
        let (messages, changes) = self.read;
        let per_message = changes.checked_div(messages).unwrap_or(1).max(1);
        (wanted as u64)
            .div_ceil(per_message)
            .clamp(1, READ_FETCH as u64) as usize
    }

    async fn chunk(&mut self, max: usize) -> Result<Vec<(i64, Change)>, Error> {
        let Some(consumer) = self.consumer.clone() else {
            self.done = true;
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        let idle_since = tokio::time::Instant::now();
        loop {
            let mut batch = consumer
                .fetch()
                .max_messages(self.fetch_size(max - out.len()))
                .messages()
                .await
                .map_err(|e| unavailable(format!("changelog fetch: {e}")))?;
            while let Some(next) = batch.next().await {
                let m = next.map_err(|e| unavailable(format!("changelog fetch: {e}")))?;
                let (seq, pending) = match m.info() {
                    Ok(i) => (i.stream_sequence, i.pending),
                    Err(e) => return Err(unavailable(format!("changelog message: {e}"))),
                };
                let m = m.message;
                let before = out.len();
                decode_message(
                    m.subject.as_str(),
                    m.headers.as_ref(),
                    &m.payload,
                    seq,
                    &mut out,
                )?;
                self.read.0 += 1;
                self.read.1 += (out.len() - before) as u64;
                {
                    let mut s = self.state.lock().expect("changelog state lock");
                    s.last = Some(s.last.unwrap_or(0).max(seq));
                }
                // The end as of the open is reached, or nothing more is there now.
                if pending == 0 || seq as i64 + 1 >= self.end {
                    self.done = true;
                    break;
                }
                // Every message the fetch brought is taken (none read past: the consumer
                // does not deliver them again), so a chunk may hold more than `max`.
            }
            if !out.is_empty() || self.done {
                return Ok(out);
            }
            // An empty fetch: the records up to the end were compacted away, or the server
            // has not answered yet. The consumer's pending count decides.
            let mut c = consumer.clone();
            match c.info().await {
                Ok(ci) if ci.num_pending == 0 => {
                    self.done = true;
                    return Ok(out);
                }
                Ok(_) => {}
                Err(e) => return Err(unavailable(format!("changelog reader: {e}"))),
            }
            if idle_since.elapsed() >= READ_STALL {
                return Err(unavailable(format!(
                    "changelog stream {}: nothing read for {} s",
                    self.stream.cached_info().config.name,
                    READ_STALL.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl ChangelogReader for NatsChangelogReader {
    fn next_chunk(&mut self, max: usize) -> BoxFuture<'_, Result<Vec<(i64, Change)>, Error>> {
        Box::pin(async move {
            if self.done {
                return Ok(Vec::new());
            }
            self.chunk(max.max(1)).await
        })
    }

    fn end_hint(&self) -> Option<i64> {
        Some(self.end)
    }

    fn restarts_from_snapshot(&self) -> bool {
        self.compacted
    }
}

impl Drop for NatsChangelogReader {
    fn drop(&mut self) {
        // The ephemeral consumer also goes away by itself after its inactive threshold.
        if let Some(c) = self.consumer.take() {
            let stream = self.stream.clone();
            let name = c.cached_info().name.clone();
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    let _ = stream.delete_consumer(&name).await;
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_coalesced_append_gives_each_job_the_offset_after_its_own_last_message() {
        // Stream last at 10 before: jobs of 3, 1 and 2 messages land at 11..=16, so their
        // offsets (sequence after their last message) are 14, 15 and 17.
        let got: Vec<i64> = job_results(&Ok(17), &[3, 1, 2])
            .into_iter()
            .map(|r| r.expect("ok"))
            .collect();
        assert_eq!(got, vec![14, 15, 17]);
        let e = fatal("boom".into());
        let got = job_results(&Err(e), &[3, 1, 2]);
        assert_eq!(got.len(), 3);
        assert!(got
            .iter()
            .all(|r| r.as_ref().is_err_and(|e| e.to_string().contains("boom"))));
    }

    #[test]
    fn a_plan_gives_each_job_its_own_messages_and_marks_the_snapshot() {
        let change = |key: &[u8], bytes: usize| Change {
            key: key.to_vec(),
            value: Some(vec![1; bytes]),
        };
        let big = batch::BATCH_MAX_BYTES / 3;
        let (done, _rx) = oneshot::channel();
        let live = Job {
            changes: vec![change(b"sessions\0a", 10), change(b"meta\0writer", 8)],
            snapshot: false,
            done,
        };
        let (done, _rx2) = oneshot::channel();
        let snapshot = Job {
            // Three thirds of a batch and the writer record: two messages.
            changes: vec![
                change(b"sessions\0b", big),
                change(b"sessions\0c", big),
                change(b"sessions\0d", big),
                change(b"meta\0writer", 8),
            ],
            snapshot: true,
            done,
        };
        let plan = Plan::of(&[live, snapshot]);
        assert_eq!(plan.per_job, vec![1, 2]);
        assert_eq!(plan.snapshot_start, Some(1));
        let flags: Vec<bool> = plan.messages.iter().map(|(_, s)| *s).collect();
        assert_eq!(flags, vec![false, true, false], "only the snapshot's first");
        assert_eq!(plan.writer, vec![true, false, true]);
        let snapshot_bytes: u64 = plan.messages[1..].iter().map(|(b, _)| b.len() as u64).sum();
        assert_eq!(plan.snapshot_bytes(), Some(snapshot_bytes));
        assert_eq!(plan.bytes_after_snapshot(), snapshot_bytes);
        // Decoded back, the messages are the jobs' changes in order.
        let mut out = Vec::new();
        for (i, (body, _)) in plan.messages.iter().enumerate() {
            decode_message(
                &format!("p.0.batch-{}", i + 1),
                None,
                body,
                i as u64 + 1,
                &mut out,
            )
            .expect("decodes");
        }
        let offsets: Vec<i64> = out.iter().map(|(o, _)| *o).collect();
        assert_eq!(offsets, vec![1, 1, 2, 2, 3, 3]);
    }

    #[test]
    fn a_message_of_the_per_key_layout_is_still_read() {
        let mut out = Vec::new();
        let subject = record_subject("settle.changelog", 3, b"sessions\0acme/r1");
        decode_message(&subject, None, b"v", 9, &mut out).expect("a put");
        let mut tomb = HeaderMap::new();
        tomb.insert(TOMBSTONE_HEADER, "1");
        decode_message(&subject, Some(&tomb), b"", 10, &mut out).expect("a delete");
        assert_eq!(
            out,
            vec![
                (
                    9,
                    Change {
                        key: b"sessions\0acme/r1".to_vec(),
                        value: Some(b"v".to_vec())
                    }
                ),
                (
                    10,
                    Change {
                        key: b"sessions\0acme/r1".to_vec(),
                        value: None
                    }
                ),
            ]
        );
        let e = decode_message("settle.changelog.3.batch-4", None, b"junk", 4, &mut out)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a settle batch"), "{e}");
    }

    #[test]
    fn a_changelog_of_another_input_is_refused() {
        let config = NatsConfig {
            input_stream: "B_UPLOADS".into(),
            partitions: 4,
            ..NatsConfig::default()
        };
        assert!(
            check_binding(&config, "CL-0", None, None).is_ok(),
            "old: adopted"
        );
        assert!(check_binding(&config, "CL-0", Some("B_UPLOADS"), Some("4")).is_ok());
        let e = check_binding(&config, "CL-0", Some("A_UPLOADS"), Some("4"))
            .unwrap_err()
            .to_string();
        for words in [
            "CL-0 records input stream A_UPLOADS",
            "reads input stream B_UPLOADS",
            "nats.changelog-stream",
        ] {
            assert!(e.contains(words), "{e:?} lacks {words:?}");
        }
        let e = check_binding(&config, "CL-0", Some("B_UPLOADS"), Some("8"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("8 partitions") && e.contains("nats.partitions is 4"),
            "{e}"
        );
    }

    #[test]
    fn record_subjects_round_trip_any_key() {
        for key in [
            b"sessions\0acme/run-7".to_vec(),
            b"meta\0offset".to_vec(),
            "sessions\0t/a.b c*>/\u{1f600}".as_bytes().to_vec(),
            vec![0u8, 255, 46, 42, 62, 32],
        ] {
            let subject = record_subject("settle.changelog", 3, &key);
            let token = subject.strip_prefix("settle.changelog.3.").expect("prefix");
            assert!(token.bytes().all(|b| b.is_ascii_hexdigit()), "{subject}");
            assert_eq!(record_key(&subject).as_deref(), Some(key.as_slice()));
        }
        assert_eq!(record_key("settle.changelog.3.abc"), None);
        assert_eq!(record_key("settle.changelog.3.zz"), None);
    }
}
