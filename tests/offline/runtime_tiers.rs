//! Tiers in the running system (SEMANTICS §5): the real runtime on RocksDB and the memory
//! transport, in paused tokio time. A noisy tenant's emissions go to the `limited` topic once
//! it crosses the limit (none is dropped), the change is published on the tier-events topic
//! and shown in `<data-dir>/tiers.json` and `settle inspect`; the sweep promotes it back when
//! it goes quiet; a tenant spread over 10 000 sessions is demoted exactly like one over 10.

use crate::runtime_support;

use runtime_support::*;
use settle::cli::inspect::{self, InspectArgs};
use settle::engine::{Millis, PolicySpec};
use settle::runtime::{read_snapshot, Clock, RuntimeOptions, StatusMap, TokioClock};
use settle::tiers::{ChangeReason, TierChange, TiersConfig};
use settle::transport::memory::MemoryBroker;
use settle::transport::ReadyMessage;
use std::path::Path;
use std::time::Duration;

const DELAY: Millis = 1_000;
const NORMAL: &str = "settle.ready.normal";
const LIMITED: &str = "settle.ready.limited";
const EVENTS: &str = "settle.tier-events";

/// Test options with tier rule `limit` per `period_ms`, recovery below half, `cooldown_ms`.
fn tier_options(dir: &Path, limit: u64, period_ms: u64, cooldown_ms: u64) -> RuntimeOptions {
    let mut o = options(dir);
    o.tiers = TiersConfig {
        limit,
        period: Duration::from_millis(period_ms),
        recover_ratio: 0.5,
        cooldown: Duration::from_millis(cooldown_ms),
        ..TiersConfig::default()
    };
    o
}

fn published(m: &StatusMap) -> u64 {
    m.values().map(|s| s.published).sum()
}

