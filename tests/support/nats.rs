//! Helpers shared by the NATS integration tests: which server, streams and subjects unique to
//! one test, settle started in process on them, the input stream read back as a `simulate`
//! trace and the tier subjects decoded. The reference emissions and the comparison are the
//! Kafka tests' (`kafka_support`, declared beside this module in `tests/e2e/main.rs`).
#![allow(dead_code)]

pub use crate::running_support::Running;

use crate::kafka_support::now_ms;
use anyhow::{ensure, Context as _, Result};
use settle::codec;
use settle::config::Config;
use settle::engine::{Emission, Engine};
use settle::runtime::{Runtime, RuntimeOptions, SystemClock};
use settle::tiers::{TierSpec, TiersConfig};
use settle::transport::nats::{self, NatsConfig, NatsSink, NatsSource, Storage, StreamRecord};
use std::net::ToSocketAddrs;
use std::path::Path;
use std::time::Duration;

/// Bound on one step that talks to the server or waits for the runtime.
pub const STEP: Duration = Duration::from_secs(120);

/// The NATS server of the tests: `SETTLE_TEST_NATS` (host:port, set by scripts/test.sh) or
/// 127.0.0.1:4222. When nothing answers there, the test fails under CI (`CI` set); elsewhere
/// it says loudly that it did not run and returns `None`.
pub fn server(test: &str) -> Option<String> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SETTLE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
    let addr = std::env::var("SETTLE_TEST_NATS")
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "127.0.0.1:4222".to_owned());
    let answers = addr.to_socket_addrs().ok().is_some_and(|mut addrs| {
        addrs.any(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok())
    });
    if answers {
        return Some(addr);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI is set but no NATS server answers on {addr}: {test} needs the server scripts/test.sh starts"
    );
    println!("no NATS server on {addr}: {test} did NOT run (start one: scripts/nats.sh start)");
    None
}

/// Streams, subjects and consumers of one test (names unique to the process and moment) and
/// a JetStream context on its server.
pub struct Setup {
    pub nats: NatsConfig,
    pub tiers: TiersConfig,
    pub js: async_nats::jetstream::Context,
}

impl Setup {
    /// Names for test `name` on `server` (host:port), streams on `storage`, `partitions`
    /// input partitions; tiers `normal` and `limited` on their own subjects.
    pub async fn new(server: &str, name: &str, storage: Storage, partitions: u32) -> Result<Setup> {
        let id = format!("{name}{}x{}", std::process::id(), now_ms() % 1_000_000_000);
        let nats = NatsConfig {
            servers: format!("nats://{server}"),
            input_stream: format!("T_{id}_IN"),
            output_stream: format!("T_{id}_OUT"),
            input_subject_prefix: format!("t{id}.uploads"),
            dead_letter_subject: format!("t{id}.dlq"),
            consumer_prefix: format!("c{id}"),
            changelog_stream: Some(format!("T_{id}_CL")),
            changelog_subject_prefix: Some(format!("t{id}.changelog")),
            tier_counts_bucket: Some(format!("T_{id}_TC")),
            overrides_bucket: Some(format!("T_{id}_OV")),
            partitions,
            storage,
            ..NatsConfig::default()
        };
        let tiers = TiersConfig {
            events_topic: format!("t{id}.tier-events"),
            tiers: vec![
                TierSpec::new("normal", &format!("t{id}.ready.normal")),
                TierSpec::new("limited", &format!("t{id}.ready.limited")),
            ],
            ..TiersConfig::default()
        };
        nats.validate()?;
        nats.check_output_subjects(&tiers)?;
        let client = nats::connect(&nats).await?;
        let js = nats::jetstream(client, 10_000);
        nats::ensure_streams(&js, &nats, &tiers).await?;
        Ok(Setup { nats, tiers, js })
    }

    /// The subject of tier `tier`.
    pub fn tier_subject(&self, tier: &str) -> &str {
        &self
            .tiers
            .tiers
            .iter()
            .find(|t| t.name == tier)
            .expect("a tier of the setup")
            .topic
    }

    /// Publishes one upload to its key's partition and waits for the ack: (partition,
    /// stream sequence). `msg_id` makes a retried publish idempotent.
    pub async fn publish(
        &self,
        key: &str,
        json: &[u8],
        msg_id: Option<&str>,
    ) -> Result<(i32, u64)> {
        self.publish_with(key, json, msg_id, true).await
    }

