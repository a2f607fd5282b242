//! Tenant overrides of the admin API (SEMANTICS §7; `runtime::overrides`):
//! `PUT /v1/tenants/{tenant}/override`, `DELETE /v1/tenants/{tenant}/override?version=N`,
//! `GET /v1/overrides`. A write is committed by the broker (the override store) and answered
//! once this instance has applied it (200), or, when it is stored but not yet read back
//! here, with 202 and `result: in_flight`. Every accepted or refused write is audited
//! (`override.set`, `override.delete`) and counted (`settle_override_changes_total`).
//!
//! PUT body (JSON; unknown fields refused):
//!
//! | field | meaning |
//! |---|---|
//! | `version` | required: the version last seen (`GET /v1/overrides` or the tenant view), 0 for a tenant without an override in force; another one is refused with 409 and the current override |
//! | `debounce` | policy and parameters as `[debounce.tenants.NAME]`: `policy`, `delay`, `min-delay`, `max-delay`, `max-wait` (`"off"`: none), `state-ttl`, `learn-initial-delay`, `event-ids`; durations as in the config (`"2m"`); keys not set are inherited from the config's rule of the tenant; checked by the config's rules (400 naming the key, e.g. `debounce.max-delay`) |
//! | `tier` | pin the tenant to this tier (automatic demotion and recovery hold while it lasts) |
//! | `event_ids` | how many event ids the tenant's ready records list (`event-ids`, SEMANTICS §2; 0 to 100 000), over the config's and over `debounce."event-ids"` |
//! | `reason` | why (≤ 1024 bytes), for the audit topic |
//! | `expires_at` / `expires_in` | when it ends: RFC 3339 or epoch ms / a duration (`"2h"`); none: until removed |
//! | `request_id` | id of the request in the audit (generated when absent) |
//! | `wait_ms` | how long to wait for this instance to apply it (default 5 000, at most 60 000) |

use super::actions::{audit, new_request_id};
use super::views::check_tenant;
use super::{error, rfc3339, AdminState, Operator};
use crate::codec::action::{AuditRecord, AuditStage};
use crate::codec::parse_rfc3339_ms;
use crate::config::TenantOverride;
use crate::engine::Millis;
use crate::runtime::{Override, OverrideError, Written};
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;

/// Longest wait for this instance to apply a write (ms).
pub const MAX_WAIT_MS: u64 = 60_000;

/// `PUT /v1/tenants/{tenant}/override` body (module docs).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PutBody {
    #[serde(default)]
    version: Option<u64>,
    #[serde(default)]
    debounce: TenantOverride,
    #[serde(default)]
    tier: Option<String>,
    #[serde(default)]
    event_ids: Option<u32>,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    expires_at: Option<Value>,
    #[serde(default)]
    expires_in: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    wait_ms: Option<u64>,
}

/// `DELETE /v1/tenants/{tenant}/override` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteQuery {
    #[serde(default)]
    version: Option<u64>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    wait_ms: Option<u64>,
}

/// One override as answered: times in RFC 3339, `in_force` at `now`.
pub(super) fn override_json(o: &Override, now: Millis) -> Value {
    json!({
        "tenant": o.tenant,
        "debounce": o.debounce,
        "tier": o.tier,
        "event_ids": o.event_ids,
        "reason": o.reason,
        "who": o.who,
        "set_at": rfc3339(o.set_at),
        "expires_at": o.expires_at.map(rfc3339),
        "version": o.version,
        "deleted": o.deleted,
        "in_force": o.is_active(now),
        "request_id": o.request_id,
        "instance": o.instance,
    })
}

