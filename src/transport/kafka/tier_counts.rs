//! The tier-counts topic ([`TierCountsTopic`], a [`TierCounts`]): where the instances of one
//! deployment exchange their per-tenant emission counts (SEMANTICS §5, `tiers::share`).
//! `kafka.tier-counts-topic` (default `<group-id>.tier-counts`), compacted, keyed by
//! instance, so the log keeps the latest snapshot of every instance.
//!
//! * **Publish**: one plain producer (`acks=1`, no idempotence needed: a lost or doubled
//!   snapshot is replaced by the next one a second later), record key = instance name.
//! * **Read at start**: an assigned (not subscribed: no group) consumer reads every partition
//!   from where the log's records are younger than [`READ_BACK`] (ListOffsets by time; from
//!   the beginning when the broker cannot answer that) up to its end (partition EOF), and
//!   keeps the latest record per key. So a log nobody compacts (tansu) costs a start the
//!   snapshots of the last hour, not of its whole life.
//! * **Feed**: a consumer assigned every partition at its end, polled on its own thread
//!   (`settle-tier-counts`; a blocking `poll` never runs on a tokio worker), forwarding into
//!   a bounded channel. When the channel is full the newest snapshot is dropped: the same
//!   instance sends a fresh one a share interval later. The thread ends when the feed is
//!   dropped.
//! * **Missing topic**: created on first use (partitions 1, `cleanup.policy=compact`) when the
//!   cluster lets settle; otherwise each publish fails as unavailable and the runtime logs it
//!   once (`runtime::tier_share`).

use super::{classify, partition_count, LogContext, TRANSPORT};
use crate::config::kafka::{KafkaConfig, Role};
use crate::transport::{Error, TierCounts, TierCountsFeed};
use futures::future::BoxFuture;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// How far back the start-up read goes (records older than this are skipped where the
/// broker can look offsets up by time). Longer than any `period + cooldown` worth keeping
/// would need the whole log; an older snapshot only restores demotions whose cooldown
/// outlasts it, which the demoted tenant's live instances re-publish anyway.
pub const READ_BACK: Duration = Duration::from_secs(3600);

/// Snapshots buffered between the feed thread and the tier-share task.
const FEED_BUFFER: usize = 256;

/// Bound on one metadata, admin or produce call.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Bound on the topic creation tried at first use (a broker that does not answer it must not
/// hold the start-up read for long).
const CREATE_TIMEOUT: Duration = Duration::from_secs(3);

/// The Kafka [`TierCounts`] (see the module doc). Cheap to share (`Arc` inside).
pub struct TierCountsTopic {
    config: KafkaConfig,
    topic: String,
    producer: FutureProducer<LogContext>,
    /// The topic was found or created (creation is tried once per process).
    checked: AtomicBool,
}

impl TierCountsTopic {
    /// The tier-counts topic of `config` (`kafka.tier-counts-topic`), `None` when sharing is
    /// off (`""`).
    ///
    /// Errors: [`Error::Fatal`] when librdkafka rejects the producer configuration.
    pub fn new(config: &KafkaConfig) -> Result<Option<Arc<Self>>, Error> {
        let Some(topic) = config.tier_counts() else {
            return Ok(None);
        };
        let mut c = config.client_config(Role::Producer);
        // A snapshot is replaced a share interval later: no idempotence, one ack.
        c.set("enable.idempotence", "false")
            .set("acks", "1")
            .set("linger.ms", "0")
            .set("message.timeout.ms", "10000");
        let producer = c
            .create_with_context(LogContext)
            .map_err(|e| Error::Fatal {
                transport: TRANSPORT,
                reason: format!("tier-counts producer: {e}"),
            })?;
        Ok(Some(Arc::new(TierCountsTopic {
            config: config.clone(),
            topic,
            producer,
            checked: AtomicBool::new(false),
        })))
    }

    /// Creates the topic (1 partition, compacted) unless it exists; once per process.
    async fn ensure_topic(&self) {
        if self.checked.swap(true, Ordering::Relaxed) {
            return;
        }
        ensure_compacted_topic(
            &self.config,
            &self.topic,
            "tier-counts",
            "or set kafka.tier-counts-topic = \"\" to share no counts",
        )
        .await;
    }

    fn reader(&self) -> Result<BaseConsumer<LogContext>, Error> {
        // Assigned, never subscribed: the group id is set but no group is joined.
        let mut c = self.config.client_config(Role::Consumer);
        c.set("enable.partition.eof", "true")
            .set("fetch.wait.max.ms", "100");
        c.create_with_context(LogContext).map_err(|e| Error::Fatal {
            transport: TRANSPORT,
            reason: format!("tier-counts reader: {e}"),
        })
    }
}

