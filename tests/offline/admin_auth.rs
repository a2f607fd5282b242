//! A credential on the admin API (SEMANTICS §7, issue "operate it by hand" item 5) on the
//! real runtime and memory broker: an action without a token or with a wrong one gets 401
//! (with `WWW-Authenticate: Bearer`), a read token 403; each refusal is audited with who
//! and why, counted in `settle_admin_refused_total{reason}`, and nothing reaches the input;
//! an operator token acts and the audit records name it; every non-read `/v1` route is
//! covered, also one added later; reads are open by default and need a token with
//! `protect-reads`; `admin.actions = false` refuses actions; the server refuses to start on
//! a public address with actions and no token; TLS serves with a test certificate.

use crate::admin_support::{get_json, try_exchange, Scrape};
use crate::runtime_support::*;
use serde_json::{json, Value};
use settle::admin::auth::{Credentials, ANONYMOUS};
use settle::admin::{tls, AdminServer, AdminState, Auth};
use settle::codec::action::{AuditRecord, AuditStage};
use settle::engine::{Millis, PolicySpec, Trigger};
use settle::runtime::{ActionLog, Clock, Runtime};
use settle::transport::memory::{MemoryBroker, MEMORY_AUDIT_TOPIC};
use settle::transport::ActionChannel;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const HOUR: Millis = 3_600_000;
/// Bound on waiting for the runtime (a hang guard, not a speed assertion).
const PATIENCE: Duration = Duration::from_secs(120);
const OPERATOR_TOKEN: &str = "alice-0123456789abcdef0123456789";
const READ_TOKEN: &str = "prom-0123456789abcdef0123456789";

fn credentials() -> Credentials {
    let mut c = Credentials::default();
    c.add_list(
        &format!("alice:{OPERATOR_TOKEN},prom:read:{READ_TOKEN}"),
        "test",
    )
    .unwrap();
    c
}

fn audit(broker: &MemoryBroker) -> Vec<AuditRecord> {
    broker
        .audit()
        .iter()
        .map(|p| AuditRecord::decode(p).unwrap())
        .collect()
}

/// `method path` with an optional bearer token and JSON body: (status, head, body as JSON).
async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> (u16, String, Value) {
    let bearer = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = bearer
        .as_deref()
        .map(|b| vec![("Authorization", b)])
        .unwrap_or_default();
    let text = body.map(Value::to_string);
    let (status, head, body) = try_exchange(addr, method, path, &headers, text.as_deref())
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let v = serde_json::from_str(&body).unwrap_or(Value::String(body));
    (status, head, v)
}

