//! `[reliability]`: what "stored" means (seed 004's four flush/replication profiles) and how popgate holds the
//! brokers and its own state store to it.

use serde::{Deserialize, Serialize};

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
