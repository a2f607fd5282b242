//! Timers of the runtime in paused tokio time (SEMANTICS §3): an idle partition fires on the
//! wall clock; replaying a backlog fires nothing early (the same emissions as an in-memory
//! replay, no round emitted while later uploads of it are unread); rounds that fell due
//! while the process was down are released at `catch-up-rate`, tenants in turn (each
//! tenant's in due order; `runtime_catch_up` tests the fairness itself); a revoked
//! partition is stopped before the revocation is acknowledged.

use crate::runtime_support;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use runtime_support::*;
use settle::engine::{PolicySpec, SessionKey, Upload};
use settle::runtime::PartitionState;
use settle::transport::memory::MemoryBroker;
use std::collections::BTreeSet;
use std::time::Duration;

const DELAY: i64 = 1_000;

#[tokio::test(start_paused = true)]
async fn an_idle_partition_fires_on_the_wall_clock() {
    let f = fixture(1, PolicySpec::fixed(DELAY));
    let broker = &f.broker;
    produce(broker, "acme", "s1", T0);
    let run = f.start();

    // No input arrives after the upload; only the wall clock moves.
    tokio::time::sleep(Duration::from_millis(990)).await;
    assert!(broker.output().is_empty(), "nothing before the due time");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let out = emitted(broker);
    assert_eq!(out.len(), 1, "the round fired on the wall clock");
    let (e, emitted_at) = &out[0];
    assert_eq!(e.due_at, T0 + DELAY);
    let lateness = emitted_at - e.due_at;
    assert!(
        (0..=5).contains(&lateness),
        "woke at the due time, lateness {lateness} ms"
    );
    run.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_round_due_on_a_live_partition_does_not_wait_for_the_flush_interval() {
    // A live stream keeps a flush owed all the time (one upload every 10 ms), and the flush
    // interval is 5 s: a round falling due in between must still be published soon after its
    // due time, not at the next interval flush (EMITTING_FLUSH_INTERVAL, or 10 times the last
    // real write's time: a few ms, more in a debug build on a loaded machine).
    let f = fixture(1, PolicySpec::fixed(DELAY));
    let broker = &f.broker;
    let mut o = options(f.dir.path());
    o.flush_interval = Duration::from_secs(5);
    let run = f.start_with(o);
    produce(broker, "acme", "s1", T0);
    for i in 1..=150 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        produce(broker, "acme", "busy", T0 + 10 * i);
    }
    let out = emitted(broker);
    assert_eq!(out.len(), 1, "only s1's round was due: {out:?}");
    let (e, emitted_at) = &out[0];
    assert_eq!((e.key.session(), e.due_at), ("s1", T0 + DELAY));
    let lateness = emitted_at - e.due_at;
    assert!(
        (0..=200).contains(&lateness),
        "published {lateness} ms after its due time with a 5 s flush interval"
    );
    run.stop().await;
}

/// A backlog of `sessions` keys over 60 s of event time, several rounds per key (gaps longer
/// than the delay now and then), sorted by event time.
fn backlog(seed: u64, sessions: usize, start: i64) -> Vec<Upload> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut uploads = Vec::new();
    for s in 0..sessions {
        let key = SessionKey::new(&format!("tenant-{}", s % 5), &format!("s{s}"));
        let mut t = start + rng.random_range(0..5_000);
        while t < start + 60_000 {
            uploads.push(Upload::plain(key.clone(), t));
            t += if rng.random_bool(0.2) {
                rng.random_range(1_500..4_000)
            } else {
                rng.random_range(1..900)
            };
        }
    }
    uploads.sort_by_key(|u| u.event_time);
    uploads
}

fn produce_all(broker: &MemoryBroker, uploads: &[Upload]) {
    for u in uploads {
        produce(broker, u.key.tenant(), u.key.session(), u.event_time);
    }
}

#[tokio::test(start_paused = true)]
async fn catching_up_on_a_backlog_fires_nothing_early() {
    let f = fixture(2, PolicySpec::fixed(DELAY));
    // The backlog's event time ends an hour before the wall clock.
    let uploads = backlog(1, 40, T0 - 3_600_000);
    produce_all(&f.broker, &uploads);
    let mut opts = options(f.dir.path());
    opts.batch_size = 7; // many batches: rounds fall due between and inside batches
    let run = f.start_with(opts);
    run.until(|m| all(m, 2, |s| s.is_idle())).await;
    run.stop().await;

    let got: Vec<_> = emitted(&f.broker).into_iter().map(|(e, _)| e).collect();
    let want = reference(&f.engine, &uploads);
    assert!(
        want.len() > 80,
        "the backlog has many rounds ({})",
        want.len()
    );
    assert_eq!(
        by_id(got.clone()),
        by_id(want),
        "same emissions as an in-memory replay"
    );
    // Nothing early: every upload of a key before an emission's due time is in it or earlier.
    for e in &got {
        let unread_before_due = uploads
            .iter()
            .filter(|u| {
                u.key == e.key && u.event_time > e.last_upload_at && u.event_time < e.due_at
            })
            .count();
        assert_eq!(
            unread_before_due,
            0,
            "{} fired with later uploads unread",
            e.emission_id()
        );
    }
}

