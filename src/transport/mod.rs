//! Transports: where upload records come from ([`Source`], [`PartitionInput`]) and where ready
//! records and dead letters go ([`Sink`]). Kafka (consumer group), NATS JetStream (static
//! assignment, one durable pull consumer per partition) and the in-memory transport
//! ([`memory`]) implement the same three traits, so the runtime has one code path.
//!
//! # Shape
//!
//! * A [`Source`] yields assignment changes ([`SourceEvent`]): `Assigned` hands over one
//!   [`PartitionInput`] per newly owned partition; `Revoked` names partitions taken away and
//!   carries a `done` sender. The runtime stops each revoked partition's task (it finishes its
//!   batch, flushes its outbox, writes its store and drops its input) and only then sends
//!   `done`. A Kafka source blocks its rebalance callback on `done`, which gives the ordering
//!   the consumer group needs: nothing of a revoked partition is written after the callback
//!   returns. NATS sends one `Assigned` at start (static assignment) and never revokes; the
//!   memory source does the same unless a test revokes partitions.
//! * A [`PartitionInput`] is owned by exactly one partition task: `seek` to the stored next
//!   offset at start, `poll` batches, `commit` the next offset once a batch is durable in the
//!   partition store (Kafka: commit to the group; NATS: ack every message below it; memory:
//!   the group's committed offset). The store, not the broker, is the authority on what was
//!   applied; a broker commit only lets the broker forget.
//! * A [`Sink`] is cloned into each partition's outbox publisher. `publish` resolves when the
//!   broker acknowledged the record (Kafka delivery report, JetStream publish ack); only then
//!   is the outbox entry deleted. `dead_letter` sends a record that could not be decoded;
//!   `publish_tier_change` sends a tier change to the tier-events topic (by default through
//!   `publish`).
//!
//! # Offsets
//!
//! An offset is an `i64` position in one partition (Kafka offset, JetStream stream sequence,
//! memory log index). Everywhere in this API an offset passed to `seek`/`commit` and stored
//! by the runtime is the **next offset to consume**: "everything below it is applied" (the
//! Kafka convention).
//!
//! # Why `impl Future` in traits (static dispatch)
//!
//! The transport is chosen once at start and every partition task is spawned for that one
//! type, so the runtime is generic over `S: Source, K: Sink` and nothing is boxed on the hot
//! path (one `poll` per batch, one `publish` per emission). Methods are declared as
//! `fn … -> impl Future<Output = …> + Send` (stable return-position `impl Trait` in traits)
//! rather than `async fn`, because the partition task is `tokio::spawn`ed and so every
//! future it awaits must be `Send`; implementations still write `async fn`. The price is
//! that the traits are not object-safe; no caller needs `dyn`.
//!
//! # Cancellation
//!
//! The runtime drops an unfinished [`Source::next_event`] or [`PartitionInput::poll`] future
//! when it shuts down or stops a partition. Implementations must not lose anything that the
//! next owner needs when that happens; since a new owner seeks to the stored offset, losing
//! fetched-but-unreturned records is fine.

pub mod kafka;
pub mod memory;
pub mod nats;

pub use crate::codec::KeyRule;
use crate::store::Change;
use crate::tiers::TierChange;
use bytes::Bytes;
use futures::future::BoxFuture;
use std::future::Future;
use std::time::Duration;
use tokio::sync::oneshot;

/// One record read from a partition (an upload, not yet decoded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputRecord {
    /// Partition it was read from.
    pub partition: i32,
    /// Its offset in that partition.
    pub offset: i64,
    /// Record key (`tenant/session` for a well-formed upload), if the record has one.
    /// Shared bytes: a transport that already holds the record in a shared buffer (the
    /// memory broker's log, a NATS message) hands it over without a copy.
    pub key: Option<Bytes>,
    /// Record value (the upload's JSON object for a well-formed upload); shared like `key`.
    pub payload: Bytes,
    /// Record timestamp, ms since the Unix epoch (broker log-append time recommended,
    /// SEMANTICS §3; JetStream: the message timestamp).
    pub timestamp_ms: i64,
}

