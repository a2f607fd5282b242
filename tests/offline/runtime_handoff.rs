//! State handoff between two runtimes (two "instances" with their own data dirs) through the
//! changelog, on the memory transport in paused tokio time: a new owner restores pending
//! rounds, the outbox and the input offset; a lost partition is fenced at once; a dirty store
//! is kept unless another writer appended to the changelog (then wiped and restored); a clean
//! restart reads nothing.

use crate::runtime_support;

use runtime_support::*;
use settle::engine::{Driver, Emission, PolicySpec, SessionKey, Upload};
use settle::runtime::{Clock, PartitionState, Runtime};
use settle::store::{changelog_key, partition_path, Change, PartitionStore, StoreOptions};
use settle::transport::memory::MemoryBroker;
use settle::transport::Sink;
use std::collections::BTreeMap;
use std::path::Path;
use tokio_util::sync::CancellationToken;

const DELAY: i64 = 10_000;

/// Produces one upload for each of `sessions` sessions of tenant `acme` at the clock's now;
/// returns the uploads (for the reference replay).
fn produce_sessions(f: &Fixture, sessions: usize, tag: &str) -> Vec<Upload> {
    let now = f.clock.now_ms();
    (0..sessions)
        .map(|i| {
            let s = format!("{tag}{i}");
            produce(&f.broker, "acme", &s, now);
            Upload::plain(settle::engine::SessionKey::new("acme", &s), now)
        })
        .collect()
}

/// Count of each emission id in the broker's output.
fn id_counts(broker: &MemoryBroker) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for (e, _) in emitted(broker) {
        *counts.entry(e.emission_id()).or_insert(0) += 1;
    }
    counts
}

fn ids(emissions: &[Emission]) -> Vec<String> {
    let mut v: Vec<String> = emissions.iter().map(Emission::emission_id).collect();
    v.sort();
    v
}

fn applied_all(
    broker: &MemoryBroker,
    partitions: i32,
) -> impl Fn(&settle::runtime::StatusMap) -> bool + '_ {
    move |m| {
        (0..partitions).all(|p| {
            m.get(&p)
                .is_some_and(|s| s.next_offset == Some(broker.end_offset(p)))
        })
    }
}

