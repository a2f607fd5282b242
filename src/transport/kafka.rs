//! The Kafka transport (rdkafka over bundled librdkafka, tokio): a consumer group as the
//! [`Source`], one split partition queue per owned partition as the [`PartitionInput`], and an
//! idempotent producer as the [`Sink`] (ready records to the tier's topic, bad records to the
//! dead-letter topic). Also the `settle run` entry point on Kafka ([`run`], [`run_until`]).
//!
//! # Consumer group
//!
//! * `partition.assignment.strategy=cooperative-sticky`, `enable.auto.commit=false`,
//!   `enable.partition.eof=true`, `auto.offset.reset=earliest` (a new group misses nothing).
//! * The group's own queue (rebalances, errors, librdkafka's log) is polled by one dedicated
//!   thread (`settle-kafka-group`, a blocking `BaseConsumer::poll` loop), never by a tokio
//!   worker, because the rebalance callback blocks:
//!   * **assign**: before librdkafka starts fetching, each new partition's queue is split off
//!     the group queue (`BaseConsumer::split_partition_queue`) so its records reach only
//!     its [`KafkaInput`]; after the incremental assign, one [`SourceEvent::Assigned`] hands
//!     the inputs to the runtime, which seeks each to its stored offset (if its store has
//!     one; otherwise fetching starts at the group's committed offset).
//!   * **revoke**: sends [`SourceEvent::Revoked`] and blocks until the runtime signals `done`
//!     (the partitions' tasks finished their batch, flushed their outbox and stopped), then
//!     commits the revoked partitions' last durable offsets synchronously (unless the
//!     assignment was lost), and only then returns, so librdkafka unassigns them. Nothing of
//!     a revoked partition is written or committed after the callback returns.
//! * Offsets are committed only through [`PartitionInput::commit`], which the runtime calls
//!   for durable batches: asynchronously on the hot path (at most every
//!   [`crate::runtime::partition::COMMIT_INTERVAL`] while records flow, at once when caught
//!   up), plus one synchronous commit of the latest ones on revoke and when the source is
//!   dropped (graceful stop).
//!
//! # Caught up (SEMANTICS §3)
//!
//! A partition is caught up when librdkafka reported partition EOF after the last record
//! handed out, or when its high watermark is at or below the next offset to read. The high
//! watermark is the one librdkafka caches from every fetch response (no request is sent per
//! poll); fetch responses and EOF follow the last record by at most `fetch.wait.max.ms`
//! (100 ms here). Records appended after the last fetch response are unknown until the next
//! one: the inherent race of any consumer, bounded by that same 100 ms.
//!
//! # Errors
//!
//! librdkafka retries broker errors itself. This module logs each client's trouble once per
//! change of state ("degraded: …", "recovered"), not once per attempt, and classifies what the
//! runtime sees: broker down, timeouts, missing topics and authorization failures are
//! [`Error::Unavailable`] (retried with backoff: an operator can fix them without a restart);
//! records that can never be accepted (too large, invalid) and librdkafka fatal errors are
//! [`Error::Fatal`]. A bad client property is found at start ([`KafkaConfig::validate`],
//! client creation) and reported with the key.
//!
//! # Time
//!
//! Record timestamps are the broker's (`LogAppendTime` where the topic uses it, otherwise the
//! producer's `CreateTime`; tansu 0.6 only has `CreateTime`). A record without a timestamp
//! gets the wall clock when it is read.
//!
//! # Brokers that are not Apache Kafka (tansu 0.6, the test broker)
//!
//! * Fetch returns only batches whose base offset is at or after the fetch offset, so a
//!   fetch from the middle of a batch (resuming at a stored or committed offset) stalls or
//!   skips to the next batch: [`KafkaInput`] notices and rewinds (see its docs).
//! * ListOffsets "latest" answers the newest batch's base offset + 1, so the high watermark
//!   is taken from fetch responses instead (see "Caught up").
//! * Fetches seem to be held for the whole `fetch.wait.max.ms` even when records arrive:
//!   records of a live partition reach settle up to that long after they were produced
//!   (lower it in `[kafka.properties]` for lower latency of `leading`/`complete`/`final`).
//! * The group coordinator goes through a few extra generations per rebalance; a short
//!   `session.timeout.ms` (6 s) can evict a member that is joining. The default (45 s) is fine.

use super::{
    ChangelogReader, Error, InputBatch, InputRecord, PartitionInput, ReadyMessage, Sink, Source,
    SourceEvent,
};
use crate::codec::EMISSION_ID_HEADER;
use crate::config::Config;
use crate::engine::Engine;
use crate::runtime::{shutdown_on_signals, RunSummary, Runtime, RuntimeOptions, SystemClock};
use crate::store::Change;
use crate::tiers::TiersConfig;
use anyhow::Context as _;
use futures::future::BoxFuture;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{BorrowedMessage, Header, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_util::sync::CancellationToken;

mod changelog;
mod txn;

pub use txn::CRASH_BEFORE_COMMIT_ENV;

pub use crate::config::kafka::{KafkaConfig, KafkaConfigError, ProcessingGuarantee, Role};

const TRANSPORT: &str = "kafka";

/// Header of a ready record: the `instance-id` of the process that published it.
pub const INSTANCE_HEADER: &str = "settle-instance";
/// Header of a ready record: the input partition whose task emitted it, decimal.
pub const PARTITION_HEADER: &str = "settle-partition";

/// Header of a dead letter: the `codec::DecodeError::reason` code (SEMANTICS §2).
pub const DLQ_REASON_HEADER: &str = "settle-dlq-reason";
/// Header of a dead letter: the input topic the record was read from.
pub const DLQ_SOURCE_TOPIC_HEADER: &str = "settle-dlq-source-topic";
/// Header of a dead letter: the input partition, decimal.
pub const DLQ_SOURCE_PARTITION_HEADER: &str = "settle-dlq-source-partition";
/// Header of a dead letter: the record's offset in its input partition, decimal.
pub const DLQ_SOURCE_OFFSET_HEADER: &str = "settle-dlq-source-offset";

/// Longest wait of a poll between two looks at its partition queue.
const QUEUE_RECHECK: Duration = Duration::from_millis(50);

/// Bound on one blocking broker call (seek, watermark query, synchronous commit).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a seek waits for librdkafka to start fetching a just-assigned partition
/// (it first fetches the group's committed offset) before reporting it unavailable.
const SEEK_START_WAIT: Duration = Duration::from_secs(10);

/// How long a publish may wait for room in librdkafka's local queue.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------------
// Errors and their logging

/// Locks a mutex of this module. Poisoning is ignored: every critical section leaves the
/// data consistent (inserts, removals, replacements), so a panic elsewhere cannot corrupt it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// librdkafka error codes after which the same request can never succeed.
fn is_permanent(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::InvalidMessage
            | C::InvalidRecord
            | C::InvalidTopic
            | C::InvalidArgument
            | C::InvalidConfig
            | C::UnsupportedForMessageFormat
            | C::UnsupportedVersion
            | C::Fatal
    )
}

