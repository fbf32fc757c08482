//! Configuration: one TOML file, overridden by `POPGATE_*` environment variables.
//!
//! Every key has a default, so an empty file is a valid configuration for a local broker. Nested keys are
//! reached from the environment with a double underscore: `POPGATE_PUBLISH__SEND_TIMEOUT_MS=5000` sets
//! `publish.send_timeout_ms`. Unknown keys are rejected, and [`Config::load`] validates everything before
//! anything is bound, so popgate never starts half-configured: the error names the key and the reason.
//!
//! A `POPGATE_*` variable that names no config section is not config at all: Kubernetes gives every pod of a
//! namespace with a Service named `popgate` the variables `POPGATE_SERVICE_HOST`, `POPGATE_PORT_8080_TCP`, ….
//! Those are left out and returned in [`LoadedConfig::ignored_env`], for the caller to warn about once its
//! logging is up. A variable that does name a section is config, so a typo in its key stays an error.
//!
//! Field names carry their unit (`_ms`, `_secs`, `_bytes`); the accessors that return [`Duration`] convert at
//! the edge.

pub mod bounds;
pub mod names;
mod validate;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

/// The prefix of every environment variable popgate reads.
pub const ENV_PREFIX: &str = "POPGATE_";

/// RocketMQ's own default for `retryTimesWhenSendFailed`: 1 + 2 = 3 attempts in all (seed 004).
pub const DEFAULT_RETRY_TIMES_WHEN_SEND_FAILED: u32 = 2;
/// RocketMQ caps the synchronous retries at 3 (seed 004: "default 2, maximum 3").
pub const MAX_RETRY_TIMES_WHEN_SEND_FAILED: u32 = 3;
/// RocketMQ's `sendMsgTimeout` default.
pub const DEFAULT_SEND_TIMEOUT_MS: u64 = 3_000;
/// The broker's default `maxMessageSize` (4 MiB).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// MQFaultStrategy's latency steps (ms): a send slower than step *i* isolates the broker for `NOT_AVAILABLE[i]`.
pub const DEFAULT_LATENCY_MAX_MS: [u64; 7] = [50, 100, 550, 1_000, 2_000, 3_000, 15_000];
/// MQFaultStrategy's isolation periods (ms) for each latency step.
pub const DEFAULT_NOT_AVAILABLE_MS: [u64; 7] = [0, 0, 30_000, 60_000, 120_000, 180_000, 600_000];
/// A network error or timeout isolates a broker for 10 minutes (seed 004).
pub const DEFAULT_NETWORK_ERROR_ISOLATION_MS: u64 = 600_000;

/// How often the operators' gauges ask the brokers: about a scrape's worth of freshness for a dashboard, one
/// GET_CONSUME_STATS per broker per subscription and one GET_TOPIC_STATS_INFO per broker per group.
pub const DEFAULT_GAUGE_REFRESH_MS: u64 = 15_000;
/// Most characters of a tier instance's id (`tier.instance_id`): it starts every delivery id and handle.
pub const MAX_INSTANCE_ID_LEN: usize = 40;

/// Whether `id` may be a tier instance's id: 1 to [`MAX_INSTANCE_ID_LEN`] lowercase ASCII letters, digits and
/// `-`, starting with a letter or digit (a Kubernetes pod name's first label fits).
pub fn is_valid_instance_id(id: &str) -> bool {
    (1..=MAX_INSTANCE_ID_LEN).contains(&id.len())
        && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
}

/// The shortest refresh period allowed: tests use a short one; below this the broker requests are a load.
pub const MIN_GAUGE_REFRESH_MS: u64 = 100;

