//! The timer index of one partition: every key's one timer `(due ms, session key)`, given
//! back in firing order (SEMANTICS §3: due rounds fire in `(due_at, session key)` order).
//! Used by [`super::MemTable`] and by the store's memory (`store::mem`).
//!
//! # A lazy calendar queue
//!
//! The table that owns a [`TimerQueue`] knows each key's timer (its *due*, one per key at
//! most) and answers for it through a `due_of` function. The queue holds `(due, key)`
//! entries; an entry is *live* while `due_of(key) == Some(due)`, and *stale* once the key's
//! timer was cancelled or moved. Cancelling or moving a timer therefore costs the queue
//! nothing: the owner changes the key's due and calls [`TimerQueue::note_cancel`], and the
//! stale entry is dropped when it reaches the front, or by a compaction once stale entries
//! may outnumber live ones ([`TimerQueue::needs_compaction`]).
//!
//! Entries are kept in buckets of `2^BUCKET_BITS` ms by due time. A bucket is an unsorted
//! vector until it becomes the *front* (the bucket firing next) or a walk reaches it: then it
//! is sorted once (entries pushed in order keep it sorted for free). Timers set at or before
//! the front bucket go to a small ordered set beside it. Setting a timer is thus one push,
//! and firing it a share of one sort, where an ordered tree paid a few cache-missing node
//! visits for each insert and each remove (a third of `settle simulate`'s engine thread).
//!
//! # Hints
//!
//! An owner that keeps keys in numbered slots pushes each entry with a [`Hint`]: the slot and
//! the slot's *timer version*, which it bumps whenever the timer in that slot moves, is
//! cancelled, or leaves the slot. [`TimerQueue::first_due_hinted`] hands the hint back, so
//! the owner tells a stale entry (a hot key's timer moved by every upload leaves one each
//! time) from one array read, without the key's hash lookup and the cache misses that come
//! with it in a large index (`store::mem`, and [`super::MemTable`] for `simulate`, `tune` and
//! the shadows; issue 37's profile had the stale entries' lookups at a tenth of the
//! partition's thread). When a live timer's hint goes wrong (its key left
//! the slot), the owner pushes it again without a hint.
//!
//! Memory: 32 bytes per entry (live or stale) plus the buckets' spare capacity (about 38
//! bytes per entry in all with 1 M timers); with compaction, stale entries stay below the
//! live ones plus [`COMPACT_SLACK`].

use super::types::{Millis, SessionKey};
use std::collections::{btree_map, btree_set, BTreeMap, BTreeSet};
use std::ops::Bound;

/// One timer: a due time (ms) and its key.
pub type Timer = (Millis, SessionKey);

/// Where the owner keeps a timer's key, for a liveness check without a key lookup: a slot
/// number and the slot's timer version when the entry was pushed ([`TimerQueue::push_hinted`],
/// `store::mem`), or [`Hint::NONE`]. The queue only stores it and hands it back; what it
/// means is the owner's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Hint(u64);

impl Hint {
    /// No hint: the entry's liveness is asked by key.
    pub const NONE: Hint = Hint(u64::MAX);

    /// Slot `slot` at timer version `version`.
    pub fn new(slot: u32, version: u32) -> Self {
        Hint((u64::from(slot) << 32) | u64::from(version))
    }

    /// `(slot, version)`, or `None` for [`Hint::NONE`].
    pub fn get(self) -> Option<(u32, u32)> {
        (self != Hint::NONE).then_some(((self.0 >> 32) as u32, self.0 as u32))
    }
}

/// What the queue stores: a timer and its hint, ordered by timer first.
type Entry = (Timer, Hint);

fn timer_of(e: &Entry) -> &Timer {
    &e.0
}

/// Bucket width: `2^BUCKET_BITS` ms (1.024 s).
const BUCKET_BITS: u32 = 10;

/// Stale entries tolerated besides as many as the live ones before
/// [`TimerQueue::needs_compaction`] says so.
pub const COMPACT_SLACK: usize = 4096;

fn bucket_of(due: Millis) -> i64 {
    due >> BUCKET_BITS
}

