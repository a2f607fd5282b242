//! The operator page of `settle run` (issue 35, SEMANTICS §7 "from the admin API and its web
//! page"): server-rendered HTML under `/ui` on the admin listener, on top of the `/v1`
//! handlers (each page calls the handler of its `/v1` endpoint in process and renders its
//! JSON answer, so the page shows exactly what the API answers and goes through the same
//! checks, refusals and audit records).
//!
//! Owns: the `/ui` routes, the login cookie, the cross-site checks of the page's forms, the
//! layout and the embedded browser files. The views are in [`pages`], the forms that act in
//! [`forms`], the Overview's figures in [`stats`].
//!
//! | path | what |
//! |---|---|
//! | `GET /ui` | Overview: rates, coalescing, time-to-ready, lag, timer backlog, dead letters, tier changes; live charts |
//! | `GET /ui/stats.json` | the Overview's counters now (polled by the charts every [`POLL_MS`]) |
//! | `GET /ui/overview/live` | the Overview's tables alone (htmx swaps them in every 5 s) |
//! | `GET /ui/pending` | `/v1/pending` with its filters, a page at a time |
//! | `GET /ui/sessions/{tenant}/{session}` | one session; flush and cancel forms |
//! | `POST /ui/actions` | flush or cancel one session: a confirmation step, then `POST /v1/actions` |
//! | `GET /ui/tenants`, `GET /ui/tenants/{tenant}` | tenants with pending work, demoted or with an override; one tenant with its tier changes and override form |
//! | `POST /ui/tenants/{tenant}/override`, `POST /ui/tenants/{tenant}/override/remove` | `PUT` / `DELETE /v1/tenants/{tenant}/override` |
//! | `GET /ui/partitions`, `GET /ui/audit` | partitions, the latest audit records |
//! | `GET /ui/whatif` | the live policy's measured point and the shadow policies' figures; the sweep form when `settle run` gave the server a [`super::WhatIf`] (else how to run `settle tune`) |
//! | `POST /ui/whatif` | runs one sweep over the input's last 1–60 minutes (`settle tune`'s replay, off the async workers, one at a time per process): its Pareto chart and table, Pareto and recommended rows marked, beside the live point ([`super::whatif`]) |
//! | `GET /ui/login`, `POST /ui/login`, `POST /ui/logout` | the token form; sets or clears the cookie |
//! | `GET /ui/assets/{file}` | htmx, uPlot, the page's CSS and JS, cached for a year ([`ASSETS`]) |
//!
//! Credentials: `POST /ui/login` checks the bearer token with [`super::auth`] and keeps it
//! (hex-encoded) in the cookie [`COOKIE`]: `HttpOnly; SameSite=Strict; Path=/ui`, `Secure`
//! when the listener speaks TLS. The [`super::auth`] layer reads that cookie for `/ui`
//! requests without an `Authorization` header, so the page follows the API's rules: reads
//! open unless `admin.protect-reads`, and every `POST` under `/ui` but login, logout and the
//! What-if form is an action (operator token, `admin.actions`; refusals answered 401/403,
//! counted and audited). The What-if form only reads ([`is_read_form`]): a read token may
//! run a sweep. A `POST` must also come from this page: its `Origin` (or `Sec-Fetch-Site`)
//! must be this host, and every form but login and logout must carry the token
//! [`csrf_token`] derives from the cookie.
//! The token itself is never rendered.

mod forms;
mod pages;
mod stats;

use super::auth::Refusal;
use super::{AdminState, Operator};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use maud::{html, Markup, PreEscaped, DOCTYPE};
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::sync::OnceLock;

/// The cookie that keeps the operator's token (hex-encoded).
pub const COOKIE: &str = "settle_ui";

/// How often the Overview's charts poll `/ui/stats.json` (ms).
pub const POLL_MS: u64 = 2_000;

/// Largest JSON answer of a `/v1` handler the page reads (bytes).
const MAX_ANSWER_BYTES: usize = 16 << 20;

