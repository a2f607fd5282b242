//! The tier-share task of a runtime (SEMANTICS §5: a tenant's rate is the deployment's, and
//! its tier outlives restarts): one per process, next to the tier-events task, when the
//! transport has a [`TierCounts`] log (Kafka `kafka.tier-counts-topic`, NATS
//! `nats.tier-counts-bucket`).
//!
//! * **At start** ([`restore`], before any partition publishes): the latest snapshot of every
//!   instance is read back and handed to [`Router::restore`](crate::tiers::Router::restore):
//!   the live instances' counts are summed, and every tenant some instance had demoted (and
//!   that has not recovered by the rule since) starts demoted. A broker that does not answer
//!   within [`RESTORE_TIMEOUT`] costs only that: the process starts with empty tiers and says
//!   so in a warning.
//! * **Every `tiers.share-interval`**: this instance's [`CountsSnapshot`] (its own emissions of
//!   each tenant in the current window, and its demoted tenants) is published, key = the
//!   instance. A publish that fails is not retried (the next one is due an interval later);
//!   failures are logged at most every 10 s.
//! * **Whenever another instance publishes**: its snapshot replaces its earlier counts in the
//!   router ([`Router::apply_remote`](crate::tiers::Router::apply_remote)); a tenant whose
//!   deployment-wide count now exceeds `limit` is demoted at once, and the change goes to
//!   the tier-events task like a routing decision (which publishes it only when this
//!   instance is the tenant's reporter, `Router::reports`). Counts of an instance that
//!   stopped publishing expire (3 intervals, at least 3 s; the router's sweep drops them).
//! * **At stop**: one last snapshot, marked `stopping`, so the demoted tenants of this instance
//!   are in the log for the next start, and the others stop counting it as live at once. The
//!   counts of a stopped instance (said so, or silent for 3 intervals: `kill -9`) fade out over
//!   one `period` instead of vanishing, so a rolling restart does not let a tenant past the
//!   limit.
//!
//! # What it costs, and what the broker being away costs
//!
//! One small record per instance per interval (JSON, at most
//! [`MAX_SHARED_TENANTS`](crate::tiers::MAX_SHARED_TENANTS) tenants:
//! typically a few hundred bytes) and one consumer reading everybody's. While the broker is
//! away, nothing arrives: the others' counts expire after 3 intervals, and each instance goes
//! on deciding on its own counts (what a single instance does), then sums again when the
//! snapshots return. Routing never waits for any of this.

use super::clock::Clock;
use super::throttle::LogThrottle;
use crate::tiers::{CountsSnapshot, Restored, SharedRouter, TierChange};
use crate::transport::{Backoff, Error, TierCounts, TierCountsFeed};
use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Longest wait for the start-up read of the tier-counts log (topic or bucket creation
/// included): the partitions start only after it.
pub const RESTORE_TIMEOUT: Duration = Duration::from_secs(5);

/// Longest wait for the last snapshot at stop.
const FINAL_PUBLISH_TIMEOUT: Duration = Duration::from_secs(2);

/// Reads every instance's latest snapshot and restores the router from them (see the module
/// doc). Never fails: a broker that does not answer, or snapshots that do not parse, are
/// logged and cost only the restored state. Returns what was restored (`None`: nothing
/// could be read).
pub(crate) async fn restore<C: Clock>(
    router: &SharedRouter,
    counts: &dyn TierCounts,
    clock: &C,
    changes: &mpsc::UnboundedSender<TierChange>,
) -> Option<Restored> {
    let read = tokio::time::timeout(RESTORE_TIMEOUT, counts.read_latest(RESTORE_TIMEOUT))
        .await
        .unwrap_or_else(|_| {
            Err(Error::Unavailable {
                transport: "tier-counts",
                reason: format!("no answer within {} s", RESTORE_TIMEOUT.as_secs()),
            })
        });
    let read = match read {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, log = counts.name(), "tier state not restored: the tier-counts log could not be read; every tenant starts in its starting tier");
            return None;
        }
    };
    let mut snapshots = Vec::with_capacity(read.len());
    for bytes in read {
        match CountsSnapshot::from_json(&bytes) {
            Ok(s) => snapshots.push(s),
            Err(e) => {
                tracing::warn!(error = %e, log = counts.name(), "skipping a record of the tier-counts log")
            }
        }
    }
    let restored = router.lock().restore(&snapshots, clock.now_ms());
    tracing::info!(
        log = counts.name(),
        snapshots = restored.snapshots,
        live_instances = restored.live,
        demoted = restored.demoted,
        "tier state restored from the tier-counts log"
    );
    for c in &restored.changes {
        let _ = changes.send(c.clone());
    }
    Some(restored)
}

/// What the task needs besides the clock.
pub(crate) struct TierShareSetup {
    /// The process's router (its instance name is set).
    pub router: SharedRouter,
    /// Where the snapshots go and come from.
    pub counts: Arc<dyn TierCounts>,
    /// `tiers.share-interval`.
    pub interval: Duration,
    /// To the tier-events task: changes decided on other instances' counts.
    pub changes: mpsc::UnboundedSender<TierChange>,
}

