//! The admin HTTP server of `settle run` (axum): metrics, health, readiness and read-only
//! views of the partitions, tenants and sessions this process owns. Loopback by default
//! (`[admin] listen = "127.0.0.1:9464"`); nothing here changes state.
//!
//! | endpoint | answer |
//! |---|---|
//! | `GET /metrics` | every metric of `crate::metrics`, Prometheus text format; gauges refreshed from the status board and the tier router at each scrape |
//! | `GET /healthz` | 200 while the process serves HTTP (liveness) |
//! | `GET /readyz` | 200 when at least one partition is assigned and every owned partition has its store open and is not restoring (catching up or live); 503 otherwise, with the reason |
//! | `GET /v1/partitions` | owned partitions: state, next offset, lag, partition time and how far behind the wall clock it is, pending rounds, outbox, next due time, counters |
//! | `GET /v1/tenants/{tenant}` | the tenant's tier and its topic, pinned or not, measured rate (emissions in the last `tiers.period`) against `tiers.limit`, demotion (SEMANTICS §5) |
//! | `GET /v1/sessions/{tenant}/{session}` | the session's CallTrack, open round and next due time, asked of the partition task that holds it (SEMANTICS §4); 404 when no partition owned here holds it |
//!
//! Errors are JSON `{"error": "..."}`: 400 for a path segment that is not a valid tenant or
//! session (SEMANTICS §2) or not UTF-8, 404 for an unknown path or session, 503 when a
//! partition could not answer. Times are RFC 3339 with milliseconds (as in the output
//! records), durations are milliseconds (`*_ms`).

pub use crate::config::admin::{AdminConfig, DEFAULT_LISTEN};

use crate::codec::{format_rfc3339_ms, validate_session, validate_tenant};
use crate::engine::{Millis, SessionKey};
use crate::metrics::Metrics;
use crate::runtime::{
    Clock, Lookup, PartitionState, PartitionStatus, Runtime, SessionLookup, SessionView,
    StatusBoard, StatusMap,
};
use crate::tiers::{SharedRouter, TiersConfig};
use crate::transport::Sink;
use anyhow::Context as _;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Json;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Longest wait for the partition tasks to answer a session query.
pub const SESSION_LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a stopping server waits for open connections before it is aborted.
const STOP_GRACE: Duration = Duration::from_secs(1);

/// What the handlers read: handles shared with one runtime. Cheap to clone.
#[derive(Clone)]
pub struct AdminState {
    status: StatusBoard,
    router: SharedRouter,
    metrics: Metrics,
    sessions: SessionLookup,
    tiers: Arc<TiersConfig>,
    /// The runtime's wall clock (ms since the epoch).
    wall: Arc<dyn Fn() -> Millis + Send + Sync>,
}

impl AdminState {
    /// The handles of `runtime` (take them before `Runtime::run` consumes it).
    pub fn new<K: Sink, C: Clock>(runtime: &Runtime<K, C>) -> Self {
        let clock = runtime.clock();
        AdminState {
            status: runtime.status(),
            router: runtime.router(),
            metrics: runtime.metrics(),
            sessions: runtime.sessions(),
            tiers: Arc::new(runtime.options().tiers.clone()),
            wall: Arc::new(move || clock.now_ms()),
        }
    }
}

/// The routes, for [`AdminServer`] or a test.
pub fn router(state: AdminState) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/partitions", get(partitions))
        .route("/v1/tenants/{tenant}", get(tenant))
        // A session may contain `/` (SEMANTICS §2): the rest of the path is the session.
        .route("/v1/sessions/{tenant}/{*session}", get(session))
        .fallback(not_found)
        .with_state(state)
}

