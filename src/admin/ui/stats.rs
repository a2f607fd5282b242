//! The Overview's figures, read from the process's own metrics registry (`crate::metrics`,
//! refreshed from the status board as `GET /metrics` does) and its status board: counters
//! since the start (the charts turn two readings into rates), time-to-ready quantiles per
//! tier estimated from the histogram's buckets, dead letters by reason, tier changes, and
//! each owned partition's lag. `GET /ui/stats.json` answers them for the charts.

use super::super::AdminState;
use crate::metrics;
use crate::runtime::PartitionState;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use prometheus::proto::MetricFamily;
use serde::Serialize;
use std::collections::BTreeMap;

/// Time-to-ready of one tier (seconds, estimated from the histogram's buckets).
#[derive(Clone, Debug, Default, Serialize)]
pub struct TierLatency {
    /// Emissions measured.
    pub count: u64,
    /// Median, seconds (`None` without emissions).
    pub p50_s: Option<f64>,
    /// 99th percentile, seconds.
    pub p99_s: Option<f64>,
}

/// One owned partition, as the Overview shows it.
#[derive(Clone, Debug, Serialize)]
pub struct PartitionLine {
    /// Partition number.
    pub partition: i32,
    /// `restoring`, `catching_up`, `live`, ...
    pub state: String,
    /// Consumer lag (records), where the transport knows it.
    pub lag: Option<u64>,
    /// Open rounds.
    pub pending: u64,
    /// Owed emissions (outbox).
    pub outbox: u64,
}

/// What the Overview shows and `/ui/stats.json` answers.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Stats {
    /// When it was read (ms since the epoch, the runtime's wall clock).
    pub at_ms: i64,
    /// Input records applied since the start (`settle_uploads_consumed_total`).
    pub uploads: u64,
    /// Ready records acknowledged since the start (`settle_emissions_total`).
    pub emissions: u64,
    /// Uploads coalesced into them (`settle_emission_uploads_total`).
    pub emission_uploads: u64,
    /// Dead letters by reason (`settle_uploads_rejected_total`).
    pub dead_letters: BTreeMap<String, u64>,
    /// Tier changes by reason (`settle_tier_changes_total`).
    pub tier_changes: BTreeMap<String, u64>,
    /// Time-to-ready by tier (`settle_time_to_ready_seconds`).
    pub time_to_ready: BTreeMap<String, TierLatency>,
    /// Owned partitions.
    pub partitions: Vec<PartitionLine>,
    /// Open rounds over the owned partitions.
    pub pending: u64,
}

impl Stats {
    /// Uploads per emission since the start (`None` before the first emission).
    pub fn coalescing(&self) -> Option<f64> {
        (self.emissions > 0).then(|| self.emission_uploads as f64 / self.emissions as f64)
    }
}

fn label<'a>(m: &'a prometheus::proto::Metric, name: &str) -> &'a str {
    m.get_label()
        .iter()
        .find(|l| l.name() == name)
        .map_or("", |l| l.value())
}

fn family<'a>(families: &'a [MetricFamily], name: &str) -> Option<&'a MetricFamily> {
    families.iter().find(|f| f.name() == name)
}

/// Sum of a counter family, by the value of `by` (all in `""` when `by` is empty).
fn counter_by(families: &[MetricFamily], name: &str, by: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    if let Some(f) = family(families, name) {
        for m in f.get_metric() {
            let key = if by.is_empty() { "" } else { label(m, by) };
            *out.entry(key.to_owned()).or_default() += m.get_counter().value() as u64;
        }
    }
    out
}

fn total(families: &[MetricFamily], name: &str) -> u64 {
    counter_by(families, name, "").values().sum()
}

/// The `q` quantile (0–1) of cumulative buckets `(upper bound, count)`, interpolated
/// linearly inside the bucket that holds it (as Prometheus' `histogram_quantile`); the
/// last finite bound when it falls in `+Inf`. `None` without samples.
pub fn quantile(buckets: &[(f64, u64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let (mut lower, mut below) = (0.0, 0u64);
    for &(upper, count) in buckets {
        if count as f64 >= rank {
            if upper.is_infinite() {
                return Some(lower);
            }
            let inside = (count - below) as f64;
            let frac = if inside > 0.0 {
                (rank - below as f64) / inside
            } else {
                1.0
            };
            return Some(lower + (upper - lower) * frac);
        }
        (lower, below) = (upper, count);
    }
    Some(lower)
}

fn latencies(families: &[MetricFamily]) -> BTreeMap<String, TierLatency> {
    // Cumulative bucket counts by tier (policies added together).
    let mut by_tier: BTreeMap<String, Vec<(f64, u64)>> = BTreeMap::new();
    if let Some(f) = family(families, metrics::TIME_TO_READY) {
        for m in f.get_metric() {
            let h = m.get_histogram();
            let mut buckets: Vec<(f64, u64)> = h
                .get_bucket()
                .iter()
                .map(|b| (b.upper_bound(), b.cumulative_count()))
                .collect();
            buckets.push((f64::INFINITY, h.sample_count()));
            let sum = by_tier.entry(label(m, "tier").to_owned()).or_default();
            if sum.is_empty() {
                *sum = buckets;
            } else {
                for (s, b) in sum.iter_mut().zip(buckets) {
                    s.1 += b.1;
                }
            }
        }
    }
    by_tier
        .into_iter()
        .map(|(tier, b)| {
            let l = TierLatency {
                count: b.last().map_or(0, |x| x.1),
                p50_s: quantile(&b, 0.5),
                p99_s: quantile(&b, 0.99),
            };
            (tier, l)
        })
        .collect()
}

/// Reads the figures now.
pub fn read(s: &AdminState) -> Stats {
    let now = (s.wall)();
    let status = s.status.snapshot();
    let counters = s.router.lock().counters();
    s.metrics
        .refresh(status.values().map(|p| p.gauges(now)), &counters);
    let families = s.metrics.registry().gather();
    let partitions: Vec<PartitionLine> = status
        .values()
        .filter(|p| p.state != PartitionState::Stopped)
        .map(|p| PartitionLine {
            partition: p.partition,
            state: p.state.as_str().to_owned(),
            lag: p.lag,
            pending: p.pending_rounds,
            outbox: p.outbox_len,
        })
        .collect();
    Stats {
        at_ms: now,
        uploads: total(&families, metrics::UPLOADS_CONSUMED),
        emissions: total(&families, metrics::EMISSIONS),
        emission_uploads: total(&families, metrics::EMISSION_UPLOADS),
        dead_letters: counter_by(&families, metrics::UPLOADS_REJECTED, "reason"),
        tier_changes: counter_by(&families, metrics::TIER_CHANGES, "reason"),
        time_to_ready: latencies(&families),
        pending: partitions.iter().map(|p| p.pending).sum(),
        partitions,
    }
}

/// `GET /ui/stats.json`: [`Stats`] now.
pub(super) async fn json(State(s): State<AdminState>) -> Response {
    Json(read(&s)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_inside_the_bucket() {
        let b = [(1.0, 50), (2.0, 100), (f64::INFINITY, 100)];
        assert_eq!(quantile(&b, 0.5), Some(1.0));
        let p75 = quantile(&b, 0.75).unwrap();
        assert!((p75 - 1.5).abs() < 1e-9, "{p75}");
        assert_eq!(quantile(&[(1.0, 0), (f64::INFINITY, 0)], 0.5), None);
        // Past the last finite bound: that bound.
        assert_eq!(quantile(&[(1.0, 0), (f64::INFINITY, 4)], 0.99), Some(1.0));
    }
}
