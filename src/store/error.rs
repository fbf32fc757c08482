//! [`StoreError`]: how the state store fails, one variant per phase (open, write, read, encode, decode).

/// A state-store failure. Writes failing (disk full, I/O error) is the one the delivery path must survive.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// RocksDB could not be opened.
    #[error("cannot open the state store at {path}: {source}")]
    Open {
        /// The directory.
        path: String,
        /// RocksDB's error.
        #[source]
        source: rocksdb::Error,
    },
    /// A write (or the WAL sync) failed: nothing of the batch was stored.
    #[error("state store write failed: {0}")]
    Write(#[source] rocksdb::Error),
    /// A read failed.
    #[error("state store read failed: {0}")]
    Read(#[source] rocksdb::Error),
    /// A record could not be encoded (a bug, not an I/O problem).
    #[error("cannot encode a record: {0}")]
    Encode(#[from] serde_json::Error),
    /// A stored record does not decode (corrupt, or from an incompatible version): never read as "absent".
    #[error("the stored record `{key}` does not decode: {source}")]
    Decode {
        /// The record's key.
        key: String,
        /// Why it does not decode (each family's owner has its own format).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The database is closed after a failure and could not be reopened yet.
    #[error("state store unavailable until it can be reopened")]
    Closed,
    /// The writer thread could not be started.
    #[error("cannot start the state store's writer thread: {0}")]
    Writer(#[source] std::io::Error),
}
