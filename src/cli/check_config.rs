//! `settle check-config FILE`: validates a config file without connecting to anything and
//! prints what it says (policies, transport, admin, each transport's section, tiers).
//! Secrets are never printed: Kafka properties that hold one and every value read from
//! `[kafka.property-files]` show as `<redacted>` (`KafkaConfig::shown_properties`), as do
//! `nats.token`, `nats.password`, the values of `nats.token-file` and `nats.password-file`,
//! and the password of a NATS server URL (`NatsConfig::servers_shown`); of the admin tokens
//! only their names and roles are shown. The NATS names derived from the deployment's
//! identity (changelog, tier-counts bucket, overrides bucket, audit) are shown. The admin
//! section is checked as `settle run` checks it (`admin::preflight`): tokens and TLS files
//! read, and actions on a non-loopback address without a token refused.

use crate::config::admin::TOKENS_ENV;
use crate::config::kafka::{ProcessingGuarantee, REDACTED};
use crate::config::Config;
use std::io::Write;
use std::path::Path;

/// Loads `file` (then `SETTLE_*` variables, as `settle run` does) and writes its summary to
/// `out`.
///
/// Errors: the config is invalid (the message names the key), the admin server could not
/// start with it (`admin::preflight`), or `out` cannot be written.
pub fn run(file: &Path, out: &mut impl Write) -> anyhow::Result<()> {
    let cfg = Config::load(Some(file))?;
    writeln!(out, "{}: ok", file.display())?;
    let table = cfg.policy_table();
    writeln!(
        out,
        "debounce: policy {} ({} tenant override(s))",
        table.default.name.as_str(),
        table.tenants.len()
    )?;
    for shadow in cfg.shadow_specs() {
        writeln!(
            out,
            "shadow {}: {} (emits nothing; at most {} sessions per partition)",
            shadow.name, shadow.policy, shadow.max_sessions
        )?;
    }
    writeln!(out, "transport: {} (settle run)", cfg.transport.as_str())?;
    match crate::admin::preflight(&cfg.admin)? {
        Some(auth) => {
            let a = &cfg.admin;
            let names: Vec<String> = auth
                .credentials()
                .names()
                .iter()
                .map(|(name, role)| format!("{name} ({})", role.as_str()))
                .collect();
            let mut from: Vec<String> = Vec::new();
            if let Some(f) = &a.tokens_file {
                from.push(format!("admin.tokens-file {}", f.display()));
            }
            if std::env::var_os(TOKENS_ENV).is_some() {
                from.push(TOKENS_ENV.to_owned());
            }
            writeln!(
                out,
                "admin: {}://{} (/metrics /healthz /readyz /v1/...); actions {}, reads {}; tokens: {}{}",
                a.scheme(),
                a.listen,
                if a.actions { "on" } else { "off" },
                if a.protect_reads { "need a token" } else { "open" },
                if names.is_empty() { "none".to_owned() } else { names.join(", ") },
                if from.is_empty() { String::new() } else { format!(" from {}", from.join(" and ")) },
            )?;
        }
        None => writeln!(out, "admin: disabled")?,
    }
    let k = &cfg.kafka;
    writeln!(
        out,
        "kafka: {} group {} input {} dead-letter {} changelog {} guarantee {} instance {}",
        k.bootstrap_servers,
        k.group_id,
        k.input_topic,
        k.dead_letter_topic,
        k.changelog().as_deref().unwrap_or("(off)"),
        match k.processing_guarantee {
            ProcessingGuarantee::AtLeastOnce => "at-least-once",
            ProcessingGuarantee::ExactlyOnce => "exactly-once",
        },
        k.instance_id(),
    )?;
    let shown = k.shown_properties();
    if !shown.is_empty() {
        let list: Vec<String> = shown
            .iter()
            .map(|(key, v)| format!("{key:?} = {v}"))
            .collect();
        writeln!(out, "kafka properties: {}", list.join(", "))?;
    }
    let n = &cfg.nats;
    writeln!(
        out,
        "nats: {} input {} (subjects {}.0 to .{}) output {} dead-letter {}; instance {} of {} owns partitions {:?}",
        n.servers_shown(),
        n.input_stream,
        n.input_subject_prefix,
        n.partitions.saturating_sub(1),
        n.output_stream,
        n.dead_letter_subject,
        n.instance,
        n.instances,
        n.owned_partitions()
    )?;
    let (audit_subject, audit_stream) = crate::transport::nats::NatsActions::audit_names(n);
    writeln!(
        out,
        "nats names ({}): changelog {} (subjects {}.<partition>.*) tier-counts {} audit {} on {} heartbeat every {}",
        if n.is_default_deployment() {
            "default deployment"
        } else {
            "derived from input-stream and consumer-prefix unless set"
        },
        n.changelog()
            .map_or("(off)".to_owned(), |c| format!("{c}-<partition>")),
        n.changelog_subject_prefix(),
        n.tier_counts().as_deref().unwrap_or("(off)"),
        audit_stream,
        audit_subject,
        humantime::format_duration(n.heartbeat_interval),
    )?;
    let secrets: Vec<String> = [
        ("token", n.token.is_some(), None),
        ("token-file", n.token_file.is_some(), n.token_file.as_ref()),
        ("password", n.password.is_some(), None),
        (
            "password-file",
            n.password_file.is_some(),
            n.password_file.as_ref(),
        ),
    ]
    .into_iter()
    .filter(|(_, set, _)| *set)
    .map(|(key, _, path)| match path {
        Some(p) => format!("{key} = {REDACTED} (from file {})", p.display()),
        None => format!("{key} = {REDACTED}"),
    })
    .collect();
    if !secrets.is_empty() {
        writeln!(out, "nats auth: {}", secrets.join(", "))?;
    }
    let tiers = &cfg.tiers;
    writeln!(
        out,
        "tiers: {} (limit {} per {}, whole deployment: counts shared every {} on kafka {} / nats {})",
        tiers.routes(),
        tiers.limit,
        humantime::format_duration(tiers.period),
        humantime::format_duration(tiers.share_interval),
        k.tier_counts().as_deref().unwrap_or("(off)"),
        n.tier_counts().as_deref().unwrap_or("(off)"),
    )?;
    Ok(())
}
