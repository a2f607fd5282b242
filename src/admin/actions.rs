//! Operator actions of the admin API (SEMANTICS §7): `POST /v1/actions` flushes or cancels
//! one session's open round, or every round a filter selects (bulk), with a dry run;
//! `GET /v1/actions/{request_id}` says what became of a request.
//!
//! The instance that accepts a request does not act itself: it produces an action record
//! (`codec::action`) to the input partition that holds the session (NATS), or to every
//! input partition (Kafka: producers' partitioners differ, so the partition that holds the
//! key applies it and the others answer `no_state`), audits the acceptance, and waits up to
//! `wait_ms` for each partition's owner to report its outcome on the audit topic. Complete:
//! 200 with every outcome; otherwise 202 with those known so far and the request id to look
//! up. A request retried with the same `request_id` acts once.
//!
//! Request body (JSON; unknown fields refused):
//!
//! | field | meaning |
//! |---|---|
//! | `kind` | `flush` or `cancel` (required) |
//! | `session` | `tenant/session`: a session action; exactly one of `session` and `filter` |
//! | `filter` | a bulk action's selection: `tenant`, `partitions`, `policy`, `tier`, `due_before`, `due_after` (epoch ms), `min_uploads` |
//! | `dry_run` | only count what would be done (default false) |
//! | `limit` | bulk: most sessions per partition (default 10 000, at most 100 000); `more` in an outcome says there were more |
//! | `reason` | why (≤ 1024 bytes), for the audit topic |
//! | `request_id` | idempotency key (≤ 128 bytes); generated when absent |
//! | `wait_ms` | how long to wait for the outcomes (default 5 000, at most 60 000) |
//!
//! A body that breaks a rule gets 400 naming the field (415 without `Content-Type:
//! application/json`), and a `refused` audit record; nothing is sent.
//!
//! `GET /v1/audit` lists the latest audit records this instance knows (its own and those
//! the audit tail read back), newest first.

use super::{error, rfc3339, AdminState, Operator};
use crate::codec::action::{
    ActionKind, ActionOutcome, ActionRecord, AuditRecord, AuditStage, SessionFilter, BULK_LIMIT_MAX,
};
use crate::engine::Millis;
use crate::runtime::actions::RECENT_AUDIT;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;

/// Default wait for the outcomes (ms).
pub const DEFAULT_WAIT_MS: u64 = 5_000;

/// Longest wait for the outcomes (ms).
pub const MAX_WAIT_MS: u64 = 60_000;

/// `POST /v1/actions` body (module docs).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionRequest {
    kind: ActionKind,
    #[serde(default)]
    session: Option<String>,
    #[serde(default)]
    filter: Option<SessionFilter>,
    #[serde(default)]
    dry_run: bool,
    #[serde(default)]
    limit: Option<u32>,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    wait_ms: Option<u64>,
}

/// A request id for a request that had none: time and randomness, unique enough.
pub(super) fn new_request_id(now: Millis) -> String {
    format!("r-{now:x}-{:08x}", rand::random::<u32>())
}

/// Publishes `record` to the audit topic (when the admin has a channel) and logs it here.
pub(super) async fn audit(s: &AdminState, record: AuditRecord) {
    s.actions.add(record.clone());
    if let Some(channel) = &s.channel {
        if let Err(e) = channel
            .publish_audit(&record.request_id, record.encode())
            .await
        {
            tracing::warn!(request_id = %record.request_id, error = %e, "audit record not published");
        }
    }
}

fn outcome_json(o: &ActionOutcome) -> Value {
    let mut v = serde_json::to_value(o).unwrap_or_default();
    if let Some(m) = v.as_object_mut() {
        m.insert("applied_at".into(), Value::from(rfc3339(o.applied_at)));
    }
    v
}

