//! Which message types a topic takes: its `message.type` attribute at the brokers (`mqadmin updateTopic -a
//! +message.type=TRANSACTION`), as Apache's proxy reads it. popgate uses it for transactional messages only:
//! a half message goes only to a topic typed TRANSACTION (or MIXED), and routes list TRANSACTION among the
//! accepted types only there. Read when first asked and again once 20 s old (Apache's proxy caches topic
//! configs as long).

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::broker::{BrokerClient, BrokerError, TopicRoute};

/// How long a topic's type is used before it is read again.
const FRESH_FOR: Duration = Duration::from_secs(20);
/// How long a read waits for the brokers (a route query waits for it, within the SDK's 3 s deadline).
const READ_WAIT: Duration = Duration::from_millis(1500);

/// A topic's message type (RocketMQ's `TopicMessageType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicMessageType {
    /// No attribute, or `NORMAL`.
    Normal,
    /// `FIFO`.
    Fifo,
    /// `DELAY`.
    Delay,
    /// `TRANSACTION`.
    Transaction,
    /// `MIXED`: every type.
    Mixed,
}

impl TopicMessageType {
    /// The attribute's value; anything unknown is treated as `NORMAL`, as by the broker's default.
    fn parse(value: Option<&str>) -> TopicMessageType {
        match value.map(str::to_ascii_uppercase).as_deref() {
            Some("FIFO") => TopicMessageType::Fifo,
            Some("DELAY") => TopicMessageType::Delay,
            Some("TRANSACTION") => TopicMessageType::Transaction,
            Some("MIXED") => TopicMessageType::Mixed,
            _ => TopicMessageType::Normal,
        }
    }

    /// RocketMQ's name, as Apache's proxy prints it.
    pub fn as_str(self) -> &'static str {
        match self {
            TopicMessageType::Normal => "NORMAL",
            TopicMessageType::Fifo => "FIFO",
            TopicMessageType::Delay => "DELAY",
            TopicMessageType::Transaction => "TRANSACTION",
            TopicMessageType::Mixed => "MIXED",
        }
    }

    /// Whether transactional messages may be sent to the topic.
    pub fn takes_transactions(self) -> bool {
        matches!(self, TopicMessageType::Transaction | TopicMessageType::Mixed)
    }
}

/// The types of the topics asked about so far.
#[derive(Default)]
pub(super) struct TopicTypes {
    known: Mutex<HashMap<String, (TopicMessageType, Instant)>>,
}

impl TopicTypes {
    /// `route`'s topic's type: cached, or read from its brokers.
    pub(super) async fn of(
        &self,
        broker: &BrokerClient,
        topic: &str,
        route: &TopicRoute,
    ) -> Result<TopicMessageType, BrokerError> {
        if let Some((kind, read_at)) = self.known.lock().get(topic) {
            if read_at.elapsed() < FRESH_FOR {
                return Ok(*kind);
            }
        }
        let addrs: Vec<&str> = route.brokers.iter().map(|b| b.addr.as_str()).collect();
        // A route query waits for this: when no broker answers quickly, what was known before is used.
        let read = tokio::time::timeout(READ_WAIT, broker.topic_message_type(topic, &addrs)).await;
        match read {
            Ok(Ok(value)) => {
                let kind = TopicMessageType::parse(value.as_deref());
                self.known.lock().insert(topic.to_owned(), (kind, Instant::now()));
                Ok(kind)
            }
            Ok(Err(error)) => self.known.lock().get(topic).map(|(kind, _)| *kind).ok_or(error),
            Err(_) => self.known.lock().get(topic).map(|(kind, _)| *kind).ok_or(BrokerError::Timeout(READ_WAIT)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_topic_without_the_attribute_is_normal_and_only_transaction_or_mixed_take_transactions() {
        assert_eq!(TopicMessageType::parse(None), TopicMessageType::Normal);
        assert_eq!(TopicMessageType::parse(Some("transaction")), TopicMessageType::Transaction);
        assert_eq!(TopicMessageType::parse(Some("UNSPECIFIED")), TopicMessageType::Normal);
        let takes: Vec<&str> = [
            TopicMessageType::Normal,
            TopicMessageType::Fifo,
            TopicMessageType::Delay,
            TopicMessageType::Transaction,
            TopicMessageType::Mixed,
        ]
        .into_iter()
        .filter(|t| t.takes_transactions())
        .map(TopicMessageType::as_str)
        .collect();
        assert_eq!(takes, ["TRANSACTION", "MIXED"]);
    }
}
