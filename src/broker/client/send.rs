//! Sending: one `SEND_MESSAGE` (or a remoting client's own batch) to the one queue popgate chose, once, and
//! the broker's verdict ([`SendReceipt`], [`StoreStatus`]). No retry and no broker choice here: those are the
//! publish path's.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use cheetah_string::CheetahString;
use rocketmq_model::common::message::message_client_id_setter::MessageClientIDSetter;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::common::sys_flag::message_sys_flag::MessageSysFlag;
use rocketmq_protocol::code::request_code::RequestCode;
use rocketmq_protocol::common::message::message_decoder::{
    decode_message_id, encode_message_into, message_properties_to_string,
};
use rocketmq_protocol::protocol::header::message_operation_header::send_message_request_header::SendMessageRequestHeader;
use rocketmq_protocol::protocol::header::message_operation_header::send_message_request_header_v2::SendMessageRequestHeaderV2;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;

use super::{BrokerClient, AUTO_CREATE_TOPIC_KEY, DEFAULT_TOPIC_QUEUE_NUMS};
use crate::broker::message::{ClientWire, OutgoingMessage, PROPERTY_SHARDING_KEY, PROPERTY_UNIQ_KEY};
use crate::broker::{BrokerError, BrokerRoute};
use crate::clock::Epoch;

/// The broker's answers to SEND_MESSAGE that mean "stored", by store status (`ResponseCode`).
const CODE_SUCCESS: i32 = 0;
const CODE_FLUSH_DISK_TIMEOUT: i32 = 10;
const CODE_SLAVE_NOT_AVAILABLE: i32 = 11;
const CODE_FLUSH_SLAVE_TIMEOUT: i32 = 12;

/// What the broker said about a stored message.
#[derive(Debug, Clone, PartialEq)]
pub struct SendReceipt {
    /// The client message id (`UNIQ_KEY`).
    pub message_id: String,
    /// The broker's store status (`SEND_OK`, `FLUSH_DISK_TIMEOUT`, …).
    pub status: StoreStatus,
    /// Broker name and queue that stored it.
    pub broker: String,
    /// Queue id within the broker.
    pub queue_id: i32,
    /// Offset within the queue (for a half message: within the broker's half topic).
    pub queue_offset: u64,
    /// Where the broker's commit log holds it (from the offset message id it answered), when it said.
    pub commit_log_offset: Option<i64>,
    /// The offset message id the broker answered (store host and commit-log offset), as a remoting client
    /// reads it (`SendResult.offsetMsgId`).
    pub offset_message_id: Option<String>,
    /// The transaction id the broker answered for a half message.
    pub transaction_id: Option<String>,
}

/// The broker's verdict on storing a message (RocketMQ's `SendStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreStatus {
    /// Stored (and flushed/replicated as the broker is configured).
    SendOk,
    /// Stored in memory, but the synchronous flush to disk timed out.
    FlushDiskTimeout,
    /// Stored on the master, but the synchronous replication to the slave timed out.
    FlushSlaveTimeout,
    /// Stored on the master, but no slave was available to replicate to.
    SlaveNotAvailable,
}

impl StoreStatus {
    /// The status a broker's answer to `SEND_MESSAGE` with response code `code` means; `None` for a refusal.
    pub fn of_response_code(code: i32) -> Option<StoreStatus> {
        match code {
            CODE_SUCCESS => Some(StoreStatus::SendOk),
            CODE_FLUSH_DISK_TIMEOUT => Some(StoreStatus::FlushDiskTimeout),
            CODE_FLUSH_SLAVE_TIMEOUT => Some(StoreStatus::FlushSlaveTimeout),
            CODE_SLAVE_NOT_AVAILABLE => Some(StoreStatus::SlaveNotAvailable),
            _ => None,
        }
    }

    /// The response code a broker answers a send stored this way with (the inverse of `of_response_code`).
    pub fn response_code(self) -> i32 {
        match self {
            StoreStatus::SendOk => CODE_SUCCESS,
            StoreStatus::FlushDiskTimeout => CODE_FLUSH_DISK_TIMEOUT,
            StoreStatus::FlushSlaveTimeout => CODE_FLUSH_SLAVE_TIMEOUT,
            StoreStatus::SlaveNotAvailable => CODE_SLAVE_NOT_AVAILABLE,
        }
    }

    /// RocketMQ's name for the status, as returned to HTTP clients.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreStatus::SendOk => "SEND_OK",
            StoreStatus::FlushDiskTimeout => "FLUSH_DISK_TIMEOUT",
            StoreStatus::FlushSlaveTimeout => "FLUSH_SLAVE_TIMEOUT",
            StoreStatus::SlaveNotAvailable => "SLAVE_NOT_AVAILABLE",
        }
    }
}

