//! Pending work of the partitions this process owns: the open rounds listed for the admin's
//! `GET /v1/pending` and counted for `GET /v1/pending/summary` (issue "operate it by hand",
//! SEMANTICS §7).
//!
//! A partition task owns its store (STYLE §2), so the listing is asked of each task, like a
//! session lookup ([`super::lookup`]), in bounded slices: one query walks at most
//! [`SLICE_TIMERS`] timers of the partition's timer queue (in `(due, key)` order, from a
//! cursor) and is answered between two polls, so a partition with a million pending rounds
//! answers a listing in a few hundred short slices and its input keeps flowing between them.
//! The asker (the admin handler) chains slices until it has its page.
//!
//! Listed: open rounds with at least one upload (an empty max-wait continuation owes
//! nothing). Order: by partition, then `(due, key)`. Between slices uploads move timers, so
//! a key can be listed twice or missed by a long listing (like any cursor over live data);
//! each row is exact as of the slice that read it.

use super::lookup::{Query, SessionLookup};
use crate::codec::action::SessionFilter;
use crate::engine::{Engine, Millis, PolicyName, SessionKey, SessionState};
use crate::store::{self, PartitionStore};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// Timers one slice visits at most (live timers; the stale entries between them too).
pub const SLICE_TIMERS: usize = 4096;

/// Longest a slice holds its partition task (checked every [`BUDGET_CHECK`] timers): a slice
/// over evicted keys reads each one from RocksDB, so a count of timers alone does not bound
/// it. The asker chains slices until its page is full.
pub const SLICE_BUDGET: Duration = Duration::from_millis(2);

/// Timers visited between two looks at the clock in a slice (a look costs ~20 ns; an evicted
/// key's read ~2 µs since the block cache keeps index and filter blocks, `store::options`).
const BUDGET_CHECK: usize = 32;

/// Share of a partition task's wall time that listing slices may take (percent): after a
/// slice that held the task for `d`, the next slice waits `d * (100 - share) / share`. With
/// 1 M pending rounds and 50 000 uploads/s a partition task has no idle time, and one slice
/// per loop turn took most of it (lateness p99 1.1 s; BENCHMARKS "Listing 1 M pending
/// rounds"). At 10 % the pipeline bench's p99 was 15-29 ms (load 4-5), at 5 % 6-8 ms (load
/// 1-2), against 7-8 ms without a listing. A listing is slower for it; emissions are not.
pub const LISTING_SHARE_PERCENT: u32 = 5;

/// Longest a slice waits for its turn (ms of wall time), however long the slice before it
/// held the task: the hold is wall time, and on a starved machine a 2 ms slice can take
/// 200 ms, which at a 5 % share would hold the next one back 3.8 s, close to the asker's
/// [`SLICE_TIMEOUT`] (the offline listing test saw a partition reported `unavailable` under a
/// concurrent build). Well inside that timeout.
pub const MAX_LISTING_WAIT: Duration = Duration::from_millis(500);

/// Turns a partition task's listing slices into at most [`LISTING_SHARE_PERCENT`] of its
/// time: a slice asked for before its turn is kept (one at a time; the asker waits for its
/// answer) and answered when the turn comes.
#[derive(Debug)]
pub(crate) struct ListingShare {
    /// No slice is answered before this.
    free_at: Instant,
    /// The slice waiting for its turn.
    deferred: Option<SliceQuery>,
}

impl ListingShare {
    pub(crate) fn new() -> Self {
        ListingShare {
            free_at: Instant::now(),
            deferred: None,
        }
    }

    /// A slice waits for its turn (take no other query before it is answered).
    pub(crate) fn waiting(&self) -> bool {
        self.deferred.is_some()
    }

    /// When the waiting slice's turn comes.
    pub(crate) fn free_at(&self) -> Instant {
        self.free_at
    }

