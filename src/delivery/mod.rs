//! The consume path: at-least-once delivery with the broker ACK deferred until the subscriber ACKs.
//!
//! A delivery's life (every arrow is "write the new state, then act"):
//!
//! ```text
//! POP ──record──▶ ready(attempt n) ──hand out──▶ awaiting ACK ──ACK──▶ ACK intent ──broker ACK──▶ retired
//!                     ▲                               │
//!                     └── backoff (1 s ×2 ≤ 16 s ±20 %) ◀── timeout / NACK
//! awaiting ACK or ready with n = max ──▶ dead-letter pending ──%DLQ% write──▶ broker ACK ──▶ retired
//! TERM ──▶ dead-letter pending
//! lease lapsed (renewal failed too long) ──▶ given up: ACKs get 409, the broker redelivers the message
//! ```
//!
//! While popgate owns a delivery it keeps the message invisible at the broker by renewing its lease
//! (ChangeInvisibleTime) ahead of expiry; if popgate dies, the lease running out is the backstop and the
//! broker redelivers. Nothing but a subscriber ACK, or a successful DLQ write, ever ACKs the broker.
//!
//! - `state`: **the one owner of the state machine** (`Deliveries`): every transition above is one of its
//!   methods, and its fields are private to it. Everything below calls those methods and nothing else.
//! - [`Dispatcher`] (dispatcher.rs): the entry point every transport shares (subscribe, poll, attach, ack, nack,
//!   term, the admin view); it starts the loops.
//! - [`popper`]: one demand-paced POP loop per subscription.
//! - [`sweeper`]: the timer tick: timeouts, retries, lease renewal, owed broker ACKs and DLQ writes.
//! - [`subscriber`]: a push subscriber's session (prefetch, write failures, disconnects).
//! - [`SubscriptionWatcher`]: what a push transport beside the core (the HTTP front's webhook pusher,
//!   `api::webhook`) is told as subscriptions are made, changed and removed.
//! - [`recovery`]: boot replay of the stored state. [`dlq`]: the dead-letter message. [`retry`]: the backoff.

mod dispatcher;
pub(crate) mod dlq;
mod gauges;
mod group_order;
mod lease;
mod lease_plan;
mod pop_wait;
mod popper;
pub mod record;
pub(crate) mod recovery;
pub(crate) mod retry;
pub(crate) mod shared;
mod state;
pub(crate) mod subscriber;
mod sweeper;
#[cfg(test)]
mod test_support;
pub(crate) mod told_leases;
mod untold;

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

/// How an event's data is handed back over HTTP: the rule lives beside the message type, as the publish path
/// writes the property it reads; the fronts reach it through here.
pub(crate) use crate::broker::content;
pub use dispatcher::Dispatcher;
pub use lease::{split_lease, with_lease, Lease, LeaseSeal};
pub use record::{Event, FilterType, Holder, SubVersion, Subscription, WebhookPush};
pub use shared::{Applied, SharedChange};
pub use state::{instance_of, new_delivery_id};
pub use subscriber::Subscriber;

use recovery::RecoveryReport;
use retry::RetryPolicy;
use state::Deliveries;

use crate::broker::BrokerClient;
use crate::clock::Epoch;
use crate::config::{bounds, DeliveryConfig};
use crate::publish::Publisher;
use crate::store::{StateStore, StoreError};

/// Longest long-poll wait a client may ask for.
pub const MAX_POLL_WAIT: Duration = Duration::from_secs(30);
/// Most deliveries one poll may return.
pub const MAX_POLL_BATCH: usize = 256;

