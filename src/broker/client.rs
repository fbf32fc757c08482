//! The connection to the RocketMQ cluster, over rocketmq-client-rust.
//!
//! popgate keeps broker *choice* to itself (see [`super::fault`] and the publish path), so this client only
//! ever sends to the one queue it is told, once: a `SEND_MESSAGE` remoting request to the broker address of
//! popgate's own route, with no hidden retry and no hidden route logic. Routes come from the name server and
//! are cached for `broker.route_ttl_ms`.
//!
//! Requests go through a small pool of client handles on one client instance: the crate runs the calls of
//! one handle one at a time, so the pool is what lets concurrent publishes proceed in parallel.
//!
//! POP long-polls run on a second client instance, so they travel on connections of their own. The crate
//! keeps one connection per broker address and client instance, shared by every handle of the instance. A
//! request that times out once written (or while being written) makes the crate close that connection, and
//! the next request opens a new one, so a connection whose answers stopped is never used again; but every
//! other request in flight on it fails too, as "connection failed". On one shared connection a POP that
//! outlived its timeout would fail the sends, ACKs and renewals beside it, and a send failed that way isolates
//! its broker for `network_error_isolation_ms`. The broker also stops reading a connection while the answers
//! it owes on it exceed Netty's write high-water mark (64 KiB; it logs `auto-read is disabled`), so a large
//! POP answer still being read would hold back every request queued behind it.
//!
//! An unknown topic is handled as the Java producer does: when the name server has no route for it, the
//! route of the auto-create key topic `TBW102` is used, and the broker creates the topic on first send if its
//! `autoCreateTopicEnable` is on. When neither route exists, the topic is reported as not found.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cheetah_string::CheetahString;
use rocketmq_client_rust::{
    AclClientRPCHook, ClientConfig, ClientError, ClientInstanceHandle, ClientRpcHook, ClientRuntime,
    ClientRuntimeConfig, SessionCredentials, TelemetryHandle,
};
use rocketmq_error::CanonicalCondition;
use rocketmq_model::common::message::message_client_id_setter::MessageClientIDSetter;
use rocketmq_model::common::sys_flag::message_sys_flag::MessageSysFlag;
use rocketmq_protocol::code::request_code::RequestCode;
use rocketmq_protocol::common::message::message_decoder::{decode_message_id, message_properties_to_string};
use rocketmq_protocol::protocol::header::message_operation_header::send_message_request_header::SendMessageRequestHeader;
use rocketmq_protocol::protocol::header::message_operation_header::send_message_request_header_v2::SendMessageRequestHeaderV2;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};

use super::message::{ClientWire, OutgoingMessage};
use crate::clock::Epoch;
use crate::config::BrokerConfig;

/// The topic whose route a producer borrows for a topic the broker will auto-create.
const AUTO_CREATE_TOPIC_KEY: &str = "TBW102";
/// Broker permission bit: the queue accepts writes (`PermName.PERM_WRITE`).
const PERM_WRITE: u32 = 0x1 << 1;
/// Broker permission bit: the queue serves reads (`PermName.PERM_READ`).
const PERM_READ: u32 = 0x1 << 2;
/// Managed-domain id shared by popgate's client handles.
const CLIENT_DOMAIN: u64 = 7;
/// The client instance of the request pool (routes, sends, ACKs, renewals, admin, PULL).
const REQUEST_INSTANCE: &str = "popgate";
/// The client instance of the POP long-polls ([`BrokerClient::dedicated_handle`]): connections of their own.
const POP_INSTANCE: &str = "popgate-pop";
/// Handles in the request pool: how many broker requests can be in flight at once.
const HANDLE_POOL_SIZE: usize = 32;
/// The broker's answers to SEND_MESSAGE that mean "stored", by store status (`ResponseCode`).
const CODE_SUCCESS: i32 = 0;
const CODE_FLUSH_DISK_TIMEOUT: i32 = 10;
const CODE_SLAVE_NOT_AVAILABLE: i32 = 11;
const CODE_FLUSH_SLAVE_TIMEOUT: i32 = 12;
/// Queues a broker gives a topic it auto-creates from `TBW102`.
const DEFAULT_TOPIC_QUEUE_NUMS: i32 = 4;

