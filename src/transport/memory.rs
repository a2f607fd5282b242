//! The in-memory transport: a broker in one process, for `settle demo`, the file-fed
//! `run-file` command and tests. No network, no persistence of its own.
//!
//! * **Input**: one topic of N partitions, each an append-only log of records with offsets
//!   `0, 1, 2, …` and a record timestamp (ms). Producers append ([`MemoryBroker::produce`])
//!   or load a JSONL trace ([`MemoryBroker::load_trace`]). Records are routed by the
//!   explicit partition (modulo N) or a stable FNV-1a hash of the record key.
//! * **Consumer groups**: a committed offset per group and partition
//!   ([`MemoryBroker::committed`]). A [`MemorySource`] assigns every partition at start;
//!   tests move partitions with [`MemoryBroker::revoke`] / [`MemoryBroker::assign`].
//! * **Output**: an append-only log of every acknowledged [`ReadyMessage`] (all tier topics)
//!   and of dead letters, optionally mirrored to a JSONL file ([`MemoryBroker::tee_output`]):
//!   each ready record is written to the file before its publish resolves, so a SIGKILLed
//!   process leaves every acknowledged record in the file. Publishes in flight together
//!   share one `write` call ([`Tee`]): each appends its line to a buffer and yields once, and
//!   the first to run again writes the buffer for all of them. Tier changes
//!   (`Sink::publish_tier_change`) go to a log of their own ([`MemoryBroker::tier_events`]),
//!   never to the output log or the file, so readers of the output see ready records only.
//! * **Bounded load** ([`MemoryBroker::bound_load`], `settle run-file`): as a broker keeps
//!   its log on disk rather than in memory, the trace loader then stays at most a window of
//!   records ahead of each partition's furthest reader, and records below the retaining
//!   group's committed offset are dropped as it commits, so the process holds a bounded
//!   slice of the trace however long it is (the memory of a 1 M-upload run, issue 37).
//! * **Injected failures**: the sink can be made unavailable (every publish fails with a
//!   retryable error) for a while or until further notice, or made to lose acknowledgements
//!   (the record is stored but the publish never resolves, as when a broker acks after the
//!   producer died).
//!
//! Time: waits use tokio time, so tests with paused time drive the broker too.

use super::{
    ChangelogReader, Error, InputBatch, InputRecord, PartitionInput, ReadyMessage, Sink, Source,
    SourceEvent,
};
use crate::codec;
use crate::store::Change;
use crate::tiers::TierChange;
use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;

const TRANSPORT: &str = "memory";

/// One record as stored in a partition log (shared bytes: a poll hands them out uncopied).
#[derive(Clone, Debug)]
struct StoredRecord {
    key: Option<Bytes>,
    payload: Bytes,
    timestamp_ms: i64,
}

/// The records of one partition still held: offsets `start..start + records.len()`.
#[derive(Debug, Default)]
struct Log {
    /// Offset of `records[0]`: records below it were dropped ([`MemoryBroker::trim_committed`]).
    start: i64,
    records: Vec<StoredRecord>,
}

impl Log {
    /// Offset the next appended record gets (the log end).
    fn end(&self) -> i64 {
        self.start + self.records.len() as i64
    }

    /// Records held below offset `below`.
    fn held_below(&self, below: i64) -> usize {
        (below.min(self.end()) - self.start).max(0) as usize
    }

    /// Drops the first `n` records held (offsets do not change), giving back most of the
    /// spare capacity when little is left.
    fn drop_first(&mut self, n: usize) {
        self.records.drain(..n);
        self.start += n as i64;
        let len = self.records.len();
        if self.records.capacity() > 4 * len.max(LOAD_CHUNK) {
            self.records.shrink_to(2 * len.max(LOAD_CHUNK));
        }
    }
}

/// Trace lines [`MemoryBroker::load_trace`] appends to one partition under one lock.
const LOAD_CHUNK: usize = 1024;

/// Bytes [`MemoryBroker::load_trace`] reads at a time.
const LOAD_READ: usize = 1 << 20;

#[derive(Debug, Default)]
struct PartitionLog {
    records: Mutex<Log>,
    /// Woken on every append.
    appended: Notify,
    /// The furthest offset any reader of this partition has taken records up to (the next
    /// offset it will read); a bounded load ([`MemoryBroker::bound_load`]) stays within its
    /// window of it.
    read: AtomicI64,
    /// Notified (with `records`) when a reader took records: a bounded load waiting for room
    /// re-checks.
    taken: Condvar,
}

/// How often a partition task commits its offset to the memory broker while records flow
/// ([`PartitionInput::commit_interval`]).
pub const MEMORY_COMMIT_INTERVAL: Duration = Duration::from_millis(50);

/// Records below the retaining group's committed offset are dropped once they are at least
/// this many, and at least as many as the records left (so the move of the rest is paid
/// once per record at most).
const RETAIN_DROP_MIN: usize = 8 * 1024;

/// How the sink answers publishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SinkMode {
    Available,
    /// Unavailable until the instant, or until further notice (`None`).
    Unavailable(Option<Instant>),
    /// Stores the record, never resolves the publish.
    LoseAcks,
}

/// A record sent to the dead-letter topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// The record as read from the input.
    pub record: InputRecord,
    /// `codec::DecodeError::reason` of the failure.
    pub reason: String,
}

#[derive(Debug)]
struct Shared {
    topic: String,
    partitions: Vec<PartitionLog>,
    /// A trace is being loaded ([`MemoryBroker::load_trace_in_background`]): a poll that
    /// reaches a log's end does not report it caught up (more records are coming).
    loading: AtomicBool,
    /// The group whose commits drop the records below them, set by
    /// [`MemoryBroker::bound_load`] and cleared by [`MemoryBroker::unbound_load`].
    retaining: Mutex<Option<String>>,
    /// Records a bounded load may hold beyond each partition's furthest reader (0:
    /// unbounded).
    bound_window: AtomicUsize,
    state: Mutex<State>,
    /// The tenant overrides ([`MemoryBroker::overrides`]).
    overrides: MemoryOverrides,
}

#[derive(Debug)]
struct State {
    committed: HashMap<String, HashMap<i32, i64>>,
    sources: HashMap<String, mpsc::UnboundedSender<SourceEvent<MemoryInput>>>,
    output: Vec<ReadyMessage>,
    tier_events: Vec<ReadyMessage>,
    dead_letters: Vec<DeadLetter>,
    sink: SinkMode,
    tee: Option<Tee>,
    /// Acknowledged ready records not kept in `output` ([`MemoryBroker::tee_output_only`]).
    output_dropped: usize,
    /// `output` keeps every acknowledged ready record (off: only counted).
    keep_output: bool,
    /// Changelog partitions (`None`: the sink has no changelog).
    changelog: Option<HashMap<i32, Vec<Change>>>,
}

/// The output file of [`MemoryBroker::tee_output`] with the lines of publishes in flight not
/// yet written: publish `n` (counting from 1) resolves once `written >= n`, in the same
/// `epoch` (a failed write drops the buffer and starts a new epoch: the publishes whose lines
/// it held fail, and are retried by the publisher).
#[derive(Debug)]
struct Tee {
    file: std::fs::File,
    buffer: Vec<u8>,
    appended: u64,
    written: u64,
    epoch: u64,
}

impl Tee {
    /// Writes the buffered lines in one call. Errors: the write failed (the lines are
    /// dropped, a new epoch starts).
    fn write_out(&mut self) -> std::io::Result<()> {
        let result = self.file.write_all(&self.buffer);
        self.buffer.clear();
        self.written = self.appended;
        if result.is_err() {
            self.epoch += 1;
        }
        result
    }
}

/// Locks a mutex of the broker. Poisoning is ignored: every critical section leaves the
/// state consistent (plain pushes and inserts), so a panic elsewhere cannot corrupt it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Stable partitioner for keyed records: FNV-1a 32-bit of the key bytes, modulo `n`.
/// (Not Kafka's murmur2; the memory transport only needs it to be stable.)
pub fn partition_for_key(key: &[u8], n: i32) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in key {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    (h % n.max(1) as u32) as i32
}

/// What [`MemoryBroker::load_trace`] read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceLoad {
    /// Lines appended to the input.
    pub records: u64,
    /// Lines skipped: not a JSON object or no usable `"ts"` (blank and `#` lines are not counted).
    pub skipped: u64,
}

