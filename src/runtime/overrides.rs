//! Tenant overrides (SEMANTICS §7) on the runtime's side: the override record, every
//! instance's copy of the deployment's overrides, and how they are put in force.
//!
//! # Where they live
//!
//! An [`OverrideStore`] of the broker (NATS: a KV bucket; Kafka: a compacted topic; memory: a
//! map shared within the process) keeps each tenant's latest [`Override`], key = tenant.
//! Every instance reads it to its end at start, before its partitions start (at most
//! [`RESTORE_TIMEOUT`]; then it starts without and applies them when they arrive), then
//! follows it ([`run`]); its copy is an [`OverrideSet`] behind a watch channel. A removal is a
//! tombstone that keeps the tenant's version, so versions only grow.
//!
//! # What an override does
//!
//! * **Policy, parameters, max-wait**: the `debounce` keys, in the shape of
//!   `[debounce.tenants.NAME]` (a key not set is inherited from the rule the config gives the
//!   tenant), checked by the config's own rules (`config::DebounceConfig::validate_as`, keys
//!   named `debounce.max-delay` as a config error names them). The rules in force
//!   ([`Rules`]) are the config's table with each active override's rule over its tenant's;
//!   every partition task takes them before its next store step, so an override applies to
//!   every upload applied after this instance saw it, and a pending round keeps its due time
//!   until its next upload (the engine times a round by the rule in force at each upload).
//! * **Pinned tier**: handed to the tier router (`tiers::Router::set_override_pins`): the
//!   tenant's emissions go to that tier whatever its rate (still measured and shown); when
//!   the pin goes, automatic tiering resumes from the measured rate.
//! * **`event_ids`**: the tenant's `event-ids` (SEMANTICS §2): how many event ids its ready
//!   records list, over the config's (and over `debounce."event-ids"` of the same override).
//!   Like the other rule keys it applies from the next round's opening on for whether a
//!   round keeps ids, from the next upload on for the cap.
//! * **Expiry**: an override whose `expires_at` passed is out of force; each instance checks
//!   on a timer (at most [`EXPIRY_CHECK`] late) and puts the config's rule back.
//!
//! # Writing one ([`Overrides::write`])
//!
//! The caller names the version it replaces (0 for a tenant without one in force); a stale
//! version is refused ([`OverrideError::Stale`]) with the current override. The broker write
//! is the commit point: nothing is applied anywhere before it, and a write the broker refused
//! changed nothing. On a store that compares revisions (memory, NATS KV) two concurrent
//! writes of one version cannot both succeed, and the writer applies its write here at once.
//! On Kafka (no compare-and-set) the log's order decides: every instance takes the first
//! record of a version it reads and ignores later ones of the same or a lower version, so
//! all agree; the writer answers once its own instance has read the record back, and a
//! writer whose record lost learns it there (409) and appends the winner again, so that a
//! compacted log keeps the winner as the tenant's latest.

