//! Connections: RocketMQ remoting frames in, answers and popgate's own pushes out.
//!
//! Frames are decoded with the rocketmq-rust codec (`RemotingCommand::decode_with_max_frame_bytes`) and
//! encoded with its `EncodedFrame`. Each request is served on a task of its own, as the Java broker serves a
//! connection's requests on its executors: a held PULL does not hold up the sends behind it. Answers are
//! matched by the client through their `opaque`, so they may leave in any order.
//!
//! A frame that cannot be a command (over the size limit, a header that does not decode) ends the
//! connection: the stream cannot be resynchronised after it. A request is never half served: it is read
//! whole before anything is done with it.
//!
//! What one connection may hold is bounded, whoever is at the other end and before anyone has signed
//! anything: a connection that completes no frame for `remoting.idle_timeout_secs` is closed (one byte a
//! minute is idle too), and so is one whose answers cannot be written for as long (a client that stopped
//! reading); at most `remoting.max_requests_per_connection` of its requests are served at once, and past that
//! popgate stops reading it until one is answered, so a client that pipelines frames and reads no answers is
//! held up by its own TCP window instead of growing popgate's memory. Its requests take their place in an
//! offset lane ([`super::offset_turns`]) only once they are signed and allowed.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use metrics::{counter, gauge};
use rocketmq_protocol::protocol::encoded_frame::EncodedFrame;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use rocketmq_protocol::protocol::LanguageCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Duration, Instant};

use super::codes;
use super::frame::Frame;
use super::offset_turns::OffsetTurns;
use super::service::{error, Admitted, Front};
use crate::metrics as m;
use crate::tls::MaybeTls;

/// Frames waiting to be written to one connection; a client that stops reading holds up only its own.
const OUTBOUND_QUEUE: usize = 1024;
/// How much is read from a socket at once.
const READ_CHUNK: usize = 64 * 1024;
/// Longest time a client may take to send its first byte and finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// One client connection, as the rest of the front sees it: who is at the other end, and a way to write to it.
#[derive(Clone, Debug)]
pub(super) struct Connection {
    /// Unique within this process.
    pub id: u64,
    /// The client's address.
    pub peer: SocketAddr,
    /// The broker this connection's port stands for ([`super::ports`]); `None` on the front's own port.
    pub broker: Option<Arc<str>>,
    outbound: mpsc::Sender<Outbound>,
}

/// A frame to write, and who wants to know when it was.
#[derive(Debug)]
pub(super) struct Outbound {
    frame: Bytes,
    written: Option<oneshot::Sender<()>>,
}

impl Outbound {
    /// The frame (unit tests of what is pushed to clients).
    #[cfg(test)]
    pub fn frame(&self) -> &Bytes {
        &self.frame
    }
}

impl Connection {
    /// Writes an answer to the client, waiting while its queue is full; `false` when the connection is gone.
    pub async fn answer(&self, command: RemotingCommand) -> bool {
        match self.encode(command) {
            Some(frame) => self.outbound.send(Outbound { frame, written: None }).await.is_ok(),
            None => false,
        }
    }

    /// Writes an answer and waits until it has been written to the socket; `false` when it was not (the
    /// connection went first).
    pub async fn answer_written(&self, command: RemotingCommand) -> bool {
        let Some(frame) = self.encode(command) else { return false };
        let (written, wrote) = oneshot::channel();
        if self.outbound.send(Outbound { frame, written: Some(written) }).await.is_err() {
            return false;
        }
        wrote.await.is_ok()
    }

    /// Writes one of popgate's own one-way pushes, unless the client's queue is full (a client that does not
    /// read its answers will not read a push either); `false` when it was not queued.
    pub fn push(&self, command: RemotingCommand) -> bool {
        self.encode(command).is_some_and(|frame| self.outbound.try_send(Outbound { frame, written: None }).is_ok())
    }

    /// Resolves when the connection has closed.
    pub async fn closed(&self) {
        self.outbound.closed().await;
    }

