//! The partition store: one RocksDB database per owned partition, at
//! `<data-dir>/<topic>/<partition>` ([`partition_path`]), with the partition's state in
//! memory in front of it (store v2: "memory first, RocksDB behind", ARCHITECTURE § Partition
//! state). It holds everything the partition task needs to resume after a crash (SEMANTICS
//! §6): per-key state with its timer, owed emissions (outbox), the applied input offset and
//! the partition time (§3).
//!
//! The partition task owns its [`PartitionStore`] (single writer, no locks). Per input batch
//! it opens a [`Batch`], runs `engine::Driver` through it (the batch implements
//! `engine::SessionTable`), pushes the emissions to the outbox, sets offset and partition
//! time, and [`Batch::commit`]s: the batch is applied to memory at once (sessions, the timer
//! index, the outbox, counters). What reaches RocksDB, and when:
//!
//! * **Write-through** (the default of a store opened alone, e.g. by tests and tools): every
//!   commit and every [`PartitionStore::outbox_ack`] is also ONE RocksDB write before it
//!   returns.
//! * **Write-behind** (the runtime, [`PartitionStore::set_write_behind`]): commits change
//!   memory only; [`PartitionStore::flush`] writes everything changed since the last flush —
//!   each dirty key's latest value, the new outbox entries, the deletes of acknowledged ones,
//!   the tenants' statistics, the offset, partition time and counters — as ONE RocksDB write
//!   batch. A 700-way burst into one session between two flushes is one write of one key.
//!   Only flushed outbox entries are handed out ([`PartitionStore::outbox_peek_from`]) and
//!   [`PartitionStore::stored_offset`] is the flushed offset, so an emission is published
//!   only once the state that produced it is durable, and the input offset committed to the
//!   broker never passes what is durable: a crash re-reads the input since the last flush
//!   and decides the same emissions again (durable first, then visible; STYLE §3).
//! * **Write-behind off the partition's thread** (the runtime, at-least-once):
//!   [`PartitionStore::start_flush`] builds the same one write batch and hands it to the
//!   store's writer thread; the partition task goes on deciding, and the write counts (offset,
//!   outbox entries handed out, changes for the changelog, eviction) only once
//!   [`PartitionStore::poll_flush`] sees it done. One write in flight at a time.
//!
//! A flush evicts clean sessions past the budget once it is written, unless eviction is
//! deferred ([`PartitionStore::set_deferred_eviction`], the runtime): then the runtime calls
//! [`PartitionStore::evict`] itself, after it handed the flush's emissions out (eviction is
//! not on their way to the broker), and each call does a bounded share of the work; a write
//! of the writer thread seen done also does a share (no entry is evicted while a write that
//! holds it is in flight, and a partition catching up has one in flight most of the time).
//!
//! Sessions are cached in memory up to a process-wide budget ([`MemoryBudget`],
//! `store.session-cache`), evicted least recently used when clean and read back on a miss;
//! the timer index and the outbox are wholly in memory (`mem`), rebuilt by one scan at
//! open. A failed write (an error of [`PartitionStore::flush`] or of a write-through commit)
//! reloads the memory from RocksDB: the store is then exactly its last durable state.
//!
//! # Layout (format 2)
//!
//! Column families, not key prefixes: each has its own access pattern and so its own
//! options (bloom filter for point lookups on `sessions`; early compaction of
//! tombstone-dense files of the `outbox` queue). A RocksDB write batch is atomic across the
//! column families of a database, and they flush together (`atomic_flush`).
//!
//! | column family | key | value |
//! |---|---|---|
//! | `sessions` | session key bytes (`tenant/session`, UTF-8) | the key's timer (`0x01 ‖ encode_due(due)`, or `0x00` for none) ‖ `SessionState` (postcard) ‖ for an open round, its trailer (tagged fields: the round's policy, its event ids) |
//! | `outbox` | sequence number, u64 big-endian (FIFO) | `Emission`, postcard ‖ for an emission with event ids, its trailer (the same tagged field) |
//! | `meta` | ASCII name, see below | 8 bytes big-endian |
//! | `tenants` | tenant name (UTF-8) | `TenantStats` (learned-delay intervals, `engine::learn`), postcard |
//!
//! `meta` keys: `format_version` ([`FORMAT_VERSION`]), `offset` (i64, the applied input
//! offset), `partition_time` (i64 ms), `outbox_next_seq`, `outbox_head` (no owed emission
//! below it), `outbox_len`, `sessions` (keys with state), `open_rounds` (keys with an open
//! round). A store of format 1 (timers in a column family of their own) is refused at open
//! with what to do.
//!
//! Trailers (`keys::encode_session_into`) add fields without a new format: a value written
//! before a field existed reads with the field at its default (a round or emission from
//! before event ids has none), and an older settle reads a newer value without the fields it
//! does not know.
//!
//! # Invariants
//!
//! * Every key with state has exactly one timer, `engine::Engine::next_due` of its state;
//!   the driver keeps it so, and the store keeps at most one per key (setting one replaces
//!   the previous). State expiry (`state-ttl`) is one of those timers, so expired keys are
//!   deleted when their timer fires through the driver; no separate TTL sweep.
//! * The counters in `meta` (`sessions`, `open_rounds`, `outbox_len`) are written in the same
//!   write batch as the records they describe.
//! * Every store error is fatal for the partition (see [`Error`]).
//! * `tenants` holds at most `engine::MAX_LEARNED_TENANTS` entries: a batch storing a new
//!   tenant beyond that deletes the least recently seen one (the `SessionTable` rule).

mod batch;
pub mod changelog;
mod error;
mod evicted;
mod keys;
mod mem;
mod options;

pub use batch::Batch;
pub use changelog::{changelog_key, split_changelog_key, Change};
pub use error::Error;
pub use keys::{decode_due, encode_due, outbox_key, FORMAT_VERSION};
pub use mem::{CacheBudget, TenantTimers};
pub use options::{MemoryBudget, StoreOptions};

use crate::engine::{Emission, Millis, SessionKey, SessionState, TenantStats};
use keys::{
    CF_META, CF_OUTBOX, CF_SESSIONS, CF_TENANTS, CF_TIMERS_V1, COLUMN_FAMILIES,
    META_FORMAT_VERSION, META_OFFSET, META_OPEN_ROUNDS, META_OUTBOX_HEAD, META_OUTBOX_LEN,
    META_OUTBOX_NEXT_SEQ, META_PARTITION_TIME, META_SESSIONS,
};
use mem::Mem;
use rocksdb::{ColumnFamily, WriteBatch, WriteOptions, DB};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `<data_dir>/<topic>/<partition>`: where the store of one partition lives.
pub fn partition_path(data_dir: &Path, topic: &str, partition: i32) -> PathBuf {
    data_dir.join(topic).join(partition.to_string())
}

/// One owed emission in the outbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxEntry {
    /// Sequence number: FIFO position, the number to pass to [`PartitionStore::outbox_ack`].
    pub seq: u64,
    /// The emission, as the engine decided it.
    pub emission: Emission,
}

/// The durable `meta` values, mirrored in memory; changed only after a successful write.
#[derive(Clone, Debug, Default)]
pub(crate) struct Meta {
    offset: Option<i64>,
    partition_time: Option<Millis>,
    next_seq: u64,
    outbox_len: u64,
    sessions: u64,
    open_rounds: u64,
}

/// What one [`PartitionStore::flush`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlushReport {
    /// Session keys written (puts and deletes).
    pub sessions: usize,
    /// Outbox entries written (new owed emissions) and deleted (acknowledged ones).
    pub outbox_puts: usize,
    /// See `outbox_puts`.
    pub outbox_deletes: usize,
    /// [`PartitionStore::flush`]: how long building the batch and RocksDB's write of it took
    /// (the eviction after it excluded); zero for a write of the writer thread
    /// ([`FlushDone::took`] has its time).
    pub took: std::time::Duration,
}