/// Why a broker operation failed, in the terms popgate's policies need.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BrokerError {
    /// No answer within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The connection could not be made or broke.
    #[error("broker unreachable: {0}")]
    Unreachable(String),
    /// The broker answered with an error code (`ResponseCode`).
    #[error("broker answered code {code}: {detail}")]
    Response {
        /// The remoting response code.
        code: i32,
        /// What the client reported.
        detail: String,
    },
    /// Neither the topic nor the auto-create key topic has a route: the topic does not exist.
    #[error("topic `{0}` does not exist")]
    TopicNotFound(String),
    /// A failure inside the client (bad argument, not started).
    #[error("client error: {0}")]
    Client(String),
}

/// Response codes after which the Java producer retries on another broker (`retryResponseCodes`).
const RETRIABLE_CODES: [i32; 7] = [17, 1, 2, 14, 16, 204, 205];

/// Response codes in which a broker says it cannot serve now, whatever the message: `SYSTEM_BUSY` (2) and
/// `SERVICE_NOT_AVAILABLE` (14: a slave, a full disk, shutting down).
const BROKER_UNWELL_CODES: [i32; 2] = [2, 14];

impl BrokerError {
    /// A low-cardinality label for metrics (`reason`).
    pub fn reason_label(&self) -> &'static str {
        match self {
            BrokerError::Timeout(_) => "timeout",
            BrokerError::Unreachable(_) => "network",
            BrokerError::Response { .. } => "broker_error",
            BrokerError::TopicNotFound(_) => "no_route",
            BrokerError::Client(_) => "client",
        }
    }

    /// Whether another attempt (on another broker) may succeed: network trouble and the broker codes the
    /// Java producer retries on. Such a failure also isolates the broker in the fault table.
    pub fn is_retriable(&self) -> bool {
        match self {
            BrokerError::Timeout(_) | BrokerError::Unreachable(_) => true,
            BrokerError::Response { code, .. } => RETRIABLE_CODES.contains(code),
            BrokerError::TopicNotFound(_) | BrokerError::Client(_) => false,
        }
    }

    /// Whether the failure is the broker's own: it could not be reached, did not answer in time, or answered that
    /// it is too busy or not serving now. Fault avoidance isolates a broker for these only. A broker that
    /// answered a refusal of the message is well: popgate's fault table is shared by every tenant, and one
    /// tenant's bad message must not steer everybody's sends away from a broker (Apache's producer, too, isolates
    /// a broker for a transport failure, not for a `MQBrokerException`).
    pub fn is_brokers_own_failure(&self) -> bool {
        match self {
            BrokerError::Timeout(_) | BrokerError::Unreachable(_) => true,
            BrokerError::Response { code, .. } => BROKER_UNWELL_CODES.contains(code),
            BrokerError::TopicNotFound(_) | BrokerError::Client(_) => false,
        }
    }

    /// The broker's response code, when the broker answered with one.
    pub fn response_code(&self) -> Option<i32> {
        match self {
            BrokerError::Response { code, .. } => Some(*code),
            _ => None,
        }
    }

    pub(crate) fn from_client(error: ClientError, timeout: Duration) -> BrokerError {
        if let Some(code) = error.broker_response_code() {
            return BrokerError::Response { code, detail: error.to_string() };
        }
        match error.descriptor().condition() {
            CanonicalCondition::DeadlineExceeded => BrokerError::Timeout(timeout),
            CanonicalCondition::Unavailable => BrokerError::Unreachable(error.to_string()),
            _ => BrokerError::Client(error.to_string()),
        }
    }
}

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

/// What the broker said about a stored message.
#[derive(Debug, Clone, PartialEq)]
pub struct SendReceipt {
    /// The client message id (`UNIQ_KEY`).
    pub message_id: String,
    /// The broker's store status (`SEND_OK`, `FLUSH_DISK_TIMEOUT`, …).
    pub status: StoreStatus,
    /// Broker name and queue that stored it.
    pub broker: String,
    /// Queue id within the broker.
    pub queue_id: i32,
    /// Offset within the queue (for a half message: within the broker's half topic).
    pub queue_offset: u64,
    /// Where the broker's commit log holds it (from the offset message id it answered), when it said.
    pub commit_log_offset: Option<i64>,
    /// The offset message id the broker answered (store host and commit-log offset), as a remoting client
    /// reads it (`SendResult.offsetMsgId`).
    pub offset_message_id: Option<String>,
    /// The transaction id the broker answered for a half message.
    pub transaction_id: Option<String>,
}

