//! `Config::load`: file, environment (`SETTLE_…`) and their precedence, and the shipped
//! `config/settle.toml`. Environment tests run inside `figment::Jail`, which serializes them
//! and restores the environment afterwards.
//!
//! Its own test binary, apart from `tests/offline/` and `tests/e2e/`: `Config::load` reads
//! the process environment, so these tests set (and `Jail` clears) variables of the whole
//! process and change its working directory, which tests running beside them in one process
//! would see (a broker test losing `SETTLE_TEST_KAFKA`, a child spawned with an empty
//! environment, C code reading the environment while it changes).

use figment::Jail;
use settle::config::{Config, ConfigError, Transport};
use settle::engine::{PolicyName, PolicySpec};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn shipped() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("config/settle.toml")
}

/// Runs `f` in a jail with an empty environment.
// The closure's error type is figment's own (large) `figment::Error`, fixed by `Jail`.
#[allow(clippy::result_large_err)]
fn jailed(f: impl FnOnce(&mut Jail) -> Result<(), String>) {
    Jail::expect_with(|jail| {
        jail.clear_env();
        f(jail).map_err(figment::Error::from)
    });
}

/// What `settle check-config settle.toml` prints (in the jail's directory).
fn check_config_output() -> Result<String, String> {
    let mut out = Vec::new();
    settle::cli::check_config::run(Path::new("settle.toml"), &mut out)
        .map_err(|e| e.to_string())?;
    String::from_utf8(out).map_err(|e| e.to_string())
}

#[test]
fn shipped_file_equals_the_defaults() {
    jailed(|_| {
        let c = Config::load(Some(&shipped())).map_err(|e| e.to_string())?;
        assert_eq!(c, Config::default());
        assert_eq!(
            Config::load(None).map_err(|e| e.to_string())?,
            Config::default()
        );
        Ok(())
    });
}