/// The runtime's view of a librdkafka error (see the module docs for the split).
fn classify(e: &KafkaError) -> Error {
    let permanent = matches!(
        e,
        KafkaError::MessageConsumptionFatal(_) | KafkaError::ClientConfig(..)
    ) || e.rdkafka_error_code().is_some_and(is_permanent);
    if permanent {
        Error::Fatal {
            transport: TRANSPORT,
            reason: e.to_string(),
        }
    } else {
        Error::Unavailable {
            transport: TRANSPORT,
            reason: e.to_string(),
        }
    }
}

/// The state of one client's connection to the cluster, logged once per change (STYLE §7)
/// rather than once per retry.
#[derive(Debug)]
struct Health {
    client: &'static str,
    /// Set while in trouble: lets [`Health::healthy`] skip the lock on the hot path.
    troubled: AtomicBool,
    /// What the trouble is (error code name), `None` when healthy.
    trouble: Mutex<Option<String>>,
}

impl Health {
    fn new(client: &'static str) -> Self {
        Health {
            client,
            troubled: AtomicBool::new(false),
            trouble: Mutex::new(None),
        }
    }

    /// Records a failure; logs it when its kind differs from the current trouble's.
    fn failed(&self, e: &KafkaError, detail: &str) {
        let state = trouble_kind(e);
        let mut trouble = lock(&self.trouble);
        if trouble.as_deref() != Some(state.as_str()) {
            tracing::warn!(client = self.client, trouble = %state, error = %e, detail, "kafka {}: degraded, librdkafka keeps retrying", self.client);
            *trouble = Some(state);
            self.troubled.store(true, Ordering::Release);
        }
    }

    /// Whether the current trouble is of `kind` (see [`trouble_kind`]).
    fn is(&self, kind: &str) -> bool {
        self.troubled.load(Ordering::Acquire) && lock(&self.trouble).as_deref() == Some(kind)
    }

    /// Records a success; logs the recovery when there was trouble.
    fn healthy(&self) {
        if !self.troubled.load(Ordering::Acquire) {
            return;
        }
        if let Some(was) = lock(&self.trouble).take() {
            tracing::info!(client = self.client, after = %was, "kafka {}: recovered", self.client);
        }
        self.troubled.store(false, Ordering::Release);
    }
}

/// [`trouble_kind`] of a cluster that cannot be reached.
const UNREACHABLE: &str = "cluster unreachable";

/// The kind of trouble an error shows, coarse enough that one outage is one kind (a broker
/// that is down shows as transport failures, "all brokers down" and timeouts in turn).
fn trouble_kind(e: &KafkaError) -> String {
    use RDKafkaErrorCode as C;
    match e.rdkafka_error_code() {
        Some(
            C::BrokerTransportFailure
            | C::AllBrokersDown
            | C::MessageTimedOut
            | C::OperationTimedOut
            | C::RequestTimedOut
            | C::Resolve
            | C::NetworkException
            | C::BrokerNotAvailable
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::CoordinatorNotAvailable
            | C::NotCoordinator
            | C::CoordinatorLoadInProgress,
        ) => UNREACHABLE.to_owned(),
        Some(
            C::TopicAuthorizationFailed
            | C::GroupAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::Authentication
            | C::SaslAuthenticationFailed
            | C::IllegalSASLState,
        ) => "not authorized".to_owned(),
        Some(C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition) => {
            "unknown topic".to_owned()
        }
        Some(code) => format!("{code:?}"),
        None => e.to_string(),
    }
}

/// Routes librdkafka's log lines to `tracing` (target `librdkafka`). Connection failures
/// (facility `FAIL`) go to debug: they repeat per reconnect attempt and [`Health`] already
/// reports them once per change.
fn log_line(level: RDKafkaLogLevel, fac: &str, message: &str) {
    use RDKafkaLogLevel as L;
    // `[kafka.properties]` go to both clients: a consumer property on the producer is fine.
    let other_role = fac == "CONFWARN"
        && (message.contains("consumer property and will be ignored by this producer")
            || message.contains("producer property and will be ignored by this consumer"));
    match level {
        _ if fac == "FAIL" || other_role => tracing::debug!(target: "librdkafka", fac, "{message}"),
        L::Emerg | L::Alert | L::Critical | L::Error => {
            tracing::error!(target: "librdkafka", fac, "{message}")
        }
        L::Warning => tracing::warn!(target: "librdkafka", fac, "{message}"),
        L::Notice | L::Info => tracing::info!(target: "librdkafka", fac, "{message}"),
        L::Debug => tracing::debug!(target: "librdkafka", fac, "{message}"),
    }
}

/// A client context for settle's auxiliary clients (`settle loadgen`, topic readers, admin):
/// librdkafka's log through `tracing` as above, errors logged at warn except partition EOF.
#[derive(Clone, Copy, Debug, Default)]
pub struct LogContext;

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        log_line(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() != Some(RDKafkaErrorCode::PartitionEOF) {
            tracing::warn!(error = %error, reason, "kafka client error");
        }
    }
}

impl ConsumerContext for LogContext {}

fn wall_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

// ---------------------------------------------------------------------------------------------
// Consumer group: context, source

type Events = mpsc::UnboundedSender<Result<SourceEvent<KafkaInput>, Error>>;

/// The consumer-group member.
type GroupConsumer = BaseConsumer<GroupContext>;

/// The consumer's context: turns rebalances into [`SourceEvent`]s (module docs) and keeps
/// what the final commits need.
struct GroupContext {
    /// Number of this source in the process (1, 2, ...), to tell members apart in logs.
    member: u32,
    topic: String,
    topic_c: CString,
    events: Events,
    /// The consumer itself (set right after creation), to split partition queues.
    consumer: OnceLock<Weak<GroupConsumer>>,
    /// Inputs split in `pre_rebalance`, handed over in `post_rebalance`.
    pending: Mutex<Vec<KafkaInput>>,
    /// Owned partition → last offset committed by its input (next offset to consume).
    committed: Mutex<BTreeMap<i32, i64>>,
    health: Health,
    /// A record arrived on the group queue (should not happen; warned once).
    stray_warned: AtomicBool,
}

