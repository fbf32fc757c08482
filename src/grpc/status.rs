//! RocketMQ's own status codes: every answer carries one in its body, and the gRPC status stays OK (what the
//! SDKs expect from Apache's proxy).

use super::proto::{Code, Status};
use crate::gateway::GatewayError;

/// A body status with `code` and a message for the app's logs.
pub fn status(code: Code, message: impl Into<String>) -> Status {
    Status { code: code as i32, message: message.into() }
}

/// The gRPC front's one mapping of a gateway refusal (the gateway counted it).
pub fn refused(error: &GatewayError) -> Status {
    match error {
        GatewayError::MayNotConsume(_)
        | GatewayError::MayNotRead(_)
        | GatewayError::MayNotPublish(_)
        | GatewayError::MayNotAdminister => status(Code::Forbidden, error.to_string()),
    }
}

/// `OK`.
pub fn ok() -> Status {
    status(Code::Ok, "OK")
}

/// The whole request's status from its entries': theirs when they agree, `MULTIPLE_RESULTS` when not.
pub fn overall(entries: &[Status]) -> Status {
    match entries.first() {
        None => ok(),
        Some(first) if entries.iter().all(|s| s.code == first.code) => first.clone(),
        Some(_) => status(Code::MultipleResults, "entries differ; see each entry's status"),
    }
}

/// The name of a code for metrics labels (`OK`, `TOPIC_NOT_FOUND`, …).
pub fn code_label(code: i32) -> &'static str {
    Code::try_from(code).map(|c| c.as_str_name()).unwrap_or("UNKNOWN")
}
