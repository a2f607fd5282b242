//! Restore on assign (ARCHITECTURE "changelog"; SEMANTICS §6 "Single writer"): before a
//! partition task takes input, its store is brought level with the changelog, so a new owner
//! continues every pending round of the old one and resumes at the input offset the old one
//! stopped at (the offset is part of what is restored).
//!
//! Only when the sink has a changelog ([`Sink::changelog`]). The decision, from the local
//! store's changelog bookkeeping (see [`crate::store::changelog`]):
//!
//! | local store | what happens |
//! |---|---|
//! | clean, checkpoint `c` | records from `c` to the end are applied (nothing when the changelog ends at `c`, the usual restart) |
//! | no checkpoint, empty (new instance, new partition) | restored from offset 0 |
//! | dirty (writes not known to be in the changelog: the process died, or lost the partition, before the changelog acknowledged them), or no checkpoint but not empty (a store from before the changelog) | the changelog from the checkpoint (or 0) is read: if no other writer appended there (`meta\0writer`), the store is kept and its state appended again as a snapshot (a crash-restart resumes exactly where the store is); else it is wiped and restored from offset 0 |
//!
//! In exactly-once mode a dirty store is always wiped: its last writes belong to a
//! transaction that did not commit.
//!
//! A clean store whose checkpoint lies below a compaction that dropped tombstones (NATS:
//! the changelog purged below a snapshot, [`ChangelogReader::restarts_from_snapshot`]) is
//! wiped and restored from the start of what the changelog holds.
//!
//! After applying records, the timers are rebuilt from the sessions (they are not on the
//! changelog). A snapshot has no tombstones: a key deleted in the writes the changelog lacked
//! (an expired session, an acknowledged outbox entry) comes back on a later restore from
//! scratch, and is expired or re-published (same `emission_id`) again.
//!
//! Progress: the partition is in state `restoring` with `restore_remaining` records left
//! (status board, `/v1/partitions`, metric `settle_restore_remaining_records`), and a log line
//! every [`PROGRESS_EVERY`]; the end is logged as `partition restored from changelog` with the
//! record count and the time taken. A broker that is unavailable is retried with backoff from
//! the last applied chunk (each chunk moves the checkpoint, so no work is lost).

use super::status::{PartitionState, StatusBoard};
use super::throttle::LogThrottle;
use crate::engine::Engine;
use crate::store::{changelog::writer_of, MemoryBudget, PartitionStore, StoreOptions};
use crate::transport::{Backoff, ChangelogReader, Error, Sink};
use std::path::Path;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How often a restore claims the partition again after another writer appended during it
/// (`Sink::fences_by_changelog`) before the partition fails.
pub const MAX_CLAIMS: u32 = 20;

/// Changelog records applied per RocksDB write during a restore.
pub const RESTORE_CHUNK: usize = 10_000;

/// How often a running restore logs its progress.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// What a restore did (for logs and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Changelog records applied.
    pub records: u64,
    /// The local store was wiped first (it was dirty, or older than a non-empty changelog).
    pub wiped: bool,
    /// The local store was written to an empty changelog as a snapshot (records).
    pub seeded: u64,
    /// Wall time taken (ms).
    pub elapsed_ms: u64,
}

