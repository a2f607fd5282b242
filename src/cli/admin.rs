//! `settle admin <command>`: a running instance's admin API from the command line
//! (SEMANTICS §7): who am I, its partitions, pending work, flush and cancel, the audit
//! trail. Human output by default (aligned tables), the API's JSON answer as is with
//! `--json`.
//!
//! The URL comes from `--url` or `SETTLE_ADMIN_URL` (default `http://127.0.0.1:9464`, the
//! default `admin.listen`); the bearer token from `--token-file` (its first non-empty line)
//! or `SETTLE_ADMIN_TOKEN` (never a flag: a command line is visible to every user of the
//! machine); `--ca-file` verifies an HTTPS server whose certificate the system does not
//! know. Errors say what to do: the server unreachable, a missing or refused token (401,
//! 403), a 4xx with the API's message.
//!
//! A new command (tenant overrides: `settle admin override ...`) is a variant of
//! [`AdminCommand`], a request through [`Client`] (`get`, `send` with any method) and a
//! printer for its answer.

use crate::codec::parse_timestamp;
use crate::engine::Millis;
use anyhow::{anyhow, bail, Context as _};
use serde_json::{json, Map, Value};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

/// Default `--url`: the default `admin.listen`.
pub const DEFAULT_URL: &str = "http://127.0.0.1:9464";

/// Environment variable of the bearer token.
pub const TOKEN_ENV: &str = "SETTLE_ADMIN_TOKEN";

/// How long a request may take beyond the action's own wait.
const REQUEST_SLACK: Duration = Duration::from_secs(15);

/// `settle admin`: where the API is, how to authenticate, the command.
#[derive(Clone, Debug, clap::Args)]
pub struct AdminArgs {
    /// Admin API of a running settle (its `admin.listen`, with https:// when it has TLS).
    #[arg(long, global = true, env = "SETTLE_ADMIN_URL", default_value = DEFAULT_URL, help_heading = "Admin API")]
    pub url: String,
    /// File whose first line is the bearer token (else SETTLE_ADMIN_TOKEN).
    #[arg(long, global = true, value_name = "FILE", help_heading = "Admin API")]
    pub token_file: Option<PathBuf>,
    /// PEM certificates to verify an https:// admin server with (else the public roots).
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        env = "SETTLE_ADMIN_CA_FILE",
        help_heading = "Admin API"
    )]
    pub ca_file: Option<PathBuf>,
    /// Print the API's JSON answer as is.
    #[arg(long, global = true, help_heading = "Admin API")]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: AdminCommand,
}

/// The commands of `settle admin`.
#[derive(Clone, Debug, clap::Subcommand)]
pub enum AdminCommand {
    /// The name and role of the token in use, and whether actions are on.
    Whoami,
    /// The partitions the instance owns: state, offsets, lag, pending rounds, outbox.
    Partitions,
    /// Open rounds of the partitions the instance owns (one page), or with --summary their
    /// counts by tier and due time.
    Pending(PendingArgs),
    /// Emit open rounds now (trigger = manual): one session, or every round a filter selects.
    Flush(ActionArgs),
    /// Close open rounds without an emission (their uploads are dropped): one session, or
    /// every round a filter selects.
    Cancel(ActionArgs),
    /// The latest audit records the instance knows (its own and the deployment's audit
    /// topic), newest first.
    Audit(AuditArgs),
    /// Tenant overrides (SEMANTICS §7): list them, set one, remove one.
    #[command(subcommand)]
    Override(OverrideCommand),
}

/// `settle admin override ...`.
#[derive(Clone, Debug, clap::Subcommand)]
pub enum OverrideCommand {
    /// Every tenant's override (version, expiry, in force or not) and which rule wins.
    List,
    /// Set a tenant's override: the debounce keys given (others come from the config's rule
    /// of the tenant), a pinned tier, an expiry.
    Set(OverrideSetArgs),
    /// Remove a tenant's override: the config's rule applies again.
    Remove(OverrideRemoveArgs),
}

