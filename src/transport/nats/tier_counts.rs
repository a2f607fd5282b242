//! The tier-counts bucket ([`TierCountsBucket`], a [`TierCounts`]): a JetStream KV bucket
//! (`nats.tier-counts-bucket`, default `SETTLE_TIER_COUNTS`, history 1, values kept 24 h) where the instances
//! of one deployment exchange their per-tenant emission counts (SEMANTICS §5,
//! `tiers::share`), key = instance name. Created at first use if missing (and again if it is
//! deleted while settle runs), with `nats.storage` and `nats.replicas`.
//!
//! * **Publish**: `put(instance, snapshot)`.
//! * **Read at start**: every key, then the value of each (a deleted key is skipped).
//! * **Feed**: `watch_all` (new values only).
//!
//! KV keys are `[-/_=.A-Za-z0-9]+`: [`kv_key`] replaces anything else in an instance name.
//!
//! The bucket also holds each instance's partition assignment under
//! `assignment.<instance>` ([`ASSIGNMENT_PREFIX`], [`TierCountsBucket::put_assignment`],
//! [`TierCountsBucket::read_assignments`]; `service::assignments` checks them for partitions
//! nobody owns); the tier-count reads and the feed skip those keys.

use super::{unavailable, NatsConfig, Storage};
use crate::transport::{Error, TierCounts, TierCountsFeed};
use async_nats::jetstream::{self, kv, stream};
use futures::future::BoxFuture;
use futures::StreamExt;
use std::time::Duration;
use tokio::sync::Mutex;

/// The NATS [`TierCounts`] (see the module doc).
pub struct TierCountsBucket {
    js: jetstream::Context,
    bucket: String,
    storage: Storage,
    replicas: usize,
    store: Mutex<Option<kv::Store>>,
}

/// Values older than this are dropped by the server: keys of instances long gone do not pile
/// up (every start is a new instance name), while a live instance rewrites its key every
/// share interval. 24 h, the longest `tiers.cooldown`.
const BUCKET_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

impl TierCountsBucket {
    /// The tier-counts bucket of `config`, `None` when sharing is off (`""`). Nothing is
    /// asked of the server until first use.
    pub fn new(js: jetstream::Context, config: &NatsConfig) -> Option<Self> {
        let bucket = config.tier_counts()?;
        Some(TierCountsBucket {
            js,
            bucket,
            storage: config.storage,
            replicas: config.replicas as usize,
            store: Mutex::new(None),
        })
    }

    /// The bucket: opened (created if missing) on first use, and again after a failure (a
    /// bucket deleted while settle runs is created anew).
    ///
    /// Errors: [`Error::Unavailable`] naming why it could be neither opened nor created (for
    /// example a stream `KV_<bucket>` that is not a KV bucket).
    async fn store(&self) -> Result<kv::Store, Error> {
        let mut cached = self.store.lock().await;
        if let Some(store) = &*cached {
            return Ok(store.clone());
        }
        let opened = open_bucket(
            &self.js,
            &BucketSpec {
                bucket: &self.bucket,
                description: "settle: each instance's tier counts (SEMANTICS §5)",
                max_age: BUCKET_MAX_AGE,
                storage: self.storage,
                replicas: self.replicas,
                key: "nats.tier-counts-bucket",
                what: "tier-counts",
            },
        )
        .await?;
        *cached = Some(opened.clone());
        Ok(opened)
    }

    /// Forgets the opened bucket after a failure, so the next use opens (or creates) it again.
    async fn forget(&self) {
        *self.store.lock().await = None;
    }
}

/// What [`open_bucket`] opens or creates.
pub(super) struct BucketSpec<'a> {
    /// The bucket name.
    pub bucket: &'a str,
    /// The KV stream's description.
    pub description: &'a str,
    /// How long values are kept (`Duration::ZERO`: forever).
    pub max_age: Duration,
    /// `nats.storage`.
    pub storage: Storage,
    /// `nats.replicas`.
    pub replicas: usize,
    /// The config key that names the bucket (in error messages).
    pub key: &'a str,
    /// What the bucket holds, for messages (`tier-counts`, `overrides`).
    pub what: &'a str,
}

