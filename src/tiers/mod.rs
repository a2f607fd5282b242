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
//! * **Pinned** tenants (`[tiers.pinned]`, or a tenant override's pinned tier set while
//!   settle runs: [`Router::set_override_pins`], SEMANTICS §7) always route to their tier and
//!   never move; their rate is still measured (for [`Router::rate_of`]). While an override
//!   pins a tenant its automatic state holds (no demotion, no promotion); when the pin goes,
//!   automatic tiering resumes from the measured rate.
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
//! # Several instances: the deployment's rate (`share`)
//!
//! A tenant's sessions hash to every partition, and the partitions are split over the
//! instances, so each instance publishes about `1/N` of a spread tenant's emissions. §5 wants
//! the deployment's rate, so the instances add up their counts through the broker (no lock,
//! no extra service): every `tiers.share-interval` each instance's tier-share task
//! (`runtime::tier_share`) publishes its [`CountsSnapshot`] ([`Router::share_snapshot`]:
//! its own count of each tenant in the current window, and its demoted tenants), and hands
//! every other instance's to [`Router::apply_remote`]. The router keeps the latest counts of
//! each live instance and their sum per tenant; a tenant's count in every decision is its
//! own window plus that sum:
//!
//! * **Demotion** when that total exceeds `limit`, checked on each own emission and on each
//!   arriving snapshot (so an instance demotes a tenant it publishes nothing of, and is ready
//!   when that tenant's sessions move to it). Remote counts are up to one interval old: a
//!   tenant ramping up is caught within about one interval of crossing the limit.
//! * **Recovery** needs the total below the threshold for `cooldown`: a total at or above it
//!   seen with remote counts in it holds the tenant until one interval later
//!   (`Tenant::shared_above_until`), besides the exact own-window bound.
//! * **Expiry**: counts of an instance whose last snapshot is older than 3 intervals (at least
//!   3 s) stop counting ([`Router::sweep`] drops them).
//! * **One event per change**: every instance moves the tenant at about the same moment; only
//!   the tenant's reporter ([`Router::reports`], a stable hash among the live instances)
//!   publishes the change (the tier-events task asks).
//! * **Restore** ([`Router::restore`]): at start, the latest snapshot of every instance ever
//!   seen is read back; tenants demoted in any of them start demoted unless their cooldown
//!   has run out since, and the counts of instances still live are summed at once.
//!
//! Without a tier-counts log (memory transport, or sharing turned off) the router is what
//! it was: it measures only this process's emissions and starts empty.
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
pub mod share;
mod window;

pub use crate::config::tiers::{
    ConfigError, TierSpec, TiersConfig, MAX_DURATION, MAX_LIMIT, MAX_SHARE_INTERVAL,
    MAX_TIER_NAME_BYTES, MAX_TOPIC_BYTES, MIN_SHARE_INTERVAL,
};
pub(crate) use event::rfc3339_ms;
pub use event::{ChangeReason, DemotedTenant, TierChange, TierCounters};
pub use share::{CountsSnapshot, SharedDemotion, MAX_SHARED_TENANTS};

use crate::engine::Millis;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
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
    /// `tiers.share-interval` in ms: a deployment-wide count seen at `t` is taken to hold
    /// until `t + share_interval` (the next snapshot).
    share_interval: Millis,
}

/// What the router keeps per tracked tenant.
#[derive(Debug)]
struct Tenant {
    window: RateWindow,
    /// Set while automatically demoted: when it happened (ms).
    demoted_since: Option<Millis>,
    /// Until when the deployment-wide rate (own window plus the other instances' counts) was
    /// last seen at or above the recovery threshold (ms); `Millis::MIN`: never. The own
    /// window alone is tracked exactly by `window.above_until()`.
    shared_above_until: Millis,
}

impl Tenant {
    fn new() -> Self {
        Tenant {
            window: RateWindow::new(),
            demoted_since: None,
            shared_above_until: Millis::MIN,
        }
    }

    /// Earliest promotion time: the rate fell below the threshold at the later of
    /// `window.above_until()` and `shared_above_until`, plus `cooldown`.
    fn recovers_at(&self, rules: &Rules) -> Millis {
        self.above_until().saturating_add(rules.cooldown)
    }

