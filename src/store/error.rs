//! `store::Error`. The runtime treats every variant as fatal for the partition: stop
//! consuming it, keep its committed offsets, report (STYLE §5). Nothing here is retryable.

use std::path::PathBuf;

/// A partition store failure.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The database could not be created or opened (missing directory rights, lock held by
    /// another process, damaged files, read-only open of a store that does not exist).
    #[error("cannot open partition store at {path}: {reason}")]
    Open {
        /// The store directory.
        path: PathBuf,
        /// What RocksDB or the file system said.
        reason: String,
    },
    /// The store was written by a different layout version (see `store::FORMAT_VERSION`).
    #[error("partition store at {path} has format version {found}, this build reads {expected}")]
    Format {
        /// The store directory.
        path: PathBuf,
        /// Version found in `meta`.
        found: u64,
        /// Version this build writes.
        expected: u64,
    },
    /// A write batch was refused; nothing of it is stored.
    #[error("partition store write failed: {0}")]
    Write(#[source] rocksdb::Error),
    /// A read or iteration failed in column family `cf`.
    #[error("partition store read failed in column family {cf}: {source}")]
    Read {
        /// Column family read.
        cf: &'static str,
        /// What RocksDB said.
        source: rocksdb::Error,
    },
    /// A stored key or value could not be decoded.
    #[error("corrupt record in column family {cf}, key {key:?}: {reason}")]
    Corrupt {
        /// Column family of the record.
        cf: &'static str,
        /// The record's key, non-UTF-8 bytes escaped as `\xNN`.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A value could not be encoded (not expected for engine types; kept for completeness).
    #[error("cannot encode a value for column family {cf}: {reason}")]
    Encode {
        /// Column family it was meant for.
        cf: &'static str,
        /// The encoder's message.
        reason: String,
    },
    /// A commit refused by the fault injection of `PartitionStore::fail_next_commits`.
    #[error("partition store write failed: injected fault")]
    InjectedFault,
    /// A write-behind batch changed the store's memory and was dropped without commit (an
    /// error in the middle of a batch): memory may hold half of it, so the store writes
    /// nothing more. Reopen the store (its last flush is its durable state).
    #[error("partition store refuses to write: a batch was dropped half-applied (reopen the store; its last flush is what is durable)")]
    Stale,
}
