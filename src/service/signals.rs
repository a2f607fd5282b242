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
                std::process::exit(130);
            }
        }
    }))
}
