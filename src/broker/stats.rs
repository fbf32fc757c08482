//! The broker's own figures for the operators' gauges: how far a consumer group is behind on a topic
//! (GET_CONSUME_STATS, request code 208) and how many messages a topic holds (GET_TOPIC_STATS_INFO, 202). One
//! request per broker of the topic's route, after the route lookup at the name server.
//!
//! Facts from the 5.x broker's source (`AdminBrokerProcessor`, `PopMessageProcessor`, `PopBufferMergeService`,
//! `KeyBuilder`) that shape this:
//! - GET_CONSUME_STATS answers, for each read queue of each topic asked, the queue's max offset
//!   (`brokerOffset`) and the group's committed consume offset (`consumerOffset`, 0 when the group never
//!   committed one). `brokerOffset - consumerOffset`, summed, is what `mqadmin consumerProgress` calls the diff.
//! - A POP group has a committed offset too. With `enablePopBufferMerge=false` (the default) a POP commits its
//!   queue's offset as soon as its checkpoint is stored, so the difference counts the messages not yet popped:
//!   what popgate holds in flight is *not* in it (that is `popgate_pending_deliveries`). With
//!   `enablePopBufferMerge=true` the commit waits for the checkpoint's ACKs, so popped, unACKed messages count
//!   as backlog for a while too.
//! - `topicList` (brokers 5.3.2 and later) asks for several topics in one request and skips the check against
//!   the group's registered subscriptions; an older broker ignores it and answers for `topic` alone.
//! - Messages whose POP lease lapsed come back through the group's POP retry topic, `%RETRY%<group>_<topic>`
//!   (`%RETRY%<group>+<topic>` with `enableRetryTopicV2`): they are at the broker, not consumed, so they are
//!   backlog too, and are asked for in the same request.
//! - GET_TOPIC_STATS_INFO answers each queue's min and max offset; a broker without the topic answers
//!   `TOPIC_NOT_EXIST` (17).
//! - Most retry and DLQ topics never exist. Their routes are asked of the name server directly
//!   (GET_ROUTEINFO_BY_TOPIC, 105), since the client crate's route lookup logs a warning for every topic it
//!   does not find: at each refresh, for each subscription, that would be a steady stream of warnings.
//! - Both bodies are fastjson, not JSON: map keys are `MessageQueue` objects (`{{"brokerName":"b","queueId":0,
//!   "topic":"t"}:{…}}`). The client crate's `ConsumeStats::decode` and `TopicStatsTable::decode` rewrite such
//!   keys before parsing; the tests below decode bodies captured from a 5.4.0 broker (`testdata/`).

use std::collections::BTreeMap;

use cheetah_string::CheetahString;
use rocketmq_protocol::code::request_code::RequestCode;
use rocketmq_protocol::protocol::admin::consume_stats::ConsumeStats;
use rocketmq_protocol::protocol::admin::topic_stats_table::TopicStatsTable;
use rocketmq_protocol::protocol::header::client_request_header::GetRouteInfoRequestHeader;
use rocketmq_protocol::protocol::header::get_consume_stats_request_header::GetConsumeStatsRequestHeader;
use rocketmq_protocol::protocol::header::get_topic_stats_info_request_header::GetTopicStatsInfoRequestHeader;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use rocketmq_protocol::protocol::route::topic_route_data::TopicRouteData;

use super::client::{brokers_with_master, BrokerClient, BrokerError, TopicRoute};

/// `ResponseCode.TOPIC_NOT_EXIST`: the broker has no such topic (yet).
const CODE_TOPIC_NOT_EXIST: i32 = 17;
/// The separator of `topicList` (`GetConsumeStatsRequestHeader.TOPIC_NAME_SEPARATOR`).
const TOPIC_LIST_SEPARATOR: &str = ";";

/// The topics a POP group consumes for `topic`: the topic itself and its two possible POP retry topics.
pub fn pop_topics(group: &str, topic: &str) -> [String; 3] {
    [topic.to_owned(), format!("%RETRY%{group}_{topic}"), format!("%RETRY%{group}+{topic}")]
}