/// What one [`PartitionInput::poll`] returned.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InputBatch {
    /// Records in offset order, at most the `max` asked for; may be empty.
    pub records: Vec<InputRecord>,
    /// True when, after these records, the partition had nothing more to read (consumer lag
    /// 0: Kafka high watermark / partition EOF, JetStream pending count 0, memory log end).
    /// Decides the partition clock (SEMANTICS §3): event time while behind, wall clock when
    /// caught up.
    pub caught_up: bool,
    /// Records the transport read during this poll and dropped because they lie below the
    /// partition's next offset (already applied: read again while the fetcher was sent back,
    /// or redelivered). Each drop is also logged by the transport; the runtime counts them in
    /// `settle_input_skipped_total`, so no record is ever left out unseen.
    pub skipped: u64,
}

/// One ready record to publish (SEMANTICS §2 output record, already encoded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadyMessage {
    /// Output topic (Kafka topic / NATS subject), chosen by the tenant's tier.
    pub topic: String,
    /// Tier name written in the record.
    pub tier: String,
    /// Record key: the session key `tenant/session`.
    pub key: String,
    /// `tenant/session/generation`, also sent as header `settle-emission-id`.
    pub emission_id: String,
    /// The JSON record (`codec::encode_ready`).
    pub payload: Vec<u8>,
    /// The input partition whose task emitted it (Kafka header `settle-partition`);
    /// `None` for records that belong to no partition (tier changes).
    pub partition: Option<i32>,
}

/// The record of one tier change on the tier-events topic `topic` (SEMANTICS §5): key = the
/// tenant, tier = the tier moved to, emission id = [`TierChange::event_id`], payload =
/// [`TierChange::to_json`].
pub fn tier_change_message(topic: &str, change: &TierChange) -> ReadyMessage {
    ReadyMessage {
        topic: topic.to_owned(),
        tier: change.to.clone(),
        key: change.tenant.clone(),
        emission_id: change.event_id(),
        payload: change.to_json(),
        partition: None,
    }
}

/// An assignment change reported by a [`Source`].
#[derive(Debug)]
pub enum SourceEvent<I> {
    /// These partitions are now owned by this process; one input handle each.
    Assigned(Vec<I>),
    /// These partitions are taken away. The runtime stops their tasks (batch finished,
    /// outbox flushed or deadline reached, store written and closed) and then sends on
    /// `done`. A dropped `done` means the runtime is gone.
    Revoked {
        /// Partition numbers revoked.
        partitions: Vec<i32>,
        /// The assignment was lost (Kafka: session timeout, fenced member), not handed back:
        /// another member may own the partitions already, so the runtime fences them at
        /// once (nothing more is published or appended for them) and does not drain
        /// their outbox.
        lost: bool,
        /// Signalled once every revoked partition has stopped.
        done: oneshot::Sender<()>,
    },
}

/// A transport failure. Each variant says whether to retry (STYLE §5).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The broker cannot be reached or refused for now (timeout, leader election, sink
    /// outage): retry with backoff. Nothing was lost.
    #[error("{transport} unavailable: {reason}")]
    Unavailable {
        /// `kafka`, `nats` or `memory`.
        transport: &'static str,
        /// What the client said.
        reason: String,
    },
    /// The operation can never succeed as asked (unknown topic, authorization, record too
    /// large, partition no longer owned): the partition stops.
    #[error("{transport}: {reason}")]
    Fatal {
        /// `kafka`, `nats` or `memory`.
        transport: &'static str,
        /// What the client said.
        reason: String,
    },
    /// Another process wrote the partition's changelog after this one last did (NATS: the
    /// log refused an append with a wrong expected last sequence, `transport::nats::changelog`):
    /// this process no longer owns the partition and stops publishing, appending and acking
    /// for it (SEMANTICS §6 "Single writer"). Not retried.
    #[error("{transport}: partition fenced: {reason}")]
    Fenced {
        /// `nats` (or `memory` in tests).
        transport: &'static str,
        /// Which log refused what, and the likely cause.
        reason: String,
    },
}

