//! Exactly-once mode on Kafka (`kafka.processing-guarantee = "exactly-once"`; SEMANTICS §6):
//! one transactional producer per owned input partition, `transactional.id =
//! <group-id>.<input-topic>.<partition>`. Creating it (`init_transactions`) when the partition
//! is assigned bumps the producer epoch of that id, which fences the previous owner (its next
//! produce, offset send or commit fails) and ends its open transaction, before the new owner
//! restores the store from the changelog (`read_committed`, librdkafka's default).
//!
//! Each store batch is then one transaction ([`KafkaTxn::commit`]): its ready records (tier
//! topics), its changelog records (changelog partition = input partition) and the input
//! partition's next offset (`send_offsets_to_transaction` with the consumer group's
//! metadata). A `read_committed` consumer sees all of a batch or nothing of it, so a crash
//! between produce and commit shows no duplicate: the batch is redone by the next owner from
//! the committed changelog and offset.
//!
//! Crash drill: with the environment variable `SETTLE_FAULT_CRASH_BEFORE_TXN_COMMIT=N`, the
//! process aborts (like kill -9) right after the ready records of its N-th transaction that
//! has any (counted per process) are on the broker, before that transaction's changelog
//! records and its commit. (Any point before the commit is the same on a real broker; this
//! one keeps the changelog free of aborted records on rdkafka's `MockCluster`, which shows
//! aborted records to `read_committed` consumers: `tests/kafka_eos.rs`.)

use super::{classify, GroupConsumer, Health, KafkaConfig, ProducerContext, Role, TRANSPORT};
use crate::store::Change;
use crate::transport::{Error, ReadyMessage, TxnWriter};
use futures::future::BoxFuture;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

/// Bound on `init_transactions`, `send_offsets_to_transaction` and `commit_transaction`.
const TXN_TIMEOUT: Duration = Duration::from_secs(30);

/// Environment variable of the crash drill (module docs).
pub const CRASH_BEFORE_COMMIT_ENV: &str = "SETTLE_FAULT_CRASH_BEFORE_TXN_COMMIT";

/// Transactions with ready records attempted by this process (for the crash drill).
static TRANSACTIONS: AtomicU64 = AtomicU64::new(0);

/// What every partition's transaction writer needs. Shared by the sink's clones.
pub(crate) struct Eos {
    config: KafkaConfig,
    health: Arc<Health>,
    instance: Arc<str>,
    /// The consumer-group member, for `send_offsets_to_transaction` (set by `service::run_until`).
    group: OnceLock<Weak<GroupConsumer>>,
}

impl Eos {
    pub(crate) fn new(config: &KafkaConfig, health: Arc<Health>, instance: Arc<str>) -> Self {
        Eos {
            config: config.clone(),
            health,
            instance,
            group: OnceLock::new(),
        }
    }

    /// Links the consumer group whose offsets the transactions commit.
    pub(crate) fn attach_group(&self, consumer: Weak<GroupConsumer>) {
        let _ = self.group.set(consumer);
    }

    /// A fenced-in transactional producer for `partition` (module docs).
    ///
    /// Errors: [`Error::Fatal`] (configuration refused, `init_transactions` failed).
    pub(crate) async fn writer(&self, partition: i32) -> Result<KafkaTxn, Error> {
        let id = format!(
            "{}.{}.{}",
            self.config.group_id, self.config.input_topic, partition
        );
        let mut config = self.config.client_config(Role::Producer);
        config
            .set("transactional.id", &id)
            .set("transaction.timeout.ms", "60000")
            .set("message.timeout.ms", "55000")
            .set("client.id", format!("settle-txn-{partition}"));
        let producer: FutureProducer<ProducerContext> = config
            .create_with_context(ProducerContext {
                health: Arc::clone(&self.health),
            })
            .map_err(|e| fatal(&e))?;
        let producer = Arc::new(producer);
        let p = Arc::clone(&producer);
        tokio::task::spawn_blocking(move || p.init_transactions(TXN_TIMEOUT))
            .await
            .map_err(|e| Error::Unavailable {
                transport: TRANSPORT,
                reason: format!("init_transactions task failed: {e}"),
            })?
            .map_err(|e| match classify(&e) {
                Error::Unavailable { reason, .. } => Error::Unavailable {
                    transport: TRANSPORT,
                    reason: format!("init_transactions({id}): {reason}"),
                },
                _ => fatal(&e),
            })?;
        tracing::info!(partition, transactional_id = %id, "kafka: transactions initialised; earlier owners of the partition are fenced");
        Ok(KafkaTxn {
            producer,
            partition,
            input_topic: self.config.input_topic.clone(),
            changelog_topic: self.config.changelog().unwrap_or_default(),
            instance: Arc::clone(&self.instance),
            group: self.group.get().cloned(),
            crash_at: std::env::var(CRASH_BEFORE_COMMIT_ENV)
                .ok()
                .and_then(|v| v.parse().ok()),
        })
    }
}