async fn refused_count(addr: SocketAddr, reason: &str) -> f64 {
    let (code, _, text) = call(addr, "GET", "/metrics", None, None).await;
    assert_eq!(code, 200);
    Scrape::parse(text.as_str().unwrap()).sum(settle::metrics::ADMIN_REFUSED, &[("reason", reason)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_need_an_operator_token_and_every_refusal_is_on_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let broker = MemoryBroker::new(TOPIC, 2);
    let clock = settle::runtime::TokioClock::starting_at(T0);
    let log = ActionLog::new(Some(MEMORY_AUDIT_TOPIC.into()), "settle-0");
    let runtime = Runtime::new(
        engine(PolicySpec::fixed(HOUR)),
        broker.sink(),
        clock,
        options(dir.path()),
    )
    .unwrap()
    .with_actions(log);
    let status = runtime.status();
    let channel: Arc<dyn ActionChannel> = Arc::new(broker.actions());
    let state = AdminState::new(&runtime)
        .with_action_channel(channel)
        .with_auth(Auth::new(credentials(), true, false));
    let server = AdminServer::start("127.0.0.1:0".parse().unwrap(), state)
        .await
        .unwrap();
    let addr = server.local_addr();
    let base = clock.now_ms() - 5_000;
    for s in 0..3 {
        produce(&broker, "acme", &format!("s{s}"), base);
    }
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(runtime.run(broker.source(GROUP), shutdown.clone()));
    tokio::time::timeout(
        PATIENCE,
        status.wait_for(|m| {
            all(m, 2, |s| {
                s.caught_up && s.next_offset == Some(broker.end_offset(s.partition))
            }) && m.values().map(|s| s.pending_rounds).sum::<u64>() == 3
        }),
    )
    .await
    .expect("runtime applies every upload");
    let ends = |b: &MemoryBroker| (b.end_offset(0), b.end_offset(1));
    let before = ends(&broker);

    // Refused: no token, a wrong one, a read token. Nothing reaches the input.
    let flush =
        json!({"kind": "flush", "session": "acme/s1", "reason": "late", "request_id": "r-1"});
    let (code, head, body) = call(addr, "POST", "/v1/actions", None, Some(&flush)).await;
    assert_eq!(code, 401, "{body}");
    assert!(head.contains("www-authenticate: bearer"), "{head}");
    assert!(body["error"].as_str().unwrap().contains("Bearer"), "{body}");
    let (code, head, body) = call(
        addr,
        "POST",
        "/v1/actions",
        Some("alice-wrong-wrong-wrong-wrong"),
        Some(&flush),
    )
    .await;
    assert_eq!(code, 401, "{body}");
    assert!(head.contains("invalid_token"), "{head}");
    let (code, _, body) = call(addr, "POST", "/v1/actions", Some(READ_TOKEN), Some(&flush)).await;
    assert_eq!(code, 403, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("read role"),
        "{body}"
    );
    // A route added later under /v1 (tenant overrides) is covered without naming it.
    let (code, _, _) = call(
        addr,
        "PUT",
        "/v1/tenants/acme/override",
        None,
        Some(&json!({"policy": "fixed"})),
    )
    .await;
    assert_eq!(code, 401);
    assert_eq!(ends(&broker), before, "no action record was sent");

    let refused: Vec<AuditRecord> = audit(&broker)
        .into_iter()
        .filter(|r| r.stage == AuditStage::Refused)
        .collect();
    let summary: Vec<(&str, &str, &str)> = refused
        .iter()
        .map(|r| {
            (
                r.who.as_str(),
                r.action.as_str(),
                r.result["refusal"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (ANONYMOUS, "POST /v1/actions", "missing_token"),
            (ANONYMOUS, "POST /v1/actions", "bad_token"),
            ("prom", "POST /v1/actions", "forbidden"),
            (ANONYMOUS, "PUT /v1/tenants/acme/override", "missing_token"),
        ]
    );
    for r in &refused {
        assert!(!r.reason.is_empty());
        let text = serde_json::to_string(r).unwrap();
        assert!(
            !text.contains(OPERATOR_TOKEN) && !text.contains(READ_TOKEN) && !text.contains("wrong"),
            "no token in the audit: {text}"
        );
    }
    assert_eq!(refused_count(addr, "missing_token").await, 2.0);
    assert_eq!(refused_count(addr, "bad_token").await, 1.0);
    assert_eq!(refused_count(addr, "forbidden").await, 1.0);
    assert_eq!(refused_count(addr, "actions_disabled").await, 0.0);

    // The operator token acts; the audit records name it.
    let (code, _, body) = call(
        addr,
        "POST",
        "/v1/actions",
        Some(OPERATOR_TOKEN),
        Some(&flush),
    )
    .await;
    assert_eq!((code, &body["result"]), (200, &json!("flushed")), "{body}");
    let named: Vec<(AuditStage, String)> = audit(&broker)
        .into_iter()
        .filter(|r| r.request_id == "r-1")
        .map(|r| (r.stage, r.who))
        .collect();
    assert!(
        named.contains(&(AuditStage::Accepted, "alice".into())),
        "{named:?}"
    );
    assert!(
        named.contains(&(AuditStage::Applied, "alice".into())),
        "{named:?}"
    );
    tokio::time::timeout(PATIENCE, async {
        while !emitted(&broker)
            .iter()
            .any(|(e, _)| e.trigger == Trigger::Manual)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the flush is published");

    // whoami: any token; reads open without one.
    let (code, _, me) = call(addr, "POST", "/v1/whoami", Some(READ_TOKEN), None).await;
    assert_eq!(code, 200, "{me}");
    assert_eq!((&me["name"], &me["role"]), (&json!("prom"), &json!("read")));
    let (code, _, _) = call(addr, "POST", "/v1/whoami", None, None).await;
    assert_eq!(code, 401);
    let (code, page) = get_json(addr, "/v1/pending?tenant=acme").await;
    assert_eq!(code, 200, "{page}");

    // The audit trail through the API, newest first, and its bad input.
    let (code, trail) = get_json(addr, "/v1/audit?limit=3").await;
    assert_eq!(code, 200, "{trail}");
    let records = trail["records"].as_array().unwrap();
    assert_eq!(records.len(), 3);
    assert_eq!(
        (&records[0]["action"], &records[0]["stage"]),
        (&json!("POST /v1/whoami"), &json!("refused")),
        "newest first: the last request was the refused whoami: {trail}"
    );
    assert_eq!(records[1]["request_id"], "r-1", "{trail}");
    let (code, only) = get_json(addr, "/v1/audit?stage=refused&limit=100").await;
    assert_eq!(code, 200);
    assert_eq!(only["records"].as_array().unwrap().len(), 5, "{only}");
    for bad in [
        "/v1/audit?limit=0",
        "/v1/audit?limit=x",
        "/v1/audit?stage=gone",
        "/v1/audit?colour=1",
    ] {
        let (code, answer) = get_json(addr, bad).await;
        assert_eq!(code, 400, "{bad}: {answer}");
        assert!(!answer["error"].as_str().unwrap().is_empty());
    }

    // Routing as without the layer: an unknown path 404, a wrong method 405.
    let (code, _, _) = call(addr, "POST", "/v1/nothing", Some(OPERATOR_TOKEN), None).await;
    assert_eq!(code, 404);
    let (code, _, _) = call(addr, "DELETE", "/v1/pending", Some(OPERATOR_TOKEN), None).await;
    assert_eq!(code, 405);

    shutdown.cancel();
    run.await.unwrap().unwrap();
    server.stop().await;
}

/// A runtime that is never run: enough for the admin server's reads and refusals.
fn idle_state(dir: &Path, auth: Auth) -> AdminState {
    let broker = MemoryBroker::new(TOPIC, 1);
    let runtime = Runtime::new(
        engine(PolicySpec::fixed(HOUR)),
        broker.sink(),
        settle::runtime::TokioClock::starting_at(T0),
        options(dir),
    )
    .unwrap();
    AdminState::new(&runtime)
        .with_action_channel(Arc::new(broker.actions()))
        .with_auth(auth)
}

#[tokio::test]
async fn protected_reads_and_disabled_actions() {
    let dir = tempfile::tempdir().unwrap();
    let server = AdminServer::start(
        "127.0.0.1:0".parse().unwrap(),
        idle_state(dir.path(), Auth::new(credentials(), false, true)),
    )
    .await
    .unwrap();
    let addr = server.local_addr();
    for path in ["/metrics", "/healthz", "/v1/partitions", "/v1/pending"] {
        let (code, head, _) = call(addr, "GET", path, None, None).await;
        assert_eq!(code, 401, "{path}");
        assert!(head.contains("www-authenticate: bearer"), "{path}: {head}");
        let (code, _, _) = call(addr, "GET", path, Some(READ_TOKEN), None).await;
        assert_eq!(code, 200, "{path} with a read token");
    }
    let body = json!({"kind": "cancel", "session": "acme/s", "reason": "x"});
    let (code, _, answer) = call(
        addr,
        "POST",
        "/v1/actions",
        Some(OPERATOR_TOKEN),
        Some(&body),
    )
    .await;
    assert_eq!(code, 403, "{answer}");
    assert!(answer["error"]
        .as_str()
        .unwrap()
        .contains("admin.actions = false"));
    let (code, _, me) = call(addr, "POST", "/v1/whoami", Some(OPERATOR_TOKEN), None).await;
    assert_eq!((code, &me["actions"]), (200, &json!(false)), "{me}");
    let (_, _, metrics) = call(addr, "GET", "/metrics", Some(READ_TOKEN), None).await;
    let m = Scrape::parse(metrics.as_str().unwrap());
    assert_eq!(
        m.sum(
            settle::metrics::ADMIN_REFUSED,
            &[("reason", "actions_disabled")]
        ),
        1.0
    );
    assert_eq!(
        m.sum(
            settle::metrics::ADMIN_REFUSED,
            &[("reason", "missing_token")]
        ),
        4.0
    );
    server.stop().await;
}

#[tokio::test]
async fn no_start_on_a_public_address_with_actions_and_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let public: SocketAddr = "0.0.0.0:0".parse().unwrap();
    let e = AdminServer::start(public, idle_state(dir.path(), Auth::default()))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("admin.tokens-file")
            && e.contains("SETTLE_ADMIN_TOKENS")
            && e.contains("admin.actions = false"),
        "{e}"
    );
    // With a token, or with actions off, it starts.
    for auth in [
        Auth::new(credentials(), true, false),
        Auth::new(Credentials::default(), false, false),
    ] {
        let server = AdminServer::start(public, idle_state(dir.path(), auth))
            .await
            .unwrap();
        server.stop().await;
    }
    // `settle run`'s own path: refused before any broker is dialled.
    let mut config = settle::config::Config::default();
    config.admin.listen = public;
    config.store.data_dir = dir.path().join("data");
    let e = settle::service::run_until(&config, CancellationToken::new(), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("admin.tokens-file"), "{e}");
}

fn tls_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/admin-tls")
        .join(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_with_a_test_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let config = tls::server_config(&tls_file("server.pem"), &tls_file("server-key.pem")).unwrap();
    let server = AdminServer::start_with(
        "127.0.0.1:0".parse().unwrap(),
        idle_state(dir.path(), Auth::new(credentials(), true, false)),
        Some(config),
    )
    .await
    .unwrap();
    let addr = server.local_addr();
    // The CLI's client, verifying the server with the test CA.
    let args = settle::cli::admin::AdminArgs {
        url: format!("https://127.0.0.1:{}", addr.port()),
        token_file: None,
        ca_file: Some(tls_file("ca.pem")),
        json: false,
        command: settle::cli::admin::AdminCommand::Whoami,
    };
    let answer = tokio::task::spawn_blocking(move || {
        let client = settle::cli::admin::Client::new(&args, Duration::from_secs(30)).unwrap();
        client.get("/healthz", &[]).map(|a| a.status)
    })
    .await
    .unwrap();
    assert_eq!(answer.unwrap(), 200);
    // Plain HTTP gets no answer from a TLS listener.
    let plain = try_exchange(addr, "GET", "/healthz", &[], None).await;
    assert!(!matches!(plain, Ok((200, _, _))), "{plain:?}");
    server.stop().await;

    // Errors name the key and the path.
    let e = tls::server_config(&tls_file("missing.pem"), &tls_file("server-key.pem"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("admin.tls-cert-file") && e.contains("missing.pem"),
        "{e}"
    );
    let e = tls::server_config(&tls_file("server.pem"), &tls_file("ca.pem"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("admin.tls-key-file") && e.contains("ca.pem"),
        "{e}"
    );
}
