//! [`Batch`]: the changes of one input batch, applied to the store's memory at
//! [`Batch::commit`] (and, in write-through mode, to RocksDB in the same call).
//!
//! A batch is an overlay on the store's in-memory state (`store::mem`): reads see the batch's
//! own writes first, then the cached state, then RocksDB for a key the cache evicted. The
//! store does not change while a batch exists (the batch borrows it mutably), so the timer
//! index can be walked once: the batch remembers the first live timer of the index (its
//! *head*, skipping the timers it cancelled itself) and, when the driver cancels the head
//! (it fired), scans on from there; firing n timers in a batch costs n steps. Timers set by
//! the batch are kept in an ordered set and compared with the head.
//!
//! **In place** (write-behind mode, the runtime's): a batch changes the store's memory as it
//! goes, with no overlay — reads and writes go straight to the cached entries (read from
//! RocksDB into the cache on a miss), the timer index, the outbox and the counters; `commit`
//! only marks it done. Nothing reaches RocksDB before the next flush either way. A batch
//! dropped without commit (an error mid-batch) leaves memory ahead of what it applied, so
//! the store refuses to flush until it is reopened (`StoreState::stale`): the runtime treats
//! such an error as fatal for the partition, and the next owner re-reads that input.
//!
//! A key has at most one timer (the engine's one-timer-per-key rule; the store keeps it so:
//! setting a key's timer replaces the previous one). Timers belong to keys with state: a
//! timer of a key without state is kept in memory and not stored.

use super::error::Error;
use super::keys::{self, CF_SESSIONS};
use super::mem::{group_by_tenant, TenantTimers};
use super::{cf, StoreState};
use crate::engine::{
    Emission, Millis, SessionKey, SessionState, SessionTable, TenantStats, MAX_LEARNED_TENANTS,
};
use rocksdb::DB;
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::hash_map::Entry;
use std::collections::BTreeSet;
use std::ops::Bound;

/// One key's state as the batch knows it.
struct Slot {
    /// The state before the batch: `None` = no state; `Some(open)` = state, with a round
    /// open or not.
    base: Option<bool>,
    /// The state as of the batch's writes.
    current: Option<SessionState>,
    /// The key's timer as of the batch's writes.
    due: Option<Millis>,
    /// Written by the batch.
    dirty: bool,
    /// Read from RocksDB by this batch (not cached yet).
    from_disk: bool,
}

/// One tenant's learned-delay statistics as the batch knows them.
struct TenantSlot {
    /// The store holds the tenant.
    base: bool,
    /// The statistics as of the batch's writes (`None`: none, or evicted by the batch).
    current: Option<TenantStats>,
    /// Written by the batch.
    dirty: bool,
}

/// What the batch knows of the first live timer of the store's index.
enum Head {
    /// Not known: scan after `after` (from the start when `None`).
    Unknown { after: Option<(Millis, SessionKey)> },
    /// This timer.
    At((Millis, SessionKey)),
    /// None: every timer of the index is cancelled by the batch.
    End,
}

/// The uncommitted changes of one input batch: session puts/deletes, timer sets/cancels,
/// owed emissions (outbox), and the input offset and partition time they bring the
/// partition to. Implements [`SessionTable`] for [`crate::engine::Driver`], reading its
/// own writes. [`Batch::commit`] applies all of it to the store at once; dropping a batch
/// without committing discards it.
///
/// Memory: proportional to the keys and timers the batch touches; commit in bounded
/// chunks (e.g. `Driver::advance_at_most` during catch-up).
pub struct Batch<'s> {
    db: &'s DB,
    state: &'s mut StoreState,
    /// Changes go straight to the store's memory (write-behind mode; module docs).
    in_place: bool,
    /// Owed emissions pushed in place by this batch.
    pushed: usize,
    slots: FxHashMap<SessionKey, Slot>,
    /// Timers set by the batch, in firing order; disjoint from `timer_dels`.
    timer_puts: BTreeSet<(Millis, SessionKey)>,
    /// Timers of the index cancelled by the batch.
    timer_dels: FxHashSet<(Millis, SessionKey)>,
    head: Head,
    /// Owed emissions, in push order.
    outbox: Vec<Emission>,
    offset: Option<i64>,
    partition_time: Option<Millis>,
    /// Tenants' learned-delay statistics read or written by the batch.
    tenants: FxHashMap<Box<str>, TenantSlot>,
}

