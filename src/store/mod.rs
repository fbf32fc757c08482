//! The durable state store: RocksDB with its write-ahead log on, one column family per kind of record.
//!
//! ```text
//! deliveries     deliveryId (32 hex chars)  -> in-flight delivery record (compact binary, version byte first)
//! subscriptions  "<group>\n<topic>"          -> subscription (JSON)
//! dlq_replays    "<dlq topic>\n<message id>"  -> replay progress (JSON)
//! payloads       deliveryId                  -> the event body (raw bytes)
//! ```
//!
//! Records are JSON so an operator can read them with `ldb`, except the in-flight delivery records: boot
//! decodes every one of them, so they have a compact form of their own (`delivery::record`), and the
//! delivery module hands its encoder and decoder to the `*_with` reads and to [`Change::Put`]. The types and
//! their formats belong to their owners; this module only stores and lists them. No RocksDB type leaves it.
//! A record that no longer decodes is listed apart, for recovery to retire.
//!
//! **Writes** go through one writer thread, never a Tokio worker, and are group-committed: the writer takes
//! every write queued while it was busy and commits them as one RocksDB batch. With `sync_writes` on
//! (`durable` and `financial` profiles) that batch is synced to the WAL before any of its callers is
//! answered, so a `kill -9` (or power loss) keeps what was acknowledged, at one fsync per group rather than
//! per write. With it off (the other profiles) writes reach the WAL unsynced and the delivery layer syncs the
//! WAL every `group_commit` interval ([`StateStore::sync_wal`]): a power loss may lose that interval, a
//! process kill loses nothing (the WAL is in the page cache).
//!
//! After a failed write (disk full, I/O error) RocksDB refuses every later write, even once space is free.
//! The writer then reopens the database before its next group (at most once a second, also when no write
//! comes): opening replays the WAL, so everything that was acknowledged is still there, and writing works
//! again as soon as the disk has room. Reads meanwhile fail at once (`Closed`) rather than wait for it.
//!
//! The store keeps its own health: every failed write or WAL sync, whoever asked for it (deliveries,
//! subscriptions, the DLQ replay ledger), is counted in `popgate_offset_write_failures_total` and makes
//! [`StateStore::is_healthy`] false until a write succeeds again (`/readyz` reads it).

mod error;
mod expiry;
mod family;
mod writer;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
#[cfg(test)]
use std::time::Duration;

use parking_lot::RwLockReadGuard;
use rocksdb::{IteratorMode, ReadOptions, DB};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::oneshot;

pub use self::error::StoreError;
pub use self::expiry::{expiry_key, EXPIRY_PREFIX};
pub use self::family::Family;
use self::family::{family_handle, open_db};
use self::writer::{Job, OwnedChange, Shared};

