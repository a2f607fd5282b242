//! Operator actions (SEMANTICS §7, issue "operate it by hand") end to end on the real
//! runtime: `POST /v1/actions` produces action records to the memory broker's input (to
//! every partition: the memory channel, like Kafka, does not know producers' partitioner),
//! each partition's task applies them in order with the uploads, and the answer carries
//! every partition's outcome. Flush emits once with `trigger = manual`; cancel emits nothing
//! and the audit says so; a retried request id acts once, also when its record reaches the
//! partition again after a new round opened; a bulk dry run counts what the bulk action
//! then does; bad requests get 400 and a refused audit record.

use crate::admin_support::{get_json, post_json};
use crate::runtime_support::*;
use serde_json::{json, Value};
use settle::admin::{AdminServer, AdminState};
use settle::codec::action::{ActionKind, ActionRecord, AuditRecord, AuditStage};
use settle::engine::{Millis, PolicySpec, Trigger};
use settle::runtime::{ActionLog, Clock, Runtime};
use settle::transport::memory::{MemoryBroker, MEMORY_AUDIT_TOPIC};
use settle::transport::ActionChannel;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const HOUR: Millis = 3_600_000;
/// Bound on waiting for the runtime (a hang guard, not a speed assertion).
const PATIENCE: Duration = Duration::from_secs(120);

fn audit(broker: &MemoryBroker) -> Vec<AuditRecord> {
    broker
        .audit()
        .iter()
        .map(|p| AuditRecord::decode(p).unwrap())
        .collect()
}