/// The entries of one bucket; `sorted`: in `(due, key, hint)` order (duplicates may sit side
/// by side).
#[derive(Clone, Debug, Default)]
struct Bucket {
    timers: Vec<Entry>,
    sorted: bool,
}

impl Bucket {
    fn sort(&mut self) {
        if !self.sorted {
            self.timers.sort_unstable();
            self.sorted = true;
        }
        self.timers.dedup();
    }
}

/// Timers in `(due, key)` order with lazy cancellation (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct TimerQueue {
    /// The front bucket, sorted; entries before `pos` are consumed.
    front: Vec<Entry>,
    pos: usize,
    /// Entries pushed at or before the front bucket once it was loaded, in order.
    extra: BTreeSet<Entry>,
    /// Bucket number of the front (`None`: none loaded yet). Every bucket of `later` has a
    /// greater number, every entry of `front` and `extra` a number not greater.
    front_id: Option<i64>,
    /// The buckets after the front, by bucket number.
    later: BTreeMap<i64, Bucket>,
    /// Entries held, live or stale.
    len: usize,
    /// Cancellations noted since the last compaction, less stale entries dropped since: an
    /// estimate of the stale entries held.
    cancelled: usize,
}

impl TimerQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries held, live and stale (not the number of timers).
    pub fn entries(&self) -> usize {
        self.len
    }

    /// Forgets every entry.
    pub fn clear(&mut self) {
        *self = TimerQueue::default();
    }

    /// Adds the timer `(due, key)`: call when the owner's due of `key` became `due` (if it
    /// had another one before, also [`TimerQueue::note_cancel`]). Pushing a live timer again
    /// is harmless (it fires once).
    pub fn push(&mut self, due: Millis, key: SessionKey) {
        self.push_hinted(due, key, Hint::NONE);
    }

    /// [`TimerQueue::push`] with the owner's `hint` for [`TimerQueue::first_due_hinted`].
    pub fn push_hinted(&mut self, due: Millis, key: SessionKey, hint: Hint) {
        self.len += 1;
        let id = bucket_of(due);
        let entry = ((due, key), hint);
        if self.front_id.is_some_and(|f| id <= f) {
            self.extra.insert(entry);
            return;
        }
        let bucket = self.later.entry(id).or_default();
        if bucket.timers.is_empty() {
            bucket.sorted = true;
        } else if bucket.sorted {
            let last = bucket.timers.last().expect("not empty");
            bucket.sorted = *last <= entry;
        }
        bucket.timers.push(entry);
    }

    /// Notes that the owner cancelled or moved a timer: one entry went stale.
    pub fn note_cancel(&mut self) {
        self.cancelled += 1;
    }

    /// True when stale entries may outnumber the live ones by more than [`COMPACT_SLACK`]:
    /// time to [`TimerQueue::compact`].
    pub fn needs_compaction(&self) -> bool {
        self.cancelled > COMPACT_SLACK && self.cancelled * 2 > self.len
    }

    /// Drops every stale entry (`due_of`: the owner's due of a key). O(entries).
    pub fn compact(&mut self, due_of: impl Fn(&SessionKey) -> Option<Millis>) {
        let live = |e: &Entry| due_of(&e.0 .1) == Some(e.0 .0);
        let front: Vec<Entry> = self.front.drain(self.pos..).filter(&live).collect();
        self.front = front;
        self.pos = 0;
        self.extra.retain(&live);
        self.later.retain(|_, b| {
            b.timers.retain(&live);
            !b.timers.is_empty()
        });
        self.len = self.front.len()
            + self.extra.len()
            + self.later.values().map(|b| b.timers.len()).sum::<usize>();
        self.cancelled = 0;
    }

    /// Loads the next bucket as the front; false when there is none.
    fn load_next(&mut self) -> bool {
        let Some((id, mut bucket)) = self.later.pop_first() else {
            self.front.clear();
            self.pos = 0;
            return false;
        };
        let before = bucket.timers.len();
        bucket.sort();
        self.len -= before - bucket.timers.len();
        self.front = bucket.timers;
        self.pos = 0;
        self.front_id = Some(id);
        true
    }

    /// Whether the head of the near entries is in `front` (else in `extra`); `None`: both
    /// are used up.
    fn near_head(&self) -> Option<bool> {
        match (self.front.get(self.pos), self.extra.first()) {
            (Some(a), Some(b)) => Some(a <= b),
            (Some(_), None) => Some(true),
            (None, Some(_)) => Some(false),
            (None, None) => None,
        }
    }

    /// The first live timer if it is due at or before `now` (ms), dropping the stale entries
    /// in front of it. Most calls (one per upload) find the front not due and look no key up.
    pub fn first_due(
        &mut self,
        now: Millis,
        due_of: impl Fn(&SessionKey) -> Option<Millis>,
    ) -> Option<Timer> {
        self.first_due_hinted(now, |t, _| due_of(&t.1) == Some(t.0))
    }

    /// [`TimerQueue::first_due`] where the owner tells an entry's liveness from the timer
    /// and the hint it was pushed with (`is_live`): an owner whose hints prove staleness
    /// drops a moved timer's old entry without looking its key up. `is_live` must say true
    /// of at least one entry of each live timer (the owner pushes an entry again when it
    /// makes an earlier hint of a live timer wrong).
    pub fn first_due_hinted(
        &mut self,
        now: Millis,
        mut is_live: impl FnMut(&Timer, Hint) -> bool,
    ) -> Option<Timer> {
        loop {
            let Some(in_front) = self.near_head() else {
                if !self.load_next() {
                    return None;
                }
                continue;
            };
            let e = if in_front {
                &self.front[self.pos]
            } else {
                self.extra.first().expect("near_head saw it")
            };
            if e.0 .0 > now {
                return None;
            }
            if is_live(&e.0, e.1) {
                return Some(e.0.clone());
            }
            if in_front {
                self.pos += 1;
            } else {
                self.extra.pop_first();
            }
            self.len -= 1;
            self.cancelled = self.cancelled.saturating_sub(1);
        }
    }

    /// The first live timer (dropping the stale entries in front of it).
    pub fn first(&mut self, due_of: impl Fn(&SessionKey) -> Option<Millis>) -> Option<Timer> {
        self.first_due(Millis::MAX, due_of)
    }

    /// The first live timer without changing the queue (stale entries are skipped, not
    /// dropped): for readers that hold the queue shared. Usually O(1); an unsorted first
    /// bucket is scanned whole.
    pub fn peek(&self, due_of: impl Fn(&SessionKey) -> Option<Millis>) -> Option<Timer> {
        let live = |t: &&Timer| due_of(&t.1) == Some(t.0);
        let mut near = Merged::new(
            self.front[self.pos..].iter().map(timer_of as EntryTimer),
            self.extra.iter().map(timer_of as EntryTimer),
        );
        if let Some(t) = near.find(&live) {
            return Some(t.clone());
        }
        for b in self.later.values() {
            let mut timers = b.timers.iter().map(timer_of);
            let found = if b.sorted {
                timers.find(&live)
            } else {
                timers.filter(&live).min()
            };
            if let Some(t) = found {
                return Some(t.clone());
            }
        }
        None
    }

    /// Every entry (live and stale, each once) in `(due, key)` order, from the first one
    /// after `after` (exclusive; `None`: from the start). Sorts the buckets it reaches.
    /// Callers that want timers filter with their due of each key.
    pub fn walk(&mut self, after: Option<&Timer>) -> Walk<'_> {
        let start = match after {
            Some(a) => self.pos + self.front[self.pos..].partition_point(|e| &e.0 <= a),
            None => self.pos,
        };
        let extra = match after {
            Some(a) => self
                .extra
                .range((Bound::Excluded((a.clone(), Hint::NONE)), Bound::Unbounded)),
            None => self.extra.range::<Entry, _>(..),
        };
        let from_bucket = after.map(|a| bucket_of(a.0));
        let later = match from_bucket {
            Some(b) => self.later.range_mut(b..),
            None => self.later.range_mut(..),
        };
        Walk {
            near: Merged::new(
                self.front[start..].iter().map(timer_of as EntryTimer),
                extra.map(timer_of as EntryTimer),
            ),
            later,
            cur: [].iter(),
            after: after.cloned(),
            last: None,
        }
    }

    /// The entries (live and stale, each once) due before `before` (ms), in `(due, key)`
    /// order, copied: for readers that hold the queue shared. O(entries before `before`,
    /// plus the sort of the unsorted buckets among them).
    pub fn below(&self, before: Millis) -> Vec<Timer> {
        let mut out: Vec<Timer> = Merged::new(
            self.front[self.pos..].iter().map(timer_of as EntryTimer),
            self.extra.iter().map(timer_of as EntryTimer),
        )
        .take_while(|t| t.0 < before)
        .cloned()
        .collect();
        let last = bucket_of(before.saturating_sub(1));
        let near = out.len();
        for (_, b) in self.later.range(..=last) {
            out.extend(
                b.timers
                    .iter()
                    .map(timer_of)
                    .filter(|t| t.0 < before)
                    .cloned(),
            );
        }
        out[near..].sort_unstable();
        out.dedup();
        out
    }

    /// Every entry (live and stale), in no particular order.
    pub fn iter_unordered(&self) -> impl Iterator<Item = &Timer> {
        self.front[self.pos..]
            .iter()
            .chain(self.extra.iter())
            .chain(self.later.values().flat_map(|b| b.timers.iter()))
            .map(timer_of)
    }

    /// Whether at least `n` live timers are due before `before` (ms). Walks at most the
    /// entries due before `before`, stopping at the `n`-th live one (a duplicate counts
    /// twice: an estimate for deciding whether to build a queue, not an exact count).
    pub fn live_below_at_least(
        &self,
        before: Millis,
        n: usize,
        due_of: impl Fn(&SessionKey) -> Option<Millis>,
    ) -> bool {
        self.live_below_at_least_hinted(before, n, |t, _| due_of(&t.1) == Some(t.0))
    }

    /// [`TimerQueue::live_below_at_least`] with the owner's liveness check of an entry from
    /// its timer and hint (as [`TimerQueue::first_due_hinted`]; an entry the hint proves
    /// stale costs no key lookup).
    pub fn live_below_at_least_hinted(
        &self,
        before: Millis,
        n: usize,
        mut is_live: impl FnMut(&Timer, Hint) -> bool,
    ) -> bool {
        if n == 0 {
            return true;
        }
        let mut seen = 0;
        let below = |e: &&Entry| e.0 .0 < before;
        // The front's and `extra`'s entries are each in order (stop at the first not before
        // `before`); a later bucket's may not be, so each is checked.
        let near = (self.front[self.pos..].iter().take_while(below))
            .chain(self.extra.iter().take_while(below));
        let last = bucket_of(before.saturating_sub(1));
        let later = self.later.range(..=last).flat_map(|(_, b)| b.timers.iter());
        for e in near.chain(later) {
            if e.0 .0 < before && is_live(&e.0, e.1) {
                seen += 1;
                if seen >= n {
                    return true;
                }
            }
        }
        false
    }
}

