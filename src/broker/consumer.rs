//! The consume side of the broker connection: POP, ACK and ChangeInvisibleTime, with the receipt handle
//! (`POP_CK`) they revolve around.
//!
//! Facts from the broker's source that shape this (`PopMessageProcessor`, `AckMessageProcessor`,
//! `ChangeInvisibleTimeProcessor`, see ../shared/notes/rocketmq-pop.md):
//! - A popped message stays invisible for `invisible_time` from `pop_time`; after that the broker's revive
//!   service re-puts it to `%RETRY%` with `reconsumeTimes + 1`.
//! - ChangeInvisibleTime acks the old checkpoint and writes a new one: the answer's `popTime` makes a new
//!   handle, and the old one is dead. For a message popped orderly it only moves that message's
//!   next-visible time: `popTime` stays, and the answered invisible time counts from it.
//! - Orderly POP (`order=true`) locks each queue for the group until every message popped from it is ACKed or
//!   past its invisible time; then the same messages (same offsets) come again, never through `%RETRY%`, with
//!   the broker's count of attempts (`orderCountInfo`, read by the client crate into `reconsumeTimes`).
//! - ACK with a lapsed handle still answers SUCCESS, so ownership is judged from the handle's own deadline.
//! - A message that came back from the retry topic must be ACKed on that topic (the handle's retry marker).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cheetah_string::CheetahString;
use rocketmq_client_rust::{AckStatus, ClientInstanceHandle, PopStatus};
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_protocol::code::request_code::RequestCode;
use rocketmq_protocol::protocol::body::batch_ack_builder::{build_batch_ack_requests, BatchAckInput};
use rocketmq_protocol::protocol::body::batch_ack_message_request_body::BatchAckMessageRequestBody;
use rocketmq_protocol::protocol::header::ack_message_request_header::AckMessageRequestHeader;
use rocketmq_protocol::protocol::header::change_invisible_time_request_header::ChangeInvisibleTimeRequestHeader;
use rocketmq_protocol::protocol::header::extra_info_util::ExtraInfoUtil;
use rocketmq_protocol::protocol::header::pop_message_request_header::PopMessageRequestHeader;
use rocketmq_protocol::RemotingCommand;

use super::client::{BrokerClient, BrokerError, BrokerRoute};
use super::message::is_reserved_property;
use crate::clock::Epoch;

/// `ConsumeInitMode.MIN`: a group that never consumed a queue starts at its oldest message, so nothing
/// published before the first POP is skipped.
const INIT_MODE_MIN: i32 = 0;
/// Slack added to a POP's remoting timeout over its long-poll time.
const POP_TIMEOUT_SLACK_MS: u64 = 3_000;

/// The event as popped, ready for a subscriber.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoppedEvent {
    /// The client message id (`UNIQ_KEY`), or the broker's message id when the producer set none.
    pub id: String,
    /// The topic the event was published to (not the retry topic).
    pub topic: Arc<str>,
    /// RocketMQ tag, if any.
    pub tags: Option<String>,
    /// Message keys.
    pub keys: Vec<String>,
    /// User properties (RocketMQ's system properties are left out).
    pub properties: BTreeMap<String, String>,
    /// The payload.
    #[serde(with = "base64_bytes")]
    pub body: Vec<u8>,
    /// When the producer created the message (epoch ms).
    pub born_timestamp: i64,
    /// How often the broker already redelivered it (`reconsumeTimes`).
    pub reconsume_times: u32,
    /// The retry topic it came back from, if it did.
    pub retry_topic: Option<String>,
    /// The FIFO message group (`__SHARDINGKEY`), if the producer gave one.
    #[serde(default)]
    pub message_group: Option<String>,
    /// Where and how the broker stored it (empty in records written before popgate kept it).
    #[serde(default)]
    pub stored: StoredFacts,
}

