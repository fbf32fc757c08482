//! Ending a transaction popgate recorded, the same for every front: the caller's `Pub` on the half message's
//! topic, the producer's answer to a check-back counted, and the end stored as an intent before it is sent
//! (the transaction layer's [`Transactions::end`]).
//!
//! What the front decides, because its protocol says it: which transaction the request names, the topic where
//! the request names one (gRPC's; it must be the half message's), and, for an end popgate has no record of,
//! whether to relay it (remoting, checked against the half message's topic at the broker) or refuse it.

use std::time::Instant;

use metrics::counter;

use super::{may_publish, GatewayError};
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

/// What ending a transaction needs from the rest of popgate.
pub struct Ending<'a> {
    /// The transaction records.
    pub transactions: &'a Transactions,
    /// The front's name, for the metrics (`http`, `grpc`, `remoting`).
    pub front: &'static str,
}

impl Ending<'_> {
    /// Ends a recorded transaction. `Ok(None)`: the producer did not decide, nothing changed.
    ///
    /// # Errors
    /// [`GatewayError::MayNotPublish`] without `Pub` on the topic (the named one first, so a refused caller learns
    /// nothing of the record); [`GatewayError::Transaction`] when there is no such record (on that topic) or the
    /// transaction layer refuses the end.
    pub async fn end(&self, caller: &Caller, request: EndRequest<'_>) -> Result<Option<Ended>, GatewayError> {
        if let Some(topic) = request.topic {
            may_publish(caller, topic)?;
        }
        let Some(resolution) = request.resolution else {
            self.count_check_answer(request.from_check, "unknown");
            return Ok(None);
        };
        let unknown = || GatewayError::Transaction(TransactionError::Unknown(request.id.to_owned()));
        let record = self.transactions.lookup(request.id).map_err(TransactionError::from)?.ok_or_else(unknown)?;
        let topic = record.half.topic;
        if request.topic.is_some_and(|named| named != topic) {
            return Err(unknown());
        }
        may_publish(caller, &topic)?;
        self.count_check_answer(request.from_check, resolution.as_str());
        let ended =
            self.transactions.end(&topic, request.id, resolution, request.from_check, request.answer_by).await?;
        Ok(Some(ended))
    }

    /// Counts a producer's answer to a check-back this front forwarded.
    fn count_check_answer(&self, from_check: bool, answer: &'static str) {
        if from_check {
            counter!(m::TRANSACTION_CHECK_ANSWERS, "front" => self.front, "answer" => answer).increment(1);
        }
    }
}
