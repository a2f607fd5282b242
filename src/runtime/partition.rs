//! The task of one owned partition. It owns the partition's [`PartitionStore`], its
//! [`PartitionClock`], its input handle and its outbox publisher; nothing of it is shared.
//!
//! # One step
//!
//! 1. Poll a batch (at most `batch-size` records). The wait is bounded by `idle-tick` and,
//!    when the partition is caught up, by the wall-clock time until its earliest timer, so
//!    an idle partition wakes exactly when a round falls due (SEMANTICS §3: no "suppress
//!    never emits on idle input").
//!    While owed emissions wait for room in the publisher's queue, it is at most
//!    [`FEED_WAIT`], so a backlog of emissions is handed over as fast as the sink acknowledges.
//! 2. Decode every record (`codec::decode_upload`, event time capped at the wall clock, and
//!    on NATS the key's partition checked: `PartitionInput::key_partition`); a
//!    bad record is dead-lettered with its reason (awaited) and its offset still advances.
//! 3. In ONE store batch: for each upload, fire the timers due up to its event time (a round
//!    due before a later upload fires first), advance the partition clock to the event time
//!    and apply it through `engine::Driver`; when the partition is caught up, move partition
//!    time to the wall clock and fire what is due. Push the emissions to the outbox, set the
//!    next offset and the partition time, commit. Then commit the next offset to the source
//!    (at most every [`COMMIT_INTERVAL`] while records flow; at once when caught up).
//! 4. Hand owed emissions to the publisher; delete acknowledged ones from the outbox.
//! 5. Flush (every `store.flush-interval`, or at `store.flush-max-dirty` changed keys): the
//!    committed changes go to RocksDB in one write; only then are its emissions handed to
//!    the publisher and its offset committed. While the partition catches up (records or
//!    due timers waiting) the write runs on the store's writer thread and the task goes on
//!    with the next batch; an idle partition writes on its own thread (`Task::flush_if_due`).
//!
//! # Catch-up pacing
//!
//! A timer overdue by more than `idle-tick` (it fell due while the process was down, or a
//! backlog is being replayed) fires only when the partition's [`CatchUpPacer`] has a token
//! (`catch-up-rate` emissions/s).
//! When it has none, the step stops right there: the remaining records stay decoded in
//! memory (at most one batch) and are applied after the pending timers, so due order is kept
//! and nothing fires early or out of order; the store is committed up to that point.
//!
//! Overdue timers are released tenants in turn (SEMANTICS §3): when the first due timer is
//! overdue, the task fires the timer the [`CatchUpQueue`] gives instead (the next tenant in
//! the ring with an overdue timer due at the target time; see [`super::catch_up`]), so one
//! tenant's thousands of overdue rounds do not hold back another tenant's few. Each
//! session's rounds still fire in order, and all timers due before an upload still fire
//! before it is applied; timers that are not overdue fire in `(due, key)` order. The ring is
//! per partition, like the pacer.
//!
//! # Shadow policies
//!
//! With `[[shadow]]` (SEMANTICS §8) the task holds a [`ShadowSet`](crate::engine::ShadowSet)
//! ([`super::shadow`]): each upload the live driver applies in a step is handed to every
//! shadow at the same partition time; at the end of the step the shadows fire what is due at
//! partition time, and the step's live emissions and the shadows' would-be emissions are
//! counted by tier (the tenant's tier in the router now). Shadows write nothing: no store,
//! outbox or changelog. Without `[[shadow]]` the set is `None`: one check per upload.
//!
//! # Failure
//!
//! Every store error is fatal for the partition: the task logs it, sets status
//! [`PartitionState::Failed`], stops its publisher, commits nothing more to the source and
//! returns. The store still holds the last committed batch, so a restart resumes there.
//!
//! # Observability
//!
//! The task runs in the span `partition{topic, partition}` (its publisher too); warnings a
//! loop can repeat (poll, seek, dead-letter and commit failures, bad records) are logged at
//! most every [`LOG_EVERY`](super::throttle::LOG_EVERY) with the count left out. It records
//! consumed and rejected records and the store write latency ([`PartitionMetrics`]), keeps
//! its entry of the status board, and answers session queries of the admin endpoint
//! ([`SessionLookup`]) while it waits for input.
//!
//! # Stop
//!
//! On cancellation (shutdown or revocation) the task stops fetching, finishes the step it is
//! in, waits for the outbox to drain until the flush deadline, then stops the publisher,
//! flushes and closes the store.

use super::actions::{self, ActionLog};
use super::catch_up::{self, CatchUpQueue};
use super::clock::{Clock, PartitionClock};
use super::lookup::{Query, SessionLookup, SessionQuery, SessionView};
use super::pacer::CatchUpPacer;
use super::pending::ListingShare;
use super::publisher::{self, Fence, PublishTarget, TierRouting};
use super::status::{PartitionState, PartitionStatus, StatusBoard};
use super::throttle::LogThrottle;
use crate::codec::action::{is_action, ActionKind, ActionOutcome, ActionRecord, AuditRecord};
use crate::codec::{self, DecodeError};
use crate::engine::{
    Applied, Driver, Emission, Engine, Millis, SessionKey, SessionTable, TenantClass, Upload,
};
use crate::metrics::{Metrics, PartitionMetrics};
use crate::store::{self, Batch, PartitionStore};
use crate::transport::{self, Backoff, InputRecord, PartitionInput, Sink, TxnWriter};
use futures::future::{BoxFuture, FutureExt};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Longest time a durable offset waits before it is committed to the source while records
/// keep flowing (one commit per batch would cost the broker a request per batch). A caught-up
/// partition commits at once, and a stopping one before it drains its outbox. The store, not
/// the group, is where a restarted partition resumes, so a late commit re-reads nothing here.
pub const COMMIT_INTERVAL: Duration = Duration::from_millis(500);

/// Longest poll wait while owed emissions wait for room in the publisher's queue and the
/// publisher is making progress: the task hands over at most one queue (`publish window`)
/// per loop turn, so waiting a whole `idle-tick` there would cap an idle partition's
/// publishing at one window per tick (2 560 emissions/s with the defaults).
pub const FEED_WAIT: Duration = Duration::from_millis(1);

/// Capacity of the queue of owed emissions handed to the publisher, in publish windows: the
/// publisher still has at most one window in flight; the queue lets one loop turn hand it
/// many windows' worth (entries in it are still owed: a stop leaves them in the outbox).
pub const FEED_QUEUE_WINDOWS: usize = 16;

/// How soon after the last flush a caught-up partition writes the next one when it owes
/// emissions (ms), instead of waiting for the whole `store.flush-interval`: a round is
/// published only once its flush is durable, so the interval is part of every round's
/// lateness; state changes alone still wait for the interval. Not while the partition catches
/// up (it writes bigger batches then) nor in exactly-once mode (a flush is a transaction).
pub const EMITTING_FLUSH_INTERVAL: Duration = Duration::from_millis(2);

/// The emitting flush waits at least this many times as long as the last flush took to
/// build and write (eviction excluded), so that early flushes take at most a quarter of the
/// partition's time under load (a loaded core flushing every 2 ms fell behind its input).
/// Was 10, with eviction counted in: at 50 000 uploads/s live the interval was then 15 to
/// 50 ms and lateness p99 about 50 ms; at 3 it is about 2 to 6 ms, p99 7 to 14 ms
/// (BENCHMARKS, session 14).
pub const EMITTING_FLUSH_COST_FACTOR: u32 = 3;

/// Most changelog appends (one per store write) waiting for their acknowledgement before
/// the task stops taking input and waits for the changelog to catch up (backpressure while
/// the changelog's broker is slow or down).
pub const CHANGELOG_APPENDS_IN_FLIGHT: usize = 1024;

/// Crash drill (`tests/crash_kill.rs`): with `SETTLE_FAULT_CRASH_BEFORE_FLUSH=N` the process
/// aborts (as kill -9 would end it) when its N-th flush holding new emissions is about to be
/// written: those emissions, and the state that produced them, exist in memory only.
/// Counted per process, over all partitions.
pub const CRASH_BEFORE_FLUSH_ENV: &str = "SETTLE_FAULT_CRASH_BEFORE_FLUSH";
/// Crash drill: with `SETTLE_FAULT_CRASH_AFTER_FLUSH=N` the process aborts right after its
/// N-th flush holding new emissions is written, before they are handed to the publisher.
pub const CRASH_AFTER_FLUSH_ENV: &str = "SETTLE_FAULT_CRASH_AFTER_FLUSH";

/// Flushes holding new emissions so far in this process (for the crash drills).
static EMITTING_FLUSHES: AtomicU64 = AtomicU64::new(0);

/// The crash drills' settings, read once.
fn crash_drill() -> (Option<u64>, Option<u64>) {
    static DRILL: OnceLock<(Option<u64>, Option<u64>)> = OnceLock::new();
    *DRILL.get_or_init(|| {
        let n = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
        (n(CRASH_BEFORE_FLUSH_ENV), n(CRASH_AFTER_FLUSH_ENV))
    })
}

/// Aborts the process when `n` is the drill's number (see [`CRASH_BEFORE_FLUSH_ENV`]).
fn crash_if(drill: Option<u64>, n: u64, name: &str) {
    if n > 0 && drill == Some(n) {
        tracing::error!("{name}={n}: aborting the process (crash drill)");
        std::process::abort();
    }
}

