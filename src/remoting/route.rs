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
//!
//! The name server's answers are cached, as Apache's proxy caches routes: for `broker.route_ttl_ms` (a topic's
//! absence for a second, so a topic created just now is seen soon), at most [`MAX_CACHED_TOPICS`] topics. Every
//! client asks for the route of each of its topics every 30 s and on every start, and a busy name server made a
//! client's first send wait out its timeout; a flood of route requests costs popgate no name-server request
//! per frame either. When the name server cannot be asked, a route up to [`STALE_FOR`] old is given instead.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::counter;
use moka::ops::compute::Op;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use rocketmq_protocol::protocol::route::topic_route_data::TopicRouteData;

use super::codes;
use super::ports;
use super::service::{error, field, Front};
use crate::metrics as m;

/// The broker id of a master in a route's broker addresses.
const MASTER_ID: u64 = 0;
/// The most topics whose answers are cached.
const MAX_CACHED_TOPICS: u64 = 10_000;
/// How long the name server's answer that a topic does not exist is given again.
const ABSENCE_FRESH_FOR: Duration = Duration::from_secs(1);
/// How long a route is kept to be given while the name server cannot be asked (Apache's proxy: 300 s).
const STALE_FOR: Duration = Duration::from_secs(300);

/// What the name server answered about a topic.
#[derive(Clone)]
enum NameServerAnswer {
    /// Its route.
    Route(Arc<TopicRouteData>),
    /// Anything else (`TOPIC_NOT_EXIST`): its code and remark.
    Other { code: i32, remark: Option<cheetah_string::CheetahString> },
}

/// The name server's recent answers, by topic.
pub(super) struct RouteCache {
    answers: moka::sync::Cache<String, (Instant, NameServerAnswer)>,
    fresh_for: Duration,
}

impl RouteCache {
    /// A cache whose routes are given again for `fresh_for`.
    pub(super) fn new(fresh_for: Duration) -> RouteCache {
        let answers = moka::sync::Cache::builder().max_capacity(MAX_CACHED_TOPICS).time_to_live(STALE_FOR).build();
        RouteCache { answers, fresh_for }
    }

    fn fresh(&self, topic: &str) -> Option<NameServerAnswer> {
        let (fetched, answer) = self.answers.get(topic)?;
        let fresh_for = if matches!(answer, NameServerAnswer::Route(_)) { self.fresh_for } else { ABSENCE_FRESH_FOR };
        (fetched.elapsed() < fresh_for).then_some(answer)
    }

    /// Forgets the name server's answer that `topic` does not exist, when that is what is cached: the topic was
    /// created since (a broker creates a consumer group's retry topic as it takes the group's heartbeat).
    pub(super) fn forget_absence(&self, topic: &str) {
        let _ = self.answers.entry_by_ref(topic).and_compute_with(|cached| match cached {
            Some(cached) if matches!(cached.value().1, NameServerAnswer::Other { .. }) => Op::Remove,
            _ => Op::Nop,
        });
    }

    fn stale_route(&self, topic: &str) -> Option<NameServerAnswer> {
        self.answers.get(topic).map(|(_, answer)| answer).filter(|a| matches!(a, NameServerAnswer::Route(_)))
    }
}

pub(super) async fn topic_route(front: &Arc<Front>, request: &RemotingCommand) -> RemotingCommand {
    let Some(topic) = field(request, "topic") else {
        return error(codes::SYSTEM_ERROR, "the request names no topic".to_owned());
    };
    let answer = match front.routes.fresh(topic) {
        Some(answer) => {
            counter!(m::REMOTING_ROUTE_ANSWERS, "source" => "cache").increment(1);
            answer
        }
        None => match ask_name_server(front, request).await {
            Ok(answer) => {
                counter!(m::REMOTING_ROUTE_ANSWERS, "source" => "name_server").increment(1);
                front.routes.answers.insert(topic.to_owned(), (Instant::now(), answer.clone()));
                answer
            }
            Err(why) => match front.routes.stale_route(topic) {
                Some(answer) => {
                    tracing::warn!(topic, error = %why, "The name server could not be asked; a cached route was given.");
                    counter!(m::REMOTING_ROUTE_ANSWERS, "source" => "stale").increment(1);
                    answer
                }
                None => return error(codes::SYSTEM_ERROR, why),
            },
        },
    };
    let route = match answer {
        NameServerAnswer::Route(route) => route,
        NameServerAnswer::Other { code, remark } => {
            return RemotingCommand::create_response_command_with_code(code).set_remark_option(remark)
        }
    };
    match rewritten(front, TopicRouteData::clone(&route), ports::names_its_broker(request)).await {
        Ok(body) => RemotingCommand::create_success_response_command().set_body(body),
        Err(why) => error(codes::SYSTEM_ERROR, format!("popgate could not give the name server's route: {why}")),
    }
}

/// The name server's answer to `request`, or why there is none.
async fn ask_name_server(front: &Front, request: &RemotingCommand) -> Result<NameServerAnswer, String> {
    let timeout = front.config.broker.request_timeout();
    let answer = front
        .broker
        .relay_to_name_server(request, timeout)
        .await
        .map_err(|failure| format!("popgate could not ask the name server: {failure}"))?;
    match answer.body().filter(|_| answer.code() == codes::SUCCESS) {
        Some(body) => TopicRouteData::decode(body)
            .map(|route| NameServerAnswer::Route(Arc::new(route)))
            .map_err(|why| format!("popgate could not read the name server's route: {why}")),
        None => Ok(NameServerAnswer::Other { code: answer.code(), remark: answer.remark().cloned() }),
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
    fn a_million_topic_names_keep_the_route_cache_under_its_bound() {
        let cache = RouteCache::new(Duration::from_secs(30));
        let absent = NameServerAnswer::Other { code: codes::TOPIC_NOT_EXIST, remark: None };
        for n in 0..1_000_000 {
            cache.answers.insert(format!("flood_{n}"), (Instant::now(), absent.clone()));
        }
        cache.answers.run_pending_tasks();
        let kept = cache.answers.entry_count();
        assert!(kept <= MAX_CACHED_TOPICS, "{kept} topics kept, the bound is {MAX_CACHED_TOPICS}");
    }

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