/// Everything of the store but the database handle (so a batch can borrow both apart).
pub(crate) struct StoreState {
    write_opts: WriteOptions,
    /// The durable values.
    meta: Meta,
    /// The in-memory state (`mem`), ahead of `meta` until the next flush.
    mem: Mem,
    /// Commits change memory only; [`PartitionStore::flush`] writes (module docs).
    write_behind: bool,
    /// Flushes leave eviction to [`PartitionStore::evict`] (`set_deferred_eviction`).
    defer_eviction: bool,
    /// An in-place (write-behind) batch changed memory and was not committed: memory may
    /// hold half a batch, so nothing more is written (`store::batch` module docs).
    stale: bool,
    fail_commits: u32,
    /// Writes are recorded as [`Change`]s for the changelog ([`PartitionStore::record_changes`]).
    recording: bool,
    /// Recorded changes not yet taken ([`PartitionStore::take_changes`]), in write order.
    changes: Vec<Change>,
    /// Local-only `changelog_dirty`, mirrored.
    changelog_dirty: bool,
    /// Local-only `changelog_next`, mirrored.
    changelog_next: Option<i64>,
    /// Local-only `writer_id`, mirrored (`None`: not chosen yet; chosen at the first
    /// recorded write).
    writer_id: Option<u64>,
}

/// What [`StoreState::stamp`] added to a write, applied to the state once it is stored.
pub(crate) struct Stamp {
    mark_dirty: bool,
    new_writer: Option<u64>,
}

impl StoreState {
    /// Errors: [`Error::Stale`] when a write-behind batch was dropped without commit.
    fn refuse_stale(&self) -> Result<(), Error> {
        if self.stale {
            return Err(Error::Stale);
        }
        Ok(())
    }

    /// When the write is recorded: adds `meta\0writer` (this store's writer id, chosen now
    /// if it has none) and, if the store was clean, the local dirty flag.
    pub(crate) fn stamp(&self, w: &mut changelog::Writes<'_>) -> Stamp {
        if !w.recording() {
            return Stamp {
                mark_dirty: false,
                new_writer: None,
            };
        }
        let new_writer = match self.writer_id {
            Some(_) => None,
            None => Some(rand::random::<u64>() | 1),
        };
        let id = self.writer_id.or(new_writer).unwrap_or(1);
        if let Some(n) = new_writer {
            w.put_local(changelog::META_WRITER_ID, &n.to_be_bytes());
        }
        w.put(CF_META, changelog::META_WRITER, &id.to_be_bytes());
        let mark_dirty = !self.changelog_dirty;
        if mark_dirty {
            w.put_local(changelog::META_CHANGELOG_DIRTY, &1u64.to_be_bytes());
        }
        Stamp {
            mark_dirty,
            new_writer,
        }
    }

    /// Applies `stamp` after its write was stored.
    pub(crate) fn stamped(&mut self, stamp: Stamp) {
        self.changelog_dirty |= stamp.mark_dirty;
        if stamp.new_writer.is_some() {
            self.writer_id = stamp.new_writer;
        }
    }
}

/// Writes what `state`'s memory holds beyond its durable `meta` in ONE RocksDB write (see
/// [`PartitionStore::flush`]), on the calling thread. On error the memory is reloaded from
/// `db`.
pub(crate) fn flush_state(db: &DB, state: &mut StoreState) -> Result<FlushReport, Error> {
    state.refuse_stale()?;
    if !state.mem.unflushed() {
        return Ok(FlushReport::default());
    }
    // Measured, not decided on: how long the flush held its caller (the runtime paces
    // early flushes by it).
    let started = std::time::Instant::now();
    let written = prepare(db, state).and_then(|(wb, p)| {
        db.write_opt(wb, &state.write_opts).map_err(Error::Write)?;
        Ok(p)
    });
    let took = started.elapsed();
    match written {
        Ok(p) => {
            state.mem.sealed();
            Ok(FlushReport {
                took,
                ..state.written(p)
            })
        }
        Err(e) => Err(state.failed(db, e)),
    }
}

/// A flush's write, built: what the store becomes once RocksDB holds it.
pub(crate) struct Prepared {
    /// The changelog records of the write.
    recorded: Vec<Change>,
    stamp: Stamp,
    report: FlushReport,
    /// The durable `meta` values after the write.
    meta: Meta,
    /// Outbox entries below this sequence number are in the write.
    seq: u64,
}

impl StoreState {
    /// The write `p` is stored: its values are the durable ones, its outbox entries may be
    /// published, its changes go to the changelog, and clean sessions past the budget are
    /// evicted (only now: an entry evicted while its write is in flight would be read back
    /// stale).
    fn written(&mut self, mut p: Prepared) -> FlushReport {
        self.changes.append(&mut p.recorded);
        self.stamped(p.stamp);
        self.meta = p.meta;
        self.mem.durable(p.seq);
        if !self.defer_eviction {
            self.mem.evict(false);
        }
        p.report
    }

    /// A flush's write failed with `e`: the memory is ahead of what RocksDB holds and the
    /// write is lost, so the memory becomes the durable state again (what a restart would
    /// see). Returns `e`, or the error of that reload.
    fn failed(&mut self, db: &DB, e: Error) -> Error {
        self.changes.clear();
        match reload(db, self) {
            Ok(()) => e,
            Err(reload_error) => reload_error,
        }
    }
}