impl Error {
    /// True for [`Error::Unavailable`]: back off and try again.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }

    /// The [`Error::Fatal`] of [`PartitionInput::seek`] when partition `partition` of `topic`
    /// ends at offset `end` (the next offset the broker would append) below `next`, the next
    /// offset its store holds: this log cannot be the one the store applied, because the
    /// topic or stream started over (deleted and re-created, or a broker that lost its log).
    /// Reading on would skip every record below `next` without an emission, so the partition
    /// stops instead, and the message names both offsets and what the operator does about it
    /// (README "Operate").
    pub fn started_over(
        transport: &'static str,
        topic: &str,
        partition: i32,
        end: i64,
        next: i64,
    ) -> Self {
        Error::Fatal {
            transport,
            reason: format!(
                "{} Reading on would skip every record below {next}. Stop settle and wipe this \
                 partition's store directory (<store.data-dir>/{topic}/{partition}) to start it \
                 afresh, or restore it from a changelog of this same {topic}",
                behind("input", topic, partition, end, next)
            ),
        }
    }

    /// The [`Error::Fatal`] of [`Sink::read_changelog`] when changelog partition `partition`
    /// of `changelog` ends at offset `end` below `checkpoint`, the changelog offset the
    /// partition's store says it appended up to: the changelog started over (deleted and
    /// re-created, or a broker that lost its log), so restoring from it would wait forever
    /// for records that are gone. The partition stops with what to do (README "Operate").
    pub fn changelog_started_over(
        transport: &'static str,
        changelog: &str,
        partition: i32,
        end: i64,
        checkpoint: i64,
    ) -> Self {
        Error::Fatal {
            transport,
            reason: format!(
                "{} A restore would wait for records that are gone. Stop settle and wipe this \
                 partition's store directory (<store.data-dir>/<input topic>/{partition}) to \
                 start it afresh: settle then restores it from what {changelog} holds now",
                behind("changelog", changelog, partition, end, checkpoint)
            ),
        }
    }
}

/// The first sentence of [`Error::started_over`] and [`Error::changelog_started_over`]: the
/// `log` (`input`, `changelog`) `topic` partition ends at `end` below the stored `next`.
fn behind(log: &str, topic: &str, partition: i32, end: i64, next: i64) -> String {
    format!(
        "{log} {topic} partition {partition} ends at offset {end}, below the next offset {next} \
         stored for it: {topic} started over (deleted and re-created, or the broker lost its \
         log)."
    )
}

/// Where partitions come from: a consumer group (Kafka), a static set of durable consumers
/// (NATS) or the memory log. Owned by the runtime's supervisor task.
pub trait Source: Send + 'static {
    /// The per-partition input handle this source hands out.
    type Input: PartitionInput;

    /// The next assignment change. `Ok(None)`: the source has ended and will assign nothing
    /// more (the runtime keeps running what it owns). Must be cancel-safe: the runtime
    /// drops this future on shutdown.
    ///
    /// Errors: [`Error::Unavailable`] (the runtime retries after a backoff),
    /// [`Error::Fatal`] (the runtime stops every partition and returns the error).
    fn next_event(
        &mut self,
    ) -> impl Future<Output = Result<Option<SourceEvent<Self::Input>>, Error>> + Send;
}