impl GroupContext {
    /// Commits `partitions`' last committed offsets synchronously (`None`: every owned one)
    /// and forgets them. Runs on the group thread.
    fn commit_final<K: Consumer<GroupContext>>(&self, consumer: &K, partitions: Option<&[i32]>) {
        let offsets: Vec<(i32, i64)> = {
            let mut committed = lock(&self.committed);
            match partitions {
                Some(ps) => ps
                    .iter()
                    .filter_map(|p| committed.remove(p).map(|o| (*p, o)))
                    .collect(),
                None => std::mem::take(&mut *committed).into_iter().collect(),
            }
        };
        if offsets.is_empty() {
            return;
        }
        if self.health.is(UNREACHABLE) {
            // A synchronous commit would wait for librdkafka's socket timeout (60 s).
            tracing::warn!(
                member = self.member,
                ?offsets,
                "kafka: cluster unreachable, final offsets not committed; the stores keep them"
            );
            return;
        }
        let mut tpl = TopicPartitionList::with_capacity(offsets.len());
        for (p, o) in &offsets {
            if let Err(e) = tpl.add_partition_offset(&self.topic, *p, Offset::Offset(*o)) {
                tracing::warn!(partition = p, error = %e, "kafka: cannot build the final commit");
            }
        }
        match consumer.commit(&tpl, CommitMode::Sync) {
            Ok(()) => tracing::info!(member = self.member, ?offsets, "kafka: offsets committed"),
            Err(e) => {
                tracing::warn!(error = %e, ?offsets, "kafka: final offset commit failed; the stores keep the offsets")
            }
        }
    }

    fn partitions_of(&self, tpl: &TopicPartitionList) -> Vec<i32> {
        tpl.elements()
            .iter()
            .filter(|e| e.topic() == self.topic)
            .map(|e| e.partition())
            .collect()
    }
}

impl ClientContext for GroupContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        log_line(level, fac, log_message);
    }

    /// Every error event passes here first, partition EOF included (not a trouble).
    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() != Some(RDKafkaErrorCode::PartitionEOF) {
            self.health.failed(&error, reason);
        }
    }
}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let Some(consumer) = self.consumer.get().and_then(Weak::upgrade) else {
                    return;
                };
                let mut inputs = Vec::new();
                for p in self.partitions_of(tpl) {
                    match consumer.split_partition_queue(&self.topic, p) {
                        Some(mut queue) => {
                            let arrived = Arc::new(Notify::new());
                            let wake = Arc::clone(&arrived);
                            queue.set_nonempty_callback(move || wake.notify_one());
                            inputs.push(KafkaInput {
                                topic: self.topic.clone(),
                                topic_c: self.topic_c.clone(),
                                partition: p,
                                queue,
                                arrived,
                                consumer: Arc::clone(&consumer),
                                cursor: Cursor::default(),
                            });
                        }
                        None => {
                            tracing::error!(
                                partition = p,
                                "kafka: cannot split the partition queue"
                            )
                        }
                    }
                }
                *lock(&self.pending) = inputs;
            }
            Rebalance::Revoke(tpl) => {
                let partitions = self.partitions_of(tpl);
                if partitions.is_empty() {
                    return;
                }
                let lost = base.assignment_lost();
                tracing::info!(
                    ?partitions,
                    lost,
                    "kafka: partitions revoked; stopping their tasks"
                );
                let (done, stopped) = oneshot::channel();
                let event = SourceEvent::Revoked {
                    partitions: partitions.clone(),
                    lost,
                    done,
                };
                if self.events.send(Ok(event)).is_ok() {
                    // Blocks the group thread (never a tokio worker) until the runtime has
                    // stopped the partitions' tasks; an Err means the runtime is gone.
                    let _ = stopped.blocking_recv();
                }
                if lost {
                    // Another member may own them already: committing could move its offsets back.
                    let mut committed = lock(&self.committed);
                    for p in &partitions {
                        committed.remove(p);
                    }
                } else {
                    self.commit_final(base, Some(&partitions));
                }
            }
            Rebalance::Error(e) => self.health.failed(e, "rebalance"),
        }
    }

    fn post_rebalance(&self, _base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(_) = rebalance {
            let inputs = std::mem::take(&mut *lock(&self.pending));
            if inputs.is_empty() {
                return;
            }
            self.health.healthy();
            let partitions: Vec<i32> = inputs.iter().map(|i| i.partition).collect();
            tracing::info!(
                member = self.member,
                ?partitions,
                "kafka: partitions assigned"
            );
            // A failed send means the source is gone; the inputs are dropped with the event.
            let _ = self.events.send(Ok(SourceEvent::Assigned(inputs)));
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        match result {
            Ok(()) => self.health.healthy(),
            Err(e) => self.health.failed(&e, "offset commit"),
        }
    }
}

/// How long one poll of the group queue blocks; also the group thread's stop latency.
const GROUP_POLL: Duration = Duration::from_millis(100);

