//! [`Batch`]: the changes of one input batch, applied to the store in ONE RocksDB write.
//!
//! A batch is an overlay on the committed store: reads see the batch's own writes first,
//! then the database. The database does not change while a batch exists (the batch borrows
//! the store mutably), so one iterator over `timers` serves the whole batch.
//!
//! Finding the first timer (`first_due`) without walking tombstones: the store keeps a
//! *timer floor*, a timer key below which it has no live timer (persisted in `meta` with
//! every commit). The batch seeks there once, skips timers it cancelled itself, and
//! remembers the first live one as its *head*; when the driver cancels the head (it fired)
//! the same iterator moves on, so firing n timers in a batch costs one seek and n steps.
//! Timers set by the batch are kept in an ordered set and compared with the head. At
//! commit the new floor is the lower of the batch's floor (moved past everything it
//! deleted) and its smallest set timer, so the next batch, and the next process after a
//! restart, seeks straight past every timer ever deleted.
//!
//! Timer sets and cancels are recorded as "last one wins" and all written: the batch does
//! not assume anything about what the store held, so a stale stored timer is still deleted
//! by its cancel.

use super::changelog::Writes;
use super::error::Error;
use super::keys::{
    self, CF_META, CF_OUTBOX, CF_SESSIONS, CF_TENANTS, CF_TIMERS, META_OFFSET, META_OPEN_ROUNDS,
    META_OUTBOX_LEN, META_OUTBOX_NEXT_SEQ, META_PARTITION_TIME, META_SESSIONS, META_TIMER_FLOOR,
    TIMER_FLOOR_END,
};
use super::{cf, StoreState};
use crate::engine::{
    Emission, Millis, SessionKey, SessionState, SessionTable, TenantStats, MAX_LEARNED_TENANTS,
};
use rocksdb::{DBRawIterator, DB};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::hash_map::Entry;
use std::collections::BTreeSet;

/// One key's state as the batch knows it.
struct Slot {
    /// The committed state: `None` = no state; `Some(open)` = state, with a round open or not.
    base: Option<bool>,
    /// The state as of the batch's writes.
    current: Option<SessionState>,
    /// Written by the batch (a put or a delete is owed).
    dirty: bool,
}

/// One tenant's learned-delay statistics as the batch knows them.
struct TenantSlot {
    /// The store holds the tenant (committed).
    base: bool,
    /// The statistics as of the batch's writes (`None`: none, or evicted by the batch).
    current: Option<TenantStats>,
    /// Written by the batch.
    dirty: bool,
}

/// What the batch knows of the first live committed timer at or above its floor.
enum Head {
    /// Not known: scan (from where the iterator stands; it seeks the floor when created).
    Unknown,
    /// This timer key.
    Key(Vec<u8>),
    /// None: every committed timer is deleted or cancelled by the batch.
    End,
}

/// The uncommitted changes of one input batch: session puts/deletes, timer sets/cancels,
/// owed emissions (outbox), and the input offset and partition time they bring the
/// partition to. Implements [`SessionTable`] for [`crate::engine::Driver`], reading its
/// own writes. [`Batch::commit`] stores all of it in one RocksDB write; dropping a batch
/// without committing discards it.
///
/// Memory: proportional to the keys and timers the batch touches; commit in bounded
/// chunks (e.g. `Driver::advance_at_most` during catch-up).
pub struct Batch<'s> {
    db: &'s DB,
    state: &'s mut StoreState,
    slots: FxHashMap<SessionKey, Slot>,
    /// Timers set by the batch (encoded keys, firing order); disjoint from `timer_dels`.
    timer_puts: BTreeSet<Vec<u8>>,
    /// Timers cancelled by the batch.
    timer_dels: FxHashSet<Vec<u8>>,
    /// Every committed timer key below this is deleted, in `timer_dels` or in `timer_puts`.
    floor: Vec<u8>,
    head: Head,
    iter: Option<DBRawIterator<'s>>,
    /// Encoded owed emissions, in push order.
    outbox: Vec<Vec<u8>>,
    offset: Option<i64>,
    partition_time: Option<Millis>,
    /// Tenants' learned-delay statistics read or written by the batch.
    tenants: FxHashMap<Box<str>, TenantSlot>,
}

impl<'s> Batch<'s> {
    pub(super) fn new(db: &'s DB, state: &'s mut StoreState) -> Self {
        let floor = state.meta.timer_floor.clone();
        Batch {
            db,
            state,
            slots: FxHashMap::default(),
            timer_puts: BTreeSet::new(),
            timer_dels: FxHashSet::default(),
            floor,
            head: Head::Unknown,
            iter: None,
            outbox: Vec::new(),
            offset: None,
            partition_time: None,
            tenants: FxHashMap::default(),
        }
    }

