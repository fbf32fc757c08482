//! What popgate does when a broker refuses a relayed pull or offset query that it can still serve: the group's
//! registration lost (popgate's connection to the broker closed) or older than the pull's, a new group's offset
//! in a queue that got its first message between two relays. Each is registered again or asked again, once.

use super::*;

/// Whether `answer` to pull `request` says the broker does not have the consumer group's subscription, or has
/// an older one than the pull names: it forgot the group (its connection to popgate closed), or the pull came
/// before the heartbeat with a new subscription reached it.
pub(in crate::remoting) fn lost_its_registration(request: &RemotingCommand, answer: &Relayed) -> bool {
    let pull = matches!(request.code(), codes::PULL_MESSAGE | codes::LITE_PULL_MESSAGE);
    let lost = matches!(answer.code(), codes::SUBSCRIPTION_NOT_EXIST | codes::SUBSCRIPTION_NOT_LATEST);
    pull && lost && answer.by == AnsweredBy::Broker
}

/// Whether `answer` to offset query `request` is the broker's "no offset" (`QUERY_NOT_FOUND`) that the client's
/// own rebalance takes as "start where the queue is now" ([`offset_of_a_new_group`]): not when the client asked
/// for exactly that answer (`setZeroIfNotFound` false), nor for a group none of whose members here subscribes
/// to the topic.
///
/// A push consumer (and a lite pull consumer) subscribes, and its rebalance picks where a new group starts. A
/// `DefaultMQPullConsumer` subscribes to nothing: its `fetchConsumeOffset` hands the broker's answer to the app
/// (-1 for "no offset"), which decides what to pull, so it gets that answer as straight at the broker. Apache's
/// e2e `PullOrderParamTest` (client 4.9.3 and 5.4.0) pulls, for 30 s each, every queue whose offset is not -1:
/// told 0 for the 7 empty queues of its 8, it outlasted its 60 s wait.
pub(in crate::remoting) fn no_offset_yet(front: &Front, request: &RemotingCommand, answer: &Relayed) -> bool {
    request.code() == codes::QUERY_CONSUMER_OFFSET
        && answer.by == AnsweredBy::Broker
        && answer.code() == codes::QUERY_NOT_FOUND
        && field(request, "setZeroIfNotFound") != Some("false")
        && subscribed_here(front, request)
}

/// Whether a member of offset query `request`'s group, by its last heartbeat here, subscribes to its topic.
fn subscribed_here(front: &Front, request: &RemotingCommand) -> bool {
    let (Some(group), Some(topic)) = (field(request, "consumerGroup"), field(request, "topic")) else {
        return false;
    };
    front.clients.registrations_of(group).iter().any(|registration| registration.subscription(group, topic).is_some())
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
pub(in crate::remoting) async fn offset_of_a_new_group(
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
pub(in crate::remoting) fn still_not_latest(request: &RemotingCommand, answer: &Relayed) -> bool {
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
pub(in crate::remoting) fn with_the_groups_subscription(
    front: &Front,
    request: &RemotingCommand,
) -> Option<RemotingCommand> {
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
pub(in crate::remoting) async fn register_again(
    front: &Front,
    request: &RemotingCommand,
    refusal: i32,
    addr: &str,
) -> bool {
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
pub(in crate::remoting) const NEWER_SUBSCRIPTION_WAIT: Duration = Duration::from_secs(2);

/// Consumer group `group`'s members' last heartbeats once they `will_do`, looked at every 50 ms for
/// [`NEWER_SUBSCRIPTION_WAIT`]; `None` when they did not come.
pub(in crate::remoting) async fn registrations_once(
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
pub(in crate::remoting) async fn pass_on(
    front: &Front,
    group: &str,
    registrations: Vec<Registration>,
    addr: &str,
) -> bool {
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
