//! The RocksDB partition store across restarts (SEMANTICS §6: no lost emission across a
//! crash or restart): a driver run through store batches, interrupted by dropping the store
//! (a crash: nothing acknowledged, no clean shutdown step) and reopening it, produces exactly
//! the emissions of an uninterrupted in-memory run, and the store holds what the in-memory
//! table holds at the point of the crash. Also: a failed commit changes nothing.

use settle::engine::{
    Driver, Emission, Engine, MemTable, Millis, Part, PolicySpec, PolicyTable, SessionKey,
    SessionTable, Upload,
};
use settle::store::{Error, PartitionStore, StoreOptions};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

/// Policies that exercise every kind of timer: trailing, leading, max-wait continuation
/// rounds, adaptive CallTracks, and a short state-ttl so expiry timers fire too.
fn engine() -> Engine {
    let mut tenants = HashMap::new();
    tenants.insert("lt".to_string(), PolicySpec::leading_trailing(300));
    tenants.insert(
        "ad".to_string(),
        PolicySpec::adaptive(200, 5_000)
            .with_max_wait(3_000)
            .with_state_ttl(20_000),
    );
    tenants.insert(
        "mw".to_string(),
        PolicySpec::fixed(400).with_max_wait(1_000),
    );
    Engine::new(PolicyTable {
        default: PolicySpec::fixed(500).with_state_ttl(60_000),
        tenants,
    })
}

/// A deterministic mixed workload: bursts, gaps, late uploads, redeliveries, split and
/// final uploads over 48 keys of 4 tenants.
fn workload(n: usize) -> Vec<Upload> {
    let mut seed: u64 = 0x5eed_1234_abcd_0001;
    let mut rnd = move |m: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % m
    };
    let tenants = ["fx", "lt", "ad", "mw"];
    let mut t: Millis = 1_700_000_000_000;
    let mut last: HashMap<SessionKey, Upload> = HashMap::new();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        t += rnd(60) as Millis;
        if rnd(40) == 0 {
            t += 30_000; // a quiet gap: trailing emissions and some expiries fire
        }
        let key = SessionKey::new(tenants[rnd(4) as usize], &format!("s{}", rnd(12)));
        if rnd(25) == 0 {
            if let Some(prev) = last.get(&key) {
                out.push(prev.clone()); // exact redelivery
                continue;
            }
        }
        let mut u = Upload::plain(key.clone(), t);
        if rnd(15) == 0 {
            u.event_time = t - rnd(800) as Millis; // late
        }
        u.event_id = Some(format!("e{i}"));
        match rnd(30) {
            0 => u.final_flag = true,
            1 | 2 => {
                u.part = Some(Part {
                    index: 1 + rnd(2) as u32,
                    count: 2,
                })
            }
            _ => {}
        }
        if rnd(3) == 0 {
            u.attributes = Some(format!("{{\"n\":{i}}}"));
        }
        last.insert(key, u.clone());
        out.push(u);
    }
    out
}

/// Applies `uploads` to `table` the way the runtime replays: partition time is the running
/// maximum of event times (SEMANTICS §3), starting from `now`. Returns the new partition time.
fn apply_all<T: SessionTable>(
    driver: &mut Driver,
    table: &mut T,
    mut now: Millis,
    uploads: &[Upload],
    out: &mut Vec<Emission>,
) -> Result<Millis, T::Error> {
    for u in uploads {
        now = now.max(u.event_time);
        driver.apply(table, now, u, out)?;
    }
    Ok(now)
}

/// One input batch through the store, as the runtime does it: apply, push the emissions to
/// the outbox, record offset and partition time, commit once. The emissions decided are
/// appended to `out` even when the commit fails (the tests compare them).
fn store_batch(
    store: &mut PartitionStore,
    driver: &mut Driver,
    first_offset: i64,
    uploads: &[Upload],
    out: &mut Vec<Emission>,
) -> Result<(), Error> {
    let now = store.partition_time().unwrap_or(Millis::MIN);
    let mut batch = store.batch();
    let mut emitted = Vec::new();
    let now = apply_all(driver, &mut batch, now, uploads, &mut emitted)?;
    for e in &emitted {
        batch.push_outbox(e)?;
    }
    batch.set_offset(first_offset + uploads.len() as i64);
    batch.set_partition_time(now);
    out.extend(emitted);
    batch.commit()
}

fn keys_of(uploads: &[Upload]) -> BTreeSet<SessionKey> {
    uploads.iter().map(|u| u.key.clone()).collect()
}

fn first_due_of<T: SessionTable>(table: &mut T) -> Option<(Millis, SessionKey)>
where
    T::Error: std::fmt::Debug,
{
    table.first_due(Millis::MAX).unwrap()
}

