//! `SendMessage`: each message goes through the same publish path as HTTP (retries on another broker, fault
//! avoidance, the reliability profile's store-status rule). The SDK's message id is kept; message group,
//! delivery timestamp, tag, keys and user properties become what the HTTP front makes of them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use metrics::{counter, histogram};

use super::proto::{self as pb, Code, MessageType};
use super::service::Front;
use super::status::{ok, overall, status};
use crate::auth::{Action, Caller};
use crate::metrics as m;
use crate::publish::{
    is_reserved_property, is_valid_name, OutgoingMessage, PublishError, SendMode, DELIVER_AT_PROPERTY,
    MESSAGE_GROUP_PROPERTY, MESSAGE_ID_PROPERTY,
};

/// The broker's longest timer delay by default (`timerMaxDelaySec`, 3 days).
const MAX_DELAY: Duration = Duration::from_secs(3 * 24 * 3600);

pub(super) async fn send_messages(
    front: &Front,
    caller: &Caller,
    request: pb::SendMessageRequest,
    deadline: Option<std::time::Instant>,
) -> pb::SendMessageResponse {
    if request.messages.is_empty() {
        return pb::SendMessageResponse { status: Some(status(Code::BadRequest, "no messages")), entries: vec![] };
    }
    let mut entries = Vec::with_capacity(request.messages.len());
    for message in request.messages {
        entries.push(send_one(front, caller, message, deadline).await);
    }
    let statuses: Vec<pb::Status> = entries.iter().filter_map(|e| e.status.clone()).collect();
    pb::SendMessageResponse { status: Some(overall(&statuses)), entries }
}

/// Sends one message and counts it as the HTTP front counts a publish (`transport="grpc"`).
async fn send_one(
    front: &Front,
    caller: &Caller,
    message: pb::Message,
    deadline: Option<std::time::Instant>,
) -> pb::SendResultEntry {
    let started = std::time::Instant::now();
    let entry = send_checked(front, caller, message, deadline).await;
    let code = entry.status.as_ref().map_or(Code::Ok as i32, |s| s.code);
    let result = match Code::try_from(code) {
        Ok(Code::Ok) => "ok",
        Ok(Code::MessageBodyTooLarge) => "too_large",
        Ok(Code::TopicNotFound) => "not_found",
        Ok(Code::InternalServerError) => "unavailable",
        // Counted in `popgate_requests_rejected_total`, as the HTTP front's refusals are.
        Ok(Code::Forbidden) => return entry,
        _ => "bad_request",
    };
    counter!(m::PUBLISH_REQUESTS, "result" => result, "transport" => "grpc").increment(1);
    histogram!(m::PUBLISH_DURATION).record(started.elapsed().as_secs_f64());
    entry
}

async fn send_checked(
    front: &Front,
    caller: &Caller,
    message: pb::Message,
    deadline: Option<std::time::Instant>,
) -> pb::SendResultEntry {
    let message_id = message.system_properties.as_ref().map(|p| p.message_id.clone()).unwrap_or_default();
    let refused = |status: pb::Status| pb::SendResultEntry {
        status: Some(status),
        message_id: message_id.clone(),
        ..Default::default()
    };
    let outgoing = match to_outgoing(message, front.config.publish.max_message_bytes) {
        Ok(outgoing) => outgoing,
        Err(invalid) => return refused(invalid),
    };
    if !caller.may(Action::Publish(&outgoing.topic)) {
        counter!(m::REQUESTS_REJECTED, "reason" => "forbidden").increment(1);
        return refused(status(Code::Forbidden, format!("may not publish to `{}`", outgoing.topic)));
    }
    match front.publisher.publish_before(&outgoing, SendMode::Sync, deadline).await {
        Ok(published) => {
            let receipt = published.receipt;
            pb::SendResultEntry {
                status: Some(ok()),
                message_id: receipt.as_ref().map_or(message_id.clone(), |r| r.message_id.clone()),
                offset: receipt.map_or(0, |r| i64::try_from(r.queue_offset).unwrap_or(i64::MAX)),
                ..Default::default()
            }
        }
        Err(PublishError::TopicNotFound(topic)) => {
            refused(status(Code::TopicNotFound, format!("topic `{topic}` does not exist")))
        }
        Err(error @ PublishError::Exhausted { .. }) => refused(status(Code::InternalServerError, error.to_string())),
    }
}

/// The SDK's message as popgate sends it, or the status naming what is wrong with it.
fn to_outgoing(message: pb::Message, max_body_bytes: usize) -> Result<OutgoingMessage, pb::Status> {
    let topic = message.topic.map(|t| t.name).unwrap_or_default();
    if !is_valid_name(&topic) {
        return Err(status(Code::IllegalTopic, format!("`{topic}` is not a valid topic name")));
    }
    if message.body.is_empty() {
        return Err(status(Code::MessageBodyEmpty, "the message body is empty"));
    }
    if message.body.len() > max_body_bytes {
        return Err(status(Code::MessageBodyTooLarge, format!("the message body exceeds {max_body_bytes} bytes")));
    }
    let system = message.system_properties.unwrap_or_default();
    if system.message_type == MessageType::Transaction as i32 {
        return Err(status(Code::NotImplemented, "popgate does not serve transactional messages"));
    }
    let mut outgoing = OutgoingMessage::new(topic, message.body);
    for (name, value) in message.user_properties {
        if is_reserved_property(&name) {
            return Err(status(Code::IllegalMessagePropertyKey, format!("`{name}` is a reserved property name")));
        }
        outgoing.properties.insert(name, value);
    }
    outgoing.tags = system.tag.filter(|t| !t.is_empty());
    outgoing.keys = system.keys;
    if !system.message_id.is_empty() {
        outgoing.properties.insert(MESSAGE_ID_PROPERTY.to_owned(), system.message_id);
    }
    match (system.message_group, system.delivery_timestamp) {
        (Some(_), Some(_)) => {
            return Err(status(
                Code::MessagePropertyConflictWithType,
                "a message cannot have both a message group and a delivery timestamp",
            ))
        }
        (Some(group), None) => {
            if group.is_empty() {
                return Err(status(Code::IllegalMessageGroup, "the message group is empty"));
            }
            outgoing.properties.insert(MESSAGE_GROUP_PROPERTY.to_owned(), group);
        }
        (None, Some(at)) => {
            let deliver_at_ms = at.seconds.saturating_mul(1000).saturating_add(i64::from(at.nanos / 1_000_000));
            let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
            if deliver_at_ms > now_ms + MAX_DELAY.as_millis() as i64 {
                return Err(status(Code::IllegalDeliveryTime, "the delivery timestamp is more than 3 days ahead"));
            }
            // A time already past is delivered at once, as by the broker.
            if deliver_at_ms > now_ms {
                outgoing.properties.insert(DELIVER_AT_PROPERTY.to_owned(), deliver_at_ms.to_string());
            }
        }
        (None, None) => {}
    }
    Ok(outgoing)
}