/// The transaction writer of one partition (module docs).
pub(crate) struct KafkaTxn {
    producer: Arc<FutureProducer<ProducerContext>>,
    partition: i32,
    input_topic: String,
    changelog_topic: String,
    instance: Arc<str>,
    group: Option<Weak<GroupConsumer>>,
    crash_at: Option<u64>,
}

impl TxnWriter for KafkaTxn {
    fn commit<'a>(
        &'a mut self,
        messages: Vec<ReadyMessage>,
        changes: &'a [Change],
        next_offset: Option<i64>,
    ) -> BoxFuture<'a, Result<Option<i64>, Error>> {
        Box::pin(async move {
            self.producer.begin_transaction().map_err(|e| fatal(&e))?;
            let mut ready_acks = Vec::with_capacity(messages.len());
            for m in &messages {
                ready_acks.push(self.send(super::ready_record(m, &self.instance))?);
            }
            if !messages.is_empty() {
                let n = TRANSACTIONS.fetch_add(1, Ordering::Relaxed) + 1;
                if self.crash_at == Some(n) {
                    // Crash drill: the ready records are produced and on the broker, the
                    // transaction is not committed (module docs).
                    let _ = self.producer.flush(Duration::from_secs(5));
                    tracing::error!(
                        transaction = n,
                        "{CRASH_BEFORE_COMMIT_ENV}: aborting the process before the commit"
                    );
                    std::process::abort();
                }
            }
            let mut changelog_acks = Vec::with_capacity(changes.len());
            for c in changes {
                let mut record = FutureRecord::<[u8], [u8]>::to(&self.changelog_topic)
                    .partition(self.partition)
                    .key(c.key.as_slice());
                if let Some(v) = &c.value {
                    record = record.payload(v.as_slice());
                }
                changelog_acks.push(self.send(record)?);
            }
            let producer = Arc::clone(&self.producer);
            let offsets = match next_offset {
                Some(next) => {
                    let mut tpl = TopicPartitionList::with_capacity(1);
                    tpl.add_partition_offset(
                        &self.input_topic,
                        self.partition,
                        Offset::Offset(next),
                    )
                    .map_err(|e| fatal(&e))?;
                    let metadata = self
                        .group
                        .as_ref()
                        .and_then(Weak::upgrade)
                        .and_then(|c| c.group_metadata())
                        .ok_or_else(|| Error::Fatal {
                            transport: TRANSPORT,
                            reason: "no consumer group metadata for the transaction's offsets"
                                .into(),
                        })?;
                    Some((tpl, metadata))
                }
                None => None,
            };
            tokio::task::spawn_blocking(move || -> Result<(), KafkaError> {
                if let Some((tpl, metadata)) = offsets {
                    producer.send_offsets_to_transaction(&tpl, &metadata, TXN_TIMEOUT)?;
                }
                producer.commit_transaction(TXN_TIMEOUT)
            })
            .await
            .map_err(|e| Error::Fatal {
                transport: TRANSPORT,
                reason: format!("commit task failed: {e}"),
            })?
            .map_err(|e| {
                // Best effort: a transaction that cannot commit is aborted (a fenced
                // producer cannot abort either; the new owner's epoch ended it already).
                let _ = self.producer.abort_transaction(Duration::from_secs(5));
                fatal(&e)
            })?;
            for ack in ready_acks {
                delivered(ack.await)?;
            }
            let mut next = None;
            for ack in changelog_acks {
                next = Some(delivered(ack.await)? + 1);
            }
            Ok(next)
        })
    }
}

impl KafkaTxn {
    /// Enqueues one record of the open transaction, waiting out a full local queue.
    fn send(
        &self,
        mut record: FutureRecord<'_, [u8], [u8]>,
    ) -> Result<rdkafka::producer::DeliveryFuture, Error> {
        loop {
            match self.producer.send_result(record) {
                Ok(ack) => return Ok(ack),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err((e, _)) => return Err(fatal(&e)),
            }
        }
    }
}

/// The offset of a delivered record.
fn delivered(
    result: Result<
        rdkafka::producer::future_producer::OwnedDeliveryResult,
        futures::channel::oneshot::Canceled,
    >,
) -> Result<i64, Error> {
    match result {
        Ok(Ok(d)) => Ok(d.offset),
        Ok(Err((e, _))) => Err(fatal(&e)),
        Err(_) => Err(Error::Fatal {
            transport: TRANSPORT,
            reason: "the transactional producer was dropped".into(),
        }),
    }
}

fn fatal(e: &KafkaError) -> Error {
    let text = e.to_string();
    let hint = if text.contains("not supported by broker") {
        " (this broker has no Kafka transactions; tansu 0.6 has none: set kafka.processing-guarantee = \"at-least-once\")"
    } else {
        ""
    };
    Error::Fatal {
        transport: TRANSPORT,
        reason: format!("transaction: {text}{hint}"),
    }
}
