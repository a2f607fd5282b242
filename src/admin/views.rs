//! The read-only views of `settle run`'s admin API: `/v1/partitions`, `/v1/tenants/{tenant}`,
//! `/v1/sessions/{tenant}/{session}`, `/v1/shadow` (JSON; see the table in `crate::admin`).

use super::{error, rfc3339, AdminState, SESSION_LOOKUP_TIMEOUT};
use crate::codec::{validate_session, validate_tenant};
use crate::engine::{Figures, Millis, SessionKey, TenantClass, TierFigures, LIVE};
use crate::runtime::{Lookup, PartitionState, PartitionStatus, SessionView};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

fn partition_json(s: &PartitionStatus, now: Millis) -> Value {
    let started = !matches!(
        s.state,
        PartitionState::Starting | PartitionState::Restoring
    );
    json!({
        "topic": s.topic,
        "partition": s.partition,
        "state": s.state.as_str(),
        "error": match &s.state { PartitionState::Failed(r) => Some(r.as_str()), _ => None },
        "next_offset": s.next_offset,
        "lag": s.lag,
        "caught_up": s.caught_up,
        "partition_time": started.then(|| rfc3339(s.partition_time)),
        "clock_behind_ms": started.then(|| now.saturating_sub(s.partition_time).max(0)),
        "pending_rounds": s.pending_rounds,
        "outbox": s.outbox_len,
        "next_due": s.next_due.map(rfc3339),
        "records": s.records,
        "restore_remaining": s.restore_remaining,
        "restored": s.restored,
        "catch_up_from": s.catch_up_from,
        "progress": progress(s),
        "dead_letters": s.dead_letters,
        "emissions": s.emissions,
        "published": s.published,
    })
}

/// How far the partition is (0.0–1.0) in what it does now: the restore (records replayed
/// over replayed + left) while restoring, the catch-up (input lag closed since the first lag
/// it reported) while catching up, 1.0 when live; `None` before either is known.
fn progress(s: &PartitionStatus) -> Option<f64> {
    match s.state {
        PartitionState::Restoring => {
            let total = s.restored + s.restore_remaining;
            (total > 0).then(|| s.restored as f64 / total as f64)
        }
        PartitionState::CatchingUp => match (s.catch_up_from, s.lag) {
            (Some(from), Some(lag)) if from > 0 => Some(1.0 - (lag.min(from) as f64 / from as f64)),
            (Some(_), Some(_)) => Some(1.0),
            _ => None,
        },
        PartitionState::Live => Some(1.0),
        _ => None,
    }
}

pub(super) async fn partitions(State(s): State<AdminState>) -> Response {
    let now = (s.wall)();
    let list: Vec<Value> = s
        .status
        .snapshot()
        .values()
        .filter(|p| p.state != PartitionState::Stopped)
        .map(|p| partition_json(p, now))
        .collect();
    Json(json!({ "partitions": list })).into_response()
}

fn tier_figures_json(t: &TierFigures) -> Value {
    let p = t.time_to_ready.percentiles();
    json!({
        "emissions": t.emissions,
        "uploads": t.uploads,
        "uploads_per_emission": t.uploads_per_emission(),
        "time_to_ready_ms": { "p50": p.p50, "p99": p.p99 },
    })
}

/// One policy's figures: `total`, `classes` (per tenant class, all tiers) and `tiers` (per
/// tier name, each with its own `classes`), SEMANTICS §8 "per tier and tenant class".
fn figures_json(f: &Figures, tiers: &[&str]) -> Value {
    let classes = |of: &dyn Fn(TenantClass) -> TierFigures| -> serde_json::Map<String, Value> {
        TenantClass::ALL
            .iter()
            .map(|&c| (c.name().to_owned(), tier_figures_json(&of(c))))
            .collect()
    };
    let by_tier: serde_json::Map<String, Value> = tiers
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut v = tier_figures_json(&f.tier(i));
            v["classes"] = Value::Object(classes(&|c| f.cell(i, c)));
            ((*name).to_owned(), v)
        })
        .collect();
    json!({
        "total": tier_figures_json(&f.total()),
        "classes": classes(&|c| f.class(c)),
        "tiers": by_tier,
    })
}

/// `GET /v1/shadow` (SEMANTICS §8): the live policy's figures and each `[[shadow]]` policy's,
/// side by side, added up over the partitions owned here, with the time they start from.
pub(super) async fn shadow(State(s): State<AdminState>) -> Response {
    let snap = s.shadows.snapshot();
    let tiers: Vec<&str> = s.router.tiers().tiers().map(|(name, _)| name).collect();
    let rules = s.overrides.rules_in_force();
    let mut policies = vec![json!({
        "name": LIVE,
        "rule": rules.default.to_string(),
        "tenant_rules": rules.tenants.len(),
        "figures": figures_json(&snap.live, &tiers),
    })];
    for (spec, f) in &snap.shadows {
        policies.push(json!({
            "name": spec.name,
            "rule": spec.policy.to_string(),
            "max_sessions": spec.max_sessions,
            "sessions": f.sessions,
            "refused_sessions": f.refused_sessions,
            "refused_uploads": f.refused_uploads,
            "figures": figures_json(f, &tiers),
        }));
    }
    Json(json!({
        "configured": !s.shadows.is_empty(),
        "since": snap.since().map(rfc3339),
        "partitions": snap.partitions.iter().map(|(p, since)| json!({
            "partition": p,
            "since": rfc3339(*since),
        })).collect::<Vec<_>>(),
        "tiers": tiers,
        "time_to_ready": "due_at - last_upload_at, ms: as settle tune computes it",
        "classes": "default: the live policy times the tenant with [debounce]; own: the tenant has a rule of its own (config or override)",
        "policies": if s.shadows.is_empty() { Vec::new() } else { policies },
    }))
    .into_response()
}

