//! The Kafka transport (rdkafka over bundled librdkafka, tokio): a consumer group as the
//! [`Source`], one split partition queue per owned partition as the [`PartitionInput`], and an
//! idempotent producer as the [`Sink`] (ready records to the tier's topic, bad records to the
//! dead-letter topic); the `[kafka]` section itself is `crate::config::kafka`.
//!
//! Files, by concern: [`consumer`] (the group member, its rebalance callbacks and one input
//! per partition; the check at assignment that the partition's log reaches the stored
//! offset), [`producer`] (the sink), `changelog` (changelog producer and restore reader),
//! `txn` (exactly-once transactions and the start-up check that the cluster has them,
//! [`check_transactions`]), [`tier_counts`] (the topic where instances exchange
//! their tier counts), [`overrides`] (the compacted topic of the tenant overrides), [`topics`] (topic checks and the tooling that creates,
//! produces to and reads back topics); this file holds what they share: headers, timeouts,
//! error classification and the logging of each client's health.
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
//! poll), and it counts only once a fetch response of the current position came in (a record
//! or EOF since the assignment or the last seek): librdkafka keeps the cached watermark of an
//! earlier ownership of the partition, too low to prove anything but a backlog. Fetch
//! responses and EOF follow the last record by at most `fetch.wait.max.ms` (100 ms here).
//! Records appended after the last fetch response are unknown until the next one: the
//! inherent race of any consumer, bounded by that same 100 ms.
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
//! * A fetch lists every batch the partition ever stored (in-memory storage keeps them all), so
//!   it costs more by the minute on a long live run: delivery delay grows while the input rate
//!   stays constant (issue 33, BENCHMARKS.md "Soak"). A fetch that yields nothing for a while
//!   is therefore not rewound once records came in order ([`KafkaInput`] docs).
//! * Fetches seem to be held for the whole `fetch.wait.max.ms` even when records arrive:
//!   records of a live partition reach settle up to that long after they were produced
//!   (lower it in `[kafka.properties]` for lower latency of `leading`/`complete`/`final`).
//! * The group coordinator goes through a few extra generations per rebalance; a short
//!   `session.timeout.ms` (6 s) can evict a member that is joining. The default (45 s) is fine.

use super::Error;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub mod actions;
mod changelog;
pub mod consumer;
pub mod overrides;
pub mod producer;
pub mod tier_counts;
pub mod topics;
mod txn;

pub use crate::config::kafka::{KafkaConfig, KafkaConfigError, ProcessingGuarantee, Role};
pub use actions::KafkaActions;
pub use consumer::{KafkaInput, KafkaSource};
pub use overrides::OverridesTopic;
pub use producer::KafkaSink;
pub use tier_counts::TierCountsTopic;
pub use topics::{
    committed_offsets, create_topics, partition_count, produce_all, read_topic,
    warn_missing_topics, Delivered, OutRecord, TopicRecord,
};
pub use txn::{check_transactions, TransactionsChecked, CRASH_BEFORE_COMMIT_ENV, TRANSACTION_APIS};

use consumer::GroupConsumer;
use producer::{ready_record, ProducerContext};

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

/// The high watermark `client` cached from its last fetch response for `partition` of
/// `topic` (no request is sent); `None` before the first one. Not ListOffsets: tansu 0.6
/// answers "latest" with the newest batch's base offset + 1.
fn cached_high_watermark<C: ClientContext>(
    client: &rdkafka::client::Client<C>,
    topic: &std::ffi::CStr,
    partition: i32,
) -> Option<i64> {
    let (mut low, mut high) = (-1_i64, -1_i64);
    // SAFETY: the client pointer is live (`client` is borrowed), `topic` is a NUL-terminated
    // string that outlives the call, and librdkafka only writes the two out-parameters
    // (under its own partition lock).
    let err = unsafe {
        rdkafka::bindings::rd_kafka_get_watermark_offsets(
            client.native_ptr(),
            topic.as_ptr(),
            partition,
            &mut low,
            &mut high,
        )
    };
    (err == rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0).then_some(high)
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
