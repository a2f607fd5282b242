//! The runtime: one tokio task per owned partition (see [`partition`]), a supervisor that
//! starts and stops them as the [`Source`] assigns and revokes partitions, and shutdown.
//!
//! # Ownership
//!
//! A partition task owns its RocksDB [`PartitionStore`](crate::store::PartitionStore), its
//! partition clock, its input handle and its outbox publisher; other tasks never touch them
//! (STYLE §2). The supervisor holds only each task's cancellation token and join handle.
//! The shared mutable things are the status board (each task writes its own entry, see
//! [`status`]) and the process's one tier router (see below).
//!
//! # Tiers (SEMANTICS §5)
//!
//! [`Runtime::new`] builds one [`Router`] from `RuntimeOptions::tiers` and shares it
//! ([`SharedRouter`], [`Runtime::router`]) with every partition's outbox publisher, so a
//! tenant's rate is counted over all the partitions this process owns. Each publisher routes
//! each emission once (tier and topic, see [`publisher`]); the tier-events task
//! ([`tier_events`]) sweeps the router about once per second, publishes tier changes to
//! `tiers.events-topic` through the same sink and keeps `<data-dir>/tiers.json` for
//! `settle inspect`.
//!
//! # Clock
//!
//! Wall-clock time comes from a [`Clock`] ([`SystemClock`] in production, [`TokioClock`]
//! in tests with paused tokio time); partition time is a [`PartitionClock`] per task.
//!
//! # Shutdown
//!
//! One [`CancellationToken`] stops everything: the supervisor stops taking assignment
//! events and cancels every partition task; each stops fetching, finishes its step, waits
//! for its outbox to drain (up to three quarters of `shutdown-deadline`), closes its store.
//! The supervisor waits for them up to `shutdown-deadline` and aborts what is left (the
//! stores are consistent at every commit, so an abort loses nothing committed). Then the
//! tier-events task publishes the tier changes still owed within what is left of the
//! deadline (at most a quarter of it) and writes `tiers.json` a last time.
//! `settle run` and `run-file` cancel the token on the first SIGINT/SIGTERM and exit the
//! process at once on the second (`crate::service::signals`). A revocation stops the revoked partitions the same way
//! before the source is told they are done.

pub mod actions;
pub mod catch_up;
pub mod clock;
pub mod lease;
pub mod lookup;
pub mod overrides;
pub mod pacer;
pub mod partition;
pub mod pending;
pub mod progress;
pub mod publisher;
pub mod restore;
pub mod rules;
pub mod shadow;
pub mod status;
pub mod throttle;
pub mod tier_events;
pub mod tier_share;

pub use actions::ActionLog;
pub use catch_up::CatchUpQueue;
pub use clock::{Clock, PartitionClock, SystemClock, TokioClock};
pub use lookup::{Lookup, SessionLookup, SessionView};
pub use overrides::{Override, OverrideError, OverrideSet, Overrides, Written};
pub use pacer::CatchUpPacer;
pub use partition::{PartitionContext, PartitionExit, PartitionSettings};
pub use publisher::{Fence, PublishTarget, TierRouting};
pub use rules::Rules;
pub use shadow::{ShadowBoard, ShadowSnapshot};
pub use status::{PartitionState, PartitionStatus, StatusBoard, StatusMap};
pub use tier_events::{read_snapshot, TierSnapshot, TIERS_FILE};

use crate::config::Config;
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::store::{self, MemoryBudget, StoreOptions};
use crate::tiers::{Router, SharedRouter, TierChange, TiersConfig};
use crate::transport::{
    self, Backoff, OverrideStore, PartitionInput, Sink, Source, SourceEvent, TierCounts,
};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Settings of the runtime (from `[store]`, `[runtime]` and `[tiers]` of the config).
#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    /// `store.data-dir`: partition stores live at `<data-dir>/<topic>/<partition>`.
    pub data_dir: PathBuf,
    /// RocksDB sizes and durability; one [`MemoryBudget`] is shared by all partitions.
    pub store: StoreOptions,
    /// `store.flush-interval`: longest time a partition's committed changes wait in memory
    /// before they are written to its store (write-behind).
    pub flush_interval: Duration,
    /// `store.flush-max-dirty`: a partition flushes at once when this many keys changed.
    pub flush_max_dirty: usize,
    /// `[tiers]`: the tier topics, the events topic and the demotion rule (SEMANTICS §5).
    /// Each emission goes to its tenant's tier topic.
    pub tiers: TiersConfig,
    /// `runtime.batch-size`: most records per poll and per store write (≥ 1).
    pub batch_size: usize,
    /// `runtime.idle-tick`: longest poll wait; lateness above which a timer due before the
    /// partition's task started is overdue and paced by `catch-up-rate`.
    pub idle_tick: Duration,
    /// `runtime.catch-up-rate`: overdue emissions released per second, per partition
    /// (0 = unlimited).
    pub catch_up_rate: u32,
    /// `runtime.shutdown-deadline`: how long a graceful stop may take.
    pub shutdown_deadline: Duration,
    /// Most publishes in flight per partition (≥ 1).
    pub publish_window: usize,
    /// Liveness lease (`runtime::lease`): a process paused longer than this fences every
    /// partition and stops with [`Error::Paused`]. `None`: no lease (static ownership).
    /// `settle run` on Kafka sets two thirds of `session.timeout.ms`.
    pub lease: Option<Duration>,
}