    /// Until when the rate was last known at or above the recovery threshold.
    fn above_until(&self) -> Millis {
        self.window.above_until().max(self.shared_above_until)
    }

    /// Notes the deployment-wide count `total` seen at `now`, of which `remote` came from
    /// other instances: at or above the recovery threshold, the rate is taken to stay there
    /// until the next snapshot.
    fn observe(&mut self, total: u64, remote: u64, now: Millis, rules: &Rules) {
        if remote > 0 && total >= rules.window.recover_below as u64 {
            self.shared_above_until = self
                .shared_above_until
                .max(now.saturating_add(rules.share_interval));
        }
    }

    /// Promotes the tenant if it is demoted and has been below the recovery threshold for
    /// `cooldown` at `now` (window already expired to `now`); `remote` is the other
    /// instances' count of it.
    fn try_recover(
        &mut self,
        tenant: &str,
        now: Millis,
        remote: u64,
        table: &TierTable,
        rules: &Rules,
    ) -> Option<TierChange> {
        self.demoted_since?;
        let total = self.window.count_at(now, &rules.window) + remote;
        self.observe(total, remote, now, rules);
        if now < self.recovers_at(rules) {
            return None;
        }
        self.demoted_since = None;
        Some(table.change(
            tenant,
            (table.demote_to, 0),
            total,
            rules.window.limit,
            now,
            ChangeReason::Recovered,
        ))
    }

    /// Demotes the tenant when it may move and `total` (its deployment-wide count at `now`)
    /// exceeds `limit`.
    fn try_demote(
        &mut self,
        tenant: &str,
        pinned: Option<TierId>,
        total: u64,
        now: Millis,
        table: &TierTable,
        rules: &Rules,
    ) -> Option<TierChange> {
        if pinned.is_some()
            || self.demoted_since.is_some()
            || !table.auto_demotion()
            || total <= rules.window.limit
        {
            return None;
        }
        self.demoted_since = Some(now);
        Some(table.change(
            tenant,
            (0, table.demote_to),
            total,
            rules.window.limit,
            now,
            ChangeReason::RateExceeded,
        ))
    }

