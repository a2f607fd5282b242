//! The partition store: one RocksDB database per owned partition, at
//! `<data-dir>/<topic>/<partition>` ([`partition_path`]). It holds everything the partition
//! task needs to resume after a crash (SEMANTICS §6): per-key state, timers in firing order,
//! owed emissions (outbox), and the applied input offset with the partition time (§3).
//!
//! The partition task owns its [`PartitionStore`] (single writer, no locks). Per input batch
//! it opens a [`Batch`], runs `engine::Driver` through it (the batch implements
//! `engine::SessionTable`), pushes the emissions to the outbox, sets offset and partition
//! time, and [`Batch::commit`]s: ONE RocksDB write, so after a crash either the whole input
//! batch is applied or none of it. Emissions are deleted from the outbox only after the sink
//! acknowledged them ([`PartitionStore::outbox_ack`]).
//!
//! # Layout
//!
//! Column families, not key prefixes: each has its own access pattern and so its own
//! options (bloom filter for point lookups on `sessions`; early compaction of
//! tombstone-dense files on the two queues `timers` and `outbox`), and the queues can be
//! compacted on their own. A RocksDB write batch is atomic across the column families of a
//! database, and they flush together (`atomic_flush`).
//!
//! | column family | key | value |
//! |---|---|---|
//! | `sessions` | session key bytes (`tenant/session`, UTF-8) | `SessionState`, postcard |
//! | `timers` | `due` as 8 bytes big-endian with the sign bit flipped (numeric order for every `i64`, [`encode_due`]) ‖ session key bytes | empty |
//! | `outbox` | sequence number, u64 big-endian (FIFO) | `Emission`, postcard |
//! | `meta` | ASCII name, see below | 8 bytes big-endian, except `timer_floor` |
//! | `tenants` | tenant name (UTF-8) | `TenantStats` (learned-delay intervals, `engine::learn`), postcard |
//!
//! `meta` keys: `format_version` ([`FORMAT_VERSION`]), `offset` (i64, the applied input
//! offset), `partition_time` (i64 ms), `outbox_next_seq`, `outbox_head` (no owed emission
//! below it), `outbox_len`, `sessions` (keys with state), `open_rounds` (keys with an open
//! round), and `timer_floor`: a timer key such that no live timer is below it (`[0xFF; 9]`,
//! above every timer key because UTF-8 has no `0xFF` byte, means "no live timer").
//!
//! # Invariants
//!
//! * Every key with state has exactly one timer, `engine::Engine::next_due` of its state;
//!   the driver keeps it so. The store does not rely on it: a batch writes every timer set
//!   and cancel it is given. State expiry (`state-ttl`) is one of those timers, so expired
//!   keys are deleted when their timer fires through the driver; no separate TTL sweep.
//! * The counters in `meta` (`sessions`, `open_rounds`, `outbox_len`) and `timer_floor`
//!   are written in the same write batch as the records they describe.
//! * Every store error is fatal for the partition (see [`Error`]).
//! * `tenants` holds at most `engine::MAX_LEARNED_TENANTS` entries: a batch storing a new
//!   tenant beyond that deletes the least recently seen one in the same write (the
//!   `SessionTable` rule). Their `last_seen` order is mirrored in memory (rebuilt by a scan
//!   when the store opens or is restored) to pick that tenant without a read.
//!
//! # Tombstones in the timer queue
//!
//! Timers are deleted at the head as they fire and in the middle as rounds are moved, and
//! RocksDB keeps each delete as a tombstone until compaction, so a plain "seek to the
//! first key" walks over every timer ever fired. Three things prevent that: reads seek to
//! `timer_floor` (persisted, so a restart does not walk them either); a batch keeps one
//! iterator and steps past what it deleted itself rather than seeking again; and the
//! `timers`/`outbox` column families mark files dense with tombstones for compaction
//! (RocksDB's compact-on-deletion collector), so the tombstones drop out of the LSM.
//! The outbox does the same with `outbox_head`.

mod batch;
pub mod changelog;
mod error;
mod keys;
mod options;

