//! Tiers across the deployment (issue 18, SEMANTICS §5) with three `settle run` processes on
//! a real Kafka broker, sharing their tier counts through the `<group-id>.tier-counts` topic
//! (which settle creates):
//!
//! 1. `a`, `b`, `c` start in one group over 9 partitions (`tiers.limit = 120` per 20 s,
//!    counts shared every second, fixed delay 1 s, so every session is one emission 1 s
//!    after its upload);
//! 2. for 40 s the test produces 12 sessions/s of tenant `noisy` (twice the limit, spread
//!    over every partition, so each instance sees about a third: alone, none of them would
//!    ever demote it) and 3 sessions/s of tenant `calm` (half the limit);
//! 3. all three get SIGTERM; `d`, `e`, `f` (new instance names) start on fresh data dirs;
//! 4. for 10 s more `noisy` sends 12 sessions/s.
//!
//! Checks: `noisy` was demoted once its deployment-wide count in the window crossed the limit
//! (its emissions in the 20 s before its first `limited` record: within 10 % below and 20 %
//! above 120), not at 3 × the limit; `calm` never left `normal`; one tier-change event for the
//! demotion, not three; after the restart every `noisy` record went to `limited`, with no
//! new tier-change event (the tier was restored from the log, not decided again); every
//! session emitted exactly once (distinct ids).
//!
//! `SETTLE_TEST_KAFKA=host:port` runs it (scripts/test.sh sets it); under CI a missing
//! broker is a failure. With `SETTLE_TEST_KEEP_LOGS` set (or on failure) the instances' logs
//! are kept and their directory printed.

use crate::kafka_support;
use crate::process_support;

use anyhow::{ensure, Context as _, Result};
use kafka_support::{broker, fresh_topics, now_ms, ready_records, ReadyOut};
use process_support::{json_log, send_sigterm, start_run_logged, wait_exit};
use rdkafka::producer::{FutureProducer, FutureRecord};
use settle::cli::loadgen;
use settle::transport::kafka::{KafkaConfig, Role};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

const PARTITIONS: i32 = 9;
const LIMIT: u64 = 120;
const PERIOD_MS: i64 = 20_000;

/// Bound on any one wait on the broker or a process.
const STEP: Duration = Duration::from_secs(120);

fn config_text(
    kafka: &KafkaConfig,
    normal: &str,
    limited: &str,
    events: &str,
    data: &Path,
) -> String {
    format!(
        r#"
[debounce]
policy = "fixed"
delay = "1s"

[store]
data-dir = "{data}"

[runtime]
shutdown-deadline = "10s"
idle-tick = "50ms"

[kafka]
bootstrap-servers = "{bootstrap}"
group-id = "{group}"
input-topic = "{input}"
dead-letter-topic = "{dlq}"
[kafka.properties]
"session.timeout.ms" = 6000
"heartbeat.interval.ms" = 500

[tiers]
limit = {LIMIT}
period = "20s"
recover-ratio = 0.5
cooldown = "60s"
share-interval = "1s"
events-topic = "{events}"
[[tiers.tier]]
name = "normal"
topic = "{normal}"
[[tiers.tier]]
name = "limited"
topic = "{limited}"
"#,
        data = data.display(),
        bootstrap = kafka.bootstrap_servers,
        group = kafka.group_id,
        input = kafka.input_topic,
        dlq = kafka.dead_letter_topic,
    )
}

/// The `settle run` processes; whatever still runs is killed when dropped, and the logs are
/// kept (path printed) when the test failed or `SETTLE_TEST_KEEP_LOGS` is set.
struct Fleet {
    dir: tempfile::TempDir,
    children: Vec<(String, Child)>,
    passed: bool,
}

impl Fleet {
    fn start(&mut self, id: &str, config: &str) -> Result<()> {
        let path = self.dir.path().join(format!("{id}.toml"));
        std::fs::write(&path, config)?;
        let log = self.log(id);
        let child = start_run_logged(&path, &[("SETTLE_KAFKA__INSTANCE_ID", id)], &log)?;
        self.children.push((id.to_owned(), child));
        Ok(())
    }

    fn log(&self, id: &str) -> PathBuf {
        self.dir.path().join(format!("{id}.log"))
    }

