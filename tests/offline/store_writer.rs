//! Write-behind off the partition's thread (`PartitionStore::start_flush`): a flush handed
//! to the store's writer thread counts — offset, outbox entries handed out, changelog
//! changes — only once it is seen written; one write at a time; commits made while it is in
//! flight are not lost; a failed one leaves the store at its last durable state.

use settle::engine::{
    Emission, PolicyName, Round, SessionKey, SessionState, SessionTable, Trigger,
};
use settle::store::{PartitionStore, StoreOptions};
use std::path::Path;

fn open(path: &Path) -> PartitionStore {
    let mut store = PartitionStore::open(path, &StoreOptions::default()).unwrap();
    store.set_write_behind(true).unwrap();
    store
}

fn key(s: &str) -> SessionKey {
    SessionKey::new("acme", s)
}

fn state(generation: u64) -> SessionState {
    SessionState {
        created_at: 1_000,
        generation,
        last_upload_at: 1_000,
        last_applied_event_id: None,
        track: None,
        round: Some(Box::new(Round {
            start: 1_000,
            deadline: 1_500,
            max_wait_at: None,
            delay: 500,
            uploads: 1,
            first_upload_at: Some(1_000),
            last_upload_at: Some(1_000),
            last_event_id: None,
            attributes: None,
            parts: vec![],
            event_ids: None,
            policy: None,
        })),
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
        last_event_id: None,
        attributes: None,
        event_ids: None,
    }
}

/// Commits `k` at `generation` with its timer, one owed emission numbered `generation`, and
/// the next offset `offset`.
fn commit(store: &mut PartitionStore, k: &SessionKey, generation: u64, offset: i64) {
    let mut batch = store.batch();
    batch.put(k, &state(generation)).unwrap();
    batch.set_timer(1_500 + generation as i64, k).unwrap();
    batch.push_outbox(&emission(generation)).unwrap();
    batch.set_offset(offset);
    batch.commit().unwrap();
}

#[test]
fn a_flush_on_the_writer_thread_counts_only_once_it_is_seen_written() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    store.record_changes(true);
    commit(&mut store, &key("a"), 1, 10);
    assert!(store.start_flush().unwrap());
    assert!(store.write_in_flight());
    // Written or not by now, nothing of it counts before it is seen done.
    assert_eq!(store.stored_offset(), None);
    assert!(store.outbox_peek(10).unwrap().is_empty());
    assert!(store.take_changes().is_empty());
    assert!(
        store.pending_changes() > 0,
        "the write in flight has changes"
    );
    assert!(!store.unflushed(), "its keys were taken into the write");
    let done = store.wait_flush().unwrap().expect("a write was in flight");
    assert_eq!(done.report.sessions, 1);
    assert_eq!(done.report.outbox_puts, 1);
    assert!(!store.write_in_flight());
    assert_eq!(store.stored_offset(), Some(10));
    let owed = store.outbox_peek(10).unwrap();
    assert_eq!(owed.len(), 1);
    assert_eq!(owed[0].emission, emission(1));
    assert!(!store.take_changes().is_empty());
    assert_eq!(store.wait_flush().unwrap(), None, "seen once");
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.stored_offset(), Some(10));
    assert_eq!(store.session(&key("a")).unwrap(), Some(state(1)));
    assert_eq!(store.outbox_len(), 1);
}

#[test]
fn one_write_at_a_time_and_commits_made_while_it_is_in_flight_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    commit(&mut store, &key("a"), 1, 10);
    assert!(store.start_flush().unwrap());
    // While it is in flight: the same key again, and a new one.
    commit(&mut store, &key("a"), 2, 11);
    commit(&mut store, &key("b"), 3, 12);
    assert!(store.unflushed());
    assert!(
        !store.start_flush().unwrap(),
        "one write in flight at a time"
    );
    // Polled until done (the writer thread answers on its own time).
    let done = loop {
        if let Some(done) = store.poll_flush().unwrap() {
            break done;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    assert_eq!(done.report.sessions, 1);
    assert_eq!(store.stored_offset(), Some(10));
    assert_eq!(
        store.outbox_peek(10).unwrap().len(),
        1,
        "only the first write's entry"
    );
    assert!(store.start_flush().unwrap());
    let done = store.wait_flush().unwrap().unwrap();
    assert_eq!(done.report.sessions, 2);
    assert_eq!(done.report.outbox_puts, 2);
    assert_eq!(store.stored_offset(), Some(12));
    let seqs: Vec<u64> = store
        .outbox_peek(10)
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seqs, vec![0, 1, 2]);
    // Acknowledged entries, deleted with the next flush.
    assert_eq!(store.outbox_ack(&seqs).unwrap(), 3);
    assert!(store.start_flush().unwrap());
    assert_eq!(
        store.wait_flush().unwrap().unwrap().report.outbox_deletes,
        3
    );
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.session(&key("a")).unwrap(), Some(state(2)));
    assert_eq!(store.session(&key("b")).unwrap(), Some(state(3)));
    assert_eq!(store.outbox_len(), 0);
    assert_eq!(store.stored_offset(), Some(12));
    let timers = store.timers(10).unwrap();
    assert_eq!(timers, vec![(1_502, key("a")), (1_503, key("b"))]);
}

#[test]
fn a_store_dropped_with_a_write_in_flight_finishes_it_before_it_closes() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    commit(&mut store, &key("a"), 1, 10);
    assert!(store.start_flush().unwrap());
    drop(store);
    // Reopened at once: the writer thread finished the write and let the database go.
    let store = open(dir.path());
    assert_eq!(store.stored_offset(), Some(10));
    assert_eq!(store.outbox_len(), 1);
}

#[test]
fn a_failed_flush_on_the_writer_path_leaves_the_last_durable_state() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = open(dir.path());
    commit(&mut store, &key("a"), 1, 10);
    store.flush().unwrap();
    commit(&mut store, &key("a"), 2, 11);
    commit(&mut store, &key("b"), 3, 12);
    store.fail_next_commits(1);
    assert!(store.start_flush().is_err());
    assert!(!store.write_in_flight());
    assert!(!store.unflushed(), "memory is the durable state again");
    assert_eq!(store.stored_offset(), Some(10));
    assert_eq!(store.session(&key("a")).unwrap(), Some(state(1)));
    assert_eq!(store.session(&key("b")).unwrap(), None);
    assert_eq!(store.outbox_len(), 1);
}