/// `settle admin override set`.
#[derive(Clone, Debug, clap::Args)]
pub struct OverrideSetArgs {
    /// The tenant.
    pub tenant: String,
    /// The version you last saw (`override list`); 0 for a tenant without an override. A
    /// stale one is refused (409) with the current override.
    #[arg(long)]
    pub version: u64,
    /// Policy: fixed, leading-trailing or adaptive.
    #[arg(long)]
    pub policy: Option<String>,
    /// Delay of fixed and leading-trailing, e.g. 2m.
    #[arg(long, value_name = "DURATION")]
    pub delay: Option<String>,
    /// Smallest delay of adaptive.
    #[arg(long, value_name = "DURATION")]
    pub min_delay: Option<String>,
    /// Largest delay of adaptive.
    #[arg(long, value_name = "DURATION")]
    pub max_delay: Option<String>,
    /// Max-wait: a duration, or `off` for none.
    #[arg(long, value_name = "DURATION|off")]
    pub max_wait: Option<String>,
    /// Event ids each ready record of the tenant lists (`event-ids`, SEMANTICS §2; 0 to
    /// 100 000, 0: none).
    #[arg(long, value_name = "N")]
    pub event_ids: Option<u32>,
    /// Pin the tenant to this tier (automatic demotion does not move it).
    #[arg(long)]
    pub tier: Option<String>,
    /// The override ends after this long, e.g. 72h.
    #[arg(long, value_name = "DURATION", conflicts_with = "expires_at")]
    pub expires_in: Option<String>,
    /// The override ends at this time (RFC 3339).
    #[arg(long, value_name = "TIME")]
    pub expires_at: Option<String>,
    /// Why (goes to the audit topic with your credential's name).
    #[arg(long, required = true)]
    pub reason: String,
}

/// `settle admin override remove`.
#[derive(Clone, Debug, clap::Args)]
pub struct OverrideRemoveArgs {
    /// The tenant.
    pub tenant: String,
    /// The version you last saw (`override list`).
    #[arg(long)]
    pub version: u64,
    /// Why (goes to the audit topic with your credential's name).
    #[arg(long, required = true)]
    pub reason: String,
}

/// Selection of rounds (`GET /v1/pending` parameters, a bulk action's filter).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct FilterArgs {
    /// Only this tenant's sessions.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only these input partitions (comma-separated: 0,3).
    #[arg(long, value_delimiter = ',', value_name = "P")]
    pub partition: Vec<i32>,
    /// Only rounds timed by this policy (fixed, leading-trailing, adaptive).
    #[arg(long)]
    pub policy: Option<String>,
    /// Only tenants in this tier.
    #[arg(long)]
    pub tier: Option<String>,
    /// Only rounds due before this time (RFC 3339 or epoch ms).
    #[arg(long, value_name = "TIME")]
    pub due_before: Option<String>,
    /// Only rounds due at or after this time (RFC 3339 or epoch ms).
    #[arg(long, value_name = "TIME")]
    pub due_after: Option<String>,
    /// Only rounds with at least this many uploads.
    #[arg(long, value_name = "N")]
    pub min_uploads: Option<u32>,
}

impl FilterArgs {
    fn is_empty(&self) -> bool {
        self.tenant.is_none()
            && self.partition.is_empty()
            && self.policy.is_none()
            && self.tier.is_none()
            && self.due_before.is_none()
            && self.due_after.is_none()
            && self.min_uploads.is_none()
    }

    /// As query parameters of `/v1/pending`.
    fn query(&self) -> Vec<(&'static str, String)> {
        let mut q = Vec::new();
        if let Some(t) = &self.tenant {
            q.push(("tenant", t.clone()));
        }
        if !self.partition.is_empty() {
            let list: Vec<String> = self.partition.iter().map(i32::to_string).collect();
            q.push(("partition", list.join(",")));
        }
        if let Some(p) = &self.policy {
            q.push(("policy", p.clone()));
        }
        if let Some(t) = &self.tier {
            q.push(("tier", t.clone()));
        }
        if let Some(t) = &self.due_before {
            q.push(("due_before", t.clone()));
        }
        if let Some(t) = &self.due_after {
            q.push(("due_after", t.clone()));
        }
        if let Some(n) = self.min_uploads {
            q.push(("min_uploads", n.to_string()));
        }
        q
    }