/// The record a trace line makes ([`MemoryBroker::load_trace`]): `(partition, has_key, ts)`
/// with the key `tenant/session` written to `key` when `has_key`; `None` when the line is
/// not a JSON object or has no usable `"ts"` (epoch ms, or RFC 3339 and other forms of
/// [`codec::parse_timestamp`]).
fn trace_record(text: &[u8], key: &mut Vec<u8>) -> Option<(Option<i32>, bool, i64)> {
    match plain_trace_record(text, key) {
        Plain::Record(r) => Some(r),
        Plain::Skip => None,
        Plain::Unsure => json_trace_record(text, key),
    }
}

/// What [`plain_trace_record`] made of a line.
#[derive(Debug, PartialEq)]
enum Plain {
    /// The record ([`trace_record`]'s answer).
    Record((Option<i32>, bool, i64)),
    /// Not a trace record ([`trace_record`] says `None`).
    Skip,
    /// The line is not of the plain shape: ask serde ([`json_trace_record`]).
    Unsure,
}

/// [`trace_record`] for the plain lines a trace is made of, without serde
/// ([`codec::plain_object`]): `ts` (and `partition`, when there) an integer and
/// `tenant`/`session` strings or absent, each at most once. Anything else (nested values,
/// escapes, fractions, RFC 3339 `ts`, duplicates of those four fields) is
/// [`Plain::Unsure`], and the answer is [`json_trace_record`]'s. Tests check both agree.
fn plain_trace_record(text: &[u8], key: &mut Vec<u8>) -> Plain {
    let Ok(text) = std::str::from_utf8(text) else {
        return Plain::Unsure;
    };
    let (mut tenant, mut session, mut ts, mut partition) = (None, None, None, None);
    let plain = codec::plain_object(text, |name, value| {
        let field = match name {
            "tenant" => &mut tenant,
            "session" => &mut session,
            "ts" => &mut ts,
            "partition" => &mut partition,
            _ => return true,
        };
        // A duplicate of a field serde reads: serde's answer.
        field.replace(value).is_none()
    });
    if !plain {
        return Plain::Unsure;
    }
    // `ts`: an integer that fits, else serde's reading of it decides.
    let ts = match ts {
        None => return Plain::Skip,
        Some(v @ codec::PlainValue::Int(_)) => match v.as_i64() {
            Some(ms) => ms,
            None => return Plain::Unsure,
        },
        Some(_) => return Plain::Unsure,
    };
    let partition = match partition {
        Some(v @ codec::PlainValue::Int(_)) => match v.as_i64() {
            Some(p) => Some(p as i32),
            None => return Plain::Unsure,
        },
        // Absent, null, a string or a bool: no partition (as serde's reading says).
        _ => None,
    };
    let has_key = match (tenant, session) {
        (Some(codec::PlainValue::Str(t)), Some(codec::PlainValue::Str(s))) => {
            key.clear();
            key.extend_from_slice(t.as_bytes());
            key.push(b'/');
            key.extend_from_slice(s.as_bytes());
            true
        }
        _ => false,
    };
    Plain::Record((partition, has_key, ts))
}

/// [`trace_record`] by serde (any JSON).
fn json_trace_record(text: &[u8], key: &mut Vec<u8>) -> Option<(Option<i32>, bool, i64)> {
    /// The fields of a trace line the broker reads; the rest is the record's payload.
    #[derive(serde::Deserialize)]
    struct Line<'a> {
        #[serde(borrow, default)]
        tenant: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow, default)]
        session: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow, default)]
        ts: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow, default)]
        partition: Option<&'a serde_json::value::RawValue>,
    }
    /// A JSON string's text (`None` for any other JSON value).
    fn json_str(raw: Option<&serde_json::value::RawValue>) -> Option<std::borrow::Cow<'_, str>> {
        serde_json::from_str(raw?.get()).ok()
    }
    let line = serde_json::from_slice::<Line<'_>>(text).ok()?;
    // Epoch ms (the usual case) without building a JSON value.
    let ts = line.ts.and_then(|raw| match raw.get().parse::<i64>() {
        Ok(ms) => Some(ms),
        Err(_) => serde_json::from_str::<serde_json::Value>(raw.get())
            .ok()
            .and_then(|v| codec::parse_timestamp(&v).ok()),
    })?;
    let partition = line
        .partition
        .and_then(|raw| raw.get().parse::<i64>().ok())
        .map(|p| p as i32);
    let has_key = match (json_str(line.tenant), json_str(line.session)) {
        (Some(t), Some(s)) => {
            key.clear();
            key.extend_from_slice(t.as_bytes());
            key.push(b'/');
            key.extend_from_slice(s.as_bytes());
            true
        }
        _ => false,
    };
    Some((partition, has_key, ts))
}

/// Cuts `file` back to just after its last newline (to empty without one) when it does not
/// end with a newline; reads only its tail (64 KiB at a time, from the end).
fn cut_partial_line(file: &std::fs::File) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let len = file.metadata()?.len();
    let mut end = len;
    let mut block = vec![0u8; 64 * 1024];
    while end > 0 {
        let start = end.saturating_sub(block.len() as u64);
        let chunk = &mut block[..(end - start) as usize];
        file.read_exact_at(chunk, start)?;
        if let Some(i) = chunk.iter().rposition(|&b| b == b'\n') {
            let keep = start + i as u64 + 1;
            if keep != len {
                file.set_len(keep)?;
            }
            return Ok(());
        }
        end = start;
    }
    if len > 0 {
        file.set_len(0)?;
    }
    Ok(())
}

/// The in-memory broker. Cheap to clone; clones share the broker.
#[derive(Clone, Debug)]
pub struct MemoryBroker {
    shared: Arc<Shared>,
}

impl MemoryBroker {
    /// A broker whose input topic `topic` has `partitions` partitions (at least 1).
    pub fn new(topic: &str, partitions: i32) -> Self {
        let n = partitions.max(1) as usize;
        MemoryBroker {
            shared: Arc::new(Shared {
                topic: topic.to_owned(),
                partitions: (0..n).map(|_| PartitionLog::default()).collect(),
                loading: AtomicBool::new(false),
                retaining: Mutex::new(None),
                bound_window: AtomicUsize::new(0),
                state: Mutex::new(State {
                    committed: HashMap::new(),
                    sources: HashMap::new(),
                    output: Vec::new(),
                    tier_events: Vec::new(),
                    dead_letters: Vec::new(),
                    sink: SinkMode::Available,
                    tee: None,
                    output_dropped: 0,
                    keep_output: true,
                    changelog: None,
                }),
                overrides: MemoryOverrides::default(),
            }),
        }
    }

    /// The input topic name.
    pub fn topic(&self) -> &str {
        &self.shared.topic
    }

    /// Number of input partitions.
    pub fn partitions(&self) -> i32 {
        self.shared.partitions.len() as i32
    }

    /// Appends a record; returns `(partition, offset)`. `partition`: explicit partition
    /// (taken modulo the partition count); `None` routes by [`partition_for_key`] of `key`,
    /// or to partition 0 without a key. `timestamp_ms`: the record timestamp (ms).
    pub fn produce(
        &self,
        partition: Option<i32>,
        key: Option<&[u8]>,
        payload: Vec<u8>,
        timestamp_ms: i64,
    ) -> (i32, i64) {
        let p = self.route(partition, key);
        let record = StoredRecord {
            key: key.map(Bytes::copy_from_slice),
            payload: payload.into(),
            timestamp_ms,
        };
        let offset = self.append(p, &mut vec![record]);
        (p, offset)
    }

    /// Partition of a record: `partition` modulo the count, else by `key`, else 0.
    fn route(&self, partition: Option<i32>, key: Option<&[u8]>) -> i32 {
        let n = self.partitions();
        match (partition, key) {
            (Some(p), _) => p.rem_euclid(n),
            (None, Some(k)) => partition_for_key(k, n),
            (None, None) => 0,
        }
    }

    /// Appends `records` (emptied) to partition `p` under one lock and wakes its pollers;
    /// returns the offset of the last one.
    fn append(&self, p: i32, records: &mut Vec<StoredRecord>) -> i64 {
        let log = &self.shared.partitions[p as usize];
        let offset = {
            let mut log = lock(&log.records);
            log.records.append(records);
            log.end() - 1
        };
        log.appended.notify_waiters();
        offset
    }

    /// Appends an upload keyed `tenant/session` with payload `json` at `timestamp_ms`, routed by key.
    pub fn produce_upload(&self, key: &str, json: &str, timestamp_ms: i64) -> (i32, i64) {
        self.produce(
            None,
            Some(key.as_bytes()),
            json.as_bytes().to_vec(),
            timestamp_ms,
        )
    }

