//! The operator page's forms that act (SEMANTICS §7): flush or cancel one session (a
//! confirmation page first, then `POST /v1/actions`), set or remove a tenant override
//! (`PUT` / `DELETE /v1/tenants/{tenant}/override`). The [`super::super::auth`] layer has
//! already checked the credential (operator token, `admin.actions`) and audited a refusal;
//! here each form's CSRF token is checked ([`super::csrf_ok`]), then the `/v1` handler runs
//! with the caller's [`Operator`], so the checks, the audit records and the answers are the
//! API's. A refused form gets the API's status (400, 404, 409, 503) and message in the page.

use super::super::{actions, overrides, AdminState, Operator};
use super::pages::{session_href, tenant_href};
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

/// `POST /ui/actions`: confirm, then flush or cancel (module docs).
pub(super) async fn action(
    State(s): State<AdminState>,
    headers: HeaderMap,
    operator: Option<Extension<Operator>>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Response {
    let f = match form {
        Ok(Form(f)) => f,
        Err(e) => return bad_form(e),
    };
    if !csrf_ok(&headers, &f.csrf) {
        return csrf_refused();
    }
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
    let f = match form {
        Ok(Form(f)) => f,
        Err(e) => return bad_form(e),
    };
    if !csrf_ok(&headers, &f.csrf) {
        return csrf_refused();
    }
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
    let f = match form {
        Ok(Form(f)) => f,
        Err(e) => return bad_form(e),
    };
    if !csrf_ok(&headers, &f.csrf) {
        return csrf_refused();
    }
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