    /// Counts one emission at `now` and returns the tier it goes to, with the change it caused;
    /// `remote` is the other instances' count of the tenant.
    fn step(
        &mut self,
        tenant: &str,
        pinned: Option<TierId>,
        now: Millis,
        remote: u64,
        table: &TierTable,
        rules: &Rules,
    ) -> (TierId, Option<TierChange>) {
        self.window.expire(now, &rules.window);
        // Pinned: the automatic state holds (a demotion from before the pin stays until
        // the pin goes and the rule promotes it).
        let mut change = match pinned {
            Some(_) => None,
            None => self.try_recover(tenant, now, remote, table, rules),
        };
        let total = self.window.record(now, &rules.window) + remote;
        self.observe(total, remote, now, rules);
        if let Some(c) = self.try_demote(tenant, pinned, total, now, table, rules) {
            change = Some(c);
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
    /// This instance's name in shared snapshots (`""`: not sharing).
    instance: String,
    /// The latest counts of every other live instance, by instance name.
    remotes: BTreeMap<String, Remote>,
    /// Tenant → sum of `remotes`' counts of it (entries are removed when they reach 0).
    remote_sum: HashMap<Arc<str>, u64>,
    /// The last counts of instances that stopped (said so, or stopped publishing), by
    /// instance name: they fade out over one `period` from their snapshot's time.
    fading: BTreeMap<String, Fading>,
    /// A snapshot with another `period` was seen (logged once).
    period_mismatch: bool,
    /// Tenant → tier pinned by a tenant override (SEMANTICS §7), over `[tiers.pinned]`.
    override_pins: HashMap<String, TierId>,
}

/// The latest counts of one other instance ([`CountsSnapshot`]).
#[derive(Debug)]
struct Remote {
    counts: Vec<(Arc<str>, u64)>,
    /// The snapshot's time (the sender's clock).
    at: Millis,
    /// Router time after which the instance is taken as stopped (its counts fade).
    expires_at: Millis,
}

/// The last counts of an instance that stopped: the emissions behind them leave the window
/// during the `period` after the snapshot; taken as spread evenly over it, a count `c` taken
/// at `at` still counts `c × (at + period − now) / period` at `now`. So a stopped instance's
/// emissions neither vanish at once (a rolling restart would let a tenant past the limit)
/// nor count for longer than they can.
#[derive(Debug)]
struct Fading {
    counts: HashMap<Arc<str>, u64>,
    at: Millis,
}

impl Fading {
    fn count_at(&self, tenant: &str, now: Millis, period: Millis) -> u64 {
        let Some(&c) = self.counts.get(tenant) else {
            return 0;
        };
        let left = self
            .at
            .saturating_add(period)
            .saturating_sub(now)
            .clamp(0, period);
        // Rounded up: a count fades to 0 only when its period is over.
        (c as u128 * left as u128).div_ceil(period.max(1) as u128) as u64
    }
}

/// What [`Router::restore`] took from the snapshots read at start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Restored {
    /// Snapshots read (one per instance that ever published, as the log keeps them).
    pub snapshots: usize,
    /// Of those, instances still live (their counts are summed).
    pub live: usize,
    /// Of those, instances stopped within the last period (their last counts fade out).
    pub fading: usize,
    /// Tenants demoted again because a snapshot had them demoted and they have not recovered
    /// by the rule since.
    pub demoted: usize,
    /// Demotions decided on the live instances' counts (to publish like route changes).
    pub changes: Vec<TierChange>,
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
                share_interval: Millis::try_from(config.share_interval.as_millis())
                    .unwrap_or(Millis::MAX),
            },
            tenants: HashMap::new(),
            checks: BinaryHeap::new(),
            demoted: BTreeSet::new(),
            clock: Millis::MIN,
            demotions: 0,
            recoveries: 0,
            instance: String::new(),
            remotes: BTreeMap::new(),
            remote_sum: HashMap::new(),
            fading: BTreeMap::new(),
            period_mismatch: false,
            override_pins: HashMap::new(),
        })
    }

    /// Names this instance in the snapshots it shares ([`Router::share_snapshot`]); its own
    /// snapshots read back from the broker are then ignored ([`Router::apply_remote`]).
    pub fn set_instance(&mut self, instance: &str) {
        self.instance = instance.to_owned();
    }

    /// This instance's name in shared snapshots (`""` until [`Router::set_instance`]).
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The tier list.
    pub fn tiers(&self) -> &TierTable {
        &self.table
    }

    /// Replaces the tiers pinned by tenant overrides (SEMANTICS §7): tenant → tier name.
    /// They win over `[tiers.pinned]` and over automatic demotion and recovery while they
    /// last; a tenant no longer listed is tiered automatically again from its measured rate.
    /// Returns the tenants whose tier name is not in the tier list (left unpinned).
    pub fn set_override_pins<'a>(
        &mut self,
        pins: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Vec<String> {
        let mut unknown = Vec::new();
        self.override_pins = pins
            .into_iter()
            .filter_map(
                |(tenant, tier)| match self.table.names.iter().position(|n| n == tier) {
                    Some(i) => Some((tenant.to_owned(), i)),
                    None => {
                        unknown.push(tenant.to_owned());
                        None
                    }
                },
            )
            .collect();
        unknown
    }

    /// The tier `tenant` is pinned to and by what: `"override"` (a tenant override) or
    /// `"config"` (`[tiers.pinned]`); `None` when automatic tiering decides.
    pub fn pinned(&self, tenant: &str) -> Option<(&str, &'static str)> {
        if let Some(&i) = self.override_pins.get(tenant) {
            return Some((&self.table.names[i], "override"));
        }
        self.table.pinned(tenant).map(|t| (t, "config"))
    }

    /// The tier `tenant` is pinned to (an override's, else `[tiers.pinned]`).
    fn pin_of(&self, tenant: &str) -> Option<TierId> {
        self.override_pins
            .get(tenant)
            .or_else(|| self.table.pinned.get(tenant))
            .copied()
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
        let pinned = self.pin_of(tenant);
        let remote = self.remote_at(tenant, now);
        let (table, rules) = (&*self.table, &self.rules);
        let (tier, change) = match self.tenants.get_mut(tenant) {
            Some(t) => t.step(tenant, pinned, now, remote, table, rules),
            None => {
                let mut t = Tenant::new();
                let stepped = t.step(tenant, pinned, now, remote, table, rules);
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
        self.expire_remotes(now);
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
            let pinned = self.pin_of(&key).is_some();
            let (table, rules) = (&*self.table, &self.rules);
            // Invariant: every heap entry names a tracked tenant (one entry per tenant).
            let Some(t) = self.tenants.get_mut(&*key) else {
                continue;
            };
            t.window.expire(now, &rules.window);
            let remote = remote_at(&self.remote_sum, &self.fading, &key, now, rules);
            let change = if pinned {
                None
            } else {
                t.try_recover(&key, now, remote, table, rules)
            };
            match t.next_check(rules) {
                // Pinned and due for a promotion it may not take: looked at again in a
                // second (the pin may be gone by then), not in this sweep.
                Some(at) if pinned && at <= now => {
                    self.checks.push(Reverse((now.saturating_add(1_000), key)))
                }
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
        if let Some((tier, _)) = self.pinned(tenant) {
            return tier;
        }
        match self.tenants.get(tenant) {
            Some(t) if t.demoted_since.is_some() => self.table.demote_to(),
            _ => self.table.first(),
        }
    }

    /// The tenant's deployment-wide rate at `now_ms`: this instance's emissions in
    /// `(now - period, now]` plus the latest counts of the other live instances (emissions per
    /// period). This instance's part is exact up to `limit + 1`; above that an estimate that
    /// may over-count by the emissions of one `period / 64` slice. 0 for an unknown or
    /// forgotten tenant.
    pub fn rate_of(&self, tenant: &str, now_ms: Millis) -> u64 {
        let now = now_ms.max(self.clock);
        let own = self
            .tenants
            .get(tenant)
            .map_or(0, |t| t.window.rate_at(now, &self.rules.window));
        own + self.remote_at(tenant, now)
    }

    /// The other instances' latest count of `tenant` at router time (0 when none counts it):
    /// the live instances' latest counts plus what is left of stopped instances' last ones.
    pub fn remote_count(&self, tenant: &str) -> u64 {
        self.remote_at(tenant, self.clock)
    }

    fn remote_at(&self, tenant: &str, now: Millis) -> u64 {
        remote_at(&self.remote_sum, &self.fading, tenant, now, &self.rules)
    }

    /// Names of the other instances whose counts are live now, sorted.
    pub fn live_instances(&self) -> Vec<&str> {
        self.remotes.keys().map(String::as_str).collect()
    }

    /// Whether this instance is the one that publishes `tenant`'s tier changes: of this
    /// instance and the live others, sorted by name, the one at
    /// `stable_hash(tenant) mod count`. Every instance decides a tenant's tier on the same
    /// deployment-wide counts, so all of them move it at about the same time; only this one
    /// publishes the change, so one change is one tier-events record (§5). Alone (or not
    /// sharing) an instance reports every tenant.
    pub fn reports(&self, tenant: &str) -> bool {
        if self.remotes.is_empty() {
            return true;
        }
        let n = self.remotes.len() as u64 + 1;
        let pick = (share::stable_hash(tenant.as_bytes()) % n) as usize;
        let mut names: Vec<&str> = self.remotes.keys().map(String::as_str).collect();
        names.push(&self.instance);
        names.sort_unstable();
        names[pick] == self.instance
    }

    /// This instance's snapshot at `now_ms` for the others ([`CountsSnapshot`]): its own
    /// emissions of each tenant in the current window (the [`MAX_SHARED_TENANTS`] largest
    /// non-zero counts; pinned tenants left out) and the tenants it has demoted.
    pub fn share_snapshot(&mut self, now_ms: Millis) -> CountsSnapshot {
        let now = self.advance(now_ms);
        let rules = &self.rules;
        let mut counts: Vec<(&str, u64)> = self
            .tenants
            .iter()
            .filter(|(name, _)| !self.table.pinned.contains_key(&***name))
            .map(|(name, t)| (&**name, t.window.rate_at(now, &rules.window)))
            .filter(|&(_, c)| c > 0)
            .collect();
        if counts.len() > MAX_SHARED_TENANTS {
            counts.select_nth_unstable_by(MAX_SHARED_TENANTS - 1, |a, b| b.1.cmp(&a.1));
            counts.truncate(MAX_SHARED_TENANTS);
        }
        let demoted = self
            .demoted
            .iter()
            .filter_map(|name| {
                let t = self.tenants.get(name)?;
                Some(SharedDemotion {
                    tenant: name.to_string(),
                    since: t.demoted_since?,
                    above_until: t.above_until(),
                })
            })
            .take(MAX_SHARED_TENANTS)
            .collect();
        CountsSnapshot {
            instance: self.instance.clone(),
            at: now,
            period_ms: rules.window.period as u64,
            interval_ms: rules.share_interval as u64,
            counts: counts
                .into_iter()
                .map(|(name, c)| (name.to_owned(), c))
                .collect(),
            demoted,
            stopping: false,
        }
    }

    /// [`Router::share_snapshot`] marked as this instance's last (`stopping`): the others
    /// take its counts as fading at once and no longer count it among the live instances.
    pub fn final_snapshot(&mut self, now_ms: Millis) -> CountsSnapshot {
        CountsSnapshot {
            stopping: true,
            ..self.share_snapshot(now_ms)
        }
    }

    /// Takes another instance's snapshot, received at `now_ms`: its counts replace that
    /// instance's earlier ones in every tenant's deployment-wide rate until they expire
    /// ([`CountsSnapshot::expires_at`]), and each tenant it counts is checked at once, so a
    /// tenant is demoted here as soon as the deployment's rate crosses `limit`, even if this
    /// instance publishes none of its emissions. A snapshot of this instance itself is
    /// ignored. Returns the changes made (demotions), to publish like route changes.
    pub fn apply_remote(&mut self, snapshot: &CountsSnapshot, now_ms: Millis) -> Vec<TierChange> {
        let now = self.advance(now_ms);
        self.take_remote(snapshot, snapshot.expires_at(now), now)
    }

    fn take_remote(
        &mut self,
        snapshot: &CountsSnapshot,
        expires_at: Millis,
        now: Millis,
    ) -> Vec<TierChange> {
        if snapshot.instance == self.instance {
            return Vec::new();
        }
        if snapshot.period_ms != self.rules.window.period as u64 && !self.period_mismatch {
            self.period_mismatch = true;
            tracing::warn!(
                instance = %snapshot.instance,
                their_period_ms = snapshot.period_ms,
                our_period_ms = self.rules.window.period,
                "an instance counts over another tiers.period: its counts are summed anyway; give every instance the same [tiers]"
            );
        }
        self.drop_remote(&snapshot.instance);
        self.fading.remove(&snapshot.instance);
        if snapshot.stopping {
            tracing::info!(instance = %snapshot.instance, "an instance stopped: its tier counts fade out over one period");
            self.fade(snapshot.instance.clone(), fading_of(snapshot), now);
            return Vec::new();
        }
        let mut counts = Vec::with_capacity(snapshot.counts.len());
        for (tenant, &count) in &snapshot.counts {
            let key: Arc<str> = match self.remote_sum.get_key_value(tenant.as_str()) {
                Some((k, _)) => Arc::clone(k),
                None => Arc::from(tenant.as_str()),
            };
            *self.remote_sum.entry(Arc::clone(&key)).or_insert(0) += count;
            counts.push((key, count));
        }
        let tenants: Vec<Arc<str>> = counts.iter().map(|(t, _)| Arc::clone(t)).collect();
        self.remotes.insert(
            snapshot.instance.clone(),
            Remote {
                counts,
                at: snapshot.at,
                expires_at,
            },
        );
        let mut changes = Vec::new();
        // The other instance's demotions first: this instance may be the tenant's reporter.
        for d in &snapshot.demoted {
            if self.adopt(&d.tenant, d.since, d.above_until, now) {
                let rate = self.rate_of(&d.tenant, now);
                let change = self.table.change(
                    &d.tenant,
                    (0, self.table.demote_to),
                    rate,
                    self.rules.window.limit,
                    now,
                    ChangeReason::RateExceeded,
                );
                self.note(&change);
                changes.push(change);
            }
        }
        for tenant in &tenants {
            if let Some(c) = self.check_shared(tenant, now) {
                changes.push(c);
            }
        }
        changes
    }

    /// Keeps `fading` (an instance's last counts) until its period is over at `now`.
    fn fade(&mut self, instance: String, fading: Fading, now: Millis) {
        if fading.at.saturating_add(self.rules.window.period) > now && !fading.counts.is_empty() {
            self.fading.insert(instance, fading);
        }
    }

    /// Takes another instance's demotion of `tenant` (since `since`, its rate known at or
    /// above the recovery threshold until `above_until`): unless the rule has promoted it
    /// since (`above_until + cooldown` passed) or it is pinned, the tenant is demoted here too,
    /// and its earliest recovery here is no earlier than there, so the instances promote it
    /// together. Returns whether it was newly demoted here (the caller reports the change at
    /// run time, so that the tenant's reporter publishes it whichever instance decided; at a
    /// restore it is not a change).
    fn adopt(&mut self, tenant: &str, since: Millis, above_until: Millis, now: Millis) -> bool {
        if self.pin_of(tenant).is_some()
            || !self.table.auto_demotion()
            || above_until.saturating_add(self.rules.cooldown) <= now
        {
            return false;
        }
        let key: Arc<str> = match self.tenants.get_key_value(tenant) {
            Some((k, _)) => Arc::clone(k),
            None => Arc::from(tenant),
        };
        let is_new = !self.tenants.contains_key(tenant);
        let t = self
            .tenants
            .entry(Arc::clone(&key))
            .or_insert_with(Tenant::new);
        t.shared_above_until = t.shared_above_until.max(above_until);
        let newly = t.demoted_since.is_none();
        if newly {
            t.demoted_since = Some(since);
        }
        if is_new {
            // One heap entry per tracked tenant; a known tenant has its entry already.
            let check = t.next_check(&self.rules).unwrap_or(now);
            self.checks.push(Reverse((check, Arc::clone(&key))));
        }
        if newly {
            self.demoted.insert(key);
        }
        newly
    }

    /// Re-checks `tenant` against its deployment-wide count at `now` after the other
    /// instances' counts changed: a demotion, or a later earliest recovery.
    fn check_shared(&mut self, tenant: &Arc<str>, now: Millis) -> Option<TierChange> {
        let pinned = self.pin_of(tenant);
        if pinned.is_some() || !self.table.auto_demotion() {
            return None;
        }
        let remote = self.remote_at(tenant, now);
        let (table, rules) = (&*self.table, &self.rules);
        let change = match self.tenants.get_mut(&**tenant) {
            Some(t) => {
                t.window.expire(now, &rules.window);
                let total = t.window.count_at(now, &rules.window) + remote;
                t.observe(total, remote, now, rules);
                t.try_demote(tenant, pinned, total, now, table, rules)
            }
            None if remote > rules.window.limit => {
                let mut t = Tenant::new();
                t.observe(remote, remote, now, rules);
                let change = t.try_demote(tenant, pinned, remote, now, table, rules);
                let check = t.next_check(rules).unwrap_or(now);
                self.checks.push(Reverse((check, Arc::clone(tenant))));
                self.tenants.insert(Arc::clone(tenant), t);
                change
            }
            None => None,
        }?;
        self.note(&change);
        Some(change)
    }

    /// Removes `instance`'s counts from the sums.
    fn drop_remote(&mut self, instance: &str) {
        let Some(old) = self.remotes.remove(instance) else {
            return;
        };
        for (tenant, count) in old.counts {
            if let Some(sum) = self.remote_sum.get_mut(&tenant) {
                *sum = sum.saturating_sub(count);
                if *sum == 0 {
                    self.remote_sum.remove(&tenant);
                }
            }
        }
    }

    /// Takes the instances that stopped publishing (expired at `now`) as stopped: their counts
    /// fade out ([`Fading`]); drops faded ones.
    fn expire_remotes(&mut self, now: Millis) {
        let gone: Vec<String> = self
            .remotes
            .iter()
            .filter(|(_, r)| r.expires_at <= now)
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            tracing::info!(instance = %name, "an instance stopped publishing its tier counts: they fade out over one period");
            if let Some(r) = self.remotes.get(&name) {
                let fading = Fading {
                    counts: r.counts.iter().map(|(t, c)| (Arc::clone(t), *c)).collect(),
                    at: r.at,
                };
                self.drop_remote(&name);
                self.fade(name, fading, now);
            }
        }
        let period = self.rules.window.period;
        self.fading.retain(|_, f| f.at.saturating_add(period) > now);
    }

    /// Restores tier state at start from the latest snapshot of every instance that published
    /// one (as read from the broker, `now_ms` the wall clock): counts of instances still live
    /// (their snapshot younger than its expiry) are summed as by [`Router::apply_remote`], and
    /// every tenant demoted in any snapshot is demoted here again (from its earliest `since`,
    /// with its latest `above-until`) unless it has recovered by the rule since (its
    /// `above-until` plus `cooldown` passed). Restored demotions are not changes: nothing is published for them
    /// (the change was published when it happened). This instance's own snapshots of an
    /// earlier run (same name) count as any other's demotions, not as live counts.
    pub fn restore(&mut self, snapshots: &[CountsSnapshot], now_ms: Millis) -> Restored {
        let now = self.advance(now_ms);
        let mut restored = Restored {
            snapshots: snapshots.len(),
            ..Restored::default()
        };
        let mut demotions: BTreeMap<&str, (Millis, Millis)> = BTreeMap::new();
        for s in snapshots {
            for d in &s.demoted {
                let e = demotions
                    .entry(d.tenant.as_str())
                    .or_insert((d.since, d.above_until));
                e.0 = e.0.min(d.since);
                e.1 = e.1.max(d.above_until);
            }
        }
        for (tenant, (since, above_until)) in demotions {
            if self.adopt(tenant, since, above_until, now) {
                restored.demoted += 1;
            }
        }
        for s in snapshots {
            let expires_at = s.expires_at(s.at);
            if s.instance == self.instance {
                continue;
            }
            if !s.stopping && expires_at > now {
                restored.live += 1;
                let changes = self.take_remote(s, expires_at, now);
                restored.changes.extend(changes);
            } else {
                self.fade(s.instance.clone(), fading_of(s), now);
            }
        }
        restored.fading = self.fading.len();
        restored
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
                    rate: t.window.rate_at(now, &self.rules.window) + self.remote_at(name, now),
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
            reporter = self.reports(&change.tenant),
            "tier change"
        );
    }
}