    /// As the `filter` of `POST /v1/actions` (times in epoch ms).
    ///
    /// Errors: a time that is neither RFC 3339 nor epoch ms (the flag named).
    fn body(&self) -> anyhow::Result<Value> {
        let time = |flag: &str, v: &str| -> anyhow::Result<Millis> {
            let j = v
                .parse::<i64>()
                .map_or_else(|_| Value::from(v), Value::from);
            parse_timestamp(&j).map_err(|e| anyhow!("--{flag} {v:?}: {e} (RFC 3339 or epoch ms)"))
        };
        let mut f = Map::new();
        if let Some(t) = &self.tenant {
            f.insert("tenant".into(), json!(t));
        }
        if !self.partition.is_empty() {
            f.insert("partitions".into(), json!(self.partition));
        }
        if let Some(p) = &self.policy {
            f.insert("policy".into(), json!(p));
        }
        if let Some(t) = &self.tier {
            f.insert("tier".into(), json!(t));
        }
        if let Some(t) = &self.due_before {
            f.insert("due_before".into(), json!(time("due-before", t)?));
        }
        if let Some(t) = &self.due_after {
            f.insert("due_after".into(), json!(time("due-after", t)?));
        }
        if let Some(n) = self.min_uploads {
            f.insert("min_uploads".into(), json!(n));
        }
        Ok(Value::Object(f))
    }
}

/// `settle admin pending`.
#[derive(Clone, Debug, clap::Args)]
pub struct PendingArgs {
    /// Which rounds.
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Counts by tier and due bucket instead of the rounds.
    #[arg(long)]
    pub summary: bool,
    /// Rounds per page (1-1000; the API's default 100).
    #[arg(long, value_name = "N", conflicts_with = "summary")]
    pub limit: Option<u32>,
    /// The next page: the cursor the previous page printed.
    #[arg(long, conflicts_with = "summary")]
    pub cursor: Option<String>,
}

