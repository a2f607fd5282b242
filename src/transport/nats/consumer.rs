//! The static assignment as the [`Source`] ([`NatsSource`]) and one durable pull consumer per
//! owned partition as the [`PartitionInput`] ([`NatsInput`]): binding, no-wait fetches, the
//! position and the acks held until durable, and the check at assignment that the stream
//! reaches the offset the store holds (module docs of `crate::transport::nats`).

use super::partition_for_key;
use super::{
    ensure_streams, fatal, unavailable, JetStreamSettings, NatsConfig, CALL_TIMEOUT,
    IDLE_FETCH_INTERVAL, KEY_HEADER, MAX_FETCH, TRANSPORT,
};
use crate::config::tiers::TiersConfig;
use crate::transport::{
    Error, InputBatch, InputRecord, KeyRule, PartitionInput, Source, SourceEvent,
};
use async_nats::header::HeaderName;
use async_nats::jetstream;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::Subject;
use bytes::Bytes;
use futures::StreamExt;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// [`Source`] of the static assignment: at the first call it creates the streams if missing
/// and hands out one [`NatsInput`] per owned partition; then it never changes anything.
pub struct NatsSource {
    js: jetstream::Context,
    config: Arc<NatsConfig>,
    tiers: TiersConfig,
    assigned: bool,
}

impl NatsSource {
    /// A source over `js` for the partitions `config` assigns to this instance; the streams
    /// are those of `config` and `tiers`.
    pub fn new(js: jetstream::Context, config: &NatsConfig, tiers: &TiersConfig) -> Self {
        NatsSource {
            js,
            config: Arc::new(config.clone()),
            tiers: tiers.clone(),
            assigned: false,
        }
    }
}

impl Source for NatsSource {
    type Input = NatsInput;

    async fn next_event(&mut self) -> Result<Option<SourceEvent<NatsInput>>, Error> {
        if self.assigned {
            // Static assignment: nothing ever changes. Pending (not ending) keeps the runtime
            // quiet until shutdown drops this future.
            std::future::pending::<()>().await;
        }
        ensure_streams(&self.js, &self.config, &self.tiers).await?;
        let inputs: Vec<NatsInput> = self
            .config
            .owned_partitions()
            .into_iter()
            .map(|p| NatsInput::new(self.js.clone(), Arc::clone(&self.config), p))
            .collect();
        tracing::info!(
            stream = %self.config.input_stream,
            instance = self.config.instance,
            instances = self.config.instances,
            partitions = ?self.config.owned_partitions(),
            "nats: partitions assigned (static)"
        );
        self.assigned = true;
        Ok(Some(SourceEvent::Assigned(inputs)))
    }
}

// ---------------------------------------------------------------------------------------------
// Partition input

/// [`PartitionInput`] of one partition: its durable pull consumer, the position, and the
/// ack subjects of messages handed out and not yet durable (module docs: offsets and acks).
pub struct NatsInput {
    js: jetstream::Context,
    config: Arc<NatsConfig>,
    partition: i32,
    /// The bound consumer; `None`: bind before the next fetch.
    consumer: Option<PullConsumer>,
    /// Consumer sequence of the last delivery received from the bound consumer.
    seen: u64,
    /// Next stream sequence to hand out; `None` until known (bind, seek).
    position: Option<u64>,
    /// Stream sequences below this are durable in the store (acked or to be acked).
    committed: u64,
    /// Ack subjects of messages handed out and not yet committed, by stream sequence.
    acks: VecDeque<(u64, Subject)>,
    /// Pending count of the last fetch that told it: messages after the last one handed
    /// out (`PartitionInput::lag`).
    lag: Option<u64>,
    /// Redeliveries below the position dropped since the last poll returned
    /// (`InputBatch::skipped`).
    skipped: u64,
    /// The partition's ack sender ([`NatsInput::commit`]): a task that publishes the acks of
    /// committed messages in order, so the partition task never waits on them.
    acker: Option<mpsc::UnboundedSender<Vec<Subject>>>,
}

/// Publishes the ack subjects it receives, in order, on `client`. An ack that fails is
/// only logged: its message comes back after `nats.ack-wait`, lies below the partition's
/// position then and is dropped (and acked) as a redelivery.
async fn ack_task(
    client: async_nats::Client,
    partition: i32,
    mut batches: mpsc::UnboundedReceiver<Vec<Subject>>,
) {
    while let Some(batch) = batches.recv().await {
        for reply in batch {
            match tokio::time::timeout(CALL_TIMEOUT, client.publish(reply, Bytes::new())).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(partition, error = %e, "nats: ack not sent; the message comes back after ack-wait and is dropped as applied")
                }
                Err(_) => {
                    tracing::debug!(partition, "nats: ack timed out; the message comes back after ack-wait and is dropped as applied")
                }
            }
        }
    }
}