    /// Appends an owed emission to the outbox (FIFO). Returns the sequence number it will
    /// have once committed (the number `outbox_ack` takes). Errors: [`Error::Encode`].
    pub fn push_outbox(&mut self, emission: &Emission) -> Result<u64, Error> {
        let seq = self.state.meta.next_seq + self.outbox.len() as u64;
        self.outbox.push(keys::encode_emission(emission)?);
        Ok(seq)
    }

    /// Records that the input up to `offset` is applied by this batch. The value is stored
    /// as given and read back by `PartitionStore::stored_offset`; the runtime chooses the
    /// convention (the next offset to consume is the usual one).
    pub fn set_offset(&mut self, offset: i64) {
        self.offset = Some(offset);
    }

    /// Records the partition time (ms, SEMANTICS §3) reached by this batch.
    pub fn set_partition_time(&mut self, now: Millis) {
        self.partition_time = Some(now);
    }

    /// Owed emissions pushed so far in this batch.
    pub fn outbox_pushed(&self) -> usize {
        self.outbox.len()
    }

    /// Writes the whole batch (sessions, tenants' learned-delay statistics, timers, outbox,
    /// offset, partition time and the store's counters) in ONE RocksDB write batch: after a
    /// crash either all of it is stored or none. On error nothing is stored and the store is
    /// as before the batch; the runtime treats the error as fatal for the partition.
    ///
    /// Errors: [`Error::Write`] (RocksDB refused the write), [`Error::InjectedFault`].
    pub fn commit(mut self) -> Result<(), Error> {
        // The iterator pins the committed view; release it before writing.
        self.iter = None;
        let db = self.db;
        let meta = &self.state.meta;
        let mut recorded = Vec::new();
        let mut w = Writes::new(db, self.state.recording.then_some(&mut recorded));

        // Changelog order (see `store::changelog`): outbox, then sessions and timers, then
        // meta. Every column family's writes go in in key order: RocksDB inserts them into
        // its memtable (a skip list) starting from where the previous insert ended, which is
        // far cheaper for ascending keys than for the hash order of `slots` and
        // `timer_dels`. (The order of distinct keys in a write batch changes nothing of what
        // is stored.)
        let next_seq = meta.next_seq + self.outbox.len() as u64;
        let outbox_len = meta.outbox_len + self.outbox.len() as u64;
        for (i, value) in self.outbox.iter().enumerate() {
            w.put(
                CF_OUTBOX,
                &keys::outbox_key(meta.next_seq + i as u64),
                value,
            );
        }

        let (mut sessions, mut open_rounds) = (meta.sessions as i64, meta.open_rounds as i64);
        let mut dirty: Vec<(&SessionKey, &Slot)> =
            self.slots.iter().filter(|(_, s)| s.dirty).collect();
        dirty.sort_unstable_by(|a, b| a.0.cmp(b.0));
        // One encoding buffer for all states (the write batch copies each value).
        let mut buf = Vec::with_capacity(256);
        for (key, slot) in dirty {
            sessions -= i64::from(slot.base.is_some());
            open_rounds -= i64::from(slot.base == Some(true));
            match &slot.current {
                Some(s) => {
                    sessions += 1;
                    open_rounds += i64::from(s.round.is_some());
                    buf = keys::encode_state_into(s, buf)?;
                    w.put(CF_SESSIONS, key.as_str().as_bytes(), &buf);
                }
                None => w.delete(CF_SESSIONS, key.as_str().as_bytes()),
            }
        }
        let (sessions, open_rounds) = (sessions.max(0) as u64, open_rounds.max(0) as u64);

        let mut tenants: Vec<(&Box<str>, &TenantSlot)> =
            self.tenants.iter().filter(|(_, t)| t.dirty).collect();
        tenants.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (name, slot) in &tenants {
            match &slot.current {
                Some(stats) => {
                    buf = keys::encode_tenant_into(stats, buf)?;
                    w.put(CF_TENANTS, name.as_bytes(), &buf);
                }
                None => w.delete(CF_TENANTS, name.as_bytes()),
            }
        }

        let mut timer_dels: Vec<&Vec<u8>> = self.timer_dels.iter().collect();
        timer_dels.sort_unstable();
        for k in timer_dels {
            w.delete(CF_TIMERS, k);
        }
        for k in &self.timer_puts {
            w.put(CF_TIMERS, k, &[]);
        }
        let floor = match self.timer_puts.first() {
            Some(first) if *first < self.floor => first.clone(),
            _ => std::mem::take(&mut self.floor),
        };

        let mut put_u64 = |key: &[u8], old: u64, new: u64| {
            if old != new {
                w.put(CF_META, key, &new.to_be_bytes());
            }
        };
        put_u64(META_OUTBOX_NEXT_SEQ, meta.next_seq, next_seq);
        put_u64(META_OUTBOX_LEN, meta.outbox_len, outbox_len);
        put_u64(META_SESSIONS, meta.sessions, sessions);
        put_u64(META_OPEN_ROUNDS, meta.open_rounds, open_rounds);
        if let Some(o) = self.offset {
            w.put(CF_META, META_OFFSET, &o.to_be_bytes());
        }
        if let Some(t) = self.partition_time {
            w.put(CF_META, META_PARTITION_TIME, &t.to_be_bytes());
        }
        if floor != meta.timer_floor {
            w.put(CF_META, META_TIMER_FLOOR, &floor);
        }
        let stamp = self.state.stamp(&mut w);

        if self.state.fail_commits > 0 {
            self.state.fail_commits -= 1;
            return Err(Error::InjectedFault);
        }
        w.write(&self.state.write_opts)?;

        let state = &mut *self.state;
        for (name, slot) in tenants {
            match &slot.current {
                Some(stats) => state.tenants.touch(name, stats.last_seen),
                None => {
                    state.tenants.remove(name);
                }
            }
        }
        state.changes.append(&mut recorded);
        state.stamped(stamp);
        let meta = &mut state.meta;
        meta.next_seq = next_seq;
        meta.outbox_len = outbox_len;
        meta.sessions = sessions;
        meta.open_rounds = open_rounds;
        meta.timer_floor = floor;
        if self.offset.is_some() {
            meta.offset = self.offset;
        }
        if self.partition_time.is_some() {
            meta.partition_time = self.partition_time;
        }
        Ok(())
    }