/// The store holds exactly what the in-memory table holds.
fn assert_same_as(store: &mut PartitionStore, mem: &mut MemTable, keys: &BTreeSet<SessionKey>) {
    for k in keys {
        assert_eq!(
            store.session(k).unwrap().as_ref(),
            mem.state(k),
            "state of {k}"
        );
    }
    let mem_timers: Vec<_> = mem.timers().cloned().collect();
    assert_eq!(store.timers(usize::MAX).unwrap(), mem_timers);
    assert_eq!(first_due_of(&mut store.batch()), first_due_of(mem));
    assert_eq!(store.next_timer().unwrap(), mem_timers.first().cloned());
    assert_eq!(store.session_count(), mem.len() as u64);
    assert_eq!(store.pending_rounds(), mem.open_rounds() as u64);
}

#[test]
fn a_restart_resumes_exactly_where_the_uninterrupted_run_is() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("uploads").join("0");
    let uploads = workload(3_000);
    let keys = keys_of(&uploads);
    let cut = 1_700;
    let end = uploads.iter().map(|u| u.event_time).max().unwrap() + 10 * 60_000;

    // Uninterrupted, in memory; snapshot the table at the cut.
    let mut mem = MemTable::new();
    let mut mem_driver = Driver::new(engine());
    let mut mem_out = Vec::new();
    let now = apply_all(
        &mut mem_driver,
        &mut mem,
        Millis::MIN,
        &uploads[..cut],
        &mut mem_out,
    )
    .unwrap();
    let mut mem_at_cut = mem.clone();
    let mem_out_at_cut = mem_out.clone();
    let now = apply_all(
        &mut mem_driver,
        &mut mem,
        now,
        &uploads[cut..],
        &mut mem_out,
    )
    .unwrap();
    mem_driver
        .advance(&mut mem, now.max(end), &mut mem_out)
        .unwrap();
    assert!(mem_out.len() > 300, "workload emits: {}", mem_out.len());

    // Through the store, in input batches of varying size, crashing at the cut.
    let mut out = Vec::new();
    {
        let mut store = PartitionStore::open(&path, &StoreOptions::default()).unwrap();
        assert_eq!(store.stored_offset(), None);
        let mut driver = Driver::new(engine());
        let mut offset = 0;
        for chunk in uploads[..cut].chunks(97) {
            store_batch(&mut store, &mut driver, offset, chunk, &mut out).unwrap();
            offset += chunk.len() as i64;
        }
        // dropped here without acknowledging anything: a crash after the last commit
    }
    assert_eq!(out, mem_out_at_cut);

    let mut store = PartitionStore::open(&path, &StoreOptions::default()).unwrap();
    assert_eq!(store.stored_offset(), Some(cut as i64));
    assert_eq!(
        store.partition_time(),
        uploads[..cut].iter().map(|u| u.event_time).max()
    );
    assert_same_as(&mut store, &mut mem_at_cut, &keys);
    let owed: Vec<Emission> = store
        .outbox_peek(usize::MAX)
        .unwrap()
        .into_iter()
        .map(|e| e.emission)
        .collect();
    assert_eq!(owed, mem_out_at_cut, "every emission is still owed");
    assert_eq!(store.outbox_len(), mem_out_at_cut.len() as u64);

    // Resume from the stored offset with a fresh driver, then let time run out.
    let mut driver = Driver::new(engine());
    let resume = store.stored_offset().unwrap() as usize;
    for (i, chunk) in uploads[resume..].chunks(211).enumerate() {
        let first = (resume + i * 211) as i64;
        store_batch(&mut store, &mut driver, first, chunk, &mut out).unwrap();
    }
    {
        let mut batch = store.batch();
        let mut emitted = Vec::new();
        driver.advance(&mut batch, end, &mut emitted).unwrap();
        for e in &emitted {
            batch.push_outbox(e).unwrap();
        }
        batch.set_partition_time(end);
        batch.commit().unwrap();
        out.extend(emitted);
    }
    assert_eq!(out, mem_out, "same emissions as the uninterrupted run");
    assert_same_as(&mut store, &mut mem, &keys);
    assert_eq!(store.stored_offset(), Some(uploads.len() as i64));

    // The outbox owes everything emitted, in order; acknowledging empties it.
    let owed = store.outbox_peek(usize::MAX).unwrap();
    assert_eq!(
        owed.iter().map(|e| e.emission.clone()).collect::<Vec<_>>(),
        mem_out
    );
    let seqs: Vec<u64> = owed.iter().map(|e| e.seq).collect();
    assert_eq!(store.outbox_ack(&seqs).unwrap(), seqs.len());
    assert_eq!(store.outbox_len(), 0);
    assert!(store.outbox_peek(10).unwrap().is_empty());
}

