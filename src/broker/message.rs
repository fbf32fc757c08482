//! popgate's own picture of a message on its way to the broker, kept free of client-crate types so the
//! publish path and its tests do not depend on how the broker is reached.

use std::collections::BTreeMap;

use bytes::Bytes;

/// RocketMQ 5.x's FIFO message group (`MessageConst.PROPERTY_SHARDING_KEY`).
pub const PROPERTY_SHARDING_KEY: &str = "__SHARDINGKEY";
/// Absolute delivery time in epoch ms for the broker's timer wheel (`PROPERTY_TIMER_DELIVER_MS`).
pub const PROPERTY_TIMER_DELIVER_MS: &str = "TIMER_DELIVER_MS";

/// The client message id (`MessageConst.PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX`).
pub const PROPERTY_UNIQ_KEY: &str = "UNIQ_KEY";

// The naming rules are the config's (it validates names before anything else exists).
pub use crate::config::names::{is_valid_name, MAX_NAME_LEN};

/// Property names the broker (or popgate) gives meaning to; a user property may not take one of them.
pub fn is_reserved_property(name: &str) -> bool {
    rocketmq_model::common::message::STRING_HASH_SET.contains(name) || name == super::transaction::PROPERTY_HTTP_CHECKER
}

/// One message to send: body, routing attributes and properties (user and system ones popgate sets).
#[derive(Debug, Clone, PartialEq)]
pub struct OutgoingMessage {
    /// Destination topic.
    pub topic: String,
    /// The payload, sent as is.
    pub body: Bytes,
    /// RocketMQ tag (one), used by subscribers' tag filters.
    pub tags: Option<String>,
    /// Message keys, indexed by the broker for lookup.
    pub keys: Vec<String>,
    /// Properties: the user's, plus system ones popgate sets (delay, message group).
    pub properties: BTreeMap<String, String>,
}

impl OutgoingMessage {
    /// A message with just a topic and a body.
    pub fn new(topic: String, body: Bytes) -> OutgoingMessage {
        OutgoingMessage { topic, body, tags: None, keys: Vec::new(), properties: BTreeMap::new() }
    }
}