/// The input of one owned partition, used by that partition's task only.
pub trait PartitionInput: Send + 'static {
    /// Input topic (or stream) name; the partition store lives at `<data-dir>/<topic>/<partition>`.
    fn topic(&self) -> &str;

    /// Partition number.
    fn partition(&self) -> i32;

    /// Positions the input so the next `poll` returns the record at `next_offset` first.
    /// Called once at start with the offset stored in the partition store, if any; without a
    /// call the input starts where the transport says (group offset, reset policy).
    ///
    /// Errors: as for `poll`.
    fn seek(&mut self, next_offset: i64) -> impl Future<Output = Result<(), Error>> + Send;

    /// Up to `max` records in offset order, waiting at most `wait` for the first one; an
    /// empty batch after `wait` is normal. Records are handed out once: the next call
    /// continues after them (unless `seek` is called).
    ///
    /// Errors: [`Error::Unavailable`] (retried by the partition task after a backoff),
    /// [`Error::Fatal`] (the partition stops).
    fn poll(
        &mut self,
        max: usize,
        wait: Duration,
    ) -> impl Future<Output = Result<InputBatch, Error>> + Send;

    /// Tells the broker that every record below `next_offset` is durable in the partition
    /// store (Kafka: commit `next_offset` to the group; NATS: ack each message below it).
    ///
    /// Errors: [`Error::Unavailable`] (logged; the next commit covers it),
    /// [`Error::Fatal`] (logged; the store stays the authority on what was applied).
    fn commit(&mut self, next_offset: i64) -> impl Future<Output = Result<(), Error>> + Send;

    /// How often the partition task commits while records flow (it commits at once when
    /// caught up, and at stop): `None` (the default) for the runtime's
    /// `runtime::partition::COMMIT_INTERVAL` (500 ms: a commit is a broker round trip on
    /// Kafka and NATS). The memory transport commits more often: its commit is a map insert,
    /// and it drops what a commit covers from memory ([`memory::MemoryBroker::bound_load`]).
    fn commit_interval(&self) -> Option<std::time::Duration> {
        None
    }

    /// Consumer lag as last learned, in records: how many records the broker holds after the
    /// last one `poll` handed out (Kafka: the high watermark librdkafka cached from its last
    /// fetch response minus the position; JetStream: the pending count of the last fetch;
    /// memory: log end minus position). Sends no request. `None` (the default) where the
    /// transport does not know it. Shown by the admin endpoint and the
    /// `settle_consumer_lag_records` metric.
    fn lag(&self) -> Option<u64> {
        None
    }

    /// The partition a record with this key belongs on, where the transport's own
    /// partitioner fixes it (NATS: [`nats::partition_for_key`], the hash settle's producers
    /// and the README's publishing recipe use); `None` (the default) where producers choose
    /// the partition (Kafka: the producer's partitioner, which settle does not know). The
    /// partition task dead-letters a record whose key belongs on another partition as
    /// `wrong_partition` (SEMANTICS §2): its session's other uploads live there.
    fn key_partition(&self, _key: &[u8]) -> Option<i32> {
        None
    }

    /// Whether a record must carry a record key ([`KeyRule::Required`], the default: Kafka,
    /// where the key decides the partition) or may leave it out ([`KeyRule::Optional`]:
    /// NATS, where the session key is the body's `tenant/session` and its subject's
    /// partition is checked by [`PartitionInput::key_partition`]; SEMANTICS §2).
    fn key_rule(&self) -> KeyRule {
        KeyRule::Required
    }
}

