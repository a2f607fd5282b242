//! `[nats]`: the NATS JetStream transport's section of the config tree (servers, auth and
//! TLS, streams, subjects, partitions and this instance's share of them) and its
//! validation. The transport (`crate::transport::nats`) connects and names its streams,
//! subjects and consumers from it.

use super::tiers::TiersConfig;
use super::KeyError;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

/// JetStream storage of the streams settle creates (`nats.storage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Storage {
    /// On disk: survives a server restart (the default).
    #[default]
    File,
    /// In memory: lost when the server restarts (tests, throwaway setups).
    Memory,
}

/// A config value that must not be printed (token, password): `Debug` shows `"***"`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"***\"")
    }
}

/// `[nats]`: where the NATS transport connects, its streams, subjects and consumers, and
/// which partitions this instance owns. Output subjects are the tier topics of `[tiers]`.
///
/// ```toml
/// [nats]
/// servers = "nats://n1:4222,nats://n2:4222"
/// credentials-file = "/etc/settle/settle.creds"
/// partitions = 16
/// instance = 2          # of
/// instances = 4         # owns partitions 2, 6, 10, 14
/// ```
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct NatsConfig {
    /// `servers`: comma-separated server URLs (`nats://host:port`, `tls://host:port`;
    /// user and password or a token may be in the URL). Default `nats://127.0.0.1:4222`.
    pub servers: String,
    /// `credentials-file`: a NATS `.creds` file (JWT + NKey seed). Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credentials_file: Option<PathBuf>,
    /// `token`: authentication token. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<Secret>,
    /// `user`: user name (with `password`). Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// `password`: password of `user`. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password: Option<Secret>,
    /// `tls-required`: refuse to connect without TLS (default false; `tls://` URLs imply it).
    pub tls_required: bool,
    /// `tls-ca-file`: PEM root certificates to verify the server with. Default: system roots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<PathBuf>,
    /// `tls-cert-file`: PEM client certificate (with `tls-key-file`). Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<PathBuf>,
    /// `tls-key-file`: PEM private key of `tls-cert-file`. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<PathBuf>,
    /// `input-stream`: the stream of the uploads (default `SETTLE_UPLOADS`); also the store
    /// directory name under `store.data-dir`.
    pub input_stream: String,
    /// `input-subject-prefix`: partition `p`'s uploads go to `<prefix>.<p>` (default
    /// `settle.uploads`).
    pub input_subject_prefix: String,
    /// `partitions`: number of input partitions, 1–10 000 (default 8). Never change it once
    /// data flows.
    pub partitions: u32,
    /// `instance`: index of this instance, `0..instances` (default 0).
    pub instance: u32,
    /// `instances`: number of settle instances sharing the partitions, 1..=`partitions`
    /// (default 1).
    pub instances: u32,
    /// `consumer-prefix`: durable consumer of partition `p` is `<prefix>-<p>` (default
    /// `settle`).
    pub consumer_prefix: String,
    /// `dead-letter-subject`: where records that fail decoding go (default
    /// `settle.dead-letter`); in the output stream.
    pub dead_letter_subject: String,
    /// `output-stream`: the stream of the tier subjects, the tier-events subject and the
    /// dead-letter subject (default `SETTLE_READY`).
    pub output_stream: String,
    /// `storage`: `file` (default) or `memory`, for the streams settle creates.
    pub storage: Storage,
    /// `replicas`: replicas of the streams settle creates, 1–5 (default 1).
    pub replicas: u32,
    /// `max-age`: messages older than this are removed from the streams settle creates
    /// (default 7 days; 1 s – 10 years).
    #[serde(with = "humantime_serde")]
    pub max_age: Duration,
    /// `duplicate-window`: how long the output stream remembers emission ids to drop
    /// re-published ones (default 5 min; 1 s – `max-age`). A process that restarts later
    /// than this after a crash may publish an emission twice (same id).
    #[serde(with = "humantime_serde")]
    pub duplicate_window: Duration,
    /// `ack-wait`: how long the server waits for the ack of a delivered upload before it
    /// redelivers it (default 5 min; 1 s – 24 h).
    #[serde(with = "humantime_serde")]
    pub ack_wait: Duration,
    /// `max-ack-pending`: most uploads delivered and not yet acked per partition
    /// (default 100 000; 1 000 – 10 000 000).
    pub max_ack_pending: u32,
    /// `changelog-stream`: name prefix of the changelog streams (ARCHITECTURE "changelog",
    /// `transport::nats::changelog`): partition `p`'s store writes go to stream
    /// `<changelog-stream>-<p>`, compacted per key (`max-msgs-per-subject = 1`), which also
    /// fences a second writer of the partition. Default: derived from the deployment's
    /// identity ([`NatsConfig::changelog`]): `SETTLE_CHANGELOG` for the default deployment
    /// (`input-stream` and `consumer-prefix` at their defaults), else
    /// `<input-stream>_<consumer-prefix>_CHANGELOG`, so two deployments on one account never
    /// share one. `""` turns the changelog off (a partition's pending rounds then stay on
    /// the instance that owned it, and two instances given one index both emit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub changelog_stream: Option<String>,
    /// `changelog-subject-prefix`: partition `p`'s changelog records are on subjects
    /// `<prefix>.<p>.<hex of the record key>`. Default: `settle.changelog` for the default
    /// deployment, else `settle.changelog.<input-stream>.<consumer-prefix>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub changelog_subject_prefix: Option<String>,
    /// `changelog-snapshot-kib`: a partition's changelog is compacted once this many KiB of
    /// store changes were appended since its last snapshot and at least twice the last
    /// snapshot's size (default 65 536 = 64 MiB; 16 – 67 108 864): the owner appends its whole store as a
    /// snapshot and purges the stream below it (`transport::nats::changelog`, "Compaction").
    /// Smaller keeps the streams smaller and costs more snapshots.
    pub changelog_snapshot_kib: u32,
    /// `tier-counts-bucket`: the JetStream KV bucket where the instances exchange their
    /// per-tenant emission counts every `tiers.share-interval` (key = instance), so tiers
    /// follow the deployment's rate and outlive restarts (SEMANTICS §5), and their partition
    /// assignments every `heartbeat-interval` (key `assignment.<instance>`). Created if
    /// missing (history 1, `nats.storage`, `nats.replicas`). Default: `SETTLE_TIER_COUNTS`
    /// for the default deployment, else `<input-stream>_<consumer-prefix>_TIER_COUNTS`;
    /// `""` turns sharing off (each instance then measures only its own emissions, and
    /// partitions nobody owns go unnoticed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier_counts_bucket: Option<String>,
    /// `overrides-bucket`: the JetStream KV bucket that holds the tenant overrides set
    /// through the admin API (SEMANTICS §7; key = tenant, history 1, no expiry), shared by
    /// every instance and kept across restarts. Created if missing (`nats.storage`,
    /// `nats.replicas`). Default: `SETTLE_OVERRIDES` for the default deployment, else
    /// `<input-stream>_<consumer-prefix>_OVERRIDES`; `""` turns overrides off (the admin API
    /// then refuses them with 503).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overrides_bucket: Option<String>,
    /// `heartbeat-interval`: how often this instance writes which partitions it owns into
    /// the tier-counts bucket and reads the other instances' (1 s – 1 h, default 5 s); an
    /// instance not heard of for 3 intervals counts as gone, and partitions no live instance
    /// owns are reported (log and `settle_partitions_unowned`).
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// `token-file`: a file holding the authentication token (read at start, trailing
    /// newline trimmed; never logged). Not together with `token`. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// `password-file`: a file holding the password of `user` (read at start, trailing
    /// newline trimmed; never logged). Not together with `password`. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
    /// The token read from `token-file` by [`NatsConfig::read_secret_files`] (not a key).
    #[serde(skip)]
    pub token_from_file: Option<Secret>,
    /// The password read from `password-file` by [`NatsConfig::read_secret_files`] (not a
    /// key).
    #[serde(skip)]
    pub password_from_file: Option<Secret>,
}

