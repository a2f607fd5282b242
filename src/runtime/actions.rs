//! Operator actions (SEMANTICS §7) on the runtime's side: the [`ActionLog`] of a process —
//! the audit records it wrote or read back from the audit topic, by request id — and what a
//! partition task needs to apply an action record: selecting a bulk action's sessions and
//! building its outcome.
//!
//! An action reaches a partition's owner as a record of that partition (the accepting
//! instance produced it to the input topic), so the single writer applies it in order with
//! the uploads, in a store batch, and a replay after a crash applies it at the same place
//! again (same offset, same partition time: the same result). Once per request id: an
//! outcome of the same request id at an *earlier* offset of the partition (a retried
//! request is a new record) makes the record a duplicate that does nothing and reports that
//! first outcome again. The log knows the outcomes this process applied and those the
//! audit tail read back (the previous owner's, after a handoff), the last
//! [`RECENT_REQUESTS`] request ids.

use crate::codec::action::{ActionOutcome, AuditRecord, AuditStage, SessionFilter};
use crate::engine::{Engine, Millis, SessionKey};
use crate::store::{self, PartitionStore};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use tokio::sync::watch;

/// Request ids whose audit records a process keeps in memory (oldest forgotten first).
pub const RECENT_REQUESTS: usize = 10_000;

/// Audit records a process keeps in arrival order for `GET /v1/audit` (oldest forgotten
/// first).
pub const RECENT_AUDIT: usize = 1_000;

/// Emission ids an outcome lists at most.
pub const OUTCOME_EMISSION_IDS: usize = 100;

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Vec<AuditRecord>>,
    order: VecDeque<String>,
    /// The last [`RECENT_AUDIT`] records added, oldest first.
    recent: VecDeque<AuditRecord>,
}

/// The audit records of recent requests, shared by the partition tasks (which add their
/// outcomes), the audit tail (which adds everyone's) and the admin API (which waits for
/// outcomes). Cheap to clone.
#[derive(Clone)]
pub struct ActionLog {
    inner: Arc<Mutex<Inner>>,
    /// Bumped at every record added: waiters re-check.
    changed: watch::Sender<u64>,
    /// Audit topic (Kafka) or subject (NATS) outcomes are published to; `None`: not
    /// published (kept in this log only).
    pub topic: Option<String>,
    /// This instance's name, written into its audit records.
    pub instance: String,
}

impl std::fmt::Debug for ActionLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActionLog")
            .field("topic", &self.topic)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

impl Default for ActionLog {
    fn default() -> Self {
        Self::new(None, "settle")
    }
}

