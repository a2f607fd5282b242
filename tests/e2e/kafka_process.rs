//! `settle loadgen` → `settle run` as real processes on a real Kafka broker (issue 4):
//!
//! 1. a `settle run` process consumes while a `settle loadgen` process produces live traffic
//!    (every scenario of the demo, several tenants, one of them leading-trailing);
//! 2. mid-stream the `settle run` process is killed with SIGKILL and a new one is started on
//!    the same stores and consumer group;
//! 3. when the traffic is over and every round is out, the second process gets SIGTERM.
//!
//! Checks: the output topic holds exactly the emissions `settle simulate` computes for the
//! input topic read back with its broker timestamps (replay equals live), each emission id
//! at most twice (once before the kill, once re-published from the outbox after it); the
//! SIGTERM exit is clean and within the shutdown deadline, and the group's committed offsets
//! are then the partitions' ends.
//!
//! The delays (4 s and more) are longer than any gap inside a session of the load generator's
//! scenarios (≤ 3 s), so no upload lands within the pipeline's latency of a deadline: live
//! and replay must then agree exactly, whatever the scheduling.
//!
//! `SETTLE_TEST_KAFKA=host:port` runs it (scripts/test.sh sets it); under CI a missing
//! broker is a failure.

use crate::kafka_support;
use crate::process_support;

use anyhow::{ensure, Context as _, Result};
use kafka_support::{broker, by_id, emitted, fresh_topics, reference, same_emissions, trace_of};
use process_support::{settle, sigterm, start_run, wait_exit, wait_for_rounds};
use settle::cli::loadgen;
use settle::config::Config;
use settle::engine::Emission;
use settle::transport::kafka::KafkaConfig;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Input partitions.
const PARTITIONS: i32 = 3;

/// Bound on any one wait on the broker or a process.
const STEP: Duration = Duration::from_secs(180);

/// `[runtime] shutdown-deadline` of the settle processes.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);

fn config_text(kafka: &KafkaConfig, output: &str, data_dir: &Path) -> String {
    process_support::kafka_config_text(kafka, output, data_dir, SHUTDOWN_DEADLINE, 6_000)
}

/// Emissions on the output topic so far (no minimum).
fn emitted_now(
    rt: &tokio::runtime::Runtime,
    kafka: &KafkaConfig,
    output: &str,
) -> Result<Vec<(Emission, i64)>> {
    rt.block_on(emitted(kafka, output, "normal", 0, STEP))
}

