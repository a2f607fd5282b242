//! Shadow policies (SEMANTICS §8): candidate policies run beside the live one on the same
//! uploads and the same partition time, through the same [`Driver`], each over its own
//! in-memory [`MemTable`], emitting nothing. Their would-be emissions are only counted:
//! uploads per emission and time-to-ready per tier and tenant class ([`Figures`],
//! [`TenantClass`]), beside the live policy's.
//!
//! Invariants:
//! * a shadow sees exactly the uploads handed to [`ShadowSet::apply`], at the partition time
//!   given, and fires its due rounds on [`ShadowSet::advance`]; it never writes anywhere;
//! * time-to-ready is `due_at − last_upload_at` (ms): what `settle tune` and `settle
//!   simulate` report, where a round is emitted at its due time (`cli::report`). So on a
//!   replayed trace a shadow's figures equal the what-if tool's for the same policy, however
//!   late the runtime fires it; the live policy is measured the same way here (its actual
//!   `emitted_at` is in `settle_time_to_ready_seconds`);
//! * one policy applies to every tenant (`PolicyTable::uniform`), as in `settle tune`;
//! * a shadow keeps no attributes (they only ride on emissions);
//! * memory is bounded by `max_sessions` keys per shadow (about 150 bytes a key, 300 with an
//!   open round, plus the key and its last event id): an upload of a key the table does
//!   not hold, while it holds `max_sessions` keys, is refused and counted
//!   ([`Figures::refused_uploads`], [`Figures::refused_sessions`]). A refused key stays refused
//!   (the shadow does not follow half a session) as long as its refusal is remembered (up to
//!   `max_sessions` refused keys, 8 bytes each); past that, each refused upload of a key not
//!   remembered counts as one more session (an upper bound). A key whose state expired
//!   (`state-ttl`) frees its room.
//!
//! Pure: no clock, no I/O (the engine's rule); the caller says which tier and class a tenant
//! is in.

use super::figures::Spread;
use super::partition::{Driver, MemTable};
use super::policy::{PolicySpec, PolicyTable};
use super::types::{Emission, Millis, SessionKey, Trigger, Upload};
use super::Engine;
use rustc_hash::{FxHashSet, FxHasher};
use std::hash::{Hash, Hasher};

/// Most `[[shadow]]` entries a config may have (each costs a driver step per upload).
pub const MAX_SHADOWS: usize = 4;

/// The name the live policy's figures go by beside the shadows' (no shadow may take it).
pub const LIVE: &str = "live";

/// Default memory budget of one shadow in one partition: session keys held
/// (`runtime.shadow-max-sessions`).
pub const DEFAULT_MAX_SESSIONS: u32 = 100_000;

/// One shadow policy as configured (`[[shadow]]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShadowSpec {
    /// `name`: how its figures are labelled (metrics label `shadow`, `GET /v1/shadow`).
    pub name: String,
    /// The policy and its parameters (ms), applied to every tenant.
    pub policy: PolicySpec,
    /// Most session keys it holds per partition (its memory budget).
    pub max_sessions: usize,
}

/// The figures of one policy in one tier.
#[derive(Clone, Debug, Default)]
pub struct TierFigures {
    /// Emissions (would-be emissions for a shadow).
    pub emissions: u64,
    /// Uploads in them (their `uploads` fields summed).
    pub uploads: u64,
    /// Their time-to-ready, `due_at − last_upload_at` (ms; module docs).
    pub time_to_ready: Spread,
}

impl TierFigures {
    /// Counts the emission `e`.
    pub fn record(&mut self, e: &Emission) {
        self.emissions += 1;
        self.uploads += u64::from(e.uploads);
        self.time_to_ready
            .record((e.due_at - e.last_upload_at).max(0) as u64);
    }

    /// Adds `other`'s figures into these.
    pub fn add(&mut self, other: &TierFigures) {
        self.emissions += other.emissions;
        self.uploads += other.uploads;
        self.time_to_ready.add(&other.time_to_ready);
    }

    /// Uploads per emission (0 before the first emission).
    pub fn uploads_per_emission(&self) -> f64 {
        if self.emissions == 0 {
            0.0
        } else {
            self.uploads as f64 / self.emissions as f64
        }
    }
}

/// A tenant's class (SEMANTICS §8 "per tier and tenant class"): whether the live policy times
/// its rounds with the deployment's `[debounce]` rule or with a rule of its own (a
/// `[debounce.tenants.NAME]` entry or an operator's override, SEMANTICS §7). A shadow applies
/// one policy to every tenant, so its figures for `own` tenants show what that policy would do
/// to the tenants that today have a rule of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TenantClass {
    /// The live policy times the tenant with the deployment's `[debounce]` rule.
    Default = 0,
    /// The tenant has a rule of its own (config or override).
    Own = 1,
}

