//! Who may call the admin API (SEMANTICS §7 "Actions require a credential; reading can be
//! left open"): named bearer tokens, their roles, and the axum layer that checks every
//! request before any route sees it (the outermost layer of [`super::router`]).
//!
//! * **Tokens** come from `admin.tokens-file` (one per line) and the environment variable
//!   `SETTLE_ADMIN_TOKENS` (comma-separated), both as `NAME:TOKEN` (role `operator`) or
//!   `NAME:read:TOKEN` (role `read`); `#` starts a comment in the file. Only each token's
//!   SHA-256 digest is kept, and a presented token's digest is compared with every one in
//!   constant time (`subtle`), so neither the comparison nor the position of a match tells
//!   an attacker how close a guess was. A token is at least [`MIN_TOKEN_BYTES`] bytes.
//! * **Actions** are every request that is not a read (`GET`, `HEAD`) on a `/v1/` path —
//!   `POST /v1/actions` today, and any route added under `/v1` later (tenant overrides) —
//!   so a new endpoint is protected without naming it here. They need an operator token when
//!   any token is configured; with none configured they are open, which `settle run` allows
//!   on a loopback `admin.listen` only ([`Auth::check_listen`]). `admin.actions = false`
//!   refuses them all. `POST /v1/whoami` needs a token of either role and answers whose it
//!   is.
//! * **Reads** are open unless `admin.protect-reads`; then they need a token of either role.
//! * **The operator page** (`/ui`, [`super::ui`]) follows the same rules: a `/ui` request
//!   without an `Authorization` header presents the token its login cookie keeps, every
//!   request under `/ui/` that is not a read is an action but the What-if form, which only
//!   reads ([`super::ui::is_read_form`]: a read token may run a sweep), and the login form,
//!   logout and the browser files are open ([`super::ui::is_open`]). A refused `/ui` request is answered
//!   with the login page and the reason (same status, count and audit record).
//!
//! A refused request gets 401 (no token, or one that matches none; with `WWW-Authenticate:
//! Bearer`) or 403 (a read token on an action, or actions disabled), a JSON `{"error"}`, a
//! count in `settle_admin_refused_total{reason}` and, for an action, a `refused` record on
//! the audit topic naming who (the token's name, or `anonymous`), what (method and path) and
//! why. A request that passes carries an [`Operator`] extension: who it is, for the
//! handlers' audit records. Tokens never appear in logs, errors, audit records or answers.

use super::{error, AdminState};
use crate::codec::action::{AuditRecord, AuditStage};
use crate::config::admin::{AdminConfig, TOKENS_ENV};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Serialize;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// Shortest token accepted (bytes): a guessable token is refused when it is loaded.
pub const MIN_TOKEN_BYTES: usize = 16;

/// Longest credential name (bytes).
pub const MAX_NAME_BYTES: usize = 64;

/// Who a request that carries no (accepted) token is, in audit records.
pub const ANONYMOUS: &str = "anonymous";

/// Longest `method path` written into a refused request's audit record (bytes).
const MAX_WHAT_BYTES: usize = 256;

/// What a credential may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Everything: reads and actions.
    Operator,
    /// Reads only (with `admin.protect-reads`), and `POST /v1/whoami`.
    Read,
}

impl Role {
    /// `operator` or `read`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Operator => "operator",
            Role::Read => "read",
        }
    }
}

/// Who asked: the name and role of the credential the request carried (SEMANTICS §7 "who
/// asked"). The [`layer`] puts it on every request it lets through as an `axum::Extension`
/// (`anonymous` with the operator role when no token is configured); handlers of actions
/// and overrides write `name` into their audit records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operator {
    /// The credential's name (never the token itself), or [`ANONYMOUS`].
    pub name: String,
    /// What the credential may do.
    pub role: Role,
}

impl Operator {
    fn anonymous() -> Self {
        Operator {
            name: ANONYMOUS.to_owned(),
            role: Role::Operator,
        }
    }
}

/// Why tokens cannot be loaded, or why the admin server may not start with them. Never
/// holds a token.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// `admin.tokens-file` cannot be read.
    #[error("admin.tokens-file: cannot read {}: {source}", path.display())]
    File {
        /// The configured path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An entry is malformed (`origin` is the file and line, or the variable and entry).
    #[error("{origin}: {message}")]
    Entry {
        /// `admin.tokens-file PATH line N` or `SETTLE_ADMIN_TOKENS entry N`.
        origin: String,
        /// What is wrong (without the token).
        message: String,
    },
    /// A configuration the server refuses to start with (the message says what to change).
    #[error("{0}")]
    Refused(String),
}

