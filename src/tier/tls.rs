//! TLS on the peer link, when `tier.tls_cert_path`, `tier.tls_key_path` and `tier.tls_ca_path` are set: the
//! peer port then speaks TLS only, and mutual TLS.
//!
//! - **Server.** Each connection must open with a TLS handshake (one whose first byte is anything else, a
//!   plaintext gRPC client's, is closed there) and present a client certificate that chains to the tier's CA
//!   (rustls' `WebPkiClientVerifier`), within [`HANDSHAKE_TIMEOUT`]. Any other connection is closed, counted in
//!   `popgate_tier_connections_refused_total{reason}` and logged; the signature of each request is still
//!   checked as on a plaintext link.
//! - **Client.** An instance presents the same certificate and key to its peers, and takes a peer's server
//!   certificate when it chains to the tier's CA ([`TierCa`]). **The name in it is not checked** unless
//!   `tier.tls_server_name` is set: peers are dialled at the addresses of `tier.peers` and `tier.peer_dns`
//!   (pod IPs behind a headless Service), which their certificates rarely name, and the CA is the tier's own,
//!   so any certificate it signed is a peer's, whatever it names. With `tier.tls_server_name`, the server's
//!   certificate must name it (a DNS name or an IP address; it is also the SNI sent), whatever address was
//!   dialled.
//!
//! One certificate per instance serves both ways: if it lists extended key usages, it needs `serverAuth` and
//! `clientAuth`. There is no revocation check: a certificate is good until it expires, so issue short-lived ones
//! (cert-manager), or change the CA to shut one out. `tier.tls_ca_path` may hold several CA certificates (the
//! old and the new one while the CA is rotated).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use metrics::counter;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{verify_server_cert_signed_by_trust_anchor, verify_server_name};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::client::TlsStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Uri;

use crate::config::TierConfig;
use crate::metrics as m;
use crate::opening::Opening;
use crate::tls::MaybeTls;

/// Longest time a peer may take to send its first byte and finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The peer link is gRPC: HTTP/2 only.
const ALPN_H2: &[u8] = b"h2";

/// Why the peer link's TLS files cannot be used: the message names the config key and the file.
#[derive(Debug, thiserror::Error)]
#[error("tier TLS: {0}")]
pub struct PeerTlsError(String);

/// The peer link's TLS: the server's configuration (client certificates required) and the client's (this
/// instance's certificate presented, the peer's checked against the tier's CA).
pub struct PeerTls {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    /// `tier.tls_server_name`: the name a peer's certificate must carry, and the SNI sent.
    server_name: Option<ServerName<'static>>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTls").field("server_name", &self.server_name).finish_non_exhaustive()
    }
}

impl PeerTls {
    /// The peer link's TLS as `config` sets it; `None` when it sets no TLS files (a plaintext link).
    ///
    /// # Errors
    /// [`PeerTlsError`] naming the key and file that cannot be read or used.
    pub fn load(config: &TierConfig) -> Result<Option<Arc<PeerTls>>, PeerTlsError> {
        let Some((cert, key, ca)) = config.tls_files() else { return Ok(None) };
        PeerTls::from_files(cert, key, ca, config.tls_server_name.as_deref()).map(|tls| Some(Arc::new(tls)))
    }

    /// This instance's certificate chain (`cert_path`) and key (`key_path`), the tier's CA certificates
    /// (`ca_path`), all PEM, and the name a peer's certificate must carry (none: the chain alone is checked).
    ///
    /// # Errors
    /// [`PeerTlsError`] naming the key and file that cannot be read or used.
    pub fn from_files(
        cert_path: &Path,
        key_path: &Path,
        ca_path: &Path,
        server_name: Option<&str>,
    ) -> Result<PeerTls, PeerTlsError> {
        let failed = |key: &str, path: &Path, why: &dyn std::fmt::Display| {
            PeerTlsError(format!("tier.{key} ({}): {why}", path.display()))
        };
        let certs =
            crate::tls::read_certificates(cert_path).map_err(|e| PeerTlsError(format!("tier.tls_cert_path: {e}")))?;
        let key = crate::tls::read_key(key_path).map_err(|e| PeerTlsError(format!("tier.tls_key_path: {e}")))?;
        let mut roots = RootCertStore::empty();
        for ca in crate::tls::read_certificates(ca_path).map_err(|e| PeerTlsError(format!("tier.tls_ca_path: {e}")))? {
            roots.add(ca).map_err(|e| failed("tls_ca_path", ca_path, &e))?;
        }
        let roots = Arc::new(roots);
        let server_name = match server_name {
            Some(name) => Some(
                ServerName::try_from(name)
                    .map_err(|e| PeerTlsError(format!("tier.tls_server_name `{name}`: {e}")))?
                    .to_owned(),
            ),
            None => None,
        };
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());

