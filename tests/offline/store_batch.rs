//! The store's batch overlay (reads see the batch's own writes), timer order on disk, the
//! timer floor that keeps `first_due` off tombstones, and the outbox FIFO.

use rocksdb::perf::{set_perf_stats, PerfContext, PerfMetric, PerfStatsLevel};
use settle::engine::{
    Driver, Emission, Engine, Millis, PolicyName, PolicySpec, PolicyTable, Round, SessionKey,
    SessionState, SessionTable, Trigger, Upload,
};
use settle::store::{PartitionStore, StoreOptions};
use std::path::Path;

fn open(path: &Path) -> PartitionStore {
    PartitionStore::open(path, &StoreOptions::default()).unwrap()
}

fn key(s: &str) -> SessionKey {
    SessionKey::new("acme", s)
}

fn state(generation: u64, open_round: bool) -> SessionState {
    SessionState {
        created_at: 1_000,
        generation,
        last_upload_at: 1_000,
        last_applied_event_id: Some(format!("e{generation}")),
        track: None,
        round: open_round.then(|| {
            Box::new(Round {
                start: 1_000,
                deadline: 1_500,
                max_wait_at: None,
                delay: 500,
                uploads: 1,
                first_upload_at: Some(1_000),
                last_upload_at: Some(1_000),
                last_event_id: None,
                attributes: Some("{\"a\":1}".into()),
                parts: vec![1, 3],
                policy: Some(PolicyName::Fixed),
                event_ids: None,
            })
        }),
    }
}

fn emission(n: u64) -> Emission {
    Emission {
        state_created_at: 10,
        key: key(&format!("s{n}")),
        generation: n,
        trigger: Trigger::Trailing,
        uploads: 3,
        first_upload_at: 10,
        last_upload_at: 20,
        due_at: 520,
        delay_ms: 500,
        policy: PolicyName::Fixed,
        last_event_id: Some(format!("e{n}")),
        attributes: None,
        event_ids: None,
    }
}

#[test]
fn a_batch_reads_its_own_session_writes() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let (a, b) = (key("a"), key("b"));
    {
        let mut batch = store.batch();
        assert_eq!(batch.get(&a).unwrap(), None);
        batch.put(&a, &state(1, true)).unwrap();
        assert_eq!(batch.get(&a).unwrap(), Some(state(1, true)));
        batch.put(&a, &state(2, false)).unwrap();
        assert_eq!(batch.get(&a).unwrap(), Some(state(2, false)));
        batch.put(&b, &state(1, true)).unwrap();
        batch.commit().unwrap();
    }
    assert_eq!(store.session(&a).unwrap(), Some(state(2, false)));
    assert_eq!(store.session_count(), 2);
    assert_eq!(store.pending_rounds(), 1);
    {
        let mut batch = store.batch();
        batch.delete(&b).unwrap();
        assert_eq!(
            batch.get(&b).unwrap(),
            None,
            "a delete hides the stored state"
        );
        batch.put(&a, &state(3, true)).unwrap();
        assert_eq!(batch.get(&a).unwrap(), Some(state(3, true)));
        // dropped without commit: discarded, the store is as before
    }
    assert_eq!(store.session(&b).unwrap(), Some(state(1, true)));
    assert_eq!(store.session(&a).unwrap(), Some(state(2, false)));
    {
        let mut batch = store.batch();
        batch.delete(&b).unwrap();
        batch.put(&a, &state(3, true)).unwrap();
        batch.commit().unwrap();
    }
    assert_eq!(store.session(&b).unwrap(), None);
    assert_eq!(store.session(&a).unwrap(), Some(state(3, true)));
    assert_eq!((store.session_count(), store.pending_rounds()), (1, 1));
    drop(store);
    let store = open(dir.path());
    assert_eq!((store.session_count(), store.pending_rounds()), (1, 1));
}

#[test]
fn timer_set_then_cancel_in_one_batch_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let a = key("a");
    {
        let mut batch = store.batch();
        batch.set_timer(500, &a).unwrap();
        assert_eq!(batch.first_due(1_000).unwrap(), Some((500, a.clone())));
        batch.cancel_timer(500, &a).unwrap();
        assert_eq!(batch.first_due(Millis::MAX).unwrap(), None);
        batch.commit().unwrap();
    }
    assert!(store.timers(10).unwrap().is_empty());
    assert_eq!(store.next_timer().unwrap(), None);
}