#[tokio::test(start_paused = true)]
async fn rounds_due_while_down_are_released_at_the_catch_up_rate() {
    let f = fixture(1, PolicySpec::fixed(DELAY));
    let broker = &f.broker;
    let mut rng = StdRng::seed_from_u64(3);
    let mut uploads: Vec<(String, String, i64)> = (0..200)
        .map(|s| {
            (
                format!("tenant-{}", s % 4),
                format!("s{s}"),
                T0 + rng.random_range(0..500),
            )
        })
        .collect();
    uploads.sort_by_key(|u| u.2);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (t, s, ts) in &uploads {
        produce(broker, t, s, *ts);
    }
    f.run_until(|m| all(m, 1, |s| s.next_offset == Some(200)))
        .await;
    assert!(broker.output().is_empty());

    // Down for an hour: every round falls due meanwhile.
    tokio::time::advance(Duration::from_secs(3_600)).await;
    let mut opts = options(f.dir.path());
    opts.catch_up_rate = 100;
    let run = f.start_with(opts);
    run.until(|m| all(m, 1, |s| s.is_idle())).await;
    run.stop().await;

    let out = emitted(broker);
    assert_eq!(out.len(), 200);
    let first = out.iter().map(|(_, at)| *at).min().unwrap();
    let last = out.iter().map(|(_, at)| *at).max().unwrap();
    // 200 emissions at 100/s with a burst of 10: about 1.9 s, not one burst.
    assert!(
        (1_800..=2_200).contains(&(last - first)),
        "released over {} ms",
        last - first
    );
    let in_first_100ms = out.iter().filter(|(_, at)| *at < first + 100).count();
    assert!(in_first_100ms <= 21, "{in_first_100ms} in the first 100 ms");
    // Released tenants in turn, each tenant's in due order: the first 20 span every tenant.
    for tenant in ["tenant-0", "tenant-1", "tenant-2", "tenant-3"] {
        let dues: Vec<i64> = out
            .iter()
            .filter(|(e, _)| e.key.tenant() == tenant)
            .map(|(e, _)| e.due_at)
            .collect();
        assert_eq!(dues.len(), 50);
        assert!(dues.windows(2).all(|w| w[0] <= w[1]), "{tenant}: due order");
    }
    let tenants: BTreeSet<&str> = out[..20].iter().map(|(e, _)| e.key.tenant()).collect();
    assert_eq!(tenants.len(), 4, "{tenants:?}");
}

#[tokio::test(start_paused = true)]
async fn a_live_round_late_after_a_stall_is_not_held_to_the_catch_up_rate() {
    let f = fixture(1, PolicySpec::fixed(DELAY));
    let broker = &f.broker;
    let mut opts = options(f.dir.path());
    opts.catch_up_rate = 10;
    let run = f.start_with(opts);
    tokio::time::sleep(Duration::from_millis(100)).await;
    for s in 0..200 {
        produce(broker, "acme", &format!("s{s}"), T0 + 100);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(broker.output().is_empty(), "nothing due yet");
    // The process stalls (its threads paused) past every round's due time: the rounds are
    // 4 s late when it goes on, but they fell due while the partition was owned here, so
    // they are not paced like rounds that fell due while it was down (10/s: 20 s).
    tokio::time::advance(Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let out = emitted(broker);
    assert_eq!(out.len(), 200, "every late round out at once, not at 10/s");
    run.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_revoked_partition_stops_before_the_revocation_is_acknowledged() {
    let f = fixture(2, PolicySpec::fixed(DELAY));
    let broker = &f.broker;
    let (p_a, _) = produce(broker, "acme", "a", T0);
    let key_b = (0..100)
        .map(|i| format!("b{i}"))
        .find(|s| {
            settle::transport::memory::partition_for_key(format!("acme/{s}").as_bytes(), 2) != p_a
        })
        .unwrap();
    produce(broker, "acme", &key_b, T0);
    let run = f.start();
    run.until(|m| all(m, 2, |s| s.next_offset == Some(1))).await;

    broker
        .revoke(GROUP, &[p_a])
        .await
        .expect("revocation acknowledged");
    let st = run.status.snapshot();
    assert_eq!(
        st[&p_a].state,
        PartitionState::Stopped,
        "stopped before done"
    );
    // Its store is closed: it opens (RocksDB would refuse a second open while locked).
    drop(f.store(p_a));
    // The other partition keeps working; its round fires.
    run.until(|m| m.get(&(1 - p_a)).is_some_and(|s| s.published == 1))
        .await;

    // Assigned back: it resumes from its store and fires its round.
    broker.assign(GROUP, &[p_a]);
    run.until(|m| m.get(&p_a).is_some_and(|s| s.published == 1 && s.is_idle()))
        .await;
    run.stop().await;
    let ids: BTreeSet<String> = emitted(broker)
        .iter()
        .map(|(e, _)| e.emission_id())
        .collect();
    assert_eq!(
        ids,
        BTreeSet::from([format!("acme/a/{T0}/1"), format!("acme/{key_b}/{T0}/1")])
    );
}
