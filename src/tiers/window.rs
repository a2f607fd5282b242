//! The per-tenant rate measure: an exact sliding window of emission timestamps.
//!
//! The rate at time `t` is the number of emissions with time in `(t - period, t]`: an
//! emission at `e` counts during `[e, e + period)`. Decisions only ever compare the count
//! with `limit + 1` (demotion) and with `k = ⌈limit × recover-ratio⌉ ≤ limit` (recovery), so
//! the window keeps only the latest `limit + 1` timestamps: that is enough for both to be
//! exact, and bounds memory at `8 × (limit + 1)` bytes per tenant. Timestamps pushed out by
//! that cap while still inside the period are counted in at most ~65 coarse buckets
//! (`period / 64` wide), used only to *report* rates above `limit + 1` (over-estimate by at most
//! one bucket's worth).
//!
//! Times handed in must not go backwards; the router guarantees it.

use crate::engine::Millis;
use std::collections::VecDeque;

/// Number of coarse buckets per period for timestamps beyond the cap (reporting only).
const OVERFLOW_BUCKETS: Millis = 64;

/// Router-wide constants of the measure, derived once from the validated config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WindowParams {
    /// Window length (ms), ≥ 1.
    pub period: Millis,
    /// Demotion limit (emissions per period), ≥ 1.
    pub limit: u64,
    /// Timestamps kept exactly: `limit + 1`.
    pub cap: usize,
    /// `k`: the rate is "below the recovery threshold" when the count is `< k`; 1 ≤ k ≤ limit.
    pub recover_below: usize,
    /// Width of an overflow bucket (ms), ≥ 1.
    pub bucket: Millis,
}

impl WindowParams {
    /// `period` in ms (≥ 1), `limit` ≥ 1, `recover_ratio` in (0, 1] (validated by the config).
    pub fn new(period: Millis, limit: u64, recover_ratio: f64) -> Self {
        let period = period.max(1);
        let limit = limit.max(1);
        WindowParams {
            period,
            limit,
            cap: usize::try_from(limit.saturating_add(1)).unwrap_or(usize::MAX),
            recover_below: usize::try_from(recover_threshold(limit, recover_ratio))
                .unwrap_or(usize::MAX),
            bucket: (period / OVERFLOW_BUCKETS).max(1),
        }
    }
}

/// `k = ⌈limit × ratio⌉` clamped to `1..=limit`, with a product within 1e-9 of an integer
/// taken as that integer (so `10 × 0.3` gives 3, not 4, despite floating-point rounding).
/// "Rate below `limit × ratio`" is then "count < k".
pub(crate) fn recover_threshold(limit: u64, ratio: f64) -> u64 {
    let x = limit as f64 * ratio;
    let nearest = x.round();
    let k = if (x - nearest).abs() <= 1e-9 * x.abs().max(1.0) {
        nearest
    } else {
        x.ceil()
    };
    // `k` is finite and within 0..=limit here (ratio in (0, 1]); the cast saturates anyway.
    (k as u64).clamp(1, limit.max(1))
}

/// Emission timestamps of one tenant within the last period.
#[derive(Clone, Debug, Default)]
pub(crate) struct RateWindow {
    /// Latest ≤ `cap` emission times, oldest first, all inside the window after `expire`.
    times: VecDeque<Millis>,
    /// Emissions dropped by the cap while still inside the window: `(latest time, count)` per
    /// coarse bucket, oldest first.
    overflow: VecDeque<(Millis, u64)>,
    /// Time at which the count falls below `k` if no further emission comes; `Millis::MIN`
    /// while it has never reached `k`. Never decreases.
    above_until: Millis,
}

impl RateWindow {
    /// An empty window.
    pub fn new() -> Self {
        RateWindow {
            times: VecDeque::new(),
            overflow: VecDeque::new(),
            above_until: Millis::MIN,
        }
    }

    /// Drops everything outside `(now - period, now]`.
    pub fn expire(&mut self, now: Millis, p: &WindowParams) {
        let horizon = now.saturating_sub(p.period);
        while self.times.front().is_some_and(|&t| t <= horizon) {
            self.times.pop_front();
        }
        while self.overflow.front().is_some_and(|&(t, _)| t <= horizon) {
            self.overflow.pop_front();
        }
    }

