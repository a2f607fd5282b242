//! Helpers of the tests that run `settle` as a real child process (`tests/*_process.rs`):
//! spawning `settle run`, waiting for every round, stopping it with SIGTERM.
#![allow(dead_code)]

use anyhow::{ensure, Context as _, Result};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The `settle` binary with a clean environment for a test: no `SETTLE_CONFIG` or
/// `SETTLE_TRANSPORT` from the caller, the admin server on any free port (a settle already on
/// the default port must not make this one fail to start), stdout discarded, stderr shown.
pub fn settle() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_settle"));
    c.env_remove("SETTLE_CONFIG")
        .env_remove("SETTLE_TRANSPORT")
        .env("SETTLE_ADMIN__LISTEN", "127.0.0.1:0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    c
}

/// Starts `settle run --config CONFIG EXTRA...`, logging at `SETTLE_TEST_RUN_LOG` (default
/// `warn`).
pub fn start_run(config: &Path, extra: &[&str]) -> Result<Child> {
    settle()
        .args(["run", "--config"])
        .arg(config)
        .args(extra)
        .env(
            "SETTLE_LOG",
            std::env::var("SETTLE_TEST_RUN_LOG").unwrap_or_else(|_| "warn".to_owned()),
        )
        .spawn()
        .context("spawn settle run")
}

/// Waits up to `limit` for `child` to exit (`None`: still running).
pub fn wait_exit(child: &mut Child, limit: Duration) -> Result<Option<ExitStatus>> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(None)
}

/// Polls `emitted_now` every 300 ms until it holds at least `rounds` distinct ids (by
/// `id_of`), while `running` keeps running, for at most `limit`; returns the last read.
pub fn wait_for_rounds<T>(
    running: &mut Child,
    rounds: usize,
    limit: Duration,
    mut emitted_now: impl FnMut() -> Result<Vec<T>>,
    id_of: impl Fn(&T) -> String,
) -> Result<Vec<T>> {
    let t0 = Instant::now();
    loop {
        let got = emitted_now()?;
        let ids: BTreeSet<String> = got.iter().map(&id_of).collect();
        if ids.len() >= rounds {
            return Ok(got);
        }
        ensure!(
            running.try_wait()?.is_none(),
            "settle run exited: {:?}",
            running.try_wait()?
        );
        ensure!(
            t0.elapsed() < limit,
            "{} of {rounds} rounds out after {limit:?}",
            ids.len()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Sends SIGTERM to `child` and requires a successful exit within `deadline` + 5 s; returns
/// how long it took. Kills the child if it is still running then.
pub fn sigterm(child: &mut Child, deadline: Duration) -> Result<Duration> {
    let term = Instant::now();
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    ensure!(kill.success(), "kill -TERM failed");
    let status = wait_exit(child, deadline + Duration::from_secs(5))?;
    let stopped_in = term.elapsed();
    let Some(status) = status else {
        child.kill()?;
        anyhow::bail!("settle run still running {stopped_in:?} after SIGTERM");
    };
    ensure!(
        status.success(),
        "settle run exited with {status} on SIGTERM"
    );
    Ok(stopped_in)
}

/// The `[debounce]`, `[store]` and `[runtime]` sections of the process tests: delays of 4 s
/// and more (longer than any gap inside a session of the load generator's scenarios, so live
/// and replay agree exactly), a leading-trailing and an adaptive tenant, stores in
/// `data_dir`, `shutdown_deadline`, a 50 ms idle tick.
pub fn debounce_store_runtime(data_dir: &Path, shutdown_deadline: Duration) -> String {
    format!(
        r#"
[debounce]
policy = "fixed"
delay = "4s"
[debounce.tenants.tenant-0001]
policy = "leading-trailing"
delay = "4s"
[debounce.tenants.tenant-0002]
policy = "adaptive"
min-delay = "4s"
max-delay = "10s"

[store]
data-dir = "{}"

[runtime]
shutdown-deadline = "{}s"
idle-tick = "50ms"
"#,
        data_dir.display(),
        shutdown_deadline.as_secs()
    )
}