/// One named token, as its digest.
#[derive(Clone)]
struct Credential {
    name: String,
    role: Role,
    digest: [u8; 32],
}

/// The configured tokens, as SHA-256 digests. `Debug` shows names and roles only.
#[derive(Clone, Default)]
pub struct Credentials {
    entries: Vec<Credential>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

impl Credentials {
    /// Reads `admin.tokens-file` (when set) and [`TOKENS_ENV`] (when set and not empty).
    ///
    /// Errors: the file cannot be read ([`AuthError::File`]), an entry is malformed, a
    /// name or a token appears twice ([`AuthError::Entry`], naming file and line or the
    /// variable and entry number, never the token).
    pub fn load(config: &AdminConfig) -> Result<Self, AuthError> {
        let mut c = Credentials::default();
        if let Some(path) = &config.tokens_file {
            c.add_file(path)?;
        }
        if let Ok(v) = std::env::var(TOKENS_ENV) {
            c.add_list(&v, TOKENS_ENV)?;
        }
        Ok(c)
    }

    /// Adds the entries of a tokens file: one per line, `#` comments, blank lines skipped.
    ///
    /// Errors: as [`Credentials::load`].
    pub fn add_file(&mut self, path: &Path) -> Result<(), AuthError> {
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::File {
            path: path.to_owned(),
            source,
        })?;
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let origin = format!("admin.tokens-file {} line {}", path.display(), i + 1);
            self.add_entry(line, &origin)?;
        }
        Ok(())
    }

    /// Adds comma-separated entries (the form of [`TOKENS_ENV`]); `source` names where they
    /// came from in errors.
    ///
    /// Errors: as [`Credentials::load`].
    pub fn add_list(&mut self, list: &str, source: &str) -> Result<(), AuthError> {
        for (i, entry) in list.split(',').enumerate() {
            let entry = entry.trim();
            if entry.is_empty() {
                continue;
            }
            self.add_entry(entry, &format!("{source} entry {}", i + 1))?;
        }
        Ok(())
    }

    /// Adds one `NAME:TOKEN` or `NAME:read:TOKEN` entry (`NAME:operator:TOKEN` is also
    /// read). A token that itself starts with `read:` or `operator:` must name its role.
    ///
    /// Errors: [`AuthError::Entry`] with `origin`.
    pub fn add_entry(&mut self, entry: &str, origin: &str) -> Result<(), AuthError> {
        let bad = |message: String| AuthError::Entry {
            origin: origin.to_owned(),
            message,
        };
        let Some((name, rest)) = entry.split_once(':') else {
            return Err(bad(
                "expected NAME:TOKEN or NAME:read:TOKEN (no ':' found)".into()
            ));
        };
        let name = name.trim();
        if name.is_empty()
            || name.len() > MAX_NAME_BYTES
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-@".contains(&b))
        {
            return Err(bad(format!(
                "credential name {name:?}: 1-{MAX_NAME_BYTES} bytes of [A-Za-z0-9._@-]"
            )));
        }
        let (role, token) = if let Some(t) = rest.strip_prefix("read:") {
            (Role::Read, t)
        } else if let Some(t) = rest.strip_prefix("operator:") {
            (Role::Operator, t)
        } else {
            (Role::Operator, rest)
        };
        let token = token.trim();
        if token.len() < MIN_TOKEN_BYTES {
            return Err(bad(format!(
                "the token of {name:?} is shorter than {MIN_TOKEN_BYTES} bytes (make one with `openssl rand -hex 32`)"
            )));
        }
        if self.entries.iter().any(|c| c.name == name) {
            return Err(bad(format!("credential name {name:?} appears twice")));
        }
        let digest = digest(token.as_bytes());
        if self
            .entries
            .iter()
            .any(|c| bool::from(c.digest[..].ct_eq(&digest[..])))
        {
            return Err(bad(format!(
                "the token of {name:?} is also another credential's: every name needs its own token"
            )));
        }
        self.entries.push(Credential {
            name: name.to_owned(),
            role,
            digest,
        });
        Ok(())
    }

    /// Whether no token is configured.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The configured names and roles (no secrets: what `check-config` prints).
    pub fn names(&self) -> Vec<(&str, Role)> {
        self.entries
            .iter()
            .map(|c| (c.name.as_str(), c.role))
            .collect()
    }

    /// The credential `token` belongs to, if any: its digest is compared with every
    /// configured digest in constant time, all of them every time.
    pub fn check(&self, token: &str) -> Option<Operator> {
        let presented = digest(token.as_bytes());
        let mut found: Option<&Credential> = None;
        for c in &self.entries {
            if bool::from(c.digest[..].ct_eq(&presented[..])) {
                found = Some(c);
            }
        }
        found.map(|c| Operator {
            name: c.name.clone(),
            role: c.role,
        })
    }
}

