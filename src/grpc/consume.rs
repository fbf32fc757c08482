//! The consumer RPCs, each onto the delivery core. A message a gRPC consumer receives is a popgate delivery,
//! recorded (with the client that holds it) before it is sent; its receipt handle is popgate's own,
//! `pg2:<delivery id>.<hand-out>`: stable across lease renewals and popgate restarts, opaque to the client,
//! and its own for every hand-out, so a consumer whose invisible time ran out cannot settle the message
//! another consumer holds now. (`pg1:<delivery id>`, from before hand-outs were counted, is still accepted.)
//!
//! | RPC | gateway |
//! |---|---|
//! | `QueryAssignment` | one queue per broker of the topic, all served by popgate |
//! | `ReceiveMessage` | `Deliveries::open_receive` (the group's filter set from the request), `Deliveries::receive`; `Deliveries::written` once the client took the response in ([`super::written`]) |
//! | `AckMessage` | `Settling::ack_all` (then the broker ACK) |
//! | `ChangeInvisibleDuration` | auto-renewed (PushConsumer): `Settling::nack` on popgate's backoff; else `Settling::extend` |
//! | `ForwardMessageToDeadLetterQueue` | `Settling::term` (the DLQ write, then the broker ACK) |

use std::time::Duration;

use md5::{Digest as _, Md5};
use metrics::counter;
use tokio::sync::{mpsc, oneshot};

use super::proto::{self as pb, receive_message_response::Content, Code, DigestType, Encoding, MessageType};
use super::service::Front;
use super::settings::duration;
use super::status::{bad, ok, overall, refused, status};
use super::{deadline, names};
use crate::auth::Caller;
use crate::clock::Epoch;
use crate::gateway::below::{Dispatched, FilterType, MAX_POLL_BATCH, MAX_POLL_WAIT};
use crate::gateway::{self, Reader, Receive as Opened, ReceiveRequest, ReceivingClient, Settlement};
use crate::metrics as m;

/// The prefix of popgate's receipt handles (their version).
const HANDLE_PREFIX: &str = "pg2:";
/// The prefix of the handles popgate issued before it counted hand-outs: they name no hand-out.
const UNCOUNTED_HANDLE_PREFIX: &str = "pg1:";
/// Most messages one receive hands out, as Apache's proxy (larger batches are cut to it, not refused).
const MAX_RECEIVE_BATCH: usize = 32;
/// An auto-renewed delivery's ACK deadline is kept this far ahead while its client is alive (see
/// [`super::service::keep_alive_loop`]); a client gone without a word gets its deliveries back after it.
pub(super) const AUTO_RENEW_HOLD: Duration = Duration::from_secs(30);
/// Auto-renewal stops this long after the hand-out, as in Apache's proxy: a listener stuck for 3 hours gets
/// the message back through the retry policy.
pub(super) const AUTO_RENEW_MAX: Duration = Duration::from_secs(3 * 3600);

/// popgate's receipt handle for one hand-out of a delivery (`handle_id`: its id as handed out,
/// [`gateway::below::Dispatched::handle_id`]).
pub(super) fn receipt_handle(handle_id: &str, handout: u32) -> String {
    format!("{HANDLE_PREFIX}{handle_id}.{handout}")
}

/// The delivery id as handed out (and the hand-out) a receipt handle popgate issued names.
fn parts_of(handle: &str) -> Option<(&str, Option<u32>)> {
    if let Some(id) = handle.strip_prefix(UNCOUNTED_HANDLE_PREFIX) {
        return (!id.is_empty()).then_some((id, None));
    }
    let (id, handout) = handle.strip_prefix(HANDLE_PREFIX)?.rsplit_once('.')?;
    let handout = handout.parse().ok()?;
    (!id.is_empty()).then_some((id, Some(handout)))
}

/// The group, checked against the caller's consume scope.
fn consumer_group(caller: &Caller, group: Option<&pb::Resource>) -> Result<String, pb::Status> {
    let group = names::group(group)?;
    gateway::may_consume(caller, &group).map_err(|refusal| refused(&refusal))?;
    Ok(group)
}

/// The group and topic of a request that reads the topic as the group, checked: `Sub` on both.
fn reader(caller: &Caller, group: Option<&pb::Resource>, topic: Option<&pb::Resource>) -> Result<Reader, pb::Status> {
    let group = names::group(group)?;
    let topic = names::topic(topic)?;
    Reader::check(caller, &group, &topic).map_err(|refusal| refused(&refusal))
}

