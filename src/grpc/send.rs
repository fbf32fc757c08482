//! `SendMessage`: each message goes through the same publish path as HTTP (retries on another broker, fault
//! avoidance, the reliability profile's store-status rule). The SDK's message id is kept; message group,
//! delivery timestamp, tag, keys and user properties become what the HTTP front makes of them. A
//! transactional message becomes a half message, recorded by the transaction layer before it is answered.

use std::collections::BTreeMap;

use super::names;
use super::proto::{self as pb, Code, MessageType};
use super::service::Front;
use super::status::{bad, ok, overall_of_sends};
use crate::auth::Caller;
use crate::config::PublishConfig;
use crate::gateway::below::mark_half;
use crate::gateway::{self, PublishRefused, PublishRequest};
use crate::publish::limits::{Part, WithinLimits};
use crate::publish::{
    OutgoingMessage, Placement, SendMode, DELIVER_AT_PROPERTY, MESSAGE_GROUP_PROPERTY, MESSAGE_ID_PROPERTY,
};

/// How long the broker waits before it first checks a transaction back, when the message asks
/// (`orphaned_transaction_recovery_duration`), and the most a message may ask (Apache's proxy's
/// `maxTransactionRecoverySecond`).
const PROPERTY_CHECK_IMMUNITY_TIME: &str = "CHECK_IMMUNITY_TIME_IN_SECONDS";
const MAX_TRANSACTION_RECOVERY_SECS: i64 = 3600;

pub(super) async fn send_messages(
    front: &Front,
    caller: &Caller,
    request: pb::SendMessageRequest,
    deadline: Option<std::time::Instant>,
) -> pb::SendMessageResponse {
    // Apache's proxy sends one request's messages as one batch, so they must share their topic.
    let first_topic = request.messages.first().map(|m| m.topic.clone());
    let refusal = match &first_topic {
        None => Some(bad(Code::MessageCorrupted, "no message to send")),
        Some(topic) if request.messages.iter().any(|m| m.topic != *topic) => {
            Some(bad(Code::MessageCorrupted, "topic in message is not same"))
        }
        Some(_) => None,
    };
    if let Some(refusal) = refusal {
        return pb::SendMessageResponse { status: Some(refusal), entries: vec![] };
    }
    let mut entries = Vec::with_capacity(request.messages.len());
    for message in request.messages {
        entries.push(send_one(front, caller, message, deadline).await);
    }
    let statuses: Vec<pb::Status> = entries.iter().filter_map(|e| e.status.clone()).collect();
    pb::SendMessageResponse { status: Some(overall_of_sends(&statuses)), entries }
}

/// Sends one message (the gateway counts it, and this front counts a message it refuses while decoding it).
async fn send_one(
    front: &Front,
    caller: &Caller,
    message: pb::Message,
    deadline: Option<std::time::Instant>,
) -> pb::SendResultEntry {
    let received_at = std::time::Instant::now();
    let message_id = message.system_properties.as_ref().map(|p| p.message_id.clone()).unwrap_or_default();
    let refused = |status: pb::Status| pb::SendResultEntry {
        status: Some(status),
        message_id: message_id.clone(),
        ..Default::default()
    };
    let transactional =
        message.system_properties.as_ref().is_some_and(|p| p.message_type == MessageType::Transaction as i32);
    let half_group = transactional.then(|| front.transactions.producer_group());
    let outgoing = match to_outgoing(message, &front.config.publish, half_group) {
        Ok(outgoing) => outgoing,
        Err(invalid) => {
            gateway::count_refused_publish("grpc", PublishRefused::BadRequest, received_at);
            return refused(invalid);
        }
    };
    // Every retry of one SDK message carries its message id: a repeat is answered from the de-duplication window.
    let publish = PublishRequest {
        message: outgoing,
        placement: Placement::Policy,
        mode: SendMode::Sync,
        deadline,
        retry_key: Some(message_id.clone()),
        half: transactional,
        received_at,
    };
    match front.publishing().publish(caller, publish).await {
        Ok(published) => {
            let receipt = published.receipt;
            let mut entry = pb::SendResultEntry {
                status: Some(ok()),
                message_id: receipt.as_ref().map_or(message_id.clone(), |r| r.message_id.clone()),
                offset: receipt.as_ref().map_or(0, |r| i64::try_from(r.queue_offset).unwrap_or(i64::MAX)),
                ..Default::default()
            };
            if transactional {
                // As in RocketMQ, the transaction id is the message id.
                entry.transaction_id = entry.message_id.clone();
            }
            entry
        }
        Err(error) => refused(super::status::refused(&error)),
    }
}

