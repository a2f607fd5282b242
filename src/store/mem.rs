//! The in-memory side of a partition store (store v2, "memory first, RocksDB behind";
//! ARCHITECTURE § Partition state).
//!
//! What it holds, for one partition:
//!
//! * **Sessions**: a bounded cache of per-key state ([`Entry`]), with the key's timer. Dirty
//!   entries (changed since the last flush) are never evicted; clean ones are evicted least
//!   recently used when the process's session-cache budget ([`CacheBudget`]) is exceeded, and
//!   read back from RocksDB on a miss. While nothing with state was evicted since the store
//!   opened (`complete`), a miss needs no RocksDB read at all: the key has no state.
//! * **Idle evicted sessions**: for each evicted key whose state had no round open, its
//!   `last_upload_at` (`idle_evicted`, ~30 bytes a key): its timer is its state expiry, which
//!   then needs no read of the state ([`crate::engine::SessionTable::expire_unread`]). A key
//!   is in it only while it is not cached.
//! * **Timers**: the whole index `(due, key)` in firing order, for every stored key (evicted
//!   or not): a few dozen bytes per key. Rebuilt at open from one scan of `sessions` (each
//!   value starts with its key's timer).
//! * **Outbox**: every owed emission by sequence number, and the first sequence number not
//!   yet durable (`durable_seq`): only entries below it may be published (durable first,
//!   then visible). Acknowledged entries that were already flushed leave a delete for the
//!   next flush.
//! * **Tenants**: every tenant's learned-delay statistics (at most
//!   `engine::MAX_LEARNED_TENANTS`) and their eviction order.
//! * The current counters, input offset and partition time, ahead of the durable ones in
//!   `meta` until the next flush.
//!
//! Invariant: `timers` holds exactly one `(due, key)` for each key whose entry (cached or
//! stored) has a timer, and nothing else; `dirty` lists each dirty entry's slot once.

use crate::engine::{Emission, Millis, SessionKey, SessionState, TenantAges, TenantStats};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The session-cache budget shared by the stores of one process (bytes, approximate: key and
/// state bytes plus a fixed per-entry overhead). Cheap to clone: clones share the count.
#[derive(Clone, Debug)]
pub struct CacheBudget {
    inner: Arc<BudgetInner>,
}

#[derive(Debug)]
struct BudgetInner {
    limit: usize,
    used: AtomicUsize,
}

impl CacheBudget {
    /// A budget of `limit` bytes (`store.session-cache`).
    pub fn new(limit: usize) -> Self {
        CacheBudget {
            inner: Arc::new(BudgetInner {
                limit,
                used: AtomicUsize::new(0),
            }),
        }
    }

    /// The limit (bytes).
    pub fn limit(&self) -> usize {
        self.inner.limit
    }

    /// Bytes charged by every store sharing this budget.
    pub fn used(&self) -> usize {
        self.inner.used.load(Ordering::Relaxed)
    }

    fn charge(&self, add: usize, sub: usize) {
        if add >= sub {
            self.inner.used.fetch_add(add - sub, Ordering::Relaxed);
        } else {
            self.inner.used.fetch_sub(sub - add, Ordering::Relaxed);
        }
    }
}

/// Fixed bytes charged per cached key besides its key and string contents: the map slot, the
/// entry, the key's allocation header and the timer index node (measured order of magnitude).
const ENTRY_OVERHEAD: usize = 96 + std::mem::size_of::<Entry>();

/// One cached key.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    /// The state (`None`: the key has none; a delete is owed when dirty).
    pub(crate) state: Option<SessionState>,
    /// The key's timer (ms).
    pub(crate) due: Option<Millis>,
    /// Changed since the last flush.
    pub(crate) dirty: bool,
    /// Last use (the store's use counter), for eviction.
    tick: u64,
    /// Bytes charged to the budget for this entry.
    bytes: usize,
}

