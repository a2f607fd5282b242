//! Rate limiting of log lines that a loop can repeat (a publish retried while the broker is
//! down, a poll failing every 200 ms, a producer sending nothing but bad records): the first
//! occurrence of a run is logged at once, later ones at most once per interval with the count
//! of those left out in between, and the end of the run once (STYLE §7: logs stay readable
//! during an outage, and no event is silently lost: the left-out ones are counted, and logged
//! at debug level by the caller).
//!
//! Time is tokio time, so paused-time tests see the same behaviour.

use std::time::Duration;
use tokio::time::Instant;

/// Default interval between two log lines of one repeated warning.
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// Decides which occurrences of one repeated warning are logged. One per loop (not shared).
#[derive(Debug)]
pub struct LogThrottle {
    every: Duration,
    /// When the last occurrence was logged (`None`: no run in progress).
    logged_at: Option<Instant>,
    /// Occurrences not logged since the last logged one.
    suppressed: u64,
    /// Occurrences in the current run (since the last [`LogThrottle::clear`]).
    run: u64,
}

impl LogThrottle {
    /// Logs at most once per `every`.
    pub fn new(every: Duration) -> Self {
        LogThrottle {
            every,
            logged_at: None,
            suppressed: 0,
            run: 0,
        }
    }

    /// Counts one occurrence. `Some(n)`: log it now, mentioning the `n` occurrences left out
    /// since the previous line; `None`: leave it out (log it at debug level at most).
    pub fn allow(&mut self) -> Option<u64> {
        self.run += 1;
        let now = Instant::now();
        match self.logged_at {
            Some(at) if now.duration_since(at) < self.every => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.logged_at = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }

    /// Ends the current run (the operation succeeded). `Some(n)`: a run of `n` occurrences
    /// just ended (log the recovery once); `None`: there was none.
    pub fn clear(&mut self) -> Option<u64> {
        self.logged_at = None;
        self.suppressed = 0;
        match std::mem::take(&mut self.run) {
            0 => None,
            n => Some(n),
        }
    }
}

impl Default for LogThrottle {
    fn default() -> Self {
        LogThrottle::new(LOG_EVERY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn first_logged_then_one_per_interval_with_the_count_left_out() {
        let mut t = LogThrottle::new(Duration::from_secs(10));
        assert_eq!(t.allow(), Some(0));
        assert_eq!(t.allow(), None);
        assert_eq!(t.allow(), None);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(t.allow(), Some(2));
        assert_eq!(t.allow(), None);
        assert_eq!(t.clear(), Some(5));
        assert_eq!(t.clear(), None);
        // A new run is logged at once.
        assert_eq!(t.allow(), Some(0));
    }
}
