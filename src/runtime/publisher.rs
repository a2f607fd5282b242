//! The outbox publisher of one partition: a task that receives owed emissions (read from the
//! store's outbox by the partition task), publishes them through the [`Sink`] with up to
//! `window` in flight, and reports each acknowledged sequence number back. Only the partition
//! task writes the store, so the outbox entry is deleted there, after the ack (ARCHITECTURE:
//! "outbox, then publish"; SEMANTICS §6 no lost emission).
//!
//! # Tiers (SEMANTICS §5)
//!
//! Each emission is routed once, when the publisher takes it from the outbox: the process's
//! [`SharedRouter`] counts it in its tenant's rate at the wall-clock time and returns the
//! tier (the record's `tier` field) and its topic. Routing only picks the topic: nothing is
//! held back or dropped. A retried emission keeps the tier and topic first chosen for it
//! (a tenant demoted between two attempts does not split one emission over two topics, and
//! a retry is not counted twice in the rate). A tier change decided by that call is handed
//! to the runtime's tier-events task ([`TierRouting::changes`]), which publishes it; the
//! emission does not wait for that. An emission re-published after a restart is routed
//! again by the new process's router.
//!
//! The ready record gets `emitted_at` = the wall clock when it is sent. A failed publish is
//! retried with backoff, failed entries first and in sequence order; while any entry waits
//! for a retry no new entry is started, so an unavailable broker sees one retry round per
//! backoff rather than the whole outbox. Failures are logged once when they start, then at
//! most every [`LOG_EVERY`](super::throttle::LOG_EVERY) with the count left out, and once
//! when publishing recovers; each is counted in `settle_publish_failures_total`.
//!
//! # Metrics
//!
//! Each acknowledged emission is counted by trigger, tier and policy, with its lateness
//! (`emitted_at - due_at`) and time-to-ready (`emitted_at - last_upload_at`), where
//! `emitted_at` is the wall clock of the attempt that succeeded ([`PublishMetrics`]).