/// The whole configuration of one popgate process.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The HTTP listener.
    pub server: ServerConfig,
    /// How popgate reaches the RocketMQ cluster.
    pub broker: BrokerConfig,
    /// The publish path: RocketMQ's producer policy.
    pub publish: PublishConfig,
    /// The latency fault-avoidance table (MQFaultStrategy) used to pick brokers.
    pub fault_avoidance: FaultAvoidanceConfig,
    /// The consume path: POP, deferred broker ACK, retries and the dead-letter topic.
    pub delivery: DeliveryConfig,
    /// The reliability profile: what "stored" means, how popgate persists its own state, what it expects of
    /// the brokers.
    pub reliability: ReliabilityConfig,
    /// Who may do what: bearer tokens and their allowed actions.
    pub auth: AuthConfig,
    /// The admin plane (DLQ replay pacing).
    pub admin: AdminConfig,
    /// The RocketMQ 5 gRPC front, for apps built on the official SDKs.
    pub grpc: GrpcConfig,
    /// The RocketMQ remoting front, for apps on the remoting Java client (`rocketmq-client`, 4.x style).
    pub remoting: RemotingConfig,
    /// Which addresses webhook pushes may reach.
    pub webhook: WebhookConfig,
    /// Transactional messages: their producer group and how long their records are kept.
    pub transactions: TransactionConfig,
    /// Several popgate instances as one tier: this instance's id, and the peer link over which any instance
    /// settles a delivery another one handed out.
    pub tier: TierConfig,
}

/// Several popgate instances behind one load balancer. Each delivery id and handle names the instance that
/// handed it out; a settlement that reaches another instance is asked of that one over the peer link.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TierConfig {
    /// This instance's id: lowercase letters, digits and `-`, at most 40. Unset: the id stored in the state
    /// directory, or, on a first start, one made of the host name and a random suffix (and stored there). A
    /// state directory belongs to one instance: a set id that differs from the stored one stops the start.
    pub instance_id: Option<String>,
    /// Address the peer link listens on (host:port); empty: this instance is alone, and settles only what it
    /// handed out. Keep it off the clients' network.
    pub listen: String,
    /// The peers' peer-link addresses (host:port), this instance's own among them or not.
    pub peers: Vec<String>,
    /// A DNS name (host:port) whose addresses are the peers (a Kubernetes headless Service), looked up again
    /// every `refresh_secs`.
    pub peer_dns: String,
    /// How often the peers are looked up and asked who they are.
    pub refresh_secs: u64,
    /// The tier's shared secret: every peer request is signed with it (HMAC-SHA256 over the call, a timestamp,
    /// a nonce, the instance it is meant for and the whole request). At least 16 characters; the same on every
    /// instance.
    pub secret: String,
    /// How long a settlement asked of another instance may take before it fails (the client may retry).
    pub forward_timeout_ms: u64,
    /// Most connections the peer port keeps open at once; past it a new one is closed at once (counted in
    /// `popgate_tier_connections_refused_total{reason="too_many_connections"}`). Each instance keeps one to each
    /// peer.
    pub max_connections: usize,
    /// A delivery due again (its backoff over) on an instance where no consumer of its group has waited for
    /// this long is given back to the broker, which hands it to the next POP of any instance: a client whose
    /// connection a balancer moved to another instance gets it there instead of never.
    pub give_back_unclaimed_ms: u64,
    /// Transaction ends being asked of the peers at once. An end of a transaction this instance has no record
    /// of asks every peer; past this many, such an end is answered "try again" instead of asking (a flood of
    /// ends of made-up ids would otherwise multiply into the peers' calls).
    pub max_ends_asked_at_once: usize,
    /// PEM certificate chain this instance presents on the peer link, as a server and as a client. With
    /// `tls_key_path` and `tls_ca_path` (all three or none), the peer port speaks TLS only, mutual: each side's
    /// certificate must chain to `tls_ca_path`. Unset: the link is plaintext (signed, not private).
    pub tls_cert_path: Option<PathBuf>,
    /// PEM private key of `tls_cert_path`.
    pub tls_key_path: Option<PathBuf>,
    /// PEM certificate(s) of the tier's CA: a peer's certificate, client's or server's, is taken only when it
    /// chains to one of them. Keep this CA for the tier alone: whoever holds a certificate it signed is a peer.
    pub tls_ca_path: Option<PathBuf>,
    /// A DNS name every instance's certificate carries: a peer's server certificate must name it, whatever
    /// address it was dialled at (and it is the name sent in SNI). Unset: the chain to `tls_ca_path` is checked,
    /// not the name (peers are dialled by pod address, which certificates rarely name).
    pub tls_server_name: Option<String>,
}

