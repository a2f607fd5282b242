//! `[tiers]` configuration (SEMANTICS §5): the ordered tier list, pinned tenants and the
//! automatic-demotion settings. Parsed by serde (kebab-case keys, unknown keys rejected,
//! durations in humantime form such as `"1m"`), checked once at start by
//! [`TiersConfig::validate`], whose errors name the offending key.
//!
//! Mounted in the root config as `#[serde(default)] pub tiers: TiersConfig`, so every key
//! named in an error starts with `tiers.`.

use crate::codec;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// Largest accepted `tiers.limit` (emissions per period). The rate window keeps at most
/// `limit + 1` timestamps (8 bytes each) per tenant, so this caps it at about 8 MB per tenant.
pub const MAX_LIMIT: u64 = 1_000_000;

/// Longest accepted `tiers.period` and `tiers.cooldown` (24 h).
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// Most bytes in a tier name (it is a metrics label value).
pub const MAX_TIER_NAME_BYTES: usize = 64;

/// Most bytes in a topic name (Kafka's limit; NATS subjects are checked with the same rule).
pub const MAX_TOPIC_BYTES: usize = 249;

/// Shortest accepted `tiers.share-interval` (100 ms).
pub const MIN_SHARE_INTERVAL: Duration = Duration::from_millis(100);

/// Longest accepted `tiers.share-interval` (1 min).
pub const MAX_SHARE_INTERVAL: Duration = Duration::from_secs(60);

/// The `[tiers]` table. Every field has a default (see [`TiersConfig::default`]); an absent
/// `[tiers]` table means the defaults.
///
/// ```toml
/// [tiers]
/// limit = 600                       # emissions per period (per tenant, whole deployment)
/// period = "1m"
/// share-interval = "1s"             # how often instances exchange their counts
/// recover-ratio = 0.5
/// cooldown = "5m"
/// events-topic = "settle.tier-events"
/// # demote-to = "limited"           # default: the last tier
/// [[tiers.tier]]
/// name = "normal"
/// topic = "settle.ready.normal"
/// [[tiers.tier]]
/// name = "limited"
/// topic = "settle.ready.limited"
/// [tiers.pinned]
/// "bigco" = "limited"
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct TiersConfig {
    /// `tiers.limit`: a tenant with more than `limit` emissions within one `period` is
    /// demoted (emissions per period, 1..=[`MAX_LIMIT`]; default 600).
    pub limit: u64,
    /// `tiers.period`: length of the sliding window the rate is counted over
    /// (1 ms..=24 h; default 1 min).
    #[serde(with = "humantime_serde")]
    pub period: Duration,
    /// `tiers.recover-ratio`: a demoted tenant recovers once its rate stays below
    /// `limit × recover-ratio` (in (0, 1]; default 0.5).
    pub recover_ratio: f64,
    /// `tiers.cooldown`: how long the rate must stay below the recovery threshold before the
    /// tenant is promoted back (0..=24 h; default 5 min).
    #[serde(with = "humantime_serde")]
    pub cooldown: Duration,
    /// `tiers.demote-to`: the tier automatic demotion moves a tenant to (default: the last
    /// tier). Must not be the first tier when there are several. With a single tier,
    /// automatic demotion is off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub demote_to: Option<String>,
    /// `tiers.events-topic`: topic the tier changes are published to
    /// (default `settle.tier-events`).
    pub events_topic: String,
    /// `[[tiers.tier]]`: the ordered tier list (at least one). The first tier is where every
    /// tenant that is neither pinned nor demoted is routed.
    #[serde(rename = "tier")]
    pub tiers: Vec<TierSpec>,
    /// `[tiers.pinned]`: tenant → tier name. A pinned tenant always routes to its tier and
    /// never moves automatically.
    pub pinned: BTreeMap<String, String>,
    /// `tiers.share-interval`: how often each instance publishes its per-tenant emission
    /// counts (and its demoted tenants) to the others through the broker, so a tenant's rate
    /// is the deployment's (SEMANTICS §5; Kafka `kafka.tier-counts-topic`, NATS
    /// `nats.tier-counts-bucket`). Counts of an instance that stopped publishing expire after
    /// 3 intervals (at least 3 s). [`MIN_SHARE_INTERVAL`]..=[`MAX_SHARE_INTERVAL`];
    /// default 1 s.
    #[serde(with = "humantime_serde")]
    pub share_interval: Duration,
}

