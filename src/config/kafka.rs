//! `[kafka]`: the Kafka transport's section of the config tree (where it connects, its
//! topics, the processing guarantee, librdkafka properties) and its validation, including
//! the check of every property against librdkafka itself. The transport
//! (`crate::transport::kafka`) builds its clients from [`KafkaConfig::client_config`].

use super::KeyError;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::ClientConfig;
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;
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
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    #[serde(deserialize_with = "property_values")]
    pub properties: BTreeMap<String, String>,
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
    let raw = BTreeMap::<String, Value>::deserialize(d)?;
    Ok(raw
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
        for (k, v) in &self.properties {
            c.set(k, v);
        }
        c
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
