//! The NATS tier-counts bucket (`nats.tier-counts-bucket`, SEMANTICS §5) on a real JetStream
//! server: what two instances' tier-share tasks do through it. One instance's snapshot read
//! back by another demotes a tenant the second one publishes nothing of; a restarted
//! instance reads every instance's latest snapshot and keeps the demoted tenant limited.
//!
//! `SETTLE_TEST_NATS=host:port` runs it (scripts/test.sh sets it); under CI a missing server
//! is a failure.

use crate::nats_support;

use anyhow::{ensure, Context as _, Result};
use nats_support::{server, Setup, STEP};
use settle::runtime::{Clock, SystemClock};
use settle::tiers::{CountsSnapshot, Router, TiersConfig};
use settle::transport::nats::{Storage, TierCountsBucket};
use settle::transport::TierCounts;
use std::time::Duration;

fn tiers() -> TiersConfig {
    TiersConfig {
        limit: 10,
        period: Duration::from_secs(60),
        cooldown: Duration::from_secs(60),
        ..TiersConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_tier_counts_bucket_sums_instances_and_restores_demotions() -> Result<()> {
    let Some(addr) = server("nats_tier_counts_bucket_sums_instances_and_restores_demotions") else {
        return Ok(());
    };
    let setup = Setup::new(&addr, "tiercounts", Storage::Memory, 1).await?;
    let bucket = TierCountsBucket::new(setup.js.clone(), &setup.nats).context("sharing is on")?;
    let result = scenario(&bucket).await;
    setup.cleanup().await;
    result
}

async fn scenario(bucket: &TierCountsBucket) -> Result<()> {
    let now = SystemClock.now_ms();
    let mut a = Router::new(&tiers())?;
    a.set_instance("pod/a");
    let mut b = Router::new(&tiers())?;
    b.set_instance("pod/b");
    ensure!(
        bucket.read_latest(STEP).await?.is_empty(),
        "a new bucket holds nothing"
    );
    let mut feed = bucket.subscribe().await?;
    for i in 0..11 {
        a.route("noisy", now + i);
    }
    ensure!(a.tier_of("noisy") == "limited");
    // Two snapshots of a: the bucket keeps the latest only.
    bucket
        .publish("pod/a", a.share_snapshot(now + 20).to_json())
        .await?;
    bucket
        .publish("pod/a", a.share_snapshot(now + 30).to_json())
        .await?;
    bucket
        .publish("pod/b", b.share_snapshot(now + 30).to_json())
        .await?;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let bytes = tokio::time::timeout(STEP, feed.next()).await??;
        seen.push(CountsSnapshot::from_json(&bytes).map_err(anyhow::Error::msg)?);
    }
    ensure!(
        seen.iter().map(|s| s.at).collect::<Vec<_>>() == vec![now + 20, now + 30, now + 30],
        "the feed delivers every snapshot in order: {seen:?}"
    );
    let changes: Vec<_> = seen
        .iter()
        .flat_map(|s| b.apply_remote(s, now + 40))
        .collect();
    ensure!(
        changes.len() == 1 && b.tier_of("noisy") == "limited",
        "b demotes noisy on a's counts: {changes:?}"
    );
    let latest = bucket.read_latest(STEP).await?;
    let latest: Vec<CountsSnapshot> = latest
        .iter()
        .map(|b| CountsSnapshot::from_json(b).map_err(anyhow::Error::msg))
        .collect::<Result<_>>()?;
    ensure!(latest.len() == 2, "one snapshot per instance: {latest:?}");
    ensure!(latest
        .iter()
        .any(|s| s.instance == "pod/a" && s.at == now + 30));
    // A restarted instance (new name), 10 s later: a's counts are no longer live, its
    // demotion is.
    let mut c = Router::new(&tiers())?;
    c.set_instance("pod/c");
    let restored = c.restore(&latest, now + 10_000);
    ensure!(
        (restored.snapshots, restored.live, restored.demoted) == (2, 0, 1),
        "{restored:?}"
    );
    let route = c.route("noisy", now + 10_001);
    ensure!(route.tier == "limited" && route.change.is_none());
    Ok(())
}
