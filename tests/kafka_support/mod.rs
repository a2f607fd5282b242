//! Helpers shared by the Kafka integration tests: which broker to use, topics read back as a
//! `simulate` trace, the reference emissions of a trace, and the output topic decoded.
#![allow(dead_code)]

use anyhow::{ensure, Context as _, Result};
use settle::codec;
use settle::config::Config;
use settle::engine::{Emission, Engine};
use settle::loadgen::{self, TopicRecord};
use settle::transport::kafka::KafkaConfig;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The broker from `SETTLE_TEST_KAFKA`. Unset: `None` after saying loudly that `test` did
/// not run, except under CI (`CI` set), where a missing broker is a failure (the tests must
/// fail, not skip, when the broker is absent in CI).
pub fn broker(test: &str) -> Option<String> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SETTLE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
    match std::env::var("SETTLE_TEST_KAFKA") {
        Ok(v) if !v.trim().is_empty() => Some(v.trim().to_owned()),
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI is set but SETTLE_TEST_KAFKA is not: {test} needs the broker scripts/test.sh starts"
            );
            println!("SETTLE_TEST_KAFKA is not set: {test} did NOT run (scripts/test.sh sets it)");
            None
        }
    }
}

/// Wall clock, ms since the epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// `input` (records read back from the input topic) as a `simulate` trace: every record that
/// decodes, plus its broker timestamp as `"ts"` and its partition, sorted by
/// `(ts, partition, offset)`. Records that fail decoding (dead letters) are left out.
pub fn trace_of(input: &[TopicRecord]) -> Result<String> {
    let mut lines: Vec<(i64, i32, i64, String)> = Vec::new();
    for r in input {
        if codec::decode_upload(r.key.as_deref(), &r.payload, r.timestamp_ms, i64::MAX).is_err() {
            continue;
        }
        let mut obj: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&r.payload)?;
        obj.insert("ts".into(), r.timestamp_ms.into());
        obj.insert("partition".into(), r.partition.into());
        lines.push((
            r.timestamp_ms,
            r.partition,
            r.offset,
            serde_json::to_string(&obj)?,
        ));
    }
    lines.sort();
    Ok(lines.into_iter().map(|l| l.3 + "\n").collect())
}

/// What `simulate::replay` emits for `trace` under `config`'s policies; fails if the replay
/// rejects a line.
pub fn reference(config: &Config, trace: &str) -> Result<Vec<Emission>> {
    let mut out = Vec::new();
    let mut rejected = Vec::new();
    settle::simulate::replay(
        Engine::new(config.policy_table()),
        trace.as_bytes(),
        |e| {
            out.push(e.clone());
            Ok(())
        },
        |e| rejected.push(e.to_string()),
    )?;
    ensure!(rejected.is_empty(), "simulate rejected {rejected:?}");
    Ok(out)
}

/// The ready records of `topic`, each checked (record key = session key, header
/// `settle-emission-id` = the record's `emission_id`, tier = `tier`) and decoded:
/// `(emission, emitted_at)` in topic order. Reads until at least `at_least` or `timeout`.
pub async fn emitted(
    kafka: &KafkaConfig,
    topic: &str,
    tier: &str,
    at_least: usize,
    timeout: Duration,
) -> Result<Vec<(Emission, i64)>> {
    let records = loadgen::read_topic(kafka, topic, at_least, timeout).await?;
    let mut out = Vec::with_capacity(records.len());
    for r in records {
        let ready = codec::decode_ready(&r.payload).context("output record")?;
        let e = ready.emission();
        ensure!(
            r.key.as_deref() == Some(e.key.as_str().as_bytes()),
            "record key {:?} for {}",
            r.key.as_deref().map(String::from_utf8_lossy),
            e.emission_id()
        );
        ensure!(
            r.header(codec::EMISSION_ID_HEADER).as_deref() == Some(ready.emission_id.as_str()),
            "header of {}: {:?}",
            ready.emission_id,
            r.header(codec::EMISSION_ID_HEADER)
        );
        ensure!(
            ready.emission_id == e.emission_id() && ready.tier == tier,
            "record {} in tier {:?}, want {tier:?}",
            ready.emission_id,
            ready.tier
        );
        out.push((e, ready.emitted_at));
    }
    Ok(out)
}

/// Emissions sorted by emission id.
pub fn by_id(mut emissions: Vec<Emission>) -> Vec<Emission> {
    emissions.sort_by_key(|e| (e.key.clone(), e.generation));
    emissions
}

/// Fails with the first difference between two id-sorted emission lists (every field
/// compared; `emitted_at` is not part of [`Emission`]).
pub fn same_emissions(got: &[Emission], want: &[Emission]) -> Result<()> {
    for (g, w) in got.iter().zip(want) {
        ensure!(g == w, "emission differs:\n got {g:?}\nwant {w:?}");
    }
    ensure!(
        got.len() == want.len(),
        "{} emissions, want {} (first extra: {:?})",
        got.len(),
        want.len(),
        got.get(want.len()).or(want.get(got.len()))
    );
    Ok(())
}
