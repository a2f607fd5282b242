//! Configuration: one serde tree, read once at start (STYLE §6).
//!
//! Sources, later ones winning: built-in defaults, then the TOML file (`--config`), then
//! environment variables. Keys are kebab-case; unknown keys are errors; durations are
//! humantime strings (`"500ms"`, `"10s"`, `"5m"`, `"24h"`). Every value is range-checked once,
//! in [`Config::load`] / [`Config::from_toml_str`], and every error names the full key path
//! (`debounce.tenants.acme.delay`) and what is allowed there.
//!
//! Environment variables: `SETTLE_` + the key path in upper case, `__` between levels and `_`
//! for the `-` inside a key. `SETTLE_DEBOUNCE__MIN_DELAY=2s` sets `debounce.min-delay`,
//! `SETTLE_DEBOUNCE__TENANTS__ACME__DELAY=1s` sets `debounce.tenants.acme.delay` (tenant names
//! read from the environment are lower-cased and `_` becomes `-`; name other tenants in the
//! file). Only variables with a `__` are config keys (every key lives in a section), so
//! `SETTLE_CONFIG`, `SETTLE_LOG` and the like stay free for the CLI; the one top-level key,
//! `transport`, is the exception: `SETTLE_TRANSPORT=nats`.
//!
//! Adding a section: a field on [`Config`] whose type is `Default`, `Deserialize` and
//! `Serialize` with `#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]`, plus
//! its checks in [`Config::validate`].

pub mod admin;
pub mod kafka;
pub mod nats;
pub mod shadow;
pub mod tiers;

use crate::codec::validate_tenant;
use crate::engine::shadow::{ShadowSpec, DEFAULT_MAX_SESSIONS};
use crate::engine::{Millis, PolicyName, PolicySpec, PolicyTable};
use admin::AdminConfig;
use figment::providers::{Env, Format, Toml};
use figment::Figment;
use kafka::KafkaConfig;
use nats::NatsConfig;
use serde::{Deserialize, Serialize};
use shadow::ShadowConfig;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tiers::TiersConfig;

/// Longest debounce duration accepted (`delay`, `min-delay`, `max-delay`, `max-wait`,
/// `state-ttl`): 365 days, in ms.
pub const MAX_DEBOUNCE_DURATION_MS: Millis = 365 * 24 * 60 * 60 * 1000;

/// The whole configuration. Every section is optional in the file (`#[serde(default)]`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Config {
    /// `transport`: the broker `settle run` uses, `kafka` (default, `[kafka]`) or `nats`
    /// (`[nats]`). The only top-level key (it must come before the sections in TOML).
    pub transport: Transport,
    /// `[debounce]`: the policy and its per-tenant overrides (SEMANTICS §4).
    pub debounce: DebounceConfig,
    /// `[store]`: where the partition stores live.
    pub store: StoreConfig,
    /// `[runtime]`: pacing and shutdown of the partition tasks.
    pub runtime: RuntimeConfig,
    /// `[admin]`: the admin HTTP server of `settle run` (`/metrics`, `/healthz`, `/readyz`,
    /// `/v1/...`).
    pub admin: AdminConfig,
    /// `[kafka]`: the Kafka transport of `settle run` (broker, consumer group, input and
    /// dead-letter topics, librdkafka properties).
    pub kafka: KafkaConfig,
    /// `[nats]`: the NATS JetStream transport of `settle run` (servers, auth and TLS,
    /// streams, subjects, partitions and this instance's share of them).
    pub nats: NatsConfig,
    /// `[tiers]`: output tiers, their topics and the per-tenant demotion rule (SEMANTICS §5).
    pub tiers: TiersConfig,
    /// `[[shadow]]`: candidate policies run on live traffic beside the live one, emitting
    /// nothing (SEMANTICS §8; at most `engine::shadow::MAX_SHADOWS`). Default: none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shadow: Vec<ShadowConfig>,
}

/// `transport`: which broker `settle run` reads uploads from and publishes to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// Kafka: a consumer group on `kafka.input-topic` (section `[kafka]`).
    #[default]
    Kafka,
    /// NATS JetStream: durable pull consumers on `nats.input-stream`, static partition
    /// assignment (section `[nats]`).
    Nats,
}

impl Transport {
    /// `kafka` or `nats`, as written in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Kafka => "kafka",
            Transport::Nats => "nats",
        }
    }
}

/// `[debounce]` (SEMANTICS §4). Keys a policy does not use are accepted and ignored (they
/// are still range-checked, and a tenant override switching policy inherits them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct DebounceConfig {
    /// `policy`: `fixed`, `leading-trailing` or `adaptive` (default `adaptive`).
    pub policy: PolicyName,
    /// `delay` of `fixed` and `leading-trailing` (default 10 s).
    #[serde(with = "duration")]
    pub delay: Duration,
    /// `min-delay` of `adaptive`: the delay after a key's first upload (default 5 s).
    #[serde(with = "duration")]
    pub min_delay: Duration,
    /// `max-delay` of `adaptive`: cap of the adaptive delay (default 10 min).
    #[serde(with = "duration")]
    pub max_delay: Duration,
    /// `max-wait`, any policy: a round is emitted no later than its start + this.
    /// `None` (the default, or `"off"`) = no max-wait.
    #[serde(with = "max_wait", skip_serializing_if = "Option::is_none")]
    pub max_wait: Option<Duration>,
    /// `state-ttl`: per-key state is forgotten this long after the key's last upload
    /// (default 24 h).
    #[serde(with = "duration")]
    pub state_ttl: Duration,
    /// `learn-initial-delay` of `adaptive`: a session's first upload starts from its
    /// tenant's learned delay instead of `min-delay` (default false; `engine::learn`).
    pub learn_initial_delay: bool,
    /// `event-ids`, any policy: the ready record lists the first this many `event_id`s of
    /// the round's uploads and counts the rest (`event_ids`, `event_ids_dropped`, SEMANTICS
    /// §2). Ids, 0 to [`EVENT_IDS_MAX`](crate::engine::EVENT_IDS_MAX); 0 (the default) lists none and leaves both fields out.
    pub event_ids: u32,
    /// `[debounce.tenants.NAME]`: per-tenant overrides, by tenant name (SEMANTICS §2 alphabet).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub tenants: BTreeMap<String, TenantOverride>,
}