/// What the broker says about a stored message beyond its content, as Apache's proxy reports it to a gRPC
/// consumer (`SystemProperties`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct StoredFacts {
    /// The producer's address: `__BORNHOST` when a proxy set it, else the born host's IP.
    pub born_host: String,
    /// The broker's `ip:port`.
    pub store_host: String,
    /// When the broker stored it (epoch ms).
    pub store_timestamp: i64,
    /// Its queue and offset there (the retry topic's, when it came back from there).
    pub queue_id: i32,
    /// See `queue_id`.
    pub queue_offset: i64,
    /// The system properties that say what kind of message it is and where it came from: `TRAN_MSG`,
    /// `DELAY`, `TIMER_DELIVER_MS`, `TIMER_DELAY_SEC`, `TRACE_CONTEXT` (only those present).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub system: BTreeMap<String, String>,
    /// Its offset in the broker's commit log (with `store_host`, the broker's message id).
    pub commit_log_offset: i64,
    /// The producer's flag (`Message.flag`).
    pub flag: i32,
}

/// The system properties kept in [`StoredFacts::system`].
const DESCRIBING_PROPERTIES: [&str; 5] = ["TRAN_MSG", "DELAY", "TIMER_DELIVER_MS", "TIMER_DELAY_SEC", "TRACE_CONTEXT"];

impl StoredFacts {
    fn of(message: &MessageExt) -> StoredFacts {
        let property = |name: &str| message.properties().get(&CheetahString::from(name)).map(ToString::to_string);
        StoredFacts {
            born_host: property("__BORNHOST")
                .filter(|h| !h.trim().is_empty())
                .unwrap_or_else(|| message.born_host().ip().to_string()),
            store_host: message.store_host().to_string(),
            store_timestamp: message.store_timestamp(),
            queue_id: message.queue_id(),
            queue_offset: message.queue_offset(),
            commit_log_offset: message.commit_log_offset(),
            flag: message.flag(),
            system: DESCRIBING_PROPERTIES
                .iter()
                .filter_map(|name| Some(((*name).to_owned(), property(name)?)))
                .collect(),
        }
    }
}

/// The broker's receipt handle for a popped message, and the lease it grants.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReceiptHandle {
    /// Broker that holds the checkpoint. (Names and addresses are `Arc<str>`: the delivery state shares one
    /// copy among all the deliveries that carry the same one.)
    pub broker_name: Arc<str>,
    /// Its address when popped.
    pub broker_addr: Arc<str>,
    /// The `POP_CK` extra info: what ACK and ChangeInvisibleTime must quote.
    pub extra_info: String,
    /// The topic to ACK on: the retry topic when the message came back from `%RETRY%`.
    pub ack_topic: Arc<str>,
    /// Queue of the message (in `ack_topic`).
    pub queue_id: i32,
    /// Offset of the message in that queue.
    pub queue_offset: i64,
    /// When the current checkpoint was taken (epoch ms, the broker's clock: informational only, never
    /// compared with popgate's).
    pub pop_time_ms: i64,
    /// How long the broker keeps the message invisible from `pop_time_ms`.
    pub invisible_ms: i64,
    /// Until when popgate holds the lease, on popgate's own clock ([`Epoch::now`]): the moment the POP (or
    /// the renewal) was *sent*, plus the invisible time it asked for. The broker starts the invisible time
    /// later than that (when it takes the request), so this ends no later than the broker's lease, whatever
    /// the two clocks say. 0 in records stored before popgate judged leases this way.
    #[serde(default)]
    pub lease_until_ms: Epoch,
}

impl ReceiptHandle {
    /// The instant (epoch ms, popgate's clock) after which the broker may hand the message to someone else.
    ///
    /// Judged on popgate's clock from when the request was sent, never from the broker's `popTime`: a broker
    /// clock 60 s behind popgate's would make every fresh lease look lapsed, and one ahead would keep
    /// accepting ACKs for messages the broker has already handed to someone else. A record stored before
    /// `lease_until_ms` existed falls back to the broker's figures.
    pub fn lease_deadline(&self) -> Epoch {
        if self.lease_until_ms > Epoch::ZERO {
            self.lease_until_ms
        } else {
            Epoch::from_millis(self.pop_time_ms.saturating_add(self.invisible_ms))
        }
    }