use super::rules::Rules;
use crate::codec::action::{AuditRecord, AuditStage, REASON_MAX_BYTES};
use crate::codec::{format_rfc3339_ms, validate_tenant};
use crate::config::{DebounceConfig, TenantOverride};
pub use crate::engine::EVENT_IDS_MAX;
use crate::engine::{Engine, Millis, PolicySpec, PolicyTable};
use crate::metrics::Metrics;
use crate::tiers::SharedRouter;
use crate::transport::{Backoff, OverrideEntry, OverrideEvent, OverrideStore, OverrideWriteError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;

/// Longest wait at start for the override store to be read to its end before the
/// partitions start anyway (they take the overrides when they arrive).
pub const RESTORE_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest time between two expiry checks: an override is out of force at most this late.
pub const EXPIRY_CHECK: Duration = Duration::from_secs(1);

/// Default wait of a write for its own instance to apply it (Kafka; ms).
pub const DEFAULT_WAIT: Duration = Duration::from_secs(5);

/// One tenant's override (SEMANTICS §7), as stored (JSON, key = tenant) and shown. Times are
/// ms since the epoch (wall clock).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Override {
    /// The tenant (SEMANTICS §2 alphabet).
    pub tenant: String,
    /// Policy, parameters and max-wait, as `[debounce.tenants.NAME]` (`policy`, `delay`,
    /// `min-delay`, `max-delay`, `max-wait` with `"off"` for none, `state-ttl`,
    /// `learn-initial-delay`, `event-ids`); unset keys are inherited from the config's rule
    /// of the tenant.
    #[serde(default, skip_serializing_if = "TenantOverride::is_empty")]
    pub debounce: TenantOverride,
    /// The tier the tenant is pinned to while the override is in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// Event ids listed per ready record of the tenant (`event-ids`, SEMANTICS §2), 0 to
    /// [`EVENT_IDS_MAX`]; over `debounce."event-ids"` when both are set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_ids: Option<u32>,
    /// Why (≤ 1024 bytes).
    #[serde(default)]
    pub reason: String,
    /// Who set it (the credential's name).
    #[serde(default)]
    pub who: String,
    /// When it was written (ms).
    pub set_at: Millis,
    /// When it goes out of force (ms); `None`: until removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Millis>,
    /// 1 for a tenant's first override, +1 for each write (removals included).
    pub version: u64,
    /// A removal (tombstone): nothing in force; keeps the version.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deleted: bool,
    /// The request that wrote it (tells two writes of one version apart).
    #[serde(default)]
    pub request_id: String,
    /// The instance that accepted the request.
    #[serde(default)]
    pub instance: String,
}

/// Why an override is refused: the key (`debounce.max-delay`, `tier`, `reason`, ...) and
/// what is wrong, like a config error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidOverride {
    /// The key, empty when the error is about the whole override.
    pub key: String,
    /// What is wrong and what is allowed.
    pub message: String,
}

impl std::fmt::Display for InvalidOverride {
    /// `key: message` (the message alone when it names the key already, as a config
    /// error's does, or when there is no key).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.key.is_empty() || self.message.starts_with(self.key.as_str()) {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.key, self.message)
        }
    }
}

impl std::error::Error for InvalidOverride {}

impl Override {
    /// Whether it is in force at `now`: not a removal, not expired.
    pub fn is_active(&self, now: Millis) -> bool {
        !self.deleted && self.expires_at.is_none_or(|e| e > now)
    }

    /// Whether it changes its tenant's rule: a `debounce` key or `event_ids` set.
    pub fn sets_rule(&self) -> bool {
        !self.debounce.is_empty() || self.event_ids.is_some()
    }

    /// The rule it gives its tenant over `baseline` (the config's rule of the tenant), or
    /// `None` when it sets no `debounce` key and no `event_ids`.
    ///
    /// Errors: the first key that breaks the config's rules, named `debounce.<key>` (or
    /// `event_ids`).
    pub fn rule(&self, baseline: &PolicySpec) -> Result<Option<PolicySpec>, InvalidOverride> {
        if !self.sets_rule() {
            return Ok(None);
        }
        if let Some(n) = self.event_ids.filter(|&n| n > EVENT_IDS_MAX) {
            return Err(InvalidOverride {
                key: "event_ids".into(),
                message: format!("must be 0 to {EVENT_IDS_MAX}, got {n}"),
            });
        }
        let mut resolved = DebounceConfig::from_spec(baseline).with_override(&self.debounce);
        if let Some(n) = self.event_ids {
            resolved.event_ids = n;
        }
        resolved
            .validate_as("debounce")
            .map_err(|e| InvalidOverride {
                key: e.key().unwrap_or("debounce").to_owned(),
                message: e.to_string(),
            })?;
        Ok(Some(resolved.spec()))
    }

