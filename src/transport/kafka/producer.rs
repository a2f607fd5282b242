//! The idempotent producer as the [`Sink`] ([`KafkaSink`]): ready records to their tier's
//! topic, dead letters with the `settle-dlq-*` headers, the changelog appends and, in
//! exactly-once mode, the partitions' transaction writers.

use super::{
    changelog, classify, log_line, txn, Health, KafkaConfig, KafkaSource, ProcessingGuarantee,
    Role, DLQ_REASON_HEADER, DLQ_SOURCE_OFFSET_HEADER, DLQ_SOURCE_PARTITION_HEADER,
    DLQ_SOURCE_TOPIC_HEADER, INSTANCE_HEADER, PARTITION_HEADER, QUEUE_TIMEOUT, TRANSPORT,
};
use crate::codec::EMISSION_ID_HEADER;
use crate::store::Change;
use crate::transport::{ChangelogReader, Error, InputRecord, ReadyMessage, Sink, TxnWriter};
use futures::future::BoxFuture;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::sync::Arc;

/// Context of the producer: logging and [`Health`] only.
pub(super) struct ProducerContext {
    pub(super) health: Arc<Health>,
}

impl ClientContext for ProducerContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        log_line(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.health.failed(&error, reason);
    }
}

/// [`Sink`] over one idempotent producer (`enable.idempotence=true`, `acks=all`): ready
/// records go to their message's topic (the tier's topic) keyed by session key with header
/// `settle-emission-id`; dead letters go to `dead-letter-topic` with the original key,
/// payload and timestamp and the `settle-dlq-*` headers. Cheap to clone (one producer).
#[derive(Clone)]
pub struct KafkaSink {
    producer: FutureProducer<ProducerContext>,
    health: Arc<Health>,
    input_topic: Arc<str>,
    dead_letter_topic: Arc<str>,
    /// `instance-id` (resolved), header `settle-instance`.
    instance: Arc<str>,
    changelog: Option<changelog::KafkaChangelog>,
    /// Exactly-once mode: the partitions' transaction writers come from here.
    eos: Option<Arc<txn::Eos>>,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("input_topic", &self.input_topic)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// Creates the producer. Connecting happens in the background.
    ///
    /// Errors: [`Error::Fatal`] when librdkafka rejects the configuration.
    pub fn new(config: &KafkaConfig) -> Result<Self, Error> {
        let health = Arc::new(Health::new("producer"));
        let producer = config
            .client_config(Role::Producer)
            .create_with_context(ProducerContext {
                health: Arc::clone(&health),
            })
            .map_err(|e| Error::Fatal {
                transport: TRANSPORT,
                reason: format!("cannot create the Kafka producer: {e}"),
            })?;
        let changelog = changelog::KafkaChangelog::new(config, Arc::clone(&health))?;
        let instance: Arc<str> = config.instance_id().into();
        let eos = (config.processing_guarantee == ProcessingGuarantee::ExactlyOnce).then(|| {
            Arc::new(txn::Eos::new(
                config,
                Arc::clone(&health),
                Arc::clone(&instance),
            ))
        });
        Ok(KafkaSink {
            producer,
            health,
            input_topic: config.input_topic.as_str().into(),
            dead_letter_topic: config.dead_letter_topic.as_str().into(),
            instance,
            changelog,
            eos,
        })
    }

    /// Exactly-once mode: the transactions commit the input offsets of `source`'s consumer
    /// group. Call before the runtime runs (`crate::service::run_until` does).
    pub fn attach_group(&self, source: &KafkaSource) {
        if let Some(eos) = &self.eos {
            eos.attach_group(source.consumer.clone());
        }
    }

    /// Sends one record and waits for its delivery report.
    async fn deliver(&self, record: FutureRecord<'_, [u8], [u8]>) -> Result<(), Error> {
        match self.producer.send(record, QUEUE_TIMEOUT).await {
            Ok(_) => {
                self.health.healthy();
                Ok(())
            }
            Err((e, _)) => {
                self.health.failed(&e, "delivery");
                Err(classify(&e))
            }
        }
    }
}

/// The Kafka record of a ready message: key = session key, value = the JSON record, headers
/// `settle-emission-id`, `settle-instance` (= `instance`) and, when the message has one,
/// `settle-partition` (the input partition).
pub(super) fn ready_record<'m>(
    message: &'m ReadyMessage,
    instance: &'m str,
) -> FutureRecord<'m, [u8], [u8]> {
    let mut headers = OwnedHeaders::new_with_capacity(3)
        .insert(Header {
            key: EMISSION_ID_HEADER,
            value: Some(message.emission_id.as_bytes()),
        })
        .insert(Header {
            key: INSTANCE_HEADER,
            value: Some(instance.as_bytes()),
        });
    if let Some(p) = message.partition {
        headers = headers.insert(Header {
            key: PARTITION_HEADER,
            value: Some(p.to_string().as_bytes()),
        });
    }
    FutureRecord::to(&message.topic)
        .key(message.key.as_bytes())
        .payload(message.payload.as_slice())
        .headers(headers)
}

impl Sink for KafkaSink {
    async fn publish(&self, message: ReadyMessage) -> Result<(), Error> {
        self.deliver(ready_record(&message, &self.instance)).await
    }

    fn changelog(&self) -> Option<&str> {
        self.changelog
            .as_ref()
            .map(changelog::KafkaChangelog::topic)
    }

    fn transactions(
        &self,
        partition: i32,
    ) -> BoxFuture<'_, Result<Option<Box<dyn TxnWriter>>, Error>> {
        Box::pin(async move {
            match &self.eos {
                Some(eos) => Ok(Some(
                    Box::new(eos.writer(partition).await?) as Box<dyn TxnWriter>
                )),
                None => Ok(None),
            }
        })
    }

    fn append_changes(
        &self,
        partition: i32,
        changes: &[Change],
    ) -> Result<BoxFuture<'static, Result<i64, Error>>, Error> {
        match &self.changelog {
            Some(c) => c.append(partition, changes),
            None => Err(Error::Fatal {
                transport: TRANSPORT,
                reason: "kafka.changelog-topic is \"\": no changelog".into(),
            }),
        }
    }

    fn read_changelog(
        &self,
        partition: i32,
        from: i64,
    ) -> BoxFuture<'_, Result<Box<dyn ChangelogReader>, Error>> {
        Box::pin(async move {
            match &self.changelog {
                Some(c) => c.read(partition, from).await,
                None => Err(Error::Fatal {
                    transport: TRANSPORT,
                    reason: "kafka.changelog-topic is \"\": no changelog".into(),
                }),
            }
        })
    }

    async fn dead_letter(&self, record: &InputRecord, reason: &str) -> Result<(), Error> {
        let partition = record.partition.to_string();
        let offset = record.offset.to_string();
        let headers = OwnedHeaders::new_with_capacity(4)
            .insert(Header {
                key: DLQ_REASON_HEADER,
                value: Some(reason),
            })
            .insert(Header {
                key: DLQ_SOURCE_TOPIC_HEADER,
                value: Some(&*self.input_topic),
            })
            .insert(Header {
                key: DLQ_SOURCE_PARTITION_HEADER,
                value: Some(&partition),
            })
            .insert(Header {
                key: DLQ_SOURCE_OFFSET_HEADER,
                value: Some(&offset),
            });
        let mut out = FutureRecord::to(&self.dead_letter_topic)
            .payload(record.payload.as_slice())
            .timestamp(record.timestamp_ms)
            .headers(headers);
        if let Some(key) = &record.key {
            out = out.key(key.as_slice());
        }
        self.deliver(out).await
    }
}