    /// Answers `q` with `answer` now if its turn has come, else keeps it for
    /// [`ListingShare::run_due`] (a slice already waiting is answered first).
    pub(crate) fn offer(&mut self, q: SliceQuery, answer: impl FnOnce(SliceQuery)) {
        if self.deferred.is_some() || Instant::now() < self.free_at {
            // One slice waits at a time: the loop stops taking queries while one does.
            debug_assert!(
                self.deferred.is_none(),
                "a second slice offered while one waits"
            );
            self.deferred = Some(q);
            return;
        }
        self.timed(q, answer);
    }

    /// Answers the waiting slice with `answer` if its turn has come.
    pub(crate) fn run_due(&mut self, answer: impl FnOnce(SliceQuery)) {
        if Instant::now() < self.free_at {
            return;
        }
        if let Some(q) = self.deferred.take() {
            self.timed(q, answer);
        }
    }

    fn timed(&mut self, q: SliceQuery, answer: impl FnOnce(SliceQuery)) {
        let started = Instant::now();
        answer(q);
        let ended = Instant::now();
        self.spent(started, ended);
    }

    /// Records a slice that held the task from `started` to `ended`.
    fn spent(&mut self, started: Instant, ended: Instant) {
        let share = LISTING_SHARE_PERCENT.clamp(1, 100);
        let held = ended.saturating_duration_since(started);
        self.free_at = ended + (held * (100 - share) / share).min(MAX_LISTING_WAIT);
    }
}

/// Slices one listing page may ask for in all before it returns what it has with a cursor
/// (bounds a request with a selective filter over many rounds: 256 slices, at most ~1 M
/// timers, at most ~0.5 s of partition time).
pub const PAGE_SLICES: usize = 256;

/// Slices a summary asks of one partition at most; beyond it (or beyond [`SUMMARY_TIME`])
/// the summary is marked truncated.
pub const SUMMARY_SLICES: usize = 262_144;

/// Longest a summary walks (all partitions together) before it answers with what it has,
/// marked truncated: a million evicted rounds are a million RocksDB reads.
pub const SUMMARY_TIME: Duration = Duration::from_secs(30);

/// Longest wait for one slice's answer.
pub const SLICE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why an open round is still waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// For its debounce deadline (last upload + delay).
    Debounce,
    /// For its max-wait bound, which comes before the debounce deadline.
    MaxWait,
    /// Due at or before the partition time: it fires as the catch-up pacer lets it
    /// (SEMANTICS §3), or at the next loop turn.
    Overdue,
}

impl Waiting {
    /// The name in the API's `waiting` field.
    pub fn as_str(self) -> &'static str {
        match self {
            Waiting::Debounce => "debounce",
            Waiting::MaxWait => "max_wait",
            Waiting::Overdue => "overdue",
        }
    }
}

/// One open round, as its partition task read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingRound {
    /// Partition whose store holds the key.
    pub partition: i32,
    /// The session key.
    pub key: SessionKey,
    /// When the round is due (ms since the epoch): the earlier of `deadline` and `max_wait_at`.
    pub due: Millis,
    /// Debounce deadline (ms): last upload + delay.
    pub deadline: Millis,
    /// Max-wait bound (ms), when the rule that timed the round has one.
    pub max_wait_at: Option<Millis>,
    /// Delay in force for the round (ms).
    pub delay: Millis,
    /// Uploads so far.
    pub uploads: u32,
    /// Event times (ms) of the round's first and last on-time uploads.
    pub first_upload_at: Option<Millis>,
    /// See `first_upload_at`.
    pub last_upload_at: Option<Millis>,
    /// The policy that timed the round (the rule in force at its last upload).
    pub policy: PolicyName,
    /// Why it waits.
    pub waiting: Waiting,
}

/// Pending-round counts by due bucket, relative to the partition time: overdue (due ≤
/// partition time), due in < 10 s, < 1 min, < 10 min, later.
pub type DueBuckets = [u64; 5];

/// Names of the [`DueBuckets`] in order, as the API prints them.
pub const DUE_BUCKETS: [&str; 5] = ["overdue", "lt_10s", "lt_1m", "lt_10m", "later"];

