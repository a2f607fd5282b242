//! Helpers shared by the Kafka integration tests: which broker to use, topics read back as a
//! `simulate` trace, the reference emissions of a trace, and the output topic decoded.
#![allow(dead_code)]

use anyhow::{ensure, Context as _, Result};
use settle::cli::loadgen::{self, TopicRecord};
use settle::codec;
use settle::config::Config;
use settle::engine::{Emission, Engine};
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
    settle::cli::simulate::replay(
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

/// One ready record read back from an output topic, checked and decoded by [`ready_records`].
#[derive(Clone, Debug)]
pub struct ReadyOut {
    /// The engine emission the record carries.
    pub emission: Emission,
    /// `emission_id` (= header `settle-emission-id`).
    pub emission_id: String,
    /// The record's `emitted_at` field (ms).
    pub emitted_at: i64,
    /// The record's timestamp (producer `CreateTime`, ms).
    pub timestamp_ms: i64,
    /// Output partition and offset.
    pub partition: i32,
    /// Offset in the output partition.
    pub offset: i64,
    /// The record's headers, in record order.
    pub headers: Vec<(String, Vec<u8>)>,
}

impl ReadyOut {
    /// The value of the first header named `name`, as UTF-8 (lossy).
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }
}

/// The ready records of `topic`, each checked (record key = session key, header
/// `settle-emission-id` = the record's `emission_id`, tier = `tier`) and decoded, with
/// their timestamps and headers, in topic order. Reads until at least `at_least` or
/// `timeout`.
pub async fn ready_records(
    kafka: &KafkaConfig,
    topic: &str,
    tier: &str,
    at_least: usize,
    timeout: Duration,
) -> Result<Vec<ReadyOut>> {
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
        out.push(ReadyOut {
            emission: e,
            emission_id: ready.emission_id,
            emitted_at: ready.emitted_at,
            timestamp_ms: r.timestamp_ms,
            partition: r.partition,
            offset: r.offset,
            headers: r.headers,
        });
    }
    Ok(out)
}

/// The ready records of `topic`, checked as by [`ready_records`]: `(emission, emitted_at)`
/// in topic order. Reads until at least `at_least` or `timeout`.
pub async fn emitted(
    kafka: &KafkaConfig,
    topic: &str,
    tier: &str,
    at_least: usize,
    timeout: Duration,
) -> Result<Vec<(Emission, i64)>> {
    Ok(ready_records(kafka, topic, tier, at_least, timeout)
        .await?
        .into_iter()
        .map(|r| (r.emission, r.emitted_at))
        .collect())
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

/// A `[kafka]` section on fresh topics (input with `partitions`, dead letters, the
/// changelog `<group-id>.changelog` with `partitions`) and a fresh group, all named after
/// `name` (plus the process id and the time), and the name of the created output topic
/// (1 partition).
pub fn fresh_topics(
    rt: &tokio::runtime::Runtime,
    bootstrap: &str,
    name: &str,
    partitions: i32,
) -> Result<(KafkaConfig, String)> {
    fresh_topics_compacted(rt, bootstrap, name, partitions).map(|(k, o, _)| (k, o))
}

/// [`fresh_topics`], plus whether the broker took `cleanup.policy=compact` for the changelog
/// (see [`create_compacted_topic`]).
pub fn fresh_topics_compacted(
    rt: &tokio::runtime::Runtime,
    bootstrap: &str,
    name: &str,
    partitions: i32,
) -> Result<(KafkaConfig, String, bool)> {
    let id = format!("{name}-{}-{}", std::process::id(), now_ms());
    let kafka = KafkaConfig {
        bootstrap_servers: bootstrap.to_owned(),
        group_id: format!("{id}-group"),
        input_topic: format!("{id}-uploads"),
        dead_letter_topic: format!("{id}-dlq"),
        ..KafkaConfig::default()
    };
    let output = format!("{id}-ready");
    let compacted = create_topics_of(rt, &kafka, &output, partitions)?;
    Ok((kafka, output, compacted))
}

/// Creates the topics of `kafka` on its cluster: the input with `partitions`, dead letters,
/// `output` (1 partition) and the changelog (if on, `partitions`, compacted where the broker
/// takes it); returns whether the changelog is compacted.
pub fn create_topics_of(
    rt: &tokio::runtime::Runtime,
    kafka: &KafkaConfig,
    output: &str,
    partitions: i32,
) -> Result<bool> {
    rt.block_on(loadgen::create_topics(
        kafka,
        &[
            (&kafka.input_topic, partitions),
            (&kafka.dead_letter_topic, 1),
            (output, 1),
        ],
    ))?;
    match kafka.changelog() {
        Some(changelog) => create_compacted_topic(rt, kafka, &changelog, partitions),
        None => Ok(false),
    }
}

/// Creates `topic` with `partitions` and `cleanup.policy=compact` on the cluster of `kafka`;
/// if the broker refuses the config, creates it plain. Returns whether it is compacted
/// (as far as the broker accepted the config).
pub fn create_compacted_topic(
    rt: &tokio::runtime::Runtime,
    kafka: &KafkaConfig,
    topic: &str,
    partitions: i32,
) -> Result<bool> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use settle::transport::kafka::Role;
    let admin: AdminClient<DefaultClientContext> = kafka
        .client_config(Role::Producer)
        .create()
        .context("admin client")?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let compacted = NewTopic::new(topic, partitions, TopicReplication::Fixed(1))
        .set("cleanup.policy", "compact");
    let results = rt
        .block_on(async {
            tokio::time::timeout(
                Duration::from_secs(30),
                admin.create_topics([&compacted], &options),
            )
            .await
        })
        .context("CreateTopics timed out")?
        .context("CreateTopics")?;
    match results.into_iter().next() {
        Some(Ok(_)) => Ok(true),
        Some(Err((name, code))) => {
            println!(
                "the broker refused {name} with cleanup.policy=compact ({code}): creating it plain"
            );
            rt.block_on(loadgen::create_topics(kafka, &[(topic, partitions)]))?;
            Ok(false)
        }
        None => anyhow::bail!("CreateTopics answered nothing for {topic}"),
    }
}

/// Each partition's end (the offset after its last record) as seen in `input` (records read
/// back from a topic of `partitions` partitions): `None` for a partition without records.
/// Compare with `loadgen::committed_offsets` after a clean stop.
pub fn partition_ends(input: &[TopicRecord], partitions: i32) -> Vec<Option<i64>> {
    let mut ends = vec![None; partitions as usize];
    for r in input {
        let end: &mut Option<i64> = &mut ends[r.partition as usize];
        *end = Some(end.unwrap_or(0).max(r.offset + 1));
    }
    ends
}