impl TenantClass {
    /// Both classes, in index order.
    pub const ALL: [TenantClass; 2] = [TenantClass::Default, TenantClass::Own];

    /// The class of `tenant` under the live rules `table`.
    pub fn of(table: &PolicyTable, tenant: &str) -> TenantClass {
        if !table.tenants.is_empty() && table.tenants.contains_key(tenant) {
            TenantClass::Own
        } else {
            TenantClass::Default
        }
    }

    /// Its name in `GET /v1/shadow` and the metrics' `class` label: `default` or `own`.
    pub fn name(self) -> &'static str {
        match self {
            TenantClass::Default => "default",
            TenantClass::Own => "own",
        }
    }
}

/// The figures of one policy: per tier (index = the tier's place in the tier list) and tenant
/// class ([`TenantClass`]), and what it could not follow.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    /// Per tier, in tier-list order (shorter when the last tiers saw nothing); in each, per
    /// [`TenantClass`] (index = its value).
    pub tiers: Vec<[TierFigures; 2]>,
    /// Sessions a shadow refused for want of room (module docs; 0 for the live policy).
    pub refused_sessions: u64,
    /// Uploads a shadow refused (of refused sessions).
    pub refused_uploads: u64,
    /// Session keys held now (a shadow's table; 0 for the live policy).
    pub sessions: u64,
}

impl Figures {
    /// Counts the emission `e` in tier `tier`, tenant class `class`.
    pub fn record(&mut self, tier: usize, class: TenantClass, e: &Emission) {
        if self.tiers.len() <= tier {
            self.tiers.resize_with(tier + 1, Default::default);
        }
        self.tiers[tier][class as usize].record(e);
    }

    /// Adds `other`'s figures into these (another partition's).
    pub fn add(&mut self, other: &Figures) {
        if self.tiers.len() < other.tiers.len() {
            self.tiers.resize_with(other.tiers.len(), Default::default);
        }
        for (mine, theirs) in self.tiers.iter_mut().zip(&other.tiers) {
            for (m, t) in mine.iter_mut().zip(theirs) {
                m.add(t);
            }
        }
        self.refused_sessions += other.refused_sessions;
        self.refused_uploads += other.refused_uploads;
        self.sessions += other.sessions;
    }

    /// All tiers and classes together.
    pub fn total(&self) -> TierFigures {
        let mut t = TierFigures::default();
        for tier in &self.tiers {
            for c in tier {
                t.add(c);
            }
        }
        t
    }

    /// The figures of tier `tier`, both classes (empty when it saw nothing).
    pub fn tier(&self, tier: usize) -> TierFigures {
        let mut t = TierFigures::default();
        if let Some(cells) = self.tiers.get(tier) {
            for c in cells {
                t.add(c);
            }
        }
        t
    }

    /// The figures of tenant class `class`, all tiers.
    pub fn class(&self, class: TenantClass) -> TierFigures {
        let mut t = TierFigures::default();
        for tier in &self.tiers {
            t.add(&tier[class as usize]);
        }
        t
    }

    /// The figures of tier `tier` and tenant class `class` (empty when it saw nothing).
    pub fn cell(&self, tier: usize, class: TenantClass) -> TierFigures {
        self.tiers
            .get(tier)
            .map(|c| c[class as usize].clone())
            .unwrap_or_default()
    }
}

/// One shadow policy over one partition: its driver, its table and its figures.
#[derive(Clone, Debug)]
pub struct Shadow {
    driver: Driver,
    table: MemTable,
    max_sessions: usize,
    /// Hashes of the keys refused (at most `max_sessions`).
    refused: FxHashSet<u64>,
    /// Would-be emissions not counted yet (their tiers are looked up by the caller).
    out: Vec<Emission>,
    figures: Figures,
}

impl Shadow {
    /// An empty shadow running `spec`.
    pub fn new(spec: &ShadowSpec) -> Self {
        Shadow {
            driver: Driver::new(Engine::new(PolicyTable::uniform(spec.policy.clone()))),
            table: MemTable::new(),
            max_sessions: spec.max_sessions.max(1),
            refused: FxHashSet::default(),
            out: Vec::new(),
            figures: Figures::default(),
        }
    }

