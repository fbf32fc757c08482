//! Settling a delivery (ACK, NACK, TERM, a new deadline), the same for every front: the caller must read the
//! delivery's topic as the delivery's group (`Sub` on both), a request that names a group must name the
//! delivery's, and only then does the delivery core act (the ACK intent stored first, stale holders fenced).
//!
//! What the front decides, because its protocol says it: which delivery and hand-out its handle or id names
//! ([`Settlement`]), and what a refusal looks like to its clients (each front's one rescue).

use std::time::Duration;

use super::{may_consume, may_read, GatewayError};
use crate::auth::Caller;
use crate::delivery::{Dispatcher, NackOutcome, Target};

/// One settlement a client asks for.
#[derive(Debug, Clone, Copy)]
pub struct Settlement<'a> {
    /// The delivery, and the hand-out where the front's handles name it.
    pub target: Target<'a>,
    /// The consumer group the request names (gRPC, remoting); `None` where a front's request names none (HTTP,
    /// whose delivery ids are enough).
    pub group: Option<&'a str>,
}

/// What settling needs from the rest of popgate.
pub struct Settling<'a> {
    /// The delivery core.
    pub dispatcher: &'a Dispatcher,
}

impl Settling<'_> {
    /// Whether `caller` may settle `settlement`. A delivery popgate does not hold passes: the delivery core
    /// answers it (unknown, or already ACKed), and it reveals nothing of another group's.
    ///
    /// # Errors
    /// [`GatewayError::MayNotConsume`] for a named group the caller may not consume as;
    /// [`GatewayError::HandleOfAnotherGroup`] when the delivery is another group's;
    /// [`GatewayError::MayNotSettle`] when the caller may not read the delivery's topic as its group.
    pub fn may_settle(&self, caller: &Caller, settlement: Settlement<'_>) -> Result<(), GatewayError> {
        if let Some(named) = settlement.group {
            may_consume(caller, named)?;
        }
        let Some((owner, topic, _)) = self.dispatcher.hold_of(settlement.target.id) else {
            return Ok(());
        };
        if let Some(named) = settlement.group.filter(|named| *named != owner) {
            return Err(GatewayError::HandleOfAnotherGroup { owner, named: named.to_owned() });
        }
        // Settling reads the delivery's topic: `Sub` on it too, whatever topic the request names.
        may_read(caller, &owner, &topic).map_err(|refusal| GatewayError::MayNotSettle {
            delivery: settlement.target.id.to_owned(),
            refusal: Box::new(refusal),
        })
    }

    /// ACKs a delivery.
    ///
    /// # Errors
    /// As [`Settling::may_settle`]; [`GatewayError::Delivery`] when the delivery core refuses it.
    pub async fn ack(&self, caller: &Caller, settlement: Settlement<'_>) -> Result<(), GatewayError> {
        self.may_settle(caller, settlement)?;
        Ok(self.dispatcher.ack(settlement.target).await?)
    }

    /// ACKs a batch: each settlement answered in order as [`Settling::ack`] would, the allowed ones in one
    /// store write and one broker request per broker.
    pub async fn ack_all(&self, caller: &Caller, settlements: &[Settlement<'_>]) -> Vec<Result<(), GatewayError>> {
        let checked: Vec<Result<Target<'_>, GatewayError>> =
            settlements.iter().map(|s| self.may_settle(caller, *s).map(|()| s.target)).collect();
        let allowed: Vec<Target<'_>> = checked.iter().filter_map(|c| c.as_ref().ok().copied()).collect();
        let mut acked = self.dispatcher.ack_targets(&allowed).await.into_iter();
        checked
            .into_iter()
            .map(|check| {
                check?;
                match acked.next() {
                    Some(outcome) => Ok(outcome?),
                    None => Err(GatewayError::Unavailable("the delivery core gave no answer".to_owned())),
                }
            })
            .collect()
    }

    /// NACKs a delivery: the attempt is spent, the next comes after `delay` (or the backoff), or the DLQ.
    ///
    /// # Errors
    /// As [`Settling::ack`].
    pub async fn nack(
        &self,
        caller: &Caller,
        settlement: Settlement<'_>,
        delay: Option<Duration>,
    ) -> Result<NackOutcome, GatewayError> {
        self.may_settle(caller, settlement)?;
        Ok(self.dispatcher.nack(settlement.target, delay).await?)
    }

    /// TERMs a delivery: straight to the DLQ with `reason`.
    ///
    /// # Errors
    /// As [`Settling::ack`].
    pub async fn term(&self, caller: &Caller, settlement: Settlement<'_>, reason: &str) -> Result<(), GatewayError> {
        self.may_settle(caller, settlement)?;
        Ok(self.dispatcher.term(settlement.target, reason).await?)
    }

    /// Gives a handed-out delivery a new deadline `by` from now; returns it (epoch ms).
    ///
    /// # Errors
    /// As [`Settling::ack`].
    pub async fn extend(&self, caller: &Caller, settlement: Settlement<'_>, by: Duration) -> Result<i64, GatewayError> {
        self.may_settle(caller, settlement)?;
        Ok(self.dispatcher.extend(settlement.target, by).await?)
    }
}