/// [`Source`] of a Kafka consumer group on the input topic. Dropping it stops the group
/// thread, commits the owned partitions' last durable offsets and leaves the group.
pub struct KafkaSource {
    events: mpsc::UnboundedReceiver<Result<SourceEvent<KafkaInput>, Error>>,
    /// The group member (owned by the group thread), for exactly-once offset commits.
    consumer: Weak<GroupConsumer>,
    stop: Arc<AtomicBool>,
    group_thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource").finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// Joins consumer group `group-id` on `input-topic` (module docs for the settings).
    /// Connecting happens in the background: a broker that is down is retried, not an error.
    /// The inputs it hands out must be polled inside a tokio runtime.
    ///
    /// Errors: [`Error::Fatal`] when librdkafka rejects the configuration or the group
    /// thread cannot be started.
    pub fn new(config: &KafkaConfig) -> Result<Self, Error> {
        let fatal = |reason: String| Error::Fatal {
            transport: TRANSPORT,
            reason,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let topic_c = CString::new(config.input_topic.as_str())
            .map_err(|_| fatal("kafka.input-topic contains a NUL byte".into()))?;
        static MEMBERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let context = GroupContext {
            member: MEMBERS.fetch_add(1, Ordering::Relaxed) + 1,
            topic: config.input_topic.clone(),
            topic_c,
            events: tx.clone(),
            consumer: OnceLock::new(),
            pending: Mutex::new(Vec::new()),
            committed: Mutex::new(BTreeMap::new()),
            health: Health::new("consumer"),
            stray_warned: AtomicBool::new(false),
        };
        let consumer: Arc<GroupConsumer> = Arc::new(
            config
                .client_config(Role::Consumer)
                .create_with_context(context)
                .map_err(|e| fatal(format!("cannot create the Kafka consumer: {e}")))?,
        );
        // Set before subscribing, so the first rebalance finds it.
        let _ = consumer.context().consumer.set(Arc::downgrade(&consumer));
        consumer
            .subscribe(&[&config.input_topic])
            .map_err(|e| fatal(format!("cannot subscribe to {}: {e}", config.input_topic)))?;
        let member = consumer.context().member;
        let weak = Arc::downgrade(&consumer);
        let stop = Arc::new(AtomicBool::new(false));
        let group_thread = std::thread::Builder::new()
            .name("settle-kafka-group".into())
            .spawn({
                let stop = Arc::clone(&stop);
                move || serve_group(&consumer, &tx, &stop)
            })
            .map_err(|e| fatal(format!("cannot start the Kafka group thread: {e}")))?;
        tracing::info!(
            member,
            group = %config.group_id,
            topic = %config.input_topic,
            servers = %config.bootstrap_servers,
            "kafka: joining the consumer group"
        );
        Ok(KafkaSource {
            events: rx,
            consumer: weak,
            stop,
            group_thread: Some(group_thread),
        })
    }
}

/// The group thread: polls the consumer's own queue (rebalance callbacks run here and may
/// block) until `stop`, then commits the owned partitions' last offsets synchronously.
fn serve_group(consumer: &GroupConsumer, events: &Events, stop: &AtomicBool) {
    let ctx = consumer.context();
    while !stop.load(Ordering::Acquire) {
        match consumer.poll(GROUP_POLL) {
            Some(Ok(message)) if !ctx.stray_warned.swap(true, Ordering::Relaxed) => {
                tracing::warn!(
                    topic = message.topic(),
                    partition = message.partition(),
                    offset = message.offset(),
                    "kafka: record on the group queue ignored (its partition queue was not split)"
                );
            }
            None | Some(Ok(_)) => {}
            Some(Err(e @ KafkaError::MessageConsumptionFatal(_))) => {
                tracing::error!(error = %e, "kafka: fatal consumer error");
                let _ = events.send(Err(classify(&e)));
            }
            Some(Err(KafkaError::PartitionEOF(_))) => {}
            Some(Err(e)) => ctx.health.failed(&e, "consumer"),
        }
    }
    ctx.commit_final(consumer, None);
}

impl Source for KafkaSource {
    type Input = KafkaInput;

    async fn next_event(&mut self) -> Result<Option<SourceEvent<KafkaInput>>, Error> {
        // `recv` is cancel-safe. The group thread holds a sender while it runs, so this
        // pends while no assignment change comes.
        match self.events.recv().await {
            Some(Ok(event)) => Ok(Some(event)),
            Some(Err(e)) => Err(e),
            None => Ok(None),
        }
    }
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        // Undelivered events go first: a revoke callback waiting on one of their `done`
        // senders is released, and later callbacks see the channel closed and do not wait.
        self.events.close();
        while self.events.try_recv().is_ok() {}
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.group_thread.take() {
            // Blocks for the final synchronous commit (bounded by librdkafka's timeouts);
            // this runs once, when the runtime has stopped every partition.
            if thread.join().is_err() {
                tracing::error!("kafka: the group thread panicked");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Partition input

/// A fetch that is behind but yields nothing for this long is rewound (see [`KafkaInput`]).
const FETCH_STALL: Duration = Duration::from_secs(1);

/// First rewind distance (offsets); doubled on each further rewind of the same position.
const FIRST_REWIND: i64 = 64;

/// A rewind in progress: the fetcher was sent `step` offsets before the position.
#[derive(Clone, Copy, Debug)]
struct Rewind {
    /// Where the fetcher was sent.
    target: i64,
    /// Distance from the position.
    step: i64,
    /// A record below the position arrived since: records exist right before it.
    saw_below: bool,
}

/// Read position and caught-up evidence of one [`KafkaInput`].
#[derive(Debug, Default)]
struct Cursor {
    /// Next offset to hand out (`None`: not known yet).
    next: Option<i64>,
    /// The committed offset was asked for as the first position (once per input).
    position_known: bool,
    /// librdkafka reported partition EOF after the last record handed out.
    eof: bool,
    /// High watermark from librdkafka's last fetch response for the partition.
    high: Option<i64>,
    /// When the position last moved (record handed out, seek, rewind).
    progress_at: Option<Instant>,
    /// The fetcher must be sent back before the position (gap or stall seen).
    rewind_wanted: bool,
    rewind: Option<Rewind>,
    /// A fatal error met while records were handed out; returned by the next poll.
    failed: Option<Error>,
    /// An offset gap was already reported for this input.
    gap_warned: bool,
    /// Records dropped below the position since the last poll returned.
    skipped: Skipped,
}

/// Records dropped below the position (already applied) during one poll, for its log line
/// and `InputBatch::skipped`.
#[derive(Clone, Copy, Debug, Default)]
struct Skipped {
    /// Dropped in all.
    count: u64,
    /// Of those, dropped while no rewind was under way: the broker sent records below the
    /// position unasked (say, librdkafka reset the fetch offset to the log start).
    unasked: u64,
    /// Lowest and highest offset dropped.
    first: i64,
    last: i64,
}

impl Skipped {
    fn note(&mut self, offset: i64, rewinding: bool) {
        if self.count == 0 {
            self.first = offset;
            self.last = offset;
        }
        self.count += 1;
        self.unasked += u64::from(!rewinding);
        self.first = self.first.min(offset);
        self.last = self.last.max(offset);
    }
}

impl Cursor {
    /// A cursor positioned at `next` (after a seek).
    fn at(next: i64) -> Self {
        Cursor {
            next: Some(next),
            position_known: true,
            progress_at: Some(Instant::now()),
            ..Cursor::default()
        }
    }

    /// Takes one item of the partition queue: a record (handed out unless it lies before
    /// the position, or after it with the records in between unaccounted for), partition
    /// EOF, or an error.
    fn take(
        &mut self,
        item: KafkaResult<BorrowedMessage<'_>>,
        out: &mut Vec<InputRecord>,
        health: &Health,
    ) {
        match item {
            Ok(m) => {
                let offset = m.offset();
                if let Some(next) = self.next {
                    if offset < next {
                        // Applied already (read again while rewinding, or sent unasked):
                        // counted, and logged once per poll (`KafkaInput::poll`).
                        self.skipped.note(offset, self.rewind.is_some());
                        if let Some(r) = &mut self.rewind {
                            r.saw_below = true;
                        }
                        return;
                    }
                    if offset > next {
                        let confirmed = self.rewind.is_some_and(|r| r.saw_below || r.target == 0);
                        if !confirmed {
                            // The broker may have skipped the batch holding `next`.
                            self.rewind_wanted = true;
                            return;
                        }
                        if !self.gap_warned {
                            self.gap_warned = true;
                            tracing::warn!(
                                partition = m.partition(),
                                expected = next,
                                got = offset,
                                "kafka: offsets missing from the partition (deleted by retention, compaction or transaction markers)"
                            );
                        }
                    }
                }
                if self.rewind_wanted {
                    return;
                }
                self.rewind = None;
                self.next = Some(offset + 1);
                self.progress_at = Some(Instant::now());
                self.eof = false;
                health.healthy();
                out.push(InputRecord {
                    partition: m.partition(),
                    offset,
                    key: m.key().map(<[u8]>::to_vec),
                    payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                    timestamp_ms: m.timestamp().to_millis().unwrap_or_else(wall_ms),
                });
            }
            Err(KafkaError::PartitionEOF(_)) => self.eof = self.rewind.is_none(),
            Err(e @ KafkaError::MessageConsumptionFatal(_)) => self.failed = Some(classify(&e)),
            Err(e) => health.failed(&e, "partition fetch"),
        }
    }

    /// The high watermark proves records wait after the position.
    fn behind(&self) -> bool {
        matches!((self.next, self.high), (Some(next), Some(high)) if next < high)
    }

    /// Behind, and nothing handed out for [`FETCH_STALL`].
    fn stalled(&self) -> bool {
        self.behind() && self.progress_at.is_some_and(|t| t.elapsed() >= FETCH_STALL)
    }
}

/// [`PartitionInput`] of one assigned partition: its own queue split off the consumer group
/// (module docs). Used by that partition's task only; its methods must run inside a tokio
/// runtime (blocking librdkafka calls go to `spawn_blocking`).
///
/// # Position
///
/// The input knows the next offset it hands out: the offset sought, else the group's
/// committed offset, else the first record's. A record below it is dropped (already
/// applied). When the fetch yields a record *after* it, or nothing for 1 s while the high
/// watermark is beyond it, the fetcher is sent back 64, 128, 256, ... offsets and the
/// records below the position are dropped again, until the record at the position arrives.
/// A gap is accepted only once confirmed (records right below the position exist, or the
/// rewind reached offset 0): records deleted by retention or compaction. This costs nothing with Apache Kafka, which returns
/// the batch holding any offset; tansu 0.6 returns only batches starting at or after the
/// fetch offset, so resuming in the middle of a batch otherwise stalls or skips records.
pub struct KafkaInput {
    topic: String,
    /// `topic` for librdkafka's C API.
    topic_c: CString,
    partition: i32,
    queue: PartitionQueue<GroupContext>,
    /// Notified by librdkafka when the queue turns non-empty.
    arrived: Arc<Notify>,
    consumer: Arc<GroupConsumer>,
    cursor: Cursor,
}

impl std::fmt::Debug for KafkaInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaInput")
            .field("topic", &self.topic)
            .field("partition", &self.partition)
            .field("cursor", &self.cursor)
            .finish_non_exhaustive()
    }
}

impl KafkaInput {
    /// Takes what the partition queue holds, up to `max` records in all. A `None` from
    /// librdkafka may mean "served an internal event", so one more look is taken.
    fn drain(&mut self, records: &mut Vec<InputRecord>, max: usize) {
        let health = &self.consumer.context().health;
        let mut idle = 0;
        while records.len() < max && idle < 2 {
            match self.queue.poll(Duration::ZERO) {
                Some(item) => {
                    idle = 0;
                    self.cursor.take(item, records, health);
                }
                None => idle += 1,
            }
        }
    }