/// How a fetch ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FetchEnd {
    /// The server has nothing more for the consumer right now.
    Drained,
    /// As many messages as asked for came; the last one's pending count says the rest.
    Full,
    /// Stopped on an error or a gap; nothing is known about what is left.
    Broken,
}

impl NatsInput {
    fn new(js: jetstream::Context, config: Arc<NatsConfig>, partition: i32) -> Self {
        NatsInput {
            js,
            config,
            partition,
            consumer: None,
            seen: 0,
            position: None,
            committed: 0,
            acks: VecDeque::new(),
            lag: None,
            skipped: 0,
            acker: None,
        }
    }

    fn durable(&self) -> String {
        self.config.consumer_name(self.partition)
    }

    /// Binds to the partition's durable consumer, keeping it when it has nothing
    /// outstanding and has not delivered past the position, re-creating it at the position
    /// otherwise (module docs).
    async fn bind(&mut self) -> Result<(), Error> {
        use async_nats::jetstream::context::ConsumerInfoErrorKind;
        let stream = self
            .js
            .get_stream_no_info(&self.config.input_stream)
            .await
            .map_err(|e| fatal(format!("stream {}: {e}", self.config.input_stream)))?;
        let name = self.durable();
        let info = match stream.consumer_info(&name).await {
            Ok(info) => Some(info),
            Err(e) => match e.kind() {
                ConsumerInfoErrorKind::NotFound => None,
                _ => return Err(unavailable(format!("consumer {name}: {e}"))),
            },
        };
        let wanted = self.config.consumer_config(self.partition, self.position);
        let keep = info.as_ref().filter(|i| {
            let c = &i.config;
            c.filter_subject == wanted.filter_subject
                && c.ack_policy == wanted.ack_policy
                && c.ack_wait == wanted.ack_wait
                && c.max_ack_pending == wanted.max_ack_pending
                && i.num_ack_pending == 0
                && self
                    .position
                    .is_none_or(|p| i.delivered.stream_sequence < p)
        });
        let consumer = match keep {
            Some(i) => {
                tracing::debug!(
                    partition = self.partition,
                    consumer = %name,
                    delivered = i.delivered.consumer_sequence,
                    delivered_stream = i.delivered.stream_sequence,
                    ack_floor = i.ack_floor.stream_sequence,
                    position = ?self.position,
                    "nats: consumer kept"
                );
                self.seen = i.delivered.consumer_sequence;
                let start = *self.position.get_or_insert(i.ack_floor.stream_sequence + 1);
                self.committed = self.committed.max(start);
                PullConsumer::new(wanted, i.clone(), self.js.clone())
            }
            None => {
                // Where to start: the position, else after what the old consumer had acked.
                let start = self
                    .position
                    .or_else(|| info.as_ref().map(|i| i.ack_floor.stream_sequence + 1))
                    .unwrap_or(1);
                if info.is_some() {
                    if let Err(e) = stream.delete_consumer(&name).await {
                        return Err(unavailable(format!("cannot delete consumer {name}: {e}")));
                    }
                }
                let consumer = stream
                    .create_consumer(self.config.consumer_config(self.partition, Some(start)))
                    .await
                    .map_err(|e| unavailable(format!("cannot create consumer {name}: {e}")))?;
                tracing::info!(
                    partition = self.partition,
                    consumer = %name,
                    start_sequence = start,
                    "nats: consumer (re)created at the position"
                );
                self.seen = 0;
                self.position = Some(start);
                self.committed = self.committed.max(start);
                // Acks for the old consumer are moot: the new one starts after them.
                self.acks.clear();
                consumer
            }
        };
        self.consumer = Some(consumer);
        Ok(())
    }