/// The broker's verdict on storing a message (RocketMQ's `SendStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreStatus {
    /// Stored (and flushed/replicated as the broker is configured).
    SendOk,
    /// Stored in memory, but the synchronous flush to disk timed out.
    FlushDiskTimeout,
    /// Stored on the master, but the synchronous replication to the slave timed out.
    FlushSlaveTimeout,
    /// Stored on the master, but no slave was available to replicate to.
    SlaveNotAvailable,
}

impl StoreStatus {
    /// The status a broker's answer to `SEND_MESSAGE` with response code `code` means; `None` for a refusal.
    pub fn of_response_code(code: i32) -> Option<StoreStatus> {
        match code {
            CODE_SUCCESS => Some(StoreStatus::SendOk),
            CODE_FLUSH_DISK_TIMEOUT => Some(StoreStatus::FlushDiskTimeout),
            CODE_FLUSH_SLAVE_TIMEOUT => Some(StoreStatus::FlushSlaveTimeout),
            CODE_SLAVE_NOT_AVAILABLE => Some(StoreStatus::SlaveNotAvailable),
            _ => None,
        }
    }

    /// The response code a broker answers a send stored this way with (the inverse of `of_response_code`).
    pub fn response_code(self) -> i32 {
        match self {
            StoreStatus::SendOk => CODE_SUCCESS,
            StoreStatus::FlushDiskTimeout => CODE_FLUSH_DISK_TIMEOUT,
            StoreStatus::FlushSlaveTimeout => CODE_FLUSH_SLAVE_TIMEOUT,
            StoreStatus::SlaveNotAvailable => CODE_SLAVE_NOT_AVAILABLE,
        }
    }

    /// RocketMQ's name for the status, as returned to HTTP clients.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreStatus::SendOk => "SEND_OK",
            StoreStatus::FlushDiskTimeout => "FLUSH_DISK_TIMEOUT",
            StoreStatus::FlushSlaveTimeout => "FLUSH_SLAVE_TIMEOUT",
            StoreStatus::SlaveNotAvailable => "SLAVE_NOT_AVAILABLE",
        }
    }
}

#[derive(Clone)]
struct CachedRoute {
    route: Arc<TopicRoute>,
    fetched: Instant,
}

/// Most topics whose route (or absence of one) is cached, in each cache: topic names come from clients (a
/// remoting offset request may name any), so the caches are bounded; the least recently used go first.
const MAX_CACHED_ROUTES: u64 = 10_000;

/// A cache of at most [`MAX_CACHED_ROUTES`] topics, whose entries are dropped after `ttl` in any case.
fn route_cache<V: Clone + Send + Sync + 'static>(ttl: Duration) -> moka::sync::Cache<String, V> {
    moka::sync::Cache::builder().max_capacity(MAX_CACHED_ROUTES).time_to_live(ttl.max(NO_ROUTE_TTL)).build()
}

/// How long "no such topic" is remembered by [`BrokerClient::existing_route_cached`].
const NO_ROUTE_TTL: Duration = Duration::from_secs(1);

/// The process's connection to the RocketMQ cluster. Cheap to share behind an `Arc`.
pub struct BrokerClient {
    config: BrokerConfig,
    producer_group: String,
    /// Handles on one started client instance; requests take them round-robin.
    handles: Vec<ClientInstanceHandle>,
    /// A handle on the started POP instance, held so the instance lives while no POP loop holds one.
    pop_instance: ClientInstanceHandle,
    /// A handle on the started relay instance (the remoting front's relayed requests), and its idle handles.
    relay_instance: ClientInstanceHandle,
    relay_handles: super::relay::RelayHandles,
    next_handle: std::sync::atomic::AtomicUsize,
    runtime: Arc<ClientRuntime>,
    /// Signs every request with `broker.access_key`, when one is given.
    signer: Option<Arc<ClientRpcHook>>,
    routes: moka::sync::Cache<String, CachedRoute>,
    /// What the name server said of exactly one topic (no auto-create fallback), for the checks a receive or
    /// a gRPC route query makes: one name-server request per topic and TTL, not one per call, so thousands of
    /// groups coming and going never saturate the client's requests to the name server.
    exact_routes: moka::sync::Cache<String, (Option<TopicRoute>, Instant)>,
    /// The client crate runs its own Tokio runtime; it lives as long as the client and is dropped last.
    _owner: RuntimeOwner,
}

