//! Transactional publishes over HTTP: a half message now, its end later.
//!
//! ```text
//! POST /events/publish {"transaction": true, "producerGroup"?, ...}   200 {... "transactionId"}: a half message
//! POST /events/transactions/{id} {"resolution": "commit" | "rollback"}
//!      200 {"transactionId","topic","resolution","state":"ended"}     the broker has the resolution
//!      202 {... "state":"owed"}                                       the broker could not be reached: popgate
//!                                                                     keeps the resolution and delivers it
//! GET  /events/transactions/{id}                                      200 {"transactionId","topic","state",...}
//! 404 not_found (unknown, or past its retention), 409 conflict (ended the other way; the broker no longer has
//! it), 403 forbidden (the token may not publish to its topic)
//! ```
//!
//! A token that may publish to a topic may end that topic's transactions. A repeated end is answered as the
//! first. The broker's check-backs of a transaction whose producer named a `producerGroup` go to that group's
//! checker URL ([`super::checker`]).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::events::parse_body;
use super::guard::read_body;
use super::{ApiError, AppState};
use crate::auth::Caller;
use crate::gateway::below::{mark_half, Ended, RecordState, Resolution, TransactionError, TransactionRecord};
use crate::gateway::{self, EndOutcome, EndRequest, GatewayError};
use crate::publish::limits::WithinLimits;
use crate::publish::request::Transactional;
use crate::publish::SendMode;

/// Makes `message` a half message, after checking that it can be one: a synchronous send (its answer carries
/// the transaction id) and a checker that is configured. The gateway checks the topic's type as it publishes.
///
/// # Errors
/// 400 naming the field at fault.
pub fn prepare_half(
    state: &AppState,
    mode: SendMode,
    transactional: &Transactional,
    message: &mut WithinLimits,
) -> Result<(), ApiError> {
    if mode != SendMode::Sync {
        return Err(ApiError::invalid_field(
            "mode",
            "a transactional publish is sync: its answer names the transaction",
        ));
    }
    let checker = transactional.producer_group.as_deref();
    if let Some(group) = checker.filter(|g| !state.config.transactions.checkers.contains_key(*g)) {
        return Err(ApiError::invalid_field(
            "producerGroup",
            format!("no checker is configured for producer group `{group}` (transactions.checkers)"),
        ));
    }
    message.amend(|message| mark_half(message, state.transactions.producer_group(), checker));
    Ok(())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EndBody {
    resolution: String,
}

/// `POST /events/transactions/{id}`: commits or rolls back the transaction.
pub async fn end(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = read_body(body)?;
    let request: EndBody = parse_body(&body)?;
    let resolution = match request.resolution.as_str() {
        "commit" => Resolution::Commit,
        "rollback" => Resolution::Rollback,
        _ => return Err(ApiError::invalid_field("resolution", "must be commit or rollback")),
    };
    let recorded_topic = match known(&state, &caller, &id) {
        Ok(record) => Some(record.half.topic),
        // Another instance of the tier may have recorded it: the gateway asks them.
        Err(unknown) if unknown.status == StatusCode::NOT_FOUND && state.owners.is_some() => None,
        Err(refused) => return Err(refused),
    };
    let topic = recorded_topic.as_deref();
    let end = EndRequest { id: &id, topic, resolution: Some(resolution), from_check: false, answer_by: None };
    let ended = state.ending().end(&caller, end).await.map_err(|refused| match refused {
        // As for a transaction recorded here: the id is what the token may not end.
        GatewayError::MayNotPublish(_) => ApiError::forbidden("id", format!("this token {refused}")),
        other => ApiError::from(other),
    })?;
    let (status, word, topic) = match ended {
        Some(EndOutcome { ended: Ended::Landed, topic }) => (StatusCode::OK, "ended", topic),
        Some(EndOutcome { ended: Ended::Owed, topic }) => (StatusCode::ACCEPTED, "owed", topic),
        // Not decided: not a resolution HTTP takes.
        None => (StatusCode::ACCEPTED, "owed", recorded_topic.unwrap_or_default()),
    };
    let body = json!({"transactionId": id, "topic": topic, "resolution": resolution.as_str(), "state": word});
    Ok((status, Json(body)).into_response())
}

/// `GET /events/transactions/{id}`: how far the transaction's end has come.
pub async fn show(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let record = known(&state, &caller, &id)?;
    let mut body = json!({
        "transactionId": record.transaction_id,
        "topic": record.half.topic,
        "broker": record.half.broker_name,
        "sentAt": record.sent_ms,
        "expiresAt": record.expires_ms,
    });
    match record.state {
        RecordState::Open => body["state"] = json!("open"),
        RecordState::Owed { resolution, attempts, .. } => {
            body["state"] = json!("owed");
            body["resolution"] = json!(resolution.as_str());
            body["failedTries"] = json!(attempts + 1);
        }
        RecordState::Ended { resolution, at_ms } => {
            body["state"] = json!("ended");
            body["resolution"] = json!(resolution.as_str());
            body["endedAt"] = json!(at_ms);
        }
    }
    Ok(Json(body))
}

/// The record of transaction `id`, if the caller may publish to its topic.
fn known(state: &AppState, caller: &Caller, id: &str) -> Result<TransactionRecord, ApiError> {
    let record = state
        .transactions
        .lookup(id)
        .map_err(|e| ApiError::unavailable(format!("state store unavailable: {e}"), json!({})))?
        .ok_or_else(|| ApiError::from(GatewayError::from(TransactionError::Unknown(id.to_owned()))))?;
    gateway::may_publish(caller, &record.half.topic)
        .map_err(|refused| ApiError::forbidden("id", format!("this token {refused}")))?;
    Ok(record)
}