pub use batch::Batch;
pub use changelog::{changelog_key, split_changelog_key, Change};
pub use error::Error;
pub use keys::{decode_due, decode_timer_key, encode_due, outbox_key, timer_key, FORMAT_VERSION};
pub use options::{MemoryBudget, StoreOptions};

use crate::engine::{Emission, Millis, SessionKey, SessionState, TenantAges, TenantStats};
use keys::{
    CF_META, CF_OUTBOX, CF_TENANTS, CF_TIMERS, COLUMN_FAMILIES, META_FORMAT_VERSION, META_OFFSET,
    META_OPEN_ROUNDS, META_OUTBOX_HEAD, META_OUTBOX_LEN, META_OUTBOX_NEXT_SEQ, META_PARTITION_TIME,
    META_SESSIONS, META_TIMER_FLOOR,
};
use rocksdb::{ColumnFamily, WriteBatch, WriteOptions, DB};
use std::path::{Path, PathBuf};

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

/// The committed `meta` values, mirrored in memory; changed only after a successful write.
#[derive(Clone, Debug, Default)]
pub(crate) struct Meta {
    offset: Option<i64>,
    partition_time: Option<Millis>,
    next_seq: u64,
    outbox_head: u64,
    outbox_len: u64,
    sessions: u64,
    open_rounds: u64,
    timer_floor: Vec<u8>,
}

/// Everything of the store but the database handle (so a batch can borrow both apart).
pub(crate) struct StoreState {
    write_opts: WriteOptions,
    meta: Meta,
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
    /// The committed `tenants` entries by `last_seen` (the eviction order).
    tenants: TenantAges,
}

/// What [`StoreState::stamp`] added to a write, applied to the state once it is stored.
pub(crate) struct Stamp {
    mark_dirty: bool,
    new_writer: Option<u64>,
}

impl StoreState {
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

/// The RocksDB store of one partition (see the module docs for layout and invariants).
/// Owned by the partition task; `Send`, not shared.
pub struct PartitionStore {
    db: DB,
    path: PathBuf,
    state: StoreState,
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
    /// [`MemoryBudget`]. A process owning several partitions should share one budget through
    /// [`PartitionStore::open_with_budget`].
    ///
    /// Errors: [`Error::Open`], [`Error::Format`] (written by another layout version),
    /// [`Error::Read`] / [`Error::Corrupt`] reading `meta`, [`Error::Write`] initialising it.
    pub fn open(path: &Path, options: &StoreOptions) -> Result<Self, Error> {
        Self::open_with_budget(path, options, &MemoryBudget::new(options))
    }

    /// [`PartitionStore::open`] with a shared block cache and memtable budget.
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
        let db = DB::open_cf_descriptors(
            &options::db_options(options, budget),
            path,
            options::column_families(options, budget),
        )
        .map_err(|e| open_err(e.into_string()))?;
        let store = Self::from_db(db, path, options)?;
        if store.meta_u64(META_FORMAT_VERSION)?.is_none() {
            let mut wb = WriteBatch::default();
            wb.put_cf(
                cf(&store.db, CF_META),
                META_FORMAT_VERSION,
                FORMAT_VERSION.to_be_bytes(),
            );
            store
                .db
                .write_opt(wb, &store.state.write_opts)
                .map_err(Error::Write)?;
        }
        store.check_version()?;
        Ok(store)
    }

    /// Opens an existing store read-only (for `settle inspect` next to a running processor:
    /// it takes no lock and sees the store as of opening). Every write ([`Batch::commit`],
    /// [`PartitionStore::outbox_ack`]) fails with [`Error::Write`].
    ///
    /// Errors: [`Error::Open`] (also when no store exists at `path`), [`Error::Format`].
    pub fn open_read_only(path: &Path, options: &StoreOptions) -> Result<Self, Error> {
        let budget = MemoryBudget::new(options);
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
        let store = Self::from_db(db, path, options)?;
        store.check_version()?;
        Ok(store)
    }

