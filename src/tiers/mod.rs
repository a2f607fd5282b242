//! Tiers (SEMANTICS §5): per-tenant emission rate, automatic demotion and recovery, and
//! routing of each emission to its tier's output topic. This is the answer to noisy
//! neighbours: a tenant that finishes thousands of sessions at once goes to a separate topic
//! (its own downstream queue and workers), so the normal tier's queue stays short for
//! everyone else.
//!
//! # What it owns
//!
//! * [`TiersConfig`]: the `[tiers]` config table and its validation.
//! * [`Router`]: per emission, decides the tenant's tier and returns the topic to publish to,
//!   plus a [`TierChange`] when the tenant just moved. It never drops, holds back or delays
//!   an emission: it only picks the topic (§5 "a tier changes where they go, never whether").
//! * [`SharedRouter`]: the one router of a process, shared by every partition task.
//!
//! # The rule
//!
//! * **Rate** of a tenant at time `t`: the number of its emissions routed with time in
//!   `(t - period, t]` — a sliding window, summed over all the tenant's sessions (the router
//!   only ever sees the tenant name, so 10 000 sessions and 10 sessions with the same
//!   emission times get the same decisions at the same times).
//! * **Demotion**: the emission that makes the rate exceed `limit` (the `limit + 1`-th within
//!   one period) moves the tenant from the first tier to `demote-to` (default: the last
//!   tier), and is itself routed there. Exactly `limit` per period stays in the first tier.
//! * **Recovery** (hysteresis): a demoted tenant is promoted back to the first tier once its
//!   rate has been below `limit × recover-ratio` (`count < ⌈limit × recover-ratio⌉`)
//!   continuously for `cooldown`. Any moment at or above that threshold restarts the
//!   cooldown, so a tenant hovering near `limit` stays demoted instead of flapping.
//! * **Pinned** tenants (`[tiers.pinned]`) always route to their tier and never move; their
//!   rate is still measured (for [`Router::rate_of`]).
//! * Tiers between the first and `demote-to` are reachable only by pinning. With a single
//!   tier, automatic demotion is off.
//!
//! # Why a window of our own and not `governor`
//!
//! `governor` is a GCRA (leaky bucket): it answers "does this cell conform?" and nothing
//! else. It does not fit here because (1) GCRA with burst `limit` admits a burst of `limit`
//! *and then* `limit` per period, i.e. up to `2 × limit - 1` emissions in one period window
//! without objection, which is not "more than `limit` per `period`"; (2) it exposes no rate
//! to put in the `rate` field of a [`TierChange`] or to show in `settle inspect`; (3) the
//! recovery rule needs "when did the rate last reach the threshold", which a conformance
//! check cannot tell; (4) its clocks are monotonic `Instant`s, while the router runs on the
//! millisecond times the shell hands it. The measure here (`window.rs`) is an exact sliding
//! window holding only the latest `limit + 1` timestamps of a tenant, which is all the two
//! decisions need, so memory per tenant is bounded by `8 × (limit + 1)` bytes and in practice
//! by the tenant's own emissions per period.
//!
//! # Time
//!
//! The clock is injected: every call takes `now_ms` (ms since the epoch) and nothing here
//! reads a clock. The runtime passes the wall-clock time at publish (the record's
//! `emitted_at`), because what hurts the downstream queue is when emissions arrive there,
//! including a burst released by a backlog replay. Router time never goes backwards: a
//! `now_ms` older than the latest seen (another partition task raced ahead) is taken as the
//! latest seen. [`TierChange::at`] is that router time.
//!
//! # Memory: when a tenant is forgotten
//!
//! A tenant is tracked from its first emission. [`Router::sweep`] forgets it once it is in
//! its starting tier (first tier, or its pinned tier) and its window is empty, i.e. `period`
//! after its last emission. A demoted tenant is kept until it is promoted, at the latest
//! `period + cooldown` after its last emission (sweep promotes it then, even with no new
//! emission, and returns the [`TierChange`]). Forgetting loses nothing: the state of a
//! forgotten tenant equals that of a tenant never seen, so decisions are identical with or
//! without sweeping. Tracked tenants are therefore those with an emission in the last
//! `period`, plus the demoted ones. Sweeps use a min-heap of due checks (one entry per
//! tracked tenant), so a sweep touches only tenants whose check is due.
//!
//! # Aggregation across the partitions of one instance
//!
//! A tenant's sessions hash to every partition, so a per-partition router would see only
//! `1/partitions` of a tenant's rate and never notice the 10 000-session tenant. Hence one
//! [`Router`] per process, shared by all partition tasks as a [`SharedRouter`]: an
//! `Arc<std::sync::Mutex<Router>>`. The lock is held for one hash lookup and an amortised
//! O(1) window update per emission (well under a microsecond), never across an `.await`, and
//! [`SharedRouter::sweep`] works in chunks of [`SWEEP_CHUNK`] due tenants, releasing the lock
//! between chunks, so a partition task never waits long. A channel to a router task was
//! rejected: the publisher needs the topic *before* it can publish, so every emission would
//! pay a round trip and a task wake-up, and publish latency would depend on one task's
//! scheduling. If profiling ever shows the lock hot, shard by tenant hash (N routers, N
//! locks): decisions stay exact because a tenant lives in one shard.
//!
//! # Several instances
//!
//! Tier state is soft, per-process state: not in the store, not in the changelog. Each
//! instance measures the emissions *it* publishes. A tenant whose sessions are spread over
//! all partitions is seen by each of `N` instances at about `1/N` of its total rate, so
//! cluster-wide it is demoted only past roughly `N × limit` per period, and then by each
//! instance on its own (its emissions may go to both tier topics for a short while, and
//! each instance publishes its own [`TierChange`] events). A tenant with few sessions may sit
//! on one instance and be measured against `limit` alone. Operators should therefore set
//! `limit` to *the per-instance share* of the cluster-wide rate they want to tolerate:
//! `limit = cluster_limit / instances` (recompute when scaling), accepting that concentrated
//! tenants are demoted a little earlier. After a restart or a rebalance every tenant starts in
//! its starting tier again; a still-noisy tenant is demoted again after `limit + 1` emissions,
//! so the normal tier absorbs at most about `limit` extra emissions per instance per restart.
//!
//! # How the runtime uses it
//!
//! * `runtime::Runtime::new` builds the one router of the process from `[tiers]` and hands
//!   a [`SharedRouter`] to every partition's outbox publisher (`runtime::publisher`), on
//!   every transport (memory for `settle demo` / `run-file`, Kafka for `settle run`).
//! * Per emission, when the publisher takes it from the outbox:
//!   `let r = router.route(em.key.tenant(), now_ms)` with the wall clock; the ready record
//!   (with `tier = r.tier`) goes to `r.topic`. A failed publish is retried on the same topic
//!   with the same tier, and not counted again. `r.change`, if any, goes to the runtime's
//!   tier-events task through a channel; the emission does not wait for it.
//! * The tier-events task (`runtime::tier_events`) calls [`SharedRouter::sweep`] about every
//!   second, publishes every change through the same `Sink` to
//!   [`TierTable::events_topic`] (record key = tenant, value = [`TierChange::to_json`]), and
//!   rewrites `<data-dir>/tiers.json` atomically (temporary file + rename) with the demoted
//!   tenants, the latest changes and the counters; `settle inspect --data-dir` prints it.
//! * The router logs each change (`tracing`, info) and counts it ([`Router::counters`], for
//!   the metrics endpoint and `tiers.json`).

