//! Operator actions across a Kafka deployment (issue "operate it by hand", SEMANTICS §7):
//! three `settle run` processes in one consumer group over a 6-partition input, which the
//! test's producer fills with a partitioner settle does not use (session `sN` to partition
//! `N mod 6`, whatever its key hashes to), so settle cannot know where a session lives and
//! a session action goes to every partition.
//!
//! * Each instance's `GET /v1/pending` lists the rounds of the partitions it owns, and says
//!   which; together they list every session once.
//! * A flush asked of one instance for a session another owns: applied by the owner, every
//!   other partition answers `no_state`, emitted once with `trigger = manual` and the id the
//!   answer gave; the same request id asked of the third instance acts no more.
//! * A cancel, SIGKILL of the owner right after the answer, a restart: the round stays
//!   cancelled, nothing is emitted twice under different ids, no other round is lost.
//! * A bulk dry run's counts equal what the bulk flush then does.
//!
//! Needs `SETTLE_TEST_KAFKA` (tansu from `scripts/test.sh`).

use crate::admin_support::{post_json, try_get};
use crate::kafka_support::{broker, fresh_topics, ready_records};
use crate::process_support::free_port;
use crate::process_support::start_run_logged;
use anyhow::{ensure, Context as _, Result};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{json, Value};
use settle::engine::Trigger;
use settle::transport::kafka::{KafkaConfig, Role};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

const PARTITIONS: i32 = 6;
const SESSIONS: usize = 18;
const STEP: Duration = Duration::from_secs(180);

/// One `settle run` process of the test (also used by `kafka_overrides`).
pub(crate) struct Instance {
    pub(crate) config: PathBuf,
    pub(crate) log: PathBuf,
    pub(crate) addr: SocketAddr,
    pub(crate) child: Child,
}

impl Instance {
    pub(crate) fn start(
        kafka: &KafkaConfig,
        output: &str,
        dir: &Path,
        index: usize,
    ) -> Result<Instance> {
        let port = free_port()?;
        let text = format!(
            r#"transport = "kafka"
[debounce]
policy = "fixed"
delay = "1h"
[store]
data-dir = "{data}"
[runtime]
shutdown-deadline = "10s"
idle-tick = "50ms"
[admin]
listen = "127.0.0.1:{port}"
[kafka]
bootstrap-servers = "{bootstrap}"
group-id = "{group}"
input-topic = "{input}"
dead-letter-topic = "{dlq}"
instance-id = "actions-{index}"
[kafka.properties]
"session.timeout.ms" = 6000
"heartbeat.interval.ms" = 500
[tiers]
[[tiers.tier]]
name = "normal"
topic = "{output}"
"#,
            data = dir.join(format!("data-{index}")).display(),
            bootstrap = kafka.bootstrap_servers,
            group = kafka.group_id,
            input = kafka.input_topic,
            dlq = kafka.dead_letter_topic,
        );
        let config = dir.join(format!("i{index}.toml"));
        std::fs::write(&config, text)?;
        let log = dir.join(format!("i{index}.log"));
        // `process_support::settle` puts the admin on any free port: this test needs its own.
        let child = start_run_logged(
            &config,
            &[("SETTLE_ADMIN__LISTEN", &format!("127.0.0.1:{port}"))],
            &log,
        )?;
        Ok(Instance {
            config,
            log,
            addr: format!("127.0.0.1:{port}").parse()?,
            child,
        })
    }

