//! The connection to the RocketMQ cluster, over rocketmq-client-rust.
//!
//! popgate keeps broker *choice* to itself (see [`super::fault`] and the publish path), so this client only
//! ever sends to the one queue it is told, once: a `SEND_MESSAGE` remoting request to the broker address of
//! popgate's own route, with no hidden retry and no hidden route logic. Routes come from the name server and
//! are cached for `broker.route_ttl_ms`.
//!
//! The crate runs the calls of one handle one at a time, so every request checks a handle out for its own
//! time (`pooled`): none waits behind another's, and a send's timeout is the broker's time alone. Requests
//! travel on the request client instance, and on more of them when over 400 are in flight at once (see
//! `spread`: the crate refuses a 513th request in flight on one instance).
//!
//! POP long-polls run on client instances of their own, so they never share a connection with requests. The crate
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

mod route;
mod send;
mod spread;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cheetah_string::CheetahString;
use rocketmq_client_rust::{
    AclClientRPCHook, ClientConfig, ClientInstanceHandle, ClientRpcHook, ClientRuntime, ClientRuntimeConfig,
    SessionCredentials, TelemetryHandle,
};
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};

pub use super::error::BrokerError;
use crate::config::BrokerConfig;
pub(super) use route::brokers_with_master;
use route::{route_cache, CachedRoute};
pub use route::{BrokerRoute, TopicRoute};
pub use send::{batch_message, SendReceipt, StoreStatus};
use spread::InstanceSpread;
pub use spread::SpreadHandle;

/// The topic whose route a producer borrows for a topic the broker will auto-create.
const AUTO_CREATE_TOPIC_KEY: &str = "TBW102";
/// Managed-domain id shared by popgate's client handles.
const CLIENT_DOMAIN: u64 = 7;
/// The client instance of requests (routes, sends, ACKs, renewals, admin, PULL).
const REQUEST_INSTANCE: &str = "popgate";
/// The client instances of the POP long-polls ([`BrokerClient::dedicated_handle`]): connections of their own.
const POP_INSTANCE: &str = "popgate-pop";
/// Queues a broker gives a topic it auto-creates from `TBW102`.
const DEFAULT_TOPIC_QUEUE_NUMS: i32 = 4;

/// The process's connection to the RocketMQ cluster. Cheap to share behind an `Arc`.
pub struct BrokerClient {
    config: BrokerConfig,
    producer_group: String,
    /// The request instances (sends, ACKs, renewals, routes, admin, PULL): a handle per request in flight.
    requests: InstanceSpread,
    /// The POP long polls' instances, each carrying at most [`spread::CALLERS_PER_INSTANCE`] of them.
    pops: InstanceSpread,
    /// The instances of the remoting front's relayed requests (a 4.x consumer's pull waits up to 30 s).
    relays: InstanceSpread,
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
    /// The producer group popgate's own sends go under.
    pub fn producer_group(&self) -> &str {
        &self.producer_group
    }

    /// Starts the client runtime and a client instance. Does not require a reachable broker: readiness is
    /// reported separately ([`BrokerClient::ping`]).
    ///
    /// # Errors
    /// [`BrokerError::Client`] when the client runtime cannot be created.
    pub async fn connect(config: &BrokerConfig, producer_group: &str) -> Result<BrokerClient, BrokerError> {
        let (owner, runtime) = start_client_runtime()?;
        // One hook for every instance: the crate tells instances apart by it, so each handle must share it.
        let signer = signer(config);
        let client = BrokerClient {
            config: config.clone(),
            producer_group: producer_group.to_owned(),
            requests: InstanceSpread::new(REQUEST_INSTANCE),
            pops: InstanceSpread::new(POP_INSTANCE),
            relays: InstanceSpread::new(super::relay::RELAY_INSTANCE),
            runtime,
            signer,
            routes: route_cache(config.route_ttl()),
            exact_routes: route_cache(config.route_ttl()),
            _owner: owner,
        };
        // The first instance of each use starts now: a client that cannot start fails here, not at its first
        // request.
        drop(client.requests.check_out(&client).await?);
        drop(client.pops.check_out(&client).await?);
        drop(client.relays.check_out(&client).await?);
        Ok(client)
    }