/// Where ready records and dead letters go. Cheap to clone (each partition's outbox
/// publisher holds one).
pub trait Sink: Clone + Send + Sync + 'static {
    /// Publishes one ready record; resolves once the broker acknowledged it (Kafka delivery
    /// report, JetStream publish ack). Several publishes may be in flight at once.
    ///
    /// Errors: [`Error::Unavailable`] (the publisher retries the same message after a
    /// backoff; the outbox keeps it meanwhile), [`Error::Fatal`] (the publisher logs it
    /// and keeps retrying after a longer backoff: an emission is never dropped, SEMANTICS §6).
    fn publish(&self, message: ReadyMessage) -> impl Future<Output = Result<(), Error>> + Send;

    /// Publishes `messages` (ready records of one partition, in outbox order) and resolves
    /// once each is acknowledged or failed, with one result per message in the same order.
    /// A failed message is retried by the publisher like a failed [`Sink::publish`]; the
    /// others are acknowledged. The default puts every message in flight at once through
    /// [`Sink::publish`] (Kafka, NATS: the client batches on the wire); the memory sink
    /// overrides it to append the whole batch under one lock with one file write.
    ///
    /// Errors: per message, as for [`Sink::publish`].
    fn publish_batch(
        &self,
        messages: Vec<ReadyMessage>,
    ) -> impl Future<Output = Vec<Result<(), Error>>> + Send {
        futures::future::join_all(messages.into_iter().map(|m| self.publish(m)))
    }

    /// Publishes one tier change (SEMANTICS §5) to `topic` (`tiers.events-topic`) and
    /// resolves once acknowledged. The default sends [`tier_change_message`] through
    /// [`Sink::publish`]: record key = the tenant, value = [`TierChange::to_json`], and (Kafka)
    /// header `settle-emission-id` = [`TierChange::event_id`]. The memory sink overrides it to
    /// keep tier events apart from ready records.
    ///
    /// Errors: as for `publish` (the caller retries; tier events are soft state, see
    /// `runtime::tier_events`).
    fn publish_tier_change(
        &self,
        topic: &str,
        change: &TierChange,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        self.publish(tier_change_message(topic, change))
    }

    /// The changelog topic (stream) this sink appends partition store writes to, or `None`
    /// (the default) when the transport has no changelog: the runtime then neither records
    /// nor restores, and a partition's pending rounds stay in the store of the instance that
    /// owned it (ARCHITECTURE "changelog"; SEMANTICS §6 "Single writer").
    fn changelog(&self) -> Option<&str> {
        None
    }

    /// Whether the changelog is also the partition's ownership fence (NATS, where ownership is
    /// static and no group protocol revokes a partition): an append fails with
    /// [`Error::Fenced`] once another process appended to the partition's changelog. The
    /// runtime then hands an emission to the publisher, and commits an input offset, only
    /// after the changelog append holding it was acknowledged, and a restore ends with a
    /// claim append (`runtime::restore`). Default `false` (Kafka: the consumer group and
    /// the liveness lease fence).
    fn fences_by_changelog(&self) -> bool {
        false
    }

    /// Hands `changes` (writes of the store of input partition `partition`, in write order)
    /// to changelog partition `partition`, after every earlier append of this process for
    /// that partition, and returns at once. The returned future resolves once every one of
    /// them is acknowledged, with the changelog offset after the last one. Records of one
    /// partition are stored in append order without gaps: if one fails, the later ones fail
    /// too (Kafka: idempotent producer).
    ///
    /// A full producer queue is waited out here (backpressure), so an error is final.
    ///
    /// Errors: [`Error::Fatal`] when there is no changelog or the records can never be
    /// written (the partition stops; its store is restored from the changelog prefix on the
    /// next start), also from the future.
    fn append_changes(
        &self,
        partition: i32,
        changes: &[Change],
    ) -> Result<BoxFuture<'static, Result<i64, Error>>, Error> {
        let _ = (partition, changes);
        Err(Error::Fatal {
            transport: "sink",
            reason: "this transport has no changelog".into(),
        })
    }

    /// Whether the changelog of `partition` should be compacted now by appending the whole
    /// store with [`Sink::append_snapshot`] (NATS: enough appended since the last snapshot,
    /// `nats.changelog-snapshot-kib`). Default `false` (Kafka compacts by key itself).
    fn changelog_snapshot_due(&self, partition: i32) -> bool {
        let _ = partition;
        false
    }

    /// As [`Sink::append_changes`], for `changes` that are the partition's whole store
    /// (`PartitionStore::snapshot_changes`): once acknowledged, the changelog may drop what
    /// lies before them (NATS: purged below the snapshot). Default: an ordinary append.
    ///
    /// Errors: as [`Sink::append_changes`].
    fn append_snapshot(
        &self,
        partition: i32,
        changes: &[Change],
    ) -> Result<BoxFuture<'static, Result<i64, Error>>, Error> {
        self.append_changes(partition, changes)
    }

    /// Opens a reader of changelog partition `partition` from offset `from` up to the end
    /// as of the call (records appended later may or may not be read).
    ///
    /// Errors: [`Error::Unavailable`] (the changelog topic is missing or the broker is down:
    /// retried by the caller), [`Error::Fatal`] (no changelog).
    fn read_changelog(
        &self,
        partition: i32,
        from: i64,
    ) -> BoxFuture<'_, Result<Box<dyn ChangelogReader>, Error>> {
        let _ = (partition, from);
        Box::pin(async {
            Err(Error::Fatal {
                transport: "sink",
                reason: "this transport has no changelog".into(),
            })
        })
    }

    /// Exactly-once mode (Kafka `processing-guarantee = "exactly-once"`): a transaction writer
    /// for input partition `partition`, created when the partition is assigned and before
    /// its store is restored (creating it fences every earlier writer of the partition and
    /// ends their open transaction). `None` (the default): at-least-once, through the outbox
    /// publisher and [`Sink::append_changes`].
    ///
    /// Errors: [`Error::Unavailable`] (retried by the runtime), [`Error::Fatal`].
    fn transactions(
        &self,
        partition: i32,
    ) -> BoxFuture<'_, Result<Option<Box<dyn TxnWriter>>, Error>> {
        let _ = partition;
        Box::pin(async { Ok(None) })
    }

    /// Sends a record that failed decoding to the dead-letter topic with `reason`
    /// (`codec::DecodeError::reason`) and resolves once acknowledged (SEMANTICS §2).
    ///
    /// Errors: as for `publish`.
    fn dead_letter(
        &self,
        record: &InputRecord,
        reason: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send;
}

