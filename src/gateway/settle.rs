//! Settling a delivery (ACK, NACK, TERM, a new deadline), the same for every front: the caller must read the
//! delivery's topic as the delivery's group (`Sub` on both), a request that names a group must name the
//! delivery's, and only then does the delivery core act (the ACK intent stored first, stale holders fenced).
//!
//! What the front decides, because its protocol says it: which delivery and hand-out its handle or id names
//! ([`Settlement`]), and what a refusal looks like to its clients (each front's one rescue).
//!
//! In a tier of several instances, a delivery handed out by another instance is settled there: the
//! [`Owners`] of the tier (the peer link) ask that instance, which applies the same checks to the same caller.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use metrics::counter;

use super::{may_consume, may_read, GatewayError};
use crate::auth::Caller;
use crate::clock::Epoch;
use crate::delivery::told_leases::{renewal_due, CLOCK_MARGIN};
use crate::delivery::{split_lease, DeliveryError, Dispatcher, NackOutcome, Target};
use crate::metrics as m;

/// What a settlement does to its delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Settle {
    /// Processed: the broker ACK follows.
    Ack,
    /// Not processed: the attempt is spent, the next comes after `delay` (or the backoff), or the DLQ.
    Nack {
        /// The next attempt's delay; `None`: the backoff decides.
        delay: Option<Duration>,
    },
    /// Never to be processed: straight to the DLQ.
    Term {
        /// Why, kept with the dead-lettered message.
        reason: String,
    },
    /// Still being processed: a new deadline `by` from now (a SimpleConsumer's ChangeInvisibleDuration). A
    /// delivery its holder keeps alive itself (a gRPC PushConsumer's, auto-renewed) is NACKed instead, on the
    /// backoff: its SDK changes a delivery's invisible time only when its listener failed. Decided where the
    /// delivery is held, so a tier decides it the same whichever instance the request reached.
    Extend {
        /// How far from now.
        by: Duration,
    },
}

/// What a settlement did.
#[derive(Debug, Clone, PartialEq)]
pub enum Settled {
    /// ACKed.
    Acked,
    /// NACKed, with what comes next.
    Nacked(NackOutcome),
    /// On its way to the DLQ.
    Termed,
    /// The new deadline.
    Extended(Epoch),
}

/// The other instances of a tier, as the gateway needs them: which one handed a delivery out, and a way to ask
/// it to settle it (the peer link, `tier`).
pub trait Owners: Send + Sync {
    /// The instance that handed delivery `id` out, when it is another one than this.
    fn elsewhere(&self, id: &str) -> Option<String>;

    /// Asks instance `owner` to settle `settlement` as `caller` asked: the owner checks the caller's rights as
    /// for its own clients, and answers what it did or why it refused.
    fn settle_at<'a>(
        &'a self,
        owner: &'a str,
        caller: &'a Caller,
        settlement: Settlement<'a>,
        action: &'a Settle,
    ) -> BoxFuture<'a, Result<Settled, GatewayError>>;

    /// Asks the other instances to end a transaction this one has no record of, as `caller` asked: the answer
    /// of the instance that recorded it, `None` when none did (or none could be asked).
    fn end_elsewhere<'a>(
        &'a self,
        caller: &'a Caller,
        request: super::EndRequest<'a>,
    ) -> BoxFuture<'a, Option<Result<super::EndOutcome, GatewayError>>>;
}

/// One settlement a client asks for.
#[derive(Debug, Clone, Copy)]
pub struct Settlement<'a> {
    /// The delivery, and the hand-out where the front's handles name it.
    pub target: Target<'a>,
    /// The consumer group the request names (gRPC, remoting); `None` where a front's request names none (HTTP,
    /// whose delivery ids are enough).
    pub group: Option<&'a str>,
    /// The delivery's broker lease at the hand-out, sealed, as a tier's handles carry it: what a peer ACKs at
    /// the broker with when the owner cannot be reached.
    pub lease: Option<&'a str>,
}

impl<'a> Settlement<'a> {
    /// The settlement of `handle_id` (a delivery id as a front handed it out: [`Dispatched::handle_id`], the
    /// sealed lease after the id in a tier), hand-out `handout` where the front's handles name it, as the group
    /// the request names.
    ///
    /// [`Dispatched::handle_id`]: crate::delivery::Dispatched::handle_id
    pub fn of(handle_id: &'a str, handout: Option<u32>, group: Option<&'a str>) -> Settlement<'a> {
        let (id, lease) = split_lease(handle_id);
        Settlement { target: Target { id, handout }, group, lease }
    }
}

/// Settling deliveries, whichever front or peer asked: made by [`super::Deliveries::settling`].
pub struct Settling<'a> {
    /// The delivery core.
    pub(super) dispatcher: &'a Dispatcher,
    /// The tier's other instances, when this one is in a tier: deliveries they handed out are settled there.
    pub(super) owners: Option<&'a Arc<dyn Owners>>,
}

