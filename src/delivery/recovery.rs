//! Boot recovery: rebuild the dispatcher's state from the store after a restart or a `kill -9`.
//!
//! What is trusted, and what happens to each stored record:
//! - **Subscriptions** are restored as stored; their POP loops start again.
//! - **Awaiting ACK / ready**: the event is dispatched again with its attempt counter kept (the client sees
//!   it again: at-least-once). Nothing is ACKed for it, and its deliveryId stays valid for a late ACK.
//! - **ACKed (the ACK intent)**: the client did ACK; only the broker ACK is owed, and it is finished now
//!   instead of redelivering the event.
//! - **Dead-letter pending**: the DLQ write (then the broker ACK) is retried.
//! - **Undecodable** (corrupt, or from an incompatible version): retired *without* any broker ACK and counted;
//!   the broker's redelivery bounds it.
//! - A record whose broker lease lapsed while popgate was down is given up by the sweeper's first pass: the
//!   broker redelivers that message as a new delivery.
//!
//! The one thing recovery never does is pretend an absent client ACKed. Recovery is idempotent: records
//! already live are skipped, so running it twice changes nothing.

use metrics::counter;

use super::dispatcher::{Live, Shared, SubState};
use super::record::{DeliveryRecord, Phase, Subscription};
use super::retry::RetryPolicy;
use crate::broker::client::now_millis;
use crate::metrics as m;
use crate::store::{Change, Family, StoreError};

/// What one recovery pass found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Subscriptions restored.
    pub subscriptions: usize,
    /// Deliveries dispatched again (their attempt kept).
    pub redispatched: usize,
    /// Deliveries whose ACK intent is replayed to the broker.
    pub ack_pending: usize,
    /// Deliveries owed to the DLQ.
    pub dead_letter_pending: usize,
    /// Undecodable records retired without a broker ACK.
    pub corrupt: usize,
    /// Records already live, left alone.
    pub skipped: usize,
}

/// Loads subscriptions and deliveries into `shared`.
///
/// # Errors
/// [`StoreError`] when the store cannot be read.
pub(super) fn recover(shared: &Shared) -> Result<RecoveryReport, StoreError> {
    let mut report = RecoveryReport::default();
    let subscriptions = shared.store.list::<Subscription>(Family::Subscriptions)?;
    {
        let mut state = shared.state.lock();
        for (_, sub) in subscriptions.records {
            let key = sub.key();
            if state.subs.contains_key(&key) {
                continue;
            }
            let policy = policy_of(&sub, shared);
            state.subs.insert(key, SubState::new(sub, policy));
            report.subscriptions += 1;
        }
    }

    let deliveries = shared.store.list::<DeliveryRecord>(Family::Deliveries)?;
    for key in &deliveries.undecodable {
        tracing::warn!(record = %key, "Undecodable delivery record retired without a broker ACK.");
        let _ = shared.write(&[Change::Delete(Family::Deliveries, key)]);
        counter!(m::RECOVERED_DELIVERIES, "outcome" => "corrupt").increment(1);
        report.corrupt += 1;
    }
    let now = now_millis();
    let mut state = shared.state.lock();
    for (_, mut record) in deliveries.records {
        if state.records.contains_key(&record.id) {
            report.skipped += 1;
            continue;
        }
        let outcome = match record.phase {
            Phase::AwaitingAck { .. } | Phase::Ready { .. } => {
                if matches!(record.phase, Phase::AwaitingAck { .. }) {
                    counter!(m::REDELIVERIES, "reason" => "recovery").increment(1);
                }
                // Dispatched again at once (a retry keeps its backoff); the attempt counter is kept as stored.
                let due_ms = match record.phase {
                    Phase::Ready { due_ms } => due_ms,
                    _ => now,
                };
                record.phase = Phase::Ready { due_ms };
                report.redispatched += 1;
                "redispatched"
            }
            Phase::Acked => {
                report.ack_pending += 1;
                "ack_pending"
            }
            Phase::DeadLetter { .. } => {
                report.dead_letter_pending += 1;
                "dead_letter_pending"
            }
        };
        counter!(m::RECOVERED_DELIVERIES, "outcome" => outcome).increment(1);
        state.records.insert(record.id.clone(), Live { record, busy: false, queued: false, next_try_ms: 0 });
    }
    Ok(report)
}

/// The subscription's policy, falling back to the configured defaults if the stored values are unusable.
pub(super) fn policy_of(sub: &Subscription, shared: &Shared) -> RetryPolicy {
    RetryPolicy::try_new(
        std::time::Duration::from_millis(sub.initial_backoff_ms),
        std::time::Duration::from_millis(sub.max_backoff_ms),
        shared.config.jitter_ratio,
        sub.max_attempts,
    )
    .or_else(|_| RetryPolicy::from_config(&shared.config))
    .unwrap_or(RetryPolicy::SEED_DEFAULT)
}