/// Approximate memory of `key` with `state`.
fn entry_bytes(key: &SessionKey, state: Option<&SessionState>) -> usize {
    let heap = state.map_or(0, |s| {
        let strings = s.last_applied_event_id.as_ref().map_or(0, String::len);
        strings
            + s.round.as_ref().map_or(0, |r| {
                // The boxed round itself, with its allocation header.
                std::mem::size_of::<crate::engine::Round>()
                    + 16
                    + r.last_event_id.as_ref().map_or(0, String::len)
                    + r.attributes.as_ref().map_or(0, String::len)
                    + r.parts.capacity() * 4
            })
    });
    ENTRY_OVERHEAD + key.as_str().len() + heap
}

/// The current (not necessarily durable) counters and position of the partition.
#[derive(Clone, Debug, Default)]
pub(crate) struct Current {
    pub(crate) offset: Option<i64>,
    pub(crate) partition_time: Option<Millis>,
    pub(crate) next_seq: u64,
    pub(crate) sessions: u64,
    pub(crate) open_rounds: u64,
    /// Offset or partition time changed since the last flush.
    pub(crate) position_dirty: bool,
}

/// A cached key and its entry, in [`Mem`]'s slot vector (`entry` `None`: a free slot).
pub(crate) struct Slot {
    pub(crate) key: SessionKey,
    pub(crate) entry: Option<Entry>,
}

/// The in-memory state of one partition store (module docs).
///
/// Cached entries live in a vector of slots that never move while their key is cached; the
/// map `index` only maps a key to its slot number, so that growing it moves small buckets,
/// the dirty list names slots (a flush reaches its entries without a lookup), and the slot
/// of the key looked up last is remembered (`last`): the driver's several calls per upload
/// (state, then timer) look the key up once.
pub(crate) struct Mem {
    index: FxHashMap<SessionKey, u32>,
    slots: Vec<Slot>,
    /// Free slot numbers (their `entry` is `None`).
    free: Vec<u32>,
    /// The key last looked up, with its slot (cleared when a slot is freed).
    last: Option<(SessionKey, u32)>,
    /// Slots of dirty entries, each once.
    pub(crate) dirty: Vec<u32>,
    /// Every key with stored state has an entry (nothing with state was evicted).
    pub(crate) complete: bool,
    pub(crate) timers: BTreeSet<(Millis, SessionKey)>,
    /// Evicted keys whose state has no round open, with the state's `last_upload_at` (ms);
    /// disjoint from the cached keys (module docs).
    pub(crate) idle_evicted: FxHashMap<SessionKey, Millis>,
    /// Owed emissions by sequence number.
    pub(crate) outbox: BTreeMap<u64, Emission>,
    /// Outbox entries below this sequence number are in RocksDB.
    pub(crate) durable_seq: u64,
    /// Outbox entries below this sequence number are in RocksDB or in the write in flight
    /// (`store::InFlight`); `durable_seq` catches up when that write is done. The next flush
    /// writes the entries from here on.
    pub(crate) written_seq: u64,
    /// Acknowledged sequence numbers below `written_seq`: deletes owed to RocksDB.
    pub(crate) acked: Vec<u64>,
    /// Outbox entries below this sequence number are deleted in RocksDB (or by the write in
    /// flight): the head the last flush left (`meta` `outbox_head`).
    pub(crate) deleted_below: u64,
    pub(crate) tenants: FxHashMap<Box<str>, TenantStats>,
    /// Tenants changed (or evicted) since the last flush.
    pub(crate) dirty_tenants: FxHashSet<Box<str>>,
    /// `tenants` by `last_seen` (the eviction order).
    pub(crate) ages: TenantAges,
    pub(crate) current: Current,
    tick: u64,
    /// Bytes this store charged to `budget`.
    charged: usize,
    budget: CacheBudget,
}

