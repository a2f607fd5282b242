//! Running the engine over one partition: the [`SessionTable`] trait (per-key state plus timers
//! in firing order) and the [`Driver`] that applies uploads and fires due timers through it.
//!
//! The driver is the only place that knows how per-key steps become table changes, so the
//! in-memory table ([`MemTable`], used by `settle simulate`, tests and benches) and the RocksDB
//! store behave identically. [`Driver::advance`] fires timers in `(due_at, session key)`
//! order (SEMANTICS §3: a due emission fires when partition time ≥ its `due_at`);
//! [`Driver::fire_timer`] fires one named timer, for a caller that orders overdue timers
//! itself (the runtime's tenant-fair catch-up). Either way a key's own rounds fire in order:
//! a key has one timer at a time.
//!
//! Under a policy that learns initial delays (`PolicySpec::learns`), the driver also reads
//! the upload's tenant statistics from the table, hands the learned delay to the engine and
//! records the interval the upload observed (`engine::learn`).

use super::learn::{TenantAges, TenantStats, MAX_LEARNED_TENANTS};
use super::timers::{Hint, TimerQueue};
use super::types::{Emission, Millis, SessionKey, SessionState, Upload};
use super::{Applied, Engine, Step};
use rustc_hash::FxHashMap;

/// Per-key state and timers of one partition, as the driver needs them. Implementations may
/// buffer changes (the store batches them into one write per input batch).
pub trait SessionTable {
    /// Error of the backing storage (never produced by [`MemTable`]).
    type Error;
    /// The state of `key`, if any.
    fn get(&mut self, key: &SessionKey) -> Result<Option<SessionState>, Self::Error>;
    /// Stores `state` for `key`.
    fn put(&mut self, key: &SessionKey, state: &SessionState) -> Result<(), Self::Error>;
    /// Forgets `key`.
    fn delete(&mut self, key: &SessionKey) -> Result<(), Self::Error>;
    /// Runs `f` on the state of `key` in place (`None`: no state) and keeps what `f` leaves
    /// there (`None` forgets the key). `f` returns its result and whether it changed the
    /// state; when it says `false` the table may skip the write. This is the driver's path:
    /// unlike [`SessionTable::get`] + [`SessionTable::put`] it copies no state.
    fn update<R>(
        &mut self,
        key: &SessionKey,
        f: impl FnOnce(&mut Option<SessionState>) -> (R, bool),
    ) -> Result<R, Self::Error>;
    /// Adds the timer `(due, key)`.
    fn set_timer(&mut self, due: Millis, key: &SessionKey) -> Result<(), Self::Error>;
    /// Removes the timer `(due, key)`.
    fn cancel_timer(&mut self, due: Millis, key: &SessionKey) -> Result<(), Self::Error>;
    /// The first timer in `(due, key)` order with `due ≤ now`, if any (not removed).
    fn first_due(&mut self, now: Millis) -> Result<Option<(Millis, SessionKey)>, Self::Error>;
    /// Whether the timer `(due, key)` exists (as of the table's own writes). A caller that
    /// remembered a timer (the runtime's catch-up queue) asks before firing it: an upload
    /// may have moved it, or it fired already.
    fn has_timer(&mut self, due: Millis, key: &SessionKey) -> Result<bool, Self::Error>;
    /// The learned-delay statistics of `tenant` (`None`: none kept), `engine::learn`.
    fn tenant_stats(&mut self, tenant: &str) -> Result<Option<TenantStats>, Self::Error>;
    /// Stores `stats` for `tenant`. When `tenant` is new and the table already holds
    /// [`MAX_LEARNED_TENANTS`] tenants, it first forgets the tenant with the smallest
    /// `last_seen` (ties: the smallest name), so the table never holds more.
    fn put_tenant_stats(&mut self, tenant: &str, stats: &TenantStats) -> Result<(), Self::Error>;
    /// Forgets `key`'s state without reading it, when the table knows (without a read)
    /// that the state has no round open, and `expired` says its `last_upload_at` (ms) is
    /// past `state-ttl` at the timer `(due, key)` now firing — the state expiry
    /// ([`Engine::on_time`] on a state without a round deletes it exactly then). The timer
    /// stays: the caller cancels it. Returns whether it forgot the state; `false` (the
    /// default, and whenever the table would have to read the state) leaves the caller to
    /// read and decide as usual. What the store does for its evicted sessions: a replayed
    /// backlog's end expires them by the hundred thousand (SEMANTICS §4 state-ttl).
    fn expire_unread(
        &mut self,
        due: Millis,
        key: &SessionKey,
        expired: impl FnOnce(Millis) -> bool,
    ) -> Result<bool, Self::Error> {
        let _ = (due, key, expired);
        Ok(false)
    }
}