/// Why a delivery request could not be served.
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    /// No such delivery, or it was already ACKed.
    #[error("unknown or already acknowledged delivery")]
    Unknown,
    /// popgate no longer owns the message (its lease lapsed or a renewal failed): the broker may have handed it
    /// to someone else, and will redeliver it.
    #[error("the delivery's broker lease was lost; the broker will redeliver the event")]
    Stale,
    /// The delivery is not handed out: it waits for its next attempt, or for the DLQ.
    #[error("the delivery is not awaiting an ACK (it waits for a retry or for the DLQ)")]
    NotInFlight,
    /// The settlement names an earlier hand-out: its holder's time ran out and the delivery was handed out
    /// again since (or is waiting to be). Only the current holder may settle it.
    #[error("the receipt handle has expired: the message was handed out again after its invisible time ran out")]
    Superseded,
    /// Another request or task is acting on the delivery and did not finish in time; try again.
    #[error("the delivery is busy; try again")]
    Busy,
    /// The state store could not record the change; nothing was changed.
    #[error("state store unavailable: {0}")]
    Store(#[from] StoreError),
    /// A request value is out of range.
    #[error("{1}")]
    Invalid(&'static str, String),
}

impl DeliveryError {
    /// The short, fixed word every transport reports for this error (`status` of an ACK result, the `code`
    /// of an error body, the `result` label of `popgate_acks_total`).
    pub fn code(&self) -> &'static str {
        match self {
            DeliveryError::Unknown => "unknown",
            DeliveryError::Stale => "stale",
            DeliveryError::NotInFlight => "not_in_flight",
            DeliveryError::Superseded => "superseded",
            DeliveryError::Busy => "busy",
            DeliveryError::Store(_) => "store_error",
            DeliveryError::Invalid(..) => "invalid_field",
        }
    }
}

/// Who issues this instance's delivery ids and handles.
pub struct Issuer<'a> {
    /// The instance id every delivery id starts with (empty: ids name no instance).
    pub instance: &'a str,
    /// In a tier, seals each hand-out's broker lease into its handles ([`LeaseSeal`]).
    pub lease_seal: Option<LeaseSeal>,
    /// In a tier: a delivery due again while no consumer of its group has waited on this instance for this
    /// long is given back to the broker, for whichever instance its consumers are connected to.
    pub give_back_unclaimed: Option<Duration>,
}

/// One delivery handed to a subscriber.
#[derive(Debug, Clone)]
pub struct Dispatched {
    /// The delivery id to ACK.
    pub id: String,
    /// Attempt number (1-based).
    pub attempt: u32,
    /// Which hand-out of the delivery this is (1-based, counted over its whole life): a front whose
    /// handles name it can have a settlement of an earlier one refused ([`Target`]).
    pub handout: u32,
    /// ACK by this time.
    pub ack_deadline: Epoch,
    /// The event.
    pub event: Event,
    /// Its broker lease at the hand-out, sealed, in a tier ([`LeaseSeal`]): a peer ACKs it at the broker with
    /// this when this instance cannot be reached.
    pub lease: Option<String>,
}

impl Dispatched {
    /// The id a front hands its client: the delivery id, with the sealed lease after it in a tier
    /// ([`with_lease`]); the front reads it back with [`split_lease`].
    pub fn handle_id(&self) -> String {
        with_lease(&self.id, self.lease.as_deref())
    }
}

/// What a settlement is for: a delivery, and, from a front whose handles name it, the hand-out it settles.
/// A settlement of an earlier hand-out than the current one is refused ([`DeliveryError::Superseded`]): the
/// consumer whose time ran out cannot settle what another consumer now holds. A repeated ACK of the hand-out
/// that was ACKed is answered as the first was, for a while (a client retrying an ACK whose answer it lost).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target<'a> {
    /// The delivery id.
    pub id: &'a str,
    /// The hand-out, or `None` for whichever is current (popgate's HTTP delivery ids).
    pub handout: Option<u32>,
}

impl<'a> From<&'a str> for Target<'a> {
    fn from(id: &'a str) -> Target<'a> {
        Target { id, handout: None }
    }
}

impl<'a> From<&'a Arc<str>> for Target<'a> {
    fn from(id: &'a Arc<str>) -> Target<'a> {
        Target { id, handout: None }
    }
}

impl<'a> From<&'a String> for Target<'a> {
    fn from(id: &'a String) -> Target<'a> {
        Target { id, handout: None }
    }
}

/// How deliveries are handed out: by which transport, with which ACK deadline, to which gRPC client.
#[derive(Debug, Clone)]
pub struct HandOut {
    /// The `transport` label of `popgate_deliveries_dispatched_total`.
    pub transport: &'static str,
    /// Time to ACK from the hand-out; the subscription's ACK timeout when unset.
    pub ack_timeout: Option<Duration>,
    /// The gRPC client that receives them (stored with the hand-out).
    pub holder: Option<Holder>,
    /// In an ordered subscription, hand out consecutive messages of one message group together (a gRPC
    /// FIFO consumer's batch, as from Apache's proxy); the group's next messages wait until the whole batch
    /// is settled. Otherwise only a group's head is handed out.
    pub fifo_batch: bool,
}

