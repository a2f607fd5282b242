//! `[kafka]`: the Kafka transport's section of the config tree (where it connects, its
//! topics, the processing guarantee, librdkafka properties) and its validation, including
//! the check of every property against librdkafka itself. The transport
//! (`crate::transport::kafka`) builds its clients from [`KafkaConfig::client_config`].
//!
//! Secrets: any property can come from a file (`[kafka.property-files]`, read once at start
//! by [`KafkaConfig::read_property_files`]). Values that are secrets ([`is_secret_property`]
//! and every value read from a file) never leave this module in readable form except in
//! [`KafkaConfig::client_config`]: the `Debug` form and [`KafkaConfig::shown_properties`]
//! (what `settle check-config` prints) redact them, and errors name the key, never the value.

use super::KeyError;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::ClientConfig;
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Keys of `[kafka.properties]` that settle sets itself: each has its own config key or is
/// required for the guarantees of SEMANTICS §6.
const MANAGED_PROPERTIES: [(&str, &str); 8] = [
    ("bootstrap.servers", "set kafka.bootstrap-servers instead"),
    ("group.id", "set kafka.group-id instead"),
    (
        "enable.auto.commit",
        "settle commits offsets itself, only for batches durable in its store",
    ),
    (
        "enable.auto.offset.store",
        "settle commits offsets itself, only for batches durable in its store",
    ),
    (
        "enable.partition.eof",
        "settle needs partition EOF to know when a partition is caught up",
    ),
    (
        "enable.idempotence",
        "the producer must be idempotent (no duplicates from producer retries)",
    ),
    (
        "group.instance.id",
        "set kafka.group-instance-id instead (static membership)",
    ),
    (
        "transactional.id",
        "set kafka.processing-guarantee = \"exactly-once\" instead (one transactional id per partition)",
    ),
];

