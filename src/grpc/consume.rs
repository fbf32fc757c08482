//! The consumer RPCs, each onto the delivery core. A message a gRPC consumer receives is a popgate delivery,
//! recorded (with the client that holds it) before it is sent; its receipt handle is popgate's own,
//! `pg1:<delivery id>`: stable across lease renewals and popgate restarts, and opaque to the client.
//!
//! | RPC | delivery core |
//! |---|---|
//! | `QueryAssignment` | one queue per broker of the topic, all served by popgate |
//! | `ReceiveMessage` | `Dispatcher::poll_as`, the subscription's filter set from the request |
//! | `AckMessage` | `Dispatcher::ack` per entry (then the broker ACK) |
//! | `ChangeInvisibleDuration` | auto-renewed (PushConsumer): a NACK on popgate's backoff; else a new deadline |
//! | `ForwardMessageToDeadLetterQueue` | `Dispatcher::term` (the DLQ write, then the broker ACK) |

use std::time::Duration;

use sha1::{Digest as _, Sha1};
use tokio::sync::mpsc;

use super::deadline;
use super::proto::{
    self as pb, receive_message_response::Content, Code, DigestType, Encoding, FilterType, MessageType,
};
use super::service::Front;
use super::settings::duration;
use super::status::{ok, overall, status};
use crate::auth::{Action, Caller};
use crate::delivery::{DeliveryError, Dispatched, HandOut, Holder, Subscription, MAX_POLL_BATCH, MAX_POLL_WAIT};
use crate::publish::is_valid_name;

/// The prefix of popgate's receipt handles (its version, should their form ever change).
const HANDLE_PREFIX: &str = "pg1:";
/// The invisible durations a SimpleConsumer may ask for (Apache's proxy allows up to 12 h as well).
const INVISIBLE_RANGE: std::ops::RangeInclusive<Duration> = Duration::from_secs(1)..=Duration::from_secs(12 * 3600);
/// An auto-renewed delivery's ACK deadline is kept this far ahead while its client is alive (see
/// [`super::service::keep_alive_loop`]); a client gone without a word gets its deliveries back after it.
pub(super) const AUTO_RENEW_HOLD: Duration = Duration::from_secs(30);
/// Auto-renewal stops this long after the hand-out, as in Apache's proxy: a listener stuck for 3 hours gets
/// the message back through the retry policy.
pub(super) const AUTO_RENEW_MAX: Duration = Duration::from_secs(3 * 3600);

/// popgate's receipt handle for a delivery.
pub(super) fn receipt_handle(delivery_id: &str) -> String {
    format!("{HANDLE_PREFIX}{delivery_id}")
}

/// The delivery id in a receipt handle popgate issued.
fn delivery_id(handle: &str) -> Option<&str> {
    handle.strip_prefix(HANDLE_PREFIX).filter(|id| !id.is_empty())
}

/// A resource's name, checked.
fn name_of(resource: Option<&pb::Resource>, code: Code, field: &str) -> Result<String, pb::Status> {
    let name = resource.map(|r| r.name.clone()).unwrap_or_default();
    if is_valid_name(&name) {
        Ok(name)
    } else {
        Err(status(code, format!("{field} `{name}` is not a valid name (1..=127 letters, digits, `_`, `-`, `%`, `|`)")))
    }
}

/// The group, checked against the caller's consume scope.
fn consumer_group(caller: &Caller, group: Option<&pb::Resource>) -> Result<String, pb::Status> {
    let group = name_of(group, Code::IllegalConsumerGroup, "group")?;
    if caller.may(Action::Consume(&group)) {
        Ok(group)
    } else {
        Err(status(Code::Forbidden, format!("may not consume as group `{group}`")))
    }
}

pub(super) async fn query_assignment(
    front: &Front,
    caller: &Caller,
    request: pb::QueryAssignmentRequest,
) -> pb::QueryAssignmentResponse {
    let refused = |status| pb::QueryAssignmentResponse { status: Some(status), assignments: vec![] };
    let topic = match name_of(request.topic.as_ref(), Code::IllegalTopic, "topic") {
        Ok(topic) => topic,
        Err(refusal) => return refused(refusal),
    };
    if let Err(refusal) = consumer_group(caller, request.group.as_ref()) {
        return refused(refusal);
    }
    let Some(endpoints) = request.endpoints else {
        return refused(status(Code::IllegalAccessPoint, "the request names no endpoints"));
    };
    let route = match front.publisher.existing_topic(&topic).await {
        Ok(Some(route)) => route,
        Ok(None) => return refused(status(Code::TopicNotFound, format!("topic `{topic}` does not exist"))),
        Err(error) => {
            return refused(status(Code::InternalServerError, format!("the name server did not answer: {error}")))
        }
    };
    // One receive loop per broker, as Apache's proxy assigns normal topics; popgate serves them all from the
    // group's one subscription, so the queue only sets how many receives the SDK keeps open.
    let assignments = route
        .brokers
        .iter()
        .filter(|b| b.read_queues > 0)
        .map(|broker| pb::Assignment {
            message_queue: Some(pb::MessageQueue {
                topic: request.topic.clone(),
                id: -1,
                permission: pb::Permission::ReadWrite as i32,
                broker: Some(pb::Broker { name: broker.name.clone(), id: 0, endpoints: Some(endpoints.clone()) }),
                accept_message_types: vec![
                    MessageType::Normal as i32,
                    MessageType::Fifo as i32,
                    MessageType::Delay as i32,
                ],
            }),
        })
        .collect::<Vec<_>>();
    if assignments.is_empty() {
        return refused(status(Code::Forbidden, format!("topic `{topic}` has no readable queue")));
    }
    pb::QueryAssignmentResponse { status: Some(ok()), assignments }
}

