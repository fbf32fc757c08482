//! The writer thread: every write of the store is queued here and group-committed, never run on a Tokio
//! worker; after a failed write the writer reopens the database. Its own room because it is the store's one
//! piece of concurrency: the readers only share [`Shared`] with it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[cfg(test)]
use parking_lot::Mutex;
use parking_lot::RwLock;
use rocksdb::{WriteBatch, WriteOptions, DB};
use tokio::sync::oneshot;

use super::family::{family_handle, open_db};
use super::{Change, Family, StoreError};

/// The shortest pause between two attempts to reopen a failed database.
const REOPEN_PAUSE: Duration = Duration::from_secs(1);
/// The most callers' writes one group commit takes: enough to turn a burst into a few synced batches, few
/// enough that one batch (and the callers waiting on it) never grows without bound.
const MAX_GROUP_WRITES: usize = 1024;

/// A change as the writer thread takes it: owned, so the caller's borrow ends when it is queued.
pub(super) struct OwnedChange {
    family: Family,
    key: Box<[u8]>,
    /// `None`: delete.
    value: Option<Vec<u8>>,
}

impl From<&Change<'_>> for OwnedChange {
    fn from(change: &Change<'_>) -> OwnedChange {
        match change {
            Change::Put(family, key, value) => {
                OwnedChange { family: *family, key: key.as_bytes().into(), value: Some(value.clone()) }
            }
            Change::Delete(family, key) => OwnedChange { family: *family, key: key.as_bytes().into(), value: None },
        }
    }
}

/// What a caller asks the writer thread for.
pub(super) enum Job {
    /// Apply these changes atomically (with the other jobs of the same group commit).
    Write(Vec<OwnedChange>, oneshot::Sender<Result<(), StoreError>>),
    /// Sync the WAL to disk (the group commit of async-flush profiles).
    SyncWal(oneshot::Sender<Result<(), StoreError>>),
}

/// What the writer thread and the readers share.
pub(super) struct Shared {
    dir: PathBuf,
    sync_writes: bool,
    /// `None` while closed after a failure.
    pub(super) db: RwLock<Option<DB>>,
    /// A write failed: the writer reopens the database before its next group.
    failed: AtomicBool,
    /// False from a failed write (or WAL sync) until the next one that succeeds.
    pub(super) healthy: AtomicBool,
    /// Test hook: how long each group commit takes on top of RocksDB's own time (a slow disk).
    #[cfg(test)]
    pub(super) commit_delay: Mutex<Duration>,
    /// Group commits made, for tests.
    #[cfg(test)]
    pub(super) commits: std::sync::atomic::AtomicUsize,
}

impl Shared {
    /// What the writer of the database `db`, opened in `dir`, shares with the readers.
    pub(super) fn new(dir: &Path, sync_writes: bool, db: DB) -> Shared {
        Shared {
            dir: dir.to_path_buf(),
            sync_writes,
            db: RwLock::new(Some(db)),
            failed: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            #[cfg(test)]
            commit_delay: Mutex::new(Duration::ZERO),
            #[cfg(test)]
            commits: std::sync::atomic::AtomicUsize::new(0),
        }
    }
    /// Commits queued jobs, a group at a time, until every sender is gone.
    pub(super) fn run_writer(&self, queue: &std::sync::mpsc::Receiver<Job>) {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::StateStore;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Rec {
        n: u32,
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
}
