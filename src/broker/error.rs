//! [`BrokerError`]: why a broker operation failed, in the terms popgate's policies need (retry on another
//! broker, isolate the broker, refuse the message). Its own room because every file of `broker` returns it
//! and every front maps it.

use std::time::Duration;

use rocketmq_client_rust::ClientError;
use rocketmq_error::CanonicalCondition;

/// Why a broker operation failed, in the terms popgate's policies need.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BrokerError {
    /// No answer within the timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The connection could not be made or broke.
    #[error("broker unreachable: {0}")]
    Unreachable(String),
    /// The broker answered with an error code (`ResponseCode`).
    #[error("broker answered code {code}: {detail}")]
    Response {
        /// The remoting response code.
        code: i32,
        /// What the client reported.
        detail: String,
    },
    /// Neither the topic nor the auto-create key topic has a route: the topic does not exist.
    #[error("topic `{0}` does not exist")]
    TopicNotFound(String),
    /// A failure inside the client (bad argument, not started).
    #[error("client error: {0}")]
    Client(String),
}

/// Response codes after which the Java producer retries on another broker (`retryResponseCodes`).
const RETRIABLE_CODES: [i32; 7] = [17, 1, 2, 14, 16, 204, 205];

/// Response codes in which a broker says it cannot serve now, whatever the message: `SYSTEM_BUSY` (2) and
/// `SERVICE_NOT_AVAILABLE` (14: a slave, a full disk, shutting down).
const BROKER_UNWELL_CODES: [i32; 2] = [2, 14];

impl BrokerError {
    /// A low-cardinality label for metrics (`reason`).
    pub fn reason_label(&self) -> &'static str {
        match self {
            BrokerError::Timeout(_) => "timeout",
            BrokerError::Unreachable(_) => "network",
            BrokerError::Response { .. } => "broker_error",
            BrokerError::TopicNotFound(_) => "no_route",
            BrokerError::Client(_) => "client",
        }
    }

    /// Whether another attempt (on another broker) may succeed: network trouble and the broker codes the
    /// Java producer retries on. Such a failure also isolates the broker in the fault table.
    pub fn is_retriable(&self) -> bool {
        match self {
            BrokerError::Timeout(_) | BrokerError::Unreachable(_) => true,
            BrokerError::Response { code, .. } => RETRIABLE_CODES.contains(code),
            BrokerError::TopicNotFound(_) | BrokerError::Client(_) => false,
        }
    }

    /// Whether the failure is the broker's own: it could not be reached, did not answer in time, or answered that
    /// it is too busy or not serving now. Fault avoidance isolates a broker for these only. A broker that
    /// answered a refusal of the message is well: popgate's fault table is shared by every tenant, and one
    /// tenant's bad message must not steer everybody's sends away from a broker (Apache's producer, too, isolates
    /// a broker for a transport failure, not for a `MQBrokerException`).
    pub fn is_brokers_own_failure(&self) -> bool {
        match self {
            BrokerError::Timeout(_) | BrokerError::Unreachable(_) => true,
            BrokerError::Response { code, .. } => BROKER_UNWELL_CODES.contains(code),
            BrokerError::TopicNotFound(_) | BrokerError::Client(_) => false,
        }
    }

    /// The broker's response code, when the broker answered with one.
    pub fn response_code(&self) -> Option<i32> {
        match self {
            BrokerError::Response { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The failure a client-crate error stands for: a broker's answer code, a timeout, a broken connection.
    pub(crate) fn from_client(error: ClientError, timeout: Duration) -> BrokerError {
        if let Some(code) = error.broker_response_code() {
            return BrokerError::Response { code, detail: error.to_string() };
        }
        match error.descriptor().condition() {
            CanonicalCondition::DeadlineExceeded => BrokerError::Timeout(timeout),
            CanonicalCondition::Unavailable => BrokerError::Unreachable(error.to_string()),
            _ => BrokerError::Client(error.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_brokers_own_failures_isolate_it_and_a_refused_message_is_retried_without() {
        let answered = |code| BrokerError::Response { code, detail: String::new() };
        for own in [BrokerError::Timeout(Duration::from_secs(3)), BrokerError::Unreachable("reset".into()), answered(2)]
        {
            assert!(own.is_brokers_own_failure(), "{own}");
        }
        // SYSTEM_ERROR (an empty body's NullPointerException), TOPIC_NOT_EXIST, NO_PERMISSION: the message's.
        for refusal in [answered(1), answered(17), answered(16), answered(13)] {
            assert!(!refusal.is_brokers_own_failure(), "{refusal}");
        }
        assert!(answered(1).is_retriable(), "still retried on another broker, as Apache's producer retries it");
    }
}