/// Builds the ONE RocksDB write batch of a flush from what `state`'s memory holds beyond
/// its durable `meta`. Changes nothing in `state` but the dirty flags of the entries it
/// takes (their key list is cleared by `Mem::sealed` once the batch is handed on; on an
/// error the caller reloads memory from RocksDB).
///
/// Errors: [`Error::Encode`], [`Error::InjectedFault`].
fn prepare(db: &DB, state: &mut StoreState) -> Result<(WriteBatch, Prepared), Error> {
    let mut recorded = Vec::new();
    // ~100 bytes a session (key, timer, state, record header), ~200 an owed emission.
    let bytes = 100 * state.mem.dirty.len()
        + 200 * (state.mem.current.next_seq - state.mem.written_seq) as usize
        + 32 * state.mem.acked.len()
        + 1024;
    let mut w =
        changelog::Writes::with_capacity(db, state.recording.then_some(&mut recorded), bytes);
    let mem = &mut state.mem;
    let mut report = FlushReport::default();
    // Changelog order (see `store::changelog`): outbox, then sessions, tenants, meta. Every
    // column family's writes go in key order: RocksDB inserts them into its memtable (a
    // skip list) starting from where the previous insert ended, far cheaper for ascending
    // keys than for hash order.
    let mut buf = Vec::with_capacity(256);
    for (seq, emission) in mem.outbox.range(mem.written_seq, u64::MAX) {
        buf = keys::encode_emission_into(emission, buf)?;
        w.put(CF_OUTBOX, &keys::outbox_key(seq), &buf);
        report.outbox_puts += 1;
    }
    mem.acked.sort_unstable();
    // Every entry below the outbox's head is acknowledged: one range tombstone deletes the
    // ones acknowledged since the last flush (`deleted_below` is the head that flush left);
    // entries acknowledged out of order above the head are deleted one by one.
    let head = mem.outbox.first_seq().unwrap_or(mem.current.next_seq);
    let below = mem.acked.partition_point(|&seq| seq < head);
    if below > 0 {
        let from = mem.deleted_below.min(mem.acked[0]);
        w.delete_range(
            CF_OUTBOX,
            &keys::outbox_key(from),
            &keys::outbox_key(head),
            mem.acked[..below].iter().map(|&seq| keys::outbox_key(seq)),
        );
        report.outbox_deletes += below;
    }
    for &seq in &mem.acked[below..] {
        w.delete(CF_OUTBOX, &keys::outbox_key(seq));
        report.outbox_deletes += 1;
    }
    mem.deleted_below = mem.deleted_below.max(head);
    // Taken out for the loop (which changes the entries), put back empty after it: its
    // allocation serves the next flush.
    let mut dirty = std::mem::take(&mut mem.dirty);
    {
        let mem = &*mem;
        sort_in_key_order(&mut dirty, |&i| mem.slot_key(i).as_str());
    }
    for &i in &dirty {
        // Marked clean here rather than in a second pass by `Mem::sealed`: if this write
        // fails, memory is reloaded from RocksDB anyway.
        let (key, Some(entry)) = mem.slot_mut(i) else {
            continue;
        };
        entry.dirty = false;
        match &entry.state {
            Some(s) => {
                buf = keys::encode_session_into(entry.due, s, buf)?;
                w.put(CF_SESSIONS, key.as_str().as_bytes(), &buf);
            }
            None => w.delete(CF_SESSIONS, key.as_str().as_bytes()),
        }
        report.sessions += 1;
    }
    dirty.clear();
    mem.dirty = dirty;
    let mut tenants: Vec<&Box<str>> = mem.dirty_tenants.iter().collect();
    tenants.sort_unstable();
    for name in tenants {
        match mem.tenants.get(name) {
            Some(stats) => {
                buf = keys::encode_tenant_into(stats, buf)?;
                w.put(CF_TENANTS, name.as_bytes(), &buf);
            }
            None => w.delete(CF_TENANTS, name.as_bytes()),
        }
    }
    let meta = &state.meta;
    let cur = &mem.current;
    let outbox_len = mem.outbox.len() as u64;
    let mut put_u64 = |key: &[u8], old: u64, new: u64| {
        if old != new {
            w.put(CF_META, key, &new.to_be_bytes());
        }
    };
    put_u64(META_OUTBOX_NEXT_SEQ, meta.next_seq, cur.next_seq);
    put_u64(META_OUTBOX_LEN, meta.outbox_len, outbox_len);
    put_u64(META_SESSIONS, meta.sessions, cur.sessions);
    put_u64(META_OPEN_ROUNDS, meta.open_rounds, cur.open_rounds);
    if report.outbox_deletes > 0 || report.outbox_puts > 0 {
        w.put(CF_META, META_OUTBOX_HEAD, &head.to_be_bytes());
    }
    if let Some(t) = cur.partition_time.filter(|_| cur.position_dirty) {
        w.put(CF_META, META_PARTITION_TIME, &t.to_be_bytes());
    }
    // The offset last: a changelog cut inside this write never holds an offset past state
    // it misses.
    if let Some(o) = cur.offset.filter(|_| cur.position_dirty) {
        w.put(CF_META, META_OFFSET, &o.to_be_bytes());
    }
    let stamp = state.stamp(&mut w);
    if state.fail_commits > 0 {
        state.fail_commits -= 1;
        return Err(Error::InjectedFault);
    }
    let changelog::Writes { wb, .. } = w;
    let cur = &state.mem.current;
    let prepared = Prepared {
        recorded,
        stamp,
        report,
        meta: Meta {
            offset: cur.offset,
            partition_time: cur.partition_time,
            next_seq: cur.next_seq,
            outbox_len,
            sessions: cur.sessions,
            open_rounds: cur.open_rounds,
        },
        seq: cur.next_seq,
    };
    Ok((wb, prepared))
}

/// Sorts `items` by `key` in byte order (RocksDB's), comparing the keys' first 16 bytes as
/// one integer first: most session keys are shorter, so most comparisons are one integer
/// compare rather than a string compare. The integers are computed once per item.
fn sort_in_key_order<'a, T: Copy>(items: &mut [T], key: impl Fn(&T) -> &'a str) {
    fn prefix(s: &str) -> u128 {
        let mut b = [0u8; 16];
        let s = s.as_bytes();
        let n = s.len().min(16);
        b[..n].copy_from_slice(&s[..n]);
        u128::from_be_bytes(b)
    }
    let mut keyed: Vec<(u128, T)> = items.iter().map(|t| (prefix(key(t)), *t)).collect();
    // A prefix padded with zeros sorts as the bytes do, except that "a" and "a\0" tie:
    // ties fall back to the whole key.
    keyed.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| key(&a.1).cmp(key(&b.1))));
    for (item, (_, t)) in items.iter_mut().zip(keyed) {
        *item = t;
    }
}

/// What one flush written on the store's writer thread did
/// ([`PartitionStore::poll_flush`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlushDone {
    /// What it wrote.
    pub report: FlushReport,
    /// How long RocksDB took to write it (the writer thread's time, queueing excluded).
    pub took: std::time::Duration,
}

/// The write of a flush handed to the writer thread, not done yet.
struct InFlight {
    prepared: Prepared,
}

