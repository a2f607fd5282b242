//! What `settle run` watches while it runs, on every transport: a progress line every
//! [`PROGRESS_EVERY`], a warning when no partition is assigned for [`UNASSIGNED_WARN_AFTER`],
//! and a stop when a partition failed (a store that cannot be opened or written), so the
//! process exits non-zero and its partitions go to another group member (or to this one,
//! restarted by its supervisor) instead of sitting owned and idle.

use super::{PartitionState, PartitionStatus, StatusBoard};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// After this long without any assigned partition, `settle run` warns once.
pub const UNASSIGNED_WARN_AFTER: Duration = Duration::from_secs(60);

/// Runs until aborted: [`log_progress`], the unassigned warning, and `shutdown` cancelled
/// (with an error log naming the partition and why) as soon as a partition is
/// [`PartitionState::Failed`].
pub async fn watch(status: StatusBoard, shutdown: CancellationToken) {
    let progress = log_progress(status.clone(), PROGRESS_EVERY);
    let guard = async {
        let mut rx = status.subscribe();
        let started = tokio::time::Instant::now();
        let mut warned = false;
        loop {
            let failed = rx
                .borrow_and_update()
                .values()
                .find_map(|s| match &s.state {
                    PartitionState::Failed(reason) => Some((s.partition, reason.clone())),
                    _ => None,
                });
            if let Some((partition, reason)) = failed {
                tracing::error!(partition, error = %reason, "a partition failed: stopping settle (exit code 1) so its partitions can be owned again after a restart");
                shutdown.cancel();
                return;
            }
            let unassigned = rx.borrow().is_empty();
            if unassigned && !warned && started.elapsed() >= UNASSIGNED_WARN_AFTER {
                warned = true;
                tracing::warn!(
                    after_s = UNASSIGNED_WARN_AFTER.as_secs(),
                    "no partition assigned yet: the input topic may be missing, every partition may be owned by other members, or the group may be waiting for a killed member's session timeout (kafka session.timeout.ms, 45 s by default)"
                );
            }
            let _ = tokio::time::timeout(Duration::from_secs(5), rx.changed()).await;
        }
    };
    tokio::join!(progress, guard);
}

/// How often `settle run` logs its progress line (only when something changed).
pub const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// Logs one line every `every` while anything changed: owned partitions (live ones caught
/// up), and the sums over them of records consumed, dead letters, emissions, emissions
/// published, pending rounds and owed emissions (counters restart when a partition is
/// re-assigned).
pub async fn log_progress(status: StatusBoard, every: Duration) {
    let mut last = None;
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        let snapshot = status.snapshot();
        let sum = |f: fn(&PartitionStatus) -> u64| -> u64 { snapshot.values().map(f).sum() };
        let figures = (
            snapshot.len(),
            snapshot.values().filter(|s| s.caught_up).count(),
            sum(|s| s.records),
            sum(|s| s.dead_letters),
            sum(|s| s.emissions),
            sum(|s| s.published),
            sum(|s| s.pending_rounds),
            sum(|s| s.outbox_len),
        );
        if last == Some(figures) {
            continue;
        }
        last = Some(figures);
        let (partitions, live, records, dead, emitted, published, pending, owed) = figures;
        tracing::info!(
            partitions,
            caught_up = live,
            consumed = records,
            dead_lettered = dead,
            emitted,
            published,
            pending_rounds = pending,
            outbox = owed,
            "progress"
        );
    }
}