#[test]
fn first_due_merges_overlay_timers_and_hides_cancelled_stored_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let (a, b, c, d) = (key("a"), key("b"), key("c"), key("d"));
    {
        let mut batch = store.batch();
        // Timers belong to keys with state (store v2 keeps a key's timer in its value).
        for k in [&a, &b, &c, &d] {
            batch.put(k, &state(1, true)).unwrap();
        }
        batch.set_timer(100, &a).unwrap();
        batch.set_timer(200, &b).unwrap();
        batch.set_timer(300, &c).unwrap();
        batch.commit().unwrap();
    }
    let mut batch = store.batch();
    assert_eq!(batch.first_due(99).unwrap(), None, "nothing due before 100");
    assert_eq!(batch.first_due(100).unwrap(), Some((100, a.clone())));
    // An overlay timer earlier than every stored one comes first.
    batch.set_timer(50, &d).unwrap();
    assert_eq!(batch.first_due(1_000).unwrap(), Some((50, d.clone())));
    assert_eq!(batch.first_due(49).unwrap(), None);
    batch.cancel_timer(50, &d).unwrap();
    // Cancelled stored timers are hidden, in order.
    batch.cancel_timer(100, &a).unwrap();
    assert_eq!(batch.first_due(1_000).unwrap(), Some((200, b.clone())));
    batch.cancel_timer(200, &b).unwrap();
    assert_eq!(batch.first_due(1_000).unwrap(), Some((300, c.clone())));
    // Same due time: ordered by key.
    batch.set_timer(300, &a).unwrap();
    assert_eq!(batch.first_due(1_000).unwrap(), Some((300, a.clone())));
    // A cancelled stored timer set again is live again, even below the batch's progress
    // (and, one timer per key, it replaces the key's timer at 300).
    batch.set_timer(100, &a).unwrap();
    assert_eq!(batch.first_due(1_000).unwrap(), Some((100, a.clone())));
    batch.cancel_timer(300, &c).unwrap();
    batch.commit().unwrap();
    assert_eq!(store.timers(10).unwrap(), vec![(100, a.clone())]);
    drop(store);
    let mut store = open(dir.path());
    assert_eq!(store.next_timer().unwrap(), Some((100, a.clone())));
    assert_eq!(
        store.batch().first_due(Millis::MAX).unwrap(),
        Some((100, a))
    );
}

#[test]
fn timers_fire_in_numeric_order_across_negative_and_extreme_due_times() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let dues: [Millis; 9] = [
        Millis::MAX,
        0,
        -1,
        Millis::MIN,
        1_700_000_000_000,
        -86_400_000,
        1,
        Millis::MAX - 1,
        Millis::MIN + 1,
    ];
    {
        let mut batch = store.batch();
        for (i, d) in dues.iter().enumerate() {
            let k = key(&format!("k{i}"));
            batch.put(&k, &state(1, true)).unwrap();
            batch.set_timer(*d, &k).unwrap();
        }
        batch.commit().unwrap();
    }
    let mut sorted = dues;
    sorted.sort();
    let stored: Vec<Millis> = store
        .timers(100)
        .unwrap()
        .into_iter()
        .map(|t| t.0)
        .collect();
    assert_eq!(stored, sorted);
    drop(store);

    let mut store = open(dir.path());
    let mut batch = store.batch();
    assert_eq!(
        batch.first_due(Millis::MIN).unwrap().map(|t| t.0),
        Some(Millis::MIN)
    );
    let mut fired = Vec::new();
    // Partition time -2: only the negative timers are due.
    while let Some((due, k)) = batch.first_due(-2).unwrap() {
        fired.push(due);
        batch.cancel_timer(due, &k).unwrap();
    }
    assert_eq!(fired, vec![Millis::MIN, Millis::MIN + 1, -86_400_000]);
    while let Some((due, k)) = batch.first_due(Millis::MAX).unwrap() {
        fired.push(due);
        batch.cancel_timer(due, &k).unwrap();
    }
    assert_eq!(fired, sorted);
    batch.commit().unwrap();
    assert!(store.timers(100).unwrap().is_empty());
}

/// Tombstones a read had to step over while running `f` on this thread.
fn deletes_skipped<R>(f: impl FnOnce() -> R) -> (R, u64) {
    set_perf_stats(PerfStatsLevel::EnableCount);
    let mut ctx = PerfContext::default();
    ctx.reset();
    let r = f();
    let skipped = ctx.metric(PerfMetric::InternalDeleteSkippedCount);
    set_perf_stats(PerfStatsLevel::Disable);
    (r, skipped)
}