impl Default for DebounceConfig {
    fn default() -> Self {
        DebounceConfig {
            policy: PolicyName::Adaptive,
            delay: Duration::from_secs(10),
            min_delay: Duration::from_secs(5),
            max_delay: Duration::from_secs(600),
            max_wait: None,
            state_ttl: Duration::from_secs(24 * 60 * 60),
            learn_initial_delay: false,
            event_ids: 0,
            tenants: BTreeMap::new(),
        }
    }
}

/// `[debounce.tenants.NAME]`: the same keys as `[debounce]`, each optional; a key not set is
/// inherited from `[debounce]`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct TenantOverride {
    /// `policy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyName>,
    /// `delay`.
    #[serde(
        default,
        with = "opt_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub delay: Option<Duration>,
    /// `min-delay`.
    #[serde(
        default,
        with = "opt_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub min_delay: Option<Duration>,
    /// `max-delay`.
    #[serde(
        default,
        with = "opt_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_delay: Option<Duration>,
    /// `max-wait`: `None` inherits, `Some(None)` (`"off"`) turns it off for this tenant.
    #[serde(
        default,
        with = "tenant_max_wait",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_wait: Option<Option<Duration>>,
    /// `state-ttl`.
    #[serde(
        default,
        with = "opt_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub state_ttl: Option<Duration>,
    /// `learn-initial-delay`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub learn_initial_delay: Option<bool>,
    /// `event-ids`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_ids: Option<u32>,
}

impl TenantOverride {
    /// Whether no key is set (the tenant inherits everything).
    pub fn is_empty(&self) -> bool {
        *self == TenantOverride::default()
    }
}

/// `[store]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `data-dir`: directory of the partition stores (one RocksDB per partition below it).
    /// Default `./settle-data`.
    pub data_dir: PathBuf,
    /// `flush-interval`: longest time a partition's changes stay in memory before they are
    /// written to its store in one write batch (1 ms – 10 s, default 50 ms). Emissions are
    /// published only after the flush that holds them, so this adds up to its length to the
    /// lateness of an emission; a crash re-reads at most this much input.
    #[serde(with = "duration")]
    pub flush_interval: Duration,
    /// `flush-max-dirty`: a partition also flushes as soon as this many session keys changed
    /// since its last flush (keys, 1–1 000 000, default 20 000).
    pub flush_max_dirty: u32,
    /// `session-cache-mib`: session state the process keeps in memory for all its partitions
    /// (MiB, approximate, 1–65 536, default 64). Clean sessions past it are evicted least
    /// recently used and read back from the store when their key is touched again; the timer
    /// index and the evicted keys (about 80 bytes per stored key, plus the key when longer
    /// than 16 bytes: 48 bytes for a 26-byte key) come on top.
    pub session_cache_mib: u32,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            data_dir: PathBuf::from("./settle-data"),
            flush_interval: Duration::from_millis(50),
            flush_max_dirty: 20_000,
            session_cache_mib: 64,
        }
    }
}

/// `[runtime]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// `catch-up-rate`: most emissions per second a partition publishes while it works off
    /// a backlog of due rounds (emissions/s, 1–1 000 000, default 1000).
    pub catch_up_rate: u32,
    /// `shutdown-deadline`: how long a graceful shutdown may take before the process exits
    /// (1 ms – 1 h, default 30 s).
    #[serde(with = "duration")]
    pub shutdown_deadline: Duration,
    /// `batch-size`: most uploads applied in one store write batch (uploads, 1–100 000,
    /// default 1000).
    pub batch_size: u32,
    /// `idle-tick`: how often an idle partition advances its clock to fire due rounds
    /// (1 ms – 60 s, default 100 ms).
    #[serde(with = "duration")]
    pub idle_tick: Duration,
    /// `shadow-max-sessions`: memory budget of each `[[shadow]]` policy in each partition:
    /// most session keys it follows (keys, 1–10 000 000, default 100 000; about 150 bytes
    /// a key, 300 with an open round, plus the key). Sessions that do not fit are counted, not followed (SEMANTICS §8).
    pub shadow_max_sessions: u32,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            catch_up_rate: 1000,
            shutdown_deadline: Duration::from_secs(30),
            batch_size: 1000,
            idle_tick: Duration::from_millis(100),
            shadow_max_sessions: DEFAULT_MAX_SESSIONS,
        }
    }
}

