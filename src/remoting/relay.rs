//! Consumers' requests: the client lifecycle popgate answers itself (heartbeats, group membership), and the
//! queue requests the broker owning the queue must answer (pulls, offsets, queue locks, send-backs), relayed
//! to it unchanged, as Apache's proxy relays them.
//!
//! Which broker a queue request is for: the client names it (`bname`, from client 4.9.5 on; the broker name
//! in a lock request's queues). An older client does not; popgate then finds the broker itself from the
//! topic's route: the one broker that has a queue of that id. A topic with a queue of that id on several
//! brokers cannot be told apart, and the request is refused saying so.

use std::collections::HashMap;
use std::time::Duration;

use metrics::counter;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use serde::Deserialize;

use super::clients::{Heartbeat, Registration};
use super::codes;
use super::connection::Connection;
use super::service::{error, field, Front, Refusal, Reply};
use crate::auth::{Caller, RETRY_TOPIC_PREFIX};
use crate::gateway;
use crate::metrics as m;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_protocol::common::message::message_decoder;

/// The most a relayed pull may be held at the broker beyond what the client asked (its suspend time): the
/// broker looks at its held pulls every 5 s, so one is answered up to 5 s after its suspend time ends, later on
/// a busy broker. Apache's proxy waits 10 s beyond the suspend time too.
const PULL_ANSWER_MARGIN: Duration = Duration::from_secs(10);
/// A heartbeat whose content did not change is passed on to the brokers at most this often (the client
/// sends one per broker of its routes every 30 s, all of which reach popgate).
const HEARTBEAT_FORWARD_INTERVAL: Duration = Duration::from_secs(20);
/// How long the master list of the cluster is reused.
const MASTERS_TTL: Duration = Duration::from_secs(5);

/// `HEART_BEAT`: the client's groups are recorded here (membership, rebalance notifications), and its consumer
/// groups are passed on to every master broker, which needs a group's subscription to serve its pulls.
///
/// The members of a group the heartbeat changed are told to rebalance only once the brokers have its
/// subscriptions, and behind the heartbeat's answer: a rebalance that moves queues sends a heartbeat with a new
/// subscription version, which the client skips while another of its heartbeats is unanswered, and a broker
/// refuses every pull naming that version (`SUBSCRIPTION_NOT_LATEST`) until a later heartbeat brings it (seen: a
/// new consumer's first message 20 s late on a loaded machine, where the notification came first).
pub(super) async fn heartbeat(
    front: &Front,
    connection: &Connection,
    caller: &Caller,
    request: &RemotingCommand,
) -> Reply {
    let Some(registration) = Registration::of(request) else {
        return error(codes::SYSTEM_ERROR, "HEART_BEAT without a body (HeartbeatData)").into();
    };
    // Decoded once, and checked as `RELAYED` says of a heartbeat.
    let heartbeat = match Heartbeat::of(request).and_then(|heartbeat| {
        heartbeat_permission(caller, &heartbeat)?;
        Ok(heartbeat)
    }) {
        Ok(heartbeat) => heartbeat,
        Err(refusal) => return refusal.answer().into(),
    };
    let changed = match front.clients.heartbeat(connection, caller, &heartbeat) {
        Ok(changed) => changed,
        Err(refused) => return Refusal::from(refused).answer().into(),
    };
    let forward = front.clients.should_forward(&heartbeat.client_id, &registration, HEARTBEAT_FORWARD_INTERVAL);
    if !heartbeat.consumer_data_set.is_empty() && forward {
        forward_to_masters(front, request).await;
        // A broker creates each group's retry topic as it takes the heartbeat, and tells the name server before
        // it answers. A client asks for that topic's route at its start, before its first heartbeat, and again
        // in the rebalance that heartbeat triggers: given the cached "no such topic" then, it would pull its
        // group's retries only after its next route poll and rebalance, 30 to 40 s on (straight at the cluster,
        // a message it asks to reconsume comes back at its delay level: 10 s).
        for consumer in &heartbeat.consumer_data_set {
            front.routes.forget_absence(&format!("{RETRY_TOPIC_PREFIX}{}", consumer.group_name));
        }
    }
    Reply { command: RemotingCommand::create_success_response_command(), handed: Vec::new(), then_tell: changed }
}

/// Passes `request` on to every master broker, and waits for their answers (a pull right after start-up
/// needs the subscription there). A broker that fails gets the next heartbeat.
async fn forward_to_masters(front: &Front, request: &RemotingCommand) {
    let masters = match masters(front).await {
        Ok(masters) => masters,
        Err(why) => {
            tracing::warn!(%why, "A remoting heartbeat could not be passed on: no broker list.");
            return;
        }
    };
    let timeout = front.config.broker.request_timeout();
    let sends = masters.values().map(|addr| front.broker.relay(addr, request, timeout));
    for (result, (name, _)) in futures::future::join_all(sends).await.into_iter().zip(masters.iter()) {
        let outcome = match result {
            Ok(answer) if answer.code() == codes::SUCCESS => "ok",
            Ok(_) => "refused",
            Err(_) => "unreachable",
        };
        counter!(m::REMOTING_RELAYS, "code" => "heart_beat", "result" => outcome).increment(1);
        if outcome != "ok" {
            tracing::debug!(broker = %name, outcome, "A remoting heartbeat was not taken by a broker.");
        }
    }
}

