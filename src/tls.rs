//! TLS and plaintext on one port, for the fronts that serve both (gRPC, remoting), as Apache's proxy serves them
//! in its permissive mode: the first byte of a connection tells them apart (0x16 opens a TLS handshake; neither
//! an h2c preface nor a remoting frame, whose length would be over 350 MiB, starts with it). Clients of both
//! protocols accept any certificate by default, so without a configured one popgate generates a self-signed
//! certificate at start.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// The first byte of a TLS record carrying a handshake.
const TLS_HANDSHAKE: u8 = 0x16;
/// Opened connections waiting for their server to take them.
const ACCEPTED_BACKLOG: usize = 128;

/// The connections of `listener` that `open` made ready to serve, for tonic's `serve_with_incoming`: each
/// accepted connection takes one of `slots` (none left: it is closed at once, and `full` counts it), and is
/// handed with it to `open` (a handshake, a check, a deadline) on a task of its own, so a slow or hostile client
/// never holds up the others; it is served when `open` gives it back (holding its slot until it closes), and
/// `None` (counted and logged by `open`) closes it. `port` names the port when accepting fails (out of file
/// descriptors and the like: the loop pauses rather than spins). Stops when the stream is dropped.
pub fn accept_each<T, Open, Opened>(
    listener: TcpListener,
    port: &'static str,
    slots: Arc<tokio::sync::Semaphore>,
    full: fn(SocketAddr),
    open: Open,
) -> ReceiverStream<Result<T, io::Error>>
where
    T: Send + 'static,
    Open: Fn(TcpStream, SocketAddr, tokio::sync::OwnedSemaphorePermit) -> Opened + Send + 'static,
    Opened: Future<Output = Option<T>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(ACCEPTED_BACKLOG);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                () = tx.closed() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(%error, port, "Accepting a connection failed.");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                full(peer);
                continue;
            };
            // tonic's own listener sets this; serve_with_incoming leaves it to its caller.
            let _ = tcp.set_nodelay(true);
            let (tx, opening) = (tx.clone(), open(tcp, peer, slot));
            tokio::spawn(async move {
                if let Some(connection) = opening.await {
                    let _ = tx.send(Ok(connection)).await;
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// Why a certificate cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(String);

/// A rustls server configuration: the configured PEM files, or a self-signed certificate for `localhost`
/// and `127.0.0.1` generated now; ALPN offers `alpn` (none: no ALPN).
///
/// # Errors
/// [`TlsError`] naming the file that cannot be read or used.
pub fn server_config(
    cert_and_key: Option<(&Path, &Path)>,
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let (certs, key) = match cert_and_key {
        Some((cert_path, key_path)) => read_pem(cert_path, key_path)?,
        None => self_signed()?,
    };
    // A key that does not match the certificate is the key file's fault, as far as an operator can tell.
    let key_file = cert_and_key.map_or_else(|| "the generated key".to_owned(), |(_, k)| k.display().to_string());
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError(format!("{key_file}: {e}")))?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A certificate chain (the end entity's first) and its private key.
type CertAndKey = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

/// The certificate chain of PEM file `cert_path` and the private key of PEM file `key_path`.
///
/// # Errors
/// [`TlsError`] naming the file that cannot be read, or holds no certificate or key.
fn read_pem(cert_path: &Path, key_path: &Path) -> Result<CertAndKey, TlsError> {
    let certs = read_certificates(cert_path)?;
    Ok((certs, read_key(key_path)?))
}

/// The private key of PEM file `path`.
///
/// # Errors
/// [`TlsError`] naming the file when it cannot be read or holds no key.
pub(crate) fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError(format!("{}: {e}", path.display())))
}

/// Every certificate of PEM file `path`, in order; at least one.
///
/// # Errors
/// [`TlsError`] naming the file when it cannot be read or holds no certificate.
pub(crate) fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect)
        .map_err(|e| TlsError(format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(TlsError(format!("{}: no certificate found", path.display())));
    }
    Ok(certs)
}

fn self_signed() -> Result<CertAndKey, TlsError> {
    let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    let generated = rcgen::generate_simple_self_signed(names).map_err(|e| TlsError(e.to_string()))?;
    let key = PrivatePkcs8KeyDer::from(generated.signing_key.serialize_der());
    Ok((vec![generated.cert.der().clone()], key.into()))
}

/// One accepted connection, plaintext or TLS.
pub enum MaybeTls {
    /// Plaintext.
    Plain(TcpStream),
    /// TLS, handshaken.
    Tls(Box<TlsStream<TcpStream>>),
}

/// What a gRPC server (the gRPC front, the peer link) knows of the connection: its addresses.
impl Connected for MaybeTls {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            MaybeTls::Plain(tcp) => tcp.connect_info(),
            MaybeTls::Tls(tls) => tls.get_ref().0.connect_info(),
        }
    }
}

/// Waits for the connection's first byte; a TLS handshake is then completed with `acceptor`.
///
/// # Errors
/// When the client closes before sending anything, or the handshake fails.
pub async fn sniff(tcp: TcpStream, acceptor: &TlsAcceptor) -> io::Result<MaybeTls> {
    let mut first = [0u8; 1];
    if tcp.peek(&mut first).await? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before sending anything"));
    }
    if first[0] == TLS_HANDSHAKE {
        Ok(MaybeTls::Tls(Box::new(acceptor.accept(tcp).await?)))
    } else {
        Ok(MaybeTls::Plain(tcp))
    }
}

/// Runs `$body` with `$io` bound to the pinned inner stream, whichever kind the connection is.
macro_rules! with_inner {
    ($self:ident, $io:ident => $body:expr) => {
        match $self.get_mut() {
            MaybeTls::Plain(tcp) => {
                let $io = Pin::new(tcp);
                $body
            }
            MaybeTls::Tls(tls) => {
                let $io = Pin::new(&mut **tls);
                $body
            }
        }
    };
}

impl AsyncRead for MaybeTls {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        with_inner!(self, io => io.poll_read(cx, buf))
    }
}

impl AsyncWrite for MaybeTls {
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
            MaybeTls::Plain(tcp) => tcp.is_write_vectored(),
            MaybeTls::Tls(tls) => tls.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        with_inner!(self, io => io.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        with_inner!(self, io => io.poll_shutdown(cx))
    }
}
