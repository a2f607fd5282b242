//! The visible status of every partition task: what `settle demo`, `run-file`, the admin
//! endpoint and tests read to know whether a partition is live, catching up, stopped or
//! failed, and how much work it still owes. Each partition task is the only writer of its
//! own entry; everybody else reads (a `tokio::sync::watch` channel, so readers can wait for
//! a change instead of polling).

use crate::engine::Millis;
use crate::metrics::PartitionGauges;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::watch;

/// Life cycle of a partition task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartitionState {
    /// Opening its store, seeking, re-arming timers and the outbox.
    Starting,
    /// Replaying the changelog into its store before it takes input (see
    /// `PartitionStatus::restore_remaining`).
    Restoring,
    /// Behind: consumer lag > 0, or overdue rounds still being released (catch-up pacing).
    CatchingUp,
    /// Caught up: partition time follows the wall clock.
    Live,
    /// Shutdown or revocation: finishing the batch and flushing the outbox.
    Stopping,
    /// Stopped cleanly (store closed).
    Stopped,
    /// Stopped on a fatal error (store write/read failure, fatal transport error): nothing
    /// more is consumed or committed for this partition; the reason is here and in the log.
    Failed(String),
}

impl PartitionState {
    /// `starting`, `restoring`, `catching_up`, `live`, `stopping`, `stopped` or `failed` (admin endpoint
    /// and the `state` metrics label).
    pub fn as_str(&self) -> &'static str {
        match self {
            PartitionState::Starting => "starting",
            PartitionState::Restoring => "restoring",
            PartitionState::CatchingUp => "catching_up",
            PartitionState::Live => "live",
            PartitionState::Stopping => "stopping",
            PartitionState::Stopped => "stopped",
            PartitionState::Failed(_) => "failed",
        }
    }
}

/// One partition's figures (all counters since the task started).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionStatus {
    /// Input topic.
    pub topic: String,
    /// Partition number.
    pub partition: i32,
    /// Life cycle state.
    pub state: PartitionState,
    /// Next input offset to consume, as stored (`None`: nothing applied yet).
    pub next_offset: Option<i64>,
    /// Partition time (ms, SEMANTICS §3).
    pub partition_time: Millis,
    /// Consumer lag (records): what the broker holds after the last record applied, as the
    /// transport last learned it (`PartitionInput::lag`); `None` where it does not know.
    pub lag: Option<u64>,
    /// The last poll found no more input and no consumed record waits to be applied.
    pub caught_up: bool,
    /// Keys with an open round (rounds still to emit or to end silently).
    pub pending_rounds: u64,
    /// Owed emissions not yet acknowledged by the sink.
    pub outbox_len: u64,
    /// Due time (ms) of the partition's earliest timer, if any.
    pub next_due: Option<Millis>,
    /// Records consumed (uploads and bad records).
    pub records: u64,
    /// Records dead-lettered.
    pub dead_letters: u64,
    /// Emissions written to the outbox.
    pub emissions: u64,
    /// Emissions acknowledged by the sink.
    pub published: u64,
    /// Changelog records still to replay before the partition takes input (estimate from
    /// the broker's end offset; 0 when not restoring).
    pub restore_remaining: u64,
    /// Changelog records replayed so far by the restore of this assignment (with
    /// [`PartitionStatus::restore_remaining`], the restore's progress).
    pub restored: u64,
    /// The input lag (records) when the partition first reported one after it started taking
    /// input: the catch-up's starting point, so `1 − lag / catch_up_from` is its progress.
    /// `None` until the first lag is known.
    pub catch_up_from: Option<u64>,
}

impl PartitionStatus {
    /// A fresh entry in state [`PartitionState::Starting`].
    pub fn starting(topic: &str, partition: i32) -> Self {
        PartitionStatus {
            topic: topic.to_owned(),
            partition,
            state: PartitionState::Starting,
            next_offset: None,
            partition_time: 0,
            lag: None,
            caught_up: false,
            pending_rounds: 0,
            outbox_len: 0,
            next_due: None,
            records: 0,
            dead_letters: 0,
            emissions: 0,
            published: 0,
            restore_remaining: 0,
            restored: 0,
            catch_up_from: None,
        }
    }

    /// Caught up with no open round and nothing owed: the partition has nothing left to do
    /// until new input arrives.
    pub fn is_idle(&self) -> bool {
        self.caught_up && self.pending_rounds == 0 && self.outbox_len == 0
    }

    /// Stopped with an error.
    pub fn is_failed(&self) -> bool {
        matches!(self.state, PartitionState::Failed(_))
    }

    /// What the metrics' gauges show of this partition at wall-clock time `now_ms` (ms): the
    /// runtime hands this to [`Metrics::refresh`](crate::metrics::Metrics::refresh). The
    /// partition clock is behind only once it runs (not while starting or restoring).
    pub fn gauges(&self, now_ms: Millis) -> PartitionGauges<'_> {
        let clock_runs = !matches!(
            self.state,
            PartitionState::Starting | PartitionState::Restoring
        );
        PartitionGauges {
            topic: &self.topic,
            partition: self.partition,
            state: self.state.as_str(),
            pending_rounds: self.pending_rounds,
            outbox_len: self.outbox_len,
            restore_remaining: self.restore_remaining,
            lag: self.lag,
            clock_behind_ms: clock_runs.then(|| now_ms.saturating_sub(self.partition_time).max(0)),
        }
    }
}

/// Status of every partition this process owns or owned, by partition number.
pub type StatusMap = BTreeMap<i32, PartitionStatus>;

/// Shared handle on the status of all partitions. Cheap to clone.
#[derive(Clone, Debug)]
pub struct StatusBoard {
    tx: Arc<watch::Sender<StatusMap>>,
}

impl Default for StatusBoard {
    fn default() -> Self {
        Self::new()
    }
}

impl StatusBoard {
    /// An empty board.
    pub fn new() -> Self {
        StatusBoard {
            tx: Arc::new(watch::Sender::new(StatusMap::new())),
        }
    }

    /// A copy of every partition's status.
    pub fn snapshot(&self) -> StatusMap {
        self.tx.borrow().clone()
    }

    /// A receiver that sees every later change (`changed().await`).
    pub fn subscribe(&self) -> watch::Receiver<StatusMap> {
        self.tx.subscribe()
    }

    /// Replaces partition `status.partition`'s entry.
    pub fn set(&self, status: PartitionStatus) {
        self.tx.send_modify(|m| {
            m.insert(status.partition, status);
        });
    }

    /// Changes partition `partition`'s entry in place (no-op when it has none).
    pub fn update(&self, partition: i32, f: impl FnOnce(&mut PartitionStatus)) {
        self.tx.send_modify(|m| {
            if let Some(s) = m.get_mut(&partition) {
                f(s);
            }
        });
    }

    /// Waits until `pred` holds for the whole map (checked now and after every change).
    pub async fn wait_for(&self, mut pred: impl FnMut(&StatusMap) -> bool) {
        let mut rx = self.subscribe();
        // `wait_for` errs only when the sender is gone, and `self` holds it.
        let _ = rx.wait_for(|m| pred(m)).await;
    }
}
