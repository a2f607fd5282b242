//! Learned initial delay per tenant (the seed's v4 wish): with `adaptive` and
//! `learn-initial-delay = true`, the first upload of a session (a key without a CallTrack)
//! starts from its tenant's learned delay instead of `min-delay`, so a tenant whose sessions
//! always upload twice, 20 s apart, gets one emission per session instead of two.
//!
//! # The statistic
//!
//! * **Samples.** Each on-time upload of a key that has a CallTrack observes one interval:
//!   its event time minus the track's time (ms, SEMANTICS §4 adaptive). Intervals longer than
//!   the tenant's `max-delay` are ignored: the adaptive rule never waits that long, so such
//!   an upload starts new activity rather than continuing a session. Late and redelivered
//!   uploads observe nothing.
//! * **Window.** The last [`LEARN_WINDOW`] (64) intervals of the tenant, oldest dropped first
//!   ([`TenantStats`]; about 0.5 KiB per tenant).
//! * **Outliers.** With median `m` and median absolute deviation `MAD`, an interval is an
//!   outlier when its modified z-score `0.6745 · |x − m| / MAD` exceeds 3.5 (Iglewicz and
//!   Hoaglin); with `MAD = 0` every interval other than `m` is one.
//! * **Learned delay.** The 90th percentile (nearest rank) of the remaining intervals plus
//!   25 % headroom, clamped to `[min-delay, max-delay]`. The headroom matters: a round due at
//!   exactly the next upload's time fires before that upload is applied (SEMANTICS §4), so a
//!   delay equal to the usual interval would still emit twice. Fewer than
//!   [`LEARN_MIN_SAMPLES`] (8) intervals: nothing is learned yet and `min-delay` applies.
//!
//! What a tenant learns is what most of its recent intervals say: a tenant whose sessions
//! upload in 700-way bursts learns intervals of milliseconds, i.e. `min-delay`, exactly as
//! without learning.
//!
//! # Bounds
//!
//! Per tenant: [`LEARN_WINDOW`] intervals. Per partition: at most [`MAX_LEARNED_TENANTS`]
//! tenants; storing a new tenant beyond that forgets the tenant whose statistics were updated
//! least recently (smallest [`TenantStats::last_seen`], ties by smallest name), see
//! [`TenantAges`]. Every `SessionTable` keeps this rule, so the in-memory table and the
//! partition store learn the same delays from the same input.

use super::policy::PolicySpec;
use super::types::{Millis, PolicyName};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::sync::Arc;

/// Intervals kept per tenant (the most recent ones).
pub const LEARN_WINDOW: usize = 64;

/// Intervals a tenant needs before a delay is learned; below this `min-delay` applies.
pub const LEARN_MIN_SAMPLES: usize = 8;

/// Most tenants with statistics per partition; see the module docs for the eviction rule.
pub const MAX_LEARNED_TENANTS: usize = 4096;

/// Headroom over the 90th percentile: `delay = p90 · HEADROOM_NUM / HEADROOM_DEN` (+25 %).
const HEADROOM_NUM: i128 = 5;
const HEADROOM_DEN: i128 = 4;

/// Modified z-score limit (Iglewicz and Hoaglin): outlier when `0.6745 · |x − m| / MAD > 3.5`,
/// compared in integers as `6745 · |x − m| > 35000 · MAD`.
const Z_NUM: i128 = 6_745;
const Z_LIMIT: i128 = 35_000;

/// The learned-delay statistics of one tenant in one partition: its recent intervals.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantStats {
    /// The most recent observed intervals (ms), oldest first, at most [`LEARN_WINDOW`].
    pub intervals: Vec<Millis>,
    /// Partition time (ms) when the last interval was recorded: the eviction order.
    pub last_seen: Millis,
}

/// What [`TenantStats::summary`] finds in a window (all values in ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LearnSummary {
    /// Intervals in the window.
    pub samples: usize,
    /// Intervals left after outlier rejection.
    pub inliers: usize,
    /// Median of the window.
    pub median: Millis,
    /// Median absolute deviation of the window.
    pub mad: Millis,
    /// 90th percentile (nearest rank) of the inliers.
    pub p90: Millis,
    /// `p90` plus 25 % headroom, before clamping to the policy's `[min-delay, max-delay]`.
    pub raw_delay: Millis,
}