/// How a partition task ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartitionExit {
    /// Stopped on request; the store is closed. `flushed`: the outbox was empty at the end
    /// (otherwise the rest is published after the next start).
    Stopped {
        /// The outbox was fully acknowledged before the store closed.
        flushed: bool,
    },
    /// Stopped on a fatal error (see the module docs); the message says what failed.
    Failed(String),
}

/// Settings of partition tasks (from `[runtime]`, `[store]` and the output config).
#[derive(Clone, Debug)]
pub struct PartitionSettings {
    /// Most records per poll and per store batch (`runtime.batch-size`).
    pub batch_size: usize,
    /// Longest poll wait; also the lateness above which a timer counts as overdue for
    /// catch-up pacing (`runtime.idle-tick`).
    pub idle_tick: Duration,
    /// How long a stopping task waits for its outbox to drain.
    pub flush_timeout: Duration,
    /// How emissions are published (in-flight window, backoff).
    pub publish: PublishTarget,
    /// `runtime.catch-up-rate`: overdue emissions released per second (0 = unlimited).
    pub catch_up_rate: u32,
    /// `store.flush-interval`: longest time committed changes wait in memory before the
    /// store writes them (write-behind; emissions are published after that write).
    pub flush_interval: Duration,
    /// `store.flush-max-dirty`: flush at once when this many keys changed.
    pub flush_max_dirty: usize,
}

/// Everything a partition task needs besides its store and input. Cheap to clone.
#[derive(Clone)]
pub struct PartitionContext<K, C> {
    /// The debounce rules in force (policies); a task takes new ones at its next loop turn.
    pub rules: super::rules::Rules,
    /// Where emissions and dead letters go.
    pub sink: K,
    /// The wall clock.
    pub clock: C,
    /// The process's tier router and its tier-change channel: which topic each emission
    /// goes to (SEMANTICS §5).
    pub tiers: TierRouting,
    /// Task settings.
    pub settings: Arc<PartitionSettings>,
    /// Where the task reports its status.
    pub status: StatusBoard,
    /// The runtime's metrics (one registry per runtime).
    pub metrics: Metrics,
    /// Where the task registers to answer session queries (admin endpoint).
    pub sessions: SessionLookup,
    /// Where applied operator actions are recorded and their audit records go (SEMANTICS §7).
    pub actions: ActionLog,
    /// The shadow policies each task runs beside the live one (SEMANTICS §8; empty: none).
    pub shadows: super::shadow::ShadowBoard,
}

/// A consumed record, decoded and waiting to be applied.
struct Pending {
    offset: i64,
    /// `None`: the record was dead-lettered, or is an action; applying it only moves the
    /// offset.
    upload: Option<Upload>,
    /// An operator action record (SEMANTICS §7).
    action: Option<Box<HeldAction>>,
}

/// An action record waiting to be applied.
struct HeldAction {
    record: ActionRecord,
    /// The record's timestamp (ms): the action's event time (it moves partition time as an
    /// upload's does).
    at: Millis,
    /// A bulk action's sessions, selected when the action reached the front of a step.
    selected: Option<(Vec<actions::Selected>, bool)>,
}

/// Whether every timer due at the target time fired.
enum Fired {
    All,
    /// Stopped early: retry after this long (catch-up pacing, or the per-step fire cap).
    Paused(Duration),
}

/// What one store step did.
#[derive(Default)]
struct StepReport {
    /// The step stopped for pacing; call again after this long.
    paused: Option<Duration>,
}

/// Runs the task of the partition read by `input`, on the already opened (and, with a
/// changelog, restored) `store`, until `cancel` fires or a fatal error. Resumes from the
/// store: seeks the input to the stored next offset, re-arms timers (they are in the store),
/// re-publishes the outbox. When the sink has a changelog, every store write is appended
/// to it (see [`crate::store::changelog`]); once `fence` is revoked nothing more is
/// published or appended.
pub async fn run<I: PartitionInput, K: Sink, C: Clock>(
    ctx: PartitionContext<K, C>,
    mut store: PartitionStore,
    input: I,
    fence: Fence,
    txn: Option<Box<dyn TxnWriter>>,
    cancel: CancellationToken,
) -> PartitionExit {
    let changelog = ctx.sink.changelog().is_some();
    store.record_changes(changelog || txn.is_some());
    // Memory first: commits change memory, `flush_if_due` writes them (module docs).
    if let Err(e) = store.set_write_behind(true) {
        return PartitionExit::Failed(fatal(e));
    }
    // Eviction runs once a flush's emissions are handed out, a share per loop turn.
    store.set_deferred_eviction(true);
    let partition = input.partition();
    // Room for many windows: the task refills the queue once per loop turn (at most every
    // FEED_WAIT while it has nothing else to do), so a queue of one window capped a
    // draining outbox at one window per millisecond.
    let (entries_tx, entries_rx) =
        mpsc::channel(ctx.settings.publish.window.max(1) * FEED_QUEUE_WINDOWS);
    let (acks_tx, acks_rx) = mpsc::unbounded_channel();
    let publish_metrics = ctx
        .metrics
        .publisher(ctx.tiers.router.tiers().tiers().map(|(name, _)| name));
    let publisher = tokio::spawn(
        publisher::run(
            ctx.sink.clone(),
            ctx.clock.clone(),
            ctx.settings.publish.clone(),
            ctx.tiers.clone(),
            fence.clone(),
            entries_rx,
            acks_tx,
            publish_metrics,
        )
        .instrument(tracing::Span::current()),
    );
    // Unregistered when this function returns.
    let (_registration, queries) = ctx.sessions.register(partition);
    let mut rules = ctx.rules.subscribe();
    let first_rules = rules.borrow_and_update().clone();
    let started_at = ctx.clock.now_ms();
    let mut task = Task {
        status: PartitionStatus::starting(input.topic(), partition),
        clock: PartitionClock::resume(store.partition_time()),
        driver: Driver::new(first_rules),
        rules,
        pacer: CatchUpPacer::new(ctx.settings.catch_up_rate),
        started_at,
        shadow: ctx.shadows.register(partition, started_at),
        catch_up: CatchUpQueue::new(),
        held: VecDeque::new(),
        caught_up: false,
        paced: false,
        feed: Feed {
            publish_from: 0,
            in_flight: 0,
            progress_at: Instant::now(),
        },
        entries: Some(entries_tx),
        acks: acks_rx,
        uncommitted: None,
        committable: None,
        committed_at: Instant::now(),
        flushed_at: Instant::now(),
        flush_took: Duration::ZERO,
        flush_drill: 0,
        flushed_offset: store.stored_offset(),
        metrics: ctx.metrics.partition(input.topic(), partition),
        queries,
        listing: ListingShare::new(),
        audit_owed: Vec::new(),
        warn: Warnings::default(),
        profile: TurnProfile::default(),
        changelog: Changelog {
            enabled: changelog && txn.is_none(),
            gate: changelog && txn.is_none() && ctx.sink.fences_by_changelog(),
            acks: VecDeque::new(),
            acked: None,
            synced_at: Instant::now(),
            // What the store holds at start is in the changelog (restored from it, or
            // appended again by the restore and claimed).
            publishable_below: store.durable_outbox_seq(),
        },
        fence,
        txn,
        ctx,
        store,
        input,
    };
    let exit = match task.run(&cancel).await {
        Ok(()) => {
            task.set_state(PartitionState::Stopping);
            task.finish().await
        }
        Err(reason) => {
            tracing::error!(partition, error = %reason, "partition stopped: nothing more is consumed or committed for it");
            PartitionExit::Failed(reason)
        }
    };
    task.entries = None;
    publisher.abort();
    task.set_state(match &exit {
        PartitionExit::Stopped { .. } => PartitionState::Stopped,
        PartitionExit::Failed(r) => PartitionState::Failed(r.clone()),
    });
    exit
}

struct Task<I, K, C> {
    ctx: PartitionContext<K, C>,
    store: PartitionStore,
    input: I,
    clock: PartitionClock,
    driver: Driver,
    /// The rules in force: a change is taken at the start of a loop turn (`runtime::rules`).
    rules: tokio::sync::watch::Receiver<Engine>,
    pacer: CatchUpPacer,
    /// Wall clock (ms) when this task took the partition (its store open and restored).
    /// Only rounds due before it can be overdue (paced at `catch-up-rate`): they fell due
    /// while no task of this process owned the partition (SEMANTICS §3: "while the
    /// processor was down or restored"). A live round that is late because the task fell
    /// behind is not paced: pacing it below the rate rounds fall due at would turn one
    /// hiccup into a lag that only grows.
    started_at: Millis,
    /// The shadow policies' set of this partition (SEMANTICS §8; `None`: no `[[shadow]]`).
    shadow: Option<super::shadow::ShadowHandle>,
    /// Overdue timers by tenant, in turn order (catch-up release).
    catch_up: CatchUpQueue,
    /// Consumed, decoded records not applied yet (catch-up pacing); at most one batch.
    held: VecDeque<Pending>,
    /// The last poll found the partition at its end.
    caught_up: bool,
    /// The last step stopped at the catch-up pacer (overdue rounds released at
    /// `catch-up-rate`): the partition waits anyway, so its flush is written on its own
    /// thread and its emissions go out at once (not after the writer thread's write is
    /// seen done a loop turn later).
    paced: bool,
    /// Handed to the publisher so far (`feed`).
    feed: Feed,
    entries: Option<mpsc::Sender<store::OutboxEntry>>,
    acks: mpsc::UnboundedReceiver<Vec<u64>>,
    status: PartitionStatus,
    /// Next offset durable in the store (gated: and in an acknowledged changelog append)
    /// and not yet committed to the source.
    uncommitted: Option<i64>,
    /// Gated changelog: the input offset of the last acknowledged append.
    committable: Option<i64>,
    /// When the source was last asked to commit.
    committed_at: Instant,
    /// When the store last started a flush (write-behind).
    flushed_at: Instant,
    /// How long the last flush took to write (`EMITTING_FLUSH_COST_FACTOR`).
    flush_took: Duration,
    /// The crash drill's number of the flush in flight (0: none; see [`CRASH_AFTER_FLUSH_ENV`]).
    flush_drill: u64,
    /// The store's durable offset as last seen after a flush.
    flushed_offset: Option<i64>,
    metrics: PartitionMetrics,
    /// Session queries of the admin endpoint.
    queries: mpsc::Receiver<Query>,
    /// Listing slices' share of the task's time (`pending::LISTING_SHARE_PERCENT`).
    listing: ListingShare,
    /// Audit records of actions applied since the last flush: published once it is durable.
    audit_owed: Vec<AuditRecord>,
    warn: Warnings,
    /// Where the loop's time goes (debug log).
    profile: TurnProfile,
    changelog: Changelog,
    fence: Fence,
    /// Exactly-once mode: every store write is committed in a transaction with its
    /// emissions and input offset (`None`: at-least-once).
    txn: Option<Box<dyn TxnWriter>>,
}

