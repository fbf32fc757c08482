//! `[auth]`: who may do what. Bearer tokens, their grants and ACL 2.0 entries, and the cluster's own users.

use serde::{Deserialize, Serialize};

use super::networks;

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
