//! Tenant overrides across a Kafka deployment (issue "operate it by hand", item 3; SEMANTICS
//! §7): two `settle run` processes in one consumer group over a 4-partition input (the
//! config's rule `fixed 1h`), overrides in the compacted topic `<group-id>.overrides`.
//!
//! * An override set through instance 0 (fixed 300 ms) is in force on instance 1 within one
//!   share interval, and every upload of the tenant (on the partitions of both instances) is
//!   emitted timed by it.
//! * Both instances SIGKILLed and restarted: they read the topic back, the override is in
//!   force on both, and new uploads are timed by it.
//! * A stale version asked of instance 1: 409; a removal through instance 1 gives the tenant
//!   its configured rule back on instance 0.
//!
//! Needs `SETTLE_TEST_KAFKA` (tansu from `scripts/test.sh`).

use crate::admin_support::get_json;
use crate::kafka_actions::Instance;
use crate::kafka_support::{broker, fresh_topics, ready_records};
use crate::nats_overrides::{ready_at, send, until_wins, SHARE_INTERVAL};
use anyhow::{ensure, Result};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;
use settle::engine::PolicyName;
use settle::transport::kafka::{KafkaConfig, Role};
use std::time::Duration;

const PARTITIONS: i32 = 4;
const STEP: Duration = Duration::from_secs(180);

async fn produce(kafka: &KafkaConfig, prefix: &str, n: usize) -> Result<()> {
    let producer: FutureProducer = kafka.client_config(Role::Producer).create()?;
    for s in 0..n {
        let key = format!("acme/{prefix}{s}");
        let body = format!(r#"{{"tenant":"acme","session":"{prefix}{s}"}}"#);
        producer
            .send(
                FutureRecord::to(&kafka.input_topic)
                    .partition((s % PARTITIONS as usize) as i32)
                    .key(key.as_bytes())
                    .payload(body.as_bytes()),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| e)?;
    }
    Ok(())
}

#[test]
fn kafka_overrides_apply_on_every_instance_and_after_a_restart() -> Result<()> {
    let Some(bootstrap) = broker("kafka_overrides_apply_on_every_instance_and_after_a_restart")
    else {
        return Ok(());
    };
    let rt = tokio::runtime::Runtime::new()?;
    let (kafka, output) = fresh_topics(&rt, &bootstrap, "overrides", PARTITIONS)?;
    let dir = tempfile::tempdir()?;
    rt.block_on(async {
        let mut i0 = Instance::start(&kafka, &output, dir.path(), 0)?;
        let mut i1 = Instance::start(&kafka, &output, dir.path(), 1)?;
        ready_at(i0.addr).await?;
        ready_at(i1.addr).await?;

        let body = json!({"version": 0, "debounce": {"policy": "fixed", "delay": "300ms"}, "reason": "incident 42", "wait_ms": 30000});
        let (code, answer) = send(i0.addr, "PUT", "/v1/tenants/acme/override", Some(&body)).await?;
        ensure!(code == 200 && answer["result"] == "applied", "{answer}");
        let took = until_wins(i1.addr, "acme", "override", 1).await?;
        ensure!(
            took <= SHARE_INTERVAL,
            "instance 1 applied the override after {took:?}, more than one share interval"
        );

        produce(&kafka, "s", 8).await?;
        let records = ready_records(&kafka, &output, "normal", 8, STEP).await?;
        ensure!(records.len() == 8, "{}", records.len());
        ensure!(
            records
                .iter()
                .all(|r| r.emission.policy == PolicyName::Fixed && r.emission.delay_ms == 300),
            "every emission timed by the override"
        );

        for i in [&mut i0, &mut i1] {
            i.child.kill()?;
            i.child.wait()?;
        }
        i0.restart()?;
        i1.restart()?;
        ready_at(i0.addr).await?;
        ready_at(i1.addr).await?;
        until_wins(i0.addr, "acme", "override", 1).await?;
        until_wins(i1.addr, "acme", "override", 1).await?;
        produce(&kafka, "r", 8).await?;
        let records = ready_records(&kafka, &output, "normal", 16, STEP).await?;
        let after: Vec<_> = records
            .iter()
            .filter(|r| r.emission.key.session().starts_with('r'))
            .collect();
        ensure!(after.len() == 8, "{}", after.len());
        ensure!(
            after.iter().all(|r| r.emission.delay_ms == 300),
            "timed by the override after the restart"
        );

        let stale = json!({"version": 0, "debounce": {"delay": "1s"}});
        let (code, answer) = send(i1.addr, "PUT", "/v1/tenants/acme/override", Some(&stale)).await?;
        ensure!(code == 409 && answer["version"] == 1, "{answer}");
        let (code, answer) =
            send(i1.addr, "DELETE", "/v1/tenants/acme/override?version=1&wait_ms=30000", None)
                .await?;
        ensure!(code == 200, "{answer}");
        until_wins(i0.addr, "acme", "config", 2).await?;
        let (_, view) = get_json(i0.addr, "/v1/tenants/acme").await;
        ensure!(
            view["rules"]["rule"]
                .as_str()
                .is_some_and(|r| r.starts_with("fixed delay=1h")),
            "{view}"
        );
        Ok(())
    })
}
