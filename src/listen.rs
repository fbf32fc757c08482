//! Every port's listening socket. A port takes connections in bursts: a tier's clients reconnecting after a
//! restart, a balancer moving its connections, a flood. Until the accept loop takes them they wait in the
//! kernel's accept queue, whose length is the socket's backlog. tokio binds with the standard library's 128;
//! past it the kernel drops the handshake's last packet, and a client that sends nothing first (an SDK opening
//! its channels, an idle connection) believes itself connected while popgate never sees it (seen: 316 of 700
//! connections made at once left open and unserved for good). popgate asks for [`BACKLOG`]; the kernel caps it
//! at `net.core.somaxconn` (4 096 on current Linux).

use std::io;
use std::net::SocketAddr;

use tokio::net::{lookup_host, TcpListener, TcpSocket, ToSocketAddrs};

/// Connections a port holds before its accept loop takes them.
pub const BACKLOG: u32 = 4_096;

/// A listener on the first address `addr` resolves to that can be bound, with [`BACKLOG`].
///
/// # Errors
/// The last address's failure to bind (in use, not local), or that `addr` resolved to none.
pub async fn bind(addr: impl ToSocketAddrs) -> io::Result<TcpListener> {
    let mut last = io::Error::new(io::ErrorKind::InvalidInput, "the address resolves to none");
    for resolved in lookup_host(addr).await? {
        match bind_one(resolved) {
            Ok(listener) => return Ok(listener),
            Err(error) => last = error,
        }
    }
    Err(last)
}

fn bind_one(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    // As tokio's own bind: a restarted popgate rebinds its port at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// 600 connections made while nothing accepts are all taken once the accept loop runs (bound as tokio binds,
    /// 129 of them connect).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_made_before_the_accept_loop_runs_are_all_accepted() {
        let listener = bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connects = (0..600).map(|_| tokio::net::TcpStream::connect(addr));
        let clients: Vec<_> = futures::future::join_all(connects).await.into_iter().flatten().collect();
        assert_eq!(clients.len(), 600, "every connect completed");
        let mut accepted = 0;
        while let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(500), listener.accept()).await {
            accepted += 1;
        }
        assert_eq!(accepted, 600, "connections left in no queue");
    }
}