/// Opens the store of `partition` at `path` and, when `sink` has a changelog, brings it level
/// with the changelog (module docs), rebuilding timers with `engine`'s `next_due`;
/// `exactly_once`: the partition commits through transactions (a dirty store is always
/// wiped). Returns the store, ready for the partition task, or `None` when `cancel` fired
/// first.
///
/// Errors (fatal for the partition, the text says what failed): the store cannot be opened,
/// wiped or written; a changelog record names no column family of this build; a fatal
/// changelog error.
#[allow(clippy::too_many_arguments)]
pub async fn open_and_restore<K: Sink>(
    sink: &K,
    engine: &Engine,
    exactly_once: bool,
    path: &Path,
    options: &StoreOptions,
    budget: &MemoryBudget,
    partition: i32,
    status: &StatusBoard,
    cancel: &CancellationToken,
) -> Result<Option<(PartitionStore, RestoreReport)>, String> {
    let open = || {
        PartitionStore::open_with_budget(path, options, budget)
            .map_err(|e| format!("partition store: {e}"))
    };
    let mut store = open()?;
    let mut report = RestoreReport::default();
    let Some(topic) = sink.changelog().map(str::to_owned) else {
        return Ok(Some((store, report)));
    };
    let started = Instant::now();
    let mut wipe = false;
    if exactly_once && store.changelog_dirty() {
        // Its last writes belong to a transaction that never committed (their emissions
        // were aborted with it): only the committed changelog counts.
        tracing::warn!(
            partition,
            changelog = %topic,
            "exactly-once: the store holds writes of an uncommitted transaction: wiping it and restoring from the committed changelog"
        );
        wipe = true;
    } else if store.changelog_dirty()
        || (store.changelog_checkpoint().is_none() && !store.is_empty())
    {
        // The store may hold writes the changelog lacks (the process died before the
        // changelog acknowledged them, or the store predates the changelog). It is kept if no
        // other writer appended to the changelog since its checkpoint.
        let from = store.changelog_checkpoint().unwrap_or(0);
        let Some(foreign) =
            foreign_writes(sink, partition, from, store.writer_id(), status, cancel).await?
        else {
            return Ok(None);
        };
        let mut seeded = None;
        if foreign == 0 {
            let snapshot = store
                .snapshot_changes()
                .map_err(|e| format!("partition store: {e}"))?;
            let ack = sink
                .append_changes(partition, &snapshot)
                .map_err(|e| format!("changelog: {e}"))?;
            match ack.await {
                Ok(next) => seeded = Some((next, snapshot.len())),
                // With the changelog as the fence: somebody appended since the read above, so
                // another writer is there after all (wiped below).
                Err(e @ Error::Fenced { .. }) => {
                    tracing::warn!(partition, changelog = %topic, error = %e, "another instance appended to the changelog during the restore");
                }
                Err(e) => return Err(format!("changelog: {e}")),
            }
        }
        if let Some((next, records)) = seeded {
            store
                .changelog_synced(next)
                .map_err(|e| format!("partition store: {e}"))?;
            report.seeded = records as u64;
            report.elapsed_ms = started.elapsed().as_millis() as u64;
            tracing::info!(
                partition,
                changelog = %topic,
                records = report.seeded,
                elapsed_ms = report.elapsed_ms,
                "the store holds writes the changelog may lack and nobody else wrote the changelog since: store kept, its state written to the changelog again"
            );
            if sink.fences_by_changelog() {
                // That append was expected right after the records read: it is the claim.
                tracing::info!(partition, changelog = %topic, next, "partition claimed in its changelog: any other writer of it is fenced at its next append");
            }
            return Ok(Some((store, report)));
        }
        tracing::warn!(
            partition,
            changelog = %topic,
            foreign,
            "another instance wrote the changelog since this store's checkpoint: wiping the store and restoring it from the changelog"
        );
        wipe = true;
    }
    if wipe {
        drop(store);
        PartitionStore::destroy(path).map_err(|e| format!("partition store: {e}"))?;
        store = open()?;
        report.wiped = true;
    }

    status.update(partition, |s| s.state = PartitionState::Restoring);
    let mut backoff = Backoff::new(Duration::from_secs(5));
    let mut warn = LogThrottle::default();
    let mut logged_at = Instant::now();
    let from_start = store.changelog_checkpoint().unwrap_or(0);
    let mut claims = 0u32;
    'claim: loop {
        'reopen: loop {
            let from = store.changelog_checkpoint().unwrap_or(0);
            let Some(mut reader) = open_reader(sink, partition, from, status, cancel).await? else {
                return Ok(None);
            };
            if from > 0 && reader.restarts_from_snapshot() {
                // Purged past the checkpoint (NATS compaction): the deletes this store
                // lacks are gone with what was purged, so it starts empty from the snapshot.
                tracing::warn!(
                    partition,
                    changelog = %topic,
                    checkpoint = from,
                    "the changelog was compacted past this store's checkpoint: wiping the store and restoring it from the changelog's snapshot"
                );
                drop(reader);
                drop(store);
                PartitionStore::destroy(path).map_err(|e| format!("partition store: {e}"))?;
                store = open()?;
                report.wiped = true;
                continue 'reopen;
            }
            loop {
                let chunk = tokio::select! {
                    () = cancel.cancelled() => return Ok(None),
                    c = reader.next_chunk(RESTORE_CHUNK) => c,
                };
                let chunk = match chunk {
                    Ok(c) => c,
                    Err(e) if e.is_retryable() => {
                        if let Some(suppressed) = warn.allow() {
                            tracing::warn!(partition, error = %e, suppressed, "changelog read failed; retrying from the last applied record (logged at most every 10 s)");
                        }
                        tokio::select! {
                            () = cancel.cancelled() => return Ok(None),
                            () = tokio::time::sleep(backoff.next_delay()) => {}
                        }
                        continue 'reopen;
                    }
                    Err(e) => return Err(format!("changelog: {e}")),
                };
                let Some(&(last, _)) = chunk.last() else {
                    break 'reopen;
                };
                backoff.reset();
                let n = store
                    .restore(chunk.iter().map(|(o, c)| (*o, c)))
                    .map_err(|e| format!("partition store: restoring from the changelog: {e}"))?;
                report.records += n as u64;
                let remaining = reader
                    .end_hint()
                    .map_or(0, |end| end.saturating_sub(last + 1).max(0) as u64);
                let restored = report.records;
                status.update(partition, |s| {
                    s.restore_remaining = remaining;
                    s.restored = restored;
                });
                if logged_at.elapsed() >= PROGRESS_EVERY {
                    logged_at = Instant::now();
                    tracing::info!(
                        partition,
                        changelog = %topic,
                        restored = report.records,
                        remaining,
                        "restoring the partition store from the changelog"
                    );
                }
            }
        }
        if !sink.fences_by_changelog() {
            break 'claim;
        }
        // The changelog is the fence: this process owns the partition once its claim (its writer
        // record, expected right after the last record read) is in; a writer that appended
        // after the read makes the claim fail, and the restore reads on and claims again.
        let claim = store
            .claim_change()
            .map_err(|e| format!("partition store: {e}"))?;
        let ack = sink
            .append_changes(partition, &[claim])
            .map_err(|e| format!("changelog: {e}"))?;
        match ack.await {
            Ok(next) => {
                store
                    .changelog_synced(next)
                    .map_err(|e| format!("partition store: {e}"))?;
                tracing::info!(partition, changelog = %topic, next, "partition claimed in its changelog: any other writer of it is fenced at its next append");
                break 'claim;
            }
            Err(e @ Error::Fenced { .. }) if claims < MAX_CLAIMS => {
                claims += 1;
                tracing::info!(partition, changelog = %topic, error = %e, attempt = claims, "another writer appended during the restore; reading its records and claiming again");
                tokio::select! {
                    () = cancel.cancelled() => return Ok(None),
                    () = tokio::time::sleep(Duration::from_millis(50 * u64::from(claims))) => {}
                }
            }
            Err(e) => return Err(format!("changelog: claiming the partition: {e}")),
        }
    }
    if report.records > 0 {
        // Timers are not on the changelog: one per session, from its state.
        store
            .rebuild_timers(|key, state| engine.next_due(key, state))
            .map_err(|e| format!("partition store: rebuilding timers: {e}"))?;
    }
    status.update(partition, |s| {
        s.restore_remaining = 0;
        s.state = PartitionState::Starting;
    });
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    tracing::info!(
        partition,
        changelog = %topic,
        from = from_start,
        records = report.records,
        wiped = report.wiped,
        elapsed_ms = report.elapsed_ms,
        next_offset = ?store.stored_offset(),
        pending_rounds = store.pending_rounds(),
        outbox = store.outbox_len(),
        "partition restored from changelog"
    );
    Ok(Some((store, report)))
}

