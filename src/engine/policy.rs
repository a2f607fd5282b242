//! Policy parameters as the engine sees them: already validated, all durations in ms.
//! Built from the `[debounce]` config section by `config` (SEMANTICS §4).

use super::types::{Millis, PolicyName};
use std::collections::HashMap;

/// Default `state-ttl`: 24 h in ms (SEMANTICS §4, adaptive).
pub const DEFAULT_STATE_TTL_MS: Millis = 24 * 60 * 60 * 1000;

/// Most event ids a round may keep (`event-ids`, SEMANTICS §2): 100 000 ids, a few MB for
/// one round at most.
pub const EVENT_IDS_MAX: u32 = 100_000;

/// One policy with its parameters (ms). Invariants (checked by [`PolicySpec::validate`]):
/// `delay ≥ 1`, `1 ≤ min_delay ≤ max_delay`, `max_wait ≥ 1` when set, `state_ttl ≥ 1`,
/// `event_ids ≤ EVENT_IDS_MAX`. `learn_initial_delay` is used by `adaptive` only (other
/// policies ignore it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicySpec {
    /// Which policy.
    pub name: PolicyName,
    /// `delay` (ms) of `fixed` and `leading-trailing`.
    pub delay: Millis,
    /// `min-delay` (ms) of `adaptive`: the delay after a key's first upload.
    pub min_delay: Millis,
    /// `max-delay` (ms) of `adaptive`: the cap of the adaptive delay.
    pub max_delay: Millis,
    /// `max-wait` (ms), any policy: a round is emitted no later than `start + max_wait`.
    pub max_wait: Option<Millis>,
    /// `state-ttl` (ms): per-key state is forgotten this long after the last upload.
    pub state_ttl: Millis,
    /// `learn-initial-delay` of `adaptive`: a key's first upload starts from its tenant's
    /// learned delay instead of `min_delay` (see `engine::learn`).
    pub learn_initial_delay: bool,
    /// `event-ids`, any policy: how many of a round's upload `event_id`s its emission lists
    /// (ids; SEMANTICS §2 `event_ids`). 0 (the default): none, and the emission has no
    /// `event_ids` / `event_ids_dropped` (today's record, byte for byte).
    pub event_ids: u32,
}

impl PolicySpec {
    /// `fixed` with `delay` ms, no max-wait, default state-ttl.
    pub fn fixed(delay: Millis) -> Self {
        PolicySpec {
            name: PolicyName::Fixed,
            delay,
            min_delay: delay,
            max_delay: delay,
            max_wait: None,
            state_ttl: DEFAULT_STATE_TTL_MS,
            learn_initial_delay: false,
            event_ids: 0,
        }
    }

    /// `leading-trailing` with `delay` ms, no max-wait, default state-ttl.
    pub fn leading_trailing(delay: Millis) -> Self {
        PolicySpec {
            name: PolicyName::LeadingTrailing,
            ..Self::fixed(delay)
        }
    }

    /// `adaptive` with `min_delay`/`max_delay` ms, no max-wait, default state-ttl.
    pub fn adaptive(min_delay: Millis, max_delay: Millis) -> Self {
        PolicySpec {
            name: PolicyName::Adaptive,
            delay: min_delay,
            min_delay,
            max_delay,
            max_wait: None,
            state_ttl: DEFAULT_STATE_TTL_MS,
            learn_initial_delay: false,
            event_ids: 0,
        }
    }

    /// The same policy with `max-wait` set to `max_wait` ms.
    pub fn with_max_wait(mut self, max_wait: Millis) -> Self {
        self.max_wait = Some(max_wait);
        self
    }

    /// The same policy with `state-ttl` set to `ttl` ms.
    pub fn with_state_ttl(mut self, ttl: Millis) -> Self {
        self.state_ttl = ttl;
        self
    }

    /// The same policy with `learn-initial-delay` set to `learn` (effective under `adaptive`).
    pub fn with_learned_initial_delay(mut self, learn: bool) -> Self {
        self.learn_initial_delay = learn;
        self
    }

    /// The same policy keeping the first `n` event ids of each round (`event-ids`; 0: none).
    pub fn with_event_ids(mut self, n: u32) -> Self {
        self.event_ids = n;
        self
    }

    /// Checks the invariants. Errors name the offending key (`delay`, `min-delay`, ...).
    pub fn validate(&self) -> Result<(), String> {
        match self.name {
            PolicyName::Fixed | PolicyName::LeadingTrailing => {
                if self.delay < 1 {
                    return Err(format!("delay must be at least 1ms, got {}ms", self.delay));
                }
            }
            PolicyName::Adaptive => {
                if self.min_delay < 1 {
                    return Err(format!(
                        "min-delay must be at least 1ms, got {}ms",
                        self.min_delay
                    ));
                }
                if self.max_delay < self.min_delay {
                    return Err(format!(
                        "max-delay ({}ms) must be at least min-delay ({}ms)",
                        self.max_delay, self.min_delay
                    ));
                }
            }
        }
        if let Some(w) = self.max_wait {
            if w < 1 {
                return Err(format!("max-wait must be at least 1ms, got {w}ms"));
            }
        }
        if self.state_ttl < 1 {
            return Err(format!(
                "state-ttl must be at least 1ms, got {}ms",
                self.state_ttl
            ));
        }
        if self.event_ids > EVENT_IDS_MAX {
            return Err(format!(
                "event-ids must be 0 to {EVENT_IDS_MAX}, got {}",
                self.event_ids
            ));
        }
        Ok(())
    }
}