/// Opens the KV bucket of `spec`, creating it (history 1) when missing.
///
/// Errors: [`Error::Unavailable`] naming why it could be neither opened nor created.
pub(super) async fn open_bucket(
    js: &jetstream::Context,
    spec: &BucketSpec<'_>,
) -> Result<kv::Store, Error> {
    match js.get_key_value(spec.bucket).await {
        Ok(store) => Ok(store),
        Err(open_error) => {
            // The KV stream made by hand: `create_key_value` first asks for the account
            // info, which async-nats cannot parse from a NATS 2.9 server.
            let wanted = stream::Config {
                name: format!("KV_{}", spec.bucket),
                description: Some(spec.description.into()),
                subjects: vec![format!("$KV.{}.>", spec.bucket)],
                max_messages_per_subject: 1,
                max_age: spec.max_age,
                storage: match spec.storage {
                    Storage::File => stream::StorageType::File,
                    Storage::Memory => stream::StorageType::Memory,
                },
                num_replicas: spec.replicas.max(1),
                allow_rollup: true,
                deny_delete: true,
                allow_direct: true,
                discard: stream::DiscardPolicy::New,
                ..stream::Config::default()
            };
            if let Err(create_error) = js.create_stream(wanted).await {
                return Err(unavailable(format!(
                    "{w} bucket {b} can be neither opened ({open_error}) nor created \
                     ({create_error}); if a stream KV_{b} exists that is not a KV bucket, \
                     remove it or set {k} to another name",
                    w = spec.what,
                    b = spec.bucket,
                    k = spec.key,
                )));
            }
            tracing::info!(bucket = %spec.bucket, "nats: {} bucket created", spec.what);
            js.get_key_value(spec.bucket)
                .await
                .map_err(|e| unavailable(format!("{} bucket {}: {e}", spec.what, spec.bucket)))
        }
    }
}

/// Key prefix of the assignment records in the bucket (module docs).
pub const ASSIGNMENT_PREFIX: &str = "assignment.";

impl TierCountsBucket {
    /// Writes `record` as instance `instance`'s assignment (`assignment.<instance>`).
    ///
    /// Errors: [`Error::Unavailable`] when the bucket cannot be opened or written.
    pub async fn put_assignment(&self, instance: &str, record: Vec<u8>) -> Result<(), Error> {
        let key = format!("{ASSIGNMENT_PREFIX}{}", kv_key(instance));
        let store = self.store().await?;
        if let Err(e) = store.put(key, record.into()).await {
            self.forget().await;
            return Err(unavailable(format!(
                "assignment put to {}: {e}",
                self.bucket
            )));
        }
        Ok(())
    }

    /// Every assignment record in the bucket (of live instances and of gone ones: the
    /// caller decides by their time).
    ///
    /// Errors: [`Error::Unavailable`] when the bucket cannot be read.
    pub async fn read_assignments(&self) -> Result<Vec<Vec<u8>>, Error> {
        self.values(true).await
    }

    /// The non-empty values of the assignment keys (`assignments`) or of every other key
    /// (the tier counts); a key deleted between listing and reading is skipped.
    ///
    /// Errors: [`Error::Unavailable`] when the bucket cannot be listed or read.
    async fn values(&self, assignments: bool) -> Result<Vec<Vec<u8>>, Error> {
        let store = self.store().await?;
        let what = if assignments {
            "assignment"
        } else {
            "tier-counts"
        };
        let mut keys = store
            .keys()
            .await
            .map_err(|e| unavailable(format!("{what} keys: {e}")))?;
        let mut names = Vec::new();
        while let Some(k) = keys.next().await {
            let k = k.map_err(|e| unavailable(format!("{what} keys: {e}")))?;
            if k.starts_with(ASSIGNMENT_PREFIX) == assignments {
                names.push(k);
            }
        }
        let mut out = Vec::with_capacity(names.len());
        for k in names {
            match store.get(k).await {
                Ok(Some(v)) if !v.is_empty() => out.push(v.to_vec()),
                Ok(_) => {}
                Err(e) => return Err(unavailable(format!("{what} get: {e}"))),
            }
        }
        Ok(out)
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
            match store.put(key, snapshot.into()).await {
                Ok(_) => Ok(()),
                Err(e) => {
                    self.forget().await;
                    Err(unavailable(format!(
                        "tier-counts put to {}: {e}",
                        self.bucket
                    )))
                }
            }
        })
    }

    fn read_latest(&self, timeout: Duration) -> BoxFuture<'_, Result<Vec<Vec<u8>>, Error>> {
        Box::pin(async move {
            let read = self.values(false);
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
                        if entry.operation == kv::Operation::Put
                            && !entry.value.is_empty()
                            && !entry.key.starts_with(ASSIGNMENT_PREFIX)
                        {
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
