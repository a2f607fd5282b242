//! Restart and failure behaviour of the runtime on real RocksDB (temp dir) and the memory
//! transport, in paused tokio time: state, timers, outbox and offset survive a restart; a
//! crash between "emission durable" and "sink acked" re-publishes the same `emission_id`
//! exactly once more; a batch that fails to write leaves the stored offset unchanged and
//! stops the partition (SEMANTICS §6).

use crate::runtime_support;

use runtime_support::*;
use settle::engine::{Emission, PolicySpec, SessionKey, Trigger};
use settle::runtime::{
    partition, Clock, PartitionContext, PartitionExit, PartitionSettings, PartitionState,
    PublishTarget, StatusBoard, TierRouting,
};
use settle::tiers::{Router, SharedRouter, TiersConfig};
use settle::transport::{Source, SourceEvent};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const DELAY: i64 = 1_000;

#[tokio::test(start_paused = true)]
async fn state_timers_outbox_and_offset_survive_a_restart() {
    let f = fixture(1, PolicySpec::fixed(DELAY));
    let broker = &f.broker;
    produce(broker, "acme", "s1", T0);
    produce(broker, "acme", "s2", T0);

    // Run 1: both uploads applied, nothing due yet.
    let summary = f
        .run_until(|m| all(m, 1, |s| s.next_offset == Some(2)))
        .await;
    assert_eq!(
        summary.partitions[&0],
        PartitionExit::Stopped { flushed: true }
    );
    assert!(
        broker.output().is_empty(),
        "nothing is due before {DELAY} ms"
    );
    {
        let store = f.store(0);
        assert_eq!(store.stored_offset(), Some(2));
        assert_eq!(store.pending_rounds(), 2);
        let timers = store.timers(10).unwrap();
        assert_eq!(
            timers,
            vec![
                (T0 + DELAY, SessionKey::new("acme", "s1")),
                (T0 + DELAY, SessionKey::new("acme", "s2")),
            ]
        );
        let s1 = store
            .session(&SessionKey::new("acme", "s1"))
            .unwrap()
            .unwrap();
        assert_eq!(s1.round.as_ref().map(|r| r.uploads), Some(1));
    }

    // Run 2: the sink is down. The re-armed timers fire; emissions wait in the outbox.
    broker.set_sink_available(false);
    let summary = f
        .run_until(|m| all(m, 1, |s| s.outbox_len == 2 && s.pending_rounds == 0))
        .await;
    assert_eq!(
        summary.partitions[&0],
        PartitionExit::Stopped { flushed: false }
    );
    assert!(broker.output().is_empty());
    {
        let mut store = f.store(0);
        assert_eq!(store.outbox_len(), 2);
        assert_eq!(
            store.stored_offset(),
            Some(2),
            "no new input: offset unchanged"
        );
        let owed: Vec<String> = store
            .outbox_peek(10)
            .unwrap()
            .iter()
            .map(|e| e.emission.emission_id())
            .collect();
        assert_eq!(owed, [format!("acme/s1/{T0}/1"), format!("acme/s2/{T0}/1")]);
    }

    // Run 3: the sink is back; the outbox is re-published and emptied.
    broker.set_sink_available(true);
    f.run_until(|m| all(m, 1, |s| s.outbox_len == 0 && s.published == 2))
        .await;
    let out = emitted(broker);
    let ids: Vec<String> = out.iter().map(|(e, _)| e.emission_id()).collect();
    assert_eq!(ids, [format!("acme/s1/{T0}/1"), format!("acme/s2/{T0}/1")]);
    for (e, _) in &out {
        assert_eq!(e.due_at, T0 + DELAY);
        assert_eq!(e.uploads, 1);
    }
    assert_eq!(broker.committed(GROUP, 0), Some(2));
    let store = f.store(0);
    assert_eq!(store.outbox_len(), 0);
    assert_eq!(store.stored_offset(), Some(2));

    // A later upload continues the key's state: generation 2, not a fresh key.
    drop(store);
    produce(broker, "acme", "s1", f.clock.now_ms());
    f.run_until(|m| all(m, 1, |s| s.published == 1 && s.is_idle()))
        .await;
    let last = emitted(broker).pop().unwrap().0;
    assert_eq!(last.emission_id(), format!("acme/s1/{T0}/2"));
}