impl BrokerClient {
    /// Starts the client runtime and a client instance. Does not require a reachable broker: readiness is
    /// reported separately ([`BrokerClient::ping`]).
    ///
    /// # Errors
    /// [`BrokerError::Client`] when the client runtime cannot be created.
    pub async fn connect(config: &BrokerConfig, producer_group: &str) -> Result<BrokerClient, BrokerError> {
        let (owner, runtime) = start_client_runtime()?;
        // One hook for every instance: the crate tells instances apart by it, so each handle must share it.
        let signer = signer(config);
        let handles = (0..HANDLE_POOL_SIZE)
            .map(|_| Self::handle(&runtime, config, &signer, REQUEST_INSTANCE))
            .collect::<Result<Vec<_>, _>>()?;
        // All handles share one client instance: starting it once starts it for all.
        handles[0].start().await.map_err(|e| BrokerError::Client(e.to_string()))?;
        let pop_instance = Self::handle(&runtime, config, &signer, POP_INSTANCE)?;
        pop_instance.start().await.map_err(|e| BrokerError::Client(e.to_string()))?;
        let relay_instance = Self::handle(&runtime, config, &signer, super::relay::RELAY_INSTANCE)?;
        relay_instance.start().await.map_err(|e| BrokerError::Client(e.to_string()))?;
        Ok(BrokerClient {
            config: config.clone(),
            producer_group: producer_group.to_owned(),
            handles,
            pop_instance,
            relay_instance,
            relay_handles: super::relay::RelayHandles::default(),
            next_handle: std::sync::atomic::AtomicUsize::new(0),
            runtime,
            signer,
            routes: route_cache(config.route_ttl()),
            exact_routes: route_cache(config.route_ttl()),
            _owner: owner,
        })
    }

    /// The next handle of the pool.
    pub(crate) fn pooled(&self) -> &ClientInstanceHandle {
        let index = self.next_handle.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.handles.len();
        &self.handles[index]
    }

    /// The timeout of one request that is not a send.
    pub(crate) fn request_timeout(&self) -> Duration {
        self.config.request_timeout()
    }

    /// The configured name server addresses, in order.
    pub(crate) fn namesrv_addrs(&self) -> Vec<String> {
        self.config.namesrv_addrs()
    }

    /// A new handle on the (started) POP client instance, whose connections carry nothing but POPs.
    pub(crate) fn new_pop_handle(&self) -> Result<ClientInstanceHandle, BrokerError> {
        Self::handle(&self.runtime, &self.config, &self.signer, POP_INSTANCE)
    }

    /// A handle on the client instance named `instance`: the crate gives every handle of one instance the
    /// same instance, and so the same connections.
    fn handle(
        runtime: &ClientRuntime,
        config: &BrokerConfig,
        signer: &Option<Arc<ClientRpcHook>>,
        instance: &str,
    ) -> Result<ClientInstanceHandle, BrokerError> {
        let client_config = Self::config_for(config, instance);
        ClientInstanceHandle::get_or_create(runtime, CLIENT_DOMAIN, client_config, signer.clone())
            .map_err(|e| BrokerError::Client(e.to_string()))
    }

    /// What signs popgate's requests to the brokers, when it is given credentials (the one every instance of
    /// popgate's has: a client of the crate's own that joins one must bring the same).
    pub(super) fn signer(&self) -> Option<Arc<ClientRpcHook>> {
        self.signer.clone()
    }

    /// The client config of client instance `instance` (before the crate adds its domain to the name).
    fn config_for(config: &BrokerConfig, instance: &str) -> ClientConfig {
        let mut client_config = ClientConfig::new();
        client_config.set_namesrv_addr(CheetahString::from(config.namesrv_addr.as_str()));
        client_config.set_instance_name(CheetahString::from(instance));
        client_config
    }

    /// A handle on client instance `instance` of popgate's client runtime (created when new).
    pub(super) fn instance_handle(&self, instance: &str) -> Result<ClientInstanceHandle, BrokerError> {
        Self::handle(&self.runtime, &self.config, &self.signer, instance)
    }

    /// The client config of instance `instance`, for a client of the crate's own (a producer) that must
    /// join that instance.
    pub(super) fn client_config(&self, instance: &str) -> ClientConfig {
        Self::config_for(&self.config, instance)
    }

    /// The client runtime, for a client of the crate's own.
    pub(super) fn runtime(&self) -> Arc<ClientRuntime> {
        self.runtime.clone()
    }

    /// The relay instance's idle handles.
    pub(super) fn relay_handles(&self) -> &super::relay::RelayHandles {
        &self.relay_handles
    }

