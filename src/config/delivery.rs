//! The consume path's sections: `[delivery]` (POP, ACK timeouts, retries, bounds), `[webhook]` (which
//! addresses pushes may reach) and `[admin]` (DLQ replay pacing).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::networks;

/// How often the operators' gauges ask the brokers: about a scrape's worth of freshness for a dashboard, one
/// GET_CONSUME_STATS per broker per subscription and one GET_TOPIC_STATS_INFO per broker per group.
pub const DEFAULT_GAUGE_REFRESH_MS: u64 = 15_000;

/// The shortest refresh period allowed: tests use a short one; below this the broker requests are a load.
pub const MIN_GAUGE_REFRESH_MS: u64 = 100;

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
    /// The shortest broker lease: how long the broker keeps a popped message invisible while this instance holds
    /// few deliveries. popgate renews a lease (ChangeInvisibleTime) when half of it is left while it still owns
    /// the delivery, so an instance lost for good gives its deliveries back through the broker within about
    /// this time. Holding more, popgate asks for longer leases (see `lease_renewals_per_sec`).
    pub lease_ms: u64,
    /// The longest broker lease popgate asks for: the bound on how long the deliveries of an instance lost for
    /// good (never restarted with its state) take to come back through the broker. At most 12 h, the longest
    /// invisible time Apache's proxy lets a client ask for.
    pub max_lease_ms: u64,
    /// The broker lease renewals a second one instance plans for. Every held delivery is renewed once per half
    /// lease (the broker has no batch form), so with more than `lease_renewals_per_sec × lease_ms / 2` held each
    /// new lease is lengthened to `2 × held / lease_renewals_per_sec` (at most `max_lease_ms`), keeping the
    /// renewals near this rate however many are held.
    pub lease_renewals_per_sec: u32,
    /// Largest POP batch (the broker's limit is 32).
    pub pop_batch: u32,
    /// How long one POP may wait at the broker for a message, with few POPs waiting (see `pop_polls_per_sec`).
    pub pop_poll_ms: u64,
    /// The POPs a second that come back empty one idle instance plans for. Each subscription keeps one POP
    /// waiting at each broker of its topic, so with more than `pop_polls_per_sec × pop_poll_ms / 1000` waiting
    /// each POP waits longer, `waiting / pop_polls_per_sec` seconds (at most 60 s), keeping an idle instance's
    /// POPs near this rate however many subscriptions it serves. A message still ends a POP as it arrives.
    pub pop_polls_per_sec: u32,
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
    /// The broker requests a second the gauges' refresh may make (one per subscription for its backlog, one per
    /// group for its DLQ depth). With more subscriptions than `gauge_refresh_ms × gauge_requests_per_sec / 2000`
    /// a refresh takes longer than `gauge_refresh_ms`, and the gauges are that much older: at 10 000
    /// subscriptions, 100 s with the default. Unpaced, 10 000 subscriptions asked the brokers without a pause,
    /// for as long as popgate ran.
    pub gauge_requests_per_sec: u32,
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
            max_lease_ms: 3_600_000,
            lease_renewals_per_sec: 1_000,
            pop_batch: 32,
            pop_poll_ms: 5_000,
            pop_polls_per_sec: 200,
            prefetch: 32,
            redeliver_on_disconnect: false,
            max_in_flight: 100_000,
            max_in_flight_per_subscription: 10_000,
            idle_subscription_expiry_secs: 600,
            gauge_refresh_ms: DEFAULT_GAUGE_REFRESH_MS,
            gauge_requests_per_sec: 200,
            follow_group_config: true,
        }
    }
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
