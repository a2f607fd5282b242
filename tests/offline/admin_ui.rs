//! The operator page's rules over HTTP (issue 35), on the real runtime and the memory
//! broker, without a browser (the browser test is `tests/e2e/ui_browser.rs`):
//!
//! * the login form refuses a wrong token (401, the page says so, no cookie) and sets an
//!   `HttpOnly; SameSite=Strict; Path=/ui` cookie for a right one; no page shows the token;
//! * the pages read as `/v1` reads do (open), and a bad filter is the API's 400, in the page;
//! * a form that acts without a login is refused 401 (audited like a `/v1` action), with a
//!   read token 403, from another site 403 (origin), without the page's CSRF token 403;
//! * with the operator's cookie and the page's CSRF token, flush confirms first, then acts
//!   and the audit names the operator and the reason.

use crate::admin_support::{try_exchange, try_exchange_typed};
use crate::runtime_support::*;
use settle::admin::auth::Credentials;
use settle::admin::{AdminServer, AdminState, Auth};
use settle::codec::action::{AuditRecord, AuditStage};
use settle::engine::{Millis, PolicySpec};
use settle::runtime::{ActionLog, Clock, Runtime};
use settle::transport::memory::{MemoryBroker, MEMORY_AUDIT_TOPIC};
use settle::transport::ActionChannel;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const HOUR: Millis = 3_600_000;
/// Bound on waiting for the runtime (a hang guard, not a speed assertion).
const PATIENCE: Duration = Duration::from_secs(120);
const OPERATOR_TOKEN: &str = "alice-0123456789abcdef0123456789";
const READ_TOKEN: &str = "prom-0123456789abcdef0123456789";