    pub(crate) fn restart(&mut self) -> Result<()> {
        let log = self.log.with_extension("2.log");
        let listen = self.addr.to_string();
        self.child = start_run_logged(&self.config, &[("SETTLE_ADMIN__LISTEN", &listen)], &log)?;
        self.log = log;
        Ok(())
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every instance's pending page: (owned partitions, listed keys), once all answer and
/// together they cover every partition.
async fn pages(addrs: &[SocketAddr], seen: &mut String) -> Option<Vec<(Vec<i64>, Vec<String>)>> {
    let mut out = Vec::new();
    let mut covered = BTreeSet::new();
    seen.clear();
    for addr in addrs {
        let (code, body) = match try_get(*addr, "/v1/pending?limit=1000").await {
            Ok(a) => a,
            Err(e) => {
                *seen = format!("{addr}: {e}");
                return None;
            }
        };
        let v: Value = serde_json::from_str(&body).ok()?;
        seen.push_str(&format!(
            "{addr}: {code} partitions {} restoring {} rounds {}; ",
            v["partitions"],
            v["restoring"],
            v["rounds"].as_array().map_or(0, Vec::len)
        ));
        if code != 200 || !v["restoring"].as_array()?.is_empty() {
            return None;
        }
        let parts: Vec<i64> = v["partitions"]
            .as_array()?
            .iter()
            .filter_map(Value::as_i64)
            .collect();
        covered.extend(parts.iter().copied());
        let keys = v["rounds"]
            .as_array()?
            .iter()
            .filter_map(|r| Some(r["key"].as_str()?.to_owned()))
            .collect();
        out.push((parts, keys));
    }
    (covered.len() == PARTITIONS as usize).then_some(out)
}

async fn wait_rounds(addrs: &[SocketAddr], want: usize) -> Result<Vec<(Vec<i64>, Vec<String>)>> {
    let deadline = tokio::time::Instant::now() + STEP;
    let mut seen = String::new();
    loop {
        if let Some(p) = pages(addrs, &mut seen).await {
            let n: usize = p.iter().map(|(_, k)| k.len()).sum();
            if n == want {
                return Ok(p);
            }
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "open rounds never reached {want}: {seen}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[test]
fn kafka_actions_reach_the_owner_whatever_the_partitioner() -> Result<()> {
    let Some(bootstrap) = broker("kafka_actions_reach_the_owner_whatever_the_partitioner") else {
        return Ok(());
    };
    let rt = tokio::runtime::Runtime::new()?;
    let (kafka, output) = fresh_topics(&rt, &bootstrap, "actions", PARTITIONS)?;
    let dir = tempfile::tempdir()?;
    rt.block_on(async {
        // The test's partitioner: sN to partition N mod 6.
        let producer: FutureProducer = kafka.client_config(Role::Producer).create()?;
        for s in 0..SESSIONS {
            let key = format!("acme/s{s}");
            let body = format!(r#"{{"tenant":"acme","session":"s{s}"}}"#);
            for _ in 0..2 {
                producer
                    .send(
                        FutureRecord::to(&kafka.input_topic)
                            .partition((s % PARTITIONS as usize) as i32)
                            .key(key.as_bytes())
                            .payload(body.as_bytes()),
                        Duration::from_secs(30),
                    )
                    .await
                    .map_err(|(e, _)| e)?;
            }
        }
        let mut instances = (0..3)
            .map(|i| Instance::start(&kafka, &output, dir.path(), i))
            .collect::<Result<Vec<_>>>()?;
        let addrs: Vec<SocketAddr> = instances.iter().map(|i| i.addr).collect();
        let pages = wait_rounds(&addrs, SESSIONS).await?;
        // Each lists the sessions of its partitions (sN on partition N mod 6), once overall.
        let mut owner: BTreeMap<String, usize> = BTreeMap::new();
        for (i, (parts, keys)) in pages.iter().enumerate() {
            for k in keys {
                let s: usize = k.trim_start_matches("acme/s").parse()?;
                ensure!(parts.contains(&((s % PARTITIONS as usize) as i64)), "{k} listed by {i} owning {parts:?}");
                ensure!(owner.insert(k.clone(), i).is_none(), "{k} listed twice");
            }
        }
        ensure!(owner.len() == SESSIONS);

        // Flush a session asked of another instance than its owner.
        let (flushed, &holder) = owner.iter().next().context("a session")?;
        let asked = (holder + 1) % 3;
        let body = json!({"kind": "flush", "session": flushed, "reason": "never arrived", "request_id": "kafka-flush-1", "wait_ms": 30000});
        let (code, answer) = post_json(addrs[asked], "/v1/actions", &body.to_string()).await;
        ensure!(code == 200 && answer["result"] == "flushed", "{answer}");
        let outcomes = answer["outcomes"].as_array().context("outcomes")?;
        ensure!(outcomes.len() == PARTITIONS as usize, "every partition answers: {answer}");
        ensure!(outcomes.iter().filter(|o| o["result"] == "no_state").count() == PARTITIONS as usize - 1, "{answer}");
        let id = outcomes.iter().find_map(|o| o["emission_ids"][0].as_str()).context("emission id")?.to_owned();
        // The same request id, asked of the third instance.
        let third = (holder + 2) % 3;
        let (code, again) = post_json(addrs[third], "/v1/actions", &body.to_string()).await;
        ensure!(code == 200 && again["result"] == "flushed", "{again}");

        // Cancel a session of another owner, kill that owner at once, restart it.
        let (cancelled, &victim) = owner.iter().find(|(k, _)| *k != flushed).context("another")?;
        let asked = (victim + 1) % 3;
        let body = json!({"kind": "cancel", "session": cancelled, "reason": "bad data", "wait_ms": 30000});
        let (code, answer) = post_json(addrs[asked], "/v1/actions", &body.to_string()).await;
        ensure!(code == 200 && answer["result"] == "cancelled", "{answer}");
        instances[victim].child.kill()?;
        instances[victim].child.wait()?;
        instances[victim].restart()?;
        wait_rounds(&addrs, SESSIONS - 2).await?;

        // Bulk: a dry run's counts are what the bulk flush then does.
        let filter = json!({"tenant": "acme"});
        let (code, dry) = post_json(addrs[0], "/v1/actions", &json!({"kind": "flush", "filter": filter, "dry_run": true, "wait_ms": 30000}).to_string()).await;
        ensure!(code == 200 && dry["sessions"] == SESSIONS as u64 - 2, "{dry}");
        let (code, done) = post_json(addrs[0], "/v1/actions", &json!({"kind": "flush", "filter": filter, "wait_ms": 30000}).to_string()).await;
        ensure!(code == 200 && done["sessions"] == dry["sessions"] && done["uploads"] == dry["uploads"], "{done}");
        wait_rounds(&addrs, 0).await?;

        let records = ready_records(&kafka, &output, "normal", SESSIONS - 1, STEP).await?;
        let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for r in &records {
            ensure!(r.emission.trigger == Trigger::Manual, "{:?}", r.emission);
            ids.entry(r.emission.key.to_string()).or_default().insert(r.emission_id.clone());
        }
        ensure!(ids.len() == SESSIONS - 1, "{ids:?}");
        ensure!(!ids.contains_key(cancelled), "the cancelled round is never emitted");
        ensure!(ids[flushed] == BTreeSet::from([id]), "the flush once, with the answered id: {ids:?}");
        ensure!(ids.values().all(|s| s.len() == 1), "one id per round");
        drop(instances);
        Ok(())
    })
}
