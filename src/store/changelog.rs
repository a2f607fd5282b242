//! The store side of the changelog (ARCHITECTURE "changelog"; SEMANTICS §6 "Single
//! writer"): every write the store makes to its column families can also be recorded as a
//! [`Change`], which the runtime appends to the changelog topic (same partition number as
//! the input partition, key = [`changelog_key`], value = the stored bytes, tombstone for a
//! delete). A new owner replays those records into an empty or stale store
//! ([`PartitionStore::restore`](super::PartitionStore::restore)) and so resumes with the
//! same sessions, timers, outbox and input offset. In write-behind mode a flush records what
//! it writes: each changed key's latest value, not every intermediate update.
//!
//! Timers have no records of their own: a key's timer is the prefix of its
//! `sessions` value, so it moves with the state (one record per changed key per flush).
//!
//! # Key
//!
//! `column family name ‖ 0x00 ‖ store key`: `sessions\0acme/run-7`, `outbox\0<seq>`,
//! `tenants\0acme`, `meta\0offset`. Column family names are ASCII without `0x00`, so the first
//! `0x00` splits the two. Compaction keeps the last value of each store key, which is what a
//! restore needs.
//!
//! # Order inside one store write
//!
//! Outbox entries first, then sessions, tenants, then `meta` (counters, partition time, offset, and
//! `writer`: the id of the store that wrote it) last. A changelog cut inside one write (the old owner died while producing it)
//! therefore holds an owed emission before the state that says it was emitted, and never an
//! input offset past state that is missing: the restored store re-applies the rest of that
//! input (at least once; the emission keeps its id).
//!
//! # What is local only
//!
//! These `meta` keys: `changelog_next` (the checkpoint: the changelog offset a restore continues from;
//! every record below it is in this store), `changelog_dirty` (1 while this store holds
//! writes that are not known to be in the changelog) and `writer_id` (a random id of this
//! store's lineage, regenerated when the store is wiped, sent as `meta\0writer` with every
//! write). A store that is clean at checkpoint `c` equals the changelog's records below `c`,
//! so a restore from `c` is exact. A dirty store (the process died before the changelog
//! acknowledged its last writes) is kept when every changelog record from `c` on was written
//! by itself (the changelog holds a prefix of its history: its state is written to the
//! changelog again as a snapshot), and wiped and restored when another writer appended since
//! (see `runtime::restore`).

use super::error::Error;
use super::keys::{printable, CF_META, COLUMN_FAMILIES};
use rocksdb::{WriteBatch, DB};

/// One recorded store write: `value = None` is a delete (a tombstone on the changelog).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    /// [`changelog_key`]: column family name, `0x00`, store key.
    pub key: Vec<u8>,
    /// The stored bytes, or `None` for a delete.
    pub value: Option<Vec<u8>>,
}

/// `meta` key of the checkpoint (local only): next changelog offset to read, 8 bytes BE.
pub(crate) const META_CHANGELOG_NEXT: &[u8] = b"changelog_next";
/// `meta` key of the dirty flag (local only): 8 bytes BE, 1 = writes not yet in the changelog.
pub(crate) const META_CHANGELOG_DIRTY: &[u8] = b"changelog_dirty";
/// `meta` key of this store lineage's writer id (local only): 8 bytes BE.
pub(crate) const META_WRITER_ID: &[u8] = b"writer_id";
/// `meta` key of the fingerprint of the debounce rules the store was last opened under
/// (local only, `engine::PolicyTable::fingerprint`): 8 bytes BE.
pub(crate) const META_RULES: &[u8] = b"rules";
/// `meta` key recorded with every write: the writer id of the store that wrote it, 8 bytes BE.
pub const META_WRITER: &[u8] = b"writer";

/// The changelog key of store key `key` in column family `cf`.
pub fn changelog_key(cf: &str, key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(cf.len() + 1 + key.len());
    k.extend_from_slice(cf.as_bytes());
    k.push(0);
    k.extend_from_slice(key);
    k
}

/// Splits a changelog key into `(column family, store key)`.
///
/// Errors: [`Error::Corrupt`] (reported under column family `changelog`) when the key has no
/// `0x00` or names a column family this build does not have (a changelog written by a newer
/// layout), or names a local-only `meta` key.
pub fn split_changelog_key(key: &[u8]) -> Result<(&'static str, &[u8]), Error> {
    let corrupt = |reason: String| Error::Corrupt {
        cf: "changelog",
        key: printable(key),
        reason,
    };
    let i = key
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| corrupt("no 0x00 between column family and key".into()))?;
    let (cf, rest) = (&key[..i], &key[i + 1..]);
    let cf = COLUMN_FAMILIES
        .iter()
        .find(|c| c.as_bytes() == cf)
        .ok_or_else(|| {
            corrupt(format!(
                "unknown column family {:?} (written by another layout version?)",
                printable(cf)
            ))
        })?;
    if *cf == CF_META && is_local_meta(rest) {
        return Err(corrupt("local-only meta key on the changelog".into()));
    }
    Ok((cf, rest))
}

/// True for the `meta` keys that stay in the local store.
pub(crate) fn is_local_meta(key: &[u8]) -> bool {
    key == META_CHANGELOG_NEXT
        || key == META_CHANGELOG_DIRTY
        || key == META_WRITER_ID
        || key == META_RULES
}