    /// [`Setup::publish`] with header `settle-key` only when `key_header` (it is optional).
    pub async fn publish_with(
        &self,
        key: &str,
        json: &[u8],
        msg_id: Option<&str>,
        key_header: bool,
    ) -> Result<(i32, u64)> {
        let (p, ack) = nats::publish_upload(
            &self.js,
            &self.nats.input_subject_prefix,
            self.nats.partitions,
            key,
            json,
            msg_id,
            key_header,
        )
        .await?;
        Ok((p, ack.await?.sequence))
    }

    /// Publishes one upload with header `settle-key` = `key` to partition `partition`'s
    /// subject, whatever the key hashes to (a misrouting producer), and waits for the ack:
    /// the stream sequence.
    pub async fn publish_to(&self, partition: i32, key: &str, json: &[u8]) -> Result<u64> {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(nats::KEY_HEADER, key);
        let subject = format!("{}.{partition}", self.nats.input_subject_prefix);
        let ack = self
            .js
            .publish_with_headers(subject, headers, json.to_vec().into())
            .await?;
        Ok(ack.await?.sequence)
    }

    /// The input stream read back (at least `at_least` messages).
    pub async fn input(&self, at_least: usize) -> Result<Vec<StreamRecord>> {
        nats::read_stream(
            &self.js,
            &self.nats.input_stream,
            &self.nats.input_pattern(),
            at_least,
            STEP,
        )
        .await
    }

    /// The dead-letter subject read back (at least `at_least` messages).
    pub async fn dead_letters(&self, at_least: usize) -> Result<Vec<StreamRecord>> {
        nats::read_stream(
            &self.js,
            &self.nats.output_stream,
            &self.nats.dead_letter_subject,
            at_least,
            STEP,
        )
        .await
    }

    /// The ready records of tier `tier`'s subject, each checked (headers `Nats-Msg-Id` and
    /// `settle-emission-id` = the record's `emission_id`, `settle-key` = its session key,
    /// `tier` field = `tier`) and decoded, in stream order. Reads until at least `at_least`.
    pub async fn emitted(&self, tier: &str, at_least: usize) -> Result<Vec<Emission>> {
        let records = nats::read_stream(
            &self.js,
            &self.nats.output_stream,
            self.tier_subject(tier),
            at_least,
            STEP,
        )
        .await?;
        let mut out = Vec::with_capacity(records.len());
        for r in records {
            let ready = codec::decode_ready(&r.payload).context("output record")?;
            let e = ready.emission();
            let id = ready.emission_id.as_str();
            ensure!(
                r.header("Nats-Msg-Id") == Some(id),
                "Nats-Msg-Id of {id}: {:?}",
                r.header("Nats-Msg-Id")
            );
            ensure!(
                r.header(codec::EMISSION_ID_HEADER) == Some(id),
                "header of {id}"
            );
            ensure!(
                r.header(nats::KEY_HEADER) == Some(e.key.as_str()),
                "settle-key of {id}: {:?}",
                r.header(nats::KEY_HEADER)
            );
            ensure!(
                id == e.emission_id() && ready.tier == tier,
                "record {id} in tier {:?}, want {tier:?}",
                ready.tier
            );
            out.push(e);
        }
        Ok(out)
    }

