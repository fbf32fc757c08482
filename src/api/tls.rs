//! HTTPS on the listener (rustls), when `server.tls_cert_path` and `server.tls_key_path` are configured.
//!
//! Handshakes run in their own tasks, each bounded by [`HANDSHAKE_TIMEOUT`], so one slow or hostile client
//! never holds up the accept loop; a failed handshake is logged and counted
//! (`popgate_tls_handshake_failures_total`), and the connection dropped.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use metrics::counter;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::metrics as m;

/// Longest time a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshaken connections waiting for the server to take them.
const ACCEPTED_BACKLOG: usize = 128;

/// Why the TLS configuration cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("TLS: {0}")]
pub struct TlsError(String);

/// The rustls server configuration from PEM files (certificate chain first, then the key).
///
/// # Errors
/// [`TlsError`] naming the file that cannot be read or used.
pub fn server_config(cert_path: &Path, key_path: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    crate::tls::server_config(Some((cert_path, key_path)), &[b"http/1.1"]).map_err(|e| TlsError(e.to_string()))
}

/// A listener that yields only connections whose TLS handshake succeeded.
pub struct TlsListener {
    accepted: mpsc::Receiver<(TlsStream<tokio::net::TcpStream>, SocketAddr)>,
    local_addr: SocketAddr,
    accept_loop: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    /// Starts accepting on `listener`, handshaking with `config`.
    ///
    /// # Errors
    /// When the listener has no local address.
    pub fn new(listener: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<TlsListener> {
        let local_addr = listener.local_addr()?;
        let (tx, accepted) = mpsc::channel(ACCEPTED_BACKLOG);
        let acceptor = TlsAcceptor::from(config);
        let accept_loop = tokio::spawn(accept_loop(listener, acceptor, tx));
        Ok(TlsListener { accepted, local_addr, accept_loop })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept_loop.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    tx: mpsc::Sender<(TlsStream<tokio::net::TcpStream>, SocketAddr)>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(%error, "Accepting a connection failed.");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        super::listener::send_small_writes_at_once(&stream);
        let (acceptor, tx) = (acceptor.clone(), tx.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    let _ = tx.send((tls, peer)).await;
                }
                Ok(Err(error)) => {
                    counter!(m::TLS_HANDSHAKE_FAILURES).increment(1);
                    tracing::info!(%peer, %error, "TLS handshake failed.");
                }
                Err(_) => {
                    counter!(m::TLS_HANDSHAKE_FAILURES).increment(1);
                    tracing::info!(%peer, "TLS handshake timed out.");
                }
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(accepted) => accepted,
            // The accept loop only ends when this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local_addr)
    }
}