    /// Half of the invisible time this lease was granted: a held delivery's lease is renewed once less than
    /// this is left, which leaves the other half for renewals that fail and are retried.
    pub fn half_lease(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.invisible_ms / 2).unwrap_or(0))
    }
}

/// The end of a lease granted for `invisible_ms` by a request sent at `sent_at` (popgate's clock).
fn lease_until(sent_at: Epoch, invisible_ms: u64) -> Epoch {
    sent_at + Duration::from_millis(invisible_ms)
}

/// One message from a POP.
#[derive(Debug, Clone)]
pub struct Popped {
    /// The event.
    pub event: PoppedEvent,
    /// Its lease.
    pub handle: ReceiptHandle,
}

/// What one POP asks for.
#[derive(Debug, Clone)]
pub struct PopRequest<'a> {
    /// Consumer group.
    pub group: &'a str,
    /// Topic.
    pub topic: &'a str,
    /// The filter expression.
    pub filter: &'a str,
    /// Its kind: `TAG` or `SQL92` (RocketMQ's `ExpressionType`).
    pub filter_type: &'a str,
    /// At most this many messages (≤ 32).
    pub max: u32,
    /// Lease to take on each message.
    pub invisible_ms: u64,
    /// How long the broker may hold the request waiting for a message.
    pub poll_ms: u64,
    /// The broker's orderly POP: a queue's next messages are handed out only once the ones handed out
    /// before are ACKed (or their invisible time is over, and then those come again first).
    pub orderly: bool,
}

impl BrokerClient {
    /// POPs up to `request.max` messages from `broker`, across all its queues (retry queue included).
    /// "No message" is an empty list, not an error.
    ///
    /// # Errors
    /// [`BrokerError`] when the broker is unreachable or refuses (e.g. code 17, no such topic).
    pub async fn pop(
        &self,
        handle: &ClientInstanceHandle,
        broker: &BrokerRoute,
        request: &PopRequest<'_>,
    ) -> Result<Vec<Popped>, BrokerError> {
        let header = PopMessageRequestHeader {
            consumer_group: request.group.into(),
            topic: request.topic.into(),
            queue_id: -1,
            max_msg_nums: request.max,
            invisible_time: request.invisible_ms,
            poll_time: request.poll_ms,
            born_time: u64::try_from(Epoch::now().as_millis()).unwrap_or_default(),
            init_mode: INIT_MODE_MIN,
            exp_type: Some(request.filter_type.into()),
            exp: Some(request.filter.into()),
            order: Some(request.orderly),
            attempt_id: None,
            topic_request_header: None,
        };
        let timeout_ms = request.poll_ms + POP_TIMEOUT_SLACK_MS;
        // Read before the request leaves: the lease is judged from here (see `ReceiptHandle::lease_until_ms`).
        let sent_at = Epoch::now();
        let result = handle
            .pop_message(&broker.name.as_str().into(), &broker.addr.as_str().into(), header, timeout_ms)
            .await
            .map_err(|e| BrokerError::from_client(e, std::time::Duration::from_millis(timeout_ms)))?;
        if result.pop_status != PopStatus::Found {
            return Ok(Vec::new());
        }
        let messages = result.msg_found_list.unwrap_or_default();
        let usable: Vec<Popped> = messages.iter().filter_map(|m| popped(m, request, broker, sent_at)).collect();
        let unusable = messages.len() - usable.len();
        if unusable > 0 {
            // It cannot be ACKed or renewed without its receipt handle; the broker delivers it again once its
            // invisible time is over. Counted, never dropped in silence.
            metrics::counter!(crate::metrics::POPPED_UNUSABLE).increment(unusable as u64);
            tracing::warn!(unusable, broker = %broker.name, topic = request.topic, "Popped messages without a readable receipt handle (POP_CK); the broker will redeliver them.");
        }
        Ok(usable)
    }

