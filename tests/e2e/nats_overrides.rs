//! Tenant overrides across a NATS deployment (issue "operate it by hand", item 3; SEMANTICS
//! §7): two `settle run` processes (instances 0 and 1 of 2, 4 partitions, the config's rule
//! `fixed 1h`), overrides in the KV bucket `nats.overrides-bucket`.
//!
//! * An override set through instance 0 (fixed 300 ms, pinned to `limited`) is in force on
//!   instance 1 within one share interval (`tiers.share-interval`, 1 s), and the uploads of
//!   the tenant on every partition (both instances) are emitted timed by it, on the pinned
//!   tier.
//! * Both instances SIGKILLed and restarted: the override is in force on both, and new
//!   uploads are timed by it again.
//! * A stale version asked of instance 1: 409 with the current version. A removal through
//!   instance 1 gives the tenant its configured rule back on instance 0 within the interval.
//!
//! Uses the server of `SETTLE_TEST_NATS`, else 127.0.0.1:4222; under CI a missing server is
//! a failure.

use crate::admin_support::{get_json, try_get, try_request};
use crate::nats_actions::Instance;
use crate::nats_support::{server, Setup, STEP};
use anyhow::{ensure, Context as _, Result};
use serde_json::{json, Value};
use settle::engine::PolicyName;
use settle::transport::nats::Storage;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const PARTITIONS: u32 = 4;
/// `tiers.share-interval` of the test (the default).
pub(crate) const SHARE_INTERVAL: Duration = Duration::from_secs(1);

async fn ready(i: &Instance) -> Result<()> {
    ready_at(i.addr).await.with_context(|| i.tail())
}

/// Waits until the admin server at `addr` answers `/readyz` with 200.
pub(crate) async fn ready_at(addr: SocketAddr) -> Result<()> {
    let t0 = Instant::now();
    loop {
        if let Ok((200, _)) = try_get(addr, "/readyz").await {
            return Ok(());
        }
        ensure!(t0.elapsed() < STEP, "{addr} not ready");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `method path` with a JSON body; the answer parsed.
pub(crate) async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value)> {
    let text = body.map(Value::to_string);
    let (code, answer) = try_request(addr, method, path, &[], text.as_deref()).await?;
    Ok((
        code,
        serde_json::from_str(&answer).with_context(|| answer.clone())?,
    ))
}

/// Waits until `tenant`'s view on `addr` says `wins` with override version `version`, and
/// the rule in force differs from the configured one exactly when the override wins (the
/// override of these tests sets a rule); returns how long it took.
pub(crate) async fn until_wins(
    addr: SocketAddr,
    tenant: &str,
    wins: &str,
    version: u64,
) -> Result<Duration> {
    let t0 = Instant::now();
    loop {
        let (code, view) = get_json(addr, &format!("/v1/tenants/{tenant}")).await;
        // The rule in force (what the partitions apply) too, not only the copy of the set.
        let applied =
            (view["rules"]["rule"] != view["rules"]["configured"]["rule"]) == (wins == "override");
        if code == 200
            && view["rules"]["wins"] == wins
            && view["rules"]["override"]["version"] == version
            && applied
        {
            return Ok(t0.elapsed());
        }
        ensure!(t0.elapsed() < STEP, "{addr}: {view}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Publishes one upload of each of `sessions` of `tenant`; returns the partitions they went to.
async fn publish(setup: &Setup, tenant: &str, sessions: &[String]) -> Result<BTreeSet<i32>> {
    let mut partitions = BTreeSet::new();
    for s in sessions {
        let body = format!(r#"{{"tenant":"{tenant}","session":"{s}"}}"#);
        let (p, _) = setup
            .publish(&format!("{tenant}/{s}"), body.as_bytes(), None)
            .await?;
        partitions.insert(p);
    }
    Ok(partitions)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_overrides_apply_on_every_instance_and_after_a_restart() -> Result<()> {
    let Some(server) = server("nats_overrides_apply_on_every_instance_and_after_a_restart") else {
        return Ok(());
    };
    let setup = Setup::new(&server, "ovr", Storage::Memory, PARTITIONS).await?;
    let dir = tempfile::tempdir()?;
    let mut i0 = Instance::start(&setup, dir.path(), 0)?;
    let mut i1 = Instance::start(&setup, dir.path(), 1)?;
    ready(&i0).await?;
    ready(&i1).await?;

    // Set through instance 0.
    let body = json!({"version": 0, "debounce": {"policy": "fixed", "delay": "300ms"}, "tier": "limited", "reason": "incident 42", "request_id": "nats-ov-1"});
    let (code, answer) = send(i0.addr, "PUT", "/v1/tenants/acme/override", Some(&body)).await?;
    ensure!(
        code == 200 && answer["result"] == "applied",
        "{answer}\n{}",
        i0.tail()
    );
    let took = until_wins(i1.addr, "acme", "override", 1).await?;
    ensure!(
        took <= SHARE_INTERVAL,
        "instance 1 applied the override after {took:?}, more than one share interval"
    );

    // Uploads on every partition: timed by the override, on the pinned tier.
    let sessions: Vec<String> = (0..12).map(|i| format!("s{i}")).collect();
    let partitions = publish(&setup, "acme", &sessions).await?;
    ensure!(
        partitions.contains(&0) && partitions.contains(&1),
        "sessions on both instances: {partitions:?}"
    );
    let emitted = setup.emitted("limited", sessions.len()).await?;
    ensure!(emitted.len() == sessions.len(), "{emitted:?}");
    ensure!(
        emitted
            .iter()
            .all(|e| e.policy == PolicyName::Fixed && e.delay_ms == 300),
        "every emission timed by the override: {emitted:?}"
    );

    // Both killed and restarted: still in force on both.
    for i in [&mut i0, &mut i1] {
        i.child.kill()?;
        i.child.wait()?;
    }
    i0.restart()?;
    i1.restart()?;
    ready(&i0).await?;
    ready(&i1).await?;
    until_wins(i0.addr, "acme", "override", 1).await?;
    until_wins(i1.addr, "acme", "override", 1).await?;
    let again: Vec<String> = (0..12).map(|i| format!("r{i}")).collect();
    publish(&setup, "acme", &again).await?;
    let emitted = setup.emitted("limited", 2 * sessions.len()).await?;
    let after: Vec<_> = emitted
        .iter()
        .filter(|e| e.key.session().starts_with('r'))
        .collect();
    ensure!(after.len() == again.len(), "{emitted:?}");
    ensure!(
        after.iter().all(|e| e.delay_ms == 300),
        "timed by the override after the restart: {after:?}"
    );

    // Stale through instance 1; removal through instance 1, seen by instance 0.
    let stale = json!({"version": 0, "debounce": {"delay": "1s"}});
    let (code, answer) = send(i1.addr, "PUT", "/v1/tenants/acme/override", Some(&stale)).await?;
    ensure!(code == 409 && answer["version"] == 1, "{answer}");
    let (code, answer) = send(
        i1.addr,
        "DELETE",
        "/v1/tenants/acme/override?version=1",
        None,
    )
    .await?;
    ensure!(code == 200, "{answer}");
    let took = until_wins(i0.addr, "acme", "config", 2).await?;
    ensure!(took <= SHARE_INTERVAL, "removal seen after {took:?}");
    let (_, view) = get_json(i0.addr, "/v1/tenants/acme").await;
    ensure!(
        view["rules"]["rule"]
            .as_str()
            .is_some_and(|r| r.starts_with("fixed delay=1h")),
        "{view}"
    );

    drop((i0, i1));
    setup.cleanup().await;
    Ok(())
}
