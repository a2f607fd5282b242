//! The in-memory side of a partition store (store v2, "memory first, RocksDB behind";
//! ARCHITECTURE § Partition state).
//!
//! What it holds, for one partition:
//!
//! * **Sessions**: a bounded cache of per-key state ([`Entry`]), with the key's timer. Dirty
//!   entries (changed since the last flush) are never evicted; clean ones are evicted least
//!   recently used when the process's session-cache budget ([`CacheBudget`]) is exceeded, and
//!   read back from RocksDB on a miss.
//! * **Evicted keys**: every key with stored state that is not cached, with its timer and,
//!   when its state had no round open, the state's `last_upload_at` ([`Evicted`], 32 bytes a
//!   key). A key is in it only while it is not cached. So a miss on a key that is in neither
//!   has no state and needs no RocksDB read (a long tail's new sessions, which are most
//!   misses), and an idle evicted key's timer is its state expiry, which needs no read of the
//!   state either ([`crate::engine::SessionTable::expire_unread`]).
//! * **Timers**: the index of every key's timer (cached or evicted) in firing order, a lazy
//!   calendar queue ([`TimerQueue`]): a key's timer is the `due` of its entry or evicted
//!   record, and the queue's entries whose key has another due by now are stale and dropped
//!   as they come to the front. Rebuilt at open from one scan of `sessions` (each value
//!   starts with its key's timer).
//! * **Outbox**: every owed emission by sequence number, and the first sequence number not
//!   yet durable (`durable_seq`): only entries below it may be published (durable first,
//!   then visible). Acknowledged entries that were already flushed leave a delete for the
//!   next flush.
//! * **Tenants**: every tenant's learned-delay statistics (at most
//!   `engine::MAX_LEARNED_TENANTS`) and their eviction order.
//! * The current counters, input offset and partition time, ahead of the durable ones in
//!   `meta` until the next flush.
//!
//! Invariants: every key with a timer has it in the queue (a live entry); a key is cached,
//! evicted, or has neither state nor timer; `dirty` lists each dirty entry's slot once.

use super::evicted::EvictedKeys;
use crate::engine::{
    Emission, Millis, SessionKey, SessionState, TenantAges, TenantStats, TimerHint, TimerQueue,
};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::VecDeque;
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
/// entry, the key's allocation header and the timer queue entry (measured order of magnitude).
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

/// What memory keeps of an evicted key with stored state (16 bytes besides the key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Evicted {
    /// The key's timer (ms); `NONE`: none.
    due: Millis,
    /// The stored state's `last_upload_at` (ms) when it had no round open; `NONE`: a round
    /// was open, or not known (keys evicted at open, never decoded).
    idle_since: Millis,
}

impl Evicted {
    const NONE: Millis = Millis::MIN;

    pub(crate) fn new(due: Option<Millis>, idle_since: Option<Millis>) -> Self {
        Evicted {
            due: due.unwrap_or(Self::NONE),
            idle_since: idle_since.unwrap_or(Self::NONE),
        }
    }

    /// The key's timer (ms).
    pub(crate) fn due(&self) -> Option<Millis> {
        (self.due != Self::NONE).then_some(self.due)
    }