impl TierConfig {
    /// The peer link's certificate, key and CA files, when TLS is configured (all three set).
    pub fn tls_files(&self) -> Option<(&Path, &Path, &Path)> {
        match (&self.tls_cert_path, &self.tls_key_path, &self.tls_ca_path) {
            (Some(cert), Some(key), Some(ca)) => Some((cert.as_path(), key.as_path(), ca.as_path())),
            _ => None,
        }
    }
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            instance_id: None,
            listen: String::new(),
            peers: Vec::new(),
            peer_dns: String::new(),
            refresh_secs: 10,
            secret: String::new(),
            forward_timeout_ms: 3_000,
            max_connections: 1_000,
            give_back_unclaimed_ms: 20_000,
            max_ends_asked_at_once: 64,
            tls_cert_path: None,
            tls_key_path: None,
            tls_ca_path: None,
            tls_server_name: None,
        }
    }
}

/// Transactional messages (RocketMQ's half messages). popgate keeps, in its state store, what ending each
/// transaction needs, so a commit or rollback works after a popgate restart too.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TransactionConfig {
    /// The producer group popgate's half messages carry (`PGROUP`): the broker checks a transaction back with
    /// the producers of this group, and every popgate in front of the cluster registers as one. Give all of
    /// them the same value.
    pub producer_group: String,
    /// How long a transaction's record is kept after its send, ended or not. Cover the broker's check window
    /// (`transactionCheckMax` × `transactionCheckInterval`, plus the recovery duration a message may ask for,
    /// at most 1 h): an end after it is refused as unknown.
    pub record_retention_secs: u64,
    /// HTTP producers' checkers, by producer group: a transactional `POST /events/publish` names its group
    /// (`producerGroup`), and the broker's check-backs of its transactions are POSTed to that group's URL.
    pub checkers: BTreeMap<String, CheckerConfig>,
}

impl Default for TransactionConfig {
    fn default() -> Self {
        TransactionConfig {
            producer_group: "popgate_transaction".to_owned(),
            record_retention_secs: 3 * 3600,
            checkers: BTreeMap::new(),
        }
    }
}

/// Where the check-backs of one HTTP producer group's transactions go, signed as webhook deliveries are.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CheckerConfig {
    /// `http` or `https` URL that answers `{"resolution": "commit" | "rollback" | "unknown"}`.
    pub url: String,
    /// Key of the HMAC-SHA256 signature (`X-Popgate-Signature`).
    pub secret: String,
    /// Timeout of one check-back request.
    #[serde(default = "default_checker_timeout_ms")]
    pub timeout_ms: u64,
}

fn default_checker_timeout_ms() -> u64 {
    5_000
}

/// Which addresses webhook pushes may reach.
///
/// A webhook URL is chosen by whoever may subscribe, and popgate POSTs to it from inside the network it runs
/// in. Without a guard, a subscriber could make popgate reach what only popgate can: its own host
/// (127.0.0.1), the cloud metadata service (169.254.169.254), internal services on private addresses. So a
/// webhook may only connect to public unicast addresses: loopback, link-local, private (10/8, 172.16/12,
/// 192.168/16, fc00::/7), CGNAT (100.64/10), unspecified, multicast, broadcast and reserved addresses are
/// refused, in IPv4-mapped IPv6 form too. A literal address in a refused range is a 400 at subscribe time; a
/// host name is resolved at every connection and only its permitted addresses are used.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WebhookConfig {
    /// Networks that webhooks may reach although they are not public: the internal networks your receivers
    /// live in, in CIDR notation (`"10.1.0.0/16"`, `"fd00:1::/64"`) or as single addresses (`"10.1.2.3"`).
    /// Allow as little as you can: every address listed here is reachable by anyone who may subscribe.
    /// Empty by default: public addresses only.
    #[serde(with = "networks")]
    pub allowed_networks: Vec<ipnet::IpNet>,
}