    fn from_db(db: DB, path: &Path, options: &StoreOptions) -> Result<Self, Error> {
        if let Some(missing) = COLUMN_FAMILIES.iter().find(|n| db.cf_handle(n).is_none()) {
            return Err(Error::Open {
                path: path.to_path_buf(),
                reason: format!("column family {missing} missing"),
            });
        }
        let mut store = PartitionStore {
            db,
            path: path.to_path_buf(),
            state: StoreState {
                write_opts: options::write_options(options),
                meta: Meta::default(),
                fail_commits: 0,
                recording: false,
                changes: Vec::new(),
                changelog_dirty: false,
                changelog_next: None,
                writer_id: None,
                tenants: TenantAges::new(),
            },
        };
        store.load_meta()?;
        Ok(store)
    }

    /// Reads the committed `meta` values into memory (at open and after a restore).
    fn load_meta(&mut self) -> Result<(), Error> {
        let store = self;
        let as_i64 = |v: Option<u64>| v.map(|v| v as i64);
        let meta = Meta {
            offset: as_i64(store.meta_u64(META_OFFSET)?),
            partition_time: as_i64(store.meta_u64(META_PARTITION_TIME)?),
            next_seq: store.meta_u64(META_OUTBOX_NEXT_SEQ)?.unwrap_or(0),
            outbox_head: store.meta_u64(META_OUTBOX_HEAD)?.unwrap_or(0),
            outbox_len: store.meta_u64(META_OUTBOX_LEN)?.unwrap_or(0),
            sessions: store.meta_u64(META_SESSIONS)?.unwrap_or(0),
            open_rounds: store.meta_u64(META_OPEN_ROUNDS)?.unwrap_or(0),
            timer_floor: store.meta_raw(META_TIMER_FLOOR)?.unwrap_or_default(),
        };
        store.state.meta = meta;
        store.state.changelog_dirty = store.meta_u64(changelog::META_CHANGELOG_DIRTY)? == Some(1);
        store.state.changelog_next = as_i64(store.meta_u64(changelog::META_CHANGELOG_NEXT)?);
        store.state.writer_id = store.meta_u64(changelog::META_WRITER_ID)?;
        let mut tenants = TenantAges::new();
        for (name, stats) in store.tenants()? {
            tenants.touch(&name, stats.last_seen);
        }
        store.state.tenants = tenants;
        Ok(())
    }

    fn check_version(&self) -> Result<(), Error> {
        match self.meta_u64(META_FORMAT_VERSION)? {
            Some(FORMAT_VERSION) | None => Ok(()),
            Some(found) => Err(Error::Format {
                path: self.path.clone(),
                found,
                expected: FORMAT_VERSION,
            }),
        }
    }

    fn meta_raw(&self, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        self.db
            .get_cf(cf(&self.db, CF_META), key)
            .map_err(|source| Error::Read {
                cf: CF_META,
                source,
            })
    }

    fn meta_u64(&self, key: &[u8]) -> Result<Option<u64>, Error> {
        self.meta_raw(key)?
            .map(|v| keys::decode_meta_u64(key, &v))
            .transpose()
    }

