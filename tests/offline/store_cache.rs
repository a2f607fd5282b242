//! The bounded session cache of a write-behind store (`store::mem`, issue 14): with a cache
//! far too small for its sessions (so clean ones are evicted after every flush and read back
//! on a miss, prefetched in one multi-get, or expired without a read), a store decides
//! exactly what the in-memory table decides from the same input; a batch changes memory in
//! place, so one dropped half-applied makes the store refuse to write; acknowledged outbox
//! entries are deleted as a range, and those acknowledged out of order one by one.

use settle::engine::{
    Driver, DriverStats, Emission, Engine, MemTable, Millis, PolicySpec, PolicyTable, SessionKey,
    SessionTable, Upload,
};
use settle::store::{Error, PartitionStore, StoreOptions};
use std::path::Path;

const T0: Millis = 1_767_225_600_000;
const TTL: Millis = 600_000;

fn options(cache_bytes: usize) -> StoreOptions {
    StoreOptions {
        session_cache_bytes: cache_bytes,
        ..StoreOptions::default()
    }
}

fn open(path: &Path, cache_bytes: usize) -> PartitionStore {
    let mut store = PartitionStore::open(path, &options(cache_bytes)).unwrap();
    store.set_write_behind(true).unwrap();
    store
}

fn engine() -> Engine {
    Engine::new(PolicyTable::uniform(
        PolicySpec::adaptive(5_000, 60_000).with_state_ttl(TTL),
    ))
}

/// 3 000 long-tail sessions of 5 tenants with one or two uploads each (the second 2–9 s
/// after the first), one upload every 20 ms, and a hot session uploading every 700 ms.
fn uploads() -> Vec<Upload> {
    let mut out = Vec::new();
    for i in 0..3_000u32 {
        let t = T0 + i64::from(i) * 20;
        let key = SessionKey::new(&format!("t{}", i % 5), &format!("s{i}"));
        out.push(Upload::plain(key.clone(), t));
        if i % 3 == 0 {
            out.push(Upload::plain(key, t + 2_000 + i64::from(i % 8) * 1_000));
        }
        if i % 35 == 0 {
            out.push(Upload::plain(SessionKey::new("t0", "hot"), t));
        }
    }
    out.sort_by_key(|u| u.event_time);
    out
}

/// The reference: the in-memory table, every timer fired at the end.
fn through_memory(uploads: &[Upload], end: Millis) -> (Vec<Emission>, DriverStats) {
    let mut driver = Driver::new(engine());
    let mut table = MemTable::new();
    let mut all = Vec::new();
    let mut now = Millis::MIN;
    for u in uploads {
        now = now.max(u.event_time);
        let Ok(_) = driver.apply(&mut table, now, u, &mut all);
    }
    let Ok(_) = driver.advance(&mut table, end, &mut all);
    (all, driver.stats)
}

/// Through `store` in batches of 50 uploads, a flush after each (so eviction runs), then
/// every timer fired in batches of 200 (with the batch's due keys prefetched, as the
/// runtime's catch-up does), flushing after each. Returns the emissions, the driver's
/// counters and the fewest sessions the cache held after a flush.
fn through_store(
    store: &mut PartitionStore,
    uploads: &[Upload],
    end: Millis,
) -> (Vec<Emission>, DriverStats, usize) {
    let mut driver = Driver::new(engine());
    let mut all = Vec::new();
    let mut now = Millis::MIN;
    let mut fewest_cached = usize::MAX;
    for (n, part) in uploads.chunks(50).enumerate() {
        let mut batch = store.batch();
        for u in part {
            now = now.max(u.event_time);
            driver.apply(&mut batch, now, u, &mut all).unwrap();
        }
        batch.set_offset((n * 50 + part.len()) as i64);
        batch.commit().unwrap();
        store.flush().unwrap();
        fewest_cached = fewest_cached.min(store.cached_sessions());
    }
    loop {
        let due: Vec<SessionKey> = store
            .timers(200)
            .unwrap()
            .into_iter()
            .filter(|(d, _)| *d <= end)
            .map(|(_, k)| k)
            .collect();
        if due.is_empty() {
            break;
        }
        let mut batch = store.batch();
        batch.prefetch(due.iter()).unwrap();
        driver
            .advance_at_most(&mut batch, end, 200, &mut all)
            .unwrap();
        batch.commit().unwrap();
        store.flush().unwrap();
    }
    (all, driver.stats, fewest_cached)
}

