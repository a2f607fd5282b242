//! Learned initial delays in the partition store (`tenants` column family): the store batch
//! and the in-memory table learn the same delays and emit the same rounds from the same
//! input, including the eviction of the least recently seen tenant beyond
//! `MAX_LEARNED_TENANTS`; the statistics survive a reopen, are recorded for the changelog
//! like every other write and come back with a restore.

use settle::engine::{
    Driver, Emission, Engine, MemTable, Millis, PolicySpec, PolicyTable, SessionKey, TenantStats,
    Upload, MAX_LEARNED_TENANTS,
};
use settle::store::{PartitionStore, StoreOptions};
use std::path::Path;

const T0: Millis = 1_767_225_600_000;

fn open(path: &Path) -> PartitionStore {
    PartitionStore::open(path, &StoreOptions::default()).unwrap()
}

fn engine() -> Engine {
    Engine::new(PolicyTable::uniform(
        PolicySpec::adaptive(5_000, 600_000).with_learned_initial_delay(true),
    ))
}

/// One session a minute per tenant: tenant `t0000` opens session `r<i>` every minute (so it
/// is never the least recently seen), tenant `t<i>` (i ≥ 1) one session `s` at minute i.
/// Every session uploads twice, 20 s apart.
fn uploads(tenants: usize) -> Vec<Upload> {
    let mut out = Vec::new();
    for i in 0..tenants {
        let t = T0 + i as Millis * 60_000;
        let mut keys = vec![SessionKey::new("t0000", &format!("r{i}"))];
        if i > 0 {
            keys.push(SessionKey::new(&format!("t{i:04}"), "s"));
        }
        for key in keys {
            out.push(Upload::plain(key.clone(), t));
            out.push(Upload::plain(key, t + 20_000));
        }
    }
    out.sort_by_key(|u| u.event_time);
    out
}

/// Replays `uploads` through the store in batches of `chunk` uploads; every round fires at
/// the end. Returns the emissions.
fn through_store(store: &mut PartitionStore, uploads: &[Upload], chunk: usize) -> Vec<Emission> {
    let mut driver = Driver::new(engine());
    let mut all = Vec::new();
    let mut now = Millis::MIN;
    for (n, part) in uploads.chunks(chunk).enumerate() {
        let mut batch = store.batch();
        for u in part {
            now = now.max(u.event_time);
            driver.apply(&mut batch, now, u, &mut all).unwrap();
        }
        batch.set_offset((n * chunk + part.len()) as i64);
        batch.commit().unwrap();
    }
    let mut batch = store.batch();
    driver
        .advance(&mut batch, Millis::MAX / 4, &mut all)
        .unwrap();
    batch.commit().unwrap();
    all
}

fn through_memory(uploads: &[Upload]) -> (Vec<Emission>, MemTable) {
    let mut driver = Driver::new(engine());
    let mut table = MemTable::new();
    let mut all = Vec::new();
    let mut now = Millis::MIN;
    for u in uploads {
        now = now.max(u.event_time);
        let Ok(_) = driver.apply(&mut table, now, u, &mut all);
    }
    let Ok(_) = driver.advance(&mut table, Millis::MAX / 4, &mut all);
    (all, table)
}

#[test]
fn store_and_memory_learn_and_evict_alike() {
    let n = MAX_LEARNED_TENANTS + 20;
    let input = uploads(n);
    let (want, table) = through_memory(&input);
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let got = through_store(&mut store, &input, 37);
    assert_eq!(got, want, "same rounds from the same learned delays");

    // Bounded: the 20 least recently seen tenants (t0001..t0020, first uploads) are gone;
    // t0000 kept coming back and stays.
    assert_eq!(store.tenant_count(), MAX_LEARNED_TENANTS);
    assert_eq!(table.tenant_count(), MAX_LEARNED_TENANTS);
    let stored = store.tenants().unwrap();
    assert_eq!(stored.len(), MAX_LEARNED_TENANTS);
    for (name, stats) in &stored {
        assert_eq!(table.tenant(name), Some(stats), "{name}");
    }
    for i in 1..=20 {
        assert!(
            store.tenant(&format!("t{i:04}")).unwrap().is_none(),
            "t{i:04}"
        );
    }
    let t0 = store.tenant("t0000").unwrap().expect("t0000 kept");
    assert_eq!(t0.intervals.len(), 64, "bounded window");
    assert!(t0.intervals.iter().all(|&i| i == 20_000));
    // t0000 learned 20 s + 25 %: its later sessions emit once.
    let spec = engine().policies().default.clone();
    assert_eq!(t0.learned_delay(&spec), Some(25_000));
    let t0_rounds = want.iter().filter(|e| e.key.tenant() == "t0000").count();
    assert!(t0_rounds < 2 * n, "{t0_rounds} rounds of {n} sessions");
    assert_eq!(t0_rounds, 8 * 2 + (n - 8));

    // Reopened: the statistics and their eviction order are read back.
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.tenant_count(), MAX_LEARNED_TENANTS);
    assert_eq!(store.tenant("t0000").unwrap(), Some(t0));
}

#[test]
fn tenant_statistics_are_recorded_for_the_changelog_and_restored() {
    let input = uploads(30);
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(&dir.path().join("a"));
    store.record_changes(true);
    through_store(&mut store, &input, 11);
    let changes = store.take_changes();
    let tenant_changes = changes
        .iter()
        .filter(|c| c.key.starts_with(b"tenants\0"))
        .count();
    assert!(
        tenant_changes >= 30,
        "{tenant_changes} tenant changes recorded"
    );

    let mut copy = open(&dir.path().join("b"));
    let records: Vec<(i64, &settle::store::Change)> = changes
        .iter()
        .enumerate()
        .map(|(i, c)| (i as i64, c))
        .collect();
    copy.restore(records).unwrap();
    let original: Vec<(String, TenantStats)> = store.tenants().unwrap();
    assert_eq!(original.len(), 30);
    assert_eq!(copy.tenants().unwrap(), original);
    assert_eq!(copy.tenant_count(), 30);
}