impl ActionLog {
    /// An empty log; outcomes go to `topic` (when set), written as `instance`.
    pub fn new(topic: Option<String>, instance: &str) -> Self {
        ActionLog {
            inner: Arc::default(),
            changed: watch::Sender::new(0),
            topic,
            instance: instance.to_owned(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds `record` (one this process wrote, or one read back from the audit topic; the
    /// same record read twice is kept once).
    pub fn add(&self, record: AuditRecord) {
        {
            let mut inner = self.lock();
            let id = record.request_id.clone();
            let list = match inner.by_id.get_mut(&id) {
                Some(list) => list,
                None => {
                    inner.order.push_back(id.clone());
                    while inner.order.len() > RECENT_REQUESTS {
                        if let Some(old) = inner.order.pop_front() {
                            inner.by_id.remove(&old);
                        }
                    }
                    inner.by_id.entry(id).or_default()
                }
            };
            if list.contains(&record) {
                return;
            }
            list.push(record.clone());
            inner.recent.push_back(record);
            if inner.recent.len() > RECENT_AUDIT {
                inner.recent.pop_front();
            }
        }
        self.changed.send_modify(|n| *n += 1);
    }

    /// The audit records of `request_id` known here, in the order added.
    pub fn get(&self, request_id: &str) -> Vec<AuditRecord> {
        self.lock()
            .by_id
            .get(request_id)
            .cloned()
            .unwrap_or_default()
    }

    /// The latest audit records added (at most `limit`, of `stage` when given), newest
    /// first: this process's own and those read back from the audit topic, in the order
    /// they arrived here.
    pub fn latest(&self, limit: usize, stage: Option<AuditStage>) -> Vec<AuditRecord> {
        self.lock()
            .recent
            .iter()
            .rev()
            .filter(|r| stage.is_none_or(|s| r.stage == s))
            .take(limit)
            .cloned()
            .collect()
    }

    /// The applied outcomes of `request_id`, one per partition (the first of each).
    pub fn outcomes(&self, request_id: &str) -> Vec<ActionOutcome> {
        let mut out: Vec<ActionOutcome> = Vec::new();
        for r in self.get(request_id) {
            if r.stage != AuditStage::Applied {
                continue;
            }
            if let Ok(o) = serde_json::from_value::<ActionOutcome>(r.result) {
                if !out.iter().any(|x| x.partition == o.partition) {
                    out.push(o);
                }
            }
        }
        out.sort_by_key(|o| o.partition);
        out
    }

    /// The outcome `partition` reported for `request_id` from a record before `offset`: the
    /// record at `offset` is then a retry, a duplicate (module docs).
    pub fn applied_before(
        &self,
        request_id: &str,
        partition: i32,
        offset: i64,
    ) -> Option<ActionOutcome> {
        self.outcomes(request_id)
            .into_iter()
            .find(|o| o.partition == partition && o.offset < offset)
    }

    /// Waits until `done(outcomes of request_id)` holds or `timeout` passes; returns the
    /// outcomes known then.
    pub async fn wait(
        &self,
        request_id: &str,
        timeout: std::time::Duration,
        done: impl Fn(&[ActionOutcome]) -> bool,
    ) -> Vec<ActionOutcome> {
        let mut rx = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let now = self.outcomes(request_id);
            if done(&now) {
                return now;
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return self.outcomes(request_id),
            }
        }
    }
}

/// One session a bulk action selected: its key and the uploads of its open round.
pub type Selected = (SessionKey, u32);

/// The open rounds (with uploads) of `store` that `filter` selects, in `(due, key)` order,
/// at most `limit`; `true` when more matched. `in_tier(tenant)` checks the filter's tier.
/// Walks the committed timers in slices (one pass; a million timers take a fraction of a
/// second, while the partition's input waits: bulk actions are rare).
///
/// Errors: the store's (reading an evicted key).
pub fn select(
    store: &mut PartitionStore,
    engine: &Engine,
    partition: i32,
    filter: &SessionFilter,
    in_tier: impl Fn(&str) -> bool,
    limit: usize,
) -> Result<(Vec<Selected>, bool), store::Error> {
    if filter
        .partitions
        .as_ref()
        .is_some_and(|ps| !ps.contains(&partition))
    {
        return Ok((Vec::new(), false));
    }
    let mut out: Vec<Selected> = Vec::new();
    let mut more = false;
    let mut after: Option<(Millis, SessionKey)> = None;
    loop {
        let next = store.timer_slice(
            after.as_ref(),
            super::pending::SLICE_TIMERS,
            |due, key, state| {
                let Some(r) = state.round.as_ref().filter(|r| r.uploads > 0) else {
                    return true;
                };
                if !filter.admits(partition, key, due)
                    || filter.min_uploads.is_some_and(|m| r.uploads < m)
                    || filter
                        .policy
                        .is_some_and(|p| p != r.policy.unwrap_or_else(|| engine.spec_for(key).name))
                    || filter.tier.is_some() && !in_tier(key.tenant())
                {
                    return true;
                }
                if out.len() < limit {
                    out.push((key.clone(), r.uploads));
                } else {
                    more = true;
                }
                true
            },
        )?;
        match next {
            Some(n) if !more => after = Some(n),
            _ => return Ok((out, more)),
        }
    }
}

/// The audit record of an outcome a partition applied.
pub fn applied_record(
    log: &ActionLog,
    at: Millis,
    who: &str,
    action: &str,
    reason: &str,
    selection: serde_json::Value,
    outcome: &ActionOutcome,
) -> AuditRecord {
    AuditRecord {
        at,
        instance: log.instance.clone(),
        who: who.to_owned(),
        request_id: outcome.request_id.clone(),
        action: action.to_owned(),
        stage: AuditStage::Applied,
        reason: reason.to_owned(),
        selection,
        result: serde_json::to_value(outcome).unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(id: &str, partition: i32, offset: i64) -> AuditRecord {
        let o = ActionOutcome {
            request_id: id.into(),
            partition,
            offset,
            sessions: 1,
            result: "flushed".into(),
            ..ActionOutcome::default()
        };
        applied_record(
            &ActionLog::default(),
            1,
            "alice",
            "flush",
            "why",
            serde_json::Value::Null,
            &o,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn outcomes_by_request_partition_and_offset() {
        let log = ActionLog::new(None, "i-0");
        log.add(applied("r1", 2, 40));
        log.add(applied("r1", 2, 40));
        assert_eq!(
            log.get("r1").len(),
            1,
            "the same record read twice is kept once"
        );
        log.add(applied("r1", 0, 7));
        let o = log.outcomes("r1");
        assert_eq!(o.iter().map(|o| o.partition).collect::<Vec<_>>(), [0, 2]);
        // A retry (a later record) is a duplicate; a replay of the same record is not.
        assert!(log.applied_before("r1", 2, 41).is_some());
        assert!(log.applied_before("r1", 2, 40).is_none());
        assert!(log.applied_before("r1", 1, 99).is_none());
        // Waiting: returns when done, or at the timeout with what is known.
        let waiter = {
            let log = log.clone();
            tokio::spawn(async move {
                log.wait("r2", std::time::Duration::from_secs(5), |o| o.len() == 1)
                    .await
            })
        };
        tokio::task::yield_now().await;
        log.add(applied("r2", 1, 3));
        assert_eq!(waiter.await.unwrap().len(), 1);
        let none = log
            .wait("r3", std::time::Duration::from_secs(1), |o| !o.is_empty())
            .await;
        assert!(none.is_empty());
        let latest = log.latest(2, None);
        assert_eq!(
            latest
                .iter()
                .map(|r| r.request_id.as_str())
                .collect::<Vec<_>>(),
            ["r2", "r1"],
            "newest first"
        );
        assert!(log.latest(5, Some(AuditStage::Refused)).is_empty());
        // Bounded: the oldest request ids are forgotten.
        for i in 0..RECENT_REQUESTS {
            log.add(applied(&format!("x{i}"), 0, 1));
        }
        assert!(log.get("r1").is_empty());
        assert_eq!(log.get(&format!("x{}", RECENT_REQUESTS - 1)).len(), 1);
        assert_eq!(log.latest(usize::MAX, None).len(), RECENT_AUDIT);
    }
}