/// One embedded browser file: path under `/ui/assets/`, content type, bytes.
pub struct Asset {
    /// File name under `/ui/assets/`.
    pub name: &'static str,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// The file.
    pub bytes: &'static [u8],
}

/// The browser files, embedded in the binary (refreshed by `scripts/ui-assets.sh`; the
/// versions are in `src/admin/ui/assets/VERSIONS`). Served with a one-year cache: a new
/// version changes [`ASSET_VERSION`], which is in every URL.
pub const ASSETS: &[Asset] = &[
    Asset {
        name: "htmx.min.js",
        content_type: "text/javascript; charset=utf-8",
        bytes: include_bytes!("assets/htmx.min.js"),
    },
    Asset {
        name: "uPlot.iife.min.js",
        content_type: "text/javascript; charset=utf-8",
        bytes: include_bytes!("assets/uPlot.iife.min.js"),
    },
    Asset {
        name: "uPlot.min.css",
        content_type: "text/css; charset=utf-8",
        bytes: include_bytes!("assets/uPlot.min.css"),
    },
    Asset {
        name: "ui.css",
        content_type: "text/css; charset=utf-8",
        bytes: include_bytes!("ui.css"),
    },
    Asset {
        name: "ui.js",
        content_type: "text/javascript; charset=utf-8",
        bytes: include_bytes!("ui.js"),
    },
];