    fn one_partition(&self, offset: Offset) -> Result<TopicPartitionList, Error> {
        let mut tpl = TopicPartitionList::with_capacity(1);
        tpl.add_partition_offset(&self.topic, self.partition, offset)
            .map_err(|e| classify(&e))?;
        Ok(tpl)
    }

    /// Runs a blocking librdkafka call on the blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        call: impl FnOnce(&GroupConsumer) -> KafkaResult<T> + Send + 'static,
    ) -> Result<T, Error> {
        let consumer = Arc::clone(&self.consumer);
        tokio::task::spawn_blocking(move || call(&consumer))
            .await
            .map_err(|e| Error::Unavailable {
                transport: TRANSPORT,
                reason: format!("blocking Kafka call failed: {e}"),
            })?
            .map_err(|e| classify(&e))
    }

    /// Sends the fetcher to `offset`, waiting (up to [`SEEK_START_WAIT`]) for librdkafka to
    /// start fetching a just-assigned partition.
    async fn seek_fetcher(&self, offset: i64) -> Result<(), Error> {
        let started = Instant::now();
        loop {
            let tpl = self.one_partition(Offset::Offset(offset))?;
            let consumer = Arc::clone(&self.consumer);
            let result = tokio::task::spawn_blocking(move || {
                consumer
                    .seek_partitions(tpl, CALL_TIMEOUT)
                    .and_then(|tpl| tpl.elements().first().map_or(Ok(()), |e| e.error()))
            })
            .await
            .map_err(|e| Error::Unavailable {
                transport: TRANSPORT,
                reason: format!("seek task failed: {e}"),
            })?;
            match result {
                Ok(()) => return Ok(()),
                Err(e) if not_started(&e) && started.elapsed() < SEEK_START_WAIT => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(classify(&e)),
            }
        }
    }

    /// Learns the position from the group's committed offset, once, before the first
    /// record (so a skipped batch is noticed even without a seek).
    async fn learn_position(&mut self) {
        self.cursor.position_known = true;
        let Ok(tpl) = self.one_partition(Offset::Invalid) else {
            return;
        };
        match self
            .blocking(move |c| c.committed_offsets(tpl, CALL_TIMEOUT))
            .await
        {
            Ok(tpl) => {
                if let Some(Offset::Offset(o)) = tpl.elements().first().map(|e| e.offset()) {
                    if self.cursor.next.is_none() {
                        self.cursor.next = Some(o);
                        self.cursor.progress_at = Some(Instant::now());
                    }
                }
            }
            Err(e) => {
                tracing::debug!(partition = self.partition, error = %e, "kafka: committed offset unknown")
            }
        }
    }

    /// Sends the fetcher further back before the position (see the type docs).
    async fn rewind(&mut self) -> Result<(), Error> {
        let Some(next) = self.cursor.next else {
            self.cursor.rewind_wanted = false;
            return Ok(());
        };
        let step = self.cursor.rewind.map_or(FIRST_REWIND, |r| r.step * 2);
        let target = (next - step).max(0);
        tracing::debug!(
            partition = self.partition,
            next_offset = next,
            target,
            "kafka: fetch returned no batch holding the position; rewinding"
        );
        self.seek_fetcher(target.min(next)).await?;
        let c = &mut self.cursor;
        c.rewind_wanted = false;
        c.rewind = Some(Rewind {
            target,
            step,
            saw_below: false,
        });
        c.progress_at = Some(Instant::now());
        c.eof = false;
        Ok(())
    }

