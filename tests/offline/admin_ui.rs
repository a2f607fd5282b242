//! The operator page's rules over HTTP (issue 35), on the real runtime and the memory
//! broker, without a browser (the browser test is `tests/e2e/ui_browser.rs`):
//!
//! * the login form refuses a wrong token (401, the page says so, no cookie) and sets an
//!   `HttpOnly; SameSite=Strict; Path=/ui` cookie for a right one; no page shows the token;
//! * the pages read as `/v1` reads do (open), and a bad filter is the API's 400, in the page;
//! * a form that acts without a login is refused 401 (audited like a `/v1` action), with a
//!   read token 403, from another site 403 (origin), without the page's CSRF token 403;
//! * with the operator's cookie and the page's CSRF token, flush confirms first, then acts
//!   and the audit names the operator and the reason;
//! * the What-if view (with a fake sweep runner): its form carries the runner's defaults and
//!   a CSRF token; a post without the token or from another site is refused before any
//!   sweep, a bad look-back is a 400 in the page; a read token runs a sweep; a second one
//!   while it runs is refused 409 with who started it and when; the result is the chart and
//!   the table with the Pareto and recommended rows marked, beside the live point. Without
//!   a runner the view says how to run `settle tune`.

use crate::admin_support::{try_exchange, try_exchange_typed};
use crate::runtime_support::*;
use settle::admin::auth::Credentials;
use settle::admin::whatif::{WhatIfError, WhatIfRequest, WhatIfResult, WhatIfRow};
use settle::admin::{AdminServer, AdminState, Auth, WhatIf};
use settle::codec::action::{AuditRecord, AuditStage};
use settle::engine::{Millis, PolicySpec};
use settle::runtime::{ActionLog, Clock, Runtime};
use settle::transport::memory::{MemoryBroker, MEMORY_AUDIT_TOPIC};
use settle::transport::ActionChannel;
use std::net::SocketAddr;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
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

/// `form` (carrying `csrf`) posted to `path` with the login `cookie` is refused 403 when it
/// comes from another site, and without its CSRF token.
async fn refused_cross_site_and_without_csrf(
    addr: SocketAddr,
    path: &str,
    cookie: &str,
    form: &str,
    csrf: &str,
) {
    let cross = [("Cookie", cookie), ("Origin", "https://evil.example")];
    let (code, _, body) = post_form(addr, path, &cross, form).await;
    assert_eq!(code, 403, "{path}: {body}");
    assert!(body.contains("cross-site"), "{path}: {body}");
    let no_csrf = form.replace(&format!("csrf={csrf}"), "csrf=");
    let (code, _, body) = post_form(addr, path, &[("Cookie", cookie)], &no_csrf).await;
    assert_eq!(code, 403, "{path}: {body}");
    assert!(body.contains("CSRF"), "{path}: {body}");
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
    refused_cross_site_and_without_csrf(addr, "/ui/actions", &cookie, &flush, &csrf).await;
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
    // No sweep runner given: the What-if view says how to run the sweep beside settle.
    let (code, page) = get_page(addr, "/ui/whatif", &[]).await;
    assert_eq!(code, 200);
    assert!(
        page.contains("No sweep runner") && page.contains("settle tune --config"),
        "{page}"
    );
    assert!(!page.contains("sweep-form"), "{page}");

    shutdown.cancel();
    let _ = run.await;
    server.stop().await;
}

/// A sweep runner that answers a fixed result, each sweep waiting for the test's go.
struct FakeSweeps {
    /// Every request, in order (pushed when the sweep starts).
    asked: Mutex<Vec<WhatIfRequest>>,
    /// Says a sweep started.
    started: Mutex<Sender<()>>,
    /// One message lets one sweep finish.
    go: Mutex<Receiver<()>>,
}

fn row(setting: &str, emissions: u64, p99_ms: u64, pareto: bool, recommended: bool) -> WhatIfRow {
    WhatIfRow {
        setting: setting.into(),
        emissions,
        uploads_per_emission: 1200.0 / emissions as f64,
        time_to_ready_p50_ms: p99_ms / 2,
        time_to_ready_p99_ms: p99_ms,
        meets_goal: p99_ms <= 60_000,
        pareto,
        recommended,
    }
}

impl WhatIf for FakeSweeps {
    fn default_sweep(&self) -> &str {
        "fixed:5s,1m;adaptive:5s/10m"
    }

    fn default_goal(&self) -> &str {
        "p99<=60s"
    }

