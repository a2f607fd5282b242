//! `settle loadgen`: realistic upload traffic into the Kafka input topic, and the Kafka
//! tooling around it (create topics, read a topic back).
//!
//! Scenario generators come later in this file; the tooling first.

use crate::transport::kafka::{KafkaConfig, Role};
use anyhow::{anyhow, Context as _};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::ClientContext;
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers as _, Message as _};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// Bound on one admin or metadata request.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Creates `topics` (`(name, partitions)`, replication factor 1) on the cluster of `kafka`
/// (its `properties` apply, so SASL/TLS work). A topic that exists already is left as it is.
///
/// Errors: the cluster cannot be reached within 30 s, or refuses a creation for another
/// reason than "already exists".
pub async fn create_topics(kafka: &KafkaConfig, topics: &[(&str, i32)]) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = kafka
        .client_config(Role::Producer)
        .create()
        .context("cannot create the Kafka admin client")?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|(name, n)| NewTopic::new(name, *n, TopicReplication::Fixed(1)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT));
    let results = tokio::time::timeout(ADMIN_TIMEOUT, admin.create_topics(&new, &options))
        .await
        .context("CreateTopics timed out")?
        .context("CreateTopics")?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => return Err(anyhow!("cannot create topic {name}: {code}")),
        }
    }
    Ok(())
}

/// One record to produce with [`produce_all`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutRecord {
    /// Record key (`tenant/session` for an upload).
    pub key: Option<Vec<u8>>,
    /// Record value.
    pub payload: Vec<u8>,
    /// Record timestamp (CreateTime, ms since the epoch); `None`: the producer's clock.
    pub timestamp_ms: Option<i64>,
}

/// Where [`produce_all`] put a record, from its delivery report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivered {
    /// Partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Record timestamp as reported (ms; `LogAppendTime` where the topic uses it).
    pub timestamp_ms: Option<i64>,
}

/// Produces `records` to `topic` in order with one idempotent producer (the settle producer
/// settings of `kafka`, so a key always lands in the partition the default partitioner
/// picks) and waits for every delivery report. Returns one [`Delivered`] per record, in
/// input order.
///
/// Errors: the producer cannot be created, or a delivery failed (message in the error).
pub async fn produce_all(
    kafka: &KafkaConfig,
    topic: &str,
    records: &[OutRecord],
) -> anyhow::Result<Vec<Delivered>> {
    let producer: FutureProducer = kafka
        .client_config(Role::Producer)
        .create()
        .context("cannot create the Kafka producer")?;
    let mut pending = Vec::with_capacity(records.len());
    for r in records {
        let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(r.payload.as_slice());
        if let Some(key) = &r.key {
            record = record.key(key.as_slice());
        }
        if let Some(ts) = r.timestamp_ms {
            record = record.timestamp(ts);
        }
        pending.push(producer.send(record, ADMIN_TIMEOUT));
    }
    let mut out = Vec::with_capacity(records.len());
    for (i, delivery) in futures::future::join_all(pending)
        .await
        .into_iter()
        .enumerate()
    {
        let d = delivery.map_err(|(e, _)| anyhow!("delivery of record {i} to {topic}: {e}"))?;
        out.push(Delivered {
            partition: d.partition,
            offset: d.offset,
            timestamp_ms: d.timestamp.to_millis(),
        });
    }
    Ok(out)
}

/// One record read back by [`read_topic`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicRecord {
    /// Partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Record key.
    pub key: Option<Vec<u8>>,
    /// Record value (empty when null).
    pub payload: Vec<u8>,
    /// Record timestamp (ms since the epoch; -1 when the record has none).
    pub timestamp_ms: i64,
    /// Headers in record order (a null value reads as empty).
    pub headers: Vec<(String, Vec<u8>)>,
}

impl TopicRecord {
    /// The value of the first header named `name`, as UTF-8 (lossy).
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }
}

/// Reads `topic` from the beginning (no consumer group, nothing committed) until every
/// partition reached its end and at least `min_records` were read, or until `timeout`.
/// Records come partition by partition in offset order.
///
/// Errors: the topic's metadata cannot be read (missing topic, cluster unreachable), or a
/// consumer error other than partition EOF.
pub async fn read_topic(
    kafka: &KafkaConfig,
    topic: &str,
    min_records: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<TopicRecord>> {
    let config = kafka.clone();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || read_topic_blocking(&config, &topic, min_records, timeout))
        .await
        .context("read_topic task")?
}

/// Context of [`read_topic`]'s consumer: partition EOF is how it knows it is done, not an
/// error worth logging.
struct ReaderContext;

impl ClientContext for ReaderContext {
    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() != Some(RDKafkaErrorCode::PartitionEOF) {
            tracing::warn!(%error, reason, "kafka reader");
        }
    }
}

impl ConsumerContext for ReaderContext {}

fn read_topic_blocking(
    kafka: &KafkaConfig,
    topic: &str,
    min_records: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<TopicRecord>> {
    // The group id of `kafka` is set but never joined: partitions are assigned, not subscribed.
    let consumer: BaseConsumer<ReaderContext> = kafka
        .client_config(Role::Consumer)
        .create_with_context(ReaderContext)
        .context("cannot create a reader")?;
    let partitions = partition_count(&consumer, topic)?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let deadline = Instant::now() + timeout;
    let mut at_end = BTreeSet::new();
    let mut records = Vec::new();
    while Instant::now() < deadline {
        if at_end.len() == partitions as usize && records.len() >= min_records {
            break;
        }
        match consumer.poll(Duration::from_millis(100)) {
            None => {}
            Some(Ok(m)) => {
                at_end.remove(&m.partition());
                records.push(TopicRecord {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(<[u8]>::to_vec),
                    payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                    timestamp_ms: m.timestamp().to_millis().unwrap_or(-1),
                    headers: m
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                                .collect()
                        })
                        .unwrap_or_default(),
                });
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
            }
            Some(Err(e)) => return Err(anyhow!("reading {topic}: {e}")),
        }
    }
    records.sort_by_key(|r| (r.partition, r.offset));
    Ok(records)
}

/// Number of partitions of `topic`.
///
/// Errors: metadata cannot be fetched, or the broker reports an error for the topic.
pub fn partition_count<X: ConsumerContext, C: Consumer<X>>(
    consumer: &C,
    topic: &str,
) -> anyhow::Result<i32> {
    let metadata = consumer
        .fetch_metadata(Some(topic), ADMIN_TIMEOUT)
        .with_context(|| format!("metadata of {topic}"))?;
    let t = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .ok_or_else(|| anyhow!("topic {topic} not in the metadata"))?;
    if let Some(e) = t.error() {
        return Err(anyhow!("topic {topic}: {:?}", RDKafkaErrorCode::from(e)));
    }
    Ok(t.partitions().len() as i32)
}