/// `[kafka]`: where the Kafka transport connects and which topics it uses. Output topics
/// come from `[tiers]` ([`TiersConfig`]), not from here.
///
/// ```toml
/// [kafka]
/// bootstrap-servers = "127.0.0.1:9092"
/// group-id = "settle"
/// input-topic = "settle.uploads"
/// dead-letter-topic = "settle.dead-letter"
/// [kafka.properties]            # any librdkafka property, applied to consumer and producer
/// "security.protocol" = "SASL_SSL"
/// "sasl.mechanisms" = "SCRAM-SHA-512"
/// "session.timeout.ms" = 10000
/// [kafka.property-files]        # librdkafka property -> file holding its value
/// "sasl.password" = "/run/secrets/kafka-pass"
/// ```
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// `bootstrap-servers`: comma-separated `host:port` list (default `127.0.0.1:9092`).
    pub bootstrap_servers: String,
    /// `group-id`: consumer group of every settle instance of one deployment (default `settle`).
    pub group_id: String,
    /// `input-topic`: the uploads, keyed `tenant/session` (default `settle.uploads`).
    pub input_topic: String,
    /// `dead-letter-topic`: where records that fail decoding go (default `settle.dead-letter`).
    pub dead_letter_topic: String,
    /// `changelog-topic`: the compacted topic that mirrors every partition store (same
    /// partition count as `input-topic`; ARCHITECTURE "changelog"), so a partition's next
    /// owner restores its pending rounds and input offset. Unset (the default):
    /// `<group-id>.changelog`, so two deployments (groups) never share one. `""` turns the
    /// changelog off: a partition's state then stays on the instance that owned it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub changelog_topic: Option<String>,
    /// `tier-counts-topic`: the compacted topic (one partition is enough) where the instances
    /// of the deployment exchange their per-tenant emission counts every
    /// `tiers.share-interval`, so tiers follow the deployment's rate and outlive restarts
    /// (SEMANTICS §5). Created by settle (1 partition, compacted) when missing. Unset (the
    /// default): `<group-id>.tier-counts`. `""` turns sharing off: each instance then
    /// measures only the emissions it publishes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier_counts_topic: Option<String>,
    /// `instance-id`: this process's name in the group, sent as header `settle-instance` on
    /// every ready record (default `""`: `<hostname>-<pid>`).
    pub instance_id: String,
    /// `group-instance-id`: Kafka static membership (KIP-345, librdkafka
    /// `group.instance.id`): this instance's fixed name in the group. A member restarted
    /// with the same name within `session.timeout.ms` gets its partitions back at once,
    /// without a rebalance or waiting for the old member's session to time out. Unset or
    /// `""` (the default): dynamic membership. Give each instance its own, stable name
    /// (the StatefulSet of `deploy/kubernetes` sets the pod name, `settle-0`, ...); two
    /// live instances with one name fence each other. 1-249 bytes of `[A-Za-z0-9._-]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group_instance_id: Option<String>,
    /// `processing-guarantee`: `at-least-once` (default; a redelivered emission keeps its
    /// `emission_id`) or `exactly-once` (emissions, changelog records and input offsets of
    /// each store batch in one Kafka transaction; needs a broker with transactions).
    pub processing_guarantee: ProcessingGuarantee,
    /// `[kafka.properties]`: librdkafka properties (strings, numbers or booleans), applied to
    /// both clients after settle's own defaults, so they can override them (security
    /// settings, timeouts, `client.id`, `fetch.wait.max.ms`, ...). The keys settle manages
    /// (`bootstrap.servers`, `group.id`, `group.instance.id`, `enable.auto.commit`, `enable.auto.offset.store`,
    /// `enable.partition.eof`, `enable.idempotence`, `transactional.id`) are rejected.
    /// Nested tables join their keys with `.`, so `SETTLE_KAFKA__PROPERTIES__SASL__MECHANISMS`
    /// sets `sasl.mechanisms` (and `sasl.mechanisms = ...` without quotes works in TOML).
    #[serde(deserialize_with = "property_values")]
    pub properties: BTreeMap<String, String>,
    /// `[kafka.property-files]`: librdkafka properties whose value is the content of a file
    /// (property name -> file path; the content with surrounding whitespace trimmed), for
    /// secrets mounted as files (`"sasl.password" = "/run/secrets/kafka-pass"`). Read once, by
    /// [`KafkaConfig::read_property_files`] (`Config::load` calls it); applied like
    /// `properties`, never shown (`settle check-config` prints `<redacted>`). A key may be in
    /// `properties` or here, not both; the keys settle manages are rejected here too.
    /// `SETTLE_KAFKA__PROPERTY_FILES__SASL__PASSWORD=/run/secrets/kafka-pass` sets one from
    /// the environment.
    #[serde(
        deserialize_with = "property_paths",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub property_files: BTreeMap<String, PathBuf>,
    /// The values read from `property_files`, empty until
    /// [`KafkaConfig::read_property_files`] (not a config key).
    #[serde(skip)]
    pub file_values: FileValues,
}

/// The values read from `[kafka.property-files]` (property name -> value), only readable by
/// [`KafkaConfig::client_config`]; `Debug` shows the names alone.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct FileValues(BTreeMap<String, String>);

impl std::fmt::Debug for FileValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

impl std::fmt::Debug for KafkaConfig {
    /// Every field, with secret property values and every value read from a file as
    /// `<redacted>` ([`KafkaConfig::shown_properties`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let KafkaConfig {
            bootstrap_servers,
            group_id,
            input_topic,
            dead_letter_topic,
            changelog_topic,
            tier_counts_topic,
            instance_id,
            group_instance_id,
            processing_guarantee,
            properties: _,
            property_files,
            file_values,
        } = self;
        let properties: BTreeMap<&str, String> = self
            .shown_properties()
            .into_iter()
            .filter(|(k, _)| self.properties.contains_key(*k))
            .collect();
        f.debug_struct("KafkaConfig")
            .field("bootstrap_servers", bootstrap_servers)
            .field("group_id", group_id)
            .field("input_topic", input_topic)
            .field("dead_letter_topic", dead_letter_topic)
            .field("changelog_topic", changelog_topic)
            .field("tier_counts_topic", tier_counts_topic)
            .field("instance_id", instance_id)
            .field("group_instance_id", group_instance_id)
            .field("processing_guarantee", processing_guarantee)
            .field("properties", &properties)
            .field("property_files", property_files)
            .field("file_values", file_values)
            .finish()
    }
}

