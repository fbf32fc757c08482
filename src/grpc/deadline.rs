//! The client's deadline: every gRPC call carries it (`grpc-timeout`), and an answer after it is lost.
//!
//! A long poll takes its length from it the way Apache's proxy does (`ReceiveMessageActivity`): the
//! `long_polling_timeout` the request asks for, or else (Java SDK 5.0.x sends none, and makes its deadline
//! request timeout + await duration) the time left less half the client's request timeout, clamped to
//! 5 s ..= 20 s, and never past the deadline. A send stops retrying on other brokers when the deadline is
//! near, so its answer (stored, or the last failure) reaches the client before it gives up.

use std::time::{Duration, Instant};

use tonic::metadata::MetadataMap;

use super::proto::{self as pb, Code};
use super::status::status;

/// The shortest long poll (Apache's `grpcClientConsumerMinLongPollingTimeoutMillis`).
pub(super) const MIN_LONG_POLL: Duration = Duration::from_secs(5);
/// The longest long poll (Apache's `grpcClientConsumerMaxLongPollingTimeoutMillis`); also the length of one
/// whose client sets no deadline and asks for none.
pub(super) const MAX_LONG_POLL: Duration = Duration::from_secs(20);
/// What is kept back from the time left, so an answer written at the end of a wait still arrives in time.
pub(super) const ANSWER_RESERVE: Duration = Duration::from_millis(100);
/// The request timeout of a client whose Settings did not say (the Java SDK's default).
pub(super) const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// The first Java SDK version that understands `ILLEGAL_POLLING_TIME`; older ones are answered `BAD_REQUEST`
/// (Apache's `ILLEGAL_POLLING_TIME_INTRODUCED_CLIENT_VERSION`).
const ILLEGAL_POLLING_TIME_SINCE: &str = "5.0.3";

