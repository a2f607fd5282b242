//! The catch-up queue of one partition task: the order in which rounds that fell due while
//! the processor was down (or while it restored, or while a backlog is replayed) are
//! released, taking tenants in turn (SEMANTICS §3), so one tenant's thousands of overdue
//! rounds do not hold back another tenant's few.
//!
//! It owns a FIFO of overdue timers `(due, key)` per tenant, in due order, and the *ring* of
//! those tenants: the tenant at the front has the next turn. [`CatchUpQueue::next`] gives the
//! front timer of the first tenant in the ring whose front timer is due at the target time
//! (tenants in front of it that have nothing due yet keep their place), and moves that
//! tenant to the back. An entry whose timer is gone (an upload moved it, or it fired on
//! another path) is dropped when it comes to the front ([`SessionTable::has_timer`]).
//!
//! The queue is filled from the store ([`crate::store::Batch::overdue_timers`]: at most
//! [`PER_TENANT`] timers per tenant, and a flag when a tenant has more) when it is empty or
//! when a tenant that had more ran out ([`CatchUpQueue::needs_load`]); a load keeps the
//! turn order of the tenants already in the ring. An empty queue is filled only when at least
//! [`MIN_QUEUED`] overdue timers are due at once (`Batch::timers_due_before_at_least`): fewer
//! fire in `(due, key)` order, so a replayed backlog, which fires one or two timers per
//! upload, does not build a queue per fire. It never decides *whether* a timer fires,
//! only which overdue one goes first: pacing stays with the [`CatchUpPacer`](super::CatchUpPacer)
//! (one token per emission), and timers that are not overdue keep `(due, key)` order.
//! A session's own rounds stay in order (it has one timer at a time), so the emissions are
//! the same as in due order; only the release order across sessions differs.
//!
//! Each partition task has its own queue, as it has its own pacer: tenants take turns within
//! a partition (`runtime.catch-up-rate` is per partition), not across the partitions.

use crate::engine::{Millis, SessionKey, SessionTable};
use crate::store::TenantTimers;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;

/// Most overdue timers of one tenant held by the queue at a time (each is a due time and a
/// shared key: a few dozen bytes). A tenant with more is loaded again when these ran out.
pub const PER_TENANT: usize = 4096;

/// Fewest overdue timers due at once for which the queue is built: below this they fire in
/// `(due, key)` order, so a replayed backlog (one or two timers due per upload) does not pay
/// for a queue per fire, and no tenant waits behind more than this many of another's.
pub const MIN_QUEUED: usize = 64;

/// One tenant's place in the ring.
#[derive(Debug)]
struct Lane {
    tenant: Box<str>,
    /// Its overdue timers in due order.
    timers: VecDeque<(Millis, SessionKey)>,
    /// The store had more of its timers than the load took.
    truncated: bool,
}

/// Per-tenant FIFOs of overdue timers and the ring of tenants (see module docs).
#[derive(Debug, Default)]
pub struct CatchUpQueue {
    /// Tenants in turn order: the front one has the next turn. An empty lane stays only while
    /// it is truncated (it keeps its place until the next load).
    ring: VecDeque<Lane>,
    /// A truncated tenant ran out: load again before the next pick.
    reload: bool,
    /// Timers held over all lanes.
    queued: usize,
}

impl CatchUpQueue {
    /// An empty queue (it asks to be loaded).
    pub fn new() -> Self {
        Self::default()
    }

    /// True when the queue should be loaded from the store before the next
    /// [`CatchUpQueue::next`]: it holds no timer, or a tenant whose load was truncated
    /// ([`TenantTimers::truncated`]) ran out.
    pub fn needs_load(&self) -> bool {
        self.reload || self.queued == 0
    }

    /// Timers held (stale ones included until they are dropped).
    pub fn len(&self) -> usize {
        self.queued
    }

    /// True when it holds no timer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tenants in the ring.
    pub fn tenants(&self) -> usize {
        self.ring.len()
    }

    /// Replaces the queued timers with `groups` (the store's overdue timers by tenant, each
    /// group in due order). Tenants already in the ring keep their turn order; new tenants
    /// join at the back in the order given (the store gives them by first due time). A tenant
    /// not in `groups` leaves the ring.
    pub fn load(&mut self, groups: Vec<TenantTimers>) {
        let mut by_tenant: FxHashMap<Box<str>, TenantTimers> = FxHashMap::default();
        let mut order = Vec::with_capacity(groups.len());
        for g in groups {
            if g.timers.is_empty() {
                continue;
            }
            order.push(g.tenant.clone());
            by_tenant.insert(g.tenant.clone(), g);
        }
        let lane = |g: TenantTimers| Lane {
            tenant: g.tenant,
            timers: g.timers.into(),
            truncated: g.truncated,
        };
        let mut ring = VecDeque::with_capacity(by_tenant.len());
        for old in std::mem::take(&mut self.ring) {
            if let Some(g) = by_tenant.remove(&old.tenant) {
                ring.push_back(lane(g));
            }
        }
        for tenant in order {
            if let Some(g) = by_tenant.remove(&tenant) {
                ring.push_back(lane(g));
            }
        }
        self.queued = ring.iter().map(|l| l.timers.len()).sum();
        self.ring = ring;
        self.reload = false;
    }

