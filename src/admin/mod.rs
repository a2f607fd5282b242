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

mod views;

use crate::codec::format_rfc3339_ms;
use crate::engine::Millis;
use crate::metrics::Metrics;
use crate::runtime::{
    Clock, PartitionState, PartitionStatus, Runtime, SessionLookup, StatusBoard, StatusMap,
};
use crate::tiers::{SharedRouter, TiersConfig};
use crate::transport::Sink;
use anyhow::Context as _;
use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Json;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Longest wait for the partition tasks to answer a session query.
pub const SESSION_LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a stopping server waits for open connections before it is aborted.
const STOP_GRACE: Duration = Duration::from_secs(1);

/// Who asked for an action: the name of the credential the request carried (SEMANTICS §7
/// "who asked"). The authentication layer puts it on every authenticated request as an
/// `axum::Extension`; handlers of actions and overrides write it into their audit records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operator {
    /// The credential's name (`admin.tokens`), never the token itself.
    pub name: String,
}

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
        .route("/v1/partitions", get(views::partitions))
        .route("/v1/tenants/{tenant}", get(views::tenant))
        // A session may contain `/` (SEMANTICS §2): the rest of the path is the session.
        .route("/v1/sessions/{tenant}/{*session}", get(views::session))
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

pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

pub(crate) fn rfc3339(ms: Millis) -> String {
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
