//! A remoting peer for unit tests of the broker connection: it accepts TCP connections on 127.0.0.1, counts
//! them, and answers every request with `SUCCESS` (after a set delay). Told to go silent, it goes on reading
//! but answers nothing, as a hung broker whose kernel still takes the bytes; told to ignore POPs, it answers
//! everything but POPs; told to hang up once, it answers the next request and resets its connection.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use rocketmq_protocol::code::request_code::RequestCode;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Mutex;

#[derive(Default)]
struct Switches {
    silent: AtomicBool,
    ignore_pops: AtomicBool,
    hang_up_once: AtomicBool,
    delay_ms: AtomicU64,
    accepted: AtomicUsize,
}

/// The peer's switches and counters; it serves until the test's runtime ends.
pub(crate) struct FakePeer {
    /// `127.0.0.1:port`.
    pub addr: String,
    switches: Arc<Switches>,
}

impl FakePeer {
    /// Binds a free port and starts accepting.
    pub async fn start() -> FakePeer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr").to_string();
        let switches = Arc::new(Switches::default());
        let shared = switches.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(socket, shared.clone()));
            }
        });
        FakePeer { addr, switches }
    }

    /// Answer nothing (true) or everything (false).
    pub fn set_silent(&self, silent: bool) {
        self.switches.silent.store(silent, Ordering::SeqCst);
    }

    /// Leave POP requests unanswered.
    pub fn ignore_pops(&self) {
        self.switches.ignore_pops.store(true, Ordering::SeqCst);
    }

    /// Answer the next request, then reset its connection (a cut, a crashed broker).
    pub fn hang_up_once(&self) {
        self.switches.hang_up_once.store(true, Ordering::SeqCst);
    }

    /// Answer each request this long after it arrived.
    pub fn set_delay(&self, delay: Duration) {
        self.switches.delay_ms.store(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.switches.accepted.load(Ordering::SeqCst)
    }
}

async fn serve(socket: tokio::net::TcpStream, switches: Arc<Switches>) {
    // Closed with a reset, as by `ss -K` or a crashed broker's kernel: the client learns it at once.
    let _ = socket.set_zero_linger();
    let (mut reader, writer) = socket.into_split();
    let writer = Arc::new(Mutex::new(writer));
    let mut buffer = BytesMut::with_capacity(64 * 1024);
    loop {
        match RemotingCommand::decode_with_max_frame_bytes(&mut buffer, 32 * 1024 * 1024) {
            Ok(Some(request)) => {
                let is_pop = request.code() == RequestCode::PopMessage.to_i32();
                if switches.silent.load(Ordering::SeqCst) || (is_pop && switches.ignore_pops.load(Ordering::SeqCst)) {
                    continue;
                }
                let mut response = RemotingCommand::create_success_response_command()
                    .set_opaque(request.opaque())
                    .mark_response_type();
                let mut frame = BytesMut::new();
                if response.try_fast_header_encode(&mut frame).is_err() {
                    return;
                }
                let delay = Duration::from_millis(switches.delay_ms.load(Ordering::SeqCst));
                if switches.hang_up_once.swap(false, Ordering::SeqCst) {
                    tokio::time::sleep(delay).await;
                    let _ = writer.lock().await.write_all(&frame).await;
                    return;
                }
                let writer = writer.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _ = writer.lock().await.write_all(&frame).await;
                });
                continue;
            }
            Ok(None) => {}
            Err(_) => return,
        }
        match reader.read_buf(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}
