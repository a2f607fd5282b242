//! `[tiers]` config (SEMANTICS §5): defaults, parsing, validation errors that name the key.

use settle::tiers::{ConfigError, Router, TierSpec, TiersConfig};
use std::time::Duration;

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Root {
    #[serde(default)]
    tiers: TiersConfig,
}

fn parse(toml_text: &str) -> Result<TiersConfig, toml::de::Error> {
    toml::from_str::<Root>(toml_text).map(|r| r.tiers)
}

/// The validation error of `[tiers]` written as `body`.
fn rejected(body: &str) -> ConfigError {
    let cfg = parse(&format!("[tiers]\n{body}")).expect("parses");
    cfg.validate().expect_err("must be rejected")
}

#[test]
fn defaults() {
    let d = TiersConfig::default();
    assert_eq!(d.limit, 600);
    assert_eq!(d.period, Duration::from_secs(60));
    assert_eq!(d.recover_ratio, 0.5);
    assert_eq!(d.cooldown, Duration::from_secs(300));
    assert_eq!(d.demote_to, None);
    assert_eq!(d.events_topic, "settle.tier-events");
    assert_eq!(
        d.tiers,
        vec![
            TierSpec::new("normal", "settle.ready.normal"),
            TierSpec::new("limited", "settle.ready.limited"),
        ]
    );
    assert!(d.pinned.is_empty());
    assert_eq!(d.validate(), Ok(()));
    // An absent [tiers] table and an empty one both mean the defaults.
    assert_eq!(parse("").expect("parses"), d);
    assert_eq!(parse("[tiers]").expect("parses"), d);

    let r = Router::new(&d).expect("valid");
    let t = r.tiers();
    assert_eq!(
        (t.first(), t.demote_to(), t.events_topic()),
        ("normal", "limited", "settle.tier-events")
    );
    assert_eq!(
        t.tiers().collect::<Vec<_>>(),
        [
            ("normal", "settle.ready.normal"),
            ("limited", "settle.ready.limited")
        ]
    );
}

#[test]
fn parses_the_documented_example() {
    let cfg = parse(
        r#"
[tiers]
limit = 600
period = "1m"
recover-ratio = 0.5
cooldown = "5m"
events-topic = "settle.tier-events"
[[tiers.tier]]
name = "normal"
topic = "settle.ready.normal"
[[tiers.tier]]
name = "limited"
topic = "settle.ready.limited"
[tiers.pinned]
"bigco" = "limited"
"#,
    )
    .expect("parses");
    let mut expected = TiersConfig::default();
    expected.pinned.insert("bigco".into(), "limited".into());
    assert_eq!(cfg, expected);
    assert_eq!(cfg.validate(), Ok(()));
    let r = Router::new(&cfg).expect("valid");
    assert_eq!(r.tiers().pinned("bigco"), Some("limited"));
    assert_eq!(r.tier_of("bigco"), "limited");
}

#[test]
fn humantime_durations_and_round_trip() {
    let cfg = parse("[tiers]\nperiod = \"90s\"\ncooldown = \"1h 30m\"\ndemote-to = \"limited\"")
        .expect("parses");
    assert_eq!(cfg.period, Duration::from_secs(90));
    assert_eq!(cfg.cooldown, Duration::from_secs(5400));
    assert_eq!(cfg.validate(), Ok(()));
    // What `settle check-config` would print parses back to the same value.
    #[derive(serde::Serialize)]
    struct Out<'a> {
        tiers: &'a TiersConfig,
    }
    let text = toml::to_string(&Out { tiers: &cfg }).expect("serializes");
    assert!(text.contains("period = \"1m 30s\""), "{text}");
    assert_eq!(parse(&text).expect("parses back"), cfg);
}

#[test]
fn unknown_keys_are_rejected() {
    let err = parse("[tiers]\nlimt = 5")
        .expect_err("unknown key")
        .to_string();
    assert!(err.contains("limt"), "{err}");
    let err = parse("[[tiers.tier]]\nname = \"a\"\ntopic = \"t\"\nprio = 1")
        .expect_err("unknown key")
        .to_string();
    assert!(err.contains("prio"), "{err}");
    let err = parse("[tiers]\nperiod = \"soon\"")
        .expect_err("bad duration")
        .to_string();
    assert!(err.contains("period"), "{err}");
}

