//! settle end to end on a real Kafka broker: the partition runtime (RocksDB stores, outbox
//! publisher) over the Kafka transport, in process.
//!
//! 1. `kafka_pipeline_matches_simulate`: uploads of every scenario, produced with explicit
//!    timestamps, read back with their broker timestamps and replayed by `simulate::replay`;
//!    the output topic holds exactly the emissions the replay makes (every field but
//!    `emitted_at`), each with its key and `settle-emission-id` header.
//! 2. `kafka_bad_records_are_dead_lettered`: records that fail decoding land in the
//!    dead-letter topic with the reason and source headers; the uploads around them are
//!    applied.
//! 3. `kafka_restart_mid_stream_loses_no_round`: a settle instance killed mid-stream (its
//!    tokio runtime shut down, tasks dropped wherever they were) and a second one on the same
//!    stores and group: every round is emitted, no emission id more than twice.
//! 4. `kafka_graceful_stop_commits_offsets`: after a graceful stop the group's committed
//!    offsets are the partitions' ends, and a new instance re-reads nothing.
//!
//! `SETTLE_TEST_KAFKA=host:port` runs them (scripts/test.sh sets it); unset, they print that
//! they did not run (under CI, `CI` set, they fail). Set and no broker: they fail. `SETTLE_LOG` filters the log output.

use crate::kafka_support;
use crate::running_support;

use anyhow::{ensure, Context as _, Result};
use kafka_support::{broker, by_id, emitted, now_ms, reference, same_emissions, trace_of};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use running_support::Running;
use settle::cli::loadgen::{self, OutRecord, Scenario, Shape, TopicRecord};
use settle::config::Config;
use settle::engine::{Emission, Engine, Trigger};
use settle::runtime::{Runtime, RuntimeOptions, SystemClock};
use settle::transport::kafka::{
    KafkaConfig, KafkaSink, KafkaSource, DLQ_REASON_HEADER, DLQ_SOURCE_OFFSET_HEADER,
    DLQ_SOURCE_PARTITION_HEADER, DLQ_SOURCE_TOPIC_HEADER,
};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// Input partitions of every test topic.
const PARTITIONS: i32 = 3;

/// Bound on one step that talks to the broker or waits for the runtime.
const STEP: Duration = Duration::from_secs(120);

/// The debounce config of every test: adaptive with short delays and a max-wait, and a
/// leading-trailing tenant.
const CONFIG: &str = r#"
[debounce]
policy = "adaptive"
min-delay = "2s"
max-delay = "20s"
max-wait = "8s"
[debounce.tenants.lt]
policy = "leading-trailing"
delay = "5s"
"#;

/// Fresh topics and group for one test, and the output topic name.
struct Setup {
    kafka: KafkaConfig,
    output: String,
    config: Config,
}

impl Setup {
    async fn new(bootstrap: &str, name: &str) -> Result<Setup> {
        let id = format!("{name}-{}-{}", std::process::id(), now_ms());
        let mut kafka = KafkaConfig {
            bootstrap_servers: bootstrap.to_owned(),
            group_id: format!("{id}-group"),
            input_topic: format!("{id}-uploads"),
            dead_letter_topic: format!("{id}-dlq"),
            ..KafkaConfig::default()
        };
        kafka
            .properties
            .insert("session.timeout.ms".into(), "30000".into());
        kafka
            .properties
            .insert("heartbeat.interval.ms".into(), "1000".into());
        let output = format!("{id}-ready");
        let changelog = kafka.changelog().expect("on by default");
        loadgen::create_topics(
            &kafka,
            &[
                (&kafka.input_topic, PARTITIONS),
                (&kafka.dead_letter_topic, 1),
                (&output, 1),
                (&changelog, PARTITIONS),
            ],
        )
        .await?;
        Ok(Setup {
            kafka,
            output,
            config: Config::from_toml_str(CONFIG)?,
        })
    }

