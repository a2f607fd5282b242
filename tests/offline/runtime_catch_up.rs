//! Tenant-fair catch-up of the runtime (SEMANTICS §3) on real RocksDB and the memory
//! transport, in paused tokio time: rounds that fell due while the processor was down are
//! released tenants in turn, so a tenant with a few overdue rounds is not held back behind
//! another tenant's thousands; each session's rounds still come out in its own order, and
//! none is lost or doubled.

use crate::runtime_support;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use runtime_support::*;
use settle::engine::{PolicySpec, SessionKey, Upload};
use settle::runtime::StatusMap;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// Every partition of `broker` has applied its whole input.
fn applied_all(m: &StatusMap, ends: &[i64]) -> bool {
    ends.iter().enumerate().all(|(p, end)| {
        m.get(&(p as i32))
            .is_some_and(|s| s.next_offset == Some(*end))
    })
}

#[tokio::test(start_paused = true)]
async fn a_tenants_few_overdue_rounds_are_not_held_back_by_anothers_thousands() {
    // Long enough that nothing falls due while the first run applies the uploads.
    const DELAY: i64 = 10_000;
    const PARTITIONS: i32 = 2;
    let f = fixture(PARTITIONS, PolicySpec::fixed(DELAY));
    let broker = &f.broker;
    // 10 000 rounds of tenant a and 100 of tenant b, due times interleaved over 500 ms
    // (b's every 5 ms among a's 20 per ms), spread over both partitions.
    let mut uploads: Vec<(String, String, i64)> = (0..10_000)
        .map(|i| ("a".to_owned(), format!("s{i}"), T0 + i / 20))
        .chain((0..100).map(|j| ("b".to_owned(), format!("s{j}"), T0 + j * 5 + 2)))
        .collect();
    uploads.sort_by_key(|u| u.2);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (t, s, ts) in &uploads {
        produce(broker, t, s, *ts);
    }
    let ends: Vec<i64> = (0..PARTITIONS).map(|p| broker.end_offset(p)).collect();
    for p in 0..PARTITIONS {
        let keys: BTreeSet<String> = uploads
            .iter()
            .filter(|(t, s, _)| {
                settle::transport::memory::partition_for_key(
                    format!("{t}/{s}").as_bytes(),
                    PARTITIONS,
                ) == p
            })
            .map(|(t, _, _)| t.clone())
            .collect();
        assert_eq!(keys.len(), 2, "partition {p} holds both tenants");
    }
    f.run_until(|m| applied_all(m, &ends)).await;
    assert!(broker.output().is_empty(), "nothing due before the stop");

    // Down for an hour: every round falls due meanwhile.
    tokio::time::advance(Duration::from_secs(3_600)).await;
    let mut opts = options(f.dir.path());
    opts.catch_up_rate = 5_000;
    let run = f.start_with(opts);
    run.until(|m| all(m, PARTITIONS, |s| s.is_idle())).await;
    run.stop().await;

    let out = emitted(broker);
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for (e, _) in &out {
        *count.entry(e.emission_id()).or_default() += 1;
    }
    assert_eq!(count.len(), 10_100, "every round released");
    assert!(count.values().all(|&n| n == 1), "each emission id once");
    let keys: BTreeSet<String> = out.iter().map(|(e, _)| e.key.to_string()).collect();
    let want: BTreeSet<String> = uploads.iter().map(|(t, s, _)| format!("{t}/{s}")).collect();
    assert_eq!(keys, want);

    // Release order: b's rounds come among the first few hundred, not after a's thousands.
    let b_positions: Vec<usize> = out
        .iter()
        .enumerate()
        .filter(|(_, (e, _))| e.key.tenant() == "b")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(b_positions.len(), 100);
    let last_b = *b_positions.last().unwrap();
    assert!(
        last_b < 300,
        "b's last round came out {}th of {}",
        last_b + 1,
        out.len()
    );
    // And each tenant's own rounds come out in due order within its partition.
    for p in 0..PARTITIONS {
        for tenant in ["a", "b"] {
            let dues: Vec<i64> = out
                .iter()
                .filter(|(e, _)| {
                    e.key.tenant() == tenant
                        && settle::transport::memory::partition_for_key(
                            e.key.as_str().as_bytes(),
                            PARTITIONS,
                        ) == p
                })
                .map(|(e, _)| e.due_at)
                .collect();
            assert!(
                dues.windows(2).all(|w| w[0] <= w[1]),
                "{tenant} in partition {p}: due order"
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn overdue_rounds_keep_each_sessions_order_and_none_is_lost() {
    const DELAY: i64 = 1_000;
    let f = fixture(2, PolicySpec::fixed(DELAY));
    let broker = &f.broker;
    let mut rng = StdRng::seed_from_u64(7);
    let keys: Vec<SessionKey> = (0..60)
        .map(|s| SessionKey::new("big", &format!("s{s}")))
        .chain((0..4).map(|s| SessionKey::new("small", &format!("s{s}"))))
        .collect();

    // Run 1: one upload per session; its round is pending at the stop.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut first: Vec<Upload> = keys
        .iter()
        .map(|k| Upload::plain(k.clone(), T0 + rng.random_range(0..500)))
        .collect();
    first.sort_by_key(|u| u.event_time);
    for u in &first {
        produce(broker, u.key.tenant(), u.key.session(), u.event_time);
    }
    let ends: Vec<i64> = (0..2).map(|p| broker.end_offset(p)).collect();
    f.run_until(|m| applied_all(m, &ends)).await;
    assert!(broker.output().is_empty());

    // Down for an hour; meanwhile each session uploads again, several rounds each (gaps
    // longer than the delay now and then). Everything is overdue at the restart: the
    // pending rounds at once, the backlog's rounds as its replay passes them.
    tokio::time::advance(Duration::from_secs(3_600)).await;
    let mut later = Vec::new();
    for k in &keys {
        let mut t = T0 + 2_000 + rng.random_range(0..2_000);
        while t < T0 + 40_000 {
            later.push(Upload::plain(k.clone(), t));
            t += if rng.random_bool(0.3) {
                rng.random_range(1_500..4_000)
            } else {
                rng.random_range(1..900)
            };
        }
    }
    later.sort_by_key(|u| u.event_time);
    for u in &later {
        produce(broker, u.key.tenant(), u.key.session(), u.event_time);
    }
    let mut opts = options(f.dir.path());
    opts.catch_up_rate = 5_000;
    opts.batch_size = 7; // many batches: rounds fall due between and inside batches
    let run = f.start_with(opts);
    run.until(|m| all(m, 2, |s| s.is_idle())).await;
    run.stop().await;

    let got: Vec<_> = emitted(broker).into_iter().map(|(e, _)| e).collect();
    let all_uploads: Vec<Upload> = first.iter().chain(&later).cloned().collect();
    let want = reference(&f.engine, &all_uploads);
    assert!(
        want.len() > 3 * keys.len(),
        "several rounds per session ({})",
        want.len()
    );
    let ids: BTreeSet<String> = got.iter().map(|e| e.emission_id()).collect();
    assert_eq!(ids.len(), got.len(), "no emission id twice");
    assert_eq!(
        by_id(got.clone()),
        by_id(want),
        "the same emissions as an in-memory replay: none lost, none changed"
    );
    // Each session's rounds come out in its own order.
    let mut last: BTreeMap<&SessionKey, (i64, u64)> = BTreeMap::new();
    for e in &got {
        let round = (e.state_created_at, e.generation);
        if let Some(prev) = last.insert(&e.key, round) {
            assert!(prev < round, "{}: round {round:?} after {prev:?}", e.key);
        }
    }
    assert_eq!(last.len(), keys.len());
}
