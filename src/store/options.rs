//! Tuning of the partition stores: sizes, WAL, and the RocksDB options derived from them.
//!
//! Memory is bounded by construction: data blocks, index and filter blocks of every store
//! live in ONE LRU block cache of `block_cache_bytes`, and every store's memtables are
//! capped together by ONE write-buffer manager of `memtable_budget_bytes` (writers stall
//! when it is full). Stores opened with the same [`MemoryBudget`] share both, so the process
//! holds about `block_cache_bytes + memtable_budget_bytes` of RocksDB memory however many
//! partitions it owns and however many sessions are pending. In front of RocksDB, the
//! sessions cached in memory are bounded by ONE [`CacheBudget`] of `session_cache_bytes`
//! per [`MemoryBudget`] (clean entries evicted least recently used past it); the timer
//! index (a few dozen bytes per stored key) and the owed emissions are not in it.

use super::keys::{CF_META, CF_OUTBOX, CF_SESSIONS, CF_TENANTS, COLUMN_FAMILIES};
use super::mem::CacheBudget;
use rocksdb::{
    BlockBasedOptions, Cache, ColumnFamilyDescriptor, DBCompressionType, LruCacheOptions, Options,
    WriteBufferManager, WriteOptions,
};

const MIB: usize = 1024 * 1024;

/// Sizes (bytes) and durability switches of the partition stores.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreOptions {
    /// LRU block cache shared by the stores of one [`MemoryBudget`] (bytes). Default 32 MiB:
    /// hot sessions live in the session cache in front of RocksDB, so this one mostly serves
    /// reads of evicted sessions (64 MiB was no faster on the shared trace and held 32 MiB
    /// more RSS with 1 M pending rounds; BENCHMARKS, session 11).
    pub block_cache_bytes: usize,
    /// Memtable size of the `sessions` and `outbox` column families (bytes): a
    /// memtable is flushed to disk when it reaches this. Default 16 MiB.
    pub write_buffer_bytes: usize,
    /// Cap on all memtables of the stores of one [`MemoryBudget`] together (bytes); writers
    /// wait for flushes above it. Default 64 MiB.
    pub memtable_budget_bytes: usize,
    /// Write-ahead log on (default). Off only for benches or a store rebuilt from the
    /// changelog anyway: without it a crash loses every write since the last flush (the
    /// column families still flush atomically, so the store stays consistent, just older).
    pub wal: bool,
    /// fsync the WAL on every commit. Default off: a commit is then durable against a
    /// process crash (kill -9, SEMANTICS §6) but not against losing the machine, which the
    /// changelog covers.
    pub sync: bool,
    /// Session state cached in memory by the stores of one [`MemoryBudget`] (bytes,
    /// approximate; `store.session-cache`). Default 64 MiB.
    pub session_cache_bytes: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            block_cache_bytes: 32 * MIB,
            write_buffer_bytes: 16 * MIB,
            memtable_budget_bytes: 64 * MIB,
            wal: true,
            sync: false,
            session_cache_bytes: 64 * MIB,
        }
    }
}

/// The block cache and memtable budget shared by the stores opened with it (one per
/// process is the intent). Cheap to clone: clones share the same memory.
#[derive(Clone)]
pub struct MemoryBudget {
    pub(crate) cache: Cache,
    pub(crate) write_buffers: WriteBufferManager,
    pub(crate) sessions: CacheBudget,
}

impl MemoryBudget {
    /// A budget of `options.block_cache_bytes` of block cache,
    /// `options.memtable_budget_bytes` of memtables and `options.session_cache_bytes` of
    /// cached sessions.
    pub fn new(options: &StoreOptions) -> Self {
        fix_malloc_mmap_threshold();
        MemoryBudget {
            cache: block_cache(options.block_cache_bytes),
            write_buffers: WriteBufferManager::new_write_buffer_manager(
                options.memtable_budget_bytes,
                true,
            ),
            sessions: CacheBudget::new(options.session_cache_bytes),
        }
    }

    /// Bytes currently held by the block cache (data, index and filter blocks).
    pub fn cache_usage_bytes(&self) -> usize {
        self.cache.get_usage()
    }

    /// Bytes currently held by memtables of all stores sharing this budget.
    pub fn memtable_usage_bytes(&self) -> usize {
        self.write_buffers.get_usage()
    }

    /// Bytes of session state currently cached by all stores sharing this budget.
    pub fn session_cache_usage_bytes(&self) -> usize {
        self.sessions.used()
    }
}

impl std::fmt::Debug for MemoryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBudget")
            .field("cache_usage_bytes", &self.cache_usage_bytes())
            .field("memtable_usage_bytes", &self.memtable_usage_bytes())
            .field(
                "session_cache_usage_bytes",
                &self.session_cache_usage_bytes(),
            )
            .finish()
    }
}

/// Smallest shard of the block cache (bytes): RocksDB's LRU cache is split into shards by
/// key hash, and a block bigger than its shard's capacity is read but not kept. RocksDB's
/// automatic choice gives a 32 MiB cache 64 shards of 512 KiB, smaller than the filter
/// block (10 bits a key: 1.2 MiB for a million sessions) and the index block of one SST of
/// the `sessions` family, so every read of an evicted session read, checksummed and
/// decompressed both again: ~185 µs a read with 1 M pending rounds (BENCHMARKS, "Listing 1 M
/// pending rounds").
pub(crate) const MIN_CACHE_SHARD_BYTES: usize = 8 * MIB;

