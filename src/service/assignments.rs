//! Noticing a NATS scale-down (partitions nobody owns). NATS has no group protocol: the
//! assignment is static (`nats.instance` of `nats.instances`), so an operator who stops an
//! instance without lowering `nats.instances` on the others leaves that instance's
//! partitions unread, silently. Every instance therefore writes its assignment
//! ([`AssignmentRecord`]: the partitions it owns, the instance count it believes, the time)
//! into the tier-counts bucket under `assignment.<instance>` every `nats.heartbeat-interval`,
//! reads the others', and computes ([`coverage`]) the partitions no live instance owns and
//! the live instances whose `nats.instances` differs from its own. An instance not heard of
//! for [`STALE_INTERVALS`] intervals counts as gone. A change of either is logged once (a
//! WARN while something is wrong, an INFO when it is right again) and both are exported
//! (`settle_partitions_unowned`, `settle_instances_disagreeing`).

use crate::config::nats::NatsConfig;
use crate::metrics::Metrics;
use crate::runtime::{Clock as _, SystemClock};
use crate::transport::nats::TierCountsBucket;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use tokio_util::sync::CancellationToken;

/// An instance not heard of for this many heartbeat intervals counts as gone.
pub const STALE_INTERVALS: u32 = 3;

/// What one instance writes every heartbeat interval (JSON in the KV bucket).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssignmentRecord {
    /// The process's instance name (`NatsConfig::instance_name`).
    pub name: String,
    /// `nats.instance`.
    pub instance: u32,
    /// `nats.instances` as this instance believes it.
    pub instances: u32,
    /// `nats.partitions`.
    pub partitions: u32,
    /// The partitions it owns.
    pub owned: Vec<i32>,
    /// When it was written (ms since the epoch).
    pub at_ms: i64,
}

/// What [`coverage`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Coverage {
    /// Partitions of `0..partitions` no live instance owns, ascending.
    pub unowned: Vec<i32>,
    /// Live instances (by name) whose `instances` differs from this instance's, with theirs.
    pub disagreeing: Vec<(String, u32)>,
}

/// The partitions of `own.partitions` that neither `own` nor a live record of `seen` owns,
/// and the live instances disagreeing on the instance count. A record is live when written
/// at most `stale_ms` before `now_ms`; `own`'s entry in `seen` (same name) is ignored.
pub fn coverage(
    own: &AssignmentRecord,
    seen: &[AssignmentRecord],
    now_ms: i64,
    stale_ms: i64,
) -> Coverage {
    let live: Vec<&AssignmentRecord> = seen
        .iter()
        .filter(|r| r.name != own.name && now_ms - r.at_ms <= stale_ms)
        .collect();
    let owned: BTreeSet<i32> = own
        .owned
        .iter()
        .chain(live.iter().flat_map(|r| r.owned.iter()))
        .copied()
        .collect();
    let mut disagreeing: Vec<(String, u32)> = live
        .iter()
        .filter(|r| r.instances != own.instances)
        .map(|r| (r.name.clone(), r.instances))
        .collect();
    disagreeing.sort();
    Coverage {
        unowned: (0..own.partitions as i32)
            .filter(|p| !owned.contains(p))
            .collect(),
        disagreeing,
    }
}