impl RuntimeOptions {
    /// The `[store]`, `[runtime]` and `[tiers]` sections of `config`, publish window 256,
    /// default store tuning.
    pub fn from_config(config: &Config) -> Self {
        let r = &config.runtime;
        RuntimeOptions {
            data_dir: config.store.data_dir.clone(),
            store: StoreOptions {
                session_cache_bytes: config.store.session_cache_mib as usize * 1024 * 1024,
                ..StoreOptions::default()
            },
            flush_interval: config.store.flush_interval,
            flush_max_dirty: config.store.flush_max_dirty as usize,
            tiers: config.tiers.clone(),
            batch_size: r.batch_size as usize,
            idle_tick: r.idle_tick,
            catch_up_rate: r.catch_up_rate,
            shutdown_deadline: r.shutdown_deadline,
            publish_window: 256,
            lease: None,
        }
    }

    fn partition_settings(&self) -> PartitionSettings {
        PartitionSettings {
            batch_size: self.batch_size.max(1),
            idle_tick: self.idle_tick.max(Duration::from_millis(1)),
            flush_timeout: self.shutdown_deadline * 3 / 4,
            publish: PublishTarget {
                window: self.publish_window.max(1),
                max_backoff: Duration::from_secs(5),
            },
            catch_up_rate: self.catch_up_rate,
            flush_interval: self.flush_interval,
            flush_max_dirty: self.flush_max_dirty.max(1),
        }
    }
}

/// How a runtime run ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// How each partition task ended (the last task of each partition number).
    pub partitions: BTreeMap<i32, PartitionExit>,
}

impl RunSummary {
    /// Partitions that stopped on a fatal error, with the reason.
    pub fn failed(&self) -> Vec<(i32, &str)> {
        self.partitions
            .iter()
            .filter_map(|(p, e)| match e {
                PartitionExit::Failed(r) => Some((*p, r.as_str())),
                PartitionExit::Stopped { .. } => None,
            })
            .collect()
    }
}

