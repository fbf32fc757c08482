//! `EndTransaction`, onto the transaction layer: a COMMIT or ROLLBACK of a half message popgate recorded when
//! it was sent. The record is durable, so the end works after a popgate restart (Apache's proxy forgets it
//! after 30 s or a restart: "cannot found transaction data"). When the broker cannot be reached the answer is
//! still OK: the resolution is stored and popgate delivers it to the broker as soon as it can.

use super::names;
use super::proto::{self as pb, Code, TransactionResolution, TransactionSource};
use super::service::Front;
use super::status::{bad, ok, refused, status};
use crate::auth::Caller;
use crate::gateway::below::{Resolution, TransactionError};
use crate::gateway::{self, EndRequest};

/// The words Apache's proxy answers an end it has no transaction data for with (a `ProxyException`).
const NOT_FOUND: &str = "org.apache.rocketmq.proxy.common.ProxyException: cannot found transaction data";

pub(super) async fn end_transaction(
    front: &Front,
    caller: &Caller,
    request: pb::EndTransactionRequest,
    answer_by: Option<std::time::Instant>,
) -> pb::Status {
    let topic = match names::topic(request.topic.as_ref()) {
        Ok(topic) => topic,
        Err(refusal) => return refusal,
    };
    let id = request.transaction_id.trim();
    if id.is_empty() {
        if let Err(refusal) = gateway::may_publish(caller, &topic) {
            return refused(&refusal);
        }
        return bad(Code::InvalidTransactionId, "transaction id cannot be empty");
    }
    let resolution = match TransactionResolution::try_from(request.resolution) {
        Ok(TransactionResolution::Commit) => Some(Resolution::Commit),
        Ok(TransactionResolution::Rollback) => Some(Resolution::Rollback),
        // Apache's proxy answers OK and sends the broker a "not decided" it ignores; popgate leaves the
        // transaction as it is, for the broker's check-back to decide.
        _ => None,
    };
    let from_check = request.source == TransactionSource::SourceServerCheck as i32;
    let end = EndRequest { id, topic: Some(&topic), resolution, from_check, answer_by };
    match front.ending().end(caller, end).await {
        Ok(_) => ok(),
        Err(refusal) => refused(&refusal),
    }
}

/// The status of a refused end: Apache's code and words where Apache has them.
pub(super) fn transaction_status(error: &TransactionError) -> pb::Status {
    match error {
        TransactionError::Unknown(_) => status(Code::InternalServerError, NOT_FOUND),
        TransactionError::AlreadyEnded { .. } => status(Code::InternalServerError, format!("{NOT_FOUND}: {error}")),
        TransactionError::Busy(_) => status(Code::TooManyRequests, error.to_string()),
        TransactionError::Refused { .. } | TransactionError::Store(_) => {
            status(Code::InternalServerError, error.to_string())
        }
    }
}
