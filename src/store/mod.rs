//! The durable state store: RocksDB with its write-ahead log on, one column family per kind of record.
//!
//! ```text
//! deliveries     deliveryId (32 hex chars)  -> in-flight delivery record (JSON)
//! subscriptions  "<group>\n<topic>"          -> subscription (JSON)
//! dlq_replays    "<dlq topic>\n<message id>"  -> replay progress (JSON)
//! payloads       deliveryId                  -> the event body (raw bytes)
//! ```
//!
//! Records are JSON so an operator can read them with `ldb`; the types belong to their owners (the delivery
//! module), and this module only stores and lists them. No RocksDB type leaves it. A record that no longer
//! decodes is listed apart, for recovery to retire.
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

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(test)]
use parking_lot::Mutex;
use parking_lot::{RwLock, RwLockReadGuard};
use rocksdb::{ColumnFamilyDescriptor, IteratorMode, Options, WriteBatch, WriteOptions, DB};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::oneshot;

use crate::clock::Epoch;

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
    /// The publish de-duplication window: the receipt of each recent send by its key, and an expiry index.
    Published,
    /// Transactional messages: what ending each transaction needs, and how it ended, by transaction id.
    Transactions,
    /// In a tier, ACKs made at the broker for another instance's deliveries while it could not be reached,
    /// keyed by that instance and the delivery id, until it is told.
    UntoldAcks,
    /// In a tier, subscriptions removed (by group and topic) and the version of the removal, so an instance
    /// that still has one does not bring it back (`delivery::shared`).
    RemovedSubscriptions,
}

impl Family {
    const ALL: [Family; 8] = [
        Family::Deliveries,
        Family::Subscriptions,
        Family::DlqReplays,
        Family::Payloads,
        Family::Published,
        Family::Transactions,
        Family::UntoldAcks,
        Family::RemovedSubscriptions,
    ];