        let clients = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| failed("tls_ca_path", ca_path, &e))?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| PeerTlsError(e.to_string()))?
            .with_client_cert_verifier(clients)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(|e| failed("tls_key_path", key_path, &e))?;
        server.alpn_protocols = vec![ALPN_H2.to_vec()];

        let verifier =
            TierCa { roots, algorithms: provider.signature_verification_algorithms, name: server_name.clone() };
        let mut client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| PeerTlsError(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(certs, key)
            .map_err(|e| failed("tls_key_path", key_path, &e))?;
        client.alpn_protocols = vec![ALPN_H2.to_vec()];

        Ok(PeerTls { server: Arc::new(server), client: Arc::new(client), server_name })
    }

    /// How a peer link's channel connects: TCP, then this instance's TLS handshake
    /// (`Endpoint::connect_with_connector_lazy`).
    pub fn connector(&self) -> PeerConnector {
        PeerConnector { tls: TlsConnector::from(self.client.clone()), server_name: self.server_name.clone() }
    }

    /// The server side's handshake.
    fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.server.clone())
    }
}

/// A peer's server certificate is taken when it chains to the tier's CA, and, with `tier.tls_server_name`,
/// names that name; the name dialled is not checked (see the module's doc).
#[derive(Debug)]
struct TierCa {
    roots: Arc<RootCertStore>,
    algorithms: WebPkiSupportedAlgorithms,
    /// `tier.tls_server_name`.
    name: Option<ServerName<'static>>,
}

impl ServerCertVerifier for TierCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _dialled: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        verify_server_cert_signed_by_trust_anchor(&cert, &self.roots, intermediates, now, self.algorithms.all)?;
        if let Some(name) = &self.name {
            verify_server_name(&cert, name)?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// Connects a peer link's channel: TCP to the URI's host and port, then TLS as this instance.
#[derive(Clone)]
pub struct PeerConnector {
    tls: TlsConnector,
    server_name: Option<ServerName<'static>>,
}

impl tower_service::Service<Uri> for PeerConnector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (tls, configured) = (self.tls.clone(), self.server_name.clone());
        Box::pin(async move {
            let invalid = |why: String| io::Error::new(io::ErrorKind::InvalidInput, why);
            let host = uri.host().ok_or_else(|| invalid(format!("`{uri}` names no host")))?;
            // An IPv6 address is written in brackets in a URI.
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port = uri.port_u16().ok_or_else(|| invalid(format!("`{uri}` names no port")))?;
            let name = match configured {
                Some(name) => name,
                // Not checked against the certificate (TierCa); sent as SNI when it is a DNS name.
                None => ServerName::try_from(host).map_err(|e| invalid(format!("`{host}`: {e}")))?.to_owned(),
            };
            let tcp = TcpStream::connect((host, port)).await?;
            tcp.set_nodelay(true)?;
            Ok(TokioIo::new(tls.connect(name, tcp).await?))
        })
    }
}

/// Why a connection to the peer port was refused: the `reason` of `popgate_tier_connections_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Its first byte opens no TLS handshake (a plaintext client).
    Plaintext,
    /// The client presented no certificate.
    NoCertificate,
    /// The client's certificate does not chain to the tier's CA, has expired, or may not be used by a client.
    BadCertificate,
    /// No handshake within [`HANDSHAKE_TIMEOUT`].
    Timeout,
    /// Any other failed handshake: no common protocol version or cipher suite, the client refused this
    /// instance's certificate, or left before the handshake was over (a TCP probe of the port included).
    Handshake,
    /// The port had `tier.max_connections` open (plaintext or TLS).
    TooManyConnections,
}