/// A configuration that cannot be used. Every variant names the key (dotted path, e.g.
/// `debounce.tenants.acme.delay`) except [`ConfigError::Read`].
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file cannot be read.
    #[error("cannot read config file {}", path.display())]
    Read {
        /// The path given.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A key is unknown or its value cannot be read (wrong type, bad duration, unknown
    /// policy), or the TOML is malformed (then `key` is empty).
    #[error("{}", parse_message(key, message, origin))]
    Parse {
        /// Dotted key path, empty when the error is not about one key.
        key: String,
        /// What is wrong and what is allowed.
        message: String,
        /// Where the value came from (`file settle.toml`, `environment variable SETTLE_…`),
        /// empty when unknown.
        origin: String,
    },
    /// A value was read but is out of its allowed range.
    #[error("{}", parse_message(key, message, origin))]
    Invalid {
        /// Dotted key path.
        key: String,
        /// What is wrong and what is allowed.
        message: String,
        /// Where the key (or the nearest section above it) came from, as for
        /// [`ConfigError::Parse`]; empty when unknown (built-in defaults, a `Config` built
        /// in code).
        origin: String,
    },
}

/// A value of one key that cannot be used, found by a section's own validation (`[kafka]`,
/// `[nats]`, `[tiers]`): `key` is the full dotted key (`kafka.input-topic`,
/// `tiers.tier[1].name`, `kafka.properties."sasl.mechanisms"`), `message` says what is wrong
/// and what is allowed. Becomes [`ConfigError::Invalid`] in [`Config::validate`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct KeyError {
    /// Dotted config key.
    pub key: String,
    /// What is wrong and what is allowed.
    pub message: String,
}

impl KeyError {
    /// The error of `key`.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        KeyError {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl From<KeyError> for ConfigError {
    fn from(e: KeyError) -> Self {
        ConfigError::Invalid {
            key: e.key,
            message: e.message,
            origin: String::new(),
        }
    }
}

fn parse_message(key: &str, message: &str, origin: &str) -> String {
    match (key.is_empty(), origin.is_empty()) {
        (false, false) => format!("{key}: {message} (from {origin})"),
        (false, true) => format!("{key}: {message}"),
        (true, false) => format!("{origin}: {message}"),
        (true, true) => message.to_owned(),
    }
}

impl ConfigError {
    /// The dotted key path the error is about, if any.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Read { .. } => None,
            ConfigError::Parse { key, .. } | ConfigError::Invalid { key, .. } => {
                Some(key).filter(|k| !k.is_empty()).map(String::as_str)
            }
        }
    }
}

impl ConfigError {
    /// This error with the origin of its key filled in when it is an
    /// [`ConfigError::Invalid`] without one: where `figment` took the key from, or else the
    /// nearest section above it (`debounce` for an inherited `debounce.max-delay`).
    fn located(self, figment: &Figment) -> ConfigError {
        let ConfigError::Invalid {
            key,
            message,
            origin,
        } = self
        else {
            return self;
        };
        let mut path = key.as_str();
        let origin = loop {
            if !origin.is_empty() {
                break origin;
            }
            if let Some(md) = figment.find_metadata(path) {
                break origin_of(md, path, path == key);
            }
            match path.rsplit_once('.') {
                Some((parent, _)) => path = parent,
                None => break String::new(),
            }
        };
        ConfigError::Invalid {
            key,
            message,
            origin,
        }
    }
}

/// Where the value at `path` came from, per its figment metadata: `file PATH`, `environment
/// variable SETTLE_…` (`exact`: `path` is the key itself, not a section above it), or empty.
fn origin_of(md: &figment::Metadata, path: &str, exact: bool) -> String {
    if md.name.contains("environment") {
        return if exact {
            format!("environment variable {}", env_var_for(path))
        } else {
            "the environment".to_owned()
        };
    }
    match &md.source {
        Some(figment::Source::File(p)) => format!("file {}", p.display()),
        _ => String::new(),
    }
}