#[test]
fn first_due_does_not_walk_the_tombstones_of_fired_timers() {
    let dir = tempfile::tempdir().unwrap();
    let delay = 100_000;
    let engine = Engine::new(PolicyTable::uniform(PolicySpec::fixed(delay)));
    let n = 20_000;
    let mut store = open(dir.path());
    {
        let mut driver = Driver::new(engine.clone());
        let mut batch = store.batch();
        let mut out = Vec::new();
        for i in 0..n {
            let u = Upload::plain(key(&format!("s{i:05}")), i);
            driver.apply(&mut batch, i, &u, &mut out).unwrap();
        }
        assert!(out.is_empty());
        batch.commit().unwrap();
    }
    // Fire every round (deleting 20 000 timers) in a few batches, as the runtime would.
    let mut driver = Driver::new(engine);
    let mut emitted = 0;
    for step in 1..=4 {
        let now = n / 4 * step - 1 + delay;
        let mut batch = store.batch();
        let mut out = Vec::new();
        let (fired, skipped) = deletes_skipped(|| driver.advance(&mut batch, now, &mut out));
        assert_eq!(fired.unwrap(), (n / 4) as usize);
        assert!(
            skipped < 100,
            "batch {step} stepped over {skipped} tombstones"
        );
        emitted += out.len();
        batch.commit().unwrap();
    }
    assert_eq!(emitted, n as usize);
    // What remains: one expiry timer per key, a day later.
    drop(store);

    let store = open(dir.path());
    let (first, skipped) = deletes_skipped(|| store.next_timer().unwrap());
    assert_eq!(
        first.map(|t| t.0),
        Some(settle::engine::DEFAULT_STATE_TTL_MS)
    );
    assert!(
        skipped < 100,
        "reopen + first timer stepped over {skipped} tombstones"
    );
    assert_eq!(store.pending_rounds(), 0);
    assert_eq!(store.session_count(), n as u64);
}

#[test]
fn outbox_is_fifo_and_acks_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let seqs = {
        let mut batch = store.batch();
        let seqs: Vec<u64> = (1..=3)
            .map(|n| batch.push_outbox(&emission(n)).unwrap())
            .collect();
        assert_eq!(batch.outbox_pushed(), 3);
        batch.commit().unwrap();
        seqs
    };
    assert_eq!(seqs, vec![0, 1, 2]);
    assert_eq!(store.outbox_len(), 3);
    assert_eq!(store.outbox_ack(&[seqs[1]]).unwrap(), 1);
    assert_eq!(
        store.outbox_ack(&[seqs[1]]).unwrap(),
        0,
        "a second ack is a no-op"
    );
    assert_eq!(store.outbox_len(), 2);
    drop(store); // crash: the other two were never acknowledged

    let mut store = open(dir.path());
    let owed = store.outbox_peek(10).unwrap();
    assert_eq!(
        owed.iter()
            .map(|e| (e.seq, e.emission.clone()))
            .collect::<Vec<_>>(),
        vec![(0, emission(1)), (2, emission(3))]
    );
    assert_eq!(store.outbox_len(), 2);
    assert_eq!(store.outbox_peek(1).unwrap().len(), 1);
    assert_eq!(store.outbox_peek_from(1, 10).unwrap()[0].seq, 2);

    // New entries continue the sequence after a restart.
    {
        let mut batch = store.batch();
        assert_eq!(batch.push_outbox(&emission(4)).unwrap(), 3);
        batch.commit().unwrap();
    }
    assert_eq!(store.outbox_ack(&[0, 2, 99]).unwrap(), 2);
    drop(store);
    let mut store = open(dir.path());
    let owed = store.outbox_peek(10).unwrap();
    assert_eq!(owed.len(), 1);
    assert_eq!((owed[0].seq, owed[0].emission.clone()), (3, emission(4)));
    assert_eq!(store.outbox_len(), 1);
}

#[test]
fn a_discarded_batch_pushes_nothing_to_the_outbox() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    {
        let mut batch = store.batch();
        batch.push_outbox(&emission(1)).unwrap();
        batch.set_offset(7);
    }
    assert_eq!(store.outbox_len(), 0);
    assert_eq!(store.stored_offset(), None);
    let mut batch = store.batch();
    assert_eq!(
        batch.push_outbox(&emission(1)).unwrap(),
        0,
        "sequence not used up"
    );
    batch.set_offset(7);
    batch.commit().unwrap();
    assert_eq!(store.stored_offset(), Some(7));
}

