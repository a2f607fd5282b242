//! The changelog on Kafka (ARCHITECTURE "changelog"): a compacted topic with the input
//! topic's partition count. Changelog partition `p` mirrors the store of input partition `p`:
//! record key = `store::changelog_key` (column family, `0x00`, store key), value = the stored
//! bytes, no value (a tombstone) for a delete.
//!
//! * **Append**: one idempotent producer per process (`acks=all`, `message.timeout.ms=0`:
//!   librdkafka retries until the broker takes the records, so a broker outage delays the
//!   checkpoint, never fails the partition). Records of one partition are stored in append
//!   order without gaps (idempotence). A full local queue is waited out (backpressure).
//! * **Read**: a consumer that is not in the group, assigned to the one changelog partition
//!   at the restore's start offset, with `enable.partition.eof`, reading until partition EOF
//!   (the end as of the read). Records below the start offset (Apache Kafka returns the whole
//!   batch holding it) are skipped; gaps (compaction) are normal. The end offset for progress
//!   is the high watermark librdkafka caches from fetch responses (tansu 0.6 answers
//!   ListOffsets "latest" with the newest batch's base offset + 1).

use super::{
    cached_high_watermark, classify, Health, KafkaConfig, LogContext, Role, CALL_TIMEOUT, TRANSPORT,
};
use crate::store::Change;
use crate::transport::{ChangelogReader, Error};
use futures::future::BoxFuture;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::sync::Arc;
use std::time::Duration;

/// How long one read waits for the next record before it asks again (also the stop latency
/// of a read).
const READ_POLL: Duration = Duration::from_millis(100);

/// A read that sees neither a record nor EOF for this long reports the changelog unavailable
/// (the caller retries from its checkpoint).
const READ_STALL: Duration = Duration::from_secs(30);

/// The changelog side of the Kafka sink. Cheap to clone.
#[derive(Clone)]
pub(crate) struct KafkaChangelog {
    topic: Arc<str>,
    producer: FutureProducer<super::ProducerContext>,
    /// Reader client configuration (not in the group).
    reader_config: ClientConfig,
}

impl KafkaChangelog {
    /// The changelog of `config` (`None` when `changelog-topic` is `""`).
    ///
    /// Errors: [`Error::Fatal`] when librdkafka rejects the producer configuration.
    pub(crate) fn new(config: &KafkaConfig, health: Arc<Health>) -> Result<Option<Self>, Error> {
        let Some(topic) = config.changelog() else {
            return Ok(None);
        };
        let mut producer_config = config.client_config(Role::Producer);
        producer_config
            .set("message.timeout.ms", "0")
            .set("queue.buffering.max.messages", "1000000")
            // Changelog records come in bursts of a whole store batch: large, compressed
            // produce batches cost the broker far less per record.
            .set("linger.ms", "20")
            .set("batch.num.messages", "100000")
            .set("compression.type", "lz4")
            .set("client.id", "settle-changelog");
        let producer = producer_config
            .create_with_context(super::ProducerContext { health })
            .map_err(|e| Error::Fatal {
                transport: TRANSPORT,
                reason: format!("cannot create the changelog producer: {e}"),
            })?;
        let mut reader_config = config.client_config(Role::Consumer);
        reader_config
            .set("group.id", format!("{}.restore", config.group_id))
            .set("enable.partition.eof", "true")
            .set("auto.offset.reset", "earliest")
            // A restore reads a backlog: every fetch should answer at once (tansu holds a
            // fetch for the whole wait even when records are there, see the module docs of
            // `transport::kafka`).
            .set("fetch.wait.max.ms", "5")
            .set("client.id", "settle-restore");
        Ok(Some(KafkaChangelog {
            topic: topic.as_str().into(),
            producer,
            reader_config,
        }))
    }

    /// The topic name.
    pub(crate) fn topic(&self) -> &str {
        &self.topic
    }