/// `UNREGISTER_CLIENT`: the client leaves the groups named; the brokers learn it when its heartbeats stop. A
/// consumer that leaves gives back what it popped in that group and did not settle, due again at once (as a
/// gRPC client's termination does); only the token that registered the client id may unregister it.
pub(super) async fn unregister(front: &Front, caller: &Caller, request: &RemotingCommand) -> RemotingCommand {
    let Some(client_id) = field(request, "clientID") else {
        return error(codes::SYSTEM_ERROR, "UNREGISTER_CLIENT without clientID");
    };
    let consumer_group = field(request, "consumerGroup");
    if let Some(group) = consumer_group {
        if let Err(refused) = gateway::may_consume(caller, group) {
            return Refusal::from(refused).answer();
        }
    }
    let left = match front.clients.unregister(client_id, caller, field(request, "producerGroup"), consumer_group) {
        Ok(left) => left,
        Err(refused) => return Refusal::from(refused).answer(),
    };
    // Only a member registered here by this token gives back what it holds: a client id is anyone's to name.
    if let Some(group) = consumer_group.filter(|_| left) {
        match front.deliveries.leave_group(caller, "remoting", client_id, group).await {
            Ok(0) => {}
            Ok(released) => tracing::info!(
                client_id,
                group,
                released,
                "A remoting consumer left its group; what it popped there and did not settle is due again."
            ),
            Err(refused) => return Refusal::from(refused).answer(),
        }
    }
    RemotingCommand::create_success_response_command()
}

/// `GET_CONSUMER_LIST_BY_GROUP`: the group's members connected to this popgate.
pub(super) fn consumer_list(front: &Front, caller: &Caller, request: &RemotingCommand) -> RemotingCommand {
    let Some(group) = field(request, "consumerGroup") else {
        return error(codes::SYSTEM_ERROR, "GET_CONSUMER_LIST_BY_GROUP without consumerGroup");
    };
    if let Err(refused) = gateway::may_consume(caller, group) {
        return Refusal::from(refused).answer();
    }
    let members = front.clients.consumers_of(group);
    if members.is_empty() {
        // The broker's own words for a group without members.
        return error(codes::SYSTEM_ERROR, format!("no consumer for this group, {group}"));
    }
    let body = serde_json::json!({ "consumerIdList": members }).to_string();
    RemotingCommand::create_success_response_command().set_body(body.into_bytes())
}

/// `CHECK_CLIENT_CONFIG` (a consumer's subscription, e.g. an SQL filter, checked at start): asked of a master
/// broker, which knows whether it can serve it.
pub(super) async fn check_client_config(front: &Front, caller: &Caller, request: &RemotingCommand) -> RemotingCommand {
    if let Err(refusal) = permission(caller, request) {
        return refusal.answer();
    }
    to_a_master(front, "check_client_config", request).await
}

/// A request any master broker can answer, relayed to one of them.
pub(super) async fn to_a_master(front: &Front, label: &'static str, request: &RemotingCommand) -> RemotingCommand {
    let masters = match masters(front).await {
        Ok(masters) => masters,
        Err(why) => return error(codes::SYSTEM_ERROR, format!("popgate has no broker to ask: {why}")),
    };
    let Some(addr) = masters.values().next() else {
        return error(codes::SYSTEM_ERROR, "no master broker has registered with the name server");
    };
    relay_counted(front, label, addr, request, front.config.broker.request_timeout()).await.command
}

/// What a relayed request needs of its caller, by request code: the one list of what popgate passes on to a
/// broker or the name server, which it signs with its own cluster credentials. The brokers then refuse nothing
/// popgate lets through, so this list is the cluster's ACL for every app behind popgate. A code that is not
/// here is not relayed. The README's table is made from it ([`needs_table`]; a test checks they agree).
const RELAYED: &[(i32, Needs)] = &[
    (codes::GET_ROUTEINFO_BY_TOPIC, Needs::Nothing),
    (codes::HEART_BEAT, Needs::HeartbeatBody),
    (codes::PULL_MESSAGE, Needs::Read(GroupIn::Header("consumerGroup"), TopicIn::Header("topic"))),
    (codes::LITE_PULL_MESSAGE, Needs::Read(GroupIn::Header("consumerGroup"), TopicIn::Header("topic"))),
    (codes::QUERY_CONSUMER_OFFSET, Needs::Read(GroupIn::Header("consumerGroup"), TopicIn::Header("topic"))),
    (codes::UPDATE_CONSUMER_OFFSET, Needs::Read(GroupIn::Header("consumerGroup"), TopicIn::Header("topic"))),
    // The broker copies the message at the header's `offset` into the `%RETRY%` (or `%DLQ%`) topic of the group
    // in `group`; a `consumerGroup` field beside it is not read by the broker, so neither is it here.
    (codes::CONSUMER_SEND_MSG_BACK, Needs::SendBack(GroupIn::Header("group"))),
    (codes::LOCK_BATCH_MQ, Needs::Read(GroupIn::LockBody, TopicIn::LockBody)),
    (codes::UNLOCK_BATCH_MQ, Needs::Read(GroupIn::LockBody, TopicIn::LockBody)),
    (codes::CHECK_CLIENT_CONFIG, Needs::ConsumeAs(GroupIn::CheckClientBody)),
    (codes::SEARCH_OFFSET_BY_TIMESTAMP, Needs::LookUp(TopicIn::Header("topic"))),
    (codes::GET_MAX_OFFSET, Needs::LookUp(TopicIn::Header("topic"))),
    (codes::GET_MIN_OFFSET, Needs::LookUp(TopicIn::Header("topic"))),
    (codes::GET_EARLIEST_MSG_STORETIME, Needs::LookUp(TopicIn::Header("topic"))),
    (codes::END_TRANSACTION, Needs::PublishToHalfMessageTopic),
];

