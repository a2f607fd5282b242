//! Smoke test of the brokers the integration tests run against (not of settle itself).
//!
//! * `SETTLE_TEST_KAFKA=host:port`: creates a fresh topic with the rdkafka `AdminClient`,
//!   produces 10 keyed records with headers through an idempotent `FutureProducer`
//!   (acks=all), checks the watermarks (ListOffsets), reads the records back with a
//!   `StreamConsumer` in a consumer group, commits each offset, checks what the group
//!   coordinator stored (OffsetFetch), then checks that a new member of the group resumes
//!   after the committed offsets. Finally deletes the topic (DeleteTopics).
//! * `SETTLE_TEST_NATS=host:port`: creates a JetStream stream, publishes 10 messages with
//!   acknowledged publishes, reads them back with a durable pull consumer, acks them, checks
//!   the consumer's state, and deletes the stream.
//!
//! When a variable is unset the matching test prints that it did not run and passes (under CI,
//! `CI` set, it fails instead); when it is set and the broker is absent or misbehaves, the
//! test fails. `scripts/test.sh` starts
//! both brokers (tansu for Kafka) and sets both variables.
//!
//! Two things learnt writing it, both true for settle's own Kafka code:
//! * Drop every `BorrowedMessage` before its consumer. Dropping a `StreamConsumer` while a
//!   message borrowed from it is alive hangs forever in `rd_kafka_destroy` (the message pins
//!   its partition, which pins the broker thread). Keep a message past that point only as
//!   `detach()`ed `OwnedMessage`.
//! * tansu 0.6 stamps records with the producer's CreateTime; it has no LogAppendTime.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use futures::StreamExt as _;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio::time::timeout;

const RECORDS: usize = 10;
const PARTITIONS: i32 = 3;
/// Bound on every single broker interaction, so a broken broker fails the test instead of
/// hanging it.
const STEP: Duration = Duration::from_secs(30);

/// Returns the broker address from `var`, or `None` (after saying so) when it is unset.
fn broker(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v.trim().to_owned()),
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI is set but {var} is not: the broker smoke test needs the brokers scripts/test.sh starts"
            );
            println!(
                "{var} is not set: this broker smoke test did NOT run (scripts/test.sh sets it)"
            );
            None
        }
    }
}

/// A name no earlier run used, so runs against a long-lived broker never collide.
fn unique(prefix: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

fn kafka_config(bootstrap: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap);
    // SETTLE_TEST_KAFKA_DEBUG=protocol,cgrp (say) turns on librdkafka's debug log.
    if let Ok(debug) = std::env::var("SETTLE_TEST_KAFKA_DEBUG") {
        config.set("debug", debug);
    }
    config
}

fn group_consumer(bootstrap: &str, group: &str, topic: &str) -> Result<StreamConsumer> {
    let consumer: StreamConsumer = kafka_config(bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "10000")
        .set("heartbeat.interval.ms", "1000")
        .create()
        .context("creating the StreamConsumer")?;
    consumer.subscribe(&[topic]).context("subscribing")?;
    Ok(consumer)
}