/// Counters of what a driver did, for summaries and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// Uploads applied on time.
    pub on_time: u64,
    /// Late uploads (counted in their round, nothing else).
    pub late: u64,
    /// Redelivered `event_id`s ignored.
    pub redelivered: u64,
    /// Emissions produced.
    pub emissions: u64,
    /// Keys forgotten after `state-ttl`.
    pub expired: u64,
    /// Keys whose first upload started from their tenant's learned delay (not `min-delay`).
    pub learned_starts: u64,
}

/// Applies the engine to a partition through a [`SessionTable`].
#[derive(Clone, Debug)]
pub struct Driver {
    engine: Engine,
    /// What this driver did so far.
    pub stats: DriverStats,
}

impl Driver {
    /// A driver for `engine`.
    pub fn new(engine: Engine) -> Self {
        Driver {
            engine,
            stats: DriverStats::default(),
        }
    }

    /// The engine it drives.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Drives `engine` from now on (new rules, SEMANTICS §7); the counters stay.
    pub fn set_engine(&mut self, engine: Engine) {
        self.engine = engine;
    }

    /// Fires every timer due at or before `now` (ms) in `(due, key)` order, appending
    /// emissions to `out`. Returns how many timers fired.
    pub fn advance<T: SessionTable>(
        &mut self,
        table: &mut T,
        now: Millis,
        out: &mut Vec<Emission>,
    ) -> Result<usize, T::Error> {
        self.advance_at_most(table, now, usize::MAX, out)
    }

    /// Like [`Driver::advance`] but fires at most `limit` timers (catch-up pacing).
    pub fn advance_at_most<T: SessionTable>(
        &mut self,
        table: &mut T,
        now: Millis,
        limit: usize,
        out: &mut Vec<Emission>,
    ) -> Result<usize, T::Error> {
        let mut fired = 0;
        while fired < limit {
            let Some((due, key)) = table.first_due(now)? else {
                break;
            };
            if self.fire_existing(table, due, &key, out)? {
                fired += 1;
            }
        }
        Ok(fired)
    }

    /// Fires the one timer `(due, key)` (ms) if the table still has it, appending its
    /// emissions to `out`, whatever other timers are due: the caller chooses the order
    /// across keys (the runtime's tenant-fair catch-up, SEMANTICS §3). The key's own
    /// rounds stay in order, since a key has one timer at a time. A timer of a key without
    /// state is dropped. Returns `false` when the timer is gone (moved by an upload, or
    /// fired already) and nothing was done; `true` when it was there and is consumed now.
    pub fn fire_timer<T: SessionTable>(
        &mut self,
        table: &mut T,
        due: Millis,
        key: &SessionKey,
        out: &mut Vec<Emission>,
    ) -> Result<bool, T::Error> {
        if !table.has_timer(due, key)? {
            return Ok(false);
        }
        self.fire_existing(table, due, key, out)?;
        Ok(true)
    }

    /// Fires the existing timer `(due, key)`: one step of [`Driver::advance_at_most`].
    /// Returns `false` when the key had no state (the timer is dropped, nothing fires).
    fn fire_existing<T: SessionTable>(
        &mut self,
        table: &mut T,
        due: Millis,
        key: &SessionKey,
        out: &mut Vec<Emission>,
    ) -> Result<bool, T::Error> {
        let ttl = self.engine.spec_for(key).state_ttl;
        if table.expire_unread(due, key, |last_upload_at| {
            last_upload_at.saturating_add(ttl) <= due
        })? {
            // What `on_time` does to a state without a round at its expiry, without the read.
            let step = Step {
                applied: Applied::OnTime,
                due_before: Some(due),
                due_after: None,
                interval: None,
            };
            self.record(table, key, step, 0)?;
            return Ok(true);
        }
        let before = out.len();
        // Fire the key only up to this timer's due time (a later round is a timer of its
        // own), so keys interleave in due order under `advance`.
        let step = table.update(key, |state| match state {
            // A timer without state cannot be produced by the driver; drop it below.
            None => (None, false),
            Some(_) => (Some(self.engine.on_time(due, key, state, out)), true),
        })?;
        let Some(step) = step else {
            table.cancel_timer(due, key)?;
            return Ok(false);
        };
        // The stored timer is the one to cancel, even if the policy changed since it was
        // set (e.g. a longer state-ttl after a restart): otherwise it would fire forever.
        let step = Step {
            due_before: Some(due),
            ..step
        };
        self.record(table, key, step, out.len() - before)?;
        Ok(true)
    }

