//! The tier-events task of a runtime (SEMANTICS §5): one per process, next to the partition
//! tasks. It owns everything about tier changes that is not routing itself:
//!
//! * **Sweep**: about once per [`SWEEP_INTERVAL`] it calls [`SharedRouter::sweep`] with the
//!   wall clock, so a demoted tenant that went quiet is promoted back (and idle tenants are
//!   forgotten) without waiting for its next emission.
//! * **Publish**: every change (from a publisher's `route`, a sweep, or the tier-share task)
//!   whose tenant this instance reports (`Router::reports`; alone, every tenant) is published to
//!   `tiers.events-topic` through the runtime's [`Sink`] ([`Sink::publish_tier_change`]:
//!   key = tenant, value = `{tenant, from, to, rate, limit, at, reason}`), one at a time and
//!   in the order decided, retried with backoff while the broker is unavailable. Emissions
//!   never wait for this: the publishers hand changes over through a channel and go on.
//! * **Show**: after each change (several changes decided together make one write), and
//!   every 5 s without one, it
//!   rewrites `<data-dir>/tiers.json` ([`TIERS_FILE`], a [`TierSnapshot`]: the rule in force,
//!   the tenants demoted now, the last [`RECENT_CHANGES`] changes and the counters)
//!   atomically: written to a temporary file in the same directory, then renamed over the
//!   old one, so a reader sees the old or the new file, never half of one. `settle inspect
//!   --data-dir` prints it ([`read_snapshot`]). The file is also written at start (so a file
//!   left by an earlier run is replaced by this process's empty state) and at stop.
//!
//! Logging (`tracing`, info, one event per change) and counting ([`TierCounters`]) happen in
//! the router itself.
//!
//! # Soft state
//!
//! Tier state lives in the process and in the tier-counts log (`runtime::tier_share`), not
//! in the partition stores (see `tiers` "Several instances"). Tier events are best-effort
//! within a bound: a change not yet
//! acknowledged when the process stops is retried until `flush_timeout`, then dropped with a
//! warning; a SIGKILL loses the unpublished ones. Emissions are not affected either way.
//! `tiers.json` is replaced atomically but not fsynced.

use super::clock::Clock;
use super::publisher::sleep_until;
use crate::engine::Millis;
use crate::tiers::{
    rfc3339_ms, DemotedTenant, SharedRouter, TierChange, TierCounters, TierSpec, TiersConfig,
};
use crate::transport::{Backoff, Sink};
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Name of the tier snapshot file in `store.data-dir`.
pub const TIERS_FILE: &str = "tiers.json";

/// How many of the latest tier changes [`TierSnapshot::recent_changes`] keeps.
pub const RECENT_CHANGES: usize = 100;

/// How often the router is swept (promotions of quiet demoted tenants are at most this late).
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// `tiers.json` is also rewritten every this many sweeps (5 s) without a change, so its
/// counters and rates stay current.
const REWRITE_EVERY_SWEEPS: u64 = 5;

/// Longest wait between two attempts to publish a tier change.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The content of `<data-dir>/tiers.json`: this process's tier state when it was written
/// (SEMANTICS §5). Times are RFC 3339 with milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct TierSnapshot {
    /// When the file was written (wall clock, ms).
    #[serde(with = "rfc3339_ms")]
    pub written_at: Millis,
    /// The tier list in config order (`[[tiers.tier]]`).
    pub tiers: Vec<TierSpec>,
    /// `tiers.events-topic`.
    pub events_topic: String,
    /// `tiers.limit` (emissions per `period`, per tenant, across the instances sharing counts).
    pub limit: u64,
    /// `tiers.period` (ms).
    pub period_ms: u64,
    /// `tiers.recover-ratio`.
    pub recover_ratio: f64,
    /// `tiers.cooldown` (ms).
    pub cooldown_ms: u64,
    /// Tenants demoted automatically now, sorted by tenant (pinned tenants are not listed).
    pub demoted: Vec<DemotedTenant>,
    /// The latest tier changes of this process, oldest first (at most [`RECENT_CHANGES`]).
    pub recent_changes: Vec<TierChange>,
    /// Tier changes decided but not yet acknowledged on the events topic.
    pub events_unpublished: usize,
    /// Tier changes this instance decided and left to the tenant's reporting instance to
    /// publish (`Router::reports`).
    #[serde(default)]
    pub events_reported_elsewhere: u64,
    /// The router's counters (demotions, recoveries, emissions routed per tier, gauges).
    pub counters: TierCounters,
    /// This instance's name in the shared tier counts (`""`: not sharing).
    #[serde(default)]
    pub instance: String,
    /// The other instances whose counts are summed now, sorted.
    #[serde(default)]
    pub live_instances: Vec<String>,
}

