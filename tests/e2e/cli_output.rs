//! The command line as a shell user meets it: `settle inspect --session` prints only the
//! session and fails when it is nowhere, and every tool that prints ends quietly with status
//! 0 when the reader of its standard output has gone (`settle inspect | head`), instead of
//! `error: Broken pipe (os error 32)`; `settle run` ends its log with `settle run stopped`;
//! `settle consume --nats` prints what was published on a subject. Real `settle` child
//! processes; only the last needs a broker (NATS, `SETTLE_TEST_NATS`).

use crate::nats_support::{server, Setup};
use crate::process_support::{json_log, sigterm, start_run_logged};
use anyhow::{ensure, Context as _, Result};
use settle::transport::nats::{Storage, KEY_HEADER};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn settle() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_settle"));
    c.env("SETTLE_LOG", "warn").stdin(Stdio::null());
    c
}

/// The write end of a pipe whose only reader has already exited: every write to it fails
/// with `EPIPE`, whenever the child writes (no race with the reader's exit).
fn closed_pipe() -> Result<Stdio> {
    let mut reader = Command::new("true")
        .stdin(Stdio::piped())
        .spawn()
        .context("spawn true")?;
    let write_end = reader.stdin.take().context("the reader's stdin")?;
    ensure!(reader.wait()?.success(), "true failed");
    Ok(Stdio::from(write_end))
}

/// A data directory with the stores of `settle run-file` over two sessions of tenant `t`,
/// every round emitted (their state stays for `state-ttl`).
fn stores(dir: &Path) -> Result<std::path::PathBuf> {
    let trace = dir.join("trace.jsonl");
    // Now: state older than `state-ttl` (24 h) would expire at once.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();
    std::fs::write(
        &trace,
        format!(
            "{{\"tenant\":\"t\",\"session\":\"s1\",\"event_id\":\"a\",\"ts\":{now}}}\n\
             {{\"tenant\":\"t\",\"session\":\"s2\",\"event_id\":\"b\",\"ts\":{now}}}\n"
        ),
    )?;
    let config = dir.join("settle.toml");
    std::fs::write(
        &config,
        "[debounce]\npolicy = \"fixed\"\ndelay = \"10ms\"\n",
    )?;
    let data = dir.join("data");
    let status = settle()
        .arg("run-file")
        .arg("--input")
        .arg(&trace)
        .arg("--data-dir")
        .arg(&data)
        .arg("--output")
        .arg(dir.join("ready.jsonl"))
        .arg("--config")
        .arg(&config)
        .args(["--partitions", "2"])
        .stdout(Stdio::null())
        .status()
        .context("settle run-file")?;
    ensure!(status.success(), "run-file: {status}");
    Ok(data)
}

fn output(c: &mut Command) -> Result<(Output, String, String)> {
    let out = c.output().context("settle")?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    Ok((out, stdout, stderr))
}

#[test]
fn inspect_session_prints_only_it_and_fails_when_absent() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let data = stores(dir.path())?;
    let (out, stdout, stderr) = output(
        settle()
            .arg("inspect")
            .arg("--data-dir")
            .arg(&data)
            .args(["--session", "t/s1"]),
    )?;
    ensure!(out.status.success(), "{:?}: {stderr}", out.status);
    let first = stdout.lines().next().unwrap_or_default();
    ensure!(
        first.starts_with("uploads/") && first.contains(&data.display().to_string()),
        "the store it lives in comes first: {stdout}"
    );
    ensure!(stdout.contains("session t/s1 (partition "), "{stdout}");
    ensure!(stdout.contains("last event_id   a"), "{stdout}");
    for other in ["next offset", "t/s2", "tiers"] {
        ensure!(!stdout.contains(other), "{other} printed: {stdout}");
    }

    let (out, stdout, stderr) = output(
        settle()
            .arg("inspect")
            .arg("--data-dir")
            .arg(&data)
            .args(["--session", "t/nope"]),
    )?;
    ensure!(out.status.code() == Some(1), "{:?}", out.status);
    ensure!(stdout.is_empty(), "{stdout}");
    ensure!(
        stderr.contains("session t/nope: no state in any store read")
            && stderr.contains("uploads/0, uploads/1"),
        "{stderr}"
    );
    Ok(())
}

