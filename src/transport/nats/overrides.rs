//! The overrides bucket ([`OverridesBucket`], an [`OverrideStore`]): the JetStream KV bucket
//! `nats.overrides-bucket` (default `SETTLE_OVERRIDES`, history 1, no expiry) that holds the
//! deployment's tenant overrides (SEMANTICS §7, `runtime::overrides`), key = the tenant
//! ([`override_key`]). Created at first use if missing, with `nats.storage` and
//! `nats.replicas`.
//!
//! * **Write**: `update(key, value, revision)` with the revision the writer last read (0:
//!   the key must not exist): the server refuses a write against a stale revision, so two
//!   writers of one version cannot both succeed.
//! * **Feed**: a watch of new values is opened first, then every key's latest value is read
//!   (`keys` + `entry`), then `CaughtUp`, then the watch: nothing written meanwhile is missed
//!   (a value seen twice changes nothing).

use super::tier_counts::{open_bucket, BucketSpec};
use super::{unavailable, NatsConfig, Storage};
use crate::transport::{
    Error, OverrideEntry, OverrideEvent, OverrideFeed, OverrideStore, OverrideWriteError,
};
use async_nats::jetstream::{self, kv};
use futures::future::BoxFuture;
use futures::StreamExt;
use std::collections::VecDeque;
use std::time::Duration;
use tokio::sync::Mutex;

/// Bound on reading every key at start.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The NATS [`OverrideStore`] (see the module doc).
pub struct OverridesBucket {
    js: jetstream::Context,
    bucket: String,
    storage: Storage,
    replicas: usize,
    store: Mutex<Option<kv::Store>>,
}

impl OverridesBucket {
    /// The overrides bucket of `config`, `None` when overrides are off (`""`). Nothing is
    /// asked of the server until first use.
    pub fn new(js: jetstream::Context, config: &NatsConfig) -> Option<Self> {
        let bucket = config.overrides()?.to_owned();
        Some(OverridesBucket {
            js,
            bucket,
            storage: config.storage,
            replicas: config.replicas as usize,
            store: Mutex::new(None),
        })
    }

    /// The bucket, opened (created if missing) on first use and again after a failure.
    ///
    /// Errors: [`Error::Unavailable`].
    async fn store(&self) -> Result<kv::Store, Error> {
        let mut cached = self.store.lock().await;
        if let Some(store) = &*cached {
            return Ok(store.clone());
        }
        let opened = open_bucket(
            &self.js,
            &BucketSpec {
                bucket: &self.bucket,
                description: "settle: tenant overrides (SEMANTICS §7), key = tenant",
                max_age: Duration::ZERO,
                storage: self.storage,
                replicas: self.replicas,
                key: "nats.overrides-bucket",
                what: "overrides",
            },
        )
        .await?;
        *cached = Some(opened.clone());
        Ok(opened)
    }

    async fn forget(&self) {
        *self.store.lock().await = None;
    }
}

/// `tenant` as a KV key: KV keys are `[-/_=.A-Za-z0-9]+` without empty tokens, a tenant is
/// `[A-Za-z0-9._:-]+`; `=` (never in a tenant) escapes: `.` → `=2E`, `:` → `=3A`. One to one.
pub fn override_key(tenant: &str) -> String {
    let mut key = String::with_capacity(tenant.len() + 8);
    for c in tenant.chars() {
        match c {
            '.' => key.push_str("=2E"),
            ':' => key.push_str("=3A"),
            c => key.push(c),
        }
    }
    if key.is_empty() {
        key.push('=');
    }
    key
}

impl OverrideStore for OverridesBucket {
    fn name(&self) -> &str {
        &self.bucket
    }

    fn compares_revisions(&self) -> bool {
        true
    }

    fn put(
        &self,
        tenant: &str,
        value: Vec<u8>,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, OverrideWriteError>> {
        let key = override_key(tenant);
        Box::pin(async move {
            let store = self.store().await?;
            match store.update(&key, value.into(), expected).await {
                Ok(revision) => Ok(revision),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    Err(OverrideWriteError::Conflict { expected })
                }
                Err(e) => {
                    self.forget().await;
                    Err(unavailable(format!("overrides put to {}: {e}", self.bucket)).into())
                }
            }
        })
    }

    fn subscribe(&self) -> BoxFuture<'_, Result<Box<dyn OverrideFeed>, Error>> {
        Box::pin(async move {
            let read = async {
                let store = self.store().await?;
                // First the watch, then the read: nothing written in between is missed.
                let watch = store
                    .watch_all()
                    .await
                    .map_err(|e| unavailable(format!("overrides watch: {e}")))?;
                let mut keys = store
                    .keys()
                    .await
                    .map_err(|e| unavailable(format!("overrides keys: {e}")))?;
                let mut names = Vec::new();
                while let Some(k) = keys.next().await {
                    names.push(k.map_err(|e| unavailable(format!("overrides keys: {e}")))?);
                }
                let mut first = VecDeque::with_capacity(names.len() + 1);
                for k in names {
                    match store.entry(k).await {
                        Ok(Some(e)) if e.operation == kv::Operation::Put => {
                            first.push_back(OverrideEvent::Entry(OverrideEntry {
                                key: e.key,
                                value: e.value.to_vec(),
                                revision: e.revision,
                            }));
                        }
                        Ok(_) => {}
                        Err(e) => return Err(unavailable(format!("overrides get: {e}"))),
                    }
                }
                first.push_back(OverrideEvent::CaughtUp);
                Ok(Box::new(Watch { first, watch }) as Box<dyn OverrideFeed>)
            };
            let result = tokio::time::timeout(READ_TIMEOUT, read)
                .await
                .map_err(|_| {
                    unavailable(format!(
                        "overrides bucket {} not read within {} s",
                        self.bucket,
                        READ_TIMEOUT.as_secs()
                    ))
                })
                .and_then(|r| r);
            if result.is_err() {
                self.forget().await;
            }
            result
        })
    }
}

struct Watch {
    first: VecDeque<OverrideEvent>,
    watch: kv::Watch,
}

impl OverrideFeed for Watch {
    fn next(&mut self) -> BoxFuture<'_, Result<OverrideEvent, Error>> {
        Box::pin(async move {
            if let Some(e) = self.first.pop_front() {
                return Ok(e);
            }
            match self.watch.next().await {
                Some(Ok(e)) => Ok(OverrideEvent::Entry(OverrideEntry {
                    key: e.key,
                    value: if e.operation == kv::Operation::Put {
                        e.value.to_vec()
                    } else {
                        Vec::new()
                    },
                    revision: e.revision,
                })),
                Some(Err(e)) => Err(unavailable(format!("overrides watch: {e}"))),
                None => Err(unavailable("overrides watch ended".into())),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::override_key;

    #[test]
    fn tenants_become_kv_keys_one_to_one() {
        assert_eq!(override_key("acme"), "acme");
        assert_eq!(override_key("big.co:eu"), "big=2Eco=3Aeu");
        assert_eq!(override_key("a..b"), "a=2E=2Eb");
        assert_ne!(override_key("a.b"), override_key("a:b"));
        assert_eq!(override_key(".x"), "=2Ex");
    }
}