/// [`timer_of`] as a function pointer (a nameable iterator type).
type EntryTimer = for<'e> fn(&'e Entry) -> &'e Timer;

/// Two iterators in `(due, key)` order merged into one.
struct Merged<'a, A: Iterator<Item = &'a Timer>, B: Iterator<Item = &'a Timer>> {
    a: std::iter::Peekable<A>,
    b: std::iter::Peekable<B>,
}

impl<'a, A: Iterator<Item = &'a Timer>, B: Iterator<Item = &'a Timer>> Merged<'a, A, B> {
    fn new(a: A, b: B) -> Self {
        Merged {
            a: a.peekable(),
            b: b.peekable(),
        }
    }
}

impl<'a, A: Iterator<Item = &'a Timer>, B: Iterator<Item = &'a Timer>> Iterator
    for Merged<'a, A, B>
{
    type Item = &'a Timer;

    fn next(&mut self) -> Option<&'a Timer> {
        match (self.a.peek(), self.b.peek()) {
            (Some(x), Some(y)) if x <= y => self.a.next(),
            (Some(_), Some(_)) | (None, _) => self.b.next(),
            (Some(_), None) => self.a.next(),
        }
    }
}

/// The near entries of a [`Walk`]: the front's and `extra`'s, merged.
type Near<'a> = Merged<
    'a,
    std::iter::Map<std::slice::Iter<'a, Entry>, EntryTimer>,
    std::iter::Map<btree_set::Range<'a, Entry>, EntryTimer>,