/// `webhook.allowed_networks` as written in the file: strings, each a CIDR network or a single address.
mod networks {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(networks: &[ipnet::IpNet], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(networks.iter().map(ToString::to_string))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<ipnet::IpNet>, D::Error> {
        let written = Vec::<String>::deserialize(deserializer)?;
        written.iter().map(|text| parse(text).map_err(D::Error::custom)).collect()
    }

    /// A network in CIDR notation, or one address (a /32 or /128).
    pub fn parse(text: &str) -> Result<ipnet::IpNet, String> {
        let text = text.trim();
        text.parse::<ipnet::IpNet>()
            .map(|net| net.trunc())
            .or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| {
                format!("`{text}` is not a network: write CIDR notation such as \"10.1.0.0/16\", or one address")
            })
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

/// Bearer-token authentication. On by default: with no token configured popgate refuses to start, unless
/// `enabled = false` says explicitly that every caller may do everything.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// `false` switches authentication off: every request is allowed everything. Only for local development.
    pub enabled: bool,
    /// The accepted tokens.
    pub tokens: Vec<TokenConfig>,
    /// A gRPC signature's `x-mq-date-time` may be this far from popgate's clock, either way; outside it the
    /// call is refused, so a captured header is not a lasting credential.
    pub max_clock_skew_secs: u64,
    /// Also take the users and ACLs of the cluster (RocketMQ 5.3+ ACL 2.0, made with `mqadmin createUser` and
    /// `createAcl`), read with `broker.access_key`: an app's existing access key and secret sign its remoting
    /// and gRPC requests to popgate unchanged, and its ACL decides what it may do.
    pub cluster_acl: bool,
    /// How often the cluster's users and ACLs are read again (Apache's proxy: 20 s); a failed read keeps the
    /// last ones.
    pub cluster_acl_refresh_secs: u64,
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            enabled: true,
            tokens: Vec::new(),
            max_clock_skew_secs: 900,
            cluster_acl: false,
            cluster_acl_refresh_secs: 20,
        }
    }
}

/// One bearer token and what it may do. Patterns are topic or group names where `*` matches any run of
/// characters (`orders-*`, `*`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TokenConfig {
    /// A name for logs and metrics (the token itself is never logged).
    pub name: String,
    /// The secret as clients send it (`Authorization: Bearer <token>`), at least 16 characters. Give this
    /// or `sha256`, not both.
    pub token: Option<String>,
    /// The hex SHA-256 of the secret, so the config file need not hold the secret itself.
    pub sha256: Option<String>,
    /// Topics this token may publish to (`Pub` on `Topic:<pattern>`).
    pub publish: Vec<String>,
    /// Consumer groups this token may subscribe, poll, stream and ACK/NACK/TERM as (`Sub` on `Group:<pattern>`).
    pub consume: Vec<String>,
    /// Topics this token may read as those groups (`Sub` on `Topic:<pattern>`). Not given: every topic, the
    /// meaning tokens had before topics were scoped (popgate warns at start about each such token).
    pub subscribe: Option<Vec<String>>,
    /// RocketMQ ACL 2.0 policy entries, on top of what `publish`, `consume` and `subscribe` grant.
    pub acl: Vec<AclEntryConfig>,
    /// Whether this token may use `/admin/*`.
    pub admin: bool,
}

/// One RocketMQ ACL 2.0 policy entry (what `mqadmin createAcl -r <resource> -a <actions> -d <decision> -i
/// <source ips>` makes). Of the entries that match a request, the most specific resource decides: a literal
/// name over a prefix, a longer prefix over a shorter one, `Topic:*` or `Group:*` over `*`; `Deny` over
/// `Allow` at the same specificity. A request no entry matches is refused.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AclEntryConfig {
    /// `Topic:<name>`, `Topic:<prefix>*`, `Topic:*`, the same with `Group:`, or `*` (every topic and group).
    pub resource: String,
    /// `Pub`, `Sub`, `All` (both).
    pub actions: Vec<String>,
    /// `Allow` (the default) or `Deny`.
    pub decision: Option<String>,
    /// The entry applies only to requests from these networks (CIDR notation or single addresses); empty:
    /// from anywhere.
    #[serde(with = "networks")]
    pub source_ips: Vec<ipnet::IpNet>,
}