fn manual(broker: &MemoryBroker) -> Vec<String> {
    emitted(broker)
        .into_iter()
        .filter(|(e, _)| e.trigger == Trigger::Manual)
        .map(|(e, _)| e.emission_id())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_cancel_retry_and_bulk_through_the_input() {
    let dir = tempfile::tempdir().unwrap();
    let broker = MemoryBroker::new(TOPIC, 2);
    let clock = settle::runtime::TokioClock::starting_at(T0);
    let log = ActionLog::new(Some(MEMORY_AUDIT_TOPIC.into()), "settle-0");
    let runtime = Runtime::new(
        engine(PolicySpec::fixed(HOUR)),
        broker.sink(),
        clock,
        options(dir.path()),
    )
    .unwrap()
    .with_actions(log);
    let status = runtime.status();
    let channel: Arc<dyn ActionChannel> = Arc::new(broker.actions());
    let state = AdminState::new(&runtime).with_action_channel(Arc::clone(&channel));
    let server = AdminServer::start("127.0.0.1:0".parse().unwrap(), state)
        .await
        .unwrap();
    let addr = server.local_addr();

    let base = clock.now_ms() - 5_000;
    for s in 0..5 {
        for i in 0..2 {
            produce(&broker, "acme", &format!("s{s}"), base + i * 100);
        }
    }
    for s in 0..3 {
        produce(&broker, "other", &format!("x{s}"), base);
    }
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(runtime.run(broker.source(GROUP), shutdown.clone()));
    let pending = |n: u64| {
        let status = status.clone();
        let broker = broker.clone();
        async move {
            tokio::time::timeout(
                PATIENCE,
                status.wait_for(|m| {
                    all(m, 2, |s| {
                        s.caught_up && s.next_offset == Some(broker.end_offset(s.partition))
                    }) && m.values().map(|s| s.pending_rounds).sum::<u64>() == n
                }),
            )
            .await
            .expect("runtime applies every record");
        }
    };
    pending(8).await;

    // Flush one session: every partition answers; the one holding it flushed 2 uploads.
    let body = json!({"kind": "flush", "session": "acme/s1", "reason": "build 4711 never arrived", "request_id": "r-flush-1"});
    let (code, answer) = post_json(addr, "/v1/actions", &body.to_string()).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["result"], "flushed", "{answer}");
    assert_eq!(
        (answer["sessions"].as_u64(), answer["uploads"].as_u64()),
        (Some(1), Some(2))
    );
    assert_eq!(answer["partitions"], json!([0, 1]));
    let results: Vec<&str> = answer["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["result"].as_str().unwrap())
        .collect();
    assert_eq!(
        results.iter().filter(|r| **r == "no_state").count(),
        1,
        "{results:?}"
    );
    pending(7).await;
    tokio::time::timeout(PATIENCE, async {
        while manual(&broker).is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the flush is published");
    let flushed = manual(&broker);
    assert_eq!(flushed.len(), 1);
    let (e, _) = emitted(&broker)
        .into_iter()
        .find(|(e, _)| e.trigger == Trigger::Manual)
        .unwrap();
    assert_eq!(e.key.as_str(), "acme/s1");
    assert_eq!(e.uploads, 2);
    let ids: Vec<&str> = answer["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|o| o["emission_ids"].as_array().into_iter().flatten())
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(ids, [flushed[0].as_str()]);

    // A new round of s1, then the same request again, as a new record through the input
    // (what a retry that reached another instance does): a duplicate, nothing flushed.
    produce(&broker, "acme", "s1", clock.now_ms());
    pending(8).await;
    let retry = ActionRecord {
        request_id: "r-flush-1".into(),
        kind: ActionKind::Flush,
        dry_run: false,
        session: Some("acme/s1".into()),
        filter: None,
        limit: None,
        reason: "retried".into(),
        who: "bob".into(),
        instance: "settle-1".into(),
        requested_at: clock.now_ms(),
    };
    for p in 0..2 {
        channel
            .send(p, &retry.record_key(), retry.encode(), clock.now_ms())
            .await
            .unwrap();
    }
    // And through the API: the accepting instance knows the request and does not resend.
    let (code, again) = post_json(addr, "/v1/actions", &body.to_string()).await;
    assert_eq!((code, &again["result"]), (200, &Value::from("flushed")));
    tokio::time::timeout(PATIENCE, async {
        while audit(&broker)
            .iter()
            .filter(|r| r.request_id == "r-flush-1" && r.stage == AuditStage::Applied)
            .count()
            < 4
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("both partitions audit the retried record");
    let dups = audit(&broker)
        .into_iter()
        .filter(|r| r.request_id == "r-flush-1" && r.result["duplicate"] == true)
        .count();
    assert_eq!(dups, 2, "both partitions saw the retry as a duplicate");
    pending(8).await;
    assert_eq!(manual(&broker).len(), 1, "the retry flushed nothing");

    // Cancel: no emission, the round is gone, the audit says cancelled.
    let body = json!({"kind": "cancel", "session": "acme/s2", "reason": "bad data"});
    let (code, answer) = post_json(addr, "/v1/actions", &body.to_string()).await;
    assert_eq!(
        (code, &answer["result"]),
        (200, &Value::from("cancelled")),
        "{answer}"
    );
    pending(7).await;
    let (_, page) = get_json(addr, "/v1/pending?tenant=acme").await;
    let keys: Vec<&str> = page["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["key"].as_str().unwrap())
        .collect();
    assert!(
        !keys.contains(&"acme/s2") && keys.contains(&"acme/s1"),
        "{keys:?}"
    );
    let id = answer["request_id"].as_str().unwrap().to_owned();
    let cancelled = audit(&broker)
        .into_iter()
        .find(|r| r.request_id == id && r.result["result"] == "cancelled");
    assert!(cancelled.is_some_and(|r| r.reason == "bad data" && r.action == "cancel"));
    let (code, looked) = get_json(addr, &format!("/v1/actions/{id}")).await;
    assert_eq!(code, 200, "{looked}");
    assert!(looked["records"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["stage"] == "accepted"));

    // Nothing to act on: said so.
    let (_, answer) = post_json(
        addr,
        "/v1/actions",
        &json!({"kind": "flush", "session": "acme/none"}).to_string(),
    )
    .await;
    assert_eq!(answer["result"], "no_state");
    let (_, answer) = post_json(
        addr,
        "/v1/actions",
        &json!({"kind": "flush", "session": "acme/s2"}).to_string(),
    )
    .await;
    assert_eq!(
        answer["result"], "no_open_round",
        "s2 keeps its CallTrack: {answer}"
    );

    // Bulk: a dry run's counts are what the action then does.
    let filter = json!({"tenant": "acme", "min_uploads": 1});
    let (code, dry) = post_json(
        addr,
        "/v1/actions",
        &json!({"kind": "flush", "filter": filter, "dry_run": true}).to_string(),
    )
    .await;
    assert_eq!(
        (code, &dry["result"]),
        (200, &Value::from("would_do")),
        "{dry}"
    );
    assert_eq!(dry["sessions"], 4, "s0, s1 (new round), s3, s4: {dry}");
    assert_eq!(dry["uploads"], 7);
    pending(7).await;
    let (_, done) = post_json(
        addr,
        "/v1/actions",
        &json!({"kind": "flush", "filter": filter}).to_string(),
    )
    .await;
    assert_eq!(done["result"], "done", "{done}");
    assert_eq!(
        (done["sessions"].clone(), done["uploads"].clone()),
        (dry["sessions"].clone(), dry["uploads"].clone())
    );
    pending(3).await;
    tokio::time::timeout(PATIENCE, async {
        while manual(&broker).len() < 5 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the bulk flush is published");
    let all = manual(&broker);
    let mut unique = all.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), all.len(), "one emission id per round");

    // Bad requests: 400 naming the problem, and a refused audit record.
    for (body, says) in [
        (
            json!({"kind": "explode", "session": "a/b"}).to_string(),
            "kind",
        ),
        (
            json!({"kind": "flush"}).to_string(),
            "exactly one of session and filter",
        ),
        (
            json!({"kind": "flush", "session": "nokey"}).to_string(),
            "not tenant/session",
        ),
        (
            json!({"kind": "flush", "session": "a/b", "colour": 1}).to_string(),
            "colour",
        ),
        (
            json!({"kind": "flush", "filter": {"tier": "gold"}}).to_string(),
            "gold",
        ),
        ("not json".to_owned(), ""),
    ] {
        let (code, answer) = post_json(addr, "/v1/actions", &body).await;
        assert_eq!(code, 400, "{body}: {answer}");
        assert!(
            answer["error"].as_str().unwrap().contains(says),
            "{body}: {answer}"
        );
    }
    assert!(
        audit(&broker)
            .iter()
            .filter(|r| r.stage == AuditStage::Refused)
            .count()
            >= 6
    );
    assert_eq!(manual(&broker).len(), 5);

    shutdown.cancel();
    run.await.unwrap().unwrap();
    server.stop().await;
}