    /// ACKs the message at the broker. A message the broker no longer has (`NotExist`) counts as done.
    ///
    /// # Errors
    /// [`BrokerError`] when the broker could not be asked.
    pub async fn ack(&self, group: &str, handle: &ReceiptHandle) -> Result<(), BrokerError> {
        let header = AckMessageRequestHeader {
            consumer_group: group.into(),
            topic: (&*handle.ack_topic).into(),
            queue_id: handle.queue_id,
            extra_info: handle.extra_info.as_str().into(),
            offset: handle.queue_offset,
            lite_topic: None,
            topic_request_header: None,
        };
        let timeout = self.request_timeout();
        metrics::counter!(crate::metrics::BROKER_ACK_REQUESTS, "kind" => "single").increment(1);
        let result = self
            .pooled()
            .await?
            .handle()
            .ack_message(&(&*handle.broker_addr).into(), header, timeout.as_millis() as u64)
            .await
            .map_err(|e| BrokerError::from_client(e, timeout))?;
        if result.status() == AckStatus::NotExist {
            tracing::debug!(broker = %handle.broker_name, offset = handle.queue_offset, "Broker no longer has the acked message.");
        }
        Ok(())
    }

    /// ACKs many messages with one `BATCH_ACK_MESSAGE` request per broker (Apache brokers 5.1.3 and later; the
    /// broker ACKs each checkpoint's offsets as a bit set). The answer, per entry in order:
    /// - `Ok(true)`: the broker took it;
    /// - `Ok(false)`: not ACKed by this call, ACK it alone: its handle could not be batched, or the broker
    ///   refused the batch (a broker older than 5.1.3 answers that the request code is not supported);
    /// - `Err`: the broker could not be asked.
    pub async fn ack_batch(&self, entries: &[AckEntry<'_>]) -> Vec<Result<bool, BrokerError>> {
        let inputs: Vec<BatchAckInput<'_>> = entries
            .iter()
            .enumerate()
            .map(|(entry_index, entry)| BatchAckInput {
                entry_index,
                consumer_group: entry.group,
                topic: entry.topic,
                receipt_handle: &entry.handle.extra_info,
            })
            .collect();
        let built = build_batch_ack_requests(&inputs);
        let mut answers: Vec<Result<bool, BrokerError>> = vec![Ok(false); entries.len()];
        let timeout = self.request_timeout();
        let calls = built.requests.into_iter().filter_map(|request| {
            // Every entry of a request names the same broker, so the first one's address is the request's.
            let addr = entries.get(*request.entry_indexes.first()?)?.handle.broker_addr.clone();
            Some(async move {
                metrics::counter!(crate::metrics::BROKER_ACK_REQUESTS, "kind" => "batch").increment(1);
                let command = RemotingCommand::new_request(RequestCode::BatchAckMessage, batch_ack_body(&request.body));
                let lease = match self.pooled().await {
                    Ok(lease) => lease,
                    Err(error) => return (request.entry_indexes, Err(error)),
                };
                let answer = lease
                    .handle()
                    .invoke_remoting(&(&*addr).into(), command, timeout.as_millis() as u64)
                    .await
                    .map(|response| {
                        let taken = response.code() == 0;
                        if !taken {
                            let remark = response.remark().map(ToString::to_string).unwrap_or_default();
                            tracing::debug!(code = response.code(), %remark, "Batch ACK refused by the broker.");
                        }
                        taken
                    })
                    .map_err(|e| BrokerError::from_client(e, timeout));
                (request.entry_indexes, answer)
            })
        });
        for (indexes, answer) in futures::future::join_all(calls).await {
            if answer.as_ref().is_ok_and(|taken| !taken) {
                tracing::debug!(broker = %entries[indexes[0]].handle.broker_name, "Batch ACK refused; ACKing one by one.");
            }
            for index in indexes {
                answers[index] = answer.clone();
            }
        }
        answers
    }

    /// Extends the lease: the broker takes a new checkpoint invisible for `invisible_ms` from now and the
    /// returned handle replaces the old one, which is dead from then on.
    ///
    /// # Errors
    /// [`BrokerError`] when the broker could not be asked or refused.
    pub async fn renew(
        &self,
        group: &str,
        handle: &ReceiptHandle,
        invisible_ms: u64,
    ) -> Result<ReceiptHandle, BrokerError> {
        let header = ChangeInvisibleTimeRequestHeader {
            consumer_group: group.into(),
            topic: (&*handle.ack_topic).into(),
            queue_id: handle.queue_id,
            extra_info: handle.extra_info.as_str().into(),
            offset: handle.queue_offset,
            invisible_time: i64::try_from(invisible_ms).unwrap_or(i64::MAX),
            lite_topic: None,
            suspend: false,
            topic_request_header: None,
        };
        let timeout = self.request_timeout();
        let sent_at = Epoch::now();
        let result = self
            .pooled()
            .await?
            .handle()
            .change_invisible_time(
                &(&*handle.broker_name).into(),
                &(&*handle.broker_addr).into(),
                header,
                timeout.as_millis() as u64,
            )
            .await
            .map_err(|e| BrokerError::from_client(e, timeout))?;
        if result.status() != AckStatus::Ok {
            return Err(BrokerError::Response { code: -1, detail: "change invisible time refused".to_owned() });
        }
        // The crate appends " <offset>" to the rebuilt extra info, as the POP_CK property has it. Its
        // invisible time is the broker's answer, which is what the lease is: for a normal message the new
        // checkpoint's (`popTime` is now), for an orderly one the time since the unchanged `popTime` (the
        // broker only moves that message's next-visible time).
        let extra_info = result.extra_info().to_string();
        let requested = i64::try_from(invisible_ms).unwrap_or(i64::MAX);
        let answered = ExtraInfoUtil::parse_ack_extra_info(&extra_info).map(|p| p.invisible_time).unwrap_or(requested);
        Ok(ReceiptHandle {
            extra_info,
            pop_time_ms: result.pop_time(),
            invisible_ms: answered,
            lease_until_ms: lease_until(sent_at, invisible_ms),
            ..handle.clone()
        })
    }
}

/// The `BATCH_ACK_MESSAGE` body as Apache's broker reads it (fastjson): each checkpoint's bit set of ACKed
/// offsets is a base64 string of its little-endian bytes, as Java's `BitSet.toByteArray()` gives. (The
/// crate's own encoding writes the bit set as a JSON array of numbers, which the broker refuses with
/// "Illegal base64 character", so popgate sends the request itself.)
fn batch_ack_body(body: &BatchAckMessageRequestBody) -> Vec<u8> {
    use base64::Engine;
    let acks: Vec<serde_json::Value> = body
        .acks
        .iter()
        .map(|ack| {
            let mut bytes: Vec<u8> = ack.bit_set.0.as_raw_slice().iter().flat_map(|word| word.to_le_bytes()).collect();
            while bytes.last() == Some(&0) {
                bytes.pop();
            }
            serde_json::json!({
                "c": ack.consumer_group.as_str(),
                "t": ack.topic.as_str(),
                "r": ack.retry.as_str(),
                "so": ack.start_offset,
                "q": ack.queue_id,
                "rq": ack.revive_queue_id,
                "pt": ack.pop_time,
                "it": ack.invisible_time,
                "b": base64::engine::general_purpose::STANDARD.encode(bytes),
            })
        })
        .collect();
    serde_json::json!({"brokerName": body.broker_name.as_str(), "acks": acks}).to_string().into_bytes()
}

/// One message of a batch ACK: the consumer group, the subscribed topic (not the retry topic: the handle says
/// which one it came from) and its receipt handle.
#[derive(Debug, Clone, Copy)]
pub struct AckEntry<'a> {
    /// Consumer group.
    pub group: &'a str,
    /// Subscribed topic.
    pub topic: &'a str,
    /// The message's receipt handle.
    pub handle: &'a ReceiptHandle,
}