pub(super) async fn query_assignment(
    front: &Front,
    caller: &Caller,
    request: pb::QueryAssignmentRequest,
) -> pb::QueryAssignmentResponse {
    let unanswered = |status| pb::QueryAssignmentResponse { status: Some(status), assignments: vec![] };
    let topic = match reader(caller, request.group.as_ref(), request.topic.as_ref()) {
        Ok(reader) => reader.topic().to_owned(),
        Err(refusal) => return unanswered(refusal),
    };
    let Some(endpoints) = request.endpoints else {
        return unanswered(bad(Code::IllegalAccessPoint, "the request names no endpoints"));
    };
    let route = match front.publisher.existing_topic(&topic).await {
        Ok(Some(route)) => route,
        Ok(None) => return unanswered(status(Code::TopicNotFound, format!("topic `{topic}` does not exist"))),
        Err(error) => {
            return unanswered(status(Code::InternalServerError, format!("the name server did not answer: {error}")))
        }
    };
    // One receive loop per broker, as Apache's proxy assigns normal topics; popgate serves them all from the
    // group's one subscription, so the queue only sets how many receives the SDK keeps open.
    let accept_message_types = super::route::accepted_types(front, &topic, &route).await;
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
                accept_message_types: accept_message_types.clone(),
            }),
        })
        .collect::<Vec<_>>();
    if assignments.is_empty() {
        return unanswered(status(Code::Forbidden, format!("topic `{topic}` has no readable queue")));
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
    opened: Opened,
    batch: usize,
    wait: Duration,
    namespace: String,
}

/// Checks a `ReceiveMessage` request and finds (or creates) its subscription, with the request's filter.
pub(super) async fn prepare_receive(
    front: &Front,
    caller: &Caller,
    call: &Call,
    request: pb::ReceiveMessageRequest,
) -> Result<Receive, pb::Status> {
    let queue_topic = request.message_queue.as_ref().and_then(|q| q.topic.as_ref());
    let reader = reader(caller, request.group.as_ref(), queue_topic)?;
    let namespace = queue_topic.map(|t| t.resource_namespace.clone()).unwrap_or_default();
    let (filter, filter_type) = filter_of(request.filter_expression)?;
    let batch = usize::try_from(request.batch_size)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| bad(Code::BadRequest, "batch_size must be greater than 0"))?
        .min(MAX_RECEIVE_BATCH.min(MAX_POLL_BATCH));
    let asked = request
        .long_polling_timeout
        .map(|d| to_std(d).ok_or_else(|| bad(Code::IllegalPollingTime, "long_polling_timeout must not be negative")))
        .transpose()?;
    let request_timeout = front.request_timeout_of(&call.client_id);
    let wait = deadline::long_poll(asked, call.time_left, request_timeout, call.client_version.as_deref())?;
    // Auto-renewed (a PushConsumer): the asked duration does not matter, as in Apache's proxy. Not asked: the
    // subscription's ACK timeout.
    let ack_timeout = if request.auto_renew {
        Some(AUTO_RENEW_HOLD)
    } else {
        let grpc = &front.config.grpc;
        request
            .invisible_duration
            .map(|d| checked_invisible(d, grpc.min_invisible_ms, grpc.max_invisible_ms))
            .transpose()?
    };
    let asked = ReceiveRequest {
        filter,
        filter_type,
        front: "grpc",
        client: ReceivingClient::Named(&call.client_id),
        auto_renew: request.auto_renew,
        ack_timeout,
        fifo_batch: true,
    };
    let opened = front.deliveries.open_receive(&reader, &front.publisher, asked).await.map_err(|e| refused(&e))?;
    Ok(Receive { opened, batch, wait: wait.min(MAX_POLL_WAIT), namespace })
}

