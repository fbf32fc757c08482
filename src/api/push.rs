//! Push transports. Each moves deliveries and ACKs between a [`Subscriber`] session and a connection; the
//! delivery rules all stay in the dispatcher.
//!
//! ```text
//! GET /events/stream?group=&topic=[&prefetch=]   SSE: `event: delivery`, `id: <deliveryId>`, data = the poll JSON
//!                                                of one delivery; keep-alive comments every 15 s. ACK/NACK/TERM
//!                                                over POST /events/ack|nack|term. `Last-Event-ID` is accepted.
//! GET /events/ws?group=&topic=[&prefetch=]       WebSocket: deliveries as text frames {"type":"delivery",...};
//!                                                the client settles in band:
//!                                                  {"ack":"<id>"} | {"nack":"<id>","delayMs":n} | {"term":"<id>","reason":"..."}
//!                                                each answered {"type":"result","op","deliveryId","status"}
//!                                                (and "field","message" for a bad value, e.g. `delayMs`);
//!                                                a ping every 15 s, and no pong for 45 s closes the connection.
//! ```
//!
//! A delivery whose write fails goes straight back to the dispatcher and is dispatched again at once to any
//! subscriber of the group (`popgate_push_write_failures_total{transport}`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::events::{delivery_json, required_param, settlement};
use super::guard::{Budget, Slot};
use super::{ApiError, AppState};
use crate::auth::Caller;
use crate::gateway::below::{DeliveryError, Dispatched, NackOutcome, Subscriber};
use crate::gateway::{GatewayError, Reader};

/// How long one wait for deliveries lasts before a transport looks at its connection again.
const WAIT_SLICE: Duration = Duration::from_secs(5);
/// SSE keep-alive comments and WebSocket pings.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// A WebSocket with no pong for this long is dead.
const PONG_TIMEOUT: Duration = Duration::from_secs(45);

/// `group`, `topic` and an optional `prefetch` from the query.
fn push_params(query: &HashMap<String, String>) -> Result<(String, String, Option<usize>), ApiError> {
    let prefetch = match query.get("prefetch") {
        None => None,
        Some(text) => {
            Some(text.parse::<usize>().map_err(|_| ApiError::invalid_field("prefetch", "must be an integer"))?)
        }
    };
    Ok((required_param(query, "group")?, required_param(query, "topic")?, prefetch))
}

fn ids_from(batch: &[Dispatched]) -> Vec<String> {
    batch.iter().map(|d| d.id.clone()).collect()
}

/// `GET /events/stream`: Server-Sent Events.
pub async fn stream(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let (group, topic, prefetch) = push_params(&query)?;
    let reader = Reader::check(&caller, &group, &topic)?;
    let slot = state.limits.acquire(&caller, Budget::Streams)?;
    let subscriber = state.deliveries.attach(&reader, prefetch, "sse").await?;
    // A reconnecting client names the last delivery it saw. What it still holds unACKed stays in flight to it
    // (it is not sent again on this stream): it ACKs those by POST, or they come back after their ACK timeout.
    if let Some(last) = headers.get("last-event-id").and_then(|v| v.to_str().ok()) {
        tracing::debug!(last_event_id = last, %group, %topic, "SSE subscriber reconnected.");
    }
    // Capacity 1: a delivery leaves the pump only when the connection takes it, so a dead connection is
    // noticed with at most one delivery in its buffer.
    let (tx, rx) = mpsc::channel::<Event>(1);
    tokio::spawn(sse_pump(subscriber, tx, slot));
    let events = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|event| (Ok::<Event, Infallible>(event), rx))
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive")).into_response())
}

