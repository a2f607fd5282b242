//! The runtime: one tokio task per owned partition (see [`partition`]), a supervisor that
//! starts and stops them as the [`Source`] assigns and revokes partitions, and shutdown.
//!
//! # Ownership
//!
//! A partition task owns its RocksDB [`PartitionStore`](crate::store::PartitionStore), its
//! partition clock, its input handle and its outbox publisher; other tasks never touch them
//! (STYLE §2). The supervisor holds only each task's cancellation token and join handle.
//! The only shared mutable thing is the status board (each task writes its own entry, see
//! [`status`]).
//!
//! # Clock
//!
//! Wall-clock time comes from a [`Clock`] ([`SystemClock`] in production, [`TokioClock`]
//! in tests with paused tokio time); partition time is a [`PartitionClock`] per task.
//!
//! # Shutdown
//!
//! One [`CancellationToken`] stops everything: the supervisor stops taking assignment
//! events and cancels every partition task; each stops fetching, finishes its step, waits
//! for its outbox to drain (up to three quarters of `shutdown-deadline`), closes its store.
//! The supervisor waits for them up to `shutdown-deadline` and aborts what is left (the
//! stores are consistent at every commit, so an abort loses nothing committed).
//! [`shutdown_on_signals`] cancels the token on the first SIGINT/SIGTERM and exits the
//! process at once on the second. A revocation stops the revoked partitions the same way
//! before the source is told they are done.

pub mod clock;
pub mod pacer;
pub mod partition;
pub mod publisher;
pub mod run_file;
pub mod status;

pub use clock::{Clock, PartitionClock, SystemClock, TokioClock};
pub use pacer::CatchUpPacer;
pub use partition::{PartitionContext, PartitionExit, PartitionSettings};
pub use publisher::PublishTarget;
pub use status::{PartitionState, PartitionStatus, StatusBoard, StatusMap};

use crate::config::Config;
use crate::engine::Engine;
use crate::store::{self, MemoryBudget, PartitionStore, StoreOptions};
use crate::transport::{self, Backoff, PartitionInput, Sink, Source, SourceEvent};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Tier of every emission until tiers are wired into the runtime.
pub const DEFAULT_TIER: &str = "normal";

/// Output topic of tier `normal` until the output config exists (`tiers` default).
pub const DEFAULT_OUTPUT_TOPIC: &str = "settle.ready.normal";

/// Settings of the runtime (from `[store]`, `[runtime]` and the output topic of the config).
#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    /// `store.data-dir`: partition stores live at `<data-dir>/<topic>/<partition>`.
    pub data_dir: PathBuf,
    /// RocksDB sizes and durability; one [`MemoryBudget`] is shared by all partitions.
    pub store: StoreOptions,
    /// Topic (subject) every emission is published to (tier `normal`).
    pub output_topic: String,
    /// `runtime.batch-size`: most records per poll and per store write (≥ 1).
    pub batch_size: usize,
    /// `runtime.idle-tick`: longest poll wait; lateness above which a timer is overdue and
    /// paced by `catch-up-rate`.
    pub idle_tick: Duration,
    /// `runtime.catch-up-rate`: overdue emissions released per second, per partition
    /// (0 = unlimited).
    pub catch_up_rate: u32,
    /// `runtime.shutdown-deadline`: how long a graceful stop may take.
    pub shutdown_deadline: Duration,
    /// Most publishes in flight per partition (≥ 1).
    pub publish_window: usize,
}

impl RuntimeOptions {
    /// The `[store]` and `[runtime]` sections of `config`, output topic
    /// [`DEFAULT_OUTPUT_TOPIC`], publish window 256, default store tuning.
    pub fn from_config(config: &Config) -> Self {
        let r = &config.runtime;
        RuntimeOptions {
            data_dir: config.store.data_dir.clone(),
            store: StoreOptions::default(),
            output_topic: DEFAULT_OUTPUT_TOPIC.into(),
            batch_size: r.batch_size as usize,
            idle_tick: r.idle_tick,
            catch_up_rate: r.catch_up_rate,
            shutdown_deadline: r.shutdown_deadline,
            publish_window: 256,
        }
    }

