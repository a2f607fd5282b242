//! `settle admin` as an operator meets it (issue "operate it by hand" item 6): real `settle
//! admin` child processes against an admin server running in this process on the memory
//! transport (no broker): `pending --json` is the API's answer, `pending` a table with the
//! session's key, `flush` acts and says so, `audit` names the token's owner; a missing
//! token, a refused one, a bad filter and an unreachable server each fail with a message
//! that says what to do. `settle run` refuses to start with actions on a public address and
//! no token; on NATS (`SETTLE_TEST_NATS`) `settle run` serves its admin API over TLS with
//! tokens from a file and the environment (the CLI verifies it with the test CA), and
//! `settle consume` reads the audit subject back; on Kafka (`SETTLE_TEST_KAFKA`) it reads the
//! audit topic back.

use crate::nats_support::{server, Setup};
use crate::process_support::start_run_logged;
use crate::runtime_support::*;
use anyhow::{ensure, Context as _, Result};
use settle::admin::auth::Credentials;
use settle::admin::{AdminServer, AdminState, Auth};
use settle::codec::action::{AuditRecord, AuditStage};
use settle::engine::{Millis, PolicySpec};
use settle::runtime::{ActionLog, Clock, Runtime};
use settle::transport::memory::{MemoryBroker, MEMORY_AUDIT_TOPIC};
use settle::transport::nats::{NatsActions, Storage};
use settle::transport::ActionChannel;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const HOUR: Millis = 3_600_000;
const TOKEN: &str = "alice-e2e-0123456789abcdef0123";