impl TenantStats {
    /// Records one observed `interval` (ms) at partition time `now` (ms) for a tenant whose
    /// `max-delay` is `max_delay` (ms). Returns false (and changes nothing) when the interval
    /// is negative or longer than `max_delay`; otherwise the window keeps the last
    /// [`LEARN_WINDOW`] intervals and `last_seen` becomes `now`.
    pub fn record(&mut self, interval: Millis, now: Millis, max_delay: Millis) -> bool {
        if !(0..=max_delay).contains(&interval) {
            return false;
        }
        if self.intervals.len() >= LEARN_WINDOW {
            let excess = self.intervals.len() + 1 - LEARN_WINDOW;
            self.intervals.drain(..excess);
        }
        self.intervals.push(interval);
        self.last_seen = self.last_seen.max(now);
        true
    }

    /// The statistic of the module docs over the current window; `None` with fewer than
    /// [`LEARN_MIN_SAMPLES`] intervals.
    pub fn summary(&self) -> Option<LearnSummary> {
        let n = self.intervals.len();
        if n < LEARN_MIN_SAMPLES {
            return None;
        }
        let mut sorted = self.intervals.clone();
        sorted.sort_unstable();
        let median = median_of_sorted(&sorted);
        let mut deviations: Vec<Millis> = sorted.iter().map(|&x| (x - median).abs()).collect();
        deviations.sort_unstable();
        let mad = median_of_sorted(&deviations);
        let inliers: Vec<Millis> = sorted
            .into_iter()
            .filter(|&x| Z_NUM * i128::from((x - median).abs()) <= Z_LIMIT * i128::from(mad))
            .collect();
        // The median itself always passes, so `inliers` is never empty.
        let rank = (inliers.len() * 9).div_ceil(10).max(1);
        let p90 = inliers[rank - 1];
        let raw = i128::from(p90) * HEADROOM_NUM / HEADROOM_DEN;
        Some(LearnSummary {
            samples: n,
            inliers: inliers.len(),
            median,
            mad,
            p90,
            raw_delay: Millis::try_from(raw).unwrap_or(Millis::MAX),
        })
    }

    /// The initial delay (ms) this tenant's sessions start from under `spec`: the learned
    /// delay clamped to `[min-delay, max-delay]`. `None` when `spec` does not learn
    /// ([`PolicySpec::learns`]) or too few intervals are known (then `min-delay` applies).
    pub fn learned_delay(&self, spec: &PolicySpec) -> Option<Millis> {
        if !spec.learns() {
            return None;
        }
        let s = self.summary()?;
        Some(s.raw_delay.clamp(spec.min_delay, spec.max_delay))
    }
}

/// Median of a sorted, non-empty slice (the lower middle for an even length, so it is one
/// of the values: integers stay exact).
fn median_of_sorted(sorted: &[Millis]) -> Millis {
    sorted[(sorted.len() - 1) / 2]
}

impl PolicySpec {
    /// True when this policy learns initial delays: `adaptive` with `learn-initial-delay`.
    pub fn learns(&self) -> bool {
        self.name == PolicyName::Adaptive && self.learn_initial_delay
    }
}

/// The eviction order of the tenants with statistics in one table: `last_seen` (ms) per
/// tenant, oldest first. The in-memory table keeps one, the partition store keeps one of
/// its committed tenants (rebuilt when it opens).
#[derive(Clone, Debug, Default)]
pub struct TenantAges {
    order: BTreeSet<(Millis, Arc<str>)>,
    age: FxHashMap<Arc<str>, Millis>,
}

impl TenantAges {
    /// No tenant.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of tenants.
    pub fn len(&self) -> usize {
        self.age.len()
    }

    /// True when no tenant is kept.
    pub fn is_empty(&self) -> bool {
        self.age.is_empty()
    }

    /// True when `tenant` is kept.
    pub fn contains(&self, tenant: &str) -> bool {
        self.age.contains_key(tenant)
    }

    /// Sets `tenant`'s `last_seen` (ms), adding the tenant if new. Allocates only for a new
    /// tenant.
    pub fn touch(&mut self, tenant: &str, last_seen: Millis) {
        match self.age.get_key_value(tenant) {
            Some((_, old)) if *old == last_seen => {}
            Some((key, old)) => {
                let (key, old) = (Arc::clone(key), *old);
                self.order.remove(&(old, Arc::clone(&key)));
                self.order.insert((last_seen, Arc::clone(&key)));
                self.age.insert(key, last_seen);
            }
            None => {
                let key: Arc<str> = tenant.into();
                self.age.insert(Arc::clone(&key), last_seen);
                self.order.insert((last_seen, key));
            }
        }
    }

