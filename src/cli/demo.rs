//! `settle demo`: the real runtime (partition tasks, RocksDB stores, outbox publisher) on the
//! in-memory transport, no broker needed, driving the situations the seed system was built
//! for, in real time, scaled so the whole demo takes about 20 seconds:
//!
//! | scenario | what happens (demo time) |
//! |---|---|
//! | `burst` | 700 CI machines upload into the same session within 1.5 s (4 sessions, staggered) |
//! | `split` | clients split one upload into 2 requests (`part` 1/2, 2/2) 300 ms apart |
//! | `trickle` | a slow sender uploads every ~2.5 s (±0.5 s), 5 times per session |
//! | `tenants` | 150 tenants × 2 sessions, each a small burst of 10 uploads within 0.6 s |
//!
//! Policy: `adaptive` with `min-delay` 500 ms and `max-delay` 6 s (the defaults, 5 s and
//! 10 min, compressed so the demo fits in well under a minute). Record timestamps are the
//! wall clock when the demo producer appends them (log-append time).
//!
//! The report per scenario: uploads, emissions, coalescing ratio, time-to-ready p50/p99 and
//! lateness p99 ([`RunStats`]), plus how many sessions got exactly one emission.

use super::report::{human_ms, RunStats};
use crate::codec;
use crate::engine::{Engine, PolicySpec, PolicyTable};
use crate::runtime::{Clock, Runtime, RuntimeOptions, SystemClock};
use crate::transport::memory::MemoryBroker;
use anyhow::Context;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Input topic name of the demo's memory broker (stores live under `<data-dir>/uploads/`).
pub const DEMO_TOPIC: &str = "uploads";

/// Arguments of `settle demo`.
#[derive(Clone, Debug)]
pub struct DemoArgs {
    /// Keep the partition stores here (`--data-dir`); `None`: a temporary directory removed
    /// at the end.
    pub data_dir: Option<PathBuf>,
    /// Input partitions (`--partitions`, default 4).
    pub partitions: i32,
    /// Seed of the schedule's randomness (`--seed`, default 7).
    pub seed: u64,
    /// Draw a progress bar on stderr (off in tests).
    pub progress: bool,
}

impl Default for DemoArgs {
    fn default() -> Self {
        DemoArgs {
            data_dir: None,
            partitions: 4,
            seed: 7,
            progress: true,
        }
    }
}

/// Figures of one scenario.
#[derive(Clone, Debug)]
pub struct ScenarioReport {
    /// Scenario name (`burst`, `split`, `trickle`, `tenants`).
    pub name: &'static str,
    /// Sessions that uploaded.
    pub sessions: u64,
    /// Sessions that got exactly one emission.
    pub sessions_with_one_emission: u64,
    /// Uploads, emissions, time-to-ready and lateness (`emitted_at` as published).
    pub stats: RunStats,
}

/// What `settle demo` measured.
#[derive(Clone, Debug)]
pub struct DemoReport {
    /// One entry per scenario, in the order of the table.
    pub scenarios: Vec<ScenarioReport>,
    /// Where the stores were (removed already when it was a temporary directory).
    pub data_dir: PathBuf,
    /// Input partitions (one RocksDB store each).
    pub partitions: i32,
    /// Wall-clock length of the run (ms).
    pub elapsed_ms: u64,
}

impl DemoReport {
    /// The scenario named `name`.
    pub fn scenario(&self, name: &str) -> Option<&ScenarioReport> {
        self.scenarios.iter().find(|s| s.name == name)
    }
}

/// Runs the demo (builds its own tokio runtime; call it from a plain thread).
///
/// Errors: the data directory or a store cannot be created, a partition failed, or the run
/// did not settle within 2 minutes.
pub fn run(args: DemoArgs) -> anyhow::Result<DemoReport> {
    crate::runtime::block_on(run_async(args))?
}

/// One scheduled upload: `at` ms after the demo start.
struct Planned {
    at: u64,
    scenario: usize,
    key: String,
    json: String,
}