/// `settle admin flush` and `settle admin cancel`.
#[derive(Clone, Debug, clap::Args)]
pub struct ActionArgs {
    /// The one session to act on: tenant/session.
    #[arg(long, value_name = "TENANT/SESSION")]
    pub session: Option<String>,
    /// Or every open round these select (bulk; at least one filter flag).
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Why (goes to the audit topic with your credential's name).
    #[arg(long, required = true)]
    pub reason: String,
    /// Only count what would be done, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Idempotency key: a retried request with the same id acts once (generated when absent).
    #[arg(long)]
    pub request_id: Option<String>,
    /// Bulk: most sessions per partition (1-100000; the API's default 10000).
    #[arg(long, value_name = "N")]
    pub limit: Option<u32>,
    /// How long to wait for every partition's outcome, e.g. 5s, 1m (at most 60s).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub wait: Option<Duration>,
}

/// `settle admin audit`.
#[derive(Clone, Debug, clap::Args)]
pub struct AuditArgs {
    /// How many records (1-1000).
    #[arg(long, default_value_t = 20)]
    pub limit: u32,
    /// Only records of this stage: accepted, refused or applied.
    #[arg(long)]
    pub stage: Option<String>,
}

/// A blocking client of one admin API.
pub struct Client {
    agent: ureq::Agent,
    base: String,
    token: Option<String>,
}

/// An answer: HTTP status and JSON body.
pub struct Answer {
    /// HTTP status (2xx: errors are returned as such by the client).
    pub status: u16,
    /// The body as received.
    pub text: String,
    /// The body parsed (`Null` when it is not JSON).
    pub body: Value,
}

impl Client {
    /// A client of `args.url` with the token of `--token-file` or [`TOKEN_ENV`], requests
    /// bounded by `timeout`.
    ///
    /// Errors: the token file or CA file cannot be read, or holds nothing usable.
    pub fn new(args: &AdminArgs, timeout: Duration) -> anyhow::Result<Self> {
        let token = match &args.token_file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("--token-file: cannot read {}", path.display()))?;
                let line = text
                    .lines()
                    .map(str::trim)
                    .find(|l| !l.is_empty() && !l.starts_with('#'))
                    .ok_or_else(|| anyhow!("--token-file {}: no token in it", path.display()))?;
                Some(line.to_owned())
            }
            None => std::env::var(TOKEN_ENV)
                .ok()
                .map(|t| t.trim().to_owned())
                .filter(|t| !t.is_empty()),
        };
        let mut config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(timeout));
        if let Some(path) = &args.ca_file {
            let pem = std::fs::read(path)
                .with_context(|| format!("--ca-file: cannot read {}", path.display()))?;
            let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(&pem)
                .filter_map(|item| match item {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                    _ => None,
                })
                .collect();
            if certs.is_empty() {
                bail!("--ca-file {}: no PEM certificate in it", path.display());
            }
            config = config.tls_config(
                ureq::tls::TlsConfig::builder()
                    .root_certs(ureq::tls::RootCerts::Specific(std::sync::Arc::new(certs)))
                    .build(),
            );
        }
        Ok(Client {
            agent: config.build().into(),
            base: args.url.trim_end_matches('/').to_owned(),
            token,
        })
    }

    /// `GET path` with `query`.
    ///
    /// Errors: as [`Client::send`].
    pub fn get(&self, path: &str, query: &[(&str, String)]) -> anyhow::Result<Answer> {
        let url = format!("{}{path}", self.base);
        let mut req = self.agent.get(&url);
        for (k, v) in query {
            req = req.query(*k, v);
        }
        if let Some(t) = &self.token {
            req = req.header("Authorization", &format!("Bearer {t}"));
        }
        self.answer(&url, req.call())
    }

    /// `method path` with a JSON `body` (POST, PUT; DELETE with `Value::Null`: no body).
    ///
    /// Errors: the server cannot be reached (the message says so and names the URL); a
    /// 401/403 (what to do about the token); any other status ≥ 400 with the API's message.
    pub fn send(&self, method: &str, path: &str, body: &Value) -> anyhow::Result<Answer> {
        let url = format!("{}{path}", self.base);
        let mut request = ureq::http::Request::builder().method(method).uri(&url);
        if let Some(t) = &self.token {
            request = request.header("Authorization", format!("Bearer {t}"));
        }
        let sent = if body.is_null() {
            let request = request
                .body(())
                .with_context(|| format!("{method} {url}: not a valid request"))?;
            self.agent.run(request)
        } else {
            let request = request
                .header("Content-Type", "application/json")
                .body(body.to_string())
                .with_context(|| format!("{method} {url}: not a valid request"))?;
            self.agent.run(request)
        };
        self.answer(&url, sent)
    }

    fn answer(
        &self,
        url: &str,
        response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> anyhow::Result<Answer> {
        let mut response = response.map_err(|e| unreachable(url, e))?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| unreachable(url, e))?;
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let message = body["error"].as_str().unwrap_or(text.trim()).to_owned();
        match status {
            401 => bail!(
                "401 unauthorized: {message}. {}",
                if self.token.is_some() {
                    "The token was refused: check --token-file / SETTLE_ADMIN_TOKEN against the server's admin.tokens-file / SETTLE_ADMIN_TOKENS"
                } else {
                    "Give a token with --token-file FILE or SETTLE_ADMIN_TOKEN"
                }
            ),
            403 => bail!("403 forbidden: {message}"),
            s if s >= 400 => bail!("{s} from {url}: {message}"),
            _ => Ok(Answer { status, text, body }),
        }
    }
}

/// The error of a request that got no HTTP answer.
fn unreachable(url: &str, e: ureq::Error) -> anyhow::Error {
    let refused = match &e {
        ureq::Error::Io(io) => io.kind() == std::io::ErrorKind::ConnectionRefused,
        other => other
            .to_string()
            .to_ascii_lowercase()
            .contains("connection refused"),
    };
    if refused {
        anyhow!("cannot reach the admin API at {url}: connection refused (is `settle run` running, and is --url / SETTLE_ADMIN_URL its admin.listen?)")
    } else {
        anyhow!("cannot reach the admin API at {url}: {e}")
    }
}

