//! `[broker]`: how popgate reaches the RocketMQ cluster (name servers, route cache, timeouts, credentials).

use std::time::Duration;

use serde::{Deserialize, Serialize};

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