/// Writes this instance's assignment and checks the others' every `nats.heartbeat-interval`
/// until `shutdown` (module docs), setting the gauges on `metrics`. The first check comes
/// after [`STALE_INTERVALS`] intervals, when every live instance has written at least once.
pub async fn watch(
    bucket: TierCountsBucket,
    config: NatsConfig,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let interval = config.heartbeat_interval;
    let stale_ms = (interval * STALE_INTERVALS).as_millis() as i64;
    let name = config.instance_name();
    let mut own = AssignmentRecord {
        name: name.clone(),
        instance: config.instance,
        instances: config.instances,
        partitions: config.partitions,
        owned: config.owned_partitions(),
        at_ms: 0,
    };
    let mut ticks = 0u32;
    let mut last = Coverage::default();
    let mut warned_unavailable = false;
    loop {
        own.at_ms = SystemClock.now_ms();
        let written = match serde_json::to_vec(&own) {
            Ok(json) => bucket.put_assignment(&name, json).await,
            Err(_) => Ok(()),
        };
        let read = match written {
            Ok(()) => bucket.read_assignments().await,
            Err(e) => Err(e),
        };
        match read {
            Ok(records) => {
                warned_unavailable = false;
                ticks += 1;
                if ticks > STALE_INTERVALS {
                    let seen: Vec<AssignmentRecord> = records
                        .iter()
                        .filter_map(|r| serde_json::from_slice(r).ok())
                        .collect();
                    let now = coverage(&own, &seen, SystemClock.now_ms(), stale_ms);
                    if now != last {
                        report(&own, &now, interval);
                        metrics.set_assignment(now.unowned.len(), now.disagreeing.len());
                        last = now;
                    }
                }
            }
            Err(e) if !warned_unavailable => {
                warned_unavailable = true;
                tracing::warn!(error = %e, "nats: cannot exchange partition assignments; partitions nobody owns go unnoticed until it works again");
            }
            Err(e) => tracing::debug!(error = %e, "nats: assignment exchange failed"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// Logs a changed [`Coverage`]: loud while partitions are unowned or instances disagree.
fn report(own: &AssignmentRecord, c: &Coverage, interval: std::time::Duration) {
    if !c.unowned.is_empty() {
        tracing::warn!(
            unowned = ?c.unowned,
            count = c.unowned.len(),
            partitions = own.partitions,
            instances = own.instances,
            gone_after_s = (interval * STALE_INTERVALS).as_secs(),
            "nats: PARTITIONS NOBODY OWNS: no live instance reads them, their uploads wait and their rounds do not fire. An instance is down, or the deployment was scaled down without lowering nats.instances: start the missing instance(s) or set nats.instances on every instance to the number running (settle_partitions_unowned)"
        );
    }
    if !c.disagreeing.is_empty() {
        tracing::warn!(
            instances = own.instances,
            disagreeing = ?c.disagreeing,
            "nats: INSTANCES DISAGREE ON nats.instances: partitions may be read twice or by nobody; give every instance the same nats.instances (settle_instances_disagreeing)"
        );
    }
    if c.unowned.is_empty() && c.disagreeing.is_empty() {
        tracing::info!(
            partitions = own.partitions,
            instances = own.instances,
            "nats: every partition has a live owner again and the instances agree on nats.instances"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, instance: u32, instances: u32, at_ms: i64) -> AssignmentRecord {
        AssignmentRecord {
            name: name.into(),
            instance,
            instances,
            partitions: 8,
            owned: crate::config::nats::owned_partitions(8, instance, instances),
            at_ms,
        }
    }

    #[test]
    fn partitions_of_a_gone_instance_are_unowned() {
        let own = record("a", 0, 2, 100_000);
        let other = record("b", 1, 2, 95_000);
        let c = coverage(&own, &[own.clone(), other.clone()], 100_000, 15_000);
        assert_eq!(c, Coverage::default(), "both live: all owned");
        // b silent for longer than 3 intervals: gone.
        let c = coverage(&own, std::slice::from_ref(&other), 111_000, 15_000);
        assert_eq!(c.unowned, vec![1, 3, 5, 7]);
        assert!(c.disagreeing.is_empty());
        // Nobody else ever wrote.
        assert_eq!(coverage(&own, &[], 0, 15_000).unowned, vec![1, 3, 5, 7]);
        // Alone and the only instance: nothing to report.
        let solo = record("a", 0, 1, 0);
        assert_eq!(coverage(&solo, &[], 0, 15_000), Coverage::default());
    }

    #[test]
    fn instances_that_believe_another_count_disagree() {
        // Scaled from 3 to 2 on one instance only: c still believes 3.
        let own = record("a", 0, 2, 0);
        let b = record("b", 1, 2, 0);
        let c = record("c", 2, 3, 0);
        let got = coverage(&own, &[b, c], 0, 15_000);
        assert_eq!(got.disagreeing, vec![("c".to_owned(), 3)]);
        assert!(got.unowned.is_empty());
    }
}
