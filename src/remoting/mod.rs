//! The RocketMQ remoting front: the protocol of Apache's remoting Java client (`rocketmq-client`:
//! `DefaultMQProducer`, `TransactionMQProducer`, `DefaultMQPushConsumer`, `DefaultLitePullConsumer`), so an app
//! on it points at popgate by setting its `namesrvAddr` to this front's address.
//!
//! The front is both of what such a client talks to. As its name server it answers routes with the cluster's
//! real queues and brokers, but with popgate's own address as every broker's address, so the client's broker
//! requests come here too. As its broker it sends producers' messages through popgate's publish path, keeps
//! the clients' heartbeats (consumer group membership, rebalance notifications), and relays consumer
//! requests (pulls, offsets, queue locks, send-backs) to the broker owning the queue, which must answer them.
//! Consumers that consume by POP (5.x clients with `setClientRebalance(false)`) are served from the delivery core.
//!
//! ```text
//! connection (frames) ──▶ service::Front ──▶ route ────▶ the name server (routes rewritten)
//!                                        ├─▶ clients ──▶ heartbeats, group membership, pushes to clients
//!                                        ├─▶ send ─────▶ gateway::Publishing
//!                                        ├─▶ transaction ▶ gateway::Ending (check-backs: Transactions)
//!                                        ├─▶ pop ──────▶ gateway::Deliveries (Reader), Settling
//!                                        └─▶ relay ────▶ the broker of the queue, after the relay table's check
//! ```
//!
//! Like the other fronts it holds no message or delivery state.

mod auth;
mod clients;
mod codes;
mod connection;
mod frame;
mod offset_turns;
mod pop;
mod ports;
mod relay;
mod reregistrations;
mod route;
mod send;
mod service;
mod transaction;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::auth::TokenTable;
use crate::config::Config;
use crate::gateway::below::Transactions;
use crate::publish::Publisher;

/// The layers the front calls, and who may call it.
pub struct Parts {
    /// The publish path.
    pub publisher: Arc<Publisher>,
    /// The cluster connection, for the requests relayed to a broker or the name server as they are (only).
    pub broker: crate::gateway::Relay,
    /// The delivery core, for consumers that consume by POP.
    pub deliveries: crate::gateway::Deliveries,
    /// The tokens.
    pub tokens: Arc<TokenTable>,
    /// Transactional messages' records.
    pub transactions: Arc<Transactions>,
    /// TLS for the clients that use it, on the same ports as plaintext.
    pub tls: Arc<rustls::ServerConfig>,
    /// The tier's other instances, when this one is in a tier.
    pub owners: Option<Arc<dyn crate::gateway::Owners>>,
    /// Whose each client id is, shared with the other fronts.
    pub client_owners: crate::gateway::ClientOwners,
}

/// Starts the remoting front: its brokers' own ports (for clients before 4.9.5) are bound again before this
/// returns, so they are open by the time popgate reports itself healthy; the returned future serves `listener`
/// until `shutdown` resolves. `advertised` is the address clients are given as every broker's.
///
/// The returned future fails when the listener fails.
pub async fn start(
    listener: TcpListener,
    advertised: String,
    parts: Parts,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> impl Future<Output = std::io::Result<()>> + Send + 'static {
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let front = Arc::new(service::Front::new(parts, config, advertised, stopping));
    // The brokers' check-backs of remoting producers' transactions are asked of those producers.
    let forwarder: std::sync::Weak<dyn crate::gateway::below::CheckForwarder> = Arc::downgrade(&front) as _;
    front.transactions.add_forwarder(forwarder);
    tokio::spawn(clients::expiry_loop(Arc::downgrade(&front.clients)));
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    front.broker_ports.restore(&front).await;
    let stopped = front.stopped();
    connection::accept_loop(listener, front, stopped, None)
}
