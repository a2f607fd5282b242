//! What-if sweeps for the operator page (issue 35, view 6): the contract between the page
//! (`POST /ui/whatif`, [`super::ui`]) and whoever can replay the input's last minutes under
//! many debounce settings. The replay itself (`settle tune`'s sweep, Pareto marks,
//! recommendation and chart) lives in the command-line tools, above this module in the
//! crate's layers, so `settle run` hands the admin server an implementation of [`WhatIf`]
//! ([`super::AdminState::with_whatif`]); without one the page only says how to run `settle
//! tune` beside the service.
//!
//! Invariants, kept here for every implementation:
//! * at most one sweep runs per process ([`SweepSlot`]): a second request while one runs is
//!   refused with when the running one started and who asked;
//! * a sweep reads 1 to [`MAX_MINUTES`] minutes back from now; an implementation refuses a
//!   range of more than [`MAX_UPLOADS`] uploads ([`WhatIfError::Refused`]) rather than hold
//!   it in memory;
//! * [`WhatIf::sweep`] blocks (it reads the broker and replays on every core): the page
//!   runs it with `tokio::task::spawn_blocking`, never on the async workers.

use crate::config::Config;
use crate::engine::Millis;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Longest look-back of one sweep (minutes).
pub const MAX_MINUTES: u32 = 60;

/// Most uploads one sweep replays: a range holding more is refused (every setting replays
/// them all, and they are held in memory meanwhile).
pub const MAX_UPLOADS: u64 = 2_000_000;

/// Longest sweep or goal text accepted from the page (bytes).
pub const MAX_SPEC_BYTES: usize = 1_000;

/// One sweep asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WhatIfRequest {
    /// How far back to read from now (minutes, 1 to [`MAX_MINUTES`]).
    pub minutes: u32,
    /// The settings to replay, in `settle tune --sweep` grammar; `None`: the
    /// implementation's [`WhatIf::default_sweep`].
    pub sweep: Option<String>,
    /// The goal of the recommendation, in `settle tune --goal` grammar (`p99<=60s`); `None`:
    /// [`WhatIf::default_goal`].
    pub goal: Option<String>,
}

/// One setting's figures over the range read.
#[derive(Clone, Debug, PartialEq)]
pub struct WhatIfRow {
    /// The setting, as `settle tune` names it (`fixed 10s`, `adaptive 5s/10m, learn,
    /// max-wait 30m`).
    pub setting: String,
    /// Ready records it would have emitted (the cost).
    pub emissions: u64,
    /// Uploads per ready record (coalescing ratio).
    pub uploads_per_emission: f64,
    /// Time-to-ready median (ms): last upload of a round to its ready record.
    pub time_to_ready_p50_ms: u64,
    /// Time-to-ready 99th percentile (ms).
    pub time_to_ready_p99_ms: u64,
    /// The row meets the goal.
    pub meets_goal: bool,
    /// No other row has both fewer-or-equal emissions and lower-or-equal p99, one strictly.
    pub pareto: bool,
    /// The cheapest row meeting the goal (at most one row).
    pub recommended: bool,
}

/// What a sweep found.
#[derive(Clone, Debug, PartialEq)]
pub struct WhatIfResult {
    /// What was read: broker, topic or stream, time range.
    pub source: String,
    /// Uploads replayed.
    pub uploads: u64,
    /// Records in the range that did not decode (skipped, as the runtime dead-letters them).
    pub rejected: u64,
    /// The goal, as text (`p99 time-to-ready ≤ 1m`).
    pub goal: String,
    /// One row per setting, in sweep order.
    pub rows: Vec<WhatIfRow>,
    /// The closing sentences of `settle tune` (the recommendation, or that none meets the
    /// goal and the closest).
    pub verdict: Vec<String>,
    /// The Pareto chart, an `<svg>` element to inline; `None` when it could not be drawn.
    pub svg: Option<String>,
}

/// Why a sweep gave no result. Each message says what to change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WhatIfError {
    /// The request cannot be run as asked: a bad sweep or goal, too many uploads in the
    /// range (the page answers 400).
    #[error("{0}")]
    Refused(String),
    /// The read or the replay failed: broker away, stream missing (the page answers 502).
    #[error("{0}")]
    Failed(String),
}

/// Replays the input's last minutes under many settings (module docs). Implemented by the
/// command-line tools (`settle run` passes it in); tests use a fake.
pub trait WhatIf: Send + Sync {
    /// The sweep used when the request gives none (`settle tune --sweep` grammar).
    fn default_sweep(&self) -> &str;

    /// The goal used when the request gives none (`settle tune --goal` grammar).
    fn default_goal(&self) -> &str;

    /// Reads the last `request.minutes` minutes of the input and replays them. Blocking.
    ///
    /// Errors: [`WhatIfError::Refused`] for a bad sweep or goal or more than [`MAX_UPLOADS`]
    /// uploads; [`WhatIfError::Failed`] when the read fails.
    fn sweep(&self, request: &WhatIfRequest) -> Result<WhatIfResult, WhatIfError>;
}

/// How `settle run` gets its [`WhatIf`] from the tools above it: given the service's config
/// (the broker and input it reads), the implementation that reads that same input.
pub type WhatIfFactory = fn(&Config) -> Arc<dyn WhatIf>;

/// The sweep running now: when it started (ms since the epoch), who asked, how far back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunningSweep {
    /// When it started (wall clock, ms since the epoch).
    pub started_at: Millis,
    /// The credential name of who asked (`anonymous` without a token).
    pub who: String,
    /// Its look-back (minutes).
    pub minutes: u32,
}

/// The one sweep a process runs at a time. Cheap to clone (shared).
#[derive(Clone, Debug, Default)]
pub struct SweepSlot(Arc<Mutex<Option<RunningSweep>>>);

impl SweepSlot {
    fn lock(&self) -> MutexGuard<'_, Option<RunningSweep>> {
        // The slot holds plain data: a panic while it was held leaves nothing half-written.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the slot for `sweep`: a guard that frees it when dropped, or the sweep that
    /// holds it.
    pub fn try_take(&self, sweep: RunningSweep) -> Result<SweepGuard, RunningSweep> {
        let mut slot = self.lock();
        if let Some(running) = slot.as_ref() {
            return Err(running.clone());
        }
        *slot = Some(sweep);
        Ok(SweepGuard(self.clone()))
    }

    /// The sweep running now, if any.
    pub fn running(&self) -> Option<RunningSweep> {
        self.lock().clone()
    }
}

/// Holds the [`SweepSlot`] until dropped (moved into the blocking task, so a client that
/// goes away does not free the slot before the sweep ends).
#[derive(Debug)]
pub struct SweepGuard(SweepSlot);

impl Drop for SweepGuard {
    fn drop(&mut self) {
        *self.0.lock() = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_sweep_at_a_time_and_the_slot_frees_on_drop() {
        let slot = SweepSlot::default();
        let first = RunningSweep {
            started_at: 1_000,
            who: "alice".into(),
            minutes: 5,
        };
        let guard = slot.try_take(first.clone()).unwrap();
        let second = RunningSweep {
            who: "bob".into(),
            ..first.clone()
        };
        assert_eq!(slot.try_take(second.clone()).unwrap_err(), first);
        assert_eq!(slot.running(), Some(first));
        drop(guard);
        assert_eq!(slot.running(), None);
        assert!(slot.try_take(second).is_ok());
    }
}