    /// The domain popgate's client instances live in.
    pub(super) fn client_domain(&self) -> u64 {
        CLIENT_DOMAIN
    }

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

    /// Sends `message` to queue `queue_id` of `broker` (at `addr`), once, waiting at most `timeout` for the
    /// broker's answer. A non-OK store status is returned, not turned into an error: the caller's policy
    /// decides what it accepts.
    ///
    /// # Errors
    /// [`BrokerError`] classifying the failure.
    pub async fn send(
        &self,
        message: &OutgoingMessage,
        broker: &BrokerRoute,
        queue_id: i32,
        timeout: Duration,
    ) -> Result<SendReceipt, BrokerError> {
        let (request, message_id) = self.send_request(message, queue_id);
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let response = tokio::time::timeout(
            // The crate enforces the timeout too; this outer bound only guards against a hang inside it.
            timeout + Duration::from_millis(500),
            self.pooled().invoke_remoting(&CheetahString::from(broker.addr.as_str()), request, timeout_ms),
        )
        .await
        .map_err(|_| BrokerError::Timeout(timeout))?
        .map_err(|e| BrokerError::from_client(e, timeout))?;
        let Some(status) = StoreStatus::of_response_code(response.code()) else {
            let detail = response.remark().map(ToString::to_string).unwrap_or_default();
            return Err(BrokerError::Response { code: response.code(), detail });
        };
        let field = |name: &str| response.ext_fields().and_then(|f| f.get(name)).map(ToString::to_string);
        Ok(SendReceipt {
            message_id,
            status,
            broker: broker.name.clone(),
            queue_id: field("queueId").and_then(|q| q.parse().ok()).unwrap_or(queue_id),
            queue_offset: field("queueOffset").and_then(|q| q.parse().ok()).unwrap_or_default(),
            commit_log_offset: field("msgId").and_then(|id| decode_message_id(&id).ok()).map(|id| id.offset),
            offset_message_id: field("msgId"),
            transaction_id: field("transactionId"),
        })
    }

    /// Sends `message` without waiting for the broker's verdict: the request is handed to a background task
    /// and its outcome is only logged (RocketMQ's oneway: no retry, no failure detection).
    pub fn send_oneway(self: &Arc<Self>, message: &OutgoingMessage, broker: &BrokerRoute, queue_id: i32) {
        let client = Arc::clone(self);
        let (message, broker) = (message.clone(), broker.clone());
        tokio::spawn(async move {
            if let Err(error) = client.send(&message, &broker, queue_id, client.config.request_timeout()).await {
                tracing::debug!(%error, broker = %broker.name, "Oneway send failed (not reported to the client).");
            }
        });
    }

    /// A `SEND_MESSAGE` request for `message`, and the client message id (`UNIQ_KEY`) it carries.
    fn send_request(&self, message: &OutgoingMessage, queue_id: i32) -> (RemotingCommand, String) {
        if let Some(wire) = &message.wire {
            return client_send_request(message, wire, queue_id);
        }
        // A message that must keep an id it already has (a DLQ replay) carries it; all others get a new one.
        let message_id = message
            .properties
            .get(super::message::PROPERTY_UNIQ_KEY)
            .cloned()
            .unwrap_or_else(MessageClientIDSetter::create_uniq_id);
        let mut properties = crate_properties(&message.properties);
        properties.insert("UNIQ_KEY".into(), message_id.as_str().into());
        properties.insert("WAIT".into(), "true".into());
        if let Some(tags) = &message.tags {
            properties.insert("TAGS".into(), tags.as_str().into());
        }
        if !message.keys.is_empty() {
            properties.insert("KEYS".into(), message.keys.join(" ").into());
        }
        // A half message names its producer group (the one its transaction is checked back with) in the header
        // too, and carries the prepared flag, as RocketMQ's transactional producer sends it.
        let half_group = message
            .properties
            .get(super::transaction::PROPERTY_TRANSACTION_PREPARED)
            .filter(|v| v.as_str() == "true")
            .and(message.properties.get(super::transaction::PROPERTY_PRODUCER_GROUP));
        let sys_flag = if half_group.is_some() { MessageSysFlag::TRANSACTION_PREPARED_TYPE } else { 0 };
        let header = SendMessageRequestHeader {
            producer_group: half_group.unwrap_or(&self.producer_group).as_str().into(),
            topic: message.topic.as_str().into(),
            default_topic: AUTO_CREATE_TOPIC_KEY.into(),
            default_topic_queue_nums: DEFAULT_TOPIC_QUEUE_NUMS,
            queue_id,
            sys_flag,
            born_timestamp: Epoch::now().as_millis(),
            flag: 0,
            properties: Some(message_properties_to_string(&properties)),
            reconsume_times: Some(0),
            unit_mode: Some(false),
            batch: Some(false),
            max_reconsume_times: None,
            topic_request_header: None,
        };
        let request =
            RemotingCommand::create_request_command(RequestCode::SendMessage, header).set_body(message.body.clone());
        (request, message_id)
    }

