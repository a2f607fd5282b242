//! Where `settle tune` and `settle simulate` get their trace: a JSONL file (`--input`), or the
//! uploads themselves, read straight from the input topic (`--from-kafka`) or the input
//! JetStream stream (`--from-nats`) over a time range (`--since`, `--until`).
//!
//! Broker reads use the `[kafka]` / `[nats]` sections of `--config` (and their `SETTLE_`
//! environment overrides, e.g. `SETTLE_KAFKA__BOOTSTRAP_SERVERS`): the same connection,
//! security and name settings `settle run` uses. Nothing is committed or acknowledged: Kafka
//! partitions are assigned (no consumer group is joined), NATS uses an ephemeral consumer
//! without acks, deleted afterwards.
//!
//! # What becomes the trace
//!
//! * Every record stamped within `[since, until]` (ms, inclusive; broker timestamp as in
//!   SEMANTICS §3: Kafka record timestamp, JetStream timestamp) is decoded exactly as the
//!   runtime decodes it (`codec::decode_upload`, event time capped at the wall clock). A
//!   record that does not decode is counted by reason and skipped (the runtime would
//!   dead-letter it); the read goes on.
//! * Kafka: each partition is read from the first offset stamped at or after `since` (the
//!   broker's time index) to its end as of the read, or to the first record stamped after
//!   `until` at or past the offset the time index gives for `until`. A broker that answers
//!   the time lookup wrongly or returns only whole batches from an offset (tansu 0.6) is
//!   detected (the first record is not the one asked for) and that partition is read from
//!   its beginning instead; the time filter keeps the result the same.
//! * NATS: the stream is read from the first message stamped at or after `since` to the
//!   last one (pending count 0) or the first stamped after `until`. The partition is the
//!   last subject token, the session key the optional `settle-key` header.
//! * The partitions are interleaved by timestamp, each kept in offset order (so a key's
//!   uploads stay in the order the runtime applies them): the order a caught-up runtime
//!   would see.
//! * A read may be bounded (`max_uploads`, the operator page's What-if sweep): it stops with
//!   [`TooManyUploads`] as soon as the range holds more uploads than that, instead of
//!   holding them all.

use super::progress_bar;
use super::trace::TraceError;
use super::trace::{read_trace_file, Trace};
use crate::codec;
use crate::config::{Config, Transport};
use crate::engine::{Millis, Upload};
use crate::transport::kafka::partition_count;
use crate::transport::kafka::{KafkaConfig, LogContext, Role};
use crate::transport::nats::{self, NatsConfig, KEY_HEADER};
use anyhow::{anyhow, bail, Context as _};
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use futures::StreamExt;
use indicatif::ProgressBar;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Bound on one metadata, time-index or watermark request, and on a NATS fetch.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A Kafka read with no record and no end-of-partition event for this long takes the
/// partitions not yet at their end as read (brokers that never report the end of an empty
/// partition), with a warning naming them.
const QUIET_END: Duration = Duration::from_secs(10);

/// Most messages asked for in one NATS pull request.
const NATS_FETCH: usize = 10_000;

/// Unusable records logged one by one after a broker read (the rest are only counted).
const WARNED_RECORDS: usize = 10;

/// `--input`, `--from-kafka` or `--from-nats`: exactly one.
#[derive(Clone, Debug, clap::Args)]
#[group(id = "trace-source", required = true, multiple = false)]
pub struct SourceChoice {
    /// Trace file: one upload record per line plus "ts" (epoch ms or RFC 3339) and an
    /// optional "partition" (the format of `settle simulate`).
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,
    /// Read the uploads from the Kafka input topic (`[kafka]` of --config; --topic to
    /// override the topic).
    #[arg(long)]
    pub from_kafka: bool,
    /// Read the uploads from the NATS JetStream input stream (`[nats]` of --config;
    /// --topic to override the stream).
    #[arg(long)]
    pub from_nats: bool,
}

/// Where the trace comes from: the flags `settle tune` and `settle simulate` share.
#[derive(Clone, Debug, clap::Args)]
pub struct SourceArgs {
    /// The source.
    #[command(flatten)]
    pub choice: SourceChoice,
    /// With --from-kafka: the topic (default `kafka.input-topic`); with --from-nats: the
    /// stream (default `nats.input-stream`).
    #[arg(long, value_name = "NAME")]
    pub topic: Option<String>,
    /// With --from-kafka/--from-nats: first record time to read, RFC 3339
    /// (2026-01-01T00:00:00Z), epoch ms, or a duration ago (2h, 90m, 1day). Default: the
    /// oldest record.
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub since: Option<TimeArg>,
    /// With --from-kafka/--from-nats: last record time to read, same forms as --since.
    /// Default: now (when the read starts).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub until: Option<TimeArg>,
    /// No progress bar while reading from a broker.
    #[arg(long)]
    pub no_progress: bool,
}

