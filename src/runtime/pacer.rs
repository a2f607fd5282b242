//! Catch-up pacing: rounds that fell due while the process was down (or while a backlog is
//! replayed) are released at `catch-up-rate` emissions per second instead of in one burst.
//!
//! Each partition task owns one [`CatchUpPacer`] (`runtime.catch-up-rate` is per partition,
//! as the config documents it; nothing is shared between partitions). It is a token bucket
//! on tokio time: it refills at `rate` tokens per second up to a burst of a tenth of a
//! second's worth (at least 1). A partition fires an overdue timer only while the bucket has
//! a token, then pays one token per emission the fire produced (a silent round end or a
//! state expiry costs nothing). Which overdue timer a token goes to is the catch-up
//! queue's choice ([`super::catch_up`]): tenants take turns (round-robin, SEMANTICS §3), each
//! tenant's rounds in due order, so one tenant's backlog does not hold back another's few.
//! Every partition takes its own tenants in turn at its own rate.

use std::time::Duration;
use tokio::time::Instant;

/// A token bucket of emissions per second (see module docs).
#[derive(Clone, Debug)]
pub struct CatchUpPacer {
    /// Tokens per second; `None`: unlimited.
    rate: Option<f64>,
    burst: f64,
    /// May go negative: a fire can produce more emissions than the tokens left.
    tokens: f64,
    last: Instant,
}

impl CatchUpPacer {
    /// A pacer releasing `rate` emissions per second; `0` means unlimited.
    pub fn new(rate: u32) -> Self {
        let rate = (rate > 0).then_some(f64::from(rate));
        let burst = rate.map_or(f64::INFINITY, |r| (r / 10.0).max(1.0));
        CatchUpPacer {
            rate,
            burst,
            tokens: burst.min(1.0e9),
            last: Instant::now(),
        }
    }

    /// Refills for the time passed; returns the rate, `None` when unlimited.
    fn refill(&mut self) -> Option<f64> {
        let rate = self.rate?;
        let now = Instant::now();
        let refill = now.duration_since(self.last).as_secs_f64() * rate;
        self.tokens = (self.tokens + refill).min(self.burst);
        self.last = now;
        Some(rate)
    }

    /// `Ok(())` when an overdue timer may fire now; otherwise how long until a token is
    /// available.
    pub fn ready(&mut self) -> Result<(), Duration> {
        match self.refill() {
            Some(rate) if self.tokens < 1.0 => {
                Err(Duration::from_secs_f64((1.0 - self.tokens) / rate)
                    .max(Duration::from_millis(1)))
            }
            _ => Ok(()),
        }
    }

    /// Pays for `emissions` released by an overdue fire (right after [`CatchUpPacer::ready`]
    /// said yes: the tokens were refilled then, so the clock is not read again).
    pub fn spend(&mut self, emissions: usize) {
        if self.rate.is_some() {
            self.tokens -= emissions as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn releases_at_the_configured_rate() {
        let mut p = CatchUpPacer::new(100); // burst 10
        let mut released = 0;
        let start = Instant::now();
        while released < 110 {
            match p.ready() {
                Ok(()) => {
                    p.spend(1);
                    released += 1;
                }
                Err(wait) => tokio::time::sleep(wait).await,
            }
        }
        // 10 at once (burst), then 100 more at 100/s.
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(990) && took <= Duration::from_millis(1_020),
            "{took:?}"
        );
    }

    #[test]
    fn zero_means_unlimited() {
        let mut p = CatchUpPacer::new(0);
        for _ in 0..10_000 {
            assert!(p.ready().is_ok());
            p.spend(1);
        }
    }
}
