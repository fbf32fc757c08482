//! What every request passes before a handler sees it: a request id, size limits, authentication; and the
//! per-token limits on waiting and streaming requests that handlers take a slot of.
//!
//! Every rejection answers with the one error schema and counts in
//! `popgate_requests_rejected_total{reason}`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use futures::StreamExt;
use metrics::counter;
use rand::RngCore;
use tracing::Instrument;

use super::ApiError;
use crate::auth::{BudgetSlot, Caller, TokenBudget, TokenTable};
use crate::gateway;
use crate::metrics as m;

/// The header a request id is taken from and answered in.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// Longest request id accepted from a client; a longer or odd one is replaced.
const MAX_REQUEST_ID_LEN: usize = 128;

/// Counts a rejection and returns the error, so call sites read `return Err(rejected(...))`.
pub fn rejected(reason: &'static str, error: ApiError) -> ApiError {
    counter!(m::REQUESTS_REJECTED, "reason" => reason).increment(1);
    error
}

/// Gives every request an id, runs it inside a span that carries the id, and answers with the id.
pub(crate) async fn request_id(request: Request, next: Next) -> Response {
    let id = request
        .headers()
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= MAX_REQUEST_ID_LEN && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(new_request_id, str::to_owned);
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        method = %request.method(),
        path = %request.uri().path(),
        caller = tracing::field::Empty,
    );
    let mut response = next.run(request).instrument(span).await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

fn new_request_id() -> String {
    let mut bytes = [0u8; 12];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}

/// Largest framework error text taken over into a JSON error.
const MAX_REJECTION_TEXT: usize = 4 * 1024;

/// Turns the few error answers that do not come from popgate's handlers (axum's extractor rejections: a bad
/// query string, a WebSocket request without its upgrade headers) into the one JSON error schema.
pub async fn json_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let text = match axum::body::to_bytes(response.into_body(), MAX_REJECTION_TEXT).await {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(_) => String::new(),
    };
    let code = match status {
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        StatusCode::UPGRADE_REQUIRED => "upgrade_required",
        status if status.is_server_error() => "internal",
        _ => "bad_request",
    };
    let message = if text.is_empty() { status.canonical_reason().unwrap_or("error").to_owned() } else { text };
    let body = serde_json::json!({"error": {"code": code, "message": message}});
    (status, axum::Json(body)).into_response()
}

/// The URI and header size limits.
#[derive(Debug, Clone, Copy)]
pub struct SizeLimits {
    /// Longest URI (path and query).
    pub max_uri_bytes: usize,
    /// Most header bytes (names and values).
    pub max_header_bytes: usize,
    /// Largest body.
    pub max_body_bytes: usize,
}

/// Refuses requests whose URI, headers or declared body are too large, before anything reads them.
pub async fn size_limits(State(limits): State<SizeLimits>, request: Request, next: Next) -> Response {
    let uri_len = request.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if uri_len > limits.max_uri_bytes {
        return too_big(StatusCode::URI_TOO_LONG, "uri_too_long", "uri", limits.max_uri_bytes);
    }
    let header_bytes: usize = request.headers().iter().map(|(name, value)| name.as_str().len() + value.len()).sum();
    if header_bytes > limits.max_header_bytes {
        return too_big(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            "headers",
            limits.max_header_bytes,
        );
    }
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|length| length > limits.max_body_bytes) {
        return body_too_large(limits.max_body_bytes);
    }
    next.run(request).await
}

/// The counted 413 of a request body over `limit` bytes (the code is the publish path's `too_large`).
fn body_too_large(limit: usize) -> Response {
    let message = format!("the request body exceeds {limit} bytes");
    let refused = ApiError::limit(StatusCode::PAYLOAD_TOO_LARGE, "too_large", "body", message);
    rejected("body_too_large", refused).into_response()
}

/// How large a request's body may be, and how long it may take to arrive.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    /// Largest body.
    pub max_body_bytes: usize,
    /// Longest time from the request's head to the body's last byte.
    pub timeout: Duration,
}

/// Reads a request's body in before its handler runs: at most `max_body_bytes` of it (a body that declared no
/// length is refused once it passes them), and all of it within `timeout`. A client that sends its body a byte
/// at a time would otherwise hold the connection, and what it sent so far, for as long as it likes.
pub async fn read_body_in_time(State(limits): State<BodyLimits>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let read = async {
        let mut chunks = body.into_data_stream();
        let mut read = BytesMut::new();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk?;
            if read.len() + chunk.len() > limits.max_body_bytes {
                return Ok(None);
            }
            read.extend_from_slice(&chunk);
        }
        Ok::<_, axum::Error>(Some(read.freeze()))
    };
    match tokio::time::timeout(limits.timeout, read).await {
        Ok(Ok(Some(body))) => next.run(Request::from_parts(parts, Body::from(body))).await,
        Ok(Ok(None)) => body_too_large(limits.max_body_bytes),
        Ok(Err(error)) => ApiError::malformed_body(format!("the request body cannot be read: {error}")).into_response(),
        Err(_) => {
            let secs = limits.timeout.as_secs();
            let message = format!("the request body did not arrive within {secs} s (server.body_timeout_secs)");
            let refused = ApiError::limit(StatusCode::REQUEST_TIMEOUT, "body_timeout", "body", message);
            rejected("body_timeout", refused).into_response()
        }
    }
}