/// A receive's filter as Apache's proxy reads it (`FilterAPI.build`): a tag expression (empty or `*`: every
/// message), or an SQL92 expression that the broker evaluates (and refuses if it cannot compile it).
fn filter_of(expression: Option<pb::FilterExpression>) -> Result<(String, FilterType), pb::Status> {
    let Some(expression) = expression else { return Ok(("*".to_owned(), FilterType::Tag)) };
    if expression.r#type == pb::FilterType::Sql as i32 {
        if expression.expression.trim().is_empty() {
            return Err(bad(Code::IllegalFilterExpression, "Expression can't be null! SQL92"));
        }
        return Ok((expression.expression, FilterType::Sql92));
    }
    let tags = expression.expression.trim();
    if tags.is_empty() || tags == "*" {
        return Ok(("*".to_owned(), FilterType::Tag));
    }
    if tags.split("||").all(|tag| tag.trim().is_empty()) {
        return Err(bad(Code::IllegalFilterExpression, "subString split error"));
    }
    Ok((expression.expression, FilterType::Tag))
}

/// What a receive answered.
pub(super) struct Answered {
    /// The status code.
    pub(super) code: i32,
    /// The hand-outs it carried (delivery id, hand-out number), and the earliest of their deadlines.
    handed: Vec<(String, u32)>,
    first_deadline: Epoch,
}