/// The other instances' count of `tenant` at `now`: the live ones' latest counts plus what is
/// left of stopped ones' last counts.
fn remote_at(
    live: &HashMap<Arc<str>, u64>,
    fading: &BTreeMap<String, Fading>,
    tenant: &str,
    now: Millis,
    rules: &Rules,
) -> u64 {
    let live = live.get(tenant).copied().unwrap_or(0);
    live + fading
        .values()
        .map(|f| f.count_at(tenant, now, rules.window.period))
        .sum::<u64>()
}

/// The counts of `snapshot` as [`Fading`].
fn fading_of(snapshot: &CountsSnapshot) -> Fading {
    Fading {
        counts: snapshot
            .counts
            .iter()
            .map(|(t, &c)| (Arc::from(t.as_str()), c))
            .collect(),
        at: snapshot.at,
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

    /// [`SharedRouter::route`] for each tenant of `tenants` in order (one per emission of
    /// a batch), under one hold of the lock: one route per tenant, in the same order.
    pub fn route_many<'t>(
        &self,
        tenants: impl Iterator<Item = &'t str>,
        now_ms: Millis,
    ) -> Vec<Route<'_>> {
        let mut router = self.lock();
        tenants
            .map(|tenant| {
                let (tier, change) = router.decide(tenant, now_ms);
                Route {
                    tier: &self.table.names[tier],
                    topic: &self.table.topics[tier],
                    change,
                }
            })
            .collect()
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