#[tokio::test(start_paused = true)]
async fn a_new_owner_restores_pending_rounds_and_the_offset_from_the_changelog() {
    let f = fixture(2, PolicySpec::fixed(DELAY));
    f.broker.enable_changelog();
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let uploads = produce_sessions(&f, 40, "s");

    let a = f.start_member("a", dir_a.path(), &[0, 1]);
    a.until(applied_all(&f.broker, 2)).await;
    assert!(
        f.broker.output().is_empty(),
        "nothing is due before {DELAY} ms"
    );
    // A hands both partitions back (cooperative rebalance).
    f.broker.revoke("a", &[0, 1]).await.unwrap();
    for p in 0..2 {
        assert!(
            !f.broker.changelog_records(p).is_empty(),
            "partition {p}'s writes are on the changelog"
        );
    }

    let b = f.start_member("b", dir_b.path(), &[]);
    f.broker.assign("b", &[0, 1]);
    b.until(|m| all(m, 2, |s| s.is_idle() && s.published > 0))
        .await;
    // B resumed exactly where A stopped: same offsets, every round once.
    for p in 0..2 {
        let s = b.status.snapshot()[&p].clone();
        assert_eq!(s.next_offset, Some(f.broker.end_offset(p)));
    }
    let want = ids(&reference(&f.engine, &uploads));
    assert_eq!(want.len(), 40);
    let counts = id_counts(&f.broker);
    assert_eq!(counts.keys().cloned().collect::<Vec<_>>(), want);
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
    for (e, _) in emitted(&f.broker) {
        assert_eq!(e.due_at, T0 + DELAY, "{e:?}");
    }
    b.stop().await;
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_lost_partition_is_fenced_and_the_new_owner_publishes_what_is_owed() {
    let f = fixture(1, PolicySpec::fixed(DELAY));
    f.broker.enable_changelog();
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let uploads = produce_sessions(&f, 25, "x");

    // A fires every round while the sink is down: the emissions wait in its outbox.
    f.broker.set_sink_available(false);
    let a = f.start_member("a", dir_a.path(), &[0]);
    a.until(|m| all(m, 1, |s| s.outbox_len == 25 && s.pending_rounds == 0))
        .await;
    // The sink comes back and, before A's publisher retries (its backoff timer has not
    // fired: paused time only moves when every task waits), the assignment is lost
    // (session timeout): A is fenced at once and drains nothing.
    f.broker.set_sink_available(true);
    f.broker.revoke_lost("a", &[0]).await.unwrap();
    let a_state = a.status.snapshot()[&0].state.clone();
    assert_eq!(a_state, PartitionState::Stopped);
    // A would have published by now if it were not fenced.
    tokio::time::sleep(std::time::Duration::from_secs(30)).await;
    assert!(
        f.broker.output().is_empty(),
        "a fenced instance publishes nothing"
    );

    let b = f.start_member("b", dir_b.path(), &[]);
    f.broker.assign("b", &[0]);
    b.until(|m| all(m, 1, |s| s.is_idle() && s.published == 25))
        .await;
    let counts = id_counts(&f.broker);
    assert_eq!(
        counts.keys().cloned().collect::<Vec<_>>(),
        ids(&reference(&f.engine, &uploads))
    );
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
    b.stop().await;
    a.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_dirty_store_is_kept_unless_another_writer_appended_and_a_clean_restart_reads_nothing() {
    let f = fixture(1, PolicySpec::fixed(DELAY));
    f.broker.enable_changelog();
    let dir = tempfile::tempdir().unwrap();
    produce_sessions(&f, 10, "d");

    let run = f.start_member("a", dir.path(), &[0]);
    run.until(applied_all(&f.broker, 1)).await;
    run.stop().await;
    let logged = f.broker.changelog_records(0).len();
    {
        let store = open(dir.path());
        assert!(
            !store.changelog_dirty(),
            "a graceful stop syncs the changelog"
        );
        assert_eq!(store.changelog_checkpoint(), Some(logged as i64));
    }
    let mut shown = Vec::new();
    settle::cli::inspect::run(
        settle::cli::inspect::InspectArgs::new(dir.path().to_path_buf()),
        &mut shown,
    )
    .unwrap();
    let shown = String::from_utf8(shown).unwrap();
    assert!(
        shown.contains(&format!("changelog       in sync up to offset {logged}")),
        "{shown}"
    );

    // A clean restart reads nothing new from the changelog and keeps its store.
    let run = f.start_member("a", dir.path(), &[0]);
    run.until(|m| all(m, 1, |s| s.state == PartitionState::Live))
        .await;
    run.stop().await;

    // A write the changelog never got (the process died before the ack): the store is dirty.
    // Nobody else wrote the changelog since: the store is kept (a crash-restart resumes
    // exactly where its store is) and its state written to the changelog again.
    dirty_write(dir.path(), "late-1");
    let run = f.start_member("a", dir.path(), &[0]);
    run.until(|m| all(m, 1, |s| s.state == PartitionState::Live))
        .await;
    assert_eq!(
        run.status.snapshot()[&0].pending_rounds,
        11,
        "the unlogged session is kept"
    );
    run.stop().await;
    {
        // And it is on the changelog now: a new owner restores all 11.
        let fresh = tempfile::tempdir().unwrap();
        let b = f.start_member("b", fresh.path(), &[0]);
        b.until(|m| all(m, 1, |s| s.state == PartitionState::Live))
            .await;
        assert_eq!(b.status.snapshot()[&0].pending_rounds, 11);
        b.stop().await;
    }

    // Dirty again, but another instance appended to the changelog since this store's
    // checkpoint: the store is wiped and restored from the changelog.
    dirty_write(dir.path(), "late-2");
    let foreign = Change {
        key: changelog_key("meta", b"writer"),
        value: Some(7u64.to_be_bytes().to_vec()),
    };
    let ack = f.broker.sink().append_changes(0, &[foreign]).unwrap();
    ack.await.unwrap();
    let run = f.start_member("a", dir.path(), &[0]);
    run.until(|m| all(m, 1, |s| s.state == PartitionState::Live))
        .await;
    let s = run.status.snapshot()[&0].clone();
    assert_eq!(s.next_offset, Some(10));
    assert_eq!(
        s.pending_rounds, 11,
        "late-2 is gone: the store is the changelog's again"
    );
    run.stop().await;
}

/// Applies an upload of `acme/{session}` to the store in `dir` without the input record
/// and without shipping its changes: a write the changelog never got (a crash right after).
fn dirty_write(dir: &Path, session: &str) {
    let mut store = open(dir);
    store.record_changes(true);
    let mut driver = Driver::new(runtime_support::engine(PolicySpec::fixed(DELAY)));
    let mut out = Vec::new();
    let mut batch = store.batch();
    let upload = Upload::plain(SessionKey::new("acme", session), T0 + 1);
    driver.apply(&mut batch, T0 + 1, &upload, &mut out).unwrap();
    batch.commit().unwrap();
    assert!(store.changelog_dirty());
}

fn open(dir: &Path) -> PartitionStore {
    PartitionStore::open(&partition_path(dir, TOPIC, 0), &StoreOptions::default()).unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_process_paused_longer_than_its_lease_fences_every_partition_and_stops() {
    let f = fixture(2, PolicySpec::fixed(DELAY));
    f.broker.enable_changelog();
    let dir = tempfile::tempdir().unwrap();
    produce_sessions(&f, 12, "p");
    let mut opts = options(dir.path());
    opts.lease = Some(std::time::Duration::from_secs(30));
    let runtime = Runtime::new(f.engine.clone(), f.broker.sink(), f.clock, opts).unwrap();
    let liveness = runtime.liveness().expect("a lease was set");
    let status = runtime.status();
    let task =
        tokio::spawn(runtime.run(f.broker.source_with("a", &[0, 1]), CancellationToken::new()));
    // Every round fired while the sink is down: 12 emissions owed.
    f.broker.set_sink_available(false);
    status
        .wait_for(|m| all(m, 2, |_| true) && m.values().map(|s| s.outbox_len).sum::<u64>() == 12)
        .await;
    let logged_before = f.broker.changelog_records(0).len() + f.broker.changelog_records(1).len();

    // The process "was stopped for a minute" (longer than the 30 s lease: the group may have
    // given its partitions away), and the sink is reachable again: nothing may go out.
    liveness.simulate_pause(std::time::Duration::from_secs(60));
    f.broker.set_sink_available(true);
    let result = task.await.unwrap();
    assert!(
        matches!(result, Err(settle::runtime::Error::Paused { .. })),
        "{result:?}"
    );
    assert!(
        f.broker.output().is_empty(),
        "a fenced process publishes nothing"
    );
    let logged_after = f.broker.changelog_records(0).len() + f.broker.changelog_records(1).len();
    assert_eq!(
        logged_after, logged_before,
        "and appends nothing to the changelog"
    );
}