/// The bucket of a round due at `due` when the partition time is `now` (ms).
pub fn due_bucket(due: Millis, now: Millis) -> usize {
    match due.saturating_sub(now) {
        d if d <= 0 => 0,
        d if d < 10_000 => 1,
        d if d < 60_000 => 2,
        d if d < 600_000 => 3,
        _ => 4,
    }
}

/// One tenant's pending rounds in a slice, for a summary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantPending {
    /// Rounds by due bucket.
    pub rounds: DueBuckets,
    /// Uploads in those rounds.
    pub uploads: u64,
}

/// What one slice query asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SliceKind {
    /// The matching rounds, as rows.
    Rows,
    /// Only counts per tenant.
    Counts,
}

/// A slice query to one partition task.
#[derive(Debug)]
pub struct SliceQuery {
    /// Continue after this timer (`None`: from the first).
    pub after: Option<(Millis, SessionKey)>,
    /// Rows or counts.
    pub kind: SliceKind,
    /// Matching rows wanted at most (kind `Rows`: the rest of the asker's page); the slice
    /// ends after the one that fills it.
    pub max_rows: usize,
    /// Which rounds (its `tier` is the asker's to check: the partition task has no router).
    pub filter: Arc<SessionFilter>,
    /// Where the answer goes.
    pub reply: oneshot::Sender<Result<Slice, String>>,
}

/// A partition task's answer to a [`SliceQuery`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Slice {
    /// Matching rounds (kind `Rows`).
    pub rows: Vec<PendingRound>,
    /// Matching rounds per tenant (kind `Counts`).
    pub counts: BTreeMap<String, TenantPending>,
    /// Where the next slice starts; `None`: the walk is complete.
    pub next: Option<(Millis, SessionKey)>,
    /// The partition time (ms) the rows were judged against.
    pub partition_time: Millis,
}

/// Answers `q` from `store` (partition task side; between store batches). `now` is the
/// partition time (ms); `engine` names the policy of a round stored without one.
///
/// Errors: the store's, as text (an evicted key could not be read).
pub fn answer_slice(
    store: &mut PartitionStore,
    engine: &Engine,
    partition: i32,
    now: Millis,
    q: SliceQuery,
) {
    let mut slice = Slice {
        partition_time: now,
        ..Slice::default()
    };
    let filter = &q.filter;
    let started = Instant::now();
    let mut visited = 0usize;
    let max_rows = q.max_rows.max(1);
    let walked = store.timer_slice(
        q.after.as_ref(),
        SLICE_TIMERS,
        |due, key, state: &SessionState| {
            visited += 1;
            let go_on = visited % BUDGET_CHECK != 0 || started.elapsed() < SLICE_BUDGET;
            let Some(r) = state.round.as_ref().filter(|r| r.uploads > 0) else {
                return go_on;
            };
            if !filter.admits(partition, key, due)
                || filter.min_uploads.is_some_and(|m| r.uploads < m)
            {
                return go_on;
            }
            let policy = r.policy.unwrap_or_else(|| engine.spec_for(key).name);
            if filter.policy.is_some_and(|p| p != policy) {
                return go_on;
            }
            match q.kind {
                SliceKind::Counts => {
                    let t = slice.counts.entry(key.tenant().to_owned()).or_default();
                    t.rounds[due_bucket(due, now)] += 1;
                    t.uploads += u64::from(r.uploads);
                }
                SliceKind::Rows => slice.rows.push(PendingRound {
                    partition,
                    key: key.clone(),
                    due,
                    deadline: r.deadline,
                    max_wait_at: r.max_wait_at,
                    delay: r.delay,
                    uploads: r.uploads,
                    first_upload_at: r.first_upload_at,
                    last_upload_at: r.last_upload_at,
                    policy,
                    waiting: if due <= now {
                        Waiting::Overdue
                    } else if r.max_wait_at.is_some_and(|m| m < r.deadline) {
                        Waiting::MaxWait
                    } else {
                        Waiting::Debounce
                    },
                }),
            }
            go_on && slice.rows.len() < max_rows
        },
    );
    let answer = walked
        .map(|next| {
            slice.next = next;
            slice
        })
        .map_err(|e: store::Error| format!("partition store: {e}"));
    // The asker may have given up (timeout): nothing to do then.
    let _ = q.reply.send(answer);
}