impl BrokerClient {
    /// Messages of `topic` (and of the group's POP retry topics) at the brokers that `group` has not consumed
    /// yet: per queue, the max offset minus the group's committed offset, summed. 0 when the topic has no route.
    ///
    /// # Errors
    /// [`BrokerError`] when the name server or a broker cannot be asked, refuses, or answers what does not
    /// decode: the caller keeps its last figure.
    pub async fn consumer_backlog(&self, group: &str, topic: &str) -> Result<u64, BrokerError> {
        let topics = pop_topics(group, topic);
        let mut by_broker: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for name in &topics {
            let Some(route) = self.quiet_route(name).await? else { continue };
            for broker in route.brokers {
                by_broker.entry(broker.addr).or_default().push(name);
            }
        }
        let mut total = 0;
        for (addr, asked) in by_broker {
            let body = self.admin_request(&addr, consume_stats_request(group, &asked)).await?;
            total += backlog_of(&body, &asked)?;
        }
        Ok(total)
    }

    /// Messages `topic` holds at its brokers: per queue, max offset minus min offset, summed. 0 when the topic
    /// does not exist (no route, or a broker that does not have it).
    ///
    /// # Errors
    /// As [`BrokerClient::consumer_backlog`].
    pub async fn topic_depth(&self, topic: &str) -> Result<u64, BrokerError> {
        let Some(route) = self.quiet_route(topic).await? else { return Ok(0) };
        let mut total = 0;
        for broker in route.brokers {
            let header = GetTopicStatsInfoRequestHeader { topic: topic.into(), topic_request_header: None };
            let request = RemotingCommand::create_request_command(RequestCode::GetTopicStatsInfo, header);
            match self.admin_request(&broker.addr, request).await {
                Ok(body) => total += depth_of(&body, topic)?,
                Err(BrokerError::Response { code: CODE_TOPIC_NOT_EXIST, .. }) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(total)
    }

    /// The route the name server has for exactly `topic`, or `None`, without a log line when there is none.
    /// Each configured name server is tried in turn until one answers.
    ///
    /// # Errors
    /// The last failure when no name server answered.
    async fn quiet_route(&self, topic: &str) -> Result<Option<TopicRoute>, BrokerError> {
        let mut failure = BrokerError::Unreachable("no name server configured".to_owned());
        for namesrv in self.namesrv_addrs() {
            let header = GetRouteInfoRequestHeader {
                topic: topic.into(),
                accept_standard_json_only: None,
                topic_request_header: None,
            };
            let request = RemotingCommand::create_request_command(RequestCode::GetRouteinfoByTopic, header);
            match self.admin_request(&namesrv, request).await {
                Ok(body) => {
                    let data = TopicRouteData::decode(&body).map_err(|e| undecodable("TopicRouteData", &body, &e))?;
                    return Ok(Some(brokers_with_master(&data)));
                }
                Err(BrokerError::Response { code: CODE_TOPIC_NOT_EXIST, .. }) => return Ok(None),
                Err(error) => failure = error,
            }
        }
        Err(failure)
    }

    /// Sends one request to the broker (or name server) at `addr` and returns the body of its successful answer.
    pub(super) async fn admin_request(&self, addr: &str, request: RemotingCommand) -> Result<Vec<u8>, BrokerError> {
        let timeout = self.request_timeout();
        let response = self
            .pooled()
            .await?
            .handle()
            .invoke_remoting(&CheetahString::from(addr), request, timeout.as_millis() as u64)
            .await
            .map_err(|e| BrokerError::from_client(e, timeout))?;
        if response.code() != 0 {
            let detail = response.remark().map(ToString::to_string).unwrap_or_default();
            return Err(BrokerError::Response { code: response.code(), detail });
        }
        Ok(response.body().map(|b| b.to_vec()).unwrap_or_default())
    }
}

/// GET_CONSUME_STATS for `group` on `topics`: all of them through `topicList`, the first through `topic` for a
/// broker older than 5.3.2.
fn consume_stats_request(group: &str, topics: &[&str]) -> RemotingCommand {
    let header = GetConsumeStatsRequestHeader {
        consumer_group: group.into(),
        topic: topics.first().copied().unwrap_or_default().into(),
        topic_list: Some(topics.join(TOPIC_LIST_SEPARATOR).into()),
        topic_request_header: None,
    };
    RemotingCommand::create_request_command(RequestCode::GetConsumeStats, header)
}

/// The backlog a `ConsumeStats` body reports for the queues of `topics` (others, if any, are left out).
fn backlog_of(body: &[u8], topics: &[&str]) -> Result<u64, BrokerError> {
    let stats = ConsumeStats::decode(body).map_err(|e| undecodable("ConsumeStats", body, &e))?;
    Ok(stats
        .get_offset_table()
        .iter()
        .filter(|(queue, _)| topics.contains(&queue.topic_str()))
        .map(|(_, offsets)| non_negative(offsets.get_broker_offset() - offsets.get_consumer_offset()))
        .sum())
}

/// The messages a `TopicStatsTable` body reports for the queues of `topic`.
fn depth_of(body: &[u8], topic: &str) -> Result<u64, BrokerError> {
    let table = TopicStatsTable::decode(body).map_err(|e| undecodable("TopicStatsTable", body, &e))?;
    Ok(table
        .get_offset_table()
        .iter()
        .filter(|(queue, _)| queue.topic_str() == topic)
        .map(|(_, offsets)| non_negative(offsets.get_max_offset() - offsets.get_min_offset()))
        .sum())
}

/// A count from two offsets; a consumer offset past the max (a queue reset at the broker) counts nothing.
fn non_negative(difference: i64) -> u64 {
    u64::try_from(difference).unwrap_or(0)
}

fn undecodable(what: &str, body: &[u8], error: &dyn std::fmt::Display) -> BrokerError {
    let text = String::from_utf8_lossy(body);
    let start: String = text.chars().take(200).collect();
    BrokerError::Client(format!("the broker's {what} body does not decode ({error}): {start}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GET_CONSUME_STATS from broker-a: 10 messages published over two brokers, none popped yet (the group's
    /// offsets are 0; broker-a holds 9 of them).
    const UNPOPPED: &[u8] = include_bytes!("testdata/consume_stats_unpopped.fastjson");
    /// GET_CONSUME_STATS from broker-a for a topic and its POP retry topic: the topic's message was popped
    /// (offset committed) and given back, and the broker re-put it to the retry topic, unpopped there.
    const WITH_RETRY_TOPIC: &[u8] = include_bytes!("testdata/consume_stats_with_retry_topic.fastjson");
    /// GET_TOPIC_STATS_INFO of a `%DLQ%` topic holding one dead letter.
    const DLQ_STATS: &[u8] = include_bytes!("testdata/topic_stats_dlq.fastjson");

    #[test]
    fn a_consume_stats_body_from_a_real_broker_gives_the_unpopped_count() {
        assert!(UNPOPPED.starts_with(b"{\"consumeTps\":0.0,\"offsetTable\":{{\"brokerName\""), "fastjson object keys");
        assert_eq!(backlog_of(UNPOPPED, &["gauges_6153_2fa67dc2"]).ok(), Some(9));
        assert_eq!(backlog_of(UNPOPPED, &["another_topic"]).ok(), Some(0), "queues of topics not asked are left out");
    }

    #[test]
    fn the_pop_retry_topic_of_a_real_broker_counts_in_the_same_body() {
        let topic = "gauges_retry_4615_354eb264";
        let retry = "%RETRY%g_gauges_retry_4615_354ed738_gauges_retry_4615_354eb264";
        assert_eq!(backlog_of(WITH_RETRY_TOPIC, &[topic]).ok(), Some(0), "the topic itself is all popped");
        assert_eq!(backlog_of(WITH_RETRY_TOPIC, &[topic, retry]).ok(), Some(1));
    }

    #[test]
    fn a_topic_stats_body_from_a_real_broker_gives_the_depth() {
        assert_eq!(depth_of(DLQ_STATS, "%DLQ%g_gauges_6153_2fa6a73e").ok(), Some(1));
    }

    #[test]
    fn a_body_that_does_not_decode_is_an_error_naming_it() {
        let error = backlog_of(b"<html>oops</html>", &["t"]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("ConsumeStats") && error.contains("<html>"), "{error}");
    }

    #[test]
    fn pop_topics_are_the_topic_and_both_retry_topic_forms() {
        assert_eq!(pop_topics("g", "t"), ["t".to_owned(), "%RETRY%g_t".to_owned(), "%RETRY%g+t".to_owned()]);
    }

    #[test]
    fn a_negative_difference_counts_nothing() {
        assert_eq!(non_negative(-3), 0);
        assert_eq!(non_negative(7), 7);
    }
}