/// A running admin server.
#[derive(Debug)]
pub struct AdminServer {
    addr: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl AdminServer {
    /// Binds `listen` and serves [`router`] on it until [`AdminServer::stop`].
    ///
    /// Errors: the address cannot be bound (in use, not local, no permission).
    pub async fn start(listen: SocketAddr, state: AdminState) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let shutdown = stop.clone();
        let app = router(state);
        let task = tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { shutdown.cancelled().await })
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "admin server stopped");
            }
        });
        tracing::info!(%addr, "admin server listening: /metrics /healthz /readyz /v1/partitions /v1/tenants/{{tenant}} /v1/sessions/{{tenant}}/{{session}}");
        Ok(AdminServer { addr, stop, task })
    }

    /// Starts the server of `runtime` when `config.enabled`.
    ///
    /// Errors: `config.listen` cannot be bound (the message names `admin.listen`).
    pub async fn start_for<K: Sink, C: Clock>(
        config: &AdminConfig,
        runtime: &Runtime<K, C>,
    ) -> anyhow::Result<Option<Self>> {
        if !config.enabled {
            return Ok(None);
        }
        let server = Self::start(config.listen, AdminState::new(runtime))
            .await
            .with_context(|| format!("admin.listen: cannot listen on {}", config.listen))?;
        Ok(Some(server))
    }

    /// The address it listens on (the bound port when `listen` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets open requests finish (at most one second), stops.
    pub async fn stop(self) {
        self.stop.cancel();
        let abort = self.task.abort_handle();
        if tokio::time::timeout(STOP_GRACE, self.task).await.is_err() {
            abort.abort();
        }
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

fn rfc3339(ms: Millis) -> String {
    format_rfc3339_ms(ms)
}

async fn not_found(uri: Uri) -> Response {
    error(
        StatusCode::NOT_FOUND,
        format!("no such endpoint: {}", uri.path()),
    )
}

async fn metrics(State(s): State<AdminState>) -> Response {
    let counters = s.router.lock().counters();
    let now = (s.wall)();
    let status = s.status.snapshot();
    s.metrics
        .refresh(status.values().map(|p| p.gauges(now)), &counters);
    (
        [(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
        s.metrics.encode(),
    )
        .into_response()
}

async fn healthz() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

/// Whether the process is ready (see the module docs): `Ok(owned partitions)`, or why not.
/// Partitions in state `stopped` (revoked or shut down) are not owned.
pub fn readiness(status: &StatusMap) -> Result<usize, String> {
    let owned: Vec<&PartitionStatus> = status
        .values()
        .filter(|s| s.state != PartitionState::Stopped)
        .collect();
    if owned.is_empty() {
        return Err("no partition assigned".to_owned());
    }
    for s in &owned {
        match &s.state {
            PartitionState::Starting => {
                return Err(format!("partition {} is opening its store", s.partition))
            }
            PartitionState::Restoring => {
                return Err(format!(
                    "partition {} is restoring its store from the changelog ({} records left)",
                    s.partition, s.restore_remaining
                ))
            }
            PartitionState::Stopping => {
                return Err(format!("partition {} is stopping", s.partition))
            }
            PartitionState::Failed(reason) => {
                return Err(format!("partition {} failed: {reason}", s.partition))
            }
            PartitionState::CatchingUp | PartitionState::Live | PartitionState::Stopped => {}
        }
    }
    Ok(owned.len())
}

async fn readyz(State(s): State<AdminState>) -> Response {
    match readiness(&s.status.snapshot()) {
        Ok(n) => Json(json!({ "ready": true, "partitions": n })).into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "ready": false, "reason": reason })),
        )
            .into_response(),
    }
}

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
        "dead_letters": s.dead_letters,
        "emissions": s.emissions,
        "published": s.published,
    })
}

async fn partitions(State(s): State<AdminState>) -> Response {
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

/// The tenant of a path, or why it is not one (answered with 400).
fn tenant_of(path: Result<Path<String>, PathRejection>) -> Result<String, String> {
    let Path(tenant) = path.map_err(|e| e.body_text())?;
    check_tenant(&tenant)?;
    Ok(tenant)
}

fn check_tenant(tenant: &str) -> Result<(), String> {
    validate_tenant(tenant).map_err(|e| {
        format!("invalid tenant {tenant:?}: {e} (SEMANTICS §2: 1-128 bytes of [A-Za-z0-9._:-])")
    })
}

async fn tenant(
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
    Json(json!({
        "tenant": tenant,
        "tier": tier,
        "topic": table.topic_of(&tier),
        "pinned": table.pinned(&tenant).is_some(),
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
        })),
        "next_due": rfc3339(v.next_due),
        "next_due_is": if st.round.is_some() { "round_due" } else { "state_expiry" },
    })
}

async fn session(
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
    fn ready_only_when_every_owned_partition_has_its_store_open() {
        let mut m = StatusMap::new();
        assert!(readiness(&m).unwrap_err().contains("no partition"));
        m.insert(0, PartitionStatus::starting("t", 0));
        assert!(readiness(&m).unwrap_err().contains("opening"));
        m.get_mut(&0).unwrap().state = PartitionState::CatchingUp;
        let mut revoked = PartitionStatus::starting("t", 1);
        revoked.state = PartitionState::Stopped;
        m.insert(1, revoked);
        assert_eq!(readiness(&m), Ok(1));
        m.get_mut(&0).unwrap().state = PartitionState::Failed("disk".into());
        assert!(readiness(&m).unwrap_err().contains("disk"));
    }

    #[test]
    fn config_defaults_to_loopback() {
        let c = AdminConfig::default();
        assert!(c.enabled);
        assert!(c.listen.ip().is_loopback());
        assert_eq!(c.listen.port(), 9464);
    }
}
