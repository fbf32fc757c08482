//! The name-server request a remoting client makes: `GET_ROUTEINFO_BY_TOPIC`. The name server's own answer is
//! passed on with each broker's address replaced by popgate's, as Apache's proxy answers it: the client keeps
//! the cluster's real brokers and queues (it still chooses a queue, and rebalances a group's queues), but
//! every request it then makes to a broker comes here. The broker names stay, so popgate knows which broker
//! a request is for; only the master is given, so the client never asks for a slave popgate does not relay to.
//!
//! A client before 4.9.5 does not name the broker in its requests: it is given each broker's own port on
//! popgate instead ([`super::ports`]).
//!
//! An unknown topic gets the name server's own answer (`TOPIC_NOT_EXIST`), which the client reads as "no
//! route yet" (a producer then borrows the auto-create topic's route, as straight at the cluster).

use std::collections::HashMap;
use std::sync::Arc;

use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use rocketmq_protocol::protocol::route::topic_route_data::TopicRouteData;

use super::codes;
use super::ports;
use super::relay::answer_from;
use super::service::{error, Front};

/// The broker id of a master in a route's broker addresses.
const MASTER_ID: u64 = 0;

pub(super) async fn topic_route(front: &Arc<Front>, request: &RemotingCommand) -> RemotingCommand {
    let timeout = front.config.broker.request_timeout();
    let answer = match front.broker.relay_to_name_server(request, timeout).await {
        Ok(answer) => answer,
        Err(failure) => {
            return error(codes::SYSTEM_ERROR, format!("popgate could not ask the name server: {failure}"));
        }
    };
    if answer.code() != codes::SUCCESS {
        return answer_from(answer);
    }
    let Some(body) = answer.body() else { return answer_from(answer) };
    let rewritten = match TopicRouteData::decode(body) {
        Ok(route) => rewritten(front, route, ports::names_its_broker(request)).await,
        Err(why) => Err(why.to_string()),
    };
    match rewritten {
        Ok(body) => RemotingCommand::create_success_response_command().set_body(body),
        Err(why) => error(codes::SYSTEM_ERROR, format!("popgate could not give the name server's route: {why}")),
    }
}

/// `route` with popgate's address as every broker's master address (and no slaves): the front's own one, or,
/// for a client that does not name its brokers, each broker's own port.
async fn rewritten(front: &Arc<Front>, mut route: TopicRouteData, names_its_broker: bool) -> Result<Vec<u8>, String> {
    for broker in &mut route.broker_datas {
        let addr = if names_its_broker {
            front.advertised.clone()
        } else {
            front.broker_ports.address_of(front, broker.broker_name()).await?
        };
        broker.set_broker_addrs(master_only(broker.broker_addrs(), addr));
    }
    route.encode_standard_json().map_err(|e| e.to_string())
}

/// A broker's addresses given as `addr` for its master, and none for its slaves (and none at all without a
/// master).
fn master_only<V>(addrs: &HashMap<u64, V>, addr: String) -> HashMap<u64, cheetah_string::CheetahString> {
    if addrs.contains_key(&MASTER_ID) {
        HashMap::from([(MASTER_ID, addr.into())])
    } else {
        HashMap::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_master_address_becomes_popgates_and_slaves_are_dropped() {
        // What the name server writes (fastjson): numeric keys unquoted.
        let body = br#"{"brokerDatas":[{"brokerAddrs":{0:"10.0.0.1:10911",1:"10.0.0.2:10911"},"brokerName":"broker-a","cluster":"c","enableActingMaster":false},{"brokerAddrs":{1:"10.0.0.3:10911"},"brokerName":"broker-b","cluster":"c","enableActingMaster":false}],"filterServerTable":{},"queueDatas":[{"brokerName":"broker-a","perm":6,"readQueueNums":4,"topicSysFlag":0,"writeQueueNums":4}]}"#;
        let route = TopicRouteData::decode(body).expect("decodes");
        let a = route.broker_datas.iter().find(|b| b.broker_name() == "broker-a").expect("broker-a");
        let given = master_only(a.broker_addrs(), "127.0.0.1:9876".to_owned());
        assert_eq!(given.len(), 1);
        assert_eq!(given.get(&0).map(|a| a.as_str()), Some("127.0.0.1:9876"));
        let b = route.broker_datas.iter().find(|b| b.broker_name() == "broker-b").expect("broker-b");
        assert!(
            master_only(b.broker_addrs(), "x:1".to_owned()).is_empty(),
            "a broker without a master gets no address"
        );
        assert_eq!(route.queue_datas.len(), 1);
        assert_eq!(route.queue_datas[0].write_queue_nums(), 4);
    }
}
