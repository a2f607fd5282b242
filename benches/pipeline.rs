//! The durable pipeline end to end (issue 3): the real [`Runtime`] (partition task, timer
//! loop, outbox publisher, catch-up pacer) with RocksDB partition stores (WAL on, no fsync:
//! the default `StoreOptions`) on the in-memory transport, wall clock, one input partition.
//!
//! `cargo bench --bench pipeline` runs every phase below, each in a child process of this
//! binary (so one phase's memory does not show in the next one's RSS, and the restart is a
//! real new process), and prints one table:
//!
//! | phase | what is measured |
//! |---|---|
//! | `throughput` | uploads/s from runtime start until the stored offset covers a backlog of `PIPELINE_UPLOADS` records: (a) every upload a new session (each opens a round due in 1 h), (b) the coalescing mix of `benches/store.rs` (20 000 keys, half the uploads on 1 % of them, 5 ms apart in event time, `fixed` 2 s, so about half the uploads end a round and the outbox publisher is busy); `catch-up-rate` 0 so the replayed backlog is not paced |
//! | `preload` | writes `PIPELINE_PENDING` pending rounds into the partition store through `engine::Driver` and store batches of 10 000: all due in 50 to 60 min but 1 000 due at once; then exits without closing the store (no flush: as after kill -9) |
//! | `live` | the runtime on that store (a restart after a crash: WAL replay): time from spawning the process to the first published emission (one of the 1 000 overdue rounds, released at `catch-up-rate` 1 000/s); once those are out, a live stream of `PIPELINE_LIVE_RATE` uploads/s (sessions of 5 uploads 50 ms apart, `fixed` 500 ms, record timestamp = wall clock) for `PIPELINE_LIVE_SECS`; lateness = `emitted_at − due_at` of every live round due in that window (a round not emitted within 1 s of its due time is counted as missing); RSS sampled every 100 ms, with neither of the memory broker's logs held in this process (ready records go to a file, input the group committed is trimmed: a real broker keeps both elsewhere); the block cache, memtables and session cache at the end. The stream then goes on until the parent kills the process with SIGKILL |
//! | `restart` | started 1 s after the kill, so the live rounds open at the kill are overdue: time from spawning the process to the first published emission (`emitted_at` of the first record), RSS 3 s later, store size on disk |
//!
//! Environment (defaults in brackets; without `--bench`, e.g. under `cargo test --benches`,
//! the sizes shrink to a smoke run):
//! `PIPELINE_UPLOADS` [1 000 000], `PIPELINE_PENDING` [1 000 000], `PIPELINE_LIVE_RATE`
//! [5 000 uploads/s], `PIPELINE_LIVE_SECS` [10 s], `PIPELINE_BATCH` [`runtime.batch-size`
//! default, 1 000], `PIPELINE_DIR` [a new directory under `/tmp`, removed at the end unless
//! `PIPELINE_KEEP=1`], `PIPELINE_PHASE` [all; one phase name runs only that phase in this
//! process, for profiling: `throughput`, `preload`, `live`, `restart`],
//! `PIPELINE_WORKLOADS` [both; `new_sessions` or `coalescing`: one throughput workload],
//! `PIPELINE_LIST` [0; 1: an admin server on the live runtime and a thread that lists every
//! pending round through `GET /v1/pending` in pages of 1 000, over and over, during the live
//! window; page times reported].
//!
//! Results travel from a child to the parent as `RESULT <name> <value>` lines on stdout;
//! everything else a child says goes to stderr.

use settle::cli::report::RunStats;
use settle::codec;
use settle::engine::{Driver, Engine, Millis, PolicySpec, PolicyTable, SessionKey, Upload};
use settle::runtime::{
    Clock, PartitionState, RunSummary, Runtime, RuntimeOptions, StatusBoard, SystemClock,
};
use settle::store::{partition_path, PartitionStore, StoreOptions};
use settle::transport::memory::MemoryBroker;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const TOPIC: &str = "uploads";
const GROUP: &str = "settle-bench";
/// Tenant of the live stream.
const LIVE_TENANT: &str = "live";
/// Debounce delay of the live stream (ms).
const LIVE_DELAY_MS: Millis = 500;
/// Uploads per live session, and their spacing (ms).
const LIVE_UPLOADS_PER_SESSION: u64 = 5;
const LIVE_SPACING_MS: u64 = 50;
/// Delay of the preloaded rounds and of the "new sessions" workload (ms): 1 h.
const BULK_DELAY_MS: Millis = 3_600_000;
/// Tenants of the coalescing workload (`t0` … `t6`), `fixed` 2 s as in `benches/store.rs`.
const MIX_TENANTS: u64 = 7;
const MIX_DELAY_MS: Millis = 2_000;
const MIX_KEYS: u64 = 20_000;