/// The store's writer thread: takes one write batch at a time, writes it, answers with the
/// result and the time it took. Ends when the store drops its sender.
struct Writer {
    batches: Option<std::sync::mpsc::SyncSender<WriteBatch>>,
    done: std::sync::mpsc::Receiver<(Result<(), rocksdb::Error>, std::time::Duration)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn start(db: Arc<DB>, opts: WriteOptions, path: &Path) -> Result<Self, Error> {
        let (batches, rx) = std::sync::mpsc::sync_channel::<WriteBatch>(1);
        let (tx, done) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("settle-store-writer".into())
            .spawn(move || {
                for wb in rx {
                    let started = std::time::Instant::now();
                    let result = db.write_opt(wb, &opts);
                    if tx.send((result, started.elapsed())).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| Error::Open {
                path: path.to_path_buf(),
                reason: format!("cannot start the store's writer thread: {e}"),
            })?;
        Ok(Writer {
            batches: Some(batches),
            done,
            thread: Some(thread),
        })
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // The thread finishes the write it has (if any), sees the channel closed, and ends;
        // joined so the database is closed once the store is dropped (it may be reopened
        // right after, e.g. a partition assigned back).
        self.batches = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads the durable `meta` values and the local changelog bookkeeping, and rebuilds the
/// memory from RocksDB (module docs): one scan of `sessions` (timer index; states cached
/// while the budget has room), the outbox and the tenants.
fn reload(db: &DB, state: &mut StoreState) -> Result<(), Error> {
    let as_i64 = |v: Option<u64>| v.map(|v| v as i64);
    let meta = Meta {
        offset: as_i64(meta_u64(db, META_OFFSET)?),
        partition_time: as_i64(meta_u64(db, META_PARTITION_TIME)?),
        next_seq: meta_u64(db, META_OUTBOX_NEXT_SEQ)?.unwrap_or(0),
        outbox_len: meta_u64(db, META_OUTBOX_LEN)?.unwrap_or(0),
        sessions: meta_u64(db, META_SESSIONS)?.unwrap_or(0),
        open_rounds: meta_u64(db, META_OPEN_ROUNDS)?.unwrap_or(0),
    };
    state.changelog_dirty = meta_u64(db, changelog::META_CHANGELOG_DIRTY)? == Some(1);
    state.changelog_next = as_i64(meta_u64(db, changelog::META_CHANGELOG_NEXT)?);
    state.writer_id = meta_u64(db, changelog::META_WRITER_ID)?;
    let mem = &mut state.mem;
    mem.clear();
    mem.current = mem::Current {
        offset: meta.offset,
        partition_time: meta.partition_time,
        next_seq: meta.next_seq,
        sessions: meta.sessions,
        open_rounds: meta.open_rounds,
        position_dirty: false,
    };
    mem.durable_seq = meta.next_seq;
    mem.written_seq = meta.next_seq;
    mem.deleted_below = meta_u64(db, META_OUTBOX_HEAD)?.unwrap_or(0);

    // One pass over every stored session: its blocks are not kept in the block cache (they
    // would fill it with what the cached sessions already hold, and take memory from the
    // reads of evicted sessions that follow).
    let mut scan = rocksdb::ReadOptions::default();
    scan.fill_cache(false);
    scan.set_readahead_size(2 * 1024 * 1024);
    let mut it = db.raw_iterator_cf_opt(cf(db, CF_SESSIONS), scan);
    it.seek_to_first();
    let mut full = false;
    while let (Some(k), Some(v)) = (it.key(), it.value()) {
        let key = keys::stored_session_key(k)?;
        let (due, _) = keys::session_due(k, v)?;
        if let Some(d) = due {
            mem.load_timer(d, &key);
        }
        // Cached in key order while the budget has room; the rest is evicted from the start
        // (its timer and the fact that it has state are kept, 32 bytes a key).
        let mut cached = false;
        if !full {
            let (_, s) = keys::decode_session(k, v)?;
            if mem.has_room(Mem::bytes_of(&key, &s)) {
                mem.insert_clean(&key, Some(s), due);
                cached = true;
            } else {
                full = true;
            }
        }
        if !cached {
            mem.load_evicted(key, due);
        }
        it.next();
    }
    it.status().map_err(read_error(CF_SESSIONS))?;
    drop(it);

    let head = meta_u64(db, META_OUTBOX_HEAD)?.unwrap_or(0);
    let mut it = db.raw_iterator_cf(cf(db, CF_OUTBOX));
    it.seek(keys::outbox_key(head));
    while let (Some(k), Some(v)) = (it.key(), it.value()) {
        let seq = keys::decode_outbox_key(k).map_err(|reason| Error::Corrupt {
            cf: CF_OUTBOX,
            key: keys::printable(k),
            reason,
        })?;
        mem.outbox.push(seq, keys::decode_emission(k, v)?);
        it.next();
    }
    it.status().map_err(read_error(CF_OUTBOX))?;
    drop(it);

    let mut it = db.raw_iterator_cf(cf(db, CF_TENANTS));
    it.seek_to_first();
    while let (Some(k), Some(v)) = (it.key(), it.value()) {
        let name = std::str::from_utf8(k).map_err(|e| Error::Corrupt {
            cf: CF_TENANTS,
            key: keys::printable(k),
            reason: format!("tenant name is not UTF-8: {e}"),
        })?;
        let stats = keys::decode_tenant(k, v)?;
        mem.ages.touch(name, stats.last_seen);
        mem.tenants.insert(name.into(), stats);
        it.next();
    }
    it.status().map_err(read_error(CF_TENANTS))?;
    state.meta = meta;
    Ok(())
}

/// The error of a failed RocksDB read (or scan) in column family `cf`.
fn read_error(cf: &'static str) -> impl Fn(rocksdb::Error) -> Error {
    move |source| Error::Read { cf, source }
}

fn meta_raw(db: &DB, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
    db.get_cf(cf(db, CF_META), key)
        .map_err(|source| Error::Read {
            cf: CF_META,
            source,
        })
}

fn meta_u64(db: &DB, key: &[u8]) -> Result<Option<u64>, Error> {
    meta_raw(db, key)?
        .map(|v| keys::decode_meta_u64(key, &v))
        .transpose()
}

/// The RocksDB store of one partition with its in-memory state (see the module docs for
/// layout, modes and invariants). Owned by the partition task; `Send`, not shared.
pub struct PartitionStore {
    // Field order is drop order: the writer thread ends (and drops its handle) before the
    // store's own handle closes the database.
    writer: Option<Writer>,
    in_flight: Option<InFlight>,
    db: Arc<DB>,
    path: PathBuf,
    state: StoreState,
    /// The options it was opened with (the writer thread's write options come from them).
    options: StoreOptions,
}

impl std::fmt::Debug for PartitionStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionStore")
            .field("path", &self.path)
            .field("meta", &self.state.meta)
            .finish()
    }
}

impl PartitionStore {
    /// Opens (creating if missing, directories included) the store at `path` with its own
    /// [`MemoryBudget`], in write-through mode. A process owning several partitions should
    /// share one budget through [`PartitionStore::open_with_budget`]. Reads the whole store
    /// into memory (the timer index and outbox; sessions up to the budget).
    ///
    /// Errors: [`Error::Open`], [`Error::Format`] (written by another layout version),
    /// [`Error::Read`] / [`Error::Corrupt`] reading it, [`Error::Write`] initialising it.
    pub fn open(path: &Path, options: &StoreOptions) -> Result<Self, Error> {
        Self::open_with_budget(path, options, &MemoryBudget::new(options))
    }

    /// [`PartitionStore::open`] with a shared block cache, memtable and session-cache budget.
    pub fn open_with_budget(
        path: &Path,
        options: &StoreOptions,
        budget: &MemoryBudget,
    ) -> Result<Self, Error> {
        let open_err = |reason: String| Error::Open {
            path: path.to_path_buf(),
            reason,
        };
        std::fs::create_dir_all(path).map_err(|e| open_err(e.to_string()))?;
        refuse_format_1(path)?;
        let db = DB::open_cf_descriptors(
            &options::db_options(options, budget),
            path,
            options::column_families(options, budget),
        )
        .map_err(|e| open_err(e.into_string()))?;
        if meta_u64(&db, META_FORMAT_VERSION)?.is_none() {
            let mut wb = WriteBatch::default();
            wb.put_cf(
                cf(&db, CF_META),
                META_FORMAT_VERSION,
                FORMAT_VERSION.to_be_bytes(),
            );
            db.write_opt(wb, &options::write_options(options))
                .map_err(Error::Write)?;
        }
        Self::from_db(db, path, options, budget)
    }

    /// Opens an existing store read-only (for `settle inspect` next to a running processor:
    /// it takes no lock and sees the store as of opening). Every write ([`Batch::commit`],
    /// [`PartitionStore::outbox_ack`], [`PartitionStore::flush`]) fails with [`Error::Write`].
    ///
    /// Errors: [`Error::Open`] (also when no store exists at `path`), [`Error::Format`].
    pub fn open_read_only(path: &Path, options: &StoreOptions) -> Result<Self, Error> {
        let budget = MemoryBudget::new(options);
        refuse_format_1(path)?;
        let db = DB::open_cf_descriptors_read_only(
            &options::db_options(options, &budget),
            path,
            options::column_families(options, &budget),
            false,
        )
        .map_err(|e| Error::Open {
            path: path.to_path_buf(),
            reason: e.into_string(),
        })?;
        Self::from_db(db, path, options, &budget)
    }

    fn from_db(
        db: DB,
        path: &Path,
        options: &StoreOptions,
        budget: &MemoryBudget,
    ) -> Result<Self, Error> {
        if let Some(missing) = COLUMN_FAMILIES.iter().find(|n| db.cf_handle(n).is_none()) {
            return Err(Error::Open {
                path: path.to_path_buf(),
                reason: format!("column family {missing} missing"),
            });
        }
        match meta_u64(&db, META_FORMAT_VERSION)? {
            Some(FORMAT_VERSION) | None => {}
            Some(found) => {
                return Err(Error::Format {
                    path: path.to_path_buf(),
                    found,
                    expected: FORMAT_VERSION,
                })
            }
        }
        let mut store = PartitionStore {
            writer: None,
            in_flight: None,
            db: Arc::new(db),
            options: options.clone(),
            path: path.to_path_buf(),
            state: StoreState {
                write_opts: options::write_options(options),
                meta: Meta::default(),
                mem: Mem::new(budget.sessions.clone()),
                write_behind: false,
                defer_eviction: false,
                stale: false,
                fail_commits: 0,
                recording: false,
                changes: Vec::new(),
                changelog_dirty: false,
                changelog_next: None,
                writer_id: None,
            },
        };
        reload(&store.db, &mut store.state)?;
        Ok(store)
    }

    /// The store directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Write-behind mode on (the runtime) or off (write-through; the default): see the module
    /// docs. Turning it off flushes what is owed first.
    ///
    /// Errors: those of [`PartitionStore::flush`].
    pub fn set_write_behind(&mut self, on: bool) -> Result<(), Error> {
        if !on {
            self.flush()?;
        }
        self.state.write_behind = on;
        Ok(())
    }

    /// Writes everything committed to memory since the last flush — each changed key's
    /// latest state and timer, new outbox entries, deletes of acknowledged ones, tenants'
    /// statistics, offset, partition time, counters — in ONE RocksDB write batch, recorded
    /// for the changelog when recording. Then evicts clean sessions past the budget, unless
    /// eviction is deferred ([`PartitionStore::set_deferred_eviction`]). Does nothing when
    /// nothing is owed.
    ///
    /// Errors: [`Error::Write`], [`Error::InjectedFault`], [`Error::Encode`]: nothing is
    /// stored, and the memory is reloaded from RocksDB (the store is its last durable
    /// state); a [`Error::Read`]/[`Error::Corrupt`] of that reload.
    /// A write started by [`PartitionStore::start_flush`] is waited for first.
    pub fn flush(&mut self) -> Result<FlushReport, Error> {
        self.wait_flush()?;
        flush_state(&self.db, &mut self.state)
    }

    /// Write-behind off the caller's thread: builds the flush's ONE write batch (as
    /// [`PartitionStore::flush`] would write it) and hands it to the store's writer thread
    /// (started at the first call), then returns at once. The sessions it holds are clean
    /// from now on (a later change makes them dirty again, for the next flush), but nothing
    /// of it counts as durable — [`PartitionStore::stored_offset`], the outbox entries
    /// handed out, the changes for the changelog, eviction — until
    /// [`PartitionStore::poll_flush`] or [`PartitionStore::wait_flush`] sees it written. One
    /// write at a time: returns `Ok(false)` without doing anything while one is in flight,
    /// or when nothing is owed.
    ///
    /// Errors: [`Error::Encode`], [`Error::InjectedFault`] (the memory is reloaded from
    /// RocksDB, as for a failed [`PartitionStore::flush`]); [`Error::Open`] when the writer
    /// thread cannot be started.
    pub fn start_flush(&mut self) -> Result<bool, Error> {
        self.state.refuse_stale()?;
        if self.in_flight.is_some() || !self.state.mem.unflushed() {
            return Ok(false);
        }
        if self.writer.is_none() {
            let opts = options::write_options(&self.options);
            self.writer = Some(Writer::start(Arc::clone(&self.db), opts, &self.path)?);
        }
        let (wb, prepared) = match prepare(&self.db, &mut self.state) {
            Ok(p) => p,
            Err(e) => return Err(self.state.failed(&self.db, e)),
        };
        let writer = self.writer.as_ref().expect("started above");
        let sent = writer.batches.as_ref().map(|b| b.send(wb));
        if !matches!(sent, Some(Ok(()))) {
            let e = Error::Open {
                path: self.path.clone(),
                reason: "the store's writer thread has stopped".into(),
            };
            return Err(self.state.failed(&self.db, e));
        }
        self.state.mem.sealed();
        self.in_flight = Some(InFlight { prepared });
        Ok(true)
    }

    /// True while a write started by [`PartitionStore::start_flush`] is not seen done.
    pub fn write_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// The write started by [`PartitionStore::start_flush`], if it is done now (does not
    /// wait): `Some` once, when it is; its outbox entries, offset and changes are then the
    /// durable ones.
    ///
    /// Errors: [`Error::Write`] when RocksDB refused it: nothing of it is stored, and the
    /// memory is reloaded from RocksDB (also losing what was committed after it: the store
    /// is its last durable state); the error of that reload.
    pub fn poll_flush(&mut self) -> Result<Option<FlushDone>, Error> {
        self.finish_flush(false)
    }

    /// [`PartitionStore::poll_flush`], waiting for the write in flight if there is one.
    pub fn wait_flush(&mut self) -> Result<Option<FlushDone>, Error> {
        self.finish_flush(true)
    }

    fn finish_flush(&mut self, wait: bool) -> Result<Option<FlushDone>, Error> {
        use std::sync::mpsc::TryRecvError;
        if self.in_flight.is_none() {
            return Ok(None);
        }
        let Some(writer) = self.writer.as_ref() else {
            return Ok(None);
        };
        let answer = if wait {
            writer.done.recv().map_err(|_| TryRecvError::Disconnected)
        } else {
            writer.done.try_recv()
        };
        let (result, took) = match answer {
            Ok(a) => a,
            Err(TryRecvError::Empty) => return Ok(None),
            Err(TryRecvError::Disconnected) => {
                self.in_flight = None;
                let e = Error::Open {
                    path: self.path.clone(),
                    reason: "the store's writer thread stopped before answering".into(),
                };
                return Err(self.state.failed(&self.db, e));
            }
        };
        let InFlight { prepared } = self.in_flight.take().expect("checked above");
        match result {
            Ok(()) => {
                let report = self.state.written(prepared);
                if self.state.defer_eviction {
                    // Nothing is in flight now: every clean entry is in RocksDB. A
                    // partition catching up starts its next write at once, so this may be
                    // eviction's only chance before it (a share, as `evict` does).
                    self.state.mem.evict(true);
                }
                Ok(Some(FlushDone { report, took }))
            }
            Err(e) => Err(self.state.failed(&self.db, Error::Write(e))),
        }
    }

    /// True when memory holds changes not yet flushed.
    pub fn unflushed(&self) -> bool {
        self.state.mem.unflushed()
    }

    /// Owed emissions committed since the last flush (not durable, so not handed out yet).
    pub fn unflushed_emissions(&self) -> u64 {
        let mem = &self.state.mem;
        mem.current.next_seq - mem.durable_seq
    }

    /// Keys changed since the last flush (the dirty-key cap `store.flush-max-dirty` is
    /// checked against it).
    pub fn dirty_keys(&self) -> usize {
        self.state.mem.dirty.len()
    }

    /// Bytes of session state this store holds in memory (approximate, as charged to the
    /// session-cache budget).
    pub fn cached_bytes(&self) -> usize {
        self.state.mem.charged()
    }

    /// Session keys cached in memory.
    pub fn cached_sessions(&self) -> usize {
        self.state.mem.cached_len()
    }

    /// Starts the changes of one input batch. Nothing changes until [`Batch::commit`].
    pub fn batch(&mut self) -> Batch<'_> {
        Batch::new(&self.db, &mut self.state)
    }

    /// The input offset stored by the last durable write that set one (`None`: never). In
    /// write-behind mode, the offset of the last flush: where a restart resumes.
    pub fn stored_offset(&self) -> Option<i64> {
        self.state.meta.offset
    }

    /// The partition time (ms, SEMANTICS §3) of the last durable write that set one.
    pub fn partition_time(&self) -> Option<Millis> {
        self.state.meta.partition_time
    }

    /// Keys with state (an open round or only a CallTrack waiting for its `state-ttl`), as
    /// of the last commit. O(1).
    pub fn session_count(&self) -> u64 {
        self.state.mem.current.sessions
    }

    /// Keys with an open round: the rounds still to be emitted or to end silently, as of the
    /// last commit. O(1).
    pub fn pending_rounds(&self) -> u64 {
        self.state.mem.current.open_rounds
    }

    /// Owed emissions (committed, not yet acknowledged by the sink; flushed or not). O(1).
    pub fn outbox_len(&self) -> u64 {
        self.state.mem.outbox.len() as u64
    }

    /// The state of `key` as of the last commit. Errors: [`Error::Read`], [`Error::Corrupt`].
    pub fn session(&self, key: &SessionKey) -> Result<Option<SessionState>, Error> {
        let mem = &self.state.mem;
        if let Some(e) = mem.entry(key) {
            return Ok(e.state.clone());
        }
        if !mem.is_evicted(key) {
            // Neither cached nor evicted: no state.
            return Ok(None);
        }
        Ok(batch::read_session(&self.db, key)?.map(|(_, s)| s))
    }

    /// Tenants with learned-delay statistics (at most `engine::MAX_LEARNED_TENANTS`). O(1).
    pub fn tenant_count(&self) -> usize {
        self.state.mem.tenants.len()
    }

    /// The learned-delay statistics of `tenant`. Errors: none today (kept for a store that
    /// pages tenants).
    pub fn tenant(&self, tenant: &str) -> Result<Option<TenantStats>, Error> {
        Ok(self.state.mem.tenants.get(tenant).cloned())
    }

    /// Every tenant's learned-delay statistics, by tenant name (at most
    /// `engine::MAX_LEARNED_TENANTS` entries). Errors: none today.
    pub fn tenants(&self) -> Result<Vec<(String, TenantStats)>, Error> {
        let mut out: Vec<(String, TenantStats)> = self
            .state
            .mem
            .tenants
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// The first `limit` timers `(due ms, key)` in firing order (copied and sorted from the
    /// timer queue: O(n log n), for tools and tests). Errors: none today.
    pub fn timers(&self, limit: usize) -> Result<Vec<(Millis, SessionKey)>, Error> {
        Ok(self.state.mem.timers(limit))
    }

    /// The committed timers with `due < before` (ms), grouped by tenant in the order of each
    /// tenant's first timer: per tenant its earliest `per_tenant` timers (at least 1) in
    /// `(due, key)` order, and whether it has more ([`TenantTimers::truncated`]). Walks the
    /// timer index up to `before` but copies at most `per_tenant` keys of each tenant, so a
    /// tenant's million-timer backlog costs `per_tenant` keys. The catch-up queue's source
    /// (SEMANTICS §3); inside a batch, [`Batch::overdue_timers`] sees the batch's writes.
    /// Errors: none today (kept for a store that pages its index).
    pub fn overdue_timers(
        &self,
        before: Millis,
        per_tenant: usize,
    ) -> Result<Vec<TenantTimers>, Error> {
        Ok(self.state.mem.overdue_timers(before, per_tenant))
    }

    /// The earliest timer `(due ms, key)`: when the partition task must wake next.
    pub fn next_timer(&self) -> Result<Option<(Millis, SessionKey)>, Error> {
        Ok(self.state.mem.next_timer())
    }

    /// The outbox sequence number below which every owed emission is durable (flushed): the
    /// next emission the store takes gets at least this number.
    pub fn durable_outbox_seq(&self) -> u64 {
        self.state.mem.durable_seq
    }

    /// The changelog record that claims this store's partition for its writer (`meta\0writer`
    /// = this store lineage's writer id, chosen and stored now if it has none): what a new
    /// owner appends at the end of a restore when the changelog is the fence
    /// (`transport::Sink::fences_by_changelog`).
    ///
    /// Errors: [`Error::Write`] when a new writer id cannot be stored.
    pub fn claim_change(&mut self) -> Result<Change, Error> {
        let id = match self.state.writer_id {
            Some(id) => id,
            None => {
                let id = rand::random::<u64>() | 1;
                self.db
                    .put_cf(
                        cf(&self.db, CF_META),
                        changelog::META_WRITER_ID,
                        id.to_be_bytes(),
                    )
                    .map_err(Error::Write)?;
                self.state.writer_id = Some(id);
                id
            }
        };
        Ok(Change {
            key: changelog_key(CF_META, changelog::META_WRITER),
            value: Some(id.to_be_bytes().to_vec()),
        })
    }

    /// The first `limit` owed durable emissions in FIFO order.
    pub fn outbox_peek(&mut self, limit: usize) -> Result<Vec<OutboxEntry>, Error> {
        self.outbox_peek_from(0, limit)
    }

    /// The first `limit` owed emissions with `seq ≥ from` that are durable (flushed), in
    /// FIFO order (lets a publisher with emissions in flight read past them). Errors: none
    /// today.
    pub fn outbox_peek_from(&mut self, from: u64, limit: usize) -> Result<Vec<OutboxEntry>, Error> {
        let mem = &self.state.mem;
        Ok(mem
            .outbox
            .range(from, mem.durable_seq.max(from))
            .take(limit)
            .map(|(seq, e)| OutboxEntry {
                seq,
                emission: e.clone(),
            })
            .collect())
    }

    /// Deletes the acknowledged emissions `seqs` (call only after the sink acknowledged
    /// them). Unknown or already acknowledged numbers are ignored. Write-through: one
    /// RocksDB write, counters included; write-behind: the deletes go with the next flush.
    /// Returns how many entries were deleted.
    ///
    /// Errors (write-through): those of [`PartitionStore::flush`].
    pub fn outbox_ack(&mut self, seqs: &[u64]) -> Result<usize, Error> {
        let mem = &mut self.state.mem;
        let mut deleted = 0;
        for &seq in seqs {
            if mem.outbox.remove(seq) {
                deleted += 1;
                if seq < mem.written_seq {
                    mem.acked.push(seq);
                }
            }
        }
        if deleted > 0 && !self.state.write_behind {
            self.flush()?;
        }
        Ok(deleted)
    }

    /// Flushes stop evicting (`true`; the runtime) or evict as they end (`false`, the
    /// default): with eviction deferred the caller runs [`PartitionStore::evict`] when it
    /// has handed a flush's emissions out, so a live partition's rounds never wait for an
    /// eviction sweep.
    pub fn set_deferred_eviction(&mut self, on: bool) {
        self.state.defer_eviction = on;
    }

    /// Evicts clean sessions, least recently used first, while the process's session-cache
    /// budget is exceeded (down to three quarters of it), visiting at most a few thousand
    /// cached entries per call while the cache is at most an eighth over its budget (the
    /// next call goes on from there): call it every loop turn with eviction deferred
    /// ([`PartitionStore::set_deferred_eviction`]). Only entries RocksDB holds go: nothing
    /// while a write started by [`PartitionStore::start_flush`] is not seen done (the
    /// entries it took are clean in memory but not in RocksDB yet; a miss would read their
    /// older state).
    pub fn evict(&mut self) {
        if self.in_flight.is_none() {
            self.state.mem.evict(true);
        }
    }

    /// Flushes RocksDB's memtables to disk (all column families together). Needed only with
    /// the WAL off, before a planned stop; closing the store flushes too. Does not write
    /// what memory owes: that is [`PartitionStore::flush`]. Errors: [`Error::Write`].
    pub fn flush_memtables(&self) -> Result<(), Error> {
        let cfs: Vec<&ColumnFamily> = COLUMN_FAMILIES.iter().map(|n| cf(&self.db, n)).collect();
        self.db
            .flush_cfs_opt(&cfs, &rocksdb::FlushOptions::default())
            .map_err(Error::Write)
    }

    /// Starts (or stops) recording every write as a [`Change`] for the changelog (see
    /// [`changelog`]). While recording, the first write after the store was in sync also
    /// marks it dirty (local `changelog_dirty`), in the same RocksDB write.
    pub fn record_changes(&mut self, on: bool) {
        self.state.recording = on;
    }

    /// The changes recorded since the last call, in write order (empty when not recording).
    /// The caller appends them to the changelog and, once the changelog acknowledged them
    /// and nothing newer was written, calls [`PartitionStore::changelog_synced`].
    pub fn take_changes(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.state.changes)
    }

    /// Recorded changes not taken yet.
    pub fn pending_changes(&self) -> usize {
        // A write in flight has changes too: they are taken once it is done.
        let in_flight = self
            .in_flight
            .as_ref()
            .map_or(0, |f| f.prepared.recorded.len());
        self.state.changes.len() + in_flight
    }

    /// The checkpoint: the changelog offset a restore continues from (every changelog record
    /// below it is in this store). `None`: never restored nor synced.
    pub fn changelog_checkpoint(&self) -> Option<i64> {
        self.state.changelog_next
    }

    /// True while the store holds writes not known to be in the changelog (set by the first
    /// write after a sync, cleared by [`PartitionStore::changelog_synced`]). A dirty store
    /// after a crash does not match any changelog prefix: the runtime wipes and restores it.
    pub fn changelog_dirty(&self) -> bool {
        self.state.changelog_dirty
    }

    /// Records that every write of this store is in the changelog below offset `next` (the
    /// offset after the last acknowledged record): stores the checkpoint and clears the dirty
    /// flag, in one local write. Call only when [`PartitionStore::pending_changes`] is 0 and
    /// every taken change was acknowledged.
    ///
    /// Errors: [`Error::Write`].
    pub fn changelog_synced(&mut self, next: i64) -> Result<(), Error> {
        debug_assert!(self.pending_changes() == 0);
        let mut w = changelog::Writes::new(&self.db, None);
        w.put_local(changelog::META_CHANGELOG_NEXT, &next.to_be_bytes());
        w.put_local(changelog::META_CHANGELOG_DIRTY, &0u64.to_be_bytes());
        w.write(&self.state.write_opts)?;
        self.state.changelog_next = Some(next);
        self.state.changelog_dirty = false;
        Ok(())
    }

    /// The fingerprint of the debounce rules this store was last opened under
    /// ([`PartitionStore::set_rules_stamp`]; `engine::PolicyTable::fingerprint`), `None`
    /// when never stamped (a new store, a store restored from a changelog, or one written
    /// before stores were stamped). Local: not on the changelog.
    ///
    /// Errors: [`Error::Read`], [`Error::Corrupt`].
    pub fn rules_stamp(&self) -> Result<Option<u64>, Error> {
        meta_u64(&self.db, changelog::META_RULES)
    }

    /// Stores `fingerprint` as the rules this store runs under, in one local write (not
    /// recorded for the changelog).
    ///
    /// Errors: [`Error::Write`].
    pub fn set_rules_stamp(&mut self, fingerprint: u64) -> Result<(), Error> {
        let mut w = changelog::Writes::new(&self.db, None);
        w.put_local(changelog::META_RULES, &fingerprint.to_be_bytes());
        w.write(&self.state.write_opts)
    }

    /// One bounded slice of a walk over the committed timers, for the admin's pending-work
    /// listing (SEMANTICS §7): calls `f(due ms, key, state)` for each of the next `n` live
    /// timers after `after` (exclusive; `None`: from the first) in `(due, key)` order, with
    /// the key's state (from memory, or one RocksDB read for an evicted key). Returns the
    /// cursor to continue from: the last timer visited when the slice was full, `None` when
    /// the walk reached the end. Between slices the queue may change (uploads move timers):
    /// a key can be seen twice or not at all across slices, never within one.
    ///
    /// `f` returns `false` to end the slice early (a time or row budget): the cursor is then
    /// the timer it was called with.
    ///
    /// Errors: [`Error::Read`], [`Error::Corrupt`] (reading an evicted key).
    pub fn timer_slice(
        &mut self,
        after: Option<&(Millis, SessionKey)>,
        n: usize,
        mut f: impl FnMut(Millis, &SessionKey, &SessionState) -> bool,
    ) -> Result<Option<(Millis, SessionKey)>, Error> {
        let timers = self.state.mem.timers_after(after, n);
        for (due, key) in &timers {
            if let Some(state) = self.session(key)? {
                if !f(*due, key, &state) {
                    return Ok(Some((*due, key.clone())));
                }
            }
        }
        Ok(if timers.len() >= n.max(1) {
            timers.last().cloned()
        } else {
            None
        })
    }

    /// Calls `f` with every open round durable in the store, with its key, in key order: one
    /// scan of `sessions` decoding each state (a second or so per million sessions; the
    /// runtime does it at start only when the rules changed). Reads RocksDB, not memory:
    /// call it before the first batch of a run, or after a flush. Returns the number of
    /// rounds seen.
    ///
    /// Errors: [`Error::Read`], [`Error::Corrupt`].
    pub fn scan_rounds(
        &self,
        mut f: impl FnMut(&SessionKey, &crate::engine::Round),
    ) -> Result<u64, Error> {
        let mut scan = rocksdb::ReadOptions::default();
        scan.fill_cache(false);
        scan.set_readahead_size(2 * 1024 * 1024);
        let mut it = self.db.raw_iterator_cf_opt(cf(&self.db, CF_SESSIONS), scan);
        it.seek_to_first();
        let mut rounds = 0u64;
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            let (_, state) = keys::decode_session(k, v)?;
            if let Some(round) = &state.round {
                f(&keys::stored_session_key(k)?, round);
                rounds += 1;
            }
            it.next();
        }
        it.status().map_err(read_error(CF_SESSIONS))?;
        Ok(rounds)
    }