/// Part of every asset URL (`/ui/assets/{file}?v=`): the crate version, so a new build's
/// files are not taken from a browser's year-long cache.
pub const ASSET_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Whether `method path` is open whatever the rules (the login form, logout, the browser
/// files): the [`super::auth`] layer lets it through without a token.
pub fn is_open(method: &Method, path: &str) -> bool {
    match *method {
        Method::GET | Method::HEAD => path == "/ui/login" || path.starts_with("/ui/assets/"),
        Method::POST => path == "/ui/login" || path == "/ui/logout",
        _ => false,
    }
}

/// Whether `method path` is a form that only reads (the What-if sweep): the [`super::auth`]
/// layer treats it as a read (open unless `admin.protect-reads`, a read token is enough),
/// while it still passes the page's Origin and CSRF checks.
pub fn is_read_form(method: &Method, path: &str) -> bool {
    *method == Method::POST && path == "/ui/whatif"
}

/// The `/ui` routes (module docs), for [`super::router`].
pub(super) fn routes() -> Router<AdminState> {
    Router::new()
        .route("/ui", get(pages::overview))
        .route("/ui/", get(|| async { Redirect::to("/ui") }))
        .route("/ui/stats.json", get(stats::json))
        .route("/ui/overview/live", get(pages::overview_live))
        .route("/ui/pending", get(pages::pending))
        .route("/ui/sessions/{tenant}/{*session}", get(pages::session))
        .route("/ui/actions", post(forms::action))
        .route("/ui/tenants", get(pages::tenants))
        .route("/ui/tenants/{tenant}", get(pages::tenant))
        .route("/ui/tenants/{tenant}/override", post(forms::set_override))
        .route(
            "/ui/tenants/{tenant}/override/remove",
            post(forms::remove_override),
        )
        .route("/ui/partitions", get(pages::partitions))
        .route("/ui/whatif", get(pages::whatif).post(forms::whatif))
        .route("/ui/audit", get(pages::audit))
        .route("/ui/login", get(login_page).post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/assets/{file}", get(asset))
        .layer(axum::middleware::from_fn(same_origin))
}

/// The token kept in the cookie of `headers`, if any (hex-decoded).
pub fn cookie_token(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .and_then(|(_, v)| unhex(v))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unhex(text: &str) -> Option<String> {
    if text.len() % 2 != 0 {
        return None;
    }
    let bytes = (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}

/// A random secret of this process: the CSRF tokens are derived from it.
fn process_secret() -> &'static [u8; 32] {
    static SECRET: OnceLock<[u8; 32]> = OnceLock::new();
    SECRET.get_or_init(rand::random)
}

/// The CSRF token the action forms of a page carry: a digest of this process's secret and
/// the request's cookie (so it changes with the login and a restart, and another site can
/// neither read nor forge it).
pub fn csrf_token(headers: &HeaderMap) -> String {
    let mut h = Sha256::new();
    h.update(process_secret());
    h.update(cookie_token(headers).unwrap_or_default().as_bytes());
    hex(&h.finalize()[..16])
}

/// Whether a form's CSRF token is the one of this request's cookie (constant time).
pub(super) fn csrf_ok(headers: &HeaderMap, presented: &str) -> bool {
    use subtle::ConstantTimeEq;
    let want = csrf_token(headers);
    bool::from(want.as_bytes().ct_eq(presented.as_bytes()))
}

/// Refuses a `POST` under `/ui` that does not come from a page of this host: `Origin` must
/// be `http(s)://HOST`, or, without `Origin`, `Sec-Fetch-Site` must be `same-origin` or
/// `none` (a request with neither is not from a browser: no cross-site risk).
async fn same_origin(req: Request, next: Next) -> Response {
    if req.method() == Method::POST && !same_origin_ok(req.headers()) {
        return page_error(
            StatusCode::FORBIDDEN,
            "cross-site request refused: the form must be sent from this page",
        );
    }
    next.run(req).await
}

fn same_origin_ok(headers: &HeaderMap) -> bool {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let host = get("host");
    if let Some(origin) = get("origin") {
        let bare = origin
            .strip_prefix("https://")
            .or_else(|| origin.strip_prefix("http://"));
        return bare.is_some() && bare == host;
    }
    match get("sec-fetch-site") {
        Some(site) => site == "same-origin" || site == "none",
        None => true,
    }
}

/// The answer of a `/v1` handler as (status, JSON).
pub(super) async fn answer_json(response: Response) -> (StatusCode, Value) {
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), MAX_ANSWER_BYTES)
        .await
        .unwrap_or_default();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// Who is logged in, as the page shows it: the cookie's credential name, if it matches one.
fn signed_in(s: &AdminState, headers: &HeaderMap) -> Option<Operator> {
    cookie_token(headers).and_then(|t| s.auth.credentials().check(&t))
}

/// What every page needs to draw its frame.
pub(super) struct Frame {
    /// The credential of the cookie, if any.
    pub who: Option<Operator>,
    /// Whether tokens are configured (no: actions are open on a loopback listener).
    pub tokens: bool,
    /// The action forms' CSRF token.
    pub csrf: String,
}

impl Frame {
    pub(super) fn of(s: &AdminState, headers: &HeaderMap) -> Frame {
        Frame {
            who: signed_in(s, headers),
            tokens: !s.auth.credentials().is_empty(),
            csrf: csrf_token(headers),
        }
    }
}

const NAV: &[(&str, &str)] = &[
    ("Overview", "/ui"),
    ("Pending", "/ui/pending"),
    ("Tenants", "/ui/tenants"),
    ("Partitions", "/ui/partitions"),
    ("What-if", "/ui/whatif"),
    ("Audit", "/ui/audit"),
];

fn asset_url(name: &str) -> String {
    format!("/ui/assets/{name}?v={ASSET_VERSION}")
}

/// A whole page: head, navigation (`current` marked), who is logged in, `body`.
pub(super) fn layout(title: &str, current: &str, frame: &Frame, body: Markup) -> Markup {
    layout_with(title, current, frame, false, body)
}

/// [`layout`], loading uPlot too when `charts`.
pub(super) fn layout_with(
    title: &str,
    current: &str,
    frame: &Frame,
    charts: bool,
    body: Markup,
) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · settle" }
                link rel="stylesheet" href=(asset_url("ui.css"));
                @if charts { link rel="stylesheet" href=(asset_url("uPlot.min.css")); }
                script src=(asset_url("htmx.min.js")) defer {}
                @if charts { script src=(asset_url("uPlot.iife.min.js")) defer {} }
                script src=(asset_url("ui.js")) defer {}
            }
            body {
                a.skip href="#main" { "Skip to content" }
                header {
                    a.brand href="/ui" { "settle" }
                    nav aria-label="Views" {
                        ul {
                            @for (name, href) in NAV {
                                li { a href=(href) aria-current=[(*name == current).then_some("page")] { (name) } }
                            }
                        }
                    }
                    div.who {
                        @match &frame.who {
                            Some(o) => {
                                span { (o.name) " (" (o.role.as_str()) ")" }
                                form method="post" action="/ui/logout" { button type="submit" { "Log out" } }
                            }
                            None if frame.tokens => { a href="/ui/login" { "Log in" } }
                            None => { span title="no admin token is configured: actions are open on this loopback listener" { "no login needed" } }
                        }
                    }
                }
                main #main { h1 { (title) } (body) }
            }
        }
    }
}