/// Reads `<data_dir>/tiers.json`; `Ok(None)` when there is none (no runtime ran there yet).
///
/// Errors: the file cannot be read or is not a [`TierSnapshot`] (the message names the file).
pub fn read_snapshot(data_dir: &Path) -> anyhow::Result<Option<TierSnapshot>> {
    let path = data_dir.join(TIERS_FILE);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(anyhow::anyhow!("cannot read {}: {e}", path.display())),
    };
    serde_json::from_slice(&text)
        .map(Some)
        .map_err(|e| anyhow::anyhow!("{} is not a tier snapshot: {e}", path.display()))
}

/// Writes `snapshot` to `<data_dir>/tiers.json` atomically (temporary file + rename; mode
/// 0644 like the stores' files), creating `data_dir` if needed.
///
/// Errors: the directory or file cannot be created, written or renamed.
pub fn write_snapshot(data_dir: &Path, snapshot: &TierSnapshot) -> std::io::Result<()> {
    std::fs::create_dir_all(data_dir)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".tiers.json.")
        .tempfile_in(data_dir)?;
    serde_json::to_writer_pretty(&mut tmp, snapshot)?;
    tmp.write_all(b"\n")?;
    tmp.as_file()
        .set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    tmp.persist(data_dir.join(TIERS_FILE))
        .map(drop)
        .map_err(|e| e.error)
}

/// What the task needs besides the sink and the clock.
pub(crate) struct TierEventsSetup {
    /// The process's router.
    pub router: SharedRouter,
    /// The `[tiers]` config the router was built from (for the snapshot).
    pub config: TiersConfig,
    /// `store.data-dir`: where `tiers.json` goes.
    pub data_dir: PathBuf,
    /// Tier changes decided by the publishers.
    pub changes: mpsc::UnboundedReceiver<TierChange>,
    /// How long unpublished changes are retried after `stop`.
    pub flush_timeout: Duration,
}

/// Runs the task until `stop` fires, then publishes what it can within the flush timeout
/// and writes the file a last time.
pub(crate) async fn run<K: Sink, C: Clock>(
    setup: TierEventsSetup,
    sink: K,
    clock: C,
    stop: CancellationToken,
) {
    let TierEventsSetup {
        router,
        config,
        data_dir,
        mut changes,
        flush_timeout,
    } = setup;
    let mut task = Task {
        router,
        config,
        data_dir,
        sink,
        recent: VecDeque::new(),
        pending: VecDeque::new(),
        write_failing: false,
        reported_elsewhere: 0,
    };
    task.write(clock.now_ms());
    let mut sweep = tokio::time::interval(SWEEP_INTERVAL);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut in_flight: Option<Attempt> = None;
    let mut retry_at: Option<Instant> = None;
    let mut backoff = Backoff::new(MAX_BACKOFF);
    let mut failing = super::throttle::LogThrottle::default();
    let mut sweeps: u64 = 0;
    loop {
        let mut changed = false;
        tokio::select! {
            biased;
            () = stop.cancelled() => break,
            received = changes.recv() => {
                // Never `None` while the runtime (which holds a sender) runs.
                if let Some(change) = received {
                    task.record(change);
                    changed = true;
                }
            }
            _ = sweep.tick() => {
                for change in task.router.sweep(clock.now_ms()) {
                    task.record(change);
                    changed = true;
                }
                // The counters and rates in the file age too: rewrite it now and then.
                sweeps += 1;
                changed |= sweeps % REWRITE_EVERY_SWEEPS == 0;
            }
            result = attempt(&mut in_flight), if in_flight.is_some() => {
                in_flight = None;
                match result {
                    Ok(()) => {
                        backoff.reset();
                        if let Some(failures) = failing.clear() {
                            tracing::info!(failures, topic = %task.config.events_topic, "tier changes published again");
                        }
                        task.pending.pop_front();
                        // Rewrite the file when the last one is out (`events-unpublished` 0).
                        changed = task.pending.is_empty();
                    }
                    Err(e) => {
                        match failing.allow() {
                            Some(suppressed) => tracing::warn!(error = %e, topic = %task.config.events_topic, suppressed, "tier change not published; will retry (logged at most every 10 s)"),
                            None => tracing::debug!(error = %e, "tier change not published; will retry"),
                        }
                        retry_at = Some(Instant::now() + backoff.next_delay());
                    }
                }
            }
            () = sleep_until(retry_at), if retry_at.is_some() => retry_at = None,
        }
        // Changes decided together (a sweep, a burst of routes) make one file write.
        while let Ok(change) = changes.try_recv() {
            task.record(change);
            changed = true;
        }
        if changed {
            task.write(clock.now_ms());
        }
        if in_flight.is_none() && retry_at.is_none() {
            in_flight = task.publish_next();
        }
    }
    // Stopping: changes still in the channel, then publish within the flush timeout.
    while let Ok(change) = changes.try_recv() {
        task.record(change);
    }
    let deadline = Instant::now() + flush_timeout;
    while !task.pending.is_empty() {
        let attempt = match in_flight.take() {
            Some(f) => f,
            None => match task.publish_next() {
                Some(f) => f,
                None => break,
            },
        };
        match tokio::time::timeout_at(deadline, attempt).await {
            Ok(Ok(())) => {
                task.pending.pop_front();
            }
            Ok(Err(_)) if Instant::now() < deadline => {
                tokio::time::sleep_until(deadline.min(Instant::now() + backoff.next_delay())).await;
            }
            _ => break,
        }
    }
    if !task.pending.is_empty() {
        tracing::warn!(
            unpublished = task.pending.len(),
            topic = %task.config.events_topic,
            "stopping with tier changes not published to the events topic (tier state is soft; emissions are not affected)"
        );
    }
    task.write(clock.now_ms());
}