/// Runs a checked receive: waits for deliveries (or until the client goes away) and writes the stream Apache's
/// proxy writes: `status OK, message…, delivery_timestamp`, or `MESSAGE_NOT_FOUND, delivery_timestamp`.
/// Deliveries that can no longer be written go back at once, their attempt not spent. Returns what was
/// answered, or `None` when the client left first.
pub(super) async fn run_receive(
    front: &Front,
    receive: Receive,
    out: mpsc::Sender<Result<pb::ReceiveMessageResponse, tonic::Status>>,
) -> Option<Answered> {
    let polled = tokio::select! {
        polled = front.deliveries.receive(&receive.opened, receive.batch, receive.wait) => polled,
        () = out.closed() => return None,
        // Shutting down: the wait ends now, with nothing (`MESSAGE_NOT_FOUND`), so the call finishes in time.
        () = front.stopping() => Ok(Vec::new()),
    };
    let deliveries = match polled {
        Ok(deliveries) => deliveries,
        Err(error) => {
            let refusal = refused(&error);
            let code = refusal.code;
            let _ = out.send(Ok(content(Content::Status(refusal)))).await;
            return Some(Answered { code, handed: Vec::new(), first_deadline: Epoch::ZERO });
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
        front.deliveries.unsent(&unsent, "grpc").await;
        // The ones queued before the stream went away may or may not have left: they stay unwritten.
        let queued = deliveries.len() - unsent.len();
        counter!(m::GRPC_UNWRITTEN_DELIVERIES).increment(queued as u64);
        return None;
    }
    let _ = out.send(Ok(content(Content::DeliveryTimestamp(timestamp(Epoch::now().as_millis()))))).await;
    Some(Answered {
        code,
        handed: deliveries.iter().map(|d| (d.id.clone(), d.handout)).collect(),
        first_deadline: deliveries.iter().map(|d| d.ack_deadline).min().unwrap_or(Epoch::ZERO),
    })
}

/// Waits (at most until the first of their deadlines) for the client to take in the response that carried
/// `answered`'s deliveries, then stores them as written: from then on an auto-renewed one is kept for its
/// client, and a restart leaves it with the client. A response the client never took in (the stream broke,
/// the client stopped reading) leaves them unwritten: they come back at their deadline. Without a watch
/// (`taken_in` is `None`) the response counts as taken in once it was queued.
pub(super) async fn when_taken_in(front: &Front, answered: Answered, taken_in: Option<oneshot::Receiver<()>>) {
    if answered.handed.is_empty() {
        return;
    }
    let time_left = Epoch::now().until(answered.first_deadline);
    let taken = match taken_in {
        None => true,
        Some(watch) => matches!(tokio::time::timeout(time_left, watch).await, Ok(Ok(()))),
    };
    if !taken {
        counter!(m::GRPC_UNWRITTEN_DELIVERIES).increment(answered.handed.len() as u64);
        tracing::debug!(deliveries = answered.handed.len(), "A gRPC client did not take in its receive's response.");
        return;
    }
    if let Err(error) = front.deliveries.written(&answered.handed).await {
        tracing::warn!(%error, "Could not store that a gRPC client took in its messages; they come back at their deadline.");
    }
}

fn content(content: Content) -> pb::ReceiveMessageResponse {
    pb::ReceiveMessageResponse { content: Some(content) }
}

/// A delivery as the SDK reads a message, every system property filled as Apache's proxy fills it from the
/// stored message (`GrpcConverter`), except popgate's attempt number, receipt handle and the time left to
/// settle it (`invisible_duration`, which Apache's proxy leaves out).
fn to_message(delivery: &Dispatched, namespace: &str) -> pb::Message {
    let hand_out = HandOutFacts {
        receipt_handle: receipt_handle(&delivery.handle_id(), delivery.handout),
        invisible: Epoch::now().until(delivery.ack_deadline),
        attempt: delivery.attempt,
    };
    message_of(&delivery.event, namespace, Some(hand_out))
}

/// What a hand-out adds to a message.
pub(super) struct HandOutFacts {
    receipt_handle: String,
    invisible: Duration,
    attempt: u32,
}

/// A stored message as the SDK reads one, with its hand-out's handle, time left and attempt when it is handed
/// out (a transaction check-back's message is not: no handle, attempt 1, as Apache's proxy sends it).
pub(super) fn message_of(
    event: &crate::gateway::below::Event,
    namespace: &str,
    hand_out: Option<HandOutFacts>,
) -> pb::Message {
    let stored = &event.stored;
    let system_properties = pb::SystemProperties {
        tag: event.tags.clone(),
        keys: event.keys.clone(),
        message_id: event.id.clone(),
        body_digest: Some(pb::Digest {
            r#type: DigestType::Md5 as i32,
            checksum: hex::encode_upper(Md5::digest(&event.body)),
        }),
        body_encoding: Encoding::Identity as i32,
        message_type: message_type(event) as i32,
        born_timestamp: Some(timestamp(event.born_timestamp)),
        born_host: stored.born_host.clone(),
        store_timestamp: (stored.store_timestamp > 0).then(|| timestamp(stored.store_timestamp)),
        store_host: stored.store_host.clone(),
        delivery_timestamp: delivery_timestamp(event).map(timestamp),
        receipt_handle: hand_out.as_ref().map(|h| h.receipt_handle.clone()),
        queue_id: stored.queue_id,
        queue_offset: Some(stored.queue_offset),
        invisible_duration: hand_out.as_ref().map(|h| duration(h.invisible)),
        delivery_attempt: Some(hand_out.as_ref().map_or(1, |h| i32::try_from(h.attempt).unwrap_or(i32::MAX))),
        message_group: event.message_group.clone(),
        trace_context: stored.system.get("TRACE_CONTEXT").cloned(),
        ..Default::default()
    };
    pb::Message {
        topic: Some(pb::Resource { resource_namespace: namespace.to_owned(), name: event.topic.to_string() }),
        user_properties: event.properties.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        system_properties: Some(system_properties),
        body: event.body.clone().into(),
    }
}

/// Apache's rule (`GrpcConverter.buildMessageType`): transactional, else delayed (any timer property), else FIFO
/// (a message group), else normal.
fn message_type(event: &crate::gateway::below::Event) -> MessageType {
    let system = &event.stored.system;
    if system.get("TRAN_MSG").is_some_and(|v| v == "true") {
        MessageType::Transaction
    } else if ["DELAY", "TIMER_DELIVER_MS", "TIMER_DELAY_SEC"].iter().any(|p| system.contains_key(*p)) {
        MessageType::Delay
    } else if event.message_group.is_some() {
        MessageType::Fifo
    } else {
        MessageType::Normal
    }
}

/// When a timer message was due (epoch ms): `TIMER_DELAY_SEC` from now, as Apache's proxy computes it, else
/// `TIMER_DELIVER_MS`.
fn delivery_timestamp(event: &crate::gateway::below::Event) -> Option<i64> {
    let system = &event.stored.system;
    if let Some(seconds) = system.get("TIMER_DELAY_SEC").and_then(|v| v.parse::<i64>().ok()) {
        return Some(Epoch::now().as_millis().saturating_add(seconds.saturating_mul(1000)));
    }
    system.get("TIMER_DELIVER_MS").and_then(|v| v.parse().ok())
}

/// What a handle settles, as the request's group: a handle popgate did not issue is `INVALID_RECEIPT_HANDLE`;
/// the gateway checks the rest (the delivery's group and topic).
fn settlement_of<'h>(group: &'h str, handle: &'h str) -> Result<Settlement<'h>, pb::Status> {
    let (id, handout) =
        parts_of(handle).ok_or_else(|| bad(Code::InvalidReceiptHandle, "not a receipt handle popgate issued"))?;
    Ok(Settlement::of(id, handout, Some(group)))
}

/// The answer of one settlement.
fn settled<T>(outcome: Result<T, gateway::GatewayError>) -> pb::Status {
    outcome.map_or_else(|refusal| refused(&refusal), |_| ok())
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
        return pb::AckMessageResponse { status: Some(bad(Code::BadRequest, "no entries")), entries: vec![] };
    }
    // The entries with a valid handle are ACKed as one batch (one store write, one broker request per broker).
    let parsed: Vec<Result<Settlement<'_>, pb::Status>> =
        request.entries.iter().map(|entry| settlement_of(&group, &entry.receipt_handle)).collect();
    let valid: Vec<Settlement<'_>> = parsed.iter().filter_map(|p| p.as_ref().ok().copied()).collect();
    let mut acked = front.settling().ack_all(caller, &valid).await.into_iter();
    let entries: Vec<pb::AckMessageResultEntry> = request
        .entries
        .iter()
        .zip(parsed)
        .map(|(entry, parsed)| {
            let answer = match parsed {
                Err(refusal) => refusal,
                Ok(_) => acked.next().map_or_else(|| status(Code::InternalServerError, "no answer"), settled),
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

/// A SimpleConsumer's delivery: a new deadline. A PushConsumer's (auto-renewed): its listener failed, so the
/// gateway NACKs it on popgate's backoff (the same schedule the Settings gave the SDK, with popgate's jitter).
/// The answer carries the same handle either way: popgate's handles never change.
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
    let settlement = match settlement_of(&group, &request.receipt_handle) {
        Ok(settlement) => settlement,
        Err(refusal) => return answer(refusal),
    };
    let by = match checked_invisible(
        request.invisible_duration.unwrap_or_default(),
        0,
        front.config.grpc.max_invisible_ms,
    ) {
        Ok(by) => by,
        Err(refusal) => return answer(refusal),
    };
    answer(settled(front.settling().change_deadline(caller, settlement, by).await))
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
    let settlement = match settlement_of(&group, &request.receipt_handle) {
        Ok(settlement) => settlement,
        Err(refusal) => return refusal,
    };
    let reason = format!(
        "forwarded by the client after {} of {} attempts",
        request.delivery_attempt, request.max_delivery_attempts
    );
    settled(front.settling().term(caller, settlement, &reason).await)
}

/// An invisible duration within `min_ms..=max_ms`, refused in Apache's words.
fn checked_invisible(asked: prost_types::Duration, min_ms: u64, max_ms: u64) -> Result<Duration, pb::Status> {
    let asked = to_std(asked).unwrap_or_default();
    if asked < Duration::from_millis(min_ms) {
        return Err(bad(Code::IllegalInvisibleTime, format!("the invisibleTime is too small. min is {min_ms}")));
    }
    if asked > Duration::from_millis(max_ms) {
        return Err(bad(Code::IllegalInvisibleTime, format!("the invisibleTime is too large. max is {max_ms}")));
    }
    Ok(asked)
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
    use crate::gateway::below::Target;

    #[test]
    fn handles_round_trip_and_foreign_ones_are_refused() {
        assert_eq!(parts_of(&receipt_handle("abc", 3)), Some(("abc", Some(3))));
        assert_eq!(parts_of("pg1:abc"), Some(("abc", None)), "issued by older popgate");
        let sealed = receipt_handle("popgate-0~abc!c2VhbGVk.bWFj", 2);
        let settlement = settlement_of("g", &sealed).expect("popgate's");
        assert_eq!(settlement.target, Target { id: "popgate-0~abc", handout: Some(2) });
        assert_eq!(settlement.lease, Some("c2VhbGVk.bWFj"), "a tier's handle carries the sealed lease");
        for foreign in ["pg1:", "pg2:abc", "pg2:.1", "pg2:abc.x", "1 2 3 brokerA 0 1 2"] {
            assert_eq!(parts_of(foreign), None, "{foreign}");
        }
    }

    #[test]
    fn timestamps_split_milliseconds() {
        assert_eq!(timestamp(1_500), prost_types::Timestamp { seconds: 1, nanos: 500_000_000 });
    }
}