/// What [`KafkaConfig::shown_properties`] prints in place of a secret value.
pub const REDACTED: &str = "<redacted>";

/// Whether librdkafka property `key` holds a secret that settle never shows: a password,
/// secret or passphrase (`sasl.password`, `ssl.key.password`, `ssl.keystore.password`,
/// `sasl.oauthbearer.client.secret`, ...), `sasl.oauthbearer.config` (may carry a token or
/// client secret), and private keys given inline (`ssl.key.pem`, `ssl_key`,
/// `sasl.oauthbearer.assertion.private.key.pem`). Case-insensitive.
pub fn is_secret_property(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["password", "secret", "passphrase"]
        .iter()
        .any(|w| key.contains(w))
        || key == "sasl.oauthbearer.config"
        || key == "ssl_key"
        || (key.contains("key") && key.ends_with(".pem"))
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            bootstrap_servers: "127.0.0.1:9092".to_owned(),
            group_id: "settle".to_owned(),
            input_topic: "settle.uploads".to_owned(),
            dead_letter_topic: "settle.dead-letter".to_owned(),
            changelog_topic: None,
            tier_counts_topic: None,
            instance_id: String::new(),
            group_instance_id: None,
            processing_guarantee: ProcessingGuarantee::AtLeastOnce,
            properties: BTreeMap::new(),
            property_files: BTreeMap::new(),
            file_values: FileValues::default(),
        }
    }
}

/// `kafka.processing-guarantee` (SEMANTICS §6).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProcessingGuarantee {
    /// Store batch, then publish from the outbox, then delete: a crash re-publishes with the
    /// same `emission_id` (consumers de-duplicate).
    #[default]
    AtLeastOnce,
    /// Each store batch's emissions, changelog records and input offset are committed in
    /// one Kafka transaction (one transactional producer per partition,
    /// `transactional.id = <group-id>.<input-topic>.<partition>`, whose epoch fences a
    /// previous owner); `read_committed` consumers see each emission once.
    ExactlyOnce,
}

impl KafkaConfig {
    /// `instance-id`, or `<hostname>-<pid>` when it is empty.
    pub fn instance_id(&self) -> String {
        if !self.instance_id.is_empty() {
            return self.instance_id.clone();
        }
        format!("{}-{}", super::host_name(), std::process::id())
    }