    /// Loads a JSONL trace (the `settle simulate` format): each line an upload record plus
    /// `"ts"` (epoch ms integer or RFC 3339 string: the record timestamp) and an optional
    /// `"partition"`. The line itself is the payload (the decoder ignores `ts` and
    /// `partition`); the record key is `tenant/session` when both are strings. Lines whose
    /// upload is invalid are appended anyway (the runtime dead-letters them); lines that are
    /// not a JSON object (non-UTF-8 ones included) or have no usable `ts` are skipped and
    /// counted. Blank and `#` lines are ignored. The file is read in blocks of 1 MiB and
    /// each payload shares its block (no copy or allocation per line); records are appended
    /// to each partition [`LOAD_CHUNK`] at a time, so a consumer polling meanwhile takes
    /// whole chunks.
    ///
    /// Errors: reading `input` failed (what was loaded before stays appended).
    pub fn load_trace<R: Read>(&self, mut input: R) -> std::io::Result<TraceLoad> {
        let mut load = TraceLoad::default();
        let mut pending: Vec<Vec<StoredRecord>> =
            (0..self.partitions()).map(|_| Vec::new()).collect();
        let mut carry = BytesMut::new();
        let mut block = vec![0u8; LOAD_READ];
        let mut key = Vec::new();
        // Record keys are cut from this buffer (one allocation for many keys).
        let mut keys = BytesMut::new();
        let result = loop {
            let n = match input.read(&mut block) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => break Err(e),
            };
            carry.extend_from_slice(&block[..n]);
            // Whole lines only, but at the end whatever is left is the last line.
            let cut = if n == 0 {
                carry.len()
            } else {
                match carry.iter().rposition(|&b| b == b'\n') {
                    Some(i) => i + 1,
                    None => continue,
                }
            };
            let lines = carry.split_to(cut).freeze();
            for line in lines.split(|&b| b == b'\n') {
                let text = line.trim_ascii();
                if text.is_empty() || text.starts_with(b"#") {
                    continue;
                }
                match trace_record(text, &mut key) {
                    Some((partition, has_key, ts)) => {
                        let p = self.route(partition, has_key.then_some(key.as_slice()));
                        let chunk = &mut pending[p as usize];
                        chunk.push(StoredRecord {
                            key: has_key.then(|| {
                                if keys.capacity() < key.len() {
                                    keys.reserve(LOAD_READ / 16);
                                }
                                keys.extend_from_slice(&key);
                                keys.split().freeze()
                            }),
                            payload: lines.slice_ref(text),
                            timestamp_ms: ts,
                        });
                        if chunk.len() >= LOAD_CHUNK {
                            self.wait_for_room(p);
                            self.append(p, chunk);
                        }
                        load.records += 1;
                    }
                    None => load.skipped += 1,
                }
            }
            if n == 0 {
                break Ok(load);
            }
        };
        for (p, chunk) in pending.iter_mut().enumerate() {
            if !chunk.is_empty() {
                self.wait_for_room(p as i32);
                self.append(p as i32, chunk);
            }
        }
        result
    }

    /// Bounds what a trace load holds in memory, as a broker keeps its log on disk: from now
    /// on [`MemoryBroker::load_trace`] appends to a partition only while its log holds at
    /// most `window` records (≥ [`LOAD_CHUNK`]) beyond the furthest offset a reader of it
    /// has taken, and records below `group`'s committed offset are dropped as that group
    /// commits (as [`MemoryBroker::trim_committed`] does, in steps of at least
    /// [`RETAIN_DROP_MIN`] records). A reader positioned below the kept records (another
    /// group, or a seek back below the commit) reads on from the first kept one, with a
    /// warning. Used by `settle run-file`, whose only group is its runtime's.
    ///
    /// A load waiting for room waits while no reader takes records: call
    /// [`MemoryBroker::unbound_load`] when the readers stop (the rest of the file is then
    /// loaded unbounded).
    pub fn bound_load(&self, window: usize, group: &str) {
        let window = window.max(LOAD_CHUNK);
        *lock(&self.shared.retaining) = Some(group.to_owned());
        self.shared.bound_window.store(window, Ordering::Release);
    }

    /// Ends [`MemoryBroker::bound_load`]: a load waiting for room goes on at once, and
    /// commits drop no more records.
    pub fn unbound_load(&self) {
        *lock(&self.shared.retaining) = None;
        self.shared.bound_window.store(0, Ordering::Release);
        for log in &self.shared.partitions {
            // Under the lock, so that a loader between its check and its wait is not missed.
            let _held = lock(&log.records);
            log.taken.notify_all();
        }
    }

    /// Waits until partition `p`'s log has room for a chunk within the bound of
    /// [`MemoryBroker::bound_load`] (returns at once without one).
    fn wait_for_room(&self, p: i32) {
        let log = &self.shared.partitions[p as usize];
        let mut held = lock(&log.records);
        loop {
            let window = self.shared.bound_window.load(Ordering::Acquire);
            if window == 0 {
                return;
            }
            let read = log.read.load(Ordering::Acquire).max(held.start);
            if held.end() - read < window as i64 {
                return;
            }
            // A timeout as a backstop only: takes and `unbound_load` notify.
            held = log
                .taken
                .wait_timeout(held, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Drops partition `p`'s records below `below` when `group` is the retaining group of
    /// [`MemoryBroker::bound_load`] and enough of them are held ([`RETAIN_DROP_MIN`]).
    fn retain_after_commit(&self, group: &str, p: i32, below: i64) {
        if self.shared.bound_window.load(Ordering::Acquire) == 0 {
            return;
        }
        let retaining = lock(&self.shared.retaining).as_deref() == Some(group);
        if !retaining {
            return;
        }
        let Some(log) = self.shared.partitions.get(p as usize) else {
            return;
        };
        let mut log = lock(&log.records);
        let n = log.held_below(below);
        if n >= RETAIN_DROP_MIN && n >= log.records.len() - n {
            log.drop_first(n);
        }
    }

    /// [`MemoryBroker::load_trace`] from a file. Errors: the file cannot be opened or read.
    pub fn load_trace_file(&self, path: &Path) -> std::io::Result<TraceLoad> {
        let file = std::fs::File::open(path)?;
        self.load_trace(file)
    }

    /// [`MemoryBroker::load_trace`] of `input` (an open file) on a thread of its own, while consumers
    /// read what is loaded so far: until it ends, a poll that reaches a log's end does not
    /// report the partition caught up (the trace is a backlog, so partition time stays event
    /// time, SEMANTICS §3). When it ends (done or failed), every partition's pollers are
    /// woken. The thread's result is the load's.
    ///
    /// Errors: the thread cannot be started (nothing is loaded then).
    pub fn load_trace_in_background<R: Read + Send + 'static>(
        &self,
        input: R,
    ) -> std::io::Result<std::thread::JoinHandle<std::io::Result<TraceLoad>>> {
        self.shared.loading.store(true, Ordering::Release);
        let broker = self.clone();
        let spawned = std::thread::Builder::new()
            .name("settle-load".into())
            .spawn(move || {
                /// Clears the flag however the load ends (a panic included).
                struct Loaded(MemoryBroker);
                impl Drop for Loaded {
                    fn drop(&mut self) {
                        self.0.shared.loading.store(false, Ordering::Release);
                        for log in &self.0.shared.partitions {
                            log.appended.notify_waiters();
                        }
                    }
                }
                let loaded = Loaded(broker);
                loaded.0.load_trace(input)
            });
        if spawned.is_err() {
            self.shared.loading.store(false, Ordering::Release);
        }
        spawned
    }

    /// True while [`MemoryBroker::load_trace_in_background`] is loading.
    pub fn loading(&self) -> bool {
        self.shared.loading.load(Ordering::Acquire)
    }

    /// Offset the next appended record of `partition` will get (the log end).
    pub fn end_offset(&self, partition: i32) -> i64 {
        self.shared
            .partitions
            .get(partition as usize)
            .map_or(0, |log| lock(&log.records).end())
    }

    /// Retention: drops every record of every partition below `group`'s committed offset
    /// there (as a broker deletes consumed segments), so a long run holds only what the
    /// group has not committed yet; offsets do not change. Returns the records dropped. A
    /// reader positioned below a partition's new start (another group, or a seek back) reads
    /// on from the start, with a warning.
    pub fn trim_committed(&self, group: &str) -> u64 {
        let committed: Vec<(i32, i64)> = lock(&self.shared.state)
            .committed
            .get(group)
            .map(|m| m.iter().map(|(&p, &o)| (p, o)).collect())
            .unwrap_or_default();
        let mut dropped = 0;
        for (p, below) in committed {
            let Some(log) = self.shared.partitions.get(p as usize) else {
                continue;
            };
            let mut log = lock(&log.records);
            let n = log.held_below(below);
            if n == 0 {
                continue;
            }
            log.drop_first(n);
            dropped += n as u64;
        }
        dropped
    }

    /// Offset committed by `group` for `partition` (next offset to consume), if any.
    pub fn committed(&self, group: &str, partition: i32) -> Option<i64> {
        lock(&self.shared.state)
            .committed
            .get(group)
            .and_then(|g| g.get(&partition))
            .copied()
    }

    /// A source for consumer group `group`: it assigns every partition at once. A second
    /// source of the same group replaces the first for [`MemoryBroker::revoke`] and
    /// [`MemoryBroker::assign`].
    pub fn source(&self, group: &str) -> MemorySource {
        let all: Vec<i32> = (0..self.partitions()).collect();
        self.source_with(group, &all)
    }

    /// A source for `group` (a member name in handoff tests) that assigns `partitions` at
    /// once (possibly none); move partitions later with [`MemoryBroker::revoke`] and
    /// [`MemoryBroker::assign`]. Replaces an earlier source of the same name.
    pub fn source_with(&self, group: &str, partitions: &[i32]) -> MemorySource {
        let (tx, rx) = mpsc::unbounded_channel();
        if !partitions.is_empty() {
            // The receiver is alive, so this send cannot fail.
            let _ = tx.send(SourceEvent::Assigned(self.inputs(group, partitions)));
        }
        lock(&self.shared.state)
            .sources
            .insert(group.to_owned(), tx);
        MemorySource { events: rx }
    }

    fn inputs(&self, group: &str, partitions: &[i32]) -> Vec<MemoryInput> {
        partitions
            .iter()
            .filter(|p| (0..self.partitions()).contains(p))
            .map(|&p| MemoryInput {
                broker: self.clone(),
                group: group.to_owned(),
                partition: p,
                position: self.committed(group, p).unwrap_or(0),
            })
            .collect()
    }

    /// Revokes `partitions` from `group`'s source (a rebalance). The receiver resolves once
    /// the runtime stopped them; it errs if the group has no live source.
    pub fn revoke(&self, group: &str, partitions: &[i32]) -> oneshot::Receiver<()> {
        let (done, rx) = oneshot::channel();
        if let Some(tx) = lock(&self.shared.state).sources.get(group) {
            let _ = tx.send(SourceEvent::Revoked {
                partitions: partitions.to_vec(),
                lost: false,
                done,
            });
        }
        rx
    }

    /// Like [`MemoryBroker::revoke`], but the assignment is *lost* (as after a Kafka session
    /// timeout): the runtime fences the partitions at once and does not drain their outbox.
    pub fn revoke_lost(&self, group: &str, partitions: &[i32]) -> oneshot::Receiver<()> {
        let (done, rx) = oneshot::channel();
        if let Some(tx) = lock(&self.shared.state).sources.get(group) {
            let _ = tx.send(SourceEvent::Revoked {
                partitions: partitions.to_vec(),
                lost: true,
                done,
            });
        }
        rx
    }

    /// Gives the sink a changelog (one log per partition, named [`MEMORY_CHANGELOG`]): the
    /// runtime then records every store write there and restores stores from it.
    pub fn enable_changelog(&self) {
        lock(&self.shared.state)
            .changelog
            .get_or_insert_with(HashMap::new);
    }

    /// The changelog records of `partition` (offset = index), empty without a changelog.
    pub fn changelog_records(&self, partition: i32) -> Vec<Change> {
        lock(&self.shared.state)
            .changelog
            .as_ref()
            .and_then(|c| c.get(&partition).cloned())
            .unwrap_or_default()
    }

    /// Assigns `partitions` to `group`'s source (after a revoke). Each input starts at the
    /// group's committed offset; the runtime then seeks to its stored offset.
    pub fn assign(&self, group: &str, partitions: &[i32]) {
        let inputs = self.inputs(group, partitions);
        if let Some(tx) = lock(&self.shared.state).sources.get(group) {
            let _ = tx.send(SourceEvent::Assigned(inputs));
        }
    }

    /// A sink publishing into this broker's output log.
    pub fn sink(&self) -> MemorySink {
        MemorySink {
            broker: self.clone(),
        }
    }

    /// Every acknowledged ready record, in acknowledgement order (all topics).
    pub fn output(&self) -> Vec<ReadyMessage> {
        lock(&self.shared.state).output.clone()
    }

    /// Number of acknowledged ready records.
    pub fn output_len(&self) -> usize {
        let st = lock(&self.shared.state);
        st.output.len() + st.output_dropped
    }

    /// Every acknowledged tier change (SEMANTICS §5), in acknowledgement order: records built
    /// by `transport::tier_change_message` (topic `tiers.events-topic`, key = tenant, payload
    /// = the change's JSON).
    pub fn tier_events(&self) -> Vec<ReadyMessage> {
        lock(&self.shared.state).tier_events.clone()
    }

    /// Every dead letter, in order.
    pub fn dead_letters(&self) -> Vec<DeadLetter> {
        lock(&self.shared.state).dead_letters.clone()
    }

    /// Also appends each acknowledged ready record's payload as one line to `path` (created
    /// if missing, appended otherwise), written before the publish resolves. A file that does
    /// not end with a newline is first cut back to its last one: a process killed during a
    /// write leaves part of a line, and no publish whose line was in that write had resolved
    /// (the records are still owed, and published again by the next run).
    ///
    /// Errors: the file cannot be opened, read or cut.
    pub fn tee_output(&self, path: &Path) -> std::io::Result<()> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)?;
        cut_partial_line(&file)?;
        lock(&self.shared.state).tee = Some(Tee {
            file,
            buffer: Vec::new(),
            appended: 0,
            written: 0,
            epoch: 0,
        });
        Ok(())
    }

    /// [`MemoryBroker::tee_output`], and the records are no longer kept in memory
    /// ([`MemoryBroker::output`] stays empty; [`MemoryBroker::output_len`] still counts
    /// them): `settle run-file`, whose output is the file, would otherwise hold every
    /// ready record of a long trace in memory.
    ///
    /// Errors: the file cannot be opened.
    pub fn tee_output_only(&self, path: &Path) -> std::io::Result<()> {
        self.tee_output(path)?;
        lock(&self.shared.state).keep_output = false;
        Ok(())
    }

    /// Makes the sink available (`true`) or unavailable until further notice (`false`):
    /// publishes and dead letters then fail with [`Error::Unavailable`].
    pub fn set_sink_available(&self, available: bool) {
        lock(&self.shared.state).sink = if available {
            SinkMode::Available
        } else {
            SinkMode::Unavailable(None)
        };
    }

    /// Makes the sink unavailable for `outage` (tokio time), then available again.
    pub fn fail_publishes_for(&self, outage: Duration) {
        lock(&self.shared.state).sink = SinkMode::Unavailable(Some(Instant::now() + outage));
    }

    /// From now on the sink stores each ready record but never acknowledges it (the publish
    /// future stays pending): a crash between "broker has it" and "outbox deleted it".
    /// [`MemoryBroker::set_sink_available`] ends it.
    pub fn lose_acks(&self) {
        lock(&self.shared.state).sink = SinkMode::LoseAcks;
    }

    /// Checks the sink mode; `Ok(true)` means store and acknowledge, `Ok(false)` store only.
    fn sink_mode(&self) -> Result<bool, Error> {
        let mut st = lock(&self.shared.state);
        match st.sink {
            SinkMode::Available => Ok(true),
            SinkMode::LoseAcks => Ok(false),
            SinkMode::Unavailable(Some(until)) if Instant::now() >= until => {
                st.sink = SinkMode::Available;
                Ok(true)
            }
            SinkMode::Unavailable(_) => Err(Error::Unavailable {
                transport: TRANSPORT,
                reason: "sink unavailable (injected)".into(),
            }),
        }
    }
}

