//! Run summaries shared by `settle simulate`, `settle demo` and the tuning sweep: uploads,
//! emissions, coalescing ratio, time-to-ready and lateness percentiles, emissions per trigger.
//!
//! Time-to-ready = `emitted_at − last_upload_at` (ms); lateness = `emitted_at − due_at` (ms),
//! SEMANTICS §3. Percentiles come from an [`engine::Spread`](crate::engine::Spread) (an HDR
//! histogram, 3 significant digits, with the exact smallest and largest values; the shadow
//! policies of `settle run` use the same, SEMANTICS §8); the maximum is exact. [`human_ms`] rounds to the unit it prints.

pub use crate::engine::Percentiles;
use crate::engine::{Emission, Millis, Spread, Trigger};
use std::collections::BTreeMap;
use std::fmt;

/// Counters and histograms of one run.
#[derive(Clone, Debug)]
pub struct RunStats {
    /// Uploads offered to the engine (applied, late or redelivered).
    pub uploads: u64,
    /// Uploads counted late (SEMANTICS §3).
    pub late: u64,
    /// Uploads ignored as redeliveries of the key's last `event_id`.
    pub redelivered: u64,
    /// Input lines or records rejected (bad JSON, broken rule).
    pub rejected: u64,
    /// Emissions.
    pub emissions: u64,
    /// Emissions per trigger.
    pub by_trigger: BTreeMap<Trigger, u64>,
    time_to_ready: Spread,
    lateness: Spread,
}

impl Default for RunStats {
    fn default() -> Self {
        Self::new()
    }
}

impl RunStats {
    /// Empty stats.
    pub fn new() -> Self {
        RunStats {
            uploads: 0,
            late: 0,
            redelivered: 0,
            rejected: 0,
            emissions: 0,
            by_trigger: BTreeMap::new(),
            time_to_ready: Spread::new(),
            lateness: Spread::new(),
        }
    }

    /// These emission figures with the input counts (uploads, late, redelivered, rejected) of
    /// `inputs`: for a run whose emissions were counted apart from its inputs (on another
    /// thread).
    pub fn with_inputs_of(self, inputs: &RunStats) -> RunStats {
        RunStats {
            uploads: inputs.uploads,
            late: inputs.late,
            redelivered: inputs.redelivered,
            rejected: inputs.rejected,
            ..self
        }
    }

    /// Records one emission sent at `emitted_at` (ms).
    pub fn record_emission(&mut self, e: &Emission, emitted_at: Millis) {
        self.emissions += 1;
        *self.by_trigger.entry(e.trigger).or_default() += 1;
        self.time_to_ready
            .record((emitted_at - e.last_upload_at).max(0) as u64);
        self.lateness.record((emitted_at - e.due_at).max(0) as u64);
    }

    /// Uploads per emission (0 when nothing was emitted).
    pub fn coalescing_ratio(&self) -> f64 {
        let applied = self.uploads - self.redelivered;
        if self.emissions == 0 {
            0.0
        } else {
            applied as f64 / self.emissions as f64
        }
    }

    /// Share of emissions (0..=1) whose trigger is `max_wait`.
    pub fn max_wait_share(&self) -> f64 {
        if self.emissions == 0 {
            return 0.0;
        }
        let n = self.by_trigger.get(&Trigger::MaxWait).copied().unwrap_or(0);
        n as f64 / self.emissions as f64
    }

    /// Time-to-ready percentiles (ms).
    pub fn time_to_ready(&self) -> Percentiles {
        self.time_to_ready.percentiles()
    }

    /// Lateness percentiles (ms).
    pub fn lateness(&self) -> Percentiles {
        self.lateness.percentiles()
    }

    /// Adds another run's figures into this one.
    pub fn merge(&mut self, other: &RunStats) {
        self.uploads += other.uploads;
        self.late += other.late;
        self.redelivered += other.redelivered;
        self.rejected += other.rejected;
        self.emissions += other.emissions;
        for (t, n) in &other.by_trigger {
            *self.by_trigger.entry(*t).or_default() += n;
        }
        self.time_to_ready.add(&other.time_to_ready);
        self.lateness.add(&other.lateness);
    }
}

/// Formats a millisecond figure for people, rounded to the nearest unit it prints: `850ms`,
/// `12.3s` (tenths below a minute), `4m05s` (whole seconds from 59.95 s on).
pub fn human_ms(ms: u64) -> String {
    let tenths = ms.saturating_add(50) / 100;
    if ms < 1_000 {
        format!("{ms}ms")
    } else if tenths < 600 {
        format!("{}.{}s", tenths / 10, tenths % 10)
    } else {
        let secs = ms.saturating_add(500) / 1000;
        format!("{}m{:02}s", secs / 60, secs % 60)
    }
}