/// The task's side of the changelog.
struct Changelog {
    /// The sink has a changelog: store writes are recorded and appended.
    enabled: bool,
    /// The changelog is the ownership fence ([`Sink::fences_by_changelog`], NATS): an
    /// emission is handed to the publisher, and an input offset committed, only once the
    /// append that holds it is acknowledged (a fenced process's last appends are refused,
    /// so nothing it applied after the fence becomes visible or acked).
    gate: bool,
    /// Appends not acknowledged yet, in append order.
    acks: VecDeque<Append>,
    /// Changelog offset after the last acknowledged append.
    acked: Option<i64>,
    /// When the store's checkpoint was last written.
    synced_at: Instant,
    /// `gate`: outbox sequence numbers below this are in an acknowledged append.
    publishable_below: u64,
}

/// One changelog append in flight and what its acknowledgement makes safe (`Changelog::gate`).
struct Append {
    ack: BoxFuture<'static, Result<i64, transport::Error>>,
    /// The store's durable outbox sequence when the append was made: entries below it are in it.
    outbox_below: u64,
    /// The store's durable input offset when the append was made.
    offset: Option<i64>,
    /// When the append was made (`settle_changelog_append_seconds`).
    sent: Instant,
}

/// Where a partition task's loop spends its time, summed over [`TurnProfile::EVERY`] and
/// logged at debug level (`SETTLE_LOG=settle::runtime::partition=debug`): the wall time of
/// each phase that can wait (the input poll, decoding with its dead letters, the offset
/// commit, the changelog backpressure) and of the synchronous ones (step, flush). A loop
/// that turns slowly while the process is idle shows here which await holds it.
#[derive(Default)]
struct TurnProfile {
    since: Option<Instant>,
    turns: u64,
    poll: Duration,
    decode: Duration,
    step: Duration,
    flush: Duration,
    commit: Duration,
    backpressure: Duration,
    records: u64,
}

impl TurnProfile {
    /// How often the profile is logged (and reset).
    const EVERY: Duration = Duration::from_secs(10);

    fn report(&mut self, partition: i32) {
        let since = *self.since.get_or_insert_with(Instant::now);
        self.turns += 1;
        if since.elapsed() < Self::EVERY {
            return;
        }
        let ms = |d: Duration| d.as_millis() as u64;
        tracing::debug!(
            partition,
            window_ms = ms(since.elapsed()),
            turns = self.turns,
            records = self.records,
            poll_ms = ms(self.poll),
            decode_ms = ms(self.decode),
            step_ms = ms(self.step),
            flush_ms = ms(self.flush),
            commit_ms = ms(self.commit),
            backpressure_ms = ms(self.backpressure),
            "partition loop profile"
        );
        *self = TurnProfile::default();
    }
}

/// One log throttle per warning the task's loops can repeat.
#[derive(Default)]
struct Warnings {
    poll: LogThrottle,
    seek: LogThrottle,
    bad_record: LogThrottle,
    dead_letter: LogThrottle,
    commit: LogThrottle,
}

/// Answers one query from `store` (between store batches; `now`: the partition time, ms); a
/// listing slice only when its turn comes (`listing`, `pending::LISTING_SHARE_PERCENT`).
fn answer(
    store: &mut PartitionStore,
    engine: &Engine,
    status: &PartitionStatus,
    now: Millis,
    listing: &mut ListingShare,
    q: Query,
) {
    match q {
        Query::Pending(q) => listing.offer(q, |q| {
            super::pending::answer_slice(store, engine, status.partition, now, q)
        }),
        Query::Session(q) => answer_session(store, engine, status, q),
    }
}

/// Answers the listing slice waiting in `listing` if its turn has come.
fn answer_due_slice(
    store: &mut PartitionStore,
    engine: &Engine,
    status: &PartitionStatus,
    now: Millis,
    listing: &mut ListingShare,
) {
    listing.run_due(|q| super::pending::answer_slice(store, engine, status.partition, now, q));
}

/// Answers one session query from `store` (read-only).
fn answer_session(
    store: &PartitionStore,
    engine: &Engine,
    status: &PartitionStatus,
    q: SessionQuery,
) {
    let answer = store
        .session(&q.key)
        .map(|state| {
            state.map(|state| SessionView {
                topic: status.topic.clone(),
                partition: status.partition,
                next_due: engine.next_due(&q.key, &state),
                policy: engine.spec_for(&q.key).name,
                state,
            })
        })
        .map_err(fatal);
    // The asker may have given up (timeout): nothing to do then.
    let _ = q.reply.send(answer);
}

/// Tries of publishing one audit record (backoff up to 5 s between them: about a minute).
const AUDIT_PUBLISH_TRIES: u32 = 15;

/// Applies one action record at partition time `now` (ms), in `batch` (SEMANTICS §7): its
/// session's open round, or each session its bulk selection holds, is flushed (emissions
/// appended to `out`, `trigger = manual`) or cancelled; a dry run only counts. A request id
/// this partition applied at an earlier offset makes it a duplicate (`actions` module).
/// Returns the audit record of what was done (also added to `log`).
///
/// Errors: the store's.
#[allow(clippy::too_many_arguments)]
fn apply_action(
    driver: &mut Driver,
    batch: &mut Batch<'_>,
    now: Millis,
    partition: i32,
    offset: i64,
    held: &mut HeldAction,
    log: &ActionLog,
    out: &mut Vec<Emission>,
) -> Result<AuditRecord, store::Error> {
    let record = &held.record;
    let selection = match (&record.session, &record.filter) {
        (Some(s), _) => serde_json::json!({ "session": s }),
        (None, f) => serde_json::json!({ "filter": f, "limit": record.bulk_limit() }),
    };
    let action = crate::engine::Action {
        flush: record.kind == ActionKind::Flush,
        dry_run: record.dry_run,
    };
    let mut outcome = ActionOutcome {
        request_id: record.request_id.clone(),
        partition,
        offset,
        applied_at: now,
        dry_run: record.dry_run,
        ..ActionOutcome::default()
    };
    if let Some(first) = log.applied_before(&record.request_id, partition, offset) {
        outcome = ActionOutcome {
            duplicate: true,
            offset,
            applied_at: now,
            ..first
        };
    } else {
        let before = out.len();
        let keys: Vec<SessionKey> = match (record.session_key(), &held.selected) {
            (Some(key), _) => vec![key],
            (None, Some((selected, more))) => {
                outcome.more = *more;
                selected.iter().map(|(k, _)| k.clone()).collect()
            }
            (None, None) => Vec::new(),
        };
        let mut found_state = false;
        for key in &keys {
            if record.session.is_some() {
                found_state = batch.get(key)?.is_some();
            }
            if let Some(uploads) = driver.act(batch, now, key, action, out)? {
                outcome.sessions += 1;
                outcome.uploads += u64::from(uploads);
            }
        }
        outcome.emission_ids = out[before..]
            .iter()
            .filter(|e| e.trigger == crate::engine::Trigger::Manual)
            .take(actions::OUTCOME_EMISSION_IDS)
            .map(|e| e.emission_id())
            .collect();
        let flush = record.kind == ActionKind::Flush;
        outcome.result = match (
            record.session.is_some(),
            outcome.sessions > 0,
            record.dry_run,
        ) {
            (true, true, false) if flush => "flushed",
            (true, true, false) => "cancelled",
            (true, true, true) if flush => "would_flush",
            (true, true, true) => "would_cancel",
            (true, false, _) if found_state => "no_open_round",
            (true, false, _) => "no_state",
            (false, _, false) => "done",
            (false, _, true) => "would_do",
        }
        .to_owned();
    }
    let audit = actions::applied_record(
        log,
        now,
        &record.who,
        record.kind.as_str(),
        &record.reason,
        selection,
        &outcome,
    );
    log.add(audit.clone());
    Ok(audit)
}

/// Fatal error text for a store failure.
fn fatal(e: store::Error) -> String {
    format!("partition store: {e}")
}

impl<I: PartitionInput, K: Sink, C: Clock> Task<I, K, C> {
    fn partition(&self) -> i32 {
        self.status.partition
    }