/// Runs `args`, writing to `out`.
///
/// Errors: the request failed (see [`Client::send`]), a flag's value is invalid, or `out`
/// cannot be written.
pub fn run(args: &AdminArgs, out: &mut impl Write) -> anyhow::Result<()> {
    let wait = match &args.command {
        AdminCommand::Flush(a) | AdminCommand::Cancel(a) => a.wait.unwrap_or_default(),
        _ => Duration::ZERO,
    };
    let client = Client::new(args, wait.max(Duration::from_secs(5)) + REQUEST_SLACK)?;
    let answer = match &args.command {
        AdminCommand::Whoami => client.send("POST", "/v1/whoami", &json!({}))?,
        AdminCommand::Partitions => client.get("/v1/partitions", &[])?,
        AdminCommand::Pending(p) => {
            let mut q = p.filter.query();
            if let Some(n) = p.limit {
                q.push(("limit", n.to_string()));
            }
            if let Some(c) = &p.cursor {
                q.push(("cursor", c.clone()));
            }
            let path = if p.summary {
                "/v1/pending/summary"
            } else {
                "/v1/pending"
            };
            client.get(path, &q)?
        }
        AdminCommand::Flush(a) => client.send("POST", "/v1/actions", &action_body("flush", a)?)?,
        AdminCommand::Cancel(a) => {
            client.send("POST", "/v1/actions", &action_body("cancel", a)?)?
        }
        AdminCommand::Audit(a) => {
            let mut q = vec![("limit", a.limit.to_string())];
            if let Some(s) = &a.stage {
                q.push(("stage", s.clone()));
            }
            client.get("/v1/audit", &q)?
        }
        AdminCommand::Override(OverrideCommand::List) => client.get("/v1/overrides", &[])?,
        AdminCommand::Override(OverrideCommand::Set(a)) => client.send(
            "PUT",
            &format!("/v1/tenants/{}/override", path_segment(&a.tenant)),
            &override_body(a),
        )?,
        AdminCommand::Override(OverrideCommand::Remove(a)) => {
            let path = format!(
                "/v1/tenants/{}/override?version={}&reason={}",
                path_segment(&a.tenant),
                a.version,
                path_segment(&a.reason)
            );
            client.send("DELETE", &path, &Value::Null)?
        }
    };
    if args.json {
        writeln!(out, "{}", answer.text.trim_end())?;
        return Ok(());
    }
    let b = &answer.body;
    match &args.command {
        AdminCommand::Whoami => writeln!(
            out,
            "{} ({}) at {}: actions {}, reads {}{}",
            text(&b["name"]),
            text(&b["role"]),
            args.url,
            if b["actions"] == true { "on" } else { "off" },
            if b["protect_reads"] == true {
                "need a token"
            } else {
                "open"
            },
            if b["tokens_configured"] == true {
                ""
            } else {
                " (no token configured: actions are open to anyone who reaches this loopback address)"
            },
        )?,
        AdminCommand::Partitions => print_partitions(b, out)?,
        AdminCommand::Pending(p) if p.summary => print_summary(b, out)?,
        AdminCommand::Pending(_) => print_pending(b, out)?,
        AdminCommand::Flush(_) | AdminCommand::Cancel(_) => print_action(answer.status, b, out)?,
        AdminCommand::Audit(_) => print_audit(b, out)?,
        AdminCommand::Override(OverrideCommand::List) => print_overrides(b, out)?,
        AdminCommand::Override(OverrideCommand::Set(a)) => writeln!(
            out,
            "override of {} {} (version {}): rule in force {}",
            a.tenant,
            if answer.status == 202 {
                "written, not yet applied here (in flight)"
            } else {
                "set"
            },
            text(&b["override"]["version"]),
            text(&b["tenant"]["rule"]),
        )?,
        AdminCommand::Override(OverrideCommand::Remove(a)) => writeln!(
            out,
            "override of {} removed: the config's rule applies again",
            a.tenant
        )?,
    }
    Ok(())
}