/// Where the instances of one deployment exchange their tier counts (SEMANTICS §5: a
/// tenant's rate is the deployment's; `tiers::share`): a log that keeps the latest snapshot
/// of each instance, keyed by instance name. Kafka: the compacted `kafka.tier-counts-topic`
/// (`kafka::TierCountsTopic`); NATS: the KV bucket `nats.tier-counts-bucket`
/// (`nats::TierCountsBucket`). The transport moves bytes; the runtime's tier-share task
/// (`runtime::tier_share`) encodes and decides. Optional: without one (memory transport, or
/// the name set to `""`), every instance measures only its own emissions.
pub trait TierCounts: Send + Sync + 'static {
    /// Where the snapshots live (topic or bucket name), for log lines.
    fn name(&self) -> &str;

    /// Stores `snapshot` as the latest of `instance`; resolves once the broker acknowledged it.
    ///
    /// Errors: [`Error::Unavailable`] (the caller skips this snapshot and sends the next one
    /// on time), [`Error::Fatal`] (the caller logs it and goes on without sharing).
    fn publish(&self, instance: &str, snapshot: Vec<u8>) -> BoxFuture<'_, Result<(), Error>>;

    /// The latest snapshot of every instance the log holds now (also of instances long gone:
    /// the caller decides by their time), waiting at most `timeout` for the broker.
    ///
    /// Errors: [`Error::Unavailable`] (the broker did not answer in time: the caller starts
    /// without restored tiers and says so), [`Error::Fatal`].
    fn read_latest(&self, timeout: Duration) -> BoxFuture<'_, Result<Vec<Vec<u8>>, Error>>;

    /// A feed of the snapshots published from now on, by any instance (its own included).
    ///
    /// Errors: as for [`TierCounts::read_latest`].
    fn subscribe(&self) -> BoxFuture<'_, Result<Box<dyn TierCountsFeed>, Error>>;
}

