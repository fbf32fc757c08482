//! The broker's side of transactional messages (RocketMQ's half messages). A half message is an ordinary
//! `SEND_MESSAGE` with `TRAN_MSG=true` and the producer group in `PGROUP` (see [`super::message`]); the broker
//! keeps it in its half topic until `END_TRANSACTION` commits it (the real message is written then) or rolls
//! it back. Requests used here:
//! - `END_TRANSACTION` (37), sent two-way (Apache's proxy sends it oneway), so popgate knows it landed;
//! - `QUERY_MESSAGE` (12) by unique key, to tell whether a commit whose answer was lost already landed
//!   (the broker commits a half message again if asked again);
//! - `GET_TOPIC_CONFIG` (351), for the topic's `message.type` attribute;
//! - `HEART_BEAT` (34) as a producer of popgate's transactional group, sent by a `TransactionMQProducer` of the
//!   client crate, so the brokers send their `CHECK_TRANSACTION_STATE` (39) check-backs to popgate.

use std::collections::HashSet;

use cheetah_string::CheetahString;
use rocketmq_client_rust::{
    client_config_for_managed_domain, ClientInstanceHandle, LocalTransactionState, TransactionListener,
    TransactionMQProducer,
};
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::MessageConst;
use rocketmq_model::common::message::MessageTrait;
use rocketmq_model::common::mix_all::UNIQUE_MSG_QUERY_FLAG;
use rocketmq_model::common::sys_flag::message_sys_flag::MessageSysFlag;
use rocketmq_protocol::code::request_code::RequestCode;
use rocketmq_protocol::protocol::header::end_transaction_request_header::EndTransactionRequestHeader;
use rocketmq_protocol::protocol::header::get_topic_config_request_header::GetTopicConfigRequestHeader;
use rocketmq_protocol::protocol::header::query_message_request_header::QueryMessageRequestHeader;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::client::{BrokerClient, BrokerError};
use super::consumer::PoppedEvent;

/// The property that makes a send a half message.
pub const PROPERTY_TRANSACTION_PREPARED: &str = "TRAN_MSG";
/// The property naming the producer group the broker checks a half message back with.
pub const PROPERTY_PRODUCER_GROUP: &str = "PGROUP";
/// popgate's property naming the HTTP checker a half message's check-backs go to (`transactions.checkers`).
/// It travels in the message, so any popgate the broker asks can find the checker; it is reserved, so
/// consumers through popgate never see it.
pub const PROPERTY_HTTP_CHECKER: &str = "__POPGATE_TX_CHECKER";
/// popgate's property naming, in a half message a remoting producer sent, that producer's own group: popgate
/// sends the half message under its own transactional group (the broker checks back with popgate), and asks
/// a live producer of this group when the broker does. Reserved like the one above.
pub const PROPERTY_REMOTING_GROUP: &str = "__POPGATE_TX_REMOTING_GROUP";
/// The topic attribute that says which message types a topic takes (`mqadmin updateTopic -a +message.type=…`).
const MESSAGE_TYPE_ATTRIBUTE: &str = "message.type";

/// `ResponseCode.QUERY_NOT_FOUND`.
const QUERY_NOT_FOUND: i32 = 22;
/// `ResponseCode.TOPIC_NOT_EXIST`.
const TOPIC_NOT_EXIST: i32 = 17;
/// How long before its half message's send a committed message is looked for: the broker's index has whole
/// seconds, and its clock is not popgate's.
const LOOKUP_MARGIN_MS: i64 = 10 * 60 * 1000;

/// How a transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Resolution {
    /// The half message becomes a real message.
    Commit,
    /// The half message is dropped.
    Rollback,
}

impl Resolution {
    /// `commitOrRollback` of `END_TRANSACTION`.
    fn flag(self) -> i32 {
        match self {
            Resolution::Commit => MessageSysFlag::TRANSACTION_COMMIT_TYPE,
            Resolution::Rollback => MessageSysFlag::TRANSACTION_ROLLBACK_TYPE,
        }
    }

    /// Lower-case, for metrics and answers.
    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::Commit => "commit",
            Resolution::Rollback => "rollback",
        }
    }
}

