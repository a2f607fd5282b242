//! The overrides topic ([`OverridesTopic`], an [`OverrideStore`]): the compacted topic
//! `<group-id>.overrides` (1 partition, key = tenant) that holds the deployment's tenant
//! overrides (SEMANTICS §7, `runtime::overrides`). Created at start in the background
//! ([`OverridesTopic::ensure_topic`]: compacted, or plain where the broker refuses the
//! config).
//!
//! * **Write**: one producer (the settle producer settings: idempotent, `acks=all`), record
//!   key = tenant; the revision is the record's offset + 1. Kafka has no compare-and-set:
//!   [`OverrideStore::compares_revisions`] is `false`, and the log's order decides between
//!   two writes of one version (`runtime::overrides`).
//! * **Feed**: a consumer assigned every partition from the beginning, polled on its own
//!   thread (`settle-overrides`; a blocking `poll` never runs on a tokio worker): every
//!   record, then `CaughtUp` once every partition reached its end (partition EOF), then every
//!   new record. The channel to the runtime is bounded and the thread waits for room (an
//!   override is never dropped). A topic that does not exist yet holds no override: the feed
//!   says `CaughtUp` and looks for the topic again every second.

use super::tier_counts::{ensure_compacted_topic, topic_partitions};
use super::{classify, LogContext, TRANSPORT};
use crate::config::kafka::{KafkaConfig, Role};
use crate::transport::{
    Error, OverrideEntry, OverrideEvent, OverrideFeed, OverrideStore, OverrideWriteError,
};
use futures::future::BoxFuture;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Events buffered between the feed thread and the runtime.
const FEED_BUFFER: usize = 1_024;

/// Bound on one produce.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The Kafka [`OverrideStore`] (see the module doc).
pub struct OverridesTopic {
    config: KafkaConfig,
    topic: String,
    producer: FutureProducer<LogContext>,
}

impl OverridesTopic {
    /// The overrides topic of `config`'s deployment: `<group-id>.overrides`.
    pub fn topic_name(config: &KafkaConfig) -> String {
        format!("{}.overrides", config.group_id)
    }

    /// The overrides topic of `config`.
    ///
    /// Errors: [`Error::Fatal`] when librdkafka rejects the producer configuration.
    pub fn new(config: &KafkaConfig) -> Result<Arc<Self>, Error> {
        let producer = config
            .client_config(Role::Producer)
            .create_with_context(LogContext)
            .map_err(|e| Error::Fatal {
                transport: TRANSPORT,
                reason: format!("overrides producer: {e}"),
            })?;
        Ok(Arc::new(OverridesTopic {
            config: config.clone(),
            topic: Self::topic_name(config),
            producer,
        }))
    }

    /// Creates the topic (1 partition, compacted) unless it exists; logs when it cannot.
    pub async fn ensure_topic(&self) {
        ensure_compacted_topic(
            &self.config,
            &self.topic,
            "overrides",
            "to set tenant overrides",
        )
        .await;
    }
}

fn unavailable(e: impl std::fmt::Display) -> Error {
    Error::Unavailable {
        transport: TRANSPORT,
        reason: e.to_string(),
    }
}

impl OverrideStore for OverridesTopic {
    fn name(&self) -> &str {
        &self.topic
    }

    fn compares_revisions(&self) -> bool {
        false
    }

    fn put(
        &self,
        tenant: &str,
        value: Vec<u8>,
        _expected: u64,
    ) -> BoxFuture<'_, Result<u64, OverrideWriteError>> {
        let tenant = tenant.to_owned();
        Box::pin(async move {
            let record = FutureRecord::to(&self.topic)
                .key(tenant.as_bytes())
                .payload(&value);
            match self.producer.send(record, CALL_TIMEOUT).await {
                Ok(delivered) => Ok(u64::try_from(delivered.offset).unwrap_or(0) + 1),
                Err((e, _)) => Err(classify(&e).into()),
            }
        })
    }

    fn subscribe(&self) -> BoxFuture<'_, Result<Box<dyn OverrideFeed>, Error>> {
        Box::pin(async move {
            let mut c = self.config.client_config(Role::Consumer);
            // Assigned, never subscribed: the group id is set but no group is joined.
            c.set("enable.partition.eof", "true")
                .set("fetch.wait.max.ms", "100");
            let consumer: BaseConsumer<LogContext> =
                c.create_with_context(LogContext)
                    .map_err(|e| Error::Fatal {
                        transport: TRANSPORT,
                        reason: format!("overrides reader: {e}"),
                    })?;
            let (tx, rx) = mpsc::channel(FEED_BUFFER);
            let topic = self.topic.clone();
            std::thread::Builder::new()
                .name("settle-overrides".into())
                .spawn(move || feed_thread(&consumer, &topic, &tx))
                .map_err(|e| unavailable(format!("overrides feed thread: {e}")))?;
            Ok(Box::new(Feed { rx }) as Box<dyn OverrideFeed>)
        })
    }
}

/// Reads `topic` from its beginning and forwards every record, `CaughtUp` once at its end,
/// until the receiving side is gone.
fn feed_thread(
    consumer: &BaseConsumer<LogContext>,
    topic: &str,
    tx: &mpsc::Sender<Result<OverrideEvent, Error>>,
) {
    let mut caught_up = false;
    // Find the topic (it may be being created); a missing one holds nothing.
    let partitions = loop {
        if tx.is_closed() {
            return;
        }
        match topic_partitions(consumer, topic) {
            Ok(Some(n)) if n > 0 => break n,
            Ok(_) => {
                if !caught_up {
                    caught_up = true;
                    if tx.blocking_send(Ok(OverrideEvent::CaughtUp)).is_err() {
                        return;
                    }
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "kafka: overrides topic metadata");
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        if let Err(e) = tpl.add_partition_offset(topic, p, Offset::Beginning) {
            let _ = tx.blocking_send(Err(classify(&e)));
            return;
        }
    }
    if let Err(e) = consumer.assign(&tpl) {
        let _ = tx.blocking_send(Err(classify(&e)));
        return;
    }
    let mut at_end = BTreeSet::new();
    while !tx.is_closed() {
        let event = match consumer.poll(Duration::from_millis(200)) {
            None => continue,
            Some(Ok(m)) => {
                at_end.remove(&m.partition());
                let Some(key) = m.key() else { continue };
                OverrideEvent::Entry(OverrideEntry {
                    key: String::from_utf8_lossy(key).into_owned(),
                    value: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                    revision: u64::try_from(m.offset()).unwrap_or(0) + 1,
                })
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
                if caught_up || at_end.len() < partitions as usize {
                    continue;
                }
                caught_up = true;
                OverrideEvent::CaughtUp
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "kafka: overrides feed");
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
        };
        if tx.blocking_send(Ok(event)).is_err() {
            return;
        }
    }
}

/// The receiving side of [`feed_thread`].
struct Feed {
    rx: mpsc::Receiver<Result<OverrideEvent, Error>>,
}

impl OverrideFeed for Feed {
    fn next(&mut self) -> BoxFuture<'_, Result<OverrideEvent, Error>> {
        Box::pin(async move {
            self.rx
                .recv()
                .await
                .unwrap_or_else(|| Err(unavailable("the overrides feed thread stopped")))
        })
    }
}
