//! The gRPC front's connections: TLS and plaintext on one port ([`crate::tls`]). The official SDKs use TLS by
//! default and accept any certificate, so without a configured one popgate generates a self-signed
//! certificate at start.
//!
//! Handshakes run in their own tasks, bounded by [`HANDSHAKE_TIMEOUT`], so one slow client never holds up
//! the accept loop; a failed one is counted (`popgate_tls_handshake_failures_total`) and dropped. The same
//! time bounds the HTTP/2 preface that follows ([`crate::opening`]).

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use metrics::counter;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

use crate::metrics as m;
use crate::opening::Opening;
use crate::tls::MaybeTls;

/// Longest time a client may take to send its first byte, finish its TLS handshake and send the HTTP/2
/// connection preface.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the gRPC front's certificate cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("gRPC TLS: {0}")]
pub struct GrpcTlsError(String);

/// The rustls configuration of the gRPC front: the configured PEM files, or a self-signed certificate for
/// `localhost` and `127.0.0.1` generated now. gRPC needs HTTP/2, so ALPN offers `h2` only.
///
/// # Errors
/// [`GrpcTlsError`] naming the file that cannot be read or used.
pub fn tls_config(cert_and_key: Option<(&Path, &Path)>) -> Result<Arc<rustls::ServerConfig>, GrpcTlsError> {
    crate::tls::server_config(cert_and_key, &[b"h2"]).map_err(|e| GrpcTlsError(e.to_string()))
}

/// The connections of `listener`, each sniffed and (for TLS) handshaken, for
/// `tonic::transport::Server::serve_with_incoming`; at most `max_connections` open at once.
pub fn incoming(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    max_connections: usize,
) -> ReceiverStream<Result<Connection, io::Error>> {
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let acceptor = TlsAcceptor::from(tls);
    crate::tls::accept_each(listener, "gRPC", slots, too_many, move |tcp, peer, slot| {
        let acceptor = acceptor.clone();
        async move {
            let opened_by = Instant::now() + HANDSHAKE_TIMEOUT;
            match tokio::time::timeout_at(opened_by, crate::tls::sniff(tcp, &acceptor)).await {
                Ok(Ok(io)) => Some(Opening::new(io, peer, opened_by).holding(slot)),
                Ok(Err(error)) => handshake_failed(&peer.to_string(), &error.to_string()),
                Err(_) => handshake_failed(&peer.to_string(), "no handshake in time"),
            }
        }
    })
}

/// A connection closed at once: the front keeps `grpc.max_connections` open.
fn too_many(peer: std::net::SocketAddr) {
    counter!(m::GRPC_CONNECTIONS_REFUSED).increment(1);
    tracing::debug!(%peer, "gRPC connection closed: grpc.max_connections are open.");
}

fn handshake_failed(peer: &str, error: &str) -> Option<Connection> {
    counter!(m::TLS_HANDSHAKE_FAILURES).increment(1);
    tracing::debug!(peer, error, "gRPC connection dropped before it was served.");
    None
}

/// One accepted connection, plaintext or TLS, whose HTTP/2 preface must be in by the end of
/// [`HANDSHAKE_TIMEOUT`].
pub type Connection = Opening<MaybeTls>;