/// A point in time as written on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeArg {
    /// An instant (ms since the Unix epoch).
    At(Millis),
    /// This long (ms) before the moment the read starts.
    Ago(Millis),
}

impl TimeArg {
    /// The instant (ms) this stands for when the wall clock reads `now` (ms).
    pub fn resolve(self, now: Millis) -> Millis {
        match self {
            TimeArg::At(t) => t,
            TimeArg::Ago(d) => now.saturating_sub(d),
        }
    }
}

/// Parses `--since` / `--until`: `now`, an RFC 3339 time, epoch milliseconds (digits only),
/// or a humantime duration meaning that long ago (`2h`, `90m`, `1day`, optionally followed
/// by ` ago`).
///
/// Errors: none of these forms (the message lists them).
pub fn parse_time(text: &str) -> Result<TimeArg, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("now") {
        return Ok(TimeArg::Ago(0));
    }
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return t
            .parse::<Millis>()
            .map(TimeArg::At)
            .map_err(|e| format!("{t:?}: epoch milliseconds out of range: {e}"));
    }
    if let Ok(ms) = codec::parse_rfc3339_ms(t) {
        return Ok(TimeArg::At(ms));
    }
    let ago = t.strip_suffix("ago").map(str::trim_end).unwrap_or(t);
    match humantime::parse_duration(ago) {
        Ok(d) => Ok(TimeArg::Ago(
            Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX),
        )),
        Err(_) => Err(format!(
            "{text:?} is not a time: write RFC 3339 (2026-01-01T00:00:00Z), epoch \
             milliseconds (1767225600000), a duration ago (2h, 90m, 1day) or now"
        )),
    }
}

/// The records to read: broker timestamps in `since..=until` (ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimeRange {
    /// First timestamp read (ms); `None`: from the oldest record.
    pub since: Option<Millis>,
    /// Last timestamp read (ms).
    pub until: Millis,
}

impl TimeRange {
    /// `since`/`until` resolved against the wall clock `now` (ms); `until` defaults to `now`.
    ///
    /// Errors: `since` after `until`.
    pub fn resolve(
        since: Option<TimeArg>,
        until: Option<TimeArg>,
        now: Millis,
    ) -> anyhow::Result<Self> {
        let range = TimeRange {
            since: since.map(|s| s.resolve(now)),
            until: until.map_or(now, |u| u.resolve(now)),
        };
        if let Some(s) = range.since.filter(|s| *s > range.until) {
            bail!(
                "--since {} is after --until {}: nothing to read",
                codec::format_rfc3339_ms(s),
                codec::format_rfc3339_ms(range.until)
            );
        }
        Ok(range)
    }

    /// True when `ts` (ms) is in the range.
    pub fn contains(&self, ts: Millis) -> bool {
        self.since.is_none_or(|s| ts >= s) && ts <= self.until
    }
}

impl fmt::Display for TimeRange {
    /// `2026-01-01T00:00:00.000Z to 2026-01-01T02:00:00.000Z` (`beginning` without since).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.since {
            Some(s) => write!(f, "{}", codec::format_rfc3339_ms(s))?,
            None => f.write_str("beginning")?,
        }
        write!(f, " to {}", codec::format_rfc3339_ms(self.until))
    }
}

/// What a broker read saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadSummary {
    /// `kafka topic settle.uploads at 127.0.0.1:9092` or `nats stream SETTLE_UPLOADS at ...`.
    pub source: String,
    /// The range read.
    pub range: Option<TimeRange>,
    /// Partitions of the topic (Kafka) or seen in the stream (NATS).
    pub partitions: usize,
    /// Records received.
    pub records: u64,
    /// Records stamped outside the range (read past, not used).
    pub outside_range: u64,
    /// Records that did not decode, by `codec::DecodeError::reason`.
    pub rejected: BTreeMap<&'static str, u64>,
    /// Uploads in the trace.
    pub uploads: u64,
    /// Kafka partitions read from their beginning because the broker could not start at
    /// the time asked for (see the module docs).
    pub read_from_beginning: Vec<i32>,
    /// Kafka partitions taken as read without an end-of-partition event (see [`QUIET_END`]).
    pub assumed_at_end: Vec<i32>,
}