/// `settle` with none of the caller's admin variables.
fn settle() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_settle"));
    c.env("SETTLE_LOG", "warn")
        .env_remove("SETTLE_ADMIN_URL")
        .env_remove("SETTLE_ADMIN_TOKEN")
        .env_remove("SETTLE_ADMIN_TOKENS")
        .env_remove("SETTLE_ADMIN_CA_FILE")
        .env_remove("SETTLE_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Runs `c` to its end (at most a minute): its output.
fn finish(c: &mut Command) -> Result<Output> {
    let mut child = c.spawn().context("spawn settle")?;
    let started = Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            anyhow::bail!("still running after 60 s: {c:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(child.wait_with_output()?)
}

/// `settle admin ARGS` against `url` with the token file: stdout, or the failure's stderr.
fn admin(url: &str, token_file: Option<&Path>, args: &[&str]) -> Result<Result<String, String>> {
    let mut c = settle();
    c.args(["admin", "--url", url]);
    if let Some(f) = token_file {
        c.arg("--token-file").arg(f);
    }
    let out = finish(c.args(args))?;
    let stdout = String::from_utf8(out.stdout)?;
    let stderr = String::from_utf8(out.stderr)?;
    Ok(if out.status.success() {
        Ok(stdout)
    } else {
        Err(stderr)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_cli_against_a_running_instance() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let broker = MemoryBroker::new(TOPIC, 2);
    let clock = settle::runtime::TokioClock::starting_at(T0);
    let runtime = Runtime::new(
        engine(PolicySpec::fixed(HOUR)),
        broker.sink(),
        clock,
        options(&dir.path().join("data")),
    )?
    .with_actions(ActionLog::new(Some(MEMORY_AUDIT_TOPIC.into()), "settle-0"))
    .with_overrides(Arc::new(broker.overrides()));
    let status = runtime.status();
    let mut creds = Credentials::default();
    creds.add_list(&format!("alice:{TOKEN}"), "test")?;
    let state = AdminState::new(&runtime)
        .with_action_channel(Arc::new(broker.actions()))
        .with_auth(Auth::new(creds, true, false));
    let server = AdminServer::start("127.0.0.1:0".parse()?, state).await?;
    let url = format!("http://{}", server.local_addr());
    for s in ["build-4711", "build-4712"] {
        produce(&broker, "acme", s, clock.now_ms() - 1_000);
    }
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(runtime.run(broker.source(GROUP), shutdown.clone()));
    tokio::time::timeout(
        Duration::from_secs(120),
        status.wait_for(|m| m.values().map(|s| s.pending_rounds).sum::<u64>() == 2),
    )
    .await
    .context("the runtime applies both uploads")?;
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n"))?;

    let checks = tokio::task::spawn_blocking(move || -> Result<()> {
        let tf = Some(token_file.as_path());
        // Reads: the API's JSON as is, or a table.
        let json = admin(&url, None, &["pending", "--json"])?.map_err(anyhow::Error::msg)?;
        let page: serde_json::Value = serde_json::from_str(json.trim())?;
        let keys: Vec<&str> = page["rounds"]
            .as_array()
            .context("rounds")?
            .iter()
            .filter_map(|r| r["key"].as_str())
            .collect();
        ensure!(keys.contains(&"acme/build-4711"), "{json}");
        let table =
            admin(&url, None, &["pending", "--tenant", "acme"])?.map_err(anyhow::Error::msg)?;
        ensure!(
            table.starts_with("KEY")
                && table.contains("acme/build-4711")
                && table.contains("2 round(s)"),
            "{table}"
        );
        let summary = admin(&url, None, &["pending", "--summary"])?.map_err(anyhow::Error::msg)?;
        ensure!(
            summary.contains("TIER") && summary.contains("all"),
            "{summary}"
        );
        let parts = admin(&url, None, &["partitions"])?.map_err(anyhow::Error::msg)?;
        ensure!(
            parts.contains("PARTITION") && parts.lines().count() == 3,
            "{parts}"
        );

        // Actions: a token needed, then done and said.
        let e = admin(
            &url,
            None,
            &["flush", "--session", "acme/build-4711", "--reason", "late"],
        )?
        .expect_err("no token");
        ensure!(e.contains("401") && e.contains("--token-file"), "{e}");
        let flushed = admin(
            &url,
            tf,
            &[
                "flush",
                "--session",
                "acme/build-4711",
                "--reason",
                "results never arrived",
                "--request-id",
                "cli-1",
            ],
        )?
        .map_err(anyhow::Error::msg)?;
        ensure!(
            flushed.contains("request cli-1")
                && flushed.contains("flushed")
                && flushed.contains("RESULT"),
            "{flushed}"
        );
        let dry = admin(
            &url,
            tf,
            &[
                "cancel",
                "--tenant",
                "acme",
                "--reason",
                "bad data",
                "--dry-run",
                "--json",
            ],
        )?
        .map_err(anyhow::Error::msg)?;
        let dry: serde_json::Value = serde_json::from_str(dry.trim())?;
        ensure!(dry["result"] == "would_do" && dry["sessions"] == 1, "{dry}");
        let missing =
            finish(settle().args(["admin", "--url", &url, "cancel", "--session", "acme/x"]))?;
        ensure!(
            !missing.status.success()
                && String::from_utf8_lossy(&missing.stderr).contains("--reason"),
            "--reason is required"
        );
        let mut whoami = settle();
        whoami
            .env("SETTLE_ADMIN_TOKEN", TOKEN)
            .args(["admin", "--url", &url, "whoami"]);
        let me = String::from_utf8(finish(&mut whoami)?.stdout)?;
        ensure!(me.starts_with("alice (operator)"), "{me}");
        let audit = admin(&url, tf, &["audit", "--limit", "50"])?.map_err(anyhow::Error::msg)?;
        ensure!(
            audit
                .lines()
                .any(|l| l.contains("alice") && l.contains("accepted") && l.contains("cli-1")),
            "{audit}"
        );
        ensure!(
            audit
                .lines()
                .any(|l| l.contains("anonymous") && l.contains("refused")),
            "{audit}"
        );

        // Tenant overrides: set (a token needed), listed, stale refused, removed.
        let set = [
            "override",
            "set",
            "acme",
            "--version",
            "0",
            "--policy",
            "fixed",
            "--delay",
            "2m",
            "--max-wait",
            "off",
            "--tier",
            "normal",
            "--expires-in",
            "72h",
            "--reason",
            "INC-42",
        ];
        let e = admin(&url, None, &set)?.expect_err("no token");
        ensure!(e.contains("401"), "{e}");
        let done = admin(&url, tf, &set)?.map_err(anyhow::Error::msg)?;
        ensure!(
            done.contains("override of acme set (version 1)") && done.contains("fixed"),
            "{done}"
        );
        let list = admin(&url, None, &["override", "list"])?.map_err(anyhow::Error::msg)?;
        ensure!(
            list.contains("1 override(s) in force")
                && list
                    .lines()
                    .any(|l| l.starts_with("acme ") && l.contains("alice") && l.contains("INC-42")),
            "{list}"
        );
        let e = admin(&url, tf, &set)?.expect_err("stale version");
        ensure!(e.contains("409"), "{e}");
        let e = admin(
            &url,
            tf,
            &[
                "override",
                "set",
                "acme",
                "--version",
                "1",
                "--policy",
                "adaptive",
                "--min-delay",
                "5m",
                "--max-delay",
                "1m",
                "--reason",
                "x",
            ],
        )?
        .expect_err("max-delay below min-delay");
        ensure!(e.contains("400") && e.contains("max-delay"), "{e}");
        let removed = admin(
            &url,
            tf,
            &[
                "override",
                "remove",
                "acme",
                "--version",
                "1",
                "--reason",
                "INC-42 over",
            ],
        )?
        .map_err(anyhow::Error::msg)?;
        ensure!(removed.contains("removed"), "{removed}");
        let list = admin(&url, None, &["override", "list", "--json"])?;
        let list: serde_json::Value =
            serde_json::from_str(list.map_err(anyhow::Error::msg)?.trim())?;
        ensure!(list["in_force"] == 0, "{list}");

        // Errors that say what to do.
        let e =
            admin(&url, None, &["pending", "--tenant", "bad tenant!"])?.expect_err("bad tenant");
        ensure!(e.contains("400") && e.contains("tenant"), "{e}");
        let wrong = dir_file_with(&token_file, "alice-not-the-right-token-0000")?;
        let e = admin(
            &url,
            Some(&wrong),
            &["flush", "--session", "acme/build-4712", "--reason", "x"],
        )?
        .expect_err("wrong token");
        ensure!(e.contains("401") && e.contains("refused"), "{e}");
        let e = admin("http://127.0.0.1:1", None, &["whoami"])?.expect_err("nobody there");
        ensure!(
            e.contains("connection refused") && e.contains("127.0.0.1:1"),
            "{e}"
        );
        Ok(())
    })
    .await?;
    shutdown.cancel();
    run.await??;
    server.stop().await;
    checks
}

/// A file beside `near` holding `text`.
fn dir_file_with(near: &Path, text: &str) -> Result<std::path::PathBuf> {
    let p = near.with_extension("other");
    std::fs::write(&p, text)?;
    Ok(p)
}

#[test]
fn settle_run_refuses_a_public_admin_address_without_a_token() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let out = finish(
        settle()
            .args(["run"])
            .env("SETTLE_ADMIN__LISTEN", "0.0.0.0:0")
            .env("SETTLE_STORE__DATA_DIR", dir.path()),
    )?;
    let stderr = String::from_utf8(out.stderr)?;
    ensure!(out.status.code() == Some(1), "{:?}: {stderr}", out.status);
    ensure!(
        stderr.contains("admin.tokens-file")
            && stderr.contains("SETTLE_ADMIN_TOKENS")
            && stderr.contains("admin.actions = false"),
        "{stderr}"
    );
    Ok(())
}

#[test]
fn consume_reads_the_audit_subject() -> Result<()> {
    let Some(addr) = server("consume_reads_the_audit_subject") else {
        return Ok(());
    };
    let rt = tokio::runtime::Runtime::new()?;
    let setup = rt.block_on(Setup::new(&addr, "audit", Storage::Memory, 1))?;
    let actions = NatsActions::new(setup.js.clone(), &setup.nats);
    let record = accepted("r-audit-1");
    rt.block_on(async {
        actions.ensure_audit_stream().await?;
        actions
            .publish_audit(&record.request_id, record.encode())
            .await
    })?;
    let out = finish(settle().args([
        "consume",
        "--nats",
        &setup.nats.servers,
        "-t",
        actions.subject(),
        "--from-beginning",
        "--exit-at-end",
    ]))?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let read: Vec<AuditRecord> = text
        .lines()
        .map(|l| AuditRecord::decode(l.as_bytes()))
        .collect::<Result<_, _>>()?;
    ensure!(read == [record], "{text}");
    let (_, stream) = NatsActions::audit_names(&setup.nats);
    rt.block_on(async {
        let _ = setup.js.delete_stream(&stream).await;
        setup.cleanup().await;
    });
    Ok(())
}

/// An audit record as an instance writes it.
fn accepted(request_id: &str) -> AuditRecord {
    AuditRecord {
        at: T0,
        instance: "settle-0".into(),
        who: "alice".into(),
        request_id: request_id.into(),
        action: "flush".into(),
        stage: AuditStage::Accepted,
        reason: "results never arrived".into(),
        selection: serde_json::json!({"session": "acme/build-4711"}),
        result: serde_json::json!({"dry_run": false}),
    }
}

#[test]
fn consume_reads_the_audit_topic() -> Result<()> {
    let Some(bootstrap) = crate::kafka_support::broker("consume_reads_the_audit_topic") else {
        return Ok(());
    };
    let config = settle::transport::kafka::KafkaConfig {
        bootstrap_servers: bootstrap.clone(),
        group_id: format!(
            "audit-{}-{}",
            std::process::id(),
            crate::kafka_support::now_ms()
        ),
        ..settle::transport::kafka::KafkaConfig::default()
    };
    let actions = settle::transport::kafka::KafkaActions::new(&config)?;
    let records = [accepted("r-k-1"), accepted("r-k-2")];
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        actions.ensure_audit_topic().await;
        for r in &records {
            actions.publish_audit(&r.request_id, r.encode()).await?;
        }
        anyhow::Ok(())
    })?;
    let topic = settle::transport::kafka::KafkaActions::audit_topic(&config);
    let printed = crate::process_support::consume_topic(&bootstrap, &topic)?;
    let read: Vec<AuditRecord> = crate::process_support::lines_of(&printed)
        .into_iter()
        .map(AuditRecord::decode)
        .collect::<Result<_, _>>()?;
    ensure!(read == records, "{}", String::from_utf8_lossy(&printed));
    Ok(())
}

fn tls_file(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/admin-tls")
        .join(name)
}

#[test]
fn settle_run_serves_its_admin_api_over_tls_with_tokens() -> Result<()> {
    let Some(addr) = server("settle_run_serves_its_admin_api_over_tls_with_tokens") else {
        return Ok(());
    };
    const READ: &str = "prom-e2e-0123456789abcdef0123";
    let rt = tokio::runtime::Runtime::new()?;
    let setup = rt.block_on(Setup::new(&addr, "admintls", Storage::Memory, 2))?;
    let dir = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("# operators\nalice:{TOKEN}\n"))?;
    let config = dir.path().join("settle.toml");
    std::fs::write(
        &config,
        format!(
            r#"transport = "nats"
[debounce]
policy = "fixed"
delay = "1h"
[store]
data-dir = "{data}"
[runtime]
shutdown-deadline = "10s"
[admin]
listen = "127.0.0.1:{port}"
tokens-file = "{tokens}"
tls-cert-file = "{cert}"
tls-key-file = "{key}"
{sections}"#,
            data = dir.path().join("data").display(),
            tokens = tokens.display(),
            cert = tls_file("server.pem").display(),
            key = tls_file("server-key.pem").display(),
            sections = setup.run_config_sections(0, 1),
        ),
    )?;
    let log = dir.path().join("run.log");
    let listen = format!("127.0.0.1:{port}");
    let mut child = start_run_logged(
        &config,
        &[
            ("SETTLE_ADMIN__LISTEN", listen.as_str()),
            ("SETTLE_ADMIN_TOKENS", &format!("prom:read:{READ}")),
        ],
        &log,
    )?;
    let result = (|| -> Result<()> {
        rt.block_on(setup.publish(
            "acme/build-4711",
            upload("acme", "build-4711").as_bytes(),
            None,
        ))?;
        let url = format!("https://{listen}");
        let ca = tls_file("ca.pem");
        let cli = |token: Option<&str>, args: &[&str]| -> Result<Output> {
            let mut c = settle();
            c.args(["admin", "--url", &url, "--ca-file"]).arg(&ca);
            if let Some(t) = token {
                c.env("SETTLE_ADMIN_TOKEN", t);
            }
            finish(c.args(args))
        };
        // Until the instance serves and has read the upload.
        let started = Instant::now();
        loop {
            let out = cli(None, &["pending", "--json"])?;
            let text = String::from_utf8_lossy(&out.stdout);
            if out.status.success() && text.contains("acme/build-4711") {
                break;
            }
            ensure!(
                started.elapsed() < Duration::from_secs(60),
                "no pending round after 60 s: {}; log: {}",
                String::from_utf8_lossy(&out.stderr),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        let me = cli(Some(READ), &["whoami"])?;
        ensure!(
            String::from_utf8(me.stdout)?.starts_with("prom (read)"),
            "whoami"
        );
        let args = ["flush", "--session", "acme/build-4711", "--reason", "INC-1"];
        let refused = cli(None, &args)?;
        ensure!(
            String::from_utf8(refused.stderr)?.contains("401"),
            "no token: 401"
        );
        let refused = cli(Some(READ), &args)?;
        ensure!(
            String::from_utf8(refused.stderr)?.contains("403"),
            "read token: 403"
        );
        let done = cli(Some(TOKEN), &args)?;
        let text = String::from_utf8(done.stdout)?;
        ensure!(
            done.status.success() && text.contains("flushed"),
            "{text}: {}",
            String::from_utf8_lossy(&done.stderr)
        );
        let audit = String::from_utf8(cli(Some(READ), &["audit"])?.stdout)?;
        ensure!(
            audit
                .lines()
                .any(|l| l.contains("alice") && l.contains("applied") && l.contains("flushed")),
            "{audit}"
        );
        ensure!(
            audit
                .lines()
                .any(|l| l.contains("prom") && l.contains("refused") && l.contains("forbidden")),
            "{audit}"
        );
        // Plain HTTP is not served.
        let plain =
            finish(settle().args(["admin", "--url", &format!("http://{listen}"), "whoami"]))?;
        ensure!(!plain.status.success(), "plain HTTP answered");
        Ok(())
    })();
    let _ = child.kill();
    let _ = child.wait();
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    let (_, audit_stream) = NatsActions::audit_names(&setup.nats);
    rt.block_on(async {
        let _ = setup.js.delete_stream(&audit_stream).await;
        setup.cleanup().await;
    });
    result?;
    ensure!(
        !logged.contains(TOKEN) && !logged.contains(READ),
        "a token in the log"
    );
    ensure!(logged.contains("admin server listening"), "{logged}");
    Ok(())
}