/// Turns one popped message into an event and its handle; a message without a readable `POP_CK` is
/// skipped (it cannot be ACKed, so the broker will deliver it again).
fn popped(message: &MessageExt, request: &PopRequest<'_>, broker: &BrokerRoute, sent_at: Epoch) -> Option<Popped> {
    let property = |name: &str| message.properties().get(&CheetahString::from(name)).map(ToString::to_string);
    let extra_info = property("POP_CK")?;
    let parsed = ExtraInfoUtil::parse_ack_extra_info(&extra_info).ok()?;
    let ack_topic = ExtraInfoUtil::get_real_topic_with_retry(request.topic, request.group, parsed.retry).ok()?;
    let retry_topic = (ack_topic != request.topic).then(|| ack_topic.clone());
    let event = event_of(message, request.topic, retry_topic);
    let handle = ReceiptHandle {
        broker_name: parsed.broker_name.into(),
        broker_addr: broker.addr.as_str().into(),
        ack_topic: ack_topic.into(),
        queue_id: parsed.queue_id,
        queue_offset: parsed.queue_offset,
        pop_time_ms: parsed.pop_time,
        invisible_ms: parsed.invisible_time,
        // The shorter of what was asked and what the broker wrote into the handle.
        lease_until_ms: lease_until(
            sent_at,
            request.invisible_ms.min(u64::try_from(parsed.invisible_time).unwrap_or(0)),
        ),
        extra_info,
    };
    Some(Popped { event, handle })
}