    /// Stops the client instance (background route refresh, heartbeats) before the runtime goes.
    pub async fn shutdown(self) {
        for handle in &self.handles {
            handle.shutdown_owned().await;
        }
        self.pop_instance.shutdown_owned().await;
        self.relay_instance.shutdown_owned().await;
        self.runtime.shutdown().await;
    }
}

/// A remoting client's message, sent as the client sent it but to `queue_id`: its header fields, its
/// properties as they are (no `WAIT` or id added), a batch as one `SEND_BATCH_MESSAGE`. The id is the client's
/// `UNIQ_KEY` (empty for a batch, whose messages carry their own).
fn client_send_request(message: &OutgoingMessage, wire: &ClientWire, queue_id: i32) -> (RemotingCommand, String) {
    let message_id = message.properties.get(super::message::PROPERTY_UNIQ_KEY).cloned().unwrap_or_default();
    let properties = crate_properties(&message.properties);
    let header = SendMessageRequestHeader {
        producer_group: wire.producer_group.as_str().into(),
        topic: message.topic.as_str().into(),
        default_topic: AUTO_CREATE_TOPIC_KEY.into(),
        default_topic_queue_nums: DEFAULT_TOPIC_QUEUE_NUMS,
        queue_id,
        sys_flag: wire.sys_flag,
        born_timestamp: wire.born_timestamp,
        flag: wire.flag,
        properties: Some(message_properties_to_string(&properties)),
        reconsume_times: wire.reconsume_times,
        unit_mode: wire.unit_mode,
        batch: Some(wire.batch),
        max_reconsume_times: wire.max_reconsume_times,
        topic_request_header: None,
    };
    let request = if wire.batch {
        // The broker reads a batch's header only in the short-named V2 form.
        let header = SendMessageRequestHeaderV2::create_send_message_request_header_v2_with_move(header);
        RemotingCommand::create_request_command(RequestCode::SendBatchMessage, header)
    } else {
        RemotingCommand::create_request_command(RequestCode::SendMessage, header)
    };
    (request.set_body(message.body.clone()), message_id)
}

fn crate_properties(properties: &std::collections::BTreeMap<String, String>) -> HashMap<CheetahString, CheetahString> {
    properties.iter().map(|(k, v)| (CheetahString::from(k.as_str()), CheetahString::from(v.as_str()))).collect()
}

/// The hook that signs every request to the cluster with `broker.access_key` (RocketMQ's `AclClientRPCHook`:
/// the sorted header values and the body, HMAC-SHA1 keyed by the secret). It replaces a relayed client's own
/// `AccessKey` and `Signature`: the cluster sees popgate, and popgate's gateway decided what the client may do.
fn signer(config: &BrokerConfig) -> Option<Arc<ClientRpcHook>> {
    if config.access_key.is_empty() {
        return None;
    }
    let credentials = SessionCredentials::with_keys(config.access_key.as_str(), config.secret_key.as_str());
    Some(Arc::new(AclClientRPCHook::new(credentials)))
}

/// Starts the client crate's own Tokio runtime and the client runtime on it. The owner must outlive every
/// client made from the runtime; drop it last.
///
/// # Errors
/// [`BrokerError::Client`] when either cannot be built.
pub fn start_client_runtime() -> Result<(RuntimeOwner, Arc<ClientRuntime>), BrokerError> {
    let client_err = |e: &dyn std::fmt::Display| BrokerError::Client(e.to_string());
    let runtime_config = RuntimeConfig { thread_name: "rocketmq-client".into(), ..RuntimeConfig::default() };
    let owner = RuntimeOwner::plan(runtime_config).map_err(|e| client_err(&e))?.build().map_err(|e| client_err(&e))?;
    let runtime = ClientRuntime::try_new(
        owner.root_context().component("client"),
        ClientRuntimeConfig::default(),
        TelemetryHandle::noop(),
    )
    .map_err(|e| client_err(&e))?;
    Ok((owner, runtime))
}