/// Who makes a receive call, and by when it must be answered.
pub(super) struct Call {
    pub(super) client_id: String,
    /// Before the client's deadline (`grpc-timeout`).
    pub(super) time_left: Option<Duration>,
    /// `x-mq-client-version`.
    pub(super) client_version: Option<String>,
}

/// What a receive asks for, checked.
pub(super) struct Receive {
    sub: Subscription,
    batch: usize,
    wait: Duration,
    hand_out: HandOut,
    namespace: String,
}

/// Checks a `ReceiveMessage` request and finds (or creates) its subscription, with the request's filter.
pub(super) async fn prepare_receive(
    front: &Front,
    caller: &Caller,
    call: &Call,
    request: pb::ReceiveMessageRequest,
) -> Result<Receive, pb::Status> {
    let group = consumer_group(caller, request.group.as_ref())?;
    let queue_topic = request.message_queue.as_ref().and_then(|q| q.topic.as_ref());
    let topic = name_of(queue_topic, Code::IllegalTopic, "message_queue.topic")?;
    let namespace = queue_topic.map(|t| t.resource_namespace.clone()).unwrap_or_default();
    let filter = match request.filter_expression {
        None => "*".to_owned(),
        Some(f) if f.r#type == FilterType::Sql as i32 => {
            return Err(status(Code::IllegalFilterExpression, "SQL92 filters are not supported; use a tag expression"));
        }
        Some(f) if f.expression.trim().is_empty() => "*".to_owned(),
        Some(f) => f.expression,
    };
    let batch = usize::try_from(request.batch_size)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| status(Code::BadRequest, "batch_size must be greater than 0"))?
        .min(MAX_POLL_BATCH);
    let asked = request
        .long_polling_timeout
        .map(|d| to_std(d).ok_or_else(|| status(Code::IllegalPollingTime, "long_polling_timeout must not be negative")))
        .transpose()?;
    let request_timeout = front.request_timeout_of(&call.client_id);
    let wait = deadline::long_poll(asked, call.time_left, request_timeout, call.client_version.as_deref())?;
    let ack_timeout = if request.auto_renew {
        Some(AUTO_RENEW_HOLD)
    } else {
        match request.invisible_duration.map(to_std) {
            None => None,
            Some(Some(d)) if INVISIBLE_RANGE.contains(&d) => Some(d),
            Some(_) => {
                return Err(status(Code::IllegalInvisibleTime, "invisible_duration must be within 1 s ..= 12 h"))
            }
        }
    };
    if front.dispatcher.subscription(&group, &topic).is_none() {
        match front.publisher.existing_topic(&topic).await {
            Ok(Some(_)) => {}
            Ok(None) => return Err(status(Code::TopicNotFound, format!("topic `{topic}` does not exist"))),
            Err(error) => {
                return Err(status(Code::InternalServerError, format!("the name server did not answer: {error}")))
            }
        }
    }
    let sub = front.dispatcher.ensure_filtered(&group, &topic, &filter).await.map_err(delivery_status)?;
    let holder = Holder { client_id: call.client_id.clone(), auto_renew: request.auto_renew };
    Ok(Receive {
        sub,
        batch,
        wait: wait.min(MAX_POLL_WAIT),
        hand_out: HandOut { transport: "grpc", ack_timeout, holder: Some(holder) },
        namespace,
    })
}