#[test]
fn outbox_reads_do_not_walk_the_tombstones_of_acknowledged_entries() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let n = 10_000;
    {
        let mut batch = store.batch();
        for i in 0..n {
            batch.push_outbox(&emission(i)).unwrap();
        }
        batch.commit().unwrap();
    }
    // The publisher acknowledges in FIFO chunks, reading ahead of what it acknowledged.
    let mut from = 0;
    while from < n - 1 {
        let sent = store.outbox_peek_from(from, 500).unwrap();
        let seqs: Vec<u64> = sent.iter().map(|e| e.seq).filter(|s| *s < n - 1).collect();
        from = sent.last().unwrap().seq + 1;
        let (acked, skipped) = deletes_skipped(|| store.outbox_ack(&seqs).unwrap());
        assert_eq!(acked, seqs.len());
        assert!(skipped < 100, "ack stepped over {skipped} tombstones");
    }
    drop(store);
    let mut store = open(dir.path());
    assert_eq!(store.outbox_len(), 1);
    let (owed, skipped) = deletes_skipped(|| store.outbox_peek(10).unwrap());
    assert_eq!(owed.len(), 1);
    assert_eq!(
        (owed[0].seq, owed[0].emission.clone()),
        (n - 1, emission(n - 1))
    );
    assert!(
        skipped < 100,
        "peek after reopen stepped over {skipped} tombstones"
    );
}

/// `(tenant, due times, truncated)` of each group of an overdue-timers answer.
fn summary(groups: &[settle::store::TenantTimers]) -> Vec<(&str, Vec<Millis>, bool)> {
    groups
        .iter()
        .map(|g| {
            (
                &*g.tenant,
                g.timers.iter().map(|t| t.0).collect(),
                g.truncated,
            )
        })
        .collect()
}

#[test]
fn overdue_timers_keep_a_cap_per_tenant_and_see_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    let big: Vec<SessionKey> = (0..10)
        .map(|i| SessionKey::new("big", &format!("s{i}")))
        .collect();
    let (small, late) = (SessionKey::new("small", "x"), SessionKey::new("late", "y"));
    {
        let mut batch = store.batch();
        for (i, k) in big.iter().enumerate() {
            batch.put(k, &state(1, true)).unwrap();
            batch.set_timer(100 + i as Millis, k).unwrap();
        }
        for k in [&small, &late] {
            batch.put(k, &state(1, true)).unwrap();
        }
        batch.set_timer(105, &small).unwrap();
        batch.set_timer(500, &late).unwrap();
        batch.commit().unwrap();
    }
    // Committed: big's first 3 (of 10, truncated), small's one; late is not before 200.
    let groups = store.overdue_timers(200, 3).unwrap();
    assert_eq!(
        summary(&groups),
        vec![
            ("big", vec![100, 101, 102], true),
            ("small", vec![105], false)
        ]
    );
    assert_eq!(groups[0].timers[0].1, big[0]);

    // The batch's view: fired (cancelled) timers are gone, moved and new ones are in.
    let mut batch = store.batch();
    batch.cancel_timer(100, &big[0]).unwrap();
    batch.set_timer(150, &big[1]).unwrap(); // moves 101 to 150
    batch.set_timer(99, &late).unwrap(); // moves 500 to 99
    assert!(!batch.has_timer(100, &big[0]).unwrap());
    assert!(!batch.has_timer(101, &big[1]).unwrap());
    assert!(batch.has_timer(150, &big[1]).unwrap());
    assert!(batch.has_timer(102, &big[2]).unwrap());
    assert!(batch.has_timer(99, &late).unwrap());
    assert!(!batch.has_timer(500, &late).unwrap());
    let groups = batch.overdue_timers(200, 3).unwrap();
    assert_eq!(
        summary(&groups),
        vec![
            ("late", vec![99], false),
            ("big", vec![102, 103, 104], true),
            ("small", vec![105], false)
        ]
    );
    // A bound below everything: nothing.
    assert!(batch.overdue_timers(99, 3).unwrap().is_empty());

    // Counting from the first due timer (what the catch-up release asks before building its
    // queue): the batch's view is 99, 102..=109, 105 (small), 150 below 200: 11 timers.
    let first = batch.first_due(Millis::MAX).unwrap().expect("a timer");
    assert_eq!(first, (99, late.clone()));
    assert!(batch.timers_due_before_at_least(&first, 200, 11));
    assert!(!batch.timers_due_before_at_least(&first, 200, 12));
    assert!(
        batch.timers_due_before_at_least(&first, 103, 2),
        "99 and 102"
    );
    assert!(!batch.timers_due_before_at_least(&first, 103, 3));
}
