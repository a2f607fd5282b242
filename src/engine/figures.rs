//! Spreads of millisecond figures (time-to-ready, lateness) and their percentiles: what
//! `settle simulate`, `settle tune` and the shadow policies (SEMANTICS §8) report, computed
//! the same way everywhere so their figures can be compared (and are equal on one trace).
//!
//! A [`Spread`] is an HDR histogram (3 significant digits) plus the exact smallest and largest
//! value recorded: each percentile is the middle of its bucket, within 0.05 % of a recorded
//! value, and never outside the exact smallest and largest values, so a run whose values are
//! all 300 000 ms reports 300 000 ms; the maximum is exact. Merging spreads (the partitions of
//! one process) gives the same percentiles as recording every value in one spread.
//!
//! Pure: no clock, no I/O (the engine's rule).

use hdrhistogram::Histogram;

/// A histogram of ms figures and the exact smallest and largest (module docs).
#[derive(Clone, Debug)]
pub struct Spread {
    hist: Histogram<u64>,
    min: u64,
    max: u64,
}

impl Default for Spread {
    fn default() -> Self {
        Self::new()
    }
}

impl Spread {
    /// An empty spread.
    pub fn new() -> Spread {
        Spread {
            // Invariant: 3 significant figures is a valid precision, so `new` cannot fail.
            hist: Histogram::new(3).expect("valid histogram precision"),
            min: u64::MAX,
            max: 0,
        }
    }

    /// Records one figure (ms).
    pub fn record(&mut self, ms: u64) {
        // Auto-resizing histograms grow to any u64, so `record` cannot fail on range.
        let _ = self.hist.record(ms);
        self.min = self.min.min(ms);
        self.max = self.max.max(ms);
    }

    /// Adds every figure of `other` into this one.
    pub fn add(&mut self, other: &Spread) {
        // Both histograms auto-resize, so adding cannot fail on range; ignore the impossible.
        let _ = self.hist.add(&other.hist);
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    /// Figures recorded.
    pub fn len(&self) -> u64 {
        self.hist.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.hist.is_empty()
    }

    /// p50, p90, p99 and max (ms); all 0 when nothing was recorded.
    pub fn percentiles(&self) -> Percentiles {
        let h = &self.hist;
        if h.is_empty() {
            return Percentiles::default();
        }
        let q = |x: f64| {
            h.median_equivalent(h.value_at_quantile(x))
                .clamp(self.min, self.max)
        };
        Percentiles {
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
            max: self.max,
        }
    }
}

/// Time-to-ready / lateness percentiles (ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
pub struct Percentiles {
    /// Median (ms).
    pub p50: u64,
    /// 90th percentile (ms).
    pub p90: u64,
    /// 99th percentile (ms).
    pub p99: u64,
    /// Largest value (ms).
    pub max: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_spreads_equal_one_spread() {
        let (mut a, mut b, mut all) = (Spread::new(), Spread::new(), Spread::new());
        for ms in 0..5_000u64 {
            let v = ms * 37 % 90_001;
            let part = if ms % 3 == 0 { &mut a } else { &mut b };
            part.record(v);
            all.record(v);
        }
        a.add(&b);
        assert_eq!(a.percentiles(), all.percentiles());
        assert_eq!(a.len(), 5_000);
        assert_eq!(Spread::new().percentiles(), Percentiles::default());
    }
}
