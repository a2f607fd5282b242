//! The admin HTTP server of `settle run` (axum): metrics, health, readiness and read-only
//! views of the partitions, tenants, sessions and pending rounds this process owns, and
//! operator actions (SEMANTICS §7). Loopback by default (`[admin] listen =
//! "127.0.0.1:9464"`); only requests that are not reads on `/v1/` change state: `POST
//! /v1/actions` (through the input: the partitions' owners apply it) and the tenant override
//! routes (through the override store: every instance applies it). Every request first
//! passes the [`auth`] layer (tokens, roles, `admin.actions`, `admin.protect-reads`); the
//! listener speaks TLS when `admin.tls-cert-file` is set ([`tls`]).
//!
//! | endpoint | answer |
//! |---|---|
//! | `GET /metrics` | every metric of `crate::metrics`, Prometheus text format; gauges refreshed from the status board, the tier router and the shadow policies at each scrape |
//! | `GET /healthz` | 200 while the process serves HTTP (liveness) |
//! | `GET /readyz` | 200 when at least one partition is assigned and every owned partition has its store open and is not restoring (catching up or live); 503 otherwise, with the reason |
//! | `GET /v1/partitions` | owned partitions: state, next offset, lag, partition time and how far behind the wall clock it is, pending rounds, outbox, next due time, counters, and `progress` (0.0–1.0) of the restore (`restored` of `restored + restore_remaining`) or the catch-up (`lag` closed since `catch_up_from`) |
//! | `GET /v1/tenants/{tenant}` | the tenant's tier and its topic, pinned or not, measured rate (emissions in the last `tiers.period`) against `tiers.limit`, demotion (SEMANTICS §5) |
//! | `GET /v1/pending` | open rounds of the partitions owned here, a page at a time, with filters (tenant, partition, policy, tier, due time, uploads) and a cursor: key, partition, policy, tier, uploads, first/last upload, due time, max-wait bound, delay, why it waits (`pending` module) |
//! | `GET /v1/pending/summary` | open rounds (and their uploads) by tier and by due bucket, owed emissions, partitions covered |
//! | `POST /v1/actions` | flush or cancel one session's open round, or every round a filter selects, with a dry run; answers each partition owner's outcome (`actions` module, SEMANTICS §7) |
//! | `GET /v1/actions/{request_id}` | the audit records and outcomes known here of one request |
//! | `PUT /v1/tenants/{tenant}/override` | sets the tenant's override (policy and parameters, max-wait, pinned tier, event ids; reason, expiry), naming the version it replaces: 200 once applied here, 202 while in flight, 400 naming the key, 409 with the current one when stale (`overrides` module, SEMANTICS §7) |
//! | `DELETE /v1/tenants/{tenant}/override?version=N` | removes it: the config's rule applies again |
//! | `GET /v1/overrides` | every tenant's override (version, expiry, in force or not), the config's rule of each tenant and which wins |
//! | `GET /v1/audit?limit=N&stage=S` | the latest audit records known here (written here or read back from the audit topic), newest first: `limit` 1–1000 (default 50), `stage` `accepted`, `refused` or `applied` |
//! | `POST /v1/whoami` | the caller's credential name and role (needs a token of either role when tokens are configured), and whether actions are on and reads protected |
//! | `GET /v1/shadow` | the `[[shadow]]` policies beside the live one (SEMANTICS §8): per policy, tier and tenant class (`default`, `own`: `engine::TenantClass`), emissions (would-be, for a shadow), uploads per emission, time-to-ready p50/p99 (`due_at − last_upload_at`, ms, as `settle tune` has it); each shadow's sessions held and refused within `runtime.shadow-max-sessions`; when the figures start (`since`, per partition: they start empty at each assignment) |
//! | `GET /v1/sessions/{tenant}/{session}` | the session's CallTrack, open round and next due time, asked of the partition task that holds it (SEMANTICS §4); 404 when no partition owned here holds it |
//! | `/ui`, `/ui/...` | the operator page: HTML views of the above, login, flush/cancel and override forms, the What-if sweep ([`ui`], [`whatif`]) |
//!
//! Errors are JSON `{"error": "..."}`: 400 for a path segment that is not a valid tenant or
//! session (SEMANTICS §2) or not UTF-8, or a bad parameter or body (the message names it),
//! 401/403 from the [`auth`] layer, 404 for an unknown path or session, 405 for a method a
//! path does not take, 503 when a partition could not answer. Times are RFC 3339 with
//! milliseconds (as in the output records), durations are milliseconds (`*_ms`).