/// The time left before the client's deadline, from the `grpc-timeout` header (`<digits><unit>`, the unit one
/// of `H M S m u n`); `None` when the call has none (or an unreadable one: the call then simply has no deadline).
pub(super) fn time_left(metadata: &MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    // The gRPC spec allows at most 8 digits.
    let amount: u64 = digits.parse().ok().filter(|_| (1..=8).contains(&digits.len()))?;
    Some(match unit {
        "H" => Duration::from_secs(amount.saturating_mul(3600)),
        "M" => Duration::from_secs(amount.saturating_mul(60)),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// When an answer must be written to arrive before the client's deadline, if the call has one.
pub(super) fn answer_by(metadata: &MetadataMap) -> Option<Instant> {
    time_left(metadata).map(|left| Instant::now() + left.saturating_sub(ANSWER_RESERVE))
}

/// How long a receive may wait for messages, or the status refusing it when the deadline leaves too little.
///
/// `asked` is the request's `long_polling_timeout`, `left` the time before the deadline, `request_timeout`
/// the client's (from its Settings), `client_version` its `x-mq-client-version`.
pub(super) fn long_poll(
    asked: Option<Duration>,
    left: Option<Duration>,
    request_timeout: Duration,
    client_version: Option<&str>,
) -> Result<Duration, pb::Status> {
    let Some(left) = left else {
        return Ok(asked.unwrap_or(MAX_LONG_POLL).clamp(MIN_LONG_POLL, MAX_LONG_POLL));
    };
    let wanted = asked.unwrap_or_else(|| left.saturating_sub(request_timeout / 2));
    let wait = wanted.clamp(MIN_LONG_POLL, MAX_LONG_POLL);
    if wait <= left.saturating_sub(ANSWER_RESERVE) {
        return Ok(wait);
    }
    if left >= MIN_LONG_POLL {
        return Ok(left.saturating_sub(ANSWER_RESERVE));
    }
    let code = match client_version {
        Some(version) if version >= ILLEGAL_POLLING_TIME_SINCE => Code::IllegalPollingTime,
        _ => Code::BadRequest,
    };
    Err(status(code, "The deadline time remaining is not enough for polling, please check network condition"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(value: &str) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        metadata.insert("grpc-timeout", value.parse().expect("ascii"));
        metadata
    }

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn grpc_timeout_headers_are_read_in_every_unit_and_bad_ones_mean_no_deadline() {
        assert_eq!(time_left(&header("20S")), Some(20 * SECOND));
        assert_eq!(time_left(&header("19998m")), Some(Duration::from_millis(19_998)));
        assert_eq!(time_left(&header("2M")), Some(120 * SECOND));
        assert_eq!(time_left(&header("1H")), Some(3600 * SECOND));
        assert_eq!(time_left(&header("1500000u")), Some(Duration::from_millis(1_500)));
        assert_eq!(time_left(&header("7n")), Some(Duration::from_nanos(7)));
        for bad in ["", "S", "20", "20s", "-1S", "123456789S", "1.5S"] {
            assert_eq!(time_left(&header(bad)), None, "{bad:?}");
        }
        assert_eq!(time_left(&MetadataMap::new()), None);
    }

    #[test]
    fn without_a_long_polling_timeout_the_wait_is_the_time_left_less_half_the_request_timeout() {
        // Java SDK 5.0.x: deadline = request timeout + await duration, no long_polling_timeout.
        let wait = long_poll(None, Some(20 * SECOND), 10 * SECOND, Some("5.0.3"));
        assert_eq!(wait.ok(), Some(15 * SECOND));
        let wait = long_poll(None, Some(33 * SECOND), 3 * SECOND, Some("5.0.3"));
        assert_eq!(wait.ok(), Some(MAX_LONG_POLL), "at most 20 s");
        let wait = long_poll(None, Some(7 * SECOND), 6 * SECOND, Some("5.0.3"));
        assert_eq!(wait.ok(), Some(MIN_LONG_POLL), "at least 5 s while the deadline allows it");
    }

    #[test]
    fn an_asked_long_poll_is_clamped_and_never_outlasts_the_deadline() {
        let wait = long_poll(Some(15 * SECOND), Some(18 * SECOND), 3 * SECOND, Some("5.2.0"));
        assert_eq!(wait.ok(), Some(15 * SECOND));
        let wait = long_poll(Some(60 * SECOND), Some(90 * SECOND), 3 * SECOND, Some("5.2.0"));
        assert_eq!(wait.ok(), Some(MAX_LONG_POLL));
        let wait = long_poll(Some(SECOND), Some(90 * SECOND), 3 * SECOND, Some("5.2.0"));
        assert_eq!(wait.ok(), Some(MIN_LONG_POLL));
        let wait = long_poll(Some(15 * SECOND), Some(8 * SECOND), 3 * SECOND, Some("5.2.0"));
        assert_eq!(wait.ok(), Some(8 * SECOND - ANSWER_RESERVE), "the deadline wins");
    }

    #[test]
    fn no_deadline_means_the_asked_or_the_longest_wait() {
        assert_eq!(long_poll(None, None, 3 * SECOND, None).ok(), Some(MAX_LONG_POLL));
        assert_eq!(long_poll(Some(8 * SECOND), None, 3 * SECOND, None).ok(), Some(8 * SECOND));
    }

    #[test]
    fn too_little_time_left_is_refused_with_the_code_the_client_version_knows() {
        let refused = long_poll(None, Some(4 * SECOND), 3 * SECOND, Some("5.0.3")).expect_err("too short");
        assert_eq!(refused.code, Code::IllegalPollingTime as i32);
        assert!(refused.message.starts_with("The deadline time remaining is not enough"), "{}", refused.message);
        let older = long_poll(None, Some(4 * SECOND), 3 * SECOND, Some("5.0.2")).expect_err("too short");
        assert_eq!(older.code, Code::BadRequest as i32);
        let unknown = long_poll(None, Some(4 * SECOND), 3 * SECOND, None).expect_err("too short");
        assert_eq!(unknown.code, Code::BadRequest as i32);
    }
}
