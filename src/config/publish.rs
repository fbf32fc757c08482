//! `[publish]` and `[fault_avoidance]`: RocketMQ's producer policy (retries, timeouts, message limits) and the
//! latency table that picks brokers, with RocketMQ's own defaults as named consts.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// RocketMQ's own default for `retryTimesWhenSendFailed`: 1 + 2 = 3 attempts in all (seed 004).
pub const DEFAULT_RETRY_TIMES_WHEN_SEND_FAILED: u32 = 2;
/// RocketMQ caps the synchronous retries at 3 (seed 004: "default 2, maximum 3").
pub const MAX_RETRY_TIMES_WHEN_SEND_FAILED: u32 = 3;
/// RocketMQ's `sendMsgTimeout` default.
pub const DEFAULT_SEND_TIMEOUT_MS: u64 = 3_000;
/// The broker's default `maxMessageSize` (4 MiB).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Most messages in one batch publish: a bound on what one request makes popgate hold and encode (a batch of
/// 1 KiB messages reaches the broker's 4 MiB first).
pub const DEFAULT_MAX_BATCH_MESSAGES: usize = 1_000;
/// MQFaultStrategy's latency steps (ms): a send slower than step *i* isolates the broker for `NOT_AVAILABLE[i]`.
pub const DEFAULT_LATENCY_MAX_MS: [u64; 7] = [50, 100, 550, 1_000, 2_000, 3_000, 15_000];
/// MQFaultStrategy's isolation periods (ms) for each latency step.
pub const DEFAULT_NOT_AVAILABLE_MS: [u64; 7] = [0, 0, 30_000, 60_000, 120_000, 180_000, 600_000];
/// A network error or timeout isolates a broker for 10 minutes (seed 004).
pub const DEFAULT_NETWORK_ERROR_ISOLATION_MS: u64 = 600_000;

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
    /// Most messages in one batch publish (an HTTP array body); the batch's body as a whole is bounded by
    /// `max_message_bytes`, as the broker bounds it.
    pub max_batch_messages: usize,
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
            max_batch_messages: DEFAULT_MAX_BATCH_MESSAGES,
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