/// Where a listing page starts: a partition and the timer after which its walk goes on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cursor {
    /// The partition to continue in (partitions are walked in ascending order).
    pub partition: i32,
    /// Continue after this timer of it (`None`: from its first).
    pub after: Option<(Millis, SessionKey)>,
}

impl Cursor {
    /// The cursor as an opaque token for the API: the hex digits of the JSON array
    /// `[partition, due, key]` (or `[partition]`).
    pub fn encode(&self) -> String {
        let v = match &self.after {
            Some((due, key)) => serde_json::json!([self.partition, due, key.as_str()]),
            None => serde_json::json!([self.partition]),
        };
        let mut out = String::new();
        for b in v.to_string().bytes() {
            out.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
            out.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
        }
        out
    }

    /// Parses a token of [`Cursor::encode`]. Errors: the token is not one (text says so).
    pub fn decode(token: &str) -> Result<Self, String> {
        let bad = || format!("cursor {token:?} is not one this API gave out");
        if token.len() % 2 != 0 || token.len() > 4096 {
            return Err(bad());
        }
        let bytes: Vec<u8> = (0..token.len())
            .step_by(2)
            .map(|i| {
                u8::from_str_radix(token.get(i..i + 2).ok_or_else(bad)?, 16).map_err(|_| bad())
            })
            .collect::<Result<_, _>>()?;
        let v: Vec<serde_json::Value> = serde_json::from_slice(&bytes).map_err(|_| bad())?;
        let partition = v
            .first()
            .and_then(serde_json::Value::as_i64)
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(bad)?;
        let after = match (v.get(1), v.get(2)) {
            (Some(due), Some(key)) => {
                let due = due.as_i64().ok_or_else(bad)?;
                let key = key.as_str().ok_or_else(bad)?;
                let (t, s) = key.split_once('/').ok_or_else(bad)?;
                Some((due, SessionKey::new(t, s)))
            }
            (None, None) => None,
            _ => return Err(bad()),
        };
        Ok(Cursor { partition, after })
    }
}

/// A page of pending rounds of the partitions owned here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Page {
    /// Rounds, each with its tenant's tier, by partition then `(due, key)`.
    pub rows: Vec<(PendingRound, String)>,
    /// Partitions this process owns (registered tasks) that the page's walk covers or will
    /// cover from its cursor.
    pub partitions: Vec<i32>,
    /// Partitions that did not answer, with why (their rounds are not in the page).
    pub unavailable: Vec<(i32, String)>,
    /// Where the next page starts; `None`: the listing is complete.
    pub next: Option<Cursor>,
}

/// Open rounds counted over every partition owned here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Partitions counted, with their partition time (ms).
    pub partitions: Vec<(i32, Millis)>,
    /// Partitions that did not answer, with why.
    pub unavailable: Vec<(i32, String)>,
    /// Per tenant (matching the filter).
    pub tenants: BTreeMap<String, TenantPending>,
    /// A partition had more than [`SUMMARY_SLICES`] slices: the counts are a lower bound.
    pub truncated: bool,
}