/// Sum over partitions of (high watermark - low watermark), via ListOffsets.
fn records_in_topic(consumer: &StreamConsumer, topic: &str) -> Result<i64> {
    let mut total = 0;
    for partition in 0..PARTITIONS {
        let (low, high) = consumer
            .fetch_watermarks(topic, partition, STEP)
            .with_context(|| format!("ListOffsets for {topic}/{partition}"))?;
        total += high - low;
    }
    Ok(total)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_create_produce_consume_commit() -> Result<()> {
    let Some(bootstrap) = broker("SETTLE_TEST_KAFKA") else {
        return Ok(());
    };
    let topic = unique("settle-smoke");
    let group = unique("settle-smoke-group");

    // CreateTopics.
    let admin: AdminClient<DefaultClientContext> = kafka_config(&bootstrap)
        .create()
        .context("creating the AdminClient")?;
    let options = AdminOptions::new().operation_timeout(Some(STEP));
    let created = timeout(
        STEP,
        admin.create_topics(
            &[NewTopic::new(
                &topic,
                PARTITIONS,
                TopicReplication::Fixed(1),
            )],
            &options,
        ),
    )
    .await
    .context("CreateTopics timed out")?
    .context("CreateTopics")?;
    for result in created {
        result.map_err(|(name, code)| anyhow!("CreateTopics {name}: {code}"))?;
    }
    println!("kafka: CreateTopics {topic} ({PARTITIONS} partitions) ok");

    // Idempotent producer, acks=all.
    let producer: FutureProducer = kafka_config(&bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.timeout.ms", "30000")
        .create()
        .context("creating the idempotent FutureProducer")?;
    let mut sent = BTreeMap::new();
    for i in 0..RECORDS {
        let key = format!("tenant-{}/session-{i}", i % 3);
        let payload = format!(r#"{{"tenant":"tenant-{}","session":"session-{i}"}}"#, i % 3);
        let headers = OwnedHeaders::new().insert(Header {
            key: "settle-emission-id",
            value: Some(&format!("{key}/1")),
        });
        let record = FutureRecord::to(&topic)
            .key(&key)
            .payload(&payload)
            .headers(headers);
        let delivery = timeout(STEP, producer.send(record, STEP))
            .await
            .context("produce timed out")?
            .map_err(|(e, _)| anyhow!("produce of {key}: {e}"))?;
        ensure!(
            (0..PARTITIONS).contains(&delivery.partition) && delivery.offset >= 0,
            "bad delivery report for {key}: {delivery:?}"
        );
        sent.insert(key, payload);
    }
    producer.flush(STEP).context("flushing the producer")?;
    println!("kafka: {RECORDS} records produced (idempotent, acks=all)");

    // Consumer group: read everything back, committing each offset synchronously.
    let consumer = group_consumer(&bootstrap, &group, &topic)?;
    ensure!(
        records_in_topic(&consumer, &topic)? == RECORDS as i64,
        "watermarks do not add up to {RECORDS} records"
    );
    println!("kafka: ListOffsets watermarks add up to {RECORDS}");
    let mut received = BTreeMap::new();
    while received.len() < RECORDS {
        let message = timeout(STEP, consumer.recv())
            .await
            .with_context(|| {
                format!(
                    "consumer got {} of {RECORDS} records, then nothing for {STEP:?}",
                    received.len()
                )
            })?
            .context("consumer error")?;
        if received.is_empty() {
            println!("kafka: first record's timestamp: {:?}", message.timestamp());
        }
        let key = String::from_utf8(message.key().unwrap_or_default().to_vec())?;
        let payload = String::from_utf8(message.payload().unwrap_or_default().to_vec())?;
        let header = message
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "settle-emission-id"))
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned());
        ensure!(
            header.as_deref() == Some(format!("{key}/1").as_str()),
            "header settle-emission-id of {key} came back as {header:?}"
        );
        consumer
            .commit_message(&message, CommitMode::Sync)
            .with_context(|| format!("OffsetCommit for {key}"))?;
        ensure!(
            received.insert(key.clone(), payload).is_none(),
            "{key} delivered twice"
        );
    }
    ensure!(
        received == sent,
        "records came back different: {received:?} vs {sent:?}"
    );
    println!("kafka: {RECORDS} records consumed in group {group}, each offset committed");

    // OffsetFetch: the committed offsets are the high watermarks.
    let mut partitions = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        partitions.add_partition(&topic, partition);
    }
    let committed = consumer
        .committed_offsets(partitions, STEP)
        .context("OffsetFetch")?;
    let mut committed_total = 0;
    for element in committed.elements() {
        let (_, high) = consumer.fetch_watermarks(&topic, element.partition(), STEP)?;
        match element.offset() {
            Offset::Offset(o) => {
                ensure!(
                    o == high,
                    "partition {}: committed {o}, high watermark {high}",
                    element.partition()
                );
                committed_total += o;
            }
            Offset::Invalid if high == 0 => {}
            other => bail!(
                "partition {}: committed {other:?}, high watermark {high}",
                element.partition()
            ),
        }
    }
    ensure!(
        committed_total == RECORDS as i64,
        "committed offsets add up to {committed_total}"
    );
    println!("kafka: OffsetFetch returns the high watermarks");
    drop(consumer); // leaves the group
    println!("kafka: first consumer closed");

    // A new member of the same group resumes after the committed offsets.
    let key = "tenant-9/after-commit".to_owned();
    timeout(
        STEP,
        producer.send(FutureRecord::to(&topic).key(&key).payload("{}"), STEP),
    )
    .await
    .context("produce timed out")?
    .map_err(|(e, _)| anyhow!("produce of {key}: {e}"))?;
    let consumer = group_consumer(&bootstrap, &group, &topic)?;
    // detach(): the message must not outlive the consumer as a BorrowedMessage (see above).
    let message = timeout(STEP, consumer.recv())
        .await
        .context("the second group member got nothing")?
        .context("consumer error")?
        .detach();
    drop(consumer);
    ensure!(
        message.key() == Some(key.as_bytes()),
        "the second group member did not resume after the committed offsets: got key {:?}",
        message.key().map(String::from_utf8_lossy)
    );
    println!("kafka: a new group member resumed after the committed offsets");

    // DeleteTopics.
    let deleted = timeout(STEP, admin.delete_topics(&[&topic], &options))
        .await
        .context("DeleteTopics timed out")?
        .context("DeleteTopics")?;
    for result in deleted {
        result.map_err(|(name, code)| anyhow!("DeleteTopics {name}: {code}"))?;
    }
    println!("kafka smoke test passed against {bootstrap} (topic {topic})");
    Ok(())
}