impl BrokerClient {
    /// Sends `message` to queue `queue_id` of `broker` (at `addr`), once, waiting at most `timeout` for the
    /// broker's answer. A non-OK store status is returned, not turned into an error: the caller's policy
    /// decides what it accepts.
    ///
    /// # Errors
    /// [`BrokerError`] classifying the failure.
    pub async fn send(
        &self,
        message: &OutgoingMessage,
        broker: &BrokerRoute,
        queue_id: i32,
        timeout: Duration,
    ) -> Result<SendReceipt, BrokerError> {
        let (request, message_id) = self.send_request(message, queue_id);
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        // A handle of its own: the send's time is the broker's, never a wait behind another request.
        let lease = self.pooled().await?;
        let response = tokio::time::timeout(
            // The crate enforces the timeout too; this outer bound only guards against a hang inside it.
            timeout + Duration::from_millis(500),
            lease.handle().invoke_remoting(&CheetahString::from(broker.addr.as_str()), request, timeout_ms),
        )
        .await
        .map_err(|_| BrokerError::Timeout(timeout))?
        .map_err(|e| BrokerError::from_client(e, timeout))?;
        let Some(status) = StoreStatus::of_response_code(response.code()) else {
            let detail = response.remark().map(ToString::to_string).unwrap_or_default();
            return Err(BrokerError::Response { code: response.code(), detail });
        };
        let field = |name: &str| response.ext_fields().and_then(|f| f.get(name)).map(ToString::to_string);
        Ok(SendReceipt {
            message_id,
            status,
            broker: broker.name.clone(),
            queue_id: field("queueId").and_then(|q| q.parse().ok()).unwrap_or(queue_id),
            queue_offset: field("queueOffset").and_then(|q| q.parse().ok()).unwrap_or_default(),
            commit_log_offset: field("msgId").and_then(|id| decode_message_id(&id).ok()).map(|id| id.offset),
            offset_message_id: field("msgId"),
            transaction_id: field("transactionId"),
        })
    }

    /// Sends `message` without waiting for the broker's verdict: the request is handed to a background task
    /// and its outcome is only logged (RocketMQ's oneway: no retry, no failure detection).
    pub fn send_oneway(self: &Arc<Self>, message: &OutgoingMessage, broker: &BrokerRoute, queue_id: i32) {
        let client = Arc::clone(self);
        let (message, broker) = (message.clone(), broker.clone());
        tokio::spawn(async move {
            if let Err(error) = client.send(&message, &broker, queue_id, client.config.request_timeout()).await {
                tracing::debug!(%error, broker = %broker.name, "Oneway send failed (not reported to the client).");
            }
        });
    }

    /// A `SEND_MESSAGE` request for `message`, and the client message id (`UNIQ_KEY`) it carries.
    fn send_request(&self, message: &OutgoingMessage, queue_id: i32) -> (RemotingCommand, String) {
        if let Some(wire) = &message.wire {
            return client_send_request(message, wire, queue_id);
        }
        let (message_id, properties) = sent_properties(message);
        // A half message names its producer group (the one its transaction is checked back with) in the header
        // too, and carries the prepared flag, as RocketMQ's transactional producer sends it.
        let half_group = message
            .properties
            .get(crate::broker::transaction::PROPERTY_TRANSACTION_PREPARED)
            .filter(|v| v.as_str() == "true")
            .and(message.properties.get(crate::broker::transaction::PROPERTY_PRODUCER_GROUP));
        let sys_flag = if half_group.is_some() { MessageSysFlag::TRANSACTION_PREPARED_TYPE } else { 0 };
        let header = SendMessageRequestHeader {
            producer_group: half_group.unwrap_or(&self.producer_group).as_str().into(),
            topic: message.topic.as_str().into(),
            default_topic: AUTO_CREATE_TOPIC_KEY.into(),
            default_topic_queue_nums: DEFAULT_TOPIC_QUEUE_NUMS,
            queue_id,
            sys_flag,
            born_timestamp: Epoch::now().as_millis(),
            flag: 0,
            properties: Some(message_properties_to_string(&properties)),
            reconsume_times: Some(0),
            unit_mode: Some(false),
            batch: Some(false),
            max_reconsume_times: None,
            topic_request_header: None,
        };
        let request =
            RemotingCommand::create_request_command(RequestCode::SendMessage, header).set_body(message.body.clone());
        (request, message_id)
    }
}

