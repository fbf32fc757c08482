//! Consumers that consume by POP: a 5.x `DefaultMQPushConsumer` with `setClientRebalance(false)` asks the broker
//! for its queues (`QUERY_ASSIGNMENT`) and, when the answer says POP, pops, ACKs and retries message by message.
//! popgate serves these requests from its delivery core, so such an app gets what gRPC and HTTP apps get: the
//! broker ACK deferred until the app ACKs, a handle that stays valid across a popgate `kill -9`, popgate's backoff
//! and DLQ.
//!
//! | request | delivery core |
//! |---|---|
//! | `QUERY_ASSIGNMENT` | POP mode, one queue (id -1) per broker of the topic, all served by popgate; nothing for the group's `%RETRY%` topic (popgate retries itself); a client before 5.1.0: relayed to a broker (see [`POP_CK_KEPT_SINCE`]) |
//! | `POP_MESSAGE` | `Deliveries::open_receive` with the request's filter and invisible time, `Deliveries::receive`; `Deliveries::written` once the answer left |
//! | `ACK_MESSAGE` | `Settling::ack` of the hand-out the handle names (then the broker ACK) |
//! | `CHANGE_MESSAGE_INVISIBLETIME` | a NACK on popgate's backoff (the client sends it only for `RECONSUME_LATER`) |
//!
//! The handle: the client quotes a message's `POP_CK` property (its "extra info") in ACK and ChangeInvisibleTime.
//! The client reads eight space-separated fields from it (ck offset, pop time, invisible time, revive queue,
//! retry marker, broker name, queue id, offset) and routes by them; popgate fills those truthfully and appends
//! its own handle, `pgr:<delivery id>.<hand-out>`, as a ninth field, which the client carries along unread.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use cheetah_string::CheetahString;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::version::RocketMqVersion;
use rocketmq_model::CRC32Utils;
use rocketmq_protocol::common::message::message_decoder;
use rocketmq_protocol::protocol::header::pop_message_request_header::PopMessageRequestHeader;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use serde::Deserialize;

use super::codes;
use super::connection::Connection;
use super::service::{error, field, Front, Refusal, Reply};
use crate::auth::Caller;
use crate::clock::Epoch;
use crate::gateway::below::{Dispatched, FilterType, NackOutcome, MAX_POLL_WAIT};
use crate::gateway::{self, Reader, ReceiveRequest, ReceivingClient, Settlement};

/// The prefix of popgate's handles in a `POP_CK`.
const HANDLE_PREFIX: &str = "pgr:";
/// Most messages one POP may ask for, as the broker's limit.
const MAX_POP_BATCH: u32 = 32;
/// Clients from 5.1.0 on keep a `POP_CK` the message already carries; 5.0.x clients replace it with one of their
/// own made from the answer's offsets, which cannot carry popgate's handle. Their `QUERY_ASSIGNMENT` goes to a
/// broker, which assigns queues to pull (PULL mode) unless an operator made the group POP at the broker.
const POP_CK_KEPT_SINCE: RocketMqVersion = RocketMqVersion::V5_1_0;
/// The longest invisible time a POP may ask for (the client allows up to 5 minutes).
const MAX_INVISIBLE: Duration = Duration::from_secs(12 * 3600);

/// The message properties RocketMQ defines that popgate writes into a popped message.
const PROPERTY_POP_CK: &str = "POP_CK";
const PROPERTY_UNIQ_KEY: &str = "UNIQ_KEY";
const PROPERTY_TAGS: &str = "TAGS";
const PROPERTY_KEYS: &str = "KEYS";
const PROPERTY_SHARDING_KEY: &str = "__SHARDINGKEY";

/// `QUERY_ASSIGNMENT`'s body (`QueryAssignmentRequestBody`), as far as popgate reads it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AssignmentQuery {
    topic: String,
    consumer_group: String,
}

