//! RocketMQ's own status codes: every answer carries one in its body, and the gRPC status stays OK (what the
//! SDKs expect from Apache's proxy).

use metrics::counter;
use tonic::codegen::http;

use super::proto::{Code, Status};
use crate::gateway::below::DeliveryError;
use crate::gateway::GatewayError;
use crate::metrics as m;

/// gRPC's `OUT_OF_RANGE` and `RESOURCE_EXHAUSTED`, as `grpc-status` values.
const OUT_OF_RANGE: &str = "11";
const RESOURCE_EXHAUSTED: &str = "8";

/// A request message over the front's decoding limit is refused by tonic, from its length prefix, with
/// `OUT_OF_RANGE`, a code no other gRPC server gives it: grpc-go and gRPC's C core answer `RESOURCE_EXHAUSTED`,
/// and grpc-java, under Apache's proxy, means that code ("gRPC message exceeds maximum size") but (5.4.0, seen
/// with `curl`) resets the stream (`CANCEL`) without a status, which its client sees as `CANCELLED`. popgate
/// answers no `OUT_OF_RANGE` of its own (its refusals are RocketMQ codes in the body), so an answer `headers`
/// says carries one is that refusal: it is given `RESOURCE_EXHAUSTED`, with tonic's words (the sizes), and
/// counted.
pub(super) fn oversize_as_resource_exhausted(headers: &mut http::HeaderMap) {
    if headers.get("grpc-status").is_some_and(|code| code == OUT_OF_RANGE) {
        headers.insert("grpc-status", http::HeaderValue::from_static(RESOURCE_EXHAUSTED));
        counter!(m::REQUESTS_REJECTED, "reason" => "body_too_large").increment(1);
    }
}

/// A body status with `code` and a message for the app's logs.
pub fn status(code: Code, message: impl Into<String>) -> Status {
    Status { code: code as i32, message: message.into() }
}

/// A request the front refuses as it decodes it: a field missing, malformed, or outside what the protocol
/// allows (Apache's proxy's checks, codes and words). Every decoding refusal of the front is made here, so they
/// are found, and changed, in one place; like every answer it is RocketMQ's `code` in the body, the gRPC status
/// staying OK.
pub(super) fn bad(code: Code, message: impl Into<String>) -> Status {
    status(code, message)
}

/// The gRPC front's one mapping of the gateway's errors (the gateway counted its refusals), in Apache's
/// proxy's codes and, where an app may match on them, its words. What the caller's ACL does not allow is
/// `UNAUTHORIZED`, as Apache's proxy (5.3+, ACL 2.0) answers an `AuthorizationException`; a client id of
/// another token (popgate's own rule) is `FORBIDDEN`.
pub fn refused(error: &GatewayError) -> Status {
    match error {
        GatewayError::MayNotConsume(_)
        | GatewayError::MayNotRead(_)
        | GatewayError::MayNotRoute(_)
        | GatewayError::MayNotPublish(_)
        | GatewayError::MayNotAdminister => status(Code::Unauthorized, error.to_string()),
        GatewayError::ClientIdTaken(_) | GatewayError::ProducerGroupTaken(_) => {
            status(Code::Forbidden, error.to_string())
        }
        GatewayError::TooManyClients { .. } => status(Code::TooManyRequests, error.to_string()),
        GatewayError::TopicNotFound(_) => status(Code::TopicNotFound, error.to_string()),
        // Apache's proxy's words (`SendMessageActivity.validateMessageBodySize`).
        GatewayError::MessageTooLarge { max } => {
            status(Code::MessageBodyTooLarge, format!("message body cannot exceed the max {max}"))
        }
        // The gRPC protocol has no one-way send; kept for completeness of the one mapping.
        GatewayError::OneWayUnconfirmed => status(Code::BadRequest, error.to_string()),
        GatewayError::TakesNoTransactions { topic_type, .. } => status(
            Code::MessagePropertyConflictWithType,
            format!(
                "org.apache.rocketmq.proxy.common.ProxyException: TopicMessageType validate failed, the expected type is {topic_type}, but actual type is TRANSACTION"
            ),
        ),
        GatewayError::NotStored { .. } | GatewayError::Unavailable(_) | GatewayError::AckUnconfirmed(_) => {
            status(Code::InternalServerError, error.to_string())
        }
        GatewayError::MayNotSettle { refusal, .. } => status(Code::Unauthorized, refusal.to_string()),
        GatewayError::HandleOfAnotherGroup { .. } => status(Code::InvalidReceiptHandle, error.to_string()),
        GatewayError::Delivery(refusal) => delivery_status(refusal),
        GatewayError::Transaction(refusal) => super::transaction::transaction_status(refusal),
    }
}

