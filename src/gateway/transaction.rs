//! Ending a transaction popgate recorded, the same for every front: the caller's `Pub` on the half message's
//! topic, the producer's answer to a check-back counted, and the end stored as an intent before it is sent
//! (the transaction layer's [`Transactions::end`]).
//!
//! In a tier, a transaction this instance has no record of may be another instance's: every other instance is
//! asked ([`Owners::end_elsewhere`]), and the one that recorded it ends it with the same checks.
//!
//! What the front decides, because its protocol says it: which transaction the request names, the topic where
//! the request names one (gRPC's; it must be the half message's), and, for an end popgate has no record of,
//! whether to relay it (remoting, checked against the half message's topic at the broker) or refuse it.

use std::sync::Arc;
use std::time::Instant;

use metrics::counter;

use super::{may_publish, GatewayError, Owners};
use crate::auth::Caller;
use crate::metrics as m;
use crate::transaction::{Ended, Resolution, TransactionError, Transactions};

/// One end a producer asks for.
#[derive(Debug, Clone, Copy)]
pub struct EndRequest<'a> {
    /// The transaction id.
    pub id: &'a str,
    /// The topic the request names, where it names one; the half message's must be the same.
    pub topic: Option<&'a str>,
    /// Commit or rollback; `None`: the producer does not know yet, and nothing changes (the broker asks again
    /// at its next check-back).
    pub resolution: Option<Resolution>,
    /// The producer answers the broker's check-back.
    pub from_check: bool,
    /// When the producer stops waiting: a broker that has not answered by then leaves the end owed.
    pub answer_by: Option<Instant>,
}

/// A transaction ended: how far, and its half message's topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndOutcome {
    /// Landed at the broker, or owed to it.
    pub ended: Ended,
    /// The half message's topic.
    pub topic: String,
}

/// What ending a transaction needs from the rest of popgate.
pub struct Ending<'a> {
    /// The transaction records.
    pub transactions: &'a Transactions,
    /// The front's name, for the metrics (`http`, `grpc`, `remoting`; `tier` for an end another instance asked).
    pub front: &'static str,
    /// The tier's other instances, when this one is in a tier: a transaction one of them recorded ends there.
    pub owners: Option<&'a Arc<dyn Owners>>,
}

impl Ending<'_> {
    /// Ends a recorded transaction: here, or, when another instance of the tier recorded it, there. `Ok(None)`:
    /// the producer did not decide, nothing changed.
    ///
    /// # Errors
    /// [`GatewayError::MayNotPublish`] without `Pub` on the topic (the named one first, so a refused caller learns
    /// nothing of the record); [`GatewayError::Transaction`] when there is no such record (on that topic) or the
    /// transaction layer refuses the end.
    pub async fn end(&self, caller: &Caller, request: EndRequest<'_>) -> Result<Option<EndOutcome>, GatewayError> {
        if let Some(topic) = request.topic {
            may_publish(caller, topic)?;
        }
        let Some(resolution) = request.resolution else {
            self.count_check_answer(request.from_check, "unknown");
            return Ok(None);
        };
        let unknown = || GatewayError::Transaction(TransactionError::Unknown(request.id.to_owned()));
        let Some(record) = self.transactions.lookup(request.id).map_err(TransactionError::from)? else {
            let elsewhere = match self.owners {
                Some(owners) => owners.end_elsewhere(caller, request).await,
                None => None,
            };
            return elsewhere.unwrap_or_else(|| Err(unknown())).map(Some);
        };
        let topic = record.half.topic;
        if request.topic.is_some_and(|named| named != topic) {
            return Err(unknown());
        }
        may_publish(caller, &topic)?;
        self.count_check_answer(request.from_check, resolution.as_str());
        let ended =
            self.transactions.end(&topic, request.id, resolution, request.from_check, request.answer_by).await?;
        Ok(Some(EndOutcome { ended, topic }))
    }

    /// Counts a producer's answer to a check-back this front forwarded.
    fn count_check_answer(&self, from_check: bool, answer: &'static str) {
        if from_check {
            counter!(m::TRANSACTION_CHECK_ANSWERS, "front" => self.front, "answer" => answer).increment(1);
        }
    }
}