    /// Answers `q`; a listing slice only when its turn comes (`listing`).
    fn answer(&mut self, q: Query) {
        let now = self.clock.now();
        let engine = self.driver.engine();
        answer(
            &mut self.store,
            engine,
            &self.status,
            now,
            &mut self.listing,
            q,
        );
    }

    /// Answers the waiting listing slice if its turn has come.
    fn answer_due_slice(&mut self) {
        let now = self.clock.now();
        let engine = self.driver.engine();
        answer_due_slice(
            &mut self.store,
            engine,
            &self.status,
            now,
            &mut self.listing,
        );
    }

    async fn run(&mut self, cancel: &CancellationToken) -> Result<(), String> {
        self.check_rules().map_err(fatal)?;
        if let Some(next) = self.store.stored_offset() {
            self.seek(next, cancel).await?;
        }
        tracing::info!(
            partition = self.partition(),
            next_offset = ?self.store.stored_offset(),
            partition_time = self.clock.now(),
            outbox = self.store.outbox_len(),
            pending_rounds = self.store.pending_rounds(),
            "partition resumed from its store"
        );
        self.refresh_status().map_err(fatal)?;
        let mut paused: Option<Duration> = None;
        loop {
            self.take_rules();
            self.take_acks().map_err(fatal)?;
            if self.txn.is_none() {
                self.flush_if_due(false).map_err(fatal)?;
            }
            self.ship_changes()?;
            self.feed_publisher().map_err(fatal)?;
            // After the emissions of the last flush were handed out: eviction is not on
            // their way (a share of a sweep per turn; `PartitionStore::evict`).
            self.store.evict();
            // One query per loop turn. A listing slice is bounded (`pending::SLICE_BUDGET`)
            // and takes its turn by the listing's share of the task's time
            // (`pending::LISTING_SHARE_PERCENT`): a listing chained slice after slice holds
            // neither the input between two polls nor the loop's time.
            if self.listing.waiting() {
                self.answer_due_slice();
            } else if let Ok(q) = self.queries.try_recv() {
                self.answer(q);
            }
            if cancel.is_cancelled() {
                return Ok(());
            }
            if self.changelog.acks.len() >= CHANGELOG_APPENDS_IN_FLIGHT {
                // Backpressure: the changelog is behind; wait for its oldest append.
                let t = Instant::now();
                tokio::select! {
                    () = cancel.cancelled() => return Ok(()),
                    () = tokio::time::sleep(self.ctx.settings.idle_tick) => {}
                    r = &mut self.changelog.acks.front_mut().expect("len checked").ack => {
                        let done = self.changelog.acks.pop_front().expect("len checked");
                        let next = r.map_err(|e| self.changelog_failed(&e))?;
                        self.appended(next, &done);
                    }
                }
                self.profile.backpressure += t.elapsed();
                continue;
            }
            if self.held.is_empty() {
                let wait = self.poll_wait(paused).map_err(fatal)?;
                let settings = Arc::clone(&self.ctx.settings);
                // Session queries are answered while the poll waits; the poll future is kept
                // (not dropped and restarted), so no fetched record is lost.
                let t = Instant::now();
                let polled = {
                    let poll = self.input.poll(settings.batch_size, wait);
                    tokio::pin!(poll);
                    loop {
                        tokio::select! {
                            biased;
                            () = cancel.cancelled() => return Ok(()),
                            r = &mut poll => break r,
                            Some(q) = self.queries.recv(), if !self.listing.waiting() => {
                                answer(&mut self.store, self.driver.engine(), &self.status, self.clock.now(), &mut self.listing, q);
                            }
                            () = tokio::time::sleep_until(Instant::from_std(self.listing.free_at())), if self.listing.waiting() => {
                                answer_due_slice(&mut self.store, self.driver.engine(), &self.status, self.clock.now(), &mut self.listing);
                            }
                            // Gated: the append that holds fired emissions is acknowledged
                            // while the poll waits for input: hand them to the publisher now,
                            // not when input comes or the poll's wait ends.
                            r = changelog_ack(&mut self.changelog.acks), if self.changelog.gate && !self.changelog.acks.is_empty() => {
                                let done = self.changelog.acks.pop_front().expect("not empty");
                                let next = r.map_err(|e| changelog_failed(&self.metrics, self.status.partition, &e))?;
                                appended(&mut self.changelog, &mut self.committable, &mut self.uncommitted, &self.metrics, next, &done);
                                feed(self.entries.as_ref(), &mut self.store, &self.changelog, &mut self.feed).map_err(fatal)?;
                            }
                        }
                    }
                };
                match polled {
                    Ok(batch) => {
                        self.profile.poll += t.elapsed();
                        self.profile.records += batch.records.len() as u64;
                        self.warn.poll.clear();
                        self.metrics.skipped(batch.skipped);
                        let t = Instant::now();
                        let complete = self.decode(batch.records, cancel).await;
                        self.profile.decode += t.elapsed();
                        // A truncated batch leaves records unread: not caught up.
                        self.caught_up = batch.caught_up && complete;
                    }
                    Err(e) if e.is_retryable() => {
                        match self.warn.poll.allow() {
                            Some(suppressed) => {
                                tracing::warn!(partition = self.partition(), error = %e, suppressed, "poll failed; retrying (logged at most every 10 s)")
                            }
                            None => {
                                tracing::debug!(partition = self.partition(), error = %e, "poll failed; retrying")
                            }
                        }
                        pause(cancel, Duration::from_millis(200)).await;
                        continue;
                    }
                    Err(e) => return Err(format!("poll: {e}")),
                }
            } else if let Some(p) = paused {
                pause(cancel, p).await;
            }
            // Rules set while the poll waited apply to the records it brought (SEMANTICS §7:
            // a new rule applies to every upload applied after the owner saw it).
            self.take_rules();
            let t = Instant::now();
            let report = self.step().map_err(fatal)?;
            self.profile.step += t.elapsed();
            self.paced = report.paused.is_some();
            let t = Instant::now();
            let flushed = if self.audit_owed.is_empty() || self.txn.is_some() {
                self.flush_if_due(false).map_err(fatal)?
            } else {
                // An action was applied: its outcome is audited once it is durable.
                let flushed = self.flush_if_due(true).map_err(fatal)?;
                self.publish_audit();
                flushed
            };
            self.profile.flush += t.elapsed();
            if self.txn.is_some() {
                if flushed {
                    let next = self.uncommitted.take();
                    self.commit_transaction(next).await?;
                    self.publish_audit();
                }
                paused = report.paused;
                self.refresh_status().map_err(fatal)?;
                tokio::task::yield_now().await;
                continue;
            }
            self.ship_changes()?;
            if self.changelog.enabled
                && self.fence.owned()
                && self.ctx.sink.changelog_snapshot_due(self.status.partition)
            {
                self.snapshot_changelog()?;
            }
            paused = report.paused;
            // Offsets go to the source at most every COMMIT_INTERVAL (or the input's own
            // interval) while records flow, and at once when the partition is caught up (and
            // at stop, in `finish`).
            if self.uncommitted.is_some()
                && ((self.caught_up && self.held.is_empty())
                    || self.committed_at.elapsed()
                        >= self.input.commit_interval().unwrap_or(COMMIT_INTERVAL))
            {
                let t = Instant::now();
                self.commit_offset().await;
                self.profile.commit += t.elapsed();
            }
            if self.changelog.synced_at.elapsed() >= COMMIT_INTERVAL {
                self.sync_changelog().map_err(fatal)?;
            }
            self.refresh_status().map_err(fatal)?;
            self.profile.report(self.status.partition);
            // Let the publisher and other partitions run between steps of a long catch-up.
            tokio::task::yield_now().await;
        }
    }

    /// Takes the debounce rules in force when they changed (tenant overrides, SEMANTICS §7):
    /// the next upload applied is timed by them; a pending round keeps its due time until
    /// its next upload.
    fn take_rules(&mut self) {
        if self.rules.has_changed().unwrap_or(false) {
            let engine = self.rules.borrow_and_update().clone();
            tracing::info!(partition = self.partition(), rules = %engine.policies(), "debounce rules changed: applied to every upload from here on");
            self.driver.set_engine(engine);
        }
    }

