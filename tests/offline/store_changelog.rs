//! The store side of the changelog (src/store/changelog.rs): every write is recorded as a
//! change in changelog order, a restore of those changes into an empty store gives the same
//! store, an incremental restore from a checkpoint gives the same as a full one, and the
//! dirty flag / checkpoint bookkeeping survives a reopen.

use settle::engine::{
    Driver, Emission, Engine, Millis, PolicySpec, PolicyTable, SessionKey, Upload,
};
use settle::store::{changelog_key, Change, PartitionStore, StoreOptions};
use std::path::Path;

fn open(path: &Path) -> PartitionStore {
    PartitionStore::open(path, &StoreOptions::default()).unwrap()
}

const T0: Millis = 1_767_225_600_000;

fn engine() -> Engine {
    Engine::new(PolicyTable::uniform(PolicySpec::fixed(1_000)))
}

/// Timers are not on the changelog: a restored store rebuilds them from its sessions.
fn rebuild(store: &mut PartitionStore) {
    let engine = engine();
    store.rebuild_timers(|k, s| engine.next_due(k, s)).unwrap();
}

/// Runs a small workload through the driver in `batches` store batches: uploads of 30 keys,
/// rounds firing, acks of half the outbox. Returns the emissions.
fn workload(store: &mut PartitionStore, batches: usize) -> Vec<Emission> {
    let mut driver = Driver::new(engine());
    let mut all = Vec::new();
    let mut offset = 0;
    for b in 0..batches {
        let now = T0 + b as Millis * 400;
        let mut out = Vec::new();
        {
            let mut batch = store.batch();
            driver.advance(&mut batch, now, &mut out).unwrap();
            for k in 0..10 {
                let key = SessionKey::new("acme", &format!("s{}", (b * 7 + k) % 30));
                driver
                    .apply(&mut batch, now, &Upload::plain(key, now), &mut out)
                    .unwrap();
                offset += 1;
            }
            for e in &out {
                batch.push_outbox(e).unwrap();
            }
            batch.set_offset(offset);
            batch.set_partition_time(now);
            batch.commit().unwrap();
        }
        // Acknowledge every other owed emission.
        let owed = store.outbox_peek(1_000).unwrap();
        let acked: Vec<u64> = owed.iter().step_by(2).map(|e| e.seq).collect();
        store.outbox_ack(&acked).unwrap();
        all.extend(out);
    }
    all
}

/// Everything observable of a store: sessions via timers, the timers, the outbox, the meta.
fn contents(store: &mut PartitionStore) -> String {
    let timers = store.timers(10_000).unwrap();
    let sessions: Vec<String> = timers
        .iter()
        .map(|(_, k)| format!("{k}={:?}", store.session(k).unwrap()))
        .collect();
    let outbox: Vec<(u64, String)> = store
        .outbox_peek(10_000)
        .unwrap()
        .into_iter()
        .map(|e| (e.seq, e.emission.emission_id()))
        .collect();
    format!(
        "offset={:?} time={:?} sessions={} open={} outbox_len={} timers={timers:?} states={sessions:?} outbox={outbox:?}",
        store.stored_offset(),
        store.partition_time(),
        store.session_count(),
        store.pending_rounds(),
        store.outbox_len(),
    )
}

#[test]
fn recorded_changes_restore_an_identical_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut source = open(&dir.path().join("a"));
    source.record_changes(true);
    let emissions = workload(&mut source, 12);
    assert!(!emissions.is_empty(), "the workload fires rounds");
    let changes = source.take_changes();
    assert!(source.take_changes().is_empty(), "taken once");
    // The changelog order inside one write: outbox, then sessions and timers, then meta.
    let first_meta = changes.iter().position(|c| c.key.starts_with(b"meta\0"));
    let first_session = changes
        .iter()
        .position(|c| c.key.starts_with(b"sessions\0"));
    assert!(
        first_session < first_meta,
        "meta comes after the data it describes"
    );
    assert!(
        changes.iter().all(|c| !c.key.ends_with(b"changelog_dirty")
            && !c.key.ends_with(b"timer_floor")
            && !c.key.starts_with(b"timers\0")),
        "timers and local-only keys are never recorded"
    );
    let writer = source
        .writer_id()
        .expect("chosen at the first recorded write");
    assert!(
        changes
            .iter()
            .filter_map(settle::store::changelog::writer_of)
            .all(|w| w == writer),
        "every write names its writer"
    );

    let mut restored = open(&dir.path().join("b"));
    let log: Vec<(i64, Change)> = changes
        .into_iter()
        .enumerate()
        .map(|(i, c)| (i as i64, c))
        .collect();
    // Applied in chunks, as a restore does.
    for chunk in log.chunks(37) {
        restored
            .restore(chunk.iter().map(|(o, c)| (*o, c)))
            .unwrap();
    }
    assert_eq!(restored.changelog_checkpoint(), Some(log.len() as i64));
    assert!(!restored.changelog_dirty());
    rebuild(&mut restored);
    assert_eq!(contents(&mut restored), contents(&mut source));
}