    /// See `Sink::append_changes`.
    pub(crate) fn append(
        &self,
        partition: i32,
        changes: &[Change],
    ) -> Result<BoxFuture<'static, Result<i64, Error>>, Error> {
        let mut acks = Vec::with_capacity(changes.len());
        for change in changes {
            let mut record = FutureRecord::<[u8], [u8]>::to(&self.topic)
                .partition(partition)
                .key(change.key.as_slice());
            if let Some(v) = &change.value {
                record = record.payload(v.as_slice());
            }
            loop {
                match self.producer.send_result(record) {
                    Ok(ack) => {
                        acks.push(ack);
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                        // Backpressure: the producer's own thread drains the queue.
                        record = r;
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err((e, _)) => return Err(fatal(&e)),
                }
            }
        }
        Ok(Box::pin(async move {
            let mut next = None;
            for ack in acks {
                match ack.await {
                    Ok(Ok(delivery)) => next = Some(delivery.offset + 1),
                    Ok(Err((e, _))) => return Err(fatal(&e)),
                    Err(_) => {
                        return Err(Error::Fatal {
                            transport: TRANSPORT,
                            reason: "the changelog producer was dropped".into(),
                        })
                    }
                }
            }
            next.ok_or_else(|| Error::Fatal {
                transport: TRANSPORT,
                reason: "empty changelog append".into(),
            })
        }))
    }

    /// See `Sink::read_changelog`.
    pub(crate) async fn read(
        &self,
        partition: i32,
        from: i64,
    ) -> Result<Box<dyn ChangelogReader>, Error> {
        let config = self.reader_config.clone();
        let topic = self.topic.to_string();
        let consumer = tokio::task::spawn_blocking(move || -> Result<_, Error> {
            let consumer: BaseConsumer<LogContext> = config
                .create_with_context(LogContext)
                .map_err(|e| fatal(&e))?;
            // The partition must exist: a missing topic (or fewer partitions than the input
            // topic) is an operator error settle waits out, with a clear message.
            let metadata = consumer
                .fetch_metadata(Some(&topic), CALL_TIMEOUT)
                .map_err(|e| classify(&e))?;
            let partitions = metadata
                .topics()
                .iter()
                .find(|t| t.name() == topic && t.error().is_none())
                .map_or(0, |t| t.partitions().len());
            if partitions <= partition as usize {
                return Err(Error::Unavailable {
                    transport: TRANSPORT,
                    reason: format!(
                        "changelog topic {topic} has {partitions} partitions, partition {partition} is needed: create it, compacted, with the input topic's partition count N (on tansu: scripts/kafka.sh create-topics {topic}:N:compact)"
                    ),
                });
            }
            let mut tpl = TopicPartitionList::with_capacity(1);
            tpl.add_partition_offset(&topic, partition, Offset::Offset(from.max(0)))
                .map_err(|e| classify(&e))?;
            consumer.assign(&tpl).map_err(|e| classify(&e))?;
            check_end(&consumer, &topic, partition, from)?;
            Ok(consumer)
        })
        .await
        .map_err(|e| Error::Unavailable {
            transport: TRANSPORT,
            reason: format!("changelog reader task failed: {e}"),
        })??;
        Ok(Box::new(KafkaChangelogReader {
            consumer: Arc::new(consumer),
            topic: self.topic.to_string(),
            partition,
            next: from.max(0),
            end: None,
            done: false,
        }))
    }
}

/// Reads one changelog partition to its end (module docs).
struct KafkaChangelogReader {
    consumer: Arc<BaseConsumer<LogContext>>,
    topic: String,
    partition: i32,
    /// Next offset wanted (records below it are skipped).
    next: i64,
    /// High watermark last seen.
    end: Option<i64>,
    /// Partition EOF seen.
    done: bool,
}

/// One blocking read: up to `max` records from `next`, stopping at EOF.
struct Chunk {
    records: Vec<(i64, Change)>,
    eof: bool,
    end: Option<i64>,
}