/// The brokers of a route that have a master, with the queues each may be written and read, sorted by
/// name for a stable rotation.
pub(super) fn brokers_with_master(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::consumer::PopRequest;
    use crate::broker::fake_peer::FakePeer;

    #[test]
    fn only_the_brokers_own_failures_isolate_it_and_a_refused_message_is_retried_without() {
        let answered = |code| BrokerError::Response { code, detail: String::new() };
        for own in [BrokerError::Timeout(Duration::from_secs(3)), BrokerError::Unreachable("reset".into()), answered(2)]
        {
            assert!(own.is_brokers_own_failure(), "{own}");
        }
        // SYSTEM_ERROR (an empty body's NullPointerException), TOPIC_NOT_EXIST, NO_PERMISSION: the message's.
        for refusal in [answered(1), answered(17), answered(16), answered(13)] {
            assert!(!refusal.is_brokers_own_failure(), "{refusal}");
        }
        assert!(answered(1).is_retriable(), "still retried on another broker, as Apache's producer retries it");
    }

    async fn client(request_timeout_ms: u64) -> BrokerClient {
        let config = BrokerConfig { namesrv_addr: "127.0.0.1:1".into(), request_timeout_ms, ..BrokerConfig::default() };
        BrokerClient::connect(&config, "test").await.expect("client")
    }

    /// What popgate relies on the crate for: a connection whose answers stopped is not used again. The request
    /// that timed out closed it, the next one opens a new connection, and once the broker answers again the
    /// next request is answered at once (no backoff, no circuit breaker in the way).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_whose_answers_stop_is_replaced_by_the_next_request() {
        let peer = FakePeer::start().await;
        let client = client(500).await;
        assert!(client.broker_config(&peer.addr).await.is_ok());
        assert_eq!(peer.accepted(), 1);

        peer.set_silent(true);
        for attempt in 1..=3 {
            let error = client.broker_config(&peer.addr).await.expect_err("no answer");
            assert!(matches!(error, BrokerError::Timeout(_)), "{error}");
            // Each attempt after a timeout goes out on a new connection, not on the one that went quiet.
            assert_eq!(peer.accepted(), attempt, "attempt {attempt}");
        }

        peer.set_silent(false);
        let started = Instant::now();
        assert!(client.broker_config(&peer.addr).await.is_ok(), "answered again at once");
        assert!(started.elapsed() < Duration::from_millis(400), "took {:?}", started.elapsed());
        assert!(client.broker_config(&peer.addr).await.is_ok());
        assert_eq!(peer.accepted(), 4, "the new connection is kept");
        client.shutdown().await;
    }

    /// A POP that outlives its timeout closes its connection (see above). On the connection of the request
    /// pool that would fail a send in flight to the same broker as "connection failed", and isolate the broker.
    /// POPs have connections of their own, so the request beside it is answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pop_that_times_out_fails_no_request_in_flight_beside_it() {
        let peer = FakePeer::start().await;
        peer.ignore_pops();
        let client = Arc::new(client(20_000).await);
        let handle = client.dedicated_handle().expect("POP handle");
        let broker = BrokerRoute { name: "b".into(), addr: peer.addr.clone(), write_queues: 1, read_queues: 1 };
        let request = PopRequest {
            group: "g",
            topic: "t",
            filter: "*",
            filter_type: "TAG",
            max: 1,
            invisible_ms: 1_000,
            poll_ms: 100,
            orderly: false,
        };
        // Answered 5 s after it is sent: still in flight when the POP times out (3.1 s after it was sent).
        peer.set_delay(Duration::from_secs(5));
        let beside = {
            let (client, addr) = (client.clone(), peer.addr.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                client.broker_config(&addr).await
            })
        };
        let popped = client.pop(&handle, &broker, &request).await;
        assert!(matches!(popped, Err(BrokerError::Timeout(_))), "{popped:?}");
        let answered = beside.await.expect("join");
        assert!(answered.is_ok(), "the request beside the POP was answered: {answered:?}");
        assert_eq!(peer.accepted(), 2, "one connection for the POP, one for the request pool");
        handle.shutdown_owned().await;
        if let Ok(client) = Arc::try_unwrap(client) {
            client.shutdown().await;
        }
    }
}