/// The tenant of a path, or why it is not one (answered with 400).
pub(super) fn tenant_of(path: Result<Path<String>, PathRejection>) -> Result<String, String> {
    let Path(tenant) = path.map_err(|e| e.body_text())?;
    check_tenant(&tenant)?;
    Ok(tenant)
}

pub(super) fn check_tenant(tenant: &str) -> Result<(), String> {
    validate_tenant(tenant).map_err(|e| {
        format!("invalid tenant {tenant:?}: {e} (SEMANTICS §2: 1-128 bytes of [A-Za-z0-9._:-])")
    })
}

pub(super) async fn tenant(
    State(s): State<AdminState>,
    path: Result<Path<String>, PathRejection>,
) -> Response {
    let tenant = match tenant_of(path) {
        Ok(t) => t,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let now = (s.wall)();
    let (tier, rate, demoted) = {
        let router = s.router.lock();
        let demoted = router.demoted(now).into_iter().find(|d| d.tenant == tenant);
        (
            router.tier_of(&tenant).to_owned(),
            router.rate_of(&tenant, now),
            demoted,
        )
    };
    let table = s.router.tiers();
    let pinned = s.router.lock().pinned(&tenant).is_some();
    Json(json!({
        "tenant": tenant,
        "tier": tier,
        "topic": table.topic_of(&tier),
        "pinned": pinned,
        "rules": super::overrides::tenant_rules(&s, &tenant, now),
        "rate": rate,
        "limit": s.tiers.limit,
        "period_ms": u64::try_from(s.tiers.period.as_millis()).unwrap_or(u64::MAX),
        "demoted": demoted.map(|d| json!({
            "since": rfc3339(d.since),
            "recovers_at": rfc3339(d.recovers_at),
        })),
    }))
    .into_response()
}

fn session_json(key: &SessionKey, v: &SessionView) -> Value {
    let st = &v.state;
    json!({
        "tenant": key.tenant(),
        "session": key.session(),
        "topic": v.topic,
        "partition": v.partition,
        "policy": v.policy.as_str(),
        "generation": st.generation,
        "last_upload_at": rfc3339(st.last_upload_at),
        "last_event_id": st.last_applied_event_id,
        "call_track": st.track.map(|t| json!({
            "time": rfc3339(t.time),
            "delay_ms": t.delay,
        })),
        "round": st.round.as_ref().map(|r| json!({
            "start": rfc3339(r.start),
            "deadline": rfc3339(r.deadline),
            "max_wait_at": r.max_wait_at.map(rfc3339),
            "delay_ms": r.delay,
            "uploads": r.uploads,
            "first_upload_at": r.first_upload_at.map(rfc3339),
            "last_upload_at": r.last_upload_at.map(rfc3339),
            "last_event_id": r.last_event_id,
            "parts": r.parts,
            "event_ids": r.event_ids.as_ref().map(|ids| ids.iter().collect::<Vec<_>>()),
            "event_ids_dropped": r.event_ids.as_ref().map(|ids| ids.dropped()),
        })),
        "next_due": rfc3339(v.next_due),
        "next_due_is": if st.round.is_some() { "round_due" } else { "state_expiry" },
    })
}

pub(super) async fn session(
    State(s): State<AdminState>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let (tenant, session) = match path {
        Ok(Path(p)) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    if let Err(message) = check_tenant(&tenant) {
        return error(StatusCode::BAD_REQUEST, message);
    }
    if let Err(e) = validate_session(&session) {
        return error(
            StatusCode::BAD_REQUEST,
            format!("invalid session: {e} (SEMANTICS §2: 1-256 bytes of UTF-8 without control characters)"),
        );
    }
    let key = SessionKey::new(&tenant, &session);
    match s.sessions.find(&key, SESSION_LOOKUP_TIMEOUT).await {
        Lookup::Found(view) => Json(session_json(&key, &view)).into_response(),
        Lookup::NotFound { asked } => error(
            StatusCode::NOT_FOUND,
            format!("session {key} has no state in the {asked} partition(s) owned here"),
        ),
        Lookup::Unavailable { errors } => {
            let detail: Vec<String> = errors
                .iter()
                .map(|(p, e)| format!("partition {p}: {e}"))
                .collect();
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "session {key} not found, and some partitions could not answer: {}",
                    detail.join("; ")
                ),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_the_restore_then_the_catch_up() {
        let mut s = PartitionStatus::starting("in", 0);
        assert_eq!(progress(&s), None);
        s.state = PartitionState::Restoring;
        assert_eq!(progress(&s), None, "nothing known yet");
        s.restored = 300;
        s.restore_remaining = 100;
        assert_eq!(progress(&s), Some(0.75));
        s.state = PartitionState::CatchingUp;
        s.catch_up_from = Some(1_000);
        s.lag = Some(250);
        assert_eq!(progress(&s), Some(0.75));
        // A lag that grew past its start is no progress, not a negative one.
        s.lag = Some(5_000);
        assert_eq!(progress(&s), Some(0.0));
        s.catch_up_from = Some(0);
        assert_eq!(progress(&s), Some(1.0));
        s.state = PartitionState::Live;
        assert_eq!(progress(&s), Some(1.0));
    }
}