/// `s` percent-encoded for one URL path segment or query value (RFC 3986 unreserved
/// characters kept).
fn path_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The `PUT /v1/tenants/{tenant}/override` body of `a` (the API checks every value and
/// answers 400 naming the key).
fn override_body(a: &OverrideSetArgs) -> Value {
    let mut debounce = serde_json::Map::new();
    for (key, v) in [
        ("policy", &a.policy),
        ("delay", &a.delay),
        ("min-delay", &a.min_delay),
        ("max-delay", &a.max_delay),
        ("max-wait", &a.max_wait),
    ] {
        if let Some(v) = v {
            debounce.insert(key.to_owned(), json!(v));
        }
    }
    let mut body = json!({ "version": a.version, "debounce": debounce, "reason": a.reason });
    if let Some(n) = a.event_ids {
        body["event_ids"] = json!(n);
    }
    if let Some(t) = &a.tier {
        body["tier"] = json!(t);
    }
    if let Some(e) = &a.expires_in {
        body["expires_in"] = json!(e);
    }
    if let Some(e) = &a.expires_at {
        body["expires_at"] = json!(e);
    }
    body
}

/// The table of `GET /v1/overrides`.
fn print_overrides(b: &Value, out: &mut impl Write) -> std::io::Result<()> {
    let empty = Vec::new();
    let rows: Vec<Vec<String>> = b["overrides"]
        .as_array()
        .unwrap_or(&empty)
        .iter()
        .map(|o| {
            vec![
                text(&o["tenant"]),
                text(&o["version"]),
                if o["in_force"] == true { "yes" } else { "no" }.to_owned(),
                text(&o["rules"]["rule"]),
                text(&o["tier"]),
                text(&o["expires_at"]),
                text(&o["who"]),
                text(&o["reason"]),
            ]
        })
        .collect();
    writeln!(
        out,
        "{} override(s) in force (store {}); config default rule: {}",
        text(&b["in_force"]),
        text(&b["store"]),
        text(&b["config"]["default"]),
    )?;
    table(
        out,
        &[
            "TENANT",
            "VERSION",
            "IN FORCE",
            "RULE IN FORCE",
            "TIER",
            "EXPIRES",
            "WHO",
            "REASON",
        ],
        &rows,
    )
}

/// The `POST /v1/actions` body of `kind` with `a`.
///
/// Errors: neither or both of `--session` and filter flags; a bad time flag.
fn action_body(kind: &str, a: &ActionArgs) -> anyhow::Result<Value> {
    let mut body = json!({ "kind": kind, "reason": a.reason, "dry_run": a.dry_run });
    match (&a.session, a.filter.is_empty()) {
        (Some(s), true) => body["session"] = json!(s),
        (None, false) => body["filter"] = a.filter.body()?,
        (Some(_), false) => bail!("give either --session or filter flags (--tenant, --partition, ...), not both"),
        (None, true) => bail!("give --session TENANT/SESSION, or filter flags (--tenant, --partition, --policy, --tier, --due-before, --due-after, --min-uploads) for a bulk action"),
    }
    if let Some(id) = &a.request_id {
        body["request_id"] = json!(id);
    }
    if let Some(n) = a.limit {
        body["limit"] = json!(n);
    }
    if let Some(w) = a.wait {
        body["wait_ms"] = json!(u64::try_from(w.as_millis()).unwrap_or(u64::MAX));
    }
    Ok(body)
}

/// A JSON value as table text: strings bare, null as `-`.
fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Writes `rows` under `headers`, each column as wide as its widest cell, two spaces apart.
pub fn table(out: &mut impl Write, headers: &[&str], rows: &[Vec<String>]) -> std::io::Result<()> {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            if i + 1 == widths.len() {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$}  "));
            }
        }
        s.trim_end().to_owned()
    };
    writeln!(out, "{}", line(&mut headers.iter().copied()))?;
    for row in rows {
        writeln!(out, "{}", line(&mut row.iter().map(String::as_str)))?;
    }
    Ok(())
}

fn list(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

fn print_partitions(b: &Value, out: &mut impl Write) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> = list(&b["partitions"])
        .iter()
        .map(|p| {
            [
                "topic",
                "partition",
                "state",
                "next_offset",
                "lag",
                "pending_rounds",
                "outbox",
                "next_due",
            ]
            .iter()
            .map(|k| text(&p[*k]))
            .collect()
        })
        .collect();
    table(
        out,
        &[
            "TOPIC",
            "PARTITION",
            "STATE",
            "NEXT_OFFSET",
            "LAG",
            "PENDING",
            "OUTBOX",
            "NEXT_DUE",
        ],
        &rows,
    )
}

