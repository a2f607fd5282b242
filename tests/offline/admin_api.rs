//! The admin HTTP server (`src/admin.rs`) on the real runtime: RocksDB stores, the memory
//! transport, real time, HTTP over loopback TCP. `/metrics` is scraped during the run and its
//! counters are compared with what the broker holds (consumed, dead-lettered, emitted); every
//! endpoint is exercised, including 404s and bad path segments; the Grafana dashboard and the
//! deploy files are checked against the registry and the admin config.

use crate::admin_support;
use crate::runtime_support;

use admin_support::{get, get_json, Scrape};
use runtime_support::*;
use serde_json::Value;
use settle::admin::{AdminServer, AdminState};
use settle::codec::format_rfc3339_ms;
use settle::engine::{Engine, Millis, PolicySpec, PolicyTable, ShadowSpec};
use settle::metrics::{self, Metrics};
use settle::runtime::{Clock, Runtime, RuntimeOptions, StatusMap};
use settle::tiers::TiersConfig;
use settle::transport::memory::{partition_for_key, MemoryBroker};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const HOUR: Millis = 3_600_000;
/// Bound on waiting for the runtime (a hang guard, not a speed assertion).
const PATIENCE: Duration = Duration::from_secs(120);

async fn scrape(addr: SocketAddr) -> Scrape {
    let (status, body) = get(addr, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    Scrape::parse(&body)
}

/// Default policy fixed 1 h; tenant `ada` adaptive 1 h to 2 h.
fn engine() -> Engine {
    let mut table = PolicyTable::uniform(PolicySpec::fixed(HOUR));
    table
        .tenants
        .insert("ada".into(), PolicySpec::adaptive(HOUR, 2 * HOUR));
    Engine::new(table)
}

/// Test options; tier rule: more than 3 emissions per hour demotes.
fn admin_options(dir: &Path) -> RuntimeOptions {
    let mut o = options(dir);
    o.tiers = TiersConfig {
        limit: 3,
        period: Duration::from_secs(3600),
        cooldown: Duration::from_secs(3600),
        ..TiersConfig::default()
    };
    o
}

fn produce_json(broker: &MemoryBroker, key: &str, json: &str, ts: Millis) {
    broker.produce(None, Some(key.as_bytes()), json.as_bytes().to_vec(), ts);
}

/// `n` sessions `prefix0..` of `tenant` closed by a `final` upload after a first one.
fn produce_finals(broker: &MemoryBroker, tenant: &str, prefix: &str, n: usize, ts: Millis) {
    for i in 0..n {
        let s = format!("{prefix}{i}");
        produce(broker, tenant, &s, ts);
        let last = format!(r#"{{"tenant":"{tenant}","session":"{s}","final":true}}"#);
        produce_json(broker, &format!("{tenant}/{s}"), &last, ts + 1);
    }
}

fn produced(broker: &MemoryBroker) -> i64 {
    (0..broker.partitions()).map(|p| broker.end_offset(p)).sum()
}

/// Everything produced is applied and every owed emission acknowledged.
fn settled(m: &StatusMap, broker: &MemoryBroker, published: u64) -> bool {
    all(m, broker.partitions(), |s| {
        s.caught_up && s.outbox_len == 0 && s.next_offset == Some(broker.end_offset(s.partition))
    }) && m.values().map(|s| s.published).sum::<u64>() == published
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_admin_endpoints_on_a_running_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let broker = MemoryBroker::new(TOPIC, 2);
    let clock = settle::runtime::TokioClock::starting_at(T0);
    let runtime = Runtime::new(engine(), broker.sink(), clock, admin_options(dir.path())).unwrap();
    let status = runtime.status();
    let server = AdminServer::start("127.0.0.1:0".parse().unwrap(), AdminState::new(&runtime))
        .await
        .unwrap();
    let addr = server.local_addr();

    // Before the runtime runs: alive, not ready, nothing owned.
    let (code, health) = get_json(addr, "/healthz").await;
    assert_eq!((code, &health["status"]), (200, &Value::from("ok")));
    let (code, ready) = get_json(addr, "/readyz").await;
    assert_eq!(code, 503, "{ready}");
    assert_eq!(ready["ready"], false);
    assert!(ready["reason"].as_str().unwrap().contains("no partition"));
    let (_, parts) = get_json(addr, "/v1/partitions").await;
    assert_eq!(parts["partitions"], Value::Array(vec![]));

    // ada: 4 sessions with 3 uploads each, rounds left open (due in an hour).
    let base = clock.now_ms() - 10_000;
    for s in 0..4 {
        for i in 0..3 {
            produce(&broker, "ada", &format!("s{s}"), base + i * 1_000);
        }
    }
    // beta: 5 sessions closed by `final`: 5 emissions of 2 uploads; the 4th demotes beta.
    produce_finals(&broker, "beta", "f", 5, base);
    // Two bad records.
    produce_json(&broker, "beta/x", "not json", base);
    produce_json(
        &broker,
        "beta/y",
        &runtime_support::upload("beta", "z"),
        base,
    );
    assert_eq!(produced(&broker), 24);

    let shutdown = CancellationToken::new();
    let run = tokio::spawn(runtime.run(broker.source(GROUP), shutdown.clone()));
    tokio::time::timeout(PATIENCE, status.wait_for(|m| settled(m, &broker, 5)))
        .await
        .expect("runtime settles");

    // --- /metrics against what the broker holds.
    let m = scrape(addr).await;
    assert_eq!(m.sum(metrics::UPLOADS_CONSUMED, &[]), 24.0);
    for p in 0..2 {
        let part = p.to_string();
        assert_eq!(
            m.sum(
                metrics::UPLOADS_CONSUMED,
                &[("partition", &part), ("topic", TOPIC)]
            ),
            broker.end_offset(p) as f64
        );
        assert_eq!(m.sum(metrics::CONSUMER_LAG, &[("partition", &part)]), 0.0);
        assert!(m.has(metrics::CLOCK_BEHIND, &[("partition", &part)]));
        assert!(m.has(metrics::RESTORE_REMAINING, &[("partition", &part)]));
    }
    assert_eq!(broker.dead_letters().len(), 2);
    assert_eq!(m.sum(metrics::UPLOADS_REJECTED, &[]), 2.0);
    assert_eq!(
        m.sum(metrics::UPLOADS_REJECTED, &[("reason", "invalid_json")]),
        1.0
    );
    assert_eq!(
        m.sum(metrics::UPLOADS_REJECTED, &[("reason", "key_mismatch")]),
        1.0
    );
    let output = emitted(&broker);
    assert_eq!(output.len(), 5);
    assert_eq!(m.sum(metrics::EMISSIONS, &[]), 5.0);
    let finals = [("trigger", "final"), ("policy", "fixed")];
    assert_eq!(
        m.sum(
            metrics::EMISSIONS,
            &[finals[0], finals[1], ("tier", "normal")]
        ),
        3.0
    );
    assert_eq!(
        m.sum(
            metrics::EMISSIONS,
            &[finals[0], finals[1], ("tier", "limited")]
        ),
        2.0
    );
    let coalesced: u32 = output.iter().map(|(e, _)| e.uploads).sum();
    assert_eq!(m.sum(metrics::EMISSION_UPLOADS, &[]), f64::from(coalesced));
    assert_eq!(m.sum(metrics::COALESCING_RATIO, &[]), 2.0);
    let count = |name: &str| format!("{name}_count");
    assert_eq!(m.sum(&count(metrics::TIME_TO_READY), &[]), 5.0);
    // Time-to-ready per tier and policy (the figure `settle tune` sweeps).
    assert_eq!(
        m.sum(
            &count(metrics::TIME_TO_READY),
            &[("tier", "normal"), ("policy", "fixed")]
        ),
        3.0
    );
    assert_eq!(
        m.sum(&count(metrics::EMISSION_LATENESS), &[("trigger", "final")]),
        5.0
    );
    assert!(m.sum(&count(metrics::STORE_WRITE), &[]) >= 1.0);
    assert_eq!(m.sum(metrics::PENDING_ROUNDS, &[]), 4.0);
    assert_eq!(m.sum(metrics::OUTBOX_SIZE, &[]), 0.0);
    assert_eq!(m.sum(metrics::PARTITIONS, &[("state", "live")]), 2.0);
    assert_eq!(
        m.sum(metrics::TIER_CHANGES, &[("reason", "rate_exceeded")]),
        1.0
    );
    assert_eq!(m.sum(metrics::TENANTS_DEMOTED, &[]), 1.0);
    assert_eq!(m.sum(metrics::PUBLISH_FAILURES, &[]), 0.0);
    assert_eq!(m.sum(metrics::BUILD_INFO, &[]), 1.0);
    // Bounded labels only: never a tenant or a session.
    let allowed = [
        "topic",
        "partition",
        "tier",
        "trigger",
        "policy",
        "reason",
        "state",
        "version",
        "change",
        "le",
    ];
    for (name, labels, _) in &m.0 {
        for k in labels.keys() {
            assert!(allowed.contains(&k.as_str()), "{name} has label {k}");
        }
    }

    // More traffic while running: the counters move by exactly that much.
    produce_finals(&broker, "gamma", "g", 2, clock.now_ms() - 1_000);
    tokio::time::timeout(PATIENCE, status.wait_for(|m| settled(m, &broker, 7)))
        .await
        .expect("runtime settles again");
    let m = scrape(addr).await;
    assert_eq!(m.sum(metrics::UPLOADS_CONSUMED, &[]), 28.0);
    assert_eq!(m.sum(metrics::EMISSIONS, &[]), 7.0);
    assert_eq!(broker.output().len(), 7);
    assert_eq!(
        m.sum(metrics::EMISSIONS, &[("tier", "normal")]),
        5.0,
        "gamma is not demoted"
    );
    assert_eq!(m.sum(metrics::EMISSION_UPLOADS, &[]), 14.0);

    // Without [[shadow]]: the view says so, and no shadow series exist.
    let (code, shadow) = get_json(addr, "/v1/shadow").await;
    assert_eq!(code, 200, "{shadow}");
    assert_eq!(shadow["configured"], false);
    assert_eq!(shadow["policies"], Value::Array(vec![]));
    assert!(!m.has(metrics::SHADOW_EMISSIONS, &[]));

    // --- /readyz, /v1/partitions.
    let (code, ready) = get_json(addr, "/readyz").await;
    assert_eq!(
        (code, &ready["ready"], &ready["partitions"]),
        (200, &Value::from(true), &Value::from(2))
    );
    let (code, parts) = get_json(addr, "/v1/partitions").await;
    assert_eq!(code, 200);
    let parts = parts["partitions"].as_array().unwrap();
    assert_eq!(parts.len(), 2);
    let mut offsets = 0;
    let mut pending = 0;
    for p in parts {
        assert_eq!(p["topic"], TOPIC);
        assert_eq!(p["state"], "live");
        assert_eq!(p["lag"], 0);
        assert_eq!(p["outbox"], 0);
        assert!(p["clock_behind_ms"].as_i64().unwrap() >= 0);
        assert!(p["partition_time"].as_str().unwrap().ends_with('Z'));
        offsets += p["next_offset"].as_i64().unwrap();
        pending += p["pending_rounds"].as_u64().unwrap();
    }
    assert_eq!((offsets, pending), (produced(&broker), 4));

    // --- /v1/sessions: CallTrack, open round, next due time.
    let (code, s0) = get_json(addr, "/v1/sessions/ada/s0").await;
    assert_eq!(code, 200, "{s0}");
    let last = base + 2_000;
    assert_eq!(s0["tenant"], "ada");
    assert_eq!(s0["session"], "s0");
    assert_eq!(s0["policy"], "adaptive");
    assert_eq!(s0["topic"], TOPIC);
    assert_eq!(
        s0["partition"],
        partition_for_key(b"ada/s0", broker.partitions())
    );
    assert_eq!(s0["generation"], 0);
    assert_eq!(s0["call_track"]["time"], format_rfc3339_ms(last));
    assert_eq!(s0["call_track"]["delay_ms"], HOUR);
    assert_eq!(s0["round"]["uploads"], 3);
    assert_eq!(s0["round"]["first_upload_at"], format_rfc3339_ms(base));
    assert_eq!(s0["round"]["last_upload_at"], format_rfc3339_ms(last));
    assert_eq!(s0["next_due"], format_rfc3339_ms(last + HOUR));
    assert_eq!(s0["next_due_is"], "round_due");
    let (code, f0) = get_json(addr, "/v1/sessions/beta/f0").await;
    assert_eq!(code, 200, "{f0}");
    assert_eq!(f0["generation"], 1);
    assert_eq!(f0["round"], Value::Null);
    assert_eq!(f0["call_track"], Value::Null, "fixed keeps no CallTrack");
    assert_eq!(f0["next_due_is"], "state_expiry");
    assert_eq!(f0["next_due"], format_rfc3339_ms(base + 1 + 24 * HOUR));

    // 404s: a session with no state here (also one with a `/` in it), an unknown path.
    for path in [
        "/v1/sessions/ada/nope",
        "/v1/sessions/ada/s0/more",
        "/v1/nope",
    ] {
        let (code, body) = get_json(addr, path).await;
        assert_eq!(code, 404, "{path}: {body}");
        assert!(body["error"].is_string(), "{path}: {body}");
    }
    // 400s: bad tenant, control character in the session, not UTF-8, tenant too long.
    let long = "t".repeat(129);
    for path in [
        "/v1/sessions/bad%20tenant/s0".to_owned(),
        "/v1/sessions/ada/x%01y".to_owned(),
        "/v1/sessions/ada/%FF".to_owned(),
        "/v1/tenants/b%2Fd".to_owned(),
        "/v1/tenants/b%20d".to_owned(),
        format!("/v1/tenants/{long}"),
    ] {
        let (code, body) = get_json(addr, &path).await;
        assert_eq!(code, 400, "{path}: {body}");
        assert!(body["error"].is_string(), "{path}: {body}");
    }

    // --- /v1/tenants: tier and measured rate from the shared router.
    let (code, beta) = get_json(addr, "/v1/tenants/beta").await;
    assert_eq!(code, 200, "{beta}");
    assert_eq!(beta["tier"], "limited");
    assert_eq!(beta["topic"], "settle.ready.limited");
    assert_eq!(beta["rate"], 5);
    assert_eq!(
        (&beta["limit"], &beta["period_ms"]),
        (&Value::from(3), &Value::from(HOUR))
    );
    assert_eq!(beta["pinned"], false);
    assert!(beta["demoted"]["since"].is_string(), "{beta}");
    let (code, ada) = get_json(addr, "/v1/tenants/ada").await;
    assert_eq!(code, 200);
    assert_eq!(
        (&ada["tier"], &ada["rate"]),
        (&Value::from("normal"), &Value::from(0))
    );
    assert_eq!(ada["demoted"], Value::Null);

    // After a graceful stop nothing is owned: not ready, no session found.
    shutdown.cancel();
    let summary = run.await.unwrap().unwrap();
    assert!(summary.failed().is_empty());
    let (code, _) = get_json(addr, "/readyz").await;
    assert_eq!(code, 503);
    let (code, _) = get_json(addr, "/v1/sessions/ada/s0").await;
    assert_eq!(code, 404);
    server.stop().await;
}

/// `[[shadow]]` policies on a running runtime (SEMANTICS §8): `GET /v1/shadow` and the
/// `settle_shadow_*` gauges put a shadow's would-be emissions beside the live policy's, and
/// count the sessions that did not fit its budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_view_and_metrics_beside_the_live_policy() {
    let dir = tempfile::tempdir().unwrap();
    let broker = MemoryBroker::new(TOPIC, 1);
    let clock = settle::runtime::TokioClock::starting_at(T0);
    // beta has a rule of its own (tenant class `own`), acme runs the default (`default`).
    let mut rules = PolicyTable::uniform(PolicySpec::fixed(HOUR));
    rules
        .tenants
        .insert("beta".to_owned(), PolicySpec::fixed(2 * HOUR));
    let runtime = Runtime::new(
        Engine::new(rules),
        broker.sink(),
        clock,
        options(dir.path()),
    )
    .unwrap()
    .with_shadows(vec![ShadowSpec {
        name: "fast".to_owned(),
        policy: PolicySpec::fixed(1_000),
        max_sessions: 3,
    }]);
    let status = runtime.status();
    let server = AdminServer::start("127.0.0.1:0".parse().unwrap(), AdminState::new(&runtime))
        .await
        .unwrap();
    let addr = server.local_addr();
    // beta/f0 closed by `final` (live and shadow emit it at once, 2 uploads); then 4 acme
    // sessions of 2 uploads 100 ms apart: live waits an hour, the shadow 1 s, but it holds
    // 3 keys: acme/s2 and acme/s3 do not fit.
    let base = clock.now_ms() - 10_000;
    produce_finals(&broker, "beta", "f", 1, base);
    for s in 0..4 {
        produce(&broker, "acme", &format!("s{s}"), base + 10);
        produce(&broker, "acme", &format!("s{s}"), base + 110);
    }
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(runtime.run(broker.source(GROUP), shutdown.clone()));
    tokio::time::timeout(PATIENCE, status.wait_for(|m| settled(m, &broker, 1)))
        .await
        .expect("runtime settles");

    // The live emission is published after the step that counted it; the shadow's figures
    // are read until they hold every upload (a later poll may have carried some).
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let v = loop {
        let (code, v) = get_json(addr, "/v1/shadow").await;
        assert_eq!(code, 200, "{v}");
        let fast = &v["policies"][1];
        let seen = fast["figures"]["total"]["emissions"].as_u64().unwrap_or(0)
            + fast["refused_uploads"].as_u64().unwrap_or(0);
        if seen >= 7 || tokio::time::Instant::now() > deadline {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(v["configured"], true);
    assert!(v["since"].as_str().is_some(), "{v}");
    assert_eq!(v["partitions"].as_array().unwrap().len(), 1);
    assert_eq!(v["tiers"], serde_json::json!(["normal", "limited"]));
    let live = &v["policies"][0];
    assert_eq!(live["name"], "live");
    assert_eq!(live["figures"]["total"]["emissions"], 1, "{v}");
    assert_eq!(live["figures"]["total"]["time_to_ready_ms"]["p99"], 0);
    let fast = &v["policies"][1];
    assert_eq!(fast["name"], "fast");
    assert_eq!(fast["rule"], PolicySpec::fixed(1_000).to_string());
    assert_eq!(
        (
            &fast["sessions"],
            &fast["refused_sessions"],
            &fast["refused_uploads"]
        ),
        (&Value::from(3), &Value::from(2), &Value::from(4)),
        "{v}"
    );
    let normal = &fast["figures"]["tiers"]["normal"];
    assert_eq!(normal["emissions"], 3, "{v}");
    assert_eq!(normal["uploads_per_emission"], 2.0);
    assert_eq!(normal["time_to_ready_ms"]["p50"], 1_000);
    assert_eq!(normal["time_to_ready_ms"]["p99"], 1_000);
    assert_eq!(fast["figures"]["tiers"]["limited"]["emissions"], 0);
    // Per tenant class: beta (own rule) 1 would-be emission, acme (default) 2.
    assert_eq!(normal["classes"]["own"]["emissions"], 1, "{v}");
    assert_eq!(normal["classes"]["own"]["time_to_ready_ms"]["p99"], 0);
    assert_eq!(normal["classes"]["default"]["emissions"], 2);
    assert_eq!(fast["figures"]["classes"]["default"]["uploads"], 4);
    assert_eq!(live["figures"]["classes"]["own"]["emissions"], 1);
    assert_eq!(live["figures"]["classes"]["default"]["emissions"], 0);

    let m = scrape(addr).await;
    let fast_normal = [("shadow", "fast"), ("tier", "normal")];
    assert_eq!(m.sum(metrics::SHADOW_EMISSIONS, &fast_normal), 3.0);
    assert_eq!(m.sum(metrics::SHADOW_UPLOADS, &fast_normal), 6.0);
    assert_eq!(
        m.sum(
            metrics::SHADOW_UPLOADS_PER_EMISSION,
            &[fast_normal[0], fast_normal[1], ("class", "default")]
        ),
        2.0
    );
    assert_eq!(
        m.sum(
            metrics::SHADOW_TIME_TO_READY,
            &[
                fast_normal[0],
                fast_normal[1],
                ("class", "default"),
                ("quantile", "0.99")
            ]
        ),
        1.0
    );
    assert_eq!(
        m.sum(
            metrics::SHADOW_EMISSIONS,
            &[fast_normal[0], fast_normal[1], ("class", "own")]
        ),
        1.0
    );
    assert_eq!(m.sum(metrics::SHADOW_EMISSIONS, &[("shadow", "live")]), 1.0);
    assert_eq!(
        m.sum(
            metrics::SHADOW_EMISSIONS,
            &[("shadow", "live"), ("class", "default")]
        ),
        0.0
    );
    assert_eq!(m.sum(metrics::SHADOW_REFUSED_SESSIONS, &[]), 2.0);
    assert_eq!(m.sum(metrics::SHADOW_SESSIONS, &[]), 3.0);
    assert!(m.sum(metrics::SHADOW_SINCE, &[]) > 0.0);
    // The operator page's What-if view puts the same figures side by side.
    let (code, page) = get(addr, "/ui/whatif").await;
    assert_eq!(code, 200, "{page}");
    assert!(
        page.contains(r#"id="shadows""#)
            && page.contains("<b>fast</b>")
            && page.contains("<b>live</b>"),
        "{page}"
    );
    assert!(
        page.contains(r#"id="shadow-cells""#) && page.contains("<td>own</td>"),
        "{page}"
    );
    // The shadow emitted nothing: the broker holds the live emission only.
    assert_eq!(broker.output().len(), 1);

    shutdown.cancel();
    run.await.unwrap().unwrap();
    server.stop().await;
}

/// Every `settle_*` name in the dashboard's queries, histogram suffixes removed.
fn dashboard_metrics(dashboard: &Value, histograms: &[&str]) -> Vec<String> {
    fn exprs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::Object(o) => {
                for (k, v) in o {
                    match (k.as_str(), v) {
                        ("expr" | "query", Value::String(s)) => out.push(s),
                        _ => exprs(v, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
            _ => {}
        }
    }
    let mut found = Vec::new();
    exprs(dashboard, &mut found);
    assert!(!found.is_empty(), "no query in the dashboard");
    let mut names = Vec::new();
    for e in found {
        let mut rest = e;
        while let Some(i) = rest.find("settle_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            let mut name = &tail[..end];
            for suffix in ["_bucket", "_sum", "_count"] {
                if let Some(base) = name.strip_suffix(suffix) {
                    if histograms.contains(&base) {
                        name = base;
                    }
                }
            }
            names.push(name.to_owned());
            rest = &tail[end..];
        }
    }
    names.sort();
    names.dedup();
    names
}

#[test]
fn the_dashboard_references_only_registered_metrics_and_shows_each() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/dashboards/settle.json");
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).expect("dashboard JSON");
    let registry = Metrics::new();
    let registered = registry.names();
    let histograms = [
        metrics::EMISSION_LATENESS,
        metrics::TIME_TO_READY,
        metrics::STORE_WRITE,
        metrics::CHANGELOG_APPEND,
    ];
    let used = dashboard_metrics(&dashboard, &histograms);
    for name in &used {
        assert!(
            registered.contains(name),
            "the dashboard queries {name}, which is not registered"
        );
    }
    for name in registered {
        assert!(
            used.contains(name),
            "the dashboard shows no panel of {name}"
        );
    }
    // Every panel queries the Prometheus datasource the provisioning file defines.
    let provisioning = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy/grafana/provisioning/datasources/prometheus.yml"),
    )
    .unwrap();
    assert!(provisioning.contains("uid: prometheus"));
    for panel in dashboard["panels"].as_array().unwrap() {
        if panel["type"] != "row" {
            assert_eq!(
                panel["datasource"]["uid"], "prometheus",
                "{}",
                panel["title"]
            );
        }
    }
}

#[test]
fn deploy_files_agree_with_the_admin_config() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let read =
        |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    let port = settle::admin::DEFAULT_LISTEN.port().to_string();
    let compose = read("docker-compose.yml");
    assert!(compose.contains(&format!("SETTLE_ADMIN__LISTEN: 0.0.0.0:{port}")));
    assert!(compose.contains(&format!("\"{port}:{port}\"")));
    assert!(read("deploy/prometheus/prometheus.yml").contains(&format!("settle:{port}")));
    assert!(read("Dockerfile").contains(&format!("EXPOSE {port}")));
    let sts = read("deploy/kubernetes/statefulset.yaml");
    assert!(sts.contains(&format!("value: \"0.0.0.0:{port}\"")));
    assert!(sts.contains(&format!("containerPort: {port}")));
    assert!(sts.contains("path: /readyz") && sts.contains("path: /healthz"));
    assert!(sts.contains("volumeClaimTemplates"));
    let grace: u64 = sts
        .lines()
        .find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("terminationGracePeriodSeconds");
    let deadline = settle::config::Config::default().runtime.shutdown_deadline;
    assert!(
        grace > deadline.as_secs(),
        "terminationGracePeriodSeconds {grace} must exceed the shutdown deadline {deadline:?}"
    );
}