/// Where a half message is, as `END_TRANSACTION` names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HalfMessage {
    /// The real topic.
    pub topic: String,
    /// The producer group the half message carries (`PGROUP`).
    pub producer_group: String,
    /// The message's unique id (`UNIQ_KEY`), which is also its transaction id.
    pub message_id: String,
    /// The broker that holds it.
    pub broker_name: String,
    /// That broker's master address.
    pub broker_addr: String,
    /// Its offset in the broker's half topic queue.
    pub tran_state_table_offset: i64,
    /// Its offset in the broker's commit log.
    pub commit_log_offset: i64,
}

/// Makes `message` a half message of `producer_group` (set after the limits, which refuse these properties
/// from apps). Its check-backs go to the HTTP checker `http_checker` when one is named.
pub fn mark_half(message: &mut super::OutgoingMessage, producer_group: &str, http_checker: Option<&str>) {
    let properties = &mut message.properties;
    properties.insert(PROPERTY_TRANSACTION_PREPARED.to_owned(), "true".to_owned());
    properties.insert(PROPERTY_PRODUCER_GROUP.to_owned(), producer_group.to_owned());
    if let Some(checker) = http_checker {
        properties.insert(PROPERTY_HTTP_CHECKER.to_owned(), checker.to_owned());
    }
}

impl BrokerClient {
    /// Ends the transaction of `half`: `END_TRANSACTION` to its broker, waiting for the broker's answer.
    /// `from_check` says it answers the broker's check-back.
    ///
    /// # Errors
    /// [`BrokerError`] when the broker could not be asked (the resolution may or may not have landed when it
    /// timed out) or refused (`Response`, e.g. the half message is gone).
    pub async fn end_transaction(
        &self,
        half: &HalfMessage,
        resolution: Resolution,
        from_check: bool,
    ) -> Result<(), BrokerError> {
        let header = EndTransactionRequestHeader {
            topic: half.topic.as_str().into(),
            producer_group: half.producer_group.as_str().into(),
            tran_state_table_offset: half.tran_state_table_offset,
            commit_log_offset: half.commit_log_offset,
            commit_or_rollback: resolution.flag(),
            from_transaction_check: from_check,
            msg_id: half.message_id.as_str().into(),
            transaction_id: Some(half.message_id.as_str().into()),
            rpc_request_header: Default::default(),
        };
        let request = RemotingCommand::create_request_command(RequestCode::EndTransaction, header)
            .set_remark(CheetahString::from_static_str("end transaction from popgate"));
        self.admin_request(&half.broker_addr, request).await.map(|_| ())
    }