#[test]
fn an_incremental_restore_from_the_checkpoint_equals_a_full_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut source = open(&dir.path().join("a"));
    source.record_changes(true);
    workload(&mut source, 5);
    let first: Vec<Change> = source.take_changes();
    workload(&mut source, 5);
    let second: Vec<Change> = source.take_changes();
    let log: Vec<(i64, Change)> = first
        .iter()
        .chain(&second)
        .cloned()
        .enumerate()
        .map(|(i, c)| (i as i64, c))
        .collect();

    let mut full = open(&dir.path().join("full"));
    full.restore(log.iter().map(|(o, c)| (*o, c))).unwrap();
    rebuild(&mut full);

    let path = dir.path().join("incremental");
    {
        let mut inc = open(&path);
        inc.restore(log[..first.len()].iter().map(|(o, c)| (*o, c)))
            .unwrap();
    }
    // Reopened: the checkpoint says where to continue.
    let mut inc = open(&path);
    let from = inc.changelog_checkpoint().unwrap() as usize;
    assert_eq!(from, first.len());
    inc.restore(log[from..].iter().map(|(o, c)| (*o, c)))
        .unwrap();
    rebuild(&mut inc);
    assert_eq!(contents(&mut inc), contents(&mut full));
    assert_eq!(contents(&mut inc), contents(&mut source));
}

#[test]
fn the_first_write_after_a_sync_marks_the_store_dirty_until_the_next_sync() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut store = open(dir.path());
        assert!(!store.changelog_dirty());
        assert_eq!(store.changelog_checkpoint(), None);
        // Not recording: writes leave no mark.
        workload(&mut store, 1);
        assert!(!store.changelog_dirty());
        store.record_changes(true);
        workload(&mut store, 1);
        assert!(store.changelog_dirty());
        assert!(store.pending_changes() > 0);
    }
    {
        // A crash here (nothing synced): the reopened store says it is dirty.
        let mut store = open(dir.path());
        assert!(store.changelog_dirty());
        store.changelog_synced(42).unwrap();
    }
    let store = open(dir.path());
    assert!(!store.changelog_dirty());
    assert_eq!(store.changelog_checkpoint(), Some(42));
}

#[test]
fn a_snapshot_holds_every_record_but_the_local_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut source = open(&dir.path().join("a"));
    workload(&mut source, 6);
    source.changelog_synced(7).unwrap();
    let snapshot = source.snapshot_changes().unwrap();
    assert!(snapshot.iter().all(|c| c.value.is_some()));
    assert!(!snapshot
        .iter()
        .any(|c| c.key.ends_with(b"changelog_next") || c.key.ends_with(b"changelog_dirty")));
    let mut copy = open(&dir.path().join("b"));
    copy.restore(snapshot.iter().enumerate().map(|(i, c)| (i as i64, c)))
        .unwrap();
    rebuild(&mut copy);
    assert_eq!(contents(&mut copy), contents(&mut source));
}

#[test]
fn a_record_of_an_unknown_column_family_is_refused_whole() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let good = Change {
        key: changelog_key("meta", b"offset"),
        value: Some(9i64.to_be_bytes().to_vec()),
    };
    let bad = Change {
        key: changelog_key("tenants-v9", b"acme"),
        value: Some(vec![1]),
    };
    let err = store
        .restore([(0, &good), (1, &bad)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("tenants-v9"), "{err}");
    assert_eq!(
        store.stored_offset(),
        None,
        "nothing of the chunk is stored"
    );
    assert_eq!(store.changelog_checkpoint(), None);
}