fn read_chunk(
    consumer: &BaseConsumer<LogContext>,
    topic: &str,
    partition: i32,
    next: i64,
    max: usize,
) -> Result<Chunk, Error> {
    let mut chunk = Chunk {
        records: Vec::new(),
        eof: false,
        end: None,
    };
    let mut want = next;
    let mut idle = Duration::ZERO;
    while chunk.records.len() < max {
        match consumer.poll(READ_POLL) {
            Some(Ok(m)) => {
                idle = Duration::ZERO;
                if m.offset() < want {
                    continue;
                }
                want = m.offset() + 1;
                chunk.records.push((
                    m.offset(),
                    Change {
                        key: m.key().map(<[u8]>::to_vec).unwrap_or_default(),
                        value: m.payload().map(<[u8]>::to_vec),
                    },
                ));
            }
            Some(Err(KafkaError::PartitionEOF(_))) => {
                chunk.eof = true;
                break;
            }
            Some(Err(e)) => return Err(classify(&e)),
            None => {
                if !chunk.records.is_empty() {
                    break;
                }
                idle += READ_POLL;
                if idle >= READ_STALL {
                    return Err(Error::Unavailable {
                        transport: TRANSPORT,
                        reason: format!(
                            "changelog {topic} partition {partition}: nothing read for {} s",
                            READ_STALL.as_secs()
                        ),
                    });
                }
            }
        }
    }
    chunk.end = std::ffi::CString::new(topic)
        .ok()
        .and_then(|t| cached_high_watermark(consumer.client(), &t, partition));
    Ok(chunk)
}

impl ChangelogReader for KafkaChangelogReader {
    fn next_chunk(&mut self, max: usize) -> BoxFuture<'_, Result<Vec<(i64, Change)>, Error>> {
        Box::pin(async move {
            if self.done {
                return Ok(Vec::new());
            }
            let consumer = Arc::clone(&self.consumer);
            let (topic, partition, next) = (self.topic.clone(), self.partition, self.next);
            let chunk = tokio::task::spawn_blocking(move || {
                read_chunk(&consumer, &topic, partition, next, max.max(1))
            })
            .await
            .map_err(|e| Error::Unavailable {
                transport: TRANSPORT,
                reason: format!("changelog read task failed: {e}"),
            })??;
            if let Some(&(last, _)) = chunk.records.last() {
                self.next = last + 1;
            }
            self.end = chunk.end.or(self.end);
            self.done = chunk.eof;
            Ok(chunk.records)
        })
    }

    fn end_hint(&self) -> Option<i64> {
        self.end
    }
}

/// Fails with [`Error::changelog_started_over`] when the changelog partition ends below
/// `from` (the store's checkpoint), instead of a restore that waits forever for records that
/// are gone. The end is the larger of ListOffsets "latest" and the high watermark of the
/// reader's fetch responses, asked again every 500 ms for [`END_SETTLE`] while it is low
/// (tansu 0.6 answers "latest" with the newest batch's base offset plus one, and its high
/// watermark can lag right after a produce; the input's check does the same,
/// `KafkaInput::check_log_end`). Runs on the blocking pool.
fn check_end(
    consumer: &BaseConsumer<LogContext>,
    topic: &str,
    partition: i32,
    from: i64,
) -> Result<(), Error> {
    let started = std::time::Instant::now();
    loop {
        let (_, latest) = consumer
            .fetch_watermarks(topic, partition, CALL_TIMEOUT)
            .map_err(|e| classify(&e))?;
        let end = latest.max(
            std::ffi::CString::new(topic)
                .ok()
                .and_then(|t| cached_high_watermark(consumer.client(), &t, partition))
                .unwrap_or(-1),
        );
        if end >= from {
            return Ok(());
        }
        if started.elapsed() >= END_SETTLE {
            return Err(Error::changelog_started_over(
                TRANSPORT,
                topic,
                partition,
                end.max(0),
                from,
            ));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// How long [`check_end`] asks again about a changelog end below the checkpoint.
const END_SETTLE: Duration = Duration::from_secs(5);

fn fatal(e: &KafkaError) -> Error {
    Error::Fatal {
        transport: TRANSPORT,
        reason: format!("changelog: {e}"),
    }
}