    /// Applies `upload` at partition time `now` (ms), as `Driver::apply` does, unless the
    /// key does not fit (module docs).
    pub fn apply(&mut self, now: Millis, upload: &Upload) {
        let now = now.max(upload.event_time);
        // What is due fires first: an expired key frees its room before the check.
        let Ok(_) = self.driver.advance(&mut self.table, now, &mut self.out);
        if !self.refused.is_empty() && self.refused.contains(&key_hash(&upload.key)) {
            self.figures.refused_uploads += 1;
            return;
        }
        if self.table.len() >= self.max_sessions && self.table.state(&upload.key).is_none() {
            self.figures.refused_uploads += 1;
            self.figures.refused_sessions += 1;
            if self.refused.len() < self.max_sessions {
                self.refused.insert(key_hash(&upload.key));
            }
            return;
        }
        let Ok(_) = self
            .driver
            .apply(&mut self.table, now, upload, &mut self.out);
    }

    /// Fires every round due at or before `now` (ms).
    pub fn advance(&mut self, now: Millis) {
        let Ok(_) = self.driver.advance(&mut self.table, now, &mut self.out);
    }

    /// Its figures so far (emissions counted by [`ShadowSet::count`]).
    pub fn figures(&self) -> &Figures {
        &self.figures
    }
}

fn key_hash(key: &SessionKey) -> u64 {
    let mut h = FxHasher::default();
    key.hash(&mut h);
    h.finish()
}

/// The shadows of one partition and the live policy's figures beside them.
#[derive(Clone, Debug)]
pub struct ShadowSet {
    since: Millis,
    shadows: Vec<Shadow>,
    live: Figures,
}

impl ShadowSet {
    /// Empty shadows of `specs`, measuring from `since` (ms, wall clock: the partition's
    /// assignment).
    pub fn new(specs: &[ShadowSpec], since: Millis) -> Self {
        ShadowSet {
            since,
            shadows: specs.iter().map(Shadow::new).collect(),
            live: Figures::default(),
        }
    }

    /// When the figures start (ms since the epoch).
    pub fn since(&self) -> Millis {
        self.since
    }

    /// The shadows, in config order.
    pub fn shadows(&self) -> &[Shadow] {
        &self.shadows
    }

    /// The live policy's figures.
    pub fn live(&self) -> &Figures {
        &self.live
    }

    /// Hands `upload` to every shadow at partition time `now` (ms): call it right after the
    /// live driver applied it, with the same `now`.
    pub fn apply(&mut self, now: Millis, upload: &Upload) {
        // Attributes (up to 16 KiB) ride on emissions only: a shadow does not keep them.
        let stripped;
        let upload = match upload.attributes {
            None => upload,
            Some(_) => {
                stripped = Upload {
                    key: upload.key.clone(),
                    event_id: upload.event_id.clone(),
                    attributes: None,
                    ..*upload
                };
                &stripped
            }
        };
        for s in &mut self.shadows {
            s.apply(now, upload);
        }
    }

    /// Partition time moved to `now` (ms): every shadow fires what is due.
    pub fn advance(&mut self, now: Millis) {
        for s in &mut self.shadows {
            s.advance(now);
        }
    }

    /// Whether [`ShadowSet::count`] has emissions to place in tiers (with `live`, the live
    /// policy's emissions of the step).
    pub fn has_emissions(&self, live: &[Emission]) -> bool {
        !live.is_empty() || self.shadows.iter().any(|s| !s.out.is_empty())
    }

