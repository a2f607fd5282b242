//! The admin server of `settle run` on a real Kafka broker: `service::run_until`
//! (what `settle run` runs) with `[admin]` on a loopback port. `/metrics` is scraped until the
//! uploads are consumed and the rounds emitted; its counters match what was produced, what the
//! output topic holds and the dead letters; the consumer lag (from the high watermark the
//! Kafka input caches) is 0 per partition; `/readyz`, `/v1/partitions` and `/v1/sessions`
//! answer from the running instance.
//!
//! `SETTLE_TEST_KAFKA=host:port` runs it (scripts/test.sh sets it); unset, it prints that it
//! did not run (under CI, `CI` set, it fails).

use crate::admin_support;
use crate::kafka_support;

use crate::process_support::free_port;
use admin_support::{try_get, Scrape};
use anyhow::{ensure, Result};
use kafka_support::{broker, emitted, now_ms};
use serde_json::Value;
use settle::cli::loadgen::{self, OutRecord};
use settle::config::Config;
use settle::metrics;
use std::net::SocketAddr;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const PARTITIONS: i32 = 3;
const SESSIONS: usize = 10;
/// Bound on one step that talks to the broker or waits for the runtime.
const STEP: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_run_serves_metrics_that_match_the_topics() -> Result<()> {
    let Some(bootstrap) = broker("kafka_run_serves_metrics_that_match_the_topics") else {
        return Ok(());
    };
    let id = format!("admin-{}-{}", std::process::id(), now_ms());
    let port = free_port()?;
    let dir = tempfile::tempdir()?;
    let config = Config::from_toml_str(&format!(
        r#"
        [debounce]
        policy = "fixed"
        delay = "1s"
        [store]
        data-dir = "{data}"
        [runtime]
        idle-tick = "50ms"
        shutdown-deadline = "10s"
        [admin]
        listen = "127.0.0.1:{port}"
        [kafka]
        bootstrap-servers = "{bootstrap}"
        group-id = "{id}-group"
        input-topic = "{id}-uploads"
        dead-letter-topic = "{id}-dlq"
        [tiers]
        events-topic = "{id}-events"
        [[tiers.tier]]
        name = "normal"
        topic = "{id}-normal"
        [[tiers.tier]]
        name = "limited"
        topic = "{id}-limited"
        "#,
        data = dir.path().display(),
    ))?;
    let kafka = &config.kafka;
    let normal = format!("{id}-normal");
    let limited = format!("{id}-limited");
    let events = format!("{id}-events");
    let changelog = kafka.changelog().expect("on by default");
    loadgen::create_topics(
        kafka,
        &[
            (&changelog, PARTITIONS),
            (&kafka.input_topic, PARTITIONS),
            (&kafka.dead_letter_topic, 1),
            (&normal, 1),
            (&limited, 1),
            (&events, 1),
        ],
    )
    .await?;

    // 10 sessions × 3 uploads 500 ms apart, in time order (partition time never goes back,
    // SEMANTICS §3), a few seconds old (their rounds fall due once caught up), and one record
    // that is not JSON.
    let t0 = now_ms() - 5_000;
    let mut records = Vec::new();
    for i in 0..3 {
        for s in 0..SESSIONS {
            records.push(OutRecord {
                key: Some(format!("acme/s{s}").into_bytes()),
                payload: format!(r#"{{"tenant":"acme","session":"s{s}"}}"#).into_bytes(),
                timestamp_ms: Some(t0 + i * 500),
            });
        }
    }
    records.push(OutRecord {
        key: Some(b"acme/bad".to_vec()),
        payload: b"not json".to_vec(),
        timestamp_ms: Some(t0),
    });
    loadgen::produce_all(kafka, &kafka.input_topic, &records).await?;

    let shutdown = CancellationToken::new();
    let run = {
        let (config, shutdown) = (config.clone(), shutdown.clone());
        tokio::spawn(async move { settle::service::run_until(&config, shutdown, None).await })
    };
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;

    // Scrape until every record is consumed and every round acknowledged.
    let deadline = tokio::time::Instant::now() + STEP;
    let mut last = String::new();
    let m = loop {
        if let Ok((200, text)) = try_get(addr, "/metrics").await {
            let m = Scrape::parse(&text);
            if m.sum(metrics::UPLOADS_CONSUMED, &[]) == records.len() as f64
                && m.sum(metrics::EMISSIONS, &[]) == SESSIONS as f64
                && m.sum(metrics::OUTBOX_SIZE, &[]) == 0.0
                && m.sum(metrics::CONSUMER_LAG, &[]) == 0.0
            {
                break m;
            }
            last = text;
        }
        ensure!(
            tokio::time::Instant::now() < deadline && !run.is_finished(),
            "not settled within {STEP:?}; last scrape:\n{last}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let topic = kafka.input_topic.as_str();
    for p in 0..PARTITIONS {
        let labels = [("topic", topic), ("partition", &p.to_string())];
        // The lag is known (cached high watermark) and 0 for every partition.
        ensure!(
            m.has(metrics::CONSUMER_LAG, &labels),
            "no lag of partition {p}"
        );
    }
    ensure!(m.sum(metrics::UPLOADS_REJECTED, &[("reason", "invalid_json")]) == 1.0);
    let trailing = [("trigger", "trailing"), ("tier", "normal")];
    ensure!(m.sum(metrics::EMISSIONS, &trailing) == SESSIONS as f64);
    ensure!(m.sum(metrics::EMISSION_UPLOADS, &[]) == 3.0 * SESSIONS as f64);
    ensure!(m.sum(metrics::PARTITIONS, &[("state", "live")]) == f64::from(PARTITIONS));
    let count = format!("{}_count", metrics::TIME_TO_READY);
    ensure!(m.sum(&count, &[]) == SESSIONS as f64);

    // What the topics hold agrees.
    let out = emitted(kafka, &normal, "normal", SESSIONS, STEP).await?;
    ensure!(out.len() == SESSIONS, "{} ready records", out.len());
    ensure!(out.iter().all(|(e, _)| e.uploads == 3));
    let dead = loadgen::read_topic(kafka, &kafka.dead_letter_topic, 1, STEP).await?;
    ensure!(dead.len() == 1, "{} dead letters", dead.len());

    let (code, body) = try_get(addr, "/readyz").await?;
    ensure!(code == 200, "readyz {code} {body}");
    let (code, body) = try_get(addr, "/v1/partitions").await?;
    let parts: Value = serde_json::from_str(&body)?;
    ensure!(code == 200 && parts["partitions"].as_array().map(Vec::len) == Some(3));
    let offsets: i64 = parts["partitions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| p["next_offset"].as_i64().unwrap_or(0))
        .sum();
    ensure!(
        offsets == records.len() as i64,
        "next offsets sum {offsets}"
    );
    let (code, body) = try_get(addr, "/v1/sessions/acme/s3").await?;
    let s3: Value = serde_json::from_str(&body)?;
    ensure!(code == 200 && s3["generation"] == 1, "{code} {body}");
    let (code, _) = try_get(addr, "/v1/sessions/acme/none").await?;
    ensure!(code == 404);

    shutdown.cancel();
    let summary = tokio::time::timeout(STEP, run).await???;
    ensure!(summary.failed().is_empty(), "{:?}", summary.failed());
    ensure!(
        try_get(addr, "/healthz").await.is_err(),
        "the admin server stops with the run"
    );
    Ok(())
}