impl fmt::Display for ReadSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "read {} record(s) from {}", self.records, self.source)?;
        if let Some(r) = &self.range {
            write!(f, ", {r}")?;
        }
        write!(
            f,
            " ({} partition(s)): {} upload(s), {} outside the range, ",
            self.partitions, self.uploads, self.outside_range
        )?;
        let rejected: u64 = self.rejected.values().sum();
        if rejected == 0 {
            f.write_str("0 unusable")?;
        } else {
            let reasons: Vec<String> = self
                .rejected
                .iter()
                .map(|(r, n)| format!("{r} {n}"))
                .collect();
            write!(f, "{rejected} unusable ({})", reasons.join(", "))?;
        }
        if !self.read_from_beginning.is_empty() {
            write!(
                f,
                "; partitions {:?} read from their beginning (the broker could not start at --since)",
                self.read_from_beginning
            )?;
        }
        if !self.assumed_at_end.is_empty() {
            write!(
                f,
                "; partitions {:?} reported no end within {}s and were taken as read",
                self.assumed_at_end,
                QUIET_END.as_secs()
            )?;
        }
        Ok(())
    }
}

/// A bounded read stopped: the range holds more than this many uploads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the range holds more than {0} uploads: read a shorter range")]
pub struct TooManyUploads(pub u64);

/// A trace read from a broker, with what the read saw.
#[derive(Debug)]
pub struct BrokerTrace {
    /// The uploads (and the unusable records, counted).
    pub trace: Trace,
    /// What the read saw.
    pub summary: ReadSummary,
}

/// Collects records as they are read: range filter, decoding, per-partition order.
struct Collector {
    range: TimeRange,
    wall: Millis,
    trace: Trace,
    /// `(timestamp, upload)` per partition, in read (offset) order.
    partitions: BTreeMap<i32, Vec<(Millis, Upload)>>,
    summary: ReadSummary,
    /// NATS: the partition count keys hash over; an upload on another partition than its
    /// key's is rejected as `wrong_partition`, as `settle run` dead-letters it.
    key_partitions: Option<u32>,
    /// Most uploads kept; one more sets `over` and is dropped.
    max_uploads: Option<u64>,
    /// Uploads kept in `partitions`.
    kept: u64,
    /// More than `max_uploads` uploads were in the range: the read must stop.
    over: bool,
}

impl Collector {
    fn new(source: String, range: TimeRange, wall: Millis, max_uploads: Option<u64>) -> Self {
        Collector {
            max_uploads,
            kept: 0,
            over: false,
            range,
            wall,
            trace: Trace::default(),
            partitions: BTreeMap::new(),
            summary: ReadSummary {
                source,
                range: Some(range),
                ..ReadSummary::default()
            },
            key_partitions: None,
        }
    }

    /// One record of `partition` at `at` (`topic/partition@offset`, for error messages).
    fn push(
        &mut self,
        partition: i32,
        at: impl FnOnce() -> String,
        key: Option<&[u8]>,
        payload: &[u8],
        ts: Millis,
    ) {
        self.summary.records += 1;
        if !self.range.contains(ts) {
            self.summary.outside_range += 1;
            return;
        }
        // NATS (key partitions known): the key header is optional, as `settle run` reads it.
        let rule = match self.key_partitions {
            Some(_) => codec::KeyRule::Optional,
            None => codec::KeyRule::Required,
        };
        let decoded = codec::decode_upload_with(rule, key, payload, ts, self.wall).and_then(|u| {
            match self.key_partitions {
                Some(n) => {
                    let expected = nats::partition_for_key(u.key.as_str().as_bytes(), n);
                    if expected == partition {
                        Ok(u)
                    } else {
                        Err(codec::DecodeError::WrongPartition {
                            partition,
                            expected,
                        })
                    }
                }
                None => Ok(u),
            }
        });
        match decoded {
            Ok(_) if self.max_uploads.is_some_and(|m| self.kept >= m) => self.over = true,
            Ok(u) => {
                self.kept += 1;
                self.partitions
                    .entry(partition)
                    .or_default()
                    .push((u.event_time, u));
            }
            Err(source) => {
                *self.summary.rejected.entry(source.reason()).or_default() += 1;
                self.trace.reject(TraceError::Record { at: at(), source });
            }
        }
    }

