//! `settle tune --from-kafka` / `settle simulate --from-kafka` against a real broker: the
//! uploads of a time range read straight from the input topic (`trace_source::read_kafka`)
//! are exactly the uploads produced in that range, in each key's order; bad records are
//! counted by reason, records outside the range are left out; the tune figures equal those
//! of the same uploads from memory; and the CLI does the same end to end.
//!
//! The broker comes from `SETTLE_TEST_KAFKA` (scripts/test.sh sets it, e.g. tansu on
//! 127.0.0.1:9092). Unset: the test says loudly that it did not run, except under CI (`CI`
//! set), where that is a failure.

use crate::kafka_support;

use anyhow::{ensure, Context as _, Result};
use kafka_support::{broker, now_ms};
use settle::cli::loadgen::{self, OutRecord};
use settle::cli::trace_source::{read_kafka, TimeRange};
use settle::cli::tune::{describe, Goal, Sweep, Trace, TuneReport};
use settle::codec;
use settle::engine::{Millis, PolicySpec};
use settle::transport::kafka::KafkaConfig;
use std::process::Command;

const PARTITIONS: i32 = 3;
const SESSIONS: usize = 30;

fn record(key: &str, json: &str, ts: Millis) -> OutRecord {
    OutRecord {
        key: Some(key.as_bytes().to_vec()),
        payload: json.as_bytes().to_vec(),
        timestamp_ms: Some(ts),
    }
}