    /// True when the store holds nothing durable: no input offset, no key, no outbox entry
    /// ever.
    pub fn is_empty(&self) -> bool {
        let m = &self.state.meta;
        m.offset.is_none() && m.sessions == 0 && m.next_seq == 0 && m.partition_time.is_none()
    }

    /// Applies changelog records `(changelog offset, change)` in one RocksDB write and moves
    /// the checkpoint past the last one (the store stays clean: it equals the changelog below
    /// the checkpoint). Records must come in changelog order; a restore applies the
    /// changelog in chunks. Reloads the memory afterwards. Call with nothing unflushed.
    /// Returns the number of records applied.
    ///
    /// Errors: [`Error::Corrupt`] for a key that names no column family of this layout or a
    /// local-only key (see [`split_changelog_key`]); nothing of the chunk is stored then.
    /// [`Error::Write`], [`Error::Read`], [`Error::Format`] (the changelog carries a store of
    /// another format version).
    pub fn restore<'c>(
        &mut self,
        records: impl IntoIterator<Item = (i64, &'c Change)>,
    ) -> Result<usize, Error> {
        let mut w = changelog::Writes::new(&self.db, None);
        let mut last = None;
        let mut n = 0;
        for (offset, change) in records {
            let (cf_name, key) = split_changelog_key(&change.key)?;
            let handle = cf(&self.db, cf_name);
            match &change.value {
                Some(v) => w.wb.put_cf(handle, key, v),
                None => w.wb.delete_cf(handle, key),
            }
            last = Some(offset);
            n += 1;
        }
        let Some(last) = last else { return Ok(0) };
        w.put_local(changelog::META_CHANGELOG_NEXT, &(last + 1).to_be_bytes());
        w.put_local(changelog::META_CHANGELOG_DIRTY, &0u64.to_be_bytes());
        w.write(&self.state.write_opts)?;
        match meta_u64(&self.db, META_FORMAT_VERSION)? {
            Some(FORMAT_VERSION) | None => {}
            Some(found) => {
                return Err(Error::Format {
                    path: self.path.clone(),
                    found,
                    expected: FORMAT_VERSION,
                })
            }
        }
        reload(&self.db, &mut self.state)?;
        Ok(n)
    }