/// Why a request was refused: the `reason` label of `settle_admin_refused_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer` header where a token is needed (401).
    MissingToken,
    /// A token that matches no credential (401).
    BadToken,
    /// A read token on an action (403).
    Forbidden,
    /// `admin.actions = false` (403).
    ActionsDisabled,
}

impl Refusal {
    /// `missing_token`, `bad_token`, `forbidden` or `actions_disabled`.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::MissingToken => "missing_token",
            Refusal::BadToken => "bad_token",
            Refusal::Forbidden => "forbidden",
            Refusal::ActionsDisabled => "actions_disabled",
        }
    }

    /// 401 or 403.
    pub fn status(self) -> StatusCode {
        match self {
            Refusal::MissingToken | Refusal::BadToken => StatusCode::UNAUTHORIZED,
            Refusal::Forbidden | Refusal::ActionsDisabled => StatusCode::FORBIDDEN,
        }
    }

    /// What the caller is told.
    pub fn message(self) -> &'static str {
        match self {
            Refusal::MissingToken => {
                "this request needs a token: send `Authorization: Bearer <token>`"
            }
            Refusal::BadToken => "the token matches no configured credential",
            Refusal::Forbidden => "this token has the read role; actions need an operator token",
            Refusal::ActionsDisabled => {
                "actions are disabled on this instance (admin.actions = false)"
            }
        }
    }
}

/// The access rules of one admin server: its tokens, whether actions are on and whether
/// reads are protected. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Auth {
    credentials: Arc<Credentials>,
    actions: bool,
    protect_reads: bool,
}

impl Default for Auth {
    /// No token, actions on, reads open: what a server on a loopback address may run with
    /// (tests, a developer's machine).
    fn default() -> Self {
        Auth::new(Credentials::default(), true, false)
    }
}

/// Whether a request is an action (module docs): not a read, on a `/v1/` path, or on a
/// `/ui/` path other than the open ones (login, logout) and the forms that only read (the
/// What-if sweep: [`super::ui::is_read_form`]).
pub fn is_action(method: &Method, path: &str) -> bool {
    !(method == Method::GET || method == Method::HEAD)
        && (path.starts_with("/v1/")
            || (path.starts_with("/ui/")
                && !super::ui::is_open(method, path)
                && !super::ui::is_read_form(method, path)))
}

/// The path of `POST /v1/whoami`.
pub const WHOAMI: &str = "/v1/whoami";

impl Auth {
    /// Rules from parts.
    pub fn new(credentials: Credentials, actions: bool, protect_reads: bool) -> Self {
        Auth {
            credentials: Arc::new(credentials),
            actions,
            protect_reads,
        }
    }

    /// The rules of `[admin]`, its tokens loaded ([`Credentials::load`]).
    ///
    /// Errors: those of [`Credentials::load`].
    pub fn from_config(config: &AdminConfig) -> Result<Self, AuthError> {
        Ok(Auth::new(
            Credentials::load(config)?,
            config.actions,
            config.protect_reads,
        ))
    }

    /// The configured tokens (names and roles).
    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// Whether actions are accepted (`admin.actions`).
    pub fn actions(&self) -> bool {
        self.actions
    }

    /// Whether reads need a token (`admin.protect-reads`).
    pub fn protect_reads(&self) -> bool {
        self.protect_reads
    }