impl Mem {
    /// An empty memory side charging `budget`.
    pub(crate) fn new(budget: CacheBudget) -> Self {
        Mem {
            index: FxHashMap::default(),
            slots: Vec::new(),
            free: Vec::new(),
            last: None,
            dirty: Vec::new(),
            complete: true,
            timers: BTreeSet::new(),
            idle_evicted: FxHashMap::default(),
            outbox: BTreeMap::new(),
            durable_seq: 0,
            written_seq: 0,
            acked: Vec::new(),
            deleted_below: 0,
            tenants: FxHashMap::default(),
            dirty_tenants: FxHashSet::default(),
            ages: TenantAges::new(),
            current: Current::default(),
            tick: 0,
            charged: 0,
            budget,
        }
    }

    /// Forgets everything (before a reload from RocksDB), giving its bytes back.
    pub(crate) fn clear(&mut self) {
        // The old value's `Drop` gives its bytes back.
        *self = Mem::new(self.budget.clone());
    }

    /// True when the budget has room for `bytes` more (used while loading at open).
    pub(crate) fn has_room(&self, bytes: usize) -> bool {
        self.budget.used() + bytes <= self.budget.limit()
    }

    /// Approximate bytes of a key with state, for [`Mem::has_room`].
    pub(crate) fn bytes_of(key: &SessionKey, state: &SessionState) -> usize {
        entry_bytes(key, Some(state))
    }

    /// The slot number of `key` if cached: the remembered one, or from the index.
    fn find(&mut self, key: &SessionKey) -> Option<u32> {
        if let Some((k, i)) = &self.last {
            if k == key {
                return Some(*i);
            }
        }
        let i = *self.index.get(key)?;
        self.last = Some((key.clone(), i));
        Some(i)
    }

