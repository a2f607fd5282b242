//! The evicted keys of one partition store ([`EvictedKeys`]): every key with stored state
//! that is not cached, with its [`Evicted`] record (ARCHITECTURE § Partition state).
//!
//! With a million pending rounds nearly every key is here, so the layout is about bytes a
//! key: the records sit densely in chunks (`(key, record)`, 32 bytes, in chunks that never
//! move, so growing copies nothing), and the hash table holds only each record's position
//! (4 bytes and a control byte a bucket). A `HashMap<SessionKey, Evicted>` held the 32 bytes
//! in every bucket, of which up to half are empty after it doubles: 69 MiB for 1.1 M keys,
//! against about 46 MiB here. A removal moves the last record into the hole and repoints its
//! bucket.
//!
//! The table is [`SHARDS`] tables, by bits of the hash neither the bucket index nor the
//! control byte uses, and each doubles at its own load (shard `s` at `(1 + s/64) / 2` of
//! what it holds before it must grow): keys spread evenly, so shards that grew when full
//! would all grow at once, and a doubling now rehashes a 64th of the keys. (One table of
//! 1 M keys took about 100 ms to rehash, reading every key again, and 16 shards still
//! 10 ms each: a live partition's rounds wait for it.)

use super::mem::Evicted;
use crate::engine::SessionKey;
use hashbrown::HashTable;
use std::hash::BuildHasher;

/// Records per chunk (a power of two).
const PER_CHUNK: usize = 4096;

/// Hash tables the positions are spread over (module docs).
const SHARDS: usize = 64;

/// The shard of a hash: bits 32..38 (the bucket index takes the low bits, the control byte
/// the top seven).
fn shard(h: u64) -> usize {
    (h >> 32) as usize % SHARDS
}

/// The hasher of the table: the same FxHash the rest of the store uses.
fn hash(key: &SessionKey) -> u64 {
    rustc_hash::FxBuildHasher.hash_one(key)
}

/// Evicted keys and their records (module docs). Lookups, inserts and removals are O(1).
#[derive(Default)]
pub(crate) struct EvictedKeys {
    /// Position of each record in `chunks`, in the table of its hash's [`shard`] (empty
    /// until the first insert).
    tables: Vec<HashTable<u32>>,
    /// The records, densely: positions `0..len`.
    chunks: Vec<Vec<(SessionKey, Evicted)>>,
    len: usize,
}