#[tokio::test]
async fn nats_jetstream_publish_pull_ack() -> Result<()> {
    use async_nats::jetstream::{self, consumer::pull, stream};

    let Some(addr) = broker("SETTLE_TEST_NATS") else {
        return Ok(());
    };
    let client = timeout(STEP, async_nats::connect(&addr))
        .await
        .context("connecting to NATS timed out")?
        .with_context(|| format!("connecting to NATS at {addr}"))?;
    let js = jetstream::new(client);

    let name = unique("SETTLE_SMOKE").replace('-', "_");
    let subject = format!("settle.smoke.{name}");
    let stream = timeout(
        STEP,
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{subject}.>")],
            storage: stream::StorageType::Memory,
            max_age: Duration::from_secs(600),
            ..Default::default()
        }),
    )
    .await
    .context("create_stream timed out")?
    .context("create_stream (is JetStream enabled? nats-server -js)")?;

    for i in 0..RECORDS {
        let ack = timeout(STEP, async {
            js.publish(
                format!("{subject}.tenant-{}.session-{i}", i % 3),
                format!("upload {i}").into(),
            )
            .await?
            .await
        })
        .await
        .context("publish timed out")?
        .with_context(|| format!("acknowledged publish {i}"))?;
        ensure!(
            ack.sequence == i as u64 + 1,
            "publish {i} got stream sequence {}",
            ack.sequence
        );
    }

    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("settle-smoke".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .context("create_consumer")?;
    let mut batch = consumer
        .fetch()
        .max_messages(RECORDS)
        .expires(Duration::from_secs(5))
        .messages()
        .await
        .context("fetch")?;
    let mut received = Vec::new();
    while let Some(message) = timeout(STEP, batch.next())
        .await
        .context("fetch timed out")?
    {
        let message = message.map_err(|e| anyhow!("fetch: {e}"))?;
        received.push(String::from_utf8(message.payload.to_vec())?);
        message
            .double_ack()
            .await
            .map_err(|e| anyhow!("ack: {e}"))?;
    }
    let expected: Vec<String> = (0..RECORDS).map(|i| format!("upload {i}")).collect();
    ensure!(received == expected, "pull consumer got {received:?}");

    let mut consumer = consumer;
    let info = consumer.info().await.context("consumer info")?;
    ensure!(
        info.ack_floor.stream_sequence == RECORDS as u64 && info.num_ack_pending == 0,
        "consumer state after acks: ack floor {}, pending {}",
        info.ack_floor.stream_sequence,
        info.num_ack_pending
    );

    js.delete_stream(&name).await.context("delete_stream")?;
    println!("nats smoke test passed against {addr} (stream {name})");
    Ok(())
}