impl<'s> Batch<'s> {
    pub(super) fn new(db: &'s DB, state: &'s mut StoreState) -> Self {
        Batch {
            db,
            in_place: state.write_behind,
            state,
            pushed: 0,
            slots: FxHashMap::default(),
            timer_puts: BTreeSet::new(),
            timer_dels: FxHashSet::default(),
            head: Head::Unknown { after: None },
            outbox: Vec::new(),
            offset: None,
            partition_time: None,
            tenants: FxHashMap::default(),
        }
    }

    /// Appends an owed emission to the outbox (FIFO). Returns the sequence number it will
    /// have once committed (the number `outbox_ack` takes). Errors: none today (kept for
    /// the encoding a durable write may need).
    pub fn push_outbox(&mut self, emission: &Emission) -> Result<u64, Error> {
        if self.in_place {
            self.state.stale = true;
            let mem = &mut self.state.mem;
            let seq = mem.current.next_seq;
            mem.outbox.push(seq, emission.clone());
            mem.current.next_seq += 1;
            self.pushed += 1;
            return Ok(seq);
        }
        let seq = self.state.mem.current.next_seq + self.outbox.len() as u64;
        self.outbox.push(emission.clone());
        Ok(seq)
    }

    /// Records that the input up to `offset` is applied by this batch. The value is stored
    /// as given and read back by `PartitionStore::stored_offset` once flushed; the runtime
    /// chooses the convention (the next offset to consume is the usual one).
    pub fn set_offset(&mut self, offset: i64) {
        if self.in_place {
            self.state.stale = true;
            let c = &mut self.state.mem.current;
            c.offset = Some(offset);
            c.position_dirty = true;
            return;
        }
        self.offset = Some(offset);
    }

    /// Records the partition time (ms, SEMANTICS §3) reached by this batch.
    pub fn set_partition_time(&mut self, now: Millis) {
        if self.in_place {
            self.state.stale = true;
            let c = &mut self.state.mem.current;
            c.partition_time = Some(now);
            c.position_dirty = true;
            return;
        }
        self.partition_time = Some(now);
    }

    /// Owed emissions pushed so far in this batch.
    pub fn outbox_pushed(&self) -> usize {
        self.outbox.len() + self.pushed
    }

    /// The timers with `due < before` (ms) as of the batch's writes (the store's index
    /// without the timers the batch cancelled, plus the ones it set), grouped by tenant as
    /// [`super::PartitionStore::overdue_timers`] groups the committed ones: per tenant its
    /// earliest `per_tenant` timers and whether it has more. Walks the index up to `before`;
    /// copies at most `per_tenant` keys per tenant. In place (write-behind), a group may
    /// hold a timer that is gone (fired or moved since it was set): the index is not asked
    /// for each key; the runtime's catch-up queue checks [`SessionTable::has_timer`] before
    /// it fires one. Errors: none today (kept for a store that pages its index).
    pub fn overdue_timers(
        &mut self,
        before: Millis,
        per_tenant: usize,
    ) -> Result<Vec<TenantTimers>, Error> {
        if self.in_place {
            return Ok(self.state.mem.overdue_timers_mut(before, per_tenant));
        }
        let dels = &self.timer_dels;
        let committed: Vec<(Millis, SessionKey)> = self
            .state
            .mem
            .walk_timers()
            .take_while(|(due, _)| *due < before)
            .filter(|t| !dels.contains(*t))
            .cloned()
            .collect();
        let merged = Merged {
            a: committed.iter().peekable(),
            b: self.timer_puts.iter().peekable(),
        };
        Ok(group_by_tenant(
            merged.take_while(|(due, _)| *due < before),
            per_tenant,
        ))
    }