impl std::fmt::Debug for NatsConfig {
    /// Every field; `servers` with the password of a URL redacted ([`NatsConfig::servers_shown`]),
    /// tokens and passwords (inline or read from a file) as `"***"` ([`Secret`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let NatsConfig {
            servers: _,
            credentials_file,
            token,
            user,
            password,
            tls_required,
            tls_ca_file,
            tls_cert_file,
            tls_key_file,
            input_stream,
            input_subject_prefix,
            partitions,
            instance,
            instances,
            consumer_prefix,
            dead_letter_subject,
            output_stream,
            storage,
            replicas,
            max_age,
            duplicate_window,
            ack_wait,
            max_ack_pending,
            changelog_stream,
            changelog_subject_prefix,
            changelog_snapshot_kib,
            tier_counts_bucket,
            overrides_bucket,
            heartbeat_interval,
            token_file,
            password_file,
            token_from_file,
            password_from_file,
        } = self;
        f.debug_struct("NatsConfig")
            .field("servers", &self.servers_shown())
            .field("credentials_file", credentials_file)
            .field("token", token)
            .field("user", user)
            .field("password", password)
            .field("tls_required", tls_required)
            .field("tls_ca_file", tls_ca_file)
            .field("tls_cert_file", tls_cert_file)
            .field("tls_key_file", tls_key_file)
            .field("input_stream", input_stream)
            .field("input_subject_prefix", input_subject_prefix)
            .field("partitions", partitions)
            .field("instance", instance)
            .field("instances", instances)
            .field("consumer_prefix", consumer_prefix)
            .field("dead_letter_subject", dead_letter_subject)
            .field("output_stream", output_stream)
            .field("storage", storage)
            .field("replicas", replicas)
            .field("max_age", max_age)
            .field("duplicate_window", duplicate_window)
            .field("ack_wait", ack_wait)
            .field("max_ack_pending", max_ack_pending)
            .field("changelog_stream", changelog_stream)
            .field("changelog_subject_prefix", changelog_subject_prefix)
            .field("changelog_snapshot_kib", changelog_snapshot_kib)
            .field("tier_counts_bucket", tier_counts_bucket)
            .field("overrides_bucket", overrides_bucket)
            .field("heartbeat_interval", heartbeat_interval)
            .field("token_file", token_file)
            .field("password_file", password_file)
            .field("token_from_file", token_from_file)
            .field("password_from_file", password_from_file)
            .finish()
    }
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            servers: "nats://127.0.0.1:4222".to_owned(),
            credentials_file: None,
            token: None,
            user: None,
            password: None,
            tls_required: false,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            input_stream: "SETTLE_UPLOADS".to_owned(),
            input_subject_prefix: "settle.uploads".to_owned(),
            partitions: 8,
            instance: 0,
            instances: 1,
            consumer_prefix: "settle".to_owned(),
            dead_letter_subject: "settle.dead-letter".to_owned(),
            output_stream: "SETTLE_READY".to_owned(),
            storage: Storage::File,
            replicas: 1,
            max_age: Duration::from_secs(7 * 24 * 3600),
            duplicate_window: Duration::from_secs(300),
            ack_wait: Duration::from_secs(300),
            max_ack_pending: 100_000,
            changelog_stream: None,
            changelog_subject_prefix: None,
            changelog_snapshot_kib: 65_536,
            tier_counts_bucket: None,
            overrides_bucket: None,
            heartbeat_interval: Duration::from_secs(5),
            token_file: None,
            password_file: None,
            token_from_file: None,
            password_from_file: None,
        }
    }
}

