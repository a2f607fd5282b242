//! `settle loadgen --nats` → `settle run` on NATS JetStream as real processes (issue 7):
//!
//! 1. a `settle run` process (`transport = "nats"` in its config) consumes while a
//!    `settle loadgen --nats` process publishes live traffic (every scenario of the demo,
//!    several tenants, one of them leading-trailing) and writes its trace;
//! 2. mid-stream the `settle run` process is killed with SIGKILL and a new one is started
//!    (`--transport nats`) on the same stores and durable consumers;
//! 3. when the traffic is over and every round is out, the second process gets SIGTERM.
//!
//! Checks: the tier subject holds exactly the emissions `settle simulate` computes for the
//! input stream read back with its JetStream timestamps (replay equals live), each emission
//! id exactly once (re-published emissions are dropped by JetStream's duplicate window);
//! loadgen's trace names the same messages with the same timestamps; the SIGTERM exit is
//! clean and within the shutdown deadline, and then every consumer has nothing pending or
//! unacked.
//!
//! The delays (4 s and more) are longer than any gap inside a session of the load
//! generator's scenarios (≤ 3 s), so no upload lands within the pipeline's latency of a
//! deadline: live and replay must then agree exactly, whatever the scheduling.
//!
//! Uses the server of `SETTLE_TEST_NATS`, else 127.0.0.1:4222; under CI a missing server is
//! a failure. `SETTLE_TEST_RUN_LOG` is the `SETTLE_LOG` of the settle processes (`warn`).

use crate::kafka_support;
use crate::nats_support;
use crate::process_support;

use anyhow::{ensure, Context as _, Result};
use kafka_support::{by_id, reference, same_emissions};
use nats_support::{server, trace_of, Setup, STEP};
use process_support::{sigterm, start_run, wait_exit, wait_for_rounds};
use settle::config::Config;
use settle::engine::Emission;
use settle::transport::nats::Storage;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

/// `[runtime] shutdown-deadline` of the settle processes.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);

fn config_text(setup: &Setup, data_dir: &Path) -> String {
    format!(
        "transport = \"nats\"\n{}{}",
        process_support::debounce_store_runtime(data_dir, SHUTDOWN_DEADLINE),
        setup.run_config_sections(0, 1)
    )
}

#[test]
fn nats_loadgen_run_sigkill_restart_sigterm() -> Result<()> {
    let Some(addr) = server("nats_loadgen_run_sigkill_restart_sigterm") else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let setup = rt.block_on(Setup::new(&addr, "proc", Storage::Memory, 3))?;
    let dir = tempfile::tempdir()?;
    let config_path = dir.path().join("settle.toml");
    std::fs::write(&config_path, config_text(&setup, &dir.path().join("data")))?;
    let config = Config::load(Some(&config_path)).context("the test's config")?;
    let emitted_now = || -> Result<Vec<Emission>> { rt.block_on(setup.emitted("normal", 0)) };

    // settle run, then live traffic: ~12 s of the mixed scenarios over 4 tenants.
    let mut first = start_run(&config_path, &[])?;
    let trace_path = dir.path().join("trace.jsonl");
    let mut gen = process_support::nats_loadgen(&setup.nats, "12s", "4", "5")
        .arg("--trace-out")
        .arg(&trace_path)
        .spawn()
        .context("spawn settle loadgen")?;

    // SIGKILL 6 s into the traffic (rounds of 4 s are out by then), while it still flows.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(6) {
        ensure!(
            first.try_wait()?.is_none(),
            "settle run exited early: {:?}",
            first.try_wait()?
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    first.kill()?; // SIGKILL
    first.wait()?;
    ensure!(
        gen.try_wait()?.is_none(),
        "loadgen finished before the kill: make the traffic longer"
    );
    let at_kill = emitted_now()?.len();
    ensure!(at_kill > 0, "nothing was emitted before the kill");
    println!("killed settle run with SIGKILL after 6 s, {at_kill} emissions out");
    let mut second = start_run(&config_path, &["--transport", "nats"])?;

    let status = wait_exit(&mut gen, STEP)?.context("loadgen did not finish")?;
    ensure!(status.success(), "loadgen failed: {status}");

    // Every round of the input, as `settle simulate` sees it.
    let input = rt.block_on(setup.input(1))?;
    let want = by_id(reference(
        &config,
        &trace_of(&input, setup.nats.partitions)?,
    )?);
    ensure!(want.len() > at_kill, "too few rounds: {}", want.len());
    // loadgen's trace names the same messages, with their JetStream timestamps.
    let traced: BTreeSet<(i64, i64, i64)> = std::fs::read_to_string(&trace_path)?
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l)?;
            let field = |k: &str| v[k].as_i64().with_context(|| format!("{k} in {l}"));
            Ok((field("ts")?, field("partition")?, field("offset")?))
        })
        .collect::<Result<_>>()?;
    let stored: BTreeSet<(i64, i64, i64)> = input
        .iter()
        .map(|r| {
            let p = i64::from(r.partition().unwrap_or(-1));
            (r.timestamp_ms, p, r.sequence as i64)
        })
        .collect();
    ensure!(
        traced == stored,
        "trace ({} lines) differs from the stream ({} messages)",
        traced.len(),
        stored.len()
    );

    // Wait until every round is out (at most 4 s + catch-up after the last upload).
    let got = wait_for_rounds(
        &mut second,
        want.len(),
        STEP,
        emitted_now,
        Emission::emission_id,
    )?;

    // SIGTERM: a clean exit within the shutdown deadline, every message acked.
    let stopped_in = sigterm(&mut second, SHUTDOWN_DEADLINE)?;
    let floors = rt.block_on(setup.consumers_settled())?;

    // Replay equals live; each emission id exactly once (JetStream de-duplication).
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for e in &got {
        *count.entry(e.emission_id()).or_default() += 1;
    }
    ensure!(
        count.values().all(|&n| n == 1),
        "emission ids published more than once: {:?}",
        count.iter().filter(|(_, &n)| n > 1).collect::<Vec<_>>()
    );
    same_emissions(&by_id(got), &want)?;
    println!(
        "{} uploads, {} rounds, each emitted exactly once across SIGKILL + restart; SIGTERM exit in {:.2} s, ack floors {floors:?}",
        input.len(),
        want.len(),
        stopped_in.as_secs_f64()
    );
    rt.block_on(setup.cleanup());
    Ok(())
}

