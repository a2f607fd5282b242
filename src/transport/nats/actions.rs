//! The NATS [`ActionChannel`] (SEMANTICS §7): an operator action record is published to the
//! input subject of the partition its session hashes to (`key_partition`: settle decides
//! NATS partitions), a bulk one to every partition's subject; audit records go to the
//! subject `settle-audit.<input-stream>` of the stream `<input-stream>_AUDIT` (for a
//! deployment other than the default one, `settle-audit.<input-stream>.<consumer-prefix>`
//! of `<input-stream>_<consumer-prefix>_AUDIT`: [`NatsActions::audit_names`]; created at
//! start when missing, with the input stream's storage, replicas and max age), read back
//! by every instance from about 24 h ago with an ephemeral consumer.

use super::{partition_for_key, unavailable, JetStreamSettings, NatsConfig, KEY_HEADER};
use crate::transport::{ActionChannel, Error};
use async_nats::jetstream::consumer::{pull, DeliverPolicy};
use async_nats::jetstream::{self, message::PublishMessage};
use async_nats::HeaderMap;
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::StreamExt;
use std::sync::Arc;

/// The NATS action channel of one deployment (module docs). Cheap to clone.
#[derive(Clone)]
pub struct NatsActions {
    js: jetstream::Context,
    config: Arc<NatsConfig>,
    subject: Arc<str>,
    stream: Arc<str>,
}

impl NatsActions {
    /// The audit subject and stream of `config`'s deployment: `settle-audit.<input-stream>`
    /// and `<input-stream>_AUDIT` for the default deployment
    /// ([`NatsConfig::is_default_deployment`]), else
    /// `settle-audit.<input-stream>.<consumer-prefix>` and
    /// `<input-stream>_<consumer-prefix>_AUDIT`, so two deployments reading one input
    /// stream keep their audits apart.
    pub fn audit_names(config: &NatsConfig) -> (String, String) {
        if config.is_default_deployment() {
            (
                format!("settle-audit.{}", config.input_stream),
                format!("{}_AUDIT", config.input_stream),
            )
        } else {
            (
                format!(
                    "settle-audit.{}.{}",
                    config.input_stream, config.consumer_prefix
                ),
                format!("{}_{}_AUDIT", config.input_stream, config.consumer_prefix),
            )
        }
    }

    /// A channel over `js` for `config`'s deployment.
    pub fn new(js: jetstream::Context, config: &NatsConfig) -> Self {
        let (subject, stream) = Self::audit_names(config);
        NatsActions {
            js,
            config: Arc::new(config.clone()),
            subject: subject.into(),
            stream: stream.into(),
        }
    }

    /// The audit subject.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Creates the audit stream unless it exists.
    ///
    /// Errors: the server refuses it or does not answer.
    pub async fn ensure_audit_stream(&self) -> Result<(), Error> {
        let wanted = self
            .config
            .stream_config(&self.stream, vec![self.subject.to_string()]);
        self.js
            .get_or_create_stream(wanted)
            .await
            .map(|_| ())
            .map_err(|e| unavailable(format!("audit stream {}: {e}", self.stream)))
    }

    async fn publish(&self, subject: String, key: &str, payload: Vec<u8>) -> Result<(), Error> {
        let mut headers = HeaderMap::new();
        headers.insert(KEY_HEADER, key);
        let ack = self
            .js
            .send_publish(
                subject.clone(),
                PublishMessage::build()
                    .headers(headers)
                    .payload(Bytes::from(payload)),
            )
            .await
            .map_err(|e| unavailable(format!("publish to {subject}: {e}")))?;
        ack.await
            .map(|_| ())
            .map_err(|e| unavailable(format!("publish to {subject}: {e}")))
    }
}

impl ActionChannel for NatsActions {
    fn partitions(&self) -> BoxFuture<'_, Result<i32, Error>> {
        let n = self.config.partitions as i32;
        Box::pin(async move { Ok(n) })
    }

    fn key_partition(&self, key: &str) -> Option<i32> {
        Some(partition_for_key(key.as_bytes(), self.config.partitions))
    }

    fn send(
        &self,
        partition: i32,
        key: &str,
        payload: Vec<u8>,
        _timestamp_ms: i64,
    ) -> BoxFuture<'_, Result<(), Error>> {
        let key = key.to_owned();
        Box::pin(async move {
            self.publish(self.config.input_subject(partition), &key, payload)
                .await
        })
    }

    fn publish_audit(&self, key: &str, payload: Vec<u8>) -> BoxFuture<'_, Result<(), Error>> {
        let key = key.to_owned();
        Box::pin(async move { self.publish(self.subject.to_string(), &key, payload).await })
    }

    fn tail_audit(
        &self,
        since_ms: i64,
        each: crate::transport::AuditCallback,
    ) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            let stream = self
                .js
                .get_stream(&*self.stream)
                .await
                .map_err(|e| unavailable(format!("audit stream {}: {e}", self.stream)))?;
            let start =
                time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(since_ms) * 1_000_000)
                    .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
            let consumer = stream
                .create_consumer(pull::OrderedConfig {
                    filter_subject: self.subject.to_string(),
                    deliver_policy: DeliverPolicy::ByStartTime { start_time: start },
                    ..pull::OrderedConfig::default()
                })
                .await
                .map_err(|e| unavailable(format!("audit reader: {e}")))?;
            let mut messages = consumer
                .messages()
                .await
                .map_err(|e| unavailable(format!("audit reader: {e}")))?;
            while let Some(m) = messages.next().await {
                match m {
                    Ok(m) => each(&m.payload),
                    Err(e) => return Err(unavailable(format!("audit reader: {e}"))),
                }
            }
            Err(unavailable("audit reader ended".into()))
        })
    }
}