mod event;
mod window;

pub use crate::config::tiers::{
    ConfigError, TierSpec, TiersConfig, MAX_DURATION, MAX_LIMIT, MAX_TIER_NAME_BYTES,
    MAX_TOPIC_BYTES,
};
pub(crate) use event::rfc3339_ms;
pub use event::{ChangeReason, DemotedTenant, TierChange, TierCounters};

use crate::engine::Millis;
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use window::{RateWindow, WindowParams};

/// Most due tenants one lock hold of [`SharedRouter::sweep`] handles.
pub const SWEEP_CHUNK: usize = 256;

/// Index into the tier list (0 = first tier).
type TierId = usize;

/// The validated tier list: names, topics, `demote-to`, pinned tenants and the events topic.
/// Immutable once built; shared by the router and its handles.
#[derive(Debug)]
pub struct TierTable {
    names: Vec<String>,
    topics: Vec<String>,
    demote_to: TierId,
    pinned: HashMap<String, TierId>,
    events_topic: String,
}

impl TierTable {
    fn new(config: &TiersConfig) -> Self {
        let index = |name: &str| config.tiers.iter().position(|t| t.name == name);
        TierTable {
            names: config.tiers.iter().map(|t| t.name.clone()).collect(),
            topics: config.tiers.iter().map(|t| t.topic.clone()).collect(),
            demote_to: config.demote_to_index(),
            pinned: config
                .pinned
                .iter()
                .filter_map(|(tenant, tier)| Some((tenant.clone(), index(tier)?)))
                .collect(),
            events_topic: config.events_topic.clone(),
        }
    }