    /// Applies one upload at partition time `now` (ms): first fires every timer due at or
    /// before `max(now, upload.event_time)` (SEMANTICS §4: a due round fires before a later
    /// upload is applied), then the upload. Emissions are appended to `out`.
    pub fn apply<T: SessionTable>(
        &mut self,
        table: &mut T,
        now: Millis,
        upload: &Upload,
        out: &mut Vec<Emission>,
    ) -> Result<Applied, T::Error> {
        let now = now.max(upload.event_time);
        self.advance(table, now, out)?;
        let spec = self.engine.spec_for(&upload.key);
        let (learns, max_delay) = (spec.learns(), spec.max_delay);
        let mut tenant = if learns {
            table.tenant_stats(upload.key.tenant())?
        } else {
            None
        };
        let before = out.len();
        let mut initial_used = false;
        let step = table.update(&upload.key, |state| {
            let before = out.len();
            // The learned delay only matters to a key that has (or, once what is due fired,
            // will have) no CallTrack: computed only then.
            let fresh = state
                .as_ref()
                .is_none_or(|s| s.track.is_none() || self.engine.next_due(&upload.key, s) <= now);
            let initial_delay = tenant
                .as_ref()
                .filter(|_| fresh)
                .and_then(|t| t.learned_delay(spec));
            let step = self
                .engine
                .on_upload_from(now, state, upload, initial_delay, out);
            initial_used = initial_delay.is_some()
                && step.applied == Applied::OnTime
                && step.interval.is_none();
            // A redelivery changes nothing (every due round already fired in `advance`).
            let changed = step.applied != Applied::Redelivered
                || out.len() > before
                || step.due_before != step.due_after;
            (step, changed)
        })?;
        match step.applied {
            Applied::OnTime => self.stats.on_time += 1,
            Applied::Late => self.stats.late += 1,
            Applied::Redelivered => self.stats.redelivered += 1,
        }
        if initial_used {
            self.stats.learned_starts += 1;
        }
        if let (true, Some(interval)) = (learns, step.interval) {
            let stats = tenant.get_or_insert_with(TenantStats::default);
            if stats.record(interval, now, max_delay) {
                table.put_tenant_stats(upload.key.tenant(), stats)?;
            }
        }
        self.record(table, &upload.key, step, out.len() - before)?;
        Ok(step.applied)
    }

    /// An operator action on `key` at partition time `now` (ms), SEMANTICS §7: every timer
    /// due at or before `now` fires first (as before an upload), then [`Engine::act`]
    /// flushes or cancels the key's open round. Emissions are appended to `out`. Returns
    /// the uploads of the round acted on, `None` when the key has no open round with
    /// uploads (then nothing changed but what was due). A dry run changes nothing at all.
    pub fn act<T: SessionTable>(
        &mut self,
        table: &mut T,
        now: Millis,
        key: &SessionKey,
        action: super::Action,
        out: &mut Vec<Emission>,
    ) -> Result<Option<u32>, T::Error> {
        if !action.dry_run {
            self.advance(table, now, out)?;
        }
        let before = out.len();
        let (uploads, step) = table.update(key, |state| {
            let (uploads, step) = self.engine.act(now, key, state, action, out);
            let changed = uploads.is_some() && !action.dry_run;
            ((uploads, step), changed)
        })?;
        if !action.dry_run {
            self.record(table, key, step, out.len() - before)?;
        }
        Ok(uploads)
    }

    /// Counts what a step did and moves the key's timer (its state is already written).
    fn record<T: SessionTable>(
        &mut self,
        table: &mut T,
        key: &SessionKey,
        step: Step,
        emitted: usize,
    ) -> Result<(), T::Error> {
        self.stats.emissions += emitted as u64;
        if step.due_before.is_some() && step.due_after.is_none() {
            self.stats.expired += 1;
        }
        if step.due_before != step.due_after {
            if let Some(d) = step.due_before {
                table.cancel_timer(d, key)?;
            }
            if let Some(d) = step.due_after {
                table.set_timer(d, key)?;
            }
        }
        Ok(())
    }
}

