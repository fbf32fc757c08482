//! The durable state store: RocksDB with its write-ahead log on, one column family per kind of record.
//!
//! ```text
//! deliveries     deliveryId (32 hex chars)  -> in-flight delivery record (JSON)
//! subscriptions  "<group>\n<topic>"          -> subscription (JSON)
//! ```
//!
//! Records are JSON so an operator can read them with `ldb`; the types belong to their owners (the delivery
//! module), and this module only stores and lists them. No RocksDB type leaves it. Every write is synced to
//! the WAL before it returns when `sync_writes` is on, so a `kill -9` (or power loss) keeps what was
//! acknowledged. A record that no longer decodes is listed apart, for recovery to retire.
//!
//! After a failed write (disk full, I/O error) RocksDB refuses every later write, even once space is free.
//! The store then reopens the database before its next operation (at most once a second): opening replays
//! the WAL, so everything that was acknowledged is still there, and writing works again as soon as the
//! disk has room.
//!
//! The store keeps its own health: every failed write or WAL sync, whoever asked for it (deliveries,
//! subscriptions, the DLQ replay ledger), is counted in `popgate_offset_write_failures_total` and makes
//! [`StateStore::is_healthy`] false until a write succeeds again (`/readyz` reads it).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use rocksdb::{ColumnFamilyDescriptor, IteratorMode, Options, WriteBatch, WriteOptions, DB};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Which kind of record; each has its own column family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// In-flight deliveries, keyed by deliveryId.
    Deliveries,
    /// Subscriptions, keyed by group and topic.
    Subscriptions,
    /// DLQ replay progress, keyed by DLQ topic and message id.
    DlqReplays,
    /// The body of each in-flight delivery, keyed by deliveryId: written once at admission, read at hand-out
    /// and for the DLQ, deleted with the delivery. Kept apart so memory and every phase change carry only
    /// the small record.
    Payloads,
}

impl Family {
    const ALL: [Family; 4] = [Family::Deliveries, Family::Subscriptions, Family::DlqReplays, Family::Payloads];

    /// The family's memtable size. Memtables count in popgate's RSS (two per family at most), so they are
    /// far below RocksDB's 64 MiB: a delivery's records (admitted, handed out, deleted) and its body (written,
    /// read, deleted) still mostly meet and cancel within one memtable, since a delivery lives for
    /// milliseconds to seconds under load. Bodies are the bulk of the bytes and are written once, so their
    /// memtable is the smallest.
    fn write_buffer_bytes(self) -> usize {
        match self {
            Family::Payloads => 4 * 1024 * 1024,
            Family::Deliveries => 8 * 1024 * 1024,
            Family::Subscriptions | Family::DlqReplays => 4 * 1024 * 1024,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Family::Deliveries => "deliveries",
            Family::Subscriptions => "subscriptions",
            Family::DlqReplays => "dlq_replays",
            Family::Payloads => "payloads",
        }
    }
}

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
        /// Why it does not decode.
        #[source]
        source: serde_json::Error,
    },
    /// The database is closed after a failure and could not be reopened yet.
    #[error("state store unavailable until it can be reopened")]
    Closed,
}

/// The shortest pause between two attempts to reopen a failed database.
const REOPEN_PAUSE: Duration = Duration::from_secs(1);