    fn partition_settings(&self) -> PartitionSettings {
        PartitionSettings {
            batch_size: self.batch_size.max(1),
            idle_tick: self.idle_tick.max(Duration::from_millis(1)),
            flush_timeout: self.shutdown_deadline * 3 / 4,
            publish: PublishTarget {
                topic: self.output_topic.clone(),
                tier: DEFAULT_TIER.into(),
                window: self.publish_window.max(1),
                max_backoff: Duration::from_secs(5),
            },
            catch_up_rate: self.catch_up_rate,
        }
    }
}

/// How a runtime run ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// How each partition task ended (the last task of each partition number).
    pub partitions: BTreeMap<i32, PartitionExit>,
}

impl RunSummary {
    /// Partitions that stopped on a fatal error, with the reason.
    pub fn failed(&self) -> Vec<(i32, &str)> {
        self.partitions
            .iter()
            .filter_map(|(p, e)| match e {
                PartitionExit::Failed(r) => Some((*p, r.as_str())),
                PartitionExit::Stopped { .. } => None,
            })
            .collect()
    }
}

/// Why [`Runtime::run`] failed as a whole.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The source failed with a non-retryable error; every partition was stopped.
    #[error("source failed: {0}")]
    Source(#[from] transport::Error),
}

struct Running {
    cancel: CancellationToken,
    join: JoinHandle<PartitionExit>,
}

/// The runtime of one process: engine, sink, clock and options; [`Runtime::run`] drives a
/// source until shutdown.
pub struct Runtime<K, C> {
    ctx: PartitionContext<K, C>,
    options: RuntimeOptions,
    budget: MemoryBudget,
}

impl<K: Sink, C: Clock> Runtime<K, C> {
    /// A runtime publishing to `sink`, reading wall-clock time from `clock`.
    pub fn new(engine: Engine, sink: K, clock: C, options: RuntimeOptions) -> Self {
        let budget = MemoryBudget::new(&options.store);
        Runtime {
            ctx: PartitionContext {
                engine,
                sink,
                clock,
                settings: Arc::new(options.partition_settings()),
                status: StatusBoard::new(),
            },
            options,
            budget,
        }
    }

    /// The status board the partition tasks write (clone it before `run`).
    pub fn status(&self) -> StatusBoard {
        self.ctx.status.clone()
    }

    /// Runs until `shutdown` is cancelled: starts a partition task for each assigned
    /// partition, stops revoked ones before acknowledging the revocation, then stops all
    /// within `shutdown-deadline`. A partition that fails stays failed (visible in
    /// [`Runtime::status`] and in the summary) while the others go on.
    ///
    /// Errors: [`Error::Source`] when the source fails with a non-retryable error.
    pub async fn run<S: Source>(
        self,
        mut source: S,
        shutdown: CancellationToken,
    ) -> Result<RunSummary, Error> {
        let mut running: HashMap<i32, Running> = HashMap::new();
        let mut summary = RunSummary::default();
        let mut backoff = Backoff::new(Duration::from_secs(5));
        let mut source_open = true;
        let result = loop {
            let event = tokio::select! {
                biased;
                () = shutdown.cancelled() => break Ok(()),
                ev = source.next_event(), if source_open => ev,
            };
            match event {
                Ok(Some(SourceEvent::Assigned(inputs))) => {
                    backoff.reset();
                    for input in inputs {
                        let p = input.partition();
                        if let Some(old) = running.remove(&p) {
                            let exits = self.stop(vec![(p, old)]).await;
                            summary.partitions.extend(exits);
                        }
                        running.insert(p, self.spawn(input));
                    }
                }
                Ok(Some(SourceEvent::Revoked { partitions, done })) => {
                    backoff.reset();
                    let stopping = partitions
                        .iter()
                        .filter_map(|p| running.remove(p).map(|r| (*p, r)))
                        .collect();
                    summary.partitions.extend(self.stop(stopping).await);
                    tracing::info!(?partitions, "revoked partitions stopped");
                    let _ = done.send(());
                }
                Ok(None) => {
                    tracing::info!("source ended; running until shutdown");
                    source_open = false;
                }
                Err(e) if e.is_retryable() => {
                    tracing::warn!(error = %e, "source unavailable; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => {}
                        () = tokio::time::sleep(backoff.next_delay()) => {}
                    }
                }
                Err(e) => break Err(e),
            }
        };
        summary
            .partitions
            .extend(self.stop(running.drain().collect()).await);
        result.map(|()| summary).map_err(Error::from)
    }