    /// At start: when the debounce rules differ from those the store last ran under (its
    /// stamp, `PolicyTable::fingerprint`), counts the pending rounds timed under another
    /// rule and says so (SEMANTICS §7: each keeps its due time until its next upload, then
    /// the rule in force times it), then stamps the store with the rules in force. One scan
    /// of the store's sessions, only when the rules changed (a restart with another
    /// `[debounce]`, a store restored from the changelog or written by an older settle).
    ///
    /// Errors: the store's (reading the sessions, writing the stamp).
    fn check_rules(&mut self) -> Result<(), store::Error> {
        let engine = self.driver.engine();
        let fingerprint = engine.policies().fingerprint();
        let stamp = self.store.rules_stamp()?;
        if stamp == Some(fingerprint) {
            return Ok(());
        }
        let (mut other, mut unrecorded) = (0u64, 0u64);
        let mut by_policy: std::collections::BTreeMap<&'static str, u64> = Default::default();
        let rounds = self.store.scan_rounds(|key, round| match round.policy {
            None => unrecorded += 1,
            Some(p) if !engine.spec_for(key).times_alike(round) => {
                other += 1;
                *by_policy.entry(p.as_str()).or_default() += 1;
            }
            Some(_) => {}
        })?;
        let by_policy = by_policy
            .iter()
            .map(|(p, n)| format!("{p}: {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        if other + unrecorded > 0 {
            tracing::warn!(
                partition = self.partition(),
                pending_rounds = rounds,
                timed_under_other_rules = other,
                by_policy = %by_policy,
                without_recorded_rule = unrecorded,
                rules = %engine.policies(),
                "pending rounds were timed under other debounce rules than those in force: each keeps its due time until its next upload, then the rules in force time it (SEMANTICS §7); its emission names the policy and delay that timed it"
            );
        } else if stamp.is_some() {
            tracing::info!(
                partition = self.partition(),
                pending_rounds = rounds,
                timed_under_other_rules = 0,
                rules = %engine.policies(),
                "debounce rules changed since the store last ran; no pending round was timed otherwise"
            );
        }
        self.store.set_rules_stamp(fingerprint)
    }

    /// Writes what the store holds in memory when the flush interval has passed since the
    /// last flush, the dirty-key cap is reached, or `force`; then the durable offset is the
    /// one to commit to the source. Returns whether a flush became durable in this call.
    ///
    /// While the partition catches up (a backlog of records or of due timers; at-least-once,
    /// not forced), the write
    /// runs on the store's writer thread ([`PartitionStore::start_flush`]) while this task
    /// goes on deciding the next records; this call (made every loop turn) sees it done
    /// ([`PartitionStore::poll_flush`]) and only then are its emissions handed out and its
    /// offset committed. One write at a time: a due flush waits for the one in flight. An
    /// idle partition, a stopping one (`force`) and exactly-once flushes write on this
    /// thread, after the one in flight: nothing else is waiting then, and the emissions go
    /// out without a loop turn in between.
    ///
    /// Errors: the store's (fatal; its memory is back at the last durable state).
    fn flush_if_due(&mut self, force: bool) -> Result<bool, store::Error> {
        let busy = self.busy()?;
        let on_thread = force || self.txn.is_some() || !busy;
        let mut durable = match self.store.poll_flush()? {
            Some(done) => {
                self.flush_written(done.took);
                true
            }
            None => false,
        };
        if on_thread {
            if let Some(done) = self.store.wait_flush()? {
                self.flush_written(done.took);
                durable = true;
            }
        }
        if !self.store.unflushed() || self.store.write_in_flight() {
            return Ok(durable);
        }
        if !force
            && self.store.dirty_keys() < self.ctx.settings.flush_max_dirty
            && self.flushed_at.elapsed() < self.flush_interval_now(busy)
        {
            return Ok(durable);
        }
        let drill = crash_drill();
        let n = if self.store.unflushed_emissions() > 0 && drill != (None, None) {
            EMITTING_FLUSHES.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            0
        };
        crash_if(drill.0, n, CRASH_BEFORE_FLUSH_ENV);
        self.flushed_at = Instant::now();
        self.flush_drill = n;
        if on_thread {
            // Building and writing the batch (the store measures it); not the wait for a
            // write in flight, nor eviction, which comes after the emissions go out.
            let report = self.store.flush()?;
            self.flush_written(report.took);
            return Ok(true);
        }
        self.store.start_flush()?;
        Ok(durable)
    }

    /// True while the partition has work beyond this flush: records to read or apply, or
    /// timers already due (a replayed backlog's rounds, overdue ones after a restart) — but
    /// not while the catch-up pacer holds them back (`paced`).
    fn busy(&self) -> Result<bool, store::Error> {
        if self.paced {
            return Ok(false);
        }
        if !self.caught_up || !self.held.is_empty() {
            return Ok(true);
        }
        Ok(matches!(self.store.next_timer()?, Some((due, _)) if due <= self.clock.now()))
    }

    /// A flush is durable (it took `took` to write): counts it, runs the after-flush crash
    /// drill, and makes its offset the one to commit.
    fn flush_written(&mut self, took: Duration) {
        self.metrics.store_write(took);
        self.flush_took = took;
        crash_if(crash_drill().1, self.flush_drill, CRASH_AFTER_FLUSH_ENV);
        self.flush_drill = 0;
        let durable = self.store.stored_offset();
        if durable != self.flushed_offset {
            self.flushed_offset = durable;
            if !self.changelog.gate {
                self.uncommitted = durable;
            }
        }
    }

    /// How long the next poll may wait for input: [`Task::wait_for_input`], and no longer
    /// than until the next flush is due while memory holds unflushed changes.
    fn poll_wait(&self, pause: Option<Duration>) -> Result<Duration, store::Error> {
        let wait = self.wait_for_input(pause)?;
        if self.store.write_in_flight() {
            // Its emissions are handed out (and its offset committed) once it is seen done.
            return Ok(wait.min(FEED_WAIT));
        }
        if self.store.unflushed() {
            let left = self
                .flush_interval_now(self.busy()?)
                .saturating_sub(self.flushed_at.elapsed());
            return Ok(wait.min(left));
        }
        Ok(wait)
    }

    /// The flush interval in force: `store.flush-interval`, or for a partition that owes
    /// emissions and is live (caught up, `busy` false, or its partition time within
    /// `idle-tick` of the wall clock: a batch behind on a live stream, not replaying a
    /// backlog), outside exactly-once mode, [`EMITTING_FLUSH_INTERVAL`] or
    /// [`EMITTING_FLUSH_COST_FACTOR`] times the last flush's write time if longer (never more
    /// than `store.flush-interval`).
    fn flush_interval_now(&self, busy: bool) -> Duration {
        let interval = self.ctx.settings.flush_interval;
        if (!busy || self.live()) && self.txn.is_none() && self.store.unflushed_emissions() > 0 {
            interval.min(EMITTING_FLUSH_INTERVAL.max(self.flush_took * EMITTING_FLUSH_COST_FACTOR))
        } else {
            interval
        }
    }

    /// True when partition time is within `idle-tick` of the wall clock: the records being
    /// applied are live ones (a replayed backlog's event times are behind the wall clock).
    fn live(&self) -> bool {
        let tick = self.ctx.settings.idle_tick.as_millis() as Millis;
        self.ctx.clock.now_ms().saturating_sub(self.clock.now()) <= tick
    }

    /// How long the next poll may wait for input, flushes aside.
    fn wait_for_input(&self, pause: Option<Duration>) -> Result<Duration, store::Error> {
        let tick = self.ctx.settings.idle_tick;
        if let Some(p) = pause {
            return Ok(p.min(tick));
        }
        // Owed emissions not handed over yet (the publisher's queue was full): come back as
        // soon as it has room, while it keeps acknowledging (not while the sink is down).
        if self.store.outbox_len() > self.feed.in_flight && self.feed.progress_at.elapsed() < tick {
            return Ok(tick.min(FEED_WAIT));
        }
        if !self.caught_up {
            return Ok(tick);
        }
        // Caught up: partition time follows the wall clock, so sleep until the next timer.
        Ok(match self.store.next_timer()? {
            Some((due, _)) => {
                let ms = (due - self.ctx.clock.now_ms()).clamp(0, tick.as_millis() as Millis);
                Duration::from_millis(ms as u64)
            }
            None => tick,
        })
    }

    /// Seeks the input to `next`, retrying while the error is retryable.
    async fn seek(&mut self, next: i64, cancel: &CancellationToken) -> Result<(), String> {
        let mut backoff = Backoff::new(Duration::from_secs(5));
        loop {
            match self.input.seek(next).await {
                Ok(()) => return Ok(()),
                Err(e) if e.is_retryable() && !cancel.is_cancelled() => {
                    match self.warn.seek.allow() {
                        Some(suppressed) => {
                            tracing::warn!(partition = self.partition(), error = %e, suppressed, "seek failed; retrying (logged at most every 10 s)")
                        }
                        None => {
                            tracing::debug!(partition = self.partition(), error = %e, "seek failed; retrying")
                        }
                    }
                    pause(cancel, backoff.next_delay()).await;
                }
                Err(e) => return Err(format!("seek: {e}")),
            }
        }
    }

    /// Decodes a polled batch into `held`; dead-letters bad records (awaited, retried while
    /// the sink is unavailable) before they count as applied.
    /// Returns `false` when stopped before the whole batch was decoded (the rest is dropped
    /// and read again after the next start).
    async fn decode(&mut self, records: Vec<InputRecord>, cancel: &CancellationToken) -> bool {
        let wall = self.ctx.clock.now_ms();
        for r in records {
            self.status.records += 1;
            if is_action(&r.payload) {
                match ActionRecord::decode(&r.payload) {
                    Ok(record) => self.held.push_back(Pending {
                        offset: r.offset,
                        upload: None,
                        action: Some(Box::new(HeldAction {
                            record,
                            at: r.timestamp_ms,
                            selected: None,
                        })),
                    }),
                    Err(e) => {
                        tracing::warn!(partition = self.partition(), offset = r.offset, error = %e, "operator action record cannot be applied: dead-lettered");
                        if !self.dead_letter(&r, e.reason(), cancel).await {
                            return false;
                        }
                        self.held.push_back(Pending {
                            offset: r.offset,
                            upload: None,
                            action: None,
                        });
                    }
                }
                continue;
            }
            let decoded = codec::decode_upload_with(
                self.input.key_rule(),
                r.key.as_deref(),
                &r.payload,
                r.timestamp_ms,
                wall,
            )
            .and_then(|u| self.check_partition(&r, u));
            let upload = match decoded {
                Ok(u) => Some(u),
                Err(e) => {
                    if !self.dead_letter(&r, e.reason(), cancel).await {
                        // Stopping while the dead-letter topic is unavailable: this record
                        // and the rest of the batch are not applied; they are read again
                        // after the next start.
                        return false;
                    }
                    None
                }
            };
            self.held.push_back(Pending {
                offset: r.offset,
                upload,
                action: None,
            });
        }
        true
    }

    /// `Err(WrongPartition)` when the transport fixes the partition of a key
    /// ([`PartitionInput::key_partition`], NATS) and `record`'s key belongs elsewhere
    /// (SEMANTICS §2); the upload otherwise. Only called on a decoded upload, whose session
    /// key is `tenant/session` (and equals the record key when there is one).
    fn check_partition(&self, record: &InputRecord, upload: Upload) -> Result<Upload, DecodeError> {
        match self.input.key_partition(upload.key.as_str().as_bytes()) {
            Some(expected) if expected != record.partition => Err(DecodeError::WrongPartition {
                partition: record.partition,
                expected,
            }),
            _ => Ok(upload),
        }
    }

    /// Sends `record` to the dead-letter topic; `false` if stopped before it was acknowledged.
    async fn dead_letter(
        &mut self,
        record: &InputRecord,
        reason: &str,
        cancel: &CancellationToken,
    ) -> bool {
        match self.warn.bad_record.allow() {
            Some(suppressed) => tracing::warn!(
                partition = self.partition(),
                offset = record.offset,
                reason,
                suppressed,
                "bad record: dead-lettered (logged at most every 10 s; each one is counted in settle_uploads_rejected_total)"
            ),
            None => tracing::debug!(
                partition = self.partition(),
                offset = record.offset,
                reason,
                "bad record: dead-lettered"
            ),
        }
        let mut backoff = Backoff::new(Duration::from_secs(5));
        loop {
            match self.ctx.sink.dead_letter(record, reason).await {
                Ok(()) => {
                    self.warn.dead_letter.clear();
                    self.status.dead_letters += 1;
                    self.metrics.rejected(reason);
                    return true;
                }
                Err(_) if cancel.is_cancelled() => return false,
                Err(e) => {
                    match self.warn.dead_letter.allow() {
                        Some(suppressed) => {
                            tracing::warn!(partition = self.partition(), error = %e, suppressed, "dead letter failed; retrying (logged at most every 10 s)")
                        }
                        None => {
                            tracing::debug!(partition = self.partition(), error = %e, "dead letter failed; retrying")
                        }
                    }
                    pause(cancel, backoff.next_delay()).await;
                }
            }
        }
    }

    /// When the next held record is a bulk action not selected yet: selects its sessions
    /// from the store (as of every record before it: they are committed).
    ///
    /// Errors: the store's.
    fn select_bulk(&mut self) -> Result<(), store::Error> {
        let Some(held) = self.held.front_mut().and_then(|p| p.action.as_mut()) else {
            return Ok(());
        };
        let Some(filter) = held
            .record
            .filter
            .as_ref()
            .filter(|_| held.selected.is_none())
        else {
            return Ok(());
        };
        let router = &self.ctx.tiers.router;
        let in_tier = |tenant: &str| {
            filter
                .tier
                .as_deref()
                .is_none_or(|t| router.lock().tier_of(tenant) == t)
        };
        let limit = held.record.bulk_limit() as usize;
        held.selected = Some(actions::select(
            &mut self.store,
            self.driver.engine(),
            self.status.partition,
            filter,
            in_tier,
            limit,
        )?);
        Ok(())
    }

    /// Publishes the audit records of the actions applied, once the flush holding them is
    /// durable (the caller flushed): to the audit topic when there is one, retried in the
    /// background for a while (an audit record that cannot be published is logged).
    fn publish_audit(&mut self) {
        for record in self.audit_owed.drain(..) {
            let outcome: Option<ActionOutcome> = serde_json::from_value(record.result.clone()).ok();
            if let Some(o) = &outcome {
                let result = if o.duplicate {
                    "duplicate"
                } else {
                    o.result.as_str()
                };
                self.metrics.action(&record.action, result);
            }
            tracing::info!(
                partition = self.status.partition,
                request_id = %record.request_id,
                action = %record.action,
                who = %record.who,
                reason = %record.reason,
                result = %outcome.as_ref().map_or("", |o| o.result.as_str()),
                sessions = outcome.as_ref().map_or(0, |o| o.sessions),
                uploads = outcome.as_ref().map_or(0, |o| o.uploads),
                "operator action applied"
            );
            let Some(topic) = self.ctx.actions.topic.clone() else {
                continue;
            };
            let message = transport::ReadyMessage {
                topic,
                tier: "audit".to_owned(),
                key: record.request_id.clone(),
                emission_id: format!(
                    "{}/{}/{}",
                    record.request_id,
                    self.status.partition,
                    outcome.as_ref().map_or(0, |o| o.offset)
                ),
                payload: record.encode(),
                partition: Some(self.status.partition),
            };
            let sink = self.ctx.sink.clone();
            tokio::spawn(async move {
                let mut backoff = Backoff::new(Duration::from_secs(5));
                for _ in 0..AUDIT_PUBLISH_TRIES {
                    match sink.publish(message.clone()).await {
                        Ok(()) => return,
                        Err(e) => {
                            tracing::debug!(error = %e, "audit record not published yet; retrying");
                            tokio::time::sleep(backoff.next_delay()).await;
                        }
                    }
                }
                tracing::error!(request_id = %message.key, topic = %message.topic, "audit record not published after {AUDIT_PUBLISH_TRIES} tries: the action was applied; its outcome is in this log");
            });
        }
    }

    /// One store batch: apply held records and fire due timers (paced), commit.
    fn step(&mut self) -> Result<StepReport, store::Error> {
        self.select_bulk()?;
        let wall = self.ctx.clock.now_ms();
        let grace = self.ctx.settings.idle_tick.as_millis() as Millis;
        let mut budget = self.ctx.settings.batch_size.max(1);
        let mut out: Vec<Emission> = Vec::new();
        let mut report = StepReport::default();
        let mut applied: Option<i64> = None;
        let mut applied_records = 0u64;
        let mut fired = 0usize;

        // Shadow policies see the uploads applied here, at the same partition time.
        let mut shadows = self.shadow.as_ref().map(|h| h.lock());
        let mut batch = self.store.batch();
        // The uploads this step may apply: their entries' lookups, overlapped up front.
        batch.warm(
            (self.held.iter().take(budget)).filter_map(|h| h.upload.as_ref().map(|u| &u.key)),
        );
        let mut fire = FireCtx {
            driver: &mut self.driver,
            pacer: &mut self.pacer,
            queue: &mut self.catch_up,
            overdue_before: wall.saturating_sub(grace).min(self.started_at),
            budget: &mut budget,
            fired: &mut fired,
            prefetched: false,
        };
        let partition = self.status.partition;
        while let Some(front) = self.held.front_mut() {
            if let Some(held) = &mut front.action {
                if held.record.filter.is_some() && held.selected.is_none() {
                    // A bulk action selects from the store as of the records before it:
                    // it starts the next step.
                    break;
                }
                let target = self.clock.now().max(held.at);
                if let Fired::Paused(d) = fire.fire_due(&mut batch, target, &mut out)? {
                    report.paused = Some(d);
                    break;
                }
                let now = self.clock.observe(held.at);
                let outcome = apply_action(
                    fire.driver,
                    &mut batch,
                    now,
                    partition,
                    front.offset,
                    held,
                    &self.ctx.actions,
                    &mut out,
                )?;
                self.audit_owed.push(outcome);
            }
            if let Some(upload) = &front.upload {
                let target = self.clock.now().max(upload.event_time);
                if let Fired::Paused(d) = fire.fire_due(&mut batch, target, &mut out)? {
                    report.paused = Some(d);
                    break;
                }
                let now = self.clock.observe(upload.event_time);
                let applied_as = fire.driver.apply(&mut batch, now, upload, &mut out)?;
                if let Some(set) = shadows.as_mut() {
                    set.apply(now, upload);
                }
                if applied_as == Applied::Redelivered {
                    tracing::debug!(partition = self.status.partition, key = %upload.key, "redelivered event_id ignored");
                }
            }
            applied = Some(front.offset);
            applied_records += 1;
            self.held.pop_front();
        }
        if report.paused.is_none() {
            if self.held.is_empty() && self.caught_up {
                self.clock.caught_up(wall);
            }
            if let Fired::Paused(d) = fire.fire_due(&mut batch, self.clock.now(), &mut out)? {
                report.paused = Some(d);
            }
        }

        if let Some(set) = shadows.as_mut() {
            set.advance(self.clock.now());
            if set.has_emissions(&out) {
                let router = self.ctx.tiers.router.lock();
                let tiers = self.ctx.tiers.router.tiers();
                let rules = self.driver.engine().policies();
                set.count(&out, |tenant| {
                    let tier = router.tier_of(tenant);
                    let tier = tiers.tiers().position(|(n, _)| n == tier).unwrap_or(0);
                    (tier, TenantClass::of(rules, tenant))
                });
            }
        }
        drop(shadows);
        if applied.is_none() && fired == 0 {
            // Nothing changed but (maybe) partition time; it is stored with the next change.
            return Ok(report);
        }
        for e in &out {
            batch.push_outbox(e)?;
        }
        if let Some(last) = applied {
            batch.set_offset(last + 1);
        }
        batch.set_partition_time(self.clock.now());
        batch.commit()?;
        self.metrics.consumed(applied_records);
        self.status.emissions += out.len() as u64;
        Ok(report)
    }

    /// Appends the store writes recorded since the last call to the changelog (when the
    /// sink has one and the partition is still owned) and collects finished appends.
    /// A fenced partition appends nothing: its store stays dirty, and is restored from the
    /// changelog if this process owns the partition again.
    ///
    /// Errors: a failed append (fatal for the partition: the changelog holds a prefix of
    /// this store's writes, which the next owner restores).
    fn ship_changes(&mut self) -> Result<(), String> {
        if !self.changelog.enabled {
            return Ok(());
        }
        let changes = self.store.take_changes();
        while let Some(front) = self.changelog.acks.front_mut() {
            match (&mut front.ack).now_or_never() {
                Some(Ok(next)) => {
                    let done = self.changelog.acks.pop_front().expect("front checked");
                    self.appended(next, &done);
                }
                Some(Err(e)) => return Err(self.changelog_failed(&e)),
                None => break,
            }
        }
        if changes.is_empty() || !self.fence.owned() {
            return Ok(());
        }
        let ack = self
            .ctx
            .sink
            .append_changes(self.status.partition, &changes)
            .map_err(|e| self.changelog_failed(&e))?;
        self.track_append(ack);
        Ok(())
    }

    /// Tracks an append just made: its acknowledgement makes what the store holds durable
    /// now (outbox entries, input offset) safe to publish and commit (`Changelog::gate`).
    fn track_append(&mut self, ack: BoxFuture<'static, Result<i64, transport::Error>>) {
        self.changelog.acks.push_back(Append {
            ack,
            outbox_below: self.store.durable_outbox_seq(),
            offset: self.flushed_offset,
            sent: Instant::now(),
        });
    }

    /// Compacts the changelog (`Sink::changelog_snapshot_due`; NATS, where the changelog
    /// holds batches that the server does not compact): flushes what memory owes and ships
    /// its changes, then appends the whole store (`PartitionStore::snapshot_changes`) with
    /// `Sink::append_snapshot`, which drops what lies before it once acknowledged. The
    /// append is tracked as any other (gating, checkpoint). The snapshot is built on this
    /// task (about 1 s per million stored keys; the input waits meanwhile).
    ///
    /// Errors: the store's, or a failed append (fatal for the partition, as in
    /// [`Task::ship_changes`]).
    fn snapshot_changelog(&mut self) -> Result<(), String> {
        let t = Instant::now();
        self.flush_if_due(true).map_err(fatal)?;
        self.ship_changes()?;
        let snapshot = self.store.snapshot_changes().map_err(fatal)?;
        // Nothing was owed after the flush above; should the snapshot's own flush have
        // recorded anything, it goes first (the same values as the snapshot's).
        self.ship_changes()?;
        if snapshot.is_empty() {
            return Ok(());
        }
        let ack = self
            .ctx
            .sink
            .append_snapshot(self.status.partition, &snapshot)
            .map_err(|e| self.changelog_failed(&e))?;
        self.track_append(ack);
        tracing::info!(
            partition = self.partition(),
            records = snapshot.len(),
            elapsed_ms = t.elapsed().as_millis() as u64,
            "changelog snapshot appended: the changelog is compacted below it once acknowledged"
        );
        Ok(())
    }

    /// The text a failed changelog append stops the partition with; a fence is logged as such
    /// and counted (`settle_partitions_fenced_total`): the partition belongs to another
    /// process now.
    fn changelog_failed(&self, e: &transport::Error) -> String {
        changelog_failed(&self.metrics, self.partition(), e)
    }

    /// An append was acknowledged: its offset is the changelog's, and (gated) the emissions
    /// and the input offset it holds may be published and committed now.
    fn appended(&mut self, next: i64, done: &Append) {
        appended(
            &mut self.changelog,
            &mut self.committable,
            &mut self.uncommitted,
            &self.metrics,
            next,
            done,
        );
    }

    /// Exactly-once: commits what the last store write did in one transaction: every owed
    /// emission (routed now, deleted from the outbox first so the transaction's changelog
    /// records hold the put and the delete), the recorded changelog records, and the input
    /// offset `next_offset`. Then the changelog checkpoint. Does nothing when the store
    /// recorded nothing.
    ///
    /// Errors: a failed transaction (fenced, aborted): fatal for the partition; the local
    /// store stays dirty and is restored from the committed changelog on the next start.
    async fn commit_transaction(&mut self, next_offset: Option<i64>) -> Result<(), String> {
        if self.store.pending_changes() == 0 && next_offset.is_none() {
            return Ok(());
        }
        if !self.fence.owned() {
            return Err("partition fenced: transaction not committed".into());
        }
        let owed = self.store.outbox_peek(usize::MAX).map_err(fatal)?;
        let now = self.ctx.clock.now_ms();
        let partition = self.partition();
        let seqs: Vec<u64> = owed.iter().map(|entry| entry.seq).collect();
        let messages: Vec<transport::ReadyMessage> = self
            .ctx
            .tiers
            .route_all(owed, now)
            .iter()
            .map(|routed| publisher::ready_message(routed, now, partition))
            .collect();
        if !seqs.is_empty() {
            self.store.outbox_ack(&seqs).map_err(fatal)?;
            // The deletes are written (and recorded) now, for this transaction.
            self.store.flush().map_err(fatal)?;
        }
        let changes = self.store.take_changes();
        let sent = messages.len() as u64;
        let txn = self.txn.as_mut().expect("checked by the caller");
        let next = txn
            .commit(messages, &changes, next_offset)
            .await
            .map_err(|e| format!("transaction: {e}"))?;
        self.status.published += sent;
        if let Some(next) = next {
            self.store.changelog_synced(next).map_err(fatal)?;
        }
        Ok(())
    }

    /// Writes the changelog checkpoint when every store write is acknowledged by the
    /// changelog (the store is clean again; see [`crate::store::changelog`]).
    fn sync_changelog(&mut self) -> Result<(), store::Error> {
        let cl = &mut self.changelog;
        cl.synced_at = Instant::now();
        if !cl.enabled || !cl.acks.is_empty() || self.store.pending_changes() > 0 {
            return Ok(());
        }
        match cl.acked {
            Some(next)
                if self.store.changelog_dirty()
                    || self.store.changelog_checkpoint() != Some(next) =>
            {
                self.store.changelog_synced(next)
            }
            _ => Ok(()),
        }
    }

    /// At stop: waits (until `deadline`) for every changelog append to be acknowledged,
    /// then writes the checkpoint. A fenced partition waits for nothing.
    async fn drain_changelog(&mut self, deadline: Instant) -> Result<(), String> {
        self.ship_changes()?;
        while let Some(front) = self.changelog.acks.front_mut() {
            if !self.fence.owned() {
                break;
            }
            match tokio::time::timeout_at(deadline, &mut front.ack).await {
                Ok(Ok(next)) => {
                    let done = self.changelog.acks.pop_front().expect("front checked");
                    self.appended(next, &done);
                }
                Ok(Err(e)) => return Err(self.changelog_failed(&e)),
                Err(_) => {
                    tracing::warn!(
                        partition = self.partition(),
                        appends = self.changelog.acks.len(),
                        "changelog appends not acknowledged before the deadline; the store stays dirty and is restored from the changelog if this instance owns the partition again"
                    );
                    return Ok(());
                }
            }
        }
        self.sync_changelog().map_err(fatal)
    }

    /// Deletes acknowledged emissions from the outbox.
    fn take_acks(&mut self) -> Result<(), store::Error> {
        let mut seqs = Vec::new();
        while let Ok(batch) = self.acks.try_recv() {
            seqs.extend(batch);
        }
        if seqs.is_empty() {
            return Ok(());
        }
        self.store.outbox_ack(&seqs)?;
        self.feed.progress_at = Instant::now();
        self.feed.in_flight = self.feed.in_flight.saturating_sub(seqs.len() as u64);
        self.status.published += seqs.len() as u64;
        Ok(())
    }

    /// Hands owed emissions not yet handed over to the publisher, as far as its queue has room.
    fn feed_publisher(&mut self) -> Result<(), store::Error> {
        feed(
            self.entries.as_ref(),
            &mut self.store,
            &self.changelog,
            &mut self.feed,
        )
    }

    fn refresh_status(&mut self) -> Result<(), store::Error> {
        let live = self.caught_up && self.held.is_empty();
        let s = &mut self.status;
        s.state = if live {
            PartitionState::Live
        } else {
            PartitionState::CatchingUp
        };
        s.caught_up = live;
        s.next_offset = self.store.stored_offset();
        s.partition_time = self.clock.now();
        s.lag = self
            .input
            .lag()
            .map(|lag| lag.saturating_add(self.held.len() as u64));
        if s.catch_up_from.is_none() {
            s.catch_up_from = s.lag;
        }
        s.pending_rounds = self.store.pending_rounds();
        s.outbox_len = self.store.outbox_len();
        s.next_due = self.store.next_timer()?.map(|(d, _)| d);
        self.ctx.status.set(s.clone());
        Ok(())
    }

    fn set_state(&mut self, state: PartitionState) {
        self.status.state = state;
        self.ctx.status.set(self.status.clone());
    }

    /// Commits the last durable offset to the source, if it has not been committed yet. A
    /// failed commit is only logged: the store keeps the offset, and the next commit (or the
    /// store, on the next start here) covers it.
    async fn commit_offset(&mut self) {
        let Some(next) = self.uncommitted.take() else {
            return;
        };
        if !self.fence.owned() {
            // Another member may own the partition already: its offsets are not ours to move.
            return;
        }
        self.committed_at = Instant::now();
        match self.input.commit(next).await {
            Ok(()) => {
                self.warn.commit.clear();
            }
            Err(e) => match self.warn.commit.allow() {
                Some(suppressed) => {
                    tracing::warn!(partition = self.partition(), error = %e, next_offset = next, suppressed, "offset commit failed; the store keeps the offset (logged at most every 10 s)")
                }
                None => {
                    tracing::debug!(partition = self.partition(), error = %e, next_offset = next, "offset commit failed")
                }
            },
        }
    }

    /// After cancellation: commit the offset, drain the outbox until the flush deadline,
    /// close the store.
    async fn finish(&mut self) -> PartitionExit {
        // What the last steps committed to memory becomes durable (and, exactly-once, one
        // last transaction) before the offset is committed.
        let deadline = Instant::now() + self.ctx.settings.flush_timeout;
        if self.fence.owned() {
            if let Err(e) = self.flush_if_due(true) {
                return PartitionExit::Failed(fatal(e));
            }
            if self.txn.is_some() {
                let next = self.uncommitted.take();
                if let Err(reason) = self.commit_transaction(next).await {
                    return PartitionExit::Failed(reason);
                }
            }
            if self.changelog.gate {
                // The last writes into the changelog first: only then may their emissions be
                // published and their input acked.
                if let Err(reason) = self.drain_changelog(deadline).await {
                    return PartitionExit::Failed(reason);
                }
            }
        }
        self.commit_offset().await;
        loop {
            if !self.fence.owned() {
                // Lost, not handed back: the next owner publishes what is owed.
                break;
            }
            if let Err(e) = self.take_acks().and_then(|()| self.feed_publisher()) {
                return PartitionExit::Failed(fatal(e));
            }
            if self.store.outbox_len() == 0 {
                break;
            }
            match tokio::time::timeout_at(deadline, self.acks.recv()).await {
                Ok(Some(seqs)) => {
                    if let Err(e) = self.store.outbox_ack(&seqs) {
                        return PartitionExit::Failed(fatal(e));
                    }
                    self.feed.in_flight = self.feed.in_flight.saturating_sub(seqs.len() as u64);
                    self.status.published += seqs.len() as u64;
                }
                Ok(None) | Err(_) => break,
            }
        }
        if self.txn.is_none() && self.fence.owned() {
            // The deletes of what was acknowledged while draining.
            if let Err(e) = self.flush_if_due(true) {
                return PartitionExit::Failed(fatal(e));
            }
        }
        if let Err(reason) = self.drain_changelog(deadline).await {
            return PartitionExit::Failed(reason);
        }
        let flushed = self.store.outbox_len() == 0;
        if !flushed && self.fence.owned() {
            tracing::warn!(
                partition = self.partition(),
                owed = self.store.outbox_len(),
                "outbox not drained before the deadline; it is published after the next start"
            );
        }
        let _ = self.refresh_status();
        if let Err(e) = self.store.flush_memtables() {
            return PartitionExit::Failed(fatal(e));
        }
        PartitionExit::Stopped { flushed }
    }
}

/// Sleeps `d` or until `cancel` fires.
/// A failed changelog append as the partition's fatal error (a fence is counted and logged).
fn changelog_failed(metrics: &PartitionMetrics, partition: i32, e: &transport::Error) -> String {
    if matches!(e, transport::Error::Fenced { .. }) {
        metrics.fenced();
        tracing::error!(
            partition,
            error = %e,
            "partition fenced by its changelog: this instance stops publishing, appending and acking input for it; the other owner continues it"
        );
    }
    format!("changelog: {e}")
}

/// The oldest append's acknowledgement; pending while none is in flight. Cancel-safe: the
/// append's future stays in `acks` until it is popped.
async fn changelog_ack(acks: &mut VecDeque<Append>) -> Result<i64, transport::Error> {
    match acks.front_mut() {
        Some(a) => (&mut a.ack).await,
        None => std::future::pending().await,
    }
}

/// What the partition task knows of the publisher's intake (`feed`).
struct Feed {
    /// Outbox sequence numbers below this were handed to the publisher.
    publish_from: u64,
    /// Handed to the publisher and not acknowledged yet.
    in_flight: u64,
    /// When the publisher last took an entry or acknowledged one.
    progress_at: Instant,
}

/// Hands owed emissions not yet handed over to the publisher (`entries`), as far as its
/// queue has room and (gated) the changelog has acknowledged them (`Task::feed_publisher`).
/// Over the task's fields, so the poll's wait can feed without giving up the poll.
fn feed(
    entries: Option<&mpsc::Sender<store::OutboxEntry>>,
    store: &mut PartitionStore,
    changelog: &Changelog,
    f: &mut Feed,
) -> Result<(), store::Error> {
    let Some(tx) = entries else {
        return Ok(());
    };
    let room = tx.capacity();
    if room == 0 || store.outbox_len() <= f.in_flight {
        return Ok(());
    }
    let below = if changelog.gate {
        changelog.publishable_below
    } else {
        u64::MAX
    };
    let in_flight = f.in_flight;
    for entry in store.outbox_peek_from(f.publish_from, room)? {
        if entry.seq >= below {
            // Not in an acknowledged changelog append yet (`Changelog::gate`).
            break;
        }
        f.publish_from = entry.seq + 1;
        // Room was checked and only this task sends, so `try_send` fails only if the
        // publisher is gone (aborted at stop); the entry stays in the outbox then.
        if tx.try_send(entry).is_err() {
            break;
        }
        f.in_flight += 1;
    }
    if f.in_flight > in_flight {
        // One clock read for the entries handed over together.
        f.progress_at = Instant::now();
    }
    Ok(())
}

/// An append was acknowledged (`Task::appended`): the changelog's offset, and (gated) the
/// emissions and input offset it makes publishable and committable. Over the task's fields,
/// so the poll's wait can take an ack without giving up the poll.
fn appended(
    cl: &mut Changelog,
    committable: &mut Option<i64>,
    uncommitted: &mut Option<i64>,
    metrics: &PartitionMetrics,
    next: i64,
    done: &Append,
) {
    metrics.changelog_append(done.sent.elapsed());
    cl.acked = Some(next);
    if cl.gate {
        cl.publishable_below = cl.publishable_below.max(done.outbox_below);
        if done.offset.is_some() && done.offset != *committable {
            *committable = done.offset;
            *uncommitted = done.offset;
        }
    }
}

async fn pause(cancel: &CancellationToken, d: Duration) {
    tokio::select! {
        () = cancel.cancelled() => {}
        () = tokio::time::sleep(d) => {}
    }
}

/// Fires due timers for one step, pacing the overdue ones and releasing them tenants in
/// turn (module docs, "Catch-up pacing").
struct FireCtx<'a> {
    driver: &'a mut Driver,
    pacer: &'a mut CatchUpPacer,
    /// The order in which overdue timers fire: tenants in turn.
    queue: &'a mut CatchUpQueue,
    /// Timers due before this (ms) are overdue: paced, and released tenants in turn.
    overdue_before: Millis,
    /// Timer fires left in this step.
    budget: &'a mut usize,
    fired: &'a mut usize,
    /// The queue's next timers of this step were read from the store in one multi-get
    /// ([`Batch::prefetch`]).
    prefetched: bool,
}