    /// Checks a new override: tenant name, reason length, `debounce` by the config's rules
    /// over `baseline`, `tier` in `tiers`, `event_ids` bound, at least one thing set, an
    /// expiry after `now`.
    ///
    /// Errors: [`InvalidOverride`] naming the key.
    pub fn validate<'a>(
        &self,
        baseline: &PolicySpec,
        mut tiers: impl Iterator<Item = &'a str>,
        now: Millis,
    ) -> Result<(), InvalidOverride> {
        let bad = |key: &str, message: String| {
            Err(InvalidOverride {
                key: key.to_owned(),
                message,
            })
        };
        if let Err(e) = validate_tenant(&self.tenant) {
            return bad(
                "tenant",
                format!(
                    "invalid tenant {:?}: {e} (SEMANTICS §2: 1-128 bytes of [A-Za-z0-9._:-])",
                    self.tenant
                ),
            );
        }
        if self.reason.len() > REASON_MAX_BYTES {
            return bad(
                "reason",
                format!(
                    "must be at most {REASON_MAX_BYTES} bytes, got {}",
                    self.reason.len()
                ),
            );
        }
        if self.debounce.is_empty() && self.tier.is_none() && self.event_ids.is_none() {
            return bad(
                "",
                "nothing to override: set debounce keys (policy, delay, min-delay, max-delay, max-wait, state-ttl, learn-initial-delay, event-ids), tier or event_ids".into(),
            );
        }
        self.rule(baseline)?;
        if let Some(tier) = &self.tier {
            let names: Vec<&str> = tiers.by_ref().collect();
            if !names.contains(&tier.as_str()) {
                return bad(
                    "tier",
                    format!("unknown tier {tier:?}; the tiers are {}", names.join(", ")),
                );
            }
        }
        if let Some(at) = self.expires_at {
            if at <= now {
                return bad(
                    "expires_at",
                    format!(
                        "must be in the future, got {} (now {})",
                        format_rfc3339_ms(at),
                        format_rfc3339_ms(now)
                    ),
                );
            }
        }
        Ok(())
    }

    /// The stored JSON.
    pub fn encode(&self) -> Vec<u8> {
        // A struct of strings, numbers and options: serializing cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Reads a stored override.
    ///
    /// Errors: the JSON parser's.
    pub fn decode(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// A tenant's latest override as the store holds it, with the store's revision.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored {
    /// The record (a removal included).
    pub record: Override,
    /// The store's revision of it (`transport::OverrideStore::put`).
    pub revision: u64,
}

/// This instance's copy of the deployment's overrides.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OverrideSet {
    /// Tenant → latest record (removals included, for their version).
    pub entries: BTreeMap<String, Stored>,
    /// The store was read to its end at least once.
    pub caught_up: bool,
}

impl OverrideSet {
    /// The version of `tenant`'s latest record (0: none).
    pub fn version_of(&self, tenant: &str) -> u64 {
        self.entries.get(tenant).map_or(0, |s| s.record.version)
    }

    /// The overrides in force at `now`.
    pub fn active(&self, now: Millis) -> impl Iterator<Item = &Override> {
        self.entries
            .values()
            .map(|s| &s.record)
            .filter(move |o| o.is_active(now))
    }

    /// `tenant`'s override in force at `now`.
    pub fn active_of(&self, tenant: &str, now: Millis) -> Option<&Override> {
        self.entries
            .get(tenant)
            .map(|s| &s.record)
            .filter(|o| o.is_active(now))
    }

    /// Takes a record read from the store: kept when its version is above the tenant's
    /// (the first record of a version wins: module docs). Returns whether it was kept.
    fn take(&mut self, record: Override, revision: u64) -> bool {
        match self.entries.get_mut(&record.tenant) {
            Some(s) if s.record.version > record.version => false,
            Some(s) if s.record.version == record.version => {
                // The same record read again (its own write applied early): newer revision.
                if s.record.request_id == record.request_id {
                    s.revision = s.revision.max(revision);
                }
                false
            }
            _ => {
                self.entries
                    .insert(record.tenant.clone(), Stored { record, revision });
                true
            }
        }
    }
}

