//! The gateway: what an application's request is allowed and what it does, decided once for every front
//! (HTTP, gRPC, remoting). A front decodes its protocol, calls the gateway with the authenticated [`Caller`],
//! and maps a [`GatewayError`] to its own codes in one place.
//!
//! Here: publishing needs `Pub` on the topic ([`may_publish`]), and a publish goes through
//! [`Publishing::publish`] whichever front it came in on; reading a topic needs `Sub` on the topic as well as on
//! the group, and every read (an HTTP poll or stream, a gRPC receive, a remoting POP) starts from a [`Reader`]
//! that only that check makes and goes through [`Deliveries`], the only handle of the delivery core a front
//! holds; settling a delivery needs the same rights, whichever front or peer it came in on ([`Settling`]);
//! a client leaving a consumer group (a remoting `UNREGISTER_CLIENT`, a gRPC `NotifyClientTermination`) gives
//! back only what it holds in that group, and only when its caller may consume as that group
//! ([`Deliveries::leave_group`]); ending a recorded transaction needs `Pub` on its half message's topic
//! ([`Ending`]); a topic's route needs `Pub` or `Sub` on it ([`may_look_up`]), and a client that announces
//! itself as a consumer group's needs `Sub` on the group and on each of its topics ([`may_subscribe`]); a client
//! id is the token's that first used it on any front ([`ClientOwners`], one registry for every front), and a
//! front keeps a bounded number of them ([`ClientIds`]).

pub(crate) mod below;
mod clients;
mod publish;
mod receive;
mod relay;
mod settle;
mod tier_state;
mod transaction;

use metrics::counter;

use crate::auth::{Action, Caller, RETRY_TOPIC_PREFIX};
use crate::delivery::DeliveryError;
use crate::metrics as m;
use crate::publish::Attempt;
use crate::transaction::TransactionError;

pub use clients::{ClientIds, ClientOwners};
pub use publish::{count_refused_publish, PublishRefused, PublishRequest, Publishing};
pub use receive::{Deliveries, Reader, Receive, ReceiveRequest, ReceivingClient};
pub use relay::Relay;
pub use settle::{Owners, Settle, Settled, Settlement, Settling};
pub use transaction::{EndOutcome, EndRequest, Ending};