/// Runs the task until `stop` fires, then publishes one last snapshot.
pub(crate) async fn run<C: Clock>(setup: TierShareSetup, clock: C, stop: CancellationToken) {
    let TierShareSetup {
        router,
        counts,
        interval,
        changes,
    } = setup;
    let instance = router.lock().instance().to_owned();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut feed: Option<Box<dyn TierCountsFeed>> = None;
    let mut subscribe_at = Some(tokio::time::Instant::now());
    // A subscription under way: awaited inside the select, so a broker that never answers it
    // cannot hold the task past `stop`.
    let mut subscribing: Option<BoxFuture<'static, Result<Box<dyn TierCountsFeed>, Error>>> = None;
    let mut backoff = Backoff::new(Duration::from_secs(5));
    let mut in_flight: Option<BoxFuture<'static, Result<(), Error>>> = None;
    let mut publish_failing = LogThrottle::default();
    let mut feed_failing = LogThrottle::default();
    let mut bad_record = LogThrottle::default();
    loop {
        tokio::select! {
            biased;
            () = stop.cancelled() => break,
            _ = tick.tick() => {
                if in_flight.is_none() {
                    let snapshot = router.lock().share_snapshot(clock.now_ms());
                    let (counts, instance) = (Arc::clone(&counts), instance.clone());
                    in_flight = Some(Box::pin(async move {
                        counts.publish(&instance, snapshot.to_json()).await
                    }));
                }
            }
            result = published(&mut in_flight), if in_flight.is_some() => {
                in_flight = None;
                match result {
                    Ok(()) => {
                        if let Some(failures) = publish_failing.clear() {
                            tracing::info!(failures, log = counts.name(), "tier counts published again");
                        }
                    }
                    Err(e) => match publish_failing.allow() {
                        Some(suppressed) => tracing::warn!(error = %e, log = counts.name(), suppressed, "tier counts not published: the other instances will not see this one's emissions until the broker is back (logged at most every 10 s)"),
                        None => tracing::debug!(error = %e, "tier counts not published"),
                    },
                }
            }
            () = super::publisher::sleep_until(subscribe_at), if subscribe_at.is_some() => {
                subscribe_at = None;
                let counts = Arc::clone(&counts);
                subscribing = Some(Box::pin(async move { counts.subscribe().await }));
            }
            result = subscribed(&mut subscribing), if subscribing.is_some() => {
                subscribing = None;
                match result {
                    Ok(f) => {
                        feed = Some(f);
                        backoff.reset();
                        if let Some(failures) = feed_failing.clear() {
                            tracing::info!(failures, log = counts.name(), "reading the tier counts of the other instances again");
                        }
                    }
                    Err(e) => {
                        feed_failed(&mut feed_failing, &e, counts.name());
                        subscribe_at = Some(tokio::time::Instant::now() + backoff.next_delay());
                    }
                }
            }
            next = next_snapshot(&mut feed), if feed.is_some() => match next {
                Ok(bytes) => match CountsSnapshot::from_json(&bytes) {
                    Ok(s) => {
                        let decided = router.lock().apply_remote(&s, clock.now_ms());
                        for c in decided {
                            let _ = changes.send(c);
                        }
                    }
                    Err(e) => match bad_record.allow() {
                        Some(suppressed) => tracing::warn!(error = %e, log = counts.name(), suppressed, "skipping a record of the tier-counts log (logged at most every 10 s)"),
                        None => tracing::debug!(error = %e, "skipping a record of the tier-counts log"),
                    },
                },
                Err(e) => {
                    feed_failed(&mut feed_failing, &e, counts.name());
                    feed = None;
                    subscribe_at = Some(tokio::time::Instant::now() + backoff.next_delay());
                }
            },
        }
    }
    // The demoted tenants of this instance, for the next start; marked as the last, so the
    // others count this instance as stopped at once (its counts fade out).
    let snapshot = router.lock().final_snapshot(clock.now_ms());
    let last = counts.publish(&instance, snapshot.to_json());
    match tokio::time::timeout(FINAL_PUBLISH_TIMEOUT, last).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, log = counts.name(), "last tier counts not published at stop")
        }
        Err(_) => tracing::warn!(
            log = counts.name(),
            "last tier counts not published at stop (timed out)"
        ),
    }
}

fn feed_failed(throttle: &mut LogThrottle, e: &Error, log: &str) {
    match throttle.allow() {
        Some(suppressed) => {
            tracing::warn!(error = %e, log, suppressed, "cannot read the tier counts of the other instances; deciding on this instance's own until they are back (logged at most every 10 s)")
        }
        None => tracing::debug!(error = %e, "tier-counts feed"),
    }
}

/// Awaits the publish in flight; pends forever when there is none.
async fn published(
    in_flight: &mut Option<BoxFuture<'static, Result<(), Error>>>,
) -> Result<(), Error> {
    match in_flight {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// Awaits the subscription under way; pends forever when there is none.
async fn subscribed(
    subscribing: &mut Option<BoxFuture<'static, Result<Box<dyn TierCountsFeed>, Error>>>,
) -> Result<Box<dyn TierCountsFeed>, Error> {
    match subscribing {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// The next snapshot of the feed; pends forever when there is none.
async fn next_snapshot(feed: &mut Option<Box<dyn TierCountsFeed>>) -> Result<Vec<u8>, Error> {
    match feed {
        Some(f) => f.next().await,
        None => std::future::pending().await,
    }
}