/// The answer for `request_id`: its outcomes, what they add up to, which partitions have
/// not answered.
fn answer(
    request_id: &str,
    record: &ActionRecord,
    targets: &[i32],
    outcomes: &[ActionOutcome],
) -> Response {
    let waiting: Vec<i32> = targets
        .iter()
        .copied()
        .filter(|p| !outcomes.iter().any(|o| o.partition == *p))
        .collect();
    let complete = waiting.is_empty();
    let sessions: u64 = outcomes.iter().map(|o| o.sessions).sum();
    let uploads: u64 = outcomes.iter().map(|o| o.uploads).sum();
    // A session action: the partition that holds the key says what happened.
    let result = if record.session.is_some() {
        outcomes
            .iter()
            .map(|o| o.result.as_str())
            .find(|r| *r != "no_state")
            .unwrap_or(if complete { "no_state" } else { "in_flight" })
    } else if complete {
        if record.dry_run {
            "would_do"
        } else {
            "done"
        }
    } else {
        "in_flight"
    };
    let body = json!({
        "request_id": request_id,
        "kind": record.kind.as_str(),
        "dry_run": record.dry_run,
        "session": record.session,
        "filter": record.filter,
        "result": result,
        "complete": complete,
        "sessions": sessions,
        "uploads": uploads,
        "more": outcomes.iter().any(|o| o.more),
        "duplicate": outcomes.iter().any(|o| o.duplicate),
        "partitions": targets,
        "waiting_for": waiting,
        "outcomes": outcomes.iter().map(outcome_json).collect::<Vec<_>>(),
    });
    let code = if complete {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    (code, Json(body)).into_response()
}

/// `POST /v1/actions` (module docs).
pub(super) async fn post(
    State(s): State<AdminState>,
    operator: Option<Extension<Operator>>,
    body: Result<Json<ActionRequest>, JsonRejection>,
) -> Response {
    let who = operator.map_or_else(|| super::auth::ANONYMOUS.to_owned(), |Extension(o)| o.name);
    let now = (s.wall)();
    let refuse = |code: StatusCode, why: String, request_id: String| {
        let s = s.clone();
        let who = who.clone();
        async move {
            audit(
                &s,
                AuditRecord {
                    at: now,
                    instance: s.actions.instance.clone(),
                    who,
                    request_id,
                    action: "POST /v1/actions".into(),
                    stage: AuditStage::Refused,
                    reason: why.clone(),
                    selection: Value::Null,
                    result: json!({ "status": code.as_u16() }),
                },
            )
            .await;
            error(code, why)
        }
    };
    let req = match body {
        Ok(Json(r)) => r,
        // 400 for a body that is not the JSON above (the text names the field), 415
        // without `Content-Type: application/json`.
        Err(e) => {
            let code = match e.status() {
                StatusCode::UNSUPPORTED_MEDIA_TYPE => StatusCode::UNSUPPORTED_MEDIA_TYPE,
                _ => StatusCode::BAD_REQUEST,
            };
            return refuse(code, e.body_text(), new_request_id(now)).await;
        }
    };
    let request_id = req
        .request_id
        .clone()
        .unwrap_or_else(|| new_request_id(now));
    let Some(channel) = s.channel.clone() else {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "actions are not available on this instance: it has no action channel to the input"
                .into(),
            request_id,
        )
        .await;
    };
    let record = ActionRecord {
        request_id: request_id.clone(),
        kind: req.kind,
        dry_run: req.dry_run,
        session: req.session,
        filter: req.filter,
        limit: req.limit,
        reason: req.reason,
        who: who.clone(),
        instance: s.actions.instance.clone(),
        requested_at: now,
    };
    if let Err(e) = record.validate() {
        return refuse(StatusCode::BAD_REQUEST, e.to_string(), request_id).await;
    }
    if let Some(limit) = req.limit {
        if record.session.is_some() {
            return refuse(
                StatusCode::BAD_REQUEST,
                "limit: only a bulk action (filter) takes a limit".into(),
                request_id,
            )
            .await;
        }
        if !(1..=BULK_LIMIT_MAX).contains(&limit) {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!("limit {limit}: sessions per partition, 1 to {BULK_LIMIT_MAX}"),
                request_id,
            )
            .await;
        }
    }
    if req.wait_ms.is_some_and(|w| w > MAX_WAIT_MS) {
        return refuse(
            StatusCode::BAD_REQUEST,
            format!("wait_ms: at most {MAX_WAIT_MS} (ms)"),
            request_id,
        )
        .await;
    }
    if let Some(tier) = record.filter.as_ref().and_then(|f| f.tier.as_ref()) {
        if s.router.tiers().topic_of(tier).is_none() {
            let known: Vec<&str> = s.router.tiers().tiers().map(|(n, _)| n).collect();
            return refuse(
                StatusCode::BAD_REQUEST,
                format!(
                    "filter.tier {tier:?}: unknown; the tiers are {}",
                    known.join(", ")
                ),
                request_id,
            )
            .await;
        }
    }
    let partitions = match channel.partitions().await {
        Ok(n) => n,
        Err(e) => {
            return refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("cannot read the input's partitions: {e}"),
                request_id,
            )
            .await
        }
    };
    let mut targets: Vec<i32> = match record.session_key() {
        Some(key) => match channel.key_partition(key.as_str()) {
            Some(p) => vec![p],
            None => (0..partitions).collect(),
        },
        None => (0..partitions).collect(),
    };
    if let Some(ps) = record.filter.as_ref().and_then(|f| f.partitions.as_ref()) {
        if let Some(p) = ps.iter().find(|p| **p >= partitions) {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!("filter.partitions: partition {p} does not exist (the input has {partitions}: 0 to {})", partitions - 1),
                request_id,
            )
            .await;
        }
        targets.retain(|p| ps.contains(p));
    }
    let wait = Duration::from_millis(req.wait_ms.unwrap_or(DEFAULT_WAIT_MS).min(MAX_WAIT_MS));
    let selection =
        json!({ "session": record.session, "filter": record.filter, "partitions": targets });
    // A retry of a request this instance (or the audit tail) already saw: not sent again.
    let seen = s
        .actions
        .get(&request_id)
        .iter()
        .any(|r| r.stage == AuditStage::Accepted);
    if !seen {
        audit(
            &s,
            AuditRecord {
                at: now,
                instance: s.actions.instance.clone(),
                who: who.clone(),
                request_id: request_id.clone(),
                action: record.kind.as_str().into(),
                stage: AuditStage::Accepted,
                reason: record.reason.clone(),
                selection,
                result: json!({ "dry_run": record.dry_run }),
            },
        )
        .await;
        let payload = record.encode();
        let key = record.record_key();
        for p in &targets {
            if let Err(e) = channel.send(*p, &key, payload.clone(), now).await {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("request {request_id}: the action record could not be sent to partition {p}: {e} (partitions before it have it and will apply it; retry with the same request_id)"),
                );
            }
        }
    }
    let n = targets.len();
    let outcomes = s
        .actions
        .wait(&request_id, wait, |o| {
            o.iter().filter(|o| targets.contains(&o.partition)).count() >= n
        })
        .await;
    answer(&request_id, &record, &targets, &outcomes)
}