/// Why a write was refused or not done.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum OverrideError {
    /// This instance has no override store (503).
    #[error("{0}")]
    Unavailable(String),
    /// The override breaks a rule (400).
    #[error(transparent)]
    Invalid(#[from] InvalidOverride),
    /// The version named is not the current one (409).
    #[error("version {expected} is stale: the tenant's current override version is {}", .current.as_ref().map_or(0, |c| c.version))]
    Stale {
        /// The version the request named.
        expected: u64,
        /// The tenant's latest record (a removal included), if any.
        current: Option<Box<Override>>,
    },
    /// A removal of a tenant without an override in force (404).
    #[error("tenant {0} has no override in force")]
    NotFound(String),
}

/// How a write ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Written {
    /// Stored and in force on this instance (the others apply it as they read it).
    Applied(Override),
    /// Stored, not yet read back here within the wait: it applies when it is.
    InFlight(Override),
}

/// Publishes an audit record (to the audit topic, and to this process's action log).
pub type AuditFn = Arc<dyn Fn(AuditRecord) + Send + Sync>;

struct Inner {
    store: Option<Arc<dyn OverrideStore>>,
    rules: Rules,
    /// The config's rules: what a tenant without an override gets.
    baseline: PolicyTable,
    router: SharedRouter,
    metrics: Metrics,
    wall: Arc<dyn Fn() -> Millis + Send + Sync>,
    set: watch::Sender<OverrideSet>,
    /// What was last put in force: tenant → version of its active override.
    applied: Mutex<BTreeMap<String, u64>>,
    instance: String,
    audit: Option<AuditFn>,
}

/// The overrides of one runtime: its copy of the store, putting them in force, writing
/// them. Cheap to clone.
#[derive(Clone)]
pub struct Overrides {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Overrides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overrides")
            .field("store", &self.store_name())
            .field("instance", &self.inner.instance)
            .finish_non_exhaustive()
    }
}

/// What [`Overrides::new`] needs from the runtime.
pub struct OverridesSetup {
    /// The store; `None`: overrides are off (writes answer [`OverrideError::Unavailable`]).
    pub store: Option<Arc<dyn OverrideStore>>,
    /// The rules in force; their table when this is built is the config's baseline.
    pub rules: Rules,
    /// The process's tier router (pinned tiers).
    pub router: SharedRouter,
    /// The runtime's metrics.
    pub metrics: Metrics,
    /// The wall clock (ms since the epoch).
    pub wall: Arc<dyn Fn() -> Millis + Send + Sync>,
    /// This instance's name (in records and audit records).
    pub instance: String,
    /// Where expiries are audited.
    pub audit: Option<AuditFn>,
}

impl Overrides {
    /// The overrides of a runtime (see [`OverridesSetup`]).
    pub fn new(setup: OverridesSetup) -> Self {
        let baseline = setup.rules.current().policies().clone();
        Overrides {
            inner: Arc::new(Inner {
                store: setup.store,
                rules: setup.rules,
                baseline,
                router: setup.router,
                metrics: setup.metrics,
                wall: setup.wall,
                set: watch::Sender::new(OverrideSet::default()),
                applied: Mutex::new(BTreeMap::new()),
                instance: setup.instance,
                audit: setup.audit,
            }),
        }
    }

    /// The store's name (bucket or topic), `None` when overrides are off.
    pub fn store_name(&self) -> Option<&str> {
        self.inner.store.as_deref().map(|s| s.name())
    }

    /// This instance's copy of the overrides.
    pub fn snapshot(&self) -> OverrideSet {
        self.inner.set.borrow().clone()
    }

    /// The config's rules (what a tenant without an override gets).
    pub fn baseline(&self) -> &PolicyTable {
        &self.inner.baseline
    }

    /// The rules in force now.
    pub fn rules_in_force(&self) -> PolicyTable {
        self.inner.rules.current().policies().clone()
    }

    /// The wall clock (ms).
    pub fn now(&self) -> Millis {
        (self.inner.wall)()
    }

    /// This instance's name.
    pub fn instance(&self) -> &str {
        &self.inner.instance
    }