/// Issue 19: stores whose next offsets are past the end of the input stream (the stream was
/// deleted and re-created) stop `settle run` with exit code 1 and an error naming the
/// stream, the partition, both offsets and what to do, instead of a consumer created at the
/// stored sequence skipping every new message below it without a word.
#[test]
fn nats_run_stops_when_the_input_stream_started_over() -> Result<()> {
    let Some(addr) = server("nats_run_stops_when_the_input_stream_started_over") else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let setup = rt.block_on(Setup::new(&addr, "over", Storage::Memory, 2))?;
    let dir = tempfile::tempdir()?;
    let config_path = dir.path().join("settle.toml");
    std::fs::write(&config_path, config_text(&setup, &dir.path().join("data")))?;
    let config = Config::load(Some(&config_path)).context("the test's config")?;
    let produce =
        |duration: &str, seed: &str| -> Result<Vec<settle::transport::nats::StreamRecord>> {
            let status = process_support::nats_loadgen(&setup.nats, duration, "2", seed)
                .status()
                .context("settle loadgen")?;
            ensure!(status.success(), "loadgen failed: {status}");
            rt.block_on(setup.input(1))
        };

    // First life of the stream: every round out, then a clean stop.
    let input = produce("3s", "3")?;
    let want = by_id(reference(
        &config,
        &trace_of(&input, setup.nats.partitions)?,
    )?);
    process_support::run_until_rounds(
        &config_path,
        want.len(),
        STEP,
        || rt.block_on(setup.emitted("normal", 0)),
        Emission::emission_id,
        SHUTDOWN_DEADLINE,
    )?;
    // Each partition's store holds the sequence after its last message.
    let mut stored: BTreeMap<i32, i64> = BTreeMap::new();
    for r in &input {
        let p = r.partition().context("input subject without a partition")?;
        let next = stored.entry(p).or_default();
        *next = (*next).max(r.sequence as i64 + 1);
    }

    // The stream starts over: deleted (with its consumers), created again, fewer uploads.
    rt.block_on(async {
        setup.js.delete_stream(&setup.nats.input_stream).await?;
        settle::transport::nats::ensure_input_stream(&setup.js, &setup.nats).await?;
        anyhow::Ok(())
    })?;
    let again = produce("1s", "4")?;
    let end = again
        .iter()
        .map(|r| r.sequence as i64 + 1)
        .max()
        .unwrap_or(1);
    ensure!(
        stored.values().all(|next| end < *next),
        "the second life must be shorter: stored {stored:?}, stream end {end}"
    );
    let ends: BTreeMap<i32, i64> = stored.keys().map(|p| (*p, end)).collect();

    let errors = process_support::run_expecting_started_over(
        &config_path,
        "input",
        &setup.nats.input_stream,
        &stored,
        &ends,
        STEP,
    )?;
    let out = rt.block_on(setup.emitted("normal", 0))?;
    ensure!(
        out.len() == want.len(),
        "emissions after the stream started over: {} (before: {})",
        out.len(),
        want.len()
    );
    println!("stores at {stored:?}, stream end {end}: settle run exited 1 with\n{errors}");
    rt.block_on(setup.cleanup());
    Ok(())
}