/// Sends operator action records (SEMANTICS §7, `codec::action`) to the input partitions, so
/// that each partition's single writer applies them in order with the uploads, and reads
/// back the audit records every instance publishes. Kafka: the input topic (any partition;
/// the producer sets it) and the audit topic; NATS: the input stream's partition subjects
/// and the audit subject; memory: the broker's log.
pub trait ActionChannel: Send + Sync + 'static {
    /// The input's partition count.
    ///
    /// Errors: [`Error::Unavailable`] (metadata not reachable now).
    fn partitions(&self) -> BoxFuture<'_, Result<i32, Error>>;

    /// The partition whose records hold `key` when the transport decides it (NATS: the
    /// subject's hash); `None` when producers' partitioners decide (Kafka), so that a
    /// session action goes to every partition and the one that holds the key applies it.
    fn key_partition(&self, key: &str) -> Option<i32>;

    /// Appends one record (record key `key`, value `payload`, timestamp `timestamp_ms`
    /// where the broker keeps the producer's) to input partition `partition`; resolves once
    /// the broker acknowledged it.
    ///
    /// Errors: [`Error::Unavailable`], [`Error::Fatal`].
    fn send(
        &self,
        partition: i32,
        key: &str,
        payload: Vec<u8>,
        timestamp_ms: i64,
    ) -> BoxFuture<'_, Result<(), Error>>;

    /// Publishes one audit record (JSON, record key = the request id) to the audit topic.
    ///
    /// Errors: [`Error::Unavailable`], [`Error::Fatal`].
    fn publish_audit(&self, key: &str, payload: Vec<u8>) -> BoxFuture<'_, Result<(), Error>>;

    /// Calls `each` with every audit record (its JSON payload) published from about
    /// `since_ms` (wall clock, ms) on, then with every new one, until the returned future is
    /// dropped. A transport without a shared audit log (memory) returns at once: a single
    /// process sees its own records.
    ///
    /// Errors: the audit log cannot be read (the caller retries after a backoff).
    fn tail_audit(&self, since_ms: i64, each: AuditCallback) -> BoxFuture<'_, Result<(), Error>>;
}

/// What [`ActionChannel::tail_audit`] calls with each audit record's JSON payload.
pub type AuditCallback = Box<dyn Fn(&[u8]) + Send + Sync>;

/// Where the tenant overrides of one deployment live (SEMANTICS §7): a log that keeps the
/// latest value of each tenant, key = tenant, value = the override's JSON
/// (`runtime::overrides::Override`; a removal is a tombstone value that keeps its version).
/// Memory: a map shared by every handle of one [`memory::MemoryBroker`]; NATS: the KV bucket
/// `nats.overrides-bucket` (`nats::OverridesBucket`); Kafka: the compacted topic
/// `<group-id>.overrides` (`kafka::OverridesTopic`). The transport moves bytes; the runtime
/// (`runtime::overrides`) encodes, checks versions and decides.
pub trait OverrideStore: Send + Sync + 'static {
    /// Where the overrides live (bucket or topic name), for log lines and answers.
    fn name(&self) -> &str;

    /// Whether [`OverrideStore::put`] compares the revision (memory, NATS: a write made
    /// against a stale revision is refused by the store itself). `false` (Kafka): every write
    /// is appended, and the log's order decides between two writes of one version (the
    /// runtime takes the first it reads; every instance reads the same order).
    fn compares_revisions(&self) -> bool;

    /// Stores `value` as `tenant`'s latest, if the tenant's latest is at `expected` (its
    /// revision as the feed gave it; 0: the tenant has no value yet) where the store compares
    /// revisions. Resolves once the broker acknowledged the write: this is the commit point.
    /// Returns the new value's revision (memory: a counter; NATS: the KV revision; Kafka: the
    /// record's offset + 1).
    ///
    /// Errors: [`OverrideWriteError::Conflict`] (another write came first: nothing written),
    /// [`OverrideWriteError::Transport`] ([`Error::Unavailable`] when the broker did not
    /// answer: the write may or may not have happened; the feed tells).
    fn put(
        &self,
        tenant: &str,
        value: Vec<u8>,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, OverrideWriteError>>;

    /// A feed of every tenant's latest value as the store holds it now, then
    /// [`OverrideEvent::CaughtUp`], then every value written from then on (by any instance,
    /// this one included), in the store's order.
    ///
    /// Errors: [`Error::Unavailable`] (the caller subscribes again after a backoff),
    /// [`Error::Fatal`].
    fn subscribe(&self) -> BoxFuture<'_, Result<Box<dyn OverrideFeed>, Error>>;
}

/// Why an [`OverrideStore::put`] wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum OverrideWriteError {
    /// The tenant's latest value is not at the expected revision: another write came first.
    #[error(
        "the override was changed by another write (revision {expected} is no longer the latest)"
    )]
    Conflict {
        /// The revision the write expected.
        expected: u64,
    },
    /// The broker refused or did not answer.
    #[error(transparent)]
    Transport(#[from] Error),
}

