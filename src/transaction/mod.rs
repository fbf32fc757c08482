//! Transactional messages: the durable record of each half message, and its end.
//!
//! A transactional send stores a half message at a broker (the publish path, as every send); before the send
//! is answered, popgate writes here what ending the transaction needs (broker, half-topic and commit-log
//! offsets, producer group). So a commit or rollback works after a popgate restart, and on any popgate that
//! shares the state directory. Apache's proxy keeps that in memory for 30 s.
//!
//! Ending a transaction sends `END_TRANSACTION` to the broker and waits for its answer. When the broker cannot
//! be reached the resolution is stored as owed and retried in the background until the broker has it: the
//! broker's check-back is the last resort, never the plan. A commit whose answer was lost may have landed, and
//! the broker would commit the message again if asked again, so before retrying such a commit popgate looks
//! the committed message up.
//!
//! A record lives `transactions.record_retention_secs` after its send, ended or not: an end repeated within
//! it is answered as the first (an SDK retrying), the other resolution is refused.
//!
//! popgate registers at the brokers as a producer of its transactional group (`transactions.producer_group`),
//! so their check-backs (`CHECK_TRANSACTION_STATE`) come to popgate. A transaction whose end popgate knows is
//! answered from its record; any other is passed to a front ([`CheckForwarder`]) to ask a live producer of
//! its topic, whose answer comes back as an end. With no producer to ask the check is dropped, and the broker
//! asks again at its next pass.

mod check_back;
mod ending;
mod expiry;
mod record;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use metrics::gauge;
use parking_lot::Mutex;

pub use self::record::{State, TransactionRecord};
pub use crate::broker::consumer::PoppedEvent as Event;
use crate::broker::transaction::CheckBacks;
pub use crate::broker::transaction::{mark_half, HalfMessage, RemotingCheck, Resolution, PROPERTY_REMOTING_GROUP};
use crate::broker::{BrokerClient, BrokerError};
use crate::clock::Epoch;
use crate::config::TransactionConfig;
use crate::metrics as m;
use crate::store::{expiry_key, Change, Family, StateStore, StoreError, EXPIRY_PREFIX};

use self::check_back::{check_loop, register_loop};
use self::ending::owed_loop;
use self::expiry::{expiry_loop, index_unindexed};

/// How long an end waits while another task works on the same transaction.
const CLAIM_WAIT: Duration = Duration::from_secs(10);

/// How an end went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The broker has the resolution.
    Landed,
    /// The broker could not be reached: the resolution is stored and retried until it lands.
    Owed,
}