    /// The high watermark librdkafka cached from its last fetch response for this
    /// partition (no request is sent). Not ListOffsets: tansu 0.6 answers "latest" with the
    /// newest batch's base offset + 1.
    fn cached_high_watermark(&self) -> Option<i64> {
        let (mut low, mut high) = (-1_i64, -1_i64);
        // SAFETY: the client pointer is live (`self.consumer` owns the client), `topic_c` is
        // a NUL-terminated string that outlives the call, and librdkafka only writes the two
        // out-parameters (under its own partition lock).
        let err = unsafe {
            rdkafka::bindings::rd_kafka_get_watermark_offsets(
                self.consumer.client().native_ptr(),
                self.topic_c.as_ptr(),
                self.partition,
                &mut low,
                &mut high,
            )
        };
        (err == rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0)
            .then_some(high)
    }

    /// Whether the partition has nothing more to read after the records handed out
    /// (module docs: EOF, else the high watermark).
    fn caught_up(&mut self) -> bool {
        self.cursor.high = self.cached_high_watermark().or(self.cursor.high);
        if self.cursor.eof {
            return true;
        }
        match (self.cursor.next, self.cursor.high) {
            (Some(next), Some(high)) => next >= high && self.cursor.rewind.is_none(),
            _ => false,
        }
    }
}

impl KafkaInput {
    /// Fails with [`Error::started_over`] when the partition's log ends below `next`, the
    /// offset stored for it (the topic was re-created, or the broker lost its log): records
    /// below `next` would otherwise be dropped as applied already, without an emission.
    ///
    /// The log end is the larger of ListOffsets "latest" and the high watermark of
    /// librdkafka's fetch responses (the fetcher was just sent to `next`). Neither is trusted
    /// alone when it is low: tansu 0.6 answers "latest" with the newest batch's base offset
    /// plus one (below the end when that batch holds several records), and its high watermark can
    /// lag the log end for a moment right after a produce. So a low end is asked again every
    /// 500 ms for [`LOG_END_SETTLE`] (the fetch response of the position arrives meanwhile)
    /// before the partition is failed.
    ///
    /// Errors: [`Error::Unavailable`] when the broker does not answer (the runtime retries the
    /// seek); [`Error::Fatal`] ([`Error::started_over`]) as above.
    async fn check_log_end(&self, next: i64) -> Result<(), Error> {
        let started = Instant::now();
        loop {
            let (topic, partition) = (self.topic.clone(), self.partition);
            let (_, latest) = self
                .blocking(move |c| c.fetch_watermarks(&topic, partition, CALL_TIMEOUT))
                .await?;
            let end = latest.max(self.cached_high_watermark().unwrap_or(-1));
            if end >= next {
                return Ok(());
            }
            if started.elapsed() >= LOG_END_SETTLE {
                return Err(Error::started_over(
                    TRANSPORT,
                    &self.topic,
                    self.partition,
                    end.max(0),
                    next,
                ));
            }
            tracing::debug!(
                partition = self.partition,
                end,
                next_offset = next,
                "kafka: log end below the stored offset; asking again"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Logs the records the last poll dropped below the position (one line per poll) and
    /// returns how many (`InputBatch::skipped`).
    fn log_skipped(&mut self) -> u64 {
        let s = std::mem::take(&mut self.cursor.skipped);
        if s.count == 0 {
            return 0;
        }
        let next_offset = self.cursor.next.unwrap_or(-1);
        if s.unasked > 0 {
            tracing::warn!(
                partition = self.partition,
                skipped = s.count,
                first = s.first,
                last = s.last,
                next_offset,
                "kafka: the broker sent records below the partition's next offset unasked; dropped as applied already (settle_input_skipped_total)"
            );
        } else {
            tracing::info!(
                partition = self.partition,
                skipped = s.count,
                first = s.first,
                last = s.last,
                next_offset,
                "kafka: records below the partition's next offset read again while rewinding; dropped as applied already (settle_input_skipped_total)"
            );
        }
        s.count
    }
}

/// How long [`KafkaInput::check_log_end`] asks again about a log end below the stored offset
/// before it fails the partition.
const LOG_END_SETTLE: Duration = Duration::from_secs(5);

/// librdkafka refuses a seek while a just-assigned partition has not started fetching.
fn not_started(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(RDKafkaErrorCode::State | RDKafkaErrorCode::PreviousInProgress)
    )
}

impl PartitionInput for KafkaInput {
    fn topic(&self) -> &str {
        &self.topic
    }

    fn partition(&self) -> i32 {
        self.partition
    }

    async fn seek(&mut self, next_offset: i64) -> Result<(), Error> {
        self.seek_fetcher(next_offset).await?;
        self.check_log_end(next_offset).await?;
        tracing::debug!(
            partition = self.partition,
            next_offset,
            "kafka: input positioned"
        );
        self.cursor = Cursor::at(next_offset);
        Ok(())
    }

    async fn poll(&mut self, max: usize, wait: Duration) -> Result<InputBatch, Error> {
        if let Some(e) = self.cursor.failed.take() {
            return Err(e);
        }
        if !self.cursor.position_known {
            self.learn_position().await;
        }
        let max = max.max(1);
        let mut records = Vec::new();
        let was_caught_up = self.cursor.eof;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            self.drain(&mut records, max);
            if self.cursor.rewind_wanted && records.is_empty() {
                self.rewind().await?;
                continue;
            }
            // Return with records, on a fatal error, or when the partition just reached its
            // end (so the runtime moves partition time to the wall clock at once).
            let c = &self.cursor;
            if !records.is_empty() || c.failed.is_some() || (c.eof && !was_caught_up) {
                break;
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                break;
            }
            // Woken by the queue turning non-empty; re-checked after `QUEUE_RECHECK` anyway
            // (librdkafka signals only the empty → non-empty transition).
            let _ =
                tokio::time::timeout_at(deadline.min(now + QUEUE_RECHECK), self.arrived.notified())
                    .await;
        }
        if records.is_empty() {
            if let Some(e) = self.cursor.failed.take() {
                return Err(e);
            }
        }
        let caught_up = records.len() < max && self.caught_up();
        if records.is_empty() && !caught_up && self.cursor.stalled() {
            self.rewind().await?;
        }
        let skipped = self.log_skipped();
        Ok(InputBatch {
            records,
            caught_up,
            skipped,
        })
    }

    fn lag(&self) -> Option<u64> {
        let high = self.cached_high_watermark().or(self.cursor.high)?;
        Some(high.saturating_sub(self.cursor.next?).max(0) as u64)
    }

    async fn commit(&mut self, next_offset: i64) -> Result<(), Error> {
        let tpl = self.one_partition(Offset::Offset(next_offset))?;
        self.consumer
            .commit(&tpl, CommitMode::Async)
            .map_err(|e| classify(&e))?;
        lock(&self.consumer.context().committed).insert(self.partition, next_offset);
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Sink

/// Context of the producer: logging and [`Health`] only.
struct ProducerContext {
    health: Arc<Health>,
}

impl ClientContext for ProducerContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        log_line(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.health.failed(&error, reason);
    }
}

/// [`Sink`] over one idempotent producer (`enable.idempotence=true`, `acks=all`): ready
/// records go to their message's topic (the tier's topic) keyed by session key with header
/// `settle-emission-id`; dead letters go to `dead-letter-topic` with the original key,
/// payload and timestamp and the `settle-dlq-*` headers. Cheap to clone (one producer).
#[derive(Clone)]
pub struct KafkaSink {
    producer: FutureProducer<ProducerContext>,
    health: Arc<Health>,
    input_topic: Arc<str>,
    dead_letter_topic: Arc<str>,
    /// `instance-id` (resolved), header `settle-instance`.
    instance: Arc<str>,
    changelog: Option<changelog::KafkaChangelog>,
    /// Exactly-once mode: the partitions' transaction writers come from here.
    eos: Option<Arc<txn::Eos>>,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("input_topic", &self.input_topic)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// Creates the producer. Connecting happens in the background.
    ///
    /// Errors: [`Error::Fatal`] when librdkafka rejects the configuration.
    pub fn new(config: &KafkaConfig) -> Result<Self, Error> {
        let health = Arc::new(Health::new("producer"));
        let producer = config
            .client_config(Role::Producer)
            .create_with_context(ProducerContext {
                health: Arc::clone(&health),
            })
            .map_err(|e| Error::Fatal {
                transport: TRANSPORT,
                reason: format!("cannot create the Kafka producer: {e}"),
            })?;
        let changelog = changelog::KafkaChangelog::new(config, Arc::clone(&health))?;
        let instance: Arc<str> = config.instance_id().into();
        let eos = (config.processing_guarantee == ProcessingGuarantee::ExactlyOnce).then(|| {
            Arc::new(txn::Eos::new(
                config,
                Arc::clone(&health),
                Arc::clone(&instance),
            ))
        });
        Ok(KafkaSink {
            producer,
            health,
            input_topic: config.input_topic.as_str().into(),
            dead_letter_topic: config.dead_letter_topic.as_str().into(),
            instance,
            changelog,
            eos,
        })
    }

    /// Exactly-once mode: the transactions commit the input offsets of `source`'s consumer
    /// group. Call before the runtime runs (`run_until` does).
    pub fn attach_group(&self, source: &KafkaSource) {
        if let Some(eos) = &self.eos {
            eos.attach_group(source.consumer.clone());
        }
    }

    /// Sends one record and waits for its delivery report.
    async fn deliver(&self, record: FutureRecord<'_, [u8], [u8]>) -> Result<(), Error> {
        match self.producer.send(record, QUEUE_TIMEOUT).await {
            Ok(_) => {
                self.health.healthy();
                Ok(())
            }
            Err((e, _)) => {
                self.health.failed(&e, "delivery");
                Err(classify(&e))
            }
        }
    }
}

/// The Kafka record of a ready message: key = session key, value = the JSON record, headers
/// `settle-emission-id`, `settle-instance` (= `instance`) and, when the message has one,
/// `settle-partition` (the input partition).
fn ready_record<'m>(message: &'m ReadyMessage, instance: &'m str) -> FutureRecord<'m, [u8], [u8]> {
    let mut headers = OwnedHeaders::new_with_capacity(3)
        .insert(Header {
            key: EMISSION_ID_HEADER,
            value: Some(message.emission_id.as_bytes()),
        })
        .insert(Header {
            key: INSTANCE_HEADER,
            value: Some(instance.as_bytes()),
        });
    if let Some(p) = message.partition {
        headers = headers.insert(Header {
            key: PARTITION_HEADER,
            value: Some(p.to_string().as_bytes()),
        });
    }
    FutureRecord::to(&message.topic)
        .key(message.key.as_bytes())
        .payload(message.payload.as_slice())
        .headers(headers)
}

impl Sink for KafkaSink {
    async fn publish(&self, message: ReadyMessage) -> Result<(), Error> {
        self.deliver(ready_record(&message, &self.instance)).await
    }

    fn changelog(&self) -> Option<&str> {
        self.changelog
            .as_ref()
            .map(changelog::KafkaChangelog::topic)
    }

    fn transactions(
        &self,
        partition: i32,
    ) -> BoxFuture<'_, Result<Option<Box<dyn super::TxnWriter>>, Error>> {
        Box::pin(async move {
            match &self.eos {
                Some(eos) => Ok(Some(
                    Box::new(eos.writer(partition).await?) as Box<dyn super::TxnWriter>
                )),
                None => Ok(None),
            }
        })
    }

    fn append_changes(
        &self,
        partition: i32,
        changes: &[Change],
    ) -> Result<BoxFuture<'static, Result<i64, Error>>, Error> {
        match &self.changelog {
            Some(c) => c.append(partition, changes),
            None => Err(Error::Fatal {
                transport: TRANSPORT,
                reason: "kafka.changelog-topic is \"\": no changelog".into(),
            }),
        }
    }

