//! Producers' sends (`SEND_MESSAGE`, `SEND_MESSAGE_V2`, `SEND_BATCH_MESSAGE`), through popgate's publish path.
//!
//! The message goes to the broker as the client made it (header fields, properties, a compressed body, a
//! batch: see `broker::message::ClientWire`), to the queue the client chose: the client's own producer policy
//! chose it from the route popgate gave (round-robin, or a `MessageQueueSelector` for ordered sends), and its
//! retry after a failure goes to another broker, as straight at the cluster. What popgate adds on every send
//! is its own: the reliability profile's store-status rule, de-duplication of a client's retry by the
//! message's id (`UNIQ_KEY`; a batch by its content), fault accounting, metrics and auth.
//!
//! A transactional producer's half message is sent under popgate's transactional group and recorded as the
//! other fronts' are (see `transaction`), so its `END_TRANSACTION` ends it from popgate's record, after a
//! popgate restart too, and the broker's check-backs come to popgate, which asks a live producer of the
//! client's group (`super::transaction`).
//!
//! A client before 4.9.5 does not name the broker in its send; popgate then uses the one broker of the topic
//! with that queue, or, when several have it, places the message by its own policy.

use std::collections::BTreeMap;
use std::time::Instant;

use rocketmq_model::common::sys_flag::message_sys_flag::MessageSysFlag;
use rocketmq_protocol::code::request_code::RequestCode;
use rocketmq_protocol::common::message::message_decoder::string_to_message_properties;
use rocketmq_protocol::protocol::header::message_operation_header::send_message_request_header::{
    parse_request_header, SendMessageRequestHeader,
};
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use sha2::Digest;

use super::codes;
use super::connection::Connection;
use super::service::{Front, Refusal};
use crate::auth::Caller;
use crate::gateway::below::{
    is_reserved_property, ClientWire, SendReceipt, PROPERTY_PRODUCER_GROUP, PROPERTY_REMOTING_GROUP,
    PROPERTY_TRANSACTION_PREPARED, PROPERTY_UNIQ_KEY,
};
use crate::gateway::{self, GatewayError, PublishRefused, PublishRequest};
use crate::publish::limits::POPGATE_PROPERTY_PREFIX;
use crate::publish::{OutgoingMessage, Placement, SendMode};

pub(super) async fn send_message(
    front: &Front,
    connection: &Connection,
    caller: &Caller,
    request: RemotingCommand,
) -> RemotingCommand {
    let received_at = Instant::now();
    let publish = match decode(front, &request, received_at).await {
        Ok(publish) => publish,
        Err(refused) => {
            gateway::count_refused_publish("remoting", PublishRefused::BadRequest, received_at);
            return refused.answer();
        }
    };
    let transactional = publish.half;
    match front.publishing().publish(caller, publish).await {
        Ok(published) => match published.receipt {
            Some(receipt) => {
                if transactional {
                    front.clients.sent_half(&receipt.message_id, connection, caller);
                }
                stored(&receipt)
            }
            None => RemotingCommand::create_success_response_command(),
        },
        Err(failed) => {
            if matches!(failed, GatewayError::OneWayUnconfirmed) {
                // A one-way send has no answer: the app never hears of it; the log and the metric say it.
                tracing::warn!("A one-way send was refused: the financial profile takes only confirmed sends.");
            }
            Refusal::from(failed).answer()
        }
    }
}

/// The publish a send asks for, or the answer refusing it (`MESSAGE_ILLEGAL`, mostly).
async fn decode(front: &Front, request: &RemotingCommand, received_at: Instant) -> Result<PublishRequest, Refusal> {
    let header = parse_request_header(request, RequestCode::from(request.code()))
        .map_err(|why| Refusal::new(codes::MESSAGE_ILLEGAL, format!("the send's header does not decode: {why}")))?;
    let message = to_outgoing(&header, request)?;
    let transactional = is_half(&header, &message);
    let publish = &front.config.publish;
    let mut message = publish
        .limits
        .admit_client_made(message)
        .map_err(|broken| Refusal::new(codes::MESSAGE_ILLEGAL, broken.message))?;
    if transactional {
        message.amend(|message| as_popgates_half(message, front.transactions.producer_group()));
    }
    let placement = placement(front, &header).await;
    let mode = if request.is_oneway_rpc() { SendMode::Oneway } else { SendMode::Sync };
    // A half message is never taken for a retry of an earlier send: the same message sent again in a new
    // transaction is a new transaction, whose end must find its own record. A client's retry of a half message
    // that did land leaves an orphan the broker checks back, as straight at the cluster.
    let retry_key = if transactional { None } else { dedup_key(message.message()) };
    Ok(PublishRequest { message, placement, mode, deadline: None, retry_key, half: transactional, received_at })
}