/// Why the gateway refused a request, the same whichever front it came in on.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The caller may not consume as this group.
    #[error("may not consume as group `{0}`")]
    MayNotConsume(String),
    /// The caller may not publish to this topic.
    #[error("may not publish to `{0}`")]
    MayNotPublish(String),
    /// The caller may not use the admin plane.
    #[error("may not use the admin API")]
    MayNotAdminister,
    /// The caller may not read this topic (whatever group it reads it as).
    #[error("may not read topic `{0}`")]
    MayNotRead(String),
    /// The caller may neither publish to nor read this topic, so it may not look it up either (its route, its
    /// queues' offsets).
    #[error("may neither publish to nor read topic `{0}`")]
    MayNotRoute(String),
    /// The client id is used by another token (it is that token's until it expires).
    #[error("client id `{0}` is used by another token")]
    ClientIdTaken(String),
    /// The producer group is another token's: a live client of that token registered it first. A producer
    /// group is asked a transaction's check-backs, half message included.
    #[error("producer group `{0}` is used by another token")]
    ProducerGroupTaken(String),
    /// A new client id, when the front keeps as many as it may.
    #[error("popgate keeps at most {max} clients ({setting}); try again later")]
    TooManyClients {
        /// The bound.
        max: usize,
        /// The setting that sets it.
        setting: &'static str,
    },
    /// The message body is larger than `publish.max_message_bytes` (a batch's, as a whole).
    #[error("the message body is larger than the {max} bytes popgate sends")]
    MessageTooLarge {
        /// `publish.max_message_bytes`.
        max: usize,
    },
    /// A one-way send under the financial profile, which publishes only what the broker confirmed stored.
    #[error("oneway sends are never confirmed by the broker; the financial profile refuses them")]
    OneWayUnconfirmed,
    /// The topic does not exist (and the broker would not create it).
    #[error("topic `{0}` does not exist")]
    TopicNotFound(String),
    /// A transaction's message for a topic not typed TRANSACTION or MIXED.
    #[error(
        "topic `{topic}` takes {topic_type} messages; a transactional one needs a topic of type TRANSACTION (or MIXED)"
    )]
    TakesNoTransactions {
        /// The topic.
        topic: String,
        /// Its type, as RocketMQ names it.
        topic_type: &'static str,
    },
    /// No attempt stored the message.
    #[error("the broker did not store the message: {last_error}")]
    NotStored {
        /// Every attempt made.
        attempts: Vec<Attempt>,
        /// The last failure.
        last_error: String,
    },
    /// Something popgate needs for the request is unavailable now (a topic's type, the state store).
    #[error("{0}")]
    Unavailable(String),
    /// An ACK made at the broker without the instance that handed the delivery out (it cannot be reached),
    /// with the latest lease this instance knows, which may no longer be the broker's current one: the ACK may
    /// change nothing there, and the message may be delivered again. Not a plain success.
    #[error("{0}")]
    AckUnconfirmed(String),
    /// The caller may not settle this delivery: it may not read the delivery's topic as the delivery's group.
    #[error("may not settle delivery `{delivery}`: {refusal}")]
    MayNotSettle {
        /// The delivery.
        delivery: String,
        /// Why: [`GatewayError::MayNotConsume`] or [`GatewayError::MayNotRead`].
        refusal: Box<GatewayError>,
    },
    /// A settlement names a group other than the delivery's.
    #[error("the handle belongs to group `{owner}`, not `{named}`")]
    HandleOfAnotherGroup {
        /// The delivery's group.
        owner: String,
        /// The group the request named.
        named: String,
    },
    /// The delivery core refused the settlement (unknown or superseded handle, busy, store unavailable).
    #[error(transparent)]
    Delivery(#[from] DeliveryError),
    /// The transaction layer refused an end (no such record, ended the other way, busy, store unavailable).
    #[error(transparent)]
    Transaction(#[from] TransactionError),
}

impl GatewayError {
    /// A stable name for the refusal (logs, metrics, the HTTP error's `code`).
    pub fn code(&self) -> &'static str {
        match self {
            GatewayError::MayNotConsume(_)
            | GatewayError::MayNotRead(_)
            | GatewayError::MayNotRoute(_)
            | GatewayError::MayNotPublish(_)
            | GatewayError::MayNotAdminister
            | GatewayError::ClientIdTaken(_)
            | GatewayError::ProducerGroupTaken(_)
            | GatewayError::MayNotSettle { .. } => "forbidden",
            GatewayError::HandleOfAnotherGroup { .. } => "bad_request",
            GatewayError::TooManyClients { .. } => "busy",
            GatewayError::Delivery(refusal) => refusal.code(),
            GatewayError::Transaction(TransactionError::Unknown(_)) => "not_found",
            GatewayError::Transaction(TransactionError::AlreadyEnded { .. } | TransactionError::Refused { .. }) => {
                "conflict"
            }
            GatewayError::Transaction(TransactionError::Busy(_)) => "busy",
            GatewayError::Transaction(TransactionError::Store(_)) => "unavailable",
            GatewayError::TopicNotFound(_) => "not_found",
            GatewayError::TakesNoTransactions { .. } | GatewayError::OneWayUnconfirmed => "bad_request",
            GatewayError::MessageTooLarge { .. } => "too_large",
            GatewayError::NotStored { .. } | GatewayError::Unavailable(_) => "unavailable",
            GatewayError::AckUnconfirmed(_) => "unconfirmed",
        }
    }

    /// The broker's response code when the broker itself refused the message (a remoting front answers its
    /// client with it, as the broker would have).
    pub fn broker_code(&self) -> Option<i32> {
        match self {
            GatewayError::NotStored { attempts, .. } => attempts.last().and_then(|a| a.broker_code),
            _ => None,
        }
    }
}

/// Whether `caller` may consume as `group`; a refusal is counted.
///
/// # Errors
/// [`GatewayError::MayNotConsume`].
pub fn may_consume(caller: &Caller, group: &str) -> Result<(), GatewayError> {
    if caller.may(Action::Consume(group)) {
        return Ok(());
    }
    counter!(m::REQUESTS_REJECTED, "reason" => "forbidden").increment(1);
    Err(GatewayError::MayNotConsume(group.to_owned()))
}

/// Whether `caller` may use the admin plane; a refusal is counted.
///
/// # Errors
/// [`GatewayError::MayNotAdminister`].
pub fn may_administer(caller: &Caller) -> Result<(), GatewayError> {
    if caller.may(Action::Admin) {
        return Ok(());
    }
    counter!(m::REQUESTS_REJECTED, "reason" => "forbidden").increment(1);
    Err(GatewayError::MayNotAdminister)
}

/// Whether a producer of `caller` may be asked about a half message of `topic` (a check-back carries the
/// message): the producer must be allowed to publish to it. Not a refusal of anything: not counted.
pub fn may_be_checked_back(caller: &Caller, topic: &str) -> bool {
    caller.may(Action::Publish(topic))
}