    /// The family's memtable size. Memtables count in popgate's RSS (two per family at most), so they are
    /// far below RocksDB's 64 MiB: a delivery's records (admitted, handed out, deleted) and its body (written,
    /// read, deleted) still mostly meet and cancel within one memtable, since a delivery lives for
    /// milliseconds to seconds under load. Bodies are the bulk of the bytes and are written once, so their
    /// memtable is the smallest.
    fn write_buffer_bytes(self) -> usize {
        match self {
            Family::Payloads => 4 * 1024 * 1024,
            Family::Deliveries => 8 * 1024 * 1024,
            Family::Subscriptions | Family::DlqReplays | Family::Published | Family::Transactions => 4 * 1024 * 1024,
            // Written only while a peer cannot be reached.
            Family::UntoldAcks | Family::RemovedSubscriptions => 1024 * 1024,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Family::Deliveries => "deliveries",
            Family::Subscriptions => "subscriptions",
            Family::DlqReplays => "dlq_replays",
            Family::Payloads => "payloads",
            Family::Published => "published",
            Family::Transactions => "transactions",
            Family::UntoldAcks => "untold_acks",
            Family::RemovedSubscriptions => "removed_subscriptions",
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
    /// The writer thread could not be started.
    #[error("cannot start the state store's writer thread: {0}")]
    Writer(#[source] std::io::Error),
}

/// The shortest pause between two attempts to reopen a failed database.
const REOPEN_PAUSE: Duration = Duration::from_secs(1);
/// The most callers' writes one group commit takes: enough to turn a burst into a few synced batches, few
/// enough that one batch (and the callers waiting on it) never grows without bound.
const MAX_GROUP_WRITES: usize = 1024;

/// One change in an atomic batch.
#[derive(Debug)]
pub enum Change<'a> {
    /// Store `value` (JSON, or a payload's raw bytes) under `key`.
    Put(Family, &'a str, Vec<u8>),
    /// Remove `key`.
    Delete(Family, &'a str),
}

/// A change as the writer thread takes it: owned, so the caller's borrow ends when it is queued.
struct OwnedChange {
    family: Family,
    key: Box<[u8]>,
    /// `None`: delete.
    value: Option<Vec<u8>>,
}

/// What a caller asks the writer thread for.
enum Job {
    /// Apply these changes atomically (with the other jobs of the same group commit).
    Write(Vec<OwnedChange>, oneshot::Sender<Result<(), StoreError>>),
    /// Sync the WAL to disk (the group commit of async-flush profiles).
    SyncWal(oneshot::Sender<Result<(), StoreError>>),
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

/// What the writer thread and the readers share.
struct Shared {
    dir: PathBuf,
    sync_writes: bool,
    /// `None` while closed after a failure.
    db: RwLock<Option<DB>>,
    /// A write failed: the writer reopens the database before its next group.
    failed: AtomicBool,
    /// False from a failed write (or WAL sync) until the next one that succeeds.
    healthy: AtomicBool,
    /// Test hook: how long each group commit takes on top of RocksDB's own time (a slow disk).
    #[cfg(test)]
    commit_delay: Mutex<Duration>,
    /// Group commits made, for tests.
    #[cfg(test)]
    commits: std::sync::atomic::AtomicUsize,
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
    /// Opens (creating if needed) the store in `dir` and starts its writer thread.
    ///
    /// # Errors
    /// [`StoreError::Open`] when RocksDB cannot open the directory; [`StoreError::Writer`] when the writer
    /// thread cannot be started.
    pub fn open(dir: &Path, sync_writes: bool) -> Result<StateStore, StoreError> {
        let db = open_db(dir)?;
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            sync_writes,
            db: RwLock::new(Some(db)),
            failed: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            #[cfg(test)]
            commit_delay: Mutex::new(Duration::ZERO),
            #[cfg(test)]
            commits: std::sync::atomic::AtomicUsize::new(0),
        });
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
        let owned = changes
            .iter()
            .map(|change| match change {
                Change::Put(family, key, value) => {
                    OwnedChange { family: *family, key: key.as_bytes().into(), value: Some(value.clone()) }
                }
                Change::Delete(family, key) => OwnedChange { family: *family, key: key.as_bytes().into(), value: None },
            })
            .collect();
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

    /// The entries of `family`'s expiry index ([`expiry_key`]) whose time is at most `cutoff_ms`, oldest
    /// first, as `(index key, key)`.
    ///
    /// # Errors
    /// [`StoreError::Read`] when iteration fails.
    pub fn due(&self, family: Family, cutoff: Epoch) -> Result<Vec<(String, String)>, StoreError> {
        let mut due = Vec::new();
        self.scan_prefix(family, EXPIRY_PREFIX, |index_key| {
            let Some((at, key)) = parse_expiry_key(index_key) else { return true };
            if at > cutoff.as_millis() {
                return false;
            }
            due.push((index_key.to_owned(), key.to_owned()));
            true
        })?;
        Ok(due)
    }

    /// Removes `due` entries of `family`'s expiry index and the keys they name, in batches.
    ///
    /// # Errors
    /// [`StoreError::Write`]: what was not removed yet stays due.
    pub async fn remove_due(&self, family: Family, due: &[(String, String)]) -> Result<(), StoreError> {
        for chunk in due.chunks(512) {
            let changes: Vec<Change<'_>> = chunk
                .iter()
                .flat_map(|(index, key)| [Change::Delete(family, index), Change::Delete(family, key)])
                .collect();
            self.apply(&changes).await?;
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

// === the writer thread ===

impl Shared {
    /// Commits queued jobs, a group at a time, until every sender is gone.
    fn run_writer(&self, queue: &std::sync::mpsc::Receiver<Job>) {
        let mut last_reopen: Option<Instant> = None;
        loop {
            // While failed, wake up to retry the reopen even when no write comes.
            let first = if self.failed.load(Ordering::Relaxed) {
                match queue.recv_timeout(REOPEN_PAUSE) {
                    Ok(job) => Some(job),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                }
            } else {
                match queue.recv() {
                    Ok(job) => Some(job),
                    Err(_) => return,
                }
            };
            if self.failed.load(Ordering::Relaxed) && last_reopen.is_none_or(|at| at.elapsed() >= REOPEN_PAUSE) {
                last_reopen = Some(Instant::now());
                self.reopen();
            }
            let Some(first) = first else { continue };
            let mut group = vec![first];
            while group.len() < MAX_GROUP_WRITES {
                match queue.try_recv() {
                    Ok(job) => group.push(job),
                    Err(_) => break,
                }
            }
            self.commit_group(group);
        }
    }

    /// Writes every job's changes as one batch, synced once (and the WAL synced for those that asked), then
    /// answers each job.
    fn commit_group(&self, group: Vec<Job>) {
        let started = Instant::now();
        #[cfg(test)]
        {
            std::thread::sleep(*self.commit_delay.lock());
            self.commits.fetch_add(1, Ordering::Relaxed);
        }
        let writes = group.iter().filter(|job| matches!(job, Job::Write(..))).count();
        let wal_syncs = group.len() - writes;
        let guard = self.db.read();
        let result = match guard.as_ref() {
            None => Err(None),
            Some(db) => self.write_group(db, &group).map_err(Some),
        };
        // A synced write also syncs the WAL; otherwise a sync asked for is done after the writes.
        let wal_result = match guard.as_ref() {
            Some(db) if wal_syncs > 0 && !(self.sync_writes && writes > 0) => db.flush_wal(true).map_err(Some),
            Some(_) => Ok(()),
            None => Err(None),
        };
        drop(guard);
        metrics::histogram!(crate::metrics::STORE_GROUP_COMMIT_WRITES).record(writes as f64);
        metrics::histogram!(crate::metrics::STORE_COMMIT_DURATION).record(started.elapsed().as_secs_f64());
        for job in group {
            let (what, outcome, reply) = match job {
                Job::Write(_, reply) => ("batch", &result, reply),
                Job::SyncWal(reply) => ("wal sync", &wal_result, reply),
            };
            let answer = match outcome {
                Ok(()) => Ok(()),
                Err(Some(error)) => Err(StoreError::Write(error.clone())),
                Err(None) => Err(StoreError::Closed),
            };
            let _ = reply.send(self.account(what, answer));
        }
    }

    fn write_group(&self, db: &DB, group: &[Job]) -> Result<(), rocksdb::Error> {
        let mut batch = WriteBatch::default();
        for change in group.iter().flat_map(|job| match job {
            Job::Write(changes, _) => changes.as_slice(),
            Job::SyncWal(_) => &[],
        }) {
            let handle = family_handle(db, change.family);
            match &change.value {
                Some(value) => batch.put_cf(handle, &change.key, value),
                None => batch.delete_cf(handle, &change.key),
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        let mut options = WriteOptions::default();
        options.set_sync(self.sync_writes);
        db.write_opt(batch, &options)
    }

    /// Keeps the health flag, the failure counter and the reopen flag true to a job's outcome.
    fn account(&self, what: &'static str, result: Result<(), StoreError>) -> Result<(), StoreError> {
        match &result {
            Ok(()) => self.healthy.store(true, Ordering::Relaxed),
            Err(error) => {
                // After a failed write RocksDB refuses every later one: reopen before the next group.
                self.failed.store(true, Ordering::Relaxed);
                self.healthy.store(false, Ordering::Relaxed);
                metrics::counter!(crate::metrics::OFFSET_WRITE_FAILURES).increment(1);
                tracing::warn!(%error, what, "State store write failed.");
            }
        }
        result
    }

    /// Closes the failed database and opens it again (the WAL replay brings back everything acknowledged).
    /// The lock is held only to swap: readers meanwhile get `Closed` at once instead of waiting out the replay.
    fn reopen(&self) {
        // Closed first: RocksDB holds a lock on the directory.
        let old = self.db.write().take();
        drop(old);
        match open_db(&self.dir) {
            Ok(db) => {
                *self.db.write() = Some(db);
                self.failed.store(false, Ordering::Relaxed);
                tracing::info!(dir = %self.dir.display(), "State store reopened after a failure.");
            }
            Err(error) => tracing::warn!(%error, "State store still cannot be reopened."),
        }
    }
}

fn family_handle(db: &DB, family: Family) -> &rocksdb::ColumnFamily {
    // Every family is created at open (`create_missing_column_families`), so the handle always exists.
    #[allow(clippy::expect_used)]
    db.cf_handle(family.name()).expect("column family created at open")
}

/// Prefix of an expiry index kept inside a family beside its records: keys `~<time ms, 13 digits>\n<key>`,
/// in the order they expire, so forgetting what is due reads only that ([`StateStore::due`]). Record keys
/// never start with `~`.
pub const EXPIRY_PREFIX: &str = "~";

/// The expiry-index key that makes `key` due at `at`.
pub fn expiry_key(at: Epoch, key: &str) -> String {
    let at_ms = at.as_millis();
    format!("{EXPIRY_PREFIX}{at_ms:013}\n{key}")
}

fn parse_expiry_key(index_key: &str) -> Option<(i64, &str)> {
    let (at, key) = index_key.strip_prefix(EXPIRY_PREFIX)?.split_once('\n')?;
    Some((at.parse().ok()?, key))
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

    /// A multi-threaded runtime with one worker: what a loaded machine looks like to a task.
    fn one_worker() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime")
    }

    #[test]
    fn a_slow_synced_write_never_stalls_the_runtime() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(StateStore::open(dir.path(), true).expect("open"));
        store.slow_down_commits(Duration::from_millis(800));
        one_worker().block_on(async {
            let writing = tokio::spawn({
                let store = store.clone();
                async move { store.put(Family::Deliveries, "a", &Rec { n: 1 }).await }
            });
            // The only worker must stay free for everything else while the write waits for its "disk".
            let started = Instant::now();
            let timer = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                started.elapsed()
            });
            let took = timer.await.expect("timer task");
            assert!(took < Duration::from_millis(600), "a 20 ms timer took {took:?} behind a slow write");
            writing.await.expect("task").expect("put");
        });
        assert_eq!(store.get::<Rec>(Family::Deliveries, "a").expect("read"), Some(Rec { n: 1 }));
    }

    #[test]
    fn concurrent_writes_share_a_group_commit_and_each_stays_atomic() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(StateStore::open(dir.path(), true).expect("open"));
        store.slow_down_commits(Duration::from_millis(200));
        one_worker().block_on(async {
            let writes = (0..50).map(|n| {
                let store = store.clone();
                tokio::spawn(async move {
                    let (a, b) = (format!("a{n}"), format!("b{n}"));
                    let value = serde_json::to_vec(&Rec { n }).expect("encode");
                    store
                        .apply(&[
                            Change::Put(Family::Deliveries, &a, value.clone()),
                            Change::Put(Family::Payloads, &b, value),
                        ])
                        .await
                })
            });
            for write in futures::future::join_all(writes).await {
                write.expect("task").expect("write");
            }
        });
        assert!(store.commits() <= 3, "50 writes in {} group commits", store.commits());
        assert_eq!(store.list::<Rec>(Family::Deliveries).expect("list").records.len(), 50);
        assert_eq!(store.list::<Rec>(Family::Payloads).expect("list").records.len(), 50);
    }

    #[test]
    fn expiry_keys_sort_by_time_and_parse_back() {
        let (a, b) = (expiry_key(Epoch::from_millis(999), "t\nx"), expiry_key(Epoch::from_millis(1_000), "t\ny"));
        assert!(a < b);
        assert_eq!(parse_expiry_key(&b), Some((1_000, "t\ny")));
    }

    #[tokio::test]
    async fn only_what_is_due_is_removed_with_its_index_entry() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path(), true).expect("open");
        for (key, at) in [("early", 1_000), ("late", 5_000)] {
            store.put(Family::Transactions, key, &Rec { n: 1 }).await.expect("put");
            store.put_raw(Family::Transactions, &expiry_key(Epoch::from_millis(at), key), b"").await.expect("index");
        }
        let due = store.due(Family::Transactions, Epoch::from_millis(2_000)).expect("due");
        assert_eq!(due, [(expiry_key(Epoch::from_millis(1_000), "early"), "early".to_owned())]);
        store.remove_due(Family::Transactions, &due).await.expect("remove");
        assert!(store.get::<Rec>(Family::Transactions, "early").expect("get").is_none());
        assert!(store.get::<Rec>(Family::Transactions, "late").expect("get").is_some());
        assert_eq!(store.due(Family::Transactions, Epoch::from_millis(10_000)).expect("due").len(), 1);
    }
}
