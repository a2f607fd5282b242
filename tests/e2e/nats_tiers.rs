//! Tiers across the deployment on NATS (issue 18, SEMANTICS §5): two `settle run --transport
//! nats` processes (instances 0 and 1 of 2, 8 partitions) sharing their tier counts through
//! the test's KV bucket (`nats.tier-counts-bucket`):
//!
//! 1. for 30 s the test publishes 6 sessions/s of tenant `noisy` (twice `tiers.limit = 60`
//!    per 20 s, spread over every partition, so each instance sees about half) and 1/s of
//!    tenant `calm`; fixed 4 s debounce, one upload per session;
//! 2. both get SIGTERM and start again (new processes: new instance names);
//! 3. for 8 s more `noisy` publishes 6 sessions/s.
//!
//! Checks: `noisy` was demoted with its emissions in the 20 s before its first `limited`
//! record within 10 % below and 20 % above the limit; one tier-change event for it; `calm`
//! stayed `normal`; after the restart every `noisy` record is `limited` with no new event;
//! every session emitted once.
//!
//! `SETTLE_TEST_NATS=host:port` runs it (scripts/test.sh sets it); under CI a missing server
//! is a failure.

use crate::nats_support;
use crate::process_support;

use anyhow::{ensure, Context as _, Result};
use nats_support::{server, Setup, STEP};
use process_support::{json_log, send_sigterm, start_run_logged, wait_exit};
use settle::codec;
use settle::transport::nats::{self, Storage};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

const PARTITIONS: u32 = 8;
const LIMIT: u64 = 60;
const PERIOD_MS: i64 = 20_000;

/// The tier rule, from the environment (the config's `[tiers]` comes from the setup).
const TIERS_ENV: [(&str, &str); 4] = [
    ("SETTLE_TIERS__LIMIT", "60"),
    ("SETTLE_TIERS__PERIOD", "20s"),
    ("SETTLE_TIERS__COOLDOWN", "60s"),
    ("SETTLE_TIERS__SHARE_INTERVAL", "1s"),
];

/// One ready record read back: (tenant, tier, emitted_at ms, emission id).
type Out = (String, String, i64, String);

fn start(setup: &Setup, dir: &Path, name: &str, index: u32) -> Result<Child> {
    let text = format!(
        "transport = \"nats\"\n{}{}",
        process_support::debounce_store_runtime(
            &dir.join(format!("data-{index}")),
            Duration::from_secs(10)
        ),
        setup.run_config_sections(index, 2)
    );
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(&config, text)?;
    start_run_logged(&config, &TIERS_ENV, &dir.join(format!("{name}.log")))
}