    fn spawn<I: PartitionInput>(&self, input: I) -> Running {
        let cancel = CancellationToken::new();
        let partition = input.partition();
        let path = store::partition_path(&self.options.data_dir, input.topic(), partition);
        let span = tracing::info_span!("partition", topic = input.topic(), partition);
        let ctx = self.ctx.clone();
        let (store_options, budget) = (self.options.store.clone(), self.budget.clone());
        let task_cancel = cancel.clone();
        let join = tokio::spawn(
            async move {
                ctx.status
                    .set(PartitionStatus::starting(input.topic(), partition));
                match PartitionStore::open_with_budget(&path, &store_options, &budget) {
                    Ok(store) => partition::run(ctx, store, input, task_cancel).await,
                    Err(e) => {
                        let reason = format!("partition store: {e}");
                        tracing::error!(error = %reason, "partition not started");
                        ctx.status.update(partition, |s| {
                            s.state = PartitionState::Failed(reason.clone());
                        });
                        PartitionExit::Failed(reason)
                    }
                }
            }
            .instrument(span),
        );
        Running { cancel, join }
    }

    /// Cancels `tasks` and waits for them up to `shutdown-deadline`; aborts the rest.
    async fn stop(&self, tasks: Vec<(i32, Running)>) -> Vec<(i32, PartitionExit)> {
        for (_, r) in &tasks {
            r.cancel.cancel();
        }
        let deadline = tokio::time::Instant::now() + self.options.shutdown_deadline;
        let mut exits = Vec::with_capacity(tasks.len());
        for (p, r) in tasks {
            let abort = r.join.abort_handle();
            let exit = match tokio::time::timeout_at(deadline, r.join).await {
                Ok(Ok(exit)) => exit,
                Ok(Err(e)) => {
                    PartitionExit::Failed(format!("partition task ended abnormally: {e}"))
                }
                Err(_) => {
                    abort.abort();
                    tracing::warn!(
                        partition = p,
                        "partition did not stop within the shutdown deadline; aborted"
                    );
                    PartitionExit::Stopped { flushed: false }
                }
            };
            exits.push((p, exit));
        }
        exits
    }
}

/// Runs `future` to completion on a new multi-threaded tokio runtime (for the synchronous
/// entry points the CLI calls: `settle demo`, `run-file`, `settle run`).
///
/// Errors: the tokio runtime cannot be built.
pub fn block_on<F: std::future::Future>(future: F) -> anyhow::Result<F::Output> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow::anyhow!("cannot start the tokio runtime: {e}"))?;
    Ok(rt.block_on(future))
}

/// Cancels `token` on the first SIGINT or SIGTERM (graceful stop) and exits the process with
/// status 130 on the second. Returns the listening task.
///
/// Errors: the signal handlers cannot be installed.
pub fn shutdown_on_signals(token: CancellationToken) -> std::io::Result<JoinHandle<()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    Ok(tokio::spawn(async move {
        for n in 0.. {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            if n == 0 {
                tracing::info!("signal received: stopping (a second signal exits at once)");
                token.cancel();
            } else {
                tracing::warn!("second signal: exiting now");
                std::process::exit(130);
            }
        }
    }))
}