/// One value of an [`OverrideStore`]: a tenant's latest override JSON at a revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverrideEntry {
    /// The key (the tenant; on NATS the escaped KV key: the value names the tenant).
    pub key: String,
    /// The override's JSON (a tombstone is a JSON value too; empty: removed by hand).
    pub value: Vec<u8>,
    /// The store's revision of this value (see [`OverrideStore::put`]).
    pub revision: u64,
}

/// What an [`OverrideFeed`] yields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OverrideEvent {
    /// A tenant's value.
    Entry(OverrideEntry),
    /// Every value the store held when the feed started was yielded (once per feed).
    CaughtUp,
}

/// The values of an [`OverrideStore`] (see [`OverrideStore::subscribe`]).
pub trait OverrideFeed: Send {
    /// The next event; waits for one.
    ///
    /// Errors: [`Error::Unavailable`] (the caller subscribes again after a backoff),
    /// [`Error::Fatal`].
    fn next(&mut self) -> BoxFuture<'_, Result<OverrideEvent, Error>>;
}

/// The snapshots published after [`TierCounts::subscribe`], in the order the log has them.
pub trait TierCountsFeed: Send {
    /// The next snapshot; waits for one.
    ///
    /// Errors: [`Error::Unavailable`] (the caller subscribes again after a backoff),
    /// [`Error::Fatal`].
    fn next(&mut self) -> BoxFuture<'_, Result<Vec<u8>, Error>>;
}

/// One partition's transactions in exactly-once mode (see [`Sink::transactions`]).
pub trait TxnWriter: Send {
    /// Commits, in ONE transaction: the ready records `messages`, the changelog records
    /// `changes` (to changelog partition = the input partition, in order), and, when given,
    /// the input partition's next offset `next_offset` (to the consumer group). Returns the
    /// changelog offset after the last change, if there were changes. Either all of it is
    /// visible to `read_committed` consumers, or none.
    ///
    /// Errors: [`Error::Fatal`] for every failure (fenced by a newer owner, transaction
    /// aborted, broker refused): the partition stops, and its next owner restores from the
    /// committed changelog.
    fn commit<'a>(
        &'a mut self,
        messages: Vec<ReadyMessage>,
        changes: &'a [Change],
        next_offset: Option<i64>,
    ) -> BoxFuture<'a, Result<Option<i64>, Error>>;
}

/// A reader of one changelog partition (see [`Sink::read_changelog`]), used by a restore.
pub trait ChangelogReader: Send {
    /// The next records `(changelog offset, change)` in offset order, at most `max`; an
    /// empty vector means the end (as of when the reader was opened) is reached.
    ///
    /// Errors: [`Error::Unavailable`] (the caller retries the restore from its checkpoint),
    /// [`Error::Fatal`].
    fn next_chunk(&mut self, max: usize) -> BoxFuture<'_, Result<Vec<(i64, Change)>, Error>>;

    /// The offset after the last record, as the broker last reported it (for progress);
    /// `None` while unknown.
    fn end_hint(&self) -> Option<i64>;

    /// The changelog was compacted past the offset this reader was opened at, tombstones
    /// included (NATS: purged below a snapshot, `transport::nats::changelog` "Compaction"):
    /// a store at that checkpoint may hold keys deleted since, so the restore must wipe it
    /// and read from offset 0 instead. Default `false` (Kafka's compaction keeps tombstones
    /// for `delete.retention.ms`).
    fn restarts_from_snapshot(&self) -> bool {
        false
    }
}

/// Exponential backoff for retryable transport errors: 50 ms doubling up to `max`.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts at 50 ms, capped at `max`.
    pub fn new(max: Duration) -> Self {
        Backoff {
            next: Duration::from_millis(50).min(max),
            max,
        }
    }

    /// The wait before the next attempt (and doubles the one after).
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    /// Back to the first delay after a success.
    pub fn reset(&mut self) {
        self.next = Duration::from_millis(50).min(self.max);
    }
}