    /// Every record of the store as a change (all column families, local-only `meta` keys
    /// left out), for seeding an empty changelog from a store that predates it. Flushes what
    /// memory owes first.
    ///
    /// Errors: those of [`PartitionStore::flush`]; [`Error::Read`].
    pub fn snapshot_changes(&mut self) -> Result<Vec<Change>, Error> {
        self.flush()?;
        let mut out = Vec::new();
        for name in COLUMN_FAMILIES {
            let mut it = self.db.raw_iterator_cf(cf(&self.db, name));
            it.seek_to_first();
            while let (Some(k), Some(v)) = (it.key(), it.value()) {
                if !changelog::is_local(name, k) {
                    out.push(Change {
                        key: changelog_key(name, k),
                        value: Some(v.to_vec()),
                    });
                }
                it.next();
            }
            it.status()
                .map_err(|source| Error::Read { cf: name, source })?;
        }
        Ok(out)
    }

    /// This store lineage's writer id (sent as `meta\0writer` with every recorded write;
    /// `None` until the first one). A wiped store gets a new one.
    pub fn writer_id(&self) -> Option<u64> {
        self.state.writer_id
    }

    /// Sets every key's timer to `next_due(key, state)` (ms; `engine::Engine::next_due`),
    /// e.g. after a restore from a changelog written under another policy config: the stored
    /// value of each key whose timer differs is rewritten (not recorded: the changelog's
    /// values are the previous owner's), then the memory is reloaded (only when a timer
    /// changed: usually none does, and a restore has just loaded the store). Flushes what memory
    /// owes first; writes in chunks of 10 000 keys. Returns the number of timers (keys with
    /// state).
    ///
    /// Errors: those of [`PartitionStore::flush`], [`Error::Read`], [`Error::Corrupt`] (a
    /// session value that does not decode), [`Error::Write`].
    pub fn rebuild_timers(
        &mut self,
        next_due: impl Fn(&SessionKey, &SessionState) -> Millis,
    ) -> Result<u64, Error> {
        self.flush()?;
        let sessions = cf(&self.db, CF_SESSIONS);
        let mut wb = WriteBatch::default();
        let mut set = 0u64;
        let mut rewritten = 0u64;
        let mut buf = Vec::new();
        let mut it = self.db.raw_iterator_cf(sessions);
        it.seek_to_first();
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            let key = keys::stored_session_key(k)?;
            let (due, state) = keys::decode_session(k, v)?;
            let want = next_due(&key, &state);
            if due != Some(want) {
                buf = keys::encode_session_into(Some(want), &state, buf)?;
                wb.put_cf(sessions, k, &buf);
                rewritten += 1;
                if wb.len() >= 10_000 {
                    self.db
                        .write_opt(std::mem::take(&mut wb), &self.state.write_opts)
                        .map_err(Error::Write)?;
                }
            }
            set += 1;
            it.next();
        }
        it.status().map_err(read_error(CF_SESSIONS))?;
        drop(it);
        if rewritten == 0 {
            // Memory already equals the store (flushed above): nothing to reload.
            return Ok(set);
        }
        self.db
            .write_opt(wb, &self.state.write_opts)
            .map_err(Error::Write)?;
        reload(&self.db, &mut self.state)?;
        Ok(set)
    }

    /// Deletes the store at `path` (all its files; nothing if it does not exist). The store
    /// must be closed (dropped). Used to wipe a dirty store before a full restore.
    ///
    /// Errors: [`Error::Open`] when the files cannot be removed.
    pub fn destroy(path: &Path) -> Result<(), Error> {
        match std::fs::remove_dir_all(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::Open {
                path: path.to_path_buf(),
                reason: format!("cannot remove the store: {e}"),
            }),
        }
    }

    /// Fault injection for tests and crash drills: the next `count` RocksDB writes of
    /// commits and flushes fail with [`Error::InjectedFault`] after the write batch is built,
    /// storing nothing, exactly as if RocksDB had refused it. The runtime never calls this.
    pub fn fail_next_commits(&mut self, count: u32) {
        self.state.fail_commits = count;
    }
}