/// True for the writes that are not recorded (module docs: local `meta` keys).
pub(crate) fn is_local(cf: &str, key: &[u8]) -> bool {
    cf == CF_META && is_local_meta(key)
}

/// The changelog key of the writer record, `meta\0writer` (part of every append).
pub fn writer_key() -> Vec<u8> {
    changelog_key(CF_META, META_WRITER)
}

/// The writer id in a changelog record of key `meta\0writer`, if `change` is one.
pub fn writer_of(change: &Change) -> Option<u64> {
    let rest = change
        .key
        .strip_prefix(CF_META.as_bytes())?
        .strip_prefix(&[0])?;
    if rest != META_WRITER {
        return None;
    }
    let bytes: [u8; 8] = change.value.as_deref()?.try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

/// A RocksDB write batch that also records each write as a [`Change`] when `changes` is
/// given. Every write of the store that must reach the changelog goes through it.
pub(crate) struct Writes<'a> {
    db: &'a DB,
    pub(crate) wb: WriteBatch,
    changes: Option<&'a mut Vec<Change>>,
}

impl<'a> Writes<'a> {
    /// A new batch on `db`; records into `changes` when given.
    pub(crate) fn new(db: &'a DB, changes: Option<&'a mut Vec<Change>>) -> Self {
        Self::with_capacity(db, changes, 0)
    }

    /// [`Writes::new`] with room for about `bytes` of writes reserved up front (a flush of
    /// thousands of sessions otherwise grows, and copies, the batch a dozen times).
    pub(crate) fn with_capacity(
        db: &'a DB,
        changes: Option<&'a mut Vec<Change>>,
        bytes: usize,
    ) -> Self {
        Writes {
            db,
            wb: WriteBatch::with_capacity_bytes(bytes),
            changes,
        }
    }

    /// Puts `value` under `key` in column family `cf` (recorded unless local, see the
    /// module docs).
    pub(crate) fn put(&mut self, cf: &str, key: &[u8], value: &[u8]) {
        self.wb.put_cf(super::cf(self.db, cf), key, value);
        if is_local(cf, key) {
            return;
        }
        if let Some(c) = self.changes.as_deref_mut() {
            c.push(Change {
                key: changelog_key(cf, key),
                value: Some(value.to_vec()),
            });
        }
    }

    /// Deletes `key` in column family `cf` (recorded as a tombstone unless local).
    pub(crate) fn delete(&mut self, cf: &str, key: &[u8]) {
        self.wb.delete_cf(super::cf(self.db, cf), key);
        if is_local(cf, key) {
            return;
        }
        if let Some(c) = self.changes.as_deref_mut() {
            c.push(Change {
                key: changelog_key(cf, key),
                value: None,
            });
        }
    }

    /// Deletes the keys in `[from, to)` of column family `cf` with ONE range tombstone, and
    /// records a delete of each of `keys` (the keys of that range that exist): changelog
    /// readers apply deletes one by one. Used for the outbox prefix every acknowledged entry
    /// left, one memtable insert per flush instead of one per emission.
    pub(crate) fn delete_range<K: AsRef<[u8]>>(
        &mut self,
        cf: &str,
        from: &[u8],
        to: &[u8],
        keys: impl Iterator<Item = K>,
    ) {
        self.wb.delete_range_cf(super::cf(self.db, cf), from, to);
        if let Some(c) = self.changes.as_deref_mut() {
            c.extend(keys.map(|k| Change {
                key: changelog_key(cf, k.as_ref()),
                value: None,
            }));
        }
    }

    /// Puts a local-only `meta` value (never recorded).
    pub(crate) fn put_local(&mut self, key: &[u8], value: &[u8]) {
        debug_assert!(is_local_meta(key));
        self.wb.put_cf(super::cf(self.db, CF_META), key, value);
    }

    /// True when the writes are recorded.
    pub(crate) fn recording(&self) -> bool {
        self.changes.is_some()
    }

    /// Writes the batch with `opts`. Errors: [`Error::Write`].
    pub(crate) fn write(self, opts: &rocksdb::WriteOptions) -> Result<(), Error> {
        self.db.write_opt(self.wb, opts).map_err(Error::Write)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_split_back_into_column_family_and_store_key() {
        let k = changelog_key("sessions", b"acme/run-7");
        assert_eq!(k, b"sessions\0acme/run-7");
        assert_eq!(
            split_changelog_key(&k).unwrap(),
            ("sessions", &b"acme/run-7"[..])
        );
        // A store key may itself hold 0x00 bytes (timer due, outbox seq): only the first splits.
        let k = changelog_key("outbox", &[0, 0, 0, 0, 0, 0, 0, 7]);
        assert_eq!(
            split_changelog_key(&k).unwrap(),
            ("outbox", &[0u8, 0, 0, 0, 0, 0, 0, 7][..])
        );
    }

    #[test]
    fn foreign_and_local_keys_are_refused() {
        for bad in [
            &b"no-separator"[..],
            b"unknown\0x",
            b"meta\0changelog_next",
            b"meta\0changelog_dirty",
        ] {
            let e = split_changelog_key(bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Corrupt {
                        cf: "changelog",
                        ..
                    }
                ),
                "{e}"
            );
        }
        assert!(split_changelog_key(b"meta\0offset").is_ok());
    }
}