/// `QUERY_ASSIGNMENT`: every broker of the topic, in POP mode, for a client that keeps popgate's handle.
pub(super) async fn query_assignment(front: &Front, caller: &Caller, request: &RemotingCommand) -> RemotingCommand {
    let Some(query) = request.body().and_then(|body| serde_json::from_slice::<AssignmentQuery>(body).ok()) else {
        return error(codes::SYSTEM_ERROR, "QUERY_ASSIGNMENT without a body that decodes (QueryAssignmentRequestBody)");
    };
    if let Err(refused) = gateway::may_read(caller, &query.consumer_group, &query.topic) {
        return Refusal::from(refused).answer();
    }
    if !keeps_pop_ck(request) {
        return super::relay::to_a_master(front, "query_assignment", request).await;
    }
    if query.topic.starts_with("%RETRY%") {
        // popgate redelivers itself; the group's retry topic holds nothing for a POP consumer.
        return assignments(&query.topic, &[]);
    }
    match front.publisher.existing_topic(&query.topic).await {
        Ok(Some(route)) => {
            let brokers: Vec<&str> =
                route.brokers.iter().filter(|b| b.read_queues > 0).map(|b| b.name.as_str()).collect();
            assignments(&query.topic, &brokers)
        }
        Ok(None) => topic_not_exist(&query.topic),
        Err(why) => error(codes::SYSTEM_ERROR, format!("the name server did not answer: {why}")),
    }
}

/// Whether the client keeps a `POP_CK` popgate wrote (see [`POP_CK_KEPT_SINCE`]).
fn keeps_pop_ck(request: &RemotingCommand) -> bool {
    u32::try_from(request.version()).is_ok_and(|v| v >= POP_CK_KEPT_SINCE.ordinal())
}

/// The answer to `QUERY_ASSIGNMENT`: one POP queue per broker (`QueryAssignmentResponseBody`).
fn assignments(topic: &str, brokers: &[&str]) -> RemotingCommand {
    let assigned: Vec<serde_json::Value> = brokers
        .iter()
        .map(|broker| {
            serde_json::json!({
                "messageQueue": {"topic": topic, "brokerName": broker, "queueId": -1},
                "mode": "POP",
                "attachments": {},
            })
        })
        .collect();
    let body = serde_json::json!({ "messageQueueAssignments": assigned }).to_string();
    RemotingCommand::create_success_response_command().set_body(body.into_bytes())
}

fn topic_not_exist(topic: &str) -> RemotingCommand {
    error(codes::TOPIC_NOT_EXIST, format!("topic[{topic}] not exist, apply first please!"))
}

/// `POP_MESSAGE`: deliveries of the group's subscription, each with popgate's handle in its `POP_CK`. The answer
/// carries the hand-outs, to be stored as written once it has left ([`after_answer`]).
pub(super) async fn pop_message(
    front: &Front,
    connection: &Connection,
    caller: &Caller,
    request: &RemotingCommand,
) -> Reply {
    let pop = match request.decode_command_custom_header::<PopMessageRequestHeader>() {
        Ok(pop) => pop,
        Err(why) => return error(codes::SYSTEM_ERROR, format!("the POP_MESSAGE header does not decode: {why}")).into(),
    };
    let reader = match Reader::check(caller, pop.consumer_group.as_str(), pop.topic.as_str()) {
        Ok(reader) => reader,
        Err(refused) => return Refusal::from(refused).answer().into(),
    };
    if pop.max_msg_nums > MAX_POP_BATCH {
        return error(codes::INVALID_PARAMETER, "the broker[popgate] pop message's num is greater than 32").into();
    }
    let (filter, filter_type) = filter_of(pop.exp_type.as_deref(), pop.exp.as_deref());
    let invisible = Duration::from_millis(pop.invisible_time).min(MAX_INVISIBLE);
    let client_id = front.clients.consumer_on(connection.id, reader.group());
    let peer = connection.peer.to_string();
    let client = match &client_id {
        Some(id) => ReceivingClient::Named(id),
        None => ReceivingClient::Unnamed { connection: &peer },
    };
    let asked = ReceiveRequest {
        filter,
        filter_type,
        front: "remoting",
        client,
        auto_renew: false,
        ack_timeout: (!invisible.is_zero()).then_some(invisible),
        fifo_batch: false,
    };
    let opened = match front.deliveries.open_receive(&reader, &front.publisher, asked).await {
        Ok(opened) => opened,
        Err(refusal) => return Refusal::from(refusal).answer().into(),
    };
    let wait = Duration::from_millis(pop.poll_time).min(MAX_POLL_WAIT);
    let batch = usize::try_from(pop.max_msg_nums.max(1)).unwrap_or(1);
    let polled = tokio::select! {
        polled = front.deliveries.receive(&opened, batch, wait) => polled,
        // The client went away: nothing is handed out to it.
        () = connection.closed() => Ok(Vec::new()),
    };
    let deliveries = match polled {
        Ok(deliveries) => deliveries,
        Err(refusal) => return Refusal::from(refusal).answer().into(),
    };
    let (reply, unencodable) =
        popped_answer(&deliveries, field(request, "bname").unwrap_or_default(), pop.invisible_time);
    // What the answer could not carry: its attempt is spent.
    front.deliveries.undeliverable(&unencodable).await;
    reply
}