    /// Whether at least `n` timers of the batch's view, from `first` (the batch's first due
    /// timer, [`SessionTable::first_due`]) on, are due before `before` (walks at most `n`
    /// of them, none before `first`): lets the catch-up release skip building its queue
    /// when only a few timers are due at once (a replayed backlog fires one or two per
    /// upload).
    pub fn timers_due_before_at_least(
        &self,
        first: &(Millis, SessionKey),
        before: Millis,
        n: usize,
    ) -> bool {
        if self.in_place {
            // Every live timer comes at or after `first`, the first of them.
            return self.state.mem.timers_due_before_at_least(before, n);
        }
        let from = (Bound::Included(first), Bound::Unbounded);
        let mem = &self.state.mem;
        let committed: Vec<(Millis, SessionKey)> = mem
            .timers(usize::MAX)
            .into_iter()
            .filter(|t| t >= first && t.0 < before && !self.timer_dels.contains(t))
            .take(n)
            .collect();
        let merged = Merged {
            a: committed.iter().peekable(),
            b: self
                .timer_puts
                .range::<(Millis, SessionKey), _>(from)
                .peekable(),
        };
        merged.take_while(|(due, _)| *due < before).take(n).count() >= n
    }

    /// Applies the whole batch (sessions and their timers, tenants' learned-delay
    /// statistics, outbox, offset, partition time, counters) to the store's memory. In
    /// write-through mode (the default) it is then written to RocksDB in ONE write batch
    /// before this returns; in write-behind mode (`PartitionStore::set_write_behind`) the
    /// next `PartitionStore::flush` writes it.
    ///
    /// Errors (write-through only): [`Error::Write`] (RocksDB refused the write),
    /// [`Error::InjectedFault`], [`Error::Encode`]. Nothing is stored then, and the store's
    /// memory is reloaded from RocksDB: it is as before the batch. The runtime treats the
    /// error as fatal for the partition.
    pub fn commit(self) -> Result<(), Error> {
        if self.in_place {
            // Everything is in memory already; the next flush writes it.
            self.state.stale = false;
            return Ok(());
        }
        let Batch {
            db,
            state,
            slots,
            timer_puts,
            timer_dels,
            outbox,
            offset,
            partition_time,
            tenants,
            ..
        } = self;
        // The timer index follows each key's due (`Mem::set`); the batch's view of it
        // (`timer_puts`, `timer_dels`) is done.
        drop((timer_puts, timer_dels));
        let mem = &mut state.mem;
        let (mut sessions, mut open_rounds) =
            (mem.current.sessions as i64, mem.current.open_rounds as i64);
        for (key, slot) in slots {
            if !slot.dirty {
                if slot.from_disk {
                    mem.insert_clean(&key, slot.current, slot.due);
                }
                continue;
            }
            sessions -= i64::from(slot.base.is_some());
            open_rounds -= i64::from(slot.base == Some(true));
            if let Some(s) = &slot.current {
                sessions += 1;
                open_rounds += i64::from(s.round.is_some());
            }
            mem.set(&key, slot.current, slot.due);
        }
        mem.current.sessions = sessions.max(0) as u64;
        mem.current.open_rounds = open_rounds.max(0) as u64;
        for emission in outbox {
            mem.outbox.push(mem.current.next_seq, emission);
            mem.current.next_seq += 1;
        }
        for (name, slot) in tenants {
            if !slot.dirty {
                continue;
            }
            match slot.current {
                Some(stats) => {
                    mem.ages.touch(&name, stats.last_seen);
                    mem.tenants.insert(name.clone(), stats);
                }
                None => {
                    mem.ages.remove(&name);
                    mem.tenants.remove(&name);
                }
            }
            mem.dirty_tenants.insert(name);
        }
        if offset.is_some() {
            mem.current.offset = offset;
            mem.current.position_dirty = true;
        }
        if partition_time.is_some() {
            mem.current.partition_time = partition_time;
            mem.current.position_dirty = true;
        }
        if state.write_behind {
            Ok(())
        } else {
            super::flush_state(db, state).map(|_| ())
        }
    }

