//! The operator page's forms that act (SEMANTICS §7): flush or cancel one session (a
//! confirmation page first, then `POST /v1/actions`), set or remove a tenant override
//! (`PUT` / `DELETE /v1/tenants/{tenant}/override`). The [`super::super::auth`] layer has
//! already checked the credential (operator token, `admin.actions`) and audited a refusal;
//! here each form's CSRF token is checked ([`super::csrf_ok`]), then the `/v1` handler runs
//! with the caller's [`Operator`], so the checks, the audit records and the answers are the
//! API's. A refused form gets the API's status (400, 404, 409, 503) and message in the page.
//!
//! The What-if form only reads ([`super::is_read_form`]: any role) but is checked like the
//! others (Origin, CSRF): it runs one sweep through the server's
//! [`super::super::WhatIf`] on a blocking thread, one at a time per process
//! ([`super::super::whatif`]), and answers the What-if page with the result: 200, 400 for a
//! bad form or a refused sweep, 409 while another sweep runs, 502 when the read failed.

use super::super::auth::ANONYMOUS;
use super::super::whatif::{RunningSweep, WhatIfError, WhatIfRequest, MAX_MINUTES, MAX_SPEC_BYTES};
use super::super::{actions, overrides, AdminState, Operator};
use super::pages::{session_href, tenant_href, whatif_page, SweepAsked, SweepOutcome};
use super::{answer_json, csrf_ok, layout, page_error, Frame};
use axum::extract::rejection::FormRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::{Extension, Form, Json};
use maud::html;
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// The flush / cancel form.
#[derive(Deserialize)]
pub(super) struct ActionForm {
    kind: String,
    session: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    csrf: String,
    /// `yes` once the operator confirmed.
    #[serde(default)]
    confirm: String,
}

fn bad_form(e: FormRejection) -> Response {
    page_error(
        StatusCode::BAD_REQUEST,
        &format!("bad form: {}", e.body_text()),
    )
}

fn csrf_refused() -> Response {
    page_error(
        StatusCode::FORBIDDEN,
        "the form's CSRF token is missing or stale (a new login or a restart changes it): reload the page and send it again",
    )
}

/// The fields of a form that parsed and carries this request's CSRF token (`csrf` of the
/// fields), or the page that refuses it (400, 403).
fn checked<F>(
    headers: &HeaderMap,
    form: Result<Form<F>, FormRejection>,
    csrf: impl FnOnce(&F) -> &str,
) -> Result<F, Box<Response>> {
    let f = match form {
        Ok(Form(f)) => f,
        Err(e) => return Err(Box::new(bad_form(e))),
    };
    if !csrf_ok(headers, csrf(&f)) {
        return Err(Box::new(csrf_refused()));
    }
    Ok(f)
}