/// A POP's filter as the broker reads `expType` and `exp`: SQL92, else tags (none or `*`: every message).
fn filter_of(exp_type: Option<&str>, exp: Option<&str>) -> (String, FilterType) {
    let exp = exp.map(str::trim).filter(|e| !e.is_empty());
    match (exp_type, exp) {
        (Some("SQL92"), Some(sql)) => (sql.to_owned(), FilterType::Sql92),
        (_, Some(tags)) if tags != "*" => (tags.to_owned(), FilterType::Tag),
        _ => ("*".to_owned(), FilterType::Tag),
    }
}

/// The answer to a POP: `POLLING_TIMEOUT` when nothing came, else the messages, each as the broker encodes a
/// stored message, and the hand-outs they carry; with it the hand-outs it could not encode.
fn popped_answer(deliveries: &[Dispatched], bname: &str, invisible_ms: u64) -> (Reply, Vec<(String, u32)>) {
    let pop_time = Epoch::now();
    let mut encoded = BytesMut::new();
    let mut handed = Vec::with_capacity(deliveries.len());
    let mut offsets: BTreeMap<i32, Vec<i64>> = BTreeMap::new();
    let mut unencodable = Vec::new();
    for delivery in deliveries {
        match encode_delivery(delivery, bname, pop_time) {
            Ok(message) => {
                encoded.extend_from_slice(&message);
                handed.push((delivery.id.clone(), delivery.handout));
                offsets.entry(delivery.event.stored.queue_id).or_default().push(delivery.event.stored.queue_offset);
            }
            Err(why) => {
                tracing::warn!(delivery = %delivery.id, %why, "A delivery could not be encoded for a remoting client.");
                unencodable.push((delivery.id.clone(), delivery.handout));
            }
        }
    }
    let code = if handed.is_empty() { codes::POLLING_TIMEOUT } else { codes::SUCCESS };
    let remark = if handed.is_empty() { "NO_MESSAGE_IN_QUEUE" } else { "FOUND" };
    let mut answer = RemotingCommand::create_response_command_with_code_remark(code, remark);
    answer.add_ext_field("popTime", pop_time.to_string());
    answer.add_ext_field("invisibleTime", invisible_ms.to_string());
    answer.add_ext_field("reviveQid", "0");
    answer.add_ext_field("restNum", "0");
    if !handed.is_empty() {
        // Only that they are present matters (a client from 5.1.0 on then keeps each message's own POP_CK);
        // they say what the broker's would: the offsets popped, per queue id.
        let starts: Vec<String> =
            offsets.iter().map(|(q, o)| format!("0 {q} {}", o.iter().min().unwrap_or(&0))).collect();
        let each: Vec<String> = offsets
            .iter()
            .map(|(q, o)| format!("0 {q} {}", o.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")))
            .collect();
        answer.add_ext_field("startOffsetInfo", starts.join(";"));
        answer.add_ext_field("msgOffsetInfo", each.join(";"));
        answer = answer.set_body(encoded.freeze());
    }
    (Reply { command: answer, handed, then_tell: Vec::new() }, unencodable)
}

/// A delivery as the broker stores a message (`MessageDecoder.encode`), with the attempt as its
/// `reconsumeTimes` and popgate's handle in its `POP_CK`.
fn encode_delivery(delivery: &Dispatched, bname: &str, pop_time: Epoch) -> Result<Bytes, String> {
    let event = &delivery.event;
    let stored = &event.stored;
    let mut properties: HashMap<CheetahString, CheetahString> =
        event.properties.iter().map(|(k, v)| (k.as_str().into(), v.as_str().into())).collect();
    let mut put = |name: &str, value: String| {
        properties.insert(name.into(), value.into());
    };
    if let Some(tags) = &event.tags {
        put(PROPERTY_TAGS, tags.clone());
    }
    if !event.keys.is_empty() {
        put(PROPERTY_KEYS, event.keys.join(" "));
    }
    put(PROPERTY_UNIQ_KEY, event.id.clone());
    if let Some(group) = &event.message_group {
        put(PROPERTY_SHARDING_KEY, group.clone());
    }
    for (name, value) in &stored.system {
        put(name, value.clone());
    }
    let invisible = pop_time.until(delivery.ack_deadline).as_millis();
    let (queue_id, offset) = (stored.queue_id, stored.queue_offset);
    let handle = format!("{HANDLE_PREFIX}{}.{}", delivery.handle_id(), delivery.handout);
    put(PROPERTY_POP_CK, format!("{offset} {pop_time} {invisible} 0 0 {bname} {queue_id} {offset} {handle}"));

    let mut message = Message::builder()
        .topic(event.topic.as_ref())
        .body_slice(&event.body)
        .flag_bits(stored.flag)
        .build()
        .map_err(|e| e.to_string())?;
    message.set_properties(properties);
    let mut ext = MessageExt {
        message,
        queue_id,
        queue_offset: offset,
        born_timestamp: event.born_timestamp,
        born_host: socket_addr(&stored.born_host),
        store_timestamp: stored.store_timestamp,
        store_host: socket_addr(&stored.store_host),
        commit_log_offset: stored.commit_log_offset,
        body_crc: CRC32Utils::crc32(&event.body),
        reconsume_times: i32::try_from(delivery.attempt.saturating_sub(1)).unwrap_or(i32::MAX),
        ..MessageExt::default()
    };
    if ext.born_host.is_ipv6() {
        ext.with_born_host_v6_flag();
    }
    if ext.store_host.is_ipv6() {
        ext.with_store_host_v6_flag();
    }
    message_decoder::encode(&ext, false).map_err(|e| e.to_string())
}

/// `ip:port` or a bare `ip` (port 0); `0.0.0.0:0` for anything else (a host popgate was not told).
fn socket_addr(host: &str) -> SocketAddr {
    host.parse::<SocketAddr>()
        .or_else(|_| host.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 0)))
        .unwrap_or_else(|_| SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
}

/// Stores that a POP answer's hand-outs reached the client (`written`), or, when it could not be written,
/// hands them out again at once, their attempt not spent.
pub(super) async fn after_answer(front: &Front, handed: Vec<(String, u32)>, written: bool) {
    if handed.is_empty() {
        return;
    }
    if written {
        if let Err(why) = front.deliveries.written(&handed).await {
            tracing::warn!(%why, "Could not store that a remoting client took its messages; they come back at their deadline.");
        }
    } else {
        let ids: Vec<String> = handed.into_iter().map(|(id, _)| id).collect();
        front.deliveries.unsent(&ids, "remoting").await;
    }
}

/// `ACK_MESSAGE`: the hand-out the handle names is ACKed (the ACK intent stored, then the broker ACK).
pub(super) async fn ack_message(front: &Front, caller: &Caller, request: &RemotingCommand) -> RemotingCommand {
    let acked = match settlement(request) {
        Ok(settlement) => front.settling().ack(caller, settlement).await.map_err(Refusal::from),
        Err(refusal) => Err(refusal),
    };
    match acked {
        Ok(()) => RemotingCommand::create_success_response_command(),
        Err(refusal) => refusal.answer(),
    }
}

/// `CHANGE_MESSAGE_INVISIBLETIME`: the client's listener answered `RECONSUME_LATER`; the attempt is spent and
/// the next comes on popgate's backoff (or the event goes to the DLQ after the last), whatever time it asked for.
pub(super) async fn change_invisible_time(
    front: &Front,
    caller: &Caller,
    request: &RemotingCommand,
) -> RemotingCommand {
    let settlement = match settlement(request) {
        Ok(settlement) => settlement,
        Err(refusal) => return refusal.answer(),
    };
    let now = Epoch::now();
    let due = match front.settling().nack(caller, settlement, None).await {
        Ok(NackOutcome::Retry { due, .. }) => due,
        Ok(NackOutcome::DeadLetter) => now,
        Err(refusal) => return Refusal::from(refusal).answer(),
    };
    let mut answer = RemotingCommand::create_success_response_command();
    answer.add_ext_field("popTime", now.to_string());
    answer.add_ext_field("invisibleTime", now.until(due).as_millis().to_string());
    answer.add_ext_field("reviveQid", "0");
    answer
}

/// The hand-out an ACK or ChangeInvisibleTime settles, as the group the request names (the gateway checks it
/// against the delivery's).
fn settlement(request: &RemotingCommand) -> Result<Settlement<'_>, Refusal> {
    let group = field(request, "consumerGroup")
        .ok_or_else(|| Refusal::new(codes::SYSTEM_ERROR, "the request does not name its consumerGroup"))?;
    let (id, handout) = field(request, "extraInfo").and_then(handle_in).ok_or_else(|| {
        Refusal::new(
            codes::INVALID_PARAMETER,
            "the extraInfo holds no handle popgate issued (a message popped elsewhere?)",
        )
    })?;
    Ok(Settlement::of(id, Some(handout), Some(group)))
}