    fn read_changelog(
        &self,
        partition: i32,
        from: i64,
    ) -> BoxFuture<'_, Result<Box<dyn ChangelogReader>, Error>> {
        Box::pin(async move {
            match &self.changelog {
                Some(c) => c.read(partition, from).await,
                None => Err(Error::Fatal {
                    transport: TRANSPORT,
                    reason: "kafka.changelog-topic is \"\": no changelog".into(),
                }),
            }
        })
    }

    async fn dead_letter(&self, record: &InputRecord, reason: &str) -> Result<(), Error> {
        let partition = record.partition.to_string();
        let offset = record.offset.to_string();
        let headers = OwnedHeaders::new_with_capacity(4)
            .insert(Header {
                key: DLQ_REASON_HEADER,
                value: Some(reason),
            })
            .insert(Header {
                key: DLQ_SOURCE_TOPIC_HEADER,
                value: Some(&*self.input_topic),
            })
            .insert(Header {
                key: DLQ_SOURCE_PARTITION_HEADER,
                value: Some(&partition),
            })
            .insert(Header {
                key: DLQ_SOURCE_OFFSET_HEADER,
                value: Some(&offset),
            });
        let mut out = FutureRecord::to(&self.dead_letter_topic)
            .payload(record.payload.as_slice())
            .timestamp(record.timestamp_ms)
            .headers(headers);
        if let Some(key) = &record.key {
            out = out.key(key.as_slice());
        }
        self.deliver(out).await
    }
}

