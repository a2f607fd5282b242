//! Time for the shell: the wall clock behind a [`Clock`] trait, and the partition clock of
//! SEMANTICS §3 ([`PartitionClock`]).
//!
//! Nothing in the runtime reads `SystemTime` directly; it asks its `Clock`. Production uses
//! [`SystemClock`]; tests use [`TokioClock`], which follows tokio's clock and so advances
//! with `tokio::time::pause`/`advance` (and the auto-advance of paused time). Sleeping is
//! always `tokio::time::sleep` for `due − now` ms, which is right for both.

use crate::engine::Millis;
use std::time::{SystemTime, UNIX_EPOCH};

/// A wall clock in ms since the Unix epoch.
pub trait Clock: Clone + Send + Sync + 'static {
    /// The current wall-clock time (ms since the Unix epoch).
    fn now_ms(&self) -> Millis;
}

/// The system's wall clock (`SystemTime::now`).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> Millis {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => d.as_millis() as Millis,
            // A clock set before 1970: report the epoch rather than fail.
            Err(_) => 0,
        }
    }
}

/// A wall clock driven by tokio's clock: `start_ms` plus the tokio time elapsed since the
/// clock was made. With paused tokio time it moves only when tokio time does.
#[derive(Clone, Copy, Debug)]
pub struct TokioClock {
    start_ms: Millis,
    start: tokio::time::Instant,
}

impl TokioClock {
    /// A clock reading `start_ms` now (ms since the epoch).
    pub fn starting_at(start_ms: Millis) -> Self {
        TokioClock {
            start_ms,
            start: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now_ms(&self) -> Millis {
        self.start_ms + self.start.elapsed().as_millis() as Millis
    }
}

/// The partition clock (SEMANTICS §3): while the partition is behind, the largest event time
/// consumed from it; when caught up, the wall clock; never backwards.
#[derive(Clone, Debug)]
pub struct PartitionClock {
    now: Millis,
}

impl PartitionClock {
    /// Resumes from the partition time stored by the last committed batch (`None`: a new
    /// partition, time starts at the epoch and the first record or catch-up moves it).
    pub fn resume(stored: Option<Millis>) -> Self {
        PartitionClock {
            now: stored.unwrap_or(0),
        }
    }

    /// Partition time (ms).
    pub fn now(&self) -> Millis {
        self.now
    }

    /// An upload with event time `event_time` (ms) was consumed: partition time becomes
    /// `max(now, event_time)`. Returns the new partition time.
    pub fn observe(&mut self, event_time: Millis) -> Millis {
        self.now = self.now.max(event_time);
        self.now
    }

    /// The partition is caught up (lag 0) at wall-clock time `wall` (ms): partition time
    /// becomes `max(now, wall)`. Returns the new partition time.
    pub fn caught_up(&mut self, wall: Millis) -> Millis {
        self.observe(wall)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_clock_never_goes_backwards() {
        let mut c = PartitionClock::resume(Some(1_000));
        assert_eq!(c.observe(900), 1_000);
        assert_eq!(c.observe(1_500), 1_500);
        assert_eq!(c.caught_up(1_200), 1_500);
        assert_eq!(c.caught_up(2_000), 2_000);
    }

    #[tokio::test(start_paused = true)]
    async fn tokio_clock_follows_paused_time() {
        let c = TokioClock::starting_at(10_000);
        assert_eq!(c.now_ms(), 10_000);
        tokio::time::advance(std::time::Duration::from_millis(250)).await;
        assert_eq!(c.now_ms(), 10_250);
    }
}
