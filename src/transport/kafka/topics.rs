//! Topics: the check at start that the configured topics exist ([`warn_missing_topics`]),
//! and the tooling of `settle loadgen`, `settle consume`, the trace readers and the tests:
//! create topics, produce records, read a topic back, a group's committed offsets, a topic's
//! partition count. (The check at assignment that a partition's log reaches the offset its
//! store holds is the input's: `KafkaInput` in `consumer`.)

use super::{KafkaConfig, LogContext, Role, CALL_TIMEOUT};
use crate::config::tiers::TiersConfig;
use anyhow::{anyhow, Context as _};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers as _, Message as _};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// Warns once at start about each topic of `kafka` and `tiers` the cluster does not have
/// (input, dead letters, tier events, changelog, tier topics), naming its config key.
/// Nothing fails here: a missing topic is retried with backoff where it is used (module
/// docs of `crate::transport::kafka`, "Errors"), so creating it later un-blocks settle
/// without a restart. An unreachable cluster is only logged at debug level (the clients
/// report it).
pub async fn warn_missing_topics(kafka: &KafkaConfig, tiers: &TiersConfig) {
    let mut wanted = vec![
        ("kafka.input-topic", kafka.input_topic.clone()),
        ("kafka.dead-letter-topic", kafka.dead_letter_topic.clone()),
        ("tiers.events-topic", tiers.events_topic.clone()),
    ];
    if let Some(c) = kafka.changelog() {
        wanted.push(("kafka.changelog-topic", c));
    }
    wanted.extend(
        tiers
            .tiers
            .iter()
            .map(|t| ("tiers.tier.topic", t.topic.clone())),
    );
    let config = kafka.client_config(Role::Consumer);
    let listed = tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = config.create()?;
        let metadata = client.fetch_metadata(None, CALL_TIMEOUT)?;
        Ok::<_, KafkaError>(
            metadata
                .topics()
                .iter()
                .filter(|t| t.error().is_none())
                .map(|t| t.name().to_owned())
                .collect::<std::collections::BTreeSet<String>>(),
        )
    })
    .await;
    let topics = match listed {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "kafka: cannot list topics at start");
            return;
        }
        Err(e) => {
            tracing::debug!(error = %e, "kafka: topic listing task failed");
            return;
        }
    };
    for (key, topic) in wanted {
        if !topics.contains(&topic) {
            tracing::warn!(
                topic = %topic,
                key,
                "kafka: topic does not exist; what settle reads or writes there waits (retried with backoff) until it is created (scripts/kafka.sh up creates the default topics)"
            );
        }
    }
}

/// Bound on one admin or metadata request.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Creates `topics` (`(name, partitions)`, replication factor 1) on the cluster of `kafka`
/// (its `properties` apply, so SASL/TLS work). A topic that exists already is left as it is.
///
/// Errors: the cluster cannot be reached within 30 s, or refuses a creation for another
/// reason than "already exists".
pub async fn create_topics(kafka: &KafkaConfig, topics: &[(&str, i32)]) -> anyhow::Result<()> {
    let admin: AdminClient<LogContext> = kafka
        .client_config(Role::Producer)
        .create_with_context(LogContext)
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
    let producer: FutureProducer<LogContext> = kafka
        .client_config(Role::Producer)
        .create_with_context(LogContext)
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

fn read_topic_blocking(
    kafka: &KafkaConfig,
    topic: &str,
    min_records: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<TopicRecord>> {
    // The group id of `kafka` is set but never joined: partitions are assigned, not subscribed.
    let consumer: BaseConsumer<LogContext> = kafka
        .client_config(Role::Consumer)
        .create_with_context(LogContext)
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

/// The committed offsets of consumer group `kafka.group-id` for partitions `0..partitions` of
/// `topic` (`None`: nothing committed).
///
/// Errors: the group coordinator cannot be reached within 30 s.
pub async fn committed_offsets(
    kafka: &KafkaConfig,
    topic: &str,
    partitions: i32,
) -> anyhow::Result<Vec<Option<i64>>> {
    let kafka = kafka.clone();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer<LogContext> = kafka
            .client_config(Role::Consumer)
            .create_with_context(LogContext)?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
        let committed = consumer
            .committed_offsets(tpl, ADMIN_TIMEOUT)
            .context("OffsetFetch")?;
        Ok(committed
            .elements()
            .iter()
            .map(|e| match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            })
            .collect())
    })
    .await
    .context("committed_offsets task")?
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