    /// Counts one emission at `now` (≥ every earlier `now`) and returns the exact count in
    /// `(now - period, now]`, saturated at `limit + 1`.
    pub fn record(&mut self, now: Millis, p: &WindowParams) -> u64 {
        self.expire(now, p);
        if self.times.len() >= p.cap {
            if let Some(dropped) = self.times.pop_front() {
                self.spill(dropped, p);
            }
        }
        self.times.push_back(now);
        let n = self.times.len();
        if n >= p.recover_below {
            // The k most recent emissions stay in the window until the oldest of them leaves.
            let kth = self.times[n - p.recover_below];
            self.above_until = self.above_until.max(kth.saturating_add(p.period));
        }
        n as u64
    }

    fn spill(&mut self, t: Millis, p: &WindowParams) {
        match self.overflow.back_mut() {
            Some((last, n)) if last.div_euclid(p.bucket) == t.div_euclid(p.bucket) => {
                *last = t;
                *n += 1;
            }
            _ => self.overflow.push_back((t, 1)),
        }
    }

    /// Exact count in `(now - period, now]`, saturated at `limit + 1`, without mutating.
    pub fn count_at(&self, now: Millis, p: &WindowParams) -> u64 {
        let horizon = now.saturating_sub(p.period);
        let gone = self.times.partition_point(|&t| t <= horizon);
        (self.times.len() - gone) as u64
    }

    /// Reported rate at `now`: the exact count, plus an estimate of emissions beyond
    /// `limit + 1` (only non-zero when the count is saturated).
    pub fn rate_at(&self, now: Millis, p: &WindowParams) -> u64 {
        let horizon = now.saturating_sub(p.period);
        let spilled: u64 = self
            .overflow
            .iter()
            .filter(|&&(t, _)| t > horizon)
            .map(|&(_, n)| n)
            .sum();
        self.count_at(now, p) + spilled
    }

    /// When the count falls (fell) below the recovery threshold `k`, absent new emissions;
    /// `Millis::MIN` if it never reached `k`.
    pub fn above_until(&self) -> Millis {
        self.above_until
    }

    /// Time of the latest emission, if any is still kept.
    pub fn last(&self) -> Option<Millis> {
        self.times.back().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(period: Millis, limit: u64, ratio: f64) -> WindowParams {
        WindowParams::new(period, limit, ratio)
    }

    #[test]
    fn recover_threshold_is_robust_to_float_rounding() {
        assert_eq!(recover_threshold(10, 0.3), 3);
        assert_eq!(recover_threshold(600, 0.5), 300);
        assert_eq!(recover_threshold(7, 0.5), 4);
        assert_eq!(recover_threshold(10, 1.0), 10);
        assert_eq!(recover_threshold(600, 1e-9), 1);
        assert_eq!(recover_threshold(1, 0.5), 1);
    }

    #[test]
    fn emission_counts_during_half_open_period() {
        let p = params(1000, 10, 0.5);
        let mut w = RateWindow::new();
        assert_eq!(w.record(100, &p), 1);
        assert_eq!(w.count_at(1099, &p), 1);
        assert_eq!(w.count_at(1100, &p), 0);
        assert_eq!(w.record(1099, &p), 2);
        assert_eq!(w.record(1100, &p), 2, "the emission at 100 left at 1100");
    }

    #[test]
    fn count_saturates_at_limit_plus_one_and_rate_estimates_beyond() {
        let p = params(64_000, 10, 0.5);
        let mut w = RateWindow::new();
        for i in 0..100 {
            assert_eq!(w.record(i * 10, &p), (i as u64 + 1).min(11));
        }
        assert_eq!(w.count_at(1000, &p), 11);
        assert_eq!(w.rate_at(1000, &p), 100);
        // All 100 fall out of the window together with the spilled buckets.
        assert_eq!(w.rate_at(64_000 + 990, &p), 0);
        assert_eq!(w.rate_at(64_000 + 985, &p), 1);
        w.expire(70_000, &p);
        assert_eq!(w.last(), None);
        assert_eq!(w.rate_at(70_000, &p), 0);
    }

    #[test]
    fn above_until_tracks_when_the_k_latest_leave() {
        // limit 10, ratio 0.5 → k = 5.
        let p = params(1000, 10, 0.5);
        let mut w = RateWindow::new();
        for t in [0, 100, 200, 300] {
            w.record(t, &p);
        }
        assert_eq!(w.above_until(), Millis::MIN, "4 < k never reached");
        w.record(400, &p);
        assert_eq!(
            w.above_until(),
            1000,
            "5 in window until the one at 0 leaves"
        );
        w.record(450, &p);
        assert_eq!(w.above_until(), 1100);
        assert_eq!(w.count_at(1099, &p), 5);
        assert_eq!(w.count_at(1100, &p), 4);
        // A later sparse emission does not move it.
        w.record(5000, &p);
        assert_eq!(w.above_until(), 1100);
    }
}
