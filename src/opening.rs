//! How long a connection to an HTTP/2 port (the gRPC front, the peer link) may take to open: its HTTP/2
//! connection preface must be in by a deadline. HTTP/2 (h2, under tonic) waits for the preface without a timeout
//! of its own, and its keep-alive PINGs start only after it, so a client that sent nothing, or part of the
//! preface, held its connection for ever.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use metrics::counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::Connected;

use crate::metrics as m;

/// The HTTP/2 connection preface's length (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const PREFACE_BYTES: usize = 24;

/// A connection whose first [`PREFACE_BYTES`] must be read by a deadline: a read past it, before they came,
/// fails (the server then closes the connection), counted in `popgate_tls_handshake_failures_total` (a
/// connection dropped before it was served).
pub struct Opening<IO> {
    io: IO,
    peer: SocketAddr,
    /// Until the preface's bytes are read: how many are left, and by when.
    preface: Option<Preface>,
    /// The port's connection slot this connection holds until it is dropped (closed).
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

struct Preface {
    left: usize,
    due: Pin<Box<Sleep>>,
}

impl<IO> Opening<IO> {
    /// `io`, from `peer`, whose preface is due by `due`.
    pub fn new(io: IO, peer: SocketAddr, due: Instant) -> Opening<IO> {
        let preface = Preface { left: PREFACE_BYTES, due: Box::pin(tokio::time::sleep_until(due)) };
        Opening { io, peer, preface: Some(preface), _slot: None }
    }

    /// The connection, holding one of its port's connection `slot`s for as long as it is open.
    pub fn holding(mut self, slot: tokio::sync::OwnedSemaphorePermit) -> Opening<IO> {
        self._slot = Some(slot);
        self
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Opening<IO> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        let Some(preface) = &mut this.preface else { return polled };
        match &polled {
            Poll::Ready(Ok(())) => {
                let read = buf.filled().len() - before;
                preface.left = preface.left.saturating_sub(read);
                // All of it came, or the client closed: nothing left to wait for.
                if preface.left == 0 || read == 0 {
                    this.preface = None;
                }
            }
            Poll::Pending if preface.due.as_mut().poll(cx).is_ready() => {
                this.preface = None;
                counter!(m::TLS_HANDSHAKE_FAILURES).increment(1);
                tracing::debug!(peer = %this.peer, "Connection dropped: no HTTP/2 preface in time.");
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "no HTTP/2 preface in time")));
            }
            _ => {}
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Opening<IO> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<IO: Connected> Connected for Opening<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> IO::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn peer() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 1))
    }

    #[tokio::test(start_paused = true)]
    async fn a_preface_in_time_is_read_and_later_silence_is_not_cut() {
        let (mut client, server) = tokio::io::duplex(1024);
        let mut opening = Opening::new(server, peer(), Instant::now() + std::time::Duration::from_secs(10));
        client.write_all(&PREFACE[..10]).await.expect("write");
        tokio::time::advance(std::time::Duration::from_secs(5)).await;
        client.write_all(&PREFACE[10..]).await.expect("write");
        let mut read = vec![0u8; 24];
        opening.read_exact(&mut read).await.expect("the preface, in two parts");
        // Past the deadline, a quiet connection is HTTP/2's to keep (its PINGs), not this one's to cut.
        tokio::time::advance(std::time::Duration::from_secs(60)).await;
        client.write_all(b"x").await.expect("write");
        assert_eq!(opening.read_u8().await.expect("read"), b'x');
    }

    #[tokio::test(start_paused = true)]
    async fn part_of_a_preface_fails_the_read_at_the_deadline() {
        let (mut client, server) = tokio::io::duplex(1024);
        let mut opening = Opening::new(server, peer(), Instant::now() + std::time::Duration::from_secs(10));
        client.write_all(&PREFACE[..16]).await.expect("write");
        let mut read = vec![0u8; 24];
        let failed = opening.read_exact(&mut read).await.expect_err("no whole preface");
        assert_eq!(failed.kind(), io::ErrorKind::TimedOut);
    }
}