/// One `[[tiers.tier]]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct TierSpec {
    /// Tier name: 1–64 bytes of `[A-Za-z0-9._-]`, unique in the list. Written in the `tier`
    /// field of output records and used as a metrics label.
    pub name: String,
    /// Output topic (Kafka) or subject (NATS) of the tier's emissions: 1–249 bytes of
    /// `[A-Za-z0-9._-]`, not starting or ending with `.`, no `..`.
    pub topic: String,
}

impl TierSpec {
    /// A tier named `name` publishing to `topic`.
    pub fn new(name: &str, topic: &str) -> Self {
        TierSpec {
            name: name.to_owned(),
            topic: topic.to_owned(),
        }
    }
}

impl Default for TiersConfig {
    /// limit 600 per 1 min, recover-ratio 0.5, cooldown 5 min, tiers `normal`
    /// (`settle.ready.normal`) then `limited` (`settle.ready.limited`), demotion to the last
    /// tier, events on `settle.tier-events`, nothing pinned, counts shared every second.
    fn default() -> Self {
        TiersConfig {
            limit: 600,
            period: Duration::from_secs(60),
            recover_ratio: 0.5,
            cooldown: Duration::from_secs(300),
            demote_to: None,
            events_topic: "settle.tier-events".to_owned(),
            tiers: vec![
                TierSpec::new("normal", "settle.ready.normal"),
                TierSpec::new("limited", "settle.ready.limited"),
            ],
            pinned: BTreeMap::new(),
            share_interval: Duration::from_secs(1),
        }
    }
}

/// A `[tiers]` value outside its allowed range. `key` is the full dotted key
/// (`tiers.recover-ratio`, `tiers.tier[1].name`, `tiers.pinned."bigco"`), `message` says what
/// is allowed.
pub type ConfigError = super::KeyError;

impl TiersConfig {
    /// The tiers in order as `name -> topic`, comma-separated (`settle check-config`).
    pub fn routes(&self) -> String {
        let routes: Vec<String> = self
            .tiers
            .iter()
            .map(|t| format!("{} -> {}", t.name, t.topic))
            .collect();
        routes.join(", ")
    }

