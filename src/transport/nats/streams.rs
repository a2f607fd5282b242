//! The streams: the input and output streams created at start if missing, or checked to
//! hold the subjects settle needs ([`ensure_streams`]); and [`read_stream`], a stream read
//! back from the beginning for tools and tests.

use super::{fatal, subject_matches, unavailable, JetStreamSettings, NatsConfig, MAX_FETCH};
use crate::config::tiers::TiersConfig;
use crate::transport::Error;
use anyhow::Context as _;
use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, stream};
use futures::StreamExt;
use std::time::Duration;
use tokio::time::Instant;

/// Creates the input stream (`<prefix>.*`) and the output stream (tier, tier-events and
/// dead-letter subjects) if missing; checks that existing ones cover those subjects.
///
/// Errors: [`Error::Unavailable`] when the server does not answer; [`Error::Fatal`] when it
/// refuses a stream (the message says why) or an existing stream lacks a subject.
pub async fn ensure_streams(
    js: &jetstream::Context,
    config: &NatsConfig,
    tiers: &TiersConfig,
) -> Result<(), Error> {
    ensure_stream(
        js,
        config.stream_config(&config.input_stream, vec![config.input_pattern()]),
        "nats.input-stream",
    )
    .await?;
    ensure_stream(
        js,
        config.stream_config(&config.output_stream, config.output_subjects(tiers)),
        "nats.output-stream",
    )
    .await
}

/// Creates the input stream of `config` if missing (what `settle loadgen --nats` needs).
///
/// Errors: as [`ensure_streams`].
pub async fn ensure_input_stream(
    js: &jetstream::Context,
    config: &NatsConfig,
) -> Result<(), Error> {
    ensure_stream(
        js,
        config.stream_config(&config.input_stream, vec![config.input_pattern()]),
        "nats.input-stream",
    )
    .await
}

async fn ensure_stream(
    js: &jetstream::Context,
    wanted: stream::Config,
    key: &str,
) -> Result<(), Error> {
    use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
    let name = wanted.name.clone();
    let existing = match js.get_stream(&name).await {
        Ok(s) => Some(s.cached_info().config.subjects.clone()),
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(j) if j.code() == 404 => None,
            GetStreamErrorKind::JetStream(j) => {
                return Err(fatal(format!("stream {name} ({key}): {j}")))
            }
            _ => return Err(unavailable(format!("stream {name}: {e}"))),
        },
    };
    let Some(subjects) = existing else {
        return match js.create_stream(wanted.clone()).await {
            Ok(_) => {
                tracing::info!(stream = %name, subjects = ?wanted.subjects, "nats: stream created");
                Ok(())
            }
            Err(e) => match e.kind() {
                CreateStreamErrorKind::JetStream(j) => Err(fatal(format!(
                    "cannot create stream {name} ({key}) with subjects {:?}: {j}",
                    wanted.subjects
                ))),
                _ => Err(unavailable(format!("cannot create stream {name}: {e}"))),
            },
        };
    };
    for s in &wanted.subjects {
        if !subjects.iter().any(|p| subject_matches(p, s)) {
            return Err(fatal(format!(
                "stream {name} ({key}) exists without subject {s:?} (its subjects: {subjects:?}): \
                 add the subject to the stream or change the settle config"
            )));
        }
    }
    Ok(())
}

/// One message read back by [`read_stream`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamRecord {
    /// Its subject.
    pub subject: String,
    /// Its stream sequence.
    pub sequence: u64,
    /// Its JetStream timestamp (ms since the epoch).
    pub timestamp_ms: i64,
    /// Headers (name, first value) in no particular order.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub payload: Vec<u8>,
}

impl StreamRecord {
    /// The value of header `name`, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The partition of an input message (the last token of its subject), if numeric.
    pub fn partition(&self) -> Option<i32> {
        self.subject.rsplit('.').next()?.parse().ok()
    }
}

/// Reads the messages of stream `stream` on subjects matching `filter` from the beginning
/// (an ephemeral consumer, deleted afterwards) in sequence order, until none is left and at
/// least `min_records` were read, or until `timeout`.
///
/// Errors: the stream does not exist or the server does not answer.
pub async fn read_stream(
    js: &jetstream::Context,
    stream: &str,
    filter: &str,
    min_records: usize,
    timeout: Duration,
) -> anyhow::Result<Vec<StreamRecord>> {
    let s = js
        .get_stream(stream)
        .await
        .with_context(|| format!("stream {stream}"))?;
    let consumer: PullConsumer = s
        .create_consumer(pull::Config {
            filter_subject: filter.to_owned(),
            ack_policy: AckPolicy::None,
            inactive_threshold: Duration::from_secs(60),
            ..pull::Config::default()
        })
        .await
        .with_context(|| format!("reader of {stream}"))?;
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    loop {
        let mut batch = consumer
            .fetch()
            .max_messages(MAX_FETCH)
            .messages()
            .await
            .context("fetch")?;
        let before = out.len();
        while let Ok(Some(next)) = tokio::time::timeout_at(deadline, batch.next()).await {
            let m = next.map_err(|e| anyhow::anyhow!("reading {stream}: {e}"))?;
            let (sequence, timestamp_ms) = {
                let info = m.info().map_err(|e| anyhow::anyhow!("{e}"))?;
                (
                    info.stream_sequence,
                    (info.published.unix_timestamp_nanos() / 1_000_000) as i64,
                )
            };
            let m = m.message;
            out.push(StreamRecord {
                subject: m.subject.to_string(),
                sequence,
                timestamp_ms,
                headers: m
                    .headers
                    .iter()
                    .flat_map(|h| h.iter())
                    .filter_map(|(k, v)| Some((k.to_string(), v.first()?.as_str().to_owned())))
                    .collect(),
                payload: m.payload.to_vec(),
            });
        }
        let drained = out.len() == before;
        if (drained && out.len() >= min_records) || Instant::now() >= deadline {
            break;
        }
        if drained {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let name = consumer.cached_info().name.clone();
    let _ = s.delete_consumer(&name).await;
    Ok(out)
}