#[test]
fn a_cache_far_too_small_decides_exactly_as_the_memory_table() {
    let input = uploads();
    let keys = {
        let mut k: Vec<&SessionKey> = input.iter().map(|u| &u.key).collect();
        k.sort();
        k.dedup();
        k.len()
    };
    let end = input.last().unwrap().event_time + 2 * TTL;
    let (want, want_stats) = through_memory(&input, end);
    assert_eq!(
        want_stats.expired as usize, keys,
        "every state expires by the end"
    );

    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), 64 * 1024);
    let (got, stats, fewest) = through_store(&mut store, &input, end);
    assert!(
        fewest < keys / 4,
        "the cache must evict for this test to mean anything: it kept {fewest} of {keys}"
    );
    assert_eq!(got.len(), want.len());
    assert_eq!(got, want, "same rounds, in the same order");
    assert_eq!(
        stats, want_stats,
        "same uploads, emissions and expiries counted"
    );
    assert_eq!(store.session_count(), 0);
    assert_eq!(store.pending_rounds(), 0);
    drop(store);
    let store = open(dir.path(), 64 * 1024);
    assert_eq!(store.session_count(), 0, "the expiries are durable");
    assert!(store.timers(10).unwrap().is_empty());
}

#[test]
fn evicted_sessions_prefetched_in_one_read_are_the_stored_ones() {
    let input = uploads();
    let dir = tempfile::tempdir().unwrap();
    let mut big = open(&dir.path().join("big"), 64 << 20);
    let mut tiny = open(&dir.path().join("tiny"), 64 * 1024);
    // Rounds an hour long: every session still has its round open (an evicted session
    // without one is expired without a read, and not prefetched).
    let hour = Engine::new(PolicyTable::uniform(PolicySpec::fixed(3_600_000)));
    for store in [&mut big, &mut tiny] {
        let mut driver = Driver::new(hour.clone());
        let mut out = Vec::new();
        let mut batch = store.batch();
        for u in &input {
            driver.apply(&mut batch, u.event_time, u, &mut out).unwrap();
        }
        batch.commit().unwrap();
        store.flush().unwrap();
    }
    assert!(tiny.cached_sessions() < big.cached_sessions() / 4);
    let keys: Vec<SessionKey> = input.iter().step_by(7).map(|u| u.key.clone()).collect();
    let mut batch = tiny.batch();
    let read = batch.prefetch(keys.iter()).unwrap();
    assert!(read > keys.len() / 2, "{read} of {} keys read", keys.len());
    let mut from_tiny = Vec::new();
    for k in &keys {
        from_tiny.push(batch.get(k).unwrap());
    }
    batch.commit().unwrap();
    let mut batch = big.batch();
    for (k, got) in keys.iter().zip(&from_tiny) {
        assert_eq!(&batch.get(k).unwrap(), got, "{k}");
    }
    batch.commit().unwrap();
}

#[test]
fn a_write_behind_batch_dropped_half_applied_stops_every_write() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), 64 << 20);
    let mut driver = Driver::new(engine());
    let mut out = Vec::new();
    {
        let mut batch = store.batch();
        let u = Upload::plain(SessionKey::new("t", "a"), T0);
        driver.apply(&mut batch, T0, &u, &mut out).unwrap();
        batch.set_offset(1);
        batch.commit().unwrap();
    }
    store.flush().unwrap();
    {
        // A batch that only reads changes nothing: dropping it is harmless.
        let mut batch = store.batch();
        assert!(batch.get(&SessionKey::new("t", "a")).unwrap().is_some());
    }
    store.flush().unwrap();
    {
        let mut batch = store.batch();
        let u = Upload::plain(SessionKey::new("t", "b"), T0 + 1);
        driver.apply(&mut batch, T0 + 1, &u, &mut out).unwrap();
        // dropped without commit, as by an error in the middle of a step
    }
    assert!(matches!(store.flush(), Err(Error::Stale)));
    assert!(matches!(store.start_flush(), Err(Error::Stale)));
    drop(store);
    let store = open(dir.path(), 64 << 20);
    assert_eq!(
        store.stored_offset(),
        Some(1),
        "the last flush is what is durable"
    );
    assert_eq!(store.session_count(), 1);
}

#[test]
fn acknowledged_outbox_entries_are_deleted_in_and_out_of_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), 64 << 20);
    let (mut driver, mut out) = (Driver::new(engine()), Vec::new());
    let mut batch = store.batch();
    for i in 0..10 {
        let u = Upload::plain(SessionKey::new("t", &format!("s{i}")), T0);
        driver.apply(&mut batch, T0, &u, &mut out).unwrap();
    }
    driver.advance(&mut batch, T0 + 10_000, &mut out).unwrap();
    assert_eq!(out.len(), 10);
    for e in &out {
        batch.push_outbox(e).unwrap();
    }
    batch.commit().unwrap();
    store.flush().unwrap();
    let seqs = |store: &mut PartitionStore| -> Vec<u64> {
        store
            .outbox_peek(100)
            .unwrap()
            .into_iter()
            .map(|e| e.seq)
            .collect()
    };
    assert_eq!(seqs(&mut store), (0..10).collect::<Vec<_>>());
    // 0–2 in order (the range below the head), 5 and 7 out of order.
    assert_eq!(store.outbox_ack(&[0, 1, 2, 5, 7]).unwrap(), 5);
    store.flush().unwrap();
    drop(store);
    let mut store = open(dir.path(), 64 << 20);
    assert_eq!(seqs(&mut store), [3, 4, 6, 8, 9]);
    assert_eq!(store.outbox_len(), 5);
    // 3 and 4 move the head past 5: the range covers what was deleted one by one.
    store.outbox_ack(&[4, 3]).unwrap();
    store.flush().unwrap();
    drop(store);
    let mut store = open(dir.path(), 64 << 20);
    assert_eq!(seqs(&mut store), [6, 8, 9]);
    store.outbox_ack(&[9, 8, 6]).unwrap();
    store.flush().unwrap();
    drop(store);
    let mut store = open(dir.path(), 64 << 20);
    assert!(seqs(&mut store).is_empty());
    assert_eq!(store.outbox_len(), 0);
}