/// What a relayed request's caller must be allowed.
#[derive(Debug, Clone, Copy)]
enum Needs {
    /// Nothing: a route query, answered to whoever asks, as RocketMQ's name server answers it (it has no ACL).
    /// A route names a topic's brokers and queues, not its messages; a client whose token does not cover the
    /// topic is then refused by its first broker request, with the reason, as straight at the cluster.
    Nothing,
    /// Consuming as the group the request names there (a request that names none is refused).
    ConsumeAs(GroupIn),
    /// Reading the topics the request names as that group: `Sub` on the group and on each topic.
    Read(GroupIn, TopicIn),
    /// Looking the topic up (its route, its queues' offsets and store times): `Pub` or `Sub` on it
    /// ([`gateway::may_look_up`]).
    LookUp(TopicIn),
    /// A consumer's heartbeat: `Sub` on each consumer group of its body and on each topic that group
    /// subscribes to.
    HeartbeatBody,
    /// Consuming as the group, and reading the topic of the message the request names only by its commit-log
    /// offset, as that group: only its broker can tell that topic ([`send_back_permission`]).
    SendBack(GroupIn),
    /// Publishing to the topic of the half message the request ends, which only its broker can tell:
    /// `super::transaction` looks it up and relays through [`ended_elsewhere`], never through
    /// [`to_queue_broker`].
    PublishToHalfMessageTopic,
}

// The README's words: the table there is made from these (a test checks it).
#[cfg(test)]
impl Needs {
    /// The README's words for what is needed.
    fn words(self) -> String {
        match self {
            Needs::ConsumeAs(group) => format!("`Sub` on {}", group.words()),
            Needs::Read(group, topic) => format!("`Sub` on {} and on {}", group.words(), topic.words()),
            Needs::Nothing => {
                "nothing: answered to whoever asks, as the name server answers it (a route names brokers and queues, \
                 no message)"
                    .to_owned()
            }
            Needs::LookUp(topic) => format!(
                "`Pub` or `Sub` on {} (ACL 2.0's `Get`, which tokens do not grant on its own); a `%RETRY%` topic: \
                 `Sub` on its group",
                topic.words()
            ),
            Needs::HeartbeatBody => {
                "`Sub` on each consumer group of the body and on each topic it subscribes to".to_owned()
            }
            Needs::SendBack(group) => format!(
                "`Sub` on {}, and on the topic of the message at the header's `offset`, read from its broker \
                 (`VIEW_MESSAGE_BY_ID`)",
                group.words()
            ),
            Needs::PublishToHalfMessageTopic => {
                "without popgate's record: `Pub` on the half message's topic, read from its broker".to_owned()
            }
        }
    }
}