/// The admin plane.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Default pace of a DLQ replay (messages per second), so a replay cannot flood subscribers.
    pub replay_rate_per_sec: u32,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig { replay_rate_per_sec: 100 }
    }
}

/// Seed 004's four flush/replication combinations, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Profile {
    /// SYNC_FLUSH + SYNC_MASTER: no message loss, lowest throughput (financial-grade transactions).
    Financial,
    /// SYNC_FLUSH + ASYNC_MASTER: loss only if the master's disk fails.
    Durable,
    /// ASYNC_FLUSH + SYNC_MASTER: loss only if the master crashes before flushing; the seed's recommended
    /// default for core business.
    Balanced,
    /// ASYNC_FLUSH + ASYNC_MASTER: highest throughput; a master crash loses its page cache (logs, metrics).
    Throughput,
}

impl Profile {
    /// Every profile, for docs and tests.
    pub const ALL: [Profile; 4] = [Profile::Financial, Profile::Durable, Profile::Balanced, Profile::Throughput];

    /// Whether the profile demands that a message be on the master's disk before it counts as stored.
    pub fn sync_flush(self) -> bool {
        matches!(self, Profile::Financial | Profile::Durable)
    }

    /// Whether the profile demands that a slave have the message before it counts as stored.
    pub fn sync_replication(self) -> bool {
        matches!(self, Profile::Financial | Profile::Balanced)
    }

    /// The profile's name as written in config.
    pub fn name(self) -> &'static str {
        match self {
            Profile::Financial => "financial",
            Profile::Durable => "durable",
            Profile::Balanced => "balanced",
            Profile::Throughput => "throughput",
        }
    }
}

/// The reliability profile and how it is enforced.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ReliabilityConfig {
    /// `financial`, `durable`, `balanced` (default) or `throughput`.
    pub profile: Profile,
    /// Refuse to start (and report not ready) when a broker is weaker than the profile, instead of warning.
    pub fail_on_mismatch: bool,
    /// Under async-flush profiles the state store syncs its WAL this often (group commit) instead of on
    /// every write; under sync-flush profiles every write is synced.
    pub group_commit_interval_ms: u64,
    /// How often each broker's running flush and replication settings are read again.
    pub broker_check_interval_secs: u64,
}

impl Default for ReliabilityConfig {
    fn default() -> Self {
        ReliabilityConfig {
            profile: Profile::Balanced,
            fail_on_mismatch: false,
            group_commit_interval_ms: 100,
            broker_check_interval_secs: 60,
        }
    }
}

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

/// How popgate reaches the RocketMQ cluster.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BrokerConfig {
    /// Name server addresses, `host:port`, separated by `;` as in RocketMQ's `namesrvAddr`.
    pub namesrv_addr: String,
    /// How long a topic's route (its brokers and queues) is trusted before it is asked for again.
    pub route_ttl_ms: u64,
    /// Timeout of one request to a name server or broker that is not a send (route, POP, ACK, admin).
    pub request_timeout_ms: u64,
    /// The access key popgate signs every broker request with (RocketMQ's `AclClientRPCHook`), for a cluster
    /// with authentication on; empty: requests are not signed. Give a user the cluster lets do everything
    /// popgate does for its clients (a `Super` user, as Apache's proxy's `innerClientAuthenticationCredentials`).
    pub access_key: String,
    /// The secret of [`Self::access_key`].
    pub secret_key: String,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            namesrv_addr: "127.0.0.1:9876".to_owned(),
            route_ttl_ms: 30_000,
            request_timeout_ms: 3_000,
            access_key: String::new(),
            secret_key: String::new(),
        }
    }
}

impl BrokerConfig {
    /// The name server addresses, in order.
    pub fn namesrv_addrs(&self) -> Vec<String> {
        self.namesrv_addr.split(';').map(str::trim).filter(|a| !a.is_empty()).map(str::to_owned).collect()
    }

    /// [`Self::route_ttl_ms`] as a duration.
    pub fn route_ttl(&self) -> Duration {
        Duration::from_millis(self.route_ttl_ms)
    }