    /// Drops what was collected for `partition` (it is read again from its beginning).
    fn restart(&mut self, partition: i32) {
        if let Some(dropped) = self.partitions.remove(&partition) {
            self.kept -= dropped.len() as u64;
        }
    }

    /// [`TooManyUploads`] once the bound was passed.
    fn check_bound(&self) -> Result<(), TooManyUploads> {
        match self.max_uploads {
            Some(m) if self.over => Err(TooManyUploads(m)),
            _ => Ok(()),
        }
    }

    /// The trace: partitions interleaved by timestamp, each in read order (ties: lower
    /// partition first).
    fn finish(mut self) -> BrokerTrace {
        let mut lists = Vec::new();
        let mut heads = BinaryHeap::new();
        for (i, (p, list)) in std::mem::take(&mut self.partitions).into_iter().enumerate() {
            let mut it = list.into_iter().peekable();
            if let Some((ts, _)) = it.peek() {
                heads.push(Reverse((*ts, p, i)));
            }
            lists.push(it);
        }
        while let Some(Reverse((_, p, i))) = heads.pop() {
            if let Some((_, u)) = lists[i].next() {
                self.trace.uploads.push(u);
            }
            if let Some((ts, _)) = lists[i].peek() {
                heads.push(Reverse((*ts, p, i)));
            }
        }
        self.summary.uploads = self.trace.uploads.len() as u64;
        BrokerTrace {
            trace: self.trace,
            summary: self.summary,
        }
    }
}

/// Wall clock, ms since the Unix epoch.
fn wall_ms() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| {
        Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
    })
}

/// Per-partition state of a Kafka read.
#[derive(Clone, Copy, Debug, Default)]
struct KafkaPartition {
    /// The offset the first record must have (the time index's answer for `since`);
    /// `None` once a record came, or when reading from the beginning.
    expect_first: Option<i64>,
    /// Past this offset, the first record stamped after `until` ends the partition.
    until_offset: Option<i64>,
    /// The partition is read.
    done: bool,
    /// Read again from its beginning.
    restarted: bool,
}