    /// Asks for up to `max` messages with a no-wait pull request (the server answers at once
    /// with what it has); appends the new ones to `out` and records their acks.
    async fn fetch(
        &mut self,
        out: &mut Vec<InputRecord>,
        max: usize,
        pending: &mut Option<u64>,
    ) -> Result<FetchEnd, Error> {
        let Some(consumer) = self.consumer.clone() else {
            return Ok(FetchEnd::Broken);
        };
        let deadline = Instant::now() + CALL_TIMEOUT;
        let mut batch = match consumer.fetch().max_messages(max).messages().await {
            Ok(b) => b,
            Err(e) => {
                self.consumer = None;
                return Err(unavailable(format!("fetch: {e}")));
            }
        };
        let mut received = 0;
        loop {
            let next = match tokio::time::timeout_at(deadline, batch.next()).await {
                Ok(next) => next,
                Err(_) => {
                    // Deliveries may be under way to an inbox that is about to go away.
                    self.consumer = None;
                    return self.broken(out, "fetch timed out".to_owned());
                }
            };
            let message = match next {
                None => {
                    if received < max {
                        *pending = Some(0);
                        return Ok(FetchEnd::Drained);
                    }
                    return Ok(FetchEnd::Full);
                }
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    let text = e.to_string();
                    if text.contains("MaxAckPending") {
                        // Too much handed out and not yet committed: the next commit frees it.
                        return Ok(FetchEnd::Broken);
                    }
                    self.consumer = None;
                    return self.broken(out, format!("fetch: {text}"));
                }
            };
            received += 1;
            let info = match message.info() {
                Ok(i) => (
                    i.stream_sequence,
                    i.consumer_sequence,
                    i.pending,
                    (i.published.unix_timestamp_nanos() / 1_000_000) as i64,
                ),
                Err(e) => {
                    self.consumer = None;
                    return self.broken(out, format!("message without JetStream metadata: {e}"));
                }
            };
            let (sseq, cseq, left, timestamp_ms) = info;
            if cseq != self.seen + 1 {
                tracing::warn!(
                    partition = self.partition,
                    expected = self.seen + 1,
                    got = cseq,
                    "nats: deliveries were lost in transit; rebinding the consumer"
                );
                self.consumer = None;
                return Ok(FetchEnd::Broken);
            }
            self.seen = cseq;
            *pending = Some(left);
            let message = message.message;
            let position = self.position.unwrap_or(0);
            if sseq < position {
                // A redelivery of something handed out before: counted, and logged once per
                // poll (`NatsInput::poll`).
                self.skipped += 1;
                if sseq < self.committed {
                    if let Some(reply) = message.reply {
                        // Not fatal for this fetch: unacked, it comes back after ack-wait.
                        if let Err(e) = self.send_ack(reply).await {
                            tracing::debug!(partition = self.partition, sseq, error = %e, "nats: ack of a redelivery failed");
                        }
                    }
                }
                continue;
            }
            if let Some(reply) = message.reply {
                self.acks.push_back((sseq, reply));
            }
            self.position = Some(sseq + 1);
            let key = message
                .headers
                .as_ref()
                // A static name: `get(&str)` would validate and copy the name per message.
                .and_then(|h| h.get(HeaderName::from_static(KEY_HEADER)))
                .map(|v| Bytes::copy_from_slice(v.as_str().as_bytes()));
            out.push(InputRecord {
                partition: self.partition,
                offset: sseq as i64,
                key,
                payload: message.payload,
                timestamp_ms,
            });
        }
    }

    /// Ends a fetch that failed: the records received so far are good (contiguous); an error
    /// only when there are none.
    fn broken(&self, out: &[InputRecord], reason: String) -> Result<FetchEnd, Error> {
        tracing::debug!(partition = self.partition, reason, "nats: fetch cut short");
        if out.is_empty() {
            Err(unavailable(reason))
        } else {
            Ok(FetchEnd::Broken)
        }
    }

    /// Fails with [`Error::started_over`] when the input stream's last sequence is below
    /// `next - 1`, the last sequence the store applied for this partition: the stream was
    /// deleted and re-created (or lost), and a consumer created at `next` would skip every
    /// new message of the partition below it. JetStream's stream state is exact (no
    /// watermark lag), so one look decides.
    ///
    /// Errors: [`Error::Unavailable`] when the server does not answer (the runtime retries the
    /// seek); [`Error::Fatal`] as above.
    async fn check_stream_end(&self, next: u64) -> Result<(), Error> {
        let stream_name = &self.config.input_stream;
        let stream = self
            .js
            .get_stream(stream_name)
            .await
            .map_err(|e| unavailable(format!("stream {stream_name}: {e}")))?;
        let end = stream.cached_info().state.last_sequence + 1;
        if next > end {
            return Err(Error::started_over(
                TRANSPORT,
                stream_name,
                self.partition,
                end as i64,
                next as i64,
            ));
        }
        Ok(())
    }

    /// Publishes one ack (`+ACK` is an empty body on a JetStream ack subject).
    async fn send_ack(&self, reply: Subject) -> Result<(), Error> {
        let client = self.js.client();
        match tokio::time::timeout(CALL_TIMEOUT, client.publish(reply, Bytes::new())).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(unavailable(format!("ack: {e}"))),
            Err(_) => Err(unavailable("ack timed out".to_owned())),
        }
    }
}