/// Sizes of one run (see the module docs for the environment variables).
#[derive(Clone, Debug)]
struct Params {
    uploads: u64,
    pending: u64,
    live_rate: u64,
    live_secs: u64,
    batch: usize,
    dir: PathBuf,
    keep: bool,
    /// Run with `--bench` (full sizes), not as a smoke run.
    full: bool,
}

impl Params {
    fn from_env(full: bool) -> Self {
        let num = |name: &str, full_default: u64, smoke_default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.replace('_', "").parse().ok())
                .unwrap_or(if full { full_default } else { smoke_default })
        };
        let dir = std::env::var_os("PIPELINE_DIR").map_or_else(
            || std::env::temp_dir().join(format!("settle-pipeline-{}", std::process::id())),
            PathBuf::from,
        );
        Params {
            uploads: num("PIPELINE_UPLOADS", 1_000_000, 20_000),
            pending: num("PIPELINE_PENDING", 1_000_000, 20_000),
            live_rate: num("PIPELINE_LIVE_RATE", 5_000, 1_000).max(1),
            live_secs: num("PIPELINE_LIVE_SECS", 10, 2).max(1),
            batch: num("PIPELINE_BATCH", 1_000, 1_000).max(1) as usize,
            dir,
            keep: std::env::var("PIPELINE_KEEP").is_ok_and(|v| v == "1"),
            full,
        }
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let params = Params::from_env(full);
    let phase = std::env::var("PIPELINE_PHASE").unwrap_or_default();
    let result = match phase.as_str() {
        "" => orchestrate(&params),
        "throughput" => block_on(throughput(&params)),
        "preload" => preload(&params),
        "live" => block_on(live(&params)),
        "restart" => block_on(restart(&params)),
        other => Err(format!("unknown PIPELINE_PHASE {other:?}")),
    };
    if let Err(e) = result {
        eprintln!("pipeline bench failed: {e}");
        std::process::exit(1);
    }
}

type Res<T> = Result<T, String>;

fn block_on<F: std::future::Future<Output = Res<()>>>(f: F) -> Res<()> {
    settle::runtime::block_on(f).map_err(|e| e.to_string())?
}

/// Prints one result for the parent.
/// `PIPELINE_LIST=1`: during the live window a thread walks every pending round through
/// the admin API (`GET /v1/pending`, pages of 1 000, cursor after cursor, over and over):
/// what an operator's listing costs the partition that must keep its timers (issue 34).
fn listing() -> bool {
    std::env::var("PIPELINE_LIST").is_ok_and(|v| v == "1")
}

/// Walks `/v1/pending` at `base` in pages of 1 000 until `stop`; returns each page's time
/// (ms) and the rounds listed.
fn list_pending_until(
    base: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> (Vec<u64>, u64, u64) {
    use std::sync::atomic::Ordering;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into();
    let (mut pages, mut rounds, mut walks) = (Vec::new(), 0u64, 0u64);
    let mut cursor: Option<String> = None;
    while !stop.load(Ordering::Relaxed) {
        let mut req = agent
            .get(format!("{base}/v1/pending"))
            .query("limit", "1000");
        if let Some(c) = &cursor {
            req = req.query("cursor", c);
        }
        let t = Instant::now();
        let body: serde_json::Value = match req.call() {
            Ok(mut r) => match r
                .body_mut()
                .read_to_string()
                .map_err(|e| e.to_string())
                .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
            {
                Ok(b) => b,
                Err(e) => {
                    eprintln!("listing: bad answer: {e}");
                    break;
                }
            },
            Err(e) => {
                eprintln!("listing: {e}");
                break;
            }
        };
        pages.push(t.elapsed().as_millis() as u64);
        rounds += body["rounds"].as_array().map_or(0, |r| r.len() as u64);
        cursor = body["next_cursor"].as_str().map(str::to_owned);
        if cursor.is_none() {
            walks += 1;
        }
    }
    (pages, rounds, walks)
}

fn result(name: &str, value: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "RESULT {name} {value}");
    let _ = out.flush();
}

fn wall_ms() -> Millis {
    SystemClock.now_ms()
}