/// Commits one batch of `uploads` and returns the emissions.
fn commit_uploads(store: &mut PartitionStore, offset: i64, uploads: &[Upload]) -> Vec<Emission> {
    let mut out = Vec::new();
    store_batch(store, &mut Driver::new(engine()), offset, uploads, &mut out).unwrap();
    out
}

/// What a failed commit must not change.
#[derive(Debug, PartialEq)]
struct Snapshot {
    offset: Option<i64>,
    partition_time: Option<Millis>,
    sessions: Vec<Option<settle::engine::SessionState>>,
    timers: Vec<(Millis, SessionKey)>,
    outbox: Vec<(u64, Emission)>,
    counts: (u64, u64, u64),
}

fn snapshot(store: &mut PartitionStore, keys: &BTreeSet<SessionKey>) -> Snapshot {
    Snapshot {
        offset: store.stored_offset(),
        partition_time: store.partition_time(),
        sessions: keys.iter().map(|k| store.session(k).unwrap()).collect(),
        timers: store.timers(usize::MAX).unwrap(),
        outbox: store
            .outbox_peek(usize::MAX)
            .unwrap()
            .into_iter()
            .map(|e| (e.seq, e.emission))
            .collect(),
        counts: (
            store.session_count(),
            store.pending_rounds(),
            store.outbox_len(),
        ),
    }
}

fn reopen(path: &Path) -> PartitionStore {
    PartitionStore::open(path, &StoreOptions::default()).unwrap()
}

#[test]
fn a_failed_commit_leaves_offset_sessions_timers_and_outbox_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p");
    let uploads = workload(400);
    let keys = keys_of(&uploads);
    let mut store = reopen(&path);
    let emitted = commit_uploads(&mut store, 0, &uploads[..200]);
    assert!(!emitted.is_empty());
    let before = snapshot(&mut store, &keys);
    assert_eq!(before.offset, Some(200));

    store.fail_next_commits(1);
    let mut out = Vec::new();
    let err = store_batch(
        &mut store,
        &mut Driver::new(engine()),
        200,
        &uploads[200..],
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(err, Error::InjectedFault), "{err}");
    assert_eq!(snapshot(&mut store, &keys), before, "in the open store");
    drop(store);
    let mut store = reopen(&path);
    assert_eq!(snapshot(&mut store, &keys), before, "after reopening");

    // The same batch applied again (the runtime would replay from the stored offset)
    // succeeds and gives what an unfailed run gives.
    let mut retried = Vec::new();
    store_batch(
        &mut store,
        &mut Driver::new(engine()),
        200,
        &uploads[200..],
        &mut retried,
    )
    .unwrap();
    assert_eq!(
        retried, out,
        "the failed attempt had decided the same emissions"
    );
    assert_eq!(store.stored_offset(), Some(400));
}

#[test]
fn a_write_refused_by_rocksdb_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p");
    let uploads = workload(300);
    let keys = keys_of(&uploads);
    {
        let mut store = reopen(&path);
        commit_uploads(&mut store, 0, &uploads[..150]);
    }
    // A read-only store: RocksDB itself refuses the write.
    let mut ro = PartitionStore::open_read_only(&path, &StoreOptions::default()).unwrap();
    let before = snapshot(&mut ro, &keys);
    let mut out = Vec::new();
    let err = store_batch(
        &mut ro,
        &mut Driver::new(engine()),
        150,
        &uploads[150..],
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(err, Error::Write(_)), "{err}");
    let owed = ro.outbox_peek(1).unwrap();
    assert!(!owed.is_empty());
    let err = ro.outbox_ack(&[owed[0].seq]).unwrap_err();
    assert!(matches!(err, Error::Write(_)), "{err}");
    assert_eq!(snapshot(&mut ro, &keys), before);
    drop(ro);
    let mut store = reopen(&path);
    assert_eq!(snapshot(&mut store, &keys), before);
}

#[test]
fn read_only_open_of_a_missing_store_fails() {
    let dir = tempfile::tempdir().unwrap();
    let err = PartitionStore::open_read_only(&dir.path().join("nope"), &StoreOptions::default())
        .unwrap_err();
    assert!(matches!(err, Error::Open { .. }), "{err}");
}

#[test]
fn a_second_writer_cannot_open_an_open_store() {
    let dir = tempfile::tempdir().unwrap();
    let _owner = reopen(dir.path());
    let err = PartitionStore::open(dir.path(), &StoreOptions::default()).unwrap_err();
    assert!(matches!(err, Error::Open { .. }), "{err}");
}