    /// The slot of `key`, read from the store on first use.
    fn slot(&mut self, key: &SessionKey) -> Result<&mut Slot, Error> {
        match self.slots.entry(key.clone()) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(e) => {
                let stored = read_state(self.db, key)?;
                Ok(e.insert(Slot {
                    base: stored.as_ref().map(|s| s.round.is_some()),
                    current: stored,
                    dirty: false,
                }))
            }
        }
    }

    /// The slot of `tenant`, read from the store on first use (no read for a tenant the
    /// store does not hold).
    fn tenant_slot(&mut self, tenant: &str) -> Result<&mut TenantSlot, Error> {
        if !self.tenants.contains_key(tenant) {
            let base = self.state.tenants.contains(tenant);
            let current = if base {
                read_tenant(self.db, tenant)?
            } else {
                None
            };
            self.tenants.insert(
                tenant.into(),
                TenantSlot {
                    base: current.is_some(),
                    current,
                    dirty: false,
                },
            );
        }
        // Inserted just above when missing.
        Ok(self
            .tenants
            .get_mut(tenant)
            .expect("the slot was just inserted"))
    }

    /// Tenants with statistics as of the batch's writes.
    fn tenant_count(&self) -> usize {
        let committed = self.state.tenants.len() as i64;
        let delta: i64 = self
            .tenants
            .values()
            .map(|t| i64::from(t.current.is_some()) - i64::from(t.base))
            .sum();
        (committed + delta).max(0) as usize
    }

    /// The tenant other than `except` with the smallest `(last_seen, name)` as of the
    /// batch's writes: the one to evict.
    fn stalest_tenant(&self, except: &str) -> Option<Box<str>> {
        let committed = self
            .state
            .tenants
            .oldest_first()
            .find(|(_, name)| !self.tenants.contains_key(*name) && *name != except);
        let touched = self
            .tenants
            .iter()
            .filter_map(|(name, t)| Some((t.current.as_ref()?.last_seen, &**name)))
            .filter(|(_, name)| *name != except)
            .min();
        match (committed, touched) {
            (Some(a), Some(b)) => Some(a.min(b).1.into()),
            (a, b) => a.or(b).map(|(_, name)| name.into()),
        }
    }

    /// Makes `head` known: the first committed timer at or above the floor not cancelled
    /// by the batch.
    fn resolve_head(&mut self) -> Result<(), Error> {
        if let Head::Unknown = self.head {
            self.head = self.scan()?;
        }
        Ok(())
    }

    fn scan(&mut self) -> Result<Head, Error> {
        let db = self.db;
        let floor = &self.floor;
        let it = self.iter.get_or_insert_with(|| {
            let mut it = db.raw_iterator_cf(cf(db, CF_TIMERS));
            it.seek(floor);
            it
        });
        loop {
            let Some(k) = it.key() else {
                it.status().map_err(|source| Error::Read {
                    cf: CF_TIMERS,
                    source,
                })?;
                // Nothing live at or above the floor: the store has no live timer left
                // except those the batch adds (they lower the floor again at commit).
                self.floor = TIMER_FLOOR_END.to_vec();
                return Ok(Head::End);
            };
            if !self.timer_dels.contains(k) {
                self.floor = k.to_vec();
                return Ok(Head::Key(k.to_vec()));
            }
            it.next();
        }
    }
}