use super::clock::Clock;
use super::throttle::LogThrottle;
use crate::codec;
use crate::engine::Millis;
use crate::metrics::PublishMetrics;
use crate::store::OutboxEntry;
use crate::tiers::{SharedRouter, TierChange};
use crate::transport::{Backoff, ReadyMessage, Sink};
use futures::stream::{FuturesUnordered, StreamExt};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The ownership fence of one partition task (SEMANTICS §6 "Single writer"; issue "state
/// handoff"): set while this process owns the partition. The runtime drops it when the
/// partition is revoked (at once when the assignment was lost, after the task stopped
/// otherwise); from then on the publisher starts no publish and the partition task appends
/// nothing to the changelog for it, so an instance that lost a partition does not emit for
/// it any more. Cheap to clone (shared flag).
#[derive(Clone, Debug)]
pub struct Fence {
    partition: i32,
    owned: Arc<AtomicBool>,
    /// The process's liveness lease, if the runtime has one (`runtime::lease`): a process
    /// paused longer than it owns nothing any more.
    liveness: Option<super::lease::Liveness>,
}

impl Fence {
    /// An owned partition's fence.
    pub fn new(partition: i32) -> Self {
        Fence {
            partition,
            owned: Arc::new(AtomicBool::new(true)),
            liveness: None,
        }
    }

    /// An owned partition's fence that also falls when `liveness` expires.
    pub fn with_liveness(partition: i32, liveness: Option<super::lease::Liveness>) -> Self {
        Fence {
            liveness,
            ..Fence::new(partition)
        }
    }

    /// The partition number.
    pub fn partition(&self) -> i32 {
        self.partition
    }

    /// True while the partition is owned (and the process's liveness lease holds).
    pub fn owned(&self) -> bool {
        self.owned.load(Ordering::Acquire) && self.liveness.as_ref().is_none_or(|l| l.fresh())
    }

    /// Fences the partition: nothing more is published or appended for it by this process.
    pub fn revoke(&self) {
        self.owned.store(false, Ordering::Release);
    }
}

/// How one partition's emissions are published (where: see [`TierRouting`]).
#[derive(Clone, Debug)]
pub struct PublishTarget {
    /// Most publishes in flight at once (≥ 1).
    pub window: usize,
    /// Longest backoff between retries.
    pub max_backoff: Duration,
}

/// The process's tier routing, shared by every partition's publisher (SEMANTICS §5).
/// Cheap to clone.
#[derive(Clone, Debug)]
pub struct TierRouting {
    /// The one router of the process: per-tenant rate over all partitions it owns.
    pub router: SharedRouter,
    /// Tier changes decided while routing, for the runtime's tier-events task (which
    /// publishes them to `tiers.events-topic` and writes `<data-dir>/tiers.json`). A send to
    /// a closed channel is ignored: routing goes on without it.
    pub changes: mpsc::UnboundedSender<TierChange>,
}

impl TierRouting {
    /// Routing through `router`, and the receiving end of its tier changes.
    pub fn new(router: SharedRouter) -> (Self, mpsc::UnboundedReceiver<TierChange>) {
        let (changes, rx) = mpsc::unbounded_channel();
        (TierRouting { router, changes }, rx)
    }

    /// Routes the emissions of `entries` at wall-clock time `now_ms` (ms), in order, under
    /// one hold of the router's lock, and forwards the tier changes they caused.
    pub(super) fn route_all(&self, entries: Vec<OutboxEntry>, now_ms: Millis) -> Vec<Routed> {
        let routes = self
            .router
            .route_many(entries.iter().map(|e| e.emission.key.tenant()), now_ms);
        entries
            .into_iter()
            .zip(routes)
            .map(|(entry, route)| {
                if let Some(change) = route.change {
                    // The tier-events task is gone only while the runtime stops; routing
                    // goes on.
                    let _ = self.changes.send(change);
                }
                Routed {
                    tier: route.tier.to_owned(),
                    topic: route.topic.to_owned(),
                    entry,
                }
            })
            .collect()
    }
}

/// An owed emission with the tier and topic chosen for it on its first attempt.
pub(super) struct Routed {
    pub(super) entry: OutboxEntry,
    tier: String,
    topic: String,
}

/// The ready record of `routed`, sent at wall-clock `now_ms` (its `emitted_at`) by the task
/// of input partition `partition`.
pub(super) fn ready_message(routed: &Routed, now_ms: Millis, partition: i32) -> ReadyMessage {
    let e = &routed.entry.emission;
    ReadyMessage {
        topic: routed.topic.clone(),
        tier: routed.tier.clone(),
        key: e.key.to_string(),
        emission_id: e.emission_id(),
        payload: codec::encode_ready(e, now_ms, &routed.tier),
        partition: Some(partition),
    }
}

/// Runs until `entries` is closed and everything received is acknowledged (or until the
/// task is aborted: the partition task aborts it at the shutdown deadline; whatever is not
/// acknowledged stays in the outbox and is published again after a restart), or until
/// `fence` is revoked: then it starts no further publish (what is in flight may still be
/// acknowledged) and returns; the owed emissions stay in the outbox (and the changelog) for
/// the partition's next owner. Records what it publishes in `metrics`.
///
/// Entries waiting in `entries` are taken together, as many as the window has room for, and
/// published as one batch ([`Sink::publish_batch`]): routed under one router lock, one
/// future, their acknowledged sequence numbers sent back as one `Vec` on `acks`.
#[allow(clippy::too_many_arguments)]
pub async fn run<K: Sink, C: Clock>(
    sink: K,
    clock: C,
    target: PublishTarget,
    tiers: TierRouting,
    fence: Fence,
    mut entries: mpsc::Receiver<OutboxEntry>,
    acks: mpsc::UnboundedSender<Vec<u64>>,
    mut metrics: PublishMetrics,
) {
    let sink = &sink;
    let window = target.window.max(1);
    let partition = fence.partition();
    let fence = &fence;
    let publish = |batch: Vec<Routed>, now_ms: Millis| async move {
        let messages: Vec<ReadyMessage> = batch
            .iter()
            .map(|routed| ready_message(routed, now_ms, partition))
            .collect();
        // Checked last, right before the records are handed to the sink.
        let results = if fence.owned() {
            sink.publish_batch(messages).await
        } else {
            let fenced = crate::transport::Error::Fatal {
                transport: "runtime",
                reason: format!("partition {partition} is no longer owned"),
            };
            vec![Err(fenced); batch.len()]
        };
        (batch, now_ms, results)
    };
    let mut in_flight = FuturesUnordered::new();
    // Entries in the batches of `in_flight` (the window counts entries, not batches).
    let mut in_flight_entries = 0usize;
    let mut retry: BTreeMap<u64, Routed> = BTreeMap::new();
    let mut backoff = Backoff::new(target.max_backoff);
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut failing = LogThrottle::default();
    let mut open = true;
    loop {
        if !fence.owned() {
            tracing::info!(
                partition,
                in_flight = in_flight_entries,
                "partition fenced: the publisher starts no more publishes for it"
            );
            return;
        }
        let can_start = open && retry.is_empty() && in_flight_entries < window;
        if !open && in_flight.is_empty() && retry.is_empty() {
            return;
        }
        tokio::select! {
            received = entries.recv(), if can_start => match received {
                Some(entry) => {
                    // Woken by the partition task's send, this task runs next on that task's
                    // worker thread (tokio's LIFO slot), where no other worker can take it:
                    // yielding once puts it in the run queue, so an idle worker publishes
                    // while the partition task goes on (and more entries arrive meanwhile).
                    tokio::task::yield_now().await;
                    let mut batch = vec![entry];
                    while in_flight_entries + batch.len() < window {
                        match entries.try_recv() {
                            Ok(entry) => batch.push(entry),
                            Err(_) => break,
                        }
                    }
                    let now = clock.now_ms();
                    in_flight_entries += batch.len();
                    in_flight.push(publish(tiers.route_all(batch, now), now));
                }
                None => open = false,
            },
            Some((batch, sent_at, results)) = in_flight.next(), if !in_flight.is_empty() => {
                in_flight_entries -= batch.len();
                let mut acked = Vec::with_capacity(batch.len());
                for (routed, result) in batch.into_iter().zip(results) {
                    match result {
                        Ok(()) => {
                            backoff.reset();
                            if let Some(failures) = failing.clear() {
                                tracing::info!(failures, topic = %routed.topic, "publishing recovered");
                            }
                            metrics.published(&routed.tier, &routed.entry.emission, sent_at);
                            acked.push(routed.entry.seq);
                        }
                        Err(_) if !fence.owned() => {}
                        Err(e) => {
                            metrics.publish_failed(&routed.tier);
                            match failing.allow() {
                                Some(suppressed) => tracing::warn!(
                                    emission_id = %routed.entry.emission.emission_id(),
                                    topic = %routed.topic,
                                    error = %e,
                                    retryable = e.is_retryable(),
                                    suppressed,
                                    "publish failed; will retry (logged at most every 10 s until it recovers)"
                                ),
                                None => tracing::debug!(
                                    emission_id = %routed.entry.emission.emission_id(),
                                    topic = %routed.topic,
                                    error = %e,
                                    "publish failed; will retry"
                                ),
                            }
                            retry.insert(routed.entry.seq, routed);
                            if retry_at.is_none() {
                                retry_at = Some(tokio::time::Instant::now() + backoff.next_delay());
                            }
                        }
                    }
                }
                if !acked.is_empty() && acks.send(acked).is_err() {
                    // The partition task is gone; nothing can be deleted any more.
                    return;
                }
            },
            () = sleep_until(retry_at), if retry_at.is_some() && in_flight.is_empty() => {
                retry_at = None;
                if !fence.owned() {
                    continue;
                }
                let now = clock.now_ms();
                let batch: Vec<Routed> = std::mem::take(&mut retry).into_values().collect();
                in_flight_entries += batch.len();
                in_flight.push(publish(batch, now));
            },
        }
    }
}

/// Sleeps until `at`; pends forever for `None` (a `select!` branch that is off).
pub(super) async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Emission, PolicyName, SessionKey, Trigger};
    use crate::runtime::TokioClock;
    use crate::tiers::{Router, TiersConfig};
    use crate::transport::memory::MemoryBroker;

    const T0: Millis = 1_767_225_600_000;

    fn entry(seq: u64, tenant: &str, session: &str) -> OutboxEntry {
        OutboxEntry {
            seq,
            emission: Emission {
                key: SessionKey::new(tenant, session),
                state_created_at: T0,
                generation: 1,
                trigger: Trigger::Trailing,
                uploads: 1,
                first_upload_at: T0,
                last_upload_at: T0,
                due_at: T0,
                delay_ms: 0,
                policy: PolicyName::Fixed,
                last_event_id: None,
                attributes: None,
                event_ids: None,
            },
        }
    }

    /// The publisher of partition 0 on `broker` with `window`, spawned: its entries' sender,
    /// its acks and its task.
    fn spawn_publisher(
        broker: &MemoryBroker,
        clock: TokioClock,
        tiers: TierRouting,
        window: usize,
    ) -> (
        mpsc::Sender<OutboxEntry>,
        mpsc::UnboundedReceiver<Vec<u64>>,
        tokio::task::JoinHandle<()>,
    ) {
        let (entries, entries_rx) = mpsc::channel(16);
        let (acks_tx, acks) = mpsc::unbounded_channel();
        let target = PublishTarget {
            window,
            max_backoff: Duration::from_secs(1),
        };
        let task = tokio::spawn(run(
            broker.sink(),
            clock,
            target,
            tiers,
            Fence::new(0),
            entries_rx,
            acks_tx,
            crate::metrics::Metrics::new().publisher(["normal", "limited"]),
        ));
        (entries, acks, task)
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_entries_go_out_in_batches_the_window_bounds_in_outbox_order() {
        let broker = MemoryBroker::new("uploads", 1);
        let router = SharedRouter::new(Router::new(&TiersConfig::default()).unwrap());
        let (tiers, _changes) = TierRouting::new(router.clone());
        let (entries, mut acks, task) =
            spawn_publisher(&broker, TokioClock::starting_at(T0), tiers, 3);
        for seq in 1..=5 {
            entries
                .send(entry(seq, "t", &format!("s{seq}")))
                .await
                .unwrap();
        }
        // Five entries waiting, a window of three: one batch of three, then one of two.
        assert_eq!(acks.recv().await, Some(vec![1, 2, 3]));
        assert_eq!(acks.recv().await, Some(vec![4, 5]));
        drop(entries);
        task.await.unwrap();
        let keys: Vec<String> = broker.output().into_iter().map(|m| m.key).collect();
        assert_eq!(keys, ["t/s1", "t/s2", "t/s3", "t/s4", "t/s5"]);
        // Each emission was routed (counted in its tenant's rate) once.
        assert_eq!(
            router.lock().counters().routed,
            [("normal".to_owned(), 5), ("limited".to_owned(), 0)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_retried_emission_keeps_the_topic_first_chosen_and_is_counted_once() {
        let broker = MemoryBroker::new("uploads", 1);
        broker.set_sink_available(false);
        let config = TiersConfig {
            limit: 2,
            ..TiersConfig::default()
        };
        let router = SharedRouter::new(Router::new(&config).unwrap());
        let (tiers, _changes) = TierRouting::new(router.clone());
        let clock = TokioClock::starting_at(T0);
        let (entries, mut acks, task) = spawn_publisher(&broker, clock, tiers, 8);

        // `a` is routed to `normal` (1st emission of `t`) and fails: the sink is down.
        entries.send(entry(1, "t", "a")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        // Meanwhile other partitions' emissions of `t` demote it (the 3rd crosses limit 2).
        assert_eq!(router.route("t", clock.now_ms()).tier, "normal");
        let third = router.route("t", clock.now_ms());
        assert_eq!((third.tier, third.change.is_some()), ("limited", true));
        // The retry of `a` still goes to `normal`; the next emission goes to `limited`.
        broker.set_sink_available(true);
        assert_eq!(acks.recv().await, Some(vec![1]));
        entries.send(entry(2, "t", "b")).await.unwrap();
        assert_eq!(acks.recv().await, Some(vec![2]));
        drop(entries);
        task.await.unwrap();

        let out: Vec<(String, String, String)> = broker
            .output()
            .into_iter()
            .map(|m| {
                let r = codec::decode_ready(&m.payload).unwrap();
                assert_eq!(r.tier, m.tier, "record field and message agree");
                (m.key, m.topic, m.tier)
            })
            .collect();
        assert_eq!(
            out,
            [
                ("t/a".into(), "settle.ready.normal".into(), "normal".into()),
                (
                    "t/b".into(),
                    "settle.ready.limited".into(),
                    "limited".into()
                ),
            ]
        );
        // `a` was counted once although published twice (one failed attempt).
        assert_eq!(
            router.lock().counters().routed,
            [("normal".to_owned(), 2), ("limited".to_owned(), 2)]
        );
    }
}