pub use crate::config::admin::{AdminConfig, DEFAULT_LISTEN};

mod actions;
pub mod auth;
mod overrides;
mod pending;
pub mod tls;
pub mod ui;
mod views;
pub mod whatif;

pub use auth::{Auth, Operator, Role};
pub use whatif::{WhatIf, WhatIfFactory};

use crate::codec::format_rfc3339_ms;
use crate::engine::Millis;
use crate::metrics::Metrics;
use crate::runtime::{
    ActionLog, Clock, Overrides, PartitionState, PartitionStatus, Runtime, SessionLookup,
    ShadowBoard, StatusBoard, StatusMap,
};
use crate::tiers::{SharedRouter, TiersConfig};
use crate::transport::{ActionChannel, Sink};
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
    /// Operator actions' audit records known here (the runtime's log).
    actions: ActionLog,
    /// Where action records and audit records go; `None`: actions are refused (503).
    channel: Option<Arc<dyn ActionChannel>>,
    /// The runtime's tenant overrides (SEMANTICS §7).
    overrides: Overrides,
    /// Who may call what ([`auth`]).
    auth: Auth,
    /// The shadow policies' figures (SEMANTICS §8).
    shadows: ShadowBoard,
    /// Whether the listener speaks TLS (the operator page's cookie is then `Secure`).
    tls: bool,
    /// `store.data-dir`: the operator page reads the tier-events task's `tiers.json` there
    /// (a tenant's latest tier changes).
    data_dir: Arc<std::path::Path>,
    /// Replays the input's last minutes for the What-if view (`POST /ui/whatif`); `None`:
    /// the view only says how to run `settle tune`.
    whatif: Option<Arc<dyn WhatIf>>,
    /// The sweep running in this process, if any (one at a time).
    sweeps: whatif::SweepSlot,
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
            actions: runtime.actions(),
            channel: None,
            overrides: runtime.overrides(),
            auth: Auth::default(),
            shadows: runtime.shadows(),
            tls: false,
            data_dir: Arc::from(runtime.options().data_dir.as_path()),
            whatif: None,
            sweeps: whatif::SweepSlot::default(),
        }
    }

    /// Checks every request with `auth` (default: no token, actions on, reads open).
    pub fn with_auth(mut self, auth: Auth) -> Self {
        self.auth = auth;
        self
    }

    /// Accepts operator actions (`POST /v1/actions`), sending their records and audit
    /// records through `channel` (SEMANTICS §7).
    pub fn with_action_channel(mut self, channel: Arc<dyn ActionChannel>) -> Self {
        self.channel = Some(channel);
        self
    }

    /// Lets the What-if view run sweeps with `whatif`: the last 1 to
    /// [`whatif::MAX_MINUTES`] minutes of the input (at most [`whatif::MAX_UPLOADS`]
    /// uploads) replayed under `settle tune`'s settings, one sweep at a time per process.
    pub fn with_whatif(mut self, whatif: Arc<dyn WhatIf>) -> Self {
        self.whatif = Some(whatif);
        self
    }
}

/// The routes, for [`AdminServer`] or a test, behind the [`auth`] layer (the outermost: it
/// sees every request, the unknown paths' too).
pub fn router(state: AdminState) -> axum::Router {
    let checked = axum::middleware::from_fn_with_state(state.clone(), auth::layer);
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/partitions", get(views::partitions))
        .route("/v1/tenants/{tenant}", get(views::tenant))
        .route(
            "/v1/tenants/{tenant}/override",
            axum::routing::put(overrides::put).delete(overrides::delete),
        )
        .route("/v1/overrides", get(overrides::list))
        .route("/v1/shadow", get(views::shadow))
        .route("/v1/pending", get(pending::list))
        .route("/v1/pending/summary", get(pending::summary))
        .route("/v1/actions", axum::routing::post(actions::post))
        .route("/v1/actions/{request_id}", get(actions::get))
        .route("/v1/audit", get(actions::audit_tail))
        .route(auth::WHOAMI, axum::routing::post(auth::whoami))
        // A session may contain `/` (SEMANTICS §2): the rest of the path is the session.
        .route("/v1/sessions/{tenant}/{*session}", get(views::session))
        .merge(ui::routes())
        .fallback(not_found)
        .with_state(state)
        .layer(checked)
}

