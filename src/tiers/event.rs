//! What the router reports: tier changes (the tier-events record, SEMANTICS §5), the listing of
//! demoted tenants, and counters for metrics.

use crate::codec::{format_rfc3339_ms, parse_rfc3339_ms};
use crate::engine::Millis;
use serde::{Deserialize, Serialize};

/// Why a tenant changed tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeReason {
    /// More than `limit` emissions within one `period`: demoted.
    RateExceeded,
    /// Rate stayed below `limit × recover-ratio` for `cooldown`: promoted back.
    Recovered,
}

impl ChangeReason {
    /// The wire name and metrics label (`rate_exceeded`, `recovered`).
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeReason::RateExceeded => "rate_exceeded",
            ChangeReason::Recovered => "recovered",
        }
    }
}

/// One tier change of a tenant (SEMANTICS §5). Its JSON form is the record published on the
/// tier-events topic (record key: the tenant), with exactly these fields:
///
/// ```json
/// {"tenant":"acme","from":"normal","to":"limited","rate":601,"limit":600,
///  "at":"2026-11-30T03:34:47.123Z","reason":"rate_exceeded"}
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierChange {
    /// The tenant that moved.
    pub tenant: String,
    /// Tier before the change.
    pub from: String,
    /// Tier after the change.
    pub to: String,
    /// Emissions in `(at - period, at]` when the change was decided. For `rate_exceeded` it
    /// includes the emission that crossed the limit (so it is `limit + 1`); for `recovered`
    /// it is the rate that stayed below the recovery threshold.
    pub rate: u64,
    /// `tiers.limit` (emissions per period).
    pub limit: u64,
    /// When the change was decided (ms; RFC 3339 with milliseconds in JSON): the router time
    /// of the `route` or `sweep` call that made it.
    #[serde(with = "rfc3339_ms")]
    pub at: Millis,
    /// Why.
    pub reason: ChangeReason,
}

impl TierChange {
    /// The JSON record for the tier-events topic (UTF-8 bytes).
    pub fn to_json(&self) -> Vec<u8> {
        // Invariant: every field is a string, an integer or a unit enum, which always
        // serialize to JSON.
        serde_json::to_vec(self).expect("TierChange always serializes to JSON")
    }

    /// A stable id of this change, `tenant/tier-change/<to>/<at ms>`: the Kafka header
    /// `settle-emission-id` of its tier-events record, so consumers can drop a re-published
    /// change as they drop a re-published emission.
    pub fn event_id(&self) -> String {
        format!("{}/tier-change/{}/{}", self.tenant, self.to, self.at)
    }
}

/// One tenant currently demoted automatically (pinned tenants are not listed): a row of
/// `settle inspect` and of the admin API. Times are RFC 3339 with milliseconds in JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DemotedTenant {
    /// The tenant.
    pub tenant: String,
    /// Tier it is routed to.
    pub tier: String,
    /// When it was demoted (ms).
    #[serde(with = "rfc3339_ms")]
    pub since: Millis,
    /// Its rate now, deployment-wide (this instance's emissions per period plus the other
    /// instances' latest counts; above `limit + 1` an estimate).
    pub rate: u64,
    /// `tiers.limit` (emissions per period).
    pub limit: u64,
    /// Earliest promotion (ms) if its rate stays below the recovery threshold from now on.
    #[serde(with = "rfc3339_ms")]
    pub recovers_at: Millis,
}

/// Counters for metrics (monotone since the router was built, except the two gauges).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCounters {
    /// Tier changes with reason `rate_exceeded`.
    pub demotions: u64,
    /// Tier changes with reason `recovered`.
    pub recoveries: u64,
    /// Emissions routed, per tier in config order: `(tier name, count)`.
    pub routed: Vec<(String, u64)>,
    /// Gauge: tenants the router keeps state for.
    pub tenants_tracked: usize,
    /// Gauge: tenants currently demoted automatically.
    pub tenants_demoted: usize,
}

/// serde for `Millis` as an RFC 3339 string with milliseconds (`#[serde(with = ...)]`).
pub(crate) mod rfc3339_ms {
    use super::{format_rfc3339_ms, parse_rfc3339_ms, Millis};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Millis, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_rfc3339_ms(*v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Millis, D::Error> {
        let text = String::deserialize(d)?;
        parse_rfc3339_ms(&text).map_err(serde::de::Error::custom)
    }
}