    /// Checks every value (SEMANTICS §5). Returns the first problem found, naming its key:
    ///
    /// * `tiers.limit` in 1..=[`MAX_LIMIT`]; `tiers.period` in 1 ms..=24 h;
    ///   `tiers.recover-ratio` in (0, 1]; `tiers.cooldown` ≤ 24 h;
    /// * `tiers.tier`: at least one tier; `tiers.tier[i].name` valid and unique;
    ///   `tiers.tier[i].topic` a valid topic;
    /// * `tiers.events-topic` a valid topic, different from every tier topic;
    /// * `tiers.demote-to` names a tier other than the first;
    /// * `tiers.pinned."tenant"`: a valid tenant name (SEMANTICS §2) pinned to a listed tier.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_LIMIT).contains(&self.limit) {
            return Err(ConfigError::new(
                "tiers.limit",
                format!(
                    "must be in 1..={MAX_LIMIT} emissions per period, got {}",
                    self.limit
                ),
            ));
        }
        if self.period < Duration::from_millis(1) || self.period > MAX_DURATION {
            return Err(ConfigError::new(
                "tiers.period",
                format!(
                    "must be between 1ms and 24h, got {}",
                    humantime::format_duration(self.period)
                ),
            ));
        }
        let ratio = self.recover_ratio;
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(ConfigError::new(
                "tiers.recover-ratio",
                format!("must be in (0, 1] (greater than 0, at most 1), got {ratio}"),
            ));
        }
        if self.cooldown > MAX_DURATION {
            return Err(ConfigError::new(
                "tiers.cooldown",
                format!(
                    "must be at most 24h, got {}",
                    humantime::format_duration(self.cooldown)
                ),
            ));
        }
        if self.share_interval < MIN_SHARE_INTERVAL || self.share_interval > MAX_SHARE_INTERVAL {
            return Err(ConfigError::new(
                "tiers.share-interval",
                format!(
                    "must be between 100ms and 1m, got {}",
                    humantime::format_duration(self.share_interval)
                ),
            ));
        }
        if self.tiers.is_empty() {
            return Err(ConfigError::new(
                "tiers.tier",
                "at least one [[tiers.tier]] is required (e.g. normal, limited)",
            ));
        }
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (i, tier) in self.tiers.iter().enumerate() {
            let key = format!("tiers.tier[{i}].name");
            check_tier_name(&tier.name).map_err(|m| ConfigError::new(&key, m))?;
            if let Some(first) = seen.insert(&tier.name, i) {
                return Err(ConfigError::new(
                    key,
                    format!(
                        "duplicate tier name {:?} (also tiers.tier[{first}])",
                        tier.name
                    ),
                ));
            }
            check_topic(&tier.topic)
                .map_err(|m| ConfigError::new(format!("tiers.tier[{i}].topic"), m))?;
        }
        check_topic(&self.events_topic).map_err(|m| ConfigError::new("tiers.events-topic", m))?;
        if let Some(i) = self.tiers.iter().position(|t| t.topic == self.events_topic) {
            return Err(ConfigError::new(
                "tiers.events-topic",
                format!(
                    "{:?} is also the topic of tiers.tier[{i}]; tier events need their own topic",
                    self.events_topic
                ),
            ));
        }
        if let Some(to) = &self.demote_to {
            match seen.get(to.as_str()) {
                None => {
                    return Err(ConfigError::new(
                        "tiers.demote-to",
                        format!("unknown tier {to:?} (tiers are: {})", self.tier_list()),
                    ))
                }
                Some(0) if self.tiers.len() > 1 => {
                    return Err(ConfigError::new(
                        "tiers.demote-to",
                        format!(
                            "{to:?} is the first tier, where tenants start; demote to a later tier"
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        for (tenant, tier) in &self.pinned {
            let key = format!("tiers.pinned.{tenant:?}");
            codec::validate_tenant(tenant)
                .map_err(|e| ConfigError::new(&key, format!("not a valid tenant name: {e}")))?;
            if !seen.contains_key(tier.as_str()) {
                return Err(ConfigError::new(
                    key,
                    format!("unknown tier {tier:?} (tiers are: {})", self.tier_list()),
                ));
            }
        }
        Ok(())
    }

    /// Index of the tier automatic demotion moves to: `demote-to`, else the last tier.
    /// Assumes [`TiersConfig::validate`] passed (an unknown name falls back to the last tier).
    pub(crate) fn demote_to_index(&self) -> usize {
        let last = self.tiers.len().saturating_sub(1);
        self.demote_to
            .as_ref()
            .and_then(|to| self.tiers.iter().position(|t| &t.name == to))
            .unwrap_or(last)
    }

    fn tier_list(&self) -> String {
        self.tiers
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn check_tier_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_TIER_NAME_BYTES {
        return Err(format!(
            "must be 1-{MAX_TIER_NAME_BYTES} bytes, got {} ({name:?})",
            name.len()
        ));
    }
    match name
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        Some(c) => Err(format!("{name:?} has {c:?}; allowed are A-Z a-z 0-9 . _ -")),
        None => Ok(()),
    }
}

fn check_topic(topic: &str) -> Result<(), String> {
    if topic.is_empty() || topic.len() > MAX_TOPIC_BYTES {
        return Err(format!(
            "must be 1-{MAX_TOPIC_BYTES} bytes, got {} ({topic:?})",
            topic.len()
        ));
    }
    if let Some(c) = topic
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "{topic:?} has {c:?}; allowed are A-Z a-z 0-9 . _ - (valid for Kafka and NATS)"
        ));
    }
    if topic.starts_with('.') || topic.ends_with('.') || topic.contains("..") {
        return Err(format!(
            "{topic:?} has an empty `.`-separated token (not a valid NATS subject)"
        ));
    }
    Ok(())
}