/// The tenant's rules as the views show them: what the config gives it, the override in
/// force, what is in force and which of the two wins.
pub(super) fn tenant_rules(s: &AdminState, tenant: &str, now: Millis) -> Value {
    let set = s.overrides.snapshot();
    let latest = set.entries.get(tenant).map(|e| &e.record);
    let active = set.active_of(tenant, now);
    let baseline = s.overrides.baseline();
    let configured = baseline.for_tenant(tenant);
    let in_force = s.overrides.rules_in_force().for_tenant(tenant).clone();
    let rule_wins = active.is_some_and(|o| o.sets_rule());
    let router = s.router.lock();
    let pinned = router.pinned(tenant);
    json!({
        "configured": {
            "rule": configured.to_string(),
            "from": if baseline.tenants.contains_key(tenant) { "debounce.tenants" } else { "debounce" },
            "pinned_tier": s.router.tiers().pinned(tenant),
        },
        "override": latest.map(|o| override_json(o, now)),
        "rule": in_force.to_string(),
        "policy": in_force.name.as_str(),
        "rule_from": if rule_wins { "override" } else { "config" },
        "pinned_by": pinned.map(|(_, by)| by),
        "wins": if active.is_some() { "override" } else { "config" },
    })
}

/// The wait of a request (default `runtime::overrides::DEFAULT_WAIT`, at most
/// [`MAX_WAIT_MS`]).
fn wait_of(ms: Option<u64>) -> Duration {
    ms.map_or(crate::runtime::overrides::DEFAULT_WAIT, |ms| {
        Duration::from_millis(ms.min(MAX_WAIT_MS))
    })
}

/// What a refused or failed request answers, audited and counted.
struct Refusal {
    code: StatusCode,
    body: Value,
}

impl Refusal {
    fn new(code: StatusCode, message: impl Into<String>) -> Self {
        Refusal {
            code,
            body: json!({ "error": message.into() }),
        }
    }

    fn key(code: StatusCode, key: &str, message: impl Into<String>) -> Self {
        Refusal {
            code,
            body: json!({ "error": message.into(), "key": key }),
        }
    }
}

/// Audits and counts a refusal of `action` on `tenant`, and answers it.
async fn refuse(
    s: &AdminState,
    who: &str,
    request_id: String,
    endpoint: &str,
    tenant: Option<&str>,
    r: Refusal,
) -> Response {
    s.metrics.override_change("refused");
    let why = r.body["error"].as_str().unwrap_or_default().to_owned();
    tracing::info!(request_id = %request_id, who, endpoint, tenant = ?tenant, status = r.code.as_u16(), error = %why, "tenant override refused");
    audit(
        s,
        AuditRecord {
            at: (s.wall)(),
            instance: s.actions.instance.clone(),
            who: who.to_owned(),
            request_id,
            action: endpoint.to_owned(),
            stage: AuditStage::Refused,
            reason: why,
            selection: json!({ "tenant": tenant }),
            result: json!({ "status": r.code.as_u16() }),
        },
    )
    .await;
    (r.code, Json(r.body)).into_response()
}

/// The answer of a write the runtime refused.
fn refusal_of(e: &OverrideError, now: Millis) -> Refusal {
    match e {
        OverrideError::Unavailable(m) => Refusal::new(StatusCode::SERVICE_UNAVAILABLE, m.clone()),
        OverrideError::Invalid(i) => Refusal::key(StatusCode::BAD_REQUEST, &i.key, i.to_string()),
        OverrideError::NotFound(_) => Refusal::new(StatusCode::NOT_FOUND, e.to_string()),
        OverrideError::Stale { current, .. } => Refusal {
            code: StatusCode::CONFLICT,
            body: json!({
                "error": e.to_string(),
                "version": current.as_ref().map_or(0, |c| c.version),
                "current": current.as_ref().map(|c| override_json(c, now)),
            }),
        },
    }
}

/// Audits an accepted write and answers it.
async fn accepted(s: &AdminState, action: &str, expected: u64, written: Written) -> Response {
    let now = (s.wall)();
    let (record, result, code) = match written {
        Written::Applied(o) => (o, "applied", StatusCode::OK),
        Written::InFlight(o) => (o, "in_flight", StatusCode::ACCEPTED),
    };
    tracing::info!(request_id = %record.request_id, who = %record.who, tenant = %record.tenant, version = record.version, action, result, reason = %record.reason, "tenant override accepted");
    audit(
        s,
        AuditRecord {
            at: now,
            instance: s.actions.instance.clone(),
            who: record.who.clone(),
            request_id: record.request_id.clone(),
            action: action.to_owned(),
            stage: AuditStage::Accepted,
            reason: record.reason.clone(),
            selection: json!({ "tenant": record.tenant }),
            result: json!({
                "version": record.version,
                "replaced": expected,
                "result": result,
                "override": override_json(&record, now),
            }),
        },
    )
    .await;
    let body = json!({
        "result": result,
        "request_id": record.request_id,
        "store": s.overrides.store_name(),
        "override": override_json(&record, now),
        "tenant": tenant_rules(s, &record.tenant, now),
    });
    (code, Json(body)).into_response()
}

