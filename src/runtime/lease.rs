//! Self-fencing after a pause (SEMANTICS §6 "Single writer"): a process that was stopped
//! (SIGSTOP, a VM freeze, a long GC-like stall) for longer than the consumer group's session
//! timeout may have lost its partitions to another member without having been told yet:
//! librdkafka reports the lost assignment only after it wakes up, and meanwhile the partition
//! tasks and publishers would go on publishing and appending to the changelog for
//! partitions another instance now owns.
//!
//! [`Liveness`] closes that window. An OS thread (not a tokio task, so a saturated runtime
//! cannot starve it) notes the monotonic time every [`TICK`]; when it sees a gap longer than
//! the lease, or a fence check sees the last note older than the lease, the liveness expires
//! for good. Every partition's [`Fence`](super::Fence) then reads as not owned (nothing is
//! published or appended from that instant), and the runtime stops and returns
//! [`Error::Paused`](super::Error::Paused), so `settle run` exits with an error and a
//! supervisor restarts it; the restarted process rejoins the group, and a store that another
//! instance wrote meanwhile is wiped and restored (`runtime::restore`).
//!
//! The lease is shorter than the session timeout (`settle run` on Kafka uses two thirds of
//! `session.timeout.ms`): a process paused for less than that cannot have been evicted.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How often the liveness thread notes the time.
pub const TICK: Duration = Duration::from_millis(100);

struct Inner {
    base: Instant,
    lease_ms: u64,
    /// Monotonic ms since `base` of the last note.
    alive_ms: AtomicU64,
    expired: AtomicBool,
    /// Length of the pause that expired it (ms).
    paused_ms: AtomicU64,
    stop: AtomicBool,
    notify: Notify,
}

/// The process's liveness lease (module docs). Cheap to clone.
#[derive(Clone)]
pub struct Liveness {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Liveness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Liveness")
            .field("lease_ms", &self.inner.lease_ms)
            .field("expired", &self.is_expired())
            .finish()
    }
}

impl Liveness {
    /// Starts the liveness thread with lease `lease` (≥ 1 s is sensible). The thread stops
    /// when [`Liveness::stop`] is called.
    ///
    /// Errors: the thread cannot be started.
    pub fn start(lease: Duration) -> std::io::Result<Self> {
        let liveness = Liveness {
            inner: Arc::new(Inner {
                base: Instant::now(),
                lease_ms: lease.as_millis().max(1) as u64,
                alive_ms: AtomicU64::new(86_400_000),
                expired: AtomicBool::new(false),
                paused_ms: AtomicU64::new(0),
                stop: AtomicBool::new(false),
                notify: Notify::new(),
            }),
        };
        let thread = liveness.clone();
        std::thread::Builder::new()
            .name("settle-liveness".into())
            .spawn(move || {
                while !thread.inner.stop.load(Ordering::Acquire) {
                    std::thread::sleep(TICK);
                    thread.note();
                }
            })?;
        Ok(liveness)
    }

    /// Monotonic ms since `base`, plus a day's worth of ms so that `simulate_pause` can move
    /// a note back before `base`.
    fn now_ms(&self) -> u64 {
        self.inner.base.elapsed().as_millis() as u64 + 86_400_000
    }

    /// Notes the time; expires the lease when the previous note is older than the lease.
    fn note(&self) {
        let now = self.now_ms();
        let prev = self.inner.alive_ms.swap(now, Ordering::AcqRel);
        self.check_gap(now.saturating_sub(prev));
    }

    fn check_gap(&self, gap_ms: u64) {
        if gap_ms > self.inner.lease_ms && !self.inner.expired.swap(true, Ordering::AcqRel) {
            self.inner.paused_ms.store(gap_ms, Ordering::Release);
            self.inner.notify.notify_waiters();
            self.inner.notify.notify_one();
        }
    }

    /// True while the lease holds: not expired, and the last note is within the lease
    /// (a check right after a pause, before the thread noted the time, sees the gap and
    /// expires the lease itself).
    pub fn fresh(&self) -> bool {
        if self.is_expired() {
            return false;
        }
        let gap = self
            .now_ms()
            .saturating_sub(self.inner.alive_ms.load(Ordering::Acquire));
        self.check_gap(gap);
        !self.is_expired()
    }

    /// The lease expired (for good).
    pub fn is_expired(&self) -> bool {
        self.inner.expired.load(Ordering::Acquire)
    }

    /// How long the pause that expired the lease was (`None`: not expired).
    pub fn paused_for(&self) -> Option<Duration> {
        self.is_expired()
            .then(|| Duration::from_millis(self.inner.paused_ms.load(Ordering::Acquire)))
    }

    /// Resolves once the lease has expired.
    pub async fn expired(&self) {
        loop {
            let notified = self.inner.notify.notified();
            if self.is_expired() {
                return;
            }
            notified.await;
        }
    }

    /// Crash drills and tests: acts as if the process had just been paused for `pause`
    /// (the last note is moved back by that much).
    pub fn simulate_pause(&self, pause: Duration) {
        let back = self.now_ms().saturating_sub(pause.as_millis() as u64 + 1);
        self.inner.alive_ms.store(back, Ordering::Release);
    }

    /// Stops the thread (the lease is not checked any more by it).
    pub fn stop(&self) {
        self.inner.stop.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_longer_than_the_lease_expires_it_for_good() {
        let l = Liveness::start(Duration::from_secs(5)).unwrap();
        assert!(l.fresh());
        l.simulate_pause(Duration::from_secs(4));
        assert!(l.fresh(), "shorter than the lease");
        l.simulate_pause(Duration::from_secs(6));
        assert!(!l.fresh());
        assert!(l.paused_for().unwrap() >= Duration::from_secs(6));
        std::thread::sleep(TICK * 3);
        assert!(!l.fresh(), "the thread's next note does not revive it");
        l.stop();
    }
}