/// One change in an atomic batch.
#[derive(Debug)]
pub enum Change<'a> {
    /// Store `value` (the record as its owner encodes it, or a payload's raw bytes) under `key`.
    Put(Family, &'a str, Vec<u8>),
    /// Remove `key`.
    Delete(Family, &'a str),
}

/// The open state store.
///
/// Every write goes through one writer thread, never a Tokio worker: RocksDB writes block (a synced write
/// waits for fsync, a full disk for RocksDB's error, a reopen for the WAL replay), and one slow fsync on a
/// worker would stall every front with it. The writer takes all the writes queued while it was busy and
/// commits them as **one** batch with one sync (group commit); each caller's changes stay atomic, since they
/// are all in that batch or none are. Callers await their answer. Reads run on the caller: they come from
/// memtables and the block cache and do not wait for a sync.
pub struct StateStore {
    shared: Arc<Shared>,
    /// `None` once dropped (which ends the writer).
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

/// Records listed from a family: those that decode, and the keys of those that do not.
pub struct Listing<T> {
    /// Decodable records with their keys.
    pub records: Vec<(String, T)>,
    /// Keys whose value does not decode as `T` (corrupt or from an incompatible version).
    pub undecodable: Vec<String>,
}

impl StateStore {
    /// Opens (creating if needed) the store in `dir` and starts its writer thread.
    ///
    /// # Errors
    /// [`StoreError::Open`] when RocksDB cannot open the directory; [`StoreError::Writer`] when the writer
    /// thread cannot be started.
    pub fn open(dir: &Path, sync_writes: bool) -> Result<StateStore, StoreError> {
        let db = open_db(dir)?;
        let shared = Arc::new(Shared::new(dir, sync_writes, db));
        let (jobs, queue) = std::sync::mpsc::channel();
        let writer = std::thread::Builder::new()
            .name("popgate-store-writer".into())
            .spawn({
                let shared = shared.clone();
                move || shared.run_writer(&queue)
            })
            .map_err(StoreError::Writer)?;
        Ok(StateStore { shared, jobs: Some(jobs), writer: Some(writer) })
    }

    /// The database for a read (`Closed` while it is being reopened after a failure).
    fn db(&self) -> Result<RwLockReadGuard<'_, Option<DB>>, StoreError> {
        let guard = self.shared.db.read();
        if guard.is_none() {
            return Err(StoreError::Closed);
        }
        Ok(guard)
    }

    /// False after a failed write or WAL sync, until a write succeeds again.
    pub fn is_healthy(&self) -> bool {
        self.shared.healthy.load(Ordering::Relaxed)
    }

    /// Hands `job` to the writer thread and waits (without blocking the runtime) for its answer.
    async fn submit(&self, job: impl FnOnce(oneshot::Sender<Result<(), StoreError>>) -> Job) -> Result<(), StoreError> {
        let (reply, answer) = oneshot::channel();
        let queued = self.jobs.as_ref().is_some_and(|jobs| jobs.send(job(reply)).is_ok());
        if !queued {
            return Err(StoreError::Closed);
        }
        answer.await.unwrap_or(Err(StoreError::Closed))
    }

    /// Applies every change or none, synced as the store is configured, on the writer thread (group commit
    /// with whatever other writes are queued).
    ///
    /// # Errors
    /// [`StoreError::Write`] when the batch could not be made durable; nothing of it is visible then.
    pub async fn apply(&self, changes: &[Change<'_>]) -> Result<(), StoreError> {
        let owned = changes.iter().map(OwnedChange::from).collect();
        self.submit(|reply| Job::Write(owned, reply)).await
    }

    /// Stores one record.
    ///
    /// # Errors
    /// [`StoreError`] when it cannot be encoded or written.
    pub async fn put<T: Serialize>(&self, family: Family, key: &str, value: &T) -> Result<(), StoreError> {
        let value = serde_json::to_vec(value)?;
        self.apply(&[Change::Put(family, key, value)]).await
    }

    /// Removes one record (a no-op when absent).
    ///
    /// # Errors
    /// [`StoreError::Write`].
    pub async fn delete(&self, family: Family, key: &str) -> Result<(), StoreError> {
        self.apply(&[Change::Delete(family, key)]).await
    }

    /// Syncs the WAL to disk: the group commit of async-flush profiles, whose writes are not synced one by one.
    ///
    /// # Errors
    /// [`StoreError::Write`] when the sync fails (the store is reopened before its next use).
    pub async fn sync_wal(&self) -> Result<(), StoreError> {
        self.submit(Job::SyncWal).await
    }

    /// One record, if present.
    ///
    /// # Errors
    /// [`StoreError::Read`] when the read fails; [`StoreError::Decode`] when the record is there but does not
    /// decode as `T` (it is never mistaken for an absent one).
    pub fn get<T: DeserializeOwned>(&self, family: Family, key: &str) -> Result<Option<T>, StoreError> {
        self.get_with(family, key, |bytes| serde_json::from_slice(bytes))
    }

    /// One record, if present, decoded by `decode` (for a family whose owner keeps its own format).
    ///
    /// # Errors
    /// As [`StateStore::get`]; [`StoreError::Decode`] carries `decode`'s error.
    pub fn get_with<T, E>(
        &self,
        family: Family,
        key: &str,
        decode: impl FnOnce(&[u8]) -> Result<T, E>,
    ) -> Result<Option<T>, StoreError>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let guard = self.db()?;
        let db = guard.as_ref().ok_or(StoreError::Closed)?;
        let Some(bytes) = db.get_pinned_cf(family_handle(db, family), key.as_bytes()).map_err(StoreError::Read)? else {
            return Ok(None);
        };
        decode(&bytes).map(Some).map_err(|source| StoreError::Decode { key: key.to_owned(), source: Box::new(source) })
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
        self.scan(family, |key, value| {
            visit(String::from_utf8_lossy(key).into_owned(), serde_json::from_slice::<T>(value).ok());
        })
    }

    /// Calls `visit` with the key and raw value of each record of `family`, in key order, without copying
    /// either: the boot scan of a million delivery records, whose owner decodes them in place.
    ///
    /// The scan reads ahead (one large read per stretch of the file instead of a read per block) and leaves
    /// the block cache alone: every block is read once, and filling the cache with them would only push out
    /// what the running instance reads again.
    ///
    /// # Errors
    /// [`StoreError::Read`] when iteration fails.
    pub fn scan(&self, family: Family, mut visit: impl FnMut(&[u8], &[u8])) -> Result<(), StoreError> {
        /// What one read ahead takes: a few dozen blocks, far fewer reads than one per 4 KiB block.
        const SCAN_READAHEAD_BYTES: usize = 2 * 1024 * 1024;
        let guard = self.db()?;
        let db = guard.as_ref().ok_or(StoreError::Closed)?;
        let mut options = ReadOptions::default();
        options.fill_cache(false);
        options.set_readahead_size(SCAN_READAHEAD_BYTES);
        let mut iterator = db.raw_iterator_cf_opt(family_handle(db, family), options);
        iterator.seek_to_first();
        while let (Some(key), Some(value)) = (iterator.key(), iterator.value()) {
            visit(key, value);
            iterator.next();
        }
        iterator.status().map_err(StoreError::Read)
    }

    /// The keys of `family` that start with `prefix`, in order, while `visit` returns `true`.
    ///
    /// # Errors
    /// [`StoreError::Read`] when iteration fails.
    pub fn scan_prefix(
        &self,
        family: Family,
        prefix: &str,
        mut visit: impl FnMut(&str) -> bool,
    ) -> Result<(), StoreError> {
        let guard = self.db()?;
        let db = guard.as_ref().ok_or(StoreError::Closed)?;
        let from = IteratorMode::From(prefix.as_bytes(), rocksdb::Direction::Forward);
        for item in db.iterator_cf(family_handle(db, family), from) {
            let (key, _) = item.map_err(StoreError::Read)?;
            if !key.starts_with(prefix.as_bytes()) || !visit(&String::from_utf8_lossy(&key)) {
                break;
            }
        }
        Ok(())
    }

    /// Every record of `family`, decoded as `T`.
    ///
    /// # Errors
    /// [`StoreError::Read`] when iteration fails.
    pub fn list<T: DeserializeOwned>(&self, family: Family) -> Result<Listing<T>, StoreError> {
        self.list_with(family, |bytes| serde_json::from_slice::<T>(bytes).ok())
    }

    /// Every record of `family`, decoded by `decode` (`None`: undecodable).
    ///
    /// # Errors
    /// [`StoreError::Read`] when iteration fails.
    pub fn list_with<T>(&self, family: Family, decode: impl Fn(&[u8]) -> Option<T>) -> Result<Listing<T>, StoreError> {
        let mut listing = Listing { records: Vec::new(), undecodable: Vec::new() };
        self.scan(family, |key, value| {
            let key = String::from_utf8_lossy(key).into_owned();
            match decode(value) {
                Some(record) => listing.records.push((key, record)),
                None => listing.undecodable.push(key),
            }
        })?;
        Ok(listing)
    }

    /// Stores raw bytes under `key`, bypassing encoding: for tools and crash tests that plant a corrupt record.
    ///
    /// # Errors
    /// [`StoreError::Write`].
    pub async fn put_raw(&self, family: Family, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.apply(&[Change::Put(family, key, value.to_vec())]).await
    }

    /// Test hook: every group commit takes `delay` longer, as on a slow disk.
    #[cfg(test)]
    pub(crate) fn slow_down_commits(&self, delay: Duration) {
        *self.shared.commit_delay.lock() = delay;
    }

    /// Test hook: the group commits made so far.
    #[cfg(test)]
    pub(crate) fn commits(&self) -> usize {
        self.shared.commits.load(Ordering::Relaxed)
    }
}

impl Drop for StateStore {
    /// Ends the writer once it has answered what is queued, so the directory is free for the next open.
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Rec {
        n: u32,
    }

    #[tokio::test]
    async fn records_survive_a_reopen_and_corrupt_ones_are_listed_apart() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let store = StateStore::open(dir.path(), true).expect("open");
            store.put(Family::Deliveries, "a", &Rec { n: 1 }).await.expect("put");
            store.put(Family::Deliveries, "b", &Rec { n: 2 }).await.expect("put");
            store.put_raw(Family::Deliveries, "c", b"{not json").await.expect("put raw");
            store.put(Family::Subscriptions, "g\nt", &Rec { n: 9 }).await.expect("put");
            store.delete(Family::Deliveries, "b").await.expect("delete");
        }
        let store = StateStore::open(dir.path(), true).expect("reopen");
        let listing = store.list::<Rec>(Family::Deliveries).expect("list");
        assert_eq!(listing.records, vec![("a".to_owned(), Rec { n: 1 })]);
        assert_eq!(listing.undecodable, vec!["c".to_owned()]);
        assert_eq!(store.list::<Rec>(Family::Subscriptions).expect("list").records.len(), 1);
    }

    #[tokio::test]
    async fn an_undecodable_record_is_an_error_not_an_absent_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path(), false).expect("open");
        store.put_raw(Family::DlqReplays, "k", b"{not json").await.expect("put raw");
        assert!(matches!(store.get::<Rec>(Family::DlqReplays, "k"), Err(StoreError::Decode { .. })));
        assert!(store.get::<Rec>(Family::DlqReplays, "absent").expect("read").is_none());
        assert!(store.is_healthy());
    }

    #[tokio::test]
    async fn a_batch_applies_every_change_together() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path(), false).expect("open");
        store.put(Family::Deliveries, "x", &Rec { n: 1 }).await.expect("put");
        let value = serde_json::to_vec(&Rec { n: 2 }).expect("encode");
        store
            .apply(&[Change::Delete(Family::Deliveries, "x"), Change::Put(Family::Deliveries, "y", value)])
            .await
            .expect("batch");
        let keys: Vec<String> =
            store.list::<Rec>(Family::Deliveries).expect("list").records.into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, vec!["y".to_owned()]);
    }
}