/// [`Source`] of the memory broker for one consumer group.
#[derive(Debug)]
pub struct MemorySource {
    events: mpsc::UnboundedReceiver<SourceEvent<MemoryInput>>,
}

impl Source for MemorySource {
    type Input = MemoryInput;

    async fn next_event(&mut self) -> Result<Option<SourceEvent<MemoryInput>>, Error> {
        // `recv` is cancel-safe. The broker holds the sender, so this pends (rather than
        // ending) while no assignment change comes.
        Ok(self.events.recv().await)
    }
}

/// [`PartitionInput`] of one memory partition for one consumer group.
#[derive(Debug)]
pub struct MemoryInput {
    broker: MemoryBroker,
    group: String,
    partition: i32,
    position: i64,
}

impl MemoryInput {
    fn log(&self) -> &PartitionLog {
        // Invariant: inputs are created only for partitions in range (`MemoryBroker::inputs`).
        &self.broker.shared.partitions[self.partition as usize]
    }

    /// Takes up to `max` records at the current position; `None` when none is there.
    fn take(&mut self, max: usize) -> Option<InputBatch> {
        let shared = Arc::clone(&self.broker.shared);
        let log = lock(&shared.partitions[self.partition as usize].records);
        if self.position < log.start {
            // Dropped by `trim_committed` before this reader got to them.
            tracing::warn!(
                partition = self.partition,
                from = self.position,
                to = log.start,
                "memory log: records below the log start were trimmed; reading on from the start"
            );
            self.position = log.start;
        }
        let part = &shared.partitions[self.partition as usize];
        // Where this reader is, before any record is there (a reader that sought past what
        // a bounded load has appended makes room for it).
        part.read.fetch_max(self.position, Ordering::AcqRel);
        let records = &log.records;
        let start = (self.position - log.start) as usize;
        if start >= records.len() {
            drop(log);
            if self.broker.shared.bound_window.load(Ordering::Acquire) != 0 {
                part.taken.notify_one();
            }
            return None;
        }
        let end = records.len().min(start + max.max(1));
        let batch = InputBatch {
            records: records[start..end]
                .iter()
                .enumerate()
                .map(|(i, r)| InputRecord {
                    partition: self.partition,
                    offset: log.start + (start + i) as i64,
                    key: r.key.clone(),
                    payload: r.payload.clone(),
                    timestamp_ms: r.timestamp_ms,
                })
                .collect(),
            caught_up: end == records.len() && !self.broker.loading(),
            skipped: 0,
        };
        self.position = log.start + end as i64;
        part.read.fetch_max(self.position, Ordering::AcqRel);
        drop(log);
        if self.broker.shared.bound_window.load(Ordering::Acquire) != 0 {
            part.taken.notify_one();
        }
        Some(batch)
    }
}