/// The expiry of a PUT body: `expires_at` (RFC 3339 or epoch ms) or `expires_in` (a
/// duration from `now`).
fn expiry(body: &PutBody, now: Millis) -> Result<Option<Millis>, Refusal> {
    let bad =
        |key: &str, m: String| Refusal::key(StatusCode::BAD_REQUEST, key, format!("{key}: {m}"));
    match (&body.expires_at, &body.expires_in) {
        (Some(_), Some(_)) => Err(bad(
            "expires_at",
            "set expires_at or expires_in, not both".into(),
        )),
        (Some(Value::String(t)), None) => parse_rfc3339_ms(t)
            .map(Some)
            .map_err(|e| bad("expires_at", e.to_string())),
        (Some(Value::Number(n)), None) => n
            .as_i64()
            .map(Some)
            .ok_or_else(|| bad("expires_at", format!("{n} is not a time in epoch ms"))),
        (Some(Value::Null), None) | (None, None) => Ok(None),
        (Some(other), None) => Err(bad(
            "expires_at",
            format!("expected an RFC 3339 time or epoch ms, got {other}"),
        )),
        (None, Some(d)) => humantime::parse_duration(d.trim())
            .map_err(|e| bad("expires_in", format!("invalid duration {d:?}: {e}")))
            .map(|d| Some(now.saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)))),
    }
}

fn who_of(operator: Option<Extension<Operator>>) -> String {
    operator.map_or_else(|| "anonymous".to_owned(), |Extension(o)| o.name)
}

/// `PUT /v1/tenants/{tenant}/override` (module docs).
pub(super) async fn put(
    State(s): State<AdminState>,
    operator: Option<Extension<Operator>>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Json<PutBody>, JsonRejection>,
) -> Response {
    const ENDPOINT: &str = "PUT /v1/tenants/{tenant}/override";
    let who = who_of(operator);
    let now = (s.wall)();
    let tenant = match path {
        Ok(Path(t)) => t,
        Err(e) => {
            let r = Refusal::new(StatusCode::BAD_REQUEST, e.body_text());
            return refuse(&s, &who, new_request_id(now), ENDPOINT, None, r).await;
        }
    };
    if let Err(m) = check_tenant(&tenant) {
        let r = Refusal::key(StatusCode::BAD_REQUEST, "tenant", m);
        return refuse(&s, &who, new_request_id(now), ENDPOINT, None, r).await;
    }
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => {
            let r = Refusal::new(StatusCode::BAD_REQUEST, e.body_text());
            return refuse(&s, &who, new_request_id(now), ENDPOINT, Some(&tenant), r).await;
        }
    };
    let request_id = body
        .request_id
        .clone()
        .unwrap_or_else(|| new_request_id(now));
    let Some(version) = body.version else {
        let r = Refusal::key(
            StatusCode::BAD_REQUEST,
            "version",
            "version: required: the version of the tenant's override you last saw (GET /v1/overrides), 0 for a tenant without one",
        );
        return refuse(&s, &who, request_id, ENDPOINT, Some(&tenant), r).await;
    };
    let expires_at = match expiry(&body, now) {
        Ok(e) => e,
        Err(r) => return refuse(&s, &who, request_id, ENDPOINT, Some(&tenant), r).await,
    };
    let record = Override {
        tenant: tenant.clone(),
        debounce: body.debounce,
        tier: body.tier,
        event_ids: body.event_ids,
        reason: body.reason,
        who: who.clone(),
        set_at: now,
        expires_at,
        version: 0,
        deleted: false,
        request_id: request_id.clone(),
        instance: s.actions.instance.clone(),
    };
    match s
        .overrides
        .write(record, version, wait_of(body.wait_ms))
        .await
    {
        Ok(written) => accepted(&s, "override.set", version, written).await,
        Err(e) => {
            let r = refusal_of(&e, now);
            refuse(&s, &who, request_id, ENDPOINT, Some(&tenant), r).await
        }
    }
}

