//! The pending-work views of the admin API (issue "operate it by hand", SEMANTICS §7):
//! `GET /v1/pending` lists the open rounds of the partitions this process owns, a page at a
//! time; `GET /v1/pending/summary` counts them by tier and by due bucket. Both are asked of
//! the partition tasks in bounded slices ([`crate::runtime::pending`]).
//!
//! Query parameters (all optional; an unknown one is refused with 400):
//!
//! | parameter | meaning |
//! |---|---|
//! | `tenant` | only this tenant's sessions |
//! | `partition` | only these input partitions, comma-separated (`0,3`) |
//! | `policy` | only rounds timed by this policy (`fixed`, `leading-trailing`, `adaptive`) |
//! | `tier` | only tenants in this tier, as the router routes them now |
//! | `due_before`, `due_after` | only rounds due before (exclusive) / at or after: RFC 3339 or epoch ms |
//! | `min_uploads` | only rounds with at least this many uploads |
//! | `limit` | rounds per page, 1–1000 (default 100); `/v1/pending` only |
//! | `cursor` | the `next_cursor` of the previous page; `/v1/pending` only |
//!
//! Every answer says which partitions it covered (`partitions`), which are owned here but
//! still opening or restoring their store (`restoring`: their rounds cannot be read yet)
//! and which could not answer (`unavailable`). Another instance answers for the partitions
//! it owns.

use super::{error, rfc3339, AdminState};
use crate::codec::action::SessionFilter;
use crate::codec::{parse_timestamp, validate_tenant};
use crate::engine::Millis;
use crate::runtime::pending::{Cursor, PendingRound, DUE_BUCKETS};
use crate::runtime::PartitionState;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// Rounds per page when `limit` is not given.
pub const DEFAULT_LIMIT: usize = 100;

/// Largest `limit`.
pub const MAX_LIMIT: usize = 1000;

/// A request's parameters, checked.
struct Params {
    filter: SessionFilter,
    limit: usize,
    cursor: Option<Cursor>,
}

/// Parses the query parameters (module docs). `paged`: `limit` and `cursor` are allowed.
///
/// Errors: the text names the parameter and what is wrong (answered with 400).
fn params(s: &AdminState, q: &BTreeMap<String, String>, paged: bool) -> Result<Params, String> {
    let mut p = Params {
        filter: SessionFilter::default(),
        limit: DEFAULT_LIMIT,
        cursor: None,
    };
    let time = |name: &str, v: &str| -> Result<Millis, String> {
        let json = match v.parse::<i64>() {
            Ok(ms) => Value::from(ms),
            Err(_) => Value::from(v),
        };
        parse_timestamp(&json).map_err(|e| format!("{name}: {e} (RFC 3339 or epoch ms)"))
    };
    for (k, v) in q {
        match k.as_str() {
            "tenant" => {
                validate_tenant(v).map_err(|e| format!("tenant {v:?}: {e}"))?;
                p.filter.tenant = Some(v.clone());
            }
            "partition" => {
                let list = v
                    .split(',')
                    .map(|x| x.trim().parse::<i32>().ok().filter(|p| *p >= 0))
                    .collect::<Option<Vec<i32>>>()
                    .ok_or_else(|| {
                        format!("partition {v:?}: a comma-separated list of partition numbers ≥ 0")
                    })?;
                p.filter.partitions = Some(list);
            }
            "policy" => p.filter.policy = Some(v.parse().map_err(|e| format!("policy: {e}"))?),
            "tier" => {
                let known: Vec<&str> = s.router.tiers().tiers().map(|(name, _)| name).collect();
                if !known.contains(&v.as_str()) {
                    return Err(format!(
                        "tier {v:?}: unknown; the tiers are {}",
                        known.join(", ")
                    ));
                }
                p.filter.tier = Some(v.clone());
            }
            "due_before" => p.filter.due_before = Some(time(k, v)?),
            "due_after" => p.filter.due_after = Some(time(k, v)?),
            "min_uploads" => {
                p.filter.min_uploads = Some(
                    v.parse()
                        .map_err(|_| format!("min_uploads {v:?}: a whole number ≥ 0"))?,
                )
            }
            "limit" if paged => {
                p.limit = v
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_LIMIT).contains(n))
                    .ok_or_else(|| format!("limit {v:?}: a whole number from 1 to {MAX_LIMIT}"))?
            }
            "cursor" if paged => {
                p.cursor = Some(Cursor::decode(v).map_err(|e| format!("cursor: {e}"))?)
            }
            other => {
                let allowed = if paged {
                    "tenant, partition, policy, tier, due_before, due_after, min_uploads, limit, cursor"
                } else {
                    "tenant, partition, policy, tier, due_before, due_after, min_uploads"
                };
                return Err(format!(
                    "unknown parameter {other:?}; the parameters are {allowed}"
                ));
            }
        }
    }
    p.filter.validate()?;
    Ok(p)
}