#[tokio::test(start_paused = true)]
async fn crash_between_durable_and_acked_republishes_the_same_id_once_more() {
    let f = fixture(2, PolicySpec::fixed(DELAY));
    let broker = &f.broker;
    for s in ["a", "b", "c", "d"] {
        produce(broker, "acme", s, T0);
    }

    // The broker stores each record but its acks are lost; then the process stops.
    broker.lose_acks();
    let run = f.start();
    run.until(|m| {
        all(m, 2, |s| s.pending_rounds == 0 && s.caught_up)
            && m.values().map(|s| s.emissions).sum::<u64>() == 4
    })
    .await;
    // Every emission reached the broker once; none was acknowledged.
    while broker.output_len() < 4 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    run.stop().await;
    let mut owed = 0;
    for p in 0..2 {
        owed += f.store(p).outbox_len();
    }
    assert_eq!(owed, 4, "unacknowledged emissions stay in the outbox");

    // Restart: the outbox is published again, same ids, then deleted.
    broker.set_sink_available(true);
    for _ in 0..2 {
        f.run_until(|m| all(m, 2, |s| s.is_idle())).await;
    }
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for (e, _) in emitted(broker) {
        *count.entry(e.emission_id()).or_default() += 1;
    }
    let expected: BTreeMap<String, usize> = ["a", "b", "c", "d"]
        .iter()
        .map(|s| (format!("acme/{s}/{T0}/1"), 2))
        .collect();
    assert_eq!(
        count, expected,
        "each id exactly twice: once lost-ack, once re-published"
    );
}