impl Refusal {
    /// Every refusal's label, registered at 0 at start.
    pub const LABELS: [&'static str; 6] =
        ["plaintext", "no_certificate", "bad_certificate", "timeout", "handshake", "too_many_connections"];

    /// The refusal's label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Plaintext => Self::LABELS[0],
            Refusal::NoCertificate => Self::LABELS[1],
            Refusal::BadCertificate => Self::LABELS[2],
            Refusal::Timeout => Self::LABELS[3],
            Refusal::Handshake => Self::LABELS[4],
            Refusal::TooManyConnections => Self::LABELS[5],
        }
    }

    /// The refusal a failed server handshake's `error` stands for.
    fn of(error: &io::Error) -> Refusal {
        match error.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
            Some(rustls::Error::NoCertificatesPresented) => Refusal::NoCertificate,
            Some(rustls::Error::InvalidCertificate(_)) => Refusal::BadCertificate,
            _ => Refusal::Handshake,
        }
    }
}

/// The connections of `listener` whose mutual TLS handshake succeeded, for
/// `tonic::transport::Server::serve_with_incoming_shutdown`. Each is handshaken on a task of its own, so a slow
/// or hostile client never holds up the others; a refused one is counted and closed.
pub(crate) fn incoming(
    listener: TcpListener,
    tls: &PeerTls,
    slots: Arc<tokio::sync::Semaphore>,
    preface_within: Duration,
) -> ReceiverStream<Result<Opening<MaybeTls>, io::Error>> {
    let acceptor = tls.acceptor();
    crate::tls::accept_each(listener, "peer link", slots, too_many, move |tcp, peer, slot| {
        let acceptor = acceptor.clone();
        async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, crate::tls::sniff(tcp, &acceptor)).await {
                Ok(Ok(tls @ MaybeTls::Tls(_))) => {
                    Some(Opening::new(tls, peer, tokio::time::Instant::now() + preface_within).holding(slot))
                }
                Ok(Ok(MaybeTls::Plain(_))) => refused(peer, Refusal::Plaintext, "it opened with no TLS handshake"),
                Ok(Err(error)) => refused(peer, Refusal::of(&error), &error.to_string()),
                Err(_) => refused(peer, Refusal::Timeout, "no handshake within 10 s"),
            }
        }
    })
}

/// A connection closed at once because the peer port had `tier.max_connections` open (plaintext or TLS).
pub(crate) fn too_many(peer: SocketAddr) {
    refused(peer, Refusal::TooManyConnections, "tier.max_connections are open");
}