    /// Takes one value read from the store (an undecodable one is logged and skipped);
    /// returns whether the set changed.
    fn take(&self, entry: &OverrideEntry) -> bool {
        if entry.value.is_empty() {
            return false;
        }
        let record = match Override::decode(&entry.value) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(key = %entry.key, error = %e, "an override record that cannot be read; skipped");
                return false;
            }
        };
        let mut changed = false;
        self.inner.set.send_if_modified(|set| {
            changed = set.take(record, entry.revision);
            changed
        });
        changed
    }

    /// Puts the overrides in force at the wall clock's now: the rules (when they changed),
    /// the router's pins, the gauge; counts and logs what changed since the last time
    /// (set, removed, expired; an expiry is audited). Returns the earliest future expiry.
    pub fn apply(&self) -> Option<Millis> {
        // Held throughout: two applies (the feed's task, a write) put the latest in force
        // in turn, never an older set after a newer one.
        let mut applied = self
            .inner
            .applied
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = self.now();
        let set = self.inner.set.borrow().clone();
        let mut table = self.inner.baseline.clone();
        let mut pins: Vec<(&str, &str)> = Vec::new();
        let mut active: BTreeMap<String, u64> = BTreeMap::new();
        let mut next_expiry: Option<Millis> = None;
        for o in set.active(now) {
            active.insert(o.tenant.clone(), o.version);
            if let Some(at) = o.expires_at {
                next_expiry = Some(next_expiry.map_or(at, |n| n.min(at)));
            }
            match o.rule(self.inner.baseline.for_tenant(&o.tenant)) {
                Ok(Some(spec)) => {
                    table.tenants.insert(o.tenant.clone(), spec);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(tenant = %o.tenant, version = o.version, error = %e, "override rule not valid over this instance's config; its debounce keys are not applied");
                }
            }
            if let Some(tier) = &o.tier {
                pins.push((&o.tenant, tier));
            }
        }
        if *self.inner.rules.current().policies() != table {
            self.inner.rules.set(Engine::new(table));
        }
        let unknown = self.inner.router.lock().set_override_pins(pins);
        for tenant in unknown {
            tracing::warn!(%tenant, "override pins a tier this instance does not have; not pinned");
        }
        self.inner.metrics.set_overrides(active.len());
        for (tenant, version) in applied.iter() {
            if active.contains_key(tenant) {
                continue;
            }
            let Some(latest) = set.entries.get(tenant).map(|s| &s.record) else {
                continue;
            };
            if latest.deleted {
                self.inner.metrics.override_change("removed");
                tracing::info!(%tenant, version = latest.version, who = %latest.who, reason = %latest.reason, "tenant override removed: the config's rule applies again");
            } else {
                self.inner.metrics.override_change("expired");
                tracing::info!(%tenant, version, expired_at = ?latest.expires_at, "tenant override expired: the config's rule applies again");
                self.audit_expiry(latest, now);
            }
        }
        for (tenant, version) in &active {
            if applied.get(tenant) != Some(version) {
                self.inner.metrics.override_change("set");
                if let Some(o) = set.active_of(tenant, now) {
                    tracing::info!(%tenant, version, who = %o.who, reason = %o.reason, tier = ?o.tier, expires_at = ?o.expires_at, "tenant override in force");
                }
            }
        }
        *applied = active;
        next_expiry
    }

    fn audit_expiry(&self, o: &Override, now: Millis) {
        let Some(audit) = &self.inner.audit else {
            return;
        };
        // One record per deployment: the instance that reports the tenant's tier changes.
        if !self.inner.router.lock().reports(&o.tenant) {
            return;
        }
        audit(AuditRecord {
            at: now,
            instance: self.inner.instance.clone(),
            who: o.who.clone(),
            request_id: o.request_id.clone(),
            action: "override.expired".into(),
            stage: AuditStage::Applied,
            reason: o.reason.clone(),
            selection: serde_json::json!({ "tenant": o.tenant }),
            result: serde_json::json!({ "version": o.version, "expires_at": o.expires_at }),
        });
    }

    /// Waits up to `timeout` until `done(set)` holds; returns the set then.
    async fn wait_for(
        &self,
        timeout: Duration,
        done: impl Fn(&OverrideSet) -> bool,
    ) -> OverrideSet {
        let mut rx = self.inner.set.subscribe();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|s| done(s))).await;
        let set = rx.borrow().clone();
        set
    }

    /// Writes `record` (a new override, or a removal with `deleted`) over the tenant's
    /// override at version `expected` (0: the tenant has none in force) and waits up to
    /// `wait` for this instance to apply it (module docs). `record.version` is set here.
    ///
    /// Errors: [`OverrideError`] (nothing was written, except for a Kafka write that lost
    /// the race to another write of the same version: [`OverrideError::Stale`] after it).
    pub async fn write(
        &self,
        mut record: Override,
        expected: u64,
        wait: Duration,
    ) -> Result<Written, OverrideError> {
        let Some(store) = self.inner.store.clone() else {
            return Err(OverrideError::Unavailable(
                "tenant overrides are off on this instance (no override store: nats.overrides-bucket = \"\", or a transport without one)".into(),
            ));
        };
        let now = self.now();
        if !record.deleted {
            record.validate(
                self.inner.baseline.for_tenant(&record.tenant),
                self.inner.router.tiers().tiers().map(|(n, _)| n),
                now,
            )?;
        }
        let tenant = record.tenant.clone();
        let mut set = self.snapshot();
        if expected > set.version_of(&tenant) {
            // This instance may not have read the caller's version yet.
            set = self
                .wait_for(Duration::from_secs(1), |s| {
                    s.version_of(&tenant) >= expected
                })
                .await;
        }
        let current = set.entries.get(&tenant).cloned();
        let version = current.as_ref().map_or(0, |c| c.record.version);
        let in_force = current.as_ref().is_some_and(|c| c.record.is_active(now));
        if record.deleted && !in_force {
            return Err(OverrideError::NotFound(tenant));
        }
        // The current version, or 0 for a tenant with nothing in force.
        let named_current = expected == version || (expected == 0 && !in_force);
        if !named_current {
            return Err(OverrideError::Stale {
                expected,
                current: current.map(|c| Box::new(c.record)),
            });
        }
        record.version = version + 1;
        let revision = current.as_ref().map_or(0, |c| c.revision);
        let put = store.put(&tenant, record.encode(), revision).await;
        let revision = match put {
            Ok(r) => r,
            Err(OverrideWriteError::Conflict { .. }) => {
                let set = self
                    .wait_for(Duration::from_secs(1), |s| s.version_of(&tenant) > version)
                    .await;
                return Err(OverrideError::Stale {
                    expected,
                    current: set.entries.get(&tenant).map(|c| Box::new(c.record.clone())),
                });
            }
            Err(OverrideWriteError::Transport(e)) => {
                return Err(OverrideError::Unavailable(format!(
                    "the override store {} did not take the write: {e} (if it did after all, the override applies when it is read back; read GET /v1/overrides before retrying with the version it shows)",
                    store.name()
                )));
            }
        };
        if store.compares_revisions() {
            self.take(&OverrideEntry {
                key: tenant.clone(),
                value: record.encode(),
                revision,
            });
            self.apply();
            return Ok(Written::Applied(record));
        }
        let target = record.version;
        let set = self
            .wait_for(wait, |s| s.version_of(&tenant) >= target)
            .await;
        match set.entries.get(&tenant) {
            Some(s) if s.record.version == target && s.record.request_id == record.request_id => {
                // Read back: the feed's task applies it; make sure it is before answering.
                self.apply();
                Ok(Written::Applied(record))
            }
            Some(s) if s.record.version >= target => {
                if s.record.version == target {
                    // Lost to another write of this version: append the winner again so
                    // that the compacted log keeps it as the tenant's latest.
                    let _ = store.put(&tenant, s.record.encode(), 0).await;
                }
                Err(OverrideError::Stale {
                    expected,
                    current: Some(Box::new(s.record.clone())),
                })
            }
            _ => Ok(Written::InFlight(record)),
        }
    }
}