    /// `(tier name, topic)` in config order (e.g. to create or check the topics at start).
    pub fn tiers(&self) -> impl Iterator<Item = (&str, &str)> {
        self.names
            .iter()
            .map(String::as_str)
            .zip(self.topics.iter().map(String::as_str))
    }

    /// The topic of tier `name`, if it exists.
    pub fn topic_of(&self, name: &str) -> Option<&str> {
        let i = self.names.iter().position(|n| n == name)?;
        Some(&self.topics[i])
    }

    /// The first tier: where every tenant starts unless pinned.
    pub fn first(&self) -> &str {
        &self.names[0]
    }

    /// The tier automatic demotion moves to (`tiers.demote-to`, default the last tier).
    pub fn demote_to(&self) -> &str {
        &self.names[self.demote_to]
    }

    /// Whether automatic demotion can happen (false with a single tier).
    pub fn auto_demotion(&self) -> bool {
        self.demote_to != 0
    }

    /// The tier `tenant` is pinned to, if any.
    pub fn pinned(&self, tenant: &str) -> Option<&str> {
        self.pinned.get(tenant).map(|&i| self.names[i].as_str())
    }

    /// Topic of the tier-change records (`tiers.events-topic`).
    pub fn events_topic(&self) -> &str {
        &self.events_topic
    }

    fn change(
        &self,
        tenant: &str,
        (from, to): (TierId, TierId),
        rate: u64,
        limit: u64,
        at: Millis,
        reason: ChangeReason,
    ) -> TierChange {
        TierChange {
            tenant: tenant.to_owned(),
            from: self.names[from].clone(),
            to: self.names[to].clone(),
            rate,
            limit,
            at,
            reason,
        }
    }
}

/// Where one emission goes (SEMANTICS §5).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route<'a> {
    /// The tenant's tier at emission time: the `tier` field of the output record.
    pub tier: &'a str,
    /// The tier's output topic: publish the emission there.
    pub topic: &'a str,
    /// `Some` when this emission moved the tenant (it is already routed to the new tier):
    /// publish it on the tier-events topic.
    pub change: Option<TierChange>,
}

/// Result of one [`Router::sweep`] call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sweep {
    /// Promotions that became due (reason `recovered`), to publish like route changes.
    pub changes: Vec<TierChange>,
    /// Tenants forgotten (idle in their starting tier).
    pub forgotten: usize,
    /// Due checks are left because the budget ran out; call again.
    pub more: bool,
}

/// Router-wide rule constants.
#[derive(Clone, Copy, Debug)]
struct Rules {
    window: WindowParams,
    /// `tiers.cooldown` in ms.
    cooldown: Millis,
}

