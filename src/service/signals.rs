//! Signals of `settle run` (and of the `settle run-file` harness), the hard stop behind
//! them, and the fault drill that proves both work while the tokio runtime is blocked.
//!
//! SIGINT and SIGTERM are handled on an OS thread of their own (`settle-signals`, running a
//! one-thread tokio runtime that does nothing else), never by a task of the service's
//! runtime: a runtime whose worker threads are all stuck (a client library blocked in a
//! call, a task that never yields) must not swallow a stop. On that thread:
//!
//! * the first signal cancels the one cancellation token (STYLE §8: graceful stop);
//! * a second signal ends the process at once, exit status 130 ([`exit_now`]);
//! * once the token is cancelled (by a signal or by the service itself, e.g. a failed
//!   partition), the hard stop counts down: if the process is still there when it expires,
//!   an error line says so and the process ends with exit status 1. The stores keep what
//!   they hold (every write is in RocksDB's log); a restart resumes from them.
//!
//! Fault drill: with `SETTLE_FAULT_BLOCK_WORKER_MS=N` ([`BLOCK_WORKERS_ENV`]), `settle run`
//! blocks every worker thread of its runtime for N ms as soon as a partition is live
//! ([`drill_block_workers`]), as a stuck client call would (`tests/e2e/signals.rs`).

use crate::runtime::{PartitionState, StatusBoard};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Environment variable of the blocked-runtime drill (module docs): a number of ms.
pub const BLOCK_WORKERS_ENV: &str = "SETTLE_FAULT_BLOCK_WORKER_MS";

/// The signal thread of [`shutdown_on_signals`]. Dropping it (or [`SignalThread::abort`])
/// ends its watch: no more graceful stop, second-signal exit or hard stop from it.
#[derive(Debug)]
pub struct SignalThread {
    done: CancellationToken,
}

impl SignalThread {
    /// Stops watching (the run is over, e.g. `run-file` finished its input). Signals that
    /// arrive later are ignored (the handlers stay installed).
    pub fn abort(&self) {
        self.done.cancel();
    }
}

impl Drop for SignalThread {
    fn drop(&mut self) {
        self.done.cancel();
    }
}

/// Starts the signal thread (module docs): the first SIGINT or SIGTERM cancels `token`, a
/// second one exits with status 130, and with `hard_stop = Some(limit)` the process exits
/// with status 1 when it is still running `limit` after `token` was cancelled (by anyone).
/// Returns once the handlers are installed.
///
/// Errors: the thread, its runtime or the signal handlers cannot be set up.
pub fn shutdown_on_signals(
    token: CancellationToken,
    hard_stop: Option<Duration>,
) -> std::io::Result<SignalThread> {
    use tokio::signal::unix::{signal, SignalKind};
    let done = CancellationToken::new();
    let (installed_tx, installed_rx) = std::sync::mpsc::channel();
    let thread_done = done.clone();
    std::thread::Builder::new()
        .name("settle-signals".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .enable_time()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = installed_tx.send(Err(e));
                    return;
                }
            };
            rt.block_on(async move {
                let handlers = signal(SignalKind::interrupt())
                    .and_then(|int| Ok((int, signal(SignalKind::terminate())?)));
                let (mut int, mut term) = match handlers {
                    Ok(h) => {
                        let _ = installed_tx.send(Ok(()));
                        h
                    }
                    Err(e) => {
                        let _ = installed_tx.send(Err(e));
                        return;
                    }
                };
                // Running: a signal starts the graceful stop; so may the service itself.
                tokio::select! {
                    () = thread_done.cancelled() => return,
                    () = either(&mut int, &mut term) => {
                        tracing::info!("signal received: stopping (a second signal exits at once)");
                        token.cancel();
                    }
                    () = token.cancelled() => {}
                }
                // Stopping: a second signal, or the hard stop.
                let expired = async {
                    match hard_stop {
                        Some(limit) => tokio::time::sleep(limit).await,
                        None => std::future::pending::<()>().await,
                    }
                };
                tokio::select! {
                    () = thread_done.cancelled() => {}
                    () = either(&mut int, &mut term) => {
                        tracing::warn!("second signal: exiting now (exit code 130)");
                        exit_now(130);
                    }
                    () = expired => {
                        let limit_ms = hard_stop.map_or(0, |l| l.as_millis() as u64);
                        tracing::error!(
                            limit_ms,
                            "settle run did not stop within runtime.shutdown-deadline + 30 s of the stop: exiting now (exit code 1); the stores keep what they hold"
                        );
                        exit_now(1);
                    }
                }
            });
        })?;
    installed_rx
        .recv()
        .unwrap_or_else(|_| Err(std::io::Error::other("the signal thread ended")))?;
    Ok(SignalThread { done })
}

/// Resolves on the next SIGINT or SIGTERM.
async fn either(int: &mut tokio::signal::unix::Signal, term: &mut tokio::signal::unix::Signal) {
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
}

/// Ends the process with `code` at once, without the exit handlers of `std::process::exit`
/// (flushing standard output, C libraries' `atexit` hooks), which a thread stuck in a client
/// library can hold up: the hard stop of the second signal and of the shutdown watchdog.
/// The stores need nothing more (every write is already in RocksDB's log).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: `_exit` only ends the process; it touches no Rust state.
    unsafe { libc::_exit(code) }
}

/// The blocked-runtime drill (module docs), when [`BLOCK_WORKERS_ENV`] holds a number of
/// ms: a task that waits until a partition of `status` is live, logs a warning, and then
/// occupies every worker thread of the current runtime with a blocking sleep of that long.
/// `None` (no task) when the variable is unset or not a number. Must run inside a
/// multi-threaded tokio runtime.
pub fn drill_block_workers(status: StatusBoard) -> Option<JoinHandle<()>> {
    let ms: u64 = std::env::var(BLOCK_WORKERS_ENV).ok()?.trim().parse().ok()?;
    Some(tokio::spawn(async move {
        status
            .wait_for(|m| m.values().any(|s| s.state == PartitionState::Live))
            .await;
        let workers = tokio::runtime::Handle::current().metrics().num_workers();
        tracing::warn!(
            workers,
            block_ms = ms,
            "{BLOCK_WORKERS_ENV}: blocking every runtime worker thread"
        );
        // One blocking task per worker, and this task returns: the last one spawned waits
        // in this worker's LIFO slot (never stolen) and runs next here, the others are
        // stolen by the other workers.
        for _ in 0..workers {
            tokio::spawn(async move { std::thread::sleep(Duration::from_millis(ms)) });
        }
    }))
}
