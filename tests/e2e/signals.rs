//! A stop is never lost behind a blocked runtime (STYLE §8, `settle::service::signals`): a
//! real `settle run` process on Kafka, whose tokio runtime the fault drill
//! `SETTLE_FAULT_BLOCK_WORKER_MS` blocks (every worker thread, for 10 min) once a partition
//! is live, gets SIGTERM:
//!
//! 1. the signal is seen at once (the signal thread logs it while the runtime is blocked),
//!    the graceful stop cannot finish, and the hard stop ends the process with exit code 1
//!    and its error line `runtime.shutdown-deadline` + 30 s after the signal, not 10 min later;
//! 2. a second SIGTERM ends it at once with exit code 130.
//!
//! Without the signal thread (signals as a task of the blocked runtime) neither signal would
//! be seen until the drill ends. `SETTLE_TEST_KAFKA=host:port` runs them; under CI a missing
//! broker is a failure.

use crate::kafka_support;
use crate::process_support;

use anyhow::{ensure, Context as _, Result};
use process_support::{json_log, send_sigterm, start_run_logged, wait_exit, JsonLog, LogEvent};
use settle::service::signals::BLOCK_WORKERS_ENV;
use settle::service::SHUTDOWN_GRACE;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

/// `[runtime] shutdown-deadline` of the process.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(2);

/// How long the drill blocks the runtime: far longer than any wait of these tests.
const BLOCK_MS: &str = "600000";

/// The drill's warning, logged right before the workers block.
const DRILL_MESSAGE: &str = "SETTLE_FAULT_BLOCK_WORKER_MS: blocking every runtime worker thread";

/// A `settle run` child killed (SIGKILL) when the test ends, however it ends: the drill
/// keeps a process blocked for 10 min.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `settle run` on fresh topics with the drill on, its JSON log in `dir/NAME.log`, and
/// waits (at most 120 s) until the drill has blocked the runtime. Returns the process and
/// the log's path.
fn blocked_run(bootstrap: &str, dir: &Path, name: &str) -> Result<(Killed, std::path::PathBuf)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (kafka, output) = kafka_support::fresh_topics(&rt, bootstrap, name, 1)?;
    let (config, _) = process_support::write_kafka_config(dir, &kafka, &output, SHUTDOWN_DEADLINE)?;
    let log = dir.join(format!("{name}.log"));
    let mut run = Killed(start_run_logged(
        &config,
        &[(BLOCK_WORKERS_ENV, BLOCK_MS)],
        &log,
    )?);
    let child = &mut run.0;
    let t0 = Instant::now();
    loop {
        if json_log(&log)?.with_message(DRILL_MESSAGE).next().is_some() {
            break;
        }
        if let Some(status) = child.try_wait()? {
            anyhow::bail!(
                "settle run exited ({status}) before the drill:\n{}",
                json_log(&log)?.trouble(20)
            );
        }
        if t0.elapsed() > Duration::from_secs(120) {
            anyhow::bail!(
                "no partition went live within 120 s:\n{}",
                json_log(&log)?.trouble(20)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Let the blocking tasks reach every worker.
    std::thread::sleep(Duration::from_millis(500));
    Ok((run, log))
}

/// The first event of `log` with `message`, waiting up to `limit` for it.
fn wait_for_event(log: &Path, message: &str, limit: Duration) -> Result<Option<LogEvent>> {
    let t0 = Instant::now();
    loop {
        if let Some(e) = json_log(log)?.with_message(message).next() {
            return Ok(Some(e.clone()));
        }
        if t0.elapsed() > limit {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

const SIGNAL_SEEN: &str = "signal received: stopping (a second signal exits at once)";

#[test]
fn sigterm_to_a_blocked_runtime_ends_at_the_hard_stop() -> Result<()> {
    let Some(bootstrap) =
        kafka_support::broker("sigterm_to_a_blocked_runtime_ends_at_the_hard_stop")
    else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let (mut run, log) = blocked_run(&bootstrap, dir.path(), "signal-hard-stop")?;
    let child = &mut run.0;
    let term = Instant::now();
    send_sigterm(child)?;
    let seen = wait_for_event(&log, SIGNAL_SEEN, Duration::from_secs(10))?;
    ensure!(
        seen.is_some(),
        "SIGTERM not seen within 10 s while the runtime is blocked:\n{}",
        json_log(&log)?.trouble(20)
    );
    let hard_stop = SHUTDOWN_DEADLINE + SHUTDOWN_GRACE;
    let status = wait_exit(child, hard_stop + Duration::from_secs(15))?;
    let took = term.elapsed();
    let Some(status) = status else {
        anyhow::bail!("still running {took:?} after SIGTERM (hard stop {hard_stop:?})");
    };
    ensure!(
        status.code() == Some(1),
        "exit {status} after {took:?}, want exit code 1 from the hard stop"
    );
    ensure!(
        took >= hard_stop,
        "exited {took:?} after SIGTERM, before the hard stop ({hard_stop:?}): the drill did not block the stop"
    );
    let log: JsonLog = json_log(&log)?;
    let error = log
        .events
        .iter()
        .find(|e| {
            e.level == "ERROR"
                && e.message
                    .starts_with("settle run did not stop within runtime.shutdown-deadline + 30 s")
        })
        .with_context(|| format!("no hard-stop error line:\n{}", log.trouble(20)))?;
    ensure!(
        error.int("limit_ms") == Some(hard_stop.as_millis() as i64),
        "hard stop line: {}",
        error.brief()
    );
    ensure!(
        log.with_message("settle run stopped").next().is_none(),
        "a blocked runtime cannot have stopped cleanly"
    );
    println!("SIGTERM to a blocked runtime: signal seen, hard stop after {took:?}");
    Ok(())
}

#[test]
fn a_second_sigterm_to_a_blocked_runtime_exits_at_once() -> Result<()> {
    let Some(bootstrap) =
        kafka_support::broker("a_second_sigterm_to_a_blocked_runtime_exits_at_once")
    else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let (mut run, log) = blocked_run(&bootstrap, dir.path(), "signal-second")?;
    let child = &mut run.0;
    send_sigterm(child)?;
    ensure!(
        wait_for_event(&log, SIGNAL_SEEN, Duration::from_secs(10))?.is_some(),
        "SIGTERM not seen within 10 s while the runtime is blocked:\n{}",
        json_log(&log)?.trouble(20)
    );
    send_sigterm(child)?;
    let Some(status) = wait_exit(child, Duration::from_secs(10))? else {
        anyhow::bail!("still running 10 s after the second SIGTERM");
    };
    ensure!(status.code() == Some(130), "exit {status}, want 130");
    let log = json_log(&log)?;
    ensure!(
        log.with_message("second signal: exiting now (exit code 130)")
            .next()
            .is_some(),
        "no second-signal line:\n{}",
        log.trouble(20)
    );
    Ok(())
}
