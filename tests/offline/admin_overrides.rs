//! Tenant overrides (SEMANTICS §7, issue "operate it by hand", item 3) on the real runtime
//! and the memory transport, through the admin API: an override set with
//! `PUT /v1/tenants/{tenant}/override` times the tenant's next upload (the emission names its
//! policy and delay) while a pending round keeps its due time until its next upload; a stale
//! version gets 409 with the current one, an invalid override 400 naming the config key;
//! expiry and removal give the tenant its configured rule back; a pinned tier holds while the
//! tenant emits at twice the tier limit, and automatic tiering resumes when the pin goes; an
//! override outlives a restart of the runtime (the memory store lives as long as the broker).

use crate::admin_support::{get_json, try_request, Scrape};
use crate::runtime_support::*;
use serde_json::{json, Value};
use settle::admin::{AdminServer, AdminState};
use settle::codec::action::{AuditRecord, AuditStage};
use settle::engine::{Emission, Millis, PolicyName, PolicySpec};
use settle::runtime::{ActionLog, Clock, RunSummary, Runtime, RuntimeOptions, StatusBoard};
use settle::tiers::TiersConfig;
use settle::transport::memory::{MemoryBroker, MEMORY_AUDIT_TOPIC};
use settle::transport::ActionChannel;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const HOUR: Millis = 3_600_000;
/// Bound on waiting for the runtime (a hang guard, not a speed assertion).
const PATIENCE: Duration = Duration::from_secs(60);

/// One runtime with its admin server on the memory broker, overrides from the broker.
struct Node {
    addr: SocketAddr,
    status: StatusBoard,
    clock: settle::runtime::TokioClock,
    shutdown: CancellationToken,
    run: JoinHandle<Result<RunSummary, settle::runtime::Error>>,
    server: AdminServer,
}

impl Node {
    async fn start(broker: &MemoryBroker, options: RuntimeOptions) -> Node {
        let clock = settle::runtime::TokioClock::starting_at(T0);
        let runtime = Runtime::new(
            engine(PolicySpec::fixed(HOUR)),
            broker.sink(),
            clock,
            options,
        )
        .unwrap()
        .with_actions(ActionLog::new(Some(MEMORY_AUDIT_TOPIC.into()), "settle-0"))
        .with_overrides(Arc::new(broker.overrides()));
        let status = runtime.status();
        let channel: Arc<dyn ActionChannel> = Arc::new(broker.actions());
        let state = AdminState::new(&runtime).with_action_channel(channel);
        let server = AdminServer::start("127.0.0.1:0".parse().unwrap(), state)
            .await
            .unwrap();
        let shutdown = CancellationToken::new();
        let run = tokio::spawn(runtime.run(broker.source(GROUP), shutdown.clone()));
        Node {
            addr: server.local_addr(),
            status,
            clock,
            shutdown,
            run,
            server,
        }
    }

    /// Waits until every partition applied every record and `rounds` rounds are open.
    async fn settled(&self, broker: &MemoryBroker, rounds: u64) {
        let n = broker.partitions();
        tokio::time::timeout(
            PATIENCE,
            self.status.wait_for(|m| {
                all(m, n, |s| {
                    // An empty partition has no next offset yet.
                    s.caught_up && s.next_offset.unwrap_or(0) == broker.end_offset(s.partition)
                }) && m.values().map(|s| s.pending_rounds).sum::<u64>() == rounds
            }),
        )
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the runtime applies every record: {:?}",
                self.status.snapshot()
            )
        });
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.run.await.unwrap().unwrap();
        self.server.stop().await;
    }
}

async fn send(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let text = body.map(Value::to_string);
    let (code, answer) = try_request(addr, method, path, &[], text.as_deref())
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let v = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{path}: {e}: {answer}"));
    (code, v)
}

