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
//!
//! Start-up check ([`check_transactions`]): before anything is consumed or produced, `settle
//! run` in exactly-once mode asks the cluster which protocol APIs it supports (the ApiVersions
//! answer every Kafka client gets when it connects) and refuses to start when one that
//! transactions need is missing. Without it, a broker that accepts transactional producers but
//! cannot end a transaction (tansu 0.6 has no EndTxn) lets the first batch's ready records
//! reach the output topics and then fails at the commit, leaving records no transaction ever
//! ends on a topic other deployments read. The check registers no transactional id, produces
//! nothing and joins no group: it connects one throw-away client, reads the answer from
//! librdkafka's `feature` debug log (librdkafka has no API that returns it), and closes.

use super::{
    classify, lock, log_line, GroupConsumer, Health, KafkaConfig, ProducerContext, Role, TRANSPORT,
};
use crate::store::Change;
use crate::transport::{Error, ReadyMessage, TxnWriter};
use futures::future::BoxFuture;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Bound on `init_transactions`, `send_offsets_to_transaction` and `commit_transaction`.
const TXN_TIMEOUT: Duration = Duration::from_secs(30);

/// The Kafka protocol APIs a transactional producer needs (KIP-98): (API key, name).
pub const TRANSACTION_APIS: [(i16, &str); 5] = [
    (22, "InitProducerId"),
    (24, "AddPartitionsToTxn"),
    (25, "AddOffsetsToTxn"),
    (26, "EndTxn"),
    (28, "TxnOffsetCommit"),
];

/// What [`check_transactions`] found out: how long it took and which brokers answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransactionsChecked {
    /// From the client's creation to the verdict (connect, ApiVersions, Metadata, close).
    pub took: Duration,
    /// The brokers whose ApiVersions answer was read (librdkafka's names, `host:port/id`).
    pub brokers: Vec<String>,
}

/// The start-up check of exactly-once mode (module docs): connects one short-lived client
/// (the `[kafka]` section's servers and security properties; no transactional id, no
/// idempotence, no group), waits at most `wait` for a broker's Metadata answer, and checks
/// that every broker it connected to lists each API of [`TRANSACTION_APIS`] in its
/// ApiVersions answer. Blocking: run it with `spawn_blocking`. Leaves nothing on the cluster.
///
/// Errors: [`Error::Fatal`] naming the broker and the missing APIs, what that means and what
/// to do (turn exactly-once off, or use a broker with transactions), when one is missing or
/// the answer could not be read (`api.version.request = false`); [`Error::Unavailable`] when
/// no broker answered within `wait` or the client cannot be created (retry: the broker may
/// not be up yet).
pub fn check_transactions(
    config: &KafkaConfig,
    wait: Duration,
) -> Result<TransactionsChecked, Error> {
    let t0 = Instant::now();
    let mut c = config.client_config(Role::Producer);
    c.set("enable.idempotence", "false")
        .set("client.id", "settle-txn-check")
        .set("debug", "feature")
        .set_log_level(RDKafkaLogLevel::Debug);
    let context = ApiVersionsLog::default();
    let producer: BaseProducer<ApiVersionsLog> =
        c.create_with_context(context)
            .map_err(|e| Error::Unavailable {
                transport: TRANSPORT,
                reason: format!("transactions check: cannot create a client: {e}"),
            })?;
    let metadata = producer.client().fetch_metadata(None, wait);
    // The log lines are events of the client's main queue, queued before the Metadata
    // answer arrived (ApiVersions comes first on every connection): serve them.
    producer.poll(Duration::from_millis(10));
    let seen = std::mem::take(&mut *lock(&producer.context().apis));
    drop(producer);
    if let Err(e) = metadata {
        return Err(Error::Unavailable {
            transport: TRANSPORT,
            reason: format!(
                "transactions check: no broker of {} answered within {} ms: {e}",
                config.bootstrap_servers,
                wait.as_millis()
            ),
        });
    }
    if seen.is_empty() {
        return Err(Error::Fatal {
            transport: TRANSPORT,
            reason: format!(
                "cannot tell whether the brokers of {} support transactions, which kafka.processing-guarantee = \"exactly-once\" needs: no ApiVersions answer was read (is \"api.version.request\" = false in kafka.properties?); remove that setting, or set kafka.processing-guarantee = \"at-least-once\"",
                config.bootstrap_servers
            ),
        });
    }
    for (broker, apis) in &seen {
        let missing: Vec<&str> = TRANSACTION_APIS
            .iter()
            .filter(|(key, _)| !apis.contains(key))
            .map(|(_, name)| *name)
            .collect();
        if !missing.is_empty() {
            return Err(Error::Fatal {
                transport: TRANSPORT,
                reason: format!(
                    "kafka.processing-guarantee = \"exactly-once\" needs Kafka transactions, and broker {broker} does not support them (no {} in its ApiVersions answer): refusing to start, nothing was consumed or produced. Set kafka.processing-guarantee = \"at-least-once\" (consumers de-duplicate on emission_id), or use a broker with transactions (Apache Kafka 0.11 or later, Redpanda, ...)",
                    missing.join(", ")
                ),
            });
        }
    }
    Ok(TransactionsChecked {
        took: t0.elapsed(),
        brokers: seen.into_keys().collect(),
    })
}

