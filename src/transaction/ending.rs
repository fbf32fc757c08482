//! Ending a transaction at its broker: the end a producer asks for, and the ends owed (the broker could not
//! be reached) retried in the background until they land, a commit that may have landed looked up first.

use std::time::Duration;

use metrics::{counter, gauge};
use rand::Rng;

use super::{Ended, State, TransactionError, TransactionRecord, Transactions};
use crate::broker::transaction::{HalfMessage, Resolution};
use crate::broker::BrokerError;
use crate::clock::Epoch;
use crate::metrics as m;
use crate::store::{Family, StoreError};

/// First wait before an owed resolution is tried again; it doubles up to [`OWED_MAX_BACKOFF`], ±20 %.
const OWED_FIRST_BACKOFF: Duration = Duration::from_secs(1);
const OWED_MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How often the owed resolutions are looked at.
const SWEEP_EVERY: Duration = Duration::from_millis(500);
/// Kept back from a producer's deadline when an end waits for its broker: storing the resolution as owed
/// (a synced write) must still fit before the deadline on a loaded machine. 100 ms did not: an SDK with a 3 s
/// timeout saw DEADLINE_EXCEEDED while popgate was storing its owed commit.
const OWED_STORE_RESERVE: Duration = Duration::from_secs(1);

impl Transactions {
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

    pub(super) async fn store_ended(
        &self,
        mut record: TransactionRecord,
        resolution: Resolution,
    ) -> Result<(), StoreError> {
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

pub(super) async fn owed_loop(transactions: std::sync::Weak<Transactions>) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    loop {
        tick.tick().await;
        let Some(transactions) = transactions.upgrade() else { return };
        transactions.retry_owed().await;
    }
}
