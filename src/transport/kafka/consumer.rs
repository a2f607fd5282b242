//! The consumer-group member on the input topic ([`KafkaSource`]) and one [`KafkaInput`] per
//! owned partition (its queue split off the group's): rebalance callbacks, positions,
//! rewinds on brokers that fetch whole batches only, the caught-up evidence, offset commits,
//! and the check at assignment that the partition's log reaches the offset its store holds
//! (module docs of `crate::transport::kafka`).

use super::{cached_high_watermark, log_line, KafkaConfig, UNREACHABLE};
use super::{
    classify, lock, wall_ms, Health, Role, CALL_TIMEOUT, QUEUE_RECHECK, SEEK_START_WAIT, TRANSPORT,
};
use crate::transport::{Error, InputBatch, InputRecord, PartitionInput, Source, SourceEvent};
use bytes::Bytes;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, Notify};

type Events = mpsc::UnboundedSender<Result<SourceEvent<KafkaInput>, Error>>;

/// The consumer-group member.
pub(super) type GroupConsumer = BaseConsumer<GroupContext>;

/// The consumer's context: turns rebalances into [`SourceEvent`]s (module docs) and keeps
/// what the final commits need.
pub(super) struct GroupContext {
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

    /// Every error event passes here first, partition EOF included (not a trouble). A fatal
    /// error (librdkafka cannot go on with this consumer: say, `FENCED_INSTANCE_ID`, another
    /// live member joined with this `kafka.group-instance-id`) stops the source: `settle run`
    /// exits with it rather than keep publishing for partitions it may no longer own.
    fn error(&self, error: KafkaError, reason: &str) {
        let code = error.rdkafka_error_code();
        if code == Some(RDKafkaErrorCode::PartitionEOF) {
            return;
        }
        if matches!(
            code,
            Some(RDKafkaErrorCode::Fatal | RDKafkaErrorCode::FencedInstanceId)
        ) {
            let hint = if reason.contains("FENCED_INSTANCE_ID")
                || code == Some(RDKafkaErrorCode::FencedInstanceId)
            {
                " (static membership: another instance joined the group with the same kafka.group-instance-id; give each instance its own)"
            } else {
                ""
            };
            tracing::error!(member = self.member, error = %error, reason, "kafka: fatal consumer error{hint}");
            let _ = self.events.send(Err(Error::Fatal {
                transport: TRANSPORT,
                reason: format!("consumer: {reason}{hint}"),
            }));
        }
        self.health.failed(&error, reason);
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
    pub(super) consumer: Weak<GroupConsumer>,
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

/// A fetch that is behind but yields nothing for this long is rewound (see [`KafkaInput`]),
/// unless the fetcher is known to be at a batch boundary ([`Cursor::aligned`]).
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
    /// A fetch response for the fetcher's current position arrived (a record or partition
    /// EOF came out of the queue since the last seek or the assignment). librdkafka keeps a
    /// partition's cached high watermark across unassign, assign and seek, so before that
    /// the cached one may come from an earlier ownership of the partition: a lower bound of
    /// the log end that still proves records wait ([`Cursor::behind`]) but can never prove
    /// the partition caught up (CI 2026-12-06: an instance given back a partition it had
    /// owned 13 s earlier took its old watermark for the end, moved partition time to the
    /// wall clock before reading the backlog and ended a round early).
    high_fresh: bool,
    /// When the position last moved (record handed out, seek, rewind).
    progress_at: Option<Instant>,
    /// The fetcher must be sent back before the position (gap or stall seen).
    rewind_wanted: bool,
    /// The record at the position arrived in order since the fetcher was last sent
    /// somewhere (seek, rewind, committed offset): librdkafka fetches on from the end of the
    /// batch it came in, a batch boundary, so every broker returns the batch holding the
    /// position and a fetch that yields nothing is a slow broker, not a misplaced fetcher:
    /// no stall rewind then (it would drop the fetch in flight and send the broker back to
    /// records already applied, making a slow broker slower).
    aligned: bool,
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
                self.high_fresh = true;
                let offset = m.offset();
                if !self.accept(m.partition(), offset) {
                    return;
                }
                health.healthy();
                out.push(InputRecord {
                    partition: m.partition(),
                    offset,
                    key: m.key().map(Bytes::copy_from_slice),
                    payload: m.payload().map(Bytes::copy_from_slice).unwrap_or_default(),
                    timestamp_ms: m.timestamp().to_millis().unwrap_or_else(wall_ms),
                });
            }
            Err(KafkaError::PartitionEOF(_)) => {
                self.high_fresh = true;
                self.eof = self.rewind.is_none();
            }
            Err(e @ KafkaError::MessageConsumptionFatal(_)) => self.failed = Some(classify(&e)),
            Err(e) => health.failed(&e, "partition fetch"),
        }
    }

    /// Whether the record at `offset` of `partition` is handed out (the position then moves
    /// past it), else why not: below the position (counted as skipped), or after it with the
    /// records in between unaccounted for (a rewind is wanted).
    fn accept(&mut self, partition: i32, offset: i64) -> bool {
        if let Some(next) = self.next {
            if offset < next {
                // Applied already (read again while rewinding, or sent unasked): counted,
                // and logged once per poll (`KafkaInput::poll`).
                self.skipped.note(offset, self.rewind.is_some());
                if let Some(r) = &mut self.rewind {
                    r.saw_below = true;
                }
                return false;
            }
            if offset > next {
                let confirmed = self.rewind.is_some_and(|r| r.saw_below || r.target == 0);
                if !confirmed {
                    // The broker may have skipped the batch holding `next`.
                    self.rewind_wanted = true;
                    return false;
                }
                if !self.gap_warned {
                    self.gap_warned = true;
                    tracing::warn!(
                        partition,
                        expected = next,
                        got = offset,
                        "kafka: offsets missing from the partition (deleted by retention, compaction or transaction markers)"
                    );
                }
            }
        }
        if self.rewind_wanted {
            return false;
        }
        // In order: the record at the position (or the first one, where librdkafka starts
        // at the log start), or one after a confirmed gap.
        self.aligned = true;
        self.rewind = None;
        self.next = Some(offset + 1);
        self.progress_at = Some(Instant::now());
        self.eof = false;
        true
    }

    /// The fetcher was sent back to `target`, `step` offsets before the position.
    fn sent_back(&mut self, target: i64, step: i64) {
        self.rewind_wanted = false;
        self.aligned = false;
        self.rewind = Some(Rewind {
            target,
            step,
            saw_below: false,
        });
        self.progress_at = Some(Instant::now());
        self.eof = false;
    }

    /// The high watermark proves records wait after the position.
    fn behind(&self) -> bool {
        matches!((self.next, self.high), (Some(next), Some(high)) if next < high)
    }

    /// Whether nothing is left to read after the records handed out, given the high
    /// watermark librdkafka has cached (`cached`, `None` before any fetch response): partition
    /// EOF was reported after the last record, or a watermark from a fetch response of the
    /// current position ([`Cursor::high_fresh`]) is at or below the next offset and no
    /// rewind is under way. Remembers `cached` as [`Cursor::high`].
    fn caught_up(&mut self, cached: Option<i64>) -> bool {
        self.high = cached.or(self.high);
        if self.eof {
            return true;
        }
        match (self.next, self.high) {
            (Some(next), Some(high)) => self.high_fresh && next >= high && self.rewind.is_none(),
            _ => false,
        }
    }

    /// Records between the position and the cached high watermark (`None` when unknown);
    /// before a fetch response of the current position only a positive lower bound is known.
    fn lag(&self, cached: Option<i64>) -> Option<u64> {
        let high = cached.or(self.high)?;
        let lag = high.saturating_sub(self.next?).max(0) as u64;
        (self.high_fresh || lag > 0).then_some(lag)
    }

    /// Behind, not [`Cursor::aligned`], and nothing handed out for [`FETCH_STALL`].
    fn stalled(&self) -> bool {
        self.behind()
            && !self.aligned
            && self.progress_at.is_some_and(|t| t.elapsed() >= FETCH_STALL)
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
/// The 1 s stall counts only until a record came in order after the fetcher was sent
/// somewhere (seek, rewind, committed offset): from then on librdkafka fetches from batch
/// boundaries, and a fetch that yields nothing is a slow broker; sending it back would drop
/// the fetch in flight and have the broker read again what was applied (issue 33: a tansu
/// slowed by its growing log was rewound every few seconds, ~150 records a minute read again).
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
        self.cursor.sent_back(target, step);
        Ok(())
    }

    /// The high watermark librdkafka cached from its last fetch response for this
    /// partition (no request is sent). Not ListOffsets: tansu 0.6 answers "latest" with the
    /// newest batch's base offset + 1.
    fn cached_high_watermark(&self) -> Option<i64> {
        cached_high_watermark(self.consumer.client(), &self.topic_c, self.partition)
    }

    /// Whether the partition has nothing more to read after the records handed out
    /// (module docs: EOF, else the high watermark).
    fn caught_up(&mut self) -> bool {
        let cached = self.cached_high_watermark();
        self.cursor.caught_up(cached)
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
            let offsets = format!("{}..={}", s.first, s.last);
            tracing::info!(partition = self.partition, skipped = s.count, %offsets, next_offset, "kafka: records below the partition's next offset read again while rewinding; dropped as applied already (settle_input_skipped_total)");
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
        self.cursor.lag(self.cached_high_watermark())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A cursor whose position last moved `ago` and whose fetch responses say the log ends
    /// at `high`.
    fn quiet_for(mut c: Cursor, ago: Duration, high: i64) -> Cursor {
        c.progress_at = Instant::now().checked_sub(ago);
        c.high = Some(high);
        c
    }

    #[test]
    fn a_watermark_from_before_the_seek_never_proves_caught_up() {
        // Given back a partition owned earlier: librdkafka still caches the watermark of
        // that ownership (20), the store says the next offset is 300.
        let mut c = Cursor::at(300);
        assert!(!c.caught_up(Some(20)), "{c:?}");
        assert_eq!(c.lag(Some(20)), None);
        // A stale watermark above the position still proves records wait.
        assert!(quiet_for(Cursor::at(10), FETCH_STALL * 2, 20).behind());
        // The first record of the position comes with a fresh watermark: the backlog shows.
        c.high_fresh = true;
        assert!(c.accept(0, 300));
        assert!(!c.caught_up(Some(900)));
        assert_eq!(c.lag(Some(900)), Some(599));
        // Read to the watermark of that response: caught up.
        for offset in 301..900 {
            assert!(c.accept(0, offset));
        }
        assert!(c.caught_up(Some(900)));
        assert_eq!(c.lag(Some(900)), Some(0));
        // A seek forgets that the watermark was fresh.
        let mut c = Cursor::at(900);
        assert!(!c.caught_up(Some(900)));
        // Partition EOF after the position is an answer of its own.
        c.eof = true;
        c.high_fresh = true;
        assert!(c.caught_up(Some(900)));
    }

    #[test]
    fn a_fetcher_sent_mid_batch_is_rewound_when_the_fetch_stalls() {
        // Sought to 100, inside a batch the broker will not return from its middle.
        let c = quiet_for(Cursor::at(100), FETCH_STALL * 2, 120);
        assert!(c.stalled());
        // The same quiet time, nothing behind: no stall.
        assert!(!quiet_for(Cursor::at(100), FETCH_STALL * 2, 100).stalled());
    }

    #[test]
    fn records_in_order_mean_a_slow_broker_is_waited_for_not_rewound() {
        let mut c = Cursor::at(100);
        for offset in 100..110 {
            assert!(c.accept(0, offset));
        }
        assert_eq!(c.next, Some(110));
        let c = quiet_for(c, FETCH_STALL * 5, 200);
        assert!(c.behind());
        assert!(!c.stalled(), "{c:?}");
    }

    #[test]
    fn a_rewind_is_stalled_again_until_the_position_arrives() {
        // Sought to 100; the broker skipped to the next batch (108): rewind wanted.
        let mut c = Cursor::at(100);
        assert!(!c.accept(0, 108));
        assert!(c.rewind_wanted);
        c.sent_back(36, 64);
        assert!(quiet_for(std::mem::take(&mut c), FETCH_STALL * 2, 120).stalled());

        let mut c = Cursor::at(100);
        c.sent_back(36, 64);
        // The records before the position come again and are dropped, then the position.
        for offset in 96..100 {
            assert!(!c.accept(0, offset));
        }
        assert_eq!(c.skipped.count, 4);
        assert!(c.accept(0, 100));
        assert!(c.rewind.is_none());
        assert!(!quiet_for(c, FETCH_STALL * 2, 120).stalled());
    }
}