    /// [`Self::request_timeout_ms`] as a duration.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

/// The publish path: RocketMQ's synchronous producer policy.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PublishConfig {
    /// Retries after a failed synchronous send, each on another broker (`retryTimesWhenSendFailed`, 0..=3).
    pub retry_times_when_send_failed: u32,
    /// Retries after a failed `mode=async` send; they stay on the same broker (`retryTimesWhenSendAsyncFailed`).
    pub retry_times_when_send_async_failed: u32,
    /// Timeout of one send attempt (`sendMsgTimeout`).
    pub send_timeout_ms: u64,
    /// Largest message body accepted; larger requests get 413. The broker's `maxMessageSize` by default.
    pub max_message_bytes: usize,
    /// What a message may carry (every front): Apache's proxy's limits by default.
    pub limits: MessageLimits,
    /// How long a keyed send is remembered, so its repeat is answered with the first receipt (0 switches the
    /// de-duplication window off).
    pub dedup_window_secs: u64,
    /// A transactional message only to a topic typed TRANSACTION (or MIXED) on the gRPC and HTTP fronts, and the
    /// gRPC SDK told to check a message's type against its topic's: Apache's proxy's
    /// `enableTopicMessageTypeCheck` (on by default there too). Off, a half message goes to any topic, as a broker
    /// alone takes it (and as the remoting front, whose yardstick is the broker, always takes it).
    pub check_topic_message_type: bool,
}

/// What a message may carry, under `[publish.limits]` (checked by `publish::limits`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MessageLimits {
    /// Most user properties on one message.
    pub max_user_properties: usize,
    /// Most bytes of user properties (names and values), tag and keys together.
    pub max_user_property_bytes: usize,
    /// A message group must be shorter than this many UTF-8 bytes.
    pub max_message_group_bytes: usize,
    /// Furthest a delivery time may lie ahead (ms).
    pub max_delay_ms: u64,
}

impl Default for MessageLimits {
    fn default() -> Self {
        MessageLimits {
            max_user_properties: 128,
            max_user_property_bytes: 16 * 1024,
            max_message_group_bytes: 64,
            max_delay_ms: 24 * 3600 * 1000,
        }
    }
}

impl Default for PublishConfig {
    fn default() -> Self {
        PublishConfig {
            retry_times_when_send_failed: DEFAULT_RETRY_TIMES_WHEN_SEND_FAILED,
            retry_times_when_send_async_failed: DEFAULT_RETRY_TIMES_WHEN_SEND_FAILED,
            send_timeout_ms: DEFAULT_SEND_TIMEOUT_MS,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            limits: MessageLimits::default(),
            dedup_window_secs: 600,
            check_topic_message_type: true,
        }
    }
}

impl PublishConfig {
    /// [`Self::send_timeout_ms`] as a duration.
    pub fn send_timeout(&self) -> Duration {
        Duration::from_millis(self.send_timeout_ms)
    }
}

/// The latency fault-avoidance table, mirroring RocketMQ's MQFaultStrategy (on by default, as the seed's
/// production checklist recommends).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FaultAvoidanceConfig {
    /// Whether slow or unreachable brokers are isolated (`sendLatencyFaultEnable`).
    pub enabled: bool,
    /// Latency steps in ms, ascending (`latencyMax`).
    pub latency_max_ms: Vec<u64>,
    /// Isolation in ms for a send at least as slow as the matching latency step (`notAvailableDuration`).
    pub not_available_ms: Vec<u64>,
    /// Isolation in ms after a network error, timeout or retriable broker error.
    pub network_error_isolation_ms: u64,
}

impl Default for FaultAvoidanceConfig {
    fn default() -> Self {
        FaultAvoidanceConfig {
            enabled: true,
            latency_max_ms: DEFAULT_LATENCY_MAX_MS.to_vec(),
            not_available_ms: DEFAULT_NOT_AVAILABLE_MS.to_vec(),
            network_error_isolation_ms: DEFAULT_NETWORK_ERROR_ISOLATION_MS,
        }
    }
}