/// What the router keeps per tracked tenant.
#[derive(Debug)]
struct Tenant {
    window: RateWindow,
    /// Set while automatically demoted: when it happened (ms).
    demoted_since: Option<Millis>,
}

impl Tenant {
    fn new() -> Self {
        Tenant {
            window: RateWindow::new(),
            demoted_since: None,
        }
    }

    /// Earliest promotion time: the rate fell below the threshold at `above_until`, plus
    /// `cooldown`.
    fn recovers_at(&self, rules: &Rules) -> Millis {
        self.window.above_until().saturating_add(rules.cooldown)
    }

    /// Promotes the tenant if it is demoted and has been below the recovery threshold for
    /// `cooldown` at `now` (window already expired to `now`).
    fn try_recover(
        &mut self,
        tenant: &str,
        now: Millis,
        table: &TierTable,
        rules: &Rules,
    ) -> Option<TierChange> {
        if self.demoted_since.is_none() || now < self.recovers_at(rules) {
            return None;
        }
        self.demoted_since = None;
        Some(table.change(
            tenant,
            (table.demote_to, 0),
            self.window.count_at(now, &rules.window),
            rules.window.limit,
            now,
            ChangeReason::Recovered,
        ))
    }

    /// Counts one emission at `now` and returns the tier it goes to, with the change it caused.
    fn step(
        &mut self,
        tenant: &str,
        pinned: Option<TierId>,
        now: Millis,
        table: &TierTable,
        rules: &Rules,
    ) -> (TierId, Option<TierChange>) {
        self.window.expire(now, &rules.window);
        let mut change = self.try_recover(tenant, now, table, rules);
        let count = self.window.record(now, &rules.window);
        if pinned.is_none()
            && self.demoted_since.is_none()
            && table.auto_demotion()
            && count > rules.window.limit
        {
            self.demoted_since = Some(now);
            change = Some(table.change(
                tenant,
                (0, table.demote_to),
                count,
                rules.window.limit,
                now,
                ChangeReason::RateExceeded,
            ));
        }
        let tier = match (pinned, self.demoted_since) {
            (Some(p), _) => p,
            (None, Some(_)) => table.demote_to,
            (None, None) => 0,
        };
        (tier, change)
    }

    /// When sweep must look at this tenant again; `None`: it can be forgotten now.
    fn next_check(&self, rules: &Rules) -> Option<Millis> {
        if self.demoted_since.is_some() {
            return Some(self.recovers_at(rules));
        }
        self.window
            .last()
            .map(|t| t.saturating_add(rules.window.period))
    }
}

/// Per-process tenant → tier router (SEMANTICS §5). See the module doc for the rule, memory
/// bound and concurrency. Not thread-safe by itself (`&mut self`); share it as a
/// [`SharedRouter`].
#[derive(Debug)]
pub struct Router {
    table: Arc<TierTable>,
    rules: Rules,
    tenants: HashMap<Arc<str>, Tenant>,
    /// One entry per tracked tenant: `(time its state must be looked at, tenant)`.
    checks: BinaryHeap<Reverse<(Millis, Arc<str>)>>,
    /// Tenants currently demoted automatically, sorted.
    demoted: BTreeSet<Arc<str>>,
    /// Router time (ms): the latest `now_ms` seen.
    clock: Millis,
    demotions: u64,
    recoveries: u64,
    routed: Vec<u64>,
}

impl Router {
    /// A router for `config`. Errors: the first [`ConfigError`] of [`TiersConfig::validate`].
    pub fn new(config: &TiersConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let table = Arc::new(TierTable::new(config));
        // Both fit: validate() bounds period and cooldown to 24 h.
        let period = Millis::try_from(config.period.as_millis()).unwrap_or(Millis::MAX);
        let cooldown = Millis::try_from(config.cooldown.as_millis()).unwrap_or(Millis::MAX);
        Ok(Router {
            routed: vec![0; table.names.len()],
            table,
            rules: Rules {
                window: WindowParams::new(period, config.limit, config.recover_ratio),
                cooldown,
            },
            tenants: HashMap::new(),
            checks: BinaryHeap::new(),
            demoted: BTreeSet::new(),
            clock: Millis::MIN,
            demotions: 0,
            recoveries: 0,
        })
    }

