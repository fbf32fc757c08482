//! `QueryRoute`: the topic's queues as the cluster has them, each served by popgate itself. The broker
//! entries carry the endpoints the client dialled, so the SDK sends everything back to popgate (it would dial
//! the brokers' remoting ports otherwise, which speak no gRPC). Only a caller that may publish to or read the
//! topic learns its route ([`gateway::may_look_up`]).

use super::names;
use super::proto::{self as pb, Code, MessageType, Permission};
use super::service::Front;
use super::status::{bad, ok, refused, status};
use crate::auth::Caller;
use crate::gateway;

/// The message types popgate's queues accept on every topic. Transactional messages too on a topic typed
/// TRANSACTION or MIXED (`message.type`), as Apache's proxy: the SDK refuses them itself elsewhere. (Apache's
/// proxy lists a topic's own type only; popgate takes the other types on every topic.)
const ACCEPTED_TYPES: [MessageType; 3] = [MessageType::Normal, MessageType::Fifo, MessageType::Delay];

/// The types a queue of `topic` (route `route`) accepts.
pub(super) async fn accepted_types(front: &Front, topic: &str, route: &crate::publish::TopicRoute) -> Vec<i32> {
    let mut types: Vec<i32> = ACCEPTED_TYPES.iter().map(|t| *t as i32).collect();
    // A topic whose type cannot be read takes no transactions until it can; every topic does when the check is
    // switched off.
    let unchecked = !front.publisher.checks_topic_message_type();
    if unchecked || front.publisher.topic_message_type(topic, route).await.is_ok_and(|t| t.takes_transactions()) {
        types.push(MessageType::Transaction as i32);
    }
    types
}

/// `caller`'s route of the topic `request` names. The caller's grants are checked before the name server is
/// asked, as Apache's proxy checks them first: a topic the caller may not use is refused whether it exists or not.
pub(super) async fn query_route(
    front: &Front,
    caller: &Caller,
    request: pb::QueryRouteRequest,
) -> pb::QueryRouteResponse {
    let answer = |status| pb::QueryRouteResponse { status: Some(status), message_queues: vec![] };
    if let Err(refusal) = names::topic(request.topic.as_ref()) {
        return answer(refusal);
    }
    let topic = request.topic.unwrap_or_default();
    if let Err(refusal) = gateway::may_look_up(caller, &topic.name) {
        return answer(refused(&refusal));
    }
    let Some(endpoints) = request.endpoints else {
        return answer(bad(Code::IllegalAccessPoint, "the request names no endpoints"));
    };
    let route = match front.publisher.existing_topic(&topic.name).await {
        Ok(Some(route)) => route,
        Ok(None) => return answer(status(Code::TopicNotFound, format!("topic `{}` does not exist", topic.name))),
        Err(error) => {
            return answer(status(Code::InternalServerError, format!("the name server did not answer: {error}")))
        }
    };
    let accept_message_types = accepted_types(front, &topic.name, &route).await;
    let mut message_queues = Vec::new();
    for broker in &route.brokers {
        for queue_id in 0..broker.write_queues.max(broker.read_queues) {
            let permission = match (queue_id < broker.read_queues, queue_id < broker.write_queues) {
                (true, true) => Permission::ReadWrite,
                (true, false) => Permission::Read,
                (false, true) => Permission::Write,
                (false, false) => Permission::None,
            };
            message_queues.push(pb::MessageQueue {
                topic: Some(topic.clone()),
                id: i32::try_from(queue_id).unwrap_or(i32::MAX),
                permission: permission as i32,
                broker: Some(pb::Broker { name: broker.name.clone(), id: 0, endpoints: Some(endpoints.clone()) }),
                accept_message_types: accept_message_types.clone(),
            });
        }
    }
    pb::QueryRouteResponse { status: Some(ok()), message_queues }
}