    /// A handle for one request, on a request instance with room; dropping it gives it back.
    ///
    /// # Errors
    /// [`BrokerError::Client`] when a new instance was needed and could not start.
    pub(crate) async fn pooled(&self) -> Result<SpreadHandle, BrokerError> {
        self.requests.check_out(self).await
    }

    /// The timeout of one request that is not a send.
    pub(crate) fn request_timeout(&self) -> Duration {
        self.config.request_timeout()
    }

    /// The configured name server addresses, in order.
    pub(crate) fn namesrv_addrs(&self) -> Vec<String> {
        self.config.namesrv_addrs()
    }

    /// A handle of its own for a caller whose requests are slow (a long-polling POP), so it never waits
    /// behind the shared pool or makes others wait. It is a handle on a POP client instance with room: its
    /// requests travel on the POP connections, never on those of sends, ACKs and renewals. Dropping it gives it
    /// back.
    ///
    /// # Errors
    /// [`BrokerError::Client`] when the handle cannot be made.
    pub async fn dedicated_handle(&self) -> Result<SpreadHandle, BrokerError> {
        self.pops.check_out(self).await
    }

    /// A handle on a relay client instance with room, for one relayed request.
    pub(super) async fn relay_handle(&self) -> Result<SpreadHandle, BrokerError> {
        self.relays.check_out(self).await
    }

    /// What signs popgate's requests to the brokers, when it is given credentials (the one every instance of
    /// popgate's has: a client of the crate's own that joins one must bring the same).
    pub(super) fn signer(&self) -> Option<Arc<ClientRpcHook>> {
        self.signer.clone()
    }

    /// A handle on client instance `instance` of popgate's client runtime (created when new): the crate gives
    /// every handle of one instance the same instance, and so the same connections.
    pub(super) fn instance_handle(&self, instance: &str) -> Result<ClientInstanceHandle, BrokerError> {
        ClientInstanceHandle::get_or_create(
            &self.runtime,
            CLIENT_DOMAIN,
            self.client_config(instance),
            self.signer.clone(),
        )
        .map_err(|e| BrokerError::Client(e.to_string()))
    }

    /// The client config of instance `instance` (before the crate adds its domain to the name), also for a
    /// client of the crate's own (a producer) that must join that instance.
    pub(super) fn client_config(&self, instance: &str) -> ClientConfig {
        let mut client_config = ClientConfig::new();
        client_config.set_namesrv_addr(CheetahString::from(self.config.namesrv_addr.as_str()));
        client_config.set_instance_name(CheetahString::from(instance));
        client_config
    }

    /// The client runtime, for a client of the crate's own.
    pub(super) fn runtime(&self) -> Arc<ClientRuntime> {
        self.runtime.clone()
    }

    /// The domain popgate's client instances live in.
    pub(super) fn client_domain(&self) -> u64 {
        CLIENT_DOMAIN
    }

    /// Stops the client instance (background route refresh, heartbeats) before the runtime goes.
    pub async fn shutdown(self) {
        self.requests.shutdown().await;
        self.pops.shutdown().await;
        self.relays.shutdown().await;
        self.runtime.shutdown().await;
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::consumer::PopRequest;
    use crate::broker::fake_peer::FakePeer;

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
        let handle = client.dedicated_handle().await.expect("POP handle");
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
        let popped = client.pop(handle.handle(), &broker, &request).await;
        assert!(matches!(popped, Err(BrokerError::Timeout(_))), "{popped:?}");
        let answered = beside.await.expect("join");
        assert!(answered.is_ok(), "the request beside the POP was answered: {answered:?}");
        assert_eq!(peer.accepted(), 2, "one connection for the POP, one for the request pool");
        drop(handle);
        if let Ok(client) = Arc::try_unwrap(client) {
            client.shutdown().await;
        }
    }
}