/// Where a relayed request names the topics it reads.
#[derive(Debug, Clone, Copy)]
enum TopicIn {
    /// A header field (a request without it is refused).
    Header(&'static str),
    /// The topics of the queues of a queue lock request's body.
    LockBody,
}

#[cfg(test)]
impl TopicIn {
    fn words(self) -> String {
        match self {
            TopicIn::Header(name) => format!("the header's `{name}`"),
            TopicIn::LockBody => "the topic of each queue of the body".to_owned(),
        }
    }
}

/// Where a relayed request names its consumer group.
#[derive(Debug, Clone, Copy)]
enum GroupIn {
    /// A header field.
    Header(&'static str),
    /// The `consumerGroup` of a queue lock request's body.
    LockBody,
    /// The `group` of a `CHECK_CLIENT_CONFIG` body.
    CheckClientBody,
}

#[cfg(test)]
impl GroupIn {
    fn words(self) -> String {
        match self {
            GroupIn::Header(name) => format!("the header's `{name}`"),
            GroupIn::LockBody => "the body's `consumerGroup`".to_owned(),
            GroupIn::CheckClientBody => "the body's `group`".to_owned(),
        }
    }
}

/// The README's table of [`RELAYED`]: code, request, what it needs.
#[cfg(test)]
fn needs_table() -> String {
    let mut table = String::from("| code | request | needs |\n|---|---|---|\n");
    for (code, needs) in RELAYED {
        let name = codes::request_label(*code).to_ascii_uppercase();
        table.push_str(&format!("| {code} | `{name}` | {} |\n", needs.words()));
    }
    table
}

/// Whether `caller` may have `request` relayed, as [`RELAYED`] says; the refusal otherwise. What only a broker
/// can tell (a send-back's message, a transaction's half message) is checked where the request is relayed.
pub(super) fn permission(caller: &Caller, request: &RemotingCommand) -> Result<(), Refusal> {
    let code = request.code();
    let Some((_, needs)) = RELAYED.iter().find(|(relayed, _)| *relayed == code) else {
        return Err(Refusal::new(codes::REQUEST_CODE_NOT_SUPPORTED, format!(" request type {code} not supported")));
    };
    let names_none =
        |what: &str| Refusal::new(codes::SYSTEM_ERROR, format!("{} names no {what}", codes::request_label(code)));
    let (group_in, topic_in) = match *needs {
        Needs::PublishToHalfMessageTopic => {
            return Err(Refusal::new(codes::NO_PERMISSION, "a transaction's end needs its half message's topic"))
        }
        Needs::Nothing => return Ok(()),
        Needs::LookUp(topic_in) => {
            let topics = topics_named(request, topic_in).ok_or_else(|| names_none("topic"))?;
            return topics.iter().try_for_each(|topic| gateway::may_look_up(caller, topic)).map_err(Refusal::from);
        }
        Needs::HeartbeatBody => return heartbeat_permission(caller, &Heartbeat::of(request)?),
        Needs::ConsumeAs(group_in) | Needs::SendBack(group_in) => (group_in, None),
        Needs::Read(group_in, topic_in) => (group_in, Some(topic_in)),
    };
    let group = group_named(request, group_in).ok_or_else(|| names_none("consumer group"))?;
    gateway::may_consume(caller, &group)?;
    let topics = match topic_in {
        None => Vec::new(),
        Some(topic_in) => topics_named(request, topic_in).ok_or_else(|| names_none("topic"))?,
    };
    topics.iter().try_for_each(|topic| gateway::may_read(caller, &group, topic)).map_err(Refusal::from)
}

/// Whether `caller` may send `heartbeat`: `Sub` on each of its consumer groups and on each topic the group
/// subscribes to (its `%RETRY%` topic is the group's), as a gRPC client's Settings.
fn heartbeat_permission(caller: &Caller, heartbeat: &Heartbeat) -> Result<(), Refusal> {
    heartbeat
        .consumer_data_set
        .iter()
        .try_for_each(|consumer| {
            let topics = consumer.subscription_data_set.iter().map(|s| s.topic.as_str());
            gateway::may_subscribe(caller, &consumer.group_name, topics)
        })
        .map_err(Refusal::from)
}

/// A send-back's further need ([`Needs::SendBack`]): the message at its `offset` is one the caller may read as
/// the group. The broker copies whatever message is stored there into the group's retry topic, which the
/// group's consumers then pull: without this, a token could read any topic by walking commit-log offsets with
/// a group of its own. With authentication off every caller may read anything: nothing is looked up.
async fn send_back_permission(front: &Front, caller: &Caller, request: &RemotingCommand) -> Result<(), Refusal> {
    if caller.is_unrestricted() {
        return Ok(());
    }
    let Some(group) = field(request, "group") else {
        return Err(Refusal::new(codes::SYSTEM_ERROR, "CONSUMER_SEND_MSG_BACK names no group"));
    };
    let Some(offset) = field(request, "offset").and_then(|v| v.parse::<i64>().ok()) else {
        return Err(Refusal::new(codes::SYSTEM_ERROR, "CONSUMER_SEND_MSG_BACK without an offset"));
    };
    let hint = field(request, "originTopic").unwrap_or_default();
    let message = stored_message(front, request, offset, hint).await?;
    let Some(message) = message else {
        // The broker's own answer for an offset with no message.
        return Err(Refusal::new(codes::SYSTEM_ERROR, format!("look message by offset failed, {offset}")));
    };
    gateway::may_read(caller, group, message.topic()).map_err(Refusal::from)
}

/// The message stored at commit-log `offset` of the broker `request` is for (`VIEW_MESSAGE_BY_ID`; `topic`:
/// the topic the request says it is of, which the broker does not need), its body left out; `None` when the
/// broker has none there. For the requests that name a message only by its offset: a send-back, a
/// transaction's end.
pub(super) async fn stored_message(
    front: &Front,
    request: &RemotingCommand,
    offset: i64,
    topic: &str,
) -> Result<Option<MessageExt>, Refusal> {
    let broker = broker_of(front, request).await.map_err(|why| Refusal::new(codes::SYSTEM_ERROR, why))?;
    let addr = master_addr(front, &broker)
        .await
        .map_err(|answer| Refusal::new(answer.code(), answer.remark().map(ToString::to_string).unwrap_or_default()))?;
    let mut view = RemotingCommand::create_remoting_command(codes::VIEW_MESSAGE_BY_ID);
    view.add_ext_field("topic", topic);
    view.add_ext_field("offset", offset.to_string());
    let timeout = front.config.broker.request_timeout();
    let mut answer = front.broker.relay(&addr, &view, timeout).await.map_err(|failed| {
        Refusal::new(codes::SYSTEM_ERROR, format!("popgate could not ask broker `{broker}`: {failed}"))
    })?;
    let Some(mut body) = answer.take_body().filter(|_| answer.code() == codes::SUCCESS) else { return Ok(None) };
    Ok(message_decoder::decode(&mut body, false, false, false, false, false))
}

/// The consumer group `request` names where `group_in` says.
fn group_named(request: &RemotingCommand, group_in: GroupIn) -> Option<String> {
    match group_in {
        GroupIn::Header(name) => field(request, name).map(str::to_owned),
        GroupIn::LockBody => {
            request.body().and_then(|b| serde_json::from_slice::<LockBody>(b).ok()).map(|lock| lock.consumer_group)
        }
        GroupIn::CheckClientBody => {
            request.body().and_then(|b| serde_json::from_slice::<CheckClientBody>(b).ok()).map(|body| body.group)
        }
    }
}

/// The topics `request` reads, named where `topic_in` says.
fn topics_named(request: &RemotingCommand, topic_in: TopicIn) -> Option<Vec<String>> {
    match topic_in {
        TopicIn::Header(name) => field(request, name).map(|topic| vec![topic.to_owned()]),
        TopicIn::LockBody => request
            .body()
            .and_then(|b| serde_json::from_slice::<LockBody>(b).ok())
            .map(|lock| lock.mq_set.into_iter().map(|queue| queue.topic).collect()),
    }
}

/// A queue request, relayed to the broker that owns the queue once [`permission`] allows it; `None` (no answer:
/// the client times out and asks again) where an error answer would mislead it.
///
/// A 4.9.x client takes any error answer to `QUERY_CONSUMER_OFFSET` for "this group has no offset", and a new
/// push consumer then starts at the queue's end, skipping what is there; so a failure to ask the broker is not
/// answered.
pub(super) async fn to_queue_broker(
    front: &Front,
    caller: &Caller,
    request: &RemotingCommand,
) -> Option<RemotingCommand> {
    if let Err(refusal) = permission(caller, request) {
        return Some(refusal.answer());
    }
    if request.code() == codes::CONSUMER_SEND_MSG_BACK {
        if let Err(refusal) = send_back_permission(front, caller, request).await {
            return Some(refusal.answer());
        }
    }
    let answer =
        if request.is_oneway_rpc() { relayed_one_way(front, request).await } else { relayed(front, request).await };
    let refused_here =
        answer.code() != codes::SUCCESS && answer.code() != codes::QUERY_NOT_FOUND && answer.by != AnsweredBy::Broker;
    if request.code() == codes::QUERY_CONSUMER_OFFSET && refused_here {
        tracing::info!(remark = ?answer.command.remark(), "An offset query was not answered: popgate could not ask its broker.");
        return None;
    }
    Some(answer.command)
}

/// An `END_TRANSACTION` of a half message popgate has no record of, relayed to its broker: only once
/// `super::transaction` found at that broker that the half message's topic is one the caller may publish to.
pub(super) async fn ended_elsewhere(front: &Front, request: &RemotingCommand) -> RemotingCommand {
    if request.is_oneway_rpc() { relayed_one_way(front, request).await } else { relayed(front, request).await }.command
}

/// A one-way request (an offset commit or queue unlock at the client's shutdown, say) is relayed again when the
/// broker could not be reached: its client never learns of a failure and never sends it again, while straight
/// at the broker it would have arrived. These requests set a state (an offset, a lock), so a repeat is harmless;
/// a commit's repeats stay within its turn ([`super::offset_turns`]), so none lands after a later commit.
async fn relayed_one_way(front: &Front, request: &RemotingCommand) -> Relayed {
    let mut answer = relayed(front, request).await;
    for pause in ONE_WAY_RETRY_PAUSES {
        if answer.by != AnsweredBy::Unreachable {
            return answer;
        }
        tokio::time::sleep(pause).await;
        answer = relayed(front, request).await;
    }
    if answer.by == AnsweredBy::Unreachable {
        tracing::warn!(
            code = codes::request_label(request.code()),
            remark = ?answer.command.remark(),
            "A client's one-way request could not be relayed to its broker and is lost."
        );
    }
    answer
}

/// Whether `answer` to pull `request` says the broker does not have the consumer group's subscription, or has
/// an older one than the pull names: it forgot the group (its connection to popgate closed), or the pull came
/// before the heartbeat with a new subscription reached it.
fn lost_its_registration(request: &RemotingCommand, answer: &Relayed) -> bool {
    let pull = matches!(request.code(), codes::PULL_MESSAGE | codes::LITE_PULL_MESSAGE);
    let lost = matches!(answer.code(), codes::SUBSCRIPTION_NOT_EXIST | codes::SUBSCRIPTION_NOT_LATEST);
    pull && lost && answer.by == AnsweredBy::Broker
}

/// Whether `answer` to offset query `request` is the broker's "no offset" (`QUERY_NOT_FOUND`) that a client may
/// take as "start where the queue is now" ([`offset_of_a_new_group`]); not when the client asked for exactly
/// that answer (`setZeroIfNotFound` false).
fn no_offset_yet(request: &RemotingCommand, answer: &Relayed) -> bool {
    request.code() == codes::QUERY_CONSUMER_OFFSET
        && answer.by == AnsweredBy::Broker
        && answer.code() == codes::QUERY_NOT_FOUND
        && field(request, "setZeroIfNotFound") != Some("false")
}

/// The answer to offset query `request` of a group that has no offset in its queue yet (`not_found`, the
/// broker's answer), given at once where the client would otherwise ask a second question whose answer can
/// skip a message.
///
/// A broker answers such a query with offset 0 when the queue's first message is still in memory, and with
/// `QUERY_NOT_FOUND` when the queue is empty. A client consuming from the last offset (the default) then asks
/// for the queue's end (`GET_MAX_OFFSET`) and starts there: a message stored between the two answers is never
/// consumed by the group. Straight at the broker the two are a millisecond apart; through popgate two relays,
/// and Apache's remoting suite (client 4.9.3, a topic of 8 queues on each broker, 10 messages sent as the
/// consumer starts) lost one message of ten. So popgate asks the queue's end itself, at once: an empty queue is
/// answered with offset 0, where every way to start (first, last, timestamp) starts in an empty queue, and the
/// message that arrives next is consumed; a queue that got its first messages since is asked again (the broker
/// answers 0 while they are in memory). Otherwise the broker's answer stands.
async fn offset_of_a_new_group(
    front: &Front,
    request: &RemotingCommand,
    broker_name: &str,
    addr: &str,
    not_found: Relayed,
) -> Relayed {
    let (Some(topic), Some(queue_id)) = (field(request, "topic"), field(request, "queueId")) else {
        return not_found;
    };
    let mut end = RemotingCommand::create_remoting_command(codes::GET_MAX_OFFSET);
    end.add_ext_field("topic", topic);
    end.add_ext_field("queueId", queue_id);
    end.add_ext_field("bname", broker_name);
    let timeout = front.config.broker.request_timeout();
    let end = relay_counted(front, "get_max_offset", addr, &end, timeout).await;
    if end.by != AnsweredBy::Broker || end.code() != codes::SUCCESS {
        return not_found;
    }
    match field(&end.command, "offset").and_then(|offset| offset.parse::<i64>().ok()) {
        Some(0) => {
            tracing::debug!(topic, queue_id, broker = broker_name, "A new group starts at offset 0 of an empty queue.");
            let mut start = RemotingCommand::create_response_command_with_code(codes::SUCCESS);
            start.add_ext_field("offset", "0");
            Relayed { command: start, by: AnsweredBy::Broker }
        }
        Some(_) => {
            let again = relay_counted(front, "query_consumer_offset", addr, request, timeout).await;
            if again.by == AnsweredBy::Broker {
                again
            } else {
                not_found
            }
        }
        None => not_found,
    }
}

/// Whether the broker still refuses pull `request` for naming a newer subscription than its own: the client
/// skipped the heartbeat that carries it ([`register_again`]).
fn still_not_latest(request: &RemotingCommand, answer: &Relayed) -> bool {
    request.code() == codes::PULL_MESSAGE
        && answer.by == AnsweredBy::Broker
        && answer.code() == codes::SUBSCRIPTION_NOT_LATEST
}

/// Pull `request` carrying its group's subscription to its topic as popgate has it (the newest of its members'
/// heartbeats), as Apache's proxy relays every pull: the broker then reads by that subscription and does not
/// compare versions. Only for a pull the broker refused as naming a newer subscription version, which the
/// client's skipped heartbeat would have brought; straight at the broker its pulls are refused until its next
/// heartbeat, up to 30 s later (seen through popgate: 29.9 s, two broadcasting consumers of one app). A 4.x
/// client gives its subscription a new version at each rebalance, its filter unchanged; had the app changed the
/// filter, it reads by the former one until that heartbeat. `None` when the pull carries a subscription already,
/// or popgate has none of its group to the topic.
fn with_the_groups_subscription(front: &Front, request: &RemotingCommand) -> Option<RemotingCommand> {
    const FLAG_SUBSCRIPTION: i32 = 1 << 2;
    const FLAG_CLASS_FILTER: i32 = 1 << 3;
    let sys_flag: i32 = field(request, "sysFlag")?.parse().ok()?;
    if sys_flag & (FLAG_SUBSCRIPTION | FLAG_CLASS_FILTER) != 0 {
        return None;
    }
    let (group, topic) = (field(request, "consumerGroup")?, field(request, "topic")?);
    let subscription = front
        .clients
        .registrations_of(group)
        .iter()
        .filter_map(|registration| registration.subscription(group, topic))
        .max_by_key(|subscription| subscription.sub_version)?;
    tracing::debug!(
        group,
        topic,
        subscription = %subscription.sub_string,
        "A pull names a newer subscription than any heartbeat of its group reached popgate with (the client \
         skipped it): relayed with the group's subscription as popgate has it."
    );
    let mut with_subscription = request.clone();
    with_subscription.add_ext_field("sysFlag", (sys_flag | FLAG_SUBSCRIPTION).to_string());
    with_subscription.add_ext_field("subscription", subscription.sub_string);
    let expression_type = if subscription.expression_type.is_empty() { "TAG" } else { &subscription.expression_type };
    with_subscription.add_ext_field("expressionType", expression_type);
    Some(with_subscription)
}

/// Registers the consumer group of pull `request` again at broker `addr`, with the heartbeats its members last
/// sent here; whether the broker took one. Straight at the broker the client's next heartbeat would, up to 30 s
/// later, with its pulls refused until then; here the pull that found the group missing is relayed once more.
/// Once for a burst of such pulls ([`super::reregistrations`]).
///
/// A pull refused for naming a newer subscription than the broker's (`SUBSCRIPTION_NOT_LATEST`, `refusal`) is
/// cured only by a heartbeat carrying that version. A 4.x client's rebalance gives the subscription a new
/// version, starts the pulls and then sends that heartbeat, so it is often on its way: the pull waits for it
/// here, up to [`NEWER_SUBSCRIPTION_WAIT`]. So does a pull refused for a group the broker does not know when no
/// heartbeat of the group reached popgate yet (a consumer that started before its topic had a route sends its
/// first heartbeat to the brokers in that rebalance). When it does not come, the client skipped it (it skips a heartbeat
/// while another of its own is under way) and only its next one brings the version: registering the older ones
/// again would change nothing, and is not done ([`with_the_groups_subscription`] serves the pull then).
async fn register_again(front: &Front, request: &RemotingCommand, refusal: i32, addr: &str) -> bool {
    let Some(group) = field(request, "consumerGroup") else { return false };
    let topic = field(request, "topic").unwrap_or_default();
    let newer = field(request, "subVersion")
        .and_then(|v| v.parse::<i64>().ok())
        .filter(|_| refusal == codes::SUBSCRIPTION_NOT_LATEST);
    let will_do = |registrations: &[Registration]| match newer {
        Some(version) => registrations.iter().any(|r| r.subscribes_at_least(group, topic, version)),
        None => !registrations.is_empty(),
    };
    let Some(registrations) = registrations_once(front, group, will_do).await else { return false };
    let version = newer.unwrap_or(0);
    front.reregistrations.once(group, addr, version, || pass_on(front, group, registrations, addr)).await
}

/// How long a pull refused for a subscription its broker does not have waits for the heartbeat carrying it
/// ([`register_again`]); the client itself tries such a pull again 3 s later.
const NEWER_SUBSCRIPTION_WAIT: Duration = Duration::from_secs(2);

/// Consumer group `group`'s members' last heartbeats once they `will_do`, looked at every 50 ms for
/// [`NEWER_SUBSCRIPTION_WAIT`]; `None` when they did not come.
async fn registrations_once(
    front: &Front,
    group: &str,
    will_do: impl Fn(&[Registration]) -> bool,
) -> Option<Vec<Registration>> {
    let deadline = tokio::time::Instant::now() + NEWER_SUBSCRIPTION_WAIT;
    loop {
        let registrations = front.clients.registrations_of(group);
        if will_do(&registrations) {
            return Some(registrations);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Passes `registrations` (consumer group `group`'s members' last heartbeats) on to broker `addr` again.
async fn pass_on(front: &Front, group: &str, registrations: Vec<Registration>, addr: &str) -> bool {
    let timeout = front.config.broker.request_timeout();
    let mut taken = false;
    for registration in registrations {
        let answer = front.broker.relay(addr, &registration.command(), timeout).await;
        let ok = answer.is_ok_and(|answer| answer.code() == codes::SUCCESS);
        counter!(m::REMOTING_REREGISTRATIONS, "result" => if ok { "ok" } else { "failed" }).increment(1);
        taken |= ok;
    }
    tracing::info!(
        group,
        broker = addr,
        taken,
        "A broker did not have a consumer group's subscription (its connection to popgate closed, or a pull \
         came before a new subscription): registered the group again there."
    );
    taken
}

/// Pauses before relaying a one-way request again.
const ONE_WAY_RETRY_PAUSES: [Duration; 2] = [Duration::from_millis(200), Duration::from_millis(1_000)];

/// An answer, and who gave it.
struct Relayed {
    command: RemotingCommand,
    by: AnsweredBy,
}

/// Who gave a relayed request's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AnsweredBy {
    /// The broker that owns the queue.
    Broker,
    /// popgate, refusing the request (its signature's scopes, a header it cannot read).
    Popgate,
    /// popgate, which could not reach the broker or learn where it is.
    Unreachable,
}

impl Relayed {
    /// popgate's answer when it could not reach the broker (or learn where it is).
    fn unreachable(command: RemotingCommand) -> Relayed {
        Relayed { command, by: AnsweredBy::Unreachable }
    }

    fn code(&self) -> i32 {
        self.command.code()
    }
}

impl From<RemotingCommand> for Relayed {
    fn from(command: RemotingCommand) -> Relayed {
        Relayed { command, by: AnsweredBy::Popgate }
    }
}

async fn relayed(front: &Front, request: &RemotingCommand) -> Relayed {
    let code = request.code();
    let label = codes::request_label(code);
    let broker_name = match broker_of(front, request).await {
        Ok(name) => name,
        Err(why) => return error(codes::SYSTEM_ERROR, why).into(),
    };
    let addr = match master_addr(front, &broker_name).await {
        Ok(addr) => addr,
        Err(answer) => return Relayed::unreachable(answer),
    };
    let timeout = relay_timeout(front, code, request);
    let mut relayed = relay_counted(front, label, &addr, request, timeout).await;
    if lost_its_registration(request, &relayed) && register_again(front, request, relayed.code(), &addr).await {
        relayed = relay_counted(front, label, &addr, request, timeout).await;
    }
    if still_not_latest(request, &relayed) {
        if let Some(with_subscription) = with_the_groups_subscription(front, request) {
            relayed = relay_counted(front, label, &addr, &with_subscription, timeout).await;
        }
    }
    if no_offset_yet(request, &relayed) {
        relayed = offset_of_a_new_group(front, request, &broker_name, &addr, relayed).await;
    }
    // At debug: what a consumer asked of which broker and what it was told (offsets, chiefly).
    tracing::debug!(
        code = label,
        broker = %broker_name,
        fields = ?request.ext_fields(),
        answer = relayed.command.code(),
        answer_fields = ?relayed.command.ext_fields(),
        remark = ?relayed.command.remark(),
        "Relayed a request to its broker."
    );
    relayed
}

async fn relay_counted(
    front: &Front,
    label: &'static str,
    addr: &str,
    request: &RemotingCommand,
    timeout: Duration,
) -> Relayed {
    match front.broker.relay(addr, request, timeout).await {
        Ok(answer) => {
            counter!(m::REMOTING_RELAYS, "code" => label, "result" => "ok").increment(1);
            Relayed { command: answer_from(answer), by: AnsweredBy::Broker }
        }
        Err(failure) => {
            counter!(m::REMOTING_RELAYS, "code" => label, "result" => "unreachable").increment(1);
            Relayed::unreachable(error(
                codes::SYSTEM_ERROR,
                format!("popgate could not reach broker {addr}: {failure}"),
            ))
        }
    }
}

/// A held pull may take its suspend time at the broker; everything else the usual request timeout.
fn relay_timeout(front: &Front, code: i32, request: &RemotingCommand) -> Duration {
    let usual = front.config.broker.request_timeout();
    if code != codes::PULL_MESSAGE && code != codes::LITE_PULL_MESSAGE {
        return usual;
    }
    let suspend = field(request, "suspendTimeoutMillis").and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // The client waits 30 s for a held pull at most; a longer suspend is not one it would wait for.
    usual.max(Duration::from_millis(suspend.min(30_000)) + PULL_ANSWER_MARGIN)
}

/// The answer to give the client for a peer's `answer`: its code, remark, header fields and body.
pub(super) fn answer_from(mut answer: RemotingCommand) -> RemotingCommand {
    let mut reply = RemotingCommand::create_response_command_with_code(answer.code())
        .set_remark_option(answer.remark().cloned())
        .set_version(answer.version());
    if let Some(fields) = answer.ext_fields() {
        reply = reply.set_ext_fields(fields.clone());
    }
    if let Some(body) = answer.take_body() {
        reply = reply.set_body(body);
    }
    reply
}

/// What a queue request names: its broker (when the client says), topic and queue.
struct QueueTarget {
    broker: Option<String>,
    topic: Option<String>,
    queue_id: Option<i32>,
}

/// The body of `CHECK_CLIENT_CONFIG` (`CheckClientRequestBody`), as far as popgate reads it.
#[derive(Deserialize)]
struct CheckClientBody {
    group: String,
}

/// The body of `LOCK_BATCH_MQ` / `UNLOCK_BATCH_MQ`, as far as popgate reads it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LockBody {
    consumer_group: String,
    #[serde(default)]
    mq_set: Vec<LockedQueue>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LockedQueue {
    topic: String,
    broker_name: String,
    queue_id: i32,
}

impl QueueTarget {
    fn of(request: &RemotingCommand) -> Result<QueueTarget, String> {
        let code = request.code();
        if code == codes::LOCK_BATCH_MQ || code == codes::UNLOCK_BATCH_MQ {
            let body = request.body().ok_or("a queue lock request without a body")?;
            let lock: LockBody = serde_json::from_slice(body)
                .map_err(|e| format!("the queue lock request's body does not decode: {e}"))?;
            let first = lock.mq_set.first();
            return Ok(QueueTarget {
                broker: first.map(|q| q.broker_name.clone()),
                topic: first.map(|q| q.topic.clone()),
                queue_id: first.map(|q| q.queue_id),
            });
        }
        let topic_field = if code == codes::CONSUMER_SEND_MSG_BACK { "originTopic" } else { "topic" };
        Ok(QueueTarget {
            broker: field(request, "bname").or_else(|| field(request, "brokerName")).map(str::to_owned),
            topic: field(request, topic_field).map(str::to_owned),
            queue_id: field(request, "queueId").and_then(|q| q.parse().ok()),
        })
    }
}

/// The broker `request` is for: the one it names, else the only broker of its topic with its queue.
pub(super) async fn broker_of(front: &Front, request: &RemotingCommand) -> Result<String, String> {
    let target = QueueTarget::of(request)?;
    match &target.broker {
        Some(name) => Ok(name.clone()),
        None => broker_of_queue(front, &target).await,
    }
}

/// The address of broker `name`'s master, or popgate's answer saying it has none now.
pub(super) async fn master_addr(front: &Front, name: &str) -> Result<String, RemotingCommand> {
    match masters(front).await.map(|m| m.get(name).cloned()) {
        Ok(Some(addr)) => Ok(addr),
        Ok(None) => {
            front.forget_masters();
            Err(error(codes::SERVICE_NOT_AVAILABLE, format!("broker `{name}` has no master now")))
        }
        Err(why) => Err(error(codes::SYSTEM_ERROR, format!("popgate has no broker list: {why}"))),
    }
}

/// The broker a request that does not name one is for: the only broker of the topic with that queue.
async fn broker_of_queue(front: &Front, target: &QueueTarget) -> Result<String, String> {
    let topic = target.topic.as_deref().ok_or("the request names neither its broker (bname) nor its topic")?;
    let route = front
        .publisher
        .existing_topic(topic)
        .await?
        .ok_or_else(|| format!("topic[{topic}] not exist, apply first please!"))?;
    let queue_id = target.queue_id.and_then(|q| u32::try_from(q).ok());
    let candidates: Vec<&str> = route
        .brokers
        .iter()
        .filter(|b| queue_id.is_none_or(|q| q < b.read_queues.max(b.write_queues)))
        .map(|b| b.name.as_str())
        .collect();
    match candidates.as_slice() {
        [only] => Ok((*only).to_owned()),
        [] => Err(format!("topic `{topic}` has no queue {:?} on any broker", target.queue_id)),
        several => Err(format!(
            "the request does not name its broker (a client before 4.9.5), and topic `{topic}` has this queue on \
             {} brokers ({}): use a client of 4.9.5 or later",
            several.len(),
            several.join(", ")
        )),
    }
}

/// The cluster's master brokers by name, reused for a few seconds.
async fn masters(front: &Front) -> Result<HashMap<String, String>, String> {
    if let Some(masters) = front.cached_masters(MASTERS_TTL) {
        return Ok(masters);
    }
    let masters: HashMap<String, String> = front
        .broker
        .cluster_masters()
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|m| (m.name, m.addr))
        .collect();
    front.remember_masters(masters.clone());
    Ok(masters)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readmes_table_of_what_a_relayed_request_needs_is_made_from_the_relay_table() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README.md");
        let table = needs_table();
        assert!(readme.contains(&table), "README.md's table of what a relayed request needs must read:\n{table}");
    }

    #[test]
    fn a_code_not_in_the_relay_table_is_refused_and_one_without_its_names_too() {
        let caller = Caller::of_scoped_test_token("app", "t", "g", "t");
        let refused = permission(&caller, &RemotingCommand::create_remoting_command(codes::VIEW_MESSAGE_BY_ID));
        assert_eq!(refused.map_err(|r| r.code), Err(codes::REQUEST_CODE_NOT_SUPPORTED));
        let nameless = permission(&caller, &RemotingCommand::create_remoting_command(codes::GET_MAX_OFFSET));
        assert_eq!(nameless.map_err(|r| r.code), Err(codes::SYSTEM_ERROR));
        let mut own = RemotingCommand::create_remoting_command(codes::GET_MAX_OFFSET);
        own.add_ext_field("topic", "t");
        assert!(permission(&caller, &own).is_ok());
        let mut other = RemotingCommand::create_remoting_command(codes::GET_MAX_OFFSET);
        other.add_ext_field("topic", "payroll");
        assert_eq!(permission(&caller, &other).map_err(|r| r.code), Err(codes::NO_PERMISSION));
    }
}