    /// Counts the live policy's emissions `live` (`manual` ones, an operator's, are left
    /// out: the shadows see no actions) and every shadow's would-be emissions since the last
    /// call, each in the tier and tenant class `place(tenant)` says (an index into the tier
    /// list, and [`TenantClass::of`] the live rules).
    pub fn count(
        &mut self,
        live: &[Emission],
        mut place: impl FnMut(&str) -> (usize, TenantClass),
    ) {
        for e in live.iter().filter(|e| e.trigger != Trigger::Manual) {
            let (tier, class) = place(e.key.tenant());
            self.live.record(tier, class, e);
        }
        for s in &mut self.shadows {
            for e in s.out.drain(..) {
                let (tier, class) = place(e.key.tenant());
                s.figures.record(tier, class, &e);
            }
            s.figures.sessions = s.table.len() as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(session: &str, t: Millis) -> Upload {
        Upload::plain(SessionKey::new("t", session), t)
    }

    fn spec(max_sessions: usize) -> ShadowSpec {
        ShadowSpec {
            name: "slow".to_owned(),
            policy: PolicySpec::fixed(1_000),
            max_sessions,
        }
    }

    #[test]
    fn counts_would_be_emissions_per_tier_with_time_to_ready() {
        let mut set = ShadowSet::new(&[spec(10)], 5);
        for (s, t) in [("a", 0), ("a", 400), ("b", 100), ("a", 900)] {
            set.apply(t, &up(s, t));
        }
        set.advance(10_000);
        // Tenant `t` in tier 1: a (3 uploads, due 1 900), b (1 upload, due 1 100).
        set.count(&[], |_| (1, TenantClass::Default));
        let f = set.shadows()[0].figures();
        assert_eq!(f.tiers.len(), 2);
        assert_eq!(f.tier(0).emissions, 0);
        let t = f.tier(1);
        assert_eq!((t.emissions, t.uploads), (2, 4));
        assert_eq!(t.uploads_per_emission(), 2.0);
        let p = t.time_to_ready.percentiles();
        assert_eq!((p.p50, p.max), (1_000, 1_000));
        assert_eq!(f.sessions, 2);
        assert_eq!(set.since(), 5);
    }

    #[test]
    fn sessions_that_do_not_fit_are_counted_not_followed() {
        let mut set = ShadowSet::new(&[spec(2)], 0);
        set.apply(0, &up("a", 0));
        set.apply(1, &up("b", 1));
        // Full: c is refused, and stays refused even once a key expires.
        set.apply(2, &up("c", 2));
        set.apply(3, &up("c", 3));
        set.apply(4, &up("a", 4));
        set.count(&[], |_| (0, TenantClass::Default));
        let f = set.shadows()[0].figures();
        assert_eq!((f.refused_sessions, f.refused_uploads), (1, 2));
        assert_eq!(f.sessions, 2);
        // After state-ttl (24 h) a and b are gone: d fits, c is still refused.
        let day = 24 * 60 * 60 * 1000;
        set.apply(day + 10, &up("d", day + 10));
        set.apply(day + 11, &up("c", day + 11));
        set.count(&[], |_| (0, TenantClass::Default));
        let f = set.shadows()[0].figures();
        assert_eq!((f.refused_sessions, f.refused_uploads), (1, 3));
        assert_eq!(f.sessions, 1);
        assert_eq!(f.total().emissions, 2);
    }

    #[test]
    fn live_figures_leave_manual_emissions_out_and_merge() {
        let mut live = ShadowSet::new(&[], 0);
        let mut out = Vec::new();
        let mut driver = Driver::new(Engine::new(PolicyTable::uniform(PolicySpec::fixed(10))));
        let mut table = MemTable::new();
        let Ok(_) = driver.apply(&mut table, 0, &up("a", 0), &mut out);
        let Ok(_) = driver.advance(&mut table, 100, &mut out);
        let mut manual = out[0].clone();
        manual.trigger = Trigger::Manual;
        out.push(manual);
        assert!(live.has_emissions(&out));
        live.count(&out, |_| (0, TenantClass::Default));
        assert_eq!(live.live().total().emissions, 1);
        let mut sum = Figures::default();
        sum.add(live.live());
        sum.add(live.live());
        assert_eq!(sum.total().emissions, 2);
        assert_eq!(sum.total().time_to_ready.percentiles().p99, 10);
    }

    #[test]
    fn figures_are_kept_per_tier_and_tenant_class() {
        // Tenant `own` has a rule of its own in the live table, `t` does not.
        let mut table = PolicyTable::uniform(PolicySpec::fixed(10));
        table
            .tenants
            .insert("own".to_owned(), PolicySpec::fixed(5_000));
        assert_eq!(TenantClass::of(&table, "own"), TenantClass::Own);
        assert_eq!(TenantClass::of(&table, "t"), TenantClass::Default);
        assert_eq!(
            TenantClass::of(&PolicyTable::uniform(PolicySpec::fixed(10)), "own"),
            TenantClass::Default
        );

        let mut set = ShadowSet::new(&[spec(10)], 0);
        set.apply(0, &up("a", 0));
        set.apply(1, &Upload::plain(SessionKey::new("own", "x"), 1));
        set.apply(2, &Upload::plain(SessionKey::new("own", "y"), 2));
        set.advance(10_000);
        set.count(&[], |tenant| (1, TenantClass::of(&table, tenant)));
        let f = set.shadows()[0].figures();
        assert_eq!(f.cell(1, TenantClass::Default).emissions, 1);
        assert_eq!(f.cell(1, TenantClass::Own).emissions, 2);
        assert_eq!(f.cell(0, TenantClass::Own).emissions, 0);
        assert_eq!(f.class(TenantClass::Own).emissions, 2);
        assert_eq!(f.class(TenantClass::Default).emissions, 1);
        assert_eq!(f.tier(1).emissions, 3);
        assert_eq!(f.total().emissions, 3);
        assert_eq!(TenantClass::Own.name(), "own");
    }
}