impl PolicySpec {
    /// Whether a round timed under this rule keeps its timing under `self`: the same policy,
    /// the same delay (`fixed`, `leading-trailing`) or a delay `adaptive` could have chosen
    /// (within `[min-delay, max-delay]`), and the same max-wait bound (none, or
    /// `start + max-wait`). `false` for a round that does not name its policy (stored before
    /// rounds recorded it). What the start-up log counts (SEMANTICS §7: a round keeps its
    /// due time until its next upload, then the rule in force times it).
    pub fn times_alike(&self, round: &super::types::Round) -> bool {
        let delay_alike = match self.name {
            PolicyName::Fixed | PolicyName::LeadingTrailing => round.delay == self.delay,
            PolicyName::Adaptive => (self.min_delay..=self.max_delay).contains(&round.delay),
        };
        round.policy == Some(self.name)
            && delay_alike
            && round.max_wait_at == self.max_wait.map(|w| round.start + w)
    }
}

impl std::fmt::Display for PolicySpec {
    /// One line for logs: `fixed delay=30s max-wait=20s state-ttl=1day`,
    /// `adaptive min-delay=2s max-delay=10s max-wait=off state-ttl=30s learn-initial-delay
    /// event-ids=64` (`event-ids` only when not 0, so a rule that keeps none reads, and
    /// fingerprints, as before it existed).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = |ms: Millis| {
            humantime::format_duration(core::time::Duration::from_millis(ms.max(0) as u64))
        };
        f.write_str(self.name.as_str())?;
        match self.name {
            PolicyName::Fixed | PolicyName::LeadingTrailing => {
                write!(f, " delay={}", d(self.delay))?
            }
            PolicyName::Adaptive => write!(
                f,
                " min-delay={} max-delay={}",
                d(self.min_delay),
                d(self.max_delay)
            )?,
        }
        match self.max_wait {
            Some(w) => write!(f, " max-wait={}", d(w))?,
            None => f.write_str(" max-wait=off")?,
        }
        write!(f, " state-ttl={}", d(self.state_ttl))?;
        if self.learn_initial_delay && self.name == PolicyName::Adaptive {
            f.write_str(" learn-initial-delay")?;
        }
        if self.event_ids > 0 {
            write!(f, " event-ids={}", self.event_ids)?;
        }
        Ok(())
    }
}

/// The default policy plus per-tenant overrides (`[debounce.tenants.NAME]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyTable {
    /// Policy of every tenant without an override.
    pub default: PolicySpec,
    /// Overrides by tenant name.
    pub tenants: HashMap<String, PolicySpec>,
}

impl PolicyTable {
    /// One policy for every tenant.
    pub fn uniform(spec: PolicySpec) -> Self {
        PolicyTable {
            default: spec,
            tenants: HashMap::new(),
        }
    }

    /// The policy in force for `tenant`.
    pub fn for_tenant(&self, tenant: &str) -> &PolicySpec {
        if self.tenants.is_empty() {
            return &self.default;
        }
        self.tenants.get(tenant).unwrap_or(&self.default)
    }

    /// A number that changes whenever a rule of the table changes (FNV-1a over the rules'
    /// [`Display`](std::fmt::Display) text, tenants in name order): stable across processes
    /// and builds, so a store can tell whether it was last run under the same rules.
    pub fn fingerprint(&self) -> u64 {
        let mut text = self.default.to_string();
        let mut tenants: Vec<(&String, &PolicySpec)> = self.tenants.iter().collect();
        tenants.sort_by_key(|(name, _)| *name);
        for (name, spec) in tenants {
            text.push_str(&format!("\n{name}: {spec}"));
        }
        text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }
}

impl std::fmt::Display for PolicyTable {
    /// The default rule, then `; tenant NAME: rule` per override in name order.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.default)?;
        let mut tenants: Vec<(&String, &PolicySpec)> = self.tenants.iter().collect();
        tenants.sort_by_key(|(name, _)| *name);
        for (name, spec) in tenants {
            write!(f, "; tenant {name}: {spec}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_print_their_parameters_and_the_fingerprint_follows_them() {
        let a = PolicySpec::fixed(30_000).with_max_wait(20_000);
        let c = PolicySpec::adaptive(2_000, 10_000).with_state_ttl(30_000);
        assert_eq!(a.to_string(), "fixed delay=30s max-wait=20s state-ttl=1day");
        assert_eq!(
            c.to_string(),
            "adaptive min-delay=2s max-delay=10s max-wait=off state-ttl=30s"
        );
        let mut table = PolicyTable::uniform(c.clone());
        let plain = table.fingerprint();
        assert_eq!(plain, PolicyTable::uniform(c.clone()).fingerprint());
        assert_ne!(plain, PolicyTable::uniform(a.clone()).fingerprint());
        table.tenants.insert("acme".into(), a);
        assert_ne!(table.fingerprint(), plain);
        assert_eq!(
            table.to_string(),
            "adaptive min-delay=2s max-delay=10s max-wait=off state-ttl=30s; tenant acme: fixed delay=30s max-wait=20s state-ttl=1day"
        );
    }
}