/// One change in an atomic batch.
#[derive(Debug)]
pub enum Change<'a> {
    /// Store `value` (JSON, or a payload's raw bytes) under `key`.
    Put(Family, &'a str, Vec<u8>),
    /// Remove `key`.
    Delete(Family, &'a str),
}

/// The open state store.
pub struct StateStore {
    dir: PathBuf,
    sync_writes: bool,
    /// `None` while closed after a failure.
    db: RwLock<Option<DB>>,
    /// A write failed: reopen before the next operation.
    failed: AtomicBool,
    /// False from a failed write (or WAL sync) until the next one that succeeds.
    healthy: AtomicBool,
    last_reopen: Mutex<Option<Instant>>,
}

/// Records listed from a family: those that decode, and the keys of those that do not.
pub struct Listing<T> {
    /// Decodable records with their keys.
    pub records: Vec<(String, T)>,
    /// Keys whose value does not decode as `T` (corrupt or from an incompatible version).
    pub undecodable: Vec<String>,
}

fn open_db(dir: &Path) -> Result<DB, StoreError> {
    let mut options = Options::default();
    options.create_if_missing(true);
    options.create_missing_column_families(true);
    // Deliveries are small and short-lived: keep the memory and file footprint modest.
    options.set_max_total_wal_size(64 * 1024 * 1024);
    options.set_keep_log_file_num(3);
    let families = Family::ALL.iter().map(|f| {
        let mut family = Options::default();
        family.set_write_buffer_size(f.write_buffer_bytes());
        ColumnFamilyDescriptor::new(f.name(), family)
    });
    DB::open_cf_descriptors(&options, dir, families)
        .map_err(|source| StoreError::Open { path: dir.display().to_string(), source })
}

impl StateStore {
    /// Opens (creating if needed) the store in `dir`.
    ///
    /// # Errors
    /// [`StoreError::Open`] when RocksDB cannot open the directory.
    pub fn open(dir: &Path, sync_writes: bool) -> Result<StateStore, StoreError> {
        let db = open_db(dir)?;
        Ok(StateStore {
            dir: dir.to_path_buf(),
            sync_writes,
            db: RwLock::new(Some(db)),
            failed: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            last_reopen: Mutex::new(None),
        })
    }

    fn write_options(&self) -> WriteOptions {
        let mut options = WriteOptions::default();
        options.set_sync(self.sync_writes);
        options
    }

    /// The database, reopened first if a write failed (rate-limited).
    fn db(&self) -> Result<RwLockReadGuard<'_, Option<DB>>, StoreError> {
        if self.failed.load(Ordering::Relaxed) {
            self.reopen();
        }
        let guard = self.db.read();
        if guard.is_none() {
            return Err(StoreError::Closed);
        }
        Ok(guard)
    }

    fn reopen(&self) {
        {
            let mut last = self.last_reopen.lock();
            if last.is_some_and(|at| at.elapsed() < REOPEN_PAUSE) {
                return;
            }
            *last = Some(Instant::now());
        }
        let mut slot = self.db.write();
        // Close first: RocksDB holds a lock on the directory.
        *slot = None;
        match open_db(&self.dir) {
            Ok(db) => {
                *slot = Some(db);
                self.failed.store(false, Ordering::Relaxed);
                tracing::info!(dir = %self.dir.display(), "State store reopened after a failure.");
            }
            Err(error) => tracing::warn!(%error, "State store still cannot be reopened."),
        }
    }

    /// False after a failed write or WAL sync, until a write succeeds again.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Keeps the health flag and the failure counter true to a write's outcome.
    fn account<T>(&self, what: &'static str, result: Result<T, StoreError>) -> Result<T, StoreError> {
        match &result {
            Ok(_) => self.healthy.store(true, Ordering::Relaxed),
            Err(error) => {
                self.healthy.store(false, Ordering::Relaxed);
                metrics::counter!(crate::metrics::OFFSET_WRITE_FAILURES).increment(1);
                tracing::warn!(%error, what, "State store write failed.");
            }
        }
        result
    }

    /// Applies every change or none.
    ///
    /// # Errors
    /// [`StoreError::Write`] when the batch could not be made durable; nothing of it is visible then.
    pub fn apply(&self, changes: &[Change<'_>]) -> Result<(), StoreError> {
        let result = self.db().and_then(|guard| {
            let db = guard.as_ref().ok_or(StoreError::Closed)?;
            let mut batch = WriteBatch::default();
            for change in changes {
                match change {
                    Change::Put(family, key, value) => batch.put_cf(family_handle(db, *family), key.as_bytes(), value),
                    Change::Delete(family, key) => batch.delete_cf(family_handle(db, *family), key.as_bytes()),
                }
            }
            db.write_opt(batch, &self.write_options()).map_err(|error| {
                self.failed.store(true, Ordering::Relaxed);
                StoreError::Write(error)
            })
        });
        self.account("batch", result)
    }

    /// Stores one record.
    ///
    /// # Errors
    /// [`StoreError`] when it cannot be encoded or written.
    pub fn put<T: Serialize>(&self, family: Family, key: &str, value: &T) -> Result<(), StoreError> {
        self.apply(&[Change::Put(family, key, serde_json::to_vec(value)?)])
    }

    /// Removes one record (a no-op when absent).
    ///
    /// # Errors
    /// [`StoreError::Write`].
    pub fn delete(&self, family: Family, key: &str) -> Result<(), StoreError> {
        self.apply(&[Change::Delete(family, key)])
    }

    /// Syncs the WAL to disk: the group commit of async-flush profiles, whose writes are not synced one by one.
    ///
    /// # Errors
    /// [`StoreError::Write`] when the sync fails (the store is reopened before its next use).
    pub fn sync_wal(&self) -> Result<(), StoreError> {
        let result = self.db().and_then(|guard| {
            let db = guard.as_ref().ok_or(StoreError::Closed)?;
            db.flush_wal(true).map_err(|error| {
                self.failed.store(true, Ordering::Relaxed);
                StoreError::Write(error)
            })
        });
        self.account("wal sync", result)
    }

    /// One record, if present.
    ///
    /// # Errors
    /// [`StoreError::Read`] when the read fails; [`StoreError::Decode`] when the record is there but does not
    /// decode as `T` (it is never mistaken for an absent one).
    pub fn get<T: DeserializeOwned>(&self, family: Family, key: &str) -> Result<Option<T>, StoreError> {
        let guard = self.db()?;
        let db = guard.as_ref().ok_or(StoreError::Closed)?;
        let Some(bytes) = db.get_cf(family_handle(db, family), key.as_bytes()).map_err(StoreError::Read)? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes).map(Some).map_err(|source| StoreError::Decode { key: key.to_owned(), source })
    }

    /// The raw values of `keys` in `family`, in the order of `keys` (`None` where a key is absent), read in one
    /// batch.
    ///
    /// # Errors
    /// [`StoreError::Read`] when a read fails.
    pub fn get_raw_many(&self, family: Family, keys: &[&str]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let guard = self.db()?;
        let db = guard.as_ref().ok_or(StoreError::Closed)?;
        let handle = family_handle(db, family);
        db.multi_get_cf(keys.iter().map(|key| (handle, key.as_bytes())))
            .into_iter()
            .map(|value| value.map_err(StoreError::Read))
            .collect()
    }

    /// Calls `visit` with each record of `family` in key order: its key and the record decoded as `T` (or
    /// `None` when it does not decode). Nothing is collected, so a million records are never all in memory
    /// twice (boot recovery).
    ///
    /// # Errors
    /// [`StoreError::Read`] when iteration fails.
    pub fn for_each<T: DeserializeOwned>(
        &self,
        family: Family,
        mut visit: impl FnMut(String, Option<T>),
    ) -> Result<(), StoreError> {
        let guard = self.db()?;
        let db = guard.as_ref().ok_or(StoreError::Closed)?;
        for item in db.iterator_cf(family_handle(db, family), IteratorMode::Start) {
            let (key, value) = item.map_err(StoreError::Read)?;
            visit(String::from_utf8_lossy(&key).into_owned(), serde_json::from_slice::<T>(&value).ok());
        }
        Ok(())
    }

    /// Every record of `family`, decoded as `T`.
    ///
    /// # Errors
    /// [`StoreError::Read`] when iteration fails.
    pub fn list<T: DeserializeOwned>(&self, family: Family) -> Result<Listing<T>, StoreError> {
        let guard = self.db()?;
        let db = guard.as_ref().ok_or(StoreError::Closed)?;
        let mut listing = Listing { records: Vec::new(), undecodable: Vec::new() };
        for item in db.iterator_cf(family_handle(db, family), IteratorMode::Start) {
            let (key, value) = item.map_err(StoreError::Read)?;
            let key = String::from_utf8_lossy(&key).into_owned();
            match serde_json::from_slice::<T>(&value) {
                Ok(record) => listing.records.push((key, record)),
                Err(_) => listing.undecodable.push(key),
            }
        }
        Ok(listing)
    }

    /// Stores raw bytes under `key`, bypassing encoding: for tools and crash tests that plant a corrupt record.
    ///
    /// # Errors
    /// [`StoreError::Write`].
    pub fn put_raw(&self, family: Family, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.apply(&[Change::Put(family, key, value.to_vec())])
    }
}