/// `POST /ui/actions`: confirm, then flush or cancel (module docs).
pub(super) async fn action(
    State(s): State<AdminState>,
    headers: HeaderMap,
    operator: Option<Extension<Operator>>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    let f = match checked(&headers, form, |f| f.csrf.as_str()) {
        Ok(f) => f,
        Err(refused) => return *refused,
    };
    let frame = Frame::of(&s, &headers);
    let (tenant, session) = f
        .session
        .split_once('/')
        .unwrap_or((f.session.as_str(), ""));
    let back = session_href(tenant, session);
    if f.confirm != "yes" {
        let body = html! {
            p { "You are about to " strong { (f.kind) } " the open round of " strong { (f.session) } "." }
            @match f.kind.as_str() {
                "flush" => p { "Its ready record is emitted now (trigger manual)." },
                "cancel" => p { "It is closed without a ready record; its uploads are dropped (the CallTrack stays)." },
                _ => p.error { "Unknown action: the server will refuse it." },
            }
            p { "Reason: " q { (f.reason) } }
            form.action method="post" action="/ui/actions" {
                input type="hidden" name="kind" value=(f.kind);
                input type="hidden" name="session" value=(f.session);
                input type="hidden" name="reason" value=(f.reason);
                input type="hidden" name="csrf" value=(frame.csrf);
                input type="hidden" name="confirm" value="yes";
                div.buttons {
                    button #confirm type="submit" { "Yes, " (f.kind) " it" }
                    a href=(back) { "No, go back" }
                }
            }
        };
        return layout(
            &format!("Confirm: {} {}", f.kind, f.session),
            "Pending",
            &frame,
            body,
        )
        .into_response();
    }
    let request: actions::ActionRequest = match serde_json::from_value(json!({
        "kind": f.kind,
        "session": f.session,
        "reason": f.reason,
    })) {
        Ok(r) => r,
        Err(e) => return page_error(StatusCode::BAD_REQUEST, &format!("kind {:?}: {e}", f.kind)),
    };
    let (code, v) =
        answer_json(actions::post(State(s.clone()), operator, Ok(Json(request))).await).await;
    let outcomes = v["outcomes"].as_array().cloned().unwrap_or_default();
    let body = html! {
        @if code.is_success() {
            p.ok #result role="status" { "Result: " strong { (v["result"].as_str().unwrap_or("?")) } @if code == StatusCode::ACCEPTED { " (still in flight: look it up in the audit)" } }
            dl.facts {
                dt { "Request id" } dd { code { (v["request_id"].as_str().unwrap_or("")) } }
                dt { "Sessions / uploads" } dd { (v["sessions"]) " / " (v["uploads"]) }
            }
            @for o in &outcomes { p.hint { "partition " (o["partition"]) ": " (o["result"].as_str().unwrap_or("")) " at " (super::time(o["applied_at"].as_str())) } }
        } @else {
            p.error role="alert" { (code.as_u16()) ": " (v["error"].as_str().unwrap_or("refused")) }
        }
        p { a href=(back) { "Back to the session" } " · " a href="/ui/audit" { "Audit" } }
    };
    (
        code,
        layout(
            &format!("{} {}", f.kind, f.session),
            "Pending",
            &frame,
            body,
        ),
    )
        .into_response()
}

/// The override form.
#[derive(Deserialize)]
pub(super) struct OverrideForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    version: String,
    #[serde(default)]
    policy: String,
    #[serde(default)]
    delay: String,
    #[serde(default)]
    min_delay: String,
    #[serde(default)]
    max_delay: String,
    #[serde(default)]
    max_wait: String,
    #[serde(default)]
    tier: String,
    #[serde(default)]
    expires_in: String,
    #[serde(default)]
    reason: String,
}

/// The form's `version`, or the 400 page that says what is wrong with it.
fn version_of(text: &str) -> Result<u64, Box<Response>> {
    text.trim().parse().map_err(|_| {
        Box::new(page_error(
            StatusCode::BAD_REQUEST,
            &format!("version {text:?}: a whole number (the version the form was drawn with)"),
        ))
    })
}

/// After a write: the tenant page with what happened, or the API's refusal.
fn written(
    s: &AdminState,
    headers: &HeaderMap,
    tenant: &str,
    what: &str,
    code: StatusCode,
    v: &Value,
) -> Response {
    if code.is_success() {
        let version = v["override"]["version"].as_u64().unwrap_or(0);
        let state = if code == StatusCode::ACCEPTED {
            "stored, not applied here yet"
        } else {
            "applied"
        };
        let msg = format!("{what}: version {version}, {state}");
        return Redirect::to(&format!(
            "{}?done={}",
            tenant_href(tenant),
            super::pages::encode(&msg, false)
        ))
        .into_response();
    }
    let frame = Frame::of(s, headers);
    let body = html! {
        p.error role="alert" { (code.as_u16()) ": " (v["error"].as_str().unwrap_or("refused")) }
        @if code == StatusCode::CONFLICT { p { "Another change came first (now version " (v["version"]) "): reload the tenant page and try again." } }
        p { a href=(tenant_href(tenant)) { "Back to " (tenant) } }
    };
    (
        code,
        layout(&format!("Tenant {tenant}"), "Tenants", &frame, body),
    )
        .into_response()
}