/// An in-memory [`SessionTable`]: a hash map of states with each key's timer, the timer
/// index, and the tenants' learned-delay statistics with their eviction order.
///
/// States live in one vector of slots indexed from the map ([`Sessions`]), so that growing the
/// map moves small entries, not states (hundreds of bytes each), and no state is an allocation
/// of its own. A key has one timer at most (setting one replaces the previous), kept in its
/// slot; the index of all timers in firing order is a lazy calendar queue
/// ([`TimerQueue`]): a cancelled or moved timer leaves a stale entry there that is dropped
/// when it comes to the front. [`SessionTable::first_due`] is asked before every upload and
/// most of the time nothing is due: it then looks no key up.
#[derive(Clone, Debug, Default)]
pub struct MemTable {
    sessions: Sessions,
    timers: TimerQueue,
    tenants: FxHashMap<Box<str>, TenantStats>,
    tenant_ages: TenantAges,
}

impl MemTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of keys with state.
    pub fn len(&self) -> usize {
        self.sessions.index.len()
    }

    /// True when no key has state.
    pub fn is_empty(&self) -> bool {
        self.sessions.index.is_empty()
    }

    /// Number of keys with an open round (pending emissions or continuation rounds).
    pub fn open_rounds(&self) -> usize {
        self.sessions.states().filter(|s| s.round.is_some()).count()
    }

    /// The state of `key`, if any.
    pub fn state(&self, key: &SessionKey) -> Option<&SessionState> {
        self.sessions.get(key)
    }

    /// Due time of the earliest timer.
    pub fn next_due(&self) -> Option<Millis> {
        self.timers.peek(|k| self.sessions.due(k)).map(|(d, _)| d)
    }

    /// Due time of the earliest timer belonging to an open round (ignores state expiry).
    pub fn next_round_due(&self) -> Option<Millis> {
        self.timers()
            .find(|(_, k)| self.sessions.get(k).is_some_and(|s| s.round.is_some()))
            .map(|(d, _)| *d)
    }

    /// Due time of the latest open round (`None`: no round open). With [`Driver::advance`] to
    /// it, every pending round fires and state expiries after it are not walked through.
    pub fn last_round_due(&self) -> Option<Millis> {
        self.sessions
            .states()
            .filter_map(|s| s.round.as_ref().map(|r| r.due()))
            .max()
    }

    /// All timers in firing order, `(due, key)`. Collects and sorts them: O(n log n).
    pub fn timers(&self) -> impl Iterator<Item = &(Millis, SessionKey)> {
        let mut live: Vec<&(Millis, SessionKey)> = self
            .timers
            .iter_unordered()
            .filter(|(d, k)| self.sessions.due(k) == Some(*d))
            .collect();
        live.sort_unstable();
        live.dedup();
        live.into_iter()
    }

    /// The learned-delay statistics of `tenant`, if kept.
    pub fn tenant(&self, tenant: &str) -> Option<&TenantStats> {
        self.tenants.get(tenant)
    }

    /// Number of tenants with learned-delay statistics (at most [`MAX_LEARNED_TENANTS`]).
    pub fn tenant_count(&self) -> usize {
        self.tenants.len()
    }

    /// Forgets `key`'s state (no-op without state). Its timer, if any, stays: its hinted
    /// entry went stale with the slot, so it is pushed again without a hint.
    fn forget(&mut self, key: &SessionKey) {
        if let Some(due) = self.sessions.remove(key) {
            self.timers.note_cancel();
            self.timers.push(due, key.clone());
            self.compact_timers();
        }
    }

    /// Drops the timer index's stale entries once they may outnumber the live ones.
    fn compact_timers(&mut self) {
        if self.timers.needs_compaction() {
            let sessions = &self.sessions;
            self.timers.compact(|k| sessions.due(k));
        }
    }
}

impl SessionTable for MemTable {
    type Error = std::convert::Infallible;

    fn get(&mut self, key: &SessionKey) -> Result<Option<SessionState>, Self::Error> {
        Ok(self.sessions.get(key).cloned())
    }

    fn put(&mut self, key: &SessionKey, state: &SessionState) -> Result<(), Self::Error> {
        match self.sessions.find(key) {
            Some(i) => self.sessions.slot(i).state.clone_from(state),
            None => self.sessions.insert(key, state.clone()),
        }
        Ok(())
    }

