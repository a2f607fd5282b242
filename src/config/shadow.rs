//! `[[shadow]]`: candidate policies run on live traffic beside the live one, emitting nothing
//! (SEMANTICS §8; `engine::shadow`). Each entry has a `name` and the policy keys of
//! `[debounce]` (`policy`, `delay`, `min-delay`, `max-delay`, `max-wait`, `state-ttl`,
//! `learn-initial-delay`), each optional: a key not set is inherited from `[debounce]` (not
//! from its tenant overrides: one shadow policy applies to every tenant, as in `settle
//! tune`). Their memory budget is `runtime.shadow-max-sessions`.

use super::{
    check_debounce_durations, check_spec, invalid, opt_duration, tenant_max_wait, ConfigError,
    DebounceConfig, TenantOverride,
};
use crate::engine::shadow::{ShadowSpec, LIVE, MAX_SHADOWS};
use crate::engine::PolicyName;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Longest shadow name (bytes).
pub const MAX_SHADOW_NAME: usize = 64;

/// One `[[shadow]]` entry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ShadowConfig {
    /// `name`: the label of its figures (metrics label `shadow`, `GET /v1/shadow`): 1-64
    /// bytes of `[A-Za-z0-9._-]`, unique, not `live` (the live policy's).
    pub name: String,
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
    /// `max-wait`: `None` inherits, `Some(None)` (`"off"`) turns it off for this shadow.
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
}

impl ShadowConfig {
    /// The policy keys of this entry as an override of `[debounce]`.
    // A literal with every key: keys `[debounce]` gains later (not shadowed) stay unset.
    #[allow(clippy::needless_update)]
    fn as_override(&self) -> TenantOverride {
        TenantOverride {
            policy: self.policy,
            delay: self.delay,
            min_delay: self.min_delay,
            max_delay: self.max_delay,
            max_wait: self.max_wait,
            state_ttl: self.state_ttl,
            learn_initial_delay: self.learn_initial_delay,
            ..TenantOverride::default()
        }
    }

    /// The section this shadow runs: its keys over `debounce`'s.
    pub fn resolved(&self, debounce: &DebounceConfig) -> DebounceConfig {
        debounce.with_override(&self.as_override())
    }
}

/// The shadow policies of `shadows` in engine form, keys not set inherited from `debounce`,
/// each holding at most `max_sessions` keys per partition.
pub fn specs(
    shadows: &[ShadowConfig],
    debounce: &DebounceConfig,
    max_sessions: u32,
) -> Vec<ShadowSpec> {
    shadows
        .iter()
        .map(|s| ShadowSpec {
            name: s.name.clone(),
            // A shadow emits nothing, so it lists no event ids (whatever `[debounce]` keeps).
            policy: s.resolved(debounce).spec().with_event_ids(0),
            max_sessions: max_sessions as usize,
        })
        .collect()
}

/// Checks the `[[shadow]]` list: at most [`MAX_SHADOWS`] entries; each name valid, unique
/// and not `live`; each resolved policy by the rules of `[debounce]`. Keys are named
/// `shadow[i].key`.
///
/// Errors: [`ConfigError::Invalid`] for the first bad key.
pub(super) fn validate(
    shadows: &[ShadowConfig],
    debounce: &DebounceConfig,
) -> Result<(), ConfigError> {
    if shadows.len() > MAX_SHADOWS {
        return Err(invalid(
            "shadow",
            format!(
                "at most {MAX_SHADOWS} [[shadow]] entries (each runs on every upload), got {}",
                shadows.len()
            ),
        ));
    }
    for (i, s) in shadows.iter().enumerate() {
        let section = format!("shadow[{i}]");
        let key = format!("{section}.name");
        let name = s.name.as_str();
        let alphabet = name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if name.is_empty() || name.len() > MAX_SHADOW_NAME || !alphabet {
            return Err(invalid(
                &key,
                format!("invalid name {name:?}: 1-{MAX_SHADOW_NAME} bytes of A-Za-z0-9 . _ -"),
            ));
        }
        if name == LIVE {
            return Err(invalid(
                &key,
                format!("{LIVE:?} names the live policy's figures; choose another name"),
            ));
        }
        if let Some(first) = shadows[..i].iter().position(|o| o.name == s.name) {
            return Err(invalid(
                &key,
                format!("duplicate shadow name {name:?} (also shadow[{first}])"),
            ));
        }
        let resolved = s.resolved(debounce);
        check_debounce_durations(&section, &resolved)?;
        check_spec(
            &section,
            &resolved,
            " (keys not set for the shadow are inherited from [debounce])",
        )?;
    }
    Ok(())
}

