//! The name-server request a remoting client makes: `GET_ROUTEINFO_BY_TOPIC`. The name server's own answer is
//! passed on with each broker's address replaced by popgate's, as Apache's proxy answers it: the client keeps
//! the cluster's real brokers and queues (it still chooses a queue, and rebalances a group's queues), but
//! every request it then makes to a broker comes here. The broker names stay, so popgate knows which broker
//! a request is for; only the master is given, so the client never asks for a slave popgate does not relay to.
//!
//! An unknown topic gets the name server's own answer (`TOPIC_NOT_EXIST`), which the client reads as "no
//! route yet" (a producer then borrows the auto-create topic's route, as straight at the cluster).

use std::collections::HashMap;

use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use rocketmq_protocol::protocol::route::topic_route_data::TopicRouteData;

use super::codes;
use super::relay::answer_from;
use super::service::{error, Front};

/// The broker id of a master in a route's broker addresses.
const MASTER_ID: u64 = 0;

pub(super) async fn topic_route(front: &Front, request: &RemotingCommand) -> RemotingCommand {
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
    match rewritten(body, &front.advertised) {
        Ok(body) => RemotingCommand::create_success_response_command().set_body(body),
        Err(why) => error(codes::SYSTEM_ERROR, format!("popgate could not read the name server's route: {why}")),
    }
}

/// The route in `body` with popgate's address `advertised` as every broker's master address (and no slaves).
fn rewritten(body: &[u8], advertised: &str) -> Result<Vec<u8>, String> {
    let mut route = TopicRouteData::decode(body).map_err(|e| e.to_string())?;
    for broker in &mut route.broker_datas {
        let has_master = broker.broker_addrs().contains_key(&MASTER_ID);
        let addrs: HashMap<u64, _> =
            if has_master { HashMap::from([(MASTER_ID, advertised.into())]) } else { HashMap::new() };
        broker.set_broker_addrs(addrs);
    }
    route.encode_standard_json().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_master_address_becomes_popgates_and_slaves_are_dropped() {
        // What the name server writes (fastjson): numeric keys unquoted.
        let body = br#"{"brokerDatas":[{"brokerAddrs":{0:"10.0.0.1:10911",1:"10.0.0.2:10911"},"brokerName":"broker-a","cluster":"c","enableActingMaster":false},{"brokerAddrs":{1:"10.0.0.3:10911"},"brokerName":"broker-b","cluster":"c","enableActingMaster":false}],"filterServerTable":{},"queueDatas":[{"brokerName":"broker-a","perm":6,"readQueueNums":4,"topicSysFlag":0,"writeQueueNums":4}]}"#;
        let route = TopicRouteData::decode(&rewritten(body, "127.0.0.1:9876").expect("rewritten")).expect("decodes");
        let a = route.broker_datas.iter().find(|b| b.broker_name() == "broker-a").expect("broker-a");
        assert_eq!(a.broker_addrs().len(), 1);
        assert_eq!(a.broker_addrs().get(&0).map(|a| a.as_str()), Some("127.0.0.1:9876"));
        let b = route.broker_datas.iter().find(|b| b.broker_name() == "broker-b").expect("broker-b");
        assert!(b.broker_addrs().is_empty(), "a broker without a master gets no address");
        assert_eq!(route.queue_datas.len(), 1);
        assert_eq!(route.queue_datas[0].write_queue_nums(), 4);
    }
}