#[test]
fn printing_into_a_closed_pipe_exits_quietly() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let data = stores(dir.path())?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let traces = root.join("examples/traces");
    let commands: Vec<Vec<std::ffi::OsString>> = vec![
        vec!["inspect".into(), "--data-dir".into(), data.clone().into()],
        vec![
            "inspect".into(),
            "--data-dir".into(),
            data.into(),
            "--session".into(),
            "t/s1".into(),
        ],
        vec![
            "check-config".into(),
            root.join("config/settle.toml").into(),
        ],
        vec![
            "simulate".into(),
            "--input".into(),
            traces.join("burst-700.jsonl").into(),
        ],
        vec![
            "tune".into(),
            "--input".into(),
            traces.join("trickle.jsonl").into(),
        ],
    ];
    for args in commands {
        let (out, _, stderr) = output(settle().args(&args).stdout(closed_pipe()?))?;
        ensure!(
            out.status.success() && !stderr.contains("Broken pipe") && !stderr.contains("panicked"),
            "settle {args:?}: {:?}, stderr: {stderr}",
            out.status
        );
    }
    Ok(())
}

#[test]
fn a_graceful_stop_logs_stopped_last() -> Result<()> {
    // No broker behind the address: settle runs, owns nothing, and stops on SIGTERM.
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("settle.toml");
    std::fs::write(
        &config,
        format!(
            "[kafka]\nbootstrap-servers = \"127.0.0.1:1\"\n[store]\ndata-dir = {:?}\n\
             [admin]\nenabled = false\n",
            dir.path().join("data")
        ),
    )?;
    let log = dir.path().join("run.log");
    let mut child = start_run_logged(&config, &[], &log)?;
    let started = Instant::now();
    while json_log(&log)?
        .with_message("settle run starting on kafka")
        .next()
        .is_none()
    {
        ensure!(
            child.try_wait()?.is_none(),
            "settle run exited: {:?}",
            json_log(&log)?.other
        );
        ensure!(started.elapsed() < Duration::from_secs(30), "no start line");
        std::thread::sleep(Duration::from_millis(100));
    }
    sigterm(&mut child, Duration::from_secs(30))?;
    let events = json_log(&log)?.events;
    let last = events.last().context("an empty log")?;
    ensure!(
        last.message == "settle run stopped" && last.level == "INFO",
        "last line: {} {:?}",
        last.message,
        last.fields
    );
    Ok(())
}

/// Runs `c` to its end within 60 s (killed and failed after that): its stdout.
fn stdout_within_a_minute(c: &mut Command) -> Result<String> {
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let started = Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            anyhow::bail!("still running after 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

#[test]
fn consume_nats_prints_what_was_published() -> Result<()> {
    let Some(addr) = server("consume_nats_prints_what_was_published") else {
        return Ok(());
    };
    let rt = tokio::runtime::Runtime::new()?;
    let setup = rt.block_on(Setup::new(&addr, "consume", Storage::Memory, 1))?;
    let subject = setup.tier_subject("normal").to_owned();
    let published: Vec<(String, String)> = (0..3)
        .map(|i| {
            let value =
                format!(r#"{{"tenant":"acme","session":"s{i}","emission_id":"acme/s{i}/1"}}"#);
            (format!("acme/s{i}"), value)
        })
        .collect();
    let mut sequences = Vec::new();
    for (key, value) in &published {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(KEY_HEADER, key.as_str());
        let ack = rt.block_on(async {
            setup
                .js
                .publish_with_headers(subject.clone(), headers, value.clone().into())
                .await?
                .await
        })?;
        sequences.push(ack.sequence);
    }
    let consume = |meta: bool| {
        let mut c = settle();
        c.args(["consume", "--nats", &setup.nats.servers, "-t", &subject])
            .args(["--from-beginning", "--exit-at-end"]);
        if meta {
            c.arg("--with-meta");
        }
        stdout_within_a_minute(&mut c)
    };
    let plain: Vec<serde_json::Value> = consume(false)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let want: Vec<serde_json::Value> = published
        .iter()
        .map(|(_, v)| serde_json::from_str(v))
        .collect::<Result<_, _>>()?;
    ensure!(plain == want, "{plain:?}");
    let meta: Vec<serde_json::Value> = consume(true)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    ensure!(meta.len() == 3, "{meta:?}");
    for (i, m) in meta.iter().enumerate() {
        ensure!(
            m["topic"] == subject.as_str()
                && m["offset"] == sequences[i]
                && m["key"] == published[i].0.as_str()
                && m["headers"][KEY_HEADER] == published[i].0.as_str()
                && m["timestamp"].as_i64().is_some_and(|t| t > 0)
                && m["value"] == want[i],
            "{m}"
        );
    }
    rt.block_on(setup.cleanup());
    Ok(())
}