/// Reads `topic` over `range` with the `[kafka]` settings `kafka` (module docs), drawing a
/// progress bar on stderr when `progress` is true, keeping at most `max_uploads` uploads.
/// Blocking; run it off async tasks.
///
/// Errors: the topic's metadata cannot be read (missing topic, cluster unreachable), the
/// reader cannot be created, a consumer error other than end-of-partition, or
/// [`TooManyUploads`].
pub fn read_kafka(
    kafka: &KafkaConfig,
    topic: &str,
    range: TimeRange,
    progress: bool,
    max_uploads: Option<u64>,
) -> anyhow::Result<BrokerTrace> {
    let wall = wall_ms();
    let consumer: BaseConsumer<LogContext> = kafka
        .client_config(Role::Consumer)
        .create_with_context(LogContext)
        .context("cannot create a Kafka reader")?;
    let n = partition_count(&consumer, topic)
        .with_context(|| format!("cannot read topic {topic} at {}", kafka.bootstrap_servers))?;
    let mut collector = Collector::new(
        format!("kafka topic {topic} at {}", kafka.bootstrap_servers),
        range,
        wall,
        max_uploads,
    );
    collector.summary.partitions = n as usize;
    let mut parts = vec![KafkaPartition::default(); n as usize];
    let starts = match range.since {
        Some(since) => offsets_at(&consumer, topic, n, since),
        None => vec![Some(Offset::Beginning); n as usize],
    };
    let untils = offsets_at(&consumer, topic, n, range.until.saturating_add(1));
    let mut tpl = TopicPartitionList::new();
    let mut estimate = 0u64;
    for p in 0..n {
        let st = &mut parts[p as usize];
        st.until_offset = match untils[p as usize] {
            Some(Offset::Offset(o)) => Some(o),
            _ => None,
        };
        let start = match starts[p as usize] {
            // Nothing stamped at or after `since` in this partition.
            Some(Offset::End) => {
                st.done = true;
                continue;
            }
            Some(Offset::Offset(o)) => {
                st.expect_first = Some(o);
                Offset::Offset(o)
            }
            // No time index answer: read everything and filter.
            _ => Offset::Beginning,
        };
        // The watermarks only size the progress bar and skip empty partitions (some brokers
        // never report the end of one); without them the partition is simply read.
        if let Ok((low, high)) = consumer.fetch_watermarks(topic, p, CALL_TIMEOUT) {
            if high <= low {
                st.done = true;
                continue;
            }
            let from = match start {
                Offset::Offset(o) => o,
                _ => low,
            };
            estimate += u64::try_from(high - from).unwrap_or(0);
        }
        tpl.add_partition_offset(topic, p, start)?;
    }
    let bar = if progress {
        progress_bar(true, estimate.max(1))
    } else {
        ProgressBar::hidden()
    };
    bar.set_message(format!("{topic}: reading"));
    if tpl.count() > 0 {
        consumer.assign(&tpl)?;
    }
    let mut last_event = Instant::now();
    while parts.iter().any(|st| !st.done) {
        match consumer.poll(Duration::from_millis(100)) {
            None => {
                if last_event.elapsed() >= QUIET_END {
                    for (p, st) in parts.iter_mut().enumerate() {
                        if !st.done {
                            st.done = true;
                            collector.summary.assumed_at_end.push(p as i32);
                        }
                    }
                }
            }
            Some(Ok(m)) => {
                last_event = Instant::now();
                let p = m.partition();
                let Some(st) = usize::try_from(p).ok().and_then(|i| parts.get_mut(i)) else {
                    continue;
                };
                if st.done {
                    continue;
                }
                let offset = m.offset();
                if let Some(first) = st.expect_first.take() {
                    if offset > first {
                        // The broker skipped the record the time index named (it returns
                        // whole batches only): read this partition from its beginning.
                        restart(&consumer, topic, p, st, &mut collector)?;
                        continue;
                    }
                }
                let ts = m.timestamp().to_millis().unwrap_or(wall);
                if st.until_offset.is_some_and(|u| offset >= u) && ts > range.until {
                    st.done = true;
                    continue;
                }
                collector.push(
                    p,
                    || format!("{topic}/{p}@{offset}"),
                    m.key(),
                    m.payload().unwrap_or_default(),
                    ts,
                );
                if let Err(e) = collector.check_bound() {
                    bar.abandon();
                    return Err(e.into());
                }
                bar.inc(1);
                if bar.position() > bar.length().unwrap_or(0) {
                    bar.set_length(bar.position());
                }
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                last_event = Instant::now();
                let Some(st) = usize::try_from(p).ok().and_then(|i| parts.get_mut(i)) else {
                    continue;
                };
                if st.expect_first.is_some() {
                    // At the end before the record the time index named: same as above.
                    restart(&consumer, topic, p, st, &mut collector)?;
                } else {
                    st.done = true;
                }
            }
            Some(Err(e)) => {
                bar.abandon();
                return Err(anyhow!("reading topic {topic}: {e}"));
            }
        }
        let done = parts.iter().filter(|st| st.done).count();
        bar.set_message(format!("{topic}: {done}/{n} partitions read"));
    }
    bar.finish_and_clear();
    Ok(collector.finish())
}

/// The time index's answer per partition for timestamp `ts` (ms): the first offset stamped
/// at or after it (`Offset::End`: none), or `None` when the broker did not answer.
fn offsets_at(
    consumer: &BaseConsumer<LogContext>,
    topic: &str,
    partitions: i32,
    ts: Millis,
) -> Vec<Option<Offset>> {
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        // Adding a partition of a known topic with a timestamp offset cannot fail.
        let _ = tpl.add_partition_offset(topic, p, Offset::Offset(ts));
    }
    let mut out = vec![None; partitions as usize];
    match consumer.offsets_for_times(tpl, CALL_TIMEOUT) {
        Ok(found) => {
            for e in found.elements() {
                if e.error().is_ok() {
                    if let Some(slot) = usize::try_from(e.partition())
                        .ok()
                        .and_then(|i| out.get_mut(i))
                    {
                        *slot = Some(e.offset());
                    }
                }
            }
        }
        Err(e) => tracing::debug!(topic, error = %e, "kafka: no time index answer"),
    }
    out
}

/// Sends partition `p` back to its beginning and forgets what was collected of it.
fn restart(
    consumer: &BaseConsumer<LogContext>,
    topic: &str,
    p: i32,
    st: &mut KafkaPartition,
    collector: &mut Collector,
) -> anyhow::Result<()> {
    consumer
        .seek(topic, p, Offset::Beginning, CALL_TIMEOUT)
        .with_context(|| format!("seek {topic}/{p} to its beginning"))?;
    st.expect_first = None;
    if !st.restarted {
        st.restarted = true;
        collector.summary.read_from_beginning.push(p);
    }
    collector.restart(p);
    Ok(())
}

