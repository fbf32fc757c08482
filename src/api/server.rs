//! The HTTP port's connections: each served on a task of its own (HTTP/1.1, upgrades for WebSockets), at most
//! `server.max_connections` at once, each closed once it has not completed a request head for
//! `server.idle_timeout_secs`: before its first request, between requests, or while it sends its headers a byte
//! at a time. `axum::serve` bounds neither the number nor the time (its hyper connections get no timer, so
//! hyper's header timeout never runs): a client that connected and sent nothing, or too little, held its
//! connection for ever.
//!
//! A request's body is the router's to time (`guard::read_body_in_time`): a long poll or a stream is a request
//! whose client rightly sends nothing for a long time, so the connection has no read timeout of its own.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::serve::Listener;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use metrics::counter;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

use super::guard::PeerAddr;
use crate::metrics as m;

/// The bounds on the port's connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionBounds {
    /// Most connections served at once; one more is closed at once.
    pub max_connections: usize,
    /// Longest time a connection may go without completing a request head.
    pub idle_timeout: Duration,
}

/// Serves `router` on what `listener` accepts until `shutdown` resolves; then stops accepting, lets each
/// connection finish the request it is serving, and returns once every connection is closed.
pub async fn serve<L>(
    mut listener: L,
    router: Router,
    bounds: ConnectionBounds,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) where
    L: Listener<Addr = std::net::SocketAddr>,
{
    let slots = Arc::new(Semaphore::new(bounds.max_connections));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(bounds.idle_timeout);
    // `true` once shutdown is asked for: each connection then finishes the request it serves and closes.
    let (stop_tx, stop_rx) = watch::channel(false);
    // A receiver held by each connection's task until it ends: `closed()` on the sender tells that all have.
    let (open_tx, open_rx) = watch::channel(());
    tokio::pin!(shutdown);
    loop {
        let (io, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            counter!(m::HTTP_CONNECTIONS_REFUSED).increment(1);
            tracing::debug!(%peer, "HTTP connection refused: server.max_connections are open.");
            continue;
        };
        let service = router.clone().map_request(move |mut request: axum::http::Request<Incoming>| {
            request.extensions_mut().insert(ConnectInfo(PeerAddr(peer)));
            request
        });
        let connection = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service)).with_upgrades();
        let (mut stop_rx, open_rx) = (stop_rx.clone(), open_rx.clone());
        tokio::spawn(async move {
            tokio::pin!(connection);
            let mut stopping = false;
            let result = loop {
                tokio::select! {
                    result = connection.as_mut() => break result,
                    _ = stop_rx.wait_for(|stop| *stop), if !stopping => {
                        stopping = true;
                        connection.as_mut().graceful_shutdown();
                    }
                }
            };
            if let Err(error) = result {
                if error.is_timeout() {
                    counter!(m::HTTP_CONNECTIONS_CLOSED, "reason" => "idle").increment(1);
                }
                tracing::debug!(%peer, %error, "HTTP connection ended with an error.");
            }
            drop((slot, open_rx));
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(open_rx);
    open_tx.closed().await;
}