/// `DELETE /v1/tenants/{tenant}/override?version=N[&reason=...]`: removes the override in
/// force (the config's rule applies again), if `N` is its version.
pub(super) async fn delete(
    State(s): State<AdminState>,
    operator: Option<Extension<Operator>>,
    path: Result<Path<String>, PathRejection>,
    query: Result<Query<DeleteQuery>, QueryRejection>,
) -> Response {
    const ENDPOINT: &str = "DELETE /v1/tenants/{tenant}/override";
    let who = who_of(operator);
    let now = (s.wall)();
    let tenant = match path {
        Ok(Path(t)) => t,
        Err(e) => {
            let r = Refusal::new(StatusCode::BAD_REQUEST, e.body_text());
            return refuse(&s, &who, new_request_id(now), ENDPOINT, None, r).await;
        }
    };
    if let Err(m) = check_tenant(&tenant) {
        let r = Refusal::key(StatusCode::BAD_REQUEST, "tenant", m);
        return refuse(&s, &who, new_request_id(now), ENDPOINT, None, r).await;
    }
    let q = match query {
        Ok(Query(q)) => q,
        Err(e) => {
            let r = Refusal::new(StatusCode::BAD_REQUEST, e.body_text());
            return refuse(&s, &who, new_request_id(now), ENDPOINT, Some(&tenant), r).await;
        }
    };
    let request_id = q.request_id.clone().unwrap_or_else(|| new_request_id(now));
    let Some(version) = q.version else {
        let r = Refusal::key(
            StatusCode::BAD_REQUEST,
            "version",
            "version: required: ?version=N, the version of the override to remove",
        );
        return refuse(&s, &who, request_id, ENDPOINT, Some(&tenant), r).await;
    };
    let tombstone = Override {
        tenant: tenant.clone(),
        debounce: TenantOverride::default(),
        tier: None,
        event_ids: None,
        reason: q.reason.unwrap_or_default(),
        who: who.clone(),
        set_at: now,
        expires_at: None,
        version: 0,
        deleted: true,
        request_id: request_id.clone(),
        instance: s.actions.instance.clone(),
    };
    match s
        .overrides
        .write(tombstone, version, wait_of(q.wait_ms))
        .await
    {
        Ok(written) => accepted(&s, "override.delete", version, written).await,
        Err(e) => {
            let r = refusal_of(&e, now);
            refuse(&s, &who, request_id, ENDPOINT, Some(&tenant), r).await
        }
    }
}

/// `GET /v1/overrides`: every tenant's latest override (in force or not), with the config's
/// rule of the tenant, the rule in force and which wins; the config's per-tenant rules.
pub(super) async fn list(State(s): State<AdminState>) -> Response {
    let now = (s.wall)();
    let set = s.overrides.snapshot();
    let list: Vec<Value> = set
        .entries
        .values()
        .map(|e| {
            let mut v = override_json(&e.record, now);
            if let Some(m) = v.as_object_mut() {
                m.insert("rules".into(), tenant_rules(&s, &e.record.tenant, now));
            }
            v
        })
        .collect();
    let baseline = s.overrides.baseline();
    let mut config_tenants: Vec<(&String, String)> = baseline
        .tenants
        .iter()
        .map(|(t, spec)| (t, spec.to_string()))
        .collect();
    config_tenants.sort();
    if s.overrides.store_name().is_none() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "tenant overrides are off on this instance (no override store)",
        );
    }
    let pinned: Vec<Value> = s
        .tiers
        .pinned
        .iter()
        .map(|(t, tier)| json!({"tenant": t, "tier": tier}))
        .collect();
    Json(json!({
        "store": s.overrides.store_name(),
        "caught_up": set.caught_up,
        "in_force": set.active(now).count(),
        "overrides": list,
        "config": {
            "default": baseline.default.to_string(),
            "tenants": config_tenants.into_iter().map(|(t, r)| json!({"tenant": t, "rule": r})).collect::<Vec<_>>(),
            "pinned": pinned,
        },
        "wins": "an override in force wins over the config for what it sets (its debounce keys, its tier); the config applies again when it is removed or expires",
    }))
    .into_response()
}