#[test]
fn kafka_loadgen_run_sigkill_restart_sigterm() -> Result<()> {
    let Some(bootstrap) = broker("kafka_loadgen_run_sigkill_restart_sigterm") else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (kafka, output) = fresh_topics(&rt, &bootstrap, "process", PARTITIONS)?;
    let dir = tempfile::tempdir()?;
    let config_path: PathBuf = dir.path().join("settle.toml");
    let text = config_text(&kafka, &output, &dir.path().join("data"));
    std::fs::write(&config_path, &text)?;
    let config = Config::load(Some(&config_path)).context("the test's config")?;

    // settle run, then live traffic: ~12 s of the mixed scenarios over 4 tenants.
    let mut first = start_run(&config_path, &[])?;
    let mut gen = process_support::kafka_loadgen(&bootstrap, &kafka.input_topic, "12s", "4", "5")
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
    let at_kill = emitted_now(&rt, &kafka, &output)?.len();
    ensure!(at_kill > 0, "nothing was emitted before the kill");
    println!("killed settle run with SIGKILL after 6 s, {at_kill} emissions out");
    let mut second = start_run(&config_path, &[])?;

    let status = wait_exit(&mut gen, STEP)?.context("loadgen did not finish")?;
    ensure!(status.success(), "loadgen failed: {status}");

    // Every round of the input, as `settle simulate` sees it.
    let input = rt.block_on(loadgen::read_topic(&kafka, &kafka.input_topic, 1, STEP))?;
    let want = by_id(reference(&config, &trace_of(&input)?)?);
    ensure!(want.len() > at_kill, "too few rounds: {}", want.len());

    // Wait until every round is out (at most 4 s + catch-up after the last upload).
    let got = wait_for_rounds(
        &mut second,
        want.len(),
        STEP,
        || emitted_now(&rt, &kafka, &output),
        |(e, _)| e.emission_id(),
    )?;

    // SIGTERM: a clean exit within the shutdown deadline, offsets committed.
    let stopped_in = sigterm(&mut second, SHUTDOWN_DEADLINE)?;
    let committed = rt.block_on(loadgen::committed_offsets(
        &kafka,
        &kafka.input_topic,
        PARTITIONS,
    ))?;
    let ends = kafka_support::partition_ends(&input, PARTITIONS);
    ensure!(
        committed == ends,
        "committed {committed:?}, partition ends {ends:?}"
    );

    // Replay equals live; each emission id at most twice, both copies equal.
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    let mut distinct: BTreeMap<String, Emission> = BTreeMap::new();
    for (e, _) in got {
        *count.entry(e.emission_id()).or_default() += 1;
        if let Some(prev) = distinct.insert(e.emission_id(), e.clone()) {
            ensure!(prev == e, "two different emissions {}", e.emission_id());
        }
    }
    ensure!(
        count.values().all(|&n| n <= 2),
        "an emission id was published more than twice: {:?}",
        count.iter().filter(|(_, &n)| n > 2).collect::<Vec<_>>()
    );
    let twice = count.values().filter(|&&n| n == 2).count();
    same_emissions(&by_id(distinct.into_values().collect()), &want)?;

    // `settle consume` prints the same records, one JSON line each.
    let printed = process_support::consume_topic(&bootstrap, &output)?;
    let lines = process_support::lines_of(&printed);
    ensure!(
        lines.len() == count.values().sum::<usize>(),
        "settle consume printed {} records, the topic holds {}",
        lines.len(),
        count.values().sum::<usize>()
    );
    for l in &lines {
        let ready = settle::codec::decode_ready(l).context("a line of settle consume")?;
        ensure!(
            count.contains_key(&ready.emission_id),
            "unknown {}",
            ready.emission_id
        );
    }
    println!(
        "{} uploads, {} rounds, all emitted across SIGKILL + restart ({twice} published twice); SIGTERM exit in {:.2} s, committed {committed:?}",
        input.len(),
        want.len(),
        stopped_in.as_secs_f64()
    );
    Ok(())
}

/// A partition whose store cannot be opened stops the process with a non-zero exit and the
/// reason, instead of leaving its partitions owned and idle.
#[test]
fn kafka_run_exits_when_a_store_cannot_open() -> Result<()> {
    let Some(bootstrap) = broker("kafka_run_exits_when_a_store_cannot_open") else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let (kafka, output) = fresh_topics(&rt, &bootstrap, "storefail", PARTITIONS)?;
    let dir = tempfile::tempdir()?;
    // The data dir lies below a regular file: no store can be created there.
    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, b"")?;
    let config_path = dir.path().join("settle.toml");
    std::fs::write(
        &config_path,
        config_text(&kafka, &output, &blocker.join("data")),
    )?;
    let child = settle()
        .args(["run", "--config"])
        .arg(&config_path)
        .env("SETTLE_LOG", "warn")
        .stderr(Stdio::piped())
        .spawn()?;
    let out = child.wait_with_output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success(),
        "settle run exited with {} though no store could open",
        out.status
    );
    ensure!(
        stderr.contains("failed") && stderr.contains("partition store"),
        "the exit does not say why:\n{stderr}"
    );
    Ok(())
}