impl HandOut {
    /// A long-poll hand-out: the subscription's ACK timeout, no holder.
    pub fn long_poll() -> HandOut {
        HandOut { transport: "poll", ack_timeout: None, holder: None, fifo_batch: false }
    }
}

/// The outcome of a NACK.
#[derive(Debug, Clone, PartialEq)]
pub enum NackOutcome {
    /// Attempt `attempt` is due at `due`.
    Retry {
        /// The next attempt's number.
        attempt: u32,
        /// When.
        due: Epoch,
    },
    /// It was the last attempt: the event goes to the DLQ.
    DeadLetter,
}

/// What a subscriber may set on its subscription; unset fields take the configured defaults.
#[derive(Debug, Clone, Default)]
pub struct SubscriptionRequest {
    /// Consumer group.
    pub group: String,
    /// Topic.
    pub topic: String,
    /// Filter expression (default `*`).
    pub filter: Option<String>,
    /// Its kind (default a tag expression).
    pub filter_type: Option<FilterType>,
    /// ACK timeout.
    pub ack_timeout_ms: Option<u64>,
    /// Attempts in all.
    pub max_attempts: Option<u32>,
    /// First retry delay.
    pub initial_backoff_ms: Option<u64>,
    /// Largest retry delay.
    pub max_backoff_ms: Option<u64>,
    /// FIFO message groups (default false).
    pub ordered: Option<bool>,
    /// Push deliveries to a webhook.
    pub push: Option<WebhookPush>,
    /// Made by a receive on its own rather than asked for (see [`Subscription::implicit`]). An existing
    /// subscription that was asked for stays so.
    pub implicit: bool,
    /// A change another instance of the tier made, with its version: taken as it is and not told again
    /// (`None`: a change made here, given a new version and told to the tier).
    pub shared_version: Option<SubVersion>,
}

impl From<Subscription> for SubscriptionRequest {
    /// A request that subscribes `sub` again as it is (to change one of its settings).
    fn from(sub: Subscription) -> SubscriptionRequest {
        SubscriptionRequest {
            filter: Some(sub.filter),
            filter_type: Some(sub.filter_type),
            ack_timeout_ms: Some(sub.ack_timeout_ms),
            max_attempts: Some(sub.max_attempts),
            initial_backoff_ms: Some(sub.initial_backoff_ms),
            max_backoff_ms: Some(sub.max_backoff_ms),
            ordered: Some(sub.ordered),
            push: sub.push,
            implicit: sub.implicit,
            shared_version: None,
            group: sub.group,
            topic: sub.topic,
        }
    }
}

/// One in-flight delivery as the admin plane shows it.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InFlight {
    /// The delivery id.
    pub delivery_id: String,
    /// Consumer group.
    pub group: String,
    /// Topic.
    pub topic: String,
    /// The event's message id.
    pub event_id: String,
    /// Current (or next) attempt, 1-based.
    pub attempt: u32,
    /// `ready`, `awaiting_ack`, `ack_pending` or `dead_letter_pending`.
    pub phase: &'static str,
    /// The ACK deadline (awaiting ACK) or when the next attempt is due (ready), epoch ms.
    pub due_ms: Option<i64>,
    /// The push subscriber holding it, if one does (long-poll hand-outs have none).
    pub subscriber: Option<String>,
    /// Why the last attempt failed.
    pub last_failure: Option<String>,
    /// Until when the broker keeps it invisible (epoch ms).
    pub lease_deadline_ms: i64,
}

/// A push transport that runs beside the core's subscriptions (the HTTP front's webhook pusher): told of every
/// subscription made or changed, and of each one kept at boot ([`Dispatcher::watch_subscriptions`]), of each one
/// removed, and of the shutdown. Calls are made with no lock held and must not block.
pub trait SubscriptionWatcher: Send + Sync {
    /// `sub` was made or changed (or was kept when the watcher was set).
    fn subscribed(&self, sub: &Subscription);
    /// The subscription of key `key` was removed.
    fn unsubscribed(&self, key: &str);
    /// popgate is shutting down.
    fn shut_down(&self);
}