/// Creates `topic` (1 partition, `cleanup.policy=compact`; plain when the broker refuses the
/// config) unless it exists; logs a warning naming `what` and `hint` when it cannot.
pub(super) async fn ensure_compacted_topic(
    config: &KafkaConfig,
    topic: &str,
    what: &str,
    hint: &str,
) {
    let admin: AdminClient<LogContext> = match config
        .client_config(Role::Producer)
        .create_with_context(LogContext)
    {
        Ok(a) => a,
        Err(e) => {
            tracing::debug!(error = %e, "kafka: no admin client for the {what} topic");
            return;
        }
    };
    let options = AdminOptions::new().operation_timeout(Some(CREATE_TIMEOUT));
    let compacted =
        NewTopic::new(topic, 1, TopicReplication::Fixed(1)).set("cleanup.policy", "compact");
    let plain = NewTopic::new(topic, 1, TopicReplication::Fixed(1));
    // A broker that refuses the config (some test brokers) gets the topic plain.
    for (new, how) in [
        (compacted, "compacted"),
        (
            plain,
            "not compacted: the broker refused cleanup.policy=compact",
        ),
    ] {
        let result =
            tokio::time::timeout(CREATE_TIMEOUT, admin.create_topics([&new], &options)).await;
        let code = match result {
            Ok(Ok(results)) => match results.into_iter().next() {
                Some(Ok(name)) => {
                    tracing::info!(topic = %name, "kafka: created the {what} topic (1 partition, {how})");
                    return;
                }
                Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) | None => return,
                Some(Err((_, code))) => code,
            },
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "kafka: CreateTopics for the {what} topic");
                return;
            }
            Err(_) => {
                tracing::debug!("kafka: CreateTopics for the {what} topic timed out");
                return;
            }
        };
        tracing::debug!(error = %code, "kafka: CreateTopics for the {what} topic refused");
    }
    tracing::warn!(
        topic = %topic,
        "kafka: cannot create the {what} topic; create it (1 partition, cleanup.policy=compact) {hint}"
    );
}

fn unavailable(e: impl std::fmt::Display) -> Error {
    Error::Unavailable {
        transport: TRANSPORT,
        reason: e.to_string(),
    }
}

impl TierCounts for TierCountsTopic {
    fn name(&self) -> &str {
        &self.topic
    }

    fn publish(&self, instance: &str, snapshot: Vec<u8>) -> BoxFuture<'_, Result<(), Error>> {
        let instance = instance.to_owned();
        Box::pin(async move {
            self.ensure_topic().await;
            let record = FutureRecord::to(&self.topic)
                .key(instance.as_bytes())
                .payload(&snapshot);
            match self.producer.send(record, CALL_TIMEOUT).await {
                Ok(_) => Ok(()),
                Err((e, _)) => Err(classify(&e)),
            }
        })
    }

    fn read_latest(&self, timeout: Duration) -> BoxFuture<'_, Result<Vec<Vec<u8>>, Error>> {
        Box::pin(async move {
            self.ensure_topic().await;
            let consumer = self.reader()?;
            let topic = self.topic.clone();
            tokio::task::spawn_blocking(move || read_latest_blocking(&consumer, &topic, timeout))
                .await
                .map_err(|e| unavailable(format!("tier-counts read task: {e}")))?
        })
    }

    fn subscribe(&self) -> BoxFuture<'_, Result<Box<dyn TierCountsFeed>, Error>> {
        Box::pin(async move {
            self.ensure_topic().await;
            let consumer = self.reader()?;
            let topic = self.topic.clone();
            let consumer = tokio::task::spawn_blocking(move || {
                let partitions = partition_count(&consumer, &topic).map_err(unavailable)?;
                let mut tpl = TopicPartitionList::new();
                for p in 0..partitions {
                    tpl.add_partition_offset(&topic, p, Offset::End)
                        .map_err(|e| classify(&e))?;
                }
                consumer.assign(&tpl).map_err(|e| classify(&e))?;
                Ok::<_, Error>(consumer)
            })
            .await
            .map_err(|e| unavailable(format!("tier-counts subscribe task: {e}")))??;
            let (tx, rx) = mpsc::channel(FEED_BUFFER);
            std::thread::Builder::new()
                .name("settle-tier-counts".into())
                .spawn(move || feed_thread(&consumer, &tx))
                .map_err(|e| unavailable(format!("tier-counts feed thread: {e}")))?;
            Ok(Box::new(Feed { rx }) as Box<dyn TierCountsFeed>)
        })
    }
}