#[test]
fn shipped_file_examples_parse_when_uncommented() {
    let text = std::fs::read_to_string(shipped()).unwrap();
    // Commented-out settings look like `# key = value` or `# [table]`.
    let uncommented: String = text
        .lines()
        .map(|l| match l.strip_prefix("# ") {
            Some(rest)
                if rest.starts_with('[')
                    || rest.split_once(" = ").is_some_and(|(k, _)| {
                        k.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
                    }) =>
            {
                rest
            }
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let c = Config::from_toml_str(&uncommented).unwrap();
    assert_eq!(c.debounce.max_wait, Some(Duration::from_secs(30 * 60)));
    let acme = c.policy_table().for_tenant("acme").clone();
    assert_eq!(acme.name, PolicyName::Fixed);
    assert_eq!(acme.delay, 500);
    assert_eq!(acme.max_wait, Some(1_800_000));
    // The [[shadow]] example: inherits max-wait from [debounce], not acme's delay.
    let shadows = c.shadow_specs();
    assert_eq!(shadows.len(), 1);
    assert_eq!(shadows[0].name, "fixed-30s");
    assert_eq!(shadows[0].policy.name, PolicyName::Fixed);
    assert_eq!(shadows[0].policy.delay, 30_000);
    assert_eq!(shadows[0].policy.max_wait, Some(1_800_000));
    assert_eq!(shadows[0].max_sessions, 100_000);
}

#[test]
fn shipped_file_documents_every_key_with_its_env_var() {
    let text = std::fs::read_to_string(shipped()).unwrap();
    let defaults = toml::to_string(&Config::default()).unwrap();
    let mut section = String::new();
    // Inside an array of tables (`[[tiers.tier]]`): a list, which has no environment form.
    let mut in_array = false;
    let mut keys = 0;
    for line in defaults.lines() {
        if let Some(s) = line.strip_prefix('[') {
            in_array = s.starts_with('[');
            section = s.trim_matches(|c| c == '[' || c == ']').to_owned();
        } else if let Some((key, _)) = line.split_once(" = ") {
            assert!(
                text.contains(&format!("\n{key} = ")),
                "{section}.{key} not set in settle.toml"
            );
            if in_array {
                assert!(
                    text.contains(&format!("\n[[{section}]]\n")),
                    "[[{section}]] not in settle.toml"
                );
            } else {
                // Top-level keys (`transport`) come before any section.
                let path = if section.is_empty() {
                    key.to_owned()
                } else {
                    format!("{section}.{key}")
                };
                let env = settle::config::env_var_for(&path);
                assert!(text.contains(&env), "{env} not documented in settle.toml");
            }
            keys += 1;
        }
    }
    // transport 1, debounce 7 (max-wait unset), store 4, runtime 5, admin 4 (tokens and
    // TLS files unset), kafka 6 (changelog-topic and tier-counts-topic unset), nats 18 (auth
    // and TLS files unset; changelog-stream, changelog-subject-prefix, tier-counts-bucket,
    // overrides-bucket unset: derived; heartbeat-interval), tiers 6 (demote-to unset;
    // share-interval), 2 tiers × 2; no [[shadow]] (commented out).
    assert_eq!(keys, 55);
    assert!(text.contains("SETTLE_RUNTIME__SHADOW_MAX_SESSIONS"));
    assert!(text.contains("SETTLE_DEBOUNCE__MAX_WAIT"));
    assert!(text.contains("SETTLE_TIERS__DEMOTE_TO"));
    assert!(text.contains("SETTLE_KAFKA__CHANGELOG_TOPIC"));
    assert!(text.contains("SETTLE_KAFKA__TIER_COUNTS_TOPIC"));
    for env in [
        "SETTLE_NATS__CHANGELOG_STREAM",
        "SETTLE_NATS__TIER_COUNTS_BUCKET",
        "SETTLE_NATS__TOKEN_FILE",
        "SETTLE_NATS__PASSWORD_FILE",
    ] {
        assert!(text.contains(env), "{env} not documented in settle.toml");
    }
}

#[test]
fn file_then_environment() {
    jailed(|jail| {
        jail.create_file(
            "settle.toml",
            r#"
            [debounce]
            policy = "fixed"
            delay = "2s"
            min-delay = "1s"
            [runtime]
            batch-size = 10
            "#,
        )
        .map_err(|e| e.to_string())?;
        jail.set_env("SETTLE_DEBOUNCE__DELAY", "750ms");
        jail.set_env("SETTLE_DEBOUNCE__MAX_WAIT", "1h");
        jail.set_env("SETTLE_RUNTIME__BATCH_SIZE", "64");
        jail.set_env("SETTLE_RUNTIME__CATCH_UP_RATE", "5");
        jail.set_env("SETTLE_STORE__DATA_DIR", "/var/lib/settle");
        let c = Config::load(Some(Path::new("settle.toml"))).map_err(|e| e.to_string())?;
        assert_eq!(c.debounce.policy, PolicyName::Fixed, "file value kept");
        assert_eq!(
            c.debounce.delay,
            Duration::from_millis(750),
            "env beats file"
        );
        assert_eq!(
            c.debounce.min_delay,
            Duration::from_secs(1),
            "file beats default"
        );
        assert_eq!(c.debounce.max_wait, Some(Duration::from_secs(3600)));
        assert_eq!(c.runtime.batch_size, 64);
        assert_eq!(c.runtime.catch_up_rate, 5);
        assert_eq!(c.store.data_dir, PathBuf::from("/var/lib/settle"));
        assert_eq!(
            c.policy_table().default,
            PolicySpec {
                min_delay: 1_000,
                max_delay: 600_000,
                ..PolicySpec::fixed(750).with_max_wait(3_600_000)
            }
        );
        Ok(())
    });
}

#[test]
fn env_sets_nested_and_tenant_keys() {
    jailed(|jail| {
        jail.set_env("SETTLE_DEBOUNCE__MIN_DELAY", "2s");
        jail.set_env("SETTLE_DEBOUNCE__TENANTS__ACME__POLICY", "leading-trailing");
        jail.set_env("SETTLE_DEBOUNCE__TENANTS__ACME__MAX_WAIT", "off");
        jail.set_env("SETTLE_DEBOUNCE__EVENT_IDS", "64");
        jail.set_env("SETTLE_DEBOUNCE__TENANTS__ACME__EVENT_IDS", "0");
        let c = Config::load(None).map_err(|e| e.to_string())?;
        assert_eq!(c.policy_table().default.event_ids, 64);
        assert_eq!(c.policy_table().for_tenant("acme").event_ids, 0);
        assert_eq!(c.debounce.min_delay, Duration::from_secs(2));
        let t = c.policy_table();
        assert_eq!(t.default.min_delay, 2_000);
        assert_eq!(t.for_tenant("acme").name, PolicyName::LeadingTrailing);
        assert_eq!(t.for_tenant("acme").delay, 10_000, "inherited");
        Ok(())
    });
}

#[test]
fn env_without_a_section_is_not_config() {
    jailed(|jail| {
        jail.set_env("SETTLE_CONFIG", "/etc/settle.toml");
        jail.set_env("SETTLE_LOG", "debug");
        jail.set_env("OTHER__DEBOUNCE__DELAY", "nonsense");
        assert_eq!(
            Config::load(None).map_err(|e| e.to_string())?,
            Config::default()
        );
        Ok(())
    });
}

#[test]
fn bad_env_values_name_the_key_and_the_variable() {
    jailed(|jail| {
        jail.set_env("SETTLE_DEBOUNCE__MIN_DELAY", "2 fortnights");
        let e = Config::load(None).unwrap_err();
        assert_eq!(e.key(), Some("debounce.min-delay"));
        let text = e.to_string();
        assert!(text.contains("SETTLE_DEBOUNCE__MIN_DELAY"), "{text}");
        assert!(text.contains("1ms to 365days"), "{text}");
        Ok(())
    });
    jailed(|jail| {
        jail.set_env("SETTLE_DEBOUNCE__DELAYS", "2s");
        let e = Config::load(None).unwrap_err();
        assert_eq!(e.key(), Some("debounce.delays"));
        assert!(e.to_string().contains("unknown key"), "{e}");
        Ok(())
    });
    jailed(|jail| {
        // Range checks see the merged value.
        jail.set_env("SETTLE_DEBOUNCE__MAX_DELAY", "1s");
        let e = Config::load(None).unwrap_err();
        assert!(matches!(e, ConfigError::Invalid { .. }), "{e:?}");
        assert_eq!(e.key(), Some("debounce.max-delay"));
        Ok(())
    });
}

#[test]
fn range_errors_name_the_file_in_the_users_units() {
    jailed(|jail| {
        jail.create_file(
            "bad.toml",
            "[debounce]\nmin-delay = \"20m\"\nmax-delay = \"10m\"\n",
        )
        .map_err(|e| e.to_string())?;
        let e = Config::load(Some(Path::new("bad.toml"))).unwrap_err();
        assert!(matches!(e, ConfigError::Invalid { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.starts_with("debounce.max-delay: must be at least min-delay: max-delay is 10m, min-delay 20m (from file ")
                && text.ends_with("bad.toml)"),
            "{text}"
        );
        // A key the file does not set: the section it inherits from names the file.
        jail.create_file(
            "tenant.toml",
            "[debounce.tenants.acme]\nmin-delay = \"20m\"\n",
        )
        .map_err(|e| e.to_string())?;
        let e = Config::load(Some(Path::new("tenant.toml"))).unwrap_err();
        let text = e.to_string();
        assert!(
            text.starts_with("debounce.tenants.acme.max-delay:") && text.ends_with("tenant.toml)"),
            "{text}"
        );
        // From the environment: the variable.
        jail.set_env("SETTLE_DEBOUNCE__MAX_DELAY", "1s");
        let e = Config::load(None).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("(from environment variable SETTLE_DEBOUNCE__MAX_DELAY)"),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn file_errors_name_the_file() {
    jailed(|jail| {
        let e = Config::load(Some(Path::new("missing.toml"))).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }), "{e:?}");
        assert!(e.to_string().contains("missing.toml"), "{e}");

        jail.create_file("bad.toml", "[debounce]\nstate-ttl = \"forever\"\n")
            .map_err(|e| e.to_string())?;
        let e = Config::load(Some(Path::new("bad.toml"))).unwrap_err();
        assert_eq!(e.key(), Some("debounce.state-ttl"));
        assert!(e.to_string().contains("bad.toml"), "{e}");

        jail.create_file("broken.toml", "[debounce\n")
            .map_err(|e| e.to_string())?;
        let e = Config::load(Some(Path::new("broken.toml"))).unwrap_err();
        assert_eq!(e.key(), None);
        assert!(e.to_string().contains("broken.toml"), "{e}");
        Ok(())
    });
}

#[test]
fn transport_and_nats_from_file_and_environment() {
    jailed(|jail| {
        jail.create_file(
            "settle.toml",
            r#"
            transport = "nats"
            [nats]
            servers = "nats://n1:4222, nats://n2:4222"
            partitions = 12
            instances = 3
            "#,
        )
        .map_err(|e| e.to_string())?;
        // The StatefulSet ordinal comes from the environment.
        jail.set_env("SETTLE_NATS__INSTANCE", "2");
        let c = Config::load(Some(Path::new("settle.toml"))).map_err(|e| e.to_string())?;
        assert_eq!(c.transport, Transport::Nats);
        assert_eq!(c.nats.server_list(), ["nats://n1:4222", "nats://n2:4222"]);
        assert_eq!(c.nats.owned_partitions(), vec![2, 5, 8, 11]);
        jail.set_env("SETTLE_TRANSPORT", "kafka");
        let c = Config::load(Some(Path::new("settle.toml"))).map_err(|e| e.to_string())?;
        assert_eq!(c.transport, Transport::Kafka, "env beats file");
        jail.set_env("SETTLE_NATS__INSTANCE", "3");
        let e = Config::load(Some(Path::new("settle.toml"))).unwrap_err();
        assert_eq!(e.key(), Some("nats.instance"));
        assert!(e.to_string().contains("0 to 2"), "{e}");
        Ok(())
    });
    jailed(|jail| {
        jail.set_env("SETTLE_TRANSPORT", "pulsar");
        let e = Config::load(None).unwrap_err();
        assert_eq!(e.key(), Some("transport"));
        assert!(e.to_string().contains("kafka, nats"), "{e}");
        // On NATS the tier topics are subjects: checked then.
        jail.set_env("SETTLE_TRANSPORT", "nats");
        jail.set_env("SETTLE_TIERS__EVENTS_TOPIC", "settle.uploads.1");
        let e = Config::load(None).unwrap_err();
        assert_eq!(e.key(), Some("tiers.events-topic"));
        Ok(())
    });
}

#[test]
fn kafka_secrets_from_files_and_the_environment_are_applied_and_never_shown() {
    jailed(|jail| {
        let dir = jail.directory().to_owned();
        jail.create_file("kafka-pass", "file-s3cret\n")
            .map_err(|e| e.to_string())?;
        jail.create_file("oauth", "  principal=settle extension_token=env-s3cret \n")
            .map_err(|e| e.to_string())?;
        jail.create_file(
            "settle.toml",
            &format!(
                r#"
                [kafka]
                [kafka.properties]
                "security.protocol" = "SASL_SSL"
                "sasl.mechanisms" = "PLAIN"
                "sasl.username" = "settle"
                "ssl.key.password" = "inline-s3cret"
                [kafka.property-files]
                "sasl.password" = "{}"
                "#,
                dir.join("kafka-pass").display()
            ),
        )
        .map_err(|e| e.to_string())?;
        // The environment: a file for a property, and a property's value itself.
        jail.set_env(
            "SETTLE_KAFKA__PROPERTY_FILES__SASL__OAUTHBEARER__CONFIG",
            dir.join("oauth").display(),
        );
        jail.set_env("SETTLE_KAFKA__PROPERTIES__SOCKET__TIMEOUT__MS", "12345");
        let c = Config::load(Some(Path::new("settle.toml"))).map_err(|e| e.to_string())?;
        let producer = c
            .kafka
            .client_config(settle::transport::kafka::Role::Producer);
        assert_eq!(producer.get("sasl.password"), Some("file-s3cret"));
        assert_eq!(
            producer.get("sasl.oauthbearer.config"),
            Some("principal=settle extension_token=env-s3cret"),
            "trimmed"
        );
        assert_eq!(producer.get("socket.timeout.ms"), Some("12345"));
        assert!(
            !format!("{c:?}").contains("s3cret"),
            "Debug of the config shows a secret"
        );

        let out = check_config_output()?;
        assert!(
            !out.contains("s3cret"),
            "check-config shows a secret:\n{out}"
        );
        for want in [
            r#""security.protocol" = SASL_SSL"#.to_owned(),
            r#""sasl.username" = settle"#.to_owned(),
            r#""socket.timeout.ms" = 12345"#.to_owned(),
            r#""ssl.key.password" = <redacted>"#.to_owned(),
            format!(
                r#""sasl.password" = <redacted> (from file {})"#,
                dir.join("kafka-pass").display()
            ),
            format!(
                r#""sasl.oauthbearer.config" = <redacted> (from file {})"#,
                dir.join("oauth").display()
            ),
        ] {
            assert!(out.contains(&want), "{want} not in:\n{out}");
        }
        Ok(())
    });
}

#[test]
fn a_missing_secret_file_names_the_key_and_the_path() {
    jailed(|jail| {
        jail.create_file(
            "settle.toml",
            r#"
            [kafka.property-files]
            "sasl.password" = "/run/secrets/no-such-kafka-pass"
            "#,
        )
        .map_err(|e| e.to_string())?;
        let e = Config::load(Some(Path::new("settle.toml"))).unwrap_err();
        assert_eq!(e.key(), Some(r#"kafka.property-files."sasl.password""#));
        let text = e.to_string();
        assert!(
            text.contains("cannot read /run/secrets/no-such-kafka-pass")
                && text.contains("(from file ")
                && text.contains("settle.toml)"),
            "{text}"
        );
        // check-config fails the same way.
        let e = settle::cli::check_config::run(Path::new("settle.toml"), &mut Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains(r#"kafka.property-files."sasl.password""#), "{e}");
        // From the environment too.
        jail.set_env(
            "SETTLE_KAFKA__PROPERTY_FILES__SSL__KEY__PASSWORD",
            "/run/secrets/no-such-key-pass",
        );
        let e = Config::load(None).unwrap_err();
        assert_eq!(e.key(), Some(r#"kafka.property-files."ssl.key.password""#));
        assert!(
            e.to_string().contains("/run/secrets/no-such-key-pass"),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn admin_tokens_are_named_never_shown_and_a_public_address_needs_one() {
    jailed(|jail| {
        let secret_file = "file-token-s3cret-0123456789";
        let secret_env = "env-token-s3cret-0123456789";
        jail.create_file("tokens", &format!("# operators\nalice:{secret_file}\n"))
            .map_err(|e| e.to_string())?;
        jail.create_file(
            "settle.toml",
            "[admin]\nlisten = \"0.0.0.0:9464\"\ntokens-file = \"tokens\"\n",
        )
        .map_err(|e| e.to_string())?;
        jail.set_env("SETTLE_ADMIN_TOKENS", format!("prom:read:{secret_env}"));
        let mut out = Vec::new();
        settle::cli::check_config::run(Path::new("settle.toml"), &mut out)
            .map_err(|e| e.to_string())?;
        let out = String::from_utf8(out).map_err(|e| e.to_string())?;
        assert!(
            !out.contains("s3cret"),
            "check-config shows a token:\n{out}"
        );
        assert!(
            out.contains("admin: http://0.0.0.0:9464")
                && out.contains("actions on, reads open")
                && out.contains("alice (operator), prom (read)")
                && out.contains("SETTLE_ADMIN_TOKENS"),
            "{out}"
        );
        // No token on a public address with actions on: refused, saying what to do.
        jail.clear_env();
        jail.create_file("settle.toml", "[admin]\nlisten = \"0.0.0.0:9464\"\n")
            .map_err(|e| e.to_string())?;
        let e = settle::cli::check_config::run(Path::new("settle.toml"), &mut Vec::new())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("admin.tokens-file") && e.contains("admin.actions = false"),
            "{e}"
        );
        jail.set_env("SETTLE_ADMIN__ACTIONS", "false");
        let mut out = Vec::new();
        settle::cli::check_config::run(Path::new("settle.toml"), &mut out)
            .map_err(|e| e.to_string())?;
        assert!(String::from_utf8_lossy(&out).contains("actions off"));
        // TLS files go together.
        jail.create_file(
            "settle.toml",
            "[admin]\ntls-cert-file = \"/etc/settle/admin.pem\"\n",
        )
        .map_err(|e| e.to_string())?;
        let e = Config::load(Some(Path::new("settle.toml"))).unwrap_err();
        assert_eq!(e.key(), Some("admin.tls-key-file"));
        Ok(())
    });
}

#[test]
fn nats_names_follow_the_deployment_and_heartbeat_interval_is_read() {
    jailed(|jail| {
        jail.create_file(
            "settle.toml",
            "transport = \"nats\"\n[nats]\ninput-stream = \"B_UPLOADS\"\nconsumer-prefix = \"b\"\nheartbeat-interval = \"2s\"\n",
        )
        .map_err(|e| e.to_string())?;
        let c = Config::load(Some(Path::new("settle.toml"))).map_err(|e| e.to_string())?;
        let n = &c.nats;
        assert!(!n.is_default_deployment());
        assert_eq!(n.changelog().as_deref(), Some("B_UPLOADS_b_CHANGELOG"));
        assert_eq!(n.changelog_stream_name(3), "B_UPLOADS_b_CHANGELOG-3");
        assert_eq!(n.changelog_subject_prefix(), "settle.changelog.B_UPLOADS.b");
        assert_eq!(n.tier_counts().as_deref(), Some("B_UPLOADS_b_TIER_COUNTS"));
        assert_eq!(n.heartbeat_interval, Duration::from_secs(2));
        let out = check_config_output()?;
        for want in [
            "changelog B_UPLOADS_b_CHANGELOG-<partition>",
            "settle.changelog.B_UPLOADS.b.<partition>.*",
            "tier-counts B_UPLOADS_b_TIER_COUNTS",
            "audit B_UPLOADS_b_AUDIT",
            "heartbeat every 2s",
        ] {
            assert!(out.contains(want), "{want} not in:\n{out}");
        }
        // The default deployment keeps the names it always had; a name set is kept.
        jail.set_env("SETTLE_NATS__INPUT_STREAM", "SETTLE_UPLOADS");
        jail.set_env("SETTLE_NATS__CONSUMER_PREFIX", "settle");
        jail.set_env("SETTLE_NATS__TIER_COUNTS_BUCKET", "MINE");
        let c = Config::load(Some(Path::new("settle.toml"))).map_err(|e| e.to_string())?;
        assert!(c.nats.is_default_deployment());
        assert_eq!(c.nats.changelog_stream_name(0), "SETTLE_CHANGELOG-0");
        assert_eq!(c.nats.changelog_subjects(0), "settle.changelog.0.*");
        assert_eq!(c.nats.tier_counts().as_deref(), Some("MINE"));
        jail.set_env("SETTLE_NATS__HEARTBEAT_INTERVAL", "0s");
        let e = Config::load(Some(Path::new("settle.toml"))).unwrap_err();
        assert_eq!(e.key(), Some("nats.heartbeat-interval"));
        Ok(())
    });
}

#[test]
fn nats_secrets_from_files_are_applied_and_never_shown() {
    jailed(|jail| {
        let dir = jail.directory().to_owned();
        jail.create_file("nats-pass", "pass-s3cret\n")
            .map_err(|e| e.to_string())?;
        jail.create_file("nats-token", "token-s3cret\n")
            .map_err(|e| e.to_string())?;
        jail.create_file(
            "settle.toml",
            &format!(
                "transport = \"nats\"\n[nats]\nservers = \"nats://u:url-s3cret@n1:4222,nats://n2:4222\"\nuser = \"settle\"\npassword-file = \"{}\"\n",
                dir.join("nats-pass").display()
            ),
        )
        .map_err(|e| e.to_string())?;
        let c = Config::load(Some(Path::new("settle.toml"))).map_err(|e| e.to_string())?;
        assert_eq!(
            c.nats.password_value().map(|s| s.0.as_str()),
            Some("pass-s3cret"),
            "read, newline trimmed"
        );
        assert!(!format!("{c:?}").contains("pass-s3cret"), "Debug shows it");
        assert_eq!(
            c.nats.servers_shown(),
            "nats://u:<redacted>@n1:4222,nats://n2:4222"
        );
        let out = check_config_output()?;
        assert!(
            !out.contains("s3cret"),
            "check-config shows a secret:\n{out}"
        );
        let want = format!(
            "password-file = <redacted> (from file {})",
            dir.join("nats-pass").display()
        );
        assert!(out.contains(&want), "{want} not in:\n{out}");
        assert!(out.contains("nats://u:<redacted>@n1:4222"), "{out}");

        // A token from a file, given in the environment.
        jail.set_env("SETTLE_NATS__TOKEN_FILE", dir.join("nats-token").display());
        let c = Config::load(Some(Path::new("settle.toml"))).map_err(|e| e.to_string())?;
        assert_eq!(
            c.nats.token_value().map(|s| s.0.as_str()),
            Some("token-s3cret")
        );
        // Not together with the inline form.
        jail.set_env("SETTLE_NATS__TOKEN", "inline");
        let e = Config::load(Some(Path::new("settle.toml"))).unwrap_err();
        assert_eq!(e.key(), Some("nats.token-file"));
        assert!(e.to_string().contains("not both"), "{e}");
        Ok(())
    });
    // An unreadable file names the key and the path, never a value.
    jailed(|jail| {
        jail.set_env("SETTLE_NATS__TOKEN_FILE", "/run/secrets/no-such-nats-token");
        let e = Config::load(None).unwrap_err();
        assert_eq!(e.key(), Some("nats.token-file"));
        assert!(
            e.to_string()
                .contains("cannot read /run/secrets/no-such-nats-token"),
            "{e}"
        );
        Ok(())
    });
}