/// The SDK's status for a delivery-core refusal. `INVALID_RECEIPT_HANDLE` tells a PushConsumer to stop
/// retrying its ACK; the others it retries every second.
pub fn delivery_status(error: &DeliveryError) -> Status {
    let code = match error {
        // Apache's proxy says "receipt handle is expired" for every handle its holder may no longer settle.
        DeliveryError::Unknown | DeliveryError::Stale | DeliveryError::NotInFlight | DeliveryError::Superseded => {
            return status(Code::InvalidReceiptHandle, format!("receipt handle is expired: {error}"));
        }
        DeliveryError::Busy => Code::TooManyRequests,
        DeliveryError::Store(_) => Code::InternalServerError,
        DeliveryError::Invalid("filter", _) => Code::IllegalFilterExpression,
        DeliveryError::Invalid(..) => Code::BadRequest,
    };
    status(code, error.to_string())
}

/// `OK`.
pub fn ok() -> Status {
    status(Code::Ok, "OK")
}

/// A response's status from its entries', as Apache's proxy makes it (`AckMessageActivity.setAckResponseStatus`):
/// their code when they agree, `MULTIPLE_RESULTS` when not, and the code's name for words. The SDKs throw the
/// response's status, so an app sees `INVALID_RECEIPT_HANDLE` (and matches on it); each entry keeps its own
/// reason. Sends: [`overall_of_sends`].
///
/// A refusal of the caller (`UNAUTHORIZED`, `FORBIDDEN`) keeps its words: Apache's proxy refuses such a request
/// as a whole, before its entries, with the reason as the status message.
pub fn overall(entries: &[Status]) -> Status {
    let code = match entries.first() {
        None => return ok(),
        Some(first) if entries.iter().all(|s| s.code == first.code) => {
            if [Code::Unauthorized as i32, Code::Forbidden as i32].contains(&first.code) {
                return first.clone();
            }
            first.code
        }
        Some(_) => Code::MultipleResults as i32,
    };
    status_named(code)
}

/// A send's status from its entries': the entries' own when they agree. popgate sends one message at a time,
/// and what fails one (a limit, a scope, the topic, the broker) is what Apache's proxy answers as the whole
/// request's status, words included (an exception there, not an entry); `MULTIPLE_RESULTS` when they differ.
pub fn overall_of_sends(entries: &[Status]) -> Status {
    match entries.first() {
        Some(first) if entries.iter().all(|s| s.code == first.code) => first.clone(),
        _ => overall(entries),
    }
}

/// A status whose words are its code's name (`INVALID_RECEIPT_HANDLE`), as Apache's proxy words a response's.
fn status_named(code: i32) -> Status {
    Status { code, message: code_label(code).to_owned() }
}

/// The name of a code for metrics labels (`OK`, `TOPIC_NOT_FOUND`, …).
pub fn code_label(code: i32) -> &'static str {
    Code::try_from(code).map(|c| c.as_str_name()).unwrap_or("UNKNOWN")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_responses_status_is_worded_with_its_code_as_by_apaches_proxy() {
        let expired = status(Code::InvalidReceiptHandle, "receipt handle is expired: stale");
        assert_eq!(
            overall(std::slice::from_ref(&expired)),
            status(Code::InvalidReceiptHandle, "INVALID_RECEIPT_HANDLE")
        );
        assert_eq!(overall(&[expired.clone(), ok()]), status(Code::MultipleResults, "MULTIPLE_RESULTS"));
        assert_eq!(overall(&[ok(), ok()]), ok());
        let forbidden = status(Code::Forbidden, "token `app` may not consume as group `g`");
        assert_eq!(overall(std::slice::from_ref(&forbidden)), forbidden, "a refusal of the caller keeps its reason");
        assert_eq!(overall_of_sends(std::slice::from_ref(&expired)), expired, "a send's refusal keeps its words");
        assert_eq!(overall_of_sends(&[expired, ok()]).message, "MULTIPLE_RESULTS");
    }
}