    /// The liveness lease of `settle run` (`runtime::lease`): two thirds of the consumer's
    /// `session.timeout.ms` (`[kafka.properties]`, librdkafka's default 45 000 ms), at least
    /// 1 s. A process paused longer than this may have been evicted from the group.
    pub fn lease(&self) -> Duration {
        let session_ms: u64 = self
            .properties
            .get("session.timeout.ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(45_000);
        Duration::from_millis((session_ms * 2 / 3).max(1_000))
    }

    /// The static group membership name: `group-instance-id` when set and not `""`.
    pub fn group_instance_id(&self) -> Option<&str> {
        self.group_instance_id
            .as_deref()
            .filter(|id| !id.is_empty())
    }

    /// The changelog topic: `changelog-topic`, else `<group-id>.changelog`; `None` when
    /// `changelog-topic` is `""` (off).
    pub fn changelog(&self) -> Option<String> {
        match &self.changelog_topic {
            Some(t) if t.is_empty() => None,
            Some(t) => Some(t.clone()),
            None => Some(format!("{}.changelog", self.group_id)),
        }
    }

    /// The tier-counts topic: `tier-counts-topic`, else `<group-id>.tier-counts`; `None` when
    /// `tier-counts-topic` is `""` (off).
    pub fn tier_counts(&self) -> Option<String> {
        match &self.tier_counts_topic {
            Some(t) if t.is_empty() => None,
            Some(t) => Some(t.clone()),
            None => Some(format!("{}.tier-counts", self.group_id)),
        }
    }
}

/// A table whose nested tables join their keys with `.`: `{sasl: {password: x}}` is
/// `sasl.password = x`. How a librdkafka property name (dots) arrives from the environment
/// (`SETTLE_KAFKA__PROPERTIES__SASL__PASSWORD`) or from an unquoted dotted TOML key.
#[derive(Deserialize)]
#[serde(untagged)]
enum Dotted<T> {
    Leaf(T),
    Table(BTreeMap<String, Dotted<T>>),
}

impl<T> Dotted<T> {
    /// The leaves of `table` by their dotted key (`prefix` + key).
    fn flatten_into(table: BTreeMap<String, Dotted<T>>, prefix: &str, out: &mut Vec<(String, T)>) {
        for (k, v) in table {
            let key = if prefix.is_empty() {
                k
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                Dotted::Leaf(leaf) => out.push((key, leaf)),
                Dotted::Table(t) => Dotted::flatten_into(t, &key, out),
            }
        }
    }
}

/// Reads a table of dotted keys ([`Dotted`]) into `key -> T`.
fn dotted<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Vec<(String, T)>, D::Error> {
    let raw = BTreeMap::<String, Dotted<T>>::deserialize(d)?;
    let mut out = Vec::new();
    Dotted::flatten_into(raw, "", &mut out);
    Ok(out)
}

/// Reads `[kafka.properties]` values written as strings, integers, floats or booleans.
fn property_values<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Value {
        Text(String),
        Int(i64),
        Float(f64),
        Bool(bool),
    }
    Ok(dotted::<D, Value>(d)?
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                Value::Text(s) => s,
                Value::Int(i) => i.to_string(),
                Value::Float(f) => f.to_string(),
                Value::Bool(b) => b.to_string(),
            };
            (k, v)
        })
        .collect())
}

/// Reads `[kafka.property-files]`: property name -> file path.
fn property_paths<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, PathBuf>, D::Error> {
    Ok(dotted::<D, PathBuf>(d)?.into_iter().collect())
}

/// A `[kafka]` value that cannot be used: `key` is the full dotted key (`kafka.input-topic`,
/// `kafka.properties."sasl.mechanisms"`), `message` says what is wrong and what is allowed.
pub type KafkaConfigError = KeyError;

/// Kafka's topic name rule: 1–249 bytes of `[A-Za-z0-9._-]`, not `.` or `..`.
fn check_topic(key: &str, topic: &str) -> Result<(), KafkaConfigError> {
    let ok_chars = topic
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if topic.is_empty() || topic.len() > 249 || !ok_chars || topic == "." || topic == ".." {
        return Err(KeyError::new(
            key,
            format!(
                "invalid topic name {topic:?}: 1-249 bytes of [A-Za-z0-9._-], not \".\" or \"..\""
            ),
        ));
    }
    Ok(())
}

/// Which client a [`ClientConfig`] is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The consumer-group member reading the input topic.
    Consumer,
    /// The idempotent producer writing ready records and dead letters.
    Producer,
}

