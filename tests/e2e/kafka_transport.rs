//! The Kafka transport against a real broker, without the runtime: records round-trip
//! through `KafkaSource`/`KafkaInput` (keys, payloads, timestamps, offsets, caught-up, seek,
//! commit) and `KafkaSink` (emission-id header, dead-letter headers), and a revocation blocks
//! the consumer group until `done` is signalled.
//!
//! `SETTLE_TEST_KAFKA=host:port` runs them (scripts/test.sh sets it); unset, they print that
//! they did not run, except under CI (`CI` set), where that is a failure. Set and no broker:
//! they fail.

use crate::kafka_support;

use anyhow::{bail, ensure, Context as _, Result};
use kafka_support::broker;
use settle::cli::loadgen::{self, OutRecord};
use settle::transport::kafka::{
    KafkaConfig, KafkaInput, KafkaSink, KafkaSource, DLQ_REASON_HEADER, DLQ_SOURCE_OFFSET_HEADER,
    DLQ_SOURCE_PARTITION_HEADER, DLQ_SOURCE_TOPIC_HEADER,
};
use settle::transport::{InputRecord, PartitionInput, ReadyMessage, Sink, Source, SourceEvent};
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::timeout;

/// Bound on one step that talks to the broker.
const STEP: Duration = Duration::from_secs(60);

/// A config on fresh topics and a fresh group, with fast group timings. Logs go to the test
/// output, filtered by `SETTLE_LOG` (default `warn`); `SETTLE_TEST_KAFKA_DEBUG=cgrp,fetch`
/// (say) turns on librdkafka's debug contexts.
fn fresh_config(bootstrap: &str, name: &str) -> KafkaConfig {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let id = format!("{name}-{}-{nanos}", std::process::id());
    let mut c = KafkaConfig {
        bootstrap_servers: bootstrap.to_owned(),
        group_id: format!("{id}-group"),
        input_topic: format!("{id}-in"),
        dead_letter_topic: format!("{id}-dlq"),
        ..KafkaConfig::default()
    };
    c.properties
        .insert("session.timeout.ms".into(), "30000".into());
    c.properties
        .insert("heartbeat.interval.ms".into(), "1000".into());
    if let Ok(debug) = std::env::var("SETTLE_TEST_KAFKA_DEBUG") {
        c.properties.insert("debug".into(), debug);
    }
    c
}

/// Waits for the next `Assigned` event (skipping nothing else: a revoke here is a failure).
async fn assigned(source: &mut KafkaSource) -> Result<Vec<KafkaInput>> {
    match timeout(STEP, source.next_event()).await {
        Err(_) => bail!("no assignment within {STEP:?}"),
        Ok(Ok(Some(SourceEvent::Assigned(inputs)))) => Ok(inputs),
        Ok(Ok(Some(SourceEvent::Revoked { partitions, .. }))) => {
            bail!("revoked {partitions:?} while waiting for an assignment")
        }
        Ok(Ok(None)) => bail!("source ended"),
        Ok(Err(e)) => bail!("source error: {e}"),
    }
}