/// A time: the UTC value in `datetime` and `title`; `ui.js` writes it in the browser's
/// time zone.
pub(super) fn time(rfc3339: Option<&str>) -> Markup {
    match rfc3339 {
        Some(t) => html! { time datetime=(t) title=(format!("{t} (UTC)")) { (t) } },
        None => html! { "—" },
    }
}

/// A page that only says what went wrong, with status `code`.
pub(super) fn page_error(code: StatusCode, message: &str) -> Response {
    let frame = Frame {
        who: None,
        tokens: true,
        csrf: String::new(),
    };
    let body = html! {
        p.error role="alert" { (message) }
        p { a href="/ui" { "Back to the overview" } }
    };
    (code, layout(&code.as_u16().to_string(), "", &frame, body)).into_response()
}

/// The login page, with `message` (an error) when given.
fn login_markup(s: &AdminState, headers: &HeaderMap, message: Option<&str>) -> Markup {
    let frame = Frame::of(s, headers);
    layout(
        "Log in",
        "",
        &frame,
        html! {
            @if let Some(m) = message { p.error role="alert" { (m) } }
            @if frame.tokens {
                form.login method="post" action="/ui/login" {
                    label for="token" { "Admin token" }
                    input #token type="password" name="token" autocomplete="current-password" required autofocus;
                    p.hint { "The bearer token of a credential of " code { "admin.tokens-file" } " or " code { "SETTLE_ADMIN_TOKENS" } ". It is kept in an HttpOnly cookie for this page only." }
                    button type="submit" { "Log in" }
                }
            } @else {
                p { "No admin token is configured: reading and actions are open on this loopback listener." }
                p { a href="/ui" { "Go to the overview" } }
            }
        },
    )
}

/// What the [`super::auth`] layer answers for a refused `/ui` request: the login page with
/// the reason, status 401 or 403.
pub(super) fn refused(s: &AdminState, headers: &HeaderMap, refusal: Refusal) -> Response {
    let message = match refusal {
        Refusal::MissingToken => "Log in: this needs an admin token.",
        Refusal::BadToken => "The token matches no configured credential: log in again.",
        other => other.message(),
    };
    (refusal.status(), login_markup(s, headers, Some(message))).into_response()
}

async fn login_page(State(s): State<AdminState>, headers: HeaderMap) -> Response {
    login_markup(&s, &headers, None).into_response()
}

/// The login form's fields.
#[derive(Deserialize)]
struct LoginForm {
    #[serde(default)]
    token: String,
}

fn cookie(value: &str, max_age: Option<u32>, secure: bool) -> HeaderValue {
    let mut c = format!("{COOKIE}={value}; HttpOnly; SameSite=Strict; Path=/ui");
    if let Some(age) = max_age {
        c.push_str(&format!("; Max-Age={age}"));
    }
    if secure {
        c.push_str("; Secure");
    }
    HeaderValue::from_str(&c).unwrap_or_else(|_| HeaderValue::from_static(""))
}