/// The id a message popgate made is sent with, and its properties as sent: the app's and popgate's, its id
/// (`UNIQ_KEY`), tag and keys, and `WAIT`. A message that must keep an id it already has (a DLQ replay)
/// carries it; all others get a new one.
fn sent_properties(message: &OutgoingMessage) -> (String, HashMap<CheetahString, CheetahString>) {
    let message_id =
        message.properties.get(PROPERTY_UNIQ_KEY).cloned().unwrap_or_else(MessageClientIDSetter::create_uniq_id);
    let mut properties = crate_properties(&message.properties);
    properties.insert("UNIQ_KEY".into(), message_id.as_str().into());
    properties.insert("WAIT".into(), "true".into());
    if let Some(tags) = &message.tags {
        properties.insert("TAGS".into(), tags.as_str().into());
    }
    if !message.keys.is_empty() {
        properties.insert("KEYS".into(), message.keys.join(" ").into());
    }
    (message_id, properties)
}

/// Messages popgate made, all of `messages[0]`'s topic, as one batch message: sent as one
/// `SEND_BATCH_MESSAGE` under `producer_group`, its body each message encoded as RocketMQ's `MessageBatch`
/// encodes it, with its own id, tag, keys and properties (as the Java client's `send(Collection)` makes a
/// batch). The broker appends a batch to one queue at once, the messages at consecutive offsets from the one it
/// answers, or stores none of it. The batch keeps the first message's message group, by which a publish places
/// it. Returns the batch and each message's id, in order; `None` for no messages.
pub fn batch_message(messages: &[OutgoingMessage], producer_group: &str) -> Option<(OutgoingMessage, Vec<String>)> {
    let first = messages.first()?;
    let mut body = bytes::BytesMut::new();
    let mut ids = Vec::with_capacity(messages.len());
    for message in messages {
        let (id, properties) = sent_properties(message);
        let mut encoded = Message::builder().topic(message.topic.as_str()).body(message.body.clone()).build_unchecked();
        encoded.set_properties(properties);
        encode_message_into(&encoded, &mut body);
        ids.push(id);
    }
    let mut batch = OutgoingMessage::new(first.topic.clone(), body.freeze());
    batch.properties.insert("WAIT".to_owned(), "true".to_owned());
    batch.properties.insert(PROPERTY_UNIQ_KEY.to_owned(), MessageClientIDSetter::create_uniq_id());
    if let Some(group) = first.properties.get(PROPERTY_SHARDING_KEY) {
        batch.properties.insert(PROPERTY_SHARDING_KEY.to_owned(), group.clone());
    }
    batch.wire = Some(ClientWire {
        producer_group: producer_group.to_owned(),
        born_timestamp: Epoch::now().as_millis(),
        reconsume_times: Some(0),
        unit_mode: Some(false),
        batch: true,
        ..ClientWire::default()
    });
    Some((batch, ids))
}

/// A remoting client's message, sent as the client sent it but to `queue_id`: its header fields, its
/// properties as they are (no `WAIT` or id added), a batch as one `SEND_BATCH_MESSAGE`. The id is the client's
/// `UNIQ_KEY` (empty for a batch, whose messages carry their own).
fn client_send_request(message: &OutgoingMessage, wire: &ClientWire, queue_id: i32) -> (RemotingCommand, String) {
    let message_id = message.properties.get(PROPERTY_UNIQ_KEY).cloned().unwrap_or_default();
    let properties = crate_properties(&message.properties);
    let header = SendMessageRequestHeader {
        producer_group: wire.producer_group.as_str().into(),
        topic: message.topic.as_str().into(),
        default_topic: AUTO_CREATE_TOPIC_KEY.into(),
        default_topic_queue_nums: DEFAULT_TOPIC_QUEUE_NUMS,
        queue_id,
        sys_flag: wire.sys_flag,
        born_timestamp: wire.born_timestamp,
        flag: wire.flag,
        properties: Some(message_properties_to_string(&properties)),
        reconsume_times: wire.reconsume_times,
        unit_mode: wire.unit_mode,
        batch: Some(wire.batch),
        max_reconsume_times: wire.max_reconsume_times,
        topic_request_header: None,
    };
    let request = if wire.batch {
        // The broker reads a batch's header only in the short-named V2 form.
        let header = SendMessageRequestHeaderV2::create_send_message_request_header_v2_with_move(header);
        RemotingCommand::create_request_command(RequestCode::SendBatchMessage, header)
    } else {
        RemotingCommand::create_request_command(RequestCode::SendMessage, header)
    };
    (request.set_body(message.body.clone()), message_id)
}

fn crate_properties(properties: &std::collections::BTreeMap<String, String>) -> HashMap<CheetahString, CheetahString> {
    properties.iter().map(|(k, v)| (CheetahString::from(k.as_str()), CheetahString::from(v.as_str()))).collect()
}