    fn delete(&mut self, key: &SessionKey) -> Result<(), Self::Error> {
        self.forget(key);
        Ok(())
    }

    fn update<R>(
        &mut self,
        key: &SessionKey,
        f: impl FnOnce(&mut Option<SessionState>) -> (R, bool),
    ) -> Result<R, Self::Error> {
        match self.sessions.find(key) {
            Some(i) => {
                let slot = &mut self.sessions.slot(i).state;
                let mut state = Some(std::mem::take(slot));
                let (r, _) = f(&mut state);
                match state {
                    Some(s) => *slot = s,
                    None => self.forget(key),
                }
                Ok(r)
            }
            None => {
                let mut state = None;
                let (r, _) = f(&mut state);
                if let Some(s) = state {
                    self.sessions.insert(key, s);
                }
                Ok(r)
            }
        }
    }

    /// One timer per key: a timer set for a key that has one replaces it.
    fn set_timer(&mut self, due: Millis, key: &SessionKey) -> Result<(), Self::Error> {
        let (old, hint) = self.sessions.set_due(key, Some(due));
        match old {
            Some(old) if old == due => return Ok(()),
            Some(_) => self.timers.note_cancel(),
            None => {}
        }
        self.timers.push_hinted(due, key.clone(), hint);
        self.compact_timers();
        Ok(())
    }

    /// Cancels `key`'s timer if it is the one due at `due` (otherwise nothing changes).
    fn cancel_timer(&mut self, due: Millis, key: &SessionKey) -> Result<(), Self::Error> {
        if self.sessions.due(key) == Some(due) {
            self.sessions.set_due(key, None);
            self.timers.note_cancel();
            self.compact_timers();
        }
        Ok(())
    }

    fn first_due(&mut self, now: Millis) -> Result<Option<(Millis, SessionKey)>, Self::Error> {
        let sessions = &self.sessions;
        Ok(self
            .timers
            .first_due_hinted(now, |(due, k), hint| match hint.get() {
                // The slot's version moves with its timer and when its key leaves it (which
                // pushes a live timer again, unhinted): a match is the live timer.
                Some((i, version)) => sessions.versions.get(i as usize) == Some(&version),
                None => sessions.due(k) == Some(*due),
            }))
    }

    fn has_timer(&mut self, due: Millis, key: &SessionKey) -> Result<bool, Self::Error> {
        Ok(self.sessions.due(key) == Some(due))
    }

    fn tenant_stats(&mut self, tenant: &str) -> Result<Option<TenantStats>, Self::Error> {
        Ok(self.tenants.get(tenant).cloned())
    }

    fn put_tenant_stats(&mut self, tenant: &str, stats: &TenantStats) -> Result<(), Self::Error> {
        if !self.tenants.contains_key(tenant) && self.tenants.len() >= MAX_LEARNED_TENANTS {
            let oldest = self
                .tenant_ages
                .oldest_first()
                .next()
                .map(|(_, t)| Box::from(t));
            if let Some(oldest) = oldest {
                self.tenants.remove(&oldest);
                self.tenant_ages.remove(&oldest);
            }
        }
        self.tenant_ages.touch(tenant, stats.last_seen);
        match self.tenants.get_mut(tenant) {
            Some(s) => s.clone_from(stats),
            None => {
                self.tenants.insert(tenant.into(), stats.clone());
            }
        }
        Ok(())
    }
}

/// The states of a [`MemTable`] and each key's timer: `index` maps a key to its slot
/// number; slots are kept in chunks of [`SLOTS_PER_CHUNK`] that never move once allocated
/// (growing copies no state). Slots of forgotten keys (reset to the default state) are listed
/// in `free` and used first. The timer of a key without state (which only a caller other than
/// the driver sets) is kept in `stateless` until the key gets a state or the timer goes.
/// The slot of the key found last is remembered (`last`): the driver's calls for one upload
/// or one timer (state, then timer) look the key up in `index` once.
#[derive(Clone, Debug, Default)]
struct Sessions {
    index: FxHashMap<SessionKey, u32>,
    chunks: Vec<Vec<Slot>>,
    /// Each slot's timer version: bumped when the slot's timer moves or is cancelled and
    /// when its key leaves the slot (`engine::timers`' hints).
    versions: Vec<u32>,
    free: Vec<u32>,
    stateless: FxHashMap<SessionKey, Millis>,
    last: Option<(SessionKey, u32)>,
}

