//! The hidden `settle run-file` command: the real runtime on the memory transport, fed from a
//! JSONL trace file, appending every acknowledged ready record to an output file, exiting
//! once the input is consumed and nothing is pending. It exists so crash tests can SIGKILL a
//! real `settle` process mid-run and start it again on the same data directory: the trace is
//! reloaded identically (same partitions, same offsets), and the stores say what was applied.
//!
//! Trace format: the `settle simulate` one (an upload record per line plus `"ts"`, epoch ms
//! or RFC 3339, used as the record timestamp, and an optional `"partition"`).
//!
//! With `[[shadow]]` policies in the config (SEMANTICS §8), the run ends with their figures
//! and the live policy's, as the partitions had them when all were idle
//! ([`RunFileReport::shadows`]; `settle run-file` prints them as JSON lines): on a trace
//! whose times are in the past every round has fired by then, so a shadow's figures are
//! those `settle tune` computes for its policy on the trace (time-to-ready
//! `due_at − last_upload_at`, `engine::shadow`).

use crate::config::Config;
use crate::engine::{Engine, Figures, Percentiles, LIVE};
use crate::runtime::{Runtime, RuntimeOptions, SystemClock};
use crate::service::shutdown_on_signals;
use crate::transport::memory::MemoryBroker;
use anyhow::Context;
use std::path::PathBuf;
use tokio_util::sync::CancellationToken;

/// Input topic name of the file-fed broker (stores live under `<data-dir>/uploads/`).
pub const RUN_FILE_TOPIC: &str = "uploads";

/// Consumer group of the runtime on the file-fed broker.
const RUN_FILE_GROUP: &str = "settle";

/// Trace records the loader holds at most beyond each partition's reader (the trace is read
/// as it is consumed, as a broker serves a log from disk; records the runtime has committed
/// are dropped): about 5 MiB of the shared trace's lines, whatever the trace's length.
pub const RUN_FILE_LOAD_WINDOW: usize = 32 * 1024;

/// Arguments of `settle run-file`.
#[derive(Clone, Debug)]
pub struct RunFileArgs {
    /// `--input`: the JSONL trace.
    pub input: PathBuf,
    /// `--data-dir`: where the partition stores live (kept across runs).
    pub data_dir: PathBuf,
    /// `--output`: ready records are appended here, one JSON line each, before they count
    /// as acknowledged.
    pub output: PathBuf,
    /// `--config`: debounce policy and `[runtime]` settings (defaults without it; its
    /// `store.data-dir` is replaced by `data_dir`).
    pub config: Option<PathBuf>,
    /// `--partitions`: input partitions (default 4). Must be the same on every run over one
    /// data directory.
    pub partitions: i32,
}

/// What a `run-file` run did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunFileReport {
    /// Trace lines appended to the input.
    pub records: u64,
    /// Trace lines skipped (no JSON object or no usable `ts`).
    pub skipped: u64,
    /// Ready records published (appended to the output) by this run.
    pub published: u64,
    /// Records dead-lettered by this run.
    pub dead_letters: u64,
    /// With `[[shadow]]`: the live policy's figures (named `live`), then each shadow's, in
    /// config order, as the partitions had them once all were idle (module docs). Empty
    /// without `[[shadow]]`, or when the run stopped before.
    pub shadows: Vec<PolicyFigures>,
}

/// One policy's figures over a `run-file` run (SEMANTICS §8), all tiers together.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PolicyFigures {
    /// `live`, or the shadow's name.
    pub name: String,
    /// Emissions (would-be, for a shadow); `manual` ones left out.
    pub emissions: u64,
    /// Uploads in them.
    pub uploads: u64,
    /// Time-to-ready `due_at − last_upload_at` percentiles (ms).
    pub time_to_ready_ms: Percentiles,
    /// Sessions the shadow could not follow within `runtime.shadow-max-sessions`.
    pub refused_sessions: u64,
}

