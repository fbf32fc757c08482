//! The brokers' check-backs: popgate registers as a producer of its transactional group, and each
//! `CHECK_TRANSACTION_STATE` is answered from the record when popgate knows the end, or passed to a front's
//! producer ([`super::CheckForwarder`]) when it does not. Its own room because it is the one path the broker
//! starts, not a client.

use std::time::Duration;

use metrics::counter;

use super::{retention, Orphan, State, TransactionRecord, Transactions};
use crate::broker::transaction::{HalfMessage, OrphanCheck, Resolution};
use crate::clock::Epoch;
use crate::metrics as m;
use crate::store::Family;

impl Transactions {
    /// Registers popgate at the brokers as a producer of its transactional group and watches the topics
    /// known so far; `None` (logged) when the brokers cannot be told now.
    pub(super) async fn register_for_check_backs(&self) -> Option<tokio::sync::mpsc::Receiver<OrphanCheck>> {
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
}

/// How often a failed registration for check-backs is tried again.
const REGISTER_RETRY: Duration = Duration::from_secs(5);

/// Tries the registration for check-backs until it is made, then serves them.
pub(super) async fn register_loop(transactions: std::sync::Weak<Transactions>) {
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

pub(super) async fn check_loop(
    transactions: std::sync::Weak<Transactions>,
    mut checks: tokio::sync::mpsc::Receiver<OrphanCheck>,
) {
    while let Some(check) = checks.recv().await {
        let Some(transactions) = transactions.upgrade() else { return };
        transactions.on_check(check).await;
    }
}
