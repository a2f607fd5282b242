//! Signals of `settle run` (and of the `settle run-file` harness): the first SIGINT or SIGTERM
//! stops gracefully (STYLE §8: one cancellation token), a second one exits at once.

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

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
                exit_now(130);
            }
        }
    }))
}

/// Ends the process with `code` at once, without the exit handlers of `std::process::exit`
/// (flushing standard output, C libraries' `atexit` hooks), which a thread stuck in a client
/// library can hold up: the hard stop of the second signal and of the shutdown watchdog.
/// The stores need nothing more (every write is already in RocksDB's log).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: `_exit` only ends the process; it touches no Rust state.
    unsafe { libc::_exit(code) }
}