/// Owned partitions still opening or restoring their store (not answering yet).
fn restoring(s: &AdminState) -> Vec<i32> {
    s.status
        .snapshot()
        .values()
        .filter(|p| {
            matches!(
                p.state,
                PartitionState::Starting | PartitionState::Restoring
            )
        })
        .map(|p| p.partition)
        .collect()
}

fn unavailable_json(list: &[(i32, String)]) -> Vec<Value> {
    list.iter()
        .map(|(p, e)| json!({ "partition": p, "error": e }))
        .collect()
}

fn round_json(r: &PendingRound, tier: &str) -> Value {
    json!({
        "key": r.key.as_str(),
        "tenant": r.key.tenant(),
        "session": r.key.session(),
        "partition": r.partition,
        "policy": r.policy.as_str(),
        "tier": tier,
        "uploads": r.uploads,
        "first_upload_at": r.first_upload_at.map(rfc3339),
        "last_upload_at": r.last_upload_at.map(rfc3339),
        "due_at": rfc3339(r.due),
        "deadline_at": rfc3339(r.deadline),
        "max_wait_at": r.max_wait_at.map(rfc3339),
        "delay_ms": r.delay,
        "waiting": r.waiting.as_str(),
    })
}

type QueryParams = Result<Query<BTreeMap<String, String>>, QueryRejection>;

/// `GET /v1/pending`: one page of open rounds (module docs).
pub(super) async fn list(State(s): State<AdminState>, q: QueryParams) -> Response {
    let q = match q {
        Ok(Query(q)) => q,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let p = match params(&s, &q, true) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let router = s.router.clone();
    let page = s
        .sessions
        .pending(p.filter, p.cursor, p.limit, |tenant| {
            router.lock().tier_of(tenant).to_owned()
        })
        .await;
    let rounds: Vec<Value> = page.rows.iter().map(|(r, t)| round_json(r, t)).collect();
    Json(json!({
        "partitions": page.partitions,
        "restoring": restoring(&s),
        "unavailable": unavailable_json(&page.unavailable),
        "rounds": rounds,
        "next_cursor": page.next.map(|c| c.encode()),
    }))
    .into_response()
}

fn buckets_json(b: &[u64; 5]) -> Value {
    let mut m = Map::new();
    for (name, n) in DUE_BUCKETS.iter().zip(b) {
        m.insert((*name).to_owned(), Value::from(*n));
    }
    Value::Object(m)
}

/// `GET /v1/pending/summary`: open rounds by tier and by due bucket (module docs).
pub(super) async fn summary(State(s): State<AdminState>, q: QueryParams) -> Response {
    let q = match q {
        Ok(Query(q)) => q,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let p = match params(&s, &q, false) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let tier_filter = p.filter.tier.clone();
    let sum = s.sessions.pending_summary(p.filter).await;
    // Tenants grouped by the tier the router routes them to now.
    let mut by_tier: BTreeMap<String, ([u64; 5], u64)> = BTreeMap::new();
    let (mut total, mut uploads, mut by_due) = (0u64, 0u64, [0u64; 5]);
    {
        let router = s.router.lock();
        for (tenant, c) in &sum.tenants {
            let tier = router.tier_of(tenant);
            if tier_filter.as_deref().is_some_and(|t| t != tier) {
                continue;
            }
            let e = by_tier.entry(tier.to_owned()).or_default();
            for (i, r) in c.rounds.iter().enumerate().take(5) {
                e.0[i] += r;
                by_due[i] += r;
            }
            e.1 += c.uploads;
            total += c.rounds.iter().sum::<u64>();
            uploads += c.uploads;
        }
    }
    let status = s.status.snapshot();
    let covered: Vec<i32> = sum.partitions.iter().map(|(p, _)| *p).collect();
    let owed: u64 = status
        .values()
        .filter(|p| covered.contains(&p.partition))
        .map(|p| p.outbox_len)
        .sum();
    let tiers: Map<String, Value> = by_tier
        .iter()
        .map(|(t, (b, u))| {
            (
                t.clone(),
                json!({ "rounds": b.iter().sum::<u64>(), "uploads": u, "due": buckets_json(b) }),
            )
        })
        .collect();
    Json(json!({
        "partitions": sum.partitions.iter().map(|(p, t)| json!({ "partition": p, "partition_time": rfc3339(*t) })).collect::<Vec<_>>(),
        "restoring": restoring(&s),
        "unavailable": unavailable_json(&sum.unavailable),
        "rounds": total,
        "uploads": uploads,
        "by_due": buckets_json(&by_due),
        "by_tier": tiers,
        "tenants": sum.tenants.len(),
        "owed": owed,
        "truncated": sum.truncated,
    }))
    .into_response()
}