async fn ask(
    tx: &mpsc::Sender<Query>,
    after: Option<(Millis, SessionKey)>,
    kind: SliceKind,
    max_rows: usize,
    filter: &Arc<SessionFilter>,
) -> Result<Slice, String> {
    let (reply, rx) = oneshot::channel();
    let q = SliceQuery {
        after,
        kind,
        max_rows,
        filter: Arc::clone(filter),
        reply,
    };
    // Waits for room: a listing is one query at a time per partition.
    tokio::time::timeout(SLICE_TIMEOUT, tx.send(Query::Pending(q)))
        .await
        .map_err(|_| format!("busy: no room for a query within {SLICE_TIMEOUT:?}"))?
        .map_err(|_| "the partition task has stopped".to_owned())?;
    match tokio::time::timeout(SLICE_TIMEOUT, rx).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(_)) => Err("the partition task has stopped".to_owned()),
        Err(_) => Err(format!("no answer within {SLICE_TIMEOUT:?}")),
    }
}

impl SessionLookup {
    /// One page of at most `limit` open rounds matching `filter` (its `tier` checked with
    /// `tier_of`), from `cursor` (`None`: from the first partition). Asks the partition
    /// tasks slice by slice, at most [`PAGE_SLICES`] slices in all: a page can be short
    /// and still have a next cursor.
    pub async fn pending(
        &self,
        filter: SessionFilter,
        cursor: Option<Cursor>,
        limit: usize,
        tier_of: impl Fn(&str) -> String,
    ) -> Page {
        let filter = Arc::new(filter);
        let tasks: Vec<(i32, mpsc::Sender<Query>)> = self
            .senders()
            .into_iter()
            .filter(|(p, _)| filter.partitions.as_ref().is_none_or(|ps| ps.contains(p)))
            .collect();
        let mut page = Page {
            partitions: tasks.iter().map(|(p, _)| *p).collect(),
            ..Page::default()
        };
        let limit = limit.max(1);
        let mut slices = 0usize;
        let start = cursor.as_ref().map_or(i32::MIN, |c| c.partition);
        for (partition, tx) in tasks.iter().filter(|(p, _)| *p >= start) {
            let mut after = cursor
                .as_ref()
                .filter(|c| c.partition == *partition)
                .and_then(|c| c.after.clone());
            loop {
                if page.rows.len() >= limit || slices >= PAGE_SLICES {
                    page.next = Some(Cursor {
                        partition: *partition,
                        after,
                    });
                    return page;
                }
                slices += 1;
                match ask(
                    tx,
                    after.clone(),
                    SliceKind::Rows,
                    limit - page.rows.len(),
                    &filter,
                )
                .await
                {
                    Ok(slice) => {
                        for row in slice.rows {
                            let tier = tier_of(row.key.tenant());
                            if filter.tier.as_ref().is_none_or(|t| *t == tier) {
                                if page.rows.len() >= limit {
                                    // The rest of this slice comes in the next page.
                                    page.next = Some(Cursor {
                                        partition: *partition,
                                        after,
                                    });
                                    return page;
                                }
                                after = Some((row.due, row.key.clone()));
                                page.rows.push((row, tier));
                            }
                        }
                        match slice.next {
                            Some(next) => after = Some(next),
                            None => break,
                        }
                    }
                    Err(e) => {
                        page.unavailable.push((*partition, e));
                        break;
                    }
                }
            }
        }
        page
    }

