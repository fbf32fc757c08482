//! What a front may name of the layers below the gateway (the delivery core, transaction records, the broker
//! client): this list, and nothing else of them (the `layering` test in `lib.rs` refuses a front's file that
//! names `crate::delivery`, `crate::transaction`, `crate::broker` or `crate::store`). So what a front can reach
//! past the gateway's decisions is read here, in one place, instead of in every front's imports.
//!
//! Most of it is what requests and answers are made of (a delivery's event, a resolution, a send receipt).
//! The services a front holds are here too, with what each front does with them itself, and why:
//! - The delivery core is not among them: a front holds [`super::Deliveries`], whose reads start from a
//!   checked [`super::Reader`] and whose settlements go through [`super::Settling`].
//! - [`Transactions`]: answering check-backs the broker sends a front's producers; ending goes through
//!   [`super::Ending`].
//! - The broker client is not among them either: the remoting front relays what it does not serve itself
//!   through [`super::Relay`], which can relay and nothing else.

pub(crate) use crate::broker::message::{is_reserved_property, ClientWire, PROPERTY_UNIQ_KEY};
pub(crate) use crate::broker::transaction::{PROPERTY_PRODUCER_GROUP, PROPERTY_TRANSACTION_PREPARED};
pub(crate) use crate::broker::SendReceipt;
pub(crate) use crate::delivery::retry::RetryPolicy;
pub(crate) use crate::delivery::shared::MAX_QUEUED_CHANGES;
pub(crate) use crate::delivery::told_leases::{RenewedLease, MAX_QUEUED_RENEWALS};
pub(crate) use crate::delivery::{
    content, instance_of, Applied, DeliveryError, Dispatched, Event, FilterType, NackOutcome, SharedChange, SubVersion,
    Subscriber, Subscription, SubscriptionRequest, SubscriptionWatcher, Target, WebhookPush, MAX_POLL_BATCH,
    MAX_POLL_WAIT,
};
pub(crate) use crate::transaction::{
    mark_half, CheckForwarder, Ended, Orphan, Resolution, State as RecordState, TransactionError, TransactionRecord,
    Transactions, PROPERTY_REMOTING_GROUP,
};
