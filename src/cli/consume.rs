//! `settle consume`: print the records of Kafka topics (or NATS JetStream subjects) as JSON
//! lines — the session-ready records settle writes (SEMANTICS §2 output record), tier
//! changes, dead letters — for people trying settle and for scripts. It is a plain reader: no consumer group is joined and
//! nothing is committed. (Debian's `kcat` cannot talk to every Kafka-compatible broker; this
//! uses the same librdkafka as settle.)
//!
//! Each line is the record value when it is JSON, else `{"value": "<text>"}`; with
//! `--with-meta` it is wrapped as
//! `{"topic", "partition", "offset", "timestamp", "key", "headers": {..}, "value"}`.
//!
//! `--nats URL` reads NATS JetStream instead: each `--topic` is a subject (or a subject
//! wildcard, `settle.ready.>`) of a stream (found by subject: `SETTLE_READY` for settle's
//! tier subjects, tier-events and dead letters), read by an ordered consumer that acks
//! nothing and is gone when the reader ends. With `--with-meta` the `"topic"` is the
//! subject, `"partition"` null, `"offset"` the stream sequence, `"timestamp"` the JetStream
//! time (ms) and `"key"` the `settle-key` header, if any (every header is under `"headers"`).

use crate::transport::kafka::partition_count;
use crate::transport::kafka::{KafkaConfig, LogContext, Role};
use crate::transport::nats::{self, NatsConfig};
use anyhow::{anyhow, Context as _};
use futures::StreamExt as _;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Headers as _, Message as _};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeSet;
use std::io::Write;
use std::time::{Duration, Instant};

/// `settle consume`: its command-line arguments (clap).
#[derive(Clone, Debug, clap::Args)]
pub struct ConsumeArgs {
    /// Topics to read (repeatable), e.g. settle.ready.normal.
    #[arg(long = "topic", short = 't', required = true, value_name = "TOPIC")]
    pub topics: Vec<String>,
    /// Kafka bootstrap servers (host:port, comma-separated).
    #[arg(
        long,
        default_value = "127.0.0.1:9092",
        env = "SETTLE_KAFKA__BOOTSTRAP_SERVERS"
    )]
    pub bootstrap_servers: String,
    /// librdkafka property, KEY=VALUE (repeatable; SASL, TLS, ...).
    #[arg(short = 'X', long = "property", value_name = "KEY=VALUE", value_parser = super::parse_property)]
    pub properties: Vec<(String, String)>,
    /// Start at the beginning of each partition (default: only records arriving from now on).
    #[arg(long)]
    pub from_beginning: bool,
    /// Stop after this many records.
    #[arg(long, value_name = "N")]
    pub max_records: Option<u64>,
    /// Stop once every partition is at its end (instead of waiting for more).
    #[arg(long)]
    pub exit_at_end: bool,
    /// Wrap each record with its topic, partition, offset, timestamp, key and headers.
    #[arg(long)]
    pub with_meta: bool,
    /// Read NATS JetStream at this server URL (e.g. nats://127.0.0.1:4222) instead of Kafka;
    /// each --topic is then a subject, e.g. settle.ready.normal.
    #[arg(long = "nats", value_name = "URL")]
    pub nats: Option<String>,
}

/// What a `settle consume` run read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConsumeReport {
    /// Records printed.
    pub records: u64,
}

/// Runs `settle consume`, writing one JSON line per record to `out`, until `--max-records`,
/// `--exit-at-end`, or `stop()` returns true (checked at least every 100 ms; the CLI stops
/// on Ctrl-C, which ends the process).
///
/// Errors: a topic is missing or the cluster cannot be reached (metadata within 10 s), a
/// consumer error other than partition EOF, or `out` fails.
pub fn run(
    args: &ConsumeArgs,
    out: &mut dyn Write,
    stop: &dyn Fn() -> bool,
) -> anyhow::Result<ConsumeReport> {
    let mut topics: Vec<String> = Vec::new();
    for t in &args.topics {
        if !topics.contains(t) {
            topics.push(t.clone());
        }
    }
    if args.nats.is_some() {
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the tokio runtime")?
            .block_on(read_nats(args, &topics, out, stop));
    }
    if !args.exit_at_end || topics.len() == 1 {
        return read(args, &topics, out, stop);
    }
    // librdkafka's partition-EOF event names no topic: with `--exit-at-end`, read the topics
    // one after the other, each to its end.
    let mut report = ConsumeReport::default();
    for topic in topics {
        let left = ConsumeArgs {
            max_records: args.max_records.map(|m| m.saturating_sub(report.records)),
            ..args.clone()
        };
        if left.max_records == Some(0) {
            break;
        }
        report.records += read(&left, &[topic], out, stop)?.records;
    }
    Ok(report)
}