/// A counted rejection of a request part (`field`) larger than `limit` bytes; `reason` is also the error code.
fn too_big(status: StatusCode, reason: &'static str, field: &str, limit: usize) -> Response {
    let message = format!("the request {field} exceeds {limit} bytes");
    rejected(reason, ApiError::limit(status, reason, field, message)).into_response()
}

/// The address a request came from, with and without TLS (set on each request by [`super::server`]).
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub SocketAddr);

/// Authenticates the bearer token (or lets everyone in when authentication is off) and hands the
/// [`Caller`] to the handlers. No or an unknown token: 401.
pub async fn authenticate(State(tokens): State<Arc<TokenTable>>, mut request: Request, next: Next) -> Response {
    let caller = if tokens.enabled() {
        let presented = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim);
        match presented.and_then(|token| tokens.authenticate(token)) {
            Some(caller) => caller,
            None => {
                let message = if presented.is_some() { "unknown bearer token" } else { "a bearer token is required" };
                let mut response = rejected("unauthenticated", ApiError::unauthenticated(message)).into_response();
                response.headers_mut().insert(axum::http::header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return response;
            }
        }
    } else {
        Caller::unrestricted()
    };
    let peer = request.extensions().get::<ConnectInfo<PeerAddr>>().map(|info| info.0 .0.ip());
    let caller = match peer {
        Some(ip) => caller.with_address(ip),
        None => caller,
    };
    tracing::Span::current().record("caller", caller.name.as_str());
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// Lets only callers with the admin right through (`/admin/*`).
pub async fn require_admin(request: Request, next: Next) -> Response {
    let allowed = match request.extensions().get::<Caller>() {
        Some(caller) => gateway::may_administer(caller).map_err(ApiError::from),
        None => Err(rejected("forbidden", ApiError::forbidden("token", "this token may not use the admin API"))),
    };
    match allowed {
        Ok(()) => next.run(request).await,
        Err(refused) => refused.into_response(),
    }
}

/// The request body, or the JSON error for one that is too large or cannot be read.
///
/// # Errors
/// 413 `too_large` (counted) or 400 `malformed_body`.
pub fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            rejected(
                "body_too_large",
                ApiError::limit(StatusCode::PAYLOAD_TOO_LARGE, "too_large", "body", rejection.body_text()),
            )
        } else {
            ApiError::malformed_body(rejection.body_text())
        }
    })
}

/// Which per-token budget a request draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Budget {
    /// Long-poll requests waiting for deliveries.
    Waiters,
    /// Open SSE and WebSocket streams.
    Streams,
}

/// Per-token budgets of waiting long-polls and open streams.
#[derive(Debug)]
pub struct ConnectionLimits {
    waiters: Arc<TokenBudget>,
    streams: Arc<TokenBudget>,
}

/// One taken slot; it is given back when dropped.
pub type Slot = BudgetSlot;

impl ConnectionLimits {
    /// Limits of `max_waiters` long-polls and `max_streams` streams per token.
    pub fn new(max_waiters: usize, max_streams: usize) -> Arc<ConnectionLimits> {
        Arc::new(ConnectionLimits { waiters: TokenBudget::new(max_waiters), streams: TokenBudget::new(max_streams) })
    }

    /// Takes a slot of `budget` for `caller`, or answers 429 when the token has used them all.
    ///
    /// # Errors
    /// [`ApiError`] 429 `too_many_requests`.
    pub fn acquire(self: &Arc<Self>, caller: &Caller, budget: Budget) -> Result<Slot, ApiError> {
        let (budget, reason, what) = match budget {
            Budget::Waiters => (&self.waiters, "too_many_waiters", "waiting long-polls"),
            Budget::Streams => (&self.streams, "too_many_streams", "open streams"),
        };
        budget.take(caller).ok_or_else(|| {
            let max = budget.max_per_token();
            rejected(reason, ApiError::too_many(format!("this token already has {max} {what}")))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_counted_per_token_and_given_back_on_drop() {
        let limits = ConnectionLimits::new(2, 1);
        let caller = Caller::unrestricted();
        let first = limits.acquire(&caller, Budget::Waiters).expect("first");
        let _second = limits.acquire(&caller, Budget::Waiters).expect("second");
        let refused = limits.acquire(&caller, Budget::Waiters).expect_err("third is one too many");
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        let _stream = limits.acquire(&caller, Budget::Streams).expect("streams are a separate budget");
        drop(first);
        limits.acquire(&caller, Budget::Waiters).expect("a slot came back");
    }
}
