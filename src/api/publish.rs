//! `POST /events/publish[?topic=&mode=]`: one event to the broker, answered after the broker stored it.
//!
//! ```text
//! 200 {"messageId","topic","broker","queueId","queueOffset","status","attempts"}   stored (sync, async)
//!     (+ "transactionId" for a transactional publish: a half message, ended with POST /events/transactions/{id})
//! 202 {"topic","status":"SENT_ONEWAY","attempts"}                                  mode=oneway: not confirmed
//! 400 invalid_field / malformed_body, 413 too_large, 404 unknown_topic, 503 unavailable (+ "attempts")
//! ```

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
    let request = match decode(&state, &query, &headers, body, received_at) {
        Ok(request) => request,
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
            answer(published, id.filter(|_| half))
        }
        Err(failed) => {
            if let GatewayError::NotStored { attempts, last_error } = &failed {
                tracing::warn!(attempts = attempts.len(), error = %last_error, "Publish failed.");
            }
            ApiError::from(failed).into_response()
        }
    }
}

/// The publish the request asks for, or why it cannot be one: 413, or 400 naming the field.
fn decode(
    state: &AppState,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    received_at: Instant,
) -> Result<PublishRequest, ApiError> {
    let max = state.config.publish.max_message_bytes;
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            rejected("body_too_large", ApiError::too_large(max))
        } else {
            ApiError::malformed_body(rejection.body_text())
        }
    })?;
    let mode = match query.get("mode") {
        None => SendMode::Sync,
        Some(text) => {
            SendMode::parse(text).ok_or_else(|| ApiError::invalid_field("mode", "must be sync, async or oneway"))?
        }
    };
    let limits = &state.config.publish.limits;
    let param = |name: &str| query.get(name).map(String::as_str);
    let transaction_params = (param("transaction"), param("producerGroup"));
    let parsed = request::parse(headers, param("topic"), transaction_params, &body, limits)?;
    let mut message = parsed.message;
    let retry_key = request::dedup_key(headers, message.message())?;
    if let Some(transactional) = &parsed.transaction {
        super::transactions::prepare_half(state, mode, transactional, &mut message)?;
    }
    let half = parsed.transaction.is_some();
    Ok(PublishRequest { message, placement: Placement::Policy, mode, deadline: None, retry_key, half, received_at })
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