/// Reads `topics` (distinct) as [`run`] describes.
fn read(
    args: &ConsumeArgs,
    topics: &[String],
    out: &mut dyn Write,
    stop: &dyn Fn() -> bool,
) -> anyhow::Result<ConsumeReport> {
    let kafka = KafkaConfig {
        bootstrap_servers: args.bootstrap_servers.clone(),
        properties: args.properties.iter().cloned().collect(),
        ..KafkaConfig::default()
    };
    // The group id is set but never joined: partitions are assigned, not subscribed.
    let consumer: BaseConsumer<LogContext> = kafka
        .client_config(Role::Consumer)
        .create_with_context(LogContext)
        .context("cannot create a Kafka reader")?;
    let start = if args.from_beginning {
        Offset::Beginning
    } else {
        Offset::End
    };
    let mut tpl = TopicPartitionList::new();
    let mut partitions = 0usize;
    for topic in topics {
        let n = partition_count(&consumer, topic)?;
        for p in 0..n {
            tpl.add_partition_offset(topic, p, start)?;
        }
        partitions += n as usize;
    }
    consumer.assign(&tpl)?;
    let mut report = ConsumeReport::default();
    let mut at_end: BTreeSet<(String, i32)> = BTreeSet::new();
    let started = Instant::now();
    loop {
        if stop() || args.max_records.is_some_and(|m| report.records >= m) {
            break;
        }
        if args.exit_at_end && at_end.len() == partitions {
            break;
        }
        match consumer.poll(Duration::from_millis(100)) {
            None => {
                // Safety net for brokers that never report EOF on an empty partition:
                // `--exit-at-end` with nothing read ends after 5 quiet seconds.
                if args.exit_at_end && report.records == 0 && started.elapsed().as_secs() >= 5 {
                    break;
                }
            }
            Some(Ok(m)) => {
                at_end.remove(&(m.topic().to_owned(), m.partition()));
                if !print(out, &line(&m, args.with_meta), &mut report)? {
                    return Ok(report);
                }
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                // librdkafka's EOF error names no topic: exact with one topic, which is how
                // `run` calls this with `--exit-at-end`.
                for t in topics {
                    at_end.insert((t.clone(), p));
                }
            }
            Some(Err(e)) => return Err(anyhow!("reading {topics:?}: {e}")),
        }
    }
    finish(out, report)
}

