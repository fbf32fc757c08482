//! What popgate stores about one in-flight delivery, and the subscription it belongs to.
//!
//! A record is written before the event is handed to anyone, and rewritten at every phase change
//! ("write the new state, then act"), so boot recovery can replay from it. The state store holds its compact
//! binary form ([`DeliveryRecord::encode`], see `binary`); records stored by earlier versions are JSON (the
//! serde form below), still read, and rewritten in the compact form at their next change.

mod binary;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::clock::Epoch;

pub use self::binary::DecodeError;
pub use crate::broker::consumer::{PoppedEvent as Event, ReceiptHandle};

/// Where a delivery stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "camelCase")]
pub enum Phase {
    /// Waiting to be dispatched: at once for a new event, at `due_ms` for a retry.
    Ready {
        /// Not before this time.
        due_ms: Epoch,
    },
    /// Handed to a subscriber; an ACK is due by `deadline_ms`.
    AwaitingAck {
        /// The ACK deadline.
        deadline_ms: Epoch,
        /// When it was handed out, for the ACK latency.
        dispatched_ms: Epoch,
        /// The gRPC client it was handed to, if one was (see [`Holder`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        holder: Option<Holder>,
    },
    /// The subscriber ACKed (the ACK intent): the broker ACK is owed, and nothing else.
    Acked,
    /// Attempts exhausted or terminated: the event is owed to `%DLQ%<group>`, then the broker ACK.
    DeadLetter {
        /// Why (the last failure, or the subscriber's TERM reason).
        reason: String,
    },
}

/// The gRPC client a delivery is handed to. Stored with the hand-out, so a restart keeps it: once the client
/// has taken the message in (`written`), such a delivery is not dispatched again at boot (its client holds it
/// and will ACK it with the handle it has), it comes back only if its ACK deadline passes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Holder {
    /// The client's `x-mq-client-id`.
    pub client_id: String,
    /// The client asked popgate to keep the delivery until it settles it (a PushConsumer's `auto_renew`):
    /// its ACK deadline is extended while the client is alive, once the message is `written`.
    pub auto_renew: bool,
    /// The client took in the whole response that carried the message (its HTTP/2 flow control accepted
    /// every byte). The record is stored before the response is written, so until this is set the client
    /// may never have seen the message: it is not renewed, and recovery dispatches it again at once.
    /// Records written before popgate tracked this count as written, as they were treated then.
    #[serde(default = "written_before_it_was_tracked")]
    pub written: bool,
}

fn written_before_it_was_tracked() -> bool {
    true
}

/// One in-flight delivery.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryRecord {
    /// 128-bit random id, 32 hex characters; never reused.
    pub id: Arc<str>,
    /// Consumer group. (`Arc<str>`: one copy shared by all the deliveries of a subscription.)
    pub group: Arc<str>,
    /// Subscribed topic.
    pub topic: Arc<str>,
    /// The event.
    pub event: Event,
    /// The broker lease.
    pub handle: ReceiptHandle,
    /// The number of the current (or next) attempt, 1-based.
    pub attempt: u32,
    /// Where it stands.
    #[serde(flatten)]
    pub phase: Phase,
    /// The last failed attempt's reason.
    pub last_failure: Option<String>,
    /// Admission order within this popgate's store: messages of one group come from one queue in offset
    /// order, so this orders a FIFO message group.
    #[serde(default)]
    pub seq: u64,
    /// How many times it was handed out, this hand-out included: the current hand-out's number. A gRPC
    /// receipt handle names it, so a consumer whose time ran out cannot settle a later hand-out. Kept across
    /// restarts (a recovered holder keeps its handle); records written before it existed count from 0.
    #[serde(default)]
    pub handouts: u32,
    /// The event's body is stored apart (the `payloads` family) and left out of this record, in memory and in
    /// the store; it is read back to hand the event out or dead-letter it. Records written before popgate
    /// kept bodies apart carry their body inline (`false`).
    #[serde(default)]
    pub body_apart: bool,
}