impl SessionTable for Batch<'_> {
    type Error = Error;

    fn get(&mut self, key: &SessionKey) -> Result<Option<SessionState>, Error> {
        Ok(self.slot(key)?.current.clone())
    }

    fn put(&mut self, key: &SessionKey, state: &SessionState) -> Result<(), Error> {
        let slot = self.slot(key)?;
        match &mut slot.current {
            Some(s) => s.clone_from(state),
            None => slot.current = Some(state.clone()),
        }
        slot.dirty = true;
        Ok(())
    }

    fn delete(&mut self, key: &SessionKey) -> Result<(), Error> {
        let slot = self.slot(key)?;
        slot.current = None;
        slot.dirty = true;
        Ok(())
    }

    fn update<R>(
        &mut self,
        key: &SessionKey,
        f: impl FnOnce(&mut Option<SessionState>) -> (R, bool),
    ) -> Result<R, Error> {
        let slot = self.slot(key)?;
        let (r, changed) = f(&mut slot.current);
        slot.dirty |= changed;
        Ok(r)
    }

    fn set_timer(&mut self, due: Millis, key: &SessionKey) -> Result<(), Error> {
        let k = keys::timer_key(due, key);
        // The last of set/cancel wins. A set is always written (re-putting a stored timer is
        // harmless) and never waits for the scan to find it: a committed timer cancelled
        // and set again may lie behind the iterator.
        self.timer_dels.remove(&k);
        self.timer_puts.insert(k);
        Ok(())
    }

    fn cancel_timer(&mut self, due: Millis, key: &SessionKey) -> Result<(), Error> {
        let k = keys::timer_key(due, key);
        // Always written as a delete, even for a timer this batch added: the store does not
        // assume it was absent before (a stale timer must not survive its cancel).
        self.timer_puts.remove(&k);
        if matches!(&self.head, Head::Key(h) if *h == k) {
            // The iterator stands on it; the next scan steps past it.
            self.head = Head::Unknown;
        }
        self.timer_dels.insert(k);
        Ok(())
    }

    fn tenant_stats(&mut self, tenant: &str) -> Result<Option<TenantStats>, Error> {
        Ok(self.tenant_slot(tenant)?.current.clone())
    }

    fn put_tenant_stats(&mut self, tenant: &str, stats: &TenantStats) -> Result<(), Error> {
        let is_new = self.tenant_slot(tenant)?.current.is_none();
        if is_new && self.tenant_count() >= MAX_LEARNED_TENANTS {
            if let Some(victim) = self.stalest_tenant(tenant) {
                let slot = self.tenant_slot(&victim)?;
                slot.current = None;
                slot.dirty = true;
            }
        }
        let slot = self.tenant_slot(tenant)?;
        match &mut slot.current {
            Some(s) => s.clone_from(stats),
            None => slot.current = Some(stats.clone()),
        }
        slot.dirty = true;
        Ok(())
    }

    fn first_due(&mut self, now: Millis) -> Result<Option<(Millis, SessionKey)>, Error> {
        self.resolve_head()?;
        let db_head = match &self.head {
            Head::Key(k) => Some(k.as_slice()),
            Head::End | Head::Unknown => None,
        };
        let first = match (db_head, self.timer_puts.first()) {
            (Some(d), Some(p)) => Some(d.min(p.as_slice())),
            (d, p) => d.or(p.map(Vec::as_slice)),
        };
        let Some(first) = first else { return Ok(None) };
        match keys::timer_key_due(first) {
            Some(due) if due > now => Ok(None),
            _ => keys::decode_timer_key(first)
                .map(Some)
                .map_err(|reason| Error::Corrupt {
                    cf: CF_TIMERS,
                    key: keys::printable(first),
                    reason,
                }),
        }
    }
}

/// The committed learned-delay statistics of `tenant`.
pub(super) fn read_tenant(db: &DB, tenant: &str) -> Result<Option<TenantStats>, Error> {
    let raw = db
        .get_pinned_cf(cf(db, CF_TENANTS), tenant)
        .map_err(|source| Error::Read {
            cf: CF_TENANTS,
            source,
        })?;
    raw.map(|v| keys::decode_tenant(tenant.as_bytes(), &v))
        .transpose()
}

/// The committed state of `key`.
pub(super) fn read_state(db: &DB, key: &SessionKey) -> Result<Option<SessionState>, Error> {
    let raw = db
        .get_pinned_cf(cf(db, CF_SESSIONS), key.as_str())
        .map_err(|source| Error::Read {
            cf: CF_SESSIONS,
            source,
        })?;
    raw.map(|v| keys::decode_state(key.as_str().as_bytes(), &v))
        .transpose()
}
