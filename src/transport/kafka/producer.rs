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
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::ClientConfig;
use std::sync::{Arc, RwLock};

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
    producer: Renewable,
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
        let producer = Renewable::new(config.client_config(Role::Producer), Arc::clone(&health))
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
        let producer = self.producer.get();
        match producer.send(record, QUEUE_TIMEOUT).await {
            Ok(_) => {
                self.health.healthy();
                Ok(())
            }
            Err((e, _)) => {
                self.health.failed(&e, "delivery");
                if self.producer.renew_if_fatal(&producer, &e) {
                    // The caller retries the same message on the new producer.
                    return Err(Error::Unavailable {
                        transport: TRANSPORT,
                        reason: format!("producer replaced after a fatal error: {e}"),
                    });
                }
                Err(classify(&e))
            }
        }
    }
}

/// The sink's idempotent producer, replaced by a new one when librdkafka reports a fatal
/// error on it. An idempotent producer that hit one (say `PRODUCER_FENCED` or
/// `OUT_OF_ORDER_SEQUENCE_NUMBER` after the broker went away and came back with its
/// producer state changed) fails every later send; the outbox would retry it forever. The
/// messages it still held are retried by their publishers on the new one, with the same
/// `emission_id` (at-least-once, SEMANTICS §6). Cheap to clone (shared).
#[derive(Clone)]
struct Renewable {
    current: Arc<RwLock<Arc<FutureProducer<ProducerContext>>>>,
    config: ClientConfig,
    health: Arc<Health>,
}

impl Renewable {
    /// Creates the first producer of `config`.
    ///
    /// Errors: librdkafka rejects the configuration.
    fn new(config: ClientConfig, health: Arc<Health>) -> Result<Self, KafkaError> {
        let producer = Renewable::create(&config, &health)?;
        Ok(Renewable {
            current: Arc::new(RwLock::new(Arc::new(producer))),
            config,
            health,
        })
    }

    fn create(
        config: &ClientConfig,
        health: &Arc<Health>,
    ) -> Result<FutureProducer<ProducerContext>, KafkaError> {
        config.create_with_context(ProducerContext {
            health: Arc::clone(health),
        })
    }

    /// The producer to send with now.
    fn get(&self) -> Arc<FutureProducer<ProducerContext>> {
        Arc::clone(&self.current.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// After a send on `used` failed with `error`: when `used` has a fatal error, or
    /// `error` says the broker no longer accepts its producer id or epoch (its idempotence
    /// state is gone: every later send would fail the same way), and `used` is still the
    /// current producer, replaces it with a new one (logged). `true` when the current
    /// producer is not `used` any more (replaced now or by another sender).
    fn renew_if_fatal(
        &self,
        used: &Arc<FutureProducer<ProducerContext>>,
        error: &KafkaError,
    ) -> bool {
        use rdkafka::types::RDKafkaErrorCode as C;
        let dead_id = matches!(
            error.rdkafka_error_code(),
            Some(
                C::ProducerFenced
                    | C::InvalidProducerEpoch
                    | C::OutOfOrderSequenceNumber
                    | C::UnknownProducerId
                    | C::InvalidProducerIdMapping
            )
        );
        let Some((code, reason)) = used.client().fatal_error().or_else(|| {
            dead_id.then(|| {
                (
                    error.rdkafka_error_code().unwrap_or(C::Fatal),
                    error.to_string(),
                )
            })
        }) else {
            return false;
        };
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        if !Arc::ptr_eq(&current, used) {
            return true;
        }
        match Renewable::create(&self.config, &self.health) {
            Ok(fresh) => {
                tracing::warn!(?code, reason, "kafka: the producer hit a fatal error; replaced it with a new one (unacknowledged emissions are published again, same emission_id)");
                *current = Arc::new(fresh);
                true
            }
            Err(e) => {
                tracing::error!(?code, reason, error = %e, "kafka: the producer hit a fatal error and a new one cannot be created");
                false
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
            .payload(&record.payload[..])
            .timestamp(record.timestamp_ms)
            .headers(headers);
        if let Some(key) = &record.key {
            out = out.key(&key[..]);
        }
        self.deliver(out).await
    }
}