/// The range's uploads: `SESSIONS` sessions of tenant `twostep`, one a minute from `base`,
/// each uploading twice 20 s apart.
fn in_range(base: Millis) -> Vec<OutRecord> {
    let mut out = Vec::new();
    for s in 0..SESSIONS {
        let key = format!("twostep/job-{s}");
        let json =
            |n: u32| format!(r#"{{"tenant":"twostep","session":"job-{s}","event_id":"e{s}-{n}"}}"#);
        let t = base + s as Millis * 60_000;
        out.push(record(&key, &json(1), t));
        out.push(record(&key, &json(2), t + 20_000));
    }
    out
}

/// `(key, event time)` of `uploads` sorted, for comparing as multisets.
fn keyed(uploads: impl IntoIterator<Item = (String, Millis)>) -> Vec<(String, Millis)> {
    let mut v: Vec<_> = uploads.into_iter().collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread")]
async fn tune_reads_a_time_range_from_the_kafka_input_topic() -> Result<()> {
    let Some(bootstrap) = broker("tune_reads_a_time_range_from_the_kafka_input_topic") else {
        return Ok(());
    };
    let id = format!("tune-{}-{}", std::process::id(), now_ms());
    let kafka = KafkaConfig {
        bootstrap_servers: bootstrap.clone(),
        input_topic: format!("{id}-in"),
        group_id: format!("{id}-reader"),
        ..KafkaConfig::default()
    };
    let topic = kafka.input_topic.clone();
    loadgen::create_topics(&kafka, &[(&topic, PARTITIONS)]).await?;

    // Two hours ago, an hour of uploads; around it, records outside the range and bad ones.
    let base = now_ms() - 2 * 3_600_000;
    let (since, until) = (base, base + 3_600_000);
    let good = in_range(base);
    let mut records = vec![
        record(
            "twostep/early",
            r#"{"tenant":"twostep","session":"early"}"#,
            since - 600_000,
        ),
        record("twostep/bad", "not json", base + 1_000),
        record(
            "other/key",
            r#"{"tenant":"twostep","session":"job-1"}"#,
            base + 2_000,
        ),
    ];
    records.extend(good.iter().cloned());
    records.push(record(
        "twostep/late",
        r#"{"tenant":"twostep","session":"late"}"#,
        until + 600_000,
    ));
    let delivered = loadgen::produce_all(&kafka, &topic, &records).await?;
    ensure!(delivered.len() == records.len());

    let range = TimeRange {
        since: Some(since),
        until,
    };
    let read = {
        let kafka = kafka.clone();
        let topic = topic.clone();
        tokio::task::spawn_blocking(move || read_kafka(&kafka, &topic, range, false, None))
            .await
            .context("reader task")??
    };
    let s = &read.summary;
    ensure!(s.partitions == PARTITIONS as usize, "{s}");
    ensure!(s.uploads == good.len() as u64, "{s}");
    ensure!(s.rejected.get("invalid_json") == Some(&1), "{s}");
    ensure!(s.rejected.get("key_mismatch") == Some(&1), "{s}");
    ensure!(read.trace.rejected_count() == 2, "{s}");
    // The records outside the range were read past (if the partition was read from its
    // beginning) or never fetched: either way not in the trace.
    ensure!(s.records >= good.len() as u64 + 2, "{s}");

    // Exactly the range's uploads, each key's in produce order.
    let got = keyed(
        read.trace
            .uploads
            .iter()
            .map(|u| (u.key.to_string(), u.event_time)),
    );
    let want = keyed(good.iter().map(|r| {
        (
            String::from_utf8(r.key.clone().unwrap()).unwrap(),
            r.timestamp_ms.unwrap(),
        )
    }));
    ensure!(got == want, "uploads differ:\n got {got:?}\nwant {want:?}");
    for w in read.trace.uploads.windows(2) {
        if w[0].key == w[1].key {
            ensure!(w[0].event_time <= w[1].event_time, "key order {w:?}");
        }
    }

    // The tune figures are those of the same uploads from memory.
    let sweep: Sweep = "adaptive:5s/10m;learn:off,on".parse()?;
    let from_kafka = TuneReport::build("kafka", &read.trace, &sweep, Goal::default());
    let uploads: Vec<_> = good
        .iter()
        .map(|r| {
            codec::decode_upload(
                r.key.as_deref(),
                &r.payload,
                r.timestamp_ms.unwrap(),
                Millis::MAX,
            )
        })
        .collect::<Result<_, _>>()?;
    let from_memory = TuneReport::build(
        "memory",
        &Trace::from_uploads(uploads),
        &sweep,
        Goal::default(),
    );
    for (a, b) in from_kafka.rows.iter().zip(&from_memory.rows) {
        ensure!(
            a.stats.emissions == b.stats.emissions && a.p99() == b.p99(),
            "{}: {} vs {}",
            describe(&a.spec),
            a.stats.emissions,
            b.stats.emissions
        );
    }
    ensure!(from_kafka.rows[0].stats.emissions == 2 * SESSIONS as u64);
    ensure!(from_kafka.rows[1].stats.emissions == (8 * 2 + SESSIONS - 8) as u64);
    ensure!(
        from_kafka.rows[1].spec
            == PolicySpec::adaptive(5_000, 600_000).with_learned_initial_delay(true)
    );

    // The CLI: `settle tune --from-kafka` with the broker from the environment, and
    // `settle simulate --from-kafka` writing the ready records.
    let rfc = codec::format_rfc3339_ms;
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(args)
            .env("SETTLE_KAFKA__BOOTSTRAP_SERVERS", &bootstrap)
            .env_remove("SETTLE_CONFIG")
            .output()
    };
    let (since_s, until_s) = (rfc(since), rfc(until));
    let out = run(&[
        "tune",
        "--from-kafka",
        "--topic",
        &topic,
        "--since",
        &since_s,
        "--until",
        &until_s,
        "--no-progress",
        "--sweep",
        "adaptive:5s/10m;learn:off,on",
    ])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "tune failed:\n{stdout}\n{stderr}");
    ensure!(
        stderr.contains(&format!("kafka topic {topic}")) && stderr.contains("invalid_json 1"),
        "{stderr}"
    );
    ensure!(
        stdout.contains(&format!("{} uploads (2 unusable skipped)", good.len())),
        "{stdout}"
    );
    ensure!(stdout.contains("adaptive 5s/10m, learn "), "{stdout}");

    let dir = tempfile::tempdir()?;
    let ready = dir.path().join("ready.jsonl");
    let out = run(&[
        "simulate",
        "--from-kafka",
        "--topic",
        &topic,
        "--since",
        &since_s,
        "--until",
        &until_s,
        "--no-progress",
        "--output",
        ready.to_str().context("utf-8 path")?,
    ])?;
    ensure!(
        out.status.success(),
        "simulate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = std::fs::read_to_string(&ready)?;
    // Default policy (adaptive 5s/10m, no learning): two ready records per session.
    ensure!(lines.lines().count() == 2 * SESSIONS, "{lines}");

    // A bad time is refused with the forms allowed; a missing topic names the topic.
    let out = run(&["tune", "--from-kafka", "--since", "yesterday-ish"])?;
    ensure!(!out.status.success());
    ensure!(String::from_utf8_lossy(&out.stderr).contains("RFC 3339"));
    let out = run(&[
        "tune",
        "--from-kafka",
        "--topic",
        &format!("{id}-missing"),
        "--no-progress",
    ])?;
    ensure!(!out.status.success());
    ensure!(String::from_utf8_lossy(&out.stderr).contains(&format!("{id}-missing")));
    Ok(())
}