/// With eviction deferred (the runtime), a flush evicts nothing and one `evict` call does a
/// bounded share of a sweep while the cache is only a little over its budget; the calls
/// that follow finish it (down to three quarters of the budget), and the evicted sessions
/// read back as they were written.
#[test]
fn deferred_eviction_is_spread_over_calls_and_loses_nothing() {
    const BUDGET: usize = 4 << 20;
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), BUDGET);
    store.set_deferred_eviction(true);
    let hour = Engine::new(PolicyTable::uniform(PolicySpec::fixed(3_600_000)));
    let mut driver = Driver::new(hour);
    let mut out = Vec::new();
    let mut keys = Vec::new();
    // Batches of 100 new sessions, each flushed, until the cache is just over its budget.
    while store.cached_bytes() <= BUDGET {
        let mut batch = store.batch();
        for _ in 0..100 {
            let key = SessionKey::new("tenant-with-a-long-name", &format!("s{}", keys.len()));
            let t = T0 + keys.len() as Millis;
            driver
                .apply(&mut batch, t, &Upload::plain(key.clone(), t), &mut out)
                .unwrap();
            keys.push(key);
        }
        batch.commit().unwrap();
        store.flush().unwrap();
    }
    assert!(keys.len() > 4 * 1024, "the sweep must take several calls");
    let cached = store.cached_sessions();
    assert_eq!(
        cached,
        keys.len(),
        "a flush evicts nothing while eviction is deferred"
    );
    store.evict();
    let after_one = store.cached_sessions();
    assert!(after_one < cached, "one call evicts");
    assert!(
        store.cached_bytes() > BUDGET * 3 / 4,
        "one call does a share of the sweep, not all of it"
    );
    let mut calls = 1;
    while store.cached_bytes() > BUDGET * 3 / 4 {
        store.evict();
        calls += 1;
        assert!(calls <= keys.len() / 1024 + 2, "the sweep ends");
    }
    assert!(store.cached_sessions() < after_one);
    // Every session reads back as written (the first ones were evicted: read from RocksDB).
    let mut memory = MemTable::new();
    let mut driver = Driver::new(Engine::new(PolicyTable::uniform(PolicySpec::fixed(
        3_600_000,
    ))));
    for (i, key) in keys.iter().enumerate() {
        let t = T0 + i as Millis;
        driver
            .apply(
                &mut memory,
                t,
                &Upload::plain(key.clone(), t),
                &mut Vec::new(),
            )
            .unwrap();
    }
    let mut batch = store.batch();
    for key in keys.iter().step_by(97) {
        assert_eq!(batch.get(key).unwrap(), memory.get(key).unwrap(), "{key}");
    }
    batch.commit().unwrap();
    assert_eq!(store.pending_rounds(), keys.len() as u64);
}

/// Deferred eviction never evicts what a write in flight holds (clean in memory, not yet in
/// RocksDB: a miss would read the older state); once the write is seen done it does.
#[test]
fn deferred_eviction_waits_for_the_write_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path(), 64 * 1024);
    store.set_deferred_eviction(true);
    let mut driver = Driver::new(engine());
    let mut out = Vec::new();
    let keys: Vec<SessionKey> = (0..2_000)
        .map(|i| SessionKey::new("t", &format!("s{i}")))
        .collect();
    let mut batch = store.batch();
    for (i, key) in keys.iter().enumerate() {
        let t = T0 + i as Millis;
        driver
            .apply(&mut batch, t, &Upload::plain(key.clone(), t), &mut out)
            .unwrap();
    }
    batch.commit().unwrap();
    assert!(
        store.start_flush().unwrap(),
        "the write goes to the writer thread"
    );
    let cached = store.cached_sessions();
    assert_eq!(cached, keys.len());
    store.evict();
    assert_eq!(
        store.cached_sessions(),
        cached,
        "nothing evicted while the write is in flight"
    );
    store.wait_flush().unwrap().expect("the write in flight");
    for _ in 0..100 {
        store.evict();
    }
    assert!(store.cached_bytes() <= 64 * 1024 * 3 / 4);
    assert!(store.cached_sessions() < cached / 4);
    let mut batch = store.batch();
    for (i, key) in keys.iter().enumerate().step_by(37) {
        let state = batch.get(key).unwrap().expect("stored");
        assert_eq!(state.last_upload_at, T0 + i as Millis, "{key}");
    }
    batch.commit().unwrap();
}
