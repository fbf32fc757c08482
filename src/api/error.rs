//! The one error type of the HTTP API: every failure becomes a status and the JSON body
//! `{"error":{"code","message","field"}}`, where `code` comes from a fixed set.

use axum::http::StatusCode;

use crate::gateway::below::DeliveryError;
use crate::gateway::below::TransactionError;
use crate::gateway::GatewayError;
use crate::publish::request::RequestError;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// An HTTP error answer. Build it with the named constructors so the status and code stay consistent.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// A stable machine-readable code (`invalid_field`, `too_large`, `unknown_topic`, `unavailable`, …).
    pub code: &'static str,
    /// What went wrong, for a person.
    pub message: String,
    /// The request field at fault, when there is one.
    pub field: Option<String>,
    /// Extra JSON merged into the `error` object (e.g. the attempts made before a 503).
    pub details: Option<serde_json::Value>,
    /// A top-level `status` word, for the delivery answers that promise one (`{"status":"unknown"}`).
    pub status_word: Option<&'static str>,
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<&'a str>,
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    code: &'a str,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    details: Option<&'a serde_json::Value>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into(), field: None, details: None, status_word: None }
    }

    /// 400: `field` is missing, malformed or has the wrong type.
    pub fn invalid_field(field: &str, message: impl Into<String>) -> ApiError {
        ApiError { field: Some(field.to_owned()), ..Self::new(StatusCode::BAD_REQUEST, "invalid_field", message) }
    }

    /// 400: the body as a whole cannot be read (not JSON, wrong content type).
    pub fn malformed_body(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::BAD_REQUEST, "malformed_body", message)
    }

    /// 413: the body (or the message it carries) is larger than the configured maximum.
    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            field: Some("data".to_owned()),
            ..Self::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", format!("message body exceeds {limit} bytes"))
        }
    }

    /// 404: the broker knows no such topic (and does not create it).
    pub fn unknown_topic(topic: &str) -> ApiError {
        ApiError {
            field: Some("topic".to_owned()),
            ..Self::new(StatusCode::NOT_FOUND, "unknown_topic", format!("topic `{topic}` does not exist"))
        }
    }

    /// 503: the broker could not take the request; `details` says what was tried.
    pub fn unavailable(message: impl Into<String>, details: serde_json::Value) -> ApiError {
        ApiError { details: Some(details), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message) }
    }

    /// A delivery answer (404 unknown, 409 stale, …) carrying its status word both at the top level and as the
    /// error code.
    pub fn delivery_status(status: StatusCode, word: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status_word: Some(word), ..Self::new(status, word, message) }
    }

    /// 401: no valid bearer token.
    pub fn unauthenticated(message: impl Into<String>) -> ApiError {
        ApiError {
            field: Some("authorization".to_owned()),
            ..Self::new(StatusCode::UNAUTHORIZED, "unauthenticated", message)
        }
    }

    /// 403: the token is valid but lacks the right for what `field` names.
    pub fn forbidden(field: &str, message: impl Into<String>) -> ApiError {
        ApiError { field: Some(field.to_owned()), ..Self::new(StatusCode::FORBIDDEN, "forbidden", message) }
    }

    /// 429: a per-token limit is used up; retry when an earlier request ends.
    pub fn too_many(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "too_many_requests", message)
    }

    /// A size limit (414 URI, 431 headers, 413 batch) on `field`.
    pub fn limit(status: StatusCode, code: &'static str, field: &str, message: impl Into<String>) -> ApiError {
        ApiError { field: Some(field.to_owned()), ..Self::new(status, code, message) }
    }

    /// 404 `not_found`: no such route or resource.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 405: the route exists, the method does not.
    pub fn method_not_allowed() -> ApiError {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this route does not take that method")
    }

    /// 409 `conflict`: the request cannot run now (another one holds what it needs).
    pub fn conflict(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    /// 500: a failure that is popgate's own; logged by the caller.
    pub fn internal(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Body {
            status: self.status_word,
            error: Inner {
                code: self.code,
                message: &self.message,
                field: self.field.as_deref(),
                details: self.details.as_ref(),
            },
        };
        (self.status, Json(body)).into_response()
    }
}