impl Config {
    /// Loads the configuration: defaults, then the TOML file `file` (if given), then `SETTLE_`
    /// environment variables (see the module docs); then reads the files of
    /// `[kafka.property-files]`, `nats.token-file` and `nats.password-file` and runs [`Config::validate`].
    ///
    /// Errors: [`ConfigError::Read`] when `file` cannot be read; [`ConfigError::Parse`] for
    /// malformed TOML, unknown keys and unreadable values; [`ConfigError::Invalid`] for values
    /// out of range and for a property file that cannot be read (key and path named).
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        let mut figment = Figment::new();
        if let Some(path) = file {
            std::fs::metadata(path).map_err(|source| ConfigError::Read {
                path: path.to_owned(),
                source,
            })?;
            figment = figment.merge(Toml::file_exact(path));
        }
        Self::extract(figment.merge(env_provider()))
    }

    /// Defaults, then the TOML text `toml` (no environment), then [`Config::validate`].
    /// Errors as [`Config::load`].
    pub fn from_toml_str(toml: &str) -> Result<Config, ConfigError> {
        Self::extract(Figment::from(Toml::string(toml)))
    }

    fn extract(figment: Figment) -> Result<Config, ConfigError> {
        let mut config: Config = figment.extract().map_err(from_figment)?;
        config
            .kafka
            .read_property_files()
            .map_err(|e| ConfigError::from(e).located(&figment))?;
        config
            .nats
            .read_secret_files()
            .map_err(|e| ConfigError::from(e).located(&figment))?;
        config.validate().map_err(|e| e.located(&figment))?;
        Ok(config)
    }

    /// Checks every value against its allowed range, tenant names against the §2 alphabet,
    /// and every resolved policy (each tenant after inheritance) with
    /// [`PolicySpec::validate`]. Run by the loaders; call it again after changing a `Config`
    /// in code (e.g. from CLI flags).
    ///
    /// Errors: [`ConfigError::Invalid`] for the first bad key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.debounce.validate()?;
        self.store.validate()?;
        self.runtime.validate()?;
        self.kafka.validate()?;
        let nats = self.nats.validate().and_then(|()| match self.transport {
            Transport::Nats => self.nats.check_output_subjects(&self.tiers),
            Transport::Kafka => Ok(()),
        });
        nats?;
        self.admin.validate()?;
        shadow::validate(&self.shadow, &self.debounce)?;
        Ok(self.tiers.validate()?)
    }

    /// The `[[shadow]]` policies in engine form (SEMANTICS §8): keys not set inherited from
    /// `[debounce]`, budget `runtime.shadow-max-sessions`. Empty without `[[shadow]]`.
    pub fn shadow_specs(&self) -> Vec<ShadowSpec> {
        shadow::specs(
            &self.shadow,
            &self.debounce,
            self.runtime.shadow_max_sessions,
        )
    }

    /// The policies in engine form (ms): `[debounce]` as the default and one entry per
    /// `[debounce.tenants.NAME]` with unset keys inherited from `[debounce]`.
    pub fn policy_table(&self) -> PolicyTable {
        let d = &self.debounce;
        PolicyTable {
            default: d.spec(),
            tenants: d
                .tenants
                .iter()
                .map(|(name, o)| (name.clone(), d.with_override(o).spec()))
                .collect(),
        }
    }
}

impl DebounceConfig {
    /// This section as an engine policy (ms); durations over `i64::MAX` ms saturate.
    pub fn spec(&self) -> PolicySpec {
        PolicySpec {
            name: self.policy,
            delay: millis(self.delay),
            min_delay: millis(self.min_delay),
            max_delay: millis(self.max_delay),
            max_wait: self.max_wait.map(millis),
            state_ttl: millis(self.state_ttl),
            learn_initial_delay: self.learn_initial_delay,
            event_ids: self.event_ids,
        }
    }

    /// The section a tenant sees: `o`'s keys over this section's (no nested tenants).
    pub fn with_override(&self, o: &TenantOverride) -> DebounceConfig {
        DebounceConfig {
            policy: o.policy.unwrap_or(self.policy),
            delay: o.delay.unwrap_or(self.delay),
            min_delay: o.min_delay.unwrap_or(self.min_delay),
            max_delay: o.max_delay.unwrap_or(self.max_delay),
            max_wait: o.max_wait.unwrap_or(self.max_wait),
            state_ttl: o.state_ttl.unwrap_or(self.state_ttl),
            learn_initial_delay: o.learn_initial_delay.unwrap_or(self.learn_initial_delay),
            event_ids: o.event_ids.unwrap_or(self.event_ids),
            tenants: BTreeMap::new(),
        }
    }

    /// The section that gives `spec` (durations from its ms, no tenants): the start of a
    /// tenant override set while settle runs (`runtime::overrides`), which inherits the keys
    /// it does not set from the rule in force for the tenant.
    pub fn from_spec(spec: &PolicySpec) -> DebounceConfig {
        let d = |ms: Millis| Duration::from_millis(u64::try_from(ms).unwrap_or(0));
        DebounceConfig {
            policy: spec.name,
            delay: d(spec.delay),
            min_delay: d(spec.min_delay),
            max_delay: d(spec.max_delay),
            max_wait: spec.max_wait.map(d),
            state_ttl: d(spec.state_ttl),
            learn_initial_delay: spec.learn_initial_delay,
            event_ids: spec.event_ids,
            tenants: BTreeMap::new(),
        }
    }

    /// Checks this section (tenants aside) by the rules of `[debounce]` (ranges, whole ms,
    /// `max-delay >= min-delay`, [`PolicySpec::validate`]), naming keys under `section`
    /// (`debounce.max-delay`): how a tenant override set while settle runs is checked
    /// (SEMANTICS §7), with the message a config file would get.
    ///
    /// Errors: [`ConfigError::Invalid`] for the first bad key.
    pub fn validate_as(&self, section: &str) -> Result<(), ConfigError> {
        check_debounce_durations(section, self)?;
        check_spec(section, self, "")
    }

    fn validate(&self) -> Result<(), ConfigError> {
        check_debounce_durations("debounce", self)?;
        check_spec("debounce", self, "")?;
        for (name, o) in &self.tenants {
            let section = format!("debounce.tenants.{name}");
            if validate_tenant(name).is_err() {
                return Err(invalid(
                    &section,
                    format!(
                        "invalid tenant name {name:?}: tenant names are 1-128 bytes of \
                         [A-Za-z0-9._:-] (SEMANTICS §2)"
                    ),
                ));
            }
            let resolved = self.with_override(o);
            check_debounce_durations(&section, &resolved)?;
            check_spec(
                &section,
                &resolved,
                " (keys not set for the tenant are inherited from [debounce])",
            )?;
        }
        Ok(())
    }
}