    /// A connection whose frames land in the returned receiver (unit tests of what is pushed to clients).
    #[cfg(test)]
    pub fn for_test(id: u64) -> (Connection, mpsc::Receiver<Outbound>) {
        let (outbound, queued) = mpsc::channel(OUTBOUND_QUEUE);
        (Connection { id, peer: SocketAddr::from(([127, 0, 0, 1], 40_000)), broker: None, outbound }, queued)
    }

    fn encode(&self, command: RemotingCommand) -> Option<Bytes> {
        match EncodedFrame::from_command(command) {
            Ok(frame) => Some(frame.into_bytes()),
            Err(error) => {
                tracing::warn!(%error, peer = %self.peer, "A remoting frame could not be encoded.");
                None
            }
        }
    }
}

/// Accepts connections until `shutdown` resolves; then the open ones are closed. `broker`: the broker this
/// port stands for, if it is one of the brokers' own ports.
pub(super) async fn accept_loop(
    listener: TcpListener,
    front: Arc<Front>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    broker: Option<Arc<str>>,
) -> std::io::Result<()> {
    let slots = front.connection_slots.clone();
    let (closing, _) = tokio::sync::broadcast::channel::<()>(1);
    tokio::pin!(shutdown);
    loop {
        let (socket, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: the listener itself is fine; try again shortly.
                    tracing::warn!(%error, "The remoting front could not accept a connection.");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            counter!(m::REMOTING_CONNECTIONS_REFUSED).increment(1);
            drop(socket);
            continue;
        };
        let id = NEXT_CONNECTION_ID.fetch_add(1, Ordering::Relaxed);
        let (front, mut closed, broker) = (front.clone(), closing.subscribe(), broker.clone());
        tokio::spawn(async move {
            gauge!(m::REMOTING_CONNECTIONS).increment(1.0);
            tokio::select! {
                () = serve_connection(socket, peer, id, broker, front.clone()) => {}
                _ = closed.recv() => {}
            }
            front.clients.connection_closed(id);
            gauge!(m::REMOTING_CONNECTIONS).decrement(1.0);
            drop(slot);
        });
    }
    let _ = closing.send(());
    Ok(())
}

/// Connection ids, unique across all of the front's ports.
static NEXT_CONNECTION_ID: AtomicU64 = AtomicU64::new(1);

async fn serve_connection(socket: TcpStream, peer: SocketAddr, id: u64, broker: Option<Arc<str>>, front: Arc<Front>) {
    let _ = socket.set_nodelay(true);
    // TLS or plaintext, told by the first byte; a client that sends nothing in time, or fails its handshake, is
    // dropped and counted.
    let socket = match tokio::time::timeout(HANDSHAKE_TIMEOUT, crate::tls::sniff(socket, &front.tls)).await {
        Ok(Ok(socket)) => socket,
        Ok(Err(error)) => return handshake_failed(peer, &error.to_string()),
        Err(_) => return handshake_failed(peer, "no first byte or handshake in time"),
    };
    let idle = Duration::from_secs(front.config.remoting.idle_timeout_secs);
    let (reader, writer) = tokio::io::split(socket);
    let (outbound, queued) = mpsc::channel(OUTBOUND_QUEUE);
    let connection = Connection { id, peer, broker, outbound };
    let mut writing = tokio::spawn(write_loop(writer, queued, idle, peer));
    // Whichever ends first ends the connection: the client closed or went quiet, or its answers stopped leaving.
    tokio::select! {
        () = read_loop(reader, &connection, &front, idle) => {}
        _ = &mut writing => {}
    }
    // Answers still being computed are dropped with the connection: the client has gone.
    drop(connection);
    writing.abort();
}

