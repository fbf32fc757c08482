//! The listeners of the three fronts: `[server]` (HTTP), `[grpc]` (the RocketMQ 5 SDKs) and `[remoting]` (the
//! remoting Java client). Each says where a front listens and how much one client may hold open there; they
//! sit together because they answer the same questions for different protocols.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The HTTP listener.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the HTTP API listens on. Port 0 picks a free port (it is logged).
    pub listen: SocketAddr,
    /// How long in-flight HTTP requests may take to finish after SIGTERM/SIGINT.
    pub shutdown_grace_secs: u64,
    /// PEM certificate chain: with `tls_key_path`, the listener speaks HTTPS only (rustls).
    pub tls_cert_path: Option<PathBuf>,
    /// PEM private key of `tls_cert_path`.
    pub tls_key_path: Option<PathBuf>,
    /// Longest request URI (path and query); longer ones get 414.
    pub max_uri_bytes: usize,
    /// Most bytes of request headers (names and values); more get 431.
    pub max_header_bytes: usize,
    /// Most long-poll requests one token may have waiting at once; more get 429.
    pub max_waiters_per_token: usize,
    /// Most open SSE and WebSocket streams per token; more get 429.
    pub max_streams_per_token: usize,
    /// Most delivery ids in one batch ACK.
    pub max_ack_batch: usize,
    /// Most HTTP connections open at once; one more is closed at once. Without it, clients that open
    /// connections and hold them take every file descriptor, the brokers' and the state store's included.
    pub max_connections: usize,
    /// A connection that completes no request head for this long is closed: one that sends nothing, waits
    /// between requests (keep-alive) or sends its headers a byte at a time. A long poll or a stream in progress is
    /// not idle.
    pub idle_timeout_secs: u64,
    /// A request's body must have arrived this long after its head, or it is answered 408 (a client sending it
    /// a byte at a time would otherwise hold its connection and the body read so far for ever).
    pub body_timeout_secs: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            shutdown_grace_secs: 10,
            tls_cert_path: None,
            tls_key_path: None,
            max_uri_bytes: 8 * 1024,
            max_header_bytes: 16 * 1024,
            max_waiters_per_token: 256,
            max_streams_per_token: 64,
            max_ack_batch: 1_000,
            max_connections: 10_000,
            idle_timeout_secs: 60,
            body_timeout_secs: 60,
        }
    }
}

/// The RocketMQ 5 gRPC front (`apache.rocketmq.v2.MessagingService`). TLS and plaintext are served on the
/// same port, as Apache's proxy does, because the official SDKs use TLS by default and accept any certificate.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GrpcConfig {
    /// Address the gRPC front listens on; empty switches it off. Port 0 picks a free port (it is logged).
    pub listen: String,
    /// PEM certificate chain for TLS; without it (and `tls_key_path`) popgate generates a self-signed one at
    /// start.
    pub tls_cert_path: Option<PathBuf>,
    /// PEM private key of `tls_cert_path`.
    pub tls_key_path: Option<PathBuf>,
    /// Shortest invisible duration a receive may ask for (Apache's `minInvisibleTimeMillsForRecv`).
    pub min_invisible_ms: u64,
    /// Longest invisible duration a receive or ChangeInvisibleDuration may ask for (`maxInvisibleTimeMills`).
    pub max_invisible_ms: u64,
    /// Most long-poll receives one token may have open at once.
    pub max_receives_per_token: usize,
    /// Most Telemetry streams one token may have open at once (an SDK client keeps one).
    pub max_streams_per_token: usize,
    /// Most client ids the front keeps track of (their liveness keeps auto-renewed deliveries held); a new
    /// client past it is refused until others expire.
    pub max_clients: usize,
    /// HTTP/2 keep-alive: a PING after this long without frames; a connection that does not answer within
    /// as long again is closed (0 switches it off).
    pub keepalive_secs: u64,
    /// Most calls (HTTP/2 streams) one connection may have open at once, advertised to the client; a client
    /// that opens more has them refused (`REFUSED_STREAM`). An SDK client keeps one per long poll, one
    /// Telemetry stream, and its calls in flight.
    pub max_concurrent_streams: u32,
    /// Most connections the front keeps open at once; past it a new connection is closed at once (counted in
    /// `popgate_grpc_connections_refused_total`). An SDK client keeps one per endpoint.
    pub max_connections: usize,
    /// A call's request must have been read and its answer begun within this long, or the call is ended
    /// (gRPC `CANCELLED`): a client sending its request message a byte at a time would otherwise hold the call,
    /// and what it sent of the message, for as long as it likes. A long poll's answer begins at once (its
    /// messages follow), so it is not cut; a client's own deadline (`grpc-timeout`) applies when shorter.
    pub call_timeout_secs: u64,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        GrpcConfig {
            listen: "127.0.0.1:8081".to_owned(),
            tls_cert_path: None,
            tls_key_path: None,
            min_invisible_ms: 10_000,
            max_invisible_ms: 12 * 3600 * 1000,
            max_receives_per_token: 10_000,
            max_streams_per_token: 10_000,
            max_clients: 100_000,
            keepalive_secs: 30,
            max_concurrent_streams: 1_000,
            max_connections: 10_000,
            call_timeout_secs: 60,
        }
    }
}