impl KafkaConfig {
    /// Checks the section without connecting: non-empty servers and group, valid and
    /// distinct topic names, no managed key in `properties`, and every property known to
    /// librdkafka with a value it accepts.
    ///
    /// Errors: [`KafkaConfigError`] for the first bad key.
    pub fn validate(&self) -> Result<(), KafkaConfigError> {
        if self.bootstrap_servers.trim().is_empty() {
            return Err(KeyError::new(
                "kafka.bootstrap-servers",
                "must list at least one host:port",
            ));
        }
        if self.group_id.trim().is_empty() {
            return Err(KeyError::new("kafka.group-id", "must not be empty"));
        }
        check_topic("kafka.input-topic", &self.input_topic)?;
        check_topic("kafka.dead-letter-topic", &self.dead_letter_topic)?;
        if self.input_topic == self.dead_letter_topic {
            return Err(KeyError::new(
                "kafka.dead-letter-topic",
                "must differ from kafka.input-topic",
            ));
        }
        if let Some(changelog) = self.changelog() {
            check_topic("kafka.changelog-topic", &changelog)?;
            if changelog == self.input_topic || changelog == self.dead_letter_topic {
                return Err(KeyError::new(
                    "kafka.changelog-topic",
                    "must differ from kafka.input-topic and kafka.dead-letter-topic (or be \"\" to turn the changelog off)",
                ));
            }
        }
        if let Some(counts) = self.tier_counts() {
            check_topic("kafka.tier-counts-topic", &counts)?;
            if counts == self.input_topic
                || counts == self.dead_letter_topic
                || Some(&counts) == self.changelog().as_ref()
            {
                return Err(KeyError::new(
                    "kafka.tier-counts-topic",
                    "must differ from kafka.input-topic, kafka.dead-letter-topic and kafka.changelog-topic (or be \"\" to turn sharing off)",
                ));
            }
        }
        if self.processing_guarantee == ProcessingGuarantee::ExactlyOnce
            && self.changelog().is_none()
        {
            return Err(KeyError::new(
                "kafka.processing-guarantee",
                "exactly-once needs the changelog: set kafka.changelog-topic",
            ));
        }
        if self.instance_id.len() > 255 || self.instance_id.chars().any(char::is_control) {
            return Err(KeyError::new(
                "kafka.instance-id",
                "at most 255 bytes, no control characters",
            ));
        }
        if let Some(id) = self.group_instance_id() {
            let ok_chars = id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
            if id.len() > 249 || !ok_chars {
                return Err(KeyError::new(
                    "kafka.group-instance-id",
                    format!("invalid name {id:?}: 1-249 bytes of [A-Za-z0-9._-] (or \"\" for dynamic membership)"),
                ));
            }
        }
        for key in self.properties.keys() {
            if let Some((_, why)) = MANAGED_PROPERTIES.iter().find(|(k, _)| k == key) {
                return Err(KeyError::new(
                    format!("kafka.properties.{key:?}"),
                    format!("managed by settle: {why}"),
                ));
            }
        }
        for key in self.property_files.keys() {
            let at = format!("kafka.property-files.{key:?}");
            if let Some((_, why)) = MANAGED_PROPERTIES.iter().find(|(k, _)| k == key) {
                return Err(KeyError::new(at, format!("managed by settle: {why}")));
            }
            if self.properties.contains_key(key) {
                return Err(KeyError::new(
                    at,
                    format!("also set in kafka.properties: give {key:?} in one of the two"),
                ));
            }
            if !self.file_values.0.contains_key(key) {
                return Err(KeyError::new(
                    at,
                    "not read yet (KafkaConfig::read_property_files)",
                ));
            }
        }
        for role in [Role::Consumer, Role::Producer] {
            self.client_config(role)
                .create_native_config()
                .map_err(|e| property_error(&e))?;
        }
        Ok(())
    }