/// Reads and dispatches the connection's requests until it closes, sends a frame that cannot be read, or
/// completes no frame for `idle`.
async fn read_loop(mut reader: ReadHalf<MaybeTls>, connection: &Connection, front: &Arc<Front>, idle: Duration) {
    let peer = connection.peer;
    let max_frame = front.config.remoting.max_frame_bytes;
    let in_flight = Arc::new(Semaphore::new(front.config.remoting.max_requests_per_connection));
    let mut buffer = BytesMut::with_capacity(READ_CHUNK);
    let mut quiet_until = Instant::now() + idle;
    // The bytes of the large frame being read, held in the front's budget until that frame is served.
    let mut frame_bytes: Option<OwnedSemaphorePermit> = None;
    loop {
        let announced = announced_frame_len(&buffer);
        match super::frame::decode(&mut buffer, max_frame) {
            Ok(Some(Frame::Command(command))) => {
                quiet_until = Instant::now() + idle;
                let Some(place) = place_in_flight(&in_flight).await else { return };
                dispatch(front, connection, command, place, frame_bytes.take());
                continue;
            }
            Ok(Some(Frame::Refused { opaque, why })) => {
                frame_bytes = None;
                quiet_until = Instant::now() + idle;
                counter!(m::REMOTING_FRAME_ERRORS, "reason" => "bad_header").increment(1);
                tracing::debug!(%peer, why, "Refused a remoting request whose header cannot be read.");
                let answer = error(codes::SYSTEM_ERROR, why).set_opaque(opaque).set_language(LanguageCode::JAVA);
                if !connection.answer(answer.mark_response_type()).await {
                    return;
                }
                continue;
            }
            Ok(None) => {}
            Err(error) => {
                let reason = if announced.is_some_and(|len| len > max_frame) { "oversize" } else { "undecodable" };
                counter!(m::REMOTING_FRAME_ERRORS, "reason" => reason).increment(1);
                tracing::info!(%error, %peer, "Closing a remoting connection whose frame cannot be read.");
                return;
            }
        }
        let large = announced.filter(|len| *len > READ_CHUNK && *len <= max_frame);
        if let (Some(len), None) = (large, &frame_bytes) {
            match reserve_frame_bytes(front, len, quiet_until).await {
                Some(reserved) => frame_bytes = Some(reserved),
                None => {
                    counter!(m::REMOTING_CONNECTIONS_CLOSED, "reason" => "idle").increment(1);
                    return;
                }
            }
        }
        buffer.reserve(READ_CHUNK);
        match tokio::time::timeout_at(quiet_until, reader.read_buf(&mut buffer)).await {
            Ok(Ok(0)) => {
                if !buffer.is_empty() {
                    // The client went away in the middle of a frame: nothing of it was acted on.
                    counter!(m::REMOTING_FRAME_ERRORS, "reason" => "truncated").increment(1);
                }
                return;
            }
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return,
            Err(_) => {
                counter!(m::REMOTING_CONNECTIONS_CLOSED, "reason" => "idle").increment(1);
                tracing::debug!(%peer, ?idle, "Closing a remoting connection that completed no frame in time.");
                return;
            }
        }
    }
}

/// A place for one more request of the connection: at once while it has fewer than its most in flight, else
/// once one of them is answered (the reader waits meanwhile: nothing more is read from the client).
async fn place_in_flight(in_flight: &Arc<Semaphore>) -> Option<OwnedSemaphorePermit> {
    if let Ok(place) = in_flight.clone().try_acquire_owned() {
        return Some(place);
    }
    counter!(m::REMOTING_READS_PAUSED).increment(1);
    in_flight.clone().acquire_owned().await.ok()
}

/// A place for a large frame of `len` bytes in the front's budget (`remoting.max_frame_bytes_in_flight`), taken
/// before the frame is read in: at once when it fits, else once other connections' large frames are served (the
/// connection is not read meanwhile); `None` when none came before `quiet_until` (the connection is closed as
/// idle, as one that completes no frame).
async fn reserve_frame_bytes(front: &Front, len: usize, quiet_until: Instant) -> Option<OwnedSemaphorePermit> {
    let len = u32::try_from(len).ok()?;
    if let Ok(reserved) = front.frame_bytes.clone().try_acquire_many_owned(len) {
        return Some(reserved);
    }
    counter!(m::REMOTING_FRAME_BUDGET_WAITS).increment(1);
    tokio::time::timeout_at(quiet_until, front.frame_bytes.clone().acquire_many_owned(len)).await.ok()?.ok()
}

