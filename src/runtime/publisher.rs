//! The outbox publisher of one partition: a task that receives owed emissions (read from the
//! store's outbox by the partition task), publishes them through the [`Sink`] with up to
//! `window` in flight, and reports each acknowledged sequence number back. Only the partition
//! task writes the store, so the outbox entry is deleted there, after the ack (ARCHITECTURE:
//! "outbox, then publish"; SEMANTICS §6 no lost emission).
//!
//! The ready record gets `emitted_at` = the wall clock when it is sent and the tier's topic
//! (until tiers are wired in, every emission goes to tier `normal` on the configured output
//! topic). A failed publish is retried with backoff, failed entries first and in sequence
//! order; while any entry waits for a retry no new entry is started, so an unavailable
//! broker sees one retry round per backoff rather than the whole outbox.

use super::clock::Clock;
use crate::codec;
use crate::store::OutboxEntry;
use crate::transport::{Backoff, ReadyMessage, Sink};
use futures::stream::{FuturesUnordered, StreamExt};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::mpsc;

/// Where and how one partition's emissions are published.
#[derive(Clone, Debug)]
pub struct PublishTarget {
    /// Output topic.
    pub topic: String,
    /// Tier name written in each record.
    pub tier: String,
    /// Most publishes in flight at once (≥ 1).
    pub window: usize,
    /// Longest backoff between retries.
    pub max_backoff: Duration,
}

/// Runs until `entries` is closed and everything received is acknowledged (or until the
/// task is aborted: the partition task aborts it at the shutdown deadline; whatever is not
/// acknowledged stays in the outbox and is published again after a restart).
pub async fn run<K: Sink, C: Clock>(
    sink: K,
    clock: C,
    target: PublishTarget,
    mut entries: mpsc::Receiver<OutboxEntry>,
    acks: mpsc::UnboundedSender<u64>,
) {
    let sink = &sink;
    let target = &target;
    let clock = &clock;
    let publish = |entry: OutboxEntry| async move {
        let e = &entry.emission;
        let message = ReadyMessage {
            topic: target.topic.clone(),
            tier: target.tier.clone(),
            key: e.key.to_string(),
            emission_id: e.emission_id(),
            payload: codec::encode_ready(e, clock.now_ms(), &target.tier),
        };
        let result = sink.publish(message).await;
        (entry, result)
    };
    let mut in_flight = FuturesUnordered::new();
    let mut retry: BTreeMap<u64, OutboxEntry> = BTreeMap::new();
    let mut backoff = Backoff::new(target.max_backoff);
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut open = true;
    loop {
        let can_start = open && retry.is_empty() && in_flight.len() < target.window.max(1);
        if !open && in_flight.is_empty() && retry.is_empty() {
            return;
        }
        tokio::select! {
            received = entries.recv(), if can_start => match received {
                Some(entry) => in_flight.push(publish(entry)),
                None => open = false,
            },
            Some((entry, result)) = in_flight.next(), if !in_flight.is_empty() => match result {
                Ok(()) => {
                    backoff.reset();
                    if acks.send(entry.seq).is_err() {
                        // The partition task is gone; nothing can be deleted any more.
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!(
                        emission_id = %entry.emission.emission_id(),
                        error = %e,
                        retryable = e.is_retryable(),
                        "publish failed; will retry"
                    );
                    retry.insert(entry.seq, entry);
                    if retry_at.is_none() {
                        retry_at = Some(tokio::time::Instant::now() + backoff.next_delay());
                    }
                }
            },
            () = sleep_until(retry_at), if retry_at.is_some() && in_flight.is_empty() => {
                retry_at = None;
                for (_, entry) in std::mem::take(&mut retry) {
                    in_flight.push(publish(entry));
                }
            },
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
