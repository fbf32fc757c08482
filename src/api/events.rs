//! The consume API (EventMesh-style paths). Every transport shares the one dispatcher; this one is long-poll.
//!
//! ```text
//! POST /events/subscribe   {"group","topic","filter","filterType","ackTimeoutMs","maxAttempts","initialBackoffMs","maxBackoffMs",
//!                           "ordered","push":{"url","secret","timeoutMs","maxConcurrency"}}
//!                          200 {"subscription":{...}}
//! POST /events/unsubscribe {"group","topic"}                 200 {"status":"unsubscribed"} | 404
//! GET  /events/poll?group=&topic=&max=&waitMs=               200 {"deliveries":[{"deliveryId","attempt","ackDeadline",
//!                          "event":{"id","topic","tags","keys","properties","data"|"dataBase64","bornTimestamp"}}]}
//! POST /events/ack         {"deliveryId"}                    200 {"status":"acked"} | 404 {"status":"unknown"}
//!                                                            | 409 {"status":"stale"}
//!                          {"deliveryIds":[...]}             200 {"results":[{"deliveryId","status"}]}
//! POST /events/nack        {"deliveryId","delayMs"?}         200 {"status":"retry","attempt","dueAt"} | {"status":"dead_letter"}
//!                          delayMs <= 3600000 (the longest    | 400 naming `delayMs`
//!                          ackTimeoutMs)
//! POST /events/term        {"deliveryId","reason"}           200 {"status":"terminated"}
//! ```

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use super::guard::{read_body, rejected, Budget};
use super::{ApiError, AppState};
use crate::auth::Caller;
use crate::gateway::below::{content, Dispatched, Event, FilterType, NackOutcome, Subscription, SubscriptionRequest};
use crate::gateway::{Reader, Settlement};

/// Default long-poll wait when `waitMs` is absent.
const DEFAULT_WAIT_MS: u64 = 1_000;
/// Default batch when `max` is absent.
const DEFAULT_MAX: usize = 16;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct SubscribeBody {
    group: String,
    topic: String,
    filter: Option<String>,
    /// `TAG` (the default) or `SQL92`.
    filter_type: Option<String>,
    ack_timeout_ms: Option<u64>,
    max_attempts: Option<u32>,
    initial_backoff_ms: Option<u64>,
    max_backoff_ms: Option<u64>,
    ordered: Option<bool>,
    push: Option<crate::gateway::below::WebhookPush>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupTopic {
    group: String,
    topic: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct AckBody {
    delivery_id: Option<String>,
    delivery_ids: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NackBody {
    delivery_id: String,
    delay_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TermBody {
    delivery_id: String,
    reason: Option<String>,
}

/// Parses a JSON body, naming the field at fault (path included) in the 400.
pub(super) fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        let message = inner.to_string();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::malformed_body(format!("the body is not valid JSON: {message}"));
        }
        let field = field_in_message(&message).unwrap_or(if path == "." { String::new() } else { path });
        if field.is_empty() {
            ApiError::malformed_body(message)
        } else {
            ApiError::invalid_field(&field, message)
        }
    })
}

/// serde names the field itself in "missing field `x`" and "unknown field `x`".
fn field_in_message(message: &str) -> Option<String> {
    let rest = message.strip_prefix("missing field `").or_else(|| message.strip_prefix("unknown field `"))?;
    rest.split('`').next().map(str::to_owned)
}

/// A query parameter that must be present and non-empty (shared by every transport).
pub fn required_param(query: &HashMap<String, String>, name: &str) -> Result<String, ApiError> {
    query.get(name).filter(|v| !v.is_empty()).cloned().ok_or_else(|| ApiError::invalid_field(name, "required"))
}

/// An optional non-negative integer query parameter, `default` when absent (shared by every route).
pub fn number_param<T: std::str::FromStr>(
    query: &HashMap<String, String>,
    name: &str,
    default: T,
) -> Result<T, ApiError> {
    match query.get(name) {
        None => Ok(default),
        Some(text) => text.parse().map_err(|_| ApiError::invalid_field(name, "must be a non-negative integer")),
    }
}

/// The settlement of delivery `id` (a `deliveryId` as popgate handed it out): an HTTP request names no group
/// (the gateway checks the delivery's own).
pub fn settlement(id: &str) -> Settlement<'_> {
    Settlement::of(id, None, None)
}

/// The wire form of a subscription: its admin id (`<group>:<topic>`), and the webhook secret redacted (it is
/// written, never read back).
pub fn subscription_json(sub: &Subscription) -> Value {
    let mut answer = json!(sub);
    answer["id"] = Value::String(format!("{}:{}", sub.group, sub.topic));
    if answer.get("push").is_some() {
        answer["push"]["secret"] = Value::String("<redacted>".into());
    }
    answer
}