    /// The librdkafka configuration of `role`: settle's settings, then `properties`.
    pub fn client_config(&self, role: Role) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap_servers)
            .set("client.id", "settle")
            .set_log_level(librdkafka_log_level());
        match role {
            Role::Consumer => {
                c.set("group.id", &self.group_id)
                    .set("partition.assignment.strategy", "cooperative-sticky")
                    .set("enable.auto.commit", "false")
                    .set("enable.auto.offset.store", "false")
                    .set("enable.partition.eof", "true")
                    .set("auto.offset.reset", "earliest")
                    .set("fetch.wait.max.ms", "100");
                if let Some(id) = self.group_instance_id() {
                    c.set("group.instance.id", id);
                }
            }
            Role::Producer => {
                c.set("enable.idempotence", "true")
                    .set("acks", "all")
                    .set("linger.ms", "5")
                    .set("message.timeout.ms", "30000");
            }
        }
        for (k, v) in self.properties.iter().chain(&self.file_values.0) {
            c.set(k, v);
        }
        c
    }

    /// Reads every file of `[kafka.property-files]` (its content, surrounding whitespace
    /// trimmed, is the property's value), replacing what an earlier call read. `Config::load`
    /// calls it before validation; call it yourself for a `KafkaConfig` built in code.
    ///
    /// Errors: [`KafkaConfigError`] with key `kafka.property-files."NAME"` and the file's path
    /// when a file cannot be read, is not UTF-8 or holds only whitespace (the content is never
    /// part of the message).
    pub fn read_property_files(&mut self) -> Result<(), KafkaConfigError> {
        let mut values = BTreeMap::new();
        for (key, path) in &self.property_files {
            let at = || format!("kafka.property-files.{key:?}");
            let text = std::fs::read_to_string(path)
                .map_err(|e| KeyError::new(at(), format!("cannot read {}: {e}", path.display())))?;
            let value = text.trim();
            if value.is_empty() {
                return Err(KeyError::new(
                    at(),
                    format!(
                        "{} is empty: it must hold the property's value",
                        path.display()
                    ),
                ));
            }
            values.insert(key.clone(), value.to_owned());
        }
        self.file_values = FileValues(values);
        Ok(())
    }

    /// Every property settle applies on top of its own settings (`[kafka.properties]` and
    /// `[kafka.property-files]`), by name, as it may be shown: a secret
    /// ([`is_secret_property`]) as [`REDACTED`], a value read from a file as
    /// `<redacted> (from file PATH)`, anything else as written.
    pub fn shown_properties(&self) -> BTreeMap<&str, String> {
        let inline = self.properties.iter().map(|(k, v)| {
            let shown = if is_secret_property(k) {
                REDACTED.to_owned()
            } else {
                v.clone()
            };
            (k.as_str(), shown)
        });
        let from_files = self.property_files.iter().map(|(k, path)| {
            (
                k.as_str(),
                format!("{REDACTED} (from file {})", path.display()),
            )
        });
        inline.chain(from_files).collect()
    }
}

/// librdkafka's log level: what `tracing` would show for target `librdkafka` (so
/// `SETTLE_LOG=librdkafka=debug` with `debug = "cgrp,fetch"` in the properties works).
fn librdkafka_log_level() -> RDKafkaLogLevel {
    use tracing::Level;
    if tracing::enabled!(target: "librdkafka", Level::DEBUG) {
        RDKafkaLogLevel::Debug
    } else if tracing::enabled!(target: "librdkafka", Level::INFO) {
        RDKafkaLogLevel::Info
    } else {
        RDKafkaLogLevel::Warning
    }
}

