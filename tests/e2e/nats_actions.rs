//! Operator actions across a NATS deployment (issue "operate it by hand", SEMANTICS §7): two
//! `settle run` processes (instances 0 and 1 of 2, 4 partitions, rounds due in an hour).
//!
//! * Instance 0's `GET /v1/pending` lists only the rounds of the partitions it owns, and
//!   says which; the two summaries add up to every open round.
//! * A flush asked of instance 0 for a session instance 1 owns is applied by instance 1
//!   (the action record goes to the session's partition subject), answered with its outcome
//!   (read back from the audit stream), and emitted once with `trigger = manual` and the id
//!   the answer gave.
//! * The same request id again, asked of instance 1 and published again as a record to the
//!   partition: acts once.
//! * A cancel, then SIGKILL of the owner right after the answer, then a restart: the round
//!   stays cancelled (never emitted), the flush is not emitted again under another id, no
//!   other round is lost; the audit stream says `cancelled`.
//! * A bulk dry run's counts equal what the bulk flush then does.
//!
//! Uses the server of `SETTLE_TEST_NATS`, else 127.0.0.1:4222; under CI a missing server is
//! a failure.

use crate::admin_support::{get_json, post_json, try_get};
use crate::nats_support::{server, Setup, STEP};
use crate::process_support::free_port;
use crate::process_support::start_run_logged;
use anyhow::{ensure, Context as _, Result};
use serde_json::{json, Value};
use settle::codec::action::{ActionKind, ActionRecord, AuditRecord};
use settle::engine::Trigger;
use settle::transport::nats::{self, NatsActions, Storage};
use settle::transport::ActionChannel;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

const PARTITIONS: u32 = 4;
const SESSIONS: usize = 16;

fn config(setup: &Setup, dir: &Path, index: u32, port: u16) -> Result<PathBuf> {
    let data = dir.join(format!("data-{index}"));
    let text = format!(
        r#"transport = "nats"
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
{sections}"#,
        data = data.display(),
        sections = setup.run_config_sections(index, 2)
    );
    let path = dir.join(format!("i{index}.toml"));
    std::fs::write(&path, text)?;
    Ok(path)
}

/// One `settle run` process of the test (also used by `nats_overrides`).
pub(crate) struct Instance {
    pub(crate) config: PathBuf,
    pub(crate) log: PathBuf,
    pub(crate) addr: SocketAddr,
    pub(crate) child: Child,
}