    fn options(&self, dir: &Path, catch_up_rate: u32) -> RuntimeOptions {
        let mut o = RuntimeOptions::from_config(&self.config);
        o.data_dir = dir.to_path_buf();
        o.tiers.tiers[0].topic = self.output.clone();
        o.batch_size = 500;
        o.idle_tick = Duration::from_millis(50);
        o.catch_up_rate = catch_up_rate;
        o.shutdown_deadline = Duration::from_secs(10);
        o
    }

    /// Starts settle on the current tokio runtime.
    fn start(&self, dir: &Path, catch_up_rate: u32) -> Result<Running> {
        let runtime = Runtime::new(
            Engine::new(self.config.policy_table()),
            KafkaSink::new(&self.kafka)?,
            SystemClock,
            self.options(dir, catch_up_rate),
        )?;
        let source = KafkaSource::new(&self.kafka)?;
        Ok(Running::spawn(runtime, source, PARTITIONS, STEP))
    }

    /// The input topic read back (with broker timestamps) as a `simulate` trace, sorted by
    /// timestamp; records that fail decoding (dead letters) are left out.
    async fn trace(&self, records: usize) -> Result<(Vec<TopicRecord>, String)> {
        let input =
            loadgen::read_topic(&self.kafka, &self.kafka.input_topic, records, STEP).await?;
        ensure!(
            input.len() == records,
            "read back {} of {records} uploads",
            input.len()
        );
        let trace = trace_of(&input)?;
        Ok((input, trace))
    }

    /// What `simulate::replay` emits for `trace`.
    fn reference(&self, trace: &str) -> Result<Vec<Emission>> {
        reference(&self.config, trace)
    }

    /// The output topic: each record checked (key, header, tier), decoded.
    async fn emitted(&self, at_least: usize) -> Result<Vec<(Emission, i64)>> {
        emitted(&self.kafka, &self.output, "normal", at_least, STEP).await
    }

    /// The group's committed offsets of every input partition (`None`: none).
    async fn committed(&self) -> Result<Vec<Option<i64>>> {
        loadgen::committed_offsets(&self.kafka, &self.kafka.input_topic, PARTITIONS).await
    }

    /// Produces [`plan`]`(seed)` (an hour ago) and reads it back: the records, the input
    /// topic and its `simulate` trace.
    async fn produce_plan(&self, seed: u64) -> Result<(Vec<OutRecord>, Vec<TopicRecord>, String)> {
        let records = plan(seed, now_ms() - 3_600_000);
        loadgen::produce_all(&self.kafka, &self.kafka.input_topic, &records).await?;
        let (input, trace) = self.trace(records.len()).await?;
        Ok((records, input, trace))
    }
}