#[test]
fn recover_ratio_must_be_in_zero_one() {
    for bad in ["0", "0.0", "-0.5", "1.01", "nan", "inf"] {
        let e = rejected(&format!("recover-ratio = {bad}"));
        assert_eq!(e.key, "tiers.recover-ratio", "{bad}: {e}");
        assert!(e.message.contains("(0, 1]"), "{e}");
        assert!(e.to_string().starts_with("tiers.recover-ratio: "), "{e}");
    }
    for good in ["1", "1.0", "0.01"] {
        let cfg = parse(&format!("[tiers]\nrecover-ratio = {good}")).expect("parses");
        assert_eq!(cfg.validate(), Ok(()), "{good}");
    }
}

#[test]
fn ranges_of_limit_period_and_cooldown() {
    assert_eq!(rejected("limit = 0").key, "tiers.limit");
    assert_eq!(rejected("limit = 1000001").key, "tiers.limit");
    assert_eq!(rejected("period = \"0s\"").key, "tiers.period");
    assert_eq!(rejected("period = \"2days\"").key, "tiers.period");
    assert_eq!(rejected("cooldown = \"25h\"").key, "tiers.cooldown");
    let zero_cooldown = parse("[tiers]\ncooldown = \"0s\"").expect("parses");
    assert_eq!(zero_cooldown.validate(), Ok(()));
}

#[test]
fn tier_list_errors_name_the_entry() {
    let e = rejected("tier = []");
    assert_eq!(e.key, "tiers.tier");

    let e = rejected(
        "[[tiers.tier]]\nname = \"normal\"\ntopic = \"a\"\n\
         [[tiers.tier]]\nname = \"normal\"\ntopic = \"b\"",
    );
    assert_eq!(e.key, "tiers.tier[1].name");
    assert!(
        e.message.contains("duplicate") && e.message.contains("tiers.tier[0]"),
        "{e}"
    );

    let e = rejected("[[tiers.tier]]\nname = \"\"\ntopic = \"a\"");
    assert_eq!(e.key, "tiers.tier[0].name");
    let e = rejected("[[tiers.tier]]\nname = \"no rmal\"\ntopic = \"a\"");
    assert_eq!(e.key, "tiers.tier[0].name");
    for topic in ["", "has space", ".lead", "trail.", "a..b", "wild.*"] {
        let e = rejected(&format!(
            "[[tiers.tier]]\nname = \"n\"\ntopic = \"{topic}\""
        ));
        assert_eq!(e.key, "tiers.tier[0].topic", "{topic:?}");
    }
}

#[test]
fn events_topic_and_demote_to_are_checked() {
    assert_eq!(rejected("events-topic = \"\"").key, "tiers.events-topic");
    let e = rejected("events-topic = \"settle.ready.limited\"");
    assert_eq!(e.key, "tiers.events-topic");
    assert!(e.message.contains("tiers.tier[1]"), "{e}");

    let e = rejected("demote-to = \"gold\"");
    assert_eq!(e.key, "tiers.demote-to");
    assert!(e.message.contains("normal, limited"), "{e}");
    let e = rejected("demote-to = \"normal\"");
    assert_eq!(e.key, "tiers.demote-to");
    assert!(e.message.contains("first tier"), "{e}");
}

#[test]
fn pinned_errors_name_the_tenant() {
    let e = rejected("[tiers.pinned]\n\"bigco\" = \"gold\"");
    assert_eq!(e.key, "tiers.pinned.\"bigco\"");
    assert!(e.message.contains("unknown tier \"gold\""), "{e}");
    let e = rejected("[tiers.pinned]\n\"big co\" = \"limited\"");
    assert_eq!(e.key, "tiers.pinned.\"big co\"");
    assert!(e.message.contains("tenant"), "{e}");
}

#[test]
fn router_refuses_an_invalid_config() {
    let cfg = TiersConfig {
        recover_ratio: 0.0,
        ..TiersConfig::default()
    };
    let e = Router::new(&cfg).expect_err("invalid");
    assert_eq!(e.key, "tiers.recover-ratio");
}
