//! Every metric popgate exports: its name, help text, unit and histogram buckets live here, and nowhere else.
//!
//! Names follow `popgate_<thing>_<unit>` with `_total` on counters; label values come from small fixed sets
//! (`result`, `reason`, `cause`, broker names), never event ids or free-form text. Call sites use the name
//! constants with the `metrics` macros; [`install`] sets up the Prometheus recorder that `GET /metrics` renders.

use std::sync::OnceLock;

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Publish requests by outcome (`result`: ok, accepted, bad_request, too_large, not_found, unavailable).
pub const PUBLISH_REQUESTS: &str = "popgate_publish_requests_total";
/// Send attempts by broker name: every try, first ones and retries.
pub const SEND_ATTEMPTS: &str = "popgate_send_attempts_total";
/// Send attempts that were retries after a failed attempt.
pub const SEND_RETRIES: &str = "popgate_send_retries_total";
/// Failed send attempts by `reason` (timeout, network, broker_error, not_stored, no_route).
pub const SEND_FAILURES: &str = "popgate_send_failures_total";
/// 1 while the fault-avoidance table isolates the broker, else 0.
pub const BROKER_ISOLATED: &str = "popgate_broker_isolated";
/// Isolations started, by broker and `cause` (latency, unreachable).
pub const BROKER_ISOLATIONS: &str = "popgate_broker_isolations_total";
/// Time from a publish request's arrival to its answer.
pub const PUBLISH_DURATION: &str = "popgate_publish_duration_seconds";

/// Buckets for [`PUBLISH_DURATION`]: from a fast local send (1 ms) to three full 3 s timeouts plus slack.
pub const PUBLISH_DURATION_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Installs the process-wide Prometheus recorder (once) and describes every metric.
///
/// # Errors
/// When another recorder was installed first (a programming error outside tests).
pub fn install() -> Result<PrometheusHandle, String> {
    static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(PUBLISH_DURATION.to_owned()), PUBLISH_DURATION_BUCKETS)
                .map_err(|e| e.to_string())?
                .install_recorder()
                .map_err(|e| e.to_string())?;
            describe_all();
            Ok(handle)
        })
        .clone()
}

fn describe_all() {
    describe_counter!(PUBLISH_REQUESTS, Unit::Count, "Publish requests answered, by result.");
    describe_counter!(SEND_ATTEMPTS, Unit::Count, "Send attempts to the broker, by broker name.");
    describe_counter!(SEND_RETRIES, Unit::Count, "Send attempts that retried a failed attempt.");
    describe_counter!(SEND_FAILURES, Unit::Count, "Failed send attempts, by reason.");
    describe_gauge!(BROKER_ISOLATED, "1 while fault avoidance isolates the broker, else 0.");
    describe_counter!(BROKER_ISOLATIONS, Unit::Count, "Broker isolations started, by broker and cause.");
    describe_histogram!(PUBLISH_DURATION, Unit::Seconds, "Publish request duration, arrival to answer.");
}