    /// Whether the committed message of `half` is in its topic at its broker (looked up by its unique key,
    /// stored since `since_ms`): a commit that timed out may have landed, and asking the broker to commit
    /// again would store the message twice.
    ///
    /// # Errors
    /// [`BrokerError`] when the broker could not be asked.
    pub async fn committed_message_exists(&self, half: &HalfMessage, since_ms: i64) -> Result<bool, BrokerError> {
        let header = QueryMessageRequestHeader {
            topic: half.topic.as_str().into(),
            key: half.message_id.as_str().into(),
            max_num: 1,
            // The broker's index keeps store times in whole seconds from its file's start (`IndexFile`), and its
            // clock is not popgate's: a message stored just after `since_ms` can read as stored before it. The
            // unique key finds the message; the time only narrows the files searched.
            begin_timestamp: since_ms.saturating_sub(LOOKUP_MARGIN_MS),
            end_timestamp: i64::MAX,
            index_type: Some(CheetahString::from_static_str(MessageConst::INDEX_UNIQUE_TYPE)),
            last_key: None,
            topic_request_header: None,
        };
        let mut request = RemotingCommand::create_request_command(RequestCode::QueryMessage, header);
        request.add_ext_field(UNIQUE_MSG_QUERY_FLAG, "true");
        match self.admin_request(&half.broker_addr, request).await {
            Ok(body) => Ok(!body.is_empty()),
            Err(BrokerError::Response { code: QUERY_NOT_FOUND, .. }) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// The `message.type` attribute of `topic` as the first of `broker_addrs` to answer has it (`NORMAL`,
    /// `FIFO`, `DELAY`, `TRANSACTION`, `MIXED`); `None` when the topic has no such attribute (it is then
    /// `NORMAL` to RocketMQ) or no broker has the topic. The brokers are asked at once, so a stopped one
    /// does not hold the answer up while another answers.
    ///
    /// # Errors
    /// [`BrokerError`] when no broker answered.
    pub async fn topic_message_type(&self, topic: &str, broker_addrs: &[&str]) -> Result<Option<String>, BrokerError> {
        let asks = broker_addrs.iter().map(|addr| {
            let header = GetTopicConfigRequestHeader { topic: topic.into(), topic_request_header: None };
            let request = RemotingCommand::create_request_command(RequestCode::GetTopicConfig, header);
            Box::pin(async move {
                match self.admin_request(addr, request).await {
                    Ok(body) => Ok(message_type_of(&body)),
                    Err(BrokerError::Response { code: TOPIC_NOT_EXIST, .. }) => Ok(None),
                    Err(error) => Err(error),
                }
            })
        });
        let asks: Vec<_> = asks.collect();
        if asks.is_empty() {
            return Ok(None);
        }
        futures::future::select_ok(asks).await.map(|(kind, _)| kind)
    }
}

/// The `message.type` attribute in a `TopicConfigAndQueueMapping` body (the attributes are kept with or without
/// the `+` of `mqadmin`'s syntax, depending on how the topic was made).
fn message_type_of(body: &[u8]) -> Option<String> {
    let config: serde_json::Value = serde_json::from_slice(body).ok()?;
    let attributes = config.get("attributes")?.as_object()?;
    [MESSAGE_TYPE_ATTRIBUTE.to_owned(), format!("+{MESSAGE_TYPE_ATTRIBUTE}")]
        .iter()
        .find_map(|key| attributes.get(key)?.as_str())
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_type_is_read_from_the_topics_attributes() {
        let typed = br#"{"topicName":"t","attributes":{"+message.type":"TRANSACTION"}}"#;
        assert_eq!(message_type_of(typed).as_deref(), Some("TRANSACTION"));
        let plain = br#"{"topicName":"t","attributes":{"message.type":"FIFO"}}"#;
        assert_eq!(message_type_of(plain).as_deref(), Some("FIFO"));
        assert_eq!(message_type_of(br#"{"topicName":"t","attributes":{}}"#), None);
        assert_eq!(message_type_of(b"not json"), None);
    }

    #[test]
    fn a_remoting_producer_is_asked_with_the_half_message_as_sent_and_its_size_counted_anew() {
        let mut stored = MessageExt::default();
        stored.set_topic(CheetahString::from("orders"));
        stored.set_body(bytes::Bytes::from_static(b"half"));
        stored.put_property(CheetahString::from(PROPERTY_REMOTING_GROUP), CheetahString::from("a-long-group-name"));
        stored.put_property(CheetahString::from(PROPERTY_HTTP_CHECKER), CheetahString::from("https://checker"));
        // As the broker stored it: with popgate's properties, longer than what the producer is sent.
        let mut as_stored =
            rocketmq_protocol::common::message::message_decoder::encode(&stored, false).expect("encodes");
        stored.set_store_size(i32::try_from(as_stored.len()).expect("small"));
        assert!(rocketmq_protocol::common::message::message_decoder::decode(
            &mut as_stored,
            true,
            true,
            false,
            false,
            false
        )
        .is_some());

        let check = remoting_check(&stored, "app-producers".to_owned()).expect("a check");
        let mut encoded = check.encoded.clone();
        let sent =
            rocketmq_protocol::common::message::message_decoder::decode(&mut encoded, true, true, true, false, false)
                .expect("the producer's client decodes it");
        let property = |name: &str| sent.get_property(&CheetahString::from(name)).map(|v| v.to_string());
        assert_eq!(property(PROPERTY_PRODUCER_GROUP).as_deref(), Some("app-producers"));
        assert_eq!(property(PROPERTY_REMOTING_GROUP), None, "popgate's own properties are not sent");
        assert_eq!(property(PROPERTY_HTTP_CHECKER), None);
        assert_eq!(sent.body().as_deref(), Some(&b"half"[..]));
    }
}

// === the brokers' check-backs ===

/// A broker asking whether the transaction of a half message committed (`CHECK_TRANSACTION_STATE`). The
/// broker stores the half message again before every check, so `half` has the offsets an answer must name.
#[derive(Debug, Clone)]
pub struct OrphanCheck {
    /// Where the half message is now. `broker_name` is empty: the broker names only its address.
    pub half: HalfMessage,
    /// The message, as a consumer of its topic would see it.
    pub event: PoppedEvent,
    /// The HTTP checker its producer named, if any ([`PROPERTY_HTTP_CHECKER`]).
    pub http_checker: Option<String>,
    /// What a remoting producer is asked, when one sent it ([`PROPERTY_REMOTING_GROUP`]).
    pub remoting: Option<RemotingCheck>,
}

/// A check-back as a remoting producer is asked it (`CHECK_TRANSACTION_STATE`): its header fields, and the
/// half message as the broker would have sent it to that producer.
#[derive(Debug, Clone)]
pub struct RemotingCheck {
    /// The producer's own group: who is asked.
    pub producer_group: String,
    /// The half message, encoded as a broker sends it, with the producer's group as its `PGROUP` (the
    /// client picks the producer to ask by it) and without popgate's own properties.
    pub encoded: bytes::Bytes,
    /// The broker's message id of the half message as stored now.
    pub offset_message_id: String,
    /// Its offset in the broker's half topic now.
    pub tran_state_table_offset: i64,
    /// Its commit-log offset now.
    pub commit_log_offset: i64,
}

/// The remoting producer's check of `message`, when a remoting producer (of the group in `group`) sent it.
fn remoting_check(message: &MessageExt, group: String) -> Option<RemotingCheck> {
    let mut as_sent = message.clone();
    as_sent.put_property(CheetahString::from(PROPERTY_PRODUCER_GROUP), CheetahString::from(group.as_str()));
    as_sent.clear_property(PROPERTY_REMOTING_GROUP);
    as_sent.clear_property(PROPERTY_HTTP_CHECKER);
    // `encode` writes a non-zero store size as the frame's total size: the broker's, counted before the
    // properties above changed. Zero makes it count what it writes; the Rust client refuses a frame whose total
    // is more than its bytes (the Java client reads past it).
    as_sent.set_store_size(0);
    let encoded = match rocketmq_protocol::common::message::message_decoder::encode(&as_sent, false) {
        Ok(encoded) => encoded,
        Err(error) => {
            tracing::warn!(%error, "A half message could not be encoded for its remoting producer's check.");
            return None;
        }
    };
    Some(RemotingCheck {
        producer_group: group,
        encoded,
        offset_message_id: message.msg_id().to_string(),
        tran_state_table_offset: message.queue_offset(),
        commit_log_offset: message.commit_log_offset(),
    })
}

/// Most check-backs waiting to be handled; more are dropped (the broker asks again at its next pass).
const CHECK_BACKLOG: usize = 10_000;
/// The client instance that registers popgate as a producer of its transactional group. A producer of its
/// own, so the broker's check-backs arrive on its connections and go to its listener. The process id makes
/// its client id (`ip@instance`) its own: two popgates on one host are two producers to the broker.
fn check_instance() -> String {
    format!("popgate-transaction-{}", std::process::id())
}

/// popgate registered at the brokers as a producer of its transactional group: they send their check-backs
/// here. Keep it for as long as check-backs should come.
pub struct CheckBacks {
    producer: tokio::sync::Mutex<TransactionMQProducer>,
    instance: ClientInstanceHandle,
    watched: parking_lot::Mutex<HashSet<String>>,
}

impl CheckBacks {
    /// Makes the brokers of `topic` know popgate as a producer of the group: the producer heartbeats only to
    /// the brokers its instance has a route to. Once per topic; the instance refreshes its routes itself after.
    pub async fn watch_topic(&self, topic: &str) {
        if !self.watched.lock().insert(topic.to_owned()) {
            return;
        }
        if !self.instance.refresh_topic_route(&CheetahString::from(topic)).await {
            tracing::warn!(topic, "Could not read the route of a transactional topic; its check-backs may not come.");
            self.watched.lock().remove(topic);
        }
    }

    /// Stops the producer (its heartbeats stop; the brokers forget it after 2 minutes).
    pub async fn shutdown(&self) {
        self.producer.lock().await.shutdown().await;
    }
}

/// The crate's transaction listener: a check-back goes to popgate's channel, and the crate is told "not
/// known yet" (it then sends the broker a "not decided" that the broker ignores). popgate answers later with
/// its own `END_TRANSACTION`.
struct ForwardChecks(mpsc::Sender<OrphanCheck>);

impl TransactionListener for ForwardChecks {
    fn execute_local_transaction(
        &self,
        _message: &dyn MessageTrait,
        _arg: Option<&(dyn std::any::Any + Send + Sync)>,
    ) -> LocalTransactionState {
        // popgate sends its half messages itself, never through this producer.
        LocalTransactionState::Unknown
    }

    fn check_local_transaction(&self, message: &MessageExt) -> LocalTransactionState {
        let property = |name: &str| message.properties().get(&CheetahString::from(name)).map(ToString::to_string);
        let topic = message.topic().to_string();
        let half = HalfMessage {
            topic: topic.clone(),
            producer_group: property(PROPERTY_PRODUCER_GROUP).unwrap_or_default(),
            message_id: property("UNIQ_KEY").unwrap_or_else(|| message.msg_id().to_string()),
            broker_name: String::new(),
            broker_addr: message.store_host().to_string(),
            tran_state_table_offset: message.queue_offset(),
            commit_log_offset: message.commit_log_offset(),
        };
        let check = OrphanCheck {
            half,
            event: super::consumer::event_of(message, &topic, None),
            http_checker: property(PROPERTY_HTTP_CHECKER),
            remoting: property(PROPERTY_REMOTING_GROUP).and_then(|group| remoting_check(message, group)),
        };
        if self.0.try_send(check).is_err() {
            tracing::warn!("Too many transaction check-backs waiting; the broker will ask again.");
        }
        LocalTransactionState::Unknown
    }
}

impl BrokerClient {
    /// Registers popgate at the brokers as a producer of `producer_group` and returns the check-backs they
    /// send for its half messages. Call [`CheckBacks::watch_topic`] for every topic half messages go to.
    ///
    /// # Errors
    /// [`BrokerError::Client`] when the producer cannot start.
    pub async fn serve_check_backs(
        &self,
        producer_group: &str,
    ) -> Result<(CheckBacks, mpsc::Receiver<OrphanCheck>), BrokerError> {
        let (checks, received) = mpsc::channel(CHECK_BACKLOG);
        let instance_name = check_instance();
        let instance = self.instance_handle(&instance_name)?;
        // The producer heartbeats to the brokers its instance has routes to, the first time as it starts: a
        // cluster's own topic routes to every broker of it.
        let clusters = self.cluster_names().await.unwrap_or_default();
        for cluster in &clusters {
            instance.refresh_topic_route(&CheetahString::from(cluster.as_str())).await;
        }
        let mut builder = TransactionMQProducer::builder(self.runtime())
            .client_config(client_config_for_managed_domain(self.client_domain(), self.client_config(&instance_name)))
            .producer_group(producer_group)
            .transaction_listener(ForwardChecks(checks))
            .check_request_hold_max(CHECK_BACKLOG as u32);
        if let Some(signer) = self.signer() {
            builder = builder.rpc_hook(signer);
        }
        let mut producer = builder.build();
        producer.start().await.map_err(|e| BrokerError::Client(e.to_string()))?;
        let backs = CheckBacks {
            producer: tokio::sync::Mutex::new(producer),
            instance,
            watched: parking_lot::Mutex::new(HashSet::new()),
        };
        // Again now that the producer is registered: its route table keeps the clusters' routes fresh.
        for cluster in &clusters {
            backs.watch_topic(cluster).await;
        }
        Ok((backs, received))
    }
}