    /// The tier list.
    pub fn tiers(&self) -> &TierTable {
        &self.table
    }

    /// Routes one emission of `tenant` published at `now_ms` (ms since the epoch): counts it in
    /// the tenant's rate, applies a due promotion or a demotion, and returns its tier and
    /// topic. Never fails, never drops: every emission gets a topic. Amortised O(1).
    pub fn route(&mut self, tenant: &str, now_ms: Millis) -> Route<'_> {
        let (tier, change) = self.decide(tenant, now_ms);
        Route {
            tier: &self.table.names[tier],
            topic: &self.table.topics[tier],
            change,
        }
    }

    fn decide(&mut self, tenant: &str, now_ms: Millis) -> (TierId, Option<TierChange>) {
        let now = self.advance(now_ms);
        let pinned = self.table.pinned.get(tenant).copied();
        let (table, rules) = (&*self.table, &self.rules);
        let (tier, change) = match self.tenants.get_mut(tenant) {
            Some(t) => t.step(tenant, pinned, now, table, rules),
            None => {
                let mut t = Tenant::new();
                let stepped = t.step(tenant, pinned, now, table, rules);
                let key: Arc<str> = Arc::from(tenant);
                let check = t.next_check(rules).unwrap_or(now);
                self.checks.push(Reverse((check, Arc::clone(&key))));
                self.tenants.insert(key, t);
                stepped
            }
        };
        if let Some(c) = &change {
            self.note(c);
        }
        self.routed[tier] += 1;
        (tier, change)
    }

    /// Promotes demoted tenants whose cooldown has passed and forgets idle ones, looking at
    /// most at `budget` due tenants. Call it regularly (about every second) with the same
    /// clock as [`Router::route`], and publish the returned changes.
    pub fn sweep(&mut self, now_ms: Millis, budget: usize) -> Sweep {
        let now = self.advance(now_ms);
        let mut sweep = Sweep::default();
        let mut looked = 0;
        while looked < budget
            && self
                .checks
                .peek()
                .is_some_and(|Reverse((at, _))| *at <= now)
        {
            let Some(Reverse((_, key))) = self.checks.pop() else {
                break;
            };
            looked += 1;
            let (table, rules) = (&*self.table, &self.rules);
            // Invariant: every heap entry names a tracked tenant (one entry per tenant).
            let Some(t) = self.tenants.get_mut(&*key) else {
                continue;
            };
            t.window.expire(now, &rules.window);
            let change = t.try_recover(&key, now, table, rules);
            match t.next_check(rules) {
                Some(at) => self.checks.push(Reverse((at, key))),
                None => {
                    self.tenants.remove(&*key);
                    sweep.forgotten += 1;
                }
            }
            if let Some(c) = change {
                self.note(&c);
                sweep.changes.push(c);
            }
        }
        sweep.more = self
            .checks
            .peek()
            .is_some_and(|Reverse((at, _))| *at <= now);
        sweep
    }

    /// The tenant's tier as last decided (pinned, demoted or first). A promotion that is due
    /// but not yet applied by `route` or `sweep` is not reflected.
    pub fn tier_of(&self, tenant: &str) -> &str {
        if let Some(tier) = self.table.pinned(tenant) {
            return tier;
        }
        match self.tenants.get(tenant) {
            Some(t) if t.demoted_since.is_some() => self.table.demote_to(),
            _ => self.table.first(),
        }
    }

    /// The tenant's rate at `now_ms`: emissions in `(now - period, now]` (emissions per
    /// period). Exact up to `limit + 1`; above that an estimate that may over-count by the
    /// emissions of one `period / 64` slice. 0 for an unknown or forgotten tenant.
    pub fn rate_of(&self, tenant: &str, now_ms: Millis) -> u64 {
        let now = now_ms.max(self.clock);
        self.tenants
            .get(tenant)
            .map_or(0, |t| t.window.rate_at(now, &self.rules.window))
    }

    /// Tenants currently demoted automatically, sorted by tenant, with their rate at `now_ms`
    /// and earliest promotion time.
    pub fn demoted(&self, now_ms: Millis) -> Vec<DemotedTenant> {
        let now = now_ms.max(self.clock);
        self.demoted
            .iter()
            .filter_map(|name| {
                let t = self.tenants.get(name)?;
                Some(DemotedTenant {
                    tenant: name.to_string(),
                    tier: self.table.demote_to().to_owned(),
                    since: t.demoted_since?,
                    rate: t.window.rate_at(now, &self.rules.window),
                    limit: self.rules.window.limit,
                    recovers_at: t.recovers_at(&self.rules),
                })
            })
            .collect()
    }

    /// Change and routing counters, and the tracked/demoted tenant gauges.
    pub fn counters(&self) -> TierCounters {
        TierCounters {
            demotions: self.demotions,
            recoveries: self.recoveries,
            routed: self
                .table
                .names
                .iter()
                .cloned()
                .zip(self.routed.iter().copied())
                .collect(),
            tenants_tracked: self.tenants.len(),
            tenants_demoted: self.demoted.len(),
        }
    }

    fn advance(&mut self, now_ms: Millis) -> Millis {
        self.clock = self.clock.max(now_ms);
        self.clock
    }

    fn note(&mut self, change: &TierChange) {
        match change.reason {
            ChangeReason::RateExceeded => {
                self.demotions += 1;
                self.demoted.insert(Arc::from(change.tenant.as_str()));
            }
            ChangeReason::Recovered => {
                self.recoveries += 1;
                self.demoted.remove(change.tenant.as_str());
            }
        }
        tracing::info!(
            tenant = %change.tenant,
            from = %change.from,
            to = %change.to,
            rate = change.rate,
            limit = change.limit,
            at = change.at,
            reason = change.reason.as_str(),
            "tier change"
        );
    }
}