/// Reads every partition of `topic` from [`READ_BACK`] ago (or its beginning) to its end and
/// returns the latest value of each key.
fn read_latest_blocking(
    consumer: &BaseConsumer<LogContext>,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<Vec<u8>>, Error> {
    let deadline = Instant::now() + timeout;
    // A topic created a moment ago may take a moment to show in the metadata; a topic that
    // does not exist (and could not be created) holds no snapshot: nothing to restore.
    let partitions = loop {
        match topic_partitions(consumer, topic) {
            Ok(Some(n)) if n > 0 => break n,
            Ok(None) => return Ok(Vec::new()),
            Ok(Some(_)) => {}
            Err(e) if Instant::now() + Duration::from_millis(200) >= deadline => return Err(e),
            Err(_) => {}
        }
        if Instant::now() >= deadline {
            return Err(unavailable(format!("{topic} has no partitions")));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let since = SystemTime::now()
        .checked_sub(READ_BACK)
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as i64);
    let mut by_time = TopicPartitionList::new();
    for p in 0..partitions {
        by_time
            .add_partition_offset(topic, p, Offset::Offset(since))
            .map_err(|e| classify(&e))?;
    }
    let mut tpl = TopicPartitionList::new();
    let found = consumer
        .offsets_for_times(
            by_time,
            deadline
                .saturating_duration_since(Instant::now())
                .min(CALL_TIMEOUT),
        )
        .ok();
    for p in 0..partitions {
        // Nothing newer than READ_BACK: start at the end. No answer: from the beginning.
        let offset = match found
            .as_ref()
            .and_then(|f| f.find_partition(topic, p))
            .map(|e| e.offset())
        {
            Some(Offset::Offset(n)) if n >= 0 => Offset::Offset(n),
            Some(Offset::End) => Offset::End,
            _ => Offset::Beginning,
        };
        tpl.add_partition_offset(topic, p, offset)
            .map_err(|e| classify(&e))?;
    }
    consumer.assign(&tpl).map_err(|e| classify(&e))?;
    let mut at_end = BTreeSet::new();
    let mut latest: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    while at_end.len() < partitions as usize {
        if Instant::now() >= deadline {
            return Err(unavailable(format!(
                "{topic}: not read to its end within {} s",
                timeout.as_secs()
            )));
        }
        match consumer.poll(Duration::from_millis(100)) {
            None => {}
            Some(Ok(m)) => {
                at_end.remove(&m.partition());
                if let Some(key) = m.key() {
                    match m.payload() {
                        Some(v) if !v.is_empty() => {
                            latest.insert(key.to_vec(), v.to_vec());
                        }
                        // A tombstone: that instance's snapshot is gone.
                        _ => {
                            latest.remove(key);
                        }
                    }
                }
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
            }
            Some(Err(e)) => return Err(classify(&e)),
        }
    }
    Ok(latest.into_values().collect())
}

/// The partition count of `topic`, `None` when the cluster says it does not exist.
///
/// Errors: the metadata cannot be read, or names another error for the topic.
pub(super) fn topic_partitions(
    consumer: &BaseConsumer<LogContext>,
    topic: &str,
) -> Result<Option<i32>, Error> {
    let metadata = consumer
        .fetch_metadata(Some(topic), CALL_TIMEOUT)
        .map_err(|e| classify(&e))?;
    let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(None);
    };
    match t.error().map(RDKafkaErrorCode::from) {
        None => Ok(Some(t.partitions().len() as i32)),
        Some(RDKafkaErrorCode::UnknownTopicOrPartition) => Ok(None),
        Some(code) => Err(unavailable(format!("topic {topic}: {code}"))),
    }
}

/// Polls the feed consumer until the receiving side is gone.
fn feed_thread(consumer: &BaseConsumer<LogContext>, tx: &mpsc::Sender<Vec<u8>>) {
    while !tx.is_closed() {
        match consumer.poll(Duration::from_millis(200)) {
            None | Some(Err(KafkaError::PartitionEOF(_))) => {}
            Some(Ok(m)) => {
                if let Some(v) = m.payload().filter(|v| !v.is_empty()) {
                    // Full: drop this one; its instance sends a newer one soon.
                    let _ = tx.try_send(v.to_vec());
                }
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "kafka: tier-counts feed");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// The receiving side of [`feed_thread`].
struct Feed {
    rx: mpsc::Receiver<Vec<u8>>,
}

impl TierCountsFeed for Feed {
    fn next(&mut self) -> BoxFuture<'_, Result<Vec<u8>, Error>> {
        Box::pin(async move {
            self.rx
                .recv()
                .await
                .ok_or_else(|| unavailable("the tier-counts feed thread stopped"))
        })
    }
}