/// Issue 19: stores whose offsets are past the end of their topics (the broker's log started
/// over: memory storage restarted, topics re-created) stop `settle run` with exit code 1 and
/// an error naming the topic, the partition, both offsets and what to do, instead of
/// dropping every new record below the stored offset without a word (input), or of waiting
/// forever for changelog records that are gone (changelog).
///
/// Runs a tansu broker of its own (`process_support::tansu_bin`; the shared broker is never
/// restarted): settle emits the rounds of some traffic and stops; the broker is restarted
/// empty, the same topics are created again and fewer uploads produced; settle is started
/// on the same data dir, first as configured (the changelog's check stops it: restore comes
/// before input), then with the changelog off (the input's check stops it).
#[test]
fn kafka_run_stops_when_the_input_topic_started_over() -> Result<()> {
    let Some(bin) = process_support::tansu_bin("kafka_run_stops_when_the_input_topic_started_over")
    else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let dir = tempfile::tempdir()?;
    let mut tansu = process_support::Tansu::start(&bin, &dir.path().join("tansu.log"))?;
    let bootstrap = tansu.bootstrap.clone();
    let (kafka, output) = fresh_topics(&rt, &bootstrap, "startover", 2)?;
    let config_path = dir.path().join("settle.toml");
    std::fs::write(
        &config_path,
        config_text(&kafka, &output, &dir.path().join("data")),
    )?;
    let config = Config::load(Some(&config_path)).context("the test's config")?;
    let produce = |duration: &str, seed: &str| -> Result<Vec<loadgen::TopicRecord>> {
        let mut gen =
            process_support::kafka_loadgen(&bootstrap, &kafka.input_topic, duration, "2", seed);
        let status = gen.status().context("settle loadgen")?;
        ensure!(status.success(), "loadgen failed: {status}");
        rt.block_on(loadgen::read_topic(&kafka, &kafka.input_topic, 1, STEP))
    };
    let ends_of = |input: &[loadgen::TopicRecord]| -> BTreeMap<i32, i64> {
        kafka_support::partition_ends(input, 2)
            .into_iter()
            .enumerate()
            .map(|(p, end)| (p as i32, end.unwrap_or(0)))
            .collect()
    };

    // First life of the topics: every round out, then a clean stop.
    let input = produce("2s", "3")?;
    let want = by_id(reference(&config, &trace_of(&input)?)?);
    process_support::run_until_rounds(
        &config_path,
        want.len(),
        STEP,
        || emitted_now(&rt, &kafka, &output),
        |(e, _)| e.emission_id(),
        SHUTDOWN_DEADLINE,
    )?;
    let stored = ends_of(&input);
    let changelog = kafka
        .changelog()
        .context("the changelog is on by default")?;
    let checkpoints = ends_of(&rt.block_on(loadgen::read_topic(&kafka, &changelog, 1, STEP))?);

    // The broker starts over: an empty cluster, the same topics, fewer uploads.
    tansu.restart()?;
    kafka_support::create_topics_of(&rt, &kafka, &output, 2)?;
    let again = produce("1s", "4")?;
    let ends = ends_of(&again);
    ensure!(
        stored.iter().all(|(p, next)| ends[p] < *next),
        "the second life must be shorter: stored {stored:?}, ends {ends:?}"
    );

    let changelog_errors = process_support::run_expecting_started_over(
        &config_path,
        "changelog",
        &changelog,
        &checkpoints,
        &BTreeMap::new(),
        STEP,
    )?;
    let text = std::fs::read_to_string(&config_path)?;
    let dlq = format!("dead-letter-topic = \"{}\"", kafka.dead_letter_topic);
    ensure!(
        text.contains(&dlq),
        "the config names the dead-letter topic"
    );
    std::fs::write(
        &config_path,
        text.replace(&dlq, &format!("{dlq}\nchangelog-topic = \"\"")),
    )?;
    let errors = process_support::run_expecting_started_over(
        &config_path,
        "input",
        &kafka.input_topic,
        &stored,
        &ends,
        STEP,
    )?;
    let out = emitted_now(&rt, &kafka, &output)?;
    ensure!(
        out.is_empty(),
        "emissions after the broker started over: {out:?}"
    );
    println!(
        "changelog checkpoints {checkpoints:?}, changelog empty: settle run exited 1 with\n{changelog_errors}"
    );
    println!("stores at {stored:?}, topic ends {ends:?}: settle run exited 1 with\n{errors}");
    Ok(())
}