impl FireCtx<'_> {
    fn fire_due(
        &mut self,
        batch: &mut Batch<'_>,
        target: Millis,
        out: &mut Vec<Emission>,
    ) -> Result<Fired, store::Error> {
        loop {
            let Some(first) = batch.first_due(target)? else {
                return Ok(Fired::All);
            };
            let due = first.0;
            if *self.budget == 0 {
                return Ok(Fired::Paused(Duration::ZERO));
            }
            let overdue = due < self.overdue_before;
            if overdue {
                if let Err(wait) = self.pacer.ready() {
                    return Ok(Fired::Paused(wait));
                }
            }
            let before = out.len();
            if !overdue || !self.fire_in_turn(batch, &first, target, out)? {
                self.driver.advance_at_most(batch, target, 1, out)?;
            }
            if overdue {
                self.pacer.spend(out.len() - before);
            }
            *self.budget -= 1;
            *self.fired += 1;
        }
    }

    /// Fires the overdue timer whose tenant's turn it is ([`CatchUpQueue::next`]), loading
    /// the queue from the batch's overdue timers first when it asks for it. Returns `false`
    /// when no queued timer is due at `target` (the caller fires in `(due, key)` order).
    fn fire_in_turn(
        &mut self,
        batch: &mut Batch<'_>,
        first: &(Millis, SessionKey),
        target: Millis,
        out: &mut Vec<Emission>,
    ) -> Result<bool, store::Error> {
        if self.queue.needs_load() {
            // Only what is overdue and due at `target`: a replayed backlog's later timers
            // are not due yet (partition time is behind the wall clock).
            let before = self.overdue_before.min(target.saturating_add(1));
            if self.queue.is_empty()
                && !batch.timers_due_before_at_least(first, before, catch_up::MIN_QUEUED)
            {
                return Ok(false);
            }
            self.queue
                .load(batch.overdue_timers(before, catch_up::PER_TENANT)?);
            self.prefetched = false;
        }
        if !self.prefetched {
            // The keys this step will fire, read in one sorted multi-get rather than one
            // point read each (evicted sessions: a replayed backlog's state expiries).
            self.prefetched = true;
            batch.prefetch(self.queue.upcoming(*self.budget))?;
        }
        while let Some((due, key)) = self.queue.next(batch, target)? {
            if self.driver.fire_timer(batch, due, &key, out)? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}