/// One key's state and timer (ms).
#[derive(Clone, Debug, Default)]
struct Slot {
    state: SessionState,
    due: Option<Millis>,
}

/// Slots per chunk of [`Sessions`] (a power of two).
const SLOTS_PER_CHUNK: usize = 4096;

impl Sessions {
    fn get(&self, key: &SessionKey) -> Option<&SessionState> {
        self.peek_slot(key).map(|i| &self.at(i).state)
    }

    fn at(&self, i: u32) -> &Slot {
        let i = i as usize;
        &self.chunks[i / SLOTS_PER_CHUNK][i % SLOTS_PER_CHUNK]
    }

    fn slot(&mut self, i: u32) -> &mut Slot {
        let i = i as usize;
        &mut self.chunks[i / SLOTS_PER_CHUNK][i % SLOTS_PER_CHUNK]
    }

    /// The slot of `key`, if it has state; remembered for the next call.
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

    /// The slot of `key` from `last` or `index`, without remembering it.
    fn peek_slot(&self, key: &SessionKey) -> Option<u32> {
        match &self.last {
            Some((k, i)) if k == key => Some(*i),
            _ => self.index.get(key).copied(),
        }
    }

    /// The timer (ms) of `key`, if it has one.
    fn due(&self, key: &SessionKey) -> Option<Millis> {
        match self.peek_slot(key) {
            Some(i) => self.at(i).due,
            None if self.stateless.is_empty() => None,
            None => self.stateless.get(key).copied(),
        }
    }

    /// Sets (or with `None` removes) the timer of `key`; returns the one it had and the
    /// hint of the new one (its slot and version; [`Hint::NONE`] for a key without state).
    fn set_due(&mut self, key: &SessionKey, due: Option<Millis>) -> (Option<Millis>, Hint) {
        if let Some(i) = self.find(key) {
            let old = std::mem::replace(&mut self.slot(i).due, due);
            let version = &mut self.versions[i as usize];
            if old != due {
                *version = version.wrapping_add(1);
            }
            return (old, Hint::new(i, *version));
        }
        let old = match due {
            Some(d) => self.stateless.insert(key.clone(), d),
            None => self.stateless.remove(key),
        };
        (old, Hint::NONE)
    }

    /// Every state held, in no particular order.
    fn states(&self) -> impl Iterator<Item = &SessionState> {
        self.index.values().map(|&i| &self.at(i).state)
    }

    /// Adds the state of a key that has none (its timer moves into its slot).
    fn insert(&mut self, key: &SessionKey, state: SessionState) {
        let due = if self.stateless.is_empty() {
            None
        } else {
            self.stateless.remove(key)
        };
        let slot = Slot { state, due };
        let i = match self.free.pop() {
            Some(i) => {
                *self.slot(i) = slot;
                i
            }
            None => {
                if self
                    .chunks
                    .last()
                    .is_none_or(|c| c.len() == SLOTS_PER_CHUNK)
                {
                    self.chunks.push(Vec::with_capacity(SLOTS_PER_CHUNK));
                }
                let used = (self.chunks.len() - 1) * SLOTS_PER_CHUNK;
                let chunk = self.chunks.last_mut();
                // Invariant: a chunk with room was pushed just above; fewer than 2^32 keys
                // live in one partition's memory (each takes hundreds of bytes).
                let chunk = chunk.expect("a chunk with room");
                chunk.push(slot);
                self.versions.push(0);
                u32::try_from(used + chunk.len() - 1).expect("fewer than 2^32 sessions")
            }
        };
        self.index.insert(key.clone(), i);
        self.last = Some((key.clone(), i));
    }

    /// Forgets `key`'s state (no-op without state); its timer, if any, stays, and is
    /// returned (its slot's version moved: a hinted entry of it is stale now).
    fn remove(&mut self, key: &SessionKey) -> Option<Millis> {
        let i = self.index.remove(key)?;
        if self.last.as_ref().is_some_and(|(_, j)| *j == i) {
            self.last = None;
        }
        let slot = std::mem::take(self.slot(i));
        let version = &mut self.versions[i as usize];
        *version = version.wrapping_add(1);
        self.free.push(i);
        let due = slot.due?;
        self.stateless.insert(key.clone(), due);
        Some(due)
    }
}