/// Why a transaction could not be ended.
#[derive(Debug, thiserror::Error)]
pub enum TransactionError {
    /// No record of that transaction on that topic (never sent through popgate, or past its retention).
    #[error("no transaction `{0}` on this topic is known (never sent, or older than its retention)")]
    Unknown(String),
    /// It already ended the other way.
    #[error("transaction `{id}` was already ended with {}", .ended.as_str())]
    AlreadyEnded {
        /// The transaction id.
        id: String,
        /// How it ended.
        ended: Resolution,
    },
    /// The broker refused the resolution (it no longer has the half message, or it does not match).
    #[error("the broker refused to end transaction `{id}`: {error}")]
    Refused {
        /// The transaction id.
        id: String,
        /// The broker's answer.
        error: BrokerError,
    },
    /// Another request is ending it right now and did not finish in time.
    #[error("transaction `{0}` is being ended by another request")]
    Busy(String),
    /// The state store failed: nothing changed.
    #[error("state store: {0}")]
    Store(#[from] StoreError),
}

/// A transaction the broker asks about, for a front to ask one of its producers (the broker's check-back).
#[derive(Debug, Clone)]
pub struct Orphan {
    /// The transaction id (the message id).
    pub transaction_id: String,
    /// The half message, as a consumer of its topic would see it.
    pub event: Event,
    /// The HTTP checker its producer named when it sent it (`transactions.checkers`), if any.
    pub http_checker: Option<String>,
    /// What its producer is asked when a remoting producer sent it.
    pub remoting: Option<RemotingCheck>,
}

/// Where check-backs go: a front that can ask a live producer of the topic. The producer's answer comes back as
/// an end with `from_check` ([`Transactions::end`]).
pub trait CheckForwarder: Send + Sync {
    /// Asks a producer of `orphan`'s topic how its transaction ended; false when no producer could be asked.
    fn forward(&self, orphan: &Orphan) -> bool;
}

/// The records of transactions, and their owed work. One per process.
pub struct Transactions {
    store: Arc<StateStore>,
    broker: Arc<BrokerClient>,
    config: TransactionConfig,
    /// Transactions a task is changing right now; others wait.
    claimed: Mutex<HashSet<String>>,
    /// Owed resolutions, by transaction id, with the time of their next try (epoch ms).
    owed: Mutex<HashMap<String, Epoch>>,
    /// popgate's registration as a producer of its transactional group, once the brokers could be told
    /// (retried in the background until they can).
    check_backs: tokio::sync::OnceCell<CheckBacks>,
    /// Topics to watch once the registration is made.
    topics_to_watch: Mutex<HashSet<String>>,
    /// The fronts that ask producers; tried in turn.
    forwarders: Mutex<Vec<std::sync::Weak<dyn CheckForwarder>>>,
}

impl Transactions {
    /// Loads the owed resolutions from the store, registers popgate at the brokers as a producer of its
    /// transactional group (for their check-backs) and starts the background work (owed retries, expiry,
    /// check-backs).
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be read.
    pub async fn start(
        store: Arc<StateStore>,
        broker: Arc<BrokerClient>,
        config: TransactionConfig,
    ) -> Result<Arc<Transactions>, StoreError> {
        let mut owed = HashMap::new();
        let mut topics = HashSet::new();
        let listing = store.list::<TransactionRecord>(Family::Transactions)?;
        // Housekeeping only: a store that cannot write now (disk full) must not stop popgate from serving.
        // The index entries are listed as undecodable records (their values are empty).
        let indexed: HashSet<&str> =
            listing.undecodable.iter().map(String::as_str).filter(|k| k.starts_with(EXPIRY_PREFIX)).collect();
        if let Err(error) = index_unindexed(&store, &listing.records, &indexed).await {
            tracing::warn!(%error, "Could not index the transaction records for expiry; they expire after a later boot.");
        }
        for id in listing.undecodable.iter().filter(|k| !k.starts_with(EXPIRY_PREFIX)) {
            tracing::warn!(transaction = %id, "Removing a transaction record that no longer decodes.");
            if let Err(error) = store.delete(Family::Transactions, id).await {
                tracing::warn!(%error, transaction = %id, "Could not remove an undecodable transaction record.");
            }
        }
        for (id, record) in listing.records {
            if let State::Owed { next_try_ms, .. } = record.state {
                owed.insert(id, next_try_ms);
            }
            if !matches!(record.state, State::Ended { .. }) {
                topics.insert(record.half.topic);
            }
        }
        gauge!(m::TRANSACTIONS_OWED).set(owed.len() as f64);
        let transactions = Arc::new(Transactions {
            store,
            broker,
            config,
            claimed: Mutex::new(HashSet::new()),
            owed: Mutex::new(owed),
            check_backs: tokio::sync::OnceCell::new(),
            topics_to_watch: Mutex::new(topics),
            forwarders: Mutex::new(Vec::new()),
        });
        // The first try is made before popgate serves, so its check-backs come from the start when it can.
        if let Some(checks) = transactions.register_for_check_backs().await {
            tokio::spawn(check_loop(Arc::downgrade(&transactions), checks));
        } else {
            tokio::spawn(register_loop(Arc::downgrade(&transactions)));
        }
        tokio::spawn(owed_loop(Arc::downgrade(&transactions)));
        tokio::spawn(expiry_loop(Arc::downgrade(&transactions)));
        Ok(transactions)
    }

    /// Adds a front that asks producers about the brokers' check-backs.
    pub fn add_forwarder(&self, forwarder: std::sync::Weak<dyn CheckForwarder>) {
        self.forwarders.lock().push(forwarder);
    }

    /// Stops the registration at the brokers.
    pub async fn shutdown(&self) {
        if let Some(backs) = self.check_backs.get() {
            backs.shutdown().await;
        }
    }

    async fn watch_topic(&self, topic: &str) {
        if self.check_backs.get().is_none() {
            self.topics_to_watch.lock().insert(topic.to_owned());
        }
        // Also when the registration was made meanwhile (it drains the set after it is made).
        if let Some(backs) = self.check_backs.get() {
            let topics: Vec<String> = self.topics_to_watch.lock().drain().chain([topic.to_owned()]).collect();
            for topic in topics {
                backs.watch_topic(&topic).await;
            }
        }
    }