/// Waits (paused time: instantly in wall time) until the broker holds `n` tier events.
async fn tier_events(broker: &MemoryBroker, n: usize) -> Vec<ReadyMessage> {
    for _ in 0..600 {
        if broker.tier_events().len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    broker.tier_events()
}

fn change(m: &ReadyMessage) -> TierChange {
    serde_json::from_slice(&m.payload).expect("a tier-change record")
}

/// Ready records of `tenant` per topic `(normal, limited)`, checking that each record's
/// `tier` field, its message tier and its topic agree.
fn by_topic(broker: &MemoryBroker, tenant: &str) -> (usize, usize) {
    let mut counts = (0, 0);
    for m in broker.output() {
        let r = settle::codec::decode_ready(&m.payload).expect("ready record");
        if r.tenant != tenant {
            continue;
        }
        assert_eq!(r.tier, m.tier);
        match (m.topic.as_str(), m.tier.as_str()) {
            (NORMAL, "normal") => counts.0 += 1,
            (LIMITED, "limited") => counts.1 += 1,
            other => panic!("unexpected topic/tier {other:?}"),
        }
    }
    counts
}

#[tokio::test(start_paused = true)]
async fn a_noisy_tenant_goes_to_limited_its_change_is_published_and_it_recovers() {
    let f = fixture(4, PolicySpec::fixed(DELAY));
    let broker = &f.broker;
    for s in 0..20 {
        produce(broker, "noisy", &format!("s{s}"), T0);
    }
    for s in 0..3 {
        produce(broker, "quiet", &format!("s{s}"), T0);
    }
    // Limit 5 per 10 s, recovery below 3 for 5 s.
    let run = f.start_with(tier_options(f.dir.path(), 5, 10_000, 5_000));
    run.until(|m| published(m) == 23).await;

    // Every emission went out; the first 5 of `noisy` on the normal topic, the rest limited.
    assert_eq!(broker.output().len(), 23);
    assert_eq!(by_topic(broker, "noisy"), (5, 15));
    assert_eq!(by_topic(broker, "quiet"), (3, 0));

    let events = tier_events(broker, 1).await;
    assert_eq!(events.len(), 1);
    assert_eq!(
        (events[0].topic.as_str(), events[0].key.as_str()),
        (EVENTS, "noisy")
    );
    let demoted = change(&events[0]);
    assert_eq!(
        (
            demoted.from.as_str(),
            demoted.to.as_str(),
            demoted.rate,
            demoted.limit,
            demoted.reason
        ),
        ("normal", "limited", 6, 5, ChangeReason::RateExceeded)
    );
    assert!(demoted.at >= T0 + DELAY);

    let snap = read_snapshot(f.dir.path())
        .expect("readable")
        .expect("tiers.json written");
    assert_eq!(snap.demoted.len(), 1);
    assert_eq!(snap.demoted[0].tenant, "noisy");
    assert_eq!(snap.recent_changes, vec![demoted.clone()]);
    assert_eq!((snap.counters.demotions, snap.counters.recoveries), (1, 0));
    assert_eq!(
        snap.counters.routed,
        vec![("normal".to_owned(), 8), ("limited".to_owned(), 15)]
    );

    // Quiet from now on: the sweep promotes it once the burst has left the 10 s window and
    // 5 s of cooldown passed, without any new emission.
    let events = tier_events(broker, 2).await;
    assert_eq!(events.len(), 2);
    let recovered = change(&events[1]);
    assert_eq!(
        (
            recovered.tenant.as_str(),
            recovered.from.as_str(),
            recovered.to.as_str(),
            recovered.reason
        ),
        ("noisy", "limited", "normal", ChangeReason::Recovered)
    );
    assert!(recovered.at >= demoted.at + 10_000 + 5_000);
    let snap = read_snapshot(f.dir.path()).unwrap().unwrap();
    assert!(snap.demoted.is_empty());
    assert_eq!(snap.recent_changes, vec![demoted, recovered]);

    // Its next emission is on the normal topic again.
    produce(broker, "noisy", "late", f.clock.now_ms());
    run.until(|m| published(m) == 24).await;
    assert_eq!(by_topic(broker, "noisy"), (6, 15));
    run.stop().await;

    // `settle inspect --data-dir` shows the tier state next to the stores.
    let mut out = Vec::new();
    inspect::run(InspectArgs::new(f.dir.path().to_path_buf()), &mut out).expect("inspect");
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("tiers  ("), "{text}");
    assert!(
        text.contains("noisy normal -> limited · rate 6/5 · rate_exceeded"),
        "{text}"
    );
    assert!(text.contains("noisy limited -> normal"), "{text}");
    assert!(
        text.contains("routed          normal 9 · limited 15"),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_tenant_over_10_000_sessions_is_demoted_like_one_over_10() {
    let mut f = fixture(4, PolicySpec::fixed(DELAY));
    // The uploads are a backlog: the wall clock starts after all of them.
    f.clock = TokioClock::starting_at(T0 + 100_000);
    let broker = &f.broker;
    // `wide`: 10 000 sessions, one round each.
    for s in 0..10_000 {
        produce(broker, "wide", &format!("s{s}"), T0);
    }
    // `narrow`: 10 sessions, 30 rounds each (uploads 2 s apart, delay 1 s).
    for r in 0..30 {
        for s in 0..10 {
            produce(broker, "narrow", &format!("s{s}"), T0 + r * 2_000);
        }
    }
    // Limit 100 per minute; no recovery within the test.
    let run = f.start_with(tier_options(f.dir.path(), 100, 60_000, 3_600_000));
    run.until(|m| published(m) == 10_300).await;

    assert_eq!(by_topic(broker, "wide"), (100, 9_900));
    assert_eq!(by_topic(broker, "narrow"), (100, 200));
    let events = tier_events(broker, 2).await;
    let mut changes: Vec<TierChange> = events.iter().map(change).collect();
    changes.sort_by(|a, b| a.tenant.cmp(&b.tenant));
    for (c, tenant) in changes.iter().zip(["narrow", "wide"]) {
        assert_eq!(
            (c.tenant.as_str(), c.rate, c.limit, c.reason),
            (tenant, 101, 100, ChangeReason::RateExceeded)
        );
    }
    assert_eq!(changes.len(), 2);
    run.stop().await;
}