/// The one mapping of a delivery failure to an HTTP answer, for every transport and route.
impl From<DeliveryError> for ApiError {
    fn from(error: DeliveryError) -> ApiError {
        let word = error.code();
        match error {
            DeliveryError::Unknown => ApiError::delivery_status(StatusCode::NOT_FOUND, word, error.to_string()),
            DeliveryError::Stale | DeliveryError::NotInFlight | DeliveryError::Superseded => {
                ApiError::delivery_status(StatusCode::CONFLICT, word, error.to_string())
            }
            DeliveryError::Busy => ApiError::delivery_status(StatusCode::SERVICE_UNAVAILABLE, word, error.to_string()),
            DeliveryError::Invalid(field, message) => ApiError::invalid_field(field, message),
            DeliveryError::Store(store) => {
                tracing::warn!(error = %store, "Delivery request refused: state store unavailable.");
                ApiError::unavailable(format!("state store unavailable: {store}"), serde_json::json!({}))
            }
        }
    }
}

/// The HTTP front's one mapping of the gateway's errors (the gateway counted its refusals): 403 naming the
/// request field that chose what was refused, 404 for a topic that does not exist, 400 naming the field at
/// fault, 503 (with the attempts made) when the message could not be stored.
impl From<GatewayError> for ApiError {
    fn from(error: GatewayError) -> ApiError {
        let said = error.to_string();
        let forbidden = |field: &str| ApiError::forbidden(field, format!("this token {said}"));
        match error {
            GatewayError::MayNotConsume(_) => forbidden("group"),
            GatewayError::MayNotRead(_) | GatewayError::MayNotRoute(_) | GatewayError::MayNotPublish(_) => {
                forbidden("topic")
            }
            GatewayError::MayNotAdminister => forbidden("token"),
            GatewayError::ClientIdTaken(_) => forbidden("clientId"),
            GatewayError::ProducerGroupTaken(_) => forbidden("producerGroup"),
            GatewayError::TooManyClients { .. } => ApiError::too_many(said),
            GatewayError::MayNotSettle { refusal, .. } => {
                ApiError::forbidden("deliveryId", format!("this token {refusal}"))
            }
            GatewayError::TopicNotFound(topic) => ApiError::unknown_topic(&topic),
            GatewayError::TakesNoTransactions { .. } => ApiError::invalid_field("transaction", said),
            GatewayError::MessageTooLarge { max } => ApiError::too_large(max),
            GatewayError::OneWayUnconfirmed => ApiError::invalid_field("mode", said),
            GatewayError::HandleOfAnotherGroup { .. } => ApiError::invalid_field("group", said),
            GatewayError::NotStored { attempts, .. } => {
                ApiError::unavailable(said, serde_json::json!({ "attempts": attempts }))
            }
            GatewayError::Unavailable(why) => ApiError::unavailable(why, serde_json::json!({})),
            // Accepted, not done: the ACK was made, but whether it lands cannot be known here.
            GatewayError::AckUnconfirmed(why) => ApiError::delivery_status(StatusCode::ACCEPTED, "unconfirmed", why),
            GatewayError::Delivery(refusal) => ApiError::from(refusal),
            GatewayError::Transaction(refusal) => transaction_refusal(refusal),
        }
    }
}

/// A refused transaction end: 404 for no such record, 409 for one ended the other way or refused by the broker.
fn transaction_refusal(error: TransactionError) -> ApiError {
    match error {
        TransactionError::Unknown(_) => ApiError::not_found(error.to_string()),
        TransactionError::AlreadyEnded { .. } | TransactionError::Refused { .. } => {
            ApiError::conflict(error.to_string())
        }
        TransactionError::Busy(_) => ApiError::too_many(error.to_string()),
        TransactionError::Store(store) => {
            tracing::warn!(error = %store, "Transaction end refused: state store unavailable.");
            ApiError::unavailable(format!("state store unavailable: {store}"), serde_json::json!({}))
        }
    }
}

/// A refused publish request: 400 naming the field.
impl From<RequestError> for ApiError {
    fn from(error: RequestError) -> ApiError {
        match error {
            RequestError::InvalidField { field, message } => ApiError::invalid_field(&field, message),
            RequestError::MalformedBody(message) => ApiError::malformed_body(message),
        }
    }
}