/// Runs for as long as the stream is open; `_slot` is the token's stream slot, given back when it ends.
async fn sse_pump(mut subscriber: Subscriber, tx: mpsc::Sender<Event>, _slot: Slot) {
    loop {
        let batch = tokio::select! {
            batch = subscriber.next(WAIT_SLICE) => batch,
            () = tx.closed() => {
                tracing::debug!("SSE subscriber left while nothing was being written.");
                return;
            }
        };
        let batch = match batch {
            Ok(batch) => batch,
            Err(error) => {
                tracing::warn!(%error, "SSE subscriber cannot be served now.");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        for (i, delivery) in batch.iter().enumerate() {
            let event =
                Event::default().event("delivery").id(delivery.id.clone()).data(delivery_json(delivery).to_string());
            if tx.send(event).await.is_err() {
                tracing::info!(
                    unwritten = batch.len() - i,
                    "SSE subscriber went away mid-write; handing deliveries back."
                );
                subscriber.push_failed(&ids_from(&batch[i..])).await;
                return;
            }
        }
    }
}

/// `GET /events/ws`: WebSocket with in-band settlement.
pub async fn websocket(
    upgrade: WebSocketUpgrade,
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let (group, topic, prefetch) = push_params(&query)?;
    let reader = Reader::check(&caller, &group, &topic)?;
    let slot = state.limits.acquire(&caller, Budget::Streams)?;
    let subscriber = state.deliveries.attach(&reader, prefetch, "websocket").await?;
    Ok(upgrade.on_upgrade(move |socket| ws_session(socket, subscriber, state, caller, slot)))
}

/// Runs for as long as the socket is open; `_slot` is the token's stream slot, given back when it ends.
async fn ws_session(socket: WebSocket, mut subscriber: Subscriber, state: AppState, caller: Caller, _slot: Slot) {
    let (mut sink, mut incoming) = socket.split();
    let mut ping = tokio::time::interval(KEEP_ALIVE);
    ping.tick().await;
    let mut last_pong = Instant::now();
    loop {
        tokio::select! {
            batch = subscriber.next(WAIT_SLICE) => {
                let Ok(batch) = batch else { continue };
                for (i, delivery) in batch.iter().enumerate() {
                    let mut frame = delivery_json(delivery);
                    frame["type"] = Value::String("delivery".into());
                    if sink.send(Message::Text(frame.to_string().into())).await.is_err() {
                        subscriber.push_failed(&ids_from(&batch[i..])).await;
                        return;
                    }
                }
            }
            message = incoming.next() => match message {
                Some(Ok(Message::Text(text))) => {
                    let reply = settle_in_band(&state, &caller, text.as_str()).await;
                    if sink.send(Message::Text(reply.to_string().into())).await.is_err() {
                        return;
                    }
                }
                Some(Ok(Message::Pong(_))) => last_pong = Instant::now(),
                Some(Ok(Message::Ping(_))) => {}
                Some(Ok(Message::Binary(_))) => {
                    let reply = json!({"type": "error", "error": {"code": "malformed_body", "message": "send JSON text frames"}});
                    if sink.send(Message::Text(reply.to_string().into())).await.is_err() {
                        return;
                    }
                }
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return,
            },
            _ = ping.tick() => {
                if last_pong.elapsed() > PONG_TIMEOUT {
                    tracing::info!("WebSocket subscriber missed its pongs; closing.");
                    return;
                }
                if sink.send(Message::Ping(Vec::new().into())).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// One in-band command: `{"ack":id}`, `{"nack":id,"delayMs":n}` or `{"term":id,"reason":"..."}`.
async fn settle_in_band(state: &AppState, caller: &Caller, text: &str) -> Value {
    let settling = state.settling();
    let command: Value = match serde_json::from_str(text) {
        Ok(Value::Object(map)) => Value::Object(map),
        _ => {
            return json!({"type": "error", "error": {"code": "malformed_body", "message": "a frame is one JSON object"}})
        }
    };
    let id_of = |op: &str| command.get(op).and_then(Value::as_str).map(str::to_owned);
    let (op, id, result) = if let Some(id) = id_of("ack") {
        let result = settling.ack(caller, settlement(&id)).await.map(|()| "acked");
        ("ack", id, result)
    } else if let Some(id) = id_of("nack") {
        let result = match in_band_delay(&command) {
            Ok(delay) => settling.nack(caller, settlement(&id), delay).await.map(|outcome| match outcome {
                NackOutcome::Retry { .. } => "retry",
                NackOutcome::DeadLetter => "dead_letter",
            }),
            Err(refused) => Err(refused.into()),
        };
        ("nack", id, result)
    } else if let Some(id) = id_of("term") {
        let reason = command.get("reason").and_then(Value::as_str).unwrap_or("terminated").to_owned();
        let result = settling.term(caller, settlement(&id), &reason).await.map(|()| "terminated");
        ("term", id, result)
    } else {
        return json!({"type": "error", "error": {"code": "invalid_field", "field": "ack",
            "message": "expected {\"ack\":id}, {\"nack\":id,\"delayMs\":n} or {\"term\":id,\"reason\":text}"}});
    };
    let status = match &result {
        Ok(status) => *status,
        Err(error) => {
            if matches!(error, GatewayError::Delivery(DeliveryError::Store(_) | DeliveryError::Busy)) {
                tracing::warn!(%error, "In-band settlement failed.");
            }
            error.code()
        }
    };
    let mut answer = json!({"type": "result", "op": op, "deliveryId": id, "status": status});
    if let Err(GatewayError::Delivery(DeliveryError::Invalid(field, message))) = result {
        answer["field"] = Value::from(field);
        answer["message"] = Value::from(message);
    }
    answer
}

/// A NACK frame's `delayMs`: absent, or milliseconds as a non-negative integer (the dispatcher bounds it).
fn in_band_delay(command: &Value) -> Result<Option<Duration>, DeliveryError> {
    match command.get("delayMs") {
        None | Some(Value::Null) => Ok(None),
        Some(ms) => ms.as_u64().map(|ms| Some(Duration::from_millis(ms))).ok_or_else(|| {
            DeliveryError::Invalid("delayMs", "must be a non-negative integer (milliseconds)".to_owned())
        }),
    }
}
