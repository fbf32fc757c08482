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
        let resp =
            reqwest::Client::new().get(format!("{base}/events/stream?{query}")).send().await.expect("connect SSE");
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
}

impl WsClient {
    /// Opens `ws://…/events/ws?{query}`.
    pub async fn connect(base: &str, query: &str) -> WsClient {
        let url = format!("{}/events/ws?{query}", base.replacen("http://", "ws://", 1));
        let (socket, _) = tokio_tungstenite::connect_async(url).await.expect("connect WebSocket");
        WsClient { socket, deliveries: VecDeque::new() }
    }

    /// The next frame that is not a delivery (a result or an error), keeping deliveries read meanwhile.
    async fn next_frame(&mut self, timeout: Duration) -> Option<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let frame = tokio::time::timeout_at(deadline, self.socket.next()).await.ok()??.ok()?;
            if let Message::Text(text) = frame {
                let value: Value = serde_json::from_str(text.as_str()).ok()?;
                if value["type"] == "delivery" {
                    self.deliveries.push_back(value);
                } else {
                    return Some(value);
                }
            }
        }
    }

    /// The next delivery frame, reading no more than needed; `None` after `timeout`.
    pub async fn next(&mut self, timeout: Duration) -> Option<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(value) = self.deliveries.pop_front() {
                return Some(value);
            }
            let frame = tokio::time::timeout_at(deadline, self.socket.next()).await.ok()??.ok()?;
            if let Message::Text(text) = frame {
                if let Ok(value) = serde_json::from_str::<Value>(text.as_str()) {
                    if value["type"] == "delivery" {
                        self.deliveries.push_back(value);
                    }
                }
            }
        }
    }

    /// Sends an in-band command and waits for its result frame.
    pub async fn settle(&mut self, command: Value) -> Value {
        self.socket.send(Message::Text(command.to_string().into())).await.expect("socket open");
        self.next_frame(Duration::from_secs(10)).await.expect("a result frame")
    }
}