impl StoreConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.data_dir.as_os_str().is_empty() {
            return Err(invalid("store.data-dir", "must not be empty".into()));
        }
        check_duration("store.flush-interval", self.flush_interval, 10_000, "10s")?;
        check_int("store.flush-max-dirty", self.flush_max_dirty, 1_000_000)?;
        check_int("store.session-cache-mib", self.session_cache_mib, 65_536)
    }
}

impl RuntimeConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        check_int("runtime.catch-up-rate", self.catch_up_rate, 1_000_000)?;
        check_int("runtime.batch-size", self.batch_size, 100_000)?;
        check_duration(
            "runtime.shutdown-deadline",
            self.shutdown_deadline,
            60 * 60 * 1000,
            "1h",
        )?;
        check_duration("runtime.idle-tick", self.idle_tick, 60 * 1000, "60s")?;
        check_int(
            "runtime.shadow-max-sessions",
            self.shadow_max_sessions,
            shadow::MAX_SHADOW_SESSIONS,
        )
    }
}

/// This machine's host name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`, else `settle`):
/// the first part of the default instance names (`kafka.instance-id`, NATS tier counts).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "settle".to_owned())
}

fn millis(d: Duration) -> Millis {
    Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
}

fn invalid(key: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_owned(),
        message,
        origin: String::new(),
    }
}

fn check_int(key: &str, v: u32, max: u32) -> Result<(), ConfigError> {
    if v < 1 || v > max {
        return Err(invalid(key, format!("must be 1 to {max}, got {v}")));
    }
    Ok(())
}

/// A duration must be a whole number of ms in `1ms..=max_ms`.
fn check_duration(key: &str, d: Duration, max_ms: Millis, max: &str) -> Result<(), ConfigError> {
    let shown = humantime::format_duration(d);
    if d.subsec_millis() * 1_000_000 != d.subsec_nanos() {
        return Err(invalid(
            key,
            format!("must be a whole number of milliseconds, got {shown}"),
        ));
    }
    let ms = millis(d);
    if ms < 1 || ms > max_ms {
        return Err(invalid(
            key,
            format!("must be 1ms to {max}, got \"{shown}\""),
        ));
    }
    Ok(())
}

fn check_debounce_durations(section: &str, d: &DebounceConfig) -> Result<(), ConfigError> {
    let max = MAX_DEBOUNCE_DURATION_MS;
    let keys = [
        ("delay", Some(d.delay)),
        ("min-delay", Some(d.min_delay)),
        ("max-delay", Some(d.max_delay)),
        ("max-wait", d.max_wait),
        ("state-ttl", Some(d.state_ttl)),
    ];
    for (key, value) in keys {
        if let Some(v) = value {
            check_duration(&format!("{section}.{key}"), v, max, "365days")?;
        }
    }
    Ok(())
}

/// Checks `max-delay >= min-delay` of an adaptive `d` (in the units the user wrote: "must be
/// at least min-delay: max-delay is 10m, min-delay 20m"), then runs [`PolicySpec::validate`],
/// whose message starts with the key it is about.
fn check_spec(section: &str, d: &DebounceConfig, note: &str) -> Result<(), ConfigError> {
    if d.policy == PolicyName::Adaptive && d.max_delay < d.min_delay {
        return Err(invalid(
            &format!("{section}.max-delay"),
            format!(
                "must be at least min-delay: max-delay is {}, min-delay {}{note}",
                humantime::format_duration(d.max_delay),
                humantime::format_duration(d.min_delay)
            ),
        ));
    }
    d.spec().validate().map_err(|message| {
        let key = message.split_whitespace().next().unwrap_or_default();
        let key = match key {
            "delay" | "min-delay" | "max-delay" | "max-wait" | "state-ttl" | "event-ids" => {
                format!("{section}.{key}")
            }
            _ => section.to_owned(),
        };
        invalid(&key, format!("{message}{note}"))
    })
}

/// `SETTLE_A__B_C=v` → key `a.b-c`; only variables with a `__`, and `SETTLE_TRANSPORT`.
fn env_provider() -> Env {
    Env::prefixed("SETTLE_")
        .filter(|k| k.as_str().contains("__") || k.as_str().eq_ignore_ascii_case("transport"))
        .map(|k| k.as_str().replace("__", ".").replace('_', "-").into())
}

/// The environment variable that sets `path` (e.g. `SETTLE_DEBOUNCE__MIN_DELAY`).
pub fn env_var_for(path: &str) -> String {
    let mut name = String::from("SETTLE_");
    name.push_str(
        &path
            .replace('.', "__")
            .replace('-', "_")
            .to_ascii_uppercase(),
    );
    name
}