/// Runs a checked receive: waits for deliveries (or until the client goes away) and writes the stream Apache's
/// proxy writes: `status OK, message…, delivery_timestamp`, or `MESSAGE_NOT_FOUND, delivery_timestamp`.
/// Deliveries that can no longer be written go back at once, their attempt not spent. Returns the status
/// code answered, or `None` when the client left first.
pub(super) async fn run_receive(
    front: &Front,
    receive: Receive,
    out: mpsc::Sender<Result<pb::ReceiveMessageResponse, tonic::Status>>,
) -> Option<i32> {
    let polled = tokio::select! {
        polled = front.dispatcher.poll_as(&receive.sub, receive.batch, receive.wait, &receive.hand_out) => polled,
        () = out.closed() => return None,
        // Shutting down: the wait ends now, with nothing (`MESSAGE_NOT_FOUND`), so the call finishes in time.
        () = front.stopping() => Ok(Vec::new()),
    };
    let deliveries = match polled {
        Ok(deliveries) => deliveries,
        Err(error) => {
            let refusal = delivery_status(error);
            let code = refusal.code;
            let _ = out.send(Ok(content(Content::Status(refusal)))).await;
            return Some(code);
        }
    };
    let first = if deliveries.is_empty() { status(Code::MessageNotFound, "no new message") } else { ok() };
    let code = first.code;
    let mut unsent: Vec<String> = Vec::new();
    if out.send(Ok(content(Content::Status(first)))).await.is_err() {
        unsent.extend(deliveries.iter().map(|d| d.id.clone()));
    } else {
        for delivery in &deliveries {
            if !unsent.is_empty()
                || out.send(Ok(content(Content::Message(to_message(delivery, &receive.namespace))))).await.is_err()
            {
                unsent.push(delivery.id.clone());
            }
        }
    }
    if !unsent.is_empty() {
        front.dispatcher.unsent(&unsent, "grpc").await;
        return None;
    }
    let _ = out.send(Ok(content(Content::DeliveryTimestamp(timestamp(now_ms()))))).await;
    Some(code)
}

fn content(content: Content) -> pb::ReceiveMessageResponse {
    pb::ReceiveMessageResponse { content: Some(content) }
}

/// A delivery as the SDK reads a message: the body's SHA-1 (the SDK checks it), popgate's attempt number and
/// receipt handle.
fn to_message(delivery: &Dispatched, namespace: &str) -> pb::Message {
    let event = &delivery.event;
    let remaining = delivery.ack_deadline_ms - now_ms();
    let system_properties = pb::SystemProperties {
        tag: event.tags.clone(),
        keys: event.keys.clone(),
        message_id: event.id.clone(),
        body_digest: Some(pb::Digest {
            r#type: DigestType::Sha1 as i32,
            checksum: hex::encode_upper(Sha1::digest(&event.body)),
        }),
        body_encoding: Encoding::Identity as i32,
        message_type: if event.message_group.is_some() { MessageType::Fifo } else { MessageType::Normal } as i32,
        born_timestamp: Some(timestamp(event.born_timestamp)),
        receipt_handle: Some(receipt_handle(&delivery.id)),
        invisible_duration: Some(duration(Duration::from_millis(u64::try_from(remaining).unwrap_or(0)))),
        delivery_attempt: Some(i32::try_from(delivery.attempt).unwrap_or(i32::MAX)),
        message_group: event.message_group.clone(),
        ..Default::default()
    };
    pb::Message {
        topic: Some(pb::Resource { resource_namespace: namespace.to_owned(), name: event.topic.to_string() }),
        user_properties: event.properties.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        system_properties: Some(system_properties),
        body: event.body.clone().into(),
    }
}

/// The delivery a handle names, checked against the request's group: a handle popgate did not issue, or one of
/// another group, is `INVALID_RECEIPT_HANDLE`.
fn delivery_of<'h>(front: &Front, group: &str, handle: &'h str) -> Result<&'h str, pb::Status> {
    let id =
        delivery_id(handle).ok_or_else(|| status(Code::InvalidReceiptHandle, "not a receipt handle popgate issued"))?;
    match front.dispatcher.hold_of(id) {
        Some((owner, _, _)) if owner != group => {
            Err(status(Code::InvalidReceiptHandle, format!("the handle belongs to group `{owner}`, not `{group}`")))
        }
        _ => Ok(id),
    }
}

