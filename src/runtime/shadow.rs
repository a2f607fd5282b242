//! The shadow policies of a runtime (SEMANTICS §8): the configured `[[shadow]]` specs and,
//! per owned partition, its [`ShadowSet`] (each shadow's in-memory table and figures, and the
//! live policy's figures beside them).
//!
//! Each partition task that starts while shadows are configured registers a fresh, empty
//! set, measuring from its start (wall clock), and is its only writer: it locks the set once
//! per store step (uploads applied, then partition time advanced, then the step's
//! emissions counted by tier), never across an `.await`. Readers (`GET /v1/shadow`, the
//! `settle_shadow_*` metrics at scrape time, `settle run-file`) take a [`ShadowSnapshot`]:
//! the partitions' figures added up. A partition's set goes when its task ends (revoked or
//! stopped): shadow state lives in memory only and starts empty at each assignment.
//!
//! Without `[[shadow]]` no set exists: the task holds `None` and its step checks that once
//! per upload, nothing more.

use crate::engine::{Figures, Millis, ShadowSet, ShadowSpec};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The runtime's shadow specs and the sets of its partitions. Cheap to clone (shared).
#[derive(Clone, Debug, Default)]
pub struct ShadowBoard {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    specs: Vec<ShadowSpec>,
    sets: Mutex<BTreeMap<i32, Arc<Mutex<ShadowSet>>>>,
}

impl ShadowBoard {
    /// A board running `specs` in every partition (none: shadows off).
    pub fn new(specs: Vec<ShadowSpec>) -> Self {
        ShadowBoard {
            inner: Arc::new(Inner {
                specs,
                sets: Mutex::default(),
            }),
        }
    }

    /// The shadow specs, in config order.
    pub fn specs(&self) -> &[ShadowSpec] {
        &self.inner.specs
    }

    /// Whether no shadow is configured.
    pub fn is_empty(&self) -> bool {
        self.inner.specs.is_empty()
    }

    /// A fresh set for `partition`, measuring from `since` (ms, wall clock), replacing the
    /// one a previous task of the partition left; `None` without shadows.
    pub fn register(&self, partition: i32, since: Millis) -> Option<ShadowHandle> {
        if self.is_empty() {
            return None;
        }
        let set = Arc::new(Mutex::new(ShadowSet::new(&self.inner.specs, since)));
        self.sets().insert(partition, Arc::clone(&set));
        Some(ShadowHandle {
            partition,
            set,
            board: self.clone(),
        })
    }

    /// The figures of every registered partition added up.
    pub fn snapshot(&self) -> ShadowSnapshot {
        let sets: Vec<(i32, Arc<Mutex<ShadowSet>>)> = self
            .sets()
            .iter()
            .map(|(p, s)| (*p, Arc::clone(s)))
            .collect();
        let mut snap = ShadowSnapshot {
            partitions: Vec::with_capacity(sets.len()),
            live: Figures::default(),
            shadows: self
                .inner
                .specs
                .iter()
                .map(|s| (s.clone(), Figures::default()))
                .collect(),
        };
        for (partition, set) in sets {
            let set = lock(&set);
            snap.partitions.push((partition, set.since()));
            snap.live.add(set.live());
            for ((_, sum), shadow) in snap.shadows.iter_mut().zip(set.shadows()) {
                sum.add(shadow.figures());
            }
        }
        snap
    }

    fn sets(&self) -> MutexGuard<'_, BTreeMap<i32, Arc<Mutex<ShadowSet>>>> {
        lock(&self.inner.sets)
    }
}

/// A lock that a panic elsewhere left poisoned is still used: the worst a half-done step
/// leaves is figures off by one step.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One partition task's set; unregistered when dropped (unless a newer task of the
/// partition replaced it already).
#[derive(Debug)]
pub struct ShadowHandle {
    partition: i32,
    set: Arc<Mutex<ShadowSet>>,
    board: ShadowBoard,
}

impl ShadowHandle {
    /// The set, locked (for one store step).
    pub fn lock(&self) -> MutexGuard<'_, ShadowSet> {
        lock(&self.set)
    }
}

impl Drop for ShadowHandle {
    fn drop(&mut self) {
        let mut sets = self.board.sets();
        if sets
            .get(&self.partition)
            .is_some_and(|s| Arc::ptr_eq(s, &self.set))
        {
            sets.remove(&self.partition);
        }
    }
}

/// The figures of every partition owned here, added up (SEMANTICS §8).
#[derive(Clone, Debug)]
pub struct ShadowSnapshot {
    /// The partitions counted and when each one's figures start (ms, wall clock).
    pub partitions: Vec<(i32, Millis)>,
    /// The live policy's figures (`manual` emissions left out).
    pub live: Figures,
    /// Each shadow's spec and figures, in config order.
    pub shadows: Vec<(ShadowSpec, Figures)>,
}

impl ShadowSnapshot {
    /// When the figures start: the earliest start of a partition counted (ms; `None`: no
    /// partition).
    pub fn since(&self) -> Option<Millis> {
        self.partitions.iter().map(|(_, s)| *s).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{PolicySpec, SessionKey, Upload};

    #[test]
    fn snapshot_adds_partitions_and_forgets_ended_tasks() {
        assert!(ShadowBoard::default().register(0, 0).is_none());
        let board = ShadowBoard::new(vec![ShadowSpec {
            name: "s".to_owned(),
            policy: PolicySpec::fixed(10),
            max_sessions: 10,
        }]);
        let a = board.register(0, 100).unwrap();
        let b = board.register(1, 50).unwrap();
        for (h, session) in [(&a, "x"), (&b, "y")] {
            let mut set = h.lock();
            set.apply(0, &Upload::plain(SessionKey::new("t", session), 0));
            set.advance(1_000);
            set.count(&[], |_| (0, crate::engine::TenantClass::Default));
        }
        let snap = board.snapshot();
        assert_eq!(snap.since(), Some(50));
        assert_eq!(snap.partitions, vec![(0, 100), (1, 50)]);
        assert_eq!(snap.shadows[0].1.total().emissions, 2);
        // A newer task of partition 1 replaces the set; the old handle's drop keeps it.
        let b2 = board.register(1, 70).unwrap();
        drop(b);
        assert_eq!(board.snapshot().partitions, vec![(0, 100), (1, 70)]);
        drop((a, b2));
        assert!(board.snapshot().partitions.is_empty());
    }
}