impl Settling<'_> {
    /// Settles `settlement` as `action` says: here when this instance handed the delivery out, else at the
    /// instance that did.
    ///
    /// # Errors
    /// As [`Settling::may_settle`]; [`GatewayError::Delivery`] when the delivery core refuses it;
    /// [`GatewayError::Unavailable`] when the instance that handed it out cannot be asked.
    pub async fn settle(
        &self,
        caller: &Caller,
        settlement: Settlement<'_>,
        action: &Settle,
    ) -> Result<Settled, GatewayError> {
        if let Some(owners) = self.owners {
            if let Some(owner) = owners.elsewhere(settlement.target.id) {
                return match owners.settle_at(&owner, caller, settlement, action).await {
                    Err(GatewayError::Unavailable(why)) => {
                        self.settle_without_owner(&owner, caller, settlement, action, why).await
                    }
                    answered => answered,
                };
            }
        }
        self.may_settle(caller, settlement)?;
        let target = settlement.target;
        Ok(match action {
            Settle::Ack => {
                self.dispatcher.ack(target).await?;
                Settled::Acked
            }
            Settle::Nack { delay } => Settled::Nacked(self.dispatcher.nack(target, *delay).await?),
            Settle::Term { reason } => {
                self.dispatcher.term(target, reason).await?;
                Settled::Termed
            }
            Settle::Extend { .. } if self.is_auto_renewed(target.id) => {
                Settled::Nacked(self.dispatcher.nack(target, None).await?)
            }
            Settle::Extend { by } => Settled::Extended(self.dispatcher.extend(target, *by).await?),
        })
    }

    /// Settles a delivery whose owner cannot be reached (`unreachable` says why), with the latest broker lease
    /// this instance knows of it: the one its owner told at its last renewal, or the one the handle carries.
    /// An ACK is made at the broker and the owner told when it can be (so, back, it does not hand the message
    /// out again); a NACK is left to the broker, whose lease runs out and redelivers it. The caller's rights
    /// are checked on the lease's group and topic, as the owner would check them. What needs the owner's
    /// record (a TERM, a new deadline, any settlement without a lease) is refused as unavailable.
    ///
    /// An ACK is answered as done only when the broker answered it while that lease was surely the current
    /// one: before its owner would renew it (half of it left, less [`CLOCK_MARGIN`] for the clocks). Past
    /// that the owner may
    /// have renewed it and not told this instance (it went down right after, or could not reach it), and an
    /// ACK with a dead handle changes nothing at the broker: it is made all the same, and answered
    /// [`GatewayError::AckUnconfirmed`].
    ///
    /// What weakens here: the owner fences stale holders, and without it an ACK of a hand-out that has since
    /// been superseded cannot be told from the current one's.
    async fn settle_without_owner(
        &self,
        owner: &str,
        caller: &Caller,
        settlement: Settlement<'_>,
        action: &Settle,
        unreachable: String,
    ) -> Result<Settled, GatewayError> {
        let unavailable = || GatewayError::Unavailable(unreachable.clone());
        let label = match action {
            Settle::Ack => "ack",
            Settle::Nack { .. } => "nack",
            _ => return Err(unavailable()),
        };
        let id = settlement.target.id;
        let sealed = settlement.lease.and_then(|token| self.dispatcher.open_lease(id, token));
        // Only a delivery whose client holds a sealed lease: a told one alone does not authorize anything.
        let Some(lease) = sealed.and_then(|sealed| self.dispatcher.latest_lease(id, Some(sealed))) else {
            return Err(unavailable());
        };
        if let Some(named) = settlement.group {
            may_consume(caller, named)?;
        }
        may_settle_of(caller, settlement, lease.group.clone(), &lease.topic)?;
        let outcome = match action {
            Settle::Ack => self.dispatcher.ack_lease(&lease).await.map(|()| Settled::Acked),
            // The broker's lease redelivers it; nothing is owed before that.
            _ => Ok(Settled::Nacked(NackOutcome::Retry {
                attempt: settlement.target.handout.unwrap_or(0).saturating_add(1),
                due: lease.handle.lease_deadline(),
            })),
        };
        // Judged once the broker answered: the ACK reached it before the owner could have renewed the lease.
        let surely_current = Epoch::now() < renewal_due(&lease) - CLOCK_MARGIN;
        let unconfirmed = matches!(action, Settle::Ack) && outcome.is_ok() && !surely_current;
        let result = match &outcome {
            Ok(_) if unconfirmed => "unconfirmed",
            Ok(_) => "ok",
            Err(error) => error.code(),
        };
        counter!(m::TIER_SETTLED_AT_BROKER, "action" => label, "result" => result).increment(1);
        if outcome.is_ok() {
            tracing::warn!(
                owner,
                delivery = id,
                action = label,
                unconfirmed,
                "Settled at the broker without the instance that handed the delivery out (it cannot be reached)."
            );
            if let Settle::Ack = action {
                // Told to the owner when it asks (kept in the store meanwhile), so that it does not hand the
                // message out again, and ACKs it with its current lease if this one was not.
                self.dispatcher.note_untold(owner, settlement.target).await;
            }
        }
        if unconfirmed {
            return Err(GatewayError::AckUnconfirmed(format!(
                "the delivery was handed out by instance `{owner}`, which cannot be reached now ({unreachable}); the \
                 ACK was made at the broker with the last lease known here, which `{owner}` may have renewed since: \
                 it may not land, and the message may be delivered again"
            )));
        }
        outcome.map_err(|error: DeliveryError| error.into())
    }

    /// A peer ACKed this instance's delivery `target` at the broker while this one could not be reached (see
    /// [`Settling::settle`]): the ACK is applied here as a client's would be (the intent stored, then the
    /// broker ACK with the current lease, which the peer's may not have been), so the message is not handed out
    /// again. The caller's rights were checked by the peer, on the lease this instance sealed.
    pub async fn acked_by_a_peer(&self, target: Target<'_>) {
        let result = match self.dispatcher.ack(target).await {
            Ok(()) => "acked",
            Err(refused) => {
                tracing::info!(delivery = target.id, %refused, "An ACK a peer made at the broker without this instance did not apply here.");
                refused.code()
            }
        };
        counter!(m::TIER_ACKS_LEARNED, "result" => result).increment(1);
    }

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
        match self.dispatcher.hold_of(settlement.target.id) {
            Some((group, topic, _)) => may_settle_of(caller, settlement, group, &topic),
            None => Ok(()),
        }
    }

    /// ACKs a delivery.
    ///
    /// # Errors
    /// As [`Settling::settle`].
    pub async fn ack(&self, caller: &Caller, settlement: Settlement<'_>) -> Result<(), GatewayError> {
        self.settle(caller, settlement, &Settle::Ack).await.map(|_| ())
    }

    /// ACKs a batch: each settlement answered in order as [`Settling::ack`] would, the allowed ones in one
    /// store write and one broker request per broker.
    /// Settlements of deliveries another instance handed out are asked of it, one by one.
    pub async fn ack_all(&self, caller: &Caller, settlements: &[Settlement<'_>]) -> Vec<Result<(), GatewayError>> {
        let elsewhere = |s: &Settlement<'_>| self.owners.and_then(|owners| owners.elsewhere(s.target.id));
        if settlements.iter().any(|s| elsewhere(s).is_some()) {
            let acks = settlements.iter().map(|s| self.ack(caller, *s));
            return futures::future::join_all(acks).await;
        }
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
    /// As [`Settling::settle`].
    pub async fn nack(
        &self,
        caller: &Caller,
        settlement: Settlement<'_>,
        delay: Option<Duration>,
    ) -> Result<NackOutcome, GatewayError> {
        match self.settle(caller, settlement, &Settle::Nack { delay }).await? {
            Settled::Nacked(outcome) => Ok(outcome),
            other => Err(unexpected(&other)),
        }
    }

    /// TERMs a delivery: straight to the DLQ with `reason`.
    ///
    /// # Errors
    /// As [`Settling::settle`].
    pub async fn term(&self, caller: &Caller, settlement: Settlement<'_>, reason: &str) -> Result<(), GatewayError> {
        self.settle(caller, settlement, &Settle::Term { reason: reason.to_owned() }).await.map(|_| ())
    }

    /// Gives a handed-out delivery a new deadline `by` from now, or NACKs it when its holder keeps it alive
    /// ([`Settle::Extend`]); says which it did.
    ///
    /// # Errors
    /// As [`Settling::settle`].
    pub async fn change_deadline(
        &self,
        caller: &Caller,
        settlement: Settlement<'_>,
        by: Duration,
    ) -> Result<Settled, GatewayError> {
        self.settle(caller, settlement, &Settle::Extend { by }).await
    }

    /// Whether delivery `id` is held by a client that keeps it alive (a gRPC PushConsumer's).
    fn is_auto_renewed(&self, id: &str) -> bool {
        self.dispatcher.hold_of(id).and_then(|(_, _, holder)| holder).is_some_and(|holder| holder.auto_renew)
    }
}

/// Whether `caller` may settle `settlement` of a delivery of `group` on `topic` (the group a request names
/// already checked as the caller's): the named group must be the delivery's, and settling reads the delivery's
/// topic, so `Sub` on it too, whatever topic the request names.
fn may_settle_of(caller: &Caller, settlement: Settlement<'_>, group: String, topic: &str) -> Result<(), GatewayError> {
    if let Some(named) = settlement.group.filter(|named| *named != group) {
        return Err(GatewayError::HandleOfAnotherGroup { owner: group, named: named.to_owned() });
    }
    may_read(caller, &group, topic).map_err(|refusal| GatewayError::MayNotSettle {
        delivery: settlement.target.id.to_owned(),
        refusal: Box::new(refusal),
    })
}

/// A settlement answered with what another action does (a peer that answers out of turn).
fn unexpected(settled: &Settled) -> GatewayError {
    GatewayError::Unavailable(format!("the settlement was answered with {settled:?}"))
}