/// Every scenario at a small scale, a leading-trailing tenant and `final` uploads, starting
/// at `t0` (ms): `(timestamp, record)` sorted by time.
fn plan(seed: u64, t0: i64) -> Vec<OutRecord> {
    let mut rng = StdRng::seed_from_u64(seed);
    let shape = Shape {
        burst_machines: 60,
        ..Shape::default()
    };
    let mut uploads: Vec<(i64, String, String)> = Vec::new();
    let mut add = |start: i64, plan: Vec<loadgen::PlannedUpload>| {
        for u in plan {
            uploads.push((start + u.at_ms as i64, u.key, u.json));
        }
    };
    for s in 0..4 {
        let p = Scenario::Burst.session(&mut rng, "burst", &format!("build-{s}"), &shape);
        add(t0 + s * 5_000, p);
    }
    for s in 0..30 {
        let start = t0 + rng.random_range(0..60_000);
        add(
            start,
            Scenario::Split.session(&mut rng, "split", &format!("run-{s}"), &shape),
        );
    }
    for (tenant, n) in [("trickle", 8), ("lt", 6)] {
        for s in 0..n {
            let start = t0 + rng.random_range(0..20_000);
            add(
                start,
                Scenario::Trickle.session(&mut rng, tenant, &format!("nightly-{s}"), &shape),
            );
        }
    }
    for s in 0..40 {
        let start = t0 + rng.random_range(0..60_000);
        let tenant = format!("t-{:02}", s % 20);
        add(
            start,
            Scenario::Tenants.session(&mut rng, &tenant, &format!("s{s}"), &shape),
        );
    }
    for s in 0..5 {
        let start = t0 + rng.random_range(0..20_000);
        let mut p = Scenario::Trickle.session(&mut rng, "fin", &format!("job-{s}"), &shape);
        let last = p.last().map_or(0, |u| u.at_ms) + 500;
        p.push(loadgen::PlannedUpload {
            at_ms: last,
            key: format!("fin/job-{s}"),
            json: loadgen::upload_json("fin", &format!("job-{s}"), "done", r#","final":true"#),
        });
        add(start, p);
    }
    uploads.sort();
    uploads
        .into_iter()
        .map(|(ts, key, json)| OutRecord {
            key: Some(key.into_bytes()),
            payload: json.into_bytes(),
            timestamp_ms: Some(ts),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_pipeline_matches_simulate() -> Result<()> {
    let Some(bootstrap) = broker("kafka_pipeline_matches_simulate") else {
        return Ok(());
    };
    let setup = Setup::new(&bootstrap, "pipeline").await?;
    let (records, _, trace) = setup.produce_plan(11).await?;
    let want = by_id(setup.reference(&trace)?);

    let dir = tempfile::tempdir()?;
    let running = setup.start(dir.path(), 0)?;
    let status = running.until_idle().await?;
    let consumed: u64 = status.values().map(|s| s.records).sum();
    ensure!(
        consumed == records.len() as u64,
        "consumed {consumed} of {}",
        records.len()
    );
    running.stop().await?;

    let emitted = setup.emitted(want.len()).await?;
    let got = by_id(emitted.into_iter().map(|(e, _)| e).collect());
    same_emissions(&got, &want)?;
    let triggers: std::collections::BTreeSet<_> = got.iter().map(|e| e.trigger).collect();
    println!(
        "kafka: {} uploads -> {} emissions equal to simulate (triggers {triggers:?})",
        records.len(),
        got.len()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_bad_records_are_dead_lettered() -> Result<()> {
    let Some(bootstrap) = broker("kafka_bad_records_are_dead_lettered") else {
        return Ok(());
    };
    let setup = Setup::new(&bootstrap, "dlq").await?;
    let t0 = now_ms() - 600_000;
    // Per key: a good upload, three bad records, a good upload: all in the key's partition.
    let mut records = Vec::new();
    let mut bad = BTreeMap::new();
    for (i, key) in ["dl/a", "dl/b", "dl/c", "dl/d"].into_iter().enumerate() {
        let session = &key[3..];
        let good = |id: &str| loadgen::upload_json("dl", session, id, "").into_bytes();
        let ts = t0 + i as i64 * 1_000;
        let recs = [
            (good("u1"), None),
            (b"not json".to_vec(), Some("invalid_json")),
            (
                format!(r#"{{"session":"{session}"}}"#).into_bytes(),
                Some("missing_tenant"),
            ),
            (
                br#"{"tenant":"dl","session":"other"}"#.to_vec(),
                Some("key_mismatch"),
            ),
            (good("u2"), None),
        ];
        for (j, (payload, reason)) in recs.into_iter().enumerate() {
            if let Some(reason) = reason {
                bad.insert((key.to_owned(), payload.clone()), reason);
            }
            records.push(OutRecord {
                key: Some(key.as_bytes().to_vec()),
                payload,
                timestamp_ms: Some(ts + j as i64 * 100),
            });
        }
    }
    loadgen::produce_all(&setup.kafka, &setup.kafka.input_topic, &records).await?;
    let (input, trace) = setup.trace(records.len()).await?;
    let want = by_id(setup.reference(&trace)?);

    let dir = tempfile::tempdir()?;
    let running = setup.start(dir.path(), 0)?;
    let status = running.until_idle().await?;
    let dead: u64 = status.values().map(|s| s.dead_letters).sum();
    ensure!(
        dead == bad.len() as u64,
        "{dead} dead letters, want {}",
        bad.len()
    );
    running.stop().await?;

    let dlq = loadgen::read_topic(
        &setup.kafka,
        &setup.kafka.dead_letter_topic,
        bad.len(),
        STEP,
    )
    .await?;
    ensure!(
        dlq.len() == bad.len(),
        "dead-letter topic holds {} records",
        dlq.len()
    );
    for d in &dlq {
        let key = String::from_utf8_lossy(d.key.as_deref().unwrap_or_default()).into_owned();
        let reason = bad
            .get(&(key.clone(), d.payload.clone()))
            .with_context(|| {
                format!(
                    "unexpected dead letter {key}: {:?}",
                    String::from_utf8_lossy(&d.payload)
                )
            })?;
        ensure!(
            d.header(DLQ_REASON_HEADER).as_deref() == Some(*reason),
            "{key}: reason {:?}",
            d.header(DLQ_REASON_HEADER)
        );
        ensure!(
            d.header(DLQ_SOURCE_TOPIC_HEADER).as_deref() == Some(setup.kafka.input_topic.as_str())
        );
        let source = input
            .iter()
            .find(|r| r.key == d.key && r.payload == d.payload)
            .context("the dead letter's source record")?;
        ensure!(d.header(DLQ_SOURCE_PARTITION_HEADER) == Some(source.partition.to_string()));
        ensure!(d.header(DLQ_SOURCE_OFFSET_HEADER) == Some(source.offset.to_string()));
        ensure!(d.timestamp_ms == source.timestamp_ms);
    }
    let got = by_id(
        setup
            .emitted(want.len())
            .await?
            .into_iter()
            .map(|(e, _)| e)
            .collect(),
    );
    same_emissions(&got, &want)?;
    ensure!(
        got.iter().all(|e| e.uploads == 2),
        "good uploads around the bad ones: {got:?}"
    );
    println!(
        "kafka: {} bad records dead-lettered with reasons; {} rounds emitted",
        dlq.len(),
        got.len()
    );
    Ok(())
}

/// Runs `f` on a fresh tokio runtime of its own.
fn on_runtime<T>(f: impl std::future::Future<Output = T>) -> Result<T> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(f))
}

#[test]
fn kafka_restart_mid_stream_loses_no_round() -> Result<()> {
    let Some(bootstrap) = broker("kafka_restart_mid_stream_loses_no_round") else {
        return Ok(());
    };
    // Two waves of the same sessions, 20 min apart (the second continues their generations).
    let t0 = now_ms() - 3_600_000;
    let first = plan(23, t0);
    let second = plan(29, t0 + 1_200_000);
    let (setup, first_rounds) = on_runtime(async {
        let setup = Setup::new(&bootstrap, "restart").await?;
        loadgen::produce_all(&setup.kafka, &setup.kafka.input_topic, &first).await?;
        let (_, trace) = setup.trace(first.len()).await?;
        let rounds = setup.reference(&trace)?.len();
        anyhow::Ok((setup, rounds))
    })??;
    let dir = tempfile::tempdir()?;

    // First instance: rounds released slowly (catch-up pacing, 20/s per partition), killed
    // (its tokio runtime shut down, every task dropped where it stood) once a quarter is out.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let running = rt.block_on(async { setup.start(dir.path(), 20) })?;
    let deadline = std::time::Instant::now() + STEP;
    let published = loop {
        let published: u64 = running
            .status
            .snapshot()
            .values()
            .map(|s| s.published)
            .sum();
        if published >= first_rounds as u64 / 4 {
            break published;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "first instance published {published} in {STEP:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    rt.shutdown_timeout(Duration::from_secs(10));
    println!("kafka: first instance killed after {published} of {first_rounds} emissions");
    ensure!(
        published < first_rounds as u64,
        "the first instance finished before the kill"
    );

    // The second wave arrives; a second instance on the same stores and group takes over.
    let (emitted, want, uploads) = on_runtime(async {
        loadgen::produce_all(&setup.kafka, &setup.kafka.input_topic, &second).await?;
        let uploads = first.len() + second.len();
        let (_, trace) = setup.trace(uploads).await?;
        let want = by_id(setup.reference(&trace)?);
        let running = setup.start(dir.path(), 0)?;
        running.until_idle().await?;
        running.stop().await?;
        anyhow::Ok((setup.emitted(want.len()).await?, want, uploads))
    })??;
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for (e, _) in &emitted {
        *count.entry(e.emission_id()).or_default() += 1;
    }
    let twice = count.values().filter(|&&n| n == 2).count();
    ensure!(
        count.values().all(|&n| n <= 2),
        "an emission id appears more than twice: {count:?}"
    );
    let mut distinct: BTreeMap<String, Emission> = BTreeMap::new();
    for (e, _) in emitted {
        if let Some(prev) = distinct.insert(e.emission_id(), e.clone()) {
            ensure!(
                prev == e,
                "two different emissions with id {}",
                e.emission_id()
            );
        }
    }
    let got = by_id(distinct.into_values().collect());
    same_emissions(&got, &want)?;
    println!(
        "kafka: {uploads} uploads, {} rounds all emitted across the restart; {twice} emission ids published twice",
        got.len()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_graceful_stop_commits_offsets() -> Result<()> {
    let Some(bootstrap) = broker("kafka_graceful_stop_commits_offsets") else {
        return Ok(());
    };
    let setup = Setup::new(&bootstrap, "commit").await?;
    let (_, input, _) = setup.produce_plan(5).await?;
    let mut ends = vec![None; PARTITIONS as usize];
    for r in &input {
        ends[r.partition as usize] = Some(r.offset + 1);
    }

    let dir = tempfile::tempdir()?;
    let running = setup.start(dir.path(), 0)?;
    running.until_idle().await?;
    running.stop().await?;
    let committed = setup.committed().await?;
    ensure!(
        committed == ends,
        "committed {committed:?}, partition ends {ends:?}"
    );

    // A new instance on the same stores resumes at the end: it reads and emits nothing.
    let running = setup.start(dir.path(), 0)?;
    let status = running.until_idle().await?;
    running.stop().await?;
    let again: u64 = status.values().map(|s| s.records + s.emissions).sum();
    ensure!(
        again == 0,
        "the second instance re-read or re-emitted: {status:#?}"
    );
    println!("kafka: graceful stop committed {committed:?}; a restart re-read nothing");
    Ok(())
}

/// `settle loadgen` arguments for `topic` on `kafka`'s broker.
fn loadgen_args(kafka: &KafkaConfig, topic: &str, rate: f64, seconds: u64) -> loadgen::LoadgenArgs {
    loadgen::LoadgenArgs {
        bootstrap_servers: kafka.bootstrap_servers.clone(),
        topic: topic.to_owned(),
        properties: Vec::new(),
        scenario: Scenario::Mix,
        rate,
        duration: Duration::from_secs(seconds),
        tenants: 50,
        sessions: None,
        burst_machines: 700,
        seed: 7,
        run_id: None,
        trace_out: None,
        create_topic: None,
        no_progress: true,
        nats: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_loadgen_trace_is_what_the_topic_holds() -> Result<()> {
    let Some(bootstrap) = broker("kafka_loadgen_trace_is_what_the_topic_holds") else {
        return Ok(());
    };
    let setup = Setup::new(&bootstrap, "loadgen").await?;
    let dir = tempfile::tempdir()?;
    let trace_path = dir.path().join("trace.jsonl");
    let mut args = loadgen_args(&setup.kafka, &setup.kafka.input_topic, 2_000.0, 3);
    args.trace_out = Some(trace_path.clone());
    let report = loadgen::run_async(&args).await?;
    println!("{report}");
    ensure!(report.failed == 0 && report.produced > 1_000, "{report:?}");
    ensure!(
        report.sessions.iter().filter(|&&n| n > 0).count() >= 3,
        "{report:?}"
    );

    let topic = loadgen::read_topic(
        &setup.kafka,
        &setup.kafka.input_topic,
        report.produced as usize,
        STEP,
    )
    .await?;
    ensure!(
        topic.len() as u64 == report.produced,
        "topic holds {}",
        topic.len()
    );
    let by_position: BTreeMap<(i32, i64), &TopicRecord> =
        topic.iter().map(|r| ((r.partition, r.offset), r)).collect();
    let text = std::fs::read_to_string(&trace_path)?;
    let mut lines = 0;
    for line in text.lines() {
        let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_str(line)?;
        let ts = v.remove("ts").and_then(|t| t.as_i64()).context("ts")?;
        let p = v
            .remove("partition")
            .and_then(|t| t.as_i64())
            .context("partition")? as i32;
        let o = v
            .remove("offset")
            .and_then(|t| t.as_i64())
            .context("offset")?;
        let r = by_position
            .get(&(p, o))
            .with_context(|| format!("no record at {p}/{o}"))?;
        let payload: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&r.payload)?;
        ensure!(
            payload == v && r.timestamp_ms == ts,
            "trace line {line} vs record {r:?}"
        );
        lines += 1;
    }
    ensure!(lines as u64 == report.produced, "{lines} trace lines");
    let mut rejected = 0;
    let stats = settle::cli::simulate::replay(
        Engine::new(setup.config.policy_table()),
        text.as_bytes(),
        |_| Ok(()),
        |_| rejected += 1,
    )?;
    ensure!(
        rejected == 0 && stats.uploads == report.produced && stats.late == 0,
        "{stats}"
    );
    println!("kafka: loadgen trace = topic ({lines} uploads); simulate replays it: {stats}");
    Ok(())
}

/// Throughput and lateness, printed (not asserted: STYLE §10). Run with
/// `SETTLE_TEST_KAFKA=127.0.0.1:9092 cargo test --release --test e2e -- --ignored --nocapture kafka_pipeline::kafka_measure`
/// (`SETTLE_MEASURE_UPLOADS`, default 200 000; `SETTLE_MEASURE_RATE`, default 2 000/s for 30 s;
/// `SETTLE_MEASURE_PROPS="k=v,k=v"`: extra librdkafka properties for settle's clients).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: run by hand in release mode"]
async fn kafka_measure_throughput_and_lateness() -> Result<()> {
    let Some(bootstrap) = broker("kafka_measure_throughput_and_lateness") else {
        return Ok(());
    };
    let env = |k: &str, d: f64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let uploads = env("SETTLE_MEASURE_UPLOADS", 200_000.0);
    let live_rate = env("SETTLE_MEASURE_RATE", 2_000.0);

    // 1. A backlog, produced by loadgen as fast as it goes.
    let mut setup = Setup::new(&bootstrap, "measure").await?;
    // `SETTLE_MEASURE_CHANGELOG=off`: settle without the changelog (for comparison).
    if std::env::var("SETTLE_MEASURE_CHANGELOG").as_deref() == Ok("off") {
        setup.kafka.changelog_topic = Some(String::new());
    }
    println!(
        "changelog: {}",
        setup.kafka.changelog().as_deref().unwrap_or("off")
    );
    let produce_rate = 50_000.0;
    let args = loadgen_args(
        &setup.kafka,
        &setup.kafka.input_topic,
        produce_rate,
        (uploads / produce_rate).ceil() as u64,
    );
    let produced = loadgen::run_async(&args).await?;
    println!("backlog: {produced}");
    let n = produced.produced as usize;

    // 2. A bare rdkafka consumer reads it (no group, copies key, payload and headers).
    let t = std::time::Instant::now();
    let read = loadgen::read_topic(&setup.kafka, &setup.kafka.input_topic, n, STEP).await?;
    let bare = read.len() as f64 / t.elapsed().as_secs_f64();
    ensure!(read.len() == n);
    drop(read);

    // 3. settle reads the same backlog (fresh group and stores), until every round is out.
    let dir = tempfile::tempdir()?;
    let t = std::time::Instant::now();
    let running = setup.start(dir.path(), 0)?;
    let mut rx = running.status.subscribe();
    // Startup (stores opened, group joined, partitions assigned) is timed apart from the
    // reading itself: the throughput is from the first record consumed to the last.
    let mut first_at = None;
    let consumed_all = loop {
        let consumed: u64 = rx.borrow_and_update().values().map(|s| s.records).sum();
        if consumed > 0 && first_at.is_none() {
            first_at = Some((t.elapsed(), consumed));
        }
        if consumed >= n as u64 {
            break t.elapsed();
        }
        tokio::time::timeout(STEP, rx.changed()).await??;
    };
    running.until_idle().await?;
    let all_out = t.elapsed();
    running.stop().await?;
    let (startup, first_batch) = first_at.unwrap_or_default();
    let settle_rate = (n as u64 - first_batch) as f64 / (consumed_all - startup).as_secs_f64();
    let with_startup = n as f64 / consumed_all.as_secs_f64();
    println!(
        "throughput on {n} uploads, {PARTITIONS} partitions: bare rdkafka consumer {bare:.0} uploads/s; \
         settle {settle_rate:.0} uploads/s ({:.0} % of bare) from its first record to its last; \
         {with_startup:.0} uploads/s counting its {:.2} s of startup (group join, stores); all rounds out after {:.1} s",
        100.0 * settle_rate / bare,
        startup.as_secs_f64(),
        all_out.as_secs_f64()
    );

    // 4. Live: settle caught up on a fresh topic while loadgen sends at `live_rate`.
    let mut live = Setup::new(&bootstrap, "measure-live").await?;
    for kv in std::env::var("SETTLE_MEASURE_PROPS")
        .unwrap_or_default()
        .split(',')
    {
        if let Some((k, v)) = kv.split_once('=') {
            live.kafka
                .properties
                .insert(k.trim().into(), v.trim().into());
        }
    }
    let dir = tempfile::tempdir()?;
    let running = live.start(dir.path(), 0)?;
    let secs = 30;
    let report = loadgen::run_async(&loadgen_args(
        &live.kafka,
        &live.kafka.input_topic,
        live_rate,
        secs,
    ))
    .await?;
    running.until_idle().await?;
    running.stop().await?;
    let emitted = live.emitted(1).await?;
    // Timer triggers (trailing, max_wait): due_at is a deadline, lateness is the timer path.
    // Immediate triggers (leading, complete, final): due_at is the upload's own timestamp, so
    // lateness is the whole produce -> broker -> fetch -> apply -> publish path.
    let mut all = settle::cli::report::RunStats::new();
    let mut timers = settle::cli::report::RunStats::new();
    let mut immediate = settle::cli::report::RunStats::new();
    for (e, emitted_at) in &emitted {
        all.record_emission(e, *emitted_at);
        match e.trigger {
            Trigger::Trailing | Trigger::MaxWait => timers.record_emission(e, *emitted_at),
            _ => immediate.record_emission(e, *emitted_at),
        }
    }
    let p = |s: &settle::cli::report::RunStats| {
        let l = s.lateness();
        format!(
            "{} emissions: p50 {} ms, p99 {} ms, max {} ms",
            s.emissions, l.p50, l.p99, l.max
        )
    };
    let ttr = all.time_to_ready();
    println!(
        "live at {live_rate:.0} uploads/s for {secs} s ({:.0} achieved, {} uploads), lateness = emitted_at - due_at:\n  \
         all       {}\n  timers    {}\n  immediate {}\n  time-to-ready p50 {} ms, p99 {} ms",
        report.rate(),
        report.produced,
        p(&all),
        p(&timers),
        p(&immediate),
        ttr.p50,
        ttr.p99
    );
    Ok(())
}