/// Reads the subjects `topics` (distinct) of NATS JetStream at `args.nats` as [`run`]
/// describes (module docs).
async fn read_nats(
    args: &ConsumeArgs,
    topics: &[String],
    out: &mut dyn Write,
    stop: &dyn Fn() -> bool,
) -> anyhow::Result<ConsumeReport> {
    use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
    let config = NatsConfig {
        servers: args.nats.clone().unwrap_or_default(),
        ..NatsConfig::default()
    };
    let js = nats::jetstream(nats::connect(&config).await?, 1);
    let mut readers = Vec::new();
    // Subjects whose reader has reached what the stream held (for --exit-at-end).
    let mut at_end: BTreeSet<usize> = BTreeSet::new();
    for (i, subject) in topics.iter().enumerate() {
        let name = js.stream_by_subject(subject.as_str()).await.map_err(|e| {
            anyhow!(
                "no JetStream stream holds subject {subject} on {}: {e}",
                config.servers_shown()
            )
        })?;
        let stream = js
            .get_stream(&name)
            .await
            .with_context(|| format!("stream {name}"))?;
        let mut consumer = stream
            .create_consumer(OrderedConfig {
                filter_subject: subject.clone(),
                deliver_policy: if args.from_beginning {
                    DeliverPolicy::All
                } else {
                    DeliverPolicy::New
                },
                ..OrderedConfig::default()
            })
            .await
            .with_context(|| format!("reader of {subject} in stream {name}"))?;
        if consumer.info().await.map_or(0, |info| info.num_pending) == 0 {
            at_end.insert(i);
        }
        let messages = consumer
            .messages()
            .await
            .with_context(|| format!("reading {subject}"))?;
        readers.push(messages.map(move |m| (i, m)).boxed());
    }
    let mut merged = futures::stream::select_all(readers);
    let mut report = ConsumeReport::default();
    loop {
        if stop() || args.max_records.is_some_and(|m| report.records >= m) {
            break;
        }
        if args.exit_at_end && at_end.len() == topics.len() {
            break;
        }
        let next = tokio::time::timeout(Duration::from_millis(100), merged.next()).await;
        let Ok(next) = next else { continue };
        let Some((i, m)) = next else { break };
        let m = m.map_err(|e| anyhow!("reading {}: {e}", topics[i]))?;
        let info = m
            .info()
            .map_err(|e| anyhow!("reading {}: {e}", topics[i]))?;
        let (sequence, published, pending) = (
            info.stream_sequence,
            (info.published.unix_timestamp_nanos() / 1_000_000) as i64,
            info.pending,
        );
        let headers: Vec<(String, String)> = m
            .headers
            .iter()
            .flat_map(|h| h.iter())
            .filter_map(|(k, v)| Some((k.to_string(), v.first()?.as_str().to_owned())))
            .collect();
        let key = headers
            .iter()
            .find(|(k, _)| k == nats::KEY_HEADER)
            .map(|(_, v)| v.clone());
        let meta = Meta {
            topic: &m.subject,
            partition: None,
            offset: sequence as i64,
            timestamp: Some(published),
            key,
            headers: headers.into_iter().map(|(k, v)| (k, v.into())).collect(),
        };
        let text = render(Some(&m.payload), args.with_meta.then_some(meta));
        if !print(out, &text, &mut report)? {
            return Ok(report);
        }
        if pending == 0 {
            at_end.insert(i);
        } else {
            at_end.remove(&i);
        }
    }
    finish(out, report)
}

/// Writes one line to `out` and counts it. `Ok(false)`: the reader went away (`| head`):
/// done, not an error.
fn print(out: &mut dyn Write, line: &str, report: &mut ConsumeReport) -> anyhow::Result<bool> {
    match writeln!(out, "{line}") {
        Ok(()) => {
            report.records += 1;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Flushes `out` (a reader gone away is no error) and returns `report`.
fn finish(out: &mut dyn Write, report: ConsumeReport) -> anyhow::Result<ConsumeReport> {
    match out.flush() {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(report),
    }
}

/// Where a record was, for `--with-meta` (module docs).
struct Meta<'a> {
    topic: &'a str,
    partition: Option<i32>,
    offset: i64,
    timestamp: Option<i64>,
    key: Option<String>,
    headers: serde_json::Map<String, serde_json::Value>,
}

/// One output line: the value of `payload`, wrapped in `meta` when given (module docs).
fn render(payload: Option<&[u8]>, meta: Option<Meta<'_>>) -> String {
    let value = payload.map(|p| {
        serde_json::from_slice::<serde_json::Value>(p)
            .unwrap_or_else(|_| serde_json::json!({ "value": String::from_utf8_lossy(p) }))
    });
    let Some(meta) = meta else {
        return value.unwrap_or(serde_json::Value::Null).to_string();
    };
    serde_json::json!({
        "topic": meta.topic,
        "partition": meta.partition,
        "offset": meta.offset,
        "timestamp": meta.timestamp,
        "key": meta.key,
        "headers": meta.headers,
        "value": value,
    })
    .to_string()
}

/// One output line for `m` (module docs).
fn line(m: &BorrowedMessage<'_>, with_meta: bool) -> String {
    if !with_meta {
        return render(m.payload(), None);
    }
    let headers: serde_json::Map<String, serde_json::Value> = m
        .headers()
        .map(|h| {
            h.iter()
                .map(|h| {
                    let v = h.value.map(|v| String::from_utf8_lossy(v).into_owned());
                    (h.key.to_owned(), v.into())
                })
                .collect()
        })
        .unwrap_or_default();
    let meta = Meta {
        topic: m.topic(),
        partition: Some(m.partition()),
        offset: m.offset(),
        timestamp: m.timestamp().to_millis(),
        key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
        headers,
    };
    render(m.payload(), Some(meta))
}
