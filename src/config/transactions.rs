//! `[transactions]`: the producer group of popgate's half messages, how long their records are kept, and
//! the HTTP producers' checkers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

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