/// A connection refused before it was served: counted, and logged at debug only (the count is the signal; a
/// stranger's flood must not fill the log).
fn refused(peer: SocketAddr, refusal: Refusal, why: &str) -> Option<Opening<MaybeTls>> {
    counter!(m::TIER_CONNECTIONS_REFUSED, "reason" => refusal.label()).increment(1);
    tracing::debug!(%peer, reason = refusal.label(), error = why, "A connection to the peer link was refused.");
    None
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose as Eku, IsCa, Issuer, KeyPair};
    use rustls::pki_types::pem::PemObject;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tower_service::Service;

    use super::*;

    /// A CA made for a test: what it signs with, and its certificate's PEM.
    struct Ca {
        issuer: Issuer<'static, KeyPair>,
        pem: String,
    }

    fn ca(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().expect("a key");
        let pem = params.self_signed(&key).expect("a CA certificate").pem();
        Ca { issuer: Issuer::new(params, key), pem }
    }

    /// Files of one instance: its certificate (signed by `signer`, naming `names`, with `usages`), its key, and
    /// the CA it trusts (`trusted`).
    fn files(dir: &tempfile::TempDir, signer: &Ca, names: &[&str], usages: Vec<Eku>, trusted: &Ca) -> [PathBuf; 3] {
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).expect("params");
        params.extended_key_usages = usages;
        let key = KeyPair::generate().expect("a key");
        let cert = params.signed_by(&key, &signer.issuer).expect("signed");
        let n = rand::random::<u64>();
        let paths = [
            dir.path().join(format!("{n}.pem")),
            dir.path().join(format!("{n}.key")),
            dir.path().join(format!("{n}-ca.pem")),
        ];
        for (path, text) in paths.iter().zip([cert.pem(), key.serialize_pem(), trusted.pem.clone()]) {
            std::fs::write(path, text).expect("write");
        }
        paths
    }

    fn both() -> Vec<Eku> {
        vec![Eku::ServerAuth, Eku::ClientAuth]
    }

    fn peer(paths: &[PathBuf; 3], server_name: Option<&str>) -> PeerTls {
        PeerTls::from_files(&paths[0], &paths[1], &paths[2], server_name).expect("usable files")
    }

    /// A handshake between `server` and a client with `client` config dialling `dialled`, then a byte each way:
    /// the server's outcome and the client's.
    async fn handshake(
        server: &PeerTls,
        client: Arc<rustls::ClientConfig>,
        dialled: &str,
    ) -> (io::Result<()>, io::Result<()>) {
        let (server_io, client_io) = tokio::io::duplex(64 * 1024);
        let acceptor = server.acceptor();
        let name = ServerName::try_from(dialled).expect("a name").to_owned();
        let serve = async {
            let mut tls = acceptor.accept(server_io).await?;
            let mut byte = [0u8; 1];
            tls.read_exact(&mut byte).await?;
            tls.write_all(b"!").await?;
            tls.flush().await
        };
        let dial = async {
            let mut tls = TlsConnector::from(client).connect(name, client_io).await?;
            tls.write_all(b"?").await?;
            tls.flush().await?;
            let mut byte = [0u8; 1];
            tls.read_exact(&mut byte).await.map(|_| ())
        };
        tokio::join!(serve, dial)
    }

    #[tokio::test]
    async fn peers_of_the_tiers_ca_are_taken_whatever_address_they_are_dialled_at() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = ca("tier");
        let server = peer(&files(&dir, &tier, &["popgate-0.popgate-peers"], both(), &tier), None);
        let client = peer(&files(&dir, &tier, &["popgate-1.popgate-peers"], both(), &tier), None);
        let (served, dialled) = handshake(&server, client.client.clone(), "10.1.2.3").await;
        served.expect("the server takes the client's certificate");
        dialled.expect("the client takes the server's certificate, which does not name 10.1.2.3");
        // A certificate with no extended key usage serves both ways too.
        let plain = peer(&files(&dir, &tier, &["popgate-2"], Vec::new(), &tier), None);
        let (served, dialled) = handshake(&plain, plain.client.clone(), "popgate-9").await;
        served.and(dialled).expect("no usage listed: any");
    }

    #[tokio::test]
    async fn a_client_certificate_of_another_ca_or_none_is_refused_by_the_server() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (tier, stranger) = (ca("tier"), ca("stranger"));
        let server = peer(&files(&dir, &tier, &["popgate-0"], both(), &tier), None);

        // Trusts the tier's CA (so it takes the server), presents a certificate of another CA.
        let other = peer(&files(&dir, &stranger, &["popgate-0"], both(), &tier), None);
        let (served, _) = handshake(&server, other.client.clone(), "127.0.0.1").await;
        let refused = served.expect_err("another CA's client certificate");
        assert_eq!(Refusal::of(&refused), Refusal::BadCertificate, "{refused}");

        // Of the tier's CA, but made for servers only.
        let server_only = peer(&files(&dir, &tier, &["popgate-1"], vec![Eku::ServerAuth], &tier), None);
        let (served, _) = handshake(&server, server_only.client.clone(), "127.0.0.1").await;
        let refused = served.expect_err("a certificate not for clients");
        assert_eq!(Refusal::of(&refused), Refusal::BadCertificate, "{refused}");

        // No certificate at all.
        let provider = rustls::crypto::aws_lc_rs::default_provider();
        let mut roots = RootCertStore::empty();
        let tier_ca = CertificateDer::from_pem_slice(tier.pem.as_bytes()).expect("the CA's certificate");
        roots.add(tier_ca).expect("a root");
        let verifier =
            TierCa { roots: Arc::new(roots), algorithms: provider.signature_verification_algorithms, name: None };
        let anonymous = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        let (served, _) = handshake(&server, Arc::new(anonymous), "127.0.0.1").await;
        let refused = served.expect_err("no client certificate");
        assert_eq!(Refusal::of(&refused), Refusal::NoCertificate, "{refused}");
    }

    #[tokio::test]
    async fn a_server_certificate_of_another_ca_is_refused_by_the_client() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (tier, stranger) = (ca("tier"), ca("stranger"));
        // A server that takes the tier's clients but shows another CA's certificate.
        let impostor = peer(&files(&dir, &stranger, &["popgate-0"], both(), &tier), None);
        let client = peer(&files(&dir, &tier, &["popgate-1"], both(), &tier), None);
        let (served, dialled) = handshake(&impostor, client.client.clone(), "popgate-0").await;
        assert!(served.is_err(), "the client left");
        let error = dialled.expect_err("another CA's server certificate");
        assert!(error.to_string().contains("UnknownIssuer"), "{error}");
    }

    #[tokio::test]
    async fn with_a_server_name_set_the_servers_certificate_must_name_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = ca("tier");
        let named = peer(&files(&dir, &tier, &["peer.tier.internal"], both(), &tier), None);
        let unnamed = peer(&files(&dir, &tier, &["popgate-0"], both(), &tier), None);
        let client = peer(&files(&dir, &tier, &["peer.tier.internal"], both(), &tier), Some("peer.tier.internal"));
        let (served, dialled) = handshake(&named, client.client.clone(), "10.1.2.3").await;
        served.and(dialled).expect("it names tier.tls_server_name, whatever address was dialled");
        let (_, dialled) = handshake(&unnamed, client.client.clone(), "popgate-0").await;
        let error = dialled.expect_err("it does not name tier.tls_server_name");
        assert!(error.to_string().contains("not valid for name \"peer.tier.internal\""), "{error}");
    }

    #[test]
    fn an_unusable_file_is_named_with_its_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = ca("tier");
        let [cert, key, ca_path] = files(&dir, &tier, &["popgate-0"], both(), &tier);
        let missing = dir.path().join("missing.pem");
        let error = |cert: &Path, key: &Path, ca: &Path| {
            PeerTls::from_files(cert, key, ca, None).expect_err("refused").to_string()
        };
        let text = error(&cert, &missing, &ca_path);
        assert!(text.contains("tier.tls_key_path") && text.contains("missing.pem"), "{text}");
        let text = error(&cert, &key, &key);
        assert!(text.contains("tier.tls_ca_path") && text.contains(&key.display().to_string()), "{text}");
        let text = error(&key, &key, &ca_path);
        assert!(text.contains("tier.tls_cert_path"), "{text}");
        let [_, other_key, _] = files(&dir, &tier, &["popgate-1"], both(), &tier);
        let text = error(&cert, &other_key, &ca_path);
        assert!(text.contains("tier.tls_key_path") && text.contains(&other_key.display().to_string()), "{text}");
    }

    /// The peer port end to end: a peer's connector is served; a plaintext client is closed unserved, and so is
    /// a connection past the port's bound while the peer's is open.
    #[tokio::test]
    async fn the_peer_port_serves_a_peers_connector_and_closes_a_plaintext_client_and_one_too_many() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = ca("tier");
        let tls = peer(&files(&dir, &tier, &["popgate-0"], both(), &tier), None);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        let one_slot = Arc::new(tokio::sync::Semaphore::new(1));
        let mut served = incoming(listener, &tls, one_slot, Duration::from_secs(10));

        let mut plain = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
        plain.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.expect("write");
        let mut rest = Vec::new();
        let read = plain.read_to_end(&mut rest).await;
        assert!(read.is_err() || rest.is_empty(), "closed unanswered: {read:?} {rest:?}");

        let uri: Uri = format!("http://127.0.0.1:{port}").parse().expect("a URI");
        let mut dialled = tls.connector().call(uri).await.expect("a TLS connection").into_inner();
        dialled.write_all(b"?").await.expect("write");
        dialled.flush().await.expect("flush");
        let connection = futures::StreamExt::next(&mut served).await.expect("one").expect("served");
        let mut connection = connection;
        let mut byte = [0u8; 1];
        connection.read_exact(&mut byte).await.expect("read");
        assert_eq!(&byte, b"?", "the plaintext client was never handed to the server");

        // The one slot is the peer's: another connection is closed at once, before any handshake.
        let mut another = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), another.read_to_end(&mut rest)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "closed at once: {read:?}");
        drop(connection);
    }
}