/// A subscription: which group consumes which topic, and its delivery policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Subscription {
    /// Consumer group.
    pub group: String,
    /// Topic.
    pub topic: String,
    /// The filter: a RocketMQ tag expression (`*`, `a || b`), or an SQL92 expression over the message's
    /// properties (`filter_type`), which the broker evaluates.
    pub filter: String,
    /// What kind of expression `filter` is.
    #[serde(default, skip_serializing_if = "FilterType::is_tag")]
    pub filter_type: FilterType,
    /// Time a subscriber has to ACK one delivery.
    pub ack_timeout_ms: u64,
    /// Attempts in all before the DLQ.
    pub max_attempts: u32,
    /// First retry delay.
    pub initial_backoff_ms: u64,
    /// Largest retry delay.
    pub max_backoff_ms: u64,
    /// FIFO message groups: an event of a message group is dispatched only once every earlier event of that
    /// group is ACKed or dead-lettered. Different groups proceed in parallel.
    #[serde(default)]
    pub ordered: bool,
    /// Push every delivery to a webhook instead of waiting for subscribers to connect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push: Option<WebhookPush>,
    /// Created by a receive on its own (a long poll, a push stream, a gRPC receive), not by
    /// `POST /events/subscribe`: removed once idle (`delivery.idle_subscription_expiry_secs`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub implicit: bool,
    /// Which change of the subscription this is, for a tier's instances to agree on one (the latest wins:
    /// see `delivery::shared`). Set on every subscription asked for; `None` on implicit ones (never shared)
    /// and on those stored before popgate versioned them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<SubVersion>,
}

/// A change's place in a tier's order of changes to one subscription: when it was made (epoch ms, on the
/// instance that made it), then that instance's id to break a tie. Compared field by field, so every instance
/// that sees the same two changes keeps the same one.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SubVersion {
    /// When the change was made (epoch ms).
    pub at_ms: i64,
    /// The instance that made it.
    pub instance: String,
}

/// The kind of a subscription's filter, as RocketMQ names it (`ExpressionType`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum FilterType {
    /// A tag expression.
    #[default]
    #[serde(rename = "TAG")]
    Tag,
    /// An SQL92 expression over the message's properties.
    #[serde(rename = "SQL92")]
    Sql92,
}

impl FilterType {
    /// RocketMQ's name for it (`expType` of a POP).
    pub fn as_str(self) -> &'static str {
        match self {
            FilterType::Tag => "TAG",
            FilterType::Sql92 => "SQL92",
        }
    }

    /// Parses RocketMQ's name (either case).
    pub fn parse(text: &str) -> Option<FilterType> {
        match text.to_ascii_uppercase().as_str() {
            "TAG" => Some(FilterType::Tag),
            "SQL92" => Some(FilterType::Sql92),
            _ => None,
        }
    }

    fn is_tag(&self) -> bool {
        *self == FilterType::Tag
    }
}

impl Subscription {
    /// The store key (and in-memory key) of a group/topic pair.
    pub fn key_of(group: &str, topic: &str) -> String {
        format!("{group}\n{topic}")
    }

    /// This subscription's key.
    pub fn key(&self) -> String {
        Self::key_of(&self.group, &self.topic)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_stored_before_popgate_tracked_writes_counts_as_written() {
        let old: Holder = serde_json::from_str(r#"{"clientId":"app@1","autoRenew":true}"#).expect("decodes");
        assert!(old.written, "treated as it was then: kept for its client");
        let new = Holder { client_id: "app@1".into(), auto_renew: true, written: false };
        let round_trip: Holder = serde_json::from_str(&serde_json::to_string(&new).expect("encodes")).expect("decodes");
        assert_eq!(round_trip, new);
    }
}

/// Where and how a subscription's deliveries are pushed (the HTTP front's webhook pusher posts them; it checks
/// the URL, the secret and the bounds when the subscription is made).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookPush {
    /// `http` or `https` URL that receives each delivery.
    pub url: String,
    /// Key of the HMAC-SHA256 signature.
    pub secret: String,
    /// Timeout of one POST.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// POSTs in flight at once.
    #[serde(default = "default_concurrency")]
    pub max_concurrency: usize,
}

fn default_timeout_ms() -> u64 {
    10_000
}

fn default_concurrency() -> usize {
    8
}