impl Drop for NatsInput {
    /// Hands back every message delivered and not acked (`-NAK`), so JetStream redelivers it
    /// at once to whoever reads the partition next instead of after `nats.ack-wait`. What
    /// this matters for: a process fenced by a second one with the same index (the two read
    /// through one durable consumer, and the first may have fetched from the consumer the
    /// second re-created before its fence took effect); without it, those uploads reach the
    /// new owner only after `ack-wait` (5 min by default). A message the new owner already
    /// has (restored from the changelog) is below its offset and skipped. Best effort: sent
    /// on the runtime if there is one.
    fn drop(&mut self) {
        if self.acks.is_empty() {
            return;
        }
        let acks = std::mem::take(&mut self.acks);
        let client = self.js.client();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                for (_, reply) in acks {
                    let _ = client.publish(reply, Bytes::from_static(b"-NAK")).await;
                }
                let _ = client.flush().await;
            });
        }
    }
}

impl PartitionInput for NatsInput {
    fn topic(&self) -> &str {
        &self.config.input_stream
    }

    fn partition(&self) -> i32 {
        self.partition
    }

    async fn seek(&mut self, next_offset: i64) -> Result<(), Error> {
        let next = next_offset.max(1) as u64;
        self.check_stream_end(next).await?;
        self.position = Some(next);
        self.committed = next;
        self.acks.clear();
        self.consumer = None;
        self.bind().await?;
        tracing::debug!(
            partition = self.partition,
            next_offset,
            "nats: input positioned"
        );
        Ok(())
    }

    async fn poll(&mut self, max: usize, wait: Duration) -> Result<InputBatch, Error> {
        if self.consumer.is_none() {
            self.bind().await?;
        }
        let max = max.clamp(1, MAX_FETCH);
        let deadline = Instant::now() + wait;
        let mut records = Vec::new();
        let mut pending = None;
        let end = loop {
            let end = self.fetch(&mut records, max, &mut pending).await?;
            let now = Instant::now();
            if !records.is_empty() || end != FetchEnd::Drained || now >= deadline {
                break end;
            }
            tokio::time::sleep((deadline - now).min(IDLE_FETCH_INTERVAL)).await;
        };
        if records.is_empty() && end == FetchEnd::Broken {
            // Too much delivered and not yet committed (or a rebind is due): do not spin.
            tokio::time::sleep(wait.min(Duration::from_millis(50))).await;
        }
        let caught_up = end != FetchEnd::Broken && pending == Some(0);
        tracing::trace!(
            partition = self.partition,
            records = records.len(),
            first = records.first().map(|r| r.offset),
            last = records.last().map(|r| r.offset),
            ?end,
            ?pending,
            ?wait,
            "nats: poll"
        );
        if pending.is_some() {
            self.lag = pending;
        }
        let skipped = std::mem::take(&mut self.skipped);
        if skipped > 0 {
            tracing::info!(
                partition = self.partition,
                skipped,
                position = ?self.position,
                "nats: redeliveries below the partition's next offset dropped as applied already (settle_input_skipped_total)"
            );
        }
        Ok(InputBatch {
            records,
            caught_up,
            skipped,
        })
    }

    fn lag(&self) -> Option<u64> {
        self.lag
    }

    fn key_partition(&self, key: &[u8]) -> Option<i32> {
        Some(partition_for_key(key, self.config.partitions))
    }

    fn key_rule(&self) -> KeyRule {
        KeyRule::Optional
    }

    /// Hands the ack of the last message below `next_offset` (under ack policy "all" it
    /// acknowledges every message before it) to the partition's ack task ([`ack_task`])
    /// without waiting for it to be sent: on one connection shared by
    /// every partition, publishing hundreds of acks inline held the partition's loop (and
    /// its timers) for tens of milliseconds a commit (issue 33's NATS soak).
    async fn commit(&mut self, next_offset: i64) -> Result<(), Error> {
        let next = next_offset.max(0) as u64;
        self.committed = self.committed.max(next);
        // Ack policy "all": the last message below `next` acknowledges every one before it
        // (module docs of `transport::nats`: offsets and acks).
        let mut last = None;
        while self.acks.front().is_some_and(|(seq, _)| *seq < next) {
            last = self.acks.pop_front().map(|(_, reply)| reply);
        }
        let Some(last) = last else {
            return Ok(());
        };
        let batch = vec![last];
        let acker = self.acker.get_or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(ack_task(self.js.client(), self.partition, rx));
            tx
        });
        if let Err(mpsc::error::SendError(batch)) = acker.send(batch) {
            // The task is gone (the runtime is stopping): send them here.
            self.acker = None;
            for reply in batch {
                self.send_ack(reply).await?;
            }
        }
        Ok(())
    }
}