pub(super) async fn ack_messages(
    front: &Front,
    caller: &Caller,
    request: pb::AckMessageRequest,
) -> pb::AckMessageResponse {
    let group = match consumer_group(caller, request.group.as_ref()) {
        Ok(group) => group,
        Err(refusal) => return pb::AckMessageResponse { status: Some(refusal), entries: vec![] },
    };
    if request.entries.is_empty() {
        return pb::AckMessageResponse { status: Some(status(Code::BadRequest, "no entries")), entries: vec![] };
    }
    // The entries with a valid handle are ACKed as one batch (one store write, one broker request per broker).
    let ids: Vec<Result<&str, pb::Status>> =
        request.entries.iter().map(|entry| delivery_of(front, &group, &entry.receipt_handle)).collect();
    let valid: Vec<&str> = ids.iter().filter_map(|id| id.as_ref().ok().copied()).collect();
    let mut acked = front.dispatcher.ack_many(&valid).await.into_iter();
    let entries: Vec<pb::AckMessageResultEntry> = request
        .entries
        .iter()
        .zip(ids)
        .map(|(entry, id)| {
            let answer = match id {
                Err(refusal) => refusal,
                Ok(_) => acked.next().map_or_else(
                    || status(Code::InternalServerError, "no answer"),
                    |a| a.map_or_else(delivery_status, |()| ok()),
                ),
            };
            pb::AckMessageResultEntry {
                message_id: entry.message_id.clone(),
                receipt_handle: entry.receipt_handle.clone(),
                status: Some(answer),
            }
        })
        .collect();
    let statuses: Vec<pb::Status> = entries.iter().filter_map(|e| e.status.clone()).collect();
    pb::AckMessageResponse { status: Some(overall(&statuses)), entries }
}

/// A PushConsumer's (auto-renewed) delivery: its listener failed, so this is a NACK on popgate's backoff (the
/// same schedule the Settings gave the SDK, with popgate's jitter). A SimpleConsumer's: a new deadline. The
/// answer carries the same handle either way: popgate's handles never change.
pub(super) async fn change_invisible_duration(
    front: &Front,
    caller: &Caller,
    request: pb::ChangeInvisibleDurationRequest,
) -> pb::ChangeInvisibleDurationResponse {
    let handle = request.receipt_handle.clone();
    let answer = |status| pb::ChangeInvisibleDurationResponse { status: Some(status), receipt_handle: handle.clone() };
    let group = match consumer_group(caller, request.group.as_ref()) {
        Ok(group) => group,
        Err(refusal) => return answer(refusal),
    };
    let id = match delivery_of(front, &group, &request.receipt_handle) {
        Ok(id) => id,
        Err(refusal) => return answer(refusal),
    };
    let auto_renewed = front.dispatcher.hold_of(id).and_then(|(_, _, holder)| holder).is_some_and(|h| h.auto_renew);
    if auto_renewed {
        return answer(front.dispatcher.nack(id, None).await.map_or_else(delivery_status, |_| ok()));
    }
    let by = match request.invisible_duration.and_then(to_std) {
        Some(by) if by <= *INVISIBLE_RANGE.end() => by,
        _ => return answer(status(Code::IllegalInvisibleTime, "invisible_duration must be within 0 s ..= 12 h")),
    };
    answer(front.dispatcher.extend(id, by).await.map_or_else(delivery_status, |_| ok()))
}

pub(super) async fn forward_to_dead_letter_queue(
    front: &Front,
    caller: &Caller,
    request: pb::ForwardMessageToDeadLetterQueueRequest,
) -> pb::Status {
    let group = match consumer_group(caller, request.group.as_ref()) {
        Ok(group) => group,
        Err(refusal) => return refusal,
    };
    let id = match delivery_of(front, &group, &request.receipt_handle) {
        Ok(id) => id,
        Err(refusal) => return refusal,
    };
    let reason = format!(
        "forwarded by the client after {} of {} attempts",
        request.delivery_attempt, request.max_delivery_attempts
    );
    front.dispatcher.term(id, &reason).await.map_or_else(delivery_status, |()| ok())
}

/// The SDK's status for a delivery-core refusal. `INVALID_RECEIPT_HANDLE` tells a PushConsumer to stop
/// retrying its ACK; the others it retries every second.
fn delivery_status(error: DeliveryError) -> pb::Status {
    let code = match &error {
        DeliveryError::Unknown | DeliveryError::Stale | DeliveryError::NotInFlight => Code::InvalidReceiptHandle,
        DeliveryError::Busy => Code::TooManyRequests,
        DeliveryError::Store(_) => Code::InternalServerError,
        DeliveryError::Invalid(..) => Code::BadRequest,
    };
    status(code, error.to_string())
}

fn now_ms() -> i64 {
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
}

pub(super) fn to_std(d: prost_types::Duration) -> Option<Duration> {
    let seconds = u64::try_from(d.seconds).ok()?;
    let nanos = u32::try_from(d.nanos).ok()?;
    Some(Duration::new(seconds, nanos))
}

fn timestamp(epoch_ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: epoch_ms.div_euclid(1000),
        nanos: i32::try_from(epoch_ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_foreign_ones_are_refused() {
        assert_eq!(delivery_id(&receipt_handle("abc")), Some("abc"));
        assert_eq!(delivery_id("pg1:"), None);
        assert_eq!(delivery_id("1 2 3 brokerA 0 1 2"), None);
    }

    #[test]
    fn timestamps_split_milliseconds() {
        assert_eq!(timestamp(1_500), prost_types::Timestamp { seconds: 1, nanos: 500_000_000 });
    }
}