>;

/// The iterator of [`TimerQueue::walk`].
pub struct Walk<'a> {
    near: Near<'a>,
    later: btree_map::RangeMut<'a, i64, Bucket>,
    cur: std::slice::Iter<'a, Entry>,
    /// Entries up to this one are skipped (the first bucket reached may hold some).
    after: Option<Timer>,
    /// The entry yielded last (duplicates are skipped).
    last: Option<&'a Timer>,
}

impl<'a> Iterator for Walk<'a> {
    type Item = &'a Timer;

    fn next(&mut self) -> Option<&'a Timer> {
        loop {
            let t = match self.near.next() {
                Some(t) => t,
                None => match self.cur.next() {
                    Some(e) => &e.0,
                    None => {
                        let (_, bucket) = self.later.next()?;
                        bucket.sort();
                        let bucket: &'a Bucket = bucket;
                        self.cur = bucket.timers.iter();
                        continue;
                    }
                },
            };
            if self.after.as_ref().is_some_and(|a| t <= a) || self.last == Some(t) {
                continue;
            }
            self.last = Some(t);
            return Some(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rustc_hash::FxHashMap;

    fn key(s: &str) -> SessionKey {
        SessionKey::new("t", s)
    }

    /// An owner: the due of each key, and the queue.
    #[derive(Default)]
    struct Owner {
        due: FxHashMap<SessionKey, Millis>,
        q: TimerQueue,
    }

    impl Owner {
        fn set(&mut self, due: Millis, k: &SessionKey) {
            if let Some(old) = self.due.insert(k.clone(), due) {
                if old == due {
                    return;
                }
                self.q.note_cancel();
            }
            self.q.push(due, k.clone());
        }
        fn cancel(&mut self, k: &SessionKey) {
            if self.due.remove(k).is_some() {
                self.q.note_cancel();
            }
        }
        fn first_due(&mut self, now: Millis) -> Option<Timer> {
            let due = &self.due;
            self.q.first_due(now, |k| due.get(k).copied())
        }
        fn live(&mut self) -> Vec<Timer> {
            let due = &self.due;
            self.q
                .walk(None)
                .filter(|t| due.get(&t.1) == Some(&t.0))
                .cloned()
                .collect()
        }
    }

    #[test]
    fn timers_come_in_due_then_key_order_across_buckets_and_the_front() {
        let mut o = Owner::default();
        for (d, k) in [(5_000, "c"), (5_000, "a"), (3, "z"), (9_000, "b"), (1, "y")] {
            o.set(d, &key(k));
        }
        assert_eq!(o.first_due(0), None);
        assert_eq!(o.first_due(2), Some((1, key("y"))));
        o.cancel(&key("y"));
        // Set into the front bucket after it was loaded, and before its head.
        o.set(2, &key("x"));
        o.set(2, &key("w"));
        assert_eq!(
            o.live(),
            [
                (2, key("w")),
                (2, key("x")),
                (3, key("z")),
                (5_000, key("a")),
                (5_000, key("c")),
                (9_000, key("b"))
            ]
        );
        // Moving a timer leaves a stale entry that never fires.
        o.set(10_000, &key("a"));
        let mut fired = Vec::new();
        while let Some(t) = o.first_due(Millis::MAX) {
            o.cancel(&t.1);
            fired.push(t);
        }
        let keys: Vec<_> = fired.iter().map(|t| t.1.session().to_owned()).collect();
        assert_eq!(keys, ["w", "x", "z", "c", "b", "a"]);
        assert_eq!(o.q.entries(), 0, "every stale entry was dropped on the way");
    }

    #[test]
    fn peek_below_and_counts_skip_stale_entries_without_changing_the_queue() {
        let mut o = Owner::default();
        for (i, d) in [4_000, 10, 3_000, 20, 2_500].into_iter().enumerate() {
            o.set(d, &key(&format!("k{i}")));
        }
        o.cancel(&key("k1"));
        o.set(5_000, &key("k3"));
        let due = o.due.clone();
        let due_of = |k: &SessionKey| due.get(k).copied();
        assert_eq!(o.q.peek(due_of), Some((2_500, key("k4"))));
        let below: Vec<_> = o.q.below(3_001).into_iter().map(|t| t.0).collect();
        assert_eq!(below, [10, 20, 2_500, 3_000], "stale entries included");
        assert!(o.q.live_below_at_least(3_001, 2, due_of));
        assert!(!o.q.live_below_at_least(3_001, 3, due_of));
        assert_eq!(o.q.entries(), 6, "five set, one moved, nothing dropped");
    }

    #[test]
    fn a_walk_after_a_timer_starts_right_behind_it() {
        let mut o = Owner::default();
        for (i, d) in [1, 1_500, 2_000, 2_000, 7_000].into_iter().enumerate() {
            o.set(d, &key(&format!("k{i}")));
        }
        let from: Vec<_> = o.q.walk(Some(&(2_000, key("k2")))).map(|t| t.0).collect();
        assert_eq!(from, [2_000, 7_000]);
        assert_eq!(o.first_due(1), Some((1, key("k0"))));
        let from: Vec<_> = o.q.walk(Some(&(1, key("k0")))).map(|t| t.0).collect();
        assert_eq!(from, [1_500, 2_000, 2_000, 7_000]);
    }

    #[test]
    fn compaction_drops_stale_entries_only() {
        let mut o = Owner::default();
        for round in 0..3 {
            for i in 0..3_000 {
                o.set(round * 100_000 + i, &key(&format!("k{i}")));
            }
        }
        assert!(o.q.needs_compaction());
        let due = o.due.clone();
        o.q.compact(|k| due.get(k).copied());
        assert_eq!(o.q.entries(), 3_000);
        assert!(!o.q.needs_compaction());
        assert_eq!(o.first_due(Millis::MAX), Some((200_000, key("k0"))));
    }

    /// Compacts `q` when it asks for it, then checks its first timer and all its live
    /// timers in order (live by `due`, the owner's due of each key) against `model`.
    fn agrees_with_the_model(
        q: &mut TimerQueue,
        due: &FxHashMap<SessionKey, Millis>,
        model: &BTreeSet<Timer>,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        if q.needs_compaction() {
            q.compact(|k| due.get(k).copied());
        }
        prop_assert_eq!(q.peek(|k| due.get(k).copied()), model.first().cloned());
        let live: Vec<Timer> = q
            .walk(None)
            .filter(|t| due.get(&t.1) == Some(&t.0))
            .cloned()
            .collect();
        let want: Vec<Timer> = model.iter().cloned().collect();
        prop_assert_eq!(live, want);
        Ok(())
    }

    /// An owner that hints its entries: key `k<i>` lives in slot `i` while `placed`, and
    /// the slot's version moves whenever the timer does or the key leaves the slot.
    #[derive(Default)]
    struct SlotOwner {
        due: FxHashMap<SessionKey, Millis>,
        version: Vec<u32>,
        placed: Vec<bool>,
        q: TimerQueue,
    }

    impl SlotOwner {
        fn new(keys: usize) -> Self {
            SlotOwner {
                version: vec![0; keys],
                placed: vec![true; keys],
                ..SlotOwner::default()
            }
        }
        fn hint(&mut self, i: usize, moved: bool) -> Hint {
            if moved {
                self.version[i] += 1;
            }
            if self.placed[i] {
                Hint::new(i as u32, self.version[i])
            } else {
                Hint::NONE
            }
        }
        fn set(&mut self, i: usize, due: Millis) {
            let k = key(&format!("k{i}"));
            if let Some(old) = self.due.insert(k.clone(), due) {
                if old == due {
                    return;
                }
                self.q.note_cancel();
            }
            let hint = self.hint(i, true);
            self.q.push_hinted(due, k, hint);
        }
        fn cancel(&mut self, i: usize) {
            if self.due.remove(&key(&format!("k{i}"))).is_some() {
                self.version[i] += 1;
                self.q.note_cancel();
            }
        }
        /// The key leaves its slot (or comes back): versions move, the timer stays, and a
        /// live timer is pushed again with its new hint.
        fn flip(&mut self, i: usize) {
            self.placed[i] = !self.placed[i];
            let hint = self.hint(i, true);
            let k = key(&format!("k{i}"));
            if let Some(&d) = self.due.get(&k) {
                self.q.note_cancel();
                self.q.push_hinted(d, k, hint);
            }
        }
        fn first_due(&mut self, now: Millis) -> Option<Timer> {
            let (due, version) = (&self.due, &self.version);
            self.q.first_due_hinted(now, |t, hint| match hint.get() {
                Some((slot, v)) => version[slot as usize] == v,
                None => due.get(&t.1) == Some(&t.0),
            })
        }
    }

    proptest! {
        /// With hints: the same timers fire in the same order as the model's, though stale
        /// entries are told by their hint alone.
        #[test]
        fn hinted_entries_fire_like_an_ordered_set_with_one_timer_per_key(
            ops in proptest::collection::vec((0u8..6, 0usize..10, -3_000i64..12_000), 1..300)
        ) {
            let mut o = SlotOwner::new(10);
            let mut model: BTreeSet<Timer> = BTreeSet::new();
            for (op, i, d) in ops {
                let k = key(&format!("k{i}"));
                match op {
                    0 | 1 => {
                        if let Some(&old) = o.due.get(&k) {
                            model.remove(&(old, k.clone()));
                        }
                        model.insert((d, k.clone()));
                        o.set(i, d);
                    }
                    2 => {
                        if let Some(&old) = o.due.get(&k) {
                            model.remove(&(old, k.clone()));
                        }
                        o.cancel(i);
                    }
                    3 => o.flip(i),
                    _ => {
                        while let Some(t) = model.first().filter(|t| t.0 <= d).cloned() {
                            prop_assert_eq!(o.first_due(d), Some(t.clone()));
                            model.remove(&t);
                            let fired: usize = t.1.session()[1..].parse().unwrap();
                            o.cancel(fired);
                        }
                        prop_assert_eq!(o.first_due(d), None);
                    }
                }
                agrees_with_the_model(&mut o.q, &o.due, &model)?;
                let due = &o.due;
                // Counting by hint finds at least the model's timers before `d` (a live
                // timer pushed again may count twice), and none when there is none.
                let below = model.iter().filter(|t| t.0 < d).count();
                let version = &o.version;
                let counted = |n: usize| {
                    o.q.live_below_at_least_hinted(d, n, |t, hint| match hint.get() {
                        Some((slot, v)) => version[slot as usize] == v,
                        None => due.get(&t.1) == Some(&t.0),
                    })
                };
                prop_assert!(counted(below));
                prop_assert_eq!(counted(1), below > 0);
            }
        }
    }

    proptest! {
        /// Against a model (an ordered set with one timer per key): the same first due
        /// timer after every operation, and the same timers in order.
        #[test]
        fn behaves_like_an_ordered_set_with_one_timer_per_key(
            ops in proptest::collection::vec((0u8..4, 0u8..12, -3_000i64..12_000), 1..300)
        ) {
            let mut o = Owner::default();
            let mut model: BTreeSet<Timer> = BTreeSet::new();
            let mut model_due: FxHashMap<SessionKey, Millis> = FxHashMap::default();
            for (op, k, d) in ops {
                let k = key(&format!("k{k}"));
                match op {
                    0 | 1 => {
                        if let Some(old) = model_due.insert(k.clone(), d) {
                            model.remove(&(old, k.clone()));
                        }
                        model.insert((d, k.clone()));
                        o.set(d, &k);
                    }
                    2 => {
                        if let Some(old) = model_due.remove(&k) {
                            model.remove(&(old, k.clone()));
                        }
                        o.cancel(&k);
                    }
                    _ => {
                        // Fire what is due at d.
                        while let Some(t) = model.first().filter(|t| t.0 <= d).cloned() {
                            prop_assert_eq!(o.first_due(d), Some(t.clone()));
                            model.remove(&t);
                            model_due.remove(&t.1);
                            o.cancel(&t.1);
                        }
                        prop_assert_eq!(o.first_due(d), None);
                    }
                }
                agrees_with_the_model(&mut o.q, &o.due, &model)?;
            }
        }
    }
}