fn hex(text: &str) -> String {
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

/// `POST path` with a form body and `headers`: (status, head, body).
async fn post_form(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    form: &str,
) -> (u16, String, String) {
    try_exchange_typed(
        addr,
        "POST",
        path,
        headers,
        Some(("application/x-www-form-urlencoded", form)),
    )
    .await
    .unwrap_or_else(|e| panic!("POST {path}: {e}"))
}

async fn get_page(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let (code, _, body) = try_exchange(addr, "GET", path, headers, None)
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    (code, body)
}

/// The value of the first `name="csrf"` hidden input of a page.
fn csrf_of(page: &str) -> String {
    let at = page
        .find(r#"name="csrf" value=""#)
        .expect("a form with a CSRF token");
    let rest = &page[at + r#"name="csrf" value=""#.len()..];
    rest[..rest.find('"').unwrap()].to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_logs_in_reads_and_acts_under_the_api_rules() {
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
    let mut credentials = Credentials::default();
    credentials
        .add_list(
            &format!("alice:{OPERATOR_TOKEN},prom:read:{READ_TOKEN}"),
            "test",
        )
        .unwrap();
    let state = AdminState::new(&runtime)
        .with_action_channel(channel)
        .with_auth(Auth::new(credentials, true, false));
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
        status.wait_for(|m| m.values().map(|s| s.pending_rounds).sum::<u64>() == 3),
    )
    .await
    .expect("runtime applies every upload");

    // Login: a wrong token is refused in the page, no cookie.
    let (code, head, body) =
        post_form(addr, "/ui/login", &[], "token=alice-wrong-wrong-wrong").await;
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("matches no configured credential"), "{body}");
    assert!(!head.contains("set-cookie"), "{head}");
    // The right one: a strict, HttpOnly cookie for /ui, and a redirect.
    let (code, head, _) =
        post_form(addr, "/ui/login", &[], &format!("token={OPERATOR_TOKEN}")).await;
    assert_eq!(code, 303, "{head}");
    let set = head
        .lines()
        .find(|l| l.starts_with("set-cookie:"))
        .expect("a cookie");
    assert!(
        set.contains("httponly") && set.contains("samesite=strict") && set.contains("path=/ui"),
        "{set}"
    );
    assert!(!set.contains("secure"), "no TLS here: {set}");
    let cookie = format!("settle_ui={}", hex(OPERATOR_TOKEN));
    let as_alice = [("Cookie", cookie.as_str())];

    // Reading: the pending list, and the API's 400 for a bad filter.
    let (code, page) = get_page(addr, "/ui/pending?tenant=acme", &as_alice).await;
    assert_eq!(code, 200);
    assert!(
        page.contains("acme/s1") && page.contains("alice (operator)"),
        "{page}"
    );
    assert!(!page.contains(OPERATOR_TOKEN), "the page shows the token");
    let (code, page) = get_page(addr, "/ui/pending?min_uploads=lots", &[]).await;
    assert_eq!(code, 400);
    assert!(page.contains("min_uploads"), "{page}");
    let (code, page) = get_page(addr, "/ui/sessions/acme/s1", &as_alice).await;
    assert_eq!(code, 200, "{page}");
    let csrf = csrf_of(&page);
    let (code, _) = get_page(addr, "/ui/sessions/acme/nope", &[]).await;
    assert_eq!(code, 404);

    // Acting: refused without a login, with a read token, from another site, without CSRF.
    let flush = format!("kind=flush&session=acme%2Fs1&reason=late+results&csrf={csrf}&confirm=yes");
    let (code, _, body) = post_form(addr, "/ui/actions", &[], &flush).await;
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("Log in"), "{body}");
    let reader = format!("settle_ui={}", hex(READ_TOKEN));
    let (code, _, body) = post_form(addr, "/ui/actions", &[("Cookie", &reader)], &flush).await;
    assert_eq!(code, 403, "{body}");
    let (code, _, body) = post_form(
        addr,
        "/ui/actions",
        &[("Cookie", &cookie), ("Origin", "https://evil.example")],
        &flush,
    )
    .await;
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("cross-site"), "{body}");
    let no_csrf = flush.replace(&format!("csrf={csrf}"), "csrf=");
    let (code, _, body) = post_form(addr, "/ui/actions", &as_alice, &no_csrf).await;
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("CSRF"), "{body}");
    let refused: Vec<(String, String)> = broker
        .audit()
        .iter()
        .map(|p| AuditRecord::decode(p).unwrap())
        .filter(|r| r.stage == AuditStage::Refused)
        .map(|r| (r.who, r.action))
        .collect();
    assert_eq!(
        refused,
        [
            ("anonymous".to_owned(), "POST /ui/actions".to_owned()),
            ("prom".to_owned(), "POST /ui/actions".to_owned()),
        ]
    );

    // With the login and the page's token: a confirmation first, then the flush.
    let ask = flush.replace("&confirm=yes", "");
    let (code, _, body) = post_form(addr, "/ui/actions", &as_alice, &ask).await;
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("You are about to") && body.contains("confirm"),
        "{body}"
    );
    let (code, _, body) = post_form(
        addr,
        "/ui/actions",
        &[("Cookie", &cookie), ("Origin", "http://localhost")],
        &flush,
    )
    .await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("flushed"), "{body}");
    let accepted: Vec<AuditRecord> = broker
        .audit()
        .iter()
        .map(|p| AuditRecord::decode(p).unwrap())
        .filter(|r| r.stage == AuditStage::Accepted)
        .collect();
    assert!(
        accepted
            .iter()
            .any(|r| r.who == "alice" && r.action == "flush" && r.reason == "late results"),
        "{accepted:?}"
    );

    // Every view answers.
    for path in [
        "/ui",
        "/ui/tenants",
        "/ui/tenants/acme",
        "/ui/partitions",
        "/ui/whatif",
        "/ui/audit",
        "/ui/stats.json",
        "/ui/overview/live",
        "/ui/assets/htmx.min.js",
    ] {
        let (code, page) = get_page(addr, path, &as_alice).await;
        assert_eq!(code, 200, "{path}: {page}");
        assert!(!page.contains(OPERATOR_TOKEN), "{path} shows the token");
    }
    let (code, page) = get_page(addr, "/ui/tenants/acme", &[]).await;
    assert_eq!(code, 200, "{page}");
    assert!(
        page.contains("No tier change of acme") && page.contains("No override"),
        "{page}"
    );
    let (code, page) = get_page(addr, "/ui/audit", &[]).await;
    assert!(code == 200 && page.contains("late results"), "{page}");
    let (code, _) = get_page(addr, "/ui/tenants/bad%20name", &[]).await;
    assert_eq!(code, 400);

    shutdown.cancel();
    let _ = run.await;
    server.stop().await;
}