async fn login(
    State(s): State<AdminState>,
    headers: HeaderMap,
    form: Result<Form<LoginForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    let token = form.map(|Form(f)| f.token).unwrap_or_default();
    let token = token.trim();
    if token.is_empty() {
        s.metrics.admin_refused(Refusal::MissingToken.as_str());
        return (
            StatusCode::UNAUTHORIZED,
            login_markup(&s, &headers, Some("Give the admin token.")),
        )
            .into_response();
    }
    let Some(operator) = s.auth.credentials().check(token) else {
        s.metrics.admin_refused(Refusal::BadToken.as_str());
        tracing::info!("operator page: login refused (the token matches no credential)");
        return (
            StatusCode::UNAUTHORIZED,
            login_markup(
                &s,
                &headers,
                Some("The token matches no configured credential."),
            ),
        )
            .into_response();
    };
    tracing::info!(who = %operator.name, role = operator.role.as_str(), "operator page: logged in");
    let mut r = Redirect::to("/ui").into_response();
    r.headers_mut().insert(
        header::SET_COOKIE,
        cookie(&hex(token.as_bytes()), None, s.tls),
    );
    r
}

async fn logout(State(s): State<AdminState>) -> Response {
    let mut r = Redirect::to("/ui/login").into_response();
    r.headers_mut()
        .insert(header::SET_COOKIE, cookie("", Some(0), s.tls));
    r
}

async fn asset(Path(file): Path<String>) -> Response {
    match ASSETS.iter().find(|a| a.name == file) {
        Some(a) => (
            [
                (header::CONTENT_TYPE, a.content_type),
                (header::CACHE_CONTROL, "public, max-age=31536000, immutable"),
            ],
            a.bytes,
        )
            .into_response(),
        None => page_error(StatusCode::NOT_FOUND, &format!("no such file: {file}")),
    }
}

/// Inline script data: `value` as JSON safe inside `<script>`.
pub(super) fn script_json(value: &Value) -> PreEscaped<String> {
    PreEscaped(value.to_string().replace('<', "\\u003c"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookie_token_round_trips_and_ignores_others() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_str(&format!(
                "a=b; {COOKIE}={}; c=d",
                hex(b"0123456789abcdef-tok")
            ))
            .unwrap(),
        );
        assert_eq!(cookie_token(&h).as_deref(), Some("0123456789abcdef-tok"));
        h.insert(header::COOKIE, HeaderValue::from_static("settle_ui=zz"));
        assert_eq!(cookie_token(&h), None);
    }

    #[test]
    fn csrf_token_follows_the_cookie() {
        let mut a = HeaderMap::new();
        a.insert(header::COOKIE, HeaderValue::from_static("settle_ui=6161"));
        let b = HeaderMap::new();
        assert!(csrf_ok(&a, &csrf_token(&a)));
        assert!(!csrf_ok(&a, &csrf_token(&b)));
        assert!(!csrf_ok(&a, ""));
    }

    #[test]
    fn cross_site_posts_are_refused() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("127.0.0.1:9464"));
        assert!(
            same_origin_ok(&h),
            "no Origin, no Sec-Fetch-Site: not a browser"
        );
        h.insert("origin", HeaderValue::from_static("http://127.0.0.1:9464"));
        assert!(same_origin_ok(&h));
        h.insert("origin", HeaderValue::from_static("https://evil.example"));
        assert!(!same_origin_ok(&h));
        h.remove("origin");
        h.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(!same_origin_ok(&h));
        h.insert("sec-fetch-site", HeaderValue::from_static("same-origin"));
        assert!(same_origin_ok(&h));
    }

    #[test]
    fn only_login_logout_and_assets_are_open() {
        assert!(is_open(&Method::GET, "/ui/login"));
        assert!(is_open(&Method::POST, "/ui/login"));
        assert!(is_open(&Method::GET, "/ui/assets/htmx.min.js"));
        assert!(!is_open(&Method::GET, "/ui/pending"));
        assert!(!is_open(&Method::POST, "/ui/actions"));
        assert!(is_read_form(&Method::POST, "/ui/whatif"));
        assert!(!is_read_form(&Method::POST, "/ui/actions"));
        assert!(!is_open(&Method::POST, "/ui/whatif"));
    }
}
