//! popgate: a proxy in front of an Apache RocketMQ 5.x cluster that gives applications at-least-once delivery
//! over HTTP, RocketMQ's 5.x gRPC protocol and its remoting protocol, several instances acting as one.
//!
//! # Architecture
//!
//! Fronts decode a protocol and map one error type to their codes; the gateway decides what each request may do
//! and does it, the same for every front; below it, the delivery core (POP, deferred broker ACK, redelivery, the
//! DLQ), transaction records and the publish path keep their state in the store and talk to the brokers.
//!
//! ```text
//!   api (HTTP)   grpc (MessagingService)   remoting (4.x clients)   tier::server (peer link)
//!        \                |                        |                        /
//!         └───────────────┴──────── gateway ───────┴───────────────────────┘
//!                  (authorization, publishing, reading, settling, ending, client ids)
//!                 /               |                    \                    \
//!            delivery        transaction             publish              tier (other instances)
//!                 \               |                    /
//!                  └──── store (RocksDB) ─── broker (the cluster) ───┘
//! ```
//!
//! # Layout
//!
//! - [`config`]: the TOML file and `POPGATE_*` overrides, validated before anything binds.
//! - [`broker`]: the cluster connection (routes, sends), the fault-avoidance table, popgate's message type.
//! - [`publish`]: the publish path: request parsing and RocketMQ's producer policy (retries, broker choice).
//! - [`delivery`]: the consume path: POP, deferred broker ACK, retries, the DLQ, boot recovery.
//! - [`store`]: the RocksDB state store the consume path writes before it acts, and the publish path's de-duplication window.
//! - [`reliability`]: the reliability profile checked against each broker's running settings.
//! - [`auth`]: bearer tokens and what each may do.
//! - [`gateway`]: the decisions every front makes the same way (what a caller may do, and what it does).
//! - [`dlq`]: browsing and replaying dead-lettered events (the admin plane's DLQ).
//! - [`api`]: the HTTP routes and the one error type they answer with, and the HTTP push transports (SSE,
//!   WebSocket, webhook push).
//! - [`grpc`]: the RocketMQ 5 gRPC front (`MessagingService`), for apps on the official 5.x SDKs.
//! - [`remoting`]: the RocketMQ remoting front, for apps on the remoting Java client (4.x style).
//! - [`tier`]: several instances as one tier: each instance's id, and the peer link over which any instance
//!   settles a delivery another one handed out.
//! - [`transaction`]: transactional messages' durable records and their ends.
//! - [`metrics`]: every metric's name, help text and buckets.
//! - [`clock`]: popgate's one clock ([`clock::Epoch`]: every deadline, lease and expiry) and the only reading of
//!   the wall clock.
//! - [`listen`]: every port's listening socket (its accept queue's length).
//! - `opening`: how long a connection to an HTTP/2 port (gRPC, the peer link) may take to open.
//! - [`cli`]: the operator CLI's client of the admin API.
//! - [`app`]: wiring and the serve loop; `main.rs` only parses the CLI and waits for a signal.
//!
//! # Layers
//!
//! Arrows run down only: `app` → the fronts (`api`, `grpc`, `remoting`, the peer link in `tier`; and `cli`) →
//! `gateway` → `delivery`, `transaction`, `publish`, `dlq`, `auth`, `reliability` → `broker`, `store` → `config`;
//! `metrics`, `clock` and `listen` are leaves anyone may use. In particular `publish` knows nothing of HTTP, a front holds the delivery
//! core only as `gateway::Deliveries` (reads start from a checked `gateway::Reader`) and names what else lies
//! below the gateway only through `gateway::below`, and `config` imports no other module. Unit tests below read
//! the sources and fail on an arrow that runs back up.

//! # Visibility
//!
//! `pub(crate)` by default: a module is `pub` only where the binary (`main.rs`), the it/ tests or the bench
//! name something in it (the protos of the gRPC front and the peer link, the store and a delivery record for
//! the boot benchmark, the broker client for the direct-path baseline, the config and the CLI); inside a
//! `pub(crate)` module an item's `pub` reaches no further than the crate.

#![recursion_limit = "256"]
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod api;
pub(crate) mod app;
pub(crate) mod auth;
pub mod broker;
pub mod cli;
pub mod clock;
pub mod config;
pub mod delivery;
pub mod dlq;
pub(crate) mod gateway;
pub mod grpc;
pub mod listen;
pub(crate) mod metrics;
mod opening;
pub(crate) mod publish;
pub(crate) mod reliability;
pub(crate) mod remoting;
pub mod store;
pub mod tier;
pub(crate) mod tls;
pub(crate) mod transaction;

pub use app::{serve, AppError};
pub use config::Config;

