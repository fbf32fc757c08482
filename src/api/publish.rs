//! `POST /events/publish[?topic=&mode=]`: one event, or a batch of them, to the broker, answered after the
//! broker stored it.
//!
//! ```text
//! 200 {"messageId","topic","broker","queueId","queueOffset","status","attempts"}   stored (sync, async)
//!     (+ "transactionId" for a transactional publish: a half message, ended with POST /events/transactions/{id})
//! 202 {"topic","status":"SENT_ONEWAY","attempts"}                                  mode=oneway: not confirmed
//! 400 invalid_field / malformed_body, 413 too_large, 404 unknown_topic, 503 unavailable (+ "attempts")
//! ```
//!
//! A batch (a JSON array body, or `application/cloudevents-batch+json`) is one broker request: stored whole, in
//! one queue, or not at all. Its answer is the one above without `messageId` and `queueOffset`, and with
//! `"messages": [{"messageId","queueOffset"}]` in the order sent (`queueOffset` absent when one-way).

use std::collections::HashMap;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use serde_json::json;

use super::guard::rejected;
use super::{ApiError, AppState};
use crate::auth::Caller;
use crate::gateway::{self, GatewayError, PublishRefused, PublishRequest};
use crate::publish::{request, Placement, Published, SendMode};

/// Handles one publish request; the gateway counts it and times it.
pub async fn publish(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let received_at = Instant::now();
    let decoded = body_within_limit(&state, body).and_then(|body| {
        if request::is_batch(&headers, &body) {
            decode_batch(&state, &query, &headers, &body, received_at).map(|(request, ids)| (request, Some(ids)))
        } else {
            decode(&state, &query, &headers, &body, received_at).map(|request| (request, None))
        }
    });
    let (request, batch_ids) = match decoded {
        Ok(decoded) => decoded,
        Err(refused) => {
            let why = if refused.status == StatusCode::PAYLOAD_TOO_LARGE {
                PublishRefused::TooLarge
            } else {
                PublishRefused::BadRequest
            };
            gateway::count_refused_publish("http", why, received_at);
            return refused.into_response();
        }
    };
    let half = request.half;
    match state.publishing().publish(&caller, request).await {
        Ok(published) => {
            let id = published.receipt.as_ref().map(|r| r.message_id.clone());
            tracing::debug!(topic = %published.topic, event_id = ?id, "Event published.");
            match batch_ids {
                Some(ids) => answer_batch(published, &ids),
                None => answer(published, id.filter(|_| half)),
            }
        }
        Err(failed) => {
            if let GatewayError::NotStored { attempts, last_error } = &failed {
                tracing::warn!(attempts = attempts.len(), error = %last_error, "Publish failed.");
            }
            ApiError::from(failed).into_response()
        }
    }
}

/// The request's body, or 413 when it is over the route's limit.
fn body_within_limit(state: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            rejected("body_too_large", ApiError::too_large(state.config.publish.max_message_bytes))
        } else {
            ApiError::malformed_body(rejection.body_text())
        }
    })
}

/// `?mode=`: sync (the default), async or oneway.
fn send_mode(query: &HashMap<String, String>) -> Result<SendMode, ApiError> {
    match query.get("mode") {
        None => Ok(SendMode::Sync),
        Some(text) => {
            SendMode::parse(text).ok_or_else(|| ApiError::invalid_field("mode", "must be sync, async or oneway"))
        }
    }
}

/// The publish the request asks for, or why it cannot be one: 400 naming the field.
fn decode(
    state: &AppState,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
    body: &Bytes,
    received_at: Instant,
) -> Result<PublishRequest, ApiError> {
    let mode = send_mode(query)?;
    let limits = &state.config.publish.limits;
    let param = |name: &str| query.get(name).map(String::as_str);
    let transaction_params = (param("transaction"), param("producerGroup"));
    let parsed = request::parse(headers, param("topic"), transaction_params, body, limits)?;
    let mut message = parsed.message;
    let retry_key = request::dedup_key(headers, message.message())?;
    if let Some(transactional) = &parsed.transaction {
        super::transactions::prepare_half(state, mode, transactional, &mut message)?;
    }
    let half = parsed.transaction.is_some();
    Ok(PublishRequest { message, placement: Placement::Policy, mode, deadline: None, retry_key, half, received_at })
}

/// The batch publish the request asks for, and its messages' ids in order; or 400 naming the field. A batch is
/// neither transactional nor de-duplicated: its messages' ids are new on every request, so a repeat could not
/// be answered with the first one's.
fn decode_batch(
    state: &AppState,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
    body: &Bytes,
    received_at: Instant,
) -> Result<(PublishRequest, Vec<String>), ApiError> {
    let mode = send_mode(query)?;
    if let Some(param) = ["transaction", "producerGroup"].into_iter().find(|p| query.contains_key(*p)) {
        return Err(ApiError::invalid_field(param, "a batch cannot be transactional"));
    }
    if headers.contains_key("idempotency-key") {
        return Err(ApiError::invalid_field(
            "Idempotency-Key",
            "a batch is not de-duplicated: publish its messages one by one for that",
        ));
    }
    let publish = &state.config.publish;
    let topic = query.get("topic").map(String::as_str);
    let messages = request::parse_batch(headers, topic, body, &publish.limits, publish.max_batch_messages)?;
    let (message, ids) = state
        .publisher
        .batch(messages)
        .ok_or_else(|| ApiError::malformed_body("the batch is empty: give at least one message"))?;
    let request = PublishRequest {
        message,
        placement: Placement::Policy,
        mode,
        deadline: None,
        retry_key: None,
        half: false,
        received_at,
    };
    Ok((request, ids))
}

/// The answer to a publish; `transaction_id` for a transactional one.
fn answer(published: Published, transaction_id: Option<String>) -> Response {
    let attempts = published.attempts.len();
    let Some(receipt) = published.receipt else {
        let body = json!({"topic": published.topic, "status": "SENT_ONEWAY", "attempts": attempts});
        return (StatusCode::ACCEPTED, Json(body)).into_response();
    };
    let mut body = json!({
        "messageId": receipt.message_id,
        "topic": published.topic,
        "broker": receipt.broker,
        "queueId": receipt.queue_id,
        "queueOffset": receipt.queue_offset,
        "status": receipt.status.as_str(),
        "attempts": attempts,
        "deduplicated": published.deduplicated,
    });
    if let Some(id) = transaction_id {
        body["transactionId"] = json!(id);
    }
    Json(body).into_response()
}

/// The answer to a batch publish: where the broker stored it, and each message's id and queue offset (the
/// broker appends a batch at consecutive offsets from the one it answers).
fn answer_batch(published: Published, ids: &[String]) -> Response {
    let attempts = published.attempts.len();
    let Some(receipt) = published.receipt else {
        let messages: Vec<_> = ids.iter().map(|id| json!({"messageId": id})).collect();
        let body =
            json!({"topic": published.topic, "status": "SENT_ONEWAY", "attempts": attempts, "messages": messages});
        return (StatusCode::ACCEPTED, Json(body)).into_response();
    };
    let messages: Vec<_> = (receipt.queue_offset..)
        .zip(ids)
        .map(|(queue_offset, id)| json!({"messageId": id, "queueOffset": queue_offset}))
        .collect();
    Json(json!({
        "topic": published.topic,
        "broker": receipt.broker,
        "queueId": receipt.queue_id,
        "status": receipt.status.as_str(),
        "attempts": attempts,
        "messages": messages,
    }))
    .into_response()
}