    fn sweep(&self, request: &WhatIfRequest) -> Result<WhatIfResult, WhatIfError> {
        self.asked.lock().unwrap().push(request.clone());
        let _ = self.started.lock().unwrap().send(());
        self.go
            .lock()
            .unwrap()
            .recv_timeout(PATIENCE)
            .map_err(|_| WhatIfError::Failed("the test never said go".into()))?;
        Ok(WhatIfResult {
            source: "fake stream, last minutes".into(),
            uploads: 1200,
            rejected: 0,
            goal: "p99 time-to-ready ≤ 1m".into(),
            rows: vec![
                row("fixed 5s", 400, 5_000, true, false),
                row("fixed 1m", 100, 60_000, true, true),
                row("adaptive 5s/10m", 150, 600_000, false, false),
            ],
            verdict: vec!["recommended for goal: fixed 1m".into()],
            svg: Some(r#"<svg xmlns="http://www.w3.org/2000/svg" id="fake-chart"></svg>"#.into()),
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whatif_form_runs_one_sweep_at_a_time_under_the_page_rules() {
    let dir = tempfile::tempdir().unwrap();
    let broker = MemoryBroker::new(TOPIC, 1);
    let runtime = Runtime::new(
        engine(PolicySpec::fixed(HOUR)),
        broker.sink(),
        settle::runtime::TokioClock::starting_at(T0),
        options(dir.path()),
    )
    .unwrap();
    let (started_tx, started) = channel();
    let (go, go_rx) = channel();
    let fake = Arc::new(FakeSweeps {
        asked: Mutex::new(Vec::new()),
        started: Mutex::new(started_tx),
        go: Mutex::new(go_rx),
    });
    let mut credentials = Credentials::default();
    credentials
        .add_list(
            &format!("alice:{OPERATOR_TOKEN},prom:read:{READ_TOKEN}"),
            "test",
        )
        .unwrap();
    let state = AdminState::new(&runtime)
        .with_auth(Auth::new(credentials, true, false))
        .with_whatif(Arc::clone(&fake) as Arc<dyn WhatIf>);
    let server = AdminServer::start("127.0.0.1:0".parse().unwrap(), state)
        .await
        .unwrap();
    let addr = server.local_addr();
    let reader = format!("settle_ui={}", hex(READ_TOKEN));
    let as_prom = [("Cookie", reader.as_str())];

    // The form: the runner's defaults, the page's CSRF token, the live point below.
    let (code, page) = get_page(addr, "/ui/whatif", &as_prom).await;
    assert_eq!(code, 200, "{page}");
    assert!(page.contains(r#"id="sweep-form""#), "{page}");
    assert!(page.contains("fixed:5s,1m;adaptive:5s/10m"), "{page}");
    assert!(page.contains("p99&lt;=60s"), "{page}");
    assert!(page.contains(r#"id="live-point""#), "{page}");
    assert!(!page.contains("No sweep runner"), "{page}");
    let csrf = csrf_of(&page);
    let form = format!("csrf={csrf}&minutes=5&sweep=fixed%3A5s%2C1m&goal=p99%3C%3D60s");

    // Refused before any sweep: another site, no CSRF token, a bad look-back.
    refused_cross_site_and_without_csrf(addr, "/ui/whatif", &reader, &form, &csrf).await;
    for minutes in ["0", "61", "soon"] {
        let bad = form.replace("minutes=5", &format!("minutes={minutes}"));
        let (code, _, body) = post_form(addr, "/ui/whatif", &as_prom, &bad).await;
        assert_eq!(code, 400, "{minutes}: {body}");
        assert!(body.contains("from 1 to 60"), "{minutes}: {body}");
    }
    assert!(fake.asked.lock().unwrap().is_empty(), "no sweep ran yet");

    // A read token runs a sweep; while it runs, a second one is refused with who and when.
    let first = tokio::spawn({
        let form = form.clone();
        let reader = reader.clone();
        async move { post_form(addr, "/ui/whatif", &[("Cookie", &reader)], &form).await }
    });
    tokio::task::spawn_blocking(move || started.recv_timeout(PATIENCE))
        .await
        .unwrap()
        .expect("the first sweep starts");
    let as_alice_cookie = format!("settle_ui={}", hex(OPERATOR_TOKEN));
    let as_alice = [("Cookie", as_alice_cookie.as_str())];
    let (_, alice_page) = get_page(addr, "/ui/whatif", &as_alice).await;
    assert!(alice_page.contains("A sweep is running"), "{alice_page}");
    let alice_form = format!("csrf={}&minutes=10&sweep=&goal=", csrf_of(&alice_page));
    let (code, _, body) = post_form(addr, "/ui/whatif", &as_alice, &alice_form).await;
    assert_eq!(code, 409, "{body}");
    assert!(
        body.contains("a sweep is running, started at") && body.contains("by prom"),
        "{body}"
    );
    assert_eq!(fake.asked.lock().unwrap().len(), 1, "the second never ran");
    go.send(()).unwrap();
    let (code, _, body) = first.await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        fake.asked.lock().unwrap()[0],
        WhatIfRequest {
            minutes: 5,
            sweep: Some("fixed:5s,1m".into()),
            goal: Some("p99<=60s".into()),
        }
    );
    // The chart inline, the table with its marks, the live point beside it.
    assert!(body.contains(r#"id="fake-chart""#), "{body}");
    assert!(body.contains(r#"id="sweep""#), "{body}");
    let row_of = |setting: &str| {
        let at = body.find(&format!("<td>{setting}</td>")).expect(setting);
        let start = body[..at].rfind("<tr").unwrap();
        body[start..at].to_owned()
    };
    assert!(
        row_of("fixed 1m").contains(r#"class="recommended""#),
        "{body}"
    );
    assert!(row_of("fixed 5s").contains(r#"class="pareto""#), "{body}");
    assert!(!row_of("adaptive 5s/10m").contains("class="), "{body}");
    assert!(body.contains("<td class=\"num\">400</td>"), "{body}");
    assert!(body.contains("recommended for goal: fixed 1m"), "{body}");
    assert!(body.contains(r#"id="live-point""#), "{body}");
    assert!(!body.contains("A sweep is running"), "freed: {body}");

    // The slot is free again: blank sweep and goal go to the runner as the defaults.
    go.send(()).unwrap();
    let (code, _, body) = post_form(addr, "/ui/whatif", &as_alice, &alice_form).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        fake.asked.lock().unwrap()[1],
        WhatIfRequest {
            minutes: 10,
            sweep: None,
            goal: None,
        }
    );
    server.stop().await;
}