/// A stored message as popgate keeps it (`topic` is the one it is consumed from; `retry_topic` the retry topic
/// it came back from, if it did).
pub(super) fn event_of(message: &MessageExt, topic: &str, retry_topic: Option<String>) -> PoppedEvent {
    let property = |name: &str| message.properties().get(&CheetahString::from(name)).map(ToString::to_string);
    PoppedEvent {
        id: property("UNIQ_KEY").unwrap_or_else(|| message.msg_id().to_string()),
        topic: topic.into(),
        tags: property("TAGS"),
        keys: property("KEYS")
            .map(|k| k.split(' ').filter(|s| !s.is_empty()).map(str::to_owned).collect())
            .unwrap_or_default(),
        properties: message
            .properties()
            .iter()
            .filter(|(k, _)| !is_reserved_property(k.as_str()))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        body: message.body().map(|b| b.to_vec()).unwrap_or_default(),
        born_timestamp: message.born_timestamp(),
        reconsume_times: u32::try_from(message.reconsume_times()).unwrap_or(0),
        retry_topic,
        message_group: property(super::message::PROPERTY_SHARDING_KEY),
        stored: StoredFacts::of(message),
    }
}

mod base64_bytes {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(deserializer)?;
        base64::engine::general_purpose::STANDARD.decode(text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(extra_info: String) -> ReceiptHandle {
        ReceiptHandle {
            broker_name: "broker-a".into(),
            broker_addr: "127.0.0.1:10911".into(),
            extra_info,
            ack_topic: "orders".into(),
            queue_id: 1,
            queue_offset: 0,
            pop_time_ms: 1_000,
            invisible_ms: 60_000,
            lease_until_ms: Epoch::from_millis(0),
        }
    }

    /// A message as the broker hands it out, its `POP_CK` taken at `broker_pop_time_ms` on the broker's clock.
    fn message_popped_at(broker_pop_time_ms: i64) -> MessageExt {
        let mut message = MessageExt::default();
        let extra_info =
            ExtraInfoUtil::build_extra_info_with_offset(5, broker_pop_time_ms, 60_000, 3, "orders", "broker-a", 1, 5);
        message.message.set_properties(std::collections::HashMap::from([(
            CheetahString::from("POP_CK"),
            CheetahString::from(extra_info),
        )]));
        message
    }

    #[test]
    fn a_lease_is_judged_on_popgates_clock_from_when_the_pop_was_sent_whatever_the_brokers_clock_says() {
        let request = PopRequest {
            group: "g",
            topic: "orders",
            filter: "*",
            filter_type: "TAG",
            max: 1,
            invisible_ms: 60_000,
            poll_ms: 0,
            orderly: false,
        };
        let broker =
            BrokerRoute { name: "broker-a".into(), addr: "127.0.0.1:10911".into(), write_queues: 1, read_queues: 1 };
        let sent_at = Epoch::now();
        // The broker's clock a minute behind popgate's, the same, and a minute ahead.
        for skew_ms in [-60_000, 0, 60_000] {
            let broker_pop_time = sent_at.as_millis() + skew_ms;
            let popped =
                popped(&message_popped_at(broker_pop_time), &request, &broker, sent_at).expect("a usable message");
            let lease = Duration::from_secs(60);
            assert_eq!(popped.handle.lease_deadline(), sent_at + lease, "broker clock off by {skew_ms} ms");
            assert_eq!(popped.handle.pop_time_ms, broker_pop_time, "the broker's own figure is kept apart");
        }
    }

    #[test]
    fn a_record_stored_before_local_leases_falls_back_to_the_brokers_figures() {
        let old = handle("0 1000 60000 3 0 broker-a 1 0".into());
        assert_eq!(old.lease_deadline(), Epoch::from_millis(61_000));
    }

    #[test]
    fn a_batch_ack_body_carries_each_checkpoint_bit_set_as_java_base64_bytes() {
        // Two messages of one checkpoint (offsets 5 and 14 of a checkpoint starting at 5): bits 0 and 9.
        let handles: Vec<ReceiptHandle> = [5, 14]
            .iter()
            .map(|offset| {
                handle(ExtraInfoUtil::build_extra_info_with_offset(
                    5, 1_000, 60_000, 3, "orders", "broker-a", 1, *offset,
                ))
            })
            .collect();
        let inputs: Vec<BatchAckInput<'_>> = handles
            .iter()
            .enumerate()
            .map(|(entry_index, h)| BatchAckInput {
                entry_index,
                consumer_group: "g",
                topic: "orders",
                receipt_handle: &h.extra_info,
            })
            .collect();
        let built = build_batch_ack_requests(&inputs);
        assert_eq!(built.requests.len(), 1, "one broker, one request");
        let body: serde_json::Value =
            serde_json::from_slice(&batch_ack_body(&built.requests[0].body)).expect("JSON body");
        assert_eq!(body["brokerName"], "broker-a");
        let acks = body["acks"].as_array().expect("acks");
        assert_eq!(acks.len(), 1, "one checkpoint");
        // Java's BitSet.toByteArray() of {0, 9}: [0x01, 0x02], as base64 (fastjson's byte[] form).
        assert_eq!(acks[0]["b"], "AQI=");
        assert_eq!(
            (acks[0]["so"].as_i64(), acks[0]["q"].as_i64(), acks[0]["rq"].as_i64()),
            (Some(5), Some(1), Some(3))
        );
        assert_eq!(
            (acks[0]["c"].as_str(), acks[0]["t"].as_str(), acks[0]["r"].as_str()),
            (Some("g"), Some("orders"), Some("0"))
        );
        assert_eq!((acks[0]["pt"].as_i64(), acks[0]["it"].as_i64()), (Some(1_000), Some(60_000)));
    }
}
