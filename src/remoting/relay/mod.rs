//! Consumers' requests: the client lifecycle popgate answers itself (heartbeats, group membership), and the
//! queue requests the broker owning the queue must answer (pulls, offsets, queue locks, send-backs), relayed
//! to it unchanged, as Apache's proxy relays them.
//!
//! Which broker a queue request is for: the client names it (`bname`, from client 4.9.5 on; the broker name
//! in a lock request's queues). An older client does not; popgate then finds the broker itself from the
//! topic's route: the one broker that has a queue of that id. A topic with a queue of that id on several
//! brokers cannot be told apart, and the request is refused saying so.

mod permission;
mod refused;

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

use self::permission::*;
pub(super) use self::permission::{permission, stored_message};
use self::refused::*;

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
    if no_offset_yet(front, request, &relayed) {
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
    let relayed = if codes::repeat_is_harmless(request.code()) {
        front.broker.relay_repeatable(addr, request, timeout).await
    } else {
        front.broker.relay(addr, request, timeout).await
    };
    match relayed {
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