/// `POST /events/subscribe`.
pub async fn subscribe(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body: SubscribeBody = parse_body(&read_body(body)?)?;
    let reader = Reader::check(&caller, &body.group, &body.topic)?;
    let filter_type = body
        .filter_type
        .map(|t| FilterType::parse(&t).ok_or_else(|| ApiError::invalid_field("filterType", "must be TAG or SQL92")))
        .transpose()?;
    if let Some(push) = &body.push {
        super::webhook::validate(push, state.webhooks.targets()).map_err(ApiError::from)?;
    }
    let sub = state
        .deliveries
        .subscribe(
            &reader,
            SubscriptionRequest {
                filter: body.filter,
                filter_type,
                ack_timeout_ms: body.ack_timeout_ms,
                max_attempts: body.max_attempts,
                initial_backoff_ms: body.initial_backoff_ms,
                max_backoff_ms: body.max_backoff_ms,
                ordered: body.ordered,
                push: body.push,
                implicit: false,
                ..SubscriptionRequest::default()
            },
        )
        .await?;
    Ok(Json(json!({ "subscription": subscription_json(&sub) })).into_response())
}

/// `POST /events/unsubscribe`.
pub async fn unsubscribe(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body: GroupTopic = parse_body(&read_body(body)?)?;
    state.deliveries.unsubscribe(&caller, &body.group, &body.topic).await?;
    Ok(Json(json!({"status": "unsubscribed"})).into_response())
}

/// `GET /events/poll`.
pub async fn poll(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let group = required_param(&query, "group")?;
    let topic = required_param(&query, "topic")?;
    let reader = Reader::check(&caller, &group, &topic)?;
    let max = number_param(&query, "max", DEFAULT_MAX)?;
    if max == 0 || max > crate::gateway::below::MAX_POLL_BATCH {
        return Err(ApiError::invalid_field(
            "max",
            format!("must be in 1..={}", crate::gateway::below::MAX_POLL_BATCH),
        ));
    }
    let wait = Duration::from_millis(number_param(&query, "waitMs", DEFAULT_WAIT_MS)?);
    let _waiting = state.limits.acquire(&caller, Budget::Waiters)?;
    let deliveries = state.deliveries.poll(&reader, max, wait).await?;
    let deliveries: Vec<Value> = deliveries.iter().map(delivery_json).collect();
    Ok(Json(json!({ "deliveries": deliveries })).into_response())
}

/// The wire form of one delivery (shared by every transport).
pub fn delivery_json(delivery: &Dispatched) -> Value {
    json!({
        "deliveryId": delivery.handle_id(),
        "attempt": delivery.attempt,
        "ackDeadline": delivery.ack_deadline.as_millis(),
        "event": event_json(&delivery.event),
    })
}

/// The wire form of one event: a delivery's, a transaction check-back's. Its `data` (or `dataBase64`) is
/// shaped by [`content::http_data`].
pub fn event_json(event: &Event) -> Value {
    let mut event_json = json!({
        "id": event.id,
        "topic": event.topic,
        "tags": event.tags,
        "keys": event.keys,
        "properties": content::user_properties(&event.properties),
        "bornTimestamp": event.born_timestamp,
    });
    if let Value::Object(fields) = &mut event_json {
        content::http_data(&event.properties, &event.body).insert_into(fields);
    }
    event_json
}

/// `POST /events/ack`: one id, or a batch with a result per id.
pub async fn ack(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body: AckBody = parse_body(&read_body(body)?)?;
    match (body.delivery_id, body.delivery_ids) {
        (Some(id), None) => {
            state.settling().ack(&caller, settlement(&id)).await?;
            tracing::debug!(delivery_id = %id, "Delivery acked.");
            Ok(Json(json!({"status": "acked"})).into_response())
        }
        (None, Some(ids)) => {
            let max = state.config.server.max_ack_batch;
            if ids.len() > max {
                return Err(rejected(
                    "batch_too_large",
                    ApiError::limit(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "too_large",
                        "deliveryIds",
                        format!("at most {max} ids per batch"),
                    ),
                ));
            }
            // Ids this caller may not settle are answered `forbidden` and left alone; the rest are ACKed together.
            let settlements: Vec<Settlement<'_>> = ids.iter().map(|id| settlement(id)).collect();
            let outcomes = state.settling().ack_all(&caller, &settlements).await;
            let results: Vec<Value> = ids
                .iter()
                .zip(outcomes)
                .map(|(id, outcome)| {
                    let status = outcome.map_or_else(|refusal| refusal.code(), |()| "acked");
                    json!({"deliveryId": id, "status": status})
                })
                .collect();
            Ok(Json(json!({ "results": results })).into_response())
        }
        _ => Err(ApiError::invalid_field("deliveryId", "give `deliveryId` or `deliveryIds`, not both or neither")),
    }
}

/// `POST /events/nack`.
pub async fn nack(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body: NackBody = parse_body(&read_body(body)?)?;
    let delay = body.delay_ms.map(Duration::from_millis);
    let outcome = state.settling().nack(&caller, settlement(&body.delivery_id), delay).await?;
    Ok(Json(match outcome {
        NackOutcome::Retry { attempt, due } => json!({"status": "retry", "attempt": attempt, "dueAt": due.as_millis()}),
        NackOutcome::DeadLetter => json!({"status": "dead_letter"}),
    })
    .into_response())
}

/// `POST /events/term`.
pub async fn term(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body: TermBody = parse_body(&read_body(body)?)?;
    let reason = body.reason.unwrap_or_else(|| "terminated".to_owned());
    state.settling().term(&caller, settlement(&body.delivery_id), &reason).await?;
    Ok(Json(json!({"status": "terminated"})).into_response())
}
