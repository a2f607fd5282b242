//! Exactly-once mode (`kafka.processing-guarantee = "exactly-once"`) on rdkafka's
//! `MockCluster` (tansu, the test broker, has no transactions): two real `settle run`
//! processes in one group; the first is crashed (aborted) between producing a transaction's
//! ready records and committing it; the second fences it (`init_transactions` on the same
//! `transactional.id`), restores the committed changelog and redoes the batch.
//!
//! What the mock cannot show, and how the test copes: librdkafka 2.12's mock broker keeps no
//! transaction state (EndTxn only checks the producer id; Fetch reports LastStableOffset =
//! the log end and no aborted transactions), so records of an aborted transaction stay
//! visible even to `read_committed` consumers, and the crash drill therefore stops *before*
//! the transaction's changelog records are produced (on a real broker the order inside a
//! transaction does not matter). The test then reads the output as a `read_committed`
//! consumer would on a real broker: the records of the crashed instance's never-committed
//! transaction are dropped (it committed no transaction with ready records: the drill
//! crashes its first one). It checks that the crash really happened between produce and
//! commit (the crashed instance's records are on the topic), that without the transaction
//! they would be visible duplicates, and that the committed records hold every round
//! exactly once.
//!
//! The start-up check of exactly-once mode (`transport::kafka::check_transactions`): accepted
//! on the mock (it has transactions; the crash test above runs through it), refused on a
//! tansu broker of the test's own (no EndTxn) with a message that says what to do, before
//! anything is consumed or produced.

use crate::kafka_support;
use crate::process_support;

use anyhow::{ensure, Context as _, Result};
use kafka_support::ready_records;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use settle::transport::kafka::{
    check_transactions, committed_offsets, produce_all, KafkaConfig, OutRecord,
    ProcessingGuarantee, CRASH_BEFORE_COMMIT_ENV, INSTANCE_HEADER,
};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

const SESSIONS: usize = 20;
/// One input partition: the drill aborts the process at its first transaction with ready
/// records; with more partitions another partition's transaction could commit during the
/// drill's flush and make "A committed nothing" untrue.
const PARTITIONS: i32 = 1;

fn config_file(dir: &Path, bootstrap: &str, instance: &str) -> Result<std::path::PathBuf> {
    let data = dir.join(format!("data-{instance}"));
    let text = format!(
        r#"
[debounce]
policy = "fixed"
delay = "8s"
[store]
data-dir = "{data}"
[runtime]
idle-tick = "50ms"
shutdown-deadline = "10s"
[kafka]
bootstrap-servers = "{bootstrap}"
group-id = "eos"
input-topic = "uploads"
dead-letter-topic = "dlq"
instance-id = "{instance}"
processing-guarantee = "exactly-once"
[kafka.properties]
"session.timeout.ms" = 6000
"heartbeat.interval.ms" = 500
[tiers]
events-topic = "tier-events"
[[tiers.tier]]
name = "normal"
topic = "ready"
"#,
        data = data.display(),
    );
    let path = dir.join(format!("{instance}.toml"));
    std::fs::write(&path, text)?;
    Ok(path)
}