/// Where the answer of a pending view says it looked.
fn coverage(b: &Value, out: &mut impl Write) -> std::io::Result<()> {
    let covered: Vec<String> = list(&b["partitions"])
        .iter()
        .map(|p| text(p.get("partition").unwrap_or(p)))
        .collect();
    write!(out, "partitions covered: {}", covered.join(","))?;
    if !list(&b["restoring"]).is_empty() {
        write!(out, "; restoring (not counted): {}", text(&b["restoring"]))?;
    }
    if !list(&b["unavailable"]).is_empty() {
        write!(out, "; unavailable: {}", text(&b["unavailable"]))?;
    }
    writeln!(out)
}

fn print_pending(b: &Value, out: &mut impl Write) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> = list(&b["rounds"])
        .iter()
        .map(|r| {
            [
                "key",
                "partition",
                "policy",
                "tier",
                "uploads",
                "last_upload_at",
                "due_at",
                "waiting",
            ]
            .iter()
            .map(|k| text(&r[*k]))
            .collect()
        })
        .collect();
    table(
        out,
        &[
            "KEY",
            "PARTITION",
            "POLICY",
            "TIER",
            "UPLOADS",
            "LAST_UPLOAD",
            "DUE",
            "WAITING",
        ],
        &rows,
    )?;
    writeln!(out, "{} round(s)", rows.len())?;
    coverage(b, out)?;
    if let Some(c) = b["next_cursor"].as_str() {
        writeln!(out, "more: --cursor {c}")?;
    }
    Ok(())
}

fn print_summary(b: &Value, out: &mut impl Write) -> std::io::Result<()> {
    const BUCKETS: [&str; 5] = ["overdue", "lt_10s", "lt_1m", "lt_10m", "later"];
    let mut rows: Vec<Vec<String>> = Vec::new();
    if let Some(tiers) = b["by_tier"].as_object() {
        for (tier, t) in tiers {
            let mut row = vec![tier.clone(), text(&t["rounds"]), text(&t["uploads"])];
            row.extend(BUCKETS.iter().map(|k| text(&t["due"][*k])));
            rows.push(row);
        }
    }
    let mut total = vec!["all".to_owned(), text(&b["rounds"]), text(&b["uploads"])];
    total.extend(BUCKETS.iter().map(|k| text(&b["by_due"][*k])));
    rows.push(total);
    table(
        out,
        &[
            "TIER", "ROUNDS", "UPLOADS", "OVERDUE", "<10S", "<1M", "<10M", "LATER",
        ],
        &rows,
    )?;
    writeln!(
        out,
        "{} tenant(s); owed emissions (outbox): {}{}",
        text(&b["tenants"]),
        text(&b["owed"]),
        if b["truncated"] == true {
            " (truncated)"
        } else {
            ""
        }
    )?;
    coverage(b, out)
}

fn print_action(status: u16, b: &Value, out: &mut impl Write) -> std::io::Result<()> {
    let what = match (&b["session"], &b["filter"]) {
        (Value::String(s), _) => s.clone(),
        (_, f) => format!("filter {f}"),
    };
    writeln!(
        out,
        "request {}: {} {}{}: {} — {} session(s), {} upload(s){}",
        text(&b["request_id"]),
        text(&b["kind"]),
        what,
        if b["dry_run"] == true {
            " (dry run)"
        } else {
            ""
        },
        text(&b["result"]),
        text(&b["sessions"]),
        text(&b["uploads"]),
        if b["more"] == true {
            "; more matched than the limit: send it again for the rest"
        } else {
            ""
        },
    )?;
    let rows: Vec<Vec<String>> = list(&b["outcomes"])
        .iter()
        .map(|o| {
            let ids: Vec<String> = list(&o["emission_ids"]).iter().map(text).collect();
            vec![
                text(&o["partition"]),
                text(&o["result"]),
                text(&o["sessions"]),
                text(&o["uploads"]),
                if o["duplicate"] == true {
                    "yes".into()
                } else {
                    "".into()
                },
                ids.join(","),
            ]
        })
        .collect();
    table(
        out,
        &[
            "PARTITION",
            "RESULT",
            "SESSIONS",
            "UPLOADS",
            "DUPLICATE",
            "EMISSION_IDS",
        ],
        &rows,
    )?;
    if status == 202 {
        writeln!(
            out,
            "still in flight: partitions {} have not answered; look it up with `curl .../v1/actions/{}` or run it again with the same --request-id (it acts once)",
            text(&b["waiting_for"]),
            text(&b["request_id"])
        )?;
    }
    Ok(())
}

