//! JetStream publishes as the [`Sink`] ([`NatsSink`]): ready records and dead letters with
//! `Nats-Msg-Id` de-duplication; and [`publish_upload`], the producer side of the input
//! partitions for `settle loadgen --nats` and the tests.

use super::changelog::NatsChangelog;
use super::{fatal, partition_for_key, unavailable, DLQ_SOURCE_TIMESTAMP_HEADER, KEY_HEADER};
use crate::codec::EMISSION_ID_HEADER;
use crate::config::nats::NatsConfig;
use crate::store::Change;
use crate::transport::kafka::{
    DLQ_REASON_HEADER, DLQ_SOURCE_OFFSET_HEADER, DLQ_SOURCE_PARTITION_HEADER,
    DLQ_SOURCE_TOPIC_HEADER, INSTANCE_HEADER, PARTITION_HEADER,
};
use crate::transport::{ChangelogReader, Error, InputRecord, ReadyMessage, Sink};
use anyhow::Context as _;
use async_nats::header::HeaderName;
use async_nats::jetstream;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::HeaderMap;
use bytes::Bytes;
use futures::future::BoxFuture;
use std::sync::Arc;

/// [`Sink`] over JetStream publishes: ready records to their message's subject (the tier's
/// topic) with `Nats-Msg-Id` = `settle-emission-id` = the emission id, `settle-key`, and (as
/// on Kafka) `settle-instance` (this process: [`NatsConfig::instance_name`]) and
/// `settle-partition` (the input partition whose task emitted it);
/// dead letters to `nats.dead-letter-subject` with the original payload, key header and the
/// `settle-dlq-*` headers (`Nats-Msg-Id` = `dlq:<stream>:<sequence>`, so a dead letter
/// re-sent after a crash is dropped as a duplicate too). Cheap to clone.
#[derive(Clone)]
pub struct NatsSink {
    js: jetstream::Context,
    input_stream: Arc<str>,
    dead_letter_subject: Arc<str>,
    /// Header `settle-instance` of ready records.
    instance: Arc<str>,
    /// `nats.changelog-stream` (`None`: off).
    changelog: Option<NatsChangelog>,
}

impl NatsSink {
    /// A sink publishing through `js` for the streams of `config`, with the changelog of
    /// `nats.changelog-stream` unless it is `""` (`transport::nats::changelog`) on `js` too.
    pub fn new(js: jetstream::Context, config: &NatsConfig) -> Self {
        Self::with_changelog_on(js.clone(), js, config)
    }

    /// [`NatsSink::new`] with the changelog appended and read through `changelog_js` (a
    /// connection of its own: `settle run` keeps the many small changelog appends off the
    /// connection that publishes ready records).
    pub fn with_changelog_on(
        js: jetstream::Context,
        changelog_js: jetstream::Context,
        config: &NatsConfig,
    ) -> Self {
        NatsSink {
            changelog: NatsChangelog::new(changelog_js, config),
            js,
            input_stream: config.input_stream.as_str().into(),
            dead_letter_subject: config.dead_letter_subject.as_str().into(),
            instance: config.instance_name().into(),
        }
    }

    async fn send(&self, subject: String, headers: HeaderMap, payload: Bytes) -> Result<(), Error> {
        let publish = PublishMessage::build().headers(headers).payload(payload);
        // A `Subject` shares its bytes: kept for the error messages without a copy.
        let subject = async_nats::Subject::from(subject);
        let ack = self
            .js
            .send_publish(subject.clone(), publish)
            .await
            .map_err(|e| classify_publish(&subject, &e))?;
        ack.await.map_err(|e| classify_publish(&subject, &e))?;
        Ok(())
    }
}

/// Retryable unless the message can never be accepted (too large, bad subject).
fn classify_publish(subject: &str, e: &async_nats::error::Error<PublishErrorKind>) -> Error {
    match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => fatal(format!("publish to {subject}: {e}")),
        PublishErrorKind::StreamNotFound => unavailable(format!(
            "publish to {subject}: no stream holds this subject (or JetStream is down)"
        )),
        _ => unavailable(format!("publish to {subject}: {e}")),
    }
}