    /// Forgets `tenant`; returns whether it was kept.
    pub fn remove(&mut self, tenant: &str) -> bool {
        match self.age.remove_entry(tenant) {
            Some((key, old)) => {
                self.order.remove(&(old, key));
                true
            }
            None => false,
        }
    }

    /// Tenants, least recently seen first: `(last_seen ms, tenant)`.
    pub fn oldest_first(&self) -> impl Iterator<Item = (Millis, &str)> {
        self.order.iter().map(|(t, name)| (*t, &**name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(intervals: &[Millis]) -> TenantStats {
        TenantStats {
            intervals: intervals.to_vec(),
            last_seen: 0,
        }
    }

    fn learning(min: Millis, max: Millis) -> PolicySpec {
        PolicySpec::adaptive(min, max).with_learned_initial_delay(true)
    }

    #[test]
    fn nothing_is_learned_from_too_few_intervals() {
        let s = stats(&[20_000; LEARN_MIN_SAMPLES - 1]);
        assert_eq!(s.summary(), None);
        assert_eq!(s.learned_delay(&learning(5_000, 600_000)), None);
    }

    #[test]
    fn steady_intervals_learn_the_interval_plus_headroom() {
        let s = stats(&[20_000; 10]);
        let sum = s.summary().unwrap();
        assert_eq!((sum.median, sum.mad, sum.p90), (20_000, 0, 20_000));
        assert_eq!(sum.raw_delay, 25_000);
        assert_eq!(s.learned_delay(&learning(5_000, 600_000)), Some(25_000));
        // Clamped to the policy's range.
        assert_eq!(s.learned_delay(&learning(30_000, 600_000)), Some(30_000));
        assert_eq!(s.learned_delay(&learning(1_000, 22_000)), Some(22_000));
        // Policies that do not learn get nothing.
        assert_eq!(s.learned_delay(&PolicySpec::adaptive(5_000, 600_000)), None);
        let fixed = PolicySpec {
            learn_initial_delay: true,
            ..PolicySpec::fixed(5_000)
        };
        assert_eq!(s.learned_delay(&fixed), None);
    }

    #[test]
    fn outliers_are_rejected_by_the_modified_z_score() {
        // Median 20 000, MAD 500: the limit is 3.5 / 0.6745 · 500 ≈ 2 594 ms around it, so
        // 9 min is an outlier and 22 000 is not.
        let mut v = vec![
            19_500, 20_000, 20_500, 20_000, 19_500, 20_500, 22_000, 20_000,
        ];
        v.push(540_000);
        let s = stats(&v);
        let sum = s.summary().unwrap();
        assert_eq!((sum.median, sum.mad), (20_000, 500));
        assert_eq!((sum.samples, sum.inliers), (9, 8));
        // p90 of the 8 inliers: rank ⌈7.2⌉ = 8 → the largest, 22 000.
        assert_eq!(sum.p90, 22_000);
        assert_eq!(sum.raw_delay, 27_500);
    }

    #[test]
    fn the_window_keeps_the_most_recent_intervals() {
        let mut s = TenantStats::default();
        for i in 0..(LEARN_WINDOW as Millis + 10) {
            assert!(s.record(i, 1_000 + i, 600_000));
        }
        assert_eq!(s.intervals.len(), LEARN_WINDOW);
        assert_eq!(s.intervals[0], 10);
        assert_eq!(s.last_seen, 1_000 + LEARN_WINDOW as Millis + 9);
        // Longer than max-delay, or negative: ignored.
        assert!(!s.record(600_001, 99_999, 600_000));
        assert!(!s.record(-1, 99_999, 600_000));
        assert_eq!(s.intervals.len(), LEARN_WINDOW);
        assert_eq!(s.last_seen, 1_000 + LEARN_WINDOW as Millis + 9);
    }

    #[test]
    fn ages_order_tenants_oldest_first_with_ties_by_name() {
        let mut a = TenantAges::new();
        a.touch("b", 5);
        a.touch("a", 5);
        a.touch("c", 1);
        assert_eq!(
            a.oldest_first().collect::<Vec<_>>(),
            vec![(1, "c"), (5, "a"), (5, "b")]
        );
        a.touch("c", 9);
        assert_eq!(a.oldest_first().next(), Some((5, "a")));
        assert!(a.remove("a"));
        assert!(!a.remove("a"));
        assert_eq!(a.len(), 2);
        assert_eq!(
            a.oldest_first().collect::<Vec<_>>(),
            vec![(5, "b"), (9, "c")]
        );
    }
}