    /// The keys of about the next `n` timers [`CatchUpQueue::next`] will pick, in turn order
    /// (the lanes' timers interleaved, front first; timers no longer set are included):
    /// what a step prefetches from the store before firing them ([`crate::store::Batch::prefetch`]).
    pub fn upcoming(&self, n: usize) -> Vec<&SessionKey> {
        let mut keys = Vec::with_capacity(n.min(self.queued));
        let mut depth = 0;
        while keys.len() < n {
            let mut any = false;
            for lane in &self.ring {
                if let Some((_, key)) = lane.timers.get(depth) {
                    any = true;
                    keys.push(key);
                    if keys.len() == n {
                        break;
                    }
                }
            }
            if !any {
                break;
            }
            depth += 1;
        }
        keys
    }

    /// The next overdue timer to fire at partition time `target` (ms): the front timer of
    /// the first tenant in turn whose front timer has `due <= target` and still exists in
    /// `table`; that tenant goes to the back of the ring. Entries whose timer is gone are
    /// dropped on the way. `None` when no queued timer is due at `target` (the caller then
    /// fires in `(due, key)` order). The timer is not fired or removed from `table`.
    ///
    /// Errors: the table's ([`SessionTable::has_timer`]).
    pub fn next<T: SessionTable>(
        &mut self,
        table: &mut T,
        target: Millis,
    ) -> Result<Option<(Millis, SessionKey)>, T::Error> {
        let mut i = 0;
        while i < self.ring.len() {
            let lane = &mut self.ring[i];
            let mut due_now = false;
            while let Some((due, key)) = lane.timers.front() {
                if *due > target {
                    break;
                }
                if table.has_timer(*due, key)? {
                    due_now = true;
                    break;
                }
                lane.timers.pop_front();
                self.queued -= 1;
            }
            if lane.timers.is_empty() {
                if lane.truncated {
                    // It keeps its place; the next load brings the rest of its timers.
                    self.reload = true;
                    i += 1;
                } else {
                    self.ring.remove(i);
                }
                continue;
            }
            if !due_now {
                i += 1;
                continue;
            }
            let mut lane = self.ring.remove(i).expect("index in range");
            let timer = lane.timers.pop_front().expect("front checked");
            self.queued -= 1;
            if lane.timers.is_empty() && lane.truncated {
                self.reload = true;
            }
            if !lane.timers.is_empty() || lane.truncated {
                self.ring.push_back(lane);
            }
            return Ok(Some(timer));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::MemTable;

    fn key(tenant: &str, session: &str) -> SessionKey {
        SessionKey::new(tenant, session)
    }

    /// A table holding `timers` and the group of each tenant (in first-due order), capped.
    fn setup(timers: &[(Millis, SessionKey)], cap: usize) -> (MemTable, Vec<TenantTimers>) {
        let mut table = MemTable::new();
        let mut sorted = timers.to_vec();
        sorted.sort();
        for (due, k) in &sorted {
            let Ok(()) = table.set_timer(*due, k);
        }
        let mut groups: Vec<TenantTimers> = Vec::new();
        for t in sorted {
            let tenant = t.1.tenant().to_owned();
            let i = match groups.iter().position(|g| *g.tenant == *tenant) {
                Some(i) => i,
                None => {
                    groups.push(TenantTimers {
                        tenant: tenant.into(),
                        timers: Vec::new(),
                        truncated: false,
                    });
                    groups.len() - 1
                }
            };
            if groups[i].timers.len() < cap {
                groups[i].timers.push(t);
            } else {
                groups[i].truncated = true;
            }
        }
        (table, groups)
    }

    /// Picks until the queue gives nothing, firing (cancelling) each pick in `table`.
    fn drain(q: &mut CatchUpQueue, table: &mut MemTable, target: Millis) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(Some((due, k))) = q.next(table, target) {
            let Ok(()) = table.cancel_timer(due, &k);
            out.push(k.as_str().to_owned());
        }
        out
    }

    #[test]
    fn tenants_take_turns_and_each_keeps_due_order() {
        // Tenant a has 5 timers, all earlier than b's 2.
        let mut timers: Vec<_> = (0..5)
            .map(|i| (10 + i, key("a", &format!("s{i}"))))
            .collect();
        timers.push((100, key("b", "x")));
        timers.push((101, key("b", "y")));
        let (mut table, groups) = setup(&timers, PER_TENANT);
        let mut q = CatchUpQueue::new();
        assert!(q.needs_load());
        q.load(groups);
        assert!(!q.needs_load());
        assert_eq!((q.len(), q.tenants()), (7, 2));
        let order = drain(&mut q, &mut table, 1_000);
        assert_eq!(
            order,
            ["a/s0", "b/x", "a/s1", "b/y", "a/s2", "a/s3", "a/s4"]
        );
        assert!(q.is_empty());
        assert!(q.needs_load());
    }

    #[test]
    fn a_tenant_with_nothing_due_yet_keeps_its_turn() {
        let timers = vec![
            (50, key("a", "late")),
            (10, key("b", "1")),
            (11, key("b", "2")),
            (12, key("b", "3")),
        ];
        let (mut table, mut groups) = setup(&timers, PER_TENANT);
        // a first in the ring, though its timer is due later.
        groups.reverse();
        let mut q = CatchUpQueue::new();
        q.load(groups);
        assert_eq!(drain(&mut q, &mut table, 20), ["b/1", "b/2", "b/3"]);
        // a is still at the front when its timer falls due.
        assert_eq!(drain(&mut q, &mut table, 50), ["a/late"]);
    }

    #[test]
    fn stale_entries_are_skipped() {
        let timers = vec![
            (10, key("a", "moved")),
            (11, key("a", "kept")),
            (12, key("b", "fired")),
            (13, key("b", "left")),
        ];
        let (mut table, groups) = setup(&timers, PER_TENANT);
        let mut q = CatchUpQueue::new();
        q.load(groups);
        // An upload moved a/moved's timer; b/fired fired on another path.
        let Ok(()) = table.cancel_timer(10, &key("a", "moved"));
        let Ok(()) = table.set_timer(500, &key("a", "moved"));
        let Ok(()) = table.cancel_timer(12, &key("b", "fired"));
        assert_eq!(drain(&mut q, &mut table, 100), ["a/kept", "b/left"]);
        assert!(q.needs_load(), "nothing left");
    }

    #[test]
    fn a_truncated_tenant_asks_for_a_load_and_keeps_its_place() {
        // a has 5 timers, cap 2; b and c one each.
        let mut timers: Vec<_> = (0..5)
            .map(|i| (10 + i, key("a", &format!("s{i}"))))
            .collect();
        timers.push((20, key("b", "1")));
        timers.push((30, key("c", "1")));
        timers.push((31, key("c", "2")));
        let (mut table, groups) = setup(&timers, 2);
        assert!(groups[0].truncated);
        let mut q = CatchUpQueue::new();
        q.load(groups);
        let mut order = Vec::new();
        let mut loads = 0;
        loop {
            if q.needs_load() {
                // What the store would give now: the live timers, capped.
                let live: Vec<_> = table.timers().cloned().collect();
                let (_, groups) = setup(&live, 2);
                if groups.is_empty() {
                    break;
                }
                q.load(groups);
                loads += 1;
            }
            let Ok(Some((due, k))) = q.next(&mut table, 1_000) else {
                break;
            };
            let Ok(()) = table.cancel_timer(due, &k);
            order.push(k.as_str().to_owned());
        }
        assert_eq!(
            order,
            ["a/s0", "b/1", "c/1", "a/s1", "c/2", "a/s2", "a/s3", "a/s4"]
        );
        assert!(loads >= 2, "a's rest came with a later load ({loads})");
        assert!(table.timers().next().is_none());
    }

    #[test]
    fn a_load_keeps_the_turn_order_of_known_tenants() {
        let timers = vec![
            (10, key("a", "1")),
            (11, key("b", "1")),
            (12, key("a", "2")),
            (13, key("b", "2")),
        ];
        let (mut table, groups) = setup(&timers, PER_TENANT);
        let mut q = CatchUpQueue::new();
        q.load(groups);
        // a took its turn: b is in front now.
        assert_eq!(
            q.next(&mut table, 100).ok().flatten(),
            Some((10, key("a", "1")))
        );
        let Ok(()) = table.cancel_timer(10, &key("a", "1"));
        // A new tenant c, due first of all, arrives with a load: it joins at the back.
        let Ok(()) = table.set_timer(1, &key("c", "1"));
        let live: Vec<_> = table.timers().cloned().collect();
        let (_, groups) = setup(&live, PER_TENANT);
        assert_eq!(&*groups[0].tenant, "c");
        q.load(groups);
        assert_eq!(drain(&mut q, &mut table, 100), ["b/1", "a/2", "c/1", "b/2"]);
    }

    #[test]
    fn nothing_due_gives_none() {
        let (mut table, groups) = setup(&[(10, key("a", "1"))], PER_TENANT);
        let mut q = CatchUpQueue::new();
        assert_eq!(q.next(&mut table, 100).ok().flatten(), None, "empty");
        q.load(groups);
        assert_eq!(q.next(&mut table, 9).ok().flatten(), None, "not due yet");
        assert_eq!(q.len(), 1, "kept");
    }
}