/// What is allowed at a key, by its last segment (for parse error messages).
fn allowed(last: &str) -> Option<&'static str> {
    Some(match last {
        "policy" => "expected one of fixed, leading-trailing, adaptive",
        "delay" | "min-delay" | "max-delay" | "state-ttl" => {
            "expected a duration such as \"500ms\", \"10s\" or \"5m\", 1ms to 365days"
        }
        "max-wait" => {
            "expected a duration such as \"500ms\", \"10s\" or \"5m\", 1ms to 365days, or \"off\""
        }
        "shutdown-deadline" => "expected a duration such as \"30s\", 1ms to 1h",
        "idle-tick" => "expected a duration such as \"100ms\", 1ms to 60s",
        "catch-up-rate" => "expected an integer 1 to 1000000 (emissions/s)",
        "batch-size" => "expected an integer 1 to 100000 (uploads)",
        "event-ids" => "expected an integer 0 to 100000 (event ids listed per ready record)",
        "shadow-max-sessions" => "expected an integer 1 to 10000000 (session keys)",
        "data-dir" => "expected a directory path (string)",
        "transport" => "expected one of kafka, nats",
        "listen" => "expected an IP address and port such as \"127.0.0.1:9464\"",
        "enabled" | "learn-initial-delay" | "actions" | "protect-reads" => "expected true or false",
        "storage" => "expected one of file, memory",
        "heartbeat-interval" => "expected a duration such as \"5s\", 1s to 1h",
        _ => return None,
    })
}

fn from_figment(e: figment::Error) -> ConfigError {
    use figment::error::Kind;
    let mut path = e.path.join(".");
    let message = match &e.kind {
        Kind::UnknownField(field, expected) => {
            // figment's path usually ends with the unknown key already.
            if e.path.last() != Some(field) {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(field);
            }
            format!("unknown key; expected one of: {}", expected.join(", "))
        }
        other => {
            let last = e.path.last().map(String::as_str).unwrap_or_default();
            let hint = match other {
                Kind::UnknownVariant(..)
                | Kind::InvalidType(..)
                | Kind::InvalidValue(..)
                | Kind::Message(_) => allowed(last),
                _ => None,
            };
            let what = match other {
                Kind::UnknownVariant(found, _) => format!("unknown value {found:?}"),
                _ => other.to_string(),
            };
            match hint {
                Some(h) => format!("{what}; {h}"),
                None => what,
            }
        }
    };
    let origin = e
        .metadata
        .as_ref()
        .map_or_else(String::new, |md| origin_of(md, &path, true));
    ConfigError::Parse {
        key: path,
        message,
        origin,
    }
}

/// serde for `Duration` as a humantime string.
mod duration {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::borrow::Cow;
    use std::time::Duration;

    pub fn parse(text: &str) -> Result<Duration, String> {
        humantime::parse_duration(text.trim())
            .map_err(|e| format!("invalid duration {text:?}: {e}"))
    }

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = Cow::<str>::deserialize(d)?;
        parse(&text).map_err(serde::de::Error::custom)
    }
}

/// serde for an optional `Duration` (tenant keys: absent = inherit).
mod opt_duration {
    use serde::{Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::duration::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        super::duration::deserialize(d).map(Some)
    }
}