    /// Every open round matching `filter` counted per tenant (the caller groups tenants
    /// by tier), over every partition owned here.
    pub async fn pending_summary(&self, filter: SessionFilter) -> Summary {
        let filter = Arc::new(filter);
        let mut summary = Summary::default();
        let started = Instant::now();
        for (partition, tx) in self.senders() {
            if filter
                .partitions
                .as_ref()
                .is_some_and(|ps| !ps.contains(&partition))
            {
                continue;
            }
            let mut after = None;
            let mut time = None;
            for n in 0.. {
                if n >= SUMMARY_SLICES || started.elapsed() >= SUMMARY_TIME {
                    summary.truncated = true;
                    break;
                }
                match ask(&tx, after.take(), SliceKind::Counts, usize::MAX, &filter).await {
                    Ok(slice) => {
                        time.get_or_insert(slice.partition_time);
                        for (tenant, c) in slice.counts {
                            let t = summary.tenants.entry(tenant).or_default();
                            for (a, b) in t.rounds.iter_mut().zip(c.rounds) {
                                *a += b;
                            }
                            t.uploads += c.uploads;
                        }
                        match slice.next {
                            Some(next) => after = Some(next),
                            None => break,
                        }
                    }
                    Err(e) => {
                        summary.unavailable.push((partition, e));
                        time = None;
                        break;
                    }
                }
            }
            if let Some(t) = time {
                summary.partitions.push((partition, t));
            }
        }
        summary
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_garbage_is_refused() {
        for c in [
            Cursor {
                partition: 3,
                after: None,
            },
            Cursor {
                partition: 0,
                after: Some((1_700_000_000_123, SessionKey::new("acme", "run/42 \"x\""))),
            },
        ] {
            assert_eq!(Cursor::decode(&c.encode()), Ok(c));
        }
        for bad in ["", "zz", "5b5d", "5b2261225d", "abc"] {
            assert!(Cursor::decode(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn due_buckets_are_relative_to_the_partition_time() {
        let now = 1_000_000;
        assert_eq!(due_bucket(now - 5, now), 0);
        assert_eq!(due_bucket(now, now), 0);
        assert_eq!(due_bucket(now + 9_999, now), 1);
        assert_eq!(due_bucket(now + 10_000, now), 2);
        assert_eq!(due_bucket(now + 599_999, now), 3);
        assert_eq!(due_bucket(now + 600_000, now), 4);
    }

    fn slice_query() -> (SliceQuery, oneshot::Receiver<Result<Slice, String>>) {
        let (reply, rx) = oneshot::channel();
        let q = SliceQuery {
            after: None,
            kind: SliceKind::Rows,
            max_rows: 10,
            filter: Arc::new(SessionFilter::default()),
            reply,
        };
        (q, rx)
    }

    #[test]
    fn a_slice_holds_back_the_next_so_listing_keeps_to_its_share() {
        let mut share = ListingShare::new();
        let t0 = Instant::now();
        share.spent(t0, t0 + Duration::from_millis(2));
        // 2 ms of listing in every 2 ms * 100 / share.
        let period = Duration::from_millis(2) * 100 / LISTING_SHARE_PERCENT;
        assert_eq!(share.free_at(), t0 + period);
        assert!(
            period >= Duration::from_millis(20),
            "a share of at most 10 %"
        );
    }

    #[test]
    fn a_slow_slice_holds_back_the_next_at_most_the_longest_wait() {
        let mut share = ListingShare::new();
        let t0 = Instant::now();
        share.spent(t0, t0 + Duration::from_millis(400));
        let end = t0 + Duration::from_millis(400);
        assert_eq!(share.free_at(), end + MAX_LISTING_WAIT);
        assert!(
            MAX_LISTING_WAIT * 4 <= SLICE_TIMEOUT,
            "well inside the asker's timeout"
        );
    }

    #[test]
    fn a_slice_offered_before_its_turn_waits_and_is_answered_once_when_due() {
        let mut share = ListingShare::new();
        let mut answered = 0;
        let (q, _rx) = slice_query();
        share.offer(q, |_| {
            answered += 1;
            std::thread::sleep(Duration::from_millis(5));
        });
        assert_eq!(answered, 1, "the first slice is answered at once");
        assert!(!share.waiting());
        let (q, _rx2) = slice_query();
        share.offer(q, |_| answered += 1);
        assert_eq!(
            answered, 1,
            "the second comes before its turn (>= 45 ms later at a 10 % share)"
        );
        assert!(share.waiting());
        share.run_due(|_| answered += 1);
        assert_eq!(answered, 1, "still before its turn");
        while Instant::now() < share.free_at() {
            std::thread::sleep(Duration::from_millis(5));
        }
        share.run_due(|_| answered += 1);
        assert_eq!(answered, 2);
        assert!(!share.waiting());
        share.run_due(|_| answered += 1);
        assert_eq!(answered, 2, "nothing is answered twice");
    }
}