const SCENARIOS: [&str; 4] = ["burst", "split", "trickle", "tenants"];

fn upload_json(tenant: &str, session: &str, event_id: &str, extra: &str) -> String {
    format!(r#"{{"tenant":"{tenant}","session":"{session}","event_id":"{event_id}"{extra}}}"#)
}

/// The whole schedule, sorted by time.
fn schedule(seed: u64) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut plan = Vec::new();
    let mut push =
        |at: u64, scenario: usize, tenant: &str, session: &str, id: String, extra: &str| {
            plan.push(Planned {
                at,
                scenario,
                key: format!("{tenant}/{session}"),
                json: upload_json(tenant, session, &id, extra),
            });
        };
    // burst: 700 machines, one upload each, within 1.5 s; 4 sessions 3 s apart.
    for s in 0..4u64 {
        let session = format!("build-{s}");
        for m in 0..700 {
            let at = 500 + s * 3_000 + rng.random_range(0..1_500);
            push(at, 0, "ci-burst", &session, format!("m{m}"), "");
        }
    }
    // split: 2 requests 300 ms apart, `part` 1/2 and 2/2.
    for s in 0..100 {
        let session = format!("run-{s}");
        let at = rng.random_range(0..10_000);
        for (i, dt) in [(1, 0), (2, 300)] {
            let extra = format!(r#","part":{{"index":{i},"count":2}}"#);
            push(at + dt, 1, "split-co", &session, format!("p{i}"), &extra);
        }
    }
    // trickle: every ~2.5 s ± 0.5 s, 5 uploads.
    for s in 0..20 {
        let session = format!("nightly-{s}");
        let mut at = rng.random_range(0..3_000);
        for i in 0..5 {
            push(at, 2, "trickle-co", &session, format!("u{i}"), "");
            at += rng.random_range(2_000..3_000);
        }
    }
    // tenants: 150 tenants × 2 sessions × 10 uploads within 0.6 s.
    for t in 0..150 {
        let tenant = format!("tenant-{t:03}");
        for s in 0..2 {
            let session = format!("s{s}");
            let start = rng.random_range(0..12_000);
            for i in 0..10 {
                let at = start + rng.random_range(0..600);
                push(at, 3, &tenant, &session, format!("u{i}"), "");
            }
        }
    }
    plan.sort_by_key(|p| p.at);
    plan
}

/// The async body of [`run`].
///
/// Errors: as [`run`].
pub async fn run_async(args: DemoArgs) -> anyhow::Result<DemoReport> {
    let started = std::time::Instant::now();
    let (data_dir, _temp) = match &args.data_dir {
        Some(d) => (d.clone(), None),
        None => {
            let t = tempfile::Builder::new()
                .prefix("settle-demo-")
                .tempdir()
                .context("cannot create a temporary data directory")?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let policy = PolicySpec::adaptive(500, 6_000);
    let engine = Engine::new(PolicyTable::uniform(policy));
    let broker = MemoryBroker::new(DEMO_TOPIC, args.partitions.max(1));
    let mut options = RuntimeOptions::from_config(&crate::config::Config::default());
    options.data_dir = data_dir.clone();
    options.shutdown_deadline = Duration::from_secs(5);
    let clock = SystemClock;
    let runtime = Runtime::new(engine, broker.sink(), clock, options)?;
    let status = runtime.status();
    let shutdown = CancellationToken::new();
    let runtime_task = tokio::spawn(runtime.run(broker.source("settle-demo"), shutdown.clone()));

    let plan = schedule(args.seed);
    let bar = super::progress_bar(args.progress, plan.len() as u64);
    let mut uploads = [0u64; SCENARIOS.len()];
    let mut sessions: [HashSet<String>; SCENARIOS.len()] = Default::default();
    let start = tokio::time::Instant::now();
    for p in &plan {
        tokio::time::sleep_until(start + Duration::from_millis(p.at)).await;
        broker.produce_upload(&p.key, &p.json, clock.now_ms());
        uploads[p.scenario] += 1;
        sessions[p.scenario].insert(p.key.clone());
        bar.inc(1);
        bar.set_message(format!("{} emitted", broker.output_len()));
    }
    bar.set_message("settling: waiting for the last rounds".to_owned());
    let n = broker.partitions();
    let settled = tokio::time::timeout(Duration::from_secs(120), async {
        let mut rx = status.subscribe();
        loop {
            bar.set_message(format!("settling: {} emitted", broker.output_len()));
            let m = rx.borrow_and_update().clone();
            if let Some((p, s)) = m.iter().find(|(_, s)| s.is_failed()) {
                return Err(anyhow::anyhow!("partition {p} failed: {:?}", s.state));
            }
            if (0..n).all(|p| m.get(&p).is_some_and(|s| s.is_idle())) {
                return Ok(());
            }
            tokio::select! {
                _ = rx.changed() => {}
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    })
    .await;
    shutdown.cancel();
    let summary = runtime_task.await.context("runtime task")??;
    bar.finish_and_clear();
    settled.context("the demo did not settle within 2 minutes")??;
    if let Some((p, reason)) = summary.failed().first() {
        anyhow::bail!("partition {p} failed: {reason}");
    }

    let mut stats: Vec<RunStats> = SCENARIOS.iter().map(|_| RunStats::new()).collect();
    let mut per_session: HashMap<String, u64> = HashMap::new();
    let scenario_of: HashMap<&str, usize> =
        plan.iter().map(|p| (p.key.as_str(), p.scenario)).collect();
    for m in broker.output() {
        let r = codec::decode_ready(&m.payload).context("demo output is a ready record")?;
        let e = r.emission();
        let Some(&sc) = scenario_of.get(e.key.as_str()) else {
            continue;
        };
        stats[sc].record_emission(&e, r.emitted_at);
        *per_session.entry(e.key.to_string()).or_default() += 1;
    }
    let scenarios = SCENARIOS
        .iter()
        .enumerate()
        .zip(stats)
        .map(|((i, name), mut stats)| {
            stats.uploads = uploads[i];
            ScenarioReport {
                name,
                sessions: sessions[i].len() as u64,
                sessions_with_one_emission: sessions[i]
                    .iter()
                    .filter(|k| per_session.get(*k) == Some(&1))
                    .count() as u64,
                stats,
            }
        })
        .collect();
    Ok(DemoReport {
        scenarios,
        data_dir,
        partitions: n,
        elapsed_ms: started.elapsed().as_millis() as u64,
    })
}

/// The line under the demo's table saying what its columns are.
const LEGEND: &str =
    "sessions: started · 1/session: sessions emitted exactly once (0 for trickle: \
its first gap, 2-3 s, outlasts the 500 ms first delay) · ratio: uploads per emission · \
ttr: time-to-ready, emitted - last upload · late: emitted - due";

impl fmt::Display for DemoReport {
    /// The table printed at the end of `settle demo`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<9} {:>8} {:>8} {:>9} {:>9} {:>8} {:>9} {:>9} {:>9}",
            "scenario",
            "sessions",
            "uploads",
            "emissions",
            "1/session",
            "ratio",
            "ttr p50",
            "ttr p99",
            "late p99"
        )?;
        for s in &self.scenarios {
            let ttr = s.stats.time_to_ready();
            writeln!(
                f,
                "{:<9} {:>8} {:>8} {:>9} {:>9} {:>8.1} {:>9} {:>9} {:>9}",
                s.name,
                s.sessions,
                s.stats.uploads,
                s.stats.emissions,
                s.sessions_with_one_emission,
                s.stats.coalescing_ratio(),
                human_ms(ttr.p50),
                human_ms(ttr.p99),
                human_ms(s.stats.lateness().p99),
            )?;
        }
        writeln!(f, "{LEGEND}")?;
        write!(
            f,
            "policy adaptive (min-delay 500ms, max-delay 6s) · {} partitions on RocksDB at {} · {}",
            self.partitions,
            self.data_dir.display(),
            human_ms(self.elapsed_ms)
        )
    }
}