/// Waits until every process logged its tier-state restore and an assignment.
fn wait_ready(dir: &Path, names: &[&str], children: &mut [Child]) -> Result<()> {
    let t0 = Instant::now();
    loop {
        let mut ready = 0;
        for (name, child) in names.iter().zip(children.iter_mut()) {
            let log = json_log(&dir.join(format!("{name}.log")))?;
            if let Some(status) = child.try_wait()? {
                anyhow::bail!("{name} exited ({status}):\n{}", log.trouble(15));
            }
            let restored = log
                .with_message("tier state restored from the tier-counts log")
                .count();
            if restored > 0 && log.with_message("partitions assigned").count() > 0 {
                ready += 1;
            }
        }
        if ready == names.len() {
            return Ok(());
        }
        ensure!(t0.elapsed() < STEP, "instances not ready after {STEP:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn stop(children: Vec<Child>) -> Result<()> {
    for c in &children {
        send_sigterm(c)?;
    }
    for mut c in children {
        let status =
            wait_exit(&mut c, Duration::from_secs(30))?.context("no exit after SIGTERM")?;
        ensure!(status.success(), "exit status {status}");
    }
    Ok(())
}

/// Publishes `noisy` at `noisy_per_s` and `calm` at `calm_per_s` sessions per second for
/// `secs` s, session numbers from `first`; returns the counts.
async fn traffic(
    setup: &Setup,
    secs: u64,
    (noisy_per_s, calm_per_s): (u64, u64),
    first: u64,
) -> Result<(u64, u64)> {
    let t0 = tokio::time::Instant::now();
    let (mut noisy, mut calm) = (0u64, 0u64);
    for tick in 0..secs * 4 {
        tokio::time::sleep_until(t0 + Duration::from_millis(250 * tick)).await;
        let due = |per_s: u64| (tick + 1) * per_s / 4 - tick * per_s / 4;
        let mut acks = Vec::new();
        for (tenant, n, count) in [
            ("noisy", &mut noisy, due(noisy_per_s)),
            ("calm", &mut calm, due(calm_per_s)),
        ] {
            for _ in 0..count {
                let key = format!("{tenant}/s-{}", first + *n);
                let body = format!(r#"{{"tenant":"{tenant}","session":"s-{}"}}"#, first + *n);
                *n += 1;
                let (_, ack) = nats::publish_upload(
                    &setup.js,
                    &setup.nats.input_subject_prefix,
                    setup.nats.partitions,
                    &key,
                    body.as_bytes(),
                    None,
                    true,
                )
                .await?;
                acks.push(ack);
            }
        }
        for a in acks {
            a.await?;
        }
    }
    Ok((noisy, calm))
}

/// Every ready record of both tier subjects.
async fn outputs(setup: &Setup) -> Result<Vec<Out>> {
    let mut out = Vec::new();
    for tier in ["normal", "limited"] {
        let records = nats::read_stream(
            &setup.js,
            &setup.nats.output_stream,
            setup.tier_subject(tier),
            0,
            STEP,
        )
        .await?;
        for r in records {
            let ready = codec::decode_ready(&r.payload).context("output record")?;
            ensure!(
                ready.tier == tier,
                "{} in tier {}",
                ready.emission_id,
                ready.tier
            );
            out.push((
                ready.tenant.clone(),
                ready.tier.clone(),
                ready.emitted_at,
                ready.emission_id.clone(),
            ));
        }
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_two_instances_share_tier_counts_and_keep_tiers_across_restart() -> Result<()> {
    let Some(addr) = server("nats_two_instances_share_tier_counts_and_keep_tiers_across_restart")
    else {
        return Ok(());
    };
    let setup = Setup::new(&addr, "tiers", Storage::Memory, PARTITIONS).await?;
    let dir = tempfile::tempdir()?;
    let result = scenario(&setup, dir.path()).await;
    setup.cleanup().await;
    if result.is_err() {
        println!("nats_tiers: logs kept in {}", dir.keep().display());
    }
    result
}

async fn scenario(setup: &Setup, dir: &Path) -> Result<()> {
    let mut first: Vec<Child> = vec![start(setup, dir, "a", 0)?, start(setup, dir, "b", 1)?];
    wait_ready(dir, &["a", "b"], &mut first)?;
    let (noisy1, calm1) = traffic(setup, 30, (6, 1), 0).await?;
    // Every round of the first phase out (4 s delay), then both stopped.
    tokio::time::sleep(Duration::from_secs(6)).await;
    stop(first)?;
    let restart_ms = settle::runtime::Clock::now_ms(&settle::runtime::SystemClock);
    let mut second: Vec<Child> = vec![start(setup, dir, "c", 0)?, start(setup, dir, "d", 1)?];
    let ready = wait_ready(dir, &["c", "d"], &mut second);
    if let Err(e) = ready {
        for mut c in second {
            let _ = c.kill();
        }
        return Err(e);
    }
    let (noisy2, _) = traffic(setup, 8, (6, 0), noisy1).await?;
    let total = (noisy1 + calm1 + noisy2) as usize;
    let t0 = Instant::now();
    let out = loop {
        let out = outputs(setup).await?;
        let ids: BTreeSet<&str> = out.iter().map(|o| o.3.as_str()).collect();
        if ids.len() >= total {
            ensure!(
                ids.len() == total,
                "{} distinct ids, {total} sessions",
                ids.len()
            );
            break out;
        }
        if t0.elapsed() > STEP {
            for mut c in second {
                let _ = c.kill();
            }
            anyhow::bail!("{} of {total} sessions out after {STEP:?}", ids.len());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    stop(second)?;

    let noisy: Vec<&Out> = out.iter().filter(|o| o.0 == "noisy").collect();
    let first_limited = noisy
        .iter()
        .filter(|o| o.1 == "limited" && o.2 < restart_ms)
        .map(|o| o.2)
        .min()
        .context("noisy was never demoted: the instances did not sum their counts")?;
    let in_window = noisy
        .iter()
        .filter(|o| o.2 > first_limited - PERIOD_MS && o.2 < first_limited)
        .count() as u64;
    println!("noisy: {in_window} of its emissions in the 20 s before its first limited record (limit {LIMIT})");
    ensure!(
        (LIMIT * 9 / 10..=LIMIT * 12 / 10).contains(&in_window),
        "demoted with {in_window} in the window, want within 20 % of {LIMIT}"
    );
    ensure!(
        out.iter().all(|o| o.0 != "calm" || o.1 == "normal"),
        "calm left normal"
    );
    let after: Vec<&&Out> = noisy.iter().filter(|o| o.2 >= restart_ms).collect();
    ensure!(
        after.len() as u64 == noisy2 && after.iter().all(|o| o.1 == "limited"),
        "after the restart: {} noisy records, {} of them normal (of {noisy2})",
        after.len(),
        after.iter().filter(|o| o.1 == "normal").count()
    );
    let events = nats::read_stream(
        &setup.js,
        &setup.nats.output_stream,
        &setup.tiers.events_topic,
        1,
        STEP,
    )
    .await?;
    let changes: Vec<serde_json::Value> = events
        .iter()
        .map(|r| serde_json::from_slice(&r.payload).context("a tier change"))
        .collect::<Result<_>>()?;
    let demotions = changes
        .iter()
        .filter(|c| c["tenant"] == "noisy" && c["reason"] == "rate_exceeded")
        .count();
    ensure!(
        demotions == 1 && !changes.iter().any(|c| c["tenant"] == "calm"),
        "tier changes: {changes:?}"
    );
    println!(
        "{total} sessions ({noisy1} + {noisy2} noisy, {calm1} calm) over 2 + 2 instances; one tier change; after the restart all {noisy2} noisy records limited"
    );
    Ok(())
}