    /// Whether a server with these rules may listen on `listen`.
    ///
    /// Errors: [`AuthError::Refused`] when actions are on, `listen` is not a loopback
    /// address and no token is configured (anyone who reaches the port could flush or
    /// cancel rounds), or when reads are protected without any token.
    pub fn check_listen(&self, listen: SocketAddr) -> Result<(), AuthError> {
        if !self.credentials.is_empty() {
            return Ok(());
        }
        if self.protect_reads {
            return Err(AuthError::Refused(format!(
                "admin.protect-reads = true but no token is configured: set admin.tokens-file or {TOKENS_ENV}, or admin.protect-reads = false"
            )));
        }
        if self.actions && !listen.ip().is_loopback() {
            return Err(AuthError::Refused(format!(
                "admin.listen = {listen} is not a loopback address and operator actions are on, but no token is configured: set admin.tokens-file (lines NAME:TOKEN) or {TOKENS_ENV} (NAME:TOKEN,...), or turn actions off with admin.actions = false (SETTLE_ADMIN__ACTIONS=false)"
            )));
        }
        Ok(())
    }

    /// Decides one request: who it is, or why it is refused and who asked (the token's
    /// name when it matched one, else [`ANONYMOUS`]). `authorization` is the
    /// `Authorization` header's value.
    pub fn decide(
        &self,
        method: &Method,
        path: &str,
        authorization: Option<&str>,
    ) -> Result<Operator, (Refusal, String)> {
        let action = is_action(method, path);
        let whoami = path == WHOAMI;
        let presented = authorization.and_then(bearer);
        let known = presented.and_then(|t| self.credentials.check(t));
        if super::ui::is_open(method, path) {
            return Ok(known.unwrap_or_else(Operator::anonymous));
        }
        let who = || {
            known
                .as_ref()
                .map_or_else(|| ANONYMOUS.to_owned(), |o| o.name.clone())
        };
        if action && !whoami && !self.actions {
            return Err((Refusal::ActionsDisabled, who()));
        }
        let needs_token = if action {
            !self.credentials.is_empty()
        } else {
            self.protect_reads
        };
        if !needs_token {
            return Ok(known.unwrap_or_else(Operator::anonymous));
        }
        let Some(operator) = known else {
            let refusal = if presented.is_some() {
                Refusal::BadToken
            } else {
                Refusal::MissingToken
            };
            return Err((refusal, ANONYMOUS.to_owned()));
        };
        if action && !whoami && operator.role != Role::Operator {
            return Err((Refusal::Forbidden, operator.name));
        }
        Ok(operator)
    }
}

