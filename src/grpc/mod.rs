//! The RocketMQ 5 gRPC front: `apache.rocketmq.v2.MessagingService`, the protocol of the official 5.x SDKs,
//! so an app built on them points at popgate by changing only its endpoint.
//!
//! Like the HTTP front it holds no message or delivery state and decides nothing an application may do: each
//! RPC is decoded, handed to the gateway, and its refusal mapped in one place ([`status::refused`]). TLS and
//! plaintext share one port (see [`listener`]).
//!
//! ```text
//! listener (TLS sniffing) ──▶ service::Front ──▶ route / settings ──▶ gateway::may_look_up, may_subscribe
//!                                            ├─▶ send ────────────▶ gateway::Publishing
//!                                            ├─▶ consume ─────────▶ gateway::Deliveries (Reader), Settling
//!                                            └─▶ transaction ─────▶ gateway::Ending (check-backs: Transactions)
//! ```

mod consume;
mod deadline;
mod limits;
mod listener;
mod names;
mod producers;
pub mod proto;
mod route;
mod send;
mod service;
mod settings;
mod status;
mod transaction;
mod written;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

pub use listener::{tls_config, GrpcTlsError};

use crate::auth::TokenTable;
use crate::config::Config;
use crate::gateway::below::Transactions;
use crate::publish::Publisher;

/// Largest gRPC message popgate reads: a send of the largest body the broker takes, plus its properties.
const MAX_DECODING_BYTES: usize = 16 * 1024 * 1024;

/// The layers the front calls, and who may call it.
pub struct Parts {
    /// The publish path.
    pub publisher: Arc<Publisher>,
    /// The delivery core, through the gateway.
    pub deliveries: crate::gateway::Deliveries,
    /// Transactional messages' records.
    pub transactions: Arc<Transactions>,
    /// The tokens.
    pub tokens: Arc<TokenTable>,
    /// The tier's other instances, when this one is in a tier.
    pub owners: Option<Arc<dyn crate::gateway::Owners>>,
    /// Whose each client id is, shared with the other fronts.
    pub client_owners: crate::gateway::ClientOwners,
}

/// Serves the gRPC front on `listener` until `shutdown` resolves.
///
/// # Errors
/// When the server fails.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    parts: Parts,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (stopping, stop_asked) = tokio::sync::watch::channel(false);
    let config_keepalive_secs = config.grpc.keepalive_secs;
    let max_concurrent_streams = config.grpc.max_concurrent_streams;
    let max_connections = config.grpc.max_connections;
    let call_timeout = std::time::Duration::from_secs(config.grpc.call_timeout_secs);
    let front = Arc::new(service::Front::new(parts, config, stop_asked));
    // The brokers' transaction check-backs go to this front's producers.
    let forwarder: std::sync::Weak<dyn crate::gateway::below::CheckForwarder> = Arc::downgrade(&front) as _;
    front.transactions.add_forwarder(forwarder);
    tokio::spawn(service::keep_alive_loop(Arc::downgrade(&front)));
    let service = written::WatchReceives::new(
        proto::messaging_service_server::MessagingServiceServer::new(front)
            .max_decoding_message_size(MAX_DECODING_BYTES),
    );
    // On shutdown the open long polls are answered first (the front watches `stopping`), so tonic's graceful
    // shutdown (GOAWAY, then the calls in flight) is not held up by receives waiting up to 20 s.
    let shutdown = async move {
        shutdown.await;
        let _ = stopping.send(true);
    };
    let keepalive = (config_keepalive_secs > 0).then(|| std::time::Duration::from_secs(config_keepalive_secs));
    tonic::transport::Server::builder()
        // tonic sets none, unlike hyper (200): one connection could open streams without end.
        .max_concurrent_streams(max_concurrent_streams)
        // Nor a time to read a request in: a message sent a byte at a time was waited for for ever.
        .timeout(call_timeout)
        .http2_keepalive_interval(keepalive)
        .http2_keepalive_timeout(keepalive)
        .add_service(service)
        .serve_with_incoming_shutdown(listener::incoming(listener, tls, max_connections), shutdown)
        .await
}