/// Shard bits of a block cache of `capacity` bytes: as many shards (at most 64) as leave
/// each at least [`MIN_CACHE_SHARD_BYTES`].
pub(crate) fn cache_shard_bits(capacity: usize) -> i32 {
    let mut bits = 0;
    while bits < 6 && capacity >> (bits + 1) >= MIN_CACHE_SHARD_BYTES {
        bits += 1;
    }
    bits
}

/// The LRU block cache of `capacity` bytes, sharded by [`cache_shard_bits`].
fn block_cache(capacity: usize) -> Cache {
    let mut o = LruCacheOptions::default();
    o.set_capacity(capacity);
    o.set_num_shard_bits(cache_shard_bits(capacity));
    Cache::new_lru_cache_opts(&o)
}

/// The mmap threshold [`fix_malloc_mmap_threshold`] sets (bytes): blocks this big or bigger
/// get their own mapping.
pub(crate) const MALLOC_MMAP_THRESHOLD_BYTES: usize = 256 * 1024;

/// Fixes glibc malloc's mmap threshold at [`MALLOC_MMAP_THRESHOLD_BYTES`], once per process
/// (a no-op on other C libraries). By default glibc raises the threshold to the largest
/// mapped block freed so far, so RocksDB's memtable arena blocks (2 MiB with 16 MiB
/// memtables), freed at every memtable flush, are served from the heap afterwards, where
/// they fragment it and stay in the RSS: with 1 M pending rounds at 50 000 uploads/s live
/// (`benches/pipeline.rs`), RSS max 250 MiB with the default, 230 MiB with the threshold
/// fixed, and `settle run-file` on the shared trace no slower (BENCHMARKS, session 14).
pub(crate) fn fix_malloc_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only changes a malloc tunable; any value is valid for it, and
            // glibc serialises it with allocation (it takes the arena lock).
            let threshold = MALLOC_MMAP_THRESHOLD_BYTES as libc::c_int;
            let set = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, threshold) };
            if set != 1 {
                tracing::debug!("mallopt(M_MMAP_THRESHOLD) refused; glibc's default stays");
            }
        });
    }
}

/// DB-wide options.
pub(crate) fn db_options(options: &StoreOptions, budget: &MemoryBudget) -> Options {
    let mut o = Options::default();
    o.create_if_missing(true);
    o.create_missing_column_families(true);
    // A flush spans four column families; flushing them together keeps the on-disk state
    // consistent at every flush point even when the WAL is off.
    o.set_atomic_flush(true);
    o.set_write_buffer_manager(&budget.write_buffers);
    o.set_max_background_jobs(2);
    o.set_max_total_wal_size(4 * options.write_buffer_bytes as u64);
    o.set_max_open_files(256);
    o.set_keep_log_file_num(2);
    o.set_max_log_file_size(4 * MIB);
    o
}

/// One descriptor per column family, with the options of its access pattern.
pub(crate) fn column_families(
    options: &StoreOptions,
    budget: &MemoryBudget,
) -> Vec<ColumnFamilyDescriptor> {
    COLUMN_FAMILIES
        .iter()
        .map(|&name| ColumnFamilyDescriptor::new(name, cf_options(name, options, budget)))
        .collect()
}

fn cf_options(name: &str, options: &StoreOptions, budget: &MemoryBudget) -> Options {
    let mut table = BlockBasedOptions::default();
    table.set_block_cache(&budget.cache);
    // Index and filter blocks are charged to the cache too, so they are bounded with it.
    table.set_cache_index_and_filter_blocks(true);
    table.set_pin_l0_filter_and_index_blocks_in_cache(true);
    let mut o = Options::default();
    o.set_compression_type(DBCompressionType::Lz4);
    o.set_max_write_buffer_number(2);
    match name {
        CF_SESSIONS => {
            // Point lookups by session key: a bloom filter skips files without the key. (No
            // memtable bloom filter: memory knows which keys have stored state, so a read is
            // only made for a key that has some, and every write would pay for the filter.)
            table.set_bloom_filter(10.0, false);
            o.set_write_buffer_size(options.write_buffer_bytes);
        }
        CF_OUTBOX => {
            // A queue: inserted ahead, deleted at the head. Files dense with tombstones are
            // compacted early so the tombstones drop out (the open scan seeks past them).
            o.add_compact_on_deletion_collector_factory(4096, 2048, 0.5);
            o.set_write_buffer_size(options.write_buffer_bytes);
        }
        // Small: bookkeeping, and at most a few thousand tenants' learned delays.
        CF_META | CF_TENANTS => o.set_write_buffer_size(MIB),
        _ => {}
    }
    o.set_block_based_table_factory(&table);
    o
}

/// Write options of commits and outbox acks.
pub(crate) fn write_options(options: &StoreOptions) -> WriteOptions {
    let mut w = WriteOptions::default();
    w.disable_wal(!options.wal);
    w.set_sync(options.wal && options.sync);
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_shards_are_never_smaller_than_the_minimum_unless_the_cache_is() {
        assert_eq!(cache_shard_bits(MIB), 0);
        assert_eq!(cache_shard_bits(8 * MIB), 0);
        assert_eq!(cache_shard_bits(16 * MIB), 1);
        assert_eq!(cache_shard_bits(32 * MIB), 2);
        assert_eq!(cache_shard_bits(33 * MIB), 2);
        assert_eq!(cache_shard_bits(1 << 40), 6);
        for capacity in [8 * MIB, 32 * MIB, 100 * MIB, 512 * MIB] {
            assert!(capacity >> cache_shard_bits(capacity) >= MIN_CACHE_SHARD_BYTES);
        }
    }
}