/// A `[nats]` value that cannot be used: `key` is the full dotted key (`nats.partitions`),
/// `message` says what is wrong and what is allowed.
pub type NatsConfigError = KeyError;

/// A subject settle publishes to or derives from: dot-separated tokens of printable ASCII
/// without whitespace or wildcards, no empty token, at most 255 bytes.
fn check_subject(key: &str, subject: &str) -> Result<(), NatsConfigError> {
    let ok = !subject.is_empty()
        && subject.len() <= 255
        && subject.split('.').all(|t| {
            !t.is_empty()
                && t != "*"
                && t != ">"
                && t.bytes()
                    .all(|b| b.is_ascii_graphic() && b != b'*' && b != b'>')
        });
    if !ok {
        return Err(KeyError::new(
            key,
            format!(
                "invalid NATS subject {subject:?}: dot-separated non-empty tokens of printable \
                 ASCII, no spaces or wildcards (* >), at most 255 bytes"
            ),
        ));
    }
    Ok(())
}

/// A stream or consumer name: 1–200 bytes of `[A-Za-z0-9_-]`.
fn check_name(key: &str, name: &str) -> Result<(), NatsConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !ok {
        return Err(KeyError::new(
            key,
            format!("invalid name {name:?}: 1-200 bytes of [A-Za-z0-9_-]"),
        ));
    }
    Ok(())
}

fn check_range(key: &str, v: u64, min: u64, max: u64) -> Result<(), NatsConfigError> {
    if v < min || v > max {
        return Err(KeyError::new(
            key,
            format!("must be {min} to {max}, got {v}"),
        ));
    }
    Ok(())
}

fn check_span(key: &str, d: Duration, min: Duration, max: Duration) -> Result<(), NatsConfigError> {
    if d < min || d > max {
        return Err(KeyError::new(
            key,
            format!(
                "must be {} to {}, got \"{}\"",
                humantime::format_duration(min),
                humantime::format_duration(max),
                humantime::format_duration(d)
            ),
        ));
    }
    Ok(())
}