/// Why [`Runtime::run`] failed as a whole.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The source failed with a non-retryable error; every partition was stopped.
    #[error("source failed: {0}")]
    Source(#[from] transport::Error),
    /// `RuntimeOptions::tiers` is invalid (the message names the `tiers.` key).
    #[error("{0}")]
    Tiers(#[from] crate::tiers::ConfigError),
    /// The process was paused longer than its liveness lease: its partitions may belong to
    /// another instance now; every partition was fenced and stopped (`runtime::lease`).
    #[error("the process was paused for {paused:?}, longer than its {lease:?} lease: every partition was fenced and stopped (restart it; the group reassigns the partitions)")]
    Paused {
        /// How long the pause was.
        paused: Duration,
        /// The lease.
        lease: Duration,
    },
    /// The liveness thread could not be started.
    #[error("cannot start the liveness thread: {0}")]
    Liveness(String),
}

struct Running {
    cancel: CancellationToken,
    fence: Fence,
    join: JoinHandle<PartitionExit>,
}

/// The runtime of one process: engine, sink, clock, options and the tier router;
/// [`Runtime::run`] drives a source until shutdown.
pub struct Runtime<K, C> {
    ctx: PartitionContext<K, C>,
    /// The liveness lease, started with the runtime when `RuntimeOptions::lease` is set.
    liveness: Option<lease::Liveness>,
    options: RuntimeOptions,
    budget: MemoryBudget,
    /// Receiving end of the publishers' tier changes, for the tier-events task.
    tier_changes: mpsc::UnboundedReceiver<TierChange>,
    /// Where the instances exchange their tier counts ([`Runtime::with_tier_counts`]).
    tier_counts: Option<Arc<dyn TierCounts>>,
    /// The tenant overrides ([`Runtime::with_overrides`]; off without a store).
    overrides: Overrides,
}

impl<K: Sink, C: Clock> Runtime<K, C> {
    /// A runtime publishing to `sink` (ready records to the tier topics of `options.tiers`,
    /// tier changes to its events topic), reading wall-clock time from `clock`.
    ///
    /// Errors: [`Error::Tiers`] when `options.tiers` fails [`TiersConfig::validate`].
    pub fn new(engine: Engine, sink: K, clock: C, options: RuntimeOptions) -> Result<Self, Error> {
        let budget = MemoryBudget::new(&options.store);
        let router = SharedRouter::new(Router::new(&options.tiers)?);
        let (tiers, tier_changes) = TierRouting::new(router);
        let liveness = options
            .lease
            .map(lease::Liveness::start)
            .transpose()
            .map_err(|e| Error::Liveness(e.to_string()))?;
        let rules = Rules::new(engine);
        let wall = clock.clone();
        let metrics = Metrics::new();
        let overrides = Overrides::new(overrides::OverridesSetup {
            store: None,
            rules: rules.clone(),
            router: tiers.router.clone(),
            metrics: metrics.clone(),
            wall: Arc::new(move || wall.now_ms()),
            instance: String::new(),
            audit: None,
        });
        Ok(Runtime {
            liveness,
            overrides,
            ctx: PartitionContext {
                rules,
                sink,
                clock,
                tiers,
                settings: Arc::new(options.partition_settings()),
                status: StatusBoard::new(),
                metrics,
                sessions: SessionLookup::new(),
                actions: ActionLog::default(),
                shadows: ShadowBoard::default(),
            },
            options,
            budget,
            tier_changes,
            tier_counts: None,
        })
    }

    /// Shares this instance's tier counts with the other instances of the deployment through
    /// `counts`, under the name `instance` (SEMANTICS §5; `tier_share`): at start the tier
    /// state is restored from the log before any partition runs, then the counts are
    /// exchanged every `tiers.share-interval`, so a tenant's rate is the deployment's.
    /// `instance` must be unique among the live instances.
    pub fn with_tier_counts(mut self, counts: Arc<dyn TierCounts>, instance: &str) -> Self {
        self.ctx.tiers.router.lock().set_instance(instance);
        self.tier_counts = Some(counts);
        self
    }

    /// Records applied operator actions in `log` (SEMANTICS §7): their audit records are
    /// published to `log.topic` when it is set, written as `log.instance`.
    pub fn with_actions(mut self, log: ActionLog) -> Self {
        self.ctx.actions = log;
        self
    }

    /// Takes tenant overrides from `store` (SEMANTICS §7; `overrides`): read to its end
    /// before the partitions start (at most `overrides::RESTORE_TIMEOUT`), then followed;
    /// each override is put in force over the rules the runtime was built with (the
    /// config's). Expiries are audited on the audit topic of the action log (call
    /// [`Runtime::with_actions`] first).
    pub fn with_overrides(mut self, store: Arc<dyn OverrideStore>) -> Self {
        let wall = self.ctx.clock.clone();
        let (sink, log) = (self.ctx.sink.clone(), self.ctx.actions.clone());
        let audit: overrides::AuditFn = Arc::new(move |record| {
            log.add(record.clone());
            let Some(topic) = log.topic.clone() else {
                return;
            };
            let message = transport::ReadyMessage {
                topic,
                tier: "audit".to_owned(),
                key: record.request_id.clone(),
                emission_id: format!(
                    "{}/{}/{}",
                    record.request_id, record.action, record.instance
                ),
                payload: record.encode(),
                partition: None,
            };
            let sink = sink.clone();
            tokio::spawn(async move {
                if let Err(e) = sink.publish(message).await {
                    tracing::warn!(error = %e, "override audit record not published");
                }
            });
        });
        self.overrides = Overrides::new(overrides::OverridesSetup {
            store: Some(store),
            rules: self.ctx.rules.clone(),
            router: self.ctx.tiers.router.clone(),
            metrics: self.ctx.metrics.clone(),
            wall: Arc::new(move || wall.now_ms()),
            instance: self.ctx.actions.instance.clone(),
            audit: Some(audit),
        });
        self
    }

    /// Runs the shadow policies `specs` beside the live one in every partition task
    /// (SEMANTICS §8; `[[shadow]]`, `Config::shadow_specs`), emitting nothing. Empty: off
    /// (the default), and the partitions' steps pay nothing for them.
    pub fn with_shadows(mut self, specs: Vec<crate::engine::ShadowSpec>) -> Self {
        self.ctx.shadows = ShadowBoard::new(specs);
        self
    }

    /// The shadow policies' figures (clone it before `run`): `GET /v1/shadow`, the
    /// `settle_shadow_*` metrics, `settle run-file`.
    pub fn shadows(&self) -> ShadowBoard {
        self.ctx.shadows.clone()
    }

    /// The tenant overrides (clone it before `run`): the admin API reads and writes them.
    pub fn overrides(&self) -> Overrides {
        self.overrides.clone()
    }

    /// The log of operator actions (clone it before `run`): the admin API waits on it for
    /// outcomes.
    pub fn actions(&self) -> ActionLog {
        self.ctx.actions.clone()
    }

    /// The debounce rules in force (clone it before `run`): setting new ones applies them
    /// in every partition task from its next loop turn on (SEMANTICS §7).
    pub fn rules(&self) -> Rules {
        self.ctx.rules.clone()
    }

    /// The status board the partition tasks write (clone it before `run`).
    pub fn status(&self) -> StatusBoard {
        self.ctx.status.clone()
    }

    /// The memory budget shared by this runtime's partition stores (clone it before `run`):
    /// block cache, memtable and session-cache usage in bytes.
    pub fn memory(&self) -> MemoryBudget {
        self.budget.clone()
    }

    /// The process's tier router (clone it before `run`): tiers, rates, demoted tenants and
    /// counters (SEMANTICS §5).
    pub fn router(&self) -> SharedRouter {
        self.ctx.tiers.router.clone()
    }

    /// This runtime's metrics (its own registry; clone it before `run`).
    pub fn metrics(&self) -> Metrics {
        self.ctx.metrics.clone()
    }

    /// The session query channels of the partition tasks (clone it before `run`), for the
    /// admin endpoint `GET /v1/sessions/{tenant}/{session}`.
    pub fn sessions(&self) -> SessionLookup {
        self.ctx.sessions.clone()
    }

    /// The liveness lease, if the options set one (for crash drills: clone it before `run`).
    pub fn liveness(&self) -> Option<lease::Liveness> {
        self.liveness.clone()
    }

    /// The wall clock the runtime reads.
    pub fn clock(&self) -> C {
        self.ctx.clock.clone()
    }

    /// The options the runtime was built with.
    pub fn options(&self) -> &RuntimeOptions {
        &self.options
    }

    /// Runs until `shutdown` is cancelled: starts a partition task for each assigned
    /// partition, stops revoked ones before acknowledging the revocation, then stops all
    /// within `shutdown-deadline`. A partition that fails stays failed (visible in
    /// [`Runtime::status`] and in the summary) while the others go on.
    ///
    /// Errors: [`Error::Source`] when the source fails with a non-retryable error.
    pub async fn run<S: Source>(
        mut self,
        mut source: S,
        shutdown: CancellationToken,
    ) -> Result<RunSummary, Error> {
        let tiers_stop = CancellationToken::new();
        let (_, idle) = mpsc::unbounded_channel();
        let tiers_task = tokio::spawn(tier_events::run(
            tier_events::TierEventsSetup {
                router: self.ctx.tiers.router.clone(),
                config: self.options.tiers.clone(),
                data_dir: self.options.data_dir.clone(),
                // `run` consumes the runtime: the receiver is taken exactly once.
                changes: std::mem::replace(&mut self.tier_changes, idle),
                // Partitions flush within 3/4 of the deadline (`PartitionSettings`).
                flush_timeout: self.options.shutdown_deadline / 4,
            },
            self.ctx.sink.clone(),
            self.ctx.clock.clone(),
            tiers_stop.clone(),
        ));
        let share_stop = CancellationToken::new();
        let share_task = match self.tier_counts.clone() {
            Some(counts) => {
                let changes = self.ctx.tiers.changes.clone();
                let router = self.ctx.tiers.router.clone();
                tokio::select! {
                    () = shutdown.cancelled() => {}
                    _ = tier_share::restore(&router, &*counts, &self.ctx.clock, &changes) => {}
                }
                Some(tokio::spawn(tier_share::run(
                    tier_share::TierShareSetup {
                        router,
                        counts,
                        interval: self.options.tiers.share_interval,
                        changes,
                    },
                    self.ctx.clock.clone(),
                    share_stop.clone(),
                )))
            }
            None => None,
        };
        // The overrides before any partition: the first upload applied is timed by them.
        let overrides_stop = CancellationToken::new();
        let (ready, restored) = tokio::sync::oneshot::channel();
        let overrides_task = tokio::spawn(overrides::run(
            self.overrides.clone(),
            ready,
            overrides_stop.clone(),
        ));
        tokio::select! {
            () = shutdown.cancelled() => {}
            _ = restored => {}
            () = tokio::time::sleep(overrides::RESTORE_TIMEOUT) => {
                tracing::warn!(store = ?self.overrides.store_name(), "tenant overrides not read within {:?}: starting without them; they apply once read", overrides::RESTORE_TIMEOUT);
            }
        }
        let mut running: HashMap<i32, Running> = HashMap::new();
        let mut summary = RunSummary::default();
        let mut backoff = Backoff::new(Duration::from_secs(5));
        let mut source_warn = throttle::LogThrottle::default();
        let mut source_open = true;
        let liveness = self.liveness.clone();
        let result = loop {
            let event = tokio::select! {
                biased;
                () = shutdown.cancelled() => break Ok(()),
                () = expired(&liveness) => {
                    let paused = liveness.as_ref().and_then(lease::Liveness::paused_for).unwrap_or_default();
                    let lease = self.options.lease.unwrap_or_default();
                    tracing::error!(
                        paused_ms = paused.as_millis() as u64,
                        lease_ms = lease.as_millis() as u64,
                        "the process was paused longer than its lease: its partitions may belong to another instance now; every partition is fenced, stopping"
                    );
                    break Err(Error::Paused { paused, lease });
                }
                ev = source.next_event(), if source_open => ev.map_err(Error::from),
            };
            match event {
                Ok(Some(SourceEvent::Assigned(inputs))) => {
                    backoff.reset();
                    source_warn.clear();
                    let partitions: Vec<i32> = inputs.iter().map(|i| i.partition()).collect();
                    tracing::info!(?partitions, "partitions assigned");
                    for input in inputs {
                        let p = input.partition();
                        if let Some(old) = running.remove(&p) {
                            let exits = self.stop(vec![(p, old)]).await;
                            summary.partitions.extend(exits);
                        }
                        running.insert(p, self.spawn(input));
                    }
                }
                Ok(Some(SourceEvent::Revoked {
                    partitions,
                    lost,
                    done,
                })) => {
                    backoff.reset();
                    let stopping: Vec<(i32, Running)> = partitions
                        .iter()
                        .filter_map(|p| running.remove(p).map(|r| (*p, r)))
                        .collect();
                    if lost {
                        // Another member may own them already: fence first, then stop.
                        for (_, r) in &stopping {
                            r.fence.revoke();
                        }
                    }
                    summary.partitions.extend(self.stop(stopping).await);
                    tracing::info!(
                        ?partitions,
                        lost,
                        revoked_at_ms = self.ctx.clock.now_ms(),
                        "partitions revoked"
                    );
                    let _ = done.send(());
                }
                Ok(None) => {
                    tracing::info!("source ended; running until shutdown");
                    source_open = false;
                }
                Err(Error::Source(e)) if e.is_retryable() => {
                    match source_warn.allow() {
                        Some(suppressed) => {
                            tracing::warn!(error = %e, suppressed, "source unavailable; retrying (logged at most every 10 s)")
                        }
                        None => tracing::debug!(error = %e, "source unavailable; retrying"),
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => {}
                        () = tokio::time::sleep(backoff.next_delay()) => {}
                    }
                }
                Err(e) => break Err(e),
            }
        };
        let stopping = tokio::time::Instant::now();
        summary
            .partitions
            .extend(self.stop(running.drain().collect()).await);
        // After the partitions (their last emissions may still have changed a tier), within
        // what is left of the shutdown deadline.
        tiers_stop.cancel();
        share_stop.cancel();
        overrides_stop.cancel();
        overrides_task.abort();
        let abort = tiers_task.abort_handle();
        let deadline = stopping + self.options.shutdown_deadline;
        if let Some(task) = share_task {
            let abort = task.abort_handle();
            if tokio::time::timeout_at(deadline, task).await.is_err() {
                abort.abort();
            }
        }
        if tokio::time::timeout_at(deadline, tiers_task).await.is_err() {
            abort.abort();
        }
        if let Some(l) = &self.liveness {
            l.stop();
        }
        result.map(|()| summary)
    }

    fn spawn<I: PartitionInput>(&self, input: I) -> Running {
        let cancel = CancellationToken::new();
        let partition = input.partition();
        let fence = Fence::with_liveness(partition, self.liveness.clone());
        let task_fence = fence.clone();
        let path = store::partition_path(&self.options.data_dir, input.topic(), partition);
        let span = tracing::info_span!("partition", topic = input.topic(), partition);
        let ctx = self.ctx.clone();
        let (store_options, budget) = (self.options.store.clone(), self.budget.clone());
        let task_cancel = cancel.clone();
        let join = tokio::spawn(
            async move {
                ctx.status
                    .set(PartitionStatus::starting(input.topic(), partition));
                // Exactly-once: the transaction writer first; creating it fences every
                // earlier writer of the partition and ends its open transaction, so the
                // restore below reads a changelog nobody else appends to.
                let txn =
                    restore::retry_unavailable("transactions", partition, &task_cancel, || {
                        ctx.sink.transactions(partition)
                    });
                // Revoked (cancelled) before the partition task ran: no longer owned here,
                // nor starting or restoring (the admin and /readyz read this state).
                let stopped = || {
                    ctx.status
                        .update(partition, |s| s.state = PartitionState::Stopped);
                    PartitionExit::Stopped { flushed: true }
                };
                let txn = match txn.await {
                    Ok(Some(txn)) => txn,
                    Ok(None) => return stopped(),
                    Err(reason) => {
                        tracing::error!(error = %reason, "partition not started");
                        ctx.status.update(partition, |s| {
                            s.state = PartitionState::Failed(reason.clone());
                        });
                        return PartitionExit::Failed(reason);
                    }
                };
                let restored = restore::open_and_restore(
                    &ctx.sink,
                    &ctx.rules.current(),
                    txn.is_some(),
                    &path,
                    &store_options,
                    &budget,
                    partition,
                    &ctx.status,
                    &task_cancel,
                )
                .await;
                match restored {
                    Ok(Some((store, _))) => {
                        partition::run(ctx, store, input, task_fence, txn, task_cancel).await
                    }
                    Ok(None) => stopped(),
                    Err(reason) => {
                        tracing::error!(error = %reason, "partition not started");
                        ctx.status.update(partition, |s| {
                            s.state = PartitionState::Failed(reason.clone());
                        });
                        PartitionExit::Failed(reason)
                    }
                }
            }
            .instrument(span),
        );
        Running {
            cancel,
            fence,
            join,
        }
    }

    /// Cancels `tasks` and waits for them up to `shutdown-deadline`; aborts the rest.
    async fn stop(&self, tasks: Vec<(i32, Running)>) -> Vec<(i32, PartitionExit)> {
        for (_, r) in &tasks {
            r.cancel.cancel();
        }
        let deadline = tokio::time::Instant::now() + self.options.shutdown_deadline;
        let mut exits = Vec::with_capacity(tasks.len());
        for (p, mut r) in tasks {
            let abort = r.join.abort_handle();
            let exit = match tokio::time::timeout_at(deadline, &mut r.join).await {
                Ok(Ok(exit)) => exit,
                Ok(Err(e)) => {
                    PartitionExit::Failed(format!("partition task ended abnormally: {e}"))
                }
                Err(_) => {
                    abort.abort();
                    tracing::warn!(
                        partition = p,
                        "partition did not stop within the shutdown deadline; aborted"
                    );
                    PartitionExit::Stopped { flushed: false }
                }
            };
            // Stopped or aborted: nothing more is published for the partition from here.
            r.fence.revoke();
            exits.push((p, exit));
        }
        exits
    }
}

/// Resolves when `liveness` expires; never without one.
async fn expired(liveness: &Option<lease::Liveness>) {
    match liveness {
        Some(l) => l.expired().await,
        None => std::future::pending().await,
    }
}

/// Runs `future` to completion on a new multi-threaded tokio runtime (for the synchronous
/// entry points the CLI calls: `settle demo`, `run-file`, `settle run`).
///
/// Errors: the tokio runtime cannot be built.
pub fn block_on<F: std::future::Future>(future: F) -> anyhow::Result<F::Output> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow::anyhow!("cannot start the tokio runtime: {e}"))?;
    Ok(rt.block_on(future))
}
