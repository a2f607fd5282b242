//! The Kafka [`ActionChannel`] (SEMANTICS §7): operator action records are produced to the
//! input topic at an explicit partition (settle cannot know the producers' partitioner, so
//! a session action goes to every partition: `key_partition` is `None`), and audit records
//! to the audit topic `<group-id>.audit` (1 partition, created at start when missing; read
//! back by every instance from about 24 h ago, so any instance can answer for a request
//! another one accepted).

use super::{classify, partition_count, LogContext, TRANSPORT};
use crate::config::kafka::{KafkaConfig, Role};
use crate::transport::{ActionChannel, Error};
use futures::future::BoxFuture;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use std::sync::Arc;
use std::time::Duration;

/// How long a send waits in the producer's queue before it fails.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// The Kafka action channel of one deployment (module docs). Cheap to clone.
#[derive(Clone)]
pub struct KafkaActions {
    config: Arc<KafkaConfig>,
    producer: FutureProducer<LogContext>,
    audit_topic: Arc<str>,
    instance: Arc<str>,
}

impl KafkaActions {
    /// The audit topic of `config`'s deployment: `<group-id>.audit`.
    pub fn audit_topic(config: &KafkaConfig) -> String {
        format!("{}.audit", config.group_id)
    }

    /// A channel over `config`'s cluster, input topic and audit topic.
    ///
    /// Errors: [`Error::Fatal`] when librdkafka rejects the producer configuration.
    pub fn new(config: &KafkaConfig) -> Result<Self, Error> {
        let producer = config
            .client_config(Role::Producer)
            .create_with_context(LogContext)
            .map_err(|e| Error::Fatal {
                transport: TRANSPORT,
                reason: format!("action producer: {e}"),
            })?;
        Ok(KafkaActions {
            config: Arc::new(config.clone()),
            producer,
            audit_topic: Self::audit_topic(config).into(),
            instance: config.instance_id().into(),
        })
    }

    /// Creates the audit topic (1 partition) unless it exists; logs when it cannot.
    pub async fn ensure_audit_topic(&self) {
        if let Err(e) = super::topics::create_topics(&self.config, &[(&self.audit_topic, 1)]).await
        {
            tracing::warn!(topic = %self.audit_topic, error = %e, "kafka: cannot create the audit topic; operator actions are applied but their outcomes may not be readable by other instances");
        }
    }

    async fn produce(&self, record: FutureRecord<'_, [u8], [u8]>) -> Result<(), Error> {
        self.producer
            .send(record, SEND_TIMEOUT)
            .await
            .map(|_| ())
            .map_err(|(e, _)| classify(&e))
    }
}

impl ActionChannel for KafkaActions {
    fn partitions(&self) -> BoxFuture<'_, Result<i32, Error>> {
        Box::pin(async move {
            let config = Arc::clone(&self.config);
            tokio::task::spawn_blocking(move || {
                let consumer: rdkafka::consumer::BaseConsumer<LogContext> = config
                    .client_config(Role::Consumer)
                    .create_with_context(LogContext)
                    .map_err(|e| e.to_string())?;
                partition_count(&consumer, &config.input_topic).map_err(|e| e.to_string())
            })
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .map_err(|reason| Error::Unavailable {
                transport: TRANSPORT,
                reason: format!("partitions of the input topic: {reason}"),
            })
        })
    }

    fn key_partition(&self, _key: &str) -> Option<i32> {
        None
    }

    fn send(
        &self,
        partition: i32,
        key: &str,
        payload: Vec<u8>,
        timestamp_ms: i64,
    ) -> BoxFuture<'_, Result<(), Error>> {
        let key = key.to_owned();
        Box::pin(async move {
            let record = FutureRecord::to(&self.config.input_topic)
                .partition(partition)
                .key(key.as_bytes())
                .payload(payload.as_slice())
                .timestamp(timestamp_ms);
            self.produce(record).await
        })
    }

    fn publish_audit(&self, key: &str, payload: Vec<u8>) -> BoxFuture<'_, Result<(), Error>> {
        let key = key.to_owned();
        Box::pin(async move {
            let record = FutureRecord::to(&self.audit_topic)
                .key(key.as_bytes())
                .payload(payload.as_slice());
            self.produce(record).await
        })
    }

    fn tail_audit(
        &self,
        since_ms: i64,
        each: crate::transport::AuditFeed,
    ) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            let unavailable = |what: &str, e: String| Error::Unavailable {
                transport: TRANSPORT,
                reason: format!("audit topic {}: {what}: {e}", self.audit_topic),
            };
            let mut c = self.config.client_config(Role::Consumer);
            // Assigned, never subscribed: its own group id, nothing committed.
            c.set(
                "group.id",
                format!("{}.audit-tail.{}", self.config.group_id, self.instance),
            )
            .set("enable.partition.eof", "false");
            let consumer: StreamConsumer<LogContext> = c
                .create_with_context(LogContext)
                .map_err(|e| unavailable("consumer", e.to_string()))?;
            let topic = self.audit_topic.to_string();
            let (consumer, assignment) = tokio::task::spawn_blocking(move || {
                let n = partition_count(&consumer, &topic).map_err(|e| e.to_string())?;
                let mut times = TopicPartitionList::new();
                for p in 0..n {
                    times
                        .add_partition_offset(&topic, p, Offset::Offset(since_ms))
                        .map_err(|e| e.to_string())?;
                }
                let found = consumer
                    .offsets_for_times(times, Duration::from_secs(10))
                    .map_err(|e| e.to_string())?;
                let mut start = TopicPartitionList::new();
                for e in found.elements() {
                    // No record at or after the time: from the end.
                    let offset = match e.offset() {
                        Offset::Offset(o) => Offset::Offset(o),
                        _ => Offset::End,
                    };
                    start
                        .add_partition_offset(&topic, e.partition(), offset)
                        .map_err(|e| e.to_string())?;
                }
                Ok::<_, String>((consumer, start))
            })
            .await
            .map_err(|e| unavailable("task", e.to_string()))?
            .map_err(|e| unavailable("offsets", e))?;
            consumer
                .assign(&assignment)
                .map_err(|e| unavailable("assign", e.to_string()))?;
            loop {
                match consumer.recv().await {
                    Ok(m) => each(m.payload().unwrap_or_default()),
                    Err(e) => return Err(unavailable("read", e.to_string())),
                }
            }
        })
    }
}