    /// The store directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Starts the changes of one input batch. Nothing is stored until [`Batch::commit`].
    pub fn batch(&mut self) -> Batch<'_> {
        Batch::new(&self.db, &mut self.state)
    }

    /// The input offset stored by the last committed batch that set one (`None`: never).
    pub fn stored_offset(&self) -> Option<i64> {
        self.state.meta.offset
    }

    /// The partition time (ms, SEMANTICS §3) stored by the last committed batch that set one.
    pub fn partition_time(&self) -> Option<Millis> {
        self.state.meta.partition_time
    }

    /// Keys with state (an open round or only a CallTrack waiting for its `state-ttl`).
    /// Kept as a counter in `meta`: O(1).
    pub fn session_count(&self) -> u64 {
        self.state.meta.sessions
    }

    /// Keys with an open round: the rounds still to be emitted or to end silently. Kept as
    /// a counter in `meta`: O(1).
    pub fn pending_rounds(&self) -> u64 {
        self.state.meta.open_rounds
    }

    /// Owed emissions (written, not yet acknowledged by the sink). O(1).
    pub fn outbox_len(&self) -> u64 {
        self.state.meta.outbox_len
    }

    /// The committed state of `key`. Errors: [`Error::Read`], [`Error::Corrupt`].
    pub fn session(&self, key: &SessionKey) -> Result<Option<SessionState>, Error> {
        batch::read_state(&self.db, key)
    }

    /// Tenants with learned-delay statistics (at most `engine::MAX_LEARNED_TENANTS`). O(1).
    pub fn tenant_count(&self) -> usize {
        self.state.tenants.len()
    }

    /// The committed learned-delay statistics of `tenant`. Errors: [`Error::Read`],
    /// [`Error::Corrupt`].
    pub fn tenant(&self, tenant: &str) -> Result<Option<TenantStats>, Error> {
        batch::read_tenant(&self.db, tenant)
    }

    /// Every tenant's committed learned-delay statistics, by tenant name (at most
    /// `engine::MAX_LEARNED_TENANTS` entries). Errors: [`Error::Read`], [`Error::Corrupt`].
    pub fn tenants(&self) -> Result<Vec<(String, TenantStats)>, Error> {
        let mut it = self.db.raw_iterator_cf(cf(&self.db, CF_TENANTS));
        it.seek_to_first();
        let mut out = Vec::new();
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            let name = std::str::from_utf8(k).map_err(|e| Error::Corrupt {
                cf: CF_TENANTS,
                key: keys::printable(k),
                reason: format!("tenant name is not UTF-8: {e}"),
            })?;
            out.push((name.to_owned(), keys::decode_tenant(k, v)?));
            it.next();
        }
        it.status().map_err(|source| Error::Read {
            cf: CF_TENANTS,
            source,
        })?;
        Ok(out)
    }

    /// The first `limit` timers `(due ms, key)` in firing order. Errors: [`Error::Read`],
    /// [`Error::Corrupt`].
    pub fn timers(&self, limit: usize) -> Result<Vec<(Millis, SessionKey)>, Error> {
        let mut it = self.db.raw_iterator_cf(cf(&self.db, CF_TIMERS));
        it.seek(&self.state.meta.timer_floor);
        let mut out = Vec::with_capacity(limit.min(1024));
        while out.len() < limit {
            let Some(k) = it.key() else { break };
            out.push(keys::decode_timer_key(k).map_err(|reason| Error::Corrupt {
                cf: CF_TIMERS,
                key: keys::printable(k),
                reason,
            })?);
            it.next();
        }
        it.status().map_err(|source| Error::Read {
            cf: CF_TIMERS,
            source,
        })?;
        Ok(out)
    }

    /// The earliest timer `(due ms, key)`: when the partition task must wake next.
    pub fn next_timer(&self) -> Result<Option<(Millis, SessionKey)>, Error> {
        Ok(self.timers(1)?.pop())
    }

    /// The first `limit` owed emissions in FIFO order.
    pub fn outbox_peek(&mut self, limit: usize) -> Result<Vec<OutboxEntry>, Error> {
        self.outbox_peek_from(0, limit)
    }

    /// The first `limit` owed emissions with `seq ≥ from`, in FIFO order (lets a publisher
    /// with emissions in flight read past them). Errors: [`Error::Read`], [`Error::Corrupt`].
    pub fn outbox_peek_from(&mut self, from: u64, limit: usize) -> Result<Vec<OutboxEntry>, Error> {
        let head = self.state.meta.outbox_head;
        let mut it = self.db.raw_iterator_cf(cf(&self.db, CF_OUTBOX));
        it.seek(keys::outbox_key(from.max(head)));
        let mut out = Vec::with_capacity(limit.min(1024));
        while out.len() < limit {
            let (Some(k), Some(v)) = (it.key(), it.value()) else {
                break;
            };
            let corrupt = |reason| Error::Corrupt {
                cf: CF_OUTBOX,
                key: keys::printable(k),
                reason,
            };
            let seq = keys::decode_outbox_key(k).map_err(corrupt)?;
            let emission = keys::decode_emission(k, v)?;
            out.push(OutboxEntry { seq, emission });
            it.next();
        }
        it.status().map_err(|source| Error::Read {
            cf: CF_OUTBOX,
            source,
        })?;
        if from <= head && limit > 0 {
            // Nothing is owed below the first entry found (or at all, if none): later
            // reads seek there instead of walking the tombstones of acknowledged entries.
            self.state.meta.outbox_head = out.first().map_or(self.state.meta.next_seq, |e| e.seq);
        }
        Ok(out)
    }

    /// Deletes the acknowledged emissions `seqs` (call only after the sink acknowledged
    /// them). Unknown or already acknowledged numbers are ignored. One RocksDB write,
    /// counters included. Returns how many entries were deleted.
    ///
    /// Errors: [`Error::Read`], [`Error::Write`].
    pub fn outbox_ack(&mut self, seqs: &[u64]) -> Result<usize, Error> {
        let outbox = cf(&self.db, CF_OUTBOX);
        let mut acked = std::collections::BTreeSet::new();
        // Which of them are still owed: one batched lookup of the distinct keys in key order.
        let mut wanted = seqs.to_vec();
        wanted.sort_unstable();
        wanted.dedup();
        let wanted_keys: Vec<[u8; 8]> = wanted.iter().map(|&s| keys::outbox_key(s)).collect();
        let found = self.db.batched_multi_get_cf(outbox, &wanted_keys, true);
        for ((&seq, _), value) in wanted.iter().zip(&wanted_keys).zip(found) {
            let present = value
                .map_err(|source| Error::Read {
                    cf: CF_OUTBOX,
                    source,
                })?
                .is_some();
            if present {
                acked.insert(seq);
            }
        }
        let deleted = acked.len();
        if deleted == 0 {
            return Ok(0);
        }
        // Move the head past what this ack deletes (acks mostly come in FIFO order), so
        // reads never walk the tombstones of acknowledged entries.
        let head = self.outbox_first_live(&acked)?;
        let len = self.state.meta.outbox_len.saturating_sub(deleted as u64);
        let state = &mut self.state;
        let mut recorded = Vec::new();
        let mut w = changelog::Writes::new(&self.db, state.recording.then_some(&mut recorded));
        for &seq in &acked {
            w.delete(CF_OUTBOX, &keys::outbox_key(seq));
        }
        w.put(CF_META, META_OUTBOX_LEN, &len.to_be_bytes());
        w.put(CF_META, META_OUTBOX_HEAD, &head.to_be_bytes());
        let stamp = state.stamp(&mut w);
        w.write(&state.write_opts)?;
        state.changes.append(&mut recorded);
        state.stamped(stamp);
        state.meta.outbox_len = len;
        state.meta.outbox_head = head;
        Ok(deleted)
    }

    /// The first outbox entry at or above the head that is not in `skip` (its sequence
    /// number), or the next sequence number if there is none.
    fn outbox_first_live(&self, skip: &std::collections::BTreeSet<u64>) -> Result<u64, Error> {
        let mut it = self.db.raw_iterator_cf(cf(&self.db, CF_OUTBOX));
        it.seek(keys::outbox_key(self.state.meta.outbox_head));
        while let Some(k) = it.key() {
            let seq = keys::decode_outbox_key(k).map_err(|reason| Error::Corrupt {
                cf: CF_OUTBOX,
                key: keys::printable(k),
                reason,
            })?;
            if !skip.contains(&seq) {
                return Ok(seq);
            }
            it.next();
        }
        it.status().map_err(|source| Error::Read {
            cf: CF_OUTBOX,
            source,
        })?;
        Ok(self.state.meta.next_seq)
    }

    /// Flushes memtables to disk (all column families together). Needed only with the WAL
    /// off, before a planned stop; closing the store flushes too. Errors: [`Error::Write`].
    pub fn flush(&self) -> Result<(), Error> {
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
        self.state.changes.len()
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
        debug_assert!(self.state.changes.is_empty());
        let mut w = changelog::Writes::new(&self.db, None);
        w.put_local(changelog::META_CHANGELOG_NEXT, &next.to_be_bytes());
        w.put_local(changelog::META_CHANGELOG_DIRTY, &0u64.to_be_bytes());
        w.write(&self.state.write_opts)?;
        self.state.changelog_next = Some(next);
        self.state.changelog_dirty = false;
        Ok(())
    }

    /// True when the store holds nothing: no input offset, no key, no outbox entry ever.
    pub fn is_empty(&self) -> bool {
        let m = &self.state.meta;
        m.offset.is_none() && m.sessions == 0 && m.next_seq == 0 && m.partition_time.is_none()
    }

    /// Applies changelog records `(changelog offset, change)` in one RocksDB write and moves
    /// the checkpoint past the last one (the store stays clean: it equals the changelog below
    /// the checkpoint). Records must come in changelog order; a restore applies the
    /// changelog in chunks. Reloads the in-memory `meta` afterwards. Returns the number of
    /// records applied.
    ///
    /// Errors: [`Error::Corrupt`] for a key that names no column family of this layout or a
    /// local-only key (see [`split_changelog_key`]); nothing of the chunk is stored then.
    /// [`Error::Write`], [`Error::Read`].
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
        self.load_meta()?;
        self.check_version()?;
        Ok(n)
    }

    /// Every record of the store as a change (all column families, local-only `meta` keys
    /// left out), for seeding an empty changelog from a store that predates it.
    ///
    /// Errors: [`Error::Read`].
    pub fn snapshot_changes(&self) -> Result<Vec<Change>, Error> {
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

    /// Rebuilds the `timers` column family from the sessions (timers are not on the
    /// changelog, see [`changelog`]): deletes every timer, then sets one timer per key with
    /// state at `next_due(key, state)` (ms; `engine::Engine::next_due`), and the timer floor.
    /// Writes in chunks of 10 000 keys. Returns the number of timers set.
    ///
    /// Errors: [`Error::Read`], [`Error::Corrupt`] (a session value that does not decode),
    /// [`Error::Write`].
    pub fn rebuild_timers(
        &mut self,
        next_due: impl Fn(&SessionKey, &SessionState) -> Millis,
    ) -> Result<u64, Error> {
        let timers = cf(&self.db, CF_TIMERS);
        let mut wb = WriteBatch::default();
        wb.delete_range_cf(timers, &[][..], &keys::TIMER_FLOOR_END[..]);
        let mut first: Option<Vec<u8>> = None;
        let mut set = 0u64;
        let mut it = self.db.raw_iterator_cf(cf(&self.db, keys::CF_SESSIONS));
        it.seek_to_first();
        while let (Some(k), Some(v)) = (it.key(), it.value()) {
            let key = keys::decode_session_key(k).map_err(|reason| Error::Corrupt {
                cf: keys::CF_SESSIONS,
                key: keys::printable(k),
                reason,
            })?;
            let state = keys::decode_state(k, v)?;
            let timer = keys::timer_key(next_due(&key, &state), &key);
            if first.as_ref().is_none_or(|f| timer < *f) {
                first = Some(timer.clone());
            }
            wb.put_cf(timers, timer, []);
            set += 1;
            if set % 10_000 == 0 {
                self.db
                    .write_opt(std::mem::take(&mut wb), &self.state.write_opts)
                    .map_err(Error::Write)?;
            }
            it.next();
        }
        it.status().map_err(|source| Error::Read {
            cf: keys::CF_SESSIONS,
            source,
        })?;
        drop(it);
        let floor = first.unwrap_or_else(|| keys::TIMER_FLOOR_END.to_vec());
        wb.put_cf(cf(&self.db, CF_META), META_TIMER_FLOOR, &floor);
        self.db
            .write_opt(wb, &self.state.write_opts)
            .map_err(Error::Write)?;
        self.state.meta.timer_floor = floor;
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

    /// Fault injection for tests and crash drills: the next `count` commits fail with
    /// [`Error::InjectedFault`] after the write batch is built, storing nothing, exactly as
    /// if RocksDB had refused it. The runtime never calls this.
    pub fn fail_next_commits(&mut self, count: u32) {
        self.state.fail_commits = count;
    }
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

    #[test]
    fn a_corrupt_session_value_names_the_column_family_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let store = PartitionStore::open(dir.path(), &StoreOptions::default()).unwrap();
        let key = SessionKey::new("acme", "run-7");
        store
            .db
            .put_cf(cf(&store.db, keys::CF_SESSIONS), key.as_str(), [0xFF, 0xFF])
            .unwrap();
        let err = store.session(&key).unwrap_err();
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