/// The consume path. The per-subscription values are defaults that `POST /events/subscribe` may override.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DeliveryConfig {
    /// Directory of the RocksDB state store (in-flight deliveries, subscriptions, ACK intents).
    pub state_dir: PathBuf,
    /// How long a subscriber has to ACK a delivery before it is redelivered.
    pub ack_timeout_ms: u64,
    /// Attempts in all (initial + retries) before the event goes to `%DLQ%<group>`.
    pub max_attempts: u32,
    /// First redelivery delay; each later one doubles.
    pub initial_backoff_ms: u64,
    /// Redelivery delays never grow past this.
    pub max_backoff_ms: u64,
    /// Each delay is scaled by a random factor in `1 ± jitter_ratio`, to spread retry storms.
    pub jitter_ratio: f64,
    /// How long the broker keeps a popped message invisible; popgate renews it (ChangeInvisibleTime) ahead of
    /// expiry while it still owns the delivery, so after a crash the broker redelivers within about this time.
    pub lease_ms: u64,
    /// Largest POP batch (the broker's limit is 32).
    pub pop_batch: u32,
    /// How long one POP may wait at the broker for a message.
    pub pop_poll_ms: u64,
    /// Default per-subscriber prefetch of push transports: at most this many unACKed deliveries in flight to
    /// one SSE or WebSocket subscriber (`?prefetch=` may lower or raise it up to 1024).
    pub prefetch: usize,
    /// When a push subscriber disconnects, hand its unACKed deliveries to another subscriber at once, instead
    /// of after their ACK timeout (the client may still ACK them over `POST /events/ack`).
    pub redeliver_on_disconnect: bool,
    /// Most deliveries one instance holds in flight; POP pauses (backpressure) at this bound.
    pub max_in_flight: usize,
    /// Most deliveries one subscription (group + topic) holds in flight, so one busy group cannot take the
    /// whole instance bound from the others.
    pub max_in_flight_per_subscription: usize,
    /// A subscription that a receive created on its own (a long poll, a push stream or a gRPC receive for a
    /// group and topic nobody subscribed with `POST /events/subscribe`) is removed after this long with no
    /// receive waiting and nothing in flight; the next receive creates it again. Subscriptions made with
    /// `POST /events/subscribe` stay until removed. Bounds the POP loops and stored subscriptions that
    /// clients coming and going leave behind.
    pub idle_subscription_expiry_secs: u64,
    /// How often the operators' gauges are refreshed: each subscription's backlog and its group's DLQ depth
    /// (broker requests), and the age of its oldest unacknowledged delivery.
    pub gauge_refresh_ms: u64,
    /// A consumer group the cluster makes orderly (its subscription group's `consumeMessageOrderly`, set with
    /// `mqadmin updateSubGroup -o true`) gets FIFO delivery, as from Apache's proxy; read from the brokers and
    /// refreshed every 20 s. `false`: only `POST /events/subscribe {"ordered": true}` makes a group FIFO.
    pub follow_group_config: bool,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            state_dir: PathBuf::from("./popgate-data"),
            ack_timeout_ms: 30_000,
            max_attempts: 6,
            initial_backoff_ms: 1_000,
            max_backoff_ms: 16_000,
            jitter_ratio: 0.2,
            lease_ms: 60_000,
            pop_batch: 16,
            pop_poll_ms: 5_000,
            prefetch: 32,
            redeliver_on_disconnect: false,
            max_in_flight: 100_000,
            max_in_flight_per_subscription: 10_000,
            idle_subscription_expiry_secs: 600,
            gauge_refresh_ms: DEFAULT_GAUGE_REFRESH_MS,
            follow_group_config: true,
        }
    }
}

/// A configuration that cannot be used; the message names the key and the reason.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file or an environment variable could not be read or does not fit the schema.
    #[error("{0}")]
    Parse(String),
    /// Values that parse but cannot work together; one line per problem, each naming its key.
    #[error("invalid configuration:\n{}", .0.join("\n"))]
    Invalid(Vec<String>),
}

