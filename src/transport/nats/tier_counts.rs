//! The tier-counts bucket ([`TierCountsBucket`], a [`TierCounts`]): a JetStream KV bucket
//! (`nats.tier-counts-bucket`, default `SETTLE_TIER_COUNTS`, history 1) where the instances
//! of one deployment exchange their per-tenant emission counts (SEMANTICS §5,
//! `tiers::share`), key = instance name. Created at first use if missing, with `nats.storage`
//! and `nats.replicas`.
//!
//! * **Publish**: `put(instance, snapshot)`.
//! * **Read at start**: every key, then the value of each (a deleted key is skipped).
//! * **Feed**: `watch_all` (new values only).
//!
//! KV keys are `[-/_=.A-Za-z0-9]+`: [`kv_key`] replaces anything else in an instance name.

use super::{unavailable, NatsConfig, Storage};
use crate::transport::{Error, TierCounts, TierCountsFeed};
use async_nats::jetstream::{self, kv, stream};
use futures::future::BoxFuture;
use futures::StreamExt;
use std::time::Duration;
use tokio::sync::OnceCell;

/// The NATS [`TierCounts`] (see the module doc).
pub struct TierCountsBucket {
    js: jetstream::Context,
    bucket: String,
    storage: Storage,
    replicas: usize,
    store: OnceCell<kv::Store>,
}

impl TierCountsBucket {
    /// The tier-counts bucket of `config`, `None` when sharing is off (`""`). Nothing is
    /// asked of the server until first use.
    pub fn new(js: jetstream::Context, config: &NatsConfig) -> Option<Self> {
        let bucket = config.tier_counts()?.to_owned();
        Some(TierCountsBucket {
            js,
            bucket,
            storage: config.storage,
            replicas: config.replicas as usize,
            store: OnceCell::new(),
        })
    }

    /// The bucket, opened or created once.
    async fn store(&self) -> Result<&kv::Store, Error> {
        self.store
            .get_or_try_init(|| async {
                if let Ok(store) = self.js.get_key_value(&self.bucket).await {
                    return Ok(store);
                }
                // The KV stream made by hand: `create_key_value` first asks for the account
                // info, which async-nats cannot parse from a NATS 2.9 server.
                let wanted = stream::Config {
                    name: format!("KV_{}", self.bucket),
                    description: Some("settle: each instance's tier counts (SEMANTICS §5)".into()),
                    subjects: vec![format!("$KV.{}.>", self.bucket)],
                    max_messages_per_subject: 1,
                    storage: match self.storage {
                        Storage::File => stream::StorageType::File,
                        Storage::Memory => stream::StorageType::Memory,
                    },
                    num_replicas: self.replicas.max(1),
                    allow_rollup: true,
                    deny_delete: true,
                    allow_direct: true,
                    discard: stream::DiscardPolicy::New,
                    ..stream::Config::default()
                };
                if let Err(e) = self.js.create_stream(wanted).await {
                    tracing::debug!(error = %e, bucket = %self.bucket, "nats: creating the tier-counts bucket");
                }
                self.js
                    .get_key_value(&self.bucket)
                    .await
                    .map_err(|e| unavailable(format!("tier-counts bucket {}: {e}", self.bucket)))
            })
            .await
    }
}

/// `instance` as a KV key: every byte outside `[-_=.A-Za-z0-9]` becomes `_` (`/` too, so a
/// key is one token); empty becomes `_`.
pub fn kv_key(instance: &str) -> String {
    let key: String = instance
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '=' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let key = key.trim_matches('.').to_owned();
    if key.is_empty() {
        "_".to_owned()
    } else {
        key
    }
}

impl TierCounts for TierCountsBucket {
    fn name(&self) -> &str {
        &self.bucket
    }

    fn publish(&self, instance: &str, snapshot: Vec<u8>) -> BoxFuture<'_, Result<(), Error>> {
        let key = kv_key(instance);
        Box::pin(async move {
            let store = self.store().await?;
            store
                .put(key, snapshot.into())
                .await
                .map(|_| ())
                .map_err(|e| unavailable(format!("tier-counts put: {e}")))
        })
    }

    fn read_latest(&self, timeout: Duration) -> BoxFuture<'_, Result<Vec<Vec<u8>>, Error>> {
        Box::pin(async move {
            let read = async {
                let store = self.store().await?;
                let mut keys = store
                    .keys()
                    .await
                    .map_err(|e| unavailable(format!("tier-counts keys: {e}")))?;
                let mut names = Vec::new();
                while let Some(k) = keys.next().await {
                    names.push(k.map_err(|e| unavailable(format!("tier-counts keys: {e}")))?);
                }
                let mut out = Vec::with_capacity(names.len());
                for k in names {
                    match store.get(k).await {
                        Ok(Some(v)) if !v.is_empty() => out.push(v.to_vec()),
                        Ok(_) => {}
                        Err(e) => return Err(unavailable(format!("tier-counts get: {e}"))),
                    }
                }
                Ok(out)
            };
            tokio::time::timeout(timeout, read).await.map_err(|_| {
                unavailable(format!(
                    "tier-counts bucket {} not read within {} s",
                    self.bucket,
                    timeout.as_secs()
                ))
            })?
        })
    }

    fn subscribe(&self) -> BoxFuture<'_, Result<Box<dyn TierCountsFeed>, Error>> {
        Box::pin(async move {
            let store = self.store().await?;
            let watch = store
                .watch_all()
                .await
                .map_err(|e| unavailable(format!("tier-counts watch: {e}")))?;
            Ok(Box::new(Watch { watch }) as Box<dyn TierCountsFeed>)
        })
    }
}

struct Watch {
    watch: kv::Watch,
}

impl TierCountsFeed for Watch {
    fn next(&mut self) -> BoxFuture<'_, Result<Vec<u8>, Error>> {
        Box::pin(async move {
            loop {
                match self.watch.next().await {
                    Some(Ok(entry)) => {
                        if entry.operation == kv::Operation::Put && !entry.value.is_empty() {
                            return Ok(entry.value.to_vec());
                        }
                    }
                    Some(Err(e)) => return Err(unavailable(format!("tier-counts watch: {e}"))),
                    None => return Err(unavailable("tier-counts watch ended".into())),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::kv_key;

    #[test]
    fn instance_names_become_kv_keys() {
        assert_eq!(kv_key("host-a-4242"), "host-a-4242");
        assert_eq!(kv_key("pod/settle 0"), "pod_settle_0");
        assert_eq!(kv_key(""), "_");
        assert_eq!(kv_key(".x."), "x");
    }
}