/// `GET /v1/actions/{request_id}`: the audit records known here for the request.
pub(super) async fn get(
    State(s): State<AdminState>,
    path: Result<Path<String>, PathRejection>,
) -> Response {
    let id = match path {
        Ok(Path(id)) => id,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let records = s.actions.get(&id);
    if records.is_empty() {
        return error(
            StatusCode::NOT_FOUND,
            format!("request {id} is not known here (this instance keeps the last {} request ids it saw)", crate::runtime::actions::RECENT_REQUESTS),
        );
    }
    let outcomes = s.actions.outcomes(&id);
    Json(json!({
        "request_id": id,
        "records": records,
        "outcomes": outcomes.iter().map(outcome_json).collect::<Vec<_>>(),
    }))
    .into_response()
}

/// Records `GET /v1/audit` answers when `limit` is not given.
pub const AUDIT_DEFAULT_LIMIT: usize = 50;

/// `GET /v1/audit` query (module docs of `crate::admin`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    stage: Option<AuditStage>,
}

/// `GET /v1/audit?limit=N&stage=S`: the latest audit records known here, newest first.
pub(super) async fn audit_tail(
    State(s): State<AdminState>,
    query: Result<Query<AuditQuery>, QueryRejection>,
) -> Response {
    let q = match query {
        Ok(Query(q)) => q,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!(
                "{} (the parameters are limit, 1 to {}, and stage: accepted, refused or applied)",
                e.body_text(),
                RECENT_AUDIT
            ),
            )
        }
    };
    let limit = q.limit.unwrap_or(AUDIT_DEFAULT_LIMIT);
    if !(1..=RECENT_AUDIT).contains(&limit) {
        return error(
            StatusCode::BAD_REQUEST,
            format!("limit {limit}: 1 to {RECENT_AUDIT}"),
        );
    }
    let records = s.actions.latest(limit, q.stage);
    Json(json!({
        "instance": s.actions.instance,
        "topic": s.actions.topic,
        "records": records,
    }))
    .into_response()
}