    /// Caches `entry` for `key` (not cached): its slot number.
    fn add(&mut self, key: &SessionKey, entry: Entry) -> u32 {
        if !self.idle_evicted.is_empty() {
            self.idle_evicted.remove(key);
        }
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = Slot {
                    key: key.clone(),
                    entry: Some(entry),
                };
                i
            }
            None => {
                // Fewer than 2^32 keys live in one partition's memory (each takes ~200 bytes).
                let i = u32::try_from(self.slots.len()).expect("fewer than 2^32 cached sessions");
                self.slots.push(Slot {
                    key: key.clone(),
                    entry: Some(entry),
                });
                i
            }
        };
        self.index.insert(key.clone(), i);
        self.last = Some((key.clone(), i));
        i
    }

    /// The entry in slot `i` (a slot number from `index` or `dirty`).
    pub(crate) fn slot_mut(&mut self, i: u32) -> (&SessionKey, Option<&mut Entry>) {
        let slot = &mut self.slots[i as usize];
        (&slot.key, slot.entry.as_mut())
    }

    /// The key of slot `i`.
    pub(crate) fn slot_key(&self, i: u32) -> &SessionKey {
        &self.slots[i as usize].key
    }

    /// The cached entry of `key`, if any (not marked as used).
    pub(crate) fn entry(&self, key: &SessionKey) -> Option<&Entry> {
        let i = *self.index.get(key)?;
        self.slots[i as usize].entry.as_ref()
    }

    /// Whether `key` is cached.
    pub(crate) fn is_cached(&self, key: &SessionKey) -> bool {
        self.index.contains_key(key)
    }

    /// Number of cached keys.
    pub(crate) fn cached_len(&self) -> usize {
        self.index.len()
    }

    /// The cached entry of `key`, marked as used.
    pub(crate) fn touch(&mut self, key: &SessionKey) -> Option<&Entry> {
        self.tick += 1;
        let tick = self.tick;
        let i = self.find(key)?;
        self.slots[i as usize].entry.as_mut().map(|e| {
            e.tick = tick;
            &*e
        })
    }

    /// Caches `key` as read from RocksDB (clean). Does nothing if it is cached already.
    pub(crate) fn insert_clean(
        &mut self,
        key: &SessionKey,
        state: Option<SessionState>,
        due: Option<Millis>,
    ) {
        if self.find(key).is_some() {
            return;
        }
        self.tick += 1;
        let bytes = entry_bytes(key, state.as_ref());
        self.charge(bytes, 0);
        let entry = Entry {
            state,
            due,
            dirty: false,
            tick: self.tick,
            bytes,
        };
        self.add(key, entry);
    }

    /// Sets `key`'s state and timer (a change: the entry becomes dirty).
    pub(crate) fn set(
        &mut self,
        key: &SessionKey,
        state: Option<SessionState>,
        due: Option<Millis>,
    ) {
        self.tick += 1;
        let bytes = entry_bytes(key, state.as_ref());
        let tick = self.tick;
        let old = match self.find(key) {
            Some(i) => {
                // Invariant: an indexed slot holds an entry.
                let e = self.slots[i as usize].entry.as_mut().expect("indexed slot");
                let old = e.bytes;
                if !e.dirty {
                    e.dirty = true;
                    self.dirty.push(i);
                }
                e.state = state;
                e.due = due;
                e.tick = tick;
                e.bytes = bytes;
                old
            }
            None => {
                let entry = Entry {
                    state,
                    due,
                    dirty: true,
                    tick,
                    bytes,
                };
                let i = self.add(key, entry);
                self.dirty.push(i);
                0
            }
        };
        self.charge(bytes, old);
    }

    /// Changes `key`'s cached entry in place (a write-behind batch, `store::batch`): `f` gets
    /// its state and timer and says whether it changed them; if so the entry becomes dirty
    /// and is charged anew, and the session / open-round counters follow the change.
    /// `Err(f)` (not called) when `key` is not cached.
    pub(crate) fn change<R, F>(&mut self, key: &SessionKey, f: F) -> Result<R, F>
    where
        F: FnOnce(&mut Option<SessionState>, &mut Option<Millis>) -> (R, bool),
    {
        self.tick += 1;
        let tick = self.tick;
        let Some(i) = self.find(key) else {
            return Err(f);
        };
        // Invariant: an indexed slot holds an entry.
        let e = self.slots[i as usize].entry.as_mut().expect("indexed slot");
        e.tick = tick;
        let before = (
            e.state.is_some(),
            e.state.as_ref().is_some_and(|s| s.round.is_some()),
        );
        let (r, changed) = f(&mut e.state, &mut e.due);
        if !changed {
            return Ok(r);
        }
        if !e.dirty {
            e.dirty = true;
            self.dirty.push(i);
        }
        let after = (
            e.state.is_some(),
            e.state.as_ref().is_some_and(|s| s.round.is_some()),
        );
        let (old, new) = (e.bytes, entry_bytes(key, e.state.as_ref()));
        e.bytes = new;
        let c = &mut self.current;
        c.sessions = (c.sessions + u64::from(after.0)).saturating_sub(u64::from(before.0));
        c.open_rounds = (c.open_rounds + u64::from(after.1)).saturating_sub(u64::from(before.1));
        self.charge(new, old);
        Ok(r)
    }

    fn charge(&mut self, add: usize, sub: usize) {
        self.charged = self.charged + add - sub.min(self.charged + add);
        self.budget.charge(add, sub);
    }

    /// After a flush took every dirty entry into its RocksDB write (clearing their flags):
    /// they are clean (but not evictable before that write is done: [`Mem::evict`] runs
    /// only then). The outbox entries it holds become durable with [`Mem::durable`].
    pub(crate) fn sealed(&mut self) {
        // `store::prepare` cleared the entries' dirty flags as it took them.
        self.dirty.clear();
        self.acked.clear();
        self.dirty_tenants.clear();
        self.written_seq = self.current.next_seq;
        self.current.position_dirty = false;
    }

    /// The write holding the outbox entries below `seq` is done: they may be published.
    pub(crate) fn durable(&mut self, seq: u64) {
        self.durable_seq = self.durable_seq.max(seq);
    }

    /// True when something is not in RocksDB yet.
    pub(crate) fn unflushed(&self) -> bool {
        !self.dirty.is_empty()
            || !self.acked.is_empty()
            || !self.dirty_tenants.is_empty()
            || self.written_seq != self.current.next_seq
            || self.current.position_dirty
    }

    /// Evicts clean entries, least recently used first, while the shared budget is exceeded:
    /// down to three quarters of it (so eviction runs rarely), or until no clean entry is
    /// left. Call after a flush (dirty entries stay).
    pub(crate) fn evict(&mut self) {
        let limit = self.budget.limit();
        let used = self.budget.used();
        if used <= limit {
            return;
        }
        let excess = used - limit * 3 / 4;
        let mut clean: Vec<(u64, usize, u32)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| {
                let e = slot.entry.as_ref().filter(|e| !e.dirty)?;
                Some((e.tick, e.bytes, i as u32))
            })
            .collect();
        clean.sort_unstable_by_key(|c| c.0);
        self.last = None;
        let mut freed = 0;
        for (_, bytes, i) in clean {
            if freed >= excess {
                break;
            }
            let slot = &mut self.slots[i as usize];
            if let Some(e) = slot.entry.take() {
                let key = std::mem::replace(&mut slot.key, SessionKey::placeholder());
                self.index.remove(&key);
                self.free.push(i);
                if let Some(s) = &e.state {
                    self.complete = false;
                    if s.round.is_none() && e.due.is_some() {
                        self.idle_evicted.insert(key, s.last_upload_at);
                    }
                }
                self.charge(0, e.bytes);
            }
            freed += bytes;
        }
    }

    /// Bytes this store holds in its cache (approximate, as charged).
    pub(crate) fn charged(&self) -> usize {
        self.charged
    }
}

