//! The plain HTTP port's listener: accepted sockets with Nagle's algorithm off, as the gRPC, remoting and peer
//! ports have them (`axum::serve` leaves a socket as accepted).

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};

/// Turns Nagle's algorithm off on an accepted HTTP connection. An SSE stream is a run of small writes: with
/// Nagle on, an event written while the client still delays its ACK of the one before waits for that ACK (up to
/// 40 ms on Linux).
pub(crate) fn send_small_writes_at_once(tcp: &TcpStream) {
    if let Err(error) = tcp.set_nodelay(true) {
        tracing::debug!(%error, "Could not set TCP_NODELAY on an HTTP connection.");
    }
}

/// A `TcpListener` whose accepted connections send small writes at once.
pub struct PlainListener(TcpListener);

impl PlainListener {
    /// Serves what `listener` accepts.
    pub fn new(listener: TcpListener) -> PlainListener {
        PlainListener(listener)
    }
}

impl axum::serve::Listener for PlainListener {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        // axum's own accept: it retries (and backs off on) failed accepts.
        let (tcp, peer) = axum::serve::Listener::accept(&mut self.0).await;
        send_small_writes_at_once(&tcp);
        (tcp, peer)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }
}