// ---------------------------------------------------------------------------------------------
// `settle run` on Kafka

/// Runs settle on Kafka until `shutdown` is cancelled: the partition runtime
/// ([`Runtime::run`]) over a [`KafkaSource`] and a [`KafkaSink`], stores under
/// `config.store.data-dir`, the debounce policies of `config`, each emission to its tenant's
/// tier topic and tier changes to the events topic of `tiers` (one router for the process,
/// see `crate::tiers`). Serves the admin endpoints of `config.admin` (`crate::admin`) until
/// the runtime has stopped. Must run inside a tokio runtime.
///
/// Errors: an invalid `[kafka]` section (the message names the key), clients librdkafka
/// rejects, an `admin.listen` address that cannot be bound, or a fatal source error.
/// Partitions that failed are in the summary.
pub async fn run_until(
    config: &Config,
    kafka: &KafkaConfig,
    tiers: &TiersConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<RunSummary> {
    kafka.validate()?;
    let sink = KafkaSink::new(kafka)?;
    let source = KafkaSource::new(kafka)?;
    sink.attach_group(&source);
    let mut wanted = vec![
        ("kafka.input-topic", kafka.input_topic.clone()),
        ("kafka.dead-letter-topic", kafka.dead_letter_topic.clone()),
        ("tiers.events-topic", tiers.events_topic.clone()),
    ];
    if let Some(c) = kafka.changelog() {
        wanted.push(("kafka.changelog-topic", c));
    }
    wanted.extend(
        tiers
            .tiers
            .iter()
            .map(|t| ("tiers.tier.topic", t.topic.clone())),
    );
    warn_missing_topics(kafka, wanted).await;
    let mut options = RuntimeOptions::from_config(config);
    options.tiers = tiers.clone();
    options.lease = Some(kafka.lease());
    let runtime = Runtime::new(
        Engine::new(config.policy_table()),
        sink,
        SystemClock,
        options,
    )?;
    let admin = crate::admin::AdminServer::start_for(&config.admin, &runtime).await?;
    let watch = tokio::spawn(crate::runtime::progress::watch(
        runtime.status(),
        shutdown.clone(),
    ));
    let summary = runtime.run(source, shutdown).await;
    watch.abort();
    if let Some(admin) = admin {
        admin.stop().await;
    }
    Ok(summary?)
}

/// Warns once at start about each configured topic the cluster does not have (`wanted`:
/// config key, topic). Nothing fails here: a missing topic is retried with backoff where it
/// is used (module docs, "Errors"), so creating it later un-blocks settle without a restart.
/// An unreachable cluster is only logged at debug level (the clients report it).
async fn warn_missing_topics(kafka: &KafkaConfig, wanted: Vec<(&'static str, String)>) {
    let config = kafka.client_config(Role::Consumer);
    let listed = tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = config.create()?;
        let metadata = client.fetch_metadata(None, CALL_TIMEOUT)?;
        Ok::<_, KafkaError>(
            metadata
                .topics()
                .iter()
                .filter(|t| t.error().is_none())
                .map(|t| t.name().to_owned())
                .collect::<std::collections::BTreeSet<String>>(),
        )
    })
    .await;
    let topics = match listed {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "kafka: cannot list topics at start");
            return;
        }
        Err(e) => {
            tracing::debug!(error = %e, "kafka: topic listing task failed");
            return;
        }
    };
    for (key, topic) in wanted {
        if !topics.contains(&topic) {
            tracing::warn!(
                topic = %topic,
                key,
                "kafka: topic does not exist; what settle reads or writes there waits (retried with backoff) until it is created (scripts/kafka.sh up creates the default topics)"
            );
        }
    }
}

/// `settle run` on Kafka: builds a tokio runtime, runs [`run_until`] until SIGINT/SIGTERM
/// (a second signal exits at once), then reports failed partitions.
///
/// Errors: as [`run_until`]; also when a partition failed (the message names it and why).
pub fn run(config: &Config, kafka: &KafkaConfig, tiers: &TiersConfig) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    rt.block_on(async {
        let shutdown = CancellationToken::new();
        let signals =
            shutdown_on_signals(shutdown.clone()).context("cannot install signal handlers")?;
        let summary = run_until(config, kafka, tiers, shutdown).await;
        signals.abort();
        let summary = summary?;
        if let Some((p, reason)) = summary.failed().first() {
            anyhow::bail!("partition {p} failed: {reason}");
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_outage_is_one_kind_of_trouble() {
        let global = |c| KafkaError::Global(c);
        let down = trouble_kind(&global(RDKafkaErrorCode::BrokerTransportFailure));
        assert_eq!(
            trouble_kind(&global(RDKafkaErrorCode::AllBrokersDown)),
            down
        );
        assert_eq!(
            trouble_kind(&KafkaError::MessageProduction(
                RDKafkaErrorCode::MessageTimedOut
            )),
            down
        );
        assert_ne!(
            trouble_kind(&global(RDKafkaErrorCode::TopicAuthorizationFailed)),
            down
        );
        let h = Health::new("test");
        h.failed(&global(RDKafkaErrorCode::AllBrokersDown), "");
        assert!(h.is(UNREACHABLE));
        h.healthy();
        assert!(!h.is(UNREACHABLE));
        assert_eq!(lock(&h.trouble).as_deref(), None);
    }

    #[test]
    fn retryable_or_fatal() {
        let produce = |c| KafkaError::MessageProduction(c);
        assert!(classify(&produce(RDKafkaErrorCode::MessageTimedOut)).is_retryable());
        // Missing topics and authorization can be fixed while settle runs: retried.
        assert!(classify(&produce(RDKafkaErrorCode::UnknownTopicOrPartition)).is_retryable());
        assert!(classify(&produce(RDKafkaErrorCode::TopicAuthorizationFailed)).is_retryable());
        assert!(!classify(&produce(RDKafkaErrorCode::MessageSizeTooLarge)).is_retryable());
        assert!(!classify(&KafkaError::MessageConsumptionFatal(
            RDKafkaErrorCode::Fatal
        ))
        .is_retryable());
    }
}