/// Reads JetStream stream `stream` over `range` with the `[nats]` settings `nats` (module
/// docs), drawing a progress bar on stderr when `progress` is true, keeping at most
/// `max_uploads` uploads.
///
/// Errors: the server does not answer, the stream does not exist, a fetch fails, or
/// [`TooManyUploads`].
pub async fn read_nats(
    nats: &NatsConfig,
    stream: &str,
    range: TimeRange,
    progress: bool,
    max_uploads: Option<u64>,
) -> anyhow::Result<BrokerTrace> {
    let wall = wall_ms();
    let client = nats::connect(nats).await?;
    let js = nats::jetstream(client, 1);
    let mut collector = Collector::new(
        format!("nats stream {stream} at {}", nats.servers_shown()),
        range,
        wall,
        max_uploads,
    );
    collector.key_partitions = Some(nats.partitions);
    let s = js.get_stream(stream).await.with_context(|| {
        format!(
            "cannot read stream {stream} at {} (is the server up, and the stream name right: --topic / nats.input-stream?)",
            nats.servers_shown()
        )
    })?;
    let deliver_policy = match range.since {
        Some(ms) => DeliverPolicy::ByStartTime {
            start_time: time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
                .map_err(|e| anyhow!("--since {ms} ms: {e}"))?,
        },
        None => DeliverPolicy::All,
    };
    let mut consumer: PullConsumer = s
        .create_consumer(pull::Config {
            deliver_policy,
            ack_policy: AckPolicy::None,
            inactive_threshold: Duration::from_secs(60),
            ..pull::Config::default()
        })
        .await
        .with_context(|| format!("cannot create a reader of stream {stream}"))?;
    let pending = consumer
        .info()
        .await
        .map(|i| i.num_pending)
        .unwrap_or_default();
    let bar = if progress {
        progress_bar(true, pending.max(1))
    } else {
        ProgressBar::hidden()
    };
    bar.set_message(format!("{stream}: reading"));
    let read = read_messages(&consumer, stream, range, &mut collector, &bar).await;
    let name = consumer.cached_info().name.clone();
    // Best effort: the consumer also goes away by itself after a minute of inactivity.
    let _ = s.delete_consumer(&name).await;
    match read {
        Ok(()) => bar.finish_and_clear(),
        Err(e) => {
            bar.abandon();
            return Err(e);
        }
    }
    let partitions: std::collections::BTreeSet<i32> =
        collector.partitions.keys().copied().collect();
    collector.summary.partitions = partitions.len();
    Ok(collector.finish())
}

/// Fetches until the pending count is 0, a fetch finds nothing, or a message is stamped
/// after `range.until`.
async fn read_messages(
    consumer: &PullConsumer,
    stream: &str,
    range: TimeRange,
    collector: &mut Collector,
    bar: &ProgressBar,
) -> anyhow::Result<()> {
    loop {
        let mut batch = consumer
            .fetch()
            .max_messages(NATS_FETCH)
            .messages()
            .await
            .map_err(|e| anyhow!("fetch from stream {stream}: {e}"))?;
        let mut got = 0usize;
        while let Some(next) = tokio::time::timeout(CALL_TIMEOUT, batch.next())
            .await
            .map_err(|_| anyhow!("fetch from stream {stream}: no answer within 10 s"))?
        {
            let m = next.map_err(|e| anyhow!("reading stream {stream}: {e}"))?;
            got += 1;
            let (seq, ts, left) = {
                let info = m.info().map_err(|e| anyhow!("stream {stream}: {e}"))?;
                (
                    info.stream_sequence,
                    Millis::try_from(info.published.unix_timestamp_nanos() / 1_000_000)
                        .unwrap_or(Millis::MAX),
                    info.pending,
                )
            };
            if ts > range.until {
                return Ok(());
            }
            let partition = m
                .subject
                .rsplit('.')
                .next()
                .and_then(|t| t.parse::<i32>().ok())
                .unwrap_or(0);
            let key = m
                .headers
                .as_ref()
                .and_then(|h| h.get(KEY_HEADER))
                .map(|v| v.as_str().as_bytes().to_vec());
            collector.push(
                partition,
                || format!("{stream}/{partition}@{seq}"),
                key.as_deref(),
                &m.payload,
                ts,
            );
            collector.check_bound()?;
            bar.inc(1);
            if left == 0 {
                return Ok(());
            }
        }
        if got == 0 {
            return Ok(());
        }
    }
}

