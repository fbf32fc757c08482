//! What each relayed request needs of its caller: the one table of the codes popgate relays ([`RELAYED`]),
//! each with the grant it needs, and how a request's group and topics are read to check them with the
//! gateway. popgate signs what it relays with its own cluster credentials, so this table is the cluster's ACL
//! for every app behind popgate.

use super::*;

/// What a relayed request needs of its caller, by request code: the one list of what popgate passes on to a
/// broker or the name server, which it signs with its own cluster credentials. The brokers then refuse nothing
/// popgate lets through, so this list is the cluster's ACL for every app behind popgate. A code that is not
/// here is not relayed. The README's table is made from it ([`needs_table`]; a test checks they agree).
pub(in crate::remoting) const RELAYED: &[(i32, Needs)] = &[
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
pub(in crate::remoting) enum Needs {
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
pub(in crate::remoting) enum TopicIn {
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
pub(in crate::remoting) enum GroupIn {
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
pub(in crate::remoting) fn needs_table() -> String {
    let mut table = String::from("| code | request | needs |\n|---|---|---|\n");
    for (code, needs) in RELAYED {
        let name = codes::request_label(*code).to_ascii_uppercase();
        table.push_str(&format!("| {code} | `{name}` | {} |\n", needs.words()));
    }
    table
}

/// Whether `caller` may have `request` relayed, as [`RELAYED`] says; the refusal otherwise. What only a broker
/// can tell (a send-back's message, a transaction's half message) is checked where the request is relayed.
pub(in crate::remoting) fn permission(caller: &Caller, request: &RemotingCommand) -> Result<(), Refusal> {
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
pub(in crate::remoting) fn heartbeat_permission(caller: &Caller, heartbeat: &Heartbeat) -> Result<(), Refusal> {
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
pub(in crate::remoting) async fn send_back_permission(
    front: &Front,
    caller: &Caller,
    request: &RemotingCommand,
) -> Result<(), Refusal> {
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
pub(in crate::remoting) async fn stored_message(
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
pub(in crate::remoting) fn group_named(request: &RemotingCommand, group_in: GroupIn) -> Option<String> {
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
pub(in crate::remoting) fn topics_named(request: &RemotingCommand, topic_in: TopicIn) -> Option<Vec<String>> {
    match topic_in {
        TopicIn::Header(name) => field(request, name).map(|topic| vec![topic.to_owned()]),
        TopicIn::LockBody => request
            .body()
            .and_then(|b| serde_json::from_slice::<LockBody>(b).ok())
            .map(|lock| lock.mq_set.into_iter().map(|queue| queue.topic).collect()),
    }
}