/// Context of the [`check_transactions`] client: collects the API keys of each broker's
/// ApiVersions answer from librdkafka's `feature` debug lines (`<broker>: Broker API
/// support:` then one `<broker>:   ApiKey EndTxn (26) Versions 0..3` per API); every other
/// line of level info or above goes to the log as usual, debug lines are dropped.
#[derive(Default)]
struct ApiVersionsLog {
    /// Broker name -> API keys it supports.
    apis: Mutex<BTreeMap<String, BTreeSet<i16>>>,
}

impl ClientContext for ApiVersionsLog {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        if fac == "APIVERSION" {
            if let Some((broker, key)) = parse_api_version_line(message) {
                let mut apis = lock(&self.apis);
                let set = apis.entry(broker.to_owned()).or_default();
                if let Some(key) = key {
                    set.insert(key);
                } else {
                    set.clear();
                }
            }
        } else if !matches!(level, RDKafkaLogLevel::Debug) {
            log_line(level, fac, message);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!(error = %error, reason, "kafka transactions check: client error");
    }
}

impl rdkafka::producer::ProducerContext for ApiVersionsLog {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &rdkafka::producer::DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

/// One line of librdkafka's ApiVersions debug log: `(broker, Some(api key))` for an
/// `ApiKey NAME (KEY) Versions MIN..MAX` line, `(broker, None)` for the `Broker API
/// support:` line that starts a broker's list; `None` for anything else. The broker is what
/// precedes the text (librdkafka's `[thrd:...]: host:port/id:` prefix, trimmed).
fn parse_api_version_line(message: &str) -> Option<(&str, Option<i16>)> {
    if let Some(at) = message.find("Broker API support:") {
        return Some((broker_of(&message[..at]), None));
    }
    let at = message.find("ApiKey ")?;
    let broker = broker_of(&message[..at]);
    let rest = &message[at..];
    let open = rest.find(" (")? + 2;
    let close = open + rest[open..].find(')')?;
    let key = rest[open..close].parse().ok()?;
    Some((broker, Some(key)))
}

/// The broker of a log line's head `[thrd:THREAD]: BROKER:` (what lies between the two).
fn broker_of(head: &str) -> &str {
    let head = head.trim_end().trim_end_matches(':');
    match head
        .strip_prefix("[thrd:")
        .and_then(|h| h.split_once("]: "))
    {
        Some((_, broker)) => broker,
        None => head,
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::RDKafkaApiKey;

    fn config(bootstrap: String) -> KafkaConfig {
        KafkaConfig {
            bootstrap_servers: bootstrap,
            ..KafkaConfig::default()
        }
    }

    #[test]
    fn a_cluster_with_transactions_passes() {
        let mock = MockCluster::new(1).unwrap();
        let checked =
            check_transactions(&config(mock.bootstrap_servers()), Duration::from_secs(10)).unwrap();
        // The bootstrap connection, and maybe the same broker again by its id (`host:port/1`).
        let address = mock.bootstrap_servers();
        assert!(!checked.brokers.is_empty(), "{checked:?}");
        assert!(
            checked
                .brokers
                .iter()
                .all(|b| b.starts_with(&format!("{address}/"))),
            "{checked:?}"
        );
        println!("transactions check on MockCluster: {checked:?}");
    }

    #[test]
    fn a_cluster_without_end_txn_is_refused_with_what_to_do() {
        let mock = MockCluster::new(1).unwrap();
        // What tansu 0.6 answers: no EndTxn in ApiVersions.
        mock.apiversion(RDKafkaApiKey::EndTxn, None, None).unwrap();
        let e = check_transactions(&config(mock.bootstrap_servers()), Duration::from_secs(10))
            .unwrap_err();
        assert!(!e.is_retryable(), "{e}");
        let text = e.to_string();
        for want in [
            "does not support them (no EndTxn in its ApiVersions answer",
            "kafka.processing-guarantee = \"at-least-once\"",
            "use a broker with transactions",
        ] {
            assert!(text.contains(want), "{want:?} not in: {text}");
        }
        assert!(!text.contains("AddPartitionsToTxn"), "{text}");
    }

    #[test]
    fn no_broker_is_retryable() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = check_transactions(
            &config(format!("127.0.0.1:{port}")),
            Duration::from_millis(500),
        )
        .unwrap_err();
        assert!(e.is_retryable(), "{e}");
    }

    #[test]
    fn api_version_lines() {
        let b = "[thrd:127.0.0.1:9092/bootstrap]: 127.0.0.1:9092/bootstrap";
        let broker = "127.0.0.1:9092/bootstrap";
        assert_eq!(
            parse_api_version_line(&format!("{b}: Broker API support:")),
            Some((broker, None))
        );
        assert_eq!(
            parse_api_version_line(&format!("{b}:   ApiKey EndTxn (26) Versions 0..3")),
            Some((broker, Some(26)))
        );
        assert_eq!(
            parse_api_version_line(&format!(
                "{b}: Feature MsgVer2: Produce (3..3) supported by broker"
            )),
            None
        );
    }
}