impl Sink for NatsSink {
    async fn publish(&self, message: ReadyMessage) -> Result<(), Error> {
        let mut headers = HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            message.emission_id.as_str(),
        );
        // Static names: a `&str` name is validated and copied per record.
        headers.insert(
            HeaderName::from_static(EMISSION_ID_HEADER),
            message.emission_id,
        );
        headers.insert(HeaderName::from_static(KEY_HEADER), message.key);
        headers.insert(HeaderName::from_static(INSTANCE_HEADER), &*self.instance);
        if let Some(p) = message.partition {
            headers.insert(HeaderName::from_static(PARTITION_HEADER), p.to_string());
        }
        self.send(message.topic, headers, message.payload.into())
            .await
    }

    fn changelog(&self) -> Option<&str> {
        self.changelog.as_ref().map(NatsChangelog::name)
    }

    fn fences_by_changelog(&self) -> bool {
        self.changelog.is_some()
    }

    fn append_changes(
        &self,
        partition: i32,
        changes: &[Change],
    ) -> Result<BoxFuture<'static, Result<i64, Error>>, Error> {
        match &self.changelog {
            Some(c) => c.append(partition, changes, false),
            None => Err(fatal("nats.changelog-stream is off".into())),
        }
    }

    fn changelog_snapshot_due(&self, partition: i32) -> bool {
        self.changelog
            .as_ref()
            .is_some_and(|c| c.snapshot_due(partition))
    }

    fn append_snapshot(
        &self,
        partition: i32,
        changes: &[Change],
    ) -> Result<BoxFuture<'static, Result<i64, Error>>, Error> {
        match &self.changelog {
            Some(c) => c.append(partition, changes, true),
            None => Err(fatal("nats.changelog-stream is off".into())),
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
                None => Err(fatal("nats.changelog-stream is off".into())),
            }
        })
    }

    async fn dead_letter(&self, record: &InputRecord, reason: &str) -> Result<(), Error> {
        let mut headers = HeaderMap::new();
        let id = format!("dlq:{}:{}", self.input_stream, record.offset);
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
        headers.insert(DLQ_REASON_HEADER, reason);
        headers.insert(DLQ_SOURCE_TOPIC_HEADER, &*self.input_stream);
        headers.insert(
            DLQ_SOURCE_PARTITION_HEADER,
            record.partition.to_string().as_str(),
        );
        headers.insert(DLQ_SOURCE_OFFSET_HEADER, record.offset.to_string().as_str());
        headers.insert(
            DLQ_SOURCE_TIMESTAMP_HEADER,
            record.timestamp_ms.to_string().as_str(),
        );
        if let Some(key) = &record.key {
            // Header values are one line of text: a key that is not UTF-8 is shown lossily.
            let key = String::from_utf8_lossy(key).replace(['\r', '\n'], " ");
            headers.insert(KEY_HEADER, key.as_str());
        }
        self.send(
            self.dead_letter_subject.to_string(),
            headers,
            Bytes::copy_from_slice(&record.payload),
        )
        .await
    }
}

/// Publishes one upload for session key `key` (`tenant/session`) to its partition's subject
/// `<prefix>.<partition_for_key(key)>` with header `settle-key` when `key_header` (it is
/// optional: settle takes the key from the body, SEMANTICS §2), and `Nats-Msg-Id` =
/// `msg_id` if given, so JetStream drops a retried publish it already stored; returns
/// the partition and the publish-ack future (await it for the stream sequence). The message
/// is handed to the client in call order, so uploads of one session keep their order.
///
/// Errors: the client refused the message (too large, connection closed, too many publishes
/// awaiting their acks past the timeout).
pub async fn publish_upload(
    js: &jetstream::Context,
    prefix: &str,
    partitions: u32,
    key: &str,
    json: &[u8],
    msg_id: Option<&str>,
    key_header: bool,
) -> anyhow::Result<(i32, PublishAckFuture)> {
    let partition = partition_for_key(key.as_bytes(), partitions);
    let mut headers = HeaderMap::new();
    if key_header {
        headers.insert(KEY_HEADER, key);
    }
    if let Some(id) = msg_id {
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    }
    let publish = PublishMessage::build()
        .headers(headers)
        .payload(Bytes::copy_from_slice(json));
    let ack = js
        .send_publish(format!("{prefix}.{partition}"), publish)
        .await
        .with_context(|| format!("publish {key}"))?;
    Ok((partition, ack))
}