/// serde for `max-wait`: a duration or `"off"` (= none).
mod max_wait {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::borrow::Cow;
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::duration::serialize(d, s),
            None => s.serialize_str("off"),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text = Cow::<str>::deserialize(d)?;
        match text.trim() {
            "off" => Ok(None),
            t => super::duration::parse(t)
                .map(Some)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// serde for a tenant's `max-wait`: absent = inherit, `"off"` = none, else a duration.
mod tenant_max_wait {
    use serde::{Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Option<Option<Duration>>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(v) => super::max_wait::serialize(v, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Option<Duration>>, D::Error> {
        super::max_wait::deserialize(d).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EVENT_IDS_MAX;

    fn err(toml: &str) -> ConfigError {
        match Config::from_toml_str(toml) {
            Ok(c) => panic!("expected an error for {toml:?}, got {c:?}"),
            Err(e) => e,
        }
    }

    /// The error names `key` and its text contains every one of `words`.
    fn assert_err(toml: &str, key: &str, words: &[&str]) {
        let e = err(toml);
        assert_eq!(e.key(), Some(key), "{e}");
        let text = e.to_string();
        assert!(text.starts_with(key), "{text}");
        for w in words {
            assert!(text.contains(w), "{text:?} should contain {w:?}");
        }
    }

    #[test]
    fn empty_file_gives_the_defaults() {
        let c = Config::from_toml_str("").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.debounce.policy, PolicyName::Adaptive);
        assert_eq!(c.store.data_dir, PathBuf::from("./settle-data"));
        assert_eq!(c.runtime.catch_up_rate, 1000);
        assert_eq!(c.runtime.batch_size, 1000);
        assert_eq!(c.runtime.shutdown_deadline, Duration::from_secs(30));
        assert_eq!(c.runtime.idle_tick, Duration::from_millis(100));
        let table = c.policy_table();
        assert_eq!(
            table,
            PolicyTable::uniform(PolicySpec {
                delay: 10_000,
                ..PolicySpec::adaptive(5_000, 600_000)
            })
        );
        assert_eq!(table.default.state_ttl, 24 * 60 * 60 * 1000);
        assert_eq!(table.default.max_wait, None);
    }

    #[test]
    fn full_file() {
        let c = Config::from_toml_str(
            r#"
            [debounce]
            policy = "leading-trailing"
            delay = "500ms"
            min-delay = "1s"
            max-delay = "2m"
            max-wait = "30m"
            state-ttl = "48h"
            [debounce.tenants.acme]
            policy = "fixed"
            delay = "250ms"
            [debounce.tenants."big.co:eu"]
            policy = "adaptive"
            max-wait = "off"
            [store]
            data-dir = "/var/lib/settle"
            [runtime]
            catch-up-rate = 50
            shutdown-deadline = "10s"
            batch-size = 64
            idle-tick = "20ms"
            "#,
        )
        .unwrap();
        assert_eq!(c.store.data_dir, PathBuf::from("/var/lib/settle"));
        assert_eq!(
            c.runtime,
            RuntimeConfig {
                catch_up_rate: 50,
                shutdown_deadline: Duration::from_secs(10),
                batch_size: 64,
                idle_tick: Duration::from_millis(20),
                shadow_max_sessions: 100_000,
            }
        );
        let t = c.policy_table();
        let base = PolicySpec {
            name: PolicyName::LeadingTrailing,
            delay: 500,
            min_delay: 1_000,
            max_delay: 120_000,
            max_wait: Some(1_800_000),
            state_ttl: 48 * 3_600_000,
            learn_initial_delay: false,
            event_ids: 0,
        };
        assert_eq!(t.default, base);
        assert_eq!(
            t.for_tenant("acme"),
            &PolicySpec {
                name: PolicyName::Fixed,
                delay: 250,
                ..base.clone()
            }
        );
        assert_eq!(
            t.for_tenant("big.co:eu"),
            &PolicySpec {
                name: PolicyName::Adaptive,
                max_wait: None,
                ..base.clone()
            }
        );
        assert_eq!(t.for_tenant("other"), &base);
        assert_eq!(t.tenants.len(), 2);
    }

    #[test]
    fn tenant_override_inherits_unset_keys() {
        let c = Config::from_toml_str(
            r#"
            [debounce]
            max-wait = "1h"
            state-ttl = "2h"
            [debounce.tenants.acme]
            policy = "fixed"
            delay = "500ms"
            [debounce.tenants.slow]
            max-delay = "20m"
            "#,
        )
        .unwrap();
        let t = c.policy_table();
        let acme = t.for_tenant("acme");
        assert_eq!(acme.name, PolicyName::Fixed);
        assert_eq!(acme.delay, 500);
        assert_eq!(acme.max_wait, Some(3_600_000));
        assert_eq!(acme.state_ttl, 7_200_000);
        let slow = t.for_tenant("slow");
        assert_eq!(slow.name, PolicyName::Adaptive);
        assert_eq!((slow.min_delay, slow.max_delay), (5_000, 1_200_000));
        assert_eq!(slow.max_wait, Some(3_600_000));
        // The overrides keep only what was written.
        assert_eq!(
            c.debounce.tenants["slow"],
            TenantOverride {
                max_delay: Some(Duration::from_secs(1200)),
                ..TenantOverride::default()
            }
        );
    }

    #[test]
    fn unknown_keys_are_rejected_by_full_path() {
        assert_err("colour = 1", "colour", &["unknown key", "debounce"]);
        assert_err("[kafkaa]\nbrokers = 1", "kafkaa", &["unknown key"]);
        assert_err(
            "[debounce]\ndelays = \"1s\"",
            "debounce.delays",
            &["unknown key", "delay"],
        );
        assert_err(
            "[debounce.tenants.acme]\ndely = \"1s\"",
            "debounce.tenants.acme.dely",
            &["unknown key", "max-wait"],
        );
        assert_err("[store]\ndata_dir = \"x\"", "store.data_dir", &["data-dir"]);
        assert_err(
            "[runtime]\nbatchsize = 1",
            "runtime.batchsize",
            &["batch-size"],
        );
    }

    #[test]
    fn bad_durations_name_the_key_and_the_range() {
        let range = "1ms to 365days";
        assert_err(
            "[debounce]\ndelay = \"5 parsecs\"",
            "debounce.delay",
            &["invalid duration", "5 parsecs", range],
        );
        assert_err(
            "[debounce]\ndelay = 10",
            "debounce.delay",
            &["500ms", range],
        );
        assert_err(
            "[debounce.tenants.acme]\ndelay = \"soon\"",
            "debounce.tenants.acme.delay",
            &["invalid duration", range],
        );
        assert_err(
            "[debounce]\nmax-wait = \"never\"",
            "debounce.max-wait",
            &["\"off\""],
        );
        assert_err(
            "[debounce]\ndelay = \"0s\"",
            "debounce.delay",
            &[range, "0s"],
        );
        assert_err(
            "[debounce]\nstate-ttl = \"400days\"",
            "debounce.state-ttl",
            &[range],
        );
        assert_err(
            "[debounce]\nmin-delay = \"1500us\"",
            "debounce.min-delay",
            &["whole number of milliseconds"],
        );
        assert_err(
            "[runtime]\nidle-tick = \"2m\"",
            "runtime.idle-tick",
            &["1ms to 60s"],
        );
        assert_err(
            "[runtime]\nshutdown-deadline = \"nope\"",
            "runtime.shutdown-deadline",
            &["1ms to 1h"],
        );
        // Durations a policy does not use are still checked.
        assert_err(
            "[debounce]\npolicy = \"fixed\"\nmin-delay = \"0ms\"",
            "debounce.min-delay",
            &[range],
        );
    }

    #[test]
    fn bad_policy_name() {
        assert_err(
            "[debounce]\npolicy = \"lodash\"",
            "debounce.policy",
            &["lodash", "fixed", "leading-trailing", "adaptive"],
        );
        assert_err(
            "[debounce.tenants.acme]\npolicy = \"Fixed\"",
            "debounce.tenants.acme.policy",
            &["Fixed", "leading-trailing"],
        );
    }

    #[test]
    fn learn_initial_delay_is_a_bool_inherited_by_tenants() {
        let c = Config::from_toml_str(
            "[debounce]\nlearn-initial-delay = true\n[debounce.tenants.acme]\nmin-delay = \"1s\"\n\
             [debounce.tenants.beta]\nlearn-initial-delay = false",
        )
        .unwrap();
        let t = c.policy_table();
        assert!(t.default.learns());
        assert!(t.for_tenant("acme").learns(), "inherited");
        assert!(!t.for_tenant("beta").learns(), "overridden");
        assert_err(
            "[debounce]\nlearn-initial-delay = \"yes\"",
            "debounce.learn-initial-delay",
            &["expected true or false"],
        );
    }

    #[test]
    fn event_ids_is_a_count_inherited_by_tenants() {
        let c = Config::from_toml_str(
            "[debounce]\nevent-ids = 64\n[debounce.tenants.acme]\ndelay = \"1s\"\n\
             [debounce.tenants.beta]\nevent-ids = 0\n[debounce.tenants.gamma]\nevent-ids = 100000",
        )
        .unwrap();
        let t = c.policy_table();
        assert_eq!(t.default.event_ids, 64);
        assert_eq!(t.for_tenant("acme").event_ids, 64, "inherited");
        assert_eq!(t.for_tenant("beta").event_ids, 0, "overridden");
        assert_eq!(t.for_tenant("gamma").event_ids, EVENT_IDS_MAX);
        assert_eq!(Config::default().policy_table().default.event_ids, 0);
        assert!(
            t.default.to_string().ends_with(" event-ids=64"),
            "{}",
            t.default
        );
        assert!(!t.for_tenant("beta").to_string().contains("event-ids"));
        assert_err(
            "[debounce]\nevent-ids = 100001",
            "debounce.event-ids",
            &["0 to 100000", "100001"],
        );
        assert_err(
            "[debounce.tenants.acme]\nevent-ids = 200000",
            "debounce.tenants.acme.event-ids",
            &["0 to 100000"],
        );
        assert_err(
            "[debounce]\nevent-ids = -1",
            "debounce.event-ids",
            &["expected an integer 0 to 100000"],
        );
    }

    #[test]
    fn min_delay_above_max_delay() {
        assert_err(
            "[debounce]\nmin-delay = \"20m\"\nmax-delay = \"10m\"",
            "debounce.max-delay",
            &["must be at least min-delay: max-delay is 10m, min-delay 20m"],
        );
        // Only an adaptive policy uses them.
        assert!(Config::from_toml_str(
            "[debounce]\npolicy = \"fixed\"\nmin-delay = \"2m\"\nmax-delay = \"1m\""
        )
        .is_ok());
        // Checked again for each tenant after inheritance.
        assert_err(
            "[debounce.tenants.acme]\nmin-delay = \"20m\"",
            "debounce.tenants.acme.max-delay",
            &[
                "max-delay is 10m, min-delay 20m",
                "inherited from [debounce]",
            ],
        );
    }

    #[test]
    fn tenant_names_follow_the_tenant_alphabet() {
        assert_err(
            "[debounce.tenants.\"acme corp\"]\ndelay = \"1s\"",
            "debounce.tenants.acme corp",
            &["invalid tenant name", "[A-Za-z0-9._:-]"],
        );
        let long = "t".repeat(129);
        let e = err(&format!("[debounce.tenants.{long}]\ndelay = \"1s\""));
        assert!(e.to_string().contains("invalid tenant name"), "{e}");
        assert!(Config::from_toml_str("[debounce.tenants.\"a.b:c_d-1\"]").is_ok());
    }

    #[test]
    fn runtime_and_store_ranges() {
        assert_err(
            "[runtime]\nbatch-size = 0",
            "runtime.batch-size",
            &["1 to 100000"],
        );
        assert_err(
            "[runtime]\ncatch-up-rate = 2000000",
            "runtime.catch-up-rate",
            &["1 to 1000000"],
        );
        assert_err(
            "[runtime]\ncatch-up-rate = -1",
            "runtime.catch-up-rate",
            &["1 to 1000000"],
        );
        assert_err("[store]\ndata-dir = \"\"", "store.data-dir", &["empty"]);
    }

    #[test]
    fn malformed_toml() {
        let e = err("[debounce\npolicy = 1");
        assert!(matches!(e, ConfigError::Parse { .. }), "{e:?}");
        assert_eq!(e.key(), None);
    }

    #[test]
    fn serializes_back_to_an_equal_config() {
        let c = Config::from_toml_str(
            r#"
            [debounce]
            max-wait = "45m"
            [debounce.tenants.acme]
            policy = "fixed"
            delay = "750ms"
            max-wait = "off"
            "#,
        )
        .unwrap();
        let text = toml::to_string(&c).unwrap();
        assert_eq!(Config::from_toml_str(&text).unwrap(), c, "{text}");
        let defaults = toml::to_string(&Config::default()).unwrap();
        assert_eq!(Config::from_toml_str(&defaults).unwrap(), Config::default());
    }

    #[test]
    fn env_var_names() {
        assert_eq!(
            env_var_for("debounce.min-delay"),
            "SETTLE_DEBOUNCE__MIN_DELAY"
        );
        assert_eq!(
            env_var_for("debounce.tenants.acme.delay"),
            "SETTLE_DEBOUNCE__TENANTS__ACME__DELAY"
        );
    }
}
