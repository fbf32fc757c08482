//! TLS and plaintext on one port, as Apache's proxy serves them in its permissive mode: the first byte of a
//! connection tells them apart (0x16 opens a TLS handshake; an h2c client starts with "PRI * HTTP/2.0").
//! The official SDKs use TLS by default and accept any certificate, so without a configured one popgate
//! generates a self-signed certificate at start.
//!
//! Handshakes run in their own tasks, bounded by [`HANDSHAKE_TIMEOUT`], so one slow client never holds up
//! the accept loop; a failed one is counted (`popgate_tls_handshake_failures_total`) and dropped.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use metrics::counter;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::metrics as m;

/// Longest time a client may take to send its first byte and finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Accepted connections waiting for the server to take them.
const ACCEPTED_BACKLOG: usize = 128;
/// The first byte of a TLS record carrying a handshake.
const TLS_HANDSHAKE: u8 = 0x16;

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
    let (certs, key) = match cert_and_key {
        Some((cert_path, key_path)) => read_pem(cert_path, key_path)?,
        None => self_signed()?,
    };
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| GrpcTlsError(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| GrpcTlsError(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

type CertAndKey = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

fn read_pem(cert_path: &Path, key_path: &Path) -> Result<CertAndKey, GrpcTlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_path)
        .and_then(Iterator::collect)
        .map_err(|e| GrpcTlsError(format!("{}: {e}", cert_path.display())))?;
    if certs.is_empty() {
        return Err(GrpcTlsError(format!("{}: no certificate found", cert_path.display())));
    }
    let key =
        PrivateKeyDer::from_pem_file(key_path).map_err(|e| GrpcTlsError(format!("{}: {e}", key_path.display())))?;
    Ok((certs, key))
}

fn self_signed() -> Result<CertAndKey, GrpcTlsError> {
    let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    let generated = rcgen::generate_simple_self_signed(names).map_err(|e| GrpcTlsError(e.to_string()))?;
    let key = PrivatePkcs8KeyDer::from(generated.signing_key.serialize_der());
    Ok((vec![generated.cert.der().clone()], key.into()))
}

/// One accepted connection, plaintext or TLS.
pub enum Connection {
    /// h2c.
    Plain(TcpStream),
    /// HTTP/2 over TLS.
    Tls(Box<TlsStream<TcpStream>>),
}

/// The connections of `listener`, each sniffed and (for TLS) handshaken, for
/// `tonic::transport::Server::serve_with_incoming`.
pub fn incoming(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
) -> ReceiverStream<Result<Connection, io::Error>> {
    let (tx, rx) = mpsc::channel(ACCEPTED_BACKLOG);
    let acceptor = TlsAcceptor::from(tls);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                () = tx.closed() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors and the like: pause rather than spin.
                        tracing::warn!(%error, "gRPC accept failed.");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            // tonic's own listener sets this; serve_with_incoming leaves it to us.
            let _ = tcp.set_nodelay(true);
            let (tx, acceptor) = (tx.clone(), acceptor.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, sniff(tcp, &acceptor)).await {
                    Ok(Ok(connection)) => {
                        let _ = tx.send(Ok(connection)).await;
                    }
                    Ok(Err(error)) => handshake_failed(&peer.to_string(), &error.to_string()),
                    Err(_) => handshake_failed(&peer.to_string(), "no handshake in time"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

fn handshake_failed(peer: &str, error: &str) {
    counter!(m::TLS_HANDSHAKE_FAILURES).increment(1);
    tracing::debug!(peer, error, "gRPC connection dropped before it was served.");
}

async fn sniff(tcp: TcpStream, acceptor: &TlsAcceptor) -> io::Result<Connection> {
    let mut first = [0u8; 1];
    if tcp.peek(&mut first).await? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before sending anything"));
    }
    if first[0] == TLS_HANDSHAKE {
        Ok(Connection::Tls(Box::new(acceptor.accept(tcp).await?)))
    } else {
        Ok(Connection::Plain(tcp))
    }
}

impl Connected for Connection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            Connection::Plain(tcp) => tcp.connect_info(),
            Connection::Tls(tls) => tls.get_ref().0.connect_info(),
        }
    }
}

/// Runs `$body` with `$io` bound to the pinned inner stream, whichever kind the connection is.
macro_rules! with_inner {
    ($self:ident, $io:ident => $body:expr) => {
        match $self.get_mut() {
            Connection::Plain(tcp) => {
                let $io = Pin::new(tcp);
                $body
            }
            Connection::Tls(tls) => {
                let $io = Pin::new(&mut **tls);
                $body
            }
        }
    };
}

impl AsyncRead for Connection {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        with_inner!(self, io => io.poll_read(cx, buf))
    }
}

impl AsyncWrite for Connection {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        with_inner!(self, io => io.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        with_inner!(self, io => io.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Connection::Plain(tcp) => tcp.is_write_vectored(),
            Connection::Tls(tls) => tls.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        with_inner!(self, io => io.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        with_inner!(self, io => io.poll_shutdown(cx))
    }
}