    /// `last_upload_at` (ms) of the stored state when it is known to have no round open.
    pub(crate) fn idle_since(&self) -> Option<Millis> {
        (self.idle_since != Self::NONE).then_some(self.idle_since)
    }
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
                    // The boxed event ids (32 bytes and their allocation header), their buffer.
                    + r.event_ids.as_ref().map_or(0, |ids| 48 + ids.heap_bytes())
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

/// A cached key and its entry, in [`Mem`]'s slots (`entry` `None`: a free slot).
pub(crate) struct Slot {
    pub(crate) key: SessionKey,
    pub(crate) entry: Option<Entry>,
}

/// Most slots one bounded [`Mem::evict`] call visits while the cache is at most an eighth
/// over its budget (the rest of the sweep goes on at the next call).
const EVICT_VISITS: usize = 1_024;

/// Slots sampled to choose an eviction sweep's cut ([`Mem::evict`]).
const EVICT_SAMPLE: usize = 4_096;

/// An eviction sweep under way: clean entries used before `cut` are evicted, slots from
/// `next` on are still to visit.
#[derive(Clone, Copy, Debug)]
struct Sweep {
    cut: u64,
    next: usize,
}

/// Slots per chunk of [`Mem`]'s slots (a power of two): chunks never move, so growing the
/// cache copies no entry.
const SLOTS_PER_CHUNK: usize = 4096;

/// The in-memory state of one partition store (module docs).
///
/// Cached entries live in chunks of slots that never move while their key is cached; the
/// map `index` only maps a key to its slot number, so that growing it moves small buckets,
/// the dirty list names slots (a flush reaches its entries without a lookup), and the slot
/// of the key looked up last is remembered (`last`): the driver's several calls per upload
/// (state, then timer) look the key up once.
pub(crate) struct Mem {
    index: FxHashMap<SessionKey, u32>,
    slots: Vec<Vec<Slot>>,
    /// Free slot numbers (their `entry` is `None`).
    free: Vec<u32>,
    /// The key last looked up, with its slot (cleared when a slot is freed).
    last: Option<(SessionKey, u32)>,
    /// Slots of dirty entries, each once.
    pub(crate) dirty: Vec<u32>,
    /// Evicted keys with stored state (module docs); disjoint from the cached keys.
    pub(crate) evicted: EvictedKeys,
    /// Every key's timer, in firing order (module docs).
    timers: TimerQueue,
    /// Each slot's timer version (by slot number): bumped whenever the timer of the slot's
    /// entry moves or is cancelled, and when the slot is freed. A queue entry pushed with
    /// its slot and version ([`TimerHint`]) is live while they still match, so a moved
    /// timer's old entry is dropped without a lookup of its key ([`Mem::first_due`]).
    timer_versions: Vec<u32>,
    /// Whether each slot's live timer entry is the hinted one its last move pushed (by slot
    /// number; false: the slot has no timer, or its key's timer is asked by key, as a timer
    /// loaded at open or kept while the key was evicted is). Only a hinted live entry goes
    /// stale when its key leaves the slot, so only then is the timer pushed again
    /// ([`Mem::evict`]): a key cached at open and evicted later keeps its one entry.
    timer_hinted: Vec<bool>,
    /// Owed emissions by sequence number.
    pub(crate) outbox: Outbox,
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
    /// Reused by [`Mem::evict`]: the use ticks of the sampled clean entries.
    ticks: Vec<u64>,
    /// The eviction sweep under way ([`Mem::evict`]).
    sweep: Option<Sweep>,
}

/// The timer of `key` (ms) as `index`, `slots` and `evicted` say: the due of its cached
/// entry, or of its evicted record. A free function over the fields so that the timer
/// queue can be changed while it is asked.
fn due_in(
    index: &FxHashMap<SessionKey, u32>,
    slots: &[Vec<Slot>],
    evicted: &EvictedKeys,
    key: &SessionKey,
) -> Option<Millis> {
    match index.get(key) {
        Some(&i) => at(slots, i).entry.as_ref().and_then(|e| e.due),
        None if evicted.is_empty() => None,
        None => evicted.get(key).and_then(Evicted::due),
    }
}

/// Asks the CPU to load the cache line at `value` (a hint: no effect on other targets).
fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults; the address is of a live reference.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

fn at(slots: &[Vec<Slot>], i: u32) -> &Slot {
    let i = i as usize;
    &slots[i / SLOTS_PER_CHUNK][i % SLOTS_PER_CHUNK]
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
            evicted: EvictedKeys::default(),
            timers: TimerQueue::new(),
            timer_versions: Vec::new(),
            timer_hinted: Vec::new(),
            outbox: Outbox::default(),
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
            ticks: Vec::new(),
            sweep: None,
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

    fn slot_at(&mut self, i: u32) -> &mut Slot {
        let i = i as usize;
        &mut self.slots[i / SLOTS_PER_CHUNK][i % SLOTS_PER_CHUNK]
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

    /// Brings the index buckets and the cached slots of `keys` (the uploads about to be
    /// applied) toward the CPU cache: the lookups here are independent of each other, so
    /// their cache misses overlap, where the same lookups made one upload at a time, between
    /// the engine's work, each wait their own miss (`Mem::find` was 8 % of the partition
    /// thread on the shared trace, issue 37). Changes nothing; a hint only.
    pub(crate) fn warm<'k>(&self, keys: impl Iterator<Item = &'k SessionKey>) {
        for key in keys {
            if let Some(&i) = self.index.get(key) {
                prefetch(at(&self.slots, i));
            }
        }
    }

    /// The timer of `key` (ms): of its cached entry or evicted record.
    pub(crate) fn due_of(&self, key: &SessionKey) -> Option<Millis> {
        due_in(&self.index, &self.slots, &self.evicted, key)
    }

    /// Whether `(due, key)` is `key`'s timer.
    pub(crate) fn has_timer(&self, due: Millis, key: &SessionKey) -> bool {
        self.due_of(key) == Some(due)
    }

    /// Whether `key` has stored state that is not cached (a miss must read it).
    pub(crate) fn is_evicted(&self, key: &SessionKey) -> bool {
        !self.evicted.is_empty() && self.evicted.contains_key(key)
    }

    /// The timer of `key`, cached in slot `i`, went from `old` to `new`: the queue follows
    /// (module docs), its new entry hinted with the slot's next timer version.
    fn timer_moved(&mut self, i: u32, key: &SessionKey, old: Option<Millis>, new: Option<Millis>) {
        if old == new {
            return;
        }
        let version = &mut self.timer_versions[i as usize];
        *version = version.wrapping_add(1);
        let hint = TimerHint::new(i, *version);
        if old.is_some() {
            self.timers.note_cancel();
        }
        if let Some(d) = new {
            self.timers.push_hinted(d, key.clone(), hint);
        }
        self.timer_hinted[i as usize] = new.is_some();
        if self.timers.needs_compaction() {
            let (index, slots, evicted) = (&self.index, &self.slots, &self.evicted);
            self.timers.compact(|k| due_in(index, slots, evicted, k));
        }
    }

    /// Adds the timer of a key read from RocksDB at open (no entry, no record yet).
    pub(crate) fn load_timer(&mut self, due: Millis, key: &SessionKey) {
        self.timers.push(due, key.clone());
    }

    /// Records an evicted key read at open (not cached), with its timer.
    pub(crate) fn load_evicted(&mut self, key: SessionKey, due: Option<Millis>) {
        self.evicted.insert(key, Evicted::new(due, None));
    }

    /// The first timer due at or before `now` (ms), if any. Its key's slot (when cached) is
    /// remembered, so the driver's firing of it looks the key up no more.
    pub(crate) fn first_due(&mut self, now: Millis) -> Option<(Millis, SessionKey)> {
        let (index, slots, evicted) = (&self.index, &self.slots, &self.evicted);
        let versions = &self.timer_versions;
        let mut slot = None;
        let first = self.timers.first_due_hinted(now, |(due, k), hint| {
            if let Some((i, version)) = hint.get() {
                // The slot's version moves with its timer and when the key leaves it (which
                // pushes the timer again): a match is the live timer, a mismatch a stale
                // entry.
                let live = versions.get(i as usize) == Some(&version);
                slot = live.then_some(i);
                return live;
            }
            let due_now = match index.get(k) {
                Some(&i) => {
                    slot = Some(i);
                    at(slots, i).entry.as_ref().and_then(|e| e.due)
                }
                None => {
                    slot = None;
                    evicted.get(k).and_then(Evicted::due)
                }
            };
            due_now == Some(*due)
        });
        if let (Some((_, key)), Some(i)) = (&first, slot) {
            self.last = Some((key.clone(), i));
        }
        first
    }

    /// The earliest timer, without changing anything.
    pub(crate) fn next_timer(&self) -> Option<(Millis, SessionKey)> {
        self.timers.peek(|k| self.due_of(k))
    }

    /// The first `limit` timers in firing order (copied and sorted: O(n log n)).
    pub(crate) fn timers(&self, limit: usize) -> Vec<(Millis, SessionKey)> {
        let mut live: Vec<&(Millis, SessionKey)> = self
            .timers
            .iter_unordered()
            .filter(|t| self.has_timer(t.0, &t.1))
            .collect();
        live.sort_unstable();
        live.dedup();
        live.into_iter().take(limit).cloned().collect()
    }

    /// The first timer after `after` (exclusive; `None`: from the start) in firing order for
    /// which `keep` holds.
    pub(crate) fn first_timer_after(
        &mut self,
        after: Option<&(Millis, SessionKey)>,
        keep: impl Fn(&(Millis, SessionKey)) -> bool,
    ) -> Option<(Millis, SessionKey)> {
        let (index, slots, evicted) = (&self.index, &self.slots, &self.evicted);
        self.timers
            .walk(after)
            .find(|t| due_in(index, slots, evicted, &t.1) == Some(t.0) && keep(t))
            .cloned()
    }

    /// Up to `n` live timers after `after` (exclusive; `None`: from the first) in firing
    /// order, copied: a bounded slice of a walk over the queue (sorts the buckets it
    /// reaches). Visits the stale entries between them too (compaction bounds those).
    pub(crate) fn timers_after(
        &mut self,
        after: Option<&(Millis, SessionKey)>,
        n: usize,
    ) -> Vec<(Millis, SessionKey)> {
        let (index, slots, evicted) = (&self.index, &self.slots, &self.evicted);
        let mut out: Vec<(Millis, SessionKey)> = Vec::with_capacity(n.min(4096));
        for t in self.timers.walk(after) {
            if out.len() >= n {
                break;
            }
            if due_in(index, slots, evicted, &t.1) == Some(t.0) && out.last() != Some(t) {
                out.push(t.clone());
            }
        }
        out
    }

    /// Every timer in firing order, for a walk (sorts the queue's buckets as it goes).
    pub(crate) fn walk_timers(&mut self) -> impl Iterator<Item = &(Millis, SessionKey)> {
        let (index, slots, evicted) = (&self.index, &self.slots, &self.evicted);
        self.timers
            .walk(None)
            .filter(move |t| due_in(index, slots, evicted, &t.1) == Some(t.0))
    }

    /// Whether at least `n` timers are due before `before` (ms).
    pub(crate) fn timers_due_before_at_least(&self, before: Millis, n: usize) -> bool {
        let versions = &self.timer_versions;
        self.timers
            .live_below_at_least_hinted(before, n, |(due, k), hint| match hint.get() {
                // As in `first_due`: a hint decides by itself.
                Some((i, version)) => versions.get(i as usize) == Some(&version),
                None => self.due_of(k) == Some(*due),
            })
    }

    /// Caches `entry` for `key` (not cached): its slot number.
    fn add(&mut self, key: &SessionKey, entry: Entry) -> u32 {
        if !self.evicted.is_empty() {
            self.evicted.remove(key);
        }
        let slot = Slot {
            key: key.clone(),
            entry: Some(entry),
        };
        let i = match self.free.pop() {
            Some(i) => {
                *self.slot_at(i) = slot;
                // A timer the key brings is asked by key (loaded at open, or kept while the
                // key was evicted).
                self.timer_hinted[i as usize] = false;
                i
            }
            None => {
                if self.slots.last().is_none_or(|c| c.len() == SLOTS_PER_CHUNK) {
                    self.slots.push(Vec::with_capacity(SLOTS_PER_CHUNK));
                }
                let used = (self.slots.len() - 1) * SLOTS_PER_CHUNK;
                // Invariant: a chunk with room was pushed just above.
                let chunk = self.slots.last_mut().expect("a chunk with room");
                chunk.push(slot);
                // Fewer than 2^32 keys live in one partition's memory (each takes ~200 bytes).
                let i =
                    u32::try_from(used + chunk.len() - 1).expect("fewer than 2^32 cached sessions");
                self.timer_versions.push(0);
                self.timer_hinted.push(false);
                i
            }
        };
        self.index.insert(key.clone(), i);
        self.last = Some((key.clone(), i));
        i
    }

    /// The entry in slot `i` (a slot number from `index` or `dirty`).
    pub(crate) fn slot_mut(&mut self, i: u32) -> (&SessionKey, Option<&mut Entry>) {
        let slot = self.slot_at(i);
        (&slot.key, slot.entry.as_mut())
    }

    /// The key of slot `i`.
    pub(crate) fn slot_key(&self, i: u32) -> &SessionKey {
        &at(&self.slots, i).key
    }

    /// The cached entry of `key`, if any (not marked as used).
    pub(crate) fn entry(&self, key: &SessionKey) -> Option<&Entry> {
        let i = *self.index.get(key)?;
        at(&self.slots, i).entry.as_ref()
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
        self.slot_at(i).entry.as_mut().map(|e| {
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
        let (old, old_due, i) = match self.find(key) {
            Some(i) => {
                // Invariant: an indexed slot holds an entry.
                let e = self.slot_at(i).entry.as_mut().expect("indexed slot");
                let (old, old_due, was_dirty) = (e.bytes, e.due, e.dirty);
                e.dirty = true;
                e.state = state;
                e.due = due;
                e.tick = tick;
                e.bytes = bytes;
                if !was_dirty {
                    self.dirty.push(i);
                }
                (old, old_due, i)
            }
            None => {
                let old_due = self.evicted.get(key).and_then(Evicted::due);
                let entry = Entry {
                    state,
                    due,
                    dirty: true,
                    tick,
                    bytes,
                };
                let i = self.add(key, entry);
                self.dirty.push(i);
                (0, old_due, i)
            }
        };
        self.charge(bytes, old);
        self.timer_moved(i, key, old_due, due);
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
        let e = self.slot_at(i).entry.as_mut().expect("indexed slot");
        e.tick = tick;
        let before = (
            e.state.is_some(),
            e.state.as_ref().is_some_and(|s| s.round.is_some()),
        );
        let due_before = e.due;
        let (r, changed) = f(&mut e.state, &mut e.due);
        if !changed {
            return Ok(r);
        }
        let was_dirty = std::mem::replace(&mut e.dirty, true);
        let after = (
            e.state.is_some(),
            e.state.as_ref().is_some_and(|s| s.round.is_some()),
        );
        let due_after = e.due;
        let (old, new) = (e.bytes, entry_bytes(key, e.state.as_ref()));
        e.bytes = new;
        if !was_dirty {
            self.dirty.push(i);
        }
        let c = &mut self.current;
        c.sessions = (c.sessions + u64::from(after.0)).saturating_sub(u64::from(before.0));
        c.open_rounds = (c.open_rounds + u64::from(after.1)).saturating_sub(u64::from(before.1));
        self.charge(new, old);
        self.timer_moved(i, key, due_before, due_after);
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

    /// Evicts clean entries, least recently used first, once the shared budget is exceeded:
    /// down to three quarters of it (so eviction runs rarely), or until a sweep over every
    /// slot found no more. Call when no write holding clean entries is in flight (dirty
    /// entries stay). A sweep chooses a cut
    /// from a sample of the clean entries' use ticks ([`EVICT_SAMPLE`] slots evenly spaced:
    /// every clean entry of a smaller cache), then evicts the clean entries used before the
    /// cut in slot order. `bounded`: while the cache is at most an eighth over its budget
    /// one call visits at most [`EVICT_VISITS`] slots and the next calls go on from there,
    /// so a sweep of a large cache is spread over the runtime's loop turns instead of
    /// stopping the partition for tens of milliseconds (a live partition's next rounds wait
    /// meanwhile); otherwise the sweep ends in this call. An evicted key with state (or a
    /// timer) keeps its record in `evicted`.
    pub(crate) fn evict(&mut self, bounded: bool) {
        let limit = self.budget.limit();
        let target = limit * 3 / 4;
        if self.sweep.is_none() {
            if self.budget.used() <= limit {
                return;
            }
            let Some(cut) = self.sweep_cut(target) else {
                return;
            };
            self.sweep = Some(Sweep { cut, next: 0 });
        }
        let total = self.slot_count();
        let mut visits = 0usize;
        while let Some(sweep) = self.sweep.as_mut() {
            if sweep.next >= total || self.budget.used() <= target {
                self.sweep = None;
                break;
            }
            if bounded && visits >= EVICT_VISITS && self.budget.used() <= limit + limit / 8 {
                break;
            }
            let (i, cut) = (sweep.next, sweep.cut);
            sweep.next += 1;
            visits += 1;
            let slot = &mut self.slots[i / SLOTS_PER_CHUNK][i % SLOTS_PER_CHUNK];
            if !slot
                .entry
                .as_ref()
                .is_some_and(|e| !e.dirty && e.tick < cut)
            {
                continue;
            }
            let e = slot.entry.take().expect("checked just above");
            let key = std::mem::replace(&mut slot.key, SessionKey::placeholder());
            self.index.remove(&key);
            self.free.push(i as u32);
            // The slot's hints are wrong from now on: a live timer whose entry was hinted is
            // pushed again, to be asked by key (one asked by key already stays live).
            let version = &mut self.timer_versions[i];
            *version = version.wrapping_add(1);
            let hinted = std::mem::replace(&mut self.timer_hinted[i], false);
            if let (Some(d), true) = (e.due, hinted) {
                self.timers.note_cancel();
                self.timers.push(d, key.clone());
            }
            // The remembered slot may be this one.
            self.last = None;
            if e.state.is_some() || e.due.is_some() {
                let idle = e.state.as_ref().filter(|s| s.round.is_none());
                let idle = idle.map(|s| s.last_upload_at);
                self.evicted.insert(key, Evicted::new(e.due, idle));
            }
            self.charge(0, e.bytes);
        }
    }

    /// Slots in use or free (the slot numbers run `0..slot_count`).
    fn slot_count(&self) -> usize {
        self.slots.iter().map(Vec::len).sum()
    }

    /// The use tick below which a sweep evicts: as many of the least recently used clean
    /// entries as the excess over `target` bytes takes at their average size, estimated from
    /// a sample of [`EVICT_SAMPLE`] evenly spaced slots. `None`: no clean entry sampled.
    fn sweep_cut(&mut self, target: usize) -> Option<u64> {
        let excess = self.budget.used().saturating_sub(target);
        let total = self.slot_count();
        let step = (total / EVICT_SAMPLE).max(1);
        let mut ticks = std::mem::take(&mut self.ticks);
        ticks.clear();
        let mut sampled_bytes = 0usize;
        for i in (0..total).step_by(step) {
            let slot = &self.slots[i / SLOTS_PER_CHUNK][i % SLOTS_PER_CHUNK];
            if let Some(e) = slot.entry.as_ref().filter(|e| !e.dirty) {
                ticks.push(e.tick);
                sampled_bytes += e.bytes;
            }
        }
        let cut = if ticks.is_empty() {
            None
        } else {
            // Each sampled entry stands for `step` entries. Ticks are unique (each use of
            // the store takes a new one).
            let average = (sampled_bytes / ticks.len()).max(1);
            let n = excess.div_ceil(average * step).min(ticks.len());
            Some(if n == ticks.len() {
                u64::MAX
            } else {
                *ticks.select_nth_unstable(n).1
            })
        };
        self.ticks = ticks;
        cut
    }

    /// Bytes this store holds in its cache (approximate, as charged).
    pub(crate) fn charged(&self) -> usize {
        self.charged
    }
}

/// Owed emissions in sequence-number order (FIFO): appended at the back, acknowledged mostly
/// at the front; one acknowledged out of order stays as a hole until the front passes it.
/// O(1) to append and to acknowledge the front; O(1) to find a sequence number while the
/// numbers held have no gap, O(log n) otherwise.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    entries: VecDeque<(u64, Option<Emission>)>,
    len: usize,
}

impl Outbox {
    /// Appends the emission `seq` (greater than every number held).
    pub(crate) fn push(&mut self, seq: u64, emission: Emission) {
        debug_assert!(self.entries.back().is_none_or(|(s, _)| *s < seq));
        self.entries.push_back((seq, Some(emission)));
        self.len += 1;
    }

    /// Removes the emission `seq`; whether it was owed.
    pub(crate) fn remove(&mut self, seq: u64) -> bool {
        let i = self.position(seq);
        let removed = match self.entries.get_mut(i) {
            Some((s, e)) if *s == seq => e.take().is_some(),
            _ => false,
        };
        if removed {
            self.len -= 1;
            while self.entries.front().is_some_and(|(_, e)| e.is_none()) {
                self.entries.pop_front();
            }
        }
        removed
    }

    /// Owed emissions.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The lowest owed sequence number.
    pub(crate) fn first_seq(&self) -> Option<u64> {
        self.entries.front().map(|(s, _)| *s)
    }

    /// The owed emissions with `from <= seq < to`, in order.
    pub(crate) fn range(&self, from: u64, to: u64) -> impl Iterator<Item = (u64, &Emission)> {
        self.entries
            .range(self.position(from)..)
            .take_while(move |(s, _)| *s < to)
            .filter_map(|(s, e)| e.as_ref().map(|e| (*s, e)))
    }

    /// Index of the first entry with a sequence number `>= seq`. Sequence numbers run
    /// without gaps (except where entries loaded at open were deleted out of order), so the
    /// offset from the front is tried first; a binary search otherwise.
    fn position(&self, seq: u64) -> usize {
        if let Some(&(front, _)) = self.entries.front() {
            let guess = seq.saturating_sub(front);
            if let Some((s, _)) = usize::try_from(guess)
                .ok()
                .and_then(|i| self.entries.get(i))
            {
                if *s == seq {
                    return guess as usize;
                }
            }
        }
        self.entries.partition_point(|(s, _)| *s < seq)
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
    /// The timers with `due < before`, grouped by tenant (see [`group_by_tenant`]), for a
    /// reader that holds the store shared: copies the queue's entries below `before`.
    pub(crate) fn overdue_timers(&self, before: Millis, per_tenant: usize) -> Vec<TenantTimers> {
        let below = self.timers.below(before);
        group_by_tenant(
            below.iter().filter(|t| self.has_timer(t.0, &t.1)),
            per_tenant,
        )
    }

    /// [`Mem::overdue_timers`] for a writer (a batch): walks the queue up to `before`
    /// (sorting its buckets as it goes) and copies at most `per_tenant` keys per tenant. The
    /// walk does not look each key up: a group may hold a timer that is gone (moved or fired
    /// since it was set); the catch-up queue drops such an entry when it comes to the front
    /// ([`crate::engine::SessionTable::has_timer`]).
    pub(crate) fn overdue_timers_mut(
        &mut self,
        before: Millis,
        per_tenant: usize,
    ) -> Vec<TenantTimers> {
        group_by_tenant(
            self.timers.walk(None).take_while(|(due, _)| *due < before),
            per_tenant,
        )
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        self.budget.charge(0, self.charged);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{PolicyName, Trigger};

    fn emission(generation: u64) -> Emission {
        Emission {
            key: SessionKey::new("t", "s"),
            state_created_at: 0,
            generation,
            trigger: Trigger::Trailing,
            uploads: 1,
            first_upload_at: 0,
            last_upload_at: 0,
            due_at: 0,
            delay_ms: 0,
            policy: PolicyName::Fixed,
            last_event_id: None,
            attributes: None,
            event_ids: None,
        }
    }

    fn long_key(i: u32) -> SessionKey {
        SessionKey::new("tenant-with-a-long-name", &format!("session-{i:06}"))
    }

    /// What a flush does to the dirty entries (`store::prepare` takes them, clearing their
    /// flags, then [`Mem::sealed`]).
    fn flushed(mem: &mut Mem) {
        for i in mem.dirty.clone() {
            if let (_, Some(e)) = mem.slot_mut(i) {
                e.dirty = false;
            }
        }
        mem.sealed();
    }

    /// A key cached at open (its timer loaded unhinted) keeps its one queue entry when it is
    /// evicted; a key whose timer moved while cached (a hinted entry) gets it pushed again.
    /// Either way every timer is still there once, in order, and fires from its record.
    #[test]
    fn eviction_pushes_a_timer_again_only_when_its_entry_was_hinted() {
        let per_entry = entry_bytes(&long_key(0), None);
        let mut mem = Mem::new(CacheBudget::new(8 * per_entry));
        // As at open: every timer pushed by key, four keys cached clean.
        for i in 0..4 {
            mem.load_timer(1_000 + i64::from(i), &long_key(i));
            mem.insert_clean(&long_key(i), None, Some(1_000 + i64::from(i)));
        }
        // Four keys set since (their timers hinted), then flushed: clean, newer.
        for i in 10..14 {
            mem.set(&long_key(i), None, Some(2_000 + i64::from(i)));
        }
        flushed(&mut mem);
        assert_eq!(mem.timers.entries(), 8);
        // Two more keys: over the budget, so the four opened ones (least recently used) go.
        for i in 20..22 {
            mem.set(&long_key(i), None, Some(3_000 + i64::from(i)));
        }
        flushed(&mut mem);
        mem.evict(false);
        for i in 0..4 {
            assert!(mem.is_evicted(&long_key(i)), "key {i} evicted");
        }
        assert_eq!(
            mem.timers.entries(),
            10,
            "no entry pushed for the unhinted timers"
        );
        // Now hinted ones go too.
        let before = mem.timers.entries();
        for i in 30..38 {
            mem.set(&long_key(i), None, Some(4_000 + i64::from(i)));
        }
        flushed(&mut mem);
        mem.evict(false);
        let evicted_hinted = (10..14)
            .chain(20..22)
            .chain(30..38)
            .filter(|&i| mem.is_evicted(&long_key(i)))
            .count();
        assert!(evicted_hinted >= 4, "the hinted keys were evicted");
        assert_eq!(
            mem.timers.entries(),
            before + 8 + evicted_hinted,
            "one entry pushed again for each evicted hinted timer"
        );
        let mut fired = Vec::new();
        while let Some((due, key)) = mem.first_due(Millis::MAX) {
            assert_eq!(mem.due_of(&key), Some(due));
            fired.push((due, key.clone()));
            mem.set(&key, None, None);
        }
        let mut expected: Vec<(Millis, SessionKey)> = (0..4)
            .map(|i| (1_000 + i64::from(i), long_key(i)))
            .chain((10..14).map(|i| (2_000 + i64::from(i), long_key(i))))
            .chain((20..22).map(|i| (3_000 + i64::from(i), long_key(i))))
            .chain((30..38).map(|i| (4_000 + i64::from(i), long_key(i))))
            .collect();
        expected.sort();
        assert_eq!(fired, expected, "every timer fires once, in order");
    }

    fn seqs(outbox: &Outbox, from: u64, to: u64) -> Vec<u64> {
        outbox.range(from, to).map(|(s, _)| s).collect()
    }

    #[test]
    fn the_outbox_finds_sequence_numbers_across_gaps_holes_and_the_front() {
        let mut outbox = Outbox::default();
        // 7 missing (deleted out of order before a reopen): the numbers have a gap.
        for seq in [5, 6, 8, 9, 10] {
            outbox.push(seq, emission(seq));
        }
        assert_eq!(seqs(&outbox, 0, 100), [5, 6, 8, 9, 10]);
        assert_eq!(seqs(&outbox, 7, 100), [8, 9, 10], "from inside the gap");
        assert_eq!(seqs(&outbox, 9, 10), [9]);
        assert!(!outbox.remove(7), "never owed");
        assert!(
            outbox.remove(9),
            "past the gap: the offset guess misses, the search finds it"
        );
        assert!(!outbox.remove(9), "once");
        assert_eq!(
            seqs(&outbox, 0, 100),
            [5, 6, 8, 10],
            "a hole until the front passes it"
        );
        assert!(outbox.remove(5) && outbox.remove(6));
        assert_eq!(outbox.first_seq(), Some(8));
        assert!(!outbox.remove(4), "below the front");
        assert!(outbox.remove(10) && outbox.remove(8));
        assert_eq!((outbox.len(), outbox.first_seq()), (0, None));
        assert!(!outbox.remove(11), "an empty outbox owes nothing");
    }
}
