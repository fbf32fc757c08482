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
    rocketmq_model::common::message::STRING_HASH_SET.contains(name)
        || name == super::transaction::PROPERTY_HTTP_CHECKER
        || name == super::transaction::PROPERTY_REMOTING_GROUP
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
    /// What a RocketMQ remoting client set on the message itself, passed to the broker as is; for a batch
    /// popgate made (`client::batch_message`), what the Java client sets on one; `None` for the other messages
    /// popgate makes (HTTP, gRPC, DLQ).
    pub wire: Option<ClientWire>,
}

/// The fields of a remoting client's `SEND_MESSAGE` header that popgate forwards unchanged, so the broker
/// stores the message as it would straight from the client: a compressed body stays compressed (its
/// `sys_flag` says so), a batch stays one batch, a retry keeps its reconsume count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientWire {
    /// The client's producer group (the broker checks transactions back with it).
    pub producer_group: String,
    /// `MessageSysFlag` bits as the client set them (compression, multiple tags, transaction type).
    pub sys_flag: i32,
    /// The message's `flag`.
    pub flag: i32,
    /// When the client made the message (epoch ms).
    pub born_timestamp: i64,
    /// A consumer's send of a message for retry: how often it was consumed before.
    pub reconsume_times: Option<i32>,
    /// A retry's limit of reconsumptions.
    pub max_reconsume_times: Option<i32>,
    /// `body` holds several messages, encoded as RocketMQ's `MessageBatch` (`SEND_BATCH_MESSAGE`).
    pub batch: bool,
    /// The client's unit mode flag.
    pub unit_mode: Option<bool>,
}

impl OutgoingMessage {
    /// A message with just a topic and a body.
    pub fn new(topic: String, body: Bytes) -> OutgoingMessage {
        OutgoingMessage { topic, body, tags: None, keys: Vec::new(), properties: BTreeMap::new(), wire: None }
    }
}
