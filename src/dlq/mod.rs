//! The admin plane's dead-letter queue: browse `%DLQ%<group>` without consuming it, and replay its events to
//! their origin topics.
//!
//! RocketMQ never deletes a message on request, so "removed from the DLQ" means "replayed": popgate keeps a
//! replay ledger in its state store (column family `dlq_replays`, key `<dlq topic>\n<message id>`) and
//! browsing leaves replayed messages out.
//!
//! A replay of one message is "write the intent, then act" like every delivery step:
//! 1. the ledger records `replaying` (synced to disk);
//! 2. the event is published to its origin topic through the publish path (retries, fault avoidance), with
//!    the message id it had when it was dead-lettered (`UNIQ_KEY`), never a new one;
//! 3. the ledger records `replayed` with the receipt.
//!
//! A crash between 1 and 3 leaves `replaying`: browsing shows the message as `interrupted`, and the next
//! replay publishes it again under the same id. So no event is lost, and a copy that reached the topic twice
//! carries one id, which a subscriber can de-duplicate on: it is never replayed as a new event.
//!
//! - [`browse`]: paging through a DLQ with a cursor. [`replay`]: the paced replay.

pub(crate) mod browse;
pub(crate) mod replay;

pub(crate) use browse::BrowseRequest;
pub(crate) use replay::ReplayRequest;

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::broker::{BrokerClient, BrokerError};
use crate::publish::Publisher;
use crate::store::{StateStore, StoreError};

/// Why a DLQ request failed.
#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    /// A request value is wrong.
    #[error("{1}")]
    Invalid(&'static str, String),
    /// The broker could not be read.
    #[error("broker: {0}")]
    Broker(#[from] BrokerError),
    /// The replay ledger could not be read or written.
    #[error("state store: {0}")]
    Store(#[from] StoreError),
    /// Another replay of the same DLQ is running.
    #[error("a replay of {0} is already running")]
    Busy(String),
}

/// The DLQ admin service.
pub struct DlqAdmin {
    broker: Arc<BrokerClient>,
    publisher: Arc<Publisher>,
    store: Arc<StateStore>,
    /// DLQ topics with a replay running: one at a time each, so two never publish the same event.
    replaying: Mutex<HashSet<String>>,
}

impl DlqAdmin {
    /// A service reading through `broker`, replaying through `publisher`, keeping its ledger in `store`.
    pub fn new(broker: Arc<BrokerClient>, publisher: Arc<Publisher>, store: Arc<StateStore>) -> DlqAdmin {
        DlqAdmin { broker, publisher, store, replaying: Mutex::new(HashSet::new()) }
    }
}

/// The ledger key of a DLQ message.
pub fn ledger_key(dlq_topic: &str, message_id: &str) -> String {
    format!("{dlq_topic}\n{message_id}")
}

/// The DLQ topic a request names: `topic=%DLQ%<group>` or `group=<group>`.
///
/// # Errors
/// [`DlqError::Invalid`] when neither or both are given, or the topic is not a DLQ topic.
pub fn dlq_topic_of(topic: Option<&str>, group: Option<&str>) -> Result<String, DlqError> {
    match (topic, group) {
        (Some(topic), None) if topic.starts_with("%DLQ%") && crate::broker::message::is_valid_name(topic) => {
            Ok(topic.to_owned())
        }
        (Some(_), None) => Err(DlqError::Invalid("topic", "must be a dead-letter topic, %DLQ%<group>".to_owned())),
        (None, Some(group)) if crate::broker::message::is_valid_name(group) => {
            Ok(crate::delivery::dlq::dlq_topic(group))
        }
        (None, Some(_)) => Err(DlqError::Invalid("group", "must be a valid consumer group name".to_owned())),
        _ => Err(DlqError::Invalid("topic", "give `topic=%DLQ%<group>` or `group=<group>`, one of them".to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dlq_topic_comes_from_topic_or_group() {
        assert_eq!(dlq_topic_of(Some("%DLQ%g1"), None).expect("topic"), "%DLQ%g1");
        assert_eq!(dlq_topic_of(None, Some("g1")).expect("group"), "%DLQ%g1");
        assert!(matches!(dlq_topic_of(Some("orders"), None), Err(DlqError::Invalid("topic", _))));
        assert!(matches!(dlq_topic_of(None, None), Err(DlqError::Invalid("topic", _))));
        assert!(matches!(dlq_topic_of(Some("%DLQ%g"), Some("g")), Err(DlqError::Invalid("topic", _))));
        assert!(matches!(dlq_topic_of(None, Some("bad group")), Err(DlqError::Invalid("group", _))));
    }
}