/// Largest `runtime.shadow-max-sessions` (session keys).
pub const MAX_SHADOW_SESSIONS: u32 = 10_000_000;

#[cfg(test)]
mod tests {
    use super::super::Config;
    use crate::engine::PolicyName;

    fn key_of(toml: &str) -> String {
        match Config::from_toml_str(toml) {
            Ok(c) => panic!("expected an error for {toml:?}, got {c:?}"),
            Err(e) => {
                let text = e.to_string();
                let key = e.key().unwrap_or_default().to_owned();
                assert!(text.starts_with(&key), "{text}");
                key
            }
        }
    }

    #[test]
    fn shadows_inherit_debounce_and_run_uniformly() {
        let c = Config::from_toml_str(
            r#"
[debounce]
policy = "fixed"
delay = "10s"
max-wait = "30m"
event-ids = 64
[debounce.tenants.acme]
delay = "1s"
[[shadow]]
name = "slow"
delay = "1m"
[[shadow]]
name = "adaptive-5s"
policy = "adaptive"
min-delay = "5s"
max-wait = "off"
"#,
        )
        .unwrap();
        let specs = c.shadow_specs();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].name, "slow");
        assert_eq!(specs[0].policy.name, PolicyName::Fixed);
        assert_eq!(specs[0].policy.delay, 60_000);
        assert_eq!(specs[0].policy.max_wait, Some(1_800_000));
        assert_eq!(specs[1].policy.name, PolicyName::Adaptive);
        assert_eq!(specs[1].policy.min_delay, 5_000);
        assert_eq!(specs[1].policy.max_wait, None);
        assert_eq!(specs[1].max_sessions, 100_000);
        // Shadows emit nothing: they keep no event ids, whatever [debounce] lists.
        assert!(specs.iter().all(|s| s.policy.event_ids == 0));
        assert_eq!(c.policy_table().default.event_ids, 64);
        assert!(Config::default().shadow_specs().is_empty());
    }

    #[test]
    fn bad_shadows_name_the_key() {
        assert_eq!(key_of("[[shadow]]\nname = \"live\""), "shadow[0].name");
        assert_eq!(key_of("[[shadow]]\nname = \"a b\""), "shadow[0].name");
        assert_eq!(key_of("[[shadow]]\nname = \"\""), "shadow[0].name");
        assert_eq!(
            key_of("[[shadow]]\nname = \"a\"\n[[shadow]]\nname = \"a\""),
            "shadow[1].name"
        );
        assert_eq!(
            key_of("[[shadow]]\nname = \"a\"\ndelay = \"0s\""),
            "shadow[0].delay"
        );
        assert_eq!(
            key_of(
                "[[shadow]]\nname = \"a\"\npolicy = \"adaptive\"\nmin-delay = \"5m\"\nmax-delay = \"1m\""
            ),
            "shadow[0].max-delay"
        );
        let five = "[[shadow]]\nname = \"a\"\n[[shadow]]\nname = \"b\"\n[[shadow]]\nname = \"c\"\n[[shadow]]\nname = \"d\"\n[[shadow]]\nname = \"e\"";
        assert_eq!(key_of(five), "shadow");
        assert_eq!(
            key_of("[runtime]\nshadow-max-sessions = 0"),
            "runtime.shadow-max-sessions"
        );
        let unknown = key_of("[[shadow]]\nname = \"a\"\nnope = 1");
        assert!(
            unknown.starts_with("shadow") && unknown.ends_with("nope"),
            "{unknown}"
        );
    }
}