/// Reads the input of `transport` with the settings of `config` over `range`: topic
/// `kafka.input-topic` or stream `nats.input-stream` unless `topic` names another, at most
/// `max_uploads` uploads, a progress bar on stderr when `progress`. Blocking (NATS: on an
/// async runtime of its own); run it off async tasks.
///
/// Errors: those of [`read_kafka`] and [`read_nats`], or no async runtime can start.
pub fn read_input(
    config: &Config,
    transport: Transport,
    topic: Option<&str>,
    range: TimeRange,
    progress: bool,
    max_uploads: Option<u64>,
) -> anyhow::Result<BrokerTrace> {
    match transport {
        Transport::Kafka => {
            let topic = topic.unwrap_or(&config.kafka.input_topic);
            read_kafka(&config.kafka, topic, range, progress, max_uploads)
        }
        Transport::Nats => {
            let stream = topic.unwrap_or(&config.nats.input_stream);
            tokio::runtime::Runtime::new()
                .context("cannot start the async runtime")?
                .block_on(read_nats(
                    &config.nats,
                    stream,
                    range,
                    progress,
                    max_uploads,
                ))
        }
    }
}

/// A trace and a name for it (the file, or the broker, topic and range).
#[derive(Debug)]
pub struct LoadedTrace {
    /// Where it came from, for titles.
    pub source: String,
    /// The uploads.
    pub trace: Trace,
    /// What the broker read saw (`None` for a file).
    pub summary: Option<ReadSummary>,
}