fn family_handle(db: &DB, family: Family) -> &rocksdb::ColumnFamily {
    // Every family is created at open (`create_missing_column_families`), so the handle always exists.
    #[allow(clippy::expect_used)]
    db.cf_handle(family.name()).expect("column family created at open")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Rec {
        n: u32,
    }

    #[test]
    fn records_survive_a_reopen_and_corrupt_ones_are_listed_apart() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let store = StateStore::open(dir.path(), true).expect("open");
            store.put(Family::Deliveries, "a", &Rec { n: 1 }).expect("put");
            store.put(Family::Deliveries, "b", &Rec { n: 2 }).expect("put");
            store.put_raw(Family::Deliveries, "c", b"{not json").expect("put raw");
            store.put(Family::Subscriptions, "g\nt", &Rec { n: 9 }).expect("put");
            store.delete(Family::Deliveries, "b").expect("delete");
        }
        let store = StateStore::open(dir.path(), true).expect("reopen");
        let listing = store.list::<Rec>(Family::Deliveries).expect("list");
        assert_eq!(listing.records, vec![("a".to_owned(), Rec { n: 1 })]);
        assert_eq!(listing.undecodable, vec!["c".to_owned()]);
        assert_eq!(store.list::<Rec>(Family::Subscriptions).expect("list").records.len(), 1);
    }

    #[test]
    fn an_undecodable_record_is_an_error_not_an_absent_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path(), false).expect("open");
        store.put_raw(Family::DlqReplays, "k", b"{not json").expect("put raw");
        assert!(matches!(store.get::<Rec>(Family::DlqReplays, "k"), Err(StoreError::Decode { .. })));
        assert!(store.get::<Rec>(Family::DlqReplays, "absent").expect("read").is_none());
        assert!(store.is_healthy());
    }

    #[test]
    fn a_batch_applies_every_change_together() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path(), false).expect("open");
        store.put(Family::Deliveries, "x", &Rec { n: 1 }).expect("put");
        let value = serde_json::to_vec(&Rec { n: 2 }).expect("encode");
        store
            .apply(&[Change::Delete(Family::Deliveries, "x"), Change::Put(Family::Deliveries, "y", value)])
            .expect("batch");
        let keys: Vec<String> =
            store.list::<Rec>(Family::Deliveries).expect("list").records.into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, vec!["y".to_owned()]);
    }
}