impl PartitionInput for MemoryInput {
    fn topic(&self) -> &str {
        self.broker.topic()
    }

    fn partition(&self) -> i32 {
        self.partition
    }

    async fn seek(&mut self, next_offset: i64) -> Result<(), Error> {
        self.position = next_offset.max(0);
        Ok(())
    }

    async fn poll(&mut self, max: usize, wait: Duration) -> Result<InputBatch, Error> {
        let shared = Arc::clone(&self.broker.shared);
        let appended = shared.partitions[self.partition as usize]
            .appended
            .notified();
        tokio::pin!(appended);
        // Register for the wake-up before looking, so an append in between is not missed.
        appended.as_mut().enable();
        if let Some(batch) = self.take(max) {
            return Ok(batch);
        }
        if !wait.is_zero() {
            let _ = tokio::time::timeout(wait, appended).await;
        }
        // Read before looking: a load that ended by then has appended everything.
        let loading = self.broker.loading();
        Ok(self.take(max).unwrap_or(InputBatch {
            records: Vec::new(),
            caught_up: !loading,
            skipped: 0,
        }))
    }

    fn lag(&self) -> Option<u64> {
        let end = lock(&self.log().records).end();
        Some(end.saturating_sub(self.position).max(0) as u64)
    }

    /// 50 ms: a commit here is a map insert, and with [`MemoryBroker::bound_load`] it frees
    /// the records it covers (at 500 ms a fast reader would hold ~300 000 of them).
    fn commit_interval(&self) -> Option<Duration> {
        Some(MEMORY_COMMIT_INTERVAL)
    }

    async fn commit(&mut self, next_offset: i64) -> Result<(), Error> {
        lock(&self.broker.shared.state)
            .committed
            .entry(self.group.clone())
            .or_default()
            .insert(self.partition, next_offset);
        self.broker
            .retain_after_commit(&self.group, self.partition, next_offset);
        Ok(())
    }
}

/// Topic of the memory broker's audit records ([`super::ActionChannel`]).
pub const MEMORY_AUDIT_TOPIC: &str = "memory.audit";

/// [`super::ActionChannel`] of the memory broker: action records are appended to the
/// broker's input log at the partition asked (producers' partitioner unknown, as on Kafka:
/// [`super::ActionChannel::key_partition`] is `None`); audit records go to the output as
/// records of topic [`MEMORY_AUDIT_TOPIC`].
#[derive(Clone, Debug)]
pub struct MemoryActions {
    broker: MemoryBroker,
}

impl MemoryBroker {
    /// The broker's [`super::ActionChannel`].
    pub fn actions(&self) -> MemoryActions {
        MemoryActions {
            broker: self.clone(),
        }
    }

    /// The audit records published so far (payloads of topic [`MEMORY_AUDIT_TOPIC`]).
    pub fn audit(&self) -> Vec<Vec<u8>> {
        self.output()
            .into_iter()
            .filter(|m| m.topic == MEMORY_AUDIT_TOPIC)
            .map(|m| m.payload)
            .collect()
    }
}

impl super::ActionChannel for MemoryActions {
    fn partitions(&self) -> BoxFuture<'_, Result<i32, Error>> {
        let n = self.broker.partitions();
        Box::pin(async move { Ok(n) })
    }

    fn key_partition(&self, _key: &str) -> Option<i32> {
        None
    }

    fn send(
        &self,
        partition: i32,
        key: &str,
        payload: Vec<u8>,
        timestamp_ms: i64,
    ) -> BoxFuture<'_, Result<(), Error>> {
        self.broker
            .produce(Some(partition), Some(key.as_bytes()), payload, timestamp_ms);
        Box::pin(async { Ok(()) })
    }

    fn publish_audit(&self, key: &str, payload: Vec<u8>) -> BoxFuture<'_, Result<(), Error>> {
        let message = ReadyMessage {
            topic: MEMORY_AUDIT_TOPIC.to_owned(),
            tier: "audit".to_owned(),
            key: key.to_owned(),
            emission_id: key.to_owned(),
            payload,
            partition: None,
        };
        let sink = self.broker.sink();
        Box::pin(async move { sink.publish(message).await })
    }

    fn tail_audit(
        &self,
        _since_ms: i64,
        _each: crate::transport::AuditCallback,
    ) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async { Ok(()) })
    }
}

/// [`super::OverrideStore`] of the memory broker: a map of tenant → latest value with a
/// revision counter, compared on every write, and the list of every write for the feeds.
/// Every handle of one broker shares it, so overrides outlive a runtime's restart within one
/// process (as a broker's KV bucket or compacted topic outlives a process).
#[derive(Clone, Debug, Default)]
pub struct MemoryOverrides {
    inner: Arc<OverridesInner>,
}

#[derive(Debug, Default)]
struct OverridesInner {
    state: Mutex<OverridesState>,
    written: Notify,
}

#[derive(Debug, Default)]
struct OverridesState {
    /// Every write in order (the feeds read it by position).
    log: Vec<super::OverrideEntry>,
    /// Tenant → position of its latest write in `log`.
    latest: HashMap<String, usize>,
}

impl MemoryBroker {
    /// The broker's tenant overrides ([`super::OverrideStore`]).
    pub fn overrides(&self) -> MemoryOverrides {
        self.shared.overrides.clone()
    }
}

impl MemoryOverrides {
    fn lock(&self) -> MutexGuard<'_, OverridesState> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl super::OverrideStore for MemoryOverrides {
    fn name(&self) -> &str {
        "memory.overrides"
    }

    fn compares_revisions(&self) -> bool {
        true
    }

    fn put(
        &self,
        tenant: &str,
        value: Vec<u8>,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, super::OverrideWriteError>> {
        let written = {
            let mut st = self.lock();
            let current = st.latest.get(tenant).map_or(0, |&i| st.log[i].revision);
            if current != expected {
                Err(super::OverrideWriteError::Conflict { expected })
            } else {
                let revision = st.log.len() as u64 + 1;
                st.log.push(super::OverrideEntry {
                    key: tenant.to_owned(),
                    value,
                    revision,
                });
                let at = st.log.len() - 1;
                st.latest.insert(tenant.to_owned(), at);
                Ok(revision)
            }
        };
        if written.is_ok() {
            self.inner.written.notify_waiters();
        }
        Box::pin(async move { written })
    }

    fn subscribe(&self) -> BoxFuture<'_, Result<Box<dyn super::OverrideFeed>, Error>> {
        let (mut first, next) = {
            let st = self.lock();
            let mut at: Vec<usize> = st.latest.values().copied().collect();
            at.sort_unstable();
            let first: std::collections::VecDeque<super::OverrideEvent> = at
                .into_iter()
                .map(|i| super::OverrideEvent::Entry(st.log[i].clone()))
                .collect();
            (first, st.log.len())
        };
        first.push_back(super::OverrideEvent::CaughtUp);
        let feed = MemoryOverrideFeed {
            store: self.clone(),
            first,
            next,
        };
        Box::pin(async move { Ok(Box::new(feed) as Box<dyn super::OverrideFeed>) })
    }
}