/// Reads changelog partition `partition` from `from` to its end and counts the records of
/// `meta\0writer` that name another writer than `own` (any writer when `own` is `None`).
/// `None`: cancelled.
async fn foreign_writes<K: Sink>(
    sink: &K,
    partition: i32,
    from: i64,
    own: Option<u64>,
    status: &StatusBoard,
    cancel: &CancellationToken,
) -> Result<Option<u64>, String> {
    let Some(mut reader) = open_reader(sink, partition, from, status, cancel).await? else {
        return Ok(None);
    };
    let mut foreign = 0u64;
    loop {
        let chunk = tokio::select! {
            () = cancel.cancelled() => return Ok(None),
            c = reader.next_chunk(RESTORE_CHUNK) => c.map_err(|e| format!("changelog: {e}"))?,
        };
        if chunk.is_empty() {
            return Ok(Some(foreign));
        }
        foreign += chunk
            .iter()
            .filter_map(|(_, c)| writer_of(c))
            .filter(|w| Some(*w) != own)
            .count() as u64;
    }
}

/// Opens a changelog reader, retrying while the changelog is unavailable (missing topic,
/// broker down). `None`: cancelled.
async fn open_reader<K: Sink>(
    sink: &K,
    partition: i32,
    from: i64,
    status: &StatusBoard,
    cancel: &CancellationToken,
) -> Result<Option<Box<dyn ChangelogReader>>, String> {
    retry_unavailable("changelog", partition, cancel, || {
        status.update(partition, |s| s.state = PartitionState::Restoring);
        sink.read_changelog(partition, from)
    })
    .await
}

/// Runs `op` until it succeeds, retrying after a backoff (50 ms doubling up to 5 s) while it
/// fails with a retryable error; the failure is logged (naming `what` and `partition`) at
/// most every 10 s. `Ok(None)`: `cancel` fired first.
///
/// Errors: the first non-retryable error, as text prefixed with `what`.
pub(crate) async fn retry_unavailable<T, Fut>(
    what: &str,
    partition: i32,
    cancel: &CancellationToken,
    mut op: impl FnMut() -> Fut,
) -> Result<Option<T>, String>
where
    Fut: std::future::Future<Output = Result<T, crate::transport::Error>>,
{
    let mut backoff = Backoff::new(Duration::from_secs(5));
    let mut warn = LogThrottle::default();
    loop {
        let result = tokio::select! {
            () = cancel.cancelled() => return Ok(None),
            r = op() => r,
        };
        match result {
            Ok(v) => return Ok(Some(v)),
            Err(e) if e.is_retryable() => {
                if let Some(suppressed) = warn.allow() {
                    tracing::warn!(partition, error = %e, suppressed, "{what} unavailable; the partition waits and retries (logged at most every 10 s)");
                }
                tokio::select! {
                    () = cancel.cancelled() => return Ok(None),
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                }
            }
            Err(e) => return Err(format!("{what}: {e}")),
        }
    }
}