/// The process's one [`Router`], shared by all partition tasks (cheap to clone). Each call
/// holds the lock for O(1) work and never across an `.await` (see the module doc).
#[derive(Clone, Debug)]
pub struct SharedRouter {
    router: Arc<Mutex<Router>>,
    table: Arc<TierTable>,
}

impl SharedRouter {
    /// Shares `router`.
    pub fn new(router: Router) -> Self {
        SharedRouter {
            table: Arc::clone(&router.table),
            router: Arc::new(Mutex::new(router)),
        }
    }

    /// [`Router::route`] under the lock. The returned names borrow the immutable tier table,
    /// not the lock.
    pub fn route(&self, tenant: &str, now_ms: Millis) -> Route<'_> {
        let (tier, change) = self.lock().decide(tenant, now_ms);
        Route {
            tier: &self.table.names[tier],
            topic: &self.table.topics[tier],
            change,
        }
    }

    /// [`Router::sweep`] until nothing is due, [`SWEEP_CHUNK`] tenants per lock hold.
    /// Returns the promotions made.
    pub fn sweep(&self, now_ms: Millis) -> Vec<TierChange> {
        let mut changes = Vec::new();
        loop {
            let chunk = self.lock().sweep(now_ms, SWEEP_CHUNK);
            changes.extend(chunk.changes);
            if !chunk.more {
                return changes;
            }
        }
    }

    /// The tier list (no lock needed).
    pub fn tiers(&self) -> &TierTable {
        &self.table
    }

    /// Locks the router for reads such as [`Router::tier_of`], [`Router::rate_of`],
    /// [`Router::demoted`] and [`Router::counters`]. Keep the guard short-lived. A router left
    /// poisoned by a panic elsewhere is still used: routing must go on (§5), and the worst a
    /// half-done call leaves is one tenant's count off by one.
    pub fn lock(&self) -> MutexGuard<'_, Router> {
        self.router.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