/// What `settle run` will serve with `config`, checked before anything starts: the tokens
/// loaded, the listen address allowed for them ([`Auth::check_listen`]) and the TLS files
/// read. `None` when the admin server is disabled.
///
/// Errors: as [`AdminServer::start_for`] but for binding the address; each message names
/// the key.
pub fn preflight(config: &AdminConfig) -> anyhow::Result<Option<Auth>> {
    if !config.enabled {
        return Ok(None);
    }
    let auth = Auth::from_config(config)?;
    auth.check_listen(config.listen)?;
    if let (Some(cert), Some(key)) = (&config.tls_cert_file, &config.tls_key_file) {
        tls::server_config(cert, key)?;
    }
    Ok(Some(auth))
}

/// A running admin server.
#[derive(Debug)]
pub struct AdminServer {
    addr: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl AdminServer {
    /// Binds `listen` and serves [`router`] on it, plain HTTP, until [`AdminServer::stop`].
    ///
    /// Errors: the state's [`Auth`] may not listen there ([`Auth::check_listen`]: actions on
    /// a non-loopback address without a token), or the address cannot be bound (in use,
    /// not local, no permission).
    pub async fn start(listen: SocketAddr, state: AdminState) -> anyhow::Result<Self> {
        Self::start_with(listen, state, None).await
    }

    /// [`AdminServer::start`], serving HTTPS with `tls` when given ([`tls::server_config`]).
    ///
    /// Errors: as [`AdminServer::start`].
    pub async fn start_with(
        listen: SocketAddr,
        mut state: AdminState,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> anyhow::Result<Self> {
        state.auth.check_listen(listen)?;
        state.tls = tls.is_some();
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("admin.listen: cannot listen on {listen}"))?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let shutdown = stop.clone();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let (tokens, actions, protect_reads) = (
            state.auth.credentials().names().len(),
            state.auth.actions(),
            state.auth.protect_reads(),
        );
        let app = router(state);
        let task = match tls {
            None => serve(listener, app, shutdown),
            Some(config) => serve(tls::TlsListener::new(listener, config)?, app, shutdown),
        };
        tracing::info!(%addr, scheme, tokens, actions, protect_reads, "admin server listening: /metrics /healthz /readyz /v1/partitions /v1/pending /v1/pending/summary /v1/actions /v1/audit /v1/whoami /v1/tenants/{{tenant}} /v1/tenants/{{tenant}}/override /v1/overrides /v1/shadow /v1/sessions/{{tenant}}/{{session}} /ui");
        Ok(AdminServer { addr, stop, task })
    }

    /// Starts the server of `runtime` when `config.enabled`, with the tokens and rules of
    /// `config` ([`Auth::from_config`]) and its TLS files; operator actions go through
    /// `actions` (none: `POST /v1/actions` answers 503), the What-if view's sweeps through
    /// `whatif` (none: the view only says how to run `settle tune`).
    ///
    /// Errors: the tokens or TLS files cannot be read or are invalid, actions are on at a
    /// non-loopback `admin.listen` without a token, or `admin.listen` cannot be bound; each
    /// message names the key.
    pub async fn start_for<K: Sink, C: Clock>(
        config: &AdminConfig,
        runtime: &Runtime<K, C>,
        actions: Option<Arc<dyn ActionChannel>>,
        whatif: Option<Arc<dyn WhatIf>>,
    ) -> anyhow::Result<Option<Self>> {
        if !config.enabled {
            return Ok(None);
        }
        let mut state = AdminState::new(runtime).with_auth(Auth::from_config(config)?);
        if let Some(channel) = actions {
            state = state.with_action_channel(channel);
        }
        if let Some(whatif) = whatif {
            state = state.with_whatif(whatif);
        }
        let tls = match (&config.tls_cert_file, &config.tls_key_file) {
            (Some(cert), Some(key)) => Some(tls::server_config(cert, key)?),
            _ => None,
        };
        Ok(Some(Self::start_with(config.listen, state, tls).await?))
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

/// Serves `app` on `listener` until `shutdown` (graceful: open requests finish).
fn serve<L>(listener: L, app: axum::Router, shutdown: CancellationToken) -> JoinHandle<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "admin server stopped");
        }
    })
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
    if !s.shadows.is_empty() {
        let snap = s.shadows.snapshot();
        let tiers: Vec<&str> = s.router.tiers().tiers().map(|(name, _)| name).collect();
        let live = std::iter::once((crate::engine::LIVE, &snap.live));
        let shadows = snap.shadows.iter().map(|(spec, f)| (spec.name.as_str(), f));
        s.metrics
            .refresh_shadows(&tiers, live.chain(shadows), snap.since());
    }
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
        assert!(c.enabled && c.actions && !c.protect_reads);
        assert!(c.listen.ip().is_loopback());
        assert_eq!(c.listen.port(), 9464);
    }
}