/// `POST /ui/tenants/{tenant}/override`: `PUT /v1/tenants/{tenant}/override`.
pub(super) async fn set_override(
    State(s): State<AdminState>,
    headers: HeaderMap,
    operator: Option<Extension<Operator>>,
    Path(tenant): Path<String>,
    form: Result<Form<OverrideForm>, FormRejection>,
) -> Response {
    let f = match checked(&headers, form, |f| f.csrf.as_str()) {
        Ok(f) => f,
        Err(refused) => return *refused,
    };
    let version = match version_of(&f.version) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let mut debounce = Map::new();
    for (key, value) in [
        ("policy", &f.policy),
        ("delay", &f.delay),
        ("min-delay", &f.min_delay),
        ("max-delay", &f.max_delay),
        ("max-wait", &f.max_wait),
    ] {
        if !value.trim().is_empty() {
            debounce.insert(key.into(), Value::from(value.trim()));
        }
    }
    let mut body = json!({ "version": version, "debounce": debounce, "reason": f.reason });
    if !f.tier.trim().is_empty() {
        body["tier"] = Value::from(f.tier.trim());
    }
    if !f.expires_in.trim().is_empty() {
        body["expires_in"] = Value::from(f.expires_in.trim());
    }
    let put: overrides::PutBody = match serde_json::from_value(body) {
        Ok(b) => b,
        // A debounce key the config refuses (e.g. a policy name): the message names it.
        Err(e) => return page_error(StatusCode::BAD_REQUEST, &format!("debounce: {e}")),
    };
    let (code, v) = answer_json(
        overrides::put(
            State(s.clone()),
            operator,
            Ok(Path(tenant.clone())),
            Ok(Json(put)),
        )
        .await,
    )
    .await;
    written(&s, &headers, &tenant, "override set", code, &v)
}

/// The remove form.
#[derive(Deserialize)]
pub(super) struct RemoveForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    version: String,
    #[serde(default)]
    reason: String,
}

/// `POST /ui/tenants/{tenant}/override/remove`: `DELETE /v1/tenants/{tenant}/override`.
pub(super) async fn remove_override(
    State(s): State<AdminState>,
    headers: HeaderMap,
    operator: Option<Extension<Operator>>,
    Path(tenant): Path<String>,
    form: Result<Form<RemoveForm>, FormRejection>,
) -> Response {
    let f = match checked(&headers, form, |f| f.csrf.as_str()) {
        Ok(f) => f,
        Err(refused) => return *refused,
    };
    let version = match version_of(&f.version) {
        Ok(v) => v,
        Err(r) => return *r,
    };
    let query: overrides::DeleteQuery =
        match serde_json::from_value(json!({ "version": version, "reason": f.reason })) {
            Ok(q) => q,
            Err(e) => return page_error(StatusCode::BAD_REQUEST, &e.to_string()),
        };
    let (code, v) = answer_json(
        overrides::delete(
            State(s.clone()),
            operator,
            Ok(Path(tenant.clone())),
            Ok(Query(query)),
        )
        .await,
    )
    .await;
    written(&s, &headers, &tenant, "override removed", code, &v)
}

/// The What-if form.
#[derive(Deserialize)]
pub(super) struct WhatIfForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    minutes: String,
    #[serde(default)]
    sweep: String,
    #[serde(default)]
    goal: String,
}

/// The form's look-back (minutes), or what is wrong with it.
fn minutes_of(text: &str) -> Result<u32, String> {
    text.trim()
        .parse::<u32>()
        .ok()
        .filter(|m| (1..=MAX_MINUTES).contains(m))
        .ok_or_else(|| {
            format!("minutes {text:?}: a whole number of minutes from 1 to {MAX_MINUTES}")
        })
}

/// A sweep or goal text: `None` when blank (the default), or why it is refused.
fn spec_of(name: &str, text: &str) -> Result<Option<String>, String> {
    let t = text.trim();
    if t.len() > MAX_SPEC_BYTES {
        return Err(format!(
            "{name}: {} bytes, at most {MAX_SPEC_BYTES}",
            t.len()
        ));
    }
    Ok((!t.is_empty()).then(|| t.to_owned()))
}

