//! `EndTransaction`, onto the transaction layer: a COMMIT or ROLLBACK of a half message popgate recorded when
//! it was sent. The record is durable, so the end works after a popgate restart (Apache's proxy forgets it
//! after 30 s or a restart: "cannot found transaction data"). When the broker cannot be reached the answer is
//! still OK: the resolution is stored and popgate delivers it to the broker as soon as it can.

use super::names;
use super::proto::{self as pb, Code, TransactionResolution, TransactionSource};
use super::service::Front;
use super::status::{ok, status};
use crate::auth::Caller;
use crate::gateway;
use crate::transaction::{Resolution, TransactionError};

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
    if let Err(refusal) = gateway::may_publish(caller, &topic) {
        return super::status::refused(&refusal);
    }
    let id = request.transaction_id.trim();
    if id.is_empty() {
        return status(Code::InvalidTransactionId, "transaction id cannot be empty");
    }
    let from_check = request.source == TransactionSource::SourceServerCheck as i32;
    let resolution = match TransactionResolution::try_from(request.resolution) {
        Ok(TransactionResolution::Commit) => Resolution::Commit,
        Ok(TransactionResolution::Rollback) => Resolution::Rollback,
        // Apache's proxy answers OK and sends the broker a "not decided" it ignores; popgate leaves the
        // transaction as it is, for the broker's check-back to decide.
        _ => {
            count_check_answer(from_check, "unknown");
            return ok();
        }
    };
    count_check_answer(from_check, resolution.as_str());
    match front.transactions.end(&topic, id, resolution, from_check, answer_by).await {
        Ok(_) => ok(),
        Err(error) => refusal(&error),
    }
}

/// Counts a producer's answer to a check-back this front forwarded.
fn count_check_answer(from_check: bool, answer: &'static str) {
    if from_check {
        metrics::counter!(crate::metrics::TRANSACTION_CHECK_ANSWERS, "front" => "grpc", "answer" => answer)
            .increment(1);
    }
}

/// The status of a refused end: Apache's code and words where Apache has them.
fn refusal(error: &TransactionError) -> pb::Status {
    match error {
        TransactionError::Unknown(_) => status(Code::InternalServerError, NOT_FOUND),
        TransactionError::AlreadyEnded { .. } => status(Code::InternalServerError, format!("{NOT_FOUND}: {error}")),
        TransactionError::Busy(_) => status(Code::TooManyRequests, error.to_string()),
        TransactionError::Refused { .. } | TransactionError::Store(_) => {
            status(Code::InternalServerError, error.to_string())
        }
    }
}