impl Instance {
    pub(crate) fn start(setup: &Setup, dir: &Path, index: u32) -> Result<Instance> {
        let port = free_port()?;
        let config = config(setup, dir, index, port)?;
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

    /// The last lines of its log, for a failure message.
    pub(crate) fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let admin: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.contains("admin") || l.contains("ERROR"))
            .collect();
        let config = std::fs::read_to_string(&self.config).unwrap_or_default();
        format!(
            "{} (addr {}) config:\n{config}\n{}",
            admin.join("\n"),
            self.addr,
            lines[lines.len().saturating_sub(5)..].join("\n")
        )
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

/// Open rounds the two instances report, once both answer.
async fn open_rounds(a: SocketAddr, b: SocketAddr) -> Option<u64> {
    let mut total = 0;
    for addr in [a, b] {
        let (code, body) = try_get(addr, "/v1/pending/summary").await.ok()?;
        let v: Value = serde_json::from_str(&body).ok()?;
        if code != 200 || v["partitions"].as_array()?.len() != 2 {
            return None;
        }
        total += v["rounds"].as_u64()?;
    }
    Some(total)
}

async fn wait_rounds(a: SocketAddr, b: SocketAddr, want: u64) -> Result<()> {
    let deadline = tokio::time::Instant::now() + STEP;
    loop {
        let now = open_rounds(a, b).await;
        if now == Some(want) {
            return Ok(());
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "open rounds {now:?}, want {want}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The manual emissions in the output stream (at least `at_least`), by key: distinct ids.
async fn manual(setup: &Setup, at_least: usize) -> Result<BTreeMap<String, BTreeSet<String>>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for e in setup.emitted("normal", at_least).await? {
        ensure!(e.trigger == Trigger::Manual, "only manual emissions: {e:?}");
        out.entry(e.key.to_string())
            .or_default()
            .insert(e.emission_id());
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_actions_reach_the_owner_once_and_survive_its_kill() -> Result<()> {
    let Some(server) = server("nats_actions_reach_the_owner_once_and_survive_its_kill") else {
        return Ok(());
    };
    let setup = Setup::new(&server, "act", Storage::Memory, PARTITIONS).await?;
    let dir = tempfile::tempdir()?;
    let mut by_partition: BTreeMap<i32, Vec<String>> = BTreeMap::new();
    for s in 0..SESSIONS {
        let key = format!("acme/s{s}");
        let body = format!(r#"{{"tenant":"acme","session":"s{s}"}}"#);
        for _ in 0..2 {
            let (p, _) = setup.publish(&key, body.as_bytes(), None).await?;
            if !by_partition.entry(p).or_default().contains(&key) {
                by_partition.entry(p).or_default().push(key.clone());
            }
        }
    }
    // Instance 0 owns partitions 0 and 2, instance 1 owns 1 and 3.
    let owned_by_1: Vec<String> = [1, 3]
        .iter()
        .flat_map(|p| by_partition.get(p).cloned().unwrap_or_default())
        .collect();
    ensure!(
        owned_by_1.len() >= 2,
        "sessions on instance 1: {owned_by_1:?}"
    );
    let i0 = Instance::start(&setup, dir.path(), 0)?;
    let mut i1 = Instance::start(&setup, dir.path(), 1)?;
    if let Err(e) = wait_rounds(i0.addr, i1.addr, SESSIONS as u64).await {
        anyhow::bail!(
            "{e}\n--- instance 0:\n{}\n--- instance 1:\n{}",
            i0.tail(),
            i1.tail()
        );
    }

    // Pending: instance 0 answers for its partitions only.
    let (code, page) = get_json(i0.addr, "/v1/pending?limit=1000").await;
    ensure!(code == 200, "{page}");
    ensure!(page["partitions"] == json!([0, 2]), "{page}");
    let listed: BTreeSet<String> = page["rounds"]
        .as_array()
        .context("rounds")?
        .iter()
        .map(|r| r["key"].as_str().unwrap_or_default().to_owned())
        .collect();
    let want: BTreeSet<String> = [0, 2]
        .iter()
        .flat_map(|p| by_partition.get(p).cloned().unwrap_or_default())
        .collect();
    ensure!(listed == want, "instance 0 lists {listed:?}, owns {want:?}");

    // Flush a session of instance 1, asked of instance 0.
    let flushed = owned_by_1[0].clone();
    let body = json!({"kind": "flush", "session": flushed, "reason": "results never arrived", "request_id": "nats-flush-1"});
    let (code, answer) = post_json(i0.addr, "/v1/actions", &body.to_string()).await;
    ensure!(code == 200 && answer["result"] == "flushed", "{answer}");
    ensure!(
        answer["partitions"].as_array().map(Vec::len) == Some(1),
        "NATS: one partition: {answer}"
    );
    let id = answer["outcomes"][0]["emission_ids"][0]
        .as_str()
        .context("emission id")?
        .to_owned();
    let out = manual(&setup, 1).await?;
    ensure!(
        out.get(&flushed) == Some(&BTreeSet::from([id.clone()])),
        "{out:?}"
    );

    // The same request again: asked of instance 1, and as a record to the partition.
    let (code, again) = post_json(i1.addr, "/v1/actions", &body.to_string()).await;
    ensure!(code == 200 && again["result"] == "flushed", "{again}");
    let record = ActionRecord {
        request_id: "nats-flush-1".into(),
        kind: ActionKind::Flush,
        dry_run: false,
        session: Some(flushed.clone()),
        filter: None,
        limit: None,
        reason: "retried".into(),
        who: "test".into(),
        instance: "test".into(),
        requested_at: 0,
    };
    let channel = NatsActions::new(setup.js.clone(), &setup.nats);
    let p = channel.key_partition(&flushed).context("nats partition")?;
    channel
        .send(p, &record.record_key(), record.encode(), 0)
        .await?;

    // Cancel another session of instance 1, then kill instance 1 at once.
    let cancelled = owned_by_1[1].clone();
    let body = json!({"kind": "cancel", "session": cancelled, "reason": "bad data", "request_id": "nats-cancel-1"});
    let (code, answer) = post_json(i0.addr, "/v1/actions", &body.to_string()).await;
    ensure!(code == 200 && answer["result"] == "cancelled", "{answer}");
    i1.child.kill()?;
    i1.child.wait()?;
    i1.restart()?;
    wait_rounds(i0.addr, i1.addr, SESSIONS as u64 - 2).await?;
    let out = manual(&setup, 1).await?;
    ensure!(
        out.len() == 1 && out[&flushed].len() == 1,
        "the flush once, nothing else: {out:?}"
    );

    // The audit stream holds the cancel's outcome.
    let (subject, stream) = NatsActions::audit_names(&setup.nats);
    let audit = nats::read_stream(&setup.js, &stream, &subject, 4, STEP).await?;
    let records: Vec<AuditRecord> = audit
        .iter()
        .filter_map(|r| AuditRecord::decode(&r.payload).ok())
        .collect();
    ensure!(
        records.iter().any(|r| r.request_id == "nats-cancel-1"
            && r.result["result"] == "cancelled"
            && r.reason == "bad data"),
        "audit: {records:?}"
    );
    ensure!(
        records
            .iter()
            .any(|r| r.request_id == "nats-flush-1" && r.result["duplicate"] == true),
        "the retried record is audited as a duplicate"
    );

    // Bulk: a dry run's counts are what the bulk flush then does.
    let filter = json!({"tenant": "acme"});
    let (code, dry) = post_json(
        i0.addr,
        "/v1/actions",
        &json!({"kind": "flush", "filter": filter, "dry_run": true, "wait_ms": 20000}).to_string(),
    )
    .await;
    ensure!(
        code == 200 && dry["sessions"] == SESSIONS as u64 - 2,
        "{dry}"
    );
    let (code, done) = post_json(
        i0.addr,
        "/v1/actions",
        &json!({"kind": "flush", "filter": filter, "wait_ms": 20000}).to_string(),
    )
    .await;
    ensure!(
        code == 200 && done["sessions"] == dry["sessions"] && done["uploads"] == dry["uploads"],
        "{done}"
    );
    wait_rounds(i0.addr, i1.addr, 0).await?;
    let out = manual(&setup, SESSIONS - 1).await?;
    ensure!(out.len() == SESSIONS - 1, "{out:?}");
    ensure!(
        !out.contains_key(&cancelled),
        "the cancelled round is never emitted"
    );
    ensure!(
        out.values().all(|ids| ids.len() == 1),
        "one id per round: {out:?}"
    );

    drop((i0, i1));
    let _ = setup.js.delete_stream(&stream).await;
    setup.cleanup().await;
    Ok(())
}