    /// The record of transaction `id`, while it is kept.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be read.
    pub fn lookup(&self, id: &str) -> Result<Option<TransactionRecord>, StoreError> {
        let record = self.store.get::<TransactionRecord>(Family::Transactions, id)?;
        Ok(record.filter(|r| r.expires_ms > Epoch::now()))
    }

    /// The producer group every half message carries.
    pub fn producer_group(&self) -> &str {
        &self.config.producer_group
    }

    /// Records a half message the broker stored, before its send is answered. A send repeated under the same
    /// message id (an SDK retry answered from the de-duplication window) keeps the record it has, while that
    /// transaction is not ended. A remoting producer that sends the same `Message` again keeps its id
    /// (`UNIQ_KEY`): a half message stored anew under the id of an *ended* transaction is a new transaction,
    /// whose record replaces the ended one (its end would otherwise find the old one and never commit the new
    /// half message).
    ///
    /// # Errors
    /// [`TransactionError::Store`] when it cannot be stored (the send must then fail: its transaction could
    /// not be ended).
    pub async fn record(&self, half: HalfMessage) -> Result<(), TransactionError> {
        let _claim = self.claim(&half.message_id).await?;
        let known = self.store.get::<TransactionRecord>(Family::Transactions, &half.message_id)?;
        let replaced = match known {
            None => None,
            Some(ended) if ended_before(&ended, &half) => Some(ended),
            Some(_) => return Ok(()),
        };
        let now = Epoch::now();
        let record = TransactionRecord {
            transaction_id: half.message_id.clone(),
            half,
            sent_ms: now,
            expires_ms: now + retention(&self.config),
            state: State::Open,
        };
        match replaced {
            None => self.store_new(&record).await?,
            Some(ended) => self.replace(&ended, &record).await?,
        }
        self.watch_topic(&record.half.topic).await;
        Ok(())
    }

    /// Stores `record` in place of `ended`, moving its entry in the expiry index (the old entry would expire the
    /// new record early).
    async fn replace(&self, ended: &TransactionRecord, record: &TransactionRecord) -> Result<(), StoreError> {
        let id = record.transaction_id.as_str();
        let value = serde_json::to_vec(record)?;
        let old_index = expiry_key(ended.expires_ms, id);
        let index = expiry_key(record.expires_ms, id);
        let changes = [
            Change::Delete(Family::Transactions, &old_index),
            Change::Put(Family::Transactions, id, value),
            Change::Put(Family::Transactions, &index, vec![]),
        ];
        self.store.apply(&changes).await
    }

    /// Stores a new record with its entry in the expiry index, at once.
    async fn store_new(&self, record: &TransactionRecord) -> Result<(), StoreError> {
        let id = record.transaction_id.as_str();
        let value = serde_json::to_vec(record)?;
        let index = expiry_key(record.expires_ms, id);
        let changes = [Change::Put(Family::Transactions, id, value), Change::Put(Family::Transactions, &index, vec![])];
        self.store.apply(&changes).await
    }

    /// Marks `id` as worked on, waiting while another task has it.
    async fn claim(&self, id: &str) -> Result<Claim<'_>, TransactionError> {
        let started = tokio::time::Instant::now();
        loop {
            if self.claimed.lock().insert(id.to_owned()) {
                return Ok(Claim { transactions: self, id: id.to_owned() });
            }
            if started.elapsed() > CLAIM_WAIT {
                return Err(TransactionError::Busy(id.to_owned()));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A transaction being worked on; released when dropped.
struct Claim<'a> {
    transactions: &'a Transactions,
    id: String,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.transactions.claimed.lock().remove(&self.id);
    }
}

/// Whether `known` is an ended transaction of another half message than `half` (stored elsewhere in the
/// commit log): the same id sent again, in a new transaction.
fn ended_before(known: &TransactionRecord, half: &HalfMessage) -> bool {
    matches!(known.state, State::Ended { .. })
        && (known.half.commit_log_offset, known.half.broker_name.as_str())
            != (half.commit_log_offset, half.broker_name.as_str())
}

fn retention(config: &TransactionConfig) -> Duration {
    Duration::from_secs(config.record_retention_secs)
}