/// Reads the trace `args` names, with the broker settings of `config`; a broker read's
/// summary is printed on stderr and its first unusable records logged as warnings.
///
/// Errors: `--since`/`--until` with a file, a range that ends before it starts, and the
/// errors of [`read_trace_file`], [`read_kafka`] and [`read_nats`].
pub fn load(args: &SourceArgs, config: &Config) -> anyhow::Result<LoadedTrace> {
    if let Some(path) = &args.choice.input {
        if args.since.is_some() || args.until.is_some() || args.topic.is_some() {
            bail!("--since, --until and --topic apply to --from-kafka and --from-nats, not to --input");
        }
        return Ok(LoadedTrace {
            source: path.display().to_string(),
            trace: read_trace_file(path)?,
            summary: None,
        });
    }
    let range = TimeRange::resolve(args.since, args.until, wall_ms())?;
    let progress = !args.no_progress && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let transport = if args.choice.from_kafka {
        Transport::Kafka
    } else {
        Transport::Nats
    };
    let read = read_input(
        config,
        transport,
        args.topic.as_deref(),
        range,
        progress,
        None,
    )?;
    eprintln!("{}", read.summary);
    for e in read.trace.rejected.iter().take(WARNED_RECORDS) {
        tracing::warn!("skipped {e}");
    }
    let more = read
        .trace
        .rejected_count()
        .saturating_sub(WARNED_RECORDS as u64);
    if more > 0 {
        tracing::warn!("skipped {more} more unusable record(s) (counted by reason above)");
    }
    Ok(LoadedTrace {
        source: format!("{}, {range}", read.summary.source),
        trace: read.trace,
        summary: Some(read.summary),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_in_every_documented_form() {
        assert_eq!(parse_time("now"), Ok(TimeArg::Ago(0)));
        assert_eq!(
            parse_time("2026-01-01T00:00:00Z"),
            Ok(TimeArg::At(1_767_225_600_000))
        );
        assert_eq!(
            parse_time("1767225600000"),
            Ok(TimeArg::At(1_767_225_600_000))
        );
        assert_eq!(parse_time("2h"), Ok(TimeArg::Ago(7_200_000)));
        assert_eq!(parse_time("90m ago"), Ok(TimeArg::Ago(5_400_000)));
        assert_eq!(parse_time(" 1day "), Ok(TimeArg::Ago(86_400_000)));
        let e = parse_time("yesterday-ish").unwrap_err();
        assert!(e.contains("RFC 3339") && e.contains("2h"), "{e}");
        assert!(parse_time("").is_err());
    }

    #[test]
    fn ranges_resolve_against_now_and_refuse_backwards() {
        let now = 10_000_000;
        let r = TimeRange::resolve(Some(TimeArg::Ago(60_000)), None, now).unwrap();
        assert_eq!((r.since, r.until), (Some(9_940_000), now));
        assert!(r.contains(9_940_000) && r.contains(now));
        assert!(!r.contains(9_939_999) && !r.contains(now + 1));
        let open = TimeRange::resolve(None, Some(TimeArg::At(5)), now).unwrap();
        assert!(open.contains(i64::MIN) && !open.contains(6));
        let e = TimeRange::resolve(Some(TimeArg::At(now)), Some(TimeArg::Ago(1)), now).unwrap_err();
        assert!(e.to_string().contains("after --until"), "{e}");
    }

    #[test]
    fn nats_uploads_on_another_partition_than_their_key_are_rejected() {
        let range = TimeRange {
            since: None,
            until: 1_000,
        };
        let mut c = Collector::new("test".into(), range, Millis::MAX, None);
        c.key_partitions = Some(8);
        let key = "acme/build-42"; // partition 1 of 8
        let body = br#"{"tenant":"acme","session":"build-42"}"#;
        c.push(1, || "s.1@1".into(), Some(key.as_bytes()), body, 10);
        c.push(2, || "s.2@2".into(), Some(key.as_bytes()), body, 20);
        assert_eq!(c.summary.rejected.get("wrong_partition"), Some(&1));
        assert_eq!(c.partitions.get(&1).map(Vec::len), Some(1));
        assert!(!c.partitions.contains_key(&2));
    }

    #[test]
    fn a_bounded_read_stops_past_its_bound_and_a_restart_gives_room_back() {
        let range = TimeRange {
            since: None,
            until: 1_000,
        };
        let mut c = Collector::new("test".into(), range, Millis::MAX, Some(2));
        let rec = |s: &str| format!(r#"{{"tenant":"t","session":"{s}"}}"#);
        let push = |c: &mut Collector, p: i32, s: &str| {
            let key = format!("t/{s}");
            c.push(p, String::new, Some(key.as_bytes()), rec(s).as_bytes(), 10);
        };
        push(&mut c, 0, "a");
        push(&mut c, 1, "b");
        // Bad records do not count against the bound.
        c.push(0, String::new, Some(b"t/x"), b"not json", 10);
        assert_eq!(c.check_bound(), Ok(()));
        c.restart(1);
        push(&mut c, 1, "b");
        assert_eq!(c.check_bound(), Ok(()));
        push(&mut c, 0, "c");
        assert_eq!(c.check_bound(), Err(TooManyUploads(2)));
        assert_eq!(c.kept, 2);
    }

    #[test]
    fn partitions_interleave_by_timestamp_keeping_each_in_read_order() {
        let range = TimeRange {
            since: Some(100),
            until: 1_000,
        };
        let mut c = Collector::new("test".into(), range, Millis::MAX, None);
        let rec = |s: &str| format!(r#"{{"tenant":"t","session":"{s}"}}"#);
        // Partition 1 has a record stamped before its predecessor: it keeps its place.
        let records = [
            (1, "a", rec("a"), 300),
            (1, "b", rec("b"), 200),
            (0, "c", rec("c"), 250),
            (0, "x", "not json".to_owned(), 260),
            (0, "d", rec("d"), 50),
            (2, "e", rec("e"), 300),
        ];
        for (partition, session, payload, ts) in records {
            let key = format!("t/{session}");
            c.push(
                partition,
                String::new,
                Some(key.as_bytes()),
                payload.as_bytes(),
                ts,
            );
        }
        // A record without a key is rejected as the runtime would dead-letter it.
        c.push(2, String::new, None, rec("f").as_bytes(), 400);
        let read = c.finish();
        let order: Vec<(String, Millis)> = read
            .trace
            .uploads
            .iter()
            .map(|u| (u.key.session().to_owned(), u.event_time))
            .collect();
        assert_eq!(
            order,
            [
                ("c".to_owned(), 250),
                ("a".to_owned(), 300),
                ("b".to_owned(), 200),
                ("e".to_owned(), 300),
            ]
        );
        let s = &read.summary;
        assert_eq!((s.records, s.outside_range, s.uploads), (7, 1, 4));
        assert_eq!(s.rejected.get("invalid_json"), Some(&1));
        assert_eq!(s.rejected.get("missing_key"), Some(&1));
        assert_eq!(read.trace.rejected_count(), 2);
    }
}