    /// Waits until every partition's consumer has nothing pending and nothing unacked, then
    /// returns each one's ack floor (stream sequence), by partition.
    pub async fn consumers_settled(&self) -> Result<Vec<u64>> {
        let stream = self.js.get_stream(&self.nats.input_stream).await?;
        let t0 = std::time::Instant::now();
        loop {
            let mut floors = Vec::new();
            let mut settled = true;
            for p in 0..self.nats.partitions as i32 {
                let info = stream.consumer_info(self.nats.consumer_name(p)).await?;
                settled &= info.num_pending == 0 && info.num_ack_pending == 0;
                floors.push(info.ack_floor.stream_sequence);
            }
            if settled {
                return Ok(floors);
            }
            ensure!(t0.elapsed() < STEP, "consumers not settled within {STEP:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Deletes the test's streams (with their consumers), changelog streams and tier-counts
    /// bucket included.
    pub async fn cleanup(&self) {
        if let Some(bucket) = self.nats.tier_counts() {
            let _ = self.js.delete_key_value(&bucket).await;
        }
        if let Some(bucket) = self.nats.overrides() {
            let _ = self.js.delete_key_value(&bucket).await;
        }
        for s in [&self.nats.input_stream, &self.nats.output_stream] {
            let _ = self.js.delete_stream(s).await;
        }
        for p in 0..self.nats.partitions as i32 {
            let _ = self
                .js
                .delete_stream(self.nats.changelog_stream_name(p))
                .await;
        }
    }

    /// The `[nats]` lines of a `settle run` config for this setup as instance `instance` of
    /// `instances` (memory storage, the setup's streams, subjects, consumers and changelog),
    /// and the `[tiers]` section.
    pub fn run_config_sections(&self, instance: u32, instances: u32) -> String {
        let n = &self.nats;
        format!(
            r#"
[nats]
servers = "{servers}"
input-stream = "{input}"
input-subject-prefix = "{prefix}"
partitions = {partitions}
instance = {instance}
instances = {instances}
consumer-prefix = "{consumers}"
dead-letter-subject = "{dlq}"
output-stream = "{output}"
{names}storage = "memory"

[tiers]
events-topic = "{events}"
[[tiers.tier]]
name = "normal"
topic = "{normal}"
[[tiers.tier]]
name = "limited"
topic = "{limited}"
"#,
            servers = n.servers,
            input = n.input_stream,
            prefix = n.input_subject_prefix,
            partitions = n.partitions,
            consumers = n.consumer_prefix,
            dlq = n.dead_letter_subject,
            output = n.output_stream,
            names = [
                ("changelog-stream", &n.changelog_stream),
                ("changelog-subject-prefix", &n.changelog_subject_prefix),
                ("tier-counts-bucket", &n.tier_counts_bucket),
                ("overrides-bucket", &n.overrides_bucket),
            ]
            .iter()
            .filter_map(|(k, v)| Some(format!("{k} = \"{}\"\n", v.as_ref()?)))
            .collect::<String>(),
            events = self.tiers.events_topic,
            normal = self.tier_subject("normal"),
            limited = self.tier_subject("limited"),
        )
    }

    /// Starts settle in process on the current tokio runtime: `config`'s policies, stores
    /// under `dir`, short idle tick.
    pub async fn start(&self, config: &Config, dir: &Path) -> Result<Running> {
        let client = nats::connect(&self.nats).await?;
        let js = nats::jetstream(client, 4_096);
        let mut options = RuntimeOptions::from_config(config);
        options.data_dir = dir.to_path_buf();
        options.tiers = self.tiers.clone();
        options.batch_size = 500;
        options.idle_tick = Duration::from_millis(50);
        options.shutdown_deadline = Duration::from_secs(10);
        let runtime = Runtime::new(
            Engine::new(config.policy_table()),
            NatsSink::new(js.clone(), &self.nats),
            SystemClock,
            options,
        )?;
        let source = NatsSource::new(js, &self.nats, &self.tiers);
        Ok(Running::spawn(
            runtime,
            source,
            self.nats.partitions as i32,
            STEP,
        ))
    }
}

/// `input` (the input stream read back) as a `simulate` trace: every message that decodes,
/// plus its JetStream timestamp as `"ts"` and its partition, sorted by
/// `(ts, partition, sequence)`. Messages that fail decoding, or sit on another partition
/// than their key hashes to among `partitions` (dead letters), are left out.
pub fn trace_of(input: &[StreamRecord], partitions: u32) -> Result<String> {
    let mut lines: Vec<(i64, i32, u64, String)> = Vec::new();
    for r in input {
        let key = r.header(nats::KEY_HEADER).map(str::as_bytes);
        let Ok(upload) = codec::decode_upload_with(
            codec::KeyRule::Optional,
            key,
            &r.payload,
            r.timestamp_ms,
            i64::MAX,
        ) else {
            continue;
        };
        let partition = r.partition().context("input subject without a partition")?;
        let owner = nats::partition_for_key(upload.key.as_str().as_bytes(), partitions);
        if partition != owner {
            continue; // dead-lettered as wrong_partition
        }
        let mut obj: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&r.payload)?;
        obj.insert("ts".into(), r.timestamp_ms.into());
        obj.insert("partition".into(), partition.into());
        lines.push((
            r.timestamp_ms,
            partition,
            r.sequence,
            serde_json::to_string(&obj)?,
        ));
    }
    lines.sort();
    Ok(lines.into_iter().map(|l| l.3 + "\n").collect())
}