#[test]
fn exactly_once_a_crash_between_produce_and_commit_shows_no_duplicate() -> Result<()> {
    let mock = MockCluster::new(1).context("mock cluster")?;
    let bootstrap = mock.bootstrap_servers();
    for (topic, partitions) in [
        ("uploads", PARTITIONS),
        ("eos.changelog", PARTITIONS),
        ("ready", 1),
        ("dlq", 1),
        ("tier-events", 1),
    ] {
        mock.create_topic(topic, partitions, 1)?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()?;
    rt.block_on(async {
        for i in 0..SESSIONS {
            let key = format!("acme/s{i}");
            let value = format!(r#"{{"tenant":"acme","session":"s{i}"}}"#);
            producer
                .send(
                    FutureRecord::to("uploads").key(&key).payload(&value),
                    Duration::from_secs(5),
                )
                .await
                .map_err(|(e, _)| e)?;
        }
        Ok::<_, rdkafka::error::KafkaError>(())
    })?;
    let dir = tempfile::tempdir()?;

    // A: crashes right after producing the ready records of its first transaction that has
    // any, before committing it. The rounds fall due 8 s after the uploads, so A's first
    // transaction (the uploads applied) commits first (joining the group takes ~3 s).
    let mut a = process_support::settle()
        .args(["run", "--config"])
        .arg(config_file(dir.path(), &bootstrap, "A")?)
        .env(CRASH_BEFORE_COMMIT_ENV, "1")
        .env(
            "SETTLE_LOG",
            std::env::var("SETTLE_TEST_RUN_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .spawn()?;
    let status = process_support::wait_exit(&mut a, Duration::from_secs(60))?
        .context("A did not crash within 60 s")?;
    ensure!(!status.success(), "A must die in the drill, got {status}");

    let kafka = KafkaConfig {
        bootstrap_servers: bootstrap.clone(),
        ..KafkaConfig::default()
    };
    let after_crash = rt.block_on(ready_records(
        &kafka,
        "ready",
        "normal",
        1,
        Duration::from_secs(5),
    ))?;
    let from_a: Vec<String> = after_crash
        .iter()
        .filter(|r| r.header(INSTANCE_HEADER).as_deref() == Some("A"))
        .map(|r| r.emission_id.clone())
        .collect();
    ensure!(
        !from_a.is_empty(),
        "A's uncommitted transaction produced ready records before the crash"
    );
    // A's earlier transactions (the uploads applied, rounds pending) are on the changelog.
    let changelog = rt.block_on(settle::cli::loadgen::read_topic(
        &kafka,
        "eos.changelog",
        1,
        Duration::from_secs(5),
    ))?;
    ensure!(
        !changelog.is_empty(),
        "A committed its first batch to the changelog"
    );

    // B: same group, its own (empty) data dir: fences A's transactional ids, restores the
    // committed changelog, redoes the batch.
    let b_log = dir.path().join("b.log");
    let mut b =
        process_support::start_run_logged(&config_file(dir.path(), &bootstrap, "B")?, &[], &b_log)?;
    let t0 = Instant::now();
    let records = loop {
        let records = rt.block_on(ready_records(
            &kafka,
            "ready",
            "normal",
            0,
            Duration::from_secs(2),
        ))?;
        let from_b = records
            .iter()
            .filter(|r| r.header(INSTANCE_HEADER).as_deref() == Some("B"))
            .count();
        if from_b >= SESSIONS || t0.elapsed() > Duration::from_secs(60) {
            break records;
        }
        if let Some(s) = b.try_wait()? {
            anyhow::bail!("B exited early: {s}");
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    process_support::sigterm(&mut b, Duration::from_secs(10))?;
    // B resumed from A's committed state: its store was restored from the changelog (A's
    // first transaction applied every upload), not rebuilt by re-reading the input.
    let log = process_support::json_log(&b_log)?;
    let restored: Vec<_> = log
        .with_message("partition restored from changelog")
        .collect();
    ensure!(
        restored.len() == PARTITIONS as usize,
        "restores: {restored:?}"
    );
    for r in &restored {
        ensure!(
            r.int("records").unwrap_or(0) > 0,
            "nothing restored: {}",
            r.brief()
        );
        ensure!(
            r.fields.get("next_offset").and_then(|v| v.as_str())
                == Some(&format!("Some({SESSIONS})")),
            "B resumes after every upload: {}",
            r.brief()
        );
    }

    // What a read_committed consumer sees on a real broker: B's committed transactions only
    // (A never committed a transaction with ready records).
    let mut committed: BTreeMap<String, usize> = BTreeMap::new();
    let mut all: BTreeMap<String, usize> = BTreeMap::new();
    for r in &records {
        *all.entry(r.emission_id.clone()).or_default() += 1;
        match r.header(INSTANCE_HEADER).as_deref() {
            Some("B") => *committed.entry(r.emission_id.clone()).or_default() += 1,
            Some("A") => {}
            other => anyhow::bail!("ready record from unknown instance {other:?}"),
        }
    }
    let want: Vec<String> = (0..SESSIONS).map(|i| format!("acme/s{i}/1")).collect();
    // `tenant/session/generation` of an id (without its state's creation time).
    let short = |id: &String| {
        let mut parts = id.rsplitn(3, '/');
        let (generation, _, key) = (parts.next(), parts.next(), parts.next());
        format!("{}/{}", key.unwrap_or(""), generation.unwrap_or(""))
    };
    ensure!(
        {
            let mut got: Vec<String> = committed.keys().map(short).collect();
            got.sort();
            got
        } == {
            let mut w = want.clone();
            w.sort();
            w
        },
        "committed ids {:?}, want every round",
        committed.keys().collect::<Vec<_>>()
    );
    ensure!(
        committed.values().all(|&n| n == 1),
        "a committed duplicate: {committed:?}"
    );
    ensure!(
        from_a.iter().all(|id| all[id] == 2),
        "each id of A's aborted transaction was redone once by B (a visible duplicate without the transaction)"
    );
    Ok(())
}

#[test]
fn exactly_once_is_refused_at_start_on_a_broker_without_transactions() -> Result<()> {
    let test = "exactly_once_is_refused_at_start_on_a_broker_without_transactions";
    let Some(bin) = process_support::tansu_bin(test) else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let tansu = process_support::Tansu::start(&bin, &dir.path().join("tansu.log"))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut kafka, output) = kafka_support::fresh_topics(&rt, &tansu.bootstrap, "eos-refused", 1)?;
    // Uploads that would be emitted at once (`final`) if settle started.
    let uploads: Vec<OutRecord> = (0..5)
        .map(|i| OutRecord {
            key: Some(format!("acme/s{i}").into_bytes()),
            payload: format!(r#"{{"tenant":"acme","session":"s{i}","final":true}}"#).into_bytes(),
            timestamp_ms: None,
        })
        .collect();
    rt.block_on(produce_all(&kafka, &kafka.input_topic, &uploads))?;

    // The check alone, as `settle run` makes it: refused, quickly, not retried.
    kafka.processing_guarantee = ProcessingGuarantee::ExactlyOnce;
    let t0 = Instant::now();
    let refused = check_transactions(&kafka, Duration::from_secs(10));
    let took = t0.elapsed();
    let e = refused
        .err()
        .context("tansu 0.6 has no transactions: the check must refuse")?;
    ensure!(!e.is_retryable(), "a missing API is not retried: {e}");
    println!("transactions check refused tansu in {took:?}: {e}");

    // `settle run`: exit code 1 with the reason and what to do, nothing consumed or produced.
    let config = dir.path().join("settle.toml");
    let text = process_support::kafka_config_text(
        &kafka,
        &output,
        &dir.path().join("data"),
        Duration::from_secs(5),
        6_000,
    )
    .replacen(
        "\n[kafka]\n",
        "\n[kafka]\nprocessing-guarantee = \"exactly-once\"\n",
        1,
    );
    std::fs::write(&config, text)?;
    let stderr_file = dir.path().join("run.log");
    let mut run = process_support::settle()
        .args(["run", "--config"])
        .arg(&config)
        .env("SETTLE_LOG", "info")
        .stderr(std::fs::File::create(&stderr_file)?)
        .spawn()?;
    let status = process_support::wait_exit(&mut run, Duration::from_secs(60))?;
    let stderr = std::fs::read_to_string(&stderr_file)?;
    let Some(status) = status else {
        run.kill()?;
        anyhow::bail!(
            "settle run still running 60 s after start in exactly-once on tansu:\n{stderr}"
        );
    };
    ensure!(status.code() == Some(1), "exit {status}:\n{stderr}");
    for want in [
        "error: kafka: kafka.processing-guarantee = \"exactly-once\" needs Kafka transactions",
        "does not support them (no EndTxn in its ApiVersions answer",
        "refusing to start, nothing was consumed or produced",
        "Set kafka.processing-guarantee = \"at-least-once\"",
        "or use a broker with transactions",
    ] {
        ensure!(stderr.contains(want), "{want:?} not in:\n{stderr}");
    }
    ensure!(
        !stderr.contains("partition assigned") && !stderr.contains("settle run stopped"),
        "settle started anyway:\n{stderr}"
    );
    let ready = rt.block_on(settle::cli::loadgen::read_topic(
        &kafka,
        &output,
        0,
        Duration::from_secs(3),
    ))?;
    ensure!(
        ready.is_empty(),
        "records on the output topic: {}",
        ready.len()
    );
    let committed = rt.block_on(committed_offsets(&kafka, &kafka.input_topic, 1))?;
    ensure!(
        committed == vec![None],
        "the group committed offsets: {committed:?}"
    );
    Ok(())
}