/// The What-if page with the form as `asked` and `outcome`, status `code`.
async fn sweep_page(
    s: &AdminState,
    headers: &HeaderMap,
    asked: &SweepAsked,
    code: StatusCode,
    outcome: SweepOutcome,
) -> Response {
    (
        code,
        whatif_page(s, headers, Some(asked), Some(&outcome)).await,
    )
        .into_response()
}

/// `POST /ui/whatif`: one sweep, then the What-if page with its result (module docs).
pub(super) async fn whatif(
    State(s): State<AdminState>,
    headers: HeaderMap,
    operator: Option<Extension<Operator>>,
    form: Result<Form<WhatIfForm>, FormRejection>,
) -> Response {
    let f = match checked(&headers, form, |f| f.csrf.as_str()) {
        Ok(f) => f,
        Err(refused) => return *refused,
    };
    let Some(runner) = s.whatif.clone() else {
        return page_error(
            StatusCode::NOT_FOUND,
            "this admin server has no sweep runner: run `settle tune` beside it",
        );
    };
    let asked = SweepAsked {
        minutes: f.minutes.clone(),
        sweep: f.sweep.clone(),
        goal: f.goal.clone(),
    };
    let request = match (
        minutes_of(&f.minutes),
        spec_of("sweep", &f.sweep),
        spec_of("goal", &f.goal),
    ) {
        (Ok(minutes), Ok(sweep), Ok(goal)) => WhatIfRequest {
            minutes,
            sweep,
            goal,
        },
        (m, w, g) => {
            let e = [m.err(), w.err(), g.err()]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>();
            let outcome = SweepOutcome::Error(e.join("; "));
            return sweep_page(&s, &headers, &asked, StatusCode::BAD_REQUEST, outcome).await;
        }
    };
    let who = operator.map_or_else(|| ANONYMOUS.to_owned(), |Extension(o)| o.name);
    let started_at = (s.wall)();
    let guard = match s.sweeps.try_take(RunningSweep {
        started_at,
        who: who.clone(),
        minutes: request.minutes,
    }) {
        Ok(g) => g,
        Err(running) => {
            let message = format!(
                "a sweep is running, started at {} by {} (last {} min): one runs at a time; send the form again once it has ended",
                crate::codec::format_rfc3339_ms(running.started_at),
                running.who,
                running.minutes
            );
            return sweep_page(
                &s,
                &headers,
                &asked,
                StatusCode::CONFLICT,
                SweepOutcome::Error(message),
            )
            .await;
        }
    };
    tracing::info!(%who, minutes = request.minutes, sweep = request.sweep.as_deref().unwrap_or("default"), goal = request.goal.as_deref().unwrap_or("default"), "operator page: what-if sweep started");
    // The guard moves into the blocking task: the slot stays taken until the sweep ends,
    // even when the browser goes away first.
    let ran = tokio::task::spawn_blocking(move || {
        let _running = guard;
        runner.sweep(&request)
    })
    .await
    .unwrap_or_else(|e| Err(WhatIfError::Failed(format!("the sweep stopped: {e}"))));
    let took_ms = (s.wall)() - started_at;
    match ran {
        Ok(result) => {
            tracing::info!(%who, took_ms, uploads = result.uploads, settings = result.rows.len(), "operator page: what-if sweep done");
            sweep_page(
                &s,
                &headers,
                &asked,
                StatusCode::OK,
                SweepOutcome::Done(result),
            )
            .await
        }
        Err(e) => {
            tracing::info!(%who, took_ms, error = %e, "operator page: what-if sweep gave no result");
            let code = match e {
                WhatIfError::Refused(_) => StatusCode::BAD_REQUEST,
                WhatIfError::Failed(_) => StatusCode::BAD_GATEWAY,
            };
            sweep_page(
                &s,
                &headers,
                &asked,
                code,
                SweepOutcome::Error(e.to_string()),
            )
            .await
        }
    }
}