/// A feed of [`MemoryOverrides`]: the latest values, then every write after them.
struct MemoryOverrideFeed {
    store: MemoryOverrides,
    first: std::collections::VecDeque<super::OverrideEvent>,
    /// Position in the store's log of the next write to yield.
    next: usize,
}

impl super::OverrideFeed for MemoryOverrideFeed {
    fn next(&mut self) -> BoxFuture<'_, Result<super::OverrideEvent, Error>> {
        Box::pin(async move {
            if let Some(e) = self.first.pop_front() {
                return Ok(e);
            }
            loop {
                let written = self.store.inner.written.notified();
                tokio::pin!(written);
                written.as_mut().enable();
                if let Some(entry) = self.store.lock().log.get(self.next).cloned() {
                    self.next += 1;
                    return Ok(super::OverrideEvent::Entry(entry));
                }
                written.await;
            }
        })
    }
}

/// [`Sink`] of the memory broker.
#[derive(Clone, Debug)]
pub struct MemorySink {
    broker: MemoryBroker,
}

/// Name of the memory sink's changelog ([`MemoryBroker::enable_changelog`]).
pub const MEMORY_CHANGELOG: &str = "memory.changelog";

/// Reads a snapshot of one memory changelog partition.
struct MemoryChangelogReader {
    records: Vec<Change>,
    next: usize,
    start: i64,
}

impl ChangelogReader for MemoryChangelogReader {
    fn next_chunk(&mut self, max: usize) -> BoxFuture<'_, Result<Vec<(i64, Change)>, Error>> {
        let end = (self.next + max.max(1)).min(self.records.len());
        let chunk = (self.next..end)
            .map(|i| (self.start + i as i64, self.records[i].clone()))
            .collect();
        self.next = end;
        Box::pin(async move { Ok(chunk) })
    }

    fn end_hint(&self) -> Option<i64> {
        Some(self.start + self.records.len() as i64)
    }
}

impl Sink for MemorySink {
    fn changelog(&self) -> Option<&str> {
        lock(&self.broker.shared.state)
            .changelog
            .is_some()
            .then_some(MEMORY_CHANGELOG)
    }