/// The SDK's message as popgate sends it, or the status naming what is wrong with it: Apache's proxy's checks,
/// codes and words (`SendMessageActivity`), with the limits every front shares. A transactional message
/// (`half_group` given) becomes a half message of that producer group.
fn to_outgoing(
    message: pb::Message,
    config: &PublishConfig,
    half_group: Option<&str>,
) -> Result<WithinLimits, pb::Status> {
    let topic = names::topic(message.topic.as_ref())?;
    if message.body.is_empty() {
        return Err(bad(Code::MessageBodyEmpty, "message body cannot be empty"));
    }
    let system = message.system_properties.unwrap_or_default();
    if system.message_id.trim().is_empty() {
        return Err(bad(Code::IllegalMessageId, "message id cannot be empty"));
    }
    let mut outgoing = OutgoingMessage::new(topic, message.body);
    // Kept apart for the limits: an app's `UNIQ_KEY` is refused, not taken for the id popgate sets below.
    let user_properties: BTreeMap<String, String> = message.user_properties.into_iter().collect();
    outgoing.properties.extend(user_properties.clone());
    let recovery_secs = system.orphaned_transaction_recovery_duration.map(|d| d.seconds.max(0));
    if half_group.is_some() && recovery_secs.is_some_and(|s| s > MAX_TRANSACTION_RECOVERY_SECS) {
        return Err(bad(
            Code::BadRequest,
            format!(
                "the max transaction recovery time of message is too large, max is {MAX_TRANSACTION_RECOVERY_SECS}"
            ),
        ));
    }
    outgoing.tags = system.tag.filter(|t| !t.is_empty());
    outgoing.keys = system.keys;
    outgoing.properties.insert(MESSAGE_ID_PROPERTY.to_owned(), system.message_id);
    match (system.message_group, system.delivery_timestamp) {
        (Some(_), Some(_)) => {
            return Err(bad(
                Code::MessagePropertyConflictWithType,
                "a message cannot have both a message group and a delivery timestamp",
            ))
        }
        // An empty group is no group, as in Apache's proxy.
        (Some(group), None) if group.is_empty() => {}
        (Some(group), None) => {
            outgoing.properties.insert(MESSAGE_GROUP_PROPERTY.to_owned(), group);
        }
        (None, Some(at)) => {
            let deliver_at_ms = at.seconds.saturating_mul(1000).saturating_add(i64::from(at.nanos / 1_000_000));
            // A time already past is kept, as by Apache's proxy: the broker stores the message as it is and
            // delivers it at once, and its consumer sees a DELAY message with the time it was sent with.
            outgoing.properties.insert(DELIVER_AT_PROPERTY.to_owned(), deliver_at_ms.to_string());
        }
        (None, None) => {}
    }
    let mut outgoing = config.limits.admit_sdk_message(outgoing, &user_properties).map_err(|broken| {
        let code = match broken.part {
            Part::Tag => Code::IllegalMessageTag,
            Part::Key => Code::IllegalMessageKey,
            Part::MessageGroup => Code::IllegalMessageGroup,
            Part::Property => Code::IllegalMessagePropertyKey,
            Part::PropertiesTooLarge => Code::MessagePropertiesTooLarge,
            Part::DeliveryTime => Code::IllegalDeliveryTime,
            // The body is checked before (empty) and by publishing (its size); the SDK's limits do not read it.
            Part::BodyEmpty => Code::MessageBodyEmpty,
        };
        bad(code, broken.message)
    })?;
    // System properties, set after the limits (which refuse them from the app).
    if let Some(group) = half_group {
        outgoing.amend(|half| {
            mark_half(half, group, None);
            if let Some(seconds) = recovery_secs {
                half.properties.insert(PROPERTY_CHECK_IMMUNITY_TIME.to_owned(), seconds.to_string());
            }
        });
    }
    Ok(outgoing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    proptest::proptest! {
        /// Whatever bytes an SDK sends as a message, what decodes is a message to send or a status naming what is
        /// wrong with it, never a panic; and arbitrary field values in a message that decodes, the same.
        #[test]
        fn arbitrary_sdk_messages_are_sent_or_refused_with_a_status(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512),
            topic in "\\PC{0,140}",
            tag in "\\PC{0,20}",
            keys in proptest::collection::vec("\\PC{0,20}", 0..4),
            group in "\\PC{0,80}",
            property in ("\\PC{0,20}", "\\PC{0,20}"),
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
            delay_secs in proptest::prelude::any::<i64>(),
        ) {
            let config = PublishConfig::default();
            if let Ok(decoded) = pb::Message::decode(&bytes[..]) {
                let _ = to_outgoing(decoded, &config, None);
            }
            let message = pb::Message {
                topic: Some(pb::Resource { resource_namespace: String::new(), name: topic }),
                user_properties: [property].into_iter().collect(),
                system_properties: Some(pb::SystemProperties {
                    tag: Some(tag),
                    keys,
                    message_id: "0123456789ABCDEF".to_owned(),
                    message_group: Some(group),
                    delivery_timestamp: Some(prost_types::Timestamp { seconds: delay_secs, nanos: 0 }),
                    ..pb::SystemProperties::default()
                }),
                body: body.into(),
            };
            let _ = to_outgoing(message, &config, Some("a_group"));
        }
    }
}
