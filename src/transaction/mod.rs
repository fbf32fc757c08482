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

mod record;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, gauge};
use parking_lot::Mutex;
use rand::Rng;

pub use self::record::{State, TransactionRecord};
pub use crate::broker::consumer::PoppedEvent as Event;
pub use crate::broker::transaction::{mark_half, HalfMessage, RemotingCheck, Resolution, PROPERTY_REMOTING_GROUP};
use crate::broker::transaction::{CheckBacks, OrphanCheck};
use crate::broker::{BrokerClient, BrokerError};
use crate::clock::Epoch;
use crate::config::TransactionConfig;
use crate::metrics as m;
use crate::store::{expiry_key, Change, Family, StateStore, StoreError, EXPIRY_PREFIX};

/// First wait before an owed resolution is tried again; it doubles up to [`OWED_MAX_BACKOFF`], ±20 %.
const OWED_FIRST_BACKOFF: Duration = Duration::from_secs(1);
const OWED_MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How often the owed resolutions are looked at, and the records past their retention removed.
const SWEEP_EVERY: Duration = Duration::from_millis(500);
const EXPIRE_EVERY: Duration = Duration::from_secs(60);
/// Kept back from a producer's deadline when an end waits for its broker: storing the resolution as owed
/// (a synced write) must still fit before the deadline on a loaded machine. 100 ms did not: an SDK with a 3 s
/// timeout saw DEADLINE_EXCEEDED while popgate was storing its owed commit.
const OWED_STORE_RESERVE: Duration = Duration::from_secs(1);
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

    /// Registers popgate at the brokers as a producer of its transactional group and watches the topics
    /// known so far; `None` (logged) when the brokers cannot be told now.
    async fn register_for_check_backs(&self) -> Option<tokio::sync::mpsc::Receiver<OrphanCheck>> {
        let (backs, checks) = match self.broker.serve_check_backs(&self.config.producer_group).await {
            Ok(registered) => registered,
            Err(error) => {
                tracing::warn!(%error, "Could not register as a transactional producer yet: the brokers' check-backs do not reach popgate until it can (retried every 5 s).");
                return None;
            }
        };
        let backs = self.check_backs.get_or_init(|| async { backs }).await;
        let topics: Vec<String> = self.topics_to_watch.lock().drain().collect();
        for topic in topics {
            backs.watch_topic(&topic).await;
        }
        tracing::info!(group = %self.config.producer_group, "Registered as a transactional producer: the brokers' check-backs come to popgate.");
        Some(checks)
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

    /// A broker's check-back. A transaction whose end popgate knows is answered at once, from its record;
    /// any other is recorded with the offsets the broker names now (a record made here lets a producer on
    /// this popgate end a transaction sent through another) and asked of a producer of its topic.
    async fn on_check(&self, check: OrphanCheck) {
        let OrphanCheck { mut half, event, http_checker, remoting } = check;
        let id = half.message_id.clone();
        let Ok(_claim) = self.claim(&id).await else { return };
        half.broker_name = self.broker_name_at(&half).await.unwrap_or_default();
        let known = match self.store.get::<TransactionRecord>(Family::Transactions, &id) {
            Ok(known) => known,
            Err(error) => {
                tracing::warn!(%error, transaction = %id, "Could not read a checked-back transaction; the broker will ask again.");
                return;
            }
        };
        let resolved = known.as_ref().and_then(|r| match r.state {
            State::Owed { resolution, .. } | State::Ended { resolution, .. } => Some(resolution),
            State::Open => None,
        });
        if let (Some(record), Some(resolution)) = (known.clone(), resolved) {
            self.answer_from_record(record, half, resolution).await;
            return;
        }
        let now = Epoch::now();
        let stored = match known {
            Some(mut record) => {
                if half.broker_name.is_empty() {
                    half.broker_name = record.half.broker_name.clone();
                }
                record.half = half;
                self.store.put(Family::Transactions, &id, &record).await
            }
            None => {
                let record = TransactionRecord {
                    transaction_id: id.clone(),
                    half,
                    sent_ms: now,
                    expires_ms: now + retention(&self.config),
                    state: State::Open,
                };
                self.store_new(&record).await
            }
        };
        if let Err(error) = stored {
            tracing::warn!(%error, transaction = %id, "Could not record a checked-back transaction; the broker will ask again.");
            return;
        }
        let orphan = Orphan { transaction_id: id, event, http_checker, remoting };
        let forwarders: Vec<_> = self.forwarders.lock().iter().filter_map(std::sync::Weak::upgrade).collect();
        let forwarded = forwarders.iter().any(|f| f.forward(&orphan));
        let outcome = if forwarded { "forwarded" } else { "no_producer" };
        tracing::debug!(transaction = %orphan.transaction_id, outcome, "A broker checked a transaction back.");
        counter!(m::TRANSACTION_CHECKS, "outcome" => outcome).increment(1);
    }

    /// Answers a check-back of a transaction whose end popgate already has, for the half message the broker
    /// names now. An end still owed is given to the broker this way (and no longer retried). An end the broker
    /// already took means this half message is a copy the broker stored again for a check before it saw that
    /// end (it records ends in batches): the copy is rolled back, since committing it would store the message
    /// a second time.
    async fn answer_from_record(&self, record: TransactionRecord, mut half: HalfMessage, resolution: Resolution) {
        if half.broker_name.is_empty() {
            half.broker_name = record.half.broker_name.clone();
        }
        let id = record.transaction_id.clone();
        counter!(m::TRANSACTION_CHECKS, "outcome" => "answered_from_record").increment(1);
        let answer = match record.state {
            State::Ended { .. } => Resolution::Rollback,
            // An owed commit whose first try may have landed (it reached a broker that stopped answering) is
            // looked up: if it did, this copy goes, as for an ended one.
            State::Owed { maybe_landed: true, .. } if resolution == Resolution::Commit => {
                match self.broker.committed_message_exists(&half, record.sent_ms.as_millis()).await {
                    Ok(true) => Resolution::Rollback,
                    Ok(false) => resolution,
                    Err(error) => {
                        tracing::warn!(%error, transaction = %id, "Could not look an owed commit up; the broker will ask again.");
                        return;
                    }
                }
            }
            State::Owed { .. } | State::Open => resolution,
        };
        tracing::debug!(transaction = %id, answer = answer.as_str(), "A check-back answered from the record.");
        if let Err(error) = self.broker.end_transaction(&half, answer, true).await {
            tracing::warn!(%error, transaction = %id, "Could not answer a check-back from the record; the broker will ask again.");
            return;
        }
        if matches!(record.state, State::Owed { .. }) {
            let ended = TransactionRecord { half, ..record };
            if let Err(error) = self.store_ended(ended, resolution).await {
                tracing::warn!(%error, transaction = %id, "Could not store a transaction's end.");
            }
        }
    }

    /// The name of the broker at `half`'s address, from its topic's route.
    async fn broker_name_at(&self, half: &HalfMessage) -> Option<String> {
        let route = self.broker.route(&half.topic).await.ok()?;
        route.brokers.iter().find(|b| b.addr == half.broker_addr).map(|b| b.name.clone())
    }

    /// Ends transaction `id` of `topic`. `from_check` says the producer answers the broker's check-back. A
    /// broker that has not answered by `answer_by` (the producer's deadline) is treated as unreachable: the
    /// resolution is stored as owed, and the producer is answered in time.
    ///
    /// # Errors
    /// See [`TransactionError`].
    pub async fn end(
        &self,
        topic: &str,
        id: &str,
        resolution: Resolution,
        from_check: bool,
        answer_by: Option<std::time::Instant>,
    ) -> Result<Ended, TransactionError> {
        let _claim = self.claim(id).await?;
        let record = self
            .store
            .get::<TransactionRecord>(Family::Transactions, id)?
            .filter(|r| r.half.topic == topic && r.expires_ms > Epoch::now())
            .ok_or_else(|| TransactionError::Unknown(id.to_owned()))?;
        match record.state {
            State::Open => {}
            State::Owed { resolution: owed, .. } if owed == resolution => return Ok(Ended::Owed),
            State::Ended { resolution: ended, .. } if ended == resolution => return Ok(Ended::Landed),
            State::Owed { resolution: ended, .. } | State::Ended { resolution: ended, .. } => {
                return Err(TransactionError::AlreadyEnded { id: id.to_owned(), ended });
            }
        }
        // The intent first: should popgate die after the broker took the end, or fail to store that it did, the
        // record says the end may have landed, and whoever tries it again (the owed retries after a restart, a
        // caller's retry) looks the committed message up instead of committing it a second time.
        self.store_intent(&record, resolution, from_check).await?;
        let sent = match answer_by {
            Some(by) => {
                // What is left after the broker's wait must cover storing the resolution as owed.
                let waited = by.saturating_duration_since(std::time::Instant::now()).saturating_sub(OWED_STORE_RESERVE);
                tokio::time::timeout(waited, self.send_end(&record.half, resolution, from_check))
                    .await
                    .unwrap_or(Err(BrokerError::Timeout(waited)))
            }
            None => self.send_end(&record.half, resolution, from_check).await,
        };
        match sent {
            Ok(()) => {
                if let Err(error) = self.store_ended(record, resolution).await {
                    // It landed: the caller is told so. The stored intent says it may have, so the owed retries
                    // find the committed message (or send a rollback again, which the broker refuses harmlessly)
                    // and store the end then.
                    tracing::warn!(%error, transaction = id, "A transaction's end landed but could not be stored; it is looked up again.");
                    self.owe_again_now(id);
                }
                Ok(Ended::Landed)
            }
            Err(error) if worth_retrying(&error) => {
                tracing::warn!(%error, transaction = id, "Could not end a transaction at its broker; the resolution is owed.");
                self.store_owed(record, resolution, from_check, maybe_landed(&error), 0).await?;
                Ok(Ended::Owed)
            }
            Err(error) => {
                counter!(m::TRANSACTIONS_ENDED, "resolution" => resolution.as_str(), "result" => "refused")
                    .increment(1);
                // The broker took nothing: the record is open again, as it was.
                self.store.put(Family::Transactions, id, &record).await?;
                Err(TransactionError::Refused { id: id.to_owned(), error })
            }
        }
    }

    /// Stores that `record` is being ended with `resolution` and may have landed, before the end is sent. It is
    /// not retried from here while its end is under way (the end holds the transaction's claim); a restart loads
    /// it as owed.
    async fn store_intent(
        &self,
        record: &TransactionRecord,
        resolution: Resolution,
        from_check: bool,
    ) -> Result<(), StoreError> {
        let mut intent = record.clone();
        let next_try_ms = Epoch::now() + backoff(0);
        intent.state = State::Owed { resolution, from_check, maybe_landed: true, attempts: 0, next_try_ms };
        self.store.put(Family::Transactions, &intent.transaction_id, &intent).await
    }

    /// Transaction `id`'s stored intent is to be retried (with its look-up) at once.
    fn owe_again_now(&self, id: &str) {
        let mut owed = self.owed.lock();
        owed.insert(id.to_owned(), Epoch::now());
        gauge!(m::TRANSACTIONS_OWED).set(owed.len() as f64);
    }

    /// `END_TRANSACTION` to the broker that holds `half` (its master's address as the route has it now).
    async fn send_end(&self, half: &HalfMessage, resolution: Resolution, from_check: bool) -> Result<(), BrokerError> {
        let mut half = half.clone();
        if let Some(addr) = self.master_addr(&half).await {
            half.broker_addr = addr;
        }
        tracing::debug!(transaction = %half.message_id, resolution = resolution.as_str(), from_check, offset = half.tran_state_table_offset, commit_log_offset = half.commit_log_offset, "END_TRANSACTION");
        self.broker.end_transaction(&half, resolution, from_check).await
    }

    /// The current master address of `half`'s broker, when the route can be read (and names it).
    async fn master_addr(&self, half: &HalfMessage) -> Option<String> {
        if half.broker_name.is_empty() {
            return None;
        }
        self.broker.master_addr(&half.topic, &half.broker_name).await
    }

    async fn store_ended(&self, mut record: TransactionRecord, resolution: Resolution) -> Result<(), StoreError> {
        record.state = State::Ended { resolution, at_ms: Epoch::now() };
        self.store.put(Family::Transactions, &record.transaction_id, &record).await?;
        counter!(m::TRANSACTIONS_ENDED, "resolution" => resolution.as_str(), "result" => "landed").increment(1);
        let mut owed = self.owed.lock();
        owed.remove(&record.transaction_id);
        gauge!(m::TRANSACTIONS_OWED).set(owed.len() as f64);
        Ok(())
    }

    async fn store_owed(
        &self,
        mut record: TransactionRecord,
        resolution: Resolution,
        from_check: bool,
        maybe_landed: bool,
        attempts: u32,
    ) -> Result<(), StoreError> {
        let next_try_ms = Epoch::now() + backoff(attempts);
        record.state = State::Owed { resolution, from_check, maybe_landed, attempts, next_try_ms };
        self.store.put(Family::Transactions, &record.transaction_id, &record).await?;
        let mut owed = self.owed.lock();
        owed.insert(record.transaction_id.clone(), next_try_ms);
        gauge!(m::TRANSACTIONS_OWED).set(owed.len() as f64);
        Ok(())
    }

    /// Tries the owed resolutions that are due; each one that lands is stored as ended.
    async fn retry_owed(&self) {
        let now = Epoch::now();
        let due: Vec<String> =
            self.owed.lock().iter().filter(|(_, at)| **at <= now).map(|(id, _)| id.clone()).collect();
        for id in due {
            let Ok(_claim) = self.claim(&id).await else { continue };
            match self.store.get::<TransactionRecord>(Family::Transactions, &id) {
                Ok(Some(record)) => self.retry_one(record).await,
                // Gone (expired) or ended meanwhile.
                Ok(None) => {
                    self.owed.lock().remove(&id);
                }
                Err(error) => tracing::warn!(%error, transaction = %id, "Could not read an owed transaction."),
            }
        }
    }

    async fn retry_one(&self, record: TransactionRecord) {
        let State::Owed { resolution, from_check, maybe_landed, attempts, .. } = record.state else {
            self.owed.lock().remove(&record.transaction_id);
            return;
        };
        let outcome = match (resolution, maybe_landed) {
            // A commit whose answer was lost may have landed: committing again would store the message twice.
            (Resolution::Commit, true) => {
                match self.broker.committed_message_exists(&record.half, record.sent_ms.as_millis()).await {
                    Ok(true) => Ok(()),
                    Ok(false) => self.send_end(&record.half, resolution, from_check).await,
                    Err(error) => Err(error),
                }
            }
            _ => self.send_end(&record.half, resolution, from_check).await,
        };
        let id = record.transaction_id.clone();
        let stored = match outcome {
            Ok(()) => {
                tracing::info!(transaction = %id, resolution = resolution.as_str(), "An owed transaction resolution landed.");
                self.store_ended(record, resolution).await
            }
            Err(error) if worth_retrying(&error) => {
                let maybe = maybe_landed || self::maybe_landed(&error);
                self.store_owed(record, resolution, from_check, maybe, attempts.saturating_add(1)).await
            }
            Err(error) => {
                // The broker no longer has the half message (it was checked back and ended, or it expired): no
                // retry can land it.
                tracing::warn!(%error, transaction = %id, "The broker refused an owed transaction resolution; giving it up.");
                counter!(m::TRANSACTIONS_ENDED, "resolution" => resolution.as_str(), "result" => "refused")
                    .increment(1);
                self.store_ended(record, resolution).await
            }
        };
        if let Err(error) = stored {
            tracing::warn!(%error, transaction = %id, "Could not store an owed transaction's progress; will retry.");
        }
    }

    /// Removes the records past their retention, read from the expiry index.
    async fn expire(&self) {
        let due = match self.store.due(Family::Transactions, Epoch::now()) {
            Ok(due) => due,
            Err(error) => {
                tracing::warn!(%error, "Could not read the transactions' expiry index.");
                return;
            }
        };
        if let Err(error) = self.store.remove_due(Family::Transactions, &due).await {
            tracing::warn!(%error, "Could not remove expired transaction records; trying again later.");
            return;
        }
        let mut owed = self.owed.lock();
        for (_, id) in &due {
            owed.remove(id);
        }
        gauge!(m::TRANSACTIONS_OWED).set(owed.len() as f64);
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

/// Writes the expiry-index entry of each record that has none (`indexed` are the entries there are): records
/// stored before the index existed get theirs, so they expire too.
async fn index_unindexed(
    store: &StateStore,
    records: &[(String, TransactionRecord)],
    indexed: &HashSet<&str>,
) -> Result<(), StoreError> {
    let missing: Vec<String> = records
        .iter()
        .map(|(id, r)| expiry_key(r.expires_ms, id))
        .filter(|key| !indexed.contains(key.as_str()))
        .collect();
    for chunk in missing.chunks(512) {
        let changes: Vec<Change<'_>> = chunk.iter().map(|key| Change::Put(Family::Transactions, key, vec![])).collect();
        store.apply(&changes).await?;
    }
    Ok(())
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

/// `ResponseCode.SYSTEM_BUSY`: the broker is overloaded and did not take the request.
const SYSTEM_BUSY: i32 = 2;

/// Whether an `END_TRANSACTION` that failed this way may land if tried again: the broker was not reached, or
/// was too busy. Any other answer means it does not have (or does not match) the half message.
fn worth_retrying(error: &BrokerError) -> bool {
    match error {
        BrokerError::Response { code, .. } => *code == SYSTEM_BUSY,
        BrokerError::Timeout(_) | BrokerError::Unreachable(_) | BrokerError::Client(_) => true,
        BrokerError::TopicNotFound(_) => false,
    }
}

/// Whether a request that failed this way may still have reached the broker (it timed out, or the connection
/// broke after it was written).
fn maybe_landed(error: &BrokerError) -> bool {
    !matches!(error, BrokerError::Response { .. })
}

/// The wait before the next try of an owed resolution that failed `attempts` times before.
fn backoff(attempts: u32) -> Duration {
    let doubled = OWED_FIRST_BACKOFF.saturating_mul(1 << attempts.min(10));
    let capped = doubled.min(OWED_MAX_BACKOFF);
    capped.mul_f64(rand::rng().random_range(0.8..=1.2))
}

async fn owed_loop(transactions: std::sync::Weak<Transactions>) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    loop {
        tick.tick().await;
        let Some(transactions) = transactions.upgrade() else { return };
        transactions.retry_owed().await;
    }
}

/// How often a failed registration for check-backs is tried again.
const REGISTER_RETRY: Duration = Duration::from_secs(5);

/// Tries the registration for check-backs until it is made, then serves them.
async fn register_loop(transactions: std::sync::Weak<Transactions>) {
    loop {
        tokio::time::sleep(REGISTER_RETRY).await;
        let Some(strong) = transactions.upgrade() else { return };
        if let Some(checks) = strong.register_for_check_backs().await {
            drop(strong);
            check_loop(transactions, checks).await;
            return;
        }
    }
}

async fn check_loop(transactions: std::sync::Weak<Transactions>, mut checks: tokio::sync::mpsc::Receiver<OrphanCheck>) {
    while let Some(check) = checks.recv().await {
        let Some(transactions) = transactions.upgrade() else { return };
        transactions.on_check(check).await;
    }
}

async fn expiry_loop(transactions: std::sync::Weak<Transactions>) {
    let mut tick = tokio::time::interval(EXPIRE_EVERY);
    loop {
        tick.tick().await;
        let Some(transactions) = transactions.upgrade() else { return };
        transactions.expire().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, expires_ms: i64) -> TransactionRecord {
        let (sent_ms, expires_ms) = (Epoch::ZERO, Epoch::from_millis(expires_ms));
        let half = HalfMessage {
            topic: "t".into(),
            producer_group: "g".into(),
            message_id: id.into(),
            broker_name: "broker-a".into(),
            broker_addr: "127.0.0.1:10911".into(),
            tran_state_table_offset: 0,
            commit_log_offset: 0,
        };
        TransactionRecord { transaction_id: id.into(), half, sent_ms, expires_ms, state: State::Open }
    }

    #[tokio::test]
    async fn a_record_stored_before_the_expiry_index_gets_its_entry_and_an_indexed_one_is_left_as_it_is() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path(), true).expect("open");
        let (old, new) = (record("OLD", 1_000), record("NEW", 2_000));
        store.put(Family::Transactions, "OLD", &old).await.expect("put");
        store.put(Family::Transactions, "NEW", &new).await.expect("put");
        store.put_raw(Family::Transactions, &expiry_key(Epoch::from_millis(2_000), "NEW"), b"").await.expect("index");
        let listing = store.list::<TransactionRecord>(Family::Transactions).expect("list");
        let indexed: HashSet<&str> =
            listing.undecodable.iter().map(String::as_str).filter(|k| k.starts_with(EXPIRY_PREFIX)).collect();
        assert_eq!(indexed.len(), 1);
        index_unindexed(&store, &listing.records, &indexed).await.expect("index");
        let due = store.due(Family::Transactions, Epoch::from_millis(5_000)).expect("due");
        let ids: Vec<&str> = due.iter().map(|(_, id)| id.as_str()).collect();
        assert_eq!(ids, ["OLD", "NEW"], "both expire, in their order");
    }
}