impl EvictedKeys {
    /// Keys held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// True when no key is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn at(&self, i: u32) -> &(SessionKey, Evicted) {
        let i = i as usize;
        &self.chunks[i / PER_CHUNK][i % PER_CHUNK]
    }

    fn at_mut(&mut self, i: u32) -> &mut (SessionKey, Evicted) {
        let i = i as usize;
        &mut self.chunks[i / PER_CHUNK][i % PER_CHUNK]
    }

    /// The record of `key`, if held.
    pub(crate) fn get(&self, key: &SessionKey) -> Option<&Evicted> {
        if self.len == 0 {
            return None;
        }
        let h = hash(key);
        let i = *self.tables[shard(h)].find(h, |&i| self.at(i).0 == *key)?;
        Some(&self.at(i).1)
    }

    /// True when `key` is held.
    pub(crate) fn contains_key(&self, key: &SessionKey) -> bool {
        self.get(key).is_some()
    }

    /// Holds `record` for `key`, replacing (and returning) the one it had.
    pub(crate) fn insert(&mut self, key: SessionKey, record: Evicted) -> Option<Evicted> {
        if self.tables.is_empty() {
            self.tables = (0..SHARDS).map(|_| HashTable::new()).collect();
        }
        let h = hash(&key);
        let (table, chunks) = (&mut self.tables[shard(h)], &self.chunks);
        let at = |i: u32| &chunks[i as usize / PER_CHUNK][i as usize % PER_CHUNK];
        if let Some(&mut i) = table.find_mut(h, |&i| at(i).0 == key) {
            return Some(std::mem::replace(&mut self.at_mut(i).1, record));
        }
        let i = self.len;
        let pos = u32::try_from(i).expect("fewer than 2^32 evicted keys in one partition");
        if i % PER_CHUNK == 0 && i / PER_CHUNK == self.chunks.len() {
            self.chunks.push(Vec::with_capacity(PER_CHUNK));
        }
        self.chunks[i / PER_CHUNK].push((key, record));
        self.len += 1;
        let chunks = &self.chunks;
        let s = shard(h);
        let rehash = |&j: &u32| hash(&chunks[j as usize / PER_CHUNK][j as usize % PER_CHUNK].0);
        let table = &mut self.tables[s];
        table.insert_unique(h, pos, rehash);
        // Staggered growth (module docs): double this shard now if it is past its load.
        let (len, room) = (table.len(), table.capacity());
        if len * 2 * SHARDS >= room * (SHARDS + s) {
            table.reserve(room + 1 - len, rehash);
        }
        None
    }

    /// Forgets `key`, returning its record.
    pub(crate) fn remove(&mut self, key: &SessionKey) -> Option<Evicted> {
        if self.len == 0 {
            return None;
        }
        let chunks = &self.chunks;
        let at = |i: u32| &chunks[i as usize / PER_CHUNK][i as usize % PER_CHUNK];
        let h = hash(key);
        let Ok(bucket) = self.tables[shard(h)].find_entry(h, |&i| at(i).0 == *key) else {
            return None;
        };
        let (hole, _) = bucket.remove();
        let last = u32::try_from(self.len - 1).expect("positions fit in u32");
        if hole != last {
            // The last record moves into the hole: its bucket follows.
            let h = hash(&self.at(last).0);
            let slot = self.tables[shard(h)]
                .find_mut(h, |&i| i == last)
                .expect("every record has its bucket");
            *slot = hole;
        }
        let chunk = &mut self.chunks[last as usize / PER_CHUNK];
        let moved = chunk.pop().expect("the last record is in the last chunk");
        if chunk.is_empty() {
            self.chunks.pop();
        }
        self.len -= 1;
        if hole == last {
            return Some(moved.1);
        }
        Some(std::mem::replace(self.at_mut(hole), moved).1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn key(i: u32) -> SessionKey {
        SessionKey::new("tenant-with-a-long-name", &format!("s{i}"))
    }

    fn record(due: i64) -> Evicted {
        Evicted::new(Some(due), (due % 3 == 0).then_some(due - 5))
    }

    proptest! {
        /// Any sequence of inserts and removals leaves what a `HashMap` would hold, across
        /// chunk boundaries.
        #[test]
        fn it_holds_what_a_hash_map_holds(
            ops in proptest::collection::vec((any::<bool>(), 0u32..6_000, any::<i64>()), 1..12_000)
        ) {
            let mut held = EvictedKeys::default();
            let mut model: HashMap<SessionKey, Evicted> = HashMap::new();
            for (insert, k, due) in ops {
                let (k, r) = (key(k), record(due));
                if insert {
                    prop_assert_eq!(held.insert(k.clone(), r), model.insert(k, r));
                } else {
                    prop_assert_eq!(held.remove(&k), model.remove(&k));
                }
                prop_assert_eq!(held.len(), model.len());
            }
            for (k, r) in &model {
                prop_assert_eq!(held.get(k), Some(r));
            }
            for i in 0..6_000 {
                prop_assert_eq!(held.contains_key(&key(i)), model.contains_key(&key(i)));
            }
        }
    }

    #[test]
    fn removing_everything_gives_back_every_chunk() {
        let mut held = EvictedKeys::default();
        for i in 0..(2 * PER_CHUNK as u32 + 10) {
            assert_eq!(held.insert(key(i), record(i.into())), None);
        }
        assert_eq!(held.chunks.len(), 3);
        for i in 0..(2 * PER_CHUNK as u32 + 10) {
            assert_eq!(held.remove(&key(i)), Some(record(i.into())));
            assert_eq!(held.remove(&key(i)), None);
        }
        assert!(held.is_empty());
        assert!(held.chunks.is_empty());
        assert_eq!(held.get(&key(1)), None);
    }
}
