//! Routes: which brokers serve a topic and with how many queues, asked of the name server and cached for
//! `broker.route_ttl_ms` (bounded caches: topic names come from clients). An unknown topic borrows the route
//! of the auto-create key topic, as the Java producer does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{BrokerClient, AUTO_CREATE_TOPIC_KEY, DEFAULT_TOPIC_QUEUE_NUMS};
use crate::broker::BrokerError;

/// Broker permission bit: the queue accepts writes (`PermName.PERM_WRITE`).
const PERM_WRITE: u32 = 0x1 << 1;
/// Broker permission bit: the queue serves reads (`PermName.PERM_READ`).
const PERM_READ: u32 = 0x1 << 2;

/// One broker that serves a topic, with the master address popgate talks to.
#[derive(Debug, Clone, PartialEq)]
pub struct BrokerRoute {
    /// Broker name (`brokerName`), the unit of fault avoidance.
    pub name: String,
    /// The master's `host:port`.
    pub addr: String,
    /// How many queues of the topic this broker takes writes on (0: not writable).
    pub write_queues: u32,
    /// How many queues of the topic this broker serves reads from (0: not readable).
    pub read_queues: u32,
}

/// The brokers that serve a topic (with a master), sorted by name.
#[derive(Debug, Clone, PartialEq)]
pub struct TopicRoute {
    /// Brokers of the topic.
    pub brokers: Vec<BrokerRoute>,
}

impl TopicRoute {
    /// The brokers that take writes.
    pub fn writable(&self) -> impl Iterator<Item = &BrokerRoute> {
        self.brokers.iter().filter(|b| b.write_queues > 0)
    }

    /// The brokers that serve reads (POP).
    pub fn readable(&self) -> impl Iterator<Item = &BrokerRoute> {
        self.brokers.iter().filter(|b| b.read_queues > 0)
    }
}

#[derive(Clone)]
pub(super) struct CachedRoute {
    route: Arc<TopicRoute>,
    fetched: Instant,
}

/// Most topics whose route (or absence of one) is cached, in each cache: topic names come from clients (a
/// remoting offset request may name any), so the caches are bounded; the least recently used go first.
const MAX_CACHED_ROUTES: u64 = 10_000;

/// A cache of at most [`MAX_CACHED_ROUTES`] topics, whose entries are dropped after `ttl` in any case.
pub(super) fn route_cache<V: Clone + Send + Sync + 'static>(ttl: Duration) -> moka::sync::Cache<String, V> {
    moka::sync::Cache::builder().max_capacity(MAX_CACHED_ROUTES).time_to_live(ttl.max(NO_ROUTE_TTL)).build()
}

/// How long "no such topic" is remembered by [`BrokerClient::existing_route_cached`].
const NO_ROUTE_TTL: Duration = Duration::from_secs(1);

impl BrokerClient {
    /// The writable brokers of `topic`, from the cache when fresh.
    ///
    /// # Errors
    /// [`BrokerError::TopicNotFound`] when the topic has no route and cannot be auto-created; the failure
    /// when no name server answered.
    pub async fn route(&self, topic: &str) -> Result<Arc<TopicRoute>, BrokerError> {
        if let Some(cached) = self.routes.get(topic) {
            if cached.fetched.elapsed() < self.config.route_ttl() {
                return Ok(cached.route.clone());
            }
        }
        let route = Arc::new(self.fetch_route(topic).await?);
        self.routes.insert(topic.to_owned(), CachedRoute { route: route.clone(), fetched: Instant::now() });
        Ok(route)
    }

    /// The current master address of broker `name` of `topic`, when its (cached) route names it.
    pub async fn master_addr(&self, topic: &str, name: &str) -> Option<String> {
        let route = self.route(topic).await.ok()?;
        route.brokers.iter().find(|b| b.name == name).map(|b| b.addr.clone())
    }

    /// Forgets a cached route, so the next send asks the name server again (after a broker failure).
    pub fn invalidate_route(&self, topic: &str) {
        self.routes.invalidate(topic);
        self.exact_routes.invalidate(topic);
    }

    /// [`BrokerClient::existing_route`], answered from a cache: a route for `broker.route_ttl_ms`, the
    /// absence of one for a second (a topic created just now is seen soon).
    ///
    /// # Errors
    /// The failure when no name server answered.
    pub async fn existing_route_cached(&self, topic: &str) -> Result<Option<TopicRoute>, BrokerError> {
        if let Some((route, fetched)) = self.exact_routes.get(topic) {
            let ttl = if route.is_some() { self.config.route_ttl() } else { NO_ROUTE_TTL };
            if fetched.elapsed() < ttl {
                return Ok(route);
            }
        }
        let route = self.existing_route(topic).await?;
        self.exact_routes.insert(topic.to_owned(), (route.clone(), Instant::now()));
        Ok(route)
    }

    /// The route the name server has for exactly `topic` (no auto-create fallback, no cache), or `None`.
    ///
    /// # Errors
    /// The failure when no name server answered.
    pub async fn existing_route(&self, topic: &str) -> Result<Option<TopicRoute>, BrokerError> {
        let data = self
            .pooled()
            .await?
            .handle()
            .topic_route(topic, self.config.request_timeout_ms)
            .await
            .map_err(|e| BrokerError::from_client(e, self.config.request_timeout()))?;
        Ok(data.as_ref().map(brokers_with_master))
    }

    async fn fetch_route(&self, topic: &str) -> Result<TopicRoute, BrokerError> {
        for lookup in [topic, AUTO_CREATE_TOPIC_KEY] {
            if let Some(mut route) = self.existing_route(lookup).await? {
                if lookup == AUTO_CREATE_TOPIC_KEY {
                    // The broker creates the topic with `defaultTopicQueueNums` queues, not TBW102's count:
                    // a queue id beyond that would be refused (the Java producer caps it the same way).
                    for broker in &mut route.brokers {
                        broker.write_queues = broker.write_queues.min(DEFAULT_TOPIC_QUEUE_NUMS as u32);
                        broker.read_queues = broker.read_queues.min(DEFAULT_TOPIC_QUEUE_NUMS as u32);
                    }
                }
                if route.writable().next().is_some() {
                    return Ok(route);
                }
            }
        }
        Err(BrokerError::TopicNotFound(topic.to_owned()))
    }
}

/// The brokers of a route that have a master, with the queues each may be written and read, sorted by
/// name for a stable rotation.
pub(in crate::broker) fn brokers_with_master(
    data: &rocketmq_protocol::protocol::route::topic_route_data::TopicRouteData,
) -> TopicRoute {
    let mut brokers: Vec<BrokerRoute> = data
        .queue_datas
        .iter()
        .filter_map(|q| {
            let broker = data.broker_datas.iter().find(|b| b.broker_name() == &q.broker_name)?;
            let master = broker.broker_addrs().get(&0)?;
            Some(BrokerRoute {
                name: q.broker_name.to_string(),
                addr: master.to_string(),
                write_queues: if q.perm & PERM_WRITE != 0 { q.write_queue_nums } else { 0 },
                read_queues: if q.perm & PERM_READ != 0 { q.read_queue_nums } else { 0 },
            })
        })
        .collect();
    brokers.sort_by(|a, b| a.name.cmp(&b.name));
    TopicRoute { brokers }
}