/// `VmRSS` of this process (MiB).
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Bytes of the files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// The policies of every phase: 1 h by default, `live` 500 ms, `t0`…`t6` 2 s.
fn engine() -> Engine {
    let mut table = PolicyTable::uniform(PolicySpec::fixed(BULK_DELAY_MS));
    table
        .tenants
        .insert(LIVE_TENANT.to_owned(), PolicySpec::fixed(LIVE_DELAY_MS));
    for t in 0..MIX_TENANTS {
        table
            .tenants
            .insert(format!("t{t}"), PolicySpec::fixed(MIX_DELAY_MS));
    }
    Engine::new(table)
}

fn options(params: &Params, data_dir: &Path, catch_up_rate: u32) -> RuntimeOptions {
    let mut o = RuntimeOptions::from_config(&settle::config::Config::default());
    o.data_dir = data_dir.to_path_buf();
    o.batch_size = params.batch;
    o.catch_up_rate = catch_up_rate;
    o.shutdown_deadline = Duration::from_secs(10);
    o
}

fn upload_json(tenant: &str, session: &str, event_id: &str) -> String {
    format!(r#"{{"tenant":"{tenant}","session":"{session}","event_id":"{event_id}"}}"#)
}

/// A running runtime on `broker`.
struct Running {
    status: StatusBoard,
    /// The admin server on the runtime (`PIPELINE_LIST=1`): where the listing thread asks.
    admin: Option<settle::admin::AdminServer>,
    /// The stores' shared memory budget (block cache, memtables, session cache).
    memory: settle::store::MemoryBudget,
    shutdown: CancellationToken,
    task: JoinHandle<Result<RunSummary, settle::runtime::Error>>,
}

impl Running {
    async fn start(broker: &MemoryBroker, options: RuntimeOptions) -> Res<Self> {
        let runtime = Runtime::new(engine(), broker.sink(), SystemClock, options)
            .map_err(|e| e.to_string())?;
        let status = runtime.status();
        let memory = runtime.memory();
        let admin = if listing() {
            let state = settle::admin::AdminState::new(&runtime);
            let server =
                settle::admin::AdminServer::start("127.0.0.1:0".parse().expect("addr"), state)
                    .await
                    .map_err(|e| format!("admin server: {e}"))?;
            Some(server)
        } else {
            None
        };
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(runtime.run(broker.source(GROUP), shutdown.clone()));
        Ok(Running {
            status,
            admin,
            memory,
            shutdown,
            task,
        })
    }

    /// Waits until `pred` holds for partition 0 (fails if the partition failed).
    async fn until(
        &self,
        mut pred: impl FnMut(&settle::runtime::PartitionStatus) -> bool,
    ) -> Res<()> {
        let mut failed = None;
        self.status
            .wait_for(|m| match m.get(&0) {
                Some(s) if s.is_failed() => {
                    failed = Some(format!("{:?}", s.state));
                    true
                }
                Some(s) => pred(s),
                None => false,
            })
            .await;
        failed.map_or(Ok(()), |f| Err(format!("partition 0 failed: {f}")))
    }

    async fn stop(self) -> Res<RunSummary> {
        self.shutdown.cancel();
        let summary = self
            .task
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        match summary.failed().first() {
            Some((p, r)) => Err(format!("partition {p} failed: {r}")),
            None => Ok(summary),
        }
    }
}

// ---------------------------------------------------------------------------------------
// throughput

/// The coalescing mix of `benches/store.rs`: keys from 20 000 (half the uploads on the
/// first 1 %), 5 ms apart in event time.
struct MixFeed {
    seed: u64,
}

impl MixFeed {
    fn next_key(&mut self) -> u64 {
        self.seed = self
            .seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let r = self.seed >> 33;
        if r & 1 == 0 {
            r % (MIX_KEYS / 100)
        } else {
            r % MIX_KEYS
        }
    }
}

async fn throughput(params: &Params) -> Res<()> {
    let n = params.uploads;
    let only = std::env::var("PIPELINE_WORKLOADS").unwrap_or_default();
    for workload in ["new_sessions", "coalescing"] {
        if !only.is_empty() && !only.split(',').any(|w| w == workload) {
            continue;
        }
        let dir = params.dir.join(format!("throughput-{workload}"));
        let broker = MemoryBroker::new(TOPIC, 1);
        let now = wall_ms();
        match workload {
            "new_sessions" => {
                for i in 0..n {
                    let (tenant, session) = (format!("tenant-{}", i % 97), format!("s-{i:08}"));
                    let json = upload_json(&tenant, &session, &format!("u{i}"));
                    broker.produce_upload(&format!("{tenant}/{session}"), &json, now);
                }
            }
            _ => {
                let mut feed = MixFeed { seed: 7 };
                let start = now - 5 * n as Millis - 10_000;
                for i in 0..n {
                    let k = feed.next_key();
                    let (tenant, session) = (format!("t{}", k % MIX_TENANTS), k.to_string());
                    let json = upload_json(&tenant, &session, &format!("e{i}"));
                    let ts = start + 5 * i as Millis;
                    broker.produce_upload(&format!("{tenant}/{session}"), &json, ts);
                }
            }
        }
        eprintln!("throughput/{workload}: {n} records in the input; starting the runtime");
        let started = Instant::now();
        let run = Running::start(&broker, options(params, &dir, 0)).await?;
        run.until(|s| s.next_offset >= Some(n as i64)).await?;
        let applied = started.elapsed();
        let snap = run.status.snapshot()[&0].clone();
        // Then until everything emitted so far is published.
        run.until(|s| s.outbox_len == 0).await?;
        let drained = started.elapsed();
        run.stop().await?;
        let per_sec = n as f64 / applied.as_secs_f64();
        eprintln!(
            "throughput/{workload}: {n} uploads applied in {applied:.2?} = {per_sec:.0} uploads/s; \
             {} emissions, {} published by then, outbox drained at {drained:.2?}",
            snap.emissions, snap.published
        );
        result(&format!("throughput.{workload}.per_sec"), per_sec.round());
        result(
            &format!("throughput.{workload}.secs"),
            format!("{:.3}", applied.as_secs_f64()),
        );
        result(&format!("throughput.{workload}.emissions"), snap.emissions);
        result(
            &format!("throughput.{workload}.drained_secs"),
            format!("{:.3}", drained.as_secs_f64()),
        );
        drop(broker);
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// preload

fn store_dir(params: &Params) -> PathBuf {
    params.dir.join("pending")
}

fn preload(params: &Params) -> Res<()> {
    let path = partition_path(&store_dir(params), TOPIC, 0);
    if path.join("CURRENT").exists() {
        return Err(format!("{} already holds a store", path.display()));
    }
    let n = params.pending;
    let overdue = overdue_rounds(n);
    let started = Instant::now();
    let mut store =
        PartitionStore::open(&path, &StoreOptions::default()).map_err(|e| e.to_string())?;
    let mut driver = Driver::new(engine());
    // Event times in the last 10 minutes: the rounds are due 50 to 60 minutes from now,
    // except the first `overdue` ones, due now (overdue when the next process starts).
    let now = wall_ms();
    let mut i = 0;
    while i < n {
        let mut batch = store.batch();
        let mut out = Vec::new();
        let mut last = 0;
        for _ in 0..10_000.min(n - i) {
            let key = SessionKey::new(&format!("tenant-{}", i % 97), &format!("session-{i:08}"));
            last = if i < overdue {
                now - BULK_DELAY_MS
            } else {
                now - 600_000 + (i % 600_000) as Millis
            };
            let mut u = Upload::plain(key, last);
            u.event_id = Some(format!("upload-{i}"));
            driver
                .apply(&mut batch, last, &u, &mut out)
                .map_err(|e| e.to_string())?;
            i += 1;
        }
        if !out.is_empty() {
            return Err("preloaded rounds must not fire".into());
        }
        batch.set_partition_time(last.max(now - 1));
        batch.commit().map_err(|e| e.to_string())?;
    }
    let pending = store.pending_rounds();
    let rss = rss_mib();
    eprintln!(
        "preload: {pending} pending rounds ({overdue} due now) written in {:.1?}, RSS {rss:.0} MiB; \
         exiting without closing the store (as after kill -9)",
        started.elapsed()
    );
    result("preload.pending", pending);
    result("preload.overdue", overdue);
    result("preload.rss_mib", format!("{rss:.0}"));
    result(
        "preload.secs",
        format!("{:.1}", started.elapsed().as_secs_f64()),
    );
    // No destructor runs: the memtables are not flushed, the next open replays the WAL.
    std::process::exit(0);
}

/// How many of `pending` preloaded rounds are due at once (1 000, or a tenth of a smaller
/// preload).
fn overdue_rounds(pending: u64) -> u64 {
    1_000.min(pending / 10)
}

// ---------------------------------------------------------------------------------------
// live

/// Produces the live stream: sessions of 5 uploads 50 ms apart, `rate` uploads/s in all.
/// Returns, per session, the event time of its last upload once it has one.
struct LiveFeed {
    broker: MemoryBroker,
    rate: u64,
    next_session: u64,
    /// `(at ms, session, upload index)`, earliest first.
    queue: BinaryHeap<Reverse<(Millis, u64, u64)>>,
    /// Session → event time of its last upload (set when the last one is produced).
    last_upload: HashMap<u64, Millis>,
    produced: u64,
    start: Millis,
}

impl LiveFeed {
    fn new(broker: MemoryBroker, rate: u64) -> Self {
        LiveFeed {
            broker,
            rate,
            next_session: 0,
            queue: BinaryHeap::new(),
            last_upload: HashMap::new(),
            produced: 0,
            start: wall_ms(),
        }
    }

    /// Produces everything scheduled up to the wall clock now.
    fn tick(&mut self) {
        let now = wall_ms();
        // Sessions start at rate / 5 per second.
        let sessions_per_sec = (self.rate / LIVE_UPLOADS_PER_SESSION).max(1);
        let due_sessions = ((now - self.start).max(0) as u64 * sessions_per_sec / 1000) + 1;
        while self.next_session < due_sessions {
            let s = self.next_session;
            self.next_session += 1;
            let at = self.start + (s * 1000 / sessions_per_sec) as Millis;
            for k in 0..LIVE_UPLOADS_PER_SESSION {
                self.queue
                    .push(Reverse((at + (k * LIVE_SPACING_MS) as Millis, s, k)));
            }
        }
        while let Some(&Reverse((at, s, k))) = self.queue.peek() {
            if at > now {
                break;
            }
            self.queue.pop();
            let session = format!("s{s:07}");
            let json = upload_json(LIVE_TENANT, &session, &format!("u{k}"));
            let ts = wall_ms();
            self.broker
                .produce_upload(&format!("{LIVE_TENANT}/{session}"), &json, ts);
            self.produced += 1;
            if k + 1 == LIVE_UPLOADS_PER_SESSION {
                self.last_upload.insert(s, ts);
            }
        }
    }
}

async fn live(params: &Params) -> Res<()> {
    let dir = store_dir(params);
    let broker = MemoryBroker::new(TOPIC, 1);
    // Neither log of the memory broker stays in this process's RSS (a real broker keeps
    // them elsewhere): ready records go to a file only, and input the group committed is
    // dropped as the stream goes (`MemoryBroker::trim_committed`).
    let out_path = params.dir.join("live-output.jsonl");
    let _ = std::fs::remove_file(&out_path);
    broker
        .tee_output_only(&out_path)
        .map_err(|e| format!("{}: {e}", out_path.display()))?;
    let rss_before = rss_mib();
    let started = Instant::now();
    let run = Running::start(&broker, options(params, &dir, 1_000)).await?;
    run.until(|s| s.state != PartitionState::Starting).await?;
    let opened = started.elapsed();
    let snap = run.status.snapshot()[&0].clone();
    result("live.open_ms", opened.as_millis());
    result("live.pending_at_start", snap.pending_rounds);
    // The preloaded rounds due now go out first (paced at catch-up-rate); the live stream
    // starts after them so that pacing does not show in its lateness.
    let overdue = overdue_rounds(params.pending) as usize;
    while broker.output_len() < overdue.max(1) {
        if started.elapsed() > Duration::from_secs(60) {
            return Err("the overdue preloaded rounds were not published within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let released = started.elapsed();
    let first = read_output(&out_path, 0)?
        .into_iter()
        .next()
        .ok_or("no ready record in the output file")?;
    eprintln!(
        "live: store open with {} pending rounds after {opened:.1?}; first emission at {} ms \
         (wall); {overdue} overdue rounds published after {released:.1?}",
        snap.pending_rounds, first.emitted_at
    );
    let mib = |b: usize| format!("{:.0}", b as f64 / 1_048_576.0);
    eprintln!(
        "live: before the stream, RSS {:.0} MiB: block cache {} MiB, memtables {} MiB, session cache {} MiB",
        rss_mib(),
        mib(run.memory.cache_usage_bytes()),
        mib(run.memory.memtable_usage_bytes()),
        mib(run.memory.session_cache_usage_bytes())
    );
    result("live.rss_open_mib", format!("{:.0}", rss_mib()));
    result("live.first_emitted_at_ms", first.emitted_at);
    result("live.overdue_released_ms", released.as_millis());
    let skip = broker.output_len();

    let stop_listing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lister = run.admin.as_ref().map(|a| {
        let base = format!("http://{}", a.local_addr());
        let stop = std::sync::Arc::clone(&stop_listing);
        std::thread::spawn(move || list_pending_until(base, stop))
    });
    let mut feed = LiveFeed::new(broker.clone(), params.live_rate);
    let window_end = feed.start + params.live_secs as Millis * 1000;
    let mut rss_max: f64 = 0.0;
    let mut rss_samples = Vec::new();
    let mut next_sample = Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // The window, then 1 s more for the window's last rounds to be emitted.
    while wall_ms() < window_end + 1_000 {
        ticker.tick().await;
        feed.tick();
        if Instant::now() >= next_sample {
            broker.trim_committed(GROUP);
            let r = rss_mib();
            rss_max = rss_max.max(r);
            rss_samples.push(r);
            next_sample += Duration::from_millis(100);
        }
    }
    stop_listing.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(lister) = lister {
        let (mut pages, rounds, walks) =
            lister.join().map_err(|_| "the listing thread panicked")?;
        pages.sort_unstable();
        let q = |f: f64| {
            pages
                .get(((pages.len() as f64 * f) as usize).min(pages.len().saturating_sub(1)))
                .copied()
                .unwrap_or(0)
        };
        eprintln!(
            "live: listing through /v1/pending during the window: {} pages of up to 1 000 ({rounds} rounds, {walks} full walks), page time p50 {} ms p99 {} ms max {} ms",
            pages.len(), q(0.5), q(0.99), pages.last().copied().unwrap_or(0)
        );
        result("live.list_pages", pages.len());
        result("live.list_rounds", rounds);
        result("live.list_page_p50_ms", q(0.5));
        result("live.list_page_p99_ms", q(0.99));
    }
    let snap = run.status.snapshot()[&0].clone();
    let rss_end = rss_mib();
    let output = read_output(&out_path, skip)?;

    let mut stats = RunStats::new();
    let mut emitted: HashMap<u64, Millis> = HashMap::new();
    for r in &output {
        if r.tenant != LIVE_TENANT || r.due_at > window_end {
            continue;
        }
        let Some(s) = r.session.strip_prefix('s').and_then(|s| s.parse().ok()) else {
            continue;
        };
        stats.record_emission(&r.emission(), r.emitted_at);
        emitted.insert(s, r.emitted_at);
    }
    let expected: Vec<u64> = feed
        .last_upload
        .iter()
        .filter(|(_, &last)| last + LIVE_DELAY_MS <= window_end)
        .map(|(&s, _)| s)
        .collect();
    let missing = expected.iter().filter(|s| !emitted.contains_key(s)).count();
    let late = stats.lateness();
    eprintln!(
        "live: {} uploads in {} s, {} rounds due in the window, {} emitted ({missing} missing), \
         lateness p50 {} ms p99 {} ms max {} ms; pending {} outbox {}; RSS before {rss_before:.0} \
         max {rss_max:.0} end {rss_end:.0} MiB",
        feed.produced,
        params.live_secs,
        expected.len(),
        stats.emissions,
        late.p50,
        late.p99,
        late.max,
        snap.pending_rounds,
        snap.outbox_len,
    );
    result("live.uploads", feed.produced);
    result("live.rounds", expected.len());
    result("live.emitted", stats.emissions);
    result("live.missing", missing);
    result("live.late_p50_ms", late.p50);
    result("live.late_p90_ms", late.p90);
    result("live.late_p99_ms", late.p99);
    result("live.late_max_ms", late.max);
    result("live.pending", snap.pending_rounds);
    result("live.rss_before_mib", format!("{rss_before:.0}"));
    result("live.rss_max_mib", format!("{rss_max:.0}"));
    result("live.rss_end_mib", format!("{rss_end:.0}"));
    let mib = |b: usize| format!("{:.0}", b as f64 / 1_048_576.0);
    eprintln!(
        "live: at the end, block cache {} MiB, memtables {} MiB, session cache {} MiB",
        mib(run.memory.cache_usage_bytes()),
        mib(run.memory.memtable_usage_bytes()),
        mib(run.memory.session_cache_usage_bytes())
    );
    result("live.block_cache_mib", mib(run.memory.cache_usage_bytes()));
    result("live.memtables_mib", mib(run.memory.memtable_usage_bytes()));
    result(
        "live.session_cache_mib",
        mib(run.memory.session_cache_usage_bytes()),
    );
    drop(output);

    if std::env::var("PIPELINE_KILL").is_ok_and(|v| v == "1") {
        // The parent kills this process (SIGKILL) while the stream goes on.
        result("live.done", 1);
        loop {
            ticker.tick().await;
            feed.tick();
        }
    }
    run.stop().await?;
    result("live.done", 1);
    Ok(())
}

/// The ready records of the output file `path`, from line `skip` on.
fn read_output(path: &Path, skip: usize) -> Res<Vec<codec::ReadyRecord>> {
    let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .skip(skip)
        .map(|l| codec::decode_ready(l).map_err(|e| e.to_string()))
        .collect()
}

// ---------------------------------------------------------------------------------------
// restart

async fn restart(params: &Params) -> Res<()> {
    let main_at = wall_ms();
    let dir = store_dir(params);
    let broker = MemoryBroker::new(TOPIC, 1);
    let started = Instant::now();
    let run = Running::start(&broker, options(params, &dir, 1_000)).await?;
    run.until(|s| s.state != PartitionState::Starting).await?;
    let opened = started.elapsed();
    let snap = run.status.snapshot()[&0].clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    while broker.output_len() == 0 {
        if Instant::now() > deadline {
            return Err("no emission within 30 s of the restart".into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let first = broker.output()[0].clone();
    let first = codec::decode_ready(&first.payload).map_err(|e| e.to_string())?;
    eprintln!(
        "restart: store open after {opened:.1?} with {} pending rounds, outbox {}; first \
         emission {} ms after main (due {} ms before it was sent)",
        snap.pending_rounds,
        snap.outbox_len,
        first.emitted_at - main_at,
        first.emitted_at - first.due_at
    );
    result("restart.main_at_ms", main_at);
    result("restart.open_ms", opened.as_millis());
    result("restart.pending", snap.pending_rounds);
    result("restart.outbox_at_start", snap.outbox_len);
    result("restart.first_emitted_at_ms", first.emitted_at);
    // Let the overdue rounds go out (paced at catch-up-rate), then measure.
    let settle_for = Duration::from_millis(if params.full { 3_000 } else { 500 });
    tokio::time::sleep(settle_for).await;
    let snap = run.status.snapshot()[&0].clone();
    result("restart.rss_mib", format!("{:.0}", rss_mib()));
    result("restart.published_3s", broker.output_len());
    result("restart.pending_after", snap.pending_rounds);
    run.stop().await?;
    result(
        "restart.store_mib",
        format!("{:.0}", dir_bytes(&dir) as f64 / 1_048_576.0),
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// orchestration

/// Starts this binary as a child running `phase`; its stdout is piped.
fn spawn_phase(params: &Params, phase: &str, kill: bool) -> Res<Child> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    if params.full {
        cmd.arg("--bench");
    }
    cmd.env("PIPELINE_PHASE", phase)
        .env("PIPELINE_DIR", &params.dir)
        .env("PIPELINE_UPLOADS", params.uploads.to_string())
        .env("PIPELINE_PENDING", params.pending.to_string())
        .env("PIPELINE_LIVE_RATE", params.live_rate.to_string())
        .env("PIPELINE_LIVE_SECS", params.live_secs.to_string())
        .env("PIPELINE_BATCH", params.batch.to_string())
        .env("PIPELINE_KILL", if kill { "1" } else { "0" })
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd.spawn()
        .map_err(|e| format!("cannot start phase {phase}: {e}"))
}

/// Reads `RESULT` lines of `child` into `results` until `stop_at` is seen (or the end).
fn collect(child: &mut Child, results: &mut BTreeMap<String, String>, stop_at: &str) {
    let Some(out) = child.stdout.take() else {
        return;
    };
    let mut lines = BufReader::new(out).lines();
    for line in lines.by_ref().map_while(Result::ok) {
        if let Some(rest) = line.strip_prefix("RESULT ") {
            if let Some((k, v)) = rest.split_once(' ') {
                results.insert(k.to_owned(), v.to_owned());
                if k == stop_at {
                    break;
                }
            }
        }
    }
    // Keep the pipe open (a child writing to a closed pipe would die of SIGPIPE).
    std::thread::spawn(move || for _ in lines {});
}

fn run_phase(params: &Params, phase: &str, results: &mut BTreeMap<String, String>) -> Res<()> {
    let mut child = spawn_phase(params, phase, false)?;
    collect(&mut child, results, "");
    let status = child.wait().map_err(|e| e.to_string())?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("phase {phase} exited with {status}"))
    }
}

fn orchestrate(params: &Params) -> Res<()> {
    let mut r = BTreeMap::new();
    std::fs::create_dir_all(&params.dir).map_err(|e| e.to_string())?;
    let outcome = (|| -> Res<()> {
        run_phase(params, "throughput", &mut r)?;
        run_phase(params, "preload", &mut r)?;
        r.insert("live.spawned_at_ms".into(), wall_ms().to_string());
        let mut live = spawn_phase(params, "live", true)?;
        collect(&mut live, &mut r, "live.done");
        if !r.contains_key("live.done") {
            let _ = live.wait();
            return Err("phase live ended without its results".into());
        }
        // SIGKILL while the live stream goes on: rounds are open, some outbox entries owed.
        std::thread::sleep(Duration::from_millis(200));
        live.kill().map_err(|e| e.to_string())?;
        let _ = live.wait();
        let killed_at = wall_ms();
        std::thread::sleep(Duration::from_secs(1));
        let spawned_at = wall_ms();
        run_phase(params, "restart", &mut r)?;
        r.insert("restart.killed_at_ms".into(), killed_at.to_string());
        r.insert("restart.spawned_at_ms".into(), spawned_at.to_string());
        Ok(())
    })();
    if !params.keep {
        let _ = std::fs::remove_dir_all(&params.dir);
    }
    outcome?;
    print_table(params, &r);
    Ok(())
}

fn print_table(params: &Params, r: &BTreeMap<String, String>) {
    let get = |k: &str| r.get(k).cloned().unwrap_or_else(|| "?".into());
    let num = |k: &str| r.get(k).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let first_ms = num("restart.first_emitted_at_ms") - num("restart.spawned_at_ms");
    let first_live_ms = num("live.first_emitted_at_ms") - num("live.spawned_at_ms");
    let m = |x: f64| format!("{:.2} M", x / 1e6);
    println!();
    println!(
        "settle pipeline bench: real runtime, memory transport, RocksDB WAL on (no fsync), \
         1 partition, batch-size {}",
        params.batch
    );
    let rows = [
        (
            format!("uploads/s, {} new sessions", params.uploads),
            format!(
                "{} ({} s)",
                m(num("throughput.new_sessions.per_sec")),
                get("throughput.new_sessions.secs")
            ),
            "≥ 1 M/s",
        ),
        (
            format!("uploads/s, {} coalescing mix", params.uploads),
            format!(
                "{} ({} s, {} emissions, outbox drained at {} s)",
                m(num("throughput.coalescing.per_sec")),
                get("throughput.coalescing.secs"),
                get("throughput.coalescing.emissions"),
                get("throughput.coalescing.drained_secs")
            ),
            "≥ 1 M/s",
        ),
        (
            format!(
                "lateness p50/p90/p99/max, {} pending, {} uploads/s live",
                get("live.pending_at_start"),
                params.live_rate
            ),
            format!(
                "{}/{}/{}/{} ms over {} rounds ({} missing)",
                get("live.late_p50_ms"),
                get("live.late_p90_ms"),
                get("live.late_p99_ms"),
                get("live.late_max_ms"),
                get("live.emitted"),
                get("live.missing")
            ),
            "p99 ≤ 20 ms",
        ),
        (
            format!("RSS at {} pending, live (max; before start)", params.pending),
            format!(
                "{} MiB; {} MiB (memory-broker logs not held: output to a file, committed input trimmed)",
                get("live.rss_max_mib"),
                get("live.rss_before_mib"),
            ),
            "≤ 256 MB",
        ),
        (
            format!("RSS at {} pending, after restart", params.pending),
            format!("{} MiB", get("restart.rss_mib")),
            "≤ 256 MB",
        ),
        (
            format!(
                "first emission, restart after kill -9 of the {} preload",
                get("preload.pending")
            ),
            format!(
                "{first_live_ms:.0} ms from spawn (store open {} ms after runtime start, WAL \
                 replayed; {} overdue rounds out at {} ms)",
                get("live.open_ms"),
                get("preload.overdue"),
                get("live.overdue_released_ms")
            ),
            "≤ 2 s",
        ),
        (
            "first emission, restart after SIGKILL of the live run".to_owned(),
            format!(
                "{first_ms:.0} ms from spawn (store open {} ms after runtime start; outbox {} at start)",
                get("restart.open_ms"),
                get("restart.outbox_at_start")
            ),
            "≤ 2 s",
        ),
        (
            format!("store on disk at {} pending", params.pending),
            format!(
                "{} MiB (preload {} s, its RSS {} MiB)",
                get("restart.store_mib"),
                get("preload.secs"),
                get("preload.rss_mib")
            ),
            "",
        ),
    ];
    for (name, value, goal) in rows {
        println!("{name:<58} {value:<70} {goal}");
    }
}