/// The config error for a property librdkafka rejected. The value is not repeated (it may
/// be a secret).
fn property_error(e: &KafkaError) -> KafkaConfigError {
    match e {
        KafkaError::ClientConfig(_, description, key, _) => KeyError::new(
            format!("kafka.properties.{key:?}"),
            format!("rejected by librdkafka: {description}"),
        ),
        other => KeyError::new(
            "kafka.properties",
            format!("rejected by librdkafka: {other}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(toml_text: &str) -> Result<KafkaConfig, toml::de::Error> {
        toml::from_str(toml_text)
    }

    #[test]
    fn group_instance_id_turns_static_membership_on() {
        let dynamic = parse("").unwrap();
        assert_eq!(dynamic.group_instance_id(), None);
        assert!(dynamic
            .client_config(Role::Consumer)
            .get("group.instance.id")
            .is_none());
        assert_eq!(
            parse(r#"group-instance-id = """#)
                .unwrap()
                .group_instance_id(),
            None
        );
        let fixed = parse(r#"group-instance-id = "settle-0""#).unwrap();
        fixed.validate().unwrap();
        assert_eq!(
            fixed.client_config(Role::Consumer).get("group.instance.id"),
            Some("settle-0")
        );
        assert!(fixed
            .client_config(Role::Producer)
            .get("group.instance.id")
            .is_none());
        let bad = parse(r#"group-instance-id = "settle 0""#).unwrap();
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("kafka.group-instance-id"), "{e}");
        let managed = parse("[properties]\n\"group.instance.id\" = \"x\"").unwrap();
        let e = managed.validate().unwrap_err().to_string();
        assert!(e.contains("kafka.group-instance-id instead"), "{e}");
    }

    #[test]
    fn defaults_and_typed_properties() {
        let c = parse("").unwrap();
        assert_eq!(c, KafkaConfig::default());
        assert_eq!(c.bootstrap_servers, "127.0.0.1:9092");
        assert_eq!(
            (
                c.group_id.as_str(),
                c.input_topic.as_str(),
                c.dead_letter_topic.as_str()
            ),
            ("settle", "settle.uploads", "settle.dead-letter")
        );
        let c = parse(
            r#"
bootstrap-servers = "k1:9092,k2:9092"
input-topic = "in"
[properties]
"security.protocol" = "SASL_SSL"
"session.timeout.ms" = 10000
"enable.ssl.certificate.verification" = false
"#,
        )
        .unwrap();
        assert_eq!(c.properties["session.timeout.ms"], "10000");
        assert_eq!(c.properties["enable.ssl.certificate.verification"], "false");
        assert!(c.validate().is_ok(), "{:?}", c.validate());
        // Security settings reach both clients.
        for role in [Role::Consumer, Role::Producer] {
            assert_eq!(
                c.client_config(role).get("security.protocol"),
                Some("SASL_SSL")
            );
        }
        assert!(
            parse("brokers = \"x\"").is_err(),
            "unknown keys are rejected"
        );
    }

    #[test]
    fn client_settings_settle_relies_on() {
        let c = KafkaConfig::default();
        let consumer = c.client_config(Role::Consumer);
        assert_eq!(consumer.get("enable.auto.commit"), Some("false"));
        assert_eq!(
            consumer.get("partition.assignment.strategy"),
            Some("cooperative-sticky")
        );
        assert_eq!(consumer.get("enable.partition.eof"), Some("true"));
        assert_eq!(
            c.client_config(Role::Producer).get("enable.idempotence"),
            Some("true")
        );
    }

    #[test]
    fn property_files_are_read_trimmed_applied_and_never_shown() {
        let dir = tempfile::tempdir().unwrap();
        let pass = dir.path().join("kafka-pass");
        std::fs::write(&pass, "  s3cret-from-file\n").unwrap();
        let mut c = parse(&format!(
            r#"
[properties]
"security.protocol" = "SASL_SSL"
"sasl.username" = "settle"
"ssl.key.password" = "inline-s3cret"
[property-files]
"sasl.password" = "{}"
"#,
            pass.display()
        ))
        .unwrap();
        assert_eq!(c.property_files["sasl.password"], pass);
        // Not read yet: refused, so a config built in code cannot lose the secret silently.
        let e = c.validate().unwrap_err();
        assert_eq!(e.key, r#"kafka.property-files."sasl.password""#);
        c.read_property_files().unwrap();
        c.validate().unwrap();
        for role in [Role::Consumer, Role::Producer] {
            assert_eq!(
                c.client_config(role).get("sasl.password"),
                Some("s3cret-from-file")
            );
            assert_eq!(
                c.client_config(role).get("ssl.key.password"),
                Some("inline-s3cret")
            );
        }
        let shown = c.shown_properties();
        assert_eq!(shown["security.protocol"], "SASL_SSL");
        assert_eq!(shown["sasl.username"], "settle");
        assert_eq!(shown["ssl.key.password"], REDACTED);
        assert_eq!(
            shown["sasl.password"],
            format!("{REDACTED} (from file {})", pass.display())
        );
        let debug = format!("{c:?}");
        assert!(!debug.contains("s3cret"), "Debug shows a secret: {debug}");
        assert!(
            debug.contains("SASL_SSL") && debug.contains("kafka-pass"),
            "{debug}"
        );
    }

    #[test]
    fn property_file_errors_name_the_key_and_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no-such-file");
        let mut c = KafkaConfig {
            property_files: [("sasl.password".to_owned(), missing.clone())].into(),
            ..KafkaConfig::default()
        };
        let e = c.read_property_files().unwrap_err();
        assert_eq!(e.key, r#"kafka.property-files."sasl.password""#);
        assert!(e.message.contains(&missing.display().to_string()), "{e}");
        let blank = dir.path().join("blank");
        std::fs::write(&blank, " \n").unwrap();
        c.property_files
            .insert("sasl.password".into(), blank.clone());
        let e = c.read_property_files().unwrap_err();
        assert!(e.message.contains("is empty"), "{e}");
        // A bad value from a file is named by its key; the value is not repeated.
        let bad = dir.path().join("bad");
        std::fs::write(&bad, "s3cret").unwrap();
        let mut c = KafkaConfig {
            property_files: [("session.timeout.ms".to_owned(), bad)].into(),
            ..KafkaConfig::default()
        };
        c.read_property_files().unwrap();
        let e = c.validate().unwrap_err();
        assert_eq!(e.key, r#"kafka.properties."session.timeout.ms""#);
        assert!(!e.to_string().contains("s3cret"), "{e}");
        // Managed keys and keys given twice are refused.
        let twice = parse(&format!(
            "[properties]\n\"sasl.password\" = \"x\"\n[property-files]\n\"sasl.password\" = \"{}\"",
            blank.display()
        ))
        .unwrap();
        let e = twice.validate().unwrap_err();
        assert_eq!(e.key, r#"kafka.property-files."sasl.password""#);
        assert!(e.message.contains("also set in kafka.properties"), "{e}");
        let managed = parse("[property-files]\n\"group.id\" = \"/x\"").unwrap();
        let e = managed.validate().unwrap_err();
        assert!(e.message.contains("managed by settle"), "{e}");
    }

    #[test]
    fn nested_property_tables_are_dotted_names() {
        let c = parse(
            r#"
[properties]
sasl.mechanisms = "PLAIN"
session = { timeout = { ms = 6000 } }
[property-files]
sasl.password = "/run/secrets/kafka-pass"
"#,
        )
        .unwrap();
        assert_eq!(c.properties["sasl.mechanisms"], "PLAIN");
        assert_eq!(c.properties["session.timeout.ms"], "6000");
        assert_eq!(
            c.property_files["sasl.password"],
            PathBuf::from("/run/secrets/kafka-pass")
        );
    }

    #[test]
    fn secret_property_names() {
        for key in [
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.config",
            "ssl.key.pem",
            "sasl.oauthbearer.assertion.private.key.pem",
            "sasl.oauthbearer.assertion.private.key.passphrase",
            "SASL.PASSWORD",
        ] {
            assert!(is_secret_property(key), "{key}");
        }
        for key in [
            "sasl.username",
            "security.protocol",
            "ssl.ca.location",
            "ssl.ca.pem",
            "session.timeout.ms",
        ] {
            assert!(!is_secret_property(key), "{key}");
        }
    }

    #[test]
    fn validation_names_the_key_and_hides_the_value() {
        let with = |k: &str, v: &str| KafkaConfig {
            properties: [(k.to_owned(), v.to_owned())].into(),
            ..KafkaConfig::default()
        };
        let e = with("enable.auto.commit", "true").validate().unwrap_err();
        assert_eq!(e.key, r#"kafka.properties."enable.auto.commit""#);
        assert!(e.message.contains("managed by settle"), "{e}");
        let e = with("no.such.property", "1").validate().unwrap_err();
        assert_eq!(e.key, r#"kafka.properties."no.such.property""#);
        let e = with("session.timeout.ms", "s3cret").validate().unwrap_err();
        assert_eq!(e.key, r#"kafka.properties."session.timeout.ms""#);
        assert!(!e.to_string().contains("s3cret"), "{e}");
        let e = KafkaConfig {
            input_topic: "bad topic".into(),
            ..KafkaConfig::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.key, "kafka.input-topic");
        let e = KafkaConfig {
            dead_letter_topic: "settle.uploads".into(),
            ..KafkaConfig::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.key, "kafka.dead-letter-topic");
    }
}