    fn append_changes(
        &self,
        partition: i32,
        changes: &[Change],
    ) -> Result<BoxFuture<'static, Result<i64, Error>>, Error> {
        let mut st = lock(&self.broker.shared.state);
        let log = st
            .changelog
            .as_mut()
            .ok_or_else(|| Error::Fatal {
                transport: TRANSPORT,
                reason: "the memory sink has no changelog".into(),
            })?
            .entry(partition)
            .or_default();
        log.extend_from_slice(changes);
        let next = log.len() as i64;
        Ok(Box::pin(async move { Ok(next) }))
    }

    fn read_changelog(
        &self,
        partition: i32,
        from: i64,
    ) -> BoxFuture<'_, Result<Box<dyn ChangelogReader>, Error>> {
        let st = lock(&self.broker.shared.state);
        let result = match st.changelog.as_ref() {
            None => Err(Error::Fatal {
                transport: TRANSPORT,
                reason: "the memory sink has no changelog".into(),
            }),
            Some(c) => {
                let all = c.get(&partition).map(Vec::as_slice).unwrap_or_default();
                let start = from.clamp(0, all.len() as i64);
                Ok(Box::new(MemoryChangelogReader {
                    records: all[start as usize..].to_vec(),
                    next: 0,
                    start,
                }) as Box<dyn ChangelogReader>)
            }
        };
        Box::pin(async move { result })
    }

    async fn publish(&self, message: ReadyMessage) -> Result<(), Error> {
        let ack = self.broker.sink_mode()?;
        let ticket = lock(&self.broker.shared.state).tee.as_mut().map(|tee| {
            tee.buffer.extend_from_slice(&message.payload);
            tee.buffer.push(b'\n');
            tee.appended += 1;
            (tee.epoch, tee.appended)
        });
        if let Some((epoch, n)) = ticket {
            // Let the other publishes in flight append their lines: one write for all.
            tokio::task::yield_now().await;
            let mut st = lock(&self.broker.shared.state);
            let tee = st.tee.as_mut().expect("the tee is never removed");
            let failed = || Error::Unavailable {
                transport: TRANSPORT,
                reason:
                    "cannot write the output file (an earlier write of this record's batch failed)"
                        .into(),
            };
            if tee.epoch != epoch {
                return Err(failed());
            }
            if tee.written < n {
                tee.write_out().map_err(|e| Error::Unavailable {
                    transport: TRANSPORT,
                    reason: format!("cannot write the output file: {e}"),
                })?;
            }
        }
        {
            let mut st = lock(&self.broker.shared.state);
            if st.keep_output {
                st.output.push(message);
            } else {
                st.output_dropped += 1;
            }
        }
        if !ack {
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    /// The whole batch under one lock: its lines appended to the output file in one write
    /// (with any single publishes' lines waiting), then stored. A failed write fails every
    /// message of the batch (none of their lines counts as written; they are retried).
    async fn publish_batch(&self, messages: Vec<ReadyMessage>) -> Vec<Result<(), Error>> {
        let n = messages.len();
        let ack = match self.broker.sink_mode() {
            Ok(ack) => ack,
            Err(e) => return vec![Err(e); n],
        };
        {
            let mut st = lock(&self.broker.shared.state);
            if let Some(tee) = st.tee.as_mut() {
                for m in &messages {
                    tee.buffer.extend_from_slice(&m.payload);
                    tee.buffer.push(b'\n');
                }
                tee.appended += n as u64;
                if let Err(e) = tee.write_out() {
                    let failed = Error::Unavailable {
                        transport: TRANSPORT,
                        reason: format!("cannot write the output file: {e}"),
                    };
                    return vec![Err(failed); n];
                }
            }
            if st.keep_output {
                st.output.extend(messages);
            } else {
                st.output_dropped += n;
            }
        }
        if !ack {
            std::future::pending::<()>().await;
        }
        vec![Ok(()); n]
    }

    async fn publish_tier_change(&self, topic: &str, change: &TierChange) -> Result<(), Error> {
        let ack = self.broker.sink_mode()?;
        lock(&self.broker.shared.state)
            .tier_events
            .push(super::tier_change_message(topic, change));
        if !ack {
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    async fn dead_letter(&self, record: &InputRecord, reason: &str) -> Result<(), Error> {
        self.broker.sink_mode()?;
        lock(&self.broker.shared.state)
            .dead_letters
            .push(DeadLetter {
                record: record.clone(),
                reason: reason.to_owned(),
            });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::future::join_all;

    fn message(n: usize) -> ReadyMessage {
        ReadyMessage {
            topic: "settle.ready.normal".into(),
            tier: "normal".into(),
            key: format!("t/s{n}"),
            emission_id: format!("t/s{n}/1/1"),
            payload: format!("{{\"n\":{n}}}").into_bytes(),
            partition: Some(0),
        }
    }

    #[tokio::test]
    async fn a_partial_last_line_of_the_output_is_cut_before_appending() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        // As a process killed in the middle of a write leaves it.
        std::fs::write(&path, "{\"n\":1}\n{\"n\":2}\n{\"n\":3,\"pol").unwrap();
        let broker = MemoryBroker::new("uploads", 1);
        broker.tee_output_only(&path).unwrap();
        broker.sink().publish(message(4)).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"n\":1}\n{\"n\":2}\n{\"n\":4}\n"
        );
        // Whole lines stay; a file that is one partial line becomes empty first.
        broker.tee_output_only(&path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 3);
        std::fs::write(&path, "{\"n\":1").unwrap();
        broker.tee_output_only(&path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
    }

    #[tokio::test]
    async fn a_batch_is_written_in_order_after_single_publishes_and_fails_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let broker = MemoryBroker::new("uploads", 1);
        broker.tee_output(&path).unwrap();
        let sink = broker.sink();
        sink.publish(message(1)).await.unwrap();
        let results = sink.publish_batch((2..=4).map(message).collect()).await;
        assert_eq!(results, vec![Ok(()), Ok(()), Ok(())]);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n{\"n\":4}\n"
        );
        let keys: Vec<String> = broker.output().into_iter().map(|m| m.key).collect();
        assert_eq!(keys, ["t/s1", "t/s2", "t/s3", "t/s4"]);
        // A sink that is down fails every message of the batch; nothing is stored.
        broker.set_sink_available(false);
        let results = sink.publish_batch(vec![message(5), message(6)]).await;
        assert_eq!(results.len(), 2);
        assert!(results
            .iter()
            .all(|r| matches!(r, Err(Error::Unavailable { .. }))));
        assert_eq!(broker.output_len(), 4);
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 4);
        // An empty batch answers with no results.
        broker.set_sink_available(true);
        assert!(sink.publish_batch(Vec::new()).await.is_empty());
    }

    #[tokio::test]
    async fn trimming_drops_what_the_group_committed_and_keeps_offsets() {
        let broker = MemoryBroker::new("uploads", 1);
        for i in 0..10 {
            broker.produce(Some(0), None, format!("r{i}").into_bytes(), i);
        }
        // Nothing committed yet: nothing dropped.
        assert_eq!(broker.trim_committed("g"), 0);
        let mut input = broker.inputs("g", &[0]).pop().unwrap();
        let first = input.poll(4, Duration::ZERO).await.unwrap();
        assert_eq!(first.records.len(), 4);
        input.commit(6).await.unwrap();
        assert_eq!(broker.trim_committed("g"), 6);
        assert_eq!(broker.trim_committed("g"), 0);
        assert_eq!(broker.end_offset(0), 10);
        assert_eq!(log_of(&broker, 0).len(), 4);
        // The reader at offset 4 (below the new start) goes on from 6; offsets are kept.
        let rest = input.poll(100, Duration::ZERO).await.unwrap();
        let offsets: Vec<i64> = rest.records.iter().map(|r| r.offset).collect();
        assert_eq!(offsets, [6, 7, 8, 9]);
        assert_eq!(&rest.records[0].payload[..], b"r6");
        assert!(rest.caught_up);
        assert_eq!(input.lag(), Some(0));
        // Appends after a trim get the next offsets.
        let (_, offset) = broker.produce(Some(0), None, b"r10".to_vec(), 10);
        assert_eq!(offset, 10);
        input.seek(10).await.unwrap();
        let next = input.poll(100, Duration::ZERO).await.unwrap();
        assert_eq!(next.records[0].offset, 10);
        assert_eq!(&next.records[0].payload[..], b"r10");
    }

    /// Every record of partition `p`'s log as `(key, payload, timestamp)`.
    fn log_of(broker: &MemoryBroker, p: i32) -> Vec<(Option<String>, String, i64)> {
        let text = |b: &Bytes| String::from_utf8(b.to_vec()).unwrap();
        lock(&broker.shared.partitions[p as usize].records)
            .records
            .iter()
            .map(|r| (r.key.as_ref().map(text), text(&r.payload), r.timestamp_ms))
            .collect()
    }

    #[test]
    fn the_plain_trace_reader_agrees_with_serde_on_every_line() {
        let lines: &[&[u8]] = &[
            br#"{"tenant":"t1","session":"s1","ts":1767225600000}"#,
            br#" { "tenant" : "t1" , "session":"s1", "ts" : -5 , "partition": 3 } "#,
            br#"{"tenant":"t1","session":"s1","ts":1767225600000,"final":true,"part":null}"#,
            br#"{"tenant":"t1","ts":12}"#,
            br#"{"session":"s","ts":12,"partition":"3"}"#,
            br#"{"tenant":1,"session":"s","ts":12}"#,
            br#"{"tenant":"t","session":"s","ts":"2026-01-01T00:00:00Z"}"#,
            br#"{"tenant":"t","session":"s","ts":1.5}"#,
            br#"{"tenant":"t","session":"s","ts":012}"#,
            br#"{"tenant":"t","session":"s","ts":99999999999999999999}"#,
            br#"{"tenant":"t","session":"s","ts":1,"partition":99999999999999999999}"#,
            br#"{"tenant":"t","session":"s","ts":1,"ts":2}"#,
            br#"{"tenant":"t","session":"s","x":1,"x":2,"ts":1}"#,
            br#"{"tenant":"t\u0041","session":"s","ts":1}"#,
            "{\"tenant\":\"t\u{e9}\",\"session\":\"s\",\"ts\":1}".as_bytes(),
            br#"{"tenant":"t","session":"s","ts":1,"attributes":{"a":[1,2]}}"#,
            br#"{"tenant":"t","session":"s","ts":1}x"#,
            br#"{"tenant":"t","session":"s","ts":1,}"#,
            br#"{"tenant":"t","session":"s" "ts":1}"#,
            br#"{"tenant":"t","session":"s","ts":}"#,
            br#"{"tenant":"t","session":"s","ts":-}"#,
            br#"{"tenant":"t","session":"s","ts":1,"ok":tru}"#,
            br#"{"ts":1}"#,
            br#"{}"#,
            br#"{"#,
            br#"[1]"#,
            br#""ts""#,
            b"{\"tenant\":\"t\x01\",\"session\":\"s\",\"ts\":1}",
            b"{\"tenant\":\"t\",\"session\":\"s\",\"ts\":1}\xff",
        ];
        for line in lines {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            let plain = plain_trace_record(line, &mut a);
            let json = json_trace_record(line, &mut b);
            let text = String::from_utf8_lossy(line);
            match plain {
                Plain::Record(r) => {
                    assert_eq!(Some(r), json, "{text}");
                    if r.1 {
                        assert_eq!(a, b, "{text}");
                    }
                }
                Plain::Skip => assert_eq!(json, None, "{text}"),
                Plain::Unsure => {}
            }
            assert_eq!(trace_record(line, &mut a), json, "{text}");
        }
        // The shared benchmark's lines take the plain path.
        let mut k = Vec::new();
        assert_eq!(
            plain_trace_record(
                br#"{"tenant": "t3", "session": "hot7", "ts": 1767225600002}"#,
                &mut k
            ),
            Plain::Record((None, true, 1_767_225_600_002))
        );
        assert_eq!(k, b"t3/hot7");
    }

    proptest::proptest! {
        /// Lines made of plain pieces: the plain reader says what serde says whenever it
        /// answers at all.
        #[test]
        fn the_plain_trace_reader_agrees_with_serde(
            members in proptest::collection::vec(
                (
                    proptest::prop_oneof!["tenant", "session", "ts", "partition", "event_id", "[a-z]{1,3}"],
                    proptest::prop_oneof![
                        "\"[a-z0-9/ ]{0,6}\"",
                        "-?[0-9]{1,20}",
                        "true|false|null",
                        "[0-9]\\.[0-9]",
                        "\\{\\}",
                    ],
                ),
                0..6,
            ),
            space in " {0,2}",
        ) {
            let body: Vec<String> = members
                .iter()
                .map(|(k, v)| format!("\"{k}\"{space}:{space}{v}"))
                .collect();
            let line = format!("{{{space}{}{space}}}", body.join(","));
            let (mut a, mut b) = (Vec::new(), Vec::new());
            let json = json_trace_record(line.as_bytes(), &mut b);
            match plain_trace_record(line.as_bytes(), &mut a) {
                Plain::Record(r) => {
                    proptest::prop_assert_eq!(Some(r), json, "{}", line);
                    if r.1 {
                        proptest::prop_assert_eq!(a, b);
                    }
                }
                Plain::Skip => proptest::prop_assert_eq!(json, None, "{}", line),
                Plain::Unsure => {}
            }
        }
    }

    #[test]
    fn a_trace_loads_line_by_line_across_read_blocks_and_chunks() {
        // Enough lines to cross the 1 MiB read block several times and fill many chunks of
        // both partitions; bad lines among them, a CRLF one, and no newline at the end.
        let mut trace = Vec::new();
        let mut want: Vec<Vec<(Option<String>, String, i64)>> = vec![Vec::new(), Vec::new()];
        let mut skipped = 0;
        for i in 0..40_000i64 {
            let line = format!(
                r#"{{"tenant":"t{}","session":"s{i}","event_id":"e{i}","ts":{}}}"#,
                i % 7,
                1_000 + i
            );
            let key = format!("t{}/s{i}", i % 7);
            let p = partition_for_key(key.as_bytes(), 2);
            want[p as usize].push((Some(key), line.clone(), 1_000 + i));
            trace.extend_from_slice(line.as_bytes());
            trace.extend_from_slice(if i % 1000 == 3 { b"\r\n" } else { b"\n" });
            if i % 5000 == 7 {
                trace.extend_from_slice(
                    b"\n# a comment\nnot json\n{\"tenant\":\"t\"}\n\xff\xfe{}\n",
                );
                skipped += 3;
            }
        }
        let last = r#"{"session":"no-tenant","ts":"2026-01-01T00:00:00Z","partition":3}"#;
        want[1].push((None, last.to_owned(), 1_767_225_600_000));
        trace.extend_from_slice(last.as_bytes());
        let broker = MemoryBroker::new("uploads", 2);
        let load = broker.load_trace(&trace[..]).unwrap();
        assert_eq!(load.records, 40_001);
        assert_eq!(load.skipped, skipped, "non-JSON, no ts, not UTF-8");
        assert_eq!(log_of(&broker, 0), want[0]);
        assert_eq!(log_of(&broker, 1), want[1]);
    }

    /// A reader that hands out `first`, then blocks until `release` says go (or is dropped),
    /// then hands out `rest`.
    struct Gate {
        first: Option<Vec<u8>>,
        release: std::sync::mpsc::Receiver<()>,
        rest: Option<Vec<u8>>,
    }

    impl Read for Gate {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let next = match (self.first.take(), self.rest.take()) {
                (Some(b), rest) => {
                    self.rest = rest;
                    b
                }
                (None, Some(b)) => {
                    let _ = self.release.recv();
                    b
                }
                (None, None) => return Ok(0),
            };
            assert!(next.len() <= buf.len());
            buf[..next.len()].copy_from_slice(&next);
            Ok(next.len())
        }
    }

    #[tokio::test]
    async fn a_partition_is_not_caught_up_while_its_trace_loads() {
        let broker = MemoryBroker::new("uploads", 1);
        let (go, release) = std::sync::mpsc::channel();
        let gate = Gate {
            first: Some(b"{\"tenant\":\"t\",\"session\":\"a\",\"ts\":1}\n".to_vec()),
            release,
            rest: Some(b"{\"tenant\":\"t\",\"session\":\"b\",\"ts\":2}\n".to_vec()),
        };
        let loader = broker.load_trace_in_background(gate).unwrap();
        assert!(broker.loading());
        let mut input = broker.inputs("g", &[0]).pop().unwrap();
        // The first line is read but waits in its partition's chunk (appended at 1 024 lines
        // or at the end): the log is empty, and its end is not the trace's end.
        let mut seen = Vec::new();
        for _ in 0..2 {
            let batch = input.poll(10, Duration::from_millis(20)).await.unwrap();
            assert!(!batch.caught_up, "caught up while the trace loads");
            seen.extend(batch.records);
        }
        go.send(()).unwrap();
        let load = loader.join().unwrap().unwrap();
        assert_eq!(load.records, 2);
        assert!(!broker.loading());
        let batch = input.poll(10, Duration::from_millis(20)).await.unwrap();
        seen.extend(batch.records);
        assert!(batch.caught_up, "caught up once the trace is all there");
        let keys: Vec<&[u8]> = seen.iter().filter_map(|r| r.key.as_deref()).collect();
        assert_eq!(keys, [&b"t/a"[..], b"t/b"]);
        assert_eq!(seen.iter().map(|r| r.offset).collect::<Vec<_>>(), [0, 1]);
    }

    fn held(broker: &MemoryBroker, p: i32) -> (i64, usize) {
        let log = lock(&broker.shared.partitions[p as usize].records);
        (log.start, log.records.len())
    }

    #[tokio::test]
    async fn a_bounded_load_stays_within_its_window_and_commits_drop_what_they_cover() {
        let n = 100_000i64;
        let mut trace = Vec::new();
        for i in 0..n {
            let line = format!(r#"{{"tenant":"t","session":"s{}","ts":{i}}}"#, i % 13);
            trace.extend_from_slice(line.as_bytes());
            trace.push(b'\n');
        }
        let broker = MemoryBroker::new("uploads", 1);
        let window = 2 * LOAD_CHUNK;
        broker.bound_load(window, "g");
        let loader = broker
            .load_trace_in_background(std::io::Cursor::new(trace))
            .unwrap();
        let mut input = broker.inputs("g", &[0]).pop().unwrap();
        // Nothing reads: the loader stops within its window (plus the chunk it appends).
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(broker.loading(), "the load waits for a reader");
        assert_eq!(held(&broker, 0), (0, window), "one window, no more");
        let (mut next, mut most_held, mut dropped_once) = (0i64, 0usize, false);
        loop {
            let batch = input.poll(700, Duration::from_millis(50)).await.unwrap();
            for r in &batch.records {
                assert_eq!(r.offset, next, "every record, in order, once");
                next += 1;
            }
            input.commit(next).await.unwrap();
            let (start, len) = held(&broker, 0);
            dropped_once |= start > 0;
            assert!(start <= next, "nothing above the commit is dropped");
            most_held = most_held.max(len);
            if batch.caught_up {
                break;
            }
        }
        assert_eq!(next, n);
        assert_eq!(loader.join().unwrap().unwrap().records, n as u64);
        assert!(dropped_once, "committed records were dropped");
        // Held: the unread window, what was read since the last drop (below the drop step
        // or below as many as are left), and a poll's worth.
        let bound = window + LOAD_CHUNK + 2 * RETAIN_DROP_MIN + 2 * 700;
        assert!(
            most_held <= bound,
            "held {most_held} records at most, bound {bound}"
        );
        // Another group's commits drop nothing.
        let before = held(&broker, 0);
        let mut other = broker.inputs("h", &[0]).pop().unwrap();
        other.commit(n).await.unwrap();
        assert_eq!(held(&broker, 0), before);
    }

    #[tokio::test]
    async fn a_reader_past_the_loaded_records_and_unbounding_both_free_a_waiting_load() {
        let mut trace = Vec::new();
        for i in 0..20_000 {
            trace.extend_from_slice(
                format!("{{\"tenant\":\"t\",\"session\":\"s\",\"ts\":{i}}}\n").as_bytes(),
            );
        }
        // A restarted reader seeks to its stored offset, beyond what a bounded load holds.
        let broker = MemoryBroker::new("uploads", 1);
        broker.bound_load(LOAD_CHUNK, "g");
        let loader = broker
            .load_trace_in_background(std::io::Cursor::new(trace.clone()))
            .unwrap();
        let mut input = broker.inputs("g", &[0]).pop().unwrap();
        input.seek(15_000).await.unwrap();
        let mut first = None;
        while first.is_none() {
            let batch = input.poll(100, Duration::from_millis(50)).await.unwrap();
            first = batch.records.first().map(|r| r.offset);
        }
        assert_eq!(
            first,
            Some(15_000),
            "the load went on to the reader's position"
        );
        broker.unbound_load();
        assert_eq!(loader.join().unwrap().unwrap().records, 20_000);
        // Nobody reads: unbounding lets the rest of the file load.
        let broker = MemoryBroker::new("uploads", 1);
        broker.bound_load(LOAD_CHUNK, "g");
        let loader = broker
            .load_trace_in_background(std::io::Cursor::new(trace))
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(broker.loading());
        broker.unbound_load();
        assert_eq!(loader.join().unwrap().unwrap().records, 20_000);
        assert_eq!(held(&broker, 0), (0, 20_000));
    }

    #[tokio::test]
    async fn publishes_in_flight_together_are_all_in_the_file_when_they_resolve() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let broker = MemoryBroker::new("uploads", 1);
        broker.tee_output_only(&path).unwrap();
        let sink = broker.sink();
        let results = join_all((0..100).map(|n| sink.publish(message(n)))).await;
        assert!(results.iter().all(Result::is_ok));
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines: Vec<&str> = text.lines().collect();
        lines.sort_unstable();
        let mut want: Vec<String> = (0..100).map(|n| format!("{{\"n\":{n}}}")).collect();
        want.sort_unstable();
        assert_eq!(lines, want, "every record once, whole lines");
        assert_eq!(broker.output_len(), 100);
        // One more after the batch: written on its own.
        sink.publish(message(100)).await.unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 101);
    }

    #[tokio::test]
    async fn a_failed_write_fails_every_publish_of_its_batch() {
        // Linux: every write to /dev/full fails with ENOSPC.
        let broker = MemoryBroker::new("uploads", 1);
        broker.tee_output(Path::new("/dev/full")).unwrap();
        let sink = broker.sink();
        let results = join_all((0..5).map(|n| sink.publish(message(n)))).await;
        for r in &results {
            assert!(
                matches!(r, Err(Error::Unavailable { .. })),
                "a record not written is not acknowledged: {r:?}"
            );
        }
        assert!(broker.output().is_empty());
        assert_eq!(broker.output_len(), 0);
    }
}
