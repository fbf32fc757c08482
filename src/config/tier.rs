//! `[tier]`: several popgate instances as one, and the rule for an instance's id. Its own room because the
//! peer link (listen address, peers, secret, TLS) is a concern no other section shares.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Most characters of a tier instance's id (`tier.instance_id`): it starts every delivery id and handle.
pub const MAX_INSTANCE_ID_LEN: usize = 40;

/// Whether `id` may be a tier instance's id: 1 to [`MAX_INSTANCE_ID_LEN`] lowercase ASCII letters, digits and
/// `-`, starting with a letter or digit (a Kubernetes pod name's first label fits).
pub fn is_valid_instance_id(id: &str) -> bool {
    (1..=MAX_INSTANCE_ID_LEN).contains(&id.len())
        && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
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