impl GrpcConfig {
    /// The address to listen on, or `None` when the front is switched off (or the address is invalid, which
    /// validation reports).
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.listen.trim().parse().ok()
    }
}

/// The RocketMQ remoting front: the protocol of Apache's `rocketmq-client` (`DefaultMQProducer`,
/// `DefaultMQPushConsumer`, ...). An app sets its `namesrvAddr` to this address; popgate answers its name-server
/// requests with itself as every broker.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RemotingConfig {
    /// Address the remoting front listens on; empty (the default) switches it off.
    pub listen: String,
    /// The `host:port` popgate gives clients as every broker's address in the routes it answers; empty means
    /// the listen address, which must then name a host clients can reach (not `0.0.0.0`).
    pub advertised_addr: String,
    /// Largest frame popgate reads, its 4-byte length included; a longer one closes the connection.
    pub max_frame_bytes: usize,
    /// Most bytes of large frames (over 64 KiB) the front's connections read in at once, whoever sent them and
    /// before anything is signed: a connection whose next frame does not fit waits (its idle timeout still
    /// runs) until others' frames are served. Without it, `max_connections` clients could each announce a
    /// `max_frame_bytes` frame. At least `max_frame_bytes`.
    pub max_frame_bytes_in_flight: usize,
    /// Most connections the front keeps open at once; one more is closed at once.
    pub max_connections: usize,
    /// A client that sent no heartbeat for this long is no longer a member of its consumer groups (the
    /// client heartbeats every 30 s; RocketMQ's brokers drop it after 120 s).
    pub client_expiry_secs: u64,
    /// A connection that completes no frame for this long (idle, or sending a frame byte by byte) is closed,
    /// and so is one whose answers cannot be written for this long (a client that stopped reading). Clients
    /// send a heartbeat and a route query every 30 s; RocketMQ's broker closes idle channels after 120 s.
    pub idle_timeout_secs: u64,
    /// Most requests of one connection served at once; past it popgate stops reading that connection until one
    /// is answered (back-pressure, nothing buffered). A push consumer holds one pull per queue it consumes.
    pub max_requests_per_connection: usize,
    /// Most client ids the front keeps (from heartbeats); a new client past it is refused until others leave.
    pub max_clients: usize,
    /// The port popgate opens for each broker, by broker name, for clients before 4.9.5 (which do not name
    /// the broker in their requests: they are given a route with an address per broker). A broker not listed
    /// gets a free port when such a client first asks for a route naming it.
    pub broker_ports: BTreeMap<String, u16>,
    /// PEM certificate chain for the clients that use TLS (`useTLS`); without it (and `tls_key_path`) popgate
    /// generates a self-signed one at start (the client accepts any certificate unless told otherwise).
    pub tls_cert_path: Option<PathBuf>,
    /// PEM private key of `tls_cert_path`.
    pub tls_key_path: Option<PathBuf>,
}

impl Default for RemotingConfig {
    fn default() -> Self {
        RemotingConfig {
            listen: String::new(),
            advertised_addr: String::new(),
            // The broker's own limit (`maxMessageSize` 4 MiB) is per message; a batch or a pull answer is more.
            max_frame_bytes: 16 * 1024 * 1024 + 4,
            max_frame_bytes_in_flight: 256 * 1024 * 1024,
            max_connections: 10_000,
            client_expiry_secs: 120,
            idle_timeout_secs: 120,
            max_requests_per_connection: 1024,
            max_clients: 10_000,
            broker_ports: BTreeMap::new(),
            tls_cert_path: None,
            tls_key_path: None,
        }
    }
}

impl RemotingConfig {
    /// The address to listen on, or `None` when the front is switched off (or the address is invalid, which
    /// validation reports).
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.listen.trim().parse().ok()
    }

    /// The address clients are told to connect to, given the address the front is bound to.
    pub fn advertised(&self, bound: SocketAddr) -> String {
        match self.advertised_addr.trim() {
            "" => bound.to_string(),
            given => given.to_owned(),
        }
    }
}