/// One tenant's timers due before a bound, in firing order, at most a cap of them
/// ([`crate::store::PartitionStore::overdue_timers`], [`crate::store::Batch::overdue_timers`]):
/// what the runtime's tenant-fair catch-up takes turns over (SEMANTICS §3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantTimers {
    /// The tenant (the part of the keys before the first `/`).
    pub tenant: Box<str>,
    /// Its timers `(due ms, key)` in `(due, key)` order: the earliest ones, at most the cap.
    pub timers: Vec<(Millis, SessionKey)>,
    /// The tenant has more timers due before the bound than `timers` holds.
    pub truncated: bool,
}

/// Groups `timers` (in `(due, key)` order) by tenant, keeping at most `per_tenant` (≥ 1) of
/// each tenant and marking the tenants that had more. Tenants come in the order of their
/// first timer. Memory: the timers kept, plus one map entry per tenant.
pub(crate) fn group_by_tenant<'a>(
    timers: impl Iterator<Item = &'a (Millis, SessionKey)>,
    per_tenant: usize,
) -> Vec<TenantTimers> {
    let per_tenant = per_tenant.max(1);
    let mut index: FxHashMap<&'a str, usize> = FxHashMap::default();
    let mut out: Vec<TenantTimers> = Vec::new();
    for t in timers {
        let tenant = t.1.tenant();
        let i = *index.entry(tenant).or_insert_with(|| {
            out.push(TenantTimers {
                tenant: tenant.into(),
                timers: Vec::new(),
                truncated: false,
            });
            out.len() - 1
        });
        let group = &mut out[i];
        if group.timers.len() < per_tenant {
            group.timers.push(t.clone());
        } else {
            group.truncated = true;
        }
    }
    out
}

impl Mem {
    /// The committed timers with `due < before`, grouped by tenant (see [`group_by_tenant`]).
    /// Walks the index up to `before`; copies at most `per_tenant` keys per tenant.
    pub(crate) fn overdue_timers(&self, before: Millis, per_tenant: usize) -> Vec<TenantTimers> {
        group_by_tenant(
            self.timers.iter().take_while(|(due, _)| *due < before),
            per_tenant,
        )
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        self.budget.charge(0, self.charged);
    }
}
