//! Reading a queue without consuming it: PULL by offset under the admin tools' consumer group
//! (`TOOLS_CONSUMER`), with no offset committed, as `mqadmin` browses a topic. Browsing twice shows the
//! same messages, and no consumer group's progress moves.

use std::collections::BTreeMap;

use cheetah_string::CheetahString;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::mix_all::TOOLS_CONSUMER_GROUP;
use rocketmq_model::common::sys_flag::pull_sys_flag::PullSysFlag;
use rocketmq_protocol::code::request_code::RequestCode;
use rocketmq_protocol::common::message::message_decoder;
use rocketmq_protocol::protocol::header::pull_message_request_header::PullMessageRequestHeader;
use rocketmq_protocol::protocol::header::pull_message_response_header::PullMessageResponseHeader;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;

use super::client::{BrokerClient, BrokerError};

/// `ResponseCode.SUCCESS`: messages found.
const PULL_FOUND: i32 = 0;
/// `PULL_NOT_FOUND`, `PULL_RETRY_IMMEDIATELY`, `PULL_OFFSET_MOVED`: nothing at this offset (the answer's
/// offsets say where the queue's messages are).
const PULL_NOTHING: [i32; 3] = [19, 20, 21];

/// A stored message as read back from its queue.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredMessage {
    /// The broker's message id (store host + commit log offset).
    pub offset_msg_id: String,
    /// The client message id (`UNIQ_KEY`), when the producer set one.
    pub uniq_key: Option<String>,
    /// Queue the message is in.
    pub queue_id: i32,
    /// Its offset in that queue.
    pub queue_offset: i64,
    /// RocketMQ tag.
    pub tags: Option<String>,
    /// Message keys.
    pub keys: Vec<String>,
    /// Every property, system ones included.
    pub properties: BTreeMap<String, String>,
    /// The payload.
    pub body: Vec<u8>,
    /// When the producer made it (epoch ms).
    pub born_timestamp: i64,
    /// When the broker stored it (epoch ms).
    pub store_timestamp: i64,
}

impl StoredMessage {
    fn from_ext(message: &MessageExt) -> StoredMessage {
        let properties: BTreeMap<String, String> =
            message.properties().iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        StoredMessage {
            offset_msg_id: message.msg_id().to_string(),
            uniq_key: properties.get("UNIQ_KEY").cloned(),
            queue_id: message.queue_id(),
            queue_offset: message.queue_offset(),
            tags: properties.get("TAGS").cloned(),
            keys: properties
                .get("KEYS")
                .map(|k| k.split(' ').filter(|s| !s.is_empty()).map(str::to_owned).collect())
                .unwrap_or_default(),
            body: message.body().map(|b| b.to_vec()).unwrap_or_default(),
            born_timestamp: message.born_timestamp(),
            store_timestamp: message.store_timestamp(),
            properties,
        }
    }

    /// The id an operator names the message by: the client id when there is one.
    pub fn id(&self) -> &str {
        self.uniq_key.as_deref().unwrap_or(&self.offset_msg_id)
    }
}

/// The answer to one PULL.
#[derive(Debug, Clone, Default)]
pub struct Pulled {
    /// Messages from the asked offset on, in queue order.
    pub messages: Vec<StoredMessage>,
    /// Where the next PULL should start.
    pub next_offset: i64,
    /// The queue's first offset still stored.
    pub min_offset: i64,
    /// One past the queue's last message.
    pub max_offset: i64,
}

impl BrokerClient {
    /// Reads up to `max` messages of queue `queue_id` of `topic` at the broker at `addr`, from `offset` on.
    ///
    /// # Errors
    /// [`BrokerError`] when the broker cannot be asked or refuses (e.g. no such topic).
    pub async fn pull(
        &self,
        addr: &str,
        topic: &str,
        queue_id: i32,
        offset: i64,
        max: i32,
    ) -> Result<Pulled, BrokerError> {
        let header = PullMessageRequestHeader {
            consumer_group: CheetahString::from_static_str(TOOLS_CONSUMER_GROUP),
            topic: topic.into(),
            lite_topic: None,
            queue_id,
            queue_offset: offset,
            max_msg_nums: max,
            // No offset commit, no suspension at the broker, a subscription expression ("*").
            sys_flag: PullSysFlag::build_sys_flag(false, false, true, false) as i32,
            commit_offset: 0,
            suspend_timeout_millis: 0,
            sub_version: 0,
            subscription: Some("*".into()),
            expression_type: None,
            max_msg_bytes: None,
            request_source: None,
            proxy_forward_client_id: None,
            topic_request: None,
        };
        let timeout = self.request_timeout();
        let request = RemotingCommand::create_request_command(RequestCode::PullMessage, header);
        let mut response = self
            .pooled()
            .await?
            .handle()
            .invoke_remoting(&CheetahString::from(addr), request, timeout.as_millis() as u64)
            .await
            .map_err(|e| BrokerError::from_client(e, timeout))?;
        let code = response.code();
        if code != PULL_FOUND && !PULL_NOTHING.contains(&code) {
            let detail = response.remark().map(ToString::to_string).unwrap_or_default();
            return Err(BrokerError::Response { code, detail });
        }
        let offsets = response
            .decode_command_custom_header::<PullMessageResponseHeader>()
            .map_err(|e| BrokerError::Client(format!("pull answer header: {e}")))?;
        let messages = match (code, response.take_body()) {
            (PULL_FOUND, Some(mut body)) => {
                message_decoder::decodes_batch(&mut body, true, true).iter().map(StoredMessage::from_ext).collect()
            }
            _ => Vec::new(),
        };
        Ok(Pulled {
            messages,
            next_offset: offsets.next_begin_offset,
            min_offset: offsets.min_offset,
            max_offset: offsets.max_offset,
        })
    }
}