impl fmt::Display for RunStats {
    /// The multi-line summary printed by `settle simulate` on stderr.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ttr = self.time_to_ready();
        writeln!(
            f,
            "uploads: {} (late {}, redelivered {}, rejected lines {})",
            self.uploads, self.late, self.redelivered, self.rejected
        )?;
        writeln!(f, "emissions: {}", self.emissions)?;
        writeln!(
            f,
            "coalescing ratio: {:.1} uploads/emission",
            self.coalescing_ratio()
        )?;
        writeln!(
            f,
            "time-to-ready: p50 {} · p90 {} · p99 {} · max {}",
            human_ms(ttr.p50),
            human_ms(ttr.p90),
            human_ms(ttr.p99),
            human_ms(ttr.max)
        )?;
        let triggers: Vec<String> = Trigger::ALL
            .iter()
            .map(|t| {
                format!(
                    "{} {}",
                    t.as_str(),
                    self.by_trigger.get(t).copied().unwrap_or(0)
                )
            })
            .collect();
        write!(f, "emissions per trigger: {}", triggers.join(" · "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{PolicyName, SessionKey};

    fn em(trigger: Trigger, last: Millis, due: Millis, uploads: u32) -> Emission {
        Emission {
            key: SessionKey::new("t", "s"),
            state_created_at: 0,
            generation: 1,
            trigger,
            uploads,
            first_upload_at: 0,
            last_upload_at: last,
            due_at: due,
            delay_ms: 10,
            policy: PolicyName::Fixed,
            last_event_id: None,
            attributes: None,
            event_ids: None,
        }
    }

    #[test]
    fn summary_figures() {
        let mut s = RunStats::new();
        s.uploads = 10;
        s.record_emission(&em(Trigger::Trailing, 0, 1_000, 6), 1_000);
        s.record_emission(&em(Trigger::MaxWait, 0, 3_000, 4), 3_010);
        assert_eq!(s.coalescing_ratio(), 5.0);
        assert_eq!(s.max_wait_share(), 0.5);
        assert_eq!(s.time_to_ready().max, 3_010);
        assert_eq!(s.lateness().max, 10);
        assert_eq!(s.lateness().p50, 0);
        let text = s.to_string();
        assert!(text.contains("emissions: 2"), "{text}");
        assert!(text.contains("max_wait 1"), "{text}");
    }

    #[test]
    fn human_units() {
        assert_eq!(human_ms(850), "850ms");
        assert_eq!(human_ms(12_340), "12.3s");
        assert_eq!(human_ms(245_000), "4m05s");
    }

    #[test]
    fn human_ms_rounds_to_the_printed_unit() {
        assert_eq!(human_ms(999), "999ms");
        assert_eq!(human_ms(1_000), "1.0s");
        assert_eq!(human_ms(12_349), "12.3s");
        assert_eq!(human_ms(12_350), "12.4s");
        assert_eq!(human_ms(59_949), "59.9s");
        assert_eq!(human_ms(59_950), "1m00s");
        assert_eq!(human_ms(299_500), "5m00s");
        assert_eq!(human_ms(299_499), "4m59s");
        assert_eq!(human_ms(300_000), "5m00s");
        assert_eq!(human_ms(599_999), "10m00s");
    }

    #[test]
    fn percentiles_of_equal_figures_are_that_figure() {
        // 300 000 ms sits in a histogram bucket starting at 299 776 ms: reported as measured.
        let mut s = RunStats::new();
        for _ in 0..100 {
            s.record_emission(&em(Trigger::Trailing, 0, 300_000, 1), 300_000);
        }
        let ttr = s.time_to_ready();
        assert_eq!(
            (ttr.p50, ttr.p90, ttr.p99, ttr.max),
            (300_000, 300_000, 300_000, 300_000)
        );
        assert!(
            s.to_string()
                .contains("p50 5m00s · p90 5m00s · p99 5m00s · max 5m00s"),
            "{s}"
        );
        // Spread figures: each percentile within 0.05 % of the one recorded.
        let mut s = RunStats::new();
        for ms in (1..=1000).map(|i| i * 600) {
            s.record_emission(&em(Trigger::Trailing, 0, ms, 1), ms);
        }
        let ttr = s.time_to_ready();
        for (got, want) in [(ttr.p50, 300_000), (ttr.p90, 540_000), (ttr.p99, 594_000)] {
            assert!(got.abs_diff(want) * 2_000 <= want, "{got} vs {want}");
        }
        assert_eq!(ttr.max, 600_000);
    }
}