impl NatsConfig {
    /// Checks the section without connecting: server URLs, names and subjects, partition
    /// counts and the instance index, auth and TLS pairs, durations and limits.
    ///
    /// Errors: [`NatsConfigError`] for the first bad key.
    pub fn validate(&self) -> Result<(), NatsConfigError> {
        let servers = self.server_list();
        if servers.is_empty() {
            return Err(KeyError::new(
                "nats.servers",
                "must list at least one server URL",
            ));
        }
        for s in &servers {
            s.parse::<async_nats::ServerAddr>().map_err(|e| {
                KeyError::new("nats.servers", format!("invalid server URL {s:?}: {e}"))
            })?;
        }
        for (inline, file, key) in [
            (
                self.token.is_some(),
                self.token_file.is_some(),
                "nats.token-file",
            ),
            (
                self.password.is_some(),
                self.password_file.is_some(),
                "nats.password-file",
            ),
        ] {
            if inline && file {
                let inline_key = key.trim_end_matches("-file");
                return Err(KeyError::new(
                    key,
                    format!("set either {inline_key} or {key}, not both"),
                ));
            }
        }
        let has_password = self.password.is_some() || self.password_file.is_some();
        if self.user.is_some() != has_password {
            return Err(KeyError::new(
                "nats.password",
                "nats.user and nats.password (or nats.password-file) go together",
            ));
        }
        for (file, read, key) in [
            (
                &self.token_file,
                self.token_from_file.is_some(),
                "nats.token-file",
            ),
            (
                &self.password_file,
                self.password_from_file.is_some(),
                "nats.password-file",
            ),
        ] {
            if file.is_some() && !read {
                return Err(KeyError::new(
                    key,
                    "not read yet (NatsConfig::read_secret_files)",
                ));
            }
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return Err(KeyError::new(
                "nats.tls-key-file",
                "nats.tls-cert-file and nats.tls-key-file go together",
            ));
        }
        check_name("nats.input-stream", &self.input_stream)?;
        check_name("nats.output-stream", &self.output_stream)?;
        if self.input_stream == self.output_stream {
            return Err(KeyError::new(
                "nats.output-stream",
                "must differ from nats.input-stream",
            ));
        }
        check_subject("nats.input-subject-prefix", &self.input_subject_prefix)?;
        check_subject("nats.dead-letter-subject", &self.dead_letter_subject)?;
        if subject_matches(&self.input_pattern(), &self.dead_letter_subject) {
            return Err(KeyError::new(
                "nats.dead-letter-subject",
                format!(
                    "must not be an input subject ({}.*)",
                    self.input_subject_prefix
                ),
            ));
        }
        check_name(
            "nats.consumer-prefix",
            &format!("{}-{}", self.consumer_prefix, self.partitions),
        )?;
        check_range("nats.partitions", self.partitions.into(), 1, 10_000)?;
        check_range(
            "nats.instances",
            self.instances.into(),
            1,
            self.partitions.into(),
        )?;
        if self.instance >= self.instances {
            return Err(KeyError::new(
                "nats.instance",
                format!(
                    "must be 0 to {} (nats.instances - 1), got {}",
                    self.instances - 1,
                    self.instance
                ),
            ));
        }
        check_range("nats.replicas", self.replicas.into(), 1, 5)?;
        let second = Duration::from_secs(1);
        check_span(
            "nats.max-age",
            self.max_age,
            second,
            Duration::from_secs(10 * 365 * 24 * 3600),
        )?;
        check_span(
            "nats.duplicate-window",
            self.duplicate_window,
            second,
            self.max_age,
        )?;
        check_span(
            "nats.ack-wait",
            self.ack_wait,
            second,
            Duration::from_secs(24 * 3600),
        )?;
        check_range(
            "nats.max-ack-pending",
            self.max_ack_pending.into(),
            1_000,
            10_000_000,
        )?;
        check_range(
            "nats.changelog-snapshot-kib",
            self.changelog_snapshot_kib.into(),
            16,
            64 << 20,
        )?;
        check_span(
            "nats.heartbeat-interval",
            self.heartbeat_interval,
            second,
            Duration::from_secs(3600),
        )?;
        if let Some(bucket) = self.tier_counts() {
            check_name("nats.tier-counts-bucket", &bucket)?;
        }
        if let Some(bucket) = self.overrides() {
            check_name("nats.overrides-bucket", &bucket)?;
        }
        if self.changelog().is_some() {
            check_name(
                "nats.changelog-stream",
                &self.changelog_stream_name(self.partitions as i32),
            )?;
            for (key, other) in [
                ("nats.input-stream", &self.input_stream),
                ("nats.output-stream", &self.output_stream),
            ] {
                if (0..self.partitions as i32).any(|p| self.changelog_stream_name(p) == *other) {
                    return Err(KeyError::new(
                        "nats.changelog-stream",
                        format!("its streams <name>-<partition> must not be {key} ({other:?})"),
                    ));
                }
            }
            let changelog_prefix = self.changelog_subject_prefix();
            check_subject("nats.changelog-subject-prefix", &changelog_prefix)?;
            for (key, subject) in [
                ("nats.input-subject-prefix", &self.input_subject_prefix),
                ("nats.dead-letter-subject", &self.dead_letter_subject),
            ] {
                if subjects_overlap(&changelog_prefix, subject) {
                    return Err(KeyError::new(
                        "nats.changelog-subject-prefix",
                        format!(
                            "{changelog_prefix:?} overlaps {key} ({subject:?}): changelog subjects must be apart"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// This process's name among the instances sharing tier counts:
    /// `i<instance>-<hostname>-<pid>` (unique per process, so a restart is a new instance
    /// whose predecessor's counts expire).
    pub fn instance_name(&self) -> String {
        format!(
            "i{}-{}-{}",
            self.instance,
            super::host_name(),
            std::process::id()
        )
    }

    /// The overrides KV bucket: `overrides-bucket`, else derived (`SETTLE_OVERRIDES` for the
    /// default deployment, `<input-stream>_<consumer-prefix>_OVERRIDES` for any other);
    /// `None` when `overrides-bucket` is `""` (off).
    pub fn overrides(&self) -> Option<String> {
        match &self.overrides_bucket {
            Some(b) if b.is_empty() => None,
            Some(b) => Some(b.clone()),
            None if self.is_default_deployment() => Some("SETTLE_OVERRIDES".to_owned()),
            None => Some(format!("{}_OVERRIDES", self.identity_name())),
        }
    }

    /// Whether this is the default deployment: `input-stream` and `consumer-prefix` at their
    /// defaults (`SETTLE_UPLOADS`, `settle`). Its derived names are the historical ones
    /// (`SETTLE_CHANGELOG`, `settle.changelog`, `SETTLE_TIER_COUNTS`), so the state of
    /// existing deployments is found where it always was.
    pub fn is_default_deployment(&self) -> bool {
        self.input_stream == DEFAULT_INPUT_STREAM && self.consumer_prefix == DEFAULT_CONSUMER_PREFIX
    }

    /// The deployment's identity as a stream or bucket name part:
    /// `<input-stream>_<consumer-prefix>`, every byte outside `[A-Za-z0-9_-]` as `_`.
    fn identity_name(&self) -> String {
        stream_safe(&format!("{}_{}", self.input_stream, self.consumer_prefix))
    }

    /// The tier-counts KV bucket: `tier-counts-bucket`, else derived (`SETTLE_TIER_COUNTS`
    /// for the default deployment, `<input-stream>_<consumer-prefix>_TIER_COUNTS` for any
    /// other); `None` when `tier-counts-bucket` is `""` (off).
    pub fn tier_counts(&self) -> Option<String> {
        match &self.tier_counts_bucket {
            Some(b) if b.is_empty() => None,
            Some(b) => Some(b.clone()),
            None if self.is_default_deployment() => Some("SETTLE_TIER_COUNTS".to_owned()),
            None => Some(format!("{}_TIER_COUNTS", self.identity_name())),
        }
    }

    /// The changelog stream prefix: `changelog-stream`, else derived (`SETTLE_CHANGELOG` for
    /// the default deployment, `<input-stream>_<consumer-prefix>_CHANGELOG` for any other);
    /// `None` when `changelog-stream` is `""` (off).
    pub fn changelog(&self) -> Option<String> {
        match &self.changelog_stream {
            Some(c) if c.is_empty() => None,
            Some(c) => Some(c.clone()),
            None if self.is_default_deployment() => Some("SETTLE_CHANGELOG".to_owned()),
            None => Some(format!("{}_CHANGELOG", self.identity_name())),
        }
    }

    /// The changelog subject prefix: `changelog-subject-prefix`, else `settle.changelog`
    /// for the default deployment and `settle.changelog.<input-stream>.<consumer-prefix>`
    /// for any other (each part made one subject token).
    pub fn changelog_subject_prefix(&self) -> String {
        match &self.changelog_subject_prefix {
            Some(p) => p.clone(),
            None if self.is_default_deployment() => "settle.changelog".to_owned(),
            None => format!(
                "settle.changelog.{}.{}",
                subject_token(&self.input_stream),
                subject_token(&self.consumer_prefix)
            ),
        }
    }

    /// The changelog stream of partition `partition`: `<changelog>-<partition>`
    /// ([`NatsConfig::changelog`]).
    pub fn changelog_stream_name(&self, partition: i32) -> String {
        format!("{}-{partition}", self.changelog().unwrap_or_default())
    }

    /// The subjects of partition `partition`'s changelog stream: `<prefix>.<partition>.*`.
    pub fn changelog_subjects(&self, partition: i32) -> String {
        format!("{}.{partition}.*", self.changelog_subject_prefix())
    }

    /// The token to connect with: `token`, or what [`NatsConfig::read_secret_files`] read
    /// from `token-file`.
    pub fn token_value(&self) -> Option<&Secret> {
        self.token.as_ref().or(self.token_from_file.as_ref())
    }

    /// The password of `user`: `password`, or what [`NatsConfig::read_secret_files`] read
    /// from `password-file`.
    pub fn password_value(&self) -> Option<&Secret> {
        self.password.as_ref().or(self.password_from_file.as_ref())
    }

    /// Reads `token-file` and `password-file` (their content, trailing newline and
    /// surrounding whitespace trimmed) into [`NatsConfig::token_value`] and
    /// [`NatsConfig::password_value`]. `Config::load` calls it once, before validating.
    ///
    /// Errors: [`NatsConfigError`] naming the key and the path when a file cannot be read,
    /// is not UTF-8 or holds only whitespace (the content is never in the message).
    pub fn read_secret_files(&mut self) -> Result<(), NatsConfigError> {
        fn read(key: &str, path: &std::path::Path) -> Result<Secret, NatsConfigError> {
            let text = std::fs::read_to_string(path)
                .map_err(|e| KeyError::new(key, format!("cannot read {}: {e}", path.display())))?;
            let value = text.trim();
            if value.is_empty() {
                return Err(KeyError::new(key, format!("{} is empty", path.display())));
            }
            Ok(Secret(value.to_owned()))
        }
        if let Some(path) = &self.token_file {
            self.token_from_file = Some(read("nats.token-file", path)?);
        }
        if let Some(path) = &self.password_file {
            self.password_from_file = Some(read("nats.password-file", path)?);
        }
        Ok(())
    }

    /// `servers` with the password (or token) of every URL that carries one replaced by
    /// `<redacted>` (`nats://u:<redacted>@host:4222`): what logs and `check-config` show.
    pub fn servers_shown(&self) -> String {
        self.servers
            .split(',')
            .map(|s| redact_url(s.trim()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Checks what `[nats]` needs of `[tiers]`: every tier topic and the events topic are
    /// valid subjects outside the input subjects and apart from the dead-letter subject.
    ///
    /// Errors: [`NatsConfigError`] naming the `tiers.` or `nats.` key.
    pub fn check_output_subjects(&self, tiers: &TiersConfig) -> Result<(), NatsConfigError> {
        let mut named: Vec<(String, &str)> = tiers
            .tiers
            .iter()
            .map(|t| (format!("tiers.tier.{}.topic", t.name), t.topic.as_str()))
            .collect();
        named.push(("tiers.events-topic".to_owned(), &tiers.events_topic));
        for (key, subject) in &named {
            check_subject(key, subject)?;
            if subject_matches(&self.input_pattern(), subject) {
                return Err(KeyError::new(
                    key.clone(),
                    format!(
                        "{subject:?} is an input subject ({}.*): output subjects must be apart",
                        self.input_subject_prefix
                    ),
                ));
            }
            if self.changelog().is_some()
                && subjects_overlap(&self.changelog_subject_prefix(), subject)
            {
                return Err(KeyError::new(
                    key.clone(),
                    format!(
                        "{subject:?} overlaps nats.changelog-subject-prefix ({:?}): output subjects must be apart",
                        self.changelog_subject_prefix()
                    ),
                ));
            }
            if *subject == self.dead_letter_subject {
                return Err(KeyError::new(
                    "nats.dead-letter-subject",
                    format!("{subject:?} is also {key}"),
                ));
            }
        }
        Ok(())
    }

    /// The server URLs of `servers`, trimmed, empty entries dropped.
    pub fn server_list(&self) -> Vec<String> {
        self.servers
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// `<input-subject-prefix>.*`: the input stream's subjects.
    pub fn input_pattern(&self) -> String {
        format!("{}.*", self.input_subject_prefix)
    }

    /// The subject of input partition `partition`: `<input-subject-prefix>.<partition>`.
    pub fn input_subject(&self, partition: i32) -> String {
        format!("{}.{partition}", self.input_subject_prefix)
    }

    /// The durable consumer of input partition `partition`: `<consumer-prefix>-<partition>`.
    pub fn consumer_name(&self, partition: i32) -> String {
        format!("{}-{partition}", self.consumer_prefix)
    }

    /// The partitions this instance owns (static assignment, module docs).
    pub fn owned_partitions(&self) -> Vec<i32> {
        owned_partitions(self.partitions, self.instance, self.instances)
    }

    /// Every subject of the output stream: the tier subjects, the tier-events subject and the
    /// dead-letter subject (deduplicated, in that order).
    pub fn output_subjects(&self, tiers: &TiersConfig) -> Vec<String> {
        let mut subjects: Vec<String> = Vec::new();
        let all = tiers
            .tiers
            .iter()
            .map(|t| t.topic.as_str())
            .chain([tiers.events_topic.as_str(), &self.dead_letter_subject]);
        for s in all {
            if !subjects.iter().any(|x| x == s) {
                subjects.push(s.to_owned());
            }
        }
        subjects
    }
}

/// The partitions instance `instance` of `instances` owns among `0..partitions`: those with
/// `p mod instances == instance`.
pub fn owned_partitions(partitions: u32, instance: u32, instances: u32) -> Vec<i32> {
    (0..partitions)
        .filter(|p| p % instances.max(1) == instance)
        .map(|p| p as i32)
        .collect()
}

/// The default `input-stream`.
pub const DEFAULT_INPUT_STREAM: &str = "SETTLE_UPLOADS";

/// The default `consumer-prefix`.
pub const DEFAULT_CONSUMER_PREFIX: &str = "settle";

/// `name` as a JetStream stream or KV bucket name part: every byte outside
/// `[A-Za-z0-9_-]` (dots, spaces, wildcards) becomes `_`.
fn stream_safe(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// `name` as one subject token: dots, whitespace, wildcards and non-ASCII become `_`.
fn subject_token(name: &str) -> String {
    let t: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() && !matches!(c, '.' | '*' | '>') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if t.is_empty() {
        "_".to_owned()
    } else {
        t
    }
}

/// Server URL `url` with the secret of its user-info part replaced by `<redacted>`:
/// `nats://u:pw@h` → `nats://u:<redacted>@h`, `nats://token@h` → `nats://<redacted>@h`.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let host_start = rest.find(['/', '?']).unwrap_or(rest.len());
    let Some(at) = rest[..host_start].rfind('@') else {
        return url.to_owned();
    };
    let user_info = &rest[..at];
    let shown = match user_info.split_once(':') {
        Some((user, _)) => format!("{user}:{}", super::kafka::REDACTED),
        None => super::kafka::REDACTED.to_owned(),
    };
    format!("{scheme}{shown}{}", &rest[at..])
}

/// Whether subject prefix `a` and subject `b` share subjects: equal, or one is the other's
/// leading tokens (`settle.changelog` and `settle.changelog.3.ab`).
fn subjects_overlap(a: &str, b: &str) -> bool {
    a == b || a.starts_with(&format!("{b}.")) || b.starts_with(&format!("{a}."))
}

/// Whether NATS subject `subject` matches `pattern` (tokens, `*` one token, `>` the rest).
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<NatsConfig, toml::de::Error> {
        toml::from_str(text)
    }

    #[test]
    fn defaults_validate_and_name_things() {
        let c = parse("").unwrap();
        assert_eq!(c, NatsConfig::default());
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        assert!(c.check_output_subjects(&TiersConfig::default()).is_ok());
        assert_eq!(c.input_subject(3), "settle.uploads.3");
        assert_eq!(c.consumer_name(3), "settle-3");
        assert_eq!(c.owned_partitions(), (0..8).collect::<Vec<_>>());
        assert_eq!(
            c.output_subjects(&TiersConfig::default()),
            [
                "settle.ready.normal",
                "settle.ready.limited",
                "settle.tier-events",
                "settle.dead-letter"
            ]
        );
        assert!(
            parse("server = \"x\"").is_err(),
            "unknown keys are rejected"
        );
    }

    #[test]
    fn changelog_names_are_checked_and_apart() {
        let c = NatsConfig::default();
        assert_eq!(c.changelog().as_deref(), Some("SETTLE_CHANGELOG"));
        assert_eq!(c.changelog_stream_name(3), "SETTLE_CHANGELOG-3");
        assert_eq!(c.changelog_subjects(3), "settle.changelog.3.*");
        let off = NatsConfig {
            changelog_stream: Some(String::new()),
            changelog_subject_prefix: Some("settle.uploads".into()),
            ..NatsConfig::default()
        };
        assert_eq!(off.changelog(), None);
        assert!(off.validate().is_ok(), "off: the prefix is not used");
        let key = |c: NatsConfig| c.validate().unwrap_err().key;
        for prefix in [
            "settle.uploads",
            "settle.uploads.x",
            "settle",
            "settle.dead-letter",
        ] {
            assert_eq!(
                key(NatsConfig {
                    changelog_subject_prefix: Some(prefix.into()),
                    ..NatsConfig::default()
                }),
                "nats.changelog-subject-prefix",
                "{prefix}"
            );
        }
        assert_eq!(
            key(NatsConfig {
                changelog_stream: Some("bad name".into()),
                ..NatsConfig::default()
            }),
            "nats.changelog-stream"
        );
        assert_eq!(
            key(NatsConfig {
                changelog_stream: Some("SETTLE".into()),
                input_stream: "SETTLE-1".into(),
                ..NatsConfig::default()
            }),
            "nats.changelog-stream"
        );
        let tiers = TiersConfig {
            events_topic: "settle.changelog.events".into(),
            ..TiersConfig::default()
        };
        assert_eq!(
            NatsConfig::default()
                .check_output_subjects(&tiers)
                .unwrap_err()
                .key,
            "tiers.events-topic"
        );
    }

    #[test]
    fn static_assignment_covers_every_partition_once() {
        let n = 4;
        let mut all: Vec<i32> = (0..n).flat_map(|i| owned_partitions(10, i, n)).collect();
        all.sort_unstable();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        assert_eq!(owned_partitions(10, 2, 4), vec![2, 6]);
    }

    #[test]
    fn subjects_match_like_nats() {
        assert!(subject_matches("a.*", "a.3"));
        assert!(!subject_matches("a.*", "a.3.x"));
        assert!(subject_matches("a.>", "a.3.x"));
        assert!(!subject_matches("a.>", "a"));
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a.c"));
    }

    #[test]
    fn validation_names_the_key() {
        let bad = |c: NatsConfig| c.validate().unwrap_err().key;
        let d = NatsConfig::default;
        assert_eq!(
            bad(NatsConfig {
                instance: 2,
                instances: 2,
                ..d()
            }),
            "nats.instance"
        );
        assert_eq!(
            bad(NatsConfig {
                instances: 9,
                ..d()
            }),
            "nats.instances"
        );
        assert_eq!(
            bad(NatsConfig {
                partitions: 0,
                ..d()
            }),
            "nats.partitions"
        );
        assert_eq!(
            bad(NatsConfig {
                input_subject_prefix: "a.*".into(),
                ..d()
            }),
            "nats.input-subject-prefix"
        );
        assert_eq!(
            bad(NatsConfig {
                input_stream: "has.dot".into(),
                ..d()
            }),
            "nats.input-stream"
        );
        assert_eq!(
            bad(NatsConfig {
                servers: " , ".into(),
                ..d()
            }),
            "nats.servers"
        );
        assert_eq!(
            bad(NatsConfig {
                user: Some("u".into()),
                ..d()
            }),
            "nats.password"
        );
        assert_eq!(
            bad(NatsConfig {
                duplicate_window: Duration::from_secs(8 * 24 * 3600),
                ..d()
            }),
            "nats.duplicate-window"
        );
        assert_eq!(
            bad(NatsConfig {
                dead_letter_subject: "settle.uploads.1".into(),
                ..d()
            }),
            "nats.dead-letter-subject"
        );
        let mut tiers = TiersConfig::default();
        tiers.tiers[0].topic = "settle.uploads.9".into();
        let e = d().check_output_subjects(&tiers).unwrap_err();
        assert_eq!(e.key, "tiers.tier.normal.topic");
        tiers.tiers[0].topic = "a..b".into();
        assert!(d().check_output_subjects(&tiers).is_err());
    }

    #[test]
    fn secrets_are_not_printed() {
        let c = parse(
            "servers = \"nats://a:url-pw@h:4222, tls://tok@h2\"\ntoken = \"s3cret\"\nuser = \"u\"\npassword = \"pw\"",
        )
        .unwrap();
        assert_eq!(
            c.servers_shown(),
            "nats://a:<redacted>@h:4222,tls://<redacted>@h2"
        );
        assert_eq!(redact_url("nats://h:4222"), "nats://h:4222");
        assert!(!format!("{c:?}").contains("url-pw"), "{c:?}");
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cret") && !shown.contains("pw\""),
            "{shown}"
        );
        assert_eq!(c.token, Some(Secret("s3cret".into())));
    }
}
