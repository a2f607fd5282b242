//! What instances tell each other about tenants (SEMANTICS §5: the rate is the deployment's,
//! a tier outlives restarts): the [`CountsSnapshot`] each instance publishes every
//! `tiers.share-interval` through the broker (Kafka: the compacted `kafka.tier-counts-topic`,
//! record key = instance; NATS: the KV bucket `nats.tier-counts-bucket`, key = instance), and
//! the stable hash that picks which live instance reports a tenant's tier changes.
//!
//! The transport only moves bytes ([`CountsSnapshot::to_json`] / [`CountsSnapshot::from_json`]);
//! the router ([`super::Router::apply_remote`], [`super::Router::restore`]) decides with them.
//!
//! # Shape and size
//!
//! ```json
//! {"instance":"host-a-4242","at":"2026-12-01T20:00:01.000Z","period-ms":60000,
//!  "interval-ms":1000,"counts":{"acme":512,"bigco":17},
//!  "demoted":[{"tenant":"noisy","since":"2026-12-01T19:58:00.000Z",
//!              "above-until":"2026-12-01T20:00:01.000Z"}]}
//! ```
//!
//! `counts` holds the instance's own emissions of each tenant in `(at - period, at]`, at most
//! [`MAX_SHARED_TENANTS`] tenants (the largest counts; a tenant left out is one whose count
//! is below all of those, too small to matter next to `limit`), and `demoted` at most
//! [`MAX_SHARED_TENANTS`] demoted tenants with when they were demoted and until when their
//! rate was last known to be at or above the recovery threshold. So one snapshot is at most
//! about 200 KB, typically a few hundred bytes.

use super::event::rfc3339_ms;
use crate::engine::Millis;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most tenants in one snapshot's `counts`, and in its `demoted` list.
pub const MAX_SHARED_TENANTS: usize = 2_000;

/// Counts of an instance expire this many share intervals after they arrived, unless a newer
/// snapshot of the same instance replaced them.
pub const EXPIRY_INTERVALS: u64 = 3;

/// ... and never sooner than this (ms), whatever the interval.
pub const MIN_EXPIRY_MS: Millis = 3_000;

/// One instance's view of its tenants at `at` (see the module doc for the JSON form).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct CountsSnapshot {
    /// The publishing instance (Kafka `kafka.instance-id`, NATS `<host>-<pid>`): also the
    /// record key, so a compacted log keeps the latest snapshot of each instance.
    pub instance: String,
    /// When it was taken: the instance's router time (ms; RFC 3339 in JSON).
    #[serde(with = "rfc3339_ms")]
    pub at: Millis,
    /// The instance's `tiers.period` (ms). Counts of a different period are still summed;
    /// the receiver logs the mismatch once.
    pub period_ms: u64,
    /// The instance's `tiers.share-interval` (ms): when its counts expire.
    pub interval_ms: u64,
    /// Tenant → the instance's own emissions of it in `(at - period, at]`.
    #[serde(default)]
    pub counts: BTreeMap<String, u64>,
    /// Tenants the instance had demoted automatically at `at`.
    #[serde(default)]
    pub demoted: Vec<SharedDemotion>,
    /// The instance's last snapshot, sent as it stops: the others stop counting it among
    /// the live instances at once, and its counts fade out over one period.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stopping: bool,
}

/// One demoted tenant of a [`CountsSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct SharedDemotion {
    /// The tenant.
    pub tenant: String,
    /// When it was demoted (ms).
    #[serde(with = "rfc3339_ms")]
    pub since: Millis,
    /// Until when its deployment-wide rate was known to be at or above the recovery threshold
    /// (ms): it recovers `cooldown` after this unless its rate reaches the threshold again.
    #[serde(with = "rfc3339_ms")]
    pub above_until: Millis,
}

impl CountsSnapshot {
    /// The JSON form (UTF-8).
    pub fn to_json(&self) -> Vec<u8> {
        // Invariant: strings, integers and RFC 3339 strings only: always serializes.
        serde_json::to_vec(self).expect("CountsSnapshot always serializes to JSON")
    }

    /// Reads a snapshot published by an instance.
    ///
    /// Errors: not a snapshot (the message says why; the caller logs and skips it).
    pub fn from_json(bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("not a tier-counts snapshot: {e}"))
    }

    /// When the counts of this snapshot stop counting, for a snapshot received at `received`
    /// (ms): [`EXPIRY_INTERVALS`] of its interval later, at least [`MIN_EXPIRY_MS`].
    pub fn expires_at(&self, received: Millis) -> Millis {
        let span = self.interval_ms.saturating_mul(EXPIRY_INTERVALS);
        let span = Millis::try_from(span)
            .unwrap_or(Millis::MAX)
            .max(MIN_EXPIRY_MS);
        received.saturating_add(span)
    }
}

/// FNV-1a (64 bit) of `bytes`: the same on every instance, build and platform (std's hashers
/// promise neither), so every instance picks the same reporter of a tenant.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_and_expiry() {
        let s = CountsSnapshot {
            instance: "a-1".into(),
            at: 1_764_619_200_000,
            period_ms: 60_000,
            interval_ms: 2_000,
            counts: [("acme".to_owned(), 512)].into(),
            demoted: vec![SharedDemotion {
                tenant: "noisy".into(),
                since: 1_764_619_100_000,
                above_until: 1_764_619_200_000,
            }],
            stopping: false,
        };
        let json = String::from_utf8(s.to_json()).unwrap();
        assert!(
            json.contains(r#""at":"2025-12-01T20:00:00.000Z""#),
            "{json}"
        );
        assert!(json.contains(r#""above-until""#), "{json}");
        assert_eq!(CountsSnapshot::from_json(json.as_bytes()).unwrap(), s);
        assert_eq!(s.expires_at(10_000), 16_000);
        let fast = CountsSnapshot {
            interval_ms: 100,
            ..s
        };
        assert_eq!(fast.expires_at(10_000), 13_000, "never below 3 s");
        assert!(CountsSnapshot::from_json(b"{}").is_err());
    }

    #[test]
    fn stable_hash_is_fnv1a() {
        assert_eq!(stable_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