/// The first emission of `key` the broker acknowledged, waiting for it.
async fn emission_of(broker: &MemoryBroker, key: &str) -> Emission {
    tokio::time::timeout(PATIENCE, async {
        loop {
            if let Some((e, _)) = emitted(broker)
                .into_iter()
                .find(|(e, _)| e.key.as_str() == key)
            {
                return e;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{key} is emitted"))
}

fn audit(broker: &MemoryBroker) -> Vec<AuditRecord> {
    broker
        .audit()
        .iter()
        .map(|p| AuditRecord::decode(p).unwrap())
        .collect()
}

async fn metric(addr: SocketAddr, name: &str, with: &[(&str, &str)]) -> f64 {
    let (code, text) = crate::admin_support::get(addr, "/metrics").await;
    assert_eq!(code, 200);
    Scrape::parse(&text).sum(name, with)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_times_the_next_upload_and_is_refused_when_stale_or_invalid() {
    let dir = tempfile::tempdir().unwrap();
    let broker = MemoryBroker::new(TOPIC, 2);
    let node = Node::start(&broker, options(dir.path())).await;
    let addr = node.addr;

    // A round of acme opened under the config's rule: due in an hour.
    produce(&broker, "acme", "held", node.clock.now_ms());
    node.settled(&broker, 1).await;
    let (_, held) = get_json(addr, "/v1/sessions/acme/held").await;
    let held_deadline = held["round"]["deadline"].clone();
    assert_eq!(held["round"]["delay_ms"], HOUR, "{held}");
    let (_, view) = get_json(addr, "/v1/tenants/acme").await;
    assert_eq!(view["rules"]["wins"], "config", "{view}");
    assert_eq!(view["rules"]["override"], Value::Null);

    // An override: fixed 200 ms for acme.
    let body = json!({"version": 0, "debounce": {"delay": "200ms"}, "reason": "calm acme down", "request_id": "ov-1"});
    let (code, answer) = send(addr, "PUT", "/v1/tenants/acme/override", Some(&body)).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["result"], "applied");
    assert_eq!(answer["override"]["version"], 1);
    assert_eq!(answer["override"]["who"], "anonymous");
    assert_eq!(answer["tenant"]["wins"], "override", "{answer}");
    assert_eq!(answer["tenant"]["rule_from"], "override");
    assert!(
        answer["tenant"]["configured"]["rule"]
            .as_str()
            .unwrap()
            .starts_with("fixed delay=1h"),
        "{answer}"
    );

    // The pending round keeps its due time...
    let (_, held) = get_json(addr, "/v1/sessions/acme/held").await;
    assert_eq!(
        (&held["round"]["delay_ms"], &held["round"]["deadline"]),
        (&Value::from(HOUR), &held_deadline),
        "{held}"
    );
    // ...a new session's first upload is timed by the override...
    produce(&broker, "acme", "fresh", node.clock.now_ms());
    let fresh = emission_of(&broker, "acme/fresh").await;
    assert_eq!((fresh.policy, fresh.delay_ms), (PolicyName::Fixed, 200));
    // ...and so is the held round's next upload.
    produce(&broker, "acme", "held", node.clock.now_ms());
    let held = emission_of(&broker, "acme/held").await;
    assert_eq!((held.delay_ms, held.uploads), (200, 2));
    // Another tenant keeps the config's rule.
    produce(&broker, "other", "s", node.clock.now_ms());
    node.settled(&broker, 1).await;
    let (_, other) = get_json(addr, "/v1/sessions/other/s").await;
    assert_eq!(other["round"]["delay_ms"], HOUR);

    // A stale version: 409 with the current override.
    let stale = json!({"version": 0, "debounce": {"delay": "5s"}});
    let (code, answer) = send(addr, "PUT", "/v1/tenants/acme/override", Some(&stale)).await;
    assert_eq!(code, 409, "{answer}");
    assert_eq!(
        (&answer["version"], &answer["current"]["version"]),
        (&Value::from(1), &Value::from(1))
    );
    // Invalid: the config's rule, the config's key.
    let invalid = json!({"version": 1, "debounce": {"policy": "adaptive", "min-delay": "10s", "max-delay": "1s"}});
    let (code, answer) = send(addr, "PUT", "/v1/tenants/acme/override", Some(&invalid)).await;
    assert_eq!(code, 400, "{answer}");
    assert_eq!(answer["key"], "debounce.max-delay", "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .starts_with("debounce.max-delay: must be at least min-delay"),
        "{answer}"
    );
    let (code, answer) = send(
        addr,
        "PUT",
        "/v1/tenants/acme/override",
        Some(&json!({"version": 1, "tier": "gold"})),
    )
    .await;
    assert_eq!(
        (code, &answer["key"]),
        (400, &Value::from("tier")),
        "{answer}"
    );
    let (code, answer) = send(
        addr,
        "PUT",
        "/v1/tenants/bad!tenant/override",
        Some(&json!({"version": 0, "tier": "normal"})),
    )
    .await;
    assert_eq!(code, 400, "{answer}");
    assert!(answer["error"].as_str().unwrap().contains("invalid tenant"));
    let (code, answer) = send(
        addr,
        "PUT",
        "/v1/tenants/acme/override",
        Some(&json!({"debounce": {"delay": "1s"}})),
    )
    .await;
    assert_eq!((code, &answer["key"]), (400, &Value::from("version")));
    // Still version 1, still in force.
    let (code, list) = get_json(addr, "/v1/overrides").await;
    assert_eq!(code, 200);
    let acme = &list["overrides"][0];
    assert_eq!(
        (&acme["tenant"], &acme["version"], &acme["in_force"]),
        (&Value::from("acme"), &Value::from(1), &Value::from(true)),
        "{list}"
    );
    assert_eq!(acme["rules"]["wins"], "override");
    assert!(list["config"]["default"]
        .as_str()
        .unwrap()
        .starts_with("fixed delay=1h"));

    // Removal: the config's rule again.
    let (code, answer) = send(addr, "DELETE", "/v1/tenants/acme/override?version=0", None).await;
    assert_eq!(code, 409, "{answer}");
    let (code, answer) = send(
        addr,
        "DELETE",
        "/v1/tenants/acme/override?version=1&reason=done",
        None,
    )
    .await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["override"]["version"], 2);
    assert_eq!(answer["tenant"]["wins"], "config");
    produce(&broker, "acme", "after", node.clock.now_ms());
    node.settled(&broker, 2).await;
    let (_, after) = get_json(addr, "/v1/sessions/acme/after").await;
    assert_eq!(after["round"]["delay_ms"], HOUR, "{after}");
    let (code, _) = send(addr, "DELETE", "/v1/tenants/acme/override?version=2", None).await;
    assert_eq!(code, 404, "nothing in force to remove");

    // Counted and audited.
    assert_eq!(
        metric(addr, "settle_override_changes_total", &[("change", "set")]).await,
        1.0
    );
    assert_eq!(
        metric(
            addr,
            "settle_override_changes_total",
            &[("change", "removed")]
        )
        .await,
        1.0
    );
    assert!(
        metric(
            addr,
            "settle_override_changes_total",
            &[("change", "refused")]
        )
        .await
            >= 6.0
    );
    assert_eq!(metric(addr, "settle_overrides", &[]).await, 0.0);
    let records = audit(&broker);
    assert!(records.iter().any(|r| r.request_id == "ov-1"
        && r.action == "override.set"
        && r.stage == AuditStage::Accepted
        && r.reason == "calm acme down"));
    assert!(records
        .iter()
        .any(|r| r.action == "override.delete" && r.stage == AuditStage::Accepted));
    assert!(records
        .iter()
        .filter(|r| r.stage == AuditStage::Refused)
        .any(|r| r.reason.contains("debounce.max-delay")));
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_override_gives_the_tenant_its_configured_rule_back() {
    let dir = tempfile::tempdir().unwrap();
    let broker = MemoryBroker::new(TOPIC, 2);
    let node = Node::start(&broker, options(dir.path())).await;
    let addr = node.addr;
    node.settled(&broker, 0).await;
    let body = json!({"version": 0, "debounce": {"delay": "100ms"}, "expires_in": "2s"});
    let (code, answer) = send(addr, "PUT", "/v1/tenants/beta/override", Some(&body)).await;
    assert_eq!(code, 200, "{answer}");
    let expires_at =
        settle::codec::parse_rfc3339_ms(answer["override"]["expires_at"].as_str().unwrap())
            .unwrap();
    produce(&broker, "beta", "before", node.clock.now_ms());
    assert_eq!(emission_of(&broker, "beta/before").await.delay_ms, 100);
    // Wait for the expiry to be applied.
    let back_at = tokio::time::timeout(PATIENCE, async {
        loop {
            let (_, view) = get_json(addr, "/v1/tenants/beta").await;
            // The rule in force (what the partitions apply), not only the view of the set.
            let rule = view["rules"]["rule"].as_str().unwrap_or_default();
            if view["rules"]["wins"] == "config" && rule.starts_with("fixed delay=1h") {
                return node.clock.now_ms();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the override expires");
    assert!(back_at >= expires_at, "not before its expiry");
    // At most a second late (plus the polling and a loaded machine's slack).
    assert!(
        back_at <= expires_at + 3_000,
        "{} ms late",
        back_at - expires_at
    );
    produce(&broker, "beta", "after", node.clock.now_ms());
    node.settled(&broker, 1).await;
    let (_, after) = get_json(addr, "/v1/sessions/beta/after").await;
    assert_eq!(after["round"]["delay_ms"], HOUR, "{after}");
    assert_eq!(
        metric(
            addr,
            "settle_override_changes_total",
            &[("change", "expired")]
        )
        .await,
        1.0
    );
    assert!(audit(&broker)
        .iter()
        .any(|r| r.action == "override.expired" && r.stage == AuditStage::Applied));
    // Expired: a new override may name version 0 again (nothing in force).
    let (code, answer) = send(
        addr,
        "PUT",
        "/v1/tenants/beta/override",
        Some(&json!({"version": 0, "tier": "limited"})),
    )
    .await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["override"]["version"], 2);
    node.stop().await;
}

fn tier_options(dir: &Path) -> RuntimeOptions {
    let mut o = options(dir);
    o.tiers = TiersConfig {
        limit: 5,
        period: Duration::from_secs(600),
        recover_ratio: 0.5,
        cooldown: Duration::from_secs(600),
        ..TiersConfig::default()
    };
    o
}

/// Ready records of `tenant` per tier `(normal, limited)`.
fn by_tier(broker: &MemoryBroker, tenant: &str) -> (usize, usize) {
    let mut counts = (0, 0);
    for (e, tier) in broker.output().iter().filter_map(|m| {
        let r = settle::codec::decode_ready(&m.payload).ok()?;
        Some((r.tenant, m.tier.clone()))
    }) {
        if e != tenant {
            continue;
        }
        match tier.as_str() {
            "normal" => counts.0 += 1,
            "limited" => counts.1 += 1,
            other => panic!("tier {other}"),
        }
    }
    counts
}

fn final_upload(broker: &MemoryBroker, tenant: &str, session: &str, ts: Millis) {
    let json = format!(r#"{{"tenant":"{tenant}","session":"{session}","final":true}}"#);
    broker.produce_upload(&format!("{tenant}/{session}"), &json, ts);
}

async fn emitted_of(broker: &MemoryBroker, tenant: &str, n: usize) {
    tokio::time::timeout(PATIENCE, async {
        loop {
            let (a, b) = by_tier(broker, tenant);
            if a + b >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{n} emissions of {tenant}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_tier_holds_at_twice_the_limit_and_automatic_tiering_resumes_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let broker = MemoryBroker::new(TOPIC, 2);
    let node = Node::start(&broker, tier_options(dir.path())).await;
    let addr = node.addr;
    node.settled(&broker, 0).await;
    let body = json!({"version": 0, "tier": "normal", "reason": "paying customer"});
    let (code, answer) = send(addr, "PUT", "/v1/tenants/paying/override", Some(&body)).await;
    assert_eq!(code, 200, "{answer}");
    // Twice the limit (5 per 10 min) each, emitted at once (`final`).
    let now = node.clock.now_ms();
    for s in 0..10 {
        final_upload(&broker, "paying", &format!("s{s}"), now);
        final_upload(&broker, "loud", &format!("s{s}"), now);
    }
    emitted_of(&broker, "paying", 10).await;
    emitted_of(&broker, "loud", 10).await;
    assert_eq!(by_tier(&broker, "paying"), (10, 0), "the pin holds");
    assert_eq!(by_tier(&broker, "loud"), (5, 5), "without a pin: demoted");
    let (_, view) = get_json(addr, "/v1/tenants/paying").await;
    assert_eq!(
        (&view["tier"], &view["pinned"]),
        (&Value::from("normal"), &Value::from(true)),
        "{view}"
    );
    // Measured (above limit + 1 the window may over-count by one slice's emissions).
    assert!(
        view["rate"].as_u64().is_some_and(|r| r >= 10),
        "the rate is still measured: {view}"
    );
    assert_eq!(view["rules"]["pinned_by"], "override");
    assert_eq!(view["rules"]["wins"], "override");
    // The pin goes: its next emission is tiered by the measured rate (11 > 5).
    let (code, answer) = send(
        addr,
        "DELETE",
        "/v1/tenants/paying/override?version=1",
        None,
    )
    .await;
    assert_eq!(code, 200, "{answer}");
    final_upload(&broker, "paying", "s10", node.clock.now_ms());
    emitted_of(&broker, "paying", 11).await;
    assert_eq!(by_tier(&broker, "paying"), (10, 1));
    let (_, view) = get_json(addr, "/v1/tenants/paying").await;
    assert_eq!(
        (&view["tier"], &view["pinned"]),
        (&Value::from("limited"), &Value::from(false))
    );
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_outlives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let broker = MemoryBroker::new(TOPIC, 2);
    let node = Node::start(&broker, options(dir.path())).await;
    node.settled(&broker, 0).await;
    let body = json!({"version": 0, "debounce": {"policy": "leading-trailing", "delay": "300ms"}, "reason": "until Friday", "expires_in": "1h"});
    let (code, answer) = send(node.addr, "PUT", "/v1/tenants/gamma/override", Some(&body)).await;
    assert_eq!(code, 200, "{answer}");
    node.stop().await;

    let node = Node::start(&broker, options(dir.path())).await;
    node.settled(&broker, 0).await;
    let (_, view) = get_json(node.addr, "/v1/tenants/gamma").await;
    assert_eq!(view["rules"]["wins"], "override", "{view}");
    assert_eq!(view["rules"]["override"]["version"], 1);
    assert_eq!(view["rules"]["override"]["reason"], "until Friday");
    assert!(view["rules"]["override"]["expires_at"].is_string());
    produce(&broker, "gamma", "s", node.clock.now_ms());
    let e = emission_of(&broker, "gamma/s").await;
    assert_eq!((e.policy, e.delay_ms), (PolicyName::LeadingTrailing, 300));
    assert_eq!(metric(node.addr, "settle_overrides", &[]).await, 1.0);
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_of_event_ids_lists_the_tenants_ids_from_its_next_round() {
    let dir = tempfile::tempdir().unwrap();
    let broker = MemoryBroker::new(TOPIC, 2);
    let node = Node::start(&broker, options(dir.path())).await;
    let addr = node.addr;
    let with_id = |session: &str, id: &str| {
        let json = format!(r#"{{"tenant":"acme","session":"{session}","event_id":"{id}"}}"#);
        broker.produce_upload(&format!("acme/{session}"), &json, node.clock.now_ms());
    };

    // Out of range: 400 naming the key.
    let (code, answer) = send(
        addr,
        "PUT",
        "/v1/tenants/acme/override",
        Some(&json!({"version": 0, "event_ids": 100_001})),
    )
    .await;
    assert_eq!(
        (code, &answer["key"]),
        (400, &Value::from("event_ids")),
        "{answer}"
    );

    // Applied (it was stored and shown only before): 2 ids per round, fast rounds.
    let body = json!({"version": 0, "debounce": {"delay": "200ms"}, "event_ids": 2});
    let (code, answer) = send(addr, "PUT", "/v1/tenants/acme/override", Some(&body)).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["override"]["event_ids"], 2);
    assert_eq!(answer["tenant"]["rule_from"], "override", "{answer}");
    for id in ["e-1", "e-2", "e-3"] {
        with_id("s", id);
    }
    let e = emission_of(&broker, "acme/s").await;
    let ids = e.event_ids.expect("the override keeps event ids");
    assert_eq!(
        (ids.iter().collect::<Vec<_>>(), ids.dropped(), e.uploads),
        (vec!["e-1", "e-2"], 1, 3)
    );

    // `event_ids` alone is a rule of its own: 0 turns them off again (delay from the config).
    let (code, answer) = send(
        addr,
        "PUT",
        "/v1/tenants/acme/override",
        Some(&json!({"version": 1, "event_ids": 0})),
    )
    .await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["tenant"]["rule_from"], "override", "{answer}");
    with_id("t", "e-9");
    node.settled(&broker, 1).await;
    let (_, t) = get_json(addr, "/v1/sessions/acme/t").await;
    assert_eq!(t["round"]["delay_ms"], HOUR, "{t}");
    node.stop().await;
}