    /// Waits until each running instance has restored its tier state and owns partitions.
    fn wait_ready(&mut self) -> Result<()> {
        let t0 = Instant::now();
        loop {
            let mut ready = 0;
            for (id, child) in &mut self.children {
                if let Some(status) = child.try_wait()? {
                    let log = json_log(&self.dir.path().join(format!("{id}.log")))?;
                    anyhow::bail!("instance {id} exited ({status}):\n{}", log.trouble(15));
                }
                let log = json_log(&self.dir.path().join(format!("{id}.log")))?;
                let restored = log
                    .with_message("tier state restored from the tier-counts log")
                    .count();
                let assigned = log.with_message("partitions assigned").count();
                if restored > 0 && assigned > 0 {
                    ready += 1;
                }
            }
            if ready == self.children.len() {
                return Ok(());
            }
            ensure!(t0.elapsed() < STEP, "instances not ready after {STEP:?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// SIGTERM to every instance; each must exit 0.
    fn stop_all(&mut self) -> Result<()> {
        for (_, child) in &self.children {
            send_sigterm(child)?;
        }
        for (id, mut child) in self.children.drain(..) {
            let status = wait_exit(&mut child, Duration::from_secs(30))?
                .with_context(|| format!("{id} did not exit after SIGTERM"))?;
            ensure!(status.success(), "{id} exited with {status}");
        }
        Ok(())
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        if !self.passed || std::env::var_os("SETTLE_TEST_KEEP_LOGS").is_some() {
            let kept = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tempdir"));
            println!("kafka_tiers: logs kept in {}", kept.keep().display());
        }
    }
}

/// Produces, in real time for `secs` seconds, `noisy_per_s` sessions per second of tenant
/// `noisy` and `calm_per_s` of tenant `calm` (one upload each, session ids from `first`).
/// Returns the number of sessions of each.
fn traffic(
    rt: &tokio::runtime::Runtime,
    producer: &FutureProducer,
    topic: &str,
    secs: u64,
    (noisy_per_s, calm_per_s): (u64, u64),
    first: u64,
) -> Result<(u64, u64)> {
    let t0 = Instant::now();
    let (mut noisy, mut calm) = (0u64, 0u64);
    let ticks = secs * 4;
    for tick in 0..ticks {
        let at = Duration::from_millis(250 * tick);
        if let Some(wait) = at.checked_sub(t0.elapsed()) {
            std::thread::sleep(wait);
        }
        let due = |per_s: u64| (tick + 1) * per_s / 4 - tick * per_s / 4;
        let mut batch = Vec::new();
        for _ in 0..due(noisy_per_s) {
            batch.push(("noisy", first + noisy));
            noisy += 1;
        }
        for _ in 0..due(calm_per_s) {
            batch.push(("calm", first + calm));
            calm += 1;
        }
        rt.block_on(async {
            let sends = batch.iter().map(|(tenant, n)| {
                let key = format!("{tenant}/s-{n}");
                let value = format!(r#"{{"tenant":"{tenant}","session":"s-{n}"}}"#);
                async move {
                    producer
                        .send(
                            FutureRecord::to(topic).key(&key).payload(&value),
                            Duration::from_secs(10),
                        )
                        .await
                        .map(drop)
                        .map_err(|(e, _)| anyhow::anyhow!("produce {key}: {e}"))
                }
            });
            futures::future::try_join_all(sends).await
        })?;
    }
    Ok((noisy, calm))
}

/// Every ready record of `tenant` in `records`.
fn of<'a>(records: &'a [ReadyOut], tenant: &str) -> Vec<&'a ReadyOut> {
    records
        .iter()
        .filter(|r| r.emission.key.tenant() == tenant)
        .collect()
}

#[test]
fn kafka_three_instances_share_tier_counts_and_keep_tiers_across_restart() -> Result<()> {
    let Some(bootstrap) =
        broker("kafka_three_instances_share_tier_counts_and_keep_tiers_across_restart")
    else {
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (kafka, normal) = fresh_topics(&rt, &bootstrap, "tiers", PARTITIONS)?;
    let limited = format!("{normal}-limited");
    let events = format!("{normal}-tier-events");
    rt.block_on(loadgen::create_topics(
        &kafka,
        &[(&limited, 1), (&events, 1)],
    ))?;
    let mut fleet = Fleet {
        dir: tempfile::tempdir()?,
        children: Vec::new(),
        passed: false,
    };
    let producer: FutureProducer = kafka.client_config(Role::Producer).create()?;
    let started = Instant::now();

    for id in ["a", "b", "c"] {
        let data = fleet.dir.path().join(format!("data-{id}"));
        fleet.start(id, &config_text(&kafka, &normal, &limited, &events, &data))?;
    }
    fleet.wait_ready()?;
    // Let the group settle on three members before the traffic.
    std::thread::sleep(Duration::from_secs(3));
    let phase1_start = now_ms();
    let (noisy1, calm1) = traffic(&rt, &producer, &kafka.input_topic, 40, (12, 3), 0)?;
    // Every round of phase 1 out (1 s delay), and a snapshot of each instance after it.
    std::thread::sleep(Duration::from_secs(4));
    fleet.stop_all()?;
    let restart_ms = now_ms();

    for id in ["d", "e", "f"] {
        let data = fleet.dir.path().join(format!("data-{id}"));
        fleet.start(id, &config_text(&kafka, &normal, &limited, &events, &data))?;
    }
    fleet.wait_ready()?;
    let (noisy2, _) = traffic(&rt, &producer, &kafka.input_topic, 10, (12, 0), noisy1)?;
    let total = (noisy1 + calm1 + noisy2) as usize;

    // Every session out exactly once, over both tiers.
    let t0 = Instant::now();
    let (normal_out, limited_out) = loop {
        let n = rt.block_on(ready_records(&kafka, &normal, "normal", 0, STEP))?;
        let l = rt.block_on(ready_records(&kafka, &limited, "limited", 0, STEP))?;
        let ids: BTreeSet<&str> = n.iter().chain(&l).map(|r| r.emission_id.as_str()).collect();
        if ids.len() >= total {
            ensure!(
                ids.len() == total,
                "{} distinct ids, {total} sessions",
                ids.len()
            );
            break (n, l);
        }
        ensure!(
            t0.elapsed() < STEP,
            "{} of {total} sessions out after {STEP:?}",
            ids.len()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    fleet.stop_all()?;

    // 1. noisy demoted near the limit of the deployment-wide count.
    let noisy_all: Vec<&ReadyOut> = of(&normal_out, "noisy")
        .into_iter()
        .chain(of(&limited_out, "noisy"))
        .filter(|r| r.emitted_at < restart_ms)
        .collect();
    let first_limited = of(&limited_out, "noisy")
        .iter()
        .map(|r| r.emitted_at)
        .filter(|&t| t < restart_ms)
        .min()
        .context("noisy was never demoted: the instances did not sum their counts")?;
    let in_window = noisy_all
        .iter()
        .filter(|r| r.emitted_at > first_limited - PERIOD_MS && r.emitted_at < first_limited)
        .count() as u64;
    println!(
        "noisy: first limited record {:.1} s into the traffic, {in_window} of its emissions in the 20 s before it (limit {LIMIT})",
        (first_limited - phase1_start) as f64 / 1000.0
    );
    ensure!(
        (LIMIT * 9 / 10..=LIMIT * 12 / 10).contains(&in_window),
        "noisy demoted with {in_window} emissions in the window, want within 20 % of the limit {LIMIT}"
    );
    // 2. calm never left normal.
    ensure!(
        of(&limited_out, "calm").is_empty(),
        "calm was routed to limited"
    );
    ensure!(
        of(&normal_out, "calm").len() as u64 == calm1,
        "calm: {} records, {calm1} sessions",
        of(&normal_out, "calm").len()
    );
    // 3. one tier-change event per change.
    let changes = rt.block_on(loadgen::read_topic(&kafka, &events, 1, STEP))?;
    let changes: Vec<serde_json::Value> = changes
        .iter()
        .map(|r| serde_json::from_slice(&r.payload).context("a tier-change record"))
        .collect::<Result<_>>()?;
    println!("tier changes: {changes:?}");
    let demotions: Vec<&serde_json::Value> = changes
        .iter()
        .filter(|c| c["tenant"] == "noisy" && c["reason"] == "rate_exceeded")
        .collect();
    ensure!(
        demotions.len() == 1,
        "{} tier-change events for noisy's demotion (one change, one event): {demotions:?}",
        demotions.len()
    );
    let rate = demotions[0]["rate"].as_u64().unwrap_or_default();
    ensure!(
        (LIMIT + 1..=LIMIT * 12 / 10).contains(&rate),
        "the event's deployment-wide rate {rate}"
    );
    ensure!(
        !changes.iter().any(|c| c["tenant"] == "calm"),
        "calm changed tier: {changes:?}"
    );
    // 4. after the restart noisy is still limited from its first emission on.
    let after: Vec<&ReadyOut> = of(&normal_out, "noisy")
        .into_iter()
        .filter(|r| r.emitted_at >= restart_ms)
        .collect();
    let after_limited = of(&limited_out, "noisy")
        .iter()
        .filter(|r| r.emitted_at >= restart_ms)
        .count() as u64;
    ensure!(
        after.is_empty(),
        "{} noisy records went to normal after the restart (of {noisy2}): the tier was forgotten",
        after.len()
    );
    ensure!(
        after_limited == noisy2,
        "{after_limited} limited after the restart, {noisy2} sessions"
    );
    println!(
        "{total} sessions ({noisy1} + {noisy2} noisy, {calm1} calm) over 3 + 3 instances; after the restart all {after_limited} noisy records limited; {} tier-change events; {:.0} s",
        changes.len(),
        started.elapsed().as_secs_f64()
    );
    fleet.passed = true;
    Ok(())
}