/// A store of format 1 (store v1: timers in a column family of their own) cannot be opened
/// as format 2 (RocksDB would refuse the unknown column family with a message about options):
/// say what it is and what to do.
fn refuse_format_1(path: &Path) -> Result<(), Error> {
    let Ok(cfs) = DB::list_cf(&rocksdb::Options::default(), path) else {
        // No store there yet (or unreadable: opening says why).
        return Ok(());
    };
    if cfs.iter().any(|c| c == CF_TIMERS_V1) {
        return Err(Error::Format {
            path: path.to_path_buf(),
            found: 1,
            expected: FORMAT_VERSION,
        });
    }
    Ok(())
}

/// The handle of a column family the store opened.
///
/// Invariant: every name in `COLUMN_FAMILIES` is opened with the database, and `from_db`
/// refuses a database missing one, so the lookup cannot fail.
pub(crate) fn cf<'a>(db: &'a DB, name: &str) -> &'a ColumnFamily {
    db.cf_handle(name)
        .expect("column families are checked when the store opens")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>() {}

    #[test]
    fn store_and_batch_can_move_into_a_partition_task() {
        assert_send::<PartitionStore>();
        assert_send::<Batch<'static>>();
    }

    proptest::proptest! {
        /// The flush's key order is RocksDB's byte order, for keys shorter and longer than
        /// the 16-byte prefix, with NUL bytes and shared prefixes.
        #[test]
        fn flush_keys_sort_in_byte_order(
            raw in proptest::collection::vec(("[a\\x00]{1,3}", "[a-c\\x00/]{0,20}"), 0..200)
        ) {
            let keys: Vec<SessionKey> = raw.iter().map(|(t, s)| SessionKey::new(t, s)).collect();
            let mut want: Vec<String> = raw.iter().map(|(t, s)| format!("{t}/{s}")).collect();
            want.sort_unstable_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
            let mut order: Vec<usize> = (0..keys.len()).collect();
            sort_in_key_order(&mut order, |&i| keys[i].as_str());
            let got: Vec<&str> = order.iter().map(|&i| keys[i].as_str()).collect();
            proptest::prop_assert_eq!(got, want.iter().map(String::as_str).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_corrupt_session_value_names_the_column_family_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let store = PartitionStore::open(dir.path(), &StoreOptions::default()).unwrap();
        let key = SessionKey::new("acme", "run-7");
        store
            .db
            .put_cf(
                cf(&store.db, keys::CF_SESSIONS),
                key.as_str(),
                [0, 0xFF, 0xFF],
            )
            .unwrap();
        drop(store);
        // Every stored session is read at open: the corrupt one is reported there.
        let err = PartitionStore::open(dir.path(), &StoreOptions::default()).unwrap_err();
        assert!(
            matches!(&err, Error::Corrupt { cf: "sessions", key, .. } if key == "acme/run-7"),
            "{err}"
        );
    }

    #[test]
    fn a_store_of_another_format_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = PartitionStore::open(dir.path(), &StoreOptions::default()).unwrap();
            store
                .db
                .put_cf(
                    cf(&store.db, CF_META),
                    META_FORMAT_VERSION,
                    99u64.to_be_bytes(),
                )
                .unwrap();
        }
        let err = PartitionStore::open(dir.path(), &StoreOptions::default()).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Format {
                    found: 99,
                    expected: FORMAT_VERSION,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn partition_paths_nest_topic_then_partition() {
        assert_eq!(
            partition_path(Path::new("/var/lib/settle"), "uploads", 3),
            PathBuf::from("/var/lib/settle/uploads/3")
        );
    }
}