/// Follows the override store until `cancel`: reads it to its end (then sends `ready`), then
/// takes every new value, and puts the overrides in force at each change and at each expiry
/// (checked at least every [`EXPIRY_CHECK`]). A feed that fails is opened again after a
/// backoff (values read twice change nothing).
pub async fn run(overrides: Overrides, ready: oneshot::Sender<()>, cancel: CancellationToken) {
    let Some(store) = overrides.inner.store.clone() else {
        let _ = ready.send(());
        return;
    };
    let mut ready = Some(ready);
    let mut backoff = Backoff::new(Duration::from_secs(5));
    let mut warned = false;
    loop {
        let feed = tokio::select! {
            () = cancel.cancelled() => return,
            f = store.subscribe() => f,
        };
        let mut feed = match feed {
            Ok(f) => f,
            Err(e) => {
                if !warned {
                    warned = true;
                    tracing::warn!(store = store.name(), error = %e, "cannot read the tenant overrides; retrying (overrides set meanwhile apply once they are read)");
                }
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                }
                continue;
            }
        };
        let mut caught_up = overrides.inner.set.borrow().caught_up;
        let mut next_expiry = caught_up.then(|| overrides.apply()).flatten();
        loop {
            let wait = next_expiry.map_or(EXPIRY_CHECK, |at| {
                Duration::from_millis(u64::try_from(at - overrides.now()).unwrap_or(0))
                    .min(EXPIRY_CHECK)
            });
            let event = tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(wait) => {
                    if caught_up {
                        next_expiry = overrides.apply();
                    }
                    continue;
                }
                e = feed.next() => e,
            };
            match event {
                Ok(OverrideEvent::Entry(entry)) => {
                    if overrides.take(&entry) && caught_up {
                        next_expiry = overrides.apply();
                    }
                }
                Ok(OverrideEvent::CaughtUp) => {
                    backoff = Backoff::new(Duration::from_secs(5));
                    warned = false;
                    if !caught_up {
                        caught_up = true;
                        overrides.inner.set.send_modify(|s| s.caught_up = true);
                        next_expiry = overrides.apply();
                        let set = overrides.snapshot();
                        tracing::info!(
                            store = store.name(),
                            in_force = set.active(overrides.now()).count(),
                            records = set.entries.len(),
                            "tenant overrides read"
                        );
                    }
                    if let Some(r) = ready.take() {
                        let _ = r.send(());
                    }
                }
                Err(e) => {
                    tracing::warn!(store = store.name(), error = %e, "reading the tenant overrides failed; reading again after a backoff");
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = tokio::time::sleep(backoff.next_delay()) => {}
                    }
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(tenant: &str, version: u64, request_id: &str) -> Override {
        Override {
            tenant: tenant.into(),
            debounce: TenantOverride::default(),
            tier: Some("normal".into()),
            event_ids: None,
            reason: "incident 42".into(),
            who: "alice".into(),
            set_at: 1,
            expires_at: None,
            version,
            deleted: false,
            request_id: request_id.into(),
            instance: "i-0".into(),
        }
    }

    #[test]
    fn the_first_record_of_a_version_wins_and_versions_only_grow() {
        let mut set = OverrideSet::default();
        assert!(set.take(record("acme", 1, "a"), 10));
        assert!(
            !set.take(record("acme", 1, "b"), 11),
            "a second write of version 1 loses"
        );
        assert_eq!(set.entries["acme"].record.request_id, "a");
        assert!(set.take(record("acme", 2, "c"), 12));
        assert!(
            !set.take(record("acme", 1, "a"), 13),
            "an older record changes nothing"
        );
        assert_eq!(set.version_of("acme"), 2);
        assert_eq!(set.version_of("other"), 0);
    }

    #[test]
    fn validation_names_the_key_as_the_config_does() {
        let base = PolicySpec::fixed(1_000);
        let tiers = || ["normal", "limited"].into_iter();
        let mut o = record("acme", 0, "r");
        o.debounce = TenantOverride {
            policy: Some(crate::engine::PolicyName::Adaptive),
            min_delay: Some(Duration::from_secs(10)),
            max_delay: Some(Duration::from_secs(1)),
            ..TenantOverride::default()
        };
        let e = o.validate(&base, tiers(), 0).unwrap_err();
        assert_eq!(e.key, "debounce.max-delay", "{e}");
        assert!(e.to_string().starts_with("debounce.max-delay"), "{e}");
        o.debounce = TenantOverride::default();
        o.tier = Some("gold".into());
        assert_eq!(o.validate(&base, tiers(), 0).unwrap_err().key, "tier");
        o.tier = None;
        assert_eq!(o.validate(&base, tiers(), 0).unwrap_err().key, "");
        o.tier = Some("limited".into());
        o.expires_at = Some(5);
        assert_eq!(
            o.validate(&base, tiers(), 10).unwrap_err().key,
            "expires_at"
        );
        o.expires_at = Some(50);
        assert!(o.validate(&base, tiers(), 10).is_ok());
        assert!(o.is_active(49) && !o.is_active(50));
    }

    #[test]
    fn a_partial_rule_inherits_the_config_rule_of_the_tenant() {
        let base = PolicySpec::fixed(1_000).with_max_wait(60_000);
        let mut o = record("acme", 1, "r");
        o.debounce = TenantOverride {
            delay: Some(Duration::from_millis(200)),
            max_wait: Some(None),
            ..TenantOverride::default()
        };
        let rule = o.rule(&base).unwrap().unwrap();
        assert_eq!(
            (rule.name, rule.delay, rule.max_wait),
            (base.name, 200, None)
        );
        let back = Override::decode(&o.encode()).unwrap();
        assert_eq!(back, o);
        let text = String::from_utf8(o.encode()).unwrap();
        assert!(text.contains(r#""max-wait":"off""#), "{text}");
    }

    #[test]
    fn event_ids_are_applied_over_the_config_rule() {
        let base = PolicySpec::fixed(1_000).with_event_ids(4);
        let tiers = || ["normal"].into_iter();
        // `event_ids` alone is a rule: the tenant's config rule with that many ids.
        let mut o = record("acme", 1, "r");
        o.tier = None;
        o.event_ids = Some(64);
        assert!(o.sets_rule());
        assert_eq!(
            o.rule(&base).unwrap(),
            Some(PolicySpec::fixed(1_000).with_event_ids(64))
        );
        assert!(o.validate(&base, tiers(), 0).is_ok());
        // 0 turns them off for the tenant.
        o.event_ids = Some(0);
        assert_eq!(o.rule(&base).unwrap(), Some(PolicySpec::fixed(1_000)));
        // Over `debounce."event-ids"` of the same override, and bounded.
        o.debounce.event_ids = Some(8);
        o.event_ids = Some(16);
        assert_eq!(o.rule(&base).unwrap().map(|r| r.event_ids), Some(16));
        o.event_ids = None;
        assert_eq!(o.rule(&base).unwrap().map(|r| r.event_ids), Some(8));
        o.event_ids = Some(EVENT_IDS_MAX + 1);
        let e = o.validate(&base, tiers(), 0).unwrap_err();
        assert_eq!(e.key, "event_ids", "{e}");
        assert!(e.to_string().contains("0 to 100000"), "{e}");
        o.event_ids = None;
        o.debounce.event_ids = Some(EVENT_IDS_MAX + 1);
        let e = o.validate(&base, tiers(), 0).unwrap_err();
        assert_eq!(e.key, "debounce.event-ids", "{e}");
        // Nothing about the rule set: no rule.
        let mut pin = record("acme", 1, "r");
        pin.event_ids = None;
        assert!(!pin.sets_rule());
        assert_eq!(pin.rule(&base).unwrap(), None);
    }
}
