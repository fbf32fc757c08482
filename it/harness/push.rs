//! Test clients for the push transports: a real SSE reader over reqwest and a real WebSocket client
//! (tokio-tungstenite). They read from the network only when asked for the next delivery, like a slow
//! subscriber, so TCP backpressure reaches popgate; dropping a client drops its connection, as a subscriber
//! that dies mid-stream would.

use std::collections::VecDeque;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, Stream, StreamExt};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// An SSE subscriber.
pub struct SseClient {
    body: ByteStream,
    buffer: String,
    parsed: VecDeque<Value>,
}

impl SseClient {
    /// Opens `GET {base}/events/stream?{query}`.
    pub async fn connect(base: &str, query: &str) -> SseClient {
        SseClient::connect_with(reqwest::Client::new().get(format!("{base}/events/stream?{query}"))).await
    }

    /// [`SseClient::connect`] with `token` as the bearer token.
    pub async fn connect_as(base: &str, query: &str, token: &str) -> SseClient {
        let request = reqwest::Client::new().get(format!("{base}/events/stream?{query}")).bearer_auth(token);
        SseClient::connect_with(request).await
    }

    async fn connect_with(request: reqwest::RequestBuilder) -> SseClient {
        let resp = request.send().await.expect("connect SSE");
        assert_eq!(resp.status().as_u16(), 200, "SSE stream opens");
        SseClient { body: Box::pin(resp.bytes_stream()), buffer: String::new(), parsed: VecDeque::new() }
    }

    /// The next `event: delivery` payload, reading no more than needed; `None` after `timeout`.
    pub async fn next(&mut self, timeout: Duration) -> Option<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(value) = self.parsed.pop_front() {
                return Some(value);
            }
            let chunk = tokio::time::timeout_at(deadline, self.body.next()).await.ok()??.ok()?;
            self.buffer.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let is_delivery = block.lines().any(|l| l == "event: delivery");
                let data: String = block
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
                    .collect();
                if is_delivery {
                    if let Ok(value) = serde_json::from_str::<Value>(&data) {
                        self.parsed.push_back(value);
                    }
                }
            }
        }
    }
}

/// A WebSocket subscriber.
pub struct WsClient {
    socket: WebSocketStream<MaybeTlsStream<TcpStream>>,
    deliveries: VecDeque<Value>,
    /// Result and error frames.
    others: VecDeque<Value>,
}

impl WsClient {
    /// Opens `ws://…/events/ws?{query}`.
    pub async fn connect(base: &str, query: &str) -> WsClient {
        let url = format!("{}/events/ws?{query}", base.replacen("http://", "ws://", 1));
        let (socket, _) = tokio_tungstenite::connect_async(url).await.expect("connect WebSocket");
        WsClient { socket, deliveries: VecDeque::new(), others: VecDeque::new() }
    }

    /// The next delivery (`deliveries`) or other frame, reading frames only as needed and keeping the kind
    /// not asked for; `None` after `timeout`.
    async fn next_of(&mut self, want_delivery: bool, timeout: Duration) -> Option<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let queue = if want_delivery { &mut self.deliveries } else { &mut self.others };
            if let Some(value) = queue.pop_front() {
                return Some(value);
            }
            let frame = tokio::time::timeout_at(deadline, self.socket.next()).await.ok()??.ok()?;
            if let Message::Text(text) = frame {
                if let Ok(value) = serde_json::from_str::<Value>(text.as_str()) {
                    let queue = if value["type"] == "delivery" { &mut self.deliveries } else { &mut self.others };
                    queue.push_back(value);
                }
            }
        }
    }

    /// The next delivery frame; `None` after `timeout`.
    pub async fn next(&mut self, timeout: Duration) -> Option<Value> {
        self.next_of(true, timeout).await
    }

    /// Sends an in-band command and waits for its result frame.
    pub async fn settle(&mut self, command: Value) -> Value {
        self.socket.send(Message::Text(command.to_string().into())).await.expect("socket open");
        self.next_of(false, Duration::from_secs(10)).await.expect("a result frame")
    }
}

/// A TCP connection to `addr` with a tiny receive buffer, so a subscriber that stops reading makes popgate's
/// writes block after a few kilobytes (loopback buffers otherwise absorb tens of megabytes).
pub async fn tight_stream(addr: &str) -> TcpStream {
    let addr: std::net::SocketAddr = addr.parse().expect("socket address");
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    socket.connect(&addr.into()).expect("connect");
    socket.set_nonblocking(true).expect("nonblocking");
    TcpStream::from_std(std::net::TcpStream::from(socket)).expect("tokio stream")
}

/// How long a tight connection may take to bring its first `keep` deliveries. Generous: through a 4 KiB
/// receive buffer a 1 MiB event takes many round trips, and a POP round on a loaded machine waits for the
/// slowest broker (a POP that times out takes its poll time plus 3 s, then a 1 s pause).
pub const TIGHT_READ_TIMEOUT: Duration = Duration::from_secs(180);

/// Opens an SSE stream over a [`tight_stream`], reads `keep` deliveries (within [`TIGHT_READ_TIMEOUT`]), then
/// stops reading; returns them with the connection, which the caller drops to kill it.
pub async fn tight_sse(base: &str, query: &str, keep: usize) -> (Vec<Value>, TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = base.trim_start_matches("http://");
    let mut stream = tight_stream(host).await;
    let request = format!("GET /events/stream?{query} HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send request");
    let mut text = String::new();
    let mut deliveries = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let deadline = tokio::time::Instant::now() + TIGHT_READ_TIMEOUT;
    while deliveries.len() < keep {
        let n = tokio::time::timeout_at(deadline, stream.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("{} of {keep} SSE deliveries within {TIGHT_READ_TIMEOUT:?}", deliveries.len()))
            .expect("read");
        assert!(n > 0, "stream closed early");
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
        // Chunked encoding frames the events; each data line holds one whole delivery.
        while let Some(start) = text.find("data: {") {
            let Some(end) = text[start..].find('\n') else { break };
            let line: String = text.drain(..start + end + 1).collect();
            let json = line[line.find("data: ").map(|i| i + 6).unwrap_or(0)..].trim();
            if let Ok(value) = serde_json::from_str::<Value>(json) {
                deliveries.push(value);
            }
        }
    }
    deliveries.truncate(keep);
    (deliveries, stream)
}

/// Opens a WebSocket over a [`tight_stream`] and reads `keep` delivery frames (within [`TIGHT_READ_TIMEOUT`]);
/// the caller drops the client.
pub async fn tight_ws(base: &str, query: &str, keep: usize) -> (Vec<Value>, WsClient) {
    let host = base.trim_start_matches("http://");
    let stream = MaybeTlsStream::Plain(tight_stream(host).await);
    let (socket, _) = tokio_tungstenite::client_async(format!("ws://{host}/events/ws?{query}"), stream)
        .await
        .expect("WebSocket handshake");
    let mut client = WsClient { socket, deliveries: VecDeque::new(), others: VecDeque::new() };
    let mut deliveries = Vec::new();
    let deadline = tokio::time::Instant::now() + TIGHT_READ_TIMEOUT;
    while deliveries.len() < keep {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let frame = client.next(left).await;
        let got = deliveries.len();
        deliveries.push(
            frame.unwrap_or_else(|| panic!("{got} of {keep} WebSocket deliveries within {TIGHT_READ_TIMEOUT:?}")),
        );
    }
    (deliveries, client)
}