#[cfg(test)]
mod layering {
    /// For each module (a folder or a file under `src/`), the modules its code must not name.
    const FORBIDDEN: &[(&str, &[&str])] = &[
        ("config", &["api", "app", "auth", "broker", "cli", "delivery", "dlq", "publish", "reliability", "store"]),
        ("store", &["api", "app", "auth", "broker", "cli", "delivery", "dlq", "publish", "reliability"]),
        ("broker", &["api", "app", "auth", "cli", "delivery", "dlq", "publish", "reliability", "store"]),
        // The publish path keeps its de-duplication window in the state store (below it, beside the broker).
        ("publish", &["api", "app", "auth", "cli", "delivery", "dlq", "reliability"]),
        ("delivery", &["api", "app", "auth", "cli", "dlq", "reliability"]),
        ("auth", &["api", "app", "cli", "delivery", "dlq", "publish", "store"]),
        ("dlq", &["api", "app", "auth", "cli"]),
        // A front reaches the delivery core, the transaction records and the brokers only through the gateway
        // (`gateway::below` lists what it may name of them).
        ("api", &["app", "broker", "cli", "delivery", "grpc", "remoting", "store", "transaction"]),
        // The gateway is below every front and above the layers it decides for.
        ("gateway", &["api", "app", "cli", "grpc", "remoting"]),
        ("grpc", &["api", "app", "broker", "cli", "delivery", "dlq", "remoting", "store", "transaction"]),
        ("remoting", &["api", "app", "broker", "cli", "delivery", "dlq", "grpc", "store", "transaction"]),
        // The peer link between the instances of a tier is a front too.
        ("tier", &["api", "app", "broker", "cli", "delivery", "dlq", "grpc", "remoting", "store", "transaction"]),
        // Transaction records live in the state store, their ends go to the brokers; the fronts call it.
        ("transaction", &["api", "app", "auth", "cli", "delivery", "dlq", "grpc", "publish", "reliability"]),
    ];

    fn sources(path: &std::path::Path, out: &mut Vec<(String, String)>) {
        if path.is_dir() {
            for entry in std::fs::read_dir(path).into_iter().flatten().flatten() {
                sources(&entry.path(), out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            out.push((path.display().to_string(), text));
        }
    }

    #[test]
    fn no_arrow_runs_back_up() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut breaks = Vec::new();
        for (module, forbidden) in FORBIDDEN {
            let mut files = Vec::new();
            sources(&src.join(module), &mut files);
            sources(&src.join(format!("{module}.rs")), &mut files);
            assert!(!files.is_empty(), "module {module} has sources");
            for (path, text) in files {
                for target in *forbidden {
                    if text.contains(&format!("crate::{target}::")) || text.contains(&format!("crate::{target}}}")) {
                        breaks.push(format!("{path} names crate::{target}"));
                    }
                }
            }
        }
        assert!(breaks.is_empty(), "arrows that run back up: {breaks:#?}");
    }

    /// Who may do what is the gateway's to decide, once for every front: a front names no authorization
    /// action and asks no caller what it may do; it calls `gateway::may_*` and maps the refusal.
    #[test]
    fn the_fronts_leave_authorization_to_the_gateway() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut breaks = Vec::new();
        for front in ["api", "grpc", "remoting"] {
            let mut files = Vec::new();
            sources(&src.join(front), &mut files);
            for (path, text) in files {
                for decision in [".may(", "Action::", "auth::Action", "auth::{Action"] {
                    if text.contains(decision) {
                        breaks.push(format!("{path} decides authorization itself (`{decision}`)"));
                    }
                }
            }
        }
        assert!(breaks.is_empty(), "{breaks:#?}");
    }

    /// Whether `text` has `word` on its own (not inside a longer name such as `HandOutFacts`).
    fn names_word(text: &str, word: &str) -> bool {
        let part_of_name = |c: char| c.is_alphanumeric() || c == '_';
        text.match_indices(word).any(|(at, _)| {
            let before = text[..at].chars().next_back();
            let after = text[at + word.len()..].chars().next();
            !before.is_some_and(part_of_name) && !after.is_some_and(part_of_name)
        })
    }

    /// popgate has one clock: every deadline is a `clock::Epoch`, and the wall clock is read in `clock.rs` alone
    /// (a deadline made from the wall clock and compared with one from popgate's clock is off by every step the
    /// wall clock took since start).
    #[test]
    fn the_wall_clock_is_read_in_one_place() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&src, &mut files);
        let readers: Vec<&String> = files
            .iter()
            .filter(|(path, text)| !path.ends_with("clock.rs") && text.contains(&["SystemTime", "::now()"].concat()))
            .map(|(path, _)| path)
            .collect();
        assert!(readers.is_empty(), "read the wall clock outside clock.rs: {readers:#?}");
    }

    /// A front holds the delivery core only as `gateway::Deliveries`: every read starts from a checked
    /// `gateway::Reader`, every settlement goes through `gateway::Settling`. Naming the core's `Dispatcher`
    /// (or the receive steps beneath the gateway's) would let a front skip them; naming the `BrokerClient` would
    /// let it send, POP or ACK around the gateway (the remoting front relays through `gateway::Relay`).
    #[test]
    fn the_fronts_reach_the_delivery_core_only_through_the_gateway() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut breaks = Vec::new();
        for front in ["api", "grpc", "remoting", "tier"] {
            let mut files = Vec::new();
            sources(&src.join(front), &mut files);
            for (path, text) in files {
                for core in
                    ["Dispatcher", "BrokerClient", "HandOut", "Holder", "poll_as", "ensure_filtered", "Settling {"]
                {
                    if names_word(&text, core) {
                        breaks.push(format!("{path} names the delivery core's `{core}`"));
                    }
                }
            }
        }
        assert!(breaks.is_empty(), "{breaks:#?}");
    }
}