/// The token of an `Authorization: Bearer TOKEN` value (scheme case-insensitive).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// `method path`, cut to [`MAX_WHAT_BYTES`] at a character boundary.
fn what(method: &Method, path: &str) -> String {
    let mut s = format!("{method} {path}");
    if s.len() > MAX_WHAT_BYTES {
        let mut end = MAX_WHAT_BYTES;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// The axum layer (module docs): lets a request through with its [`Operator`], or refuses
/// it: counted, audited when it is an action, answered 401/403.
pub(super) async fn layer(State(s): State<AdminState>, mut req: Request, next: Next) -> Response {
    let ui = req.uri().path() == "/ui" || req.uri().path().starts_with("/ui/");
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        // The operator page's login cookie stands for the header (module docs).
        .or_else(|| {
            ui.then(|| super::ui::cookie_token(req.headers()))
                .flatten()
                .map(|t| format!("Bearer {t}"))
        });
    let decided = s
        .auth
        .decide(req.method(), req.uri().path(), authorization.as_deref());
    match decided {
        Ok(operator) => {
            req.extensions_mut().insert(operator);
            next.run(req).await
        }
        Err((refusal, who)) => {
            s.metrics.admin_refused(refusal.as_str());
            let path = req.uri().path();
            if is_action(req.method(), path) {
                let now = (s.wall)();
                super::actions::audit(
                    &s,
                    AuditRecord {
                        at: now,
                        instance: s.actions.instance.clone(),
                        who: who.clone(),
                        request_id: super::actions::new_request_id(now),
                        action: what(req.method(), path),
                        stage: AuditStage::Refused,
                        reason: refusal.message().to_owned(),
                        selection: serde_json::Value::Null,
                        result: json!({
                            "status": refusal.status().as_u16(),
                            "refusal": refusal.as_str(),
                        }),
                    },
                )
                .await;
            }
            tracing::debug!(%who, reason = refusal.as_str(), method = %req.method(), path, "admin request refused");
            if ui {
                return super::ui::refused(&s, req.headers(), refusal);
            }
            let mut response = error(refusal.status(), refusal.message());
            if refusal.status() == StatusCode::UNAUTHORIZED {
                let challenge = match refusal {
                    Refusal::BadToken => "Bearer realm=\"settle\", error=\"invalid_token\"",
                    _ => "Bearer realm=\"settle\"",
                };
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static(challenge),
                );
            }
            response
        }
    }
}

/// `POST /v1/whoami`: the caller's credential name and role, and the rules in force.
pub(super) async fn whoami(
    State(s): State<AdminState>,
    operator: Option<Extension<Operator>>,
) -> Response {
    let o = operator.map_or_else(Operator::anonymous, |Extension(o)| o);
    Json(json!({
        "name": o.name,
        "role": o.role.as_str(),
        "actions": s.auth.actions(),
        "protect_reads": s.auth.protect_reads(),
        "tokens_configured": !s.auth.credentials().is_empty(),
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    const OP: &str = "0123456789abcdef-operator";
    const RD: &str = "0123456789abcdef-reader";

    fn creds() -> Credentials {
        let mut c = Credentials::default();
        c.add_list(&format!("alice:{OP}, prom:read:{RD}"), TOKENS_ENV)
            .unwrap();
        c
    }

    #[test]
    fn entries_parse_with_roles_and_errors_never_show_the_token() {
        let c = creds();
        assert_eq!(c.names(), [("alice", Role::Operator), ("prom", Role::Read)]);
        assert_eq!(c.check(OP).unwrap().name, "alice");
        assert_eq!(c.check(RD).unwrap().role, Role::Read);
        assert!(c.check("0123456789abcdef-nobody").is_none());
        assert!(c.check("").is_none());
        assert!(!format!("{c:?}").contains(OP));
        let mut c2 = Credentials::default();
        let secret = "short-secret";
        let e = c2
            .add_entry(&format!("bob:{secret}"), "SETTLE_ADMIN_TOKENS entry 1")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("SETTLE_ADMIN_TOKENS entry 1") && e.contains("16 bytes"),
            "{e}"
        );
        assert!(!e.contains(secret), "{e}");
        let e = c2.add_entry("no-colon", "x").unwrap_err().to_string();
        assert!(e.contains("NAME:TOKEN"), "{e}");
        let e = c2
            .add_entry(&format!("bad name:{OP}"), "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("credential name"), "{e}");
        let mut dup = creds();
        let e = dup
            .add_entry(&format!("alice:{RD}x"), "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("twice"), "{e}");
        let e = dup
            .add_entry(&format!("carol:{OP}"), "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("another credential") && !e.contains(OP), "{e}");
    }

    #[test]
    fn a_tokens_file_has_comments_and_names_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(
            &path,
            format!("# operators\n\nalice:{OP}\nprom:read:{RD}\nbroken\n"),
        )
        .unwrap();
        let mut c = Credentials::default();
        let e = c.add_file(&path).unwrap_err().to_string();
        assert!(
            e.contains("line 5") && e.contains("admin.tokens-file"),
            "{e}"
        );
        assert_eq!(c.names().len(), 2);
        let e = Credentials::default()
            .add_file(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("admin.tokens-file") && e.contains("missing"),
            "{e}"
        );
    }

    #[test]
    fn decisions_by_role_method_and_settings() {
        let post = Method::POST;
        let get = Method::GET;
        let bearer_op = format!("Bearer {OP}");
        let bearer_rd = format!("bearer {RD}");
        let auth = Auth::new(creds(), true, false);
        let refused = |r: Result<Operator, (Refusal, String)>| r.unwrap_err();
        assert_eq!(
            refused(auth.decide(&post, "/v1/actions", None)),
            (Refusal::MissingToken, ANONYMOUS.into())
        );
        assert_eq!(
            refused(auth.decide(&post, "/v1/actions", Some("Bearer 0123456789abcdef-wrong"))).0,
            Refusal::BadToken
        );
        assert_eq!(
            refused(auth.decide(&post, "/v1/actions", Some("Basic abc"))).0,
            Refusal::MissingToken
        );
        assert_eq!(
            refused(auth.decide(&post, "/v1/actions", Some(&bearer_rd))),
            (Refusal::Forbidden, "prom".into())
        );
        // Any non-read under /v1 is an action, routes added later included.
        assert_eq!(
            refused(auth.decide(&Method::PUT, "/v1/tenants/acme/override", Some(&bearer_rd))).0,
            Refusal::Forbidden
        );
        assert_eq!(
            refused(auth.decide(&Method::DELETE, "/v1/tenants/acme/override", None)).0,
            Refusal::MissingToken
        );
        assert_eq!(
            auth.decide(&post, "/v1/actions", Some(&bearer_op))
                .unwrap()
                .name,
            "alice"
        );
        assert_eq!(
            auth.decide(&post, WHOAMI, Some(&bearer_rd)).unwrap().role,
            Role::Read
        );
        // Reads open by default, protected on demand.
        assert!(auth.decide(&get, "/metrics", None).is_ok());
        assert!(auth.decide(&get, "/v1/pending", None).is_ok());
        let protected = Auth::new(creds(), true, true);
        assert_eq!(
            refused(protected.decide(&get, "/metrics", None)).0,
            Refusal::MissingToken
        );
        assert!(protected
            .decide(&get, "/v1/pending", Some(&bearer_rd))
            .is_ok());
        // Actions off: refused whoever asks, but whoami still answers.
        let off = Auth::new(creds(), false, false);
        assert_eq!(
            refused(off.decide(&post, "/v1/actions", Some(&bearer_op))),
            (Refusal::ActionsDisabled, "alice".into())
        );
        assert!(off.decide(&post, WHOAMI, Some(&bearer_op)).is_ok());
        // The operator page: its forms are actions, its login and files are open.
        assert_eq!(
            refused(auth.decide(&post, "/ui/actions", Some(&bearer_rd))).0,
            Refusal::Forbidden
        );
        assert_eq!(
            refused(auth.decide(&post, "/ui/tenants/acme/override", None)).0,
            Refusal::MissingToken
        );
        assert!(auth.decide(&post, "/ui/actions", Some(&bearer_op)).is_ok());
        assert!(auth.decide(&get, "/ui/pending", None).is_ok());
        // The What-if form only reads: a read token runs it, nothing without protect-reads.
        assert!(auth.decide(&post, "/ui/whatif", Some(&bearer_rd)).is_ok());
        assert!(auth.decide(&post, "/ui/whatif", None).is_ok());
        assert_eq!(
            refused(protected.decide(&get, "/ui/pending", None)).0,
            Refusal::MissingToken
        );
        assert!(protected.decide(&post, "/ui/login", None).is_ok());
        assert!(protected.decide(&get, "/ui/assets/ui.css", None).is_ok());
        assert_eq!(
            refused(off.decide(&post, "/ui/actions", Some(&bearer_op))).0,
            Refusal::ActionsDisabled
        );
        assert!(off.decide(&post, "/ui/whatif", Some(&bearer_rd)).is_ok());
        assert_eq!(
            refused(protected.decide(&post, "/ui/whatif", None)).0,
            Refusal::MissingToken
        );
        // No token configured: actions open, as anonymous.
        let open = Auth::default();
        assert_eq!(
            open.decide(&post, "/v1/actions", None).unwrap().name,
            ANONYMOUS
        );
    }

    #[test]
    fn start_refused_on_a_public_address_without_a_token() {
        let public: SocketAddr = "0.0.0.0:9464".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:9464".parse().unwrap();
        let e = Auth::default()
            .check_listen(public)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("admin.tokens-file")
                && e.contains(TOKENS_ENV)
                && e.contains("admin.actions = false"),
            "{e}"
        );
        assert!(Auth::default().check_listen(local).is_ok());
        assert!(Auth::default()
            .check_listen("[::1]:9464".parse().unwrap())
            .is_ok());
        assert!(Auth::new(Credentials::default(), false, false)
            .check_listen(public)
            .is_ok());
        assert!(Auth::new(creds(), true, false).check_listen(public).is_ok());
        let e = Auth::new(Credentials::default(), false, true)
            .check_listen(local)
            .unwrap_err()
            .to_string();
        assert!(e.contains("admin.protect-reads"), "{e}");
    }
}