/// The length a frame at the start of `buffer` announces, its 4-byte length field included.
fn announced_frame_len(buffer: &[u8]) -> Option<usize> {
    let prefix: [u8; 4] = buffer.get(..4)?.try_into().ok()?;
    usize::try_from(u32::from_be_bytes(prefix)).ok().map(|len| len.saturating_add(4))
}

/// Serves one command: a request on a task of its own; an answer to one of popgate's pushes is ignored (the
/// pushes popgate sends are one-way). Who sent it is checked here, as its frame is read: a signed and allowed
/// offset commit or query takes its turn now and is served once the turns before it are over
/// ([`super::offset_turns`]); a refused one takes none. `place`: its place among the connection's requests in
/// flight, given back when it is answered.
fn dispatch(
    front: &Arc<Front>,
    connection: &Connection,
    request: RemotingCommand,
    place: OwnedSemaphorePermit,
    frame_bytes: Option<OwnedSemaphorePermit>,
) {
    if request.is_response_type() {
        return;
    }
    let admitted = front.admit(&request, connection.peer.ip());
    let mut turn = match &admitted {
        // Only an offset request takes a turn; its grant is checked first (the rest are checked as served).
        Ok(Admitted::Caller(caller)) if OffsetTurns::takes_turns(&request) && front.may_relay(caller, &request) => {
            front.offset_turns.take(&request, connection.broker.as_deref())
        }
        _ => None,
    };
    let (front, connection) = (front.clone(), connection.clone());
    gauge!(m::REMOTING_REQUESTS_IN_FLIGHT).increment(1.0);
    tokio::spawn(async move {
        let _in_flight = InFlight { _place: place, _frame_bytes: frame_bytes };
        let oneway = request.is_oneway_rpc();
        let opaque = request.opaque();
        if let Some(turn) = &mut turn {
            turn.wait().await;
        }
        let reply = front.serve(&connection, admitted, request).await;
        // Served (a one-way request's retries included): the next offset request of its lane may go.
        drop(turn);
        let Some(reply) = reply else { return };
        // A 4.9.3 client has no language code for RUST, the crate's default.
        let answer = reply.command.set_opaque(opaque).set_language(LanguageCode::JAVA).mark_response_type();
        let written = match (oneway, reply.handed.is_empty()) {
            (true, _) => false,
            (false, true) => connection.answer(answer).await,
            // An answer that hands out deliveries: whether it left decides what becomes of them.
            (false, false) => connection.answer_written(answer).await,
        };
        // Queued behind the answer, so the client reads it first (see `relay::heartbeat`).
        front.clients.tell_members(&reply.then_tell);
        if !reply.handed.is_empty() {
            front.after_reply(reply.handed, written).await;
        }
    });
}

/// A request being served: its place among its connection's, its frame's bytes in the front's budget (a large
/// frame's), and its count in the gauge, until it is dropped (answered, or dropped with its connection).
struct InFlight {
    _place: OwnedSemaphorePermit,
    _frame_bytes: Option<OwnedSemaphorePermit>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        gauge!(m::REMOTING_REQUESTS_IN_FLIGHT).decrement(1.0);
    }
}

fn handshake_failed(peer: SocketAddr, error: &str) {
    counter!(m::TLS_HANDSHAKE_FAILURES).increment(1);
    tracing::debug!(%peer, error, "A remoting connection was dropped before it was served.");
}

/// Writes the queued frames until the connection is dropped; ends (and so ends the connection) when a frame
/// cannot be written for `idle`: a client that stopped reading its answers holds up nothing but itself.
async fn write_loop(
    mut writer: WriteHalf<MaybeTls>,
    mut queued: mpsc::Receiver<Outbound>,
    idle: Duration,
    peer: SocketAddr,
) {
    while let Some(Outbound { frame, written }) = queued.recv().await {
        match tokio::time::timeout(idle, writer.write_all(&frame)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return,
            Err(_) => {
                counter!(m::REMOTING_CONNECTIONS_CLOSED, "reason" => "not_reading").increment(1);
                tracing::debug!(%peer, ?idle, "Closing a remoting connection whose client reads no answers.");
                return;
            }
        }
        if let Some(written) = written {
            let _ = written.send(());
        }
    }
    let _ = writer.shutdown().await;
}