    /// Brings the cached entries of `keys` (the uploads a step is about to apply) toward the
    /// CPU cache, their lookups overlapping (`store::mem`'s `warm`). A hint: changes nothing,
    /// does nothing for a write-through batch.
    pub fn warm<'k>(&self, keys: impl Iterator<Item = &'k SessionKey>) {
        if self.in_place {
            self.state.mem.warm(keys);
        }
    }

    /// Reads the stored state of those of `keys` that neither the batch nor the cache holds,
    /// in ONE sorted RocksDB multi-get, so the driver's next reads of them are memory
    /// lookups: called with the keys of the timers about to fire in a catch-up (a replayed
    /// backlog's state expiries are mostly of evicted sessions, and one point read each cost
    /// ~15 % of the shared benchmark). At most `MAX_PREFETCH` keys per call (the rest are
    /// read one by one, as without it). Returns how many keys were read.
    ///
    /// Errors: [`Error::Read`] (RocksDB refused a read) or [`Error::Decode`] (a stored value
    /// is corrupt); nothing is added to the batch then.
    pub fn prefetch<'k>(
        &mut self,
        keys: impl IntoIterator<Item = &'k SessionKey>,
    ) -> Result<usize, Error> {
        const MAX_PREFETCH: usize = 4096;
        if self.state.mem.evicted.is_empty() {
            // Nothing with state was evicted: a key the cache lacks has no state.
            return Ok(0);
        }
        let mem = &self.state.mem;
        // Evicted keys whose state must be read (an idle one expires without a read).
        let mut missing: Vec<&'k SessionKey> = keys
            .into_iter()
            .filter(|k| {
                !self.slots.contains_key(*k)
                    && mem.evicted.get(k).is_some_and(|e| e.idle_since().is_none())
            })
            .take(MAX_PREFETCH)
            .collect();
        if missing.is_empty() {
            return Ok(0);
        }
        missing.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));
        missing.dedup();
        let values = self.db.batched_multi_get_cf(
            cf(self.db, CF_SESSIONS),
            missing.iter().map(|k| k.as_str().as_bytes()),
            true,
        );
        let mut slots = Vec::with_capacity(missing.len());
        let in_place = self.in_place;
        for (key, value) in missing.iter().zip(values) {
            let value = value.map_err(|source| Error::Read {
                cf: CF_SESSIONS,
                source,
            })?;
            let (current, due) = match value {
                Some(v) => {
                    let (due, state) = keys::decode_session(key.as_str().as_bytes(), &v)?;
                    (Some(state), due)
                }
                None => (None, None),
            };
            if in_place {
                self.state.mem.insert_clean(key, current, due);
                continue;
            }
            slots.push((
                (*key).clone(),
                Slot {
                    base: current.as_ref().map(|s| s.round.is_some()),
                    current,
                    due,
                    dirty: false,
                    from_disk: true,
                },
            ));
        }
        self.slots.extend(slots);
        Ok(missing.len())
    }

    /// In place: changes `key`'s cached entry with `f` ([`super::mem::Mem::change`]), first
    /// caching it from RocksDB on a miss (a key without state gets an entry without state).
    fn change<R>(
        &mut self,
        key: &SessionKey,
        f: impl FnOnce(&mut Option<SessionState>, &mut Option<Millis>) -> (R, bool),
    ) -> Result<R, Error> {
        let stale = &mut self.state.stale;
        let f = |s: &mut Option<SessionState>, d: &mut Option<Millis>| {
            let (r, changed) = f(s, d);
            // Cleared by `commit`: a batch dropped half-applied leaves it set.
            *stale |= changed;
            (r, changed)
        };
        let f = match self.state.mem.change(key, f) {
            Ok(r) => return Ok(r),
            Err(f) => f,
        };
        let mem = &mut self.state.mem;
        // A key neither cached nor evicted has no state: no read.
        let (state, due) = if mem.is_evicted(key) {
            match read_session(self.db, key)? {
                Some((due, state)) => (Some(state), due),
                None => (None, None),
            }
        } else {
            (None, None)
        };
        mem.insert_clean(key, state, due);
        match mem.change(key, f) {
            Ok(r) => Ok(r),
            Err(_) => unreachable!("the key was cached just above"),
        }
    }

    /// The slot of `key`: from the batch, the cache, or RocksDB on a miss.
    fn slot(&mut self, key: &SessionKey) -> Result<&mut Slot, Error> {
        // The common case (the driver's several calls per upload) without cloning the key.
        if self.slots.contains_key(key) {
            return Ok(self.slots.get_mut(key).expect("checked just above"));
        }
        match self.slots.entry(key.clone()) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(e) => {
                let mem = &mut self.state.mem;
                let evicted = mem.is_evicted(key);
                let (current, due, from_disk) = match mem.touch(key) {
                    Some(entry) => (entry.state.clone(), entry.due, false),
                    None if !evicted => (None, None, false),
                    None => match read_session(self.db, key)? {
                        Some((due, state)) => (Some(state), due, true),
                        None => (None, None, true),
                    },
                };
                Ok(e.insert(Slot {
                    base: current.as_ref().map(|s| s.round.is_some()),
                    current,
                    due,
                    dirty: false,
                    from_disk,
                }))
            }
        }
    }

    /// The slot of `tenant` (every tenant is in memory).
    fn tenant_slot(&mut self, tenant: &str) -> &mut TenantSlot {
        if !self.tenants.contains_key(tenant) {
            let current = self.state.mem.tenants.get(tenant).cloned();
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
        self.tenants
            .get_mut(tenant)
            .expect("the slot was just inserted")
    }

    /// Tenants with statistics as of the batch's writes.
    fn tenant_count(&self) -> usize {
        let committed = self.state.mem.tenants.len() as i64;
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
            .mem
            .ages
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

    /// The first timer of the index not cancelled by the batch.
    fn index_head(&mut self) -> Option<&(Millis, SessionKey)> {
        if let Head::Unknown { after } = &self.head {
            let after = after.clone();
            let dels = &self.timer_dels;
            let found = self
                .state
                .mem
                .first_timer_after(after.as_ref(), |t| !dels.contains(t));
            self.head = match found {
                Some(t) => Head::At(t),
                None => Head::End,
            };
        }
        match &self.head {
            Head::At(t) => Some(t),
            Head::End | Head::Unknown { .. } => None,
        }
    }

    /// Cancels the timer `(due, key)` in the overlay.
    fn drop_timer(&mut self, t: (Millis, SessionKey)) {
        self.timer_puts.remove(&t);
        if matches!(&self.head, Head::At(h) if *h == t) {
            // The head is cancelled: the next scan starts after it.
            self.head = Head::Unknown {
                after: Some(t.clone()),
            };
        }
        if self.state.mem.has_timer(t.0, &t.1) {
            self.timer_dels.insert(t);
        }
    }
}

impl SessionTable for Batch<'_> {
    type Error = Error;

    fn get(&mut self, key: &SessionKey) -> Result<Option<SessionState>, Error> {
        if self.in_place {
            return self.change(key, |s, _| (s.clone(), false));
        }
        Ok(self.slot(key)?.current.clone())
    }

    fn put(&mut self, key: &SessionKey, state: &SessionState) -> Result<(), Error> {
        if self.in_place {
            return self.change(key, |s, _| {
                match s {
                    Some(s) => s.clone_from(state),
                    None => *s = Some(state.clone()),
                }
                ((), true)
            });
        }
        let slot = self.slot(key)?;
        match &mut slot.current {
            Some(s) => s.clone_from(state),
            None => slot.current = Some(state.clone()),
        }
        slot.dirty = true;
        Ok(())
    }

    fn delete(&mut self, key: &SessionKey) -> Result<(), Error> {
        if self.in_place {
            return self.change(key, |s, _| {
                *s = None;
                ((), true)
            });
        }
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
        if self.in_place {
            return self.change(key, |s, _| f(s));
        }
        let slot = self.slot(key)?;
        let (r, changed) = f(&mut slot.current);
        slot.dirty |= changed;
        Ok(r)
    }

    fn set_timer(&mut self, due: Millis, key: &SessionKey) -> Result<(), Error> {
        if self.in_place {
            // The store's timer index follows the entry's due (`Mem::change`).
            self.change(key, |_, d| (d.replace(due), true))?;
            return Ok(());
        }
        let slot = self.slot(key)?;
        let old = slot.due.replace(due);
        slot.dirty = true;
        if let Some(old) = old.filter(|&o| o != due) {
            // One timer per key: the new one replaces it.
            self.drop_timer((old, key.clone()));
        }
        let t = (due, key.clone());
        // A set never waits for the index scan to find it: a cancelled index timer set
        // again may lie behind the head.
        self.timer_dels.remove(&t);
        self.timer_puts.insert(t);
        Ok(())
    }

    fn cancel_timer(&mut self, due: Millis, key: &SessionKey) -> Result<(), Error> {
        if self.in_place {
            self.change(key, |_, d| {
                if *d == Some(due) {
                    *d = None;
                    ((), true)
                } else {
                    ((), false)
                }
            })?;
            self.state.stale = true;
            return Ok(());
        }
        let slot = self.slot(key)?;
        if slot.due == Some(due) {
            slot.due = None;
            slot.dirty = true;
        }
        self.drop_timer((due, key.clone()));
        Ok(())
    }

    fn tenant_stats(&mut self, tenant: &str) -> Result<Option<TenantStats>, Error> {
        if self.in_place {
            return Ok(self.state.mem.tenants.get(tenant).cloned());
        }
        Ok(self.tenant_slot(tenant).current.clone())
    }

    fn put_tenant_stats(&mut self, tenant: &str, stats: &TenantStats) -> Result<(), Error> {
        if self.in_place {
            self.state.stale = true;
            let mem = &mut self.state.mem;
            if !mem.tenants.contains_key(tenant) && mem.tenants.len() >= MAX_LEARNED_TENANTS {
                let victim: Option<Box<str>> = mem
                    .ages
                    .oldest_first()
                    .find(|(_, name)| *name != tenant)
                    .map(|(_, name)| name.into());
                if let Some(victim) = victim {
                    mem.ages.remove(&victim);
                    mem.tenants.remove(&victim);
                    mem.dirty_tenants.insert(victim);
                }
            }
            mem.ages.touch(tenant, stats.last_seen);
            match mem.tenants.get_mut(tenant) {
                Some(s) => s.clone_from(stats),
                None => {
                    mem.tenants.insert(tenant.into(), stats.clone());
                }
            }
            if !mem.dirty_tenants.contains(tenant) {
                mem.dirty_tenants.insert(tenant.into());
            }
            return Ok(());
        }
        let is_new = self.tenant_slot(tenant).current.is_none();
        if is_new && self.tenant_count() >= MAX_LEARNED_TENANTS {
            if let Some(victim) = self.stalest_tenant(tenant) {
                let slot = self.tenant_slot(&victim);
                slot.current = None;
                slot.dirty = true;
            }
        }
        let slot = self.tenant_slot(tenant);
        match &mut slot.current {
            Some(s) => s.clone_from(stats),
            None => slot.current = Some(stats.clone()),
        }
        slot.dirty = true;
        Ok(())
    }

    fn expire_unread(
        &mut self,
        due: Millis,
        key: &SessionKey,
        expired: impl FnOnce(Millis) -> bool,
    ) -> Result<bool, Error> {
        if self.in_place {
            let mem = &mut self.state.mem;
            let idle = mem.evicted.get(key).and_then(|e| e.idle_since());
            let Some(last_upload_at) = idle else {
                return Ok(false);
            };
            if !expired(last_upload_at) {
                return Ok(false);
            }
            // The stored state (no round open) is gone; the timer stays until the caller
            // cancels it.
            self.state.stale = true;
            let mem = &mut self.state.mem;
            mem.set(key, None, Some(due));
            mem.current.sessions = mem.current.sessions.saturating_sub(1);
            return Ok(true);
        }
        let mem = &self.state.mem;
        if mem.evicted.is_empty() || self.slots.contains_key(key) {
            return Ok(false);
        }
        let Some(last_upload_at) = mem.evicted.get(key).and_then(|e| e.idle_since()) else {
            return Ok(false);
        };
        if !expired(last_upload_at) {
            return Ok(false);
        }
        // As `delete` after a read would leave it: the stored state (no round open) is gone,
        // the key's timer is still `due` until the caller cancels it.
        self.slots.insert(
            key.clone(),
            Slot {
                base: Some(false),
                current: None,
                due: Some(due),
                dirty: true,
                from_disk: false,
            },
        );
        Ok(true)
    }

    fn has_timer(&mut self, due: Millis, key: &SessionKey) -> Result<bool, Error> {
        if self.in_place {
            return Ok(self.state.mem.has_timer(due, key));
        }
        let t = (due, key.clone());
        Ok(self.timer_puts.contains(&t)
            || (!self.timer_dels.contains(&t) && self.state.mem.has_timer(due, key)))
    }

    fn first_due(&mut self, now: Millis) -> Result<Option<(Millis, SessionKey)>, Error> {
        if self.in_place {
            return Ok(self.state.mem.first_due(now));
        }
        self.index_head();
        let head = match &self.head {
            Head::At(t) => Some(t),
            Head::End | Head::Unknown { .. } => None,
        };
        let first = match (head, self.timer_puts.first()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // Cloned only when due: most calls (one per upload) find nothing due.
        Ok(first.filter(|(due, _)| *due <= now).cloned())
    }
}

/// Two timer iterators in `(due, key)` order merged into one (a timer in both comes once).
struct Merged<A: Iterator, B: Iterator> {
    a: std::iter::Peekable<A>,
    b: std::iter::Peekable<B>,
}

impl<'a, A, B> Iterator for Merged<A, B>
where
    A: Iterator<Item = &'a (Millis, SessionKey)>,
    B: Iterator<Item = &'a (Millis, SessionKey)>,
{
    type Item = &'a (Millis, SessionKey);

    fn next(&mut self) -> Option<Self::Item> {
        match (self.a.peek(), self.b.peek()) {
            (Some(x), Some(y)) if x == y => {
                self.b.next();
                self.a.next()
            }
            (Some(x), Some(y)) if x < y => self.a.next(),
            (Some(_), Some(_)) | (None, _) => self.b.next(),
            (Some(_), None) => self.a.next(),
        }
    }
}

/// The stored state of `key` and its timer, read from RocksDB.
pub(super) fn read_session(
    db: &DB,
    key: &SessionKey,
) -> Result<Option<(Option<Millis>, SessionState)>, Error> {
    let raw = db
        .get_pinned_cf(cf(db, CF_SESSIONS), key.as_str())
        .map_err(|source| Error::Read {
            cf: CF_SESSIONS,
            source,
        })?;
    raw.map(|v| keys::decode_session(key.as_str().as_bytes(), &v))
        .transpose()
}