/// A publish attempt in flight.
type Attempt = BoxFuture<'static, Result<(), crate::transport::Error>>;

/// Awaits the attempt in flight; pends forever when there is none.
async fn attempt(in_flight: &mut Option<Attempt>) -> Result<(), crate::transport::Error> {
    match in_flight {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

struct Task<K> {
    router: SharedRouter,
    config: TiersConfig,
    data_dir: PathBuf,
    sink: K,
    /// The latest changes, oldest first, at most [`RECENT_CHANGES`].
    recent: VecDeque<TierChange>,
    /// Changes not yet acknowledged by the events topic, in decision order; the front one is
    /// the one being published.
    pending: VecDeque<TierChange>,
    /// The last file write failed (log the next failure at debug only).
    write_failing: bool,
    /// Changes left to the tenant's reporting instance.
    reported_elsewhere: u64,
}

impl<K: Sink> Task<K> {
    /// Keeps `change` among the recent ones, and queues it for the events topic when this
    /// instance reports its tenant (`Router::reports`: one instance per tenant publishes, so
    /// a change the whole deployment decided is one record, SEMANTICS §5).
    fn record(&mut self, change: TierChange) {
        if self.recent.len() == RECENT_CHANGES {
            self.recent.pop_front();
        }
        self.recent.push_back(change.clone());
        if self.router.lock().reports(&change.tenant) {
            self.pending.push_back(change);
        } else {
            self.reported_elsewhere += 1;
            tracing::debug!(tenant = %change.tenant, "tier change published by another instance (its reporter)");
        }
    }

    /// Starts publishing the oldest pending change, if any.
    fn publish_next(&self) -> Option<Attempt> {
        let change = self.pending.front()?.clone();
        let sink = self.sink.clone();
        let topic = self.config.events_topic.clone();
        Some(Box::pin(async move {
            sink.publish_tier_change(&topic, &change).await
        }))
    }

    fn snapshot(&self, now: Millis) -> TierSnapshot {
        let (demoted, counters, instance, live_instances) = {
            let router = self.router.lock();
            let live: Vec<String> = router
                .live_instances()
                .into_iter()
                .map(str::to_owned)
                .collect();
            (
                router.demoted(now),
                router.counters(),
                router.instance().to_owned(),
                live,
            )
        };
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        TierSnapshot {
            written_at: now,
            tiers: self.config.tiers.clone(),
            events_topic: self.config.events_topic.clone(),
            limit: self.config.limit,
            period_ms: ms(self.config.period),
            recover_ratio: self.config.recover_ratio,
            cooldown_ms: ms(self.config.cooldown),
            demoted,
            recent_changes: self.recent.iter().cloned().collect(),
            events_unpublished: self.pending.len(),
            events_reported_elsewhere: self.reported_elsewhere,
            counters,
            instance,
            live_instances,
        }
    }

    /// Rewrites `tiers.json`; a failure is logged (once per run of failures) and otherwise
    /// ignored: the file is for people, routing does not depend on it.
    fn write(&mut self, now: Millis) {
        match write_snapshot(&self.data_dir, &self.snapshot(now)) {
            Ok(()) => self.write_failing = false,
            Err(e) if !self.write_failing => {
                self.write_failing = true;
                tracing::warn!(error = %e, dir = %self.data_dir.display(), "cannot write {TIERS_FILE}");
            }
            Err(e) => tracing::debug!(error = %e, "cannot write {TIERS_FILE}"),
        }
    }
}