fn print_audit(b: &Value, out: &mut impl Write) -> std::io::Result<()> {
    let rows: Vec<Vec<String>> = list(&b["records"])
        .iter()
        .map(|r| {
            let at = r["at"]
                .as_i64()
                .map_or_else(|| text(&r["at"]), crate::codec::format_rfc3339_ms);
            let result = match &r["result"] {
                Value::Object(m) => m
                    .get("result")
                    .or_else(|| m.get("refusal"))
                    .or_else(|| m.get("status"))
                    .map(text)
                    .unwrap_or_default(),
                other => text(other),
            };
            vec![
                at,
                text(&r["who"]),
                text(&r["stage"]),
                text(&r["action"]),
                text(&r["request_id"]),
                text(&r["result"]["partition"]),
                result,
                text(&r["reason"]),
            ]
        })
        .collect();
    table(
        out,
        &[
            "AT",
            "WHO",
            "STAGE",
            "ACTION",
            "REQUEST_ID",
            "PARTITION",
            "RESULT",
            "REASON",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_their_columns() {
        let mut out = Vec::new();
        table(
            &mut out,
            &["KEY", "N"],
            &[
                vec!["acme/build-4711".into(), "3".into()],
                vec!["a/b".into(), "12".into()],
            ],
        )
        .unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "KEY              N");
        assert_eq!(lines[1], "acme/build-4711  3");
        assert_eq!(lines[2], "a/b              12");
    }

    #[test]
    fn an_action_needs_a_session_or_a_filter_not_both() {
        let mut a = ActionArgs {
            session: None,
            filter: FilterArgs::default(),
            reason: "why".into(),
            dry_run: true,
            request_id: Some("r-1".into()),
            limit: None,
            wait: Some(Duration::from_secs(2)),
        };
        assert!(action_body("flush", &a)
            .unwrap_err()
            .to_string()
            .contains("--session"));
        a.filter.tenant = Some("acme".into());
        a.filter.due_before = Some("2026-01-01T00:00:00Z".into());
        let b = action_body("cancel", &a).unwrap();
        assert_eq!(b["filter"]["tenant"], "acme");
        assert_eq!(b["filter"]["due_before"], 1_767_225_600_000_i64);
        assert_eq!(
            (b["wait_ms"].as_u64(), b["dry_run"].as_bool()),
            (Some(2000), Some(true))
        );
        a.session = Some("acme/s".into());
        assert!(action_body("flush", &a)
            .unwrap_err()
            .to_string()
            .contains("not both"));
        a.session = None;
        a.filter.due_before = Some("yesterday".into());
        assert!(action_body("flush", &a)
            .unwrap_err()
            .to_string()
            .contains("--due-before"));
    }

    #[test]
    fn an_override_body_carries_only_the_keys_given() {
        let a = OverrideSetArgs {
            tenant: "acme".into(),
            version: 3,
            policy: Some("fixed".into()),
            delay: Some("2m".into()),
            min_delay: None,
            max_delay: None,
            max_wait: Some("off".into()),
            event_ids: Some(64),
            tier: Some("normal".into()),
            expires_in: Some("72h".into()),
            expires_at: None,
            reason: "INC-42".into(),
        };
        let b = override_body(&a);
        assert_eq!(
            b["debounce"],
            json!({"policy": "fixed", "delay": "2m", "max-wait": "off"})
        );
        assert_eq!(
            (b["version"].as_u64(), &b["tier"], &b["expires_in"]),
            (Some(3), &json!("normal"), &json!("72h"))
        );
        assert!(b.get("expires_at").is_none());
        assert_eq!(b["event_ids"], json!(64));
        assert_eq!(path_segment("a b/c:ü"), "a%20b%2Fc%3A%C3%BC");
    }
}
