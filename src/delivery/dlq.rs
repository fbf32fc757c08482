//! Dead-lettering: the event goes to `%DLQ%<group>` as RocketMQ itself would put it there, so RocketMQ
//! tooling (dashboard, `mqadmin`) understands it, plus popgate's own account of why.
//!
//! Kept: body, tags, keys, user properties. Added: `DLQ_ORIGIN_TOPIC`, `DLQ_ORIGIN_MESSAGE_ID`,
//! `RETRY_TOPIC` (when the event had come back from `%RETRY%`), and `POPGATE_ATTEMPTS`,
//! `POPGATE_LAST_FAILURE`, `POPGATE_DEAD_LETTERED_AT` (epoch ms), `POPGATE_DELIVERY_ID`, and
//! `POPGATE_MESSAGE_GROUP` for an event of a FIFO message group.
//! The write goes through the publish path, so its retries and fault avoidance apply.

use bytes::Bytes;

use super::record::{DeliveryRecord, Phase};
use crate::broker::OutgoingMessage;
use crate::clock::Epoch;
use crate::publish::{PublishError, Publisher, SendMode};

/// Property: the topic the event was consumed from.
pub const DLQ_ORIGIN_TOPIC: &str = "DLQ_ORIGIN_TOPIC";
/// Property: the event's message id.
pub const DLQ_ORIGIN_MESSAGE_ID: &str = "DLQ_ORIGIN_MESSAGE_ID";
/// Property: the retry topic the event came back from.
pub const RETRY_TOPIC: &str = "RETRY_TOPIC";
/// Property: attempts made before dead-lettering.
pub const POPGATE_ATTEMPTS: &str = "POPGATE_ATTEMPTS";
/// Property: why the last attempt failed (or the subscriber's TERM reason).
pub const POPGATE_LAST_FAILURE: &str = "POPGATE_LAST_FAILURE";
/// Property: when popgate dead-lettered it (epoch ms).
pub const POPGATE_DEAD_LETTERED_AT: &str = "POPGATE_DEAD_LETTERED_AT";
/// Property: the delivery id that was dead-lettered.
pub const POPGATE_DELIVERY_ID: &str = "POPGATE_DELIVERY_ID";

/// Property: the event's FIFO message group, so a replay keeps it (the DLQ message itself is not pinned).
pub const POPGATE_MESSAGE_GROUP: &str = "POPGATE_MESSAGE_GROUP";

/// The dead-letter topic of a consumer group (RocketMQ's naming).
pub fn dlq_topic(group: &str) -> String {
    format!("%DLQ%{group}")
}

/// The DLQ message for a delivery.
pub fn dead_letter_message(record: &DeliveryRecord) -> OutgoingMessage {
    let event = &record.event;
    let mut message = OutgoingMessage::new(dlq_topic(&record.group), Bytes::from(event.body.clone()));
    message.tags = event.tags.clone();
    message.keys = event.keys.clone();
    message.properties = event.properties.clone();
    let reason = match &record.phase {
        Phase::DeadLetter { reason } => reason.clone(),
        _ => record.last_failure.clone().unwrap_or_default(),
    };
    let extra = [
        (DLQ_ORIGIN_TOPIC, event.topic.to_string()),
        (DLQ_ORIGIN_MESSAGE_ID, event.id.clone()),
        (POPGATE_ATTEMPTS, record.attempt.to_string()),
        (POPGATE_LAST_FAILURE, reason),
        (POPGATE_DEAD_LETTERED_AT, Epoch::now().to_string()),
        (POPGATE_DELIVERY_ID, record.id.to_string()),
    ];
    for (name, value) in extra {
        message.properties.insert(name.to_owned(), value);
    }
    if let Some(message_group) = &event.message_group {
        message.properties.insert(POPGATE_MESSAGE_GROUP.to_owned(), message_group.clone());
    }
    if let Some(retry_topic) = &event.retry_topic {
        message.properties.insert(RETRY_TOPIC.to_owned(), retry_topic.clone());
    }
    message
}

/// Writes the delivery's event to its group's DLQ and waits for the broker to store it.
///
/// # Errors
/// The publish failure; the caller keeps the delivery in flight and retries.
pub async fn send(publisher: &Publisher, record: &DeliveryRecord) -> Result<(), PublishError> {
    publisher.publish(&dead_letter_message(record), SendMode::Sync).await.map(|_| ())
}