/// popgate's handle in a `POP_CK`, its ninth field: the delivery id as handed out, and the hand-out.
fn handle_in(extra_info: &str) -> Option<(&str, u32)> {
    let handle = extra_info.split(' ').nth(8)?.strip_prefix(HANDLE_PREFIX)?;
    let (id, handout) = handle.rsplit_once('.')?;
    let handout = handout.parse().ok()?;
    (!id.is_empty()).then_some((id, handout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handle_is_the_ninth_field_of_the_pop_ck_and_foreign_ones_are_refused() {
        let extra = "7 1796000000000 60000 0 0 broker-a 1 7 pgr:abc.3";
        assert_eq!(handle_in(extra), Some(("abc", 3)));
        for foreign in ["7 1796000000000 60000 0 0 broker-a 1 7", "7 1 2 0 0 b 1 7 pg2:abc.3", "7 1 2 0 0 b 1 7 pgr:.1"]
        {
            assert_eq!(handle_in(foreign), None, "{foreign}");
        }
    }

    #[test]
    fn a_pop_filter_is_read_as_the_broker_reads_it() {
        assert_eq!(filter_of(None, None), ("*".to_owned(), FilterType::Tag));
        assert_eq!(filter_of(Some("TAG"), Some(" * ")), ("*".to_owned(), FilterType::Tag));
        assert_eq!(filter_of(Some("TAG"), Some("a || b")), ("a || b".to_owned(), FilterType::Tag));
        assert_eq!(filter_of(Some("SQL92"), Some("n > 1")), ("n > 1".to_owned(), FilterType::Sql92));
    }

    #[test]
    fn hosts_parse_with_or_without_a_port() {
        assert_eq!(socket_addr("10.0.0.1:10911"), SocketAddr::from(([10, 0, 0, 1], 10911)));
        assert_eq!(socket_addr("10.0.0.1"), SocketAddr::from(([10, 0, 0, 1], 0)));
        assert_eq!(socket_addr(""), SocketAddr::from(([0, 0, 0, 0], 0)));
    }
}