/// The message to publish, or the answer refusing it.
fn to_outgoing(header: &SendMessageRequestHeader, request: &RemotingCommand) -> Result<OutgoingMessage, Refusal> {
    let properties: BTreeMap<String, String> = string_to_message_properties(header.properties.as_ref())
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if let Some(name) = properties.keys().find(|k| k.starts_with(POPGATE_PROPERTY_PREFIX) && is_reserved_property(k)) {
        return Err(Refusal::new(
            codes::MESSAGE_ILLEGAL,
            format!("the message property {name} is reserved by popgate"),
        ));
    }
    let body = request.body().cloned().unwrap_or_default();
    let mut message = OutgoingMessage::new(header.topic.to_string(), body);
    message.properties = properties;
    message.wire = Some(ClientWire {
        producer_group: header.producer_group.to_string(),
        sys_flag: header.sys_flag,
        flag: header.flag,
        born_timestamp: header.born_timestamp,
        reconsume_times: header.reconsume_times,
        max_reconsume_times: header.max_reconsume_times,
        batch: header.batch.unwrap_or(false) || request.code() == codes::SEND_BATCH_MESSAGE,
        unit_mode: header.unit_mode,
    });
    Ok(message)
}

/// Whether the client sent a transactional half message (`TransactionMQProducer`): as the broker tells, by the
/// header's flag or by `TRAN_MSG` read as Java's `Boolean.parseBoolean` reads it (`TRUE` and `True` too), so
/// popgate never sends as a plain message what the broker stores as a half one.
fn is_half(header: &SendMessageRequestHeader, message: &OutgoingMessage) -> bool {
    header.sys_flag & MessageSysFlag::TRANSACTION_PREPARED_TYPE != 0
        || message.properties.get(PROPERTY_TRANSACTION_PREPARED).is_some_and(|v| v.eq_ignore_ascii_case("true"))
}

/// A client's half message as popgate sends it: under popgate's transactional group (`PGROUP` and the
/// header's), so the broker checks it back with popgate, which asks a live producer of the client's group
/// (kept in popgate's property) and ends it with popgate's durable record.
fn as_popgates_half(message: &mut OutgoingMessage, popgate_group: &str) {
    let client_group = message
        .properties
        .get(PROPERTY_PRODUCER_GROUP)
        .cloned()
        .or_else(|| message.wire.as_ref().map(|w| w.producer_group.clone()))
        .unwrap_or_default();
    message.properties.insert(PROPERTY_REMOTING_GROUP.to_owned(), client_group);
    message.properties.insert(PROPERTY_PRODUCER_GROUP.to_owned(), popgate_group.to_owned());
    if let Some(wire) = message.wire.as_mut() {
        wire.producer_group = popgate_group.to_owned();
    }
}

/// The client's queue, at the broker it names; for a client that names none, at the only broker of the topic
/// with that queue, else wherever popgate's policy puts it.
async fn placement(front: &Front, header: &SendMessageRequestHeader) -> Placement {
    let named = header.topic_request_header.as_ref().and_then(|t| t.get_broker_name()).map(|b| b.to_string());
    if let Some(broker) = named {
        return Placement::Queue { broker, queue_id: header.queue_id };
    }
    let route = front.publisher.existing_topic(header.topic.as_str()).await.ok().flatten();
    let queue_id = u32::try_from(header.queue_id).unwrap_or(u32::MAX);
    let owners: Vec<&str> = route
        .iter()
        .flat_map(|r| r.brokers.iter())
        .filter(|b| queue_id < b.write_queues)
        .map(|b| b.name.as_str())
        .collect();
    match owners.as_slice() {
        [only] => Placement::Queue { broker: (*only).to_owned(), queue_id: header.queue_id },
        _ => Placement::Policy,
    }
}

/// What a retry of this send is known by: the message's id; a batch (whose messages carry theirs inside the
/// body) by its content, which a retry repeats byte for byte.
fn dedup_key(message: &OutgoingMessage) -> Option<String> {
    if message.wire.as_ref().is_some_and(|w| w.batch) {
        return Some(format!("batch:{}", hex::encode(sha2::Sha256::digest(&message.body))));
    }
    message.properties.get(PROPERTY_UNIQ_KEY).cloned()
}

/// The broker's answer to a stored message, as the client reads it (`SendMessageResponseHeader`).
fn stored(receipt: &SendReceipt) -> RemotingCommand {
    let mut answer = RemotingCommand::create_response_command_with_code(receipt.status.response_code());
    answer.add_ext_field("msgId", receipt.offset_message_id.clone().unwrap_or_else(|| receipt.message_id.clone()));
    answer.add_ext_field("queueId", receipt.queue_id.to_string());
    answer.add_ext_field("queueOffset", receipt.queue_offset.to_string());
    if let Some(transaction_id) = &receipt.transaction_id {
        answer.add_ext_field("transactionId", transaction_id.as_str());
    }
    // What the broker adds to every send answer; the client reads the region and whether tracing is on.
    answer.add_ext_field("MSG_REGION", "DefaultRegion");
    answer.add_ext_field("TRACE_ON", "true");
    answer
}