/// Whether `caller` may publish to `topic` (a message, a transaction's end); a refusal is counted. A consumer's
/// send to its group's `%RETRY%` topic (the fallback of a failed send-back) is part of consuming as the group.
///
/// # Errors
/// [`GatewayError::MayNotPublish`], [`GatewayError::MayNotConsume`] for a retry topic.
pub fn may_publish(caller: &Caller, topic: &str) -> Result<(), GatewayError> {
    if let Some(group) = topic.strip_prefix(RETRY_TOPIC_PREFIX) {
        return may_consume(caller, group);
    }
    if caller.may(Action::Publish(topic)) {
        return Ok(());
    }
    counter!(m::REQUESTS_REJECTED, "reason" => "forbidden").increment(1);
    Err(GatewayError::MayNotPublish(topic.to_owned()))
}

/// Whether `caller` may read `topic` as consumer group `group`: `Sub` on the group and on the topic, as in
/// RocketMQ's ACL 2.0 (a group's `%RETRY%` topic is the group's). A refusal is counted.
///
/// # Errors
/// [`GatewayError::MayNotConsume`], [`GatewayError::MayNotRead`].
pub fn may_read(caller: &Caller, group: &str, topic: &str) -> Result<(), GatewayError> {
    may_subscribe(caller, group, [topic])
}

/// Whether `caller` may consume as `group` from each of `topics` (a consumer's subscriptions, as a gRPC client's
/// Telemetry `Settings` announce them): `Sub` on the group and on every topic, as RocketMQ's ACL 2.0 asks of
/// Telemetry. The first refusal is counted.
///
/// # Errors
/// [`GatewayError::MayNotConsume`], [`GatewayError::MayNotRead`] naming the first topic refused.
pub fn may_subscribe<'a>(
    caller: &Caller,
    group: &str,
    topics: impl IntoIterator<Item = &'a str>,
) -> Result<(), GatewayError> {
    may_consume(caller, group)?;
    match topics.into_iter().find(|topic| !caller.may(Action::Subscribe(topic))) {
        None => Ok(()),
        Some(topic) => {
            counter!(m::REQUESTS_REJECTED, "reason" => "forbidden").increment(1);
            Err(GatewayError::MayNotRead(topic.to_owned()))
        }
    }
}

/// Whether `caller` may look `topic` up: its route (its brokers and queues: a gRPC `QueryRoute`), its queues'
/// offsets and store times (remoting). RocketMQ's ACL 2.0 asks `Pub` or `Sub` on the topic for a gRPC route, and
/// `Get` for the offsets; popgate's tokens grant no `Get` of its own, so `Pub` or `Sub` on the topic stands for
/// it (whoever may write or read a topic may find it), and a group's `%RETRY%` topic needs `Sub` on the group, as
/// in Apache's ACLs. popgate signs what it relays with its own credentials, so the cluster would answer anyone
/// who got this far. A refusal is counted.
///
/// # Errors
/// [`GatewayError::MayNotRoute`], [`GatewayError::MayNotConsume`] for a retry topic.
pub fn may_look_up(caller: &Caller, topic: &str) -> Result<(), GatewayError> {
    if let Some(group) = topic.strip_prefix(RETRY_TOPIC_PREFIX) {
        return may_consume(caller, group);
    }
    if caller.may(Action::Publish(topic)) || caller.may(Action::Subscribe(topic)) {
        return Ok(());
    }
    counter!(m::REQUESTS_REJECTED, "reason" => "forbidden").increment(1);
    Err(GatewayError::MayNotRoute(topic.to_owned()))
}

/// Who holds a delivery handed out to client `client_id` of `front` (`grpc`, `remoting`), as the delivery core
/// knows it. A client id is one token's on every front ([`ClientOwners`]), but one app may run a gRPC and a
/// remoting client under one id: the front's name keeps their holdings apart, so a remoting `UNREGISTER_CLIENT`
/// gives back nothing a gRPC client holds.
pub fn holder_id(front: &str, client_id: &str) -> String {
    format!("{front}:{client_id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_topic_is_looked_up_by_who_may_publish_to_or_read_it_and_a_retry_topic_by_its_groups_consumers() {
        let writer = Caller::of_scoped_test_token("writer", "orders", "none", "none");
        let reader = Caller::of_scoped_test_token("reader", "none", "billing", "orders");
        for caller in [&writer, &reader] {
            assert!(may_look_up(caller, "orders").is_ok(), "{}", caller.name);
            assert!(matches!(may_look_up(caller, "payroll"), Err(GatewayError::MayNotRoute(t)) if t == "payroll"));
        }
        assert!(may_look_up(&reader, "%RETRY%billing").is_ok(), "a retry topic is its group's");
        assert!(may_look_up(&reader, "%RETRY%payroll").is_err());
        assert!(may_look_up(&writer, "%RETRY%orders").is_err(), "Pub on a topic named like a group is no Sub on it");
    }
}