impl PolicyFigures {
    fn new(name: &str, f: &Figures) -> Self {
        let total = f.total();
        PolicyFigures {
            name: name.to_owned(),
            emissions: total.emissions,
            uploads: total.uploads,
            time_to_ready_ms: total.time_to_ready.percentiles(),
            refused_sessions: f.refused_sessions,
        }
    }
}

/// Runs the trace to the end (builds its own tokio runtime). Stops early and gracefully on
/// SIGINT/SIGTERM; a second signal exits at once.
///
/// Errors: the config, trace or output cannot be read/opened, or a partition failed.
pub fn run(args: RunFileArgs) -> anyhow::Result<RunFileReport> {
    crate::runtime::block_on(run_async(args))?
}

async fn run_async(args: RunFileArgs) -> anyhow::Result<RunFileReport> {
    let config = Config::load(args.config.as_deref())?;
    crate::service::log_rules(&config);
    let broker = MemoryBroker::new(RUN_FILE_TOPIC, args.partitions.max(1));
    let trace_error = || format!("cannot read the trace {}", args.input.display());
    let trace = std::fs::File::open(&args.input).with_context(trace_error)?;
    broker
        .tee_output_only(&args.output)
        .with_context(|| format!("cannot open the output {}", args.output.display()))?;
    // The trace loads on a thread of its own while the partitions consume it (a backlog
    // until it is all there: `MemoryBroker::load_trace_in_background`), at most
    // `RUN_FILE_LOAD_WINDOW` records ahead of them, and what they committed is dropped.
    broker.bound_load(RUN_FILE_LOAD_WINDOW, RUN_FILE_GROUP);
    let loader = broker
        .load_trace_in_background(trace)
        .context("cannot start the trace loader thread")?;
    let mut options = RuntimeOptions::from_config(&config);
    options.data_dir = args.data_dir.clone();
    let runtime = Runtime::new(
        Engine::new(config.policy_table()),
        broker.sink(),
        SystemClock,
        options,
    )?
    .with_shadows(config.shadow_specs());
    let status = runtime.status();
    let board = runtime.shadows();
    let shadows = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let shutdown = CancellationToken::new();
    let signals =
        shutdown_on_signals(shutdown.clone(), None).context("cannot install signal handlers")?;
    let n = broker.partitions();
    let done = {
        let shutdown = shutdown.clone();
        let shadows = std::sync::Arc::clone(&shadows);
        tokio::spawn(async move {
            status
                .wait_for(|m| {
                    m.values().any(|s| s.is_failed())
                        || (0..n).all(|p| m.get(&p).is_some_and(|s| s.is_idle()))
                })
                .await;
            if !board.is_empty() {
                // Before the stop: a partition's shadows go with its task.
                let snap = board.snapshot();
                let mut figures = vec![PolicyFigures::new(LIVE, &snap.live)];
                for (spec, f) in &snap.shadows {
                    figures.push(PolicyFigures::new(&spec.name, f));
                }
                *shadows.lock().unwrap_or_else(|e| e.into_inner()) = figures;
            }
            shutdown.cancel();
        })
    };
    let summary = runtime.run(broker.source(RUN_FILE_GROUP), shutdown).await;
    done.abort();
    signals.abort();
    // Nothing reads any more: the loader must not wait for room.
    broker.unbound_load();
    // A stop before the load ended waits for the rest of the file to be read (bounded by
    // its size); a load that failed is the error to report, whatever the runtime did.
    let load = tokio::task::spawn_blocking(move || loader.join())
        .await
        .context("the trace loader did not finish")?
        .map_err(|_| anyhow::anyhow!("the trace loader panicked"))?
        .with_context(trace_error)?;
    let summary = summary?;
    if let Some((p, reason)) = summary.failed().first() {
        anyhow::bail!("partition {p} failed: {reason}");
    }
    let shadows = std::mem::take(&mut *shadows.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(RunFileReport {
        records: load.records,
        skipped: load.skipped,
        published: broker.output_len() as u64,
        dead_letters: broker.dead_letters().len() as u64,
        shadows,
    })
}