#[tokio::test(start_paused = true)]
async fn a_batch_that_fails_to_write_keeps_the_offset_and_stops_the_partition() {
    let f = fixture(1, PolicySpec::fixed(DELAY));
    let broker = &f.broker;
    produce(broker, "acme", "s1", T0);
    produce(broker, "acme", "s2", T0);
    f.run_until(|m| all(m, 1, |s| s.next_offset == Some(2)))
        .await;

    // Two more uploads; the next store commit fails.
    produce(broker, "acme", "s3", T0);
    produce(broker, "acme", "s1", T0 + 10);
    let mut store = f.store(0);
    store.fail_next_commits(1);
    let status = StatusBoard::new();
    let router = SharedRouter::new(Router::new(&TiersConfig::default()).unwrap());
    let (tiers, _changes) = TierRouting::new(router);
    let ctx = PartitionContext {
        rules: settle::runtime::Rules::new(f.engine.clone()),
        sink: broker.sink(),
        clock: f.clock,
        tiers,
        settings: Arc::new(PartitionSettings {
            batch_size: 100,
            idle_tick: Duration::from_millis(100),
            flush_timeout: Duration::from_secs(1),
            publish: PublishTarget {
                window: 16,
                max_backoff: Duration::from_secs(1),
            },
            catch_up_rate: 0,
            flush_interval: Duration::from_millis(20),
            flush_max_dirty: 20_000,
        }),
        status: status.clone(),
        metrics: settle::metrics::Metrics::new(),
        sessions: settle::runtime::SessionLookup::new(),
        actions: settle::runtime::ActionLog::default(),
        shadows: settle::runtime::ShadowBoard::default(),
    };
    let mut source = broker.source("other-group");
    let Some(SourceEvent::Assigned(mut inputs)) = source.next_event().await.unwrap() else {
        panic!("memory source assigns at start");
    };
    let input = inputs.pop().unwrap();
    let exit = tokio::time::timeout(
        Duration::from_secs(60),
        partition::run(
            ctx,
            store,
            input,
            settle::runtime::Fence::new(0),
            None,
            CancellationToken::new(),
        ),
    )
    .await
    .expect("a failed partition stops by itself");
    let PartitionExit::Failed(reason) = exit else {
        panic!("expected a failure, got {exit:?}");
    };
    assert!(reason.contains("injected fault"), "{reason}");
    let st = &status.snapshot()[&0];
    assert!(matches!(&st.state, PartitionState::Failed(r) if r.contains("injected fault")));

    let store = f.store(0);
    assert_eq!(
        store.stored_offset(),
        Some(2),
        "the failed batch stored nothing"
    );
    assert_eq!(store.pending_rounds(), 2);
    assert!(store
        .session(&SessionKey::new("acme", "s3"))
        .unwrap()
        .is_none());
    assert_eq!(
        broker.committed("other-group", 0),
        None,
        "nothing committed to the source"
    );
    assert!(broker.output().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_sink_outage_delays_emissions_but_loses_none() {
    let f = fixture(1, PolicySpec::fixed(DELAY));
    produce(&f.broker, "acme", "s1", T0);
    f.broker.fail_publishes_for(Duration::from_secs(5));
    f.run_until(|m| all(m, 1, |s| s.published == 1 && s.is_idle()))
        .await;
    let out = emitted(&f.broker);
    assert_eq!(out.len(), 1, "published once, after the outage");
    let (e, emitted_at) = &out[0];
    assert_eq!(e.due_at, T0 + DELAY);
    assert!(
        *emitted_at >= T0 + 5_000,
        "sent after the outage ({emitted_at})"
    );
    assert!(*emitted_at <= T0 + 10_000, "retried with a bounded backoff");
}

/// Log lines written while the guard lives on this thread (a current-thread tokio test runs
/// its tasks here), as text.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[tokio::test(start_paused = true)]
async fn a_restart_with_other_rules_applies_them_from_each_rounds_next_upload() {
    // Issue "hours, not minutes" #2-#4, SEMANTICS §7. Config A: fixed 30 s, max-wait 20 s.
    // Config C: adaptive 2 s..10 s, no max-wait. Same data dir, a restart in between.
    let logs = Captured::default();
    let writer = logs.clone();
    let _guard = tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish(),
    );
    let a = PolicySpec::fixed(30_000).with_max_wait(20_000);
    let c = PolicySpec::adaptive(2_000, 10_000);
    let f = fixture(1, a);
    let broker = &f.broker;
    let tick = Duration::from_millis(1_500);

    // Run 1 under A: "busy" uploads every 1.5 s for 25.5 s; "quiet" uploads once at 24 s.
    let run = f.start();
    for i in 0..18 {
        produce(broker, "acme", "busy", f.clock.now_ms());
        if i == 16 {
            produce(broker, "acme", "quiet", f.clock.now_ms());
        }
        tokio::time::sleep(tick).await;
    }
    run.until(|m| all(m, 1, |s| s.next_offset == Some(19) && s.published == 1))
        .await;
    run.stop().await;
    let first = emitted(broker);
    assert_eq!(first.len(), 1, "A's max-wait cut busy's round at 20 s");
    assert_eq!(
        (first[0].0.trigger, first[0].0.due_at),
        (Trigger::MaxWait, T0 + 20_000)
    );

    // Run 2 under C: busy keeps uploading every 1.5 s for 60 s, quiet uploads no more.
    let run = start(broker, engine(c), options(f.dir.path()), f.clock);
    for _ in 0..40 {
        produce(broker, "acme", "busy", f.clock.now_ms());
        tokio::time::sleep(tick).await;
    }
    let last_busy = f.clock.now_ms() - tick.as_millis() as i64;
    tokio::time::sleep(Duration::from_secs(15)).await;
    run.until(|m| all(m, 1, |s| s.pending_rounds == 0 && s.outbox_len == 0))
        .await;
    run.stop().await;
    let second: Vec<Emission> = emitted(broker)
        .into_iter()
        .skip(1)
        .map(|(e, _)| e)
        .collect();
    let summary: Vec<(String, Trigger, &str, i64)> = second
        .iter()
        .map(|e| {
            (
                e.key.session().to_owned(),
                e.trigger,
                e.policy.as_str(),
                e.delay_ms,
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            // quiet had no upload after the restart: A's rule timed it (24 s + max-wait 20 s).
            ("quiet".to_owned(), Trigger::MaxWait, "fixed", 30_000),
            // busy's round (open since A's cut at 20 s) was timed by C from its next upload
            // on: no max-wait, adaptive's 2 s after its last upload.
            ("busy".to_owned(), Trigger::Trailing, "adaptive", 2_000),
        ],
        "{second:#?}"
    );
    assert_eq!(second[0].due_at, T0 + 24_000 + 20_000);
    assert_eq!(second[1].due_at, last_busy + 2_000);
    assert_eq!(
        second[1].uploads,
        4 + 40,
        "busy's round since 20 s, all of it"
    );

    // The start-up logs of run 2 say what changed: one partition, two pending rounds timed
    // under A's rule.
    let text = logs.text();
    let line = text
        .lines()
        .find(|l| l.contains("pending rounds were timed under other debounce rules"))
        .unwrap_or_else(|| panic!("no rules line in:\n{text}"));
    for field in [
        "partition=0",
        "pending_rounds=2",
        "timed_under_other_rules=2",
        "by_policy=fixed: 2",
        "without_recorded_rule=0",
        "rules=adaptive min-delay=2s max-delay=10s max-wait=off",
    ] {
        assert!(line.contains(field), "{field} missing in: {line}");
    }
    assert_eq!(
        text.matches("pending rounds were timed under other debounce rules")
            .count(),
        1,
        "run 1 found its store new, run 2 once"
    );
}