/// Polls `input` until it is caught up with at least `want` records read.
async fn read_all(input: &mut KafkaInput, want: usize) -> Result<Vec<InputRecord>> {
    let mut got = Vec::new();
    timeout(STEP, async {
        loop {
            let batch = input.poll(7, Duration::from_millis(200)).await?;
            got.extend(batch.records);
            if batch.caught_up && got.len() >= want {
                return anyhow::Ok(());
            }
        }
    })
    .await
    .with_context(|| {
        format!(
            "partition {}: {} of {want} records, never caught up",
            input.partition(),
            got.len()
        )
    })??;
    Ok(got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_transport_round_trip() -> Result<()> {
    let Some(bootstrap) = broker("kafka_transport_round_trip") else {
        return Ok(());
    };
    let kafka = fresh_config(&bootstrap, "transport");
    let out_topic = format!("{}-out", kafka.input_topic);
    loadgen::create_topics(
        &kafka,
        &[
            (&kafka.input_topic, 3),
            (&kafka.dead_letter_topic, 1),
            (&out_topic, 1),
        ],
    )
    .await?;

    // 30 keyed records with explicit timestamps.
    let t0 = 1_767_225_600_000_i64;
    let sent: Vec<OutRecord> = (0..30)
        .map(|i| OutRecord {
            key: Some(format!("t{}/s{i}", i % 4).into_bytes()),
            payload: format!(r#"{{"tenant":"t{}","session":"s{i}"}}"#, i % 4).into_bytes(),
            timestamp_ms: Some(t0 + i * 10),
        })
        .collect();
    let delivered = loadgen::produce_all(&kafka, &kafka.input_topic, &sent).await?;
    let mut expected: BTreeMap<i32, Vec<InputRecord>> = BTreeMap::new();
    for (r, d) in sent.iter().zip(&delivered) {
        expected.entry(d.partition).or_default().push(InputRecord {
            partition: d.partition,
            offset: d.offset,
            key: r.key.clone().map(Into::into),
            payload: r.payload.clone().into(),
            timestamp_ms: r.timestamp_ms.unwrap_or_default(),
        });
    }

    let mut source = KafkaSource::new(&kafka)?;
    let mut inputs = assigned(&mut source).await?;
    inputs.sort_by_key(|i| i.partition());
    let owned: Vec<i32> = inputs.iter().map(|i| i.partition()).collect();
    ensure!(owned == vec![0, 1, 2], "assigned {owned:?}");
    for input in &mut inputs {
        ensure!(input.topic() == kafka.input_topic);
        let want = expected
            .get(&input.partition())
            .cloned()
            .unwrap_or_default();
        let got = read_all(input, want.len()).await?;
        ensure!(
            got == want,
            "partition {}: read {got:?}, produced {want:?}",
            input.partition()
        );
        // Caught up: an empty poll says so again.
        let again = input.poll(10, Duration::from_millis(300)).await?;
        ensure!(again.records.is_empty() && again.caught_up, "{again:?}");
        // Seek back: the records from offset 1 on come again.
        if want.len() >= 2 {
            input.seek(1).await?;
            let replay = read_all(input, want.len() - 1).await?;
            ensure!(replay == want[1..], "after seek(1): {replay:?}");
        }
        input.commit(want.len() as i64).await?;
    }
    println!("kafka: 30 records read back per partition, seek and commit done");

    // Sink: a ready record and a dead letter.
    let sink = KafkaSink::new(&kafka)?;
    sink.publish(ReadyMessage {
        topic: out_topic.clone(),
        tier: "normal".into(),
        key: "t0/s0".into(),
        emission_id: "t0/s0/1".into(),
        payload: br#"{"ready":true}"#.to_vec(),
        partition: Some(0),
    })
    .await?;
    let bad = InputRecord {
        partition: 2,
        offset: 17,
        key: Some(bytes::Bytes::from_static(b"t9/x")),
        payload: bytes::Bytes::from_static(b"not json"),
        timestamp_ms: t0,
    };
    sink.dead_letter(&bad, "invalid_json").await?;
    let out = loadgen::read_topic(&kafka, &out_topic, 1, STEP).await?;
    ensure!(out.len() == 1, "output topic holds {out:?}");
    ensure!(out[0].key.as_deref() == Some(&b"t0/s0"[..]));
    ensure!(out[0].header("settle-emission-id").as_deref() == Some("t0/s0/1"));
    ensure!(out[0].payload == br#"{"ready":true}"#);
    let dlq = loadgen::read_topic(&kafka, &kafka.dead_letter_topic, 1, STEP).await?;
    ensure!(dlq.len() == 1, "dead-letter topic holds {dlq:?}");
    let d = &dlq[0];
    ensure!(d.key.as_deref() == Some(&b"t9/x"[..]) && d.payload == b"not json");
    ensure!(
        d.timestamp_ms == t0,
        "dead letter timestamp {}",
        d.timestamp_ms
    );
    ensure!(d.header(DLQ_REASON_HEADER).as_deref() == Some("invalid_json"));
    ensure!(d.header(DLQ_SOURCE_TOPIC_HEADER).as_deref() == Some(kafka.input_topic.as_str()));
    ensure!(d.header(DLQ_SOURCE_PARTITION_HEADER).as_deref() == Some("2"));
    ensure!(d.header(DLQ_SOURCE_OFFSET_HEADER).as_deref() == Some("17"));
    println!("kafka: ready record and dead letter carry their headers");

    // Dropping the source commits synchronously and leaves the group.
    drop(inputs);
    drop(source);
    let committed = loadgen::committed_offsets(&kafka, &kafka.input_topic, 3).await?;
    let want: Vec<i64> = (0..3)
        .map(|p| expected.get(&p).map_or(0, |v| v.len() as i64))
        .collect();
    // A partition that got no record was never committed.
    let got: Vec<i64> = committed.iter().map(|o| o.unwrap_or(0)).collect();
    ensure!(got == want, "committed {committed:?}, want {want:?}");
    println!("kafka transport round trip passed against {bootstrap}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_revocation_waits_for_done() -> Result<()> {
    let Some(bootstrap) = broker("kafka_revocation_waits_for_done") else {
        return Ok(());
    };
    let kafka = fresh_config(&bootstrap, "revoke");
    loadgen::create_topics(&kafka, &[(&kafka.input_topic, 4)]).await?;

    let mut a = KafkaSource::new(&kafka)?;
    let mut a_inputs = assigned(&mut a).await?;
    ensure!(
        a_inputs.len() == 4,
        "first member got {} partitions",
        a_inputs.len()
    );

    // A second member joins: the first must give some partitions up.
    let mut b = KafkaSource::new(&kafka)?;
    let (revoked, done) = match timeout(STEP, a.next_event()).await {
        Ok(Ok(Some(SourceEvent::Revoked {
            partitions, done, ..
        }))) => (partitions, done),
        other => bail!("first member: expected a revocation, got {other:?}"),
    };
    ensure!(
        !revoked.is_empty() && revoked.len() < 4,
        "revoked {revoked:?}"
    );
    // Until `done`, the group waits: the second member gets nothing.
    let early = timeout(Duration::from_secs(3), b.next_event()).await;
    ensure!(
        early.is_err(),
        "second member got {early:?} before the first signalled done"
    );
    a_inputs.retain(|i| !revoked.contains(&i.partition()));
    done.send(())
        .map_err(|()| anyhow::anyhow!("source dropped done"))?;
    let mut b_parts: Vec<i32> = assigned(&mut b)
        .await?
        .iter()
        .map(KafkaInput::partition)
        .collect();
    b_parts.sort_unstable();
    let mut want = revoked.clone();
    want.sort_unstable();
    ensure!(
        b_parts == want,
        "second member got {b_parts:?}, revoked {want:?}"
    );
    println!("kafka: revoke of {revoked:?} waited for done; the second member got them");
    drop(a_inputs);
    drop(a);
    drop(b);
    Ok(())
}