/// A validated configuration, and the environment variables that were left out of it.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedConfig {
    /// The configuration.
    pub config: Config,
    /// The `POPGATE_*` variables that name no config section (Kubernetes' service links), sorted; not config,
    /// so not applied, and worth one warning.
    pub ignored_env: Vec<String>,
}

impl LoadedConfig {
    /// The one warning about [`Self::ignored_env`], or `None` when every variable was config.
    pub fn ignored_env_warning(&self) -> Option<String> {
        (!self.ignored_env.is_empty()).then(|| {
            format!(
                "ignoring {} environment variable(s) that name no config section (not config, e.g. Kubernetes \
                 service links): {}",
                self.ignored_env.len(),
                self.ignored_env.join(", ")
            )
        })
    }
}

impl Config {
    /// Reads `file` (when given) and then the `POPGATE_*` environment, and validates the result.
    ///
    /// # Errors
    /// [`ConfigError`] naming the offending key when the file is missing or malformed, a key is unknown or has
    /// the wrong type, or a value is out of range.
    pub fn load(file: Option<&Path>) -> Result<LoadedConfig, ConfigError> {
        Self::load_from(file, Env::prefixed(ENV_PREFIX).split("__"))
    }

    /// Like [`Config::load`] with an explicit environment provider, so tests never touch the real environment.
    /// `env` is expected to map `POPGATE_A__B` to the key `a.b`, as [`Config::load`]'s does: the ignored
    /// variables are named back that way.
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn load_from(file: Option<&Path>, env: Env) -> Result<LoadedConfig, ConfigError> {
        let mut figment = Figment::new();
        if let Some(path) = file {
            if !path.is_file() {
                return Err(ConfigError::Parse(format!("config file {} does not exist", path.display())));
            }
            figment = figment.merge(Toml::file(path));
        }
        let sections = section_names();
        let ignored_env = env_outside(&env, &sections);
        let env = env.filter(move |key| names_a_section(key.as_str(), &sections));
        let config: Config = figment.merge(env).extract().map_err(|e| ConfigError::Parse(describe_figment_error(e)))?;
        config.validate()?;
        Ok(LoadedConfig { config, ignored_env })
    }

    /// Parses a TOML string (no environment), validating it: for tests and tools.
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        let config: Config = Figment::new()
            .merge(Toml::string(text))
            .extract()
            .map_err(|e| ConfigError::Parse(describe_figment_error(e)))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and cross-field rules, reporting every problem at once.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] listing each bad key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let problems = validate::problems(self);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }
}

/// The top-level sections of the config file (`server`, `broker`, …), read off [`Config`] itself so that a
/// new section is known here without a second list to keep.
fn section_names() -> Vec<String> {
    match serde_json::to_value(Config::default()) {
        Ok(serde_json::Value::Object(sections)) => sections.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// Whether an environment key (`publish.send_timeout_ms`, `service_host`) starts with a config section; the
/// provider's keys are not yet lowercased when its filter sees them.
fn names_a_section(key: &str, sections: &[String]) -> bool {
    let first = key.split('.').next().unwrap_or_default();
    sections.iter().any(|section| section.eq_ignore_ascii_case(first))
}

/// The variables of `env` that start with no config section, named as set (`POPGATE_SERVICE_HOST`), sorted.
fn env_outside(env: &Env, sections: &[String]) -> Vec<String> {
    let mut names: Vec<String> = env
        .iter()
        .filter(|(key, _)| !names_a_section(key.as_str(), sections))
        .map(|(key, _)| format!("{ENV_PREFIX}{}", key.as_str().replace('.', "__").to_ascii_uppercase()))
        .collect();
    names.sort();
    names
}

/// Figment's errors name the key path (`publish.send_timeout_ms`); keep every one of them, one per line.
fn describe_figment_error(error: figment::Error) -> String {
    let lines: Vec<String> = error
        .into_iter()
        .map(|e| {
            let key = e.path.join(".");
            if key.is_empty() {
                format!("config: {}", e.kind)
            } else {
                format!("config key `{key}`: {}", e.kind)
            }
        })
        .collect();
    lines.join("\n")
}

#[cfg(test)]
mod tests;
