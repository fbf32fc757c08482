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
/// Sends accepted with a store status short of `SEND_OK` that the profile does not demand, by `status`.
pub const SEND_DEGRADED: &str = "popgate_send_degraded_total";
/// 1 while the fault-avoidance table isolates the broker, else 0.
pub const BROKER_ISOLATED: &str = "popgate_broker_isolated";
/// Isolations started, by broker and `cause` (latency, unreachable).
pub const BROKER_ISOLATIONS: &str = "popgate_broker_isolations_total";
/// Time of one send attempt, by broker.
pub const SEND_DURATION: &str = "popgate_send_duration_seconds";
/// Time from a publish request's arrival to its answer.
pub const PUBLISH_DURATION: &str = "popgate_publish_duration_seconds";

/// In-flight deliveries popgate holds (popped, not yet retired).
pub const PENDING_DELIVERIES: &str = "popgate_pending_deliveries";
/// Sends answered from the publish de-duplication window instead of being stored again.
pub const PUBLISH_DEDUPLICATED: &str = "popgate_publish_deduplicated_total";
/// De-duplication keys that could not be stored (remembered by this process only).
pub const PUBLISH_DEDUP_WRITE_FAILURES: &str = "popgate_publish_dedup_write_failures_total";
/// Deliveries handed to a subscriber, by `transport` (poll, sse, websocket, webhook).
pub const DELIVERIES_DISPATCHED: &str = "popgate_deliveries_dispatched_total";
/// Deliveries a push transport could not write to its subscriber, by `transport` (sse, websocket).
pub const PUSH_WRITE_FAILURES: &str = "popgate_push_write_failures_total";
/// Webhook deliveries refused before connecting because the target is not a permitted address, by `reason`
/// (`literal`: the URL's host is an address in a refused range; `dns`: the host name resolved only to such
/// addresses). Each is a failed attempt.
pub const WEBHOOK_TARGETS_REFUSED: &str = "popgate_webhook_targets_refused_total";
/// Event `ce_*` properties not sent as webhook headers, by `reason` (name, reserved, value, limit).
pub const WEBHOOK_HEADERS_SKIPPED: &str = "popgate_webhook_headers_skipped_total";
/// Push subscribers connected now, by `transport`.
pub const PUSH_SUBSCRIBERS: &str = "popgate_push_subscribers";
/// Subscriber ACKs by `result` (acked, unknown, stale, store_error).
pub const ACKS: &str = "popgate_acks_total";
/// Redeliveries scheduled, by `reason` (timeout, nack, push_failure, recovery).
pub const REDELIVERIES: &str = "popgate_redeliveries_total";
/// Events written to `%DLQ%<group>` (then ACKed at the broker), by `group`.
pub const DLQ_MESSAGES: &str = "popgate_dlq_messages_total";
/// Failed attempts to write an event to the DLQ (retried; the delivery stays in flight).
pub const DLQ_RECORD_FAILURES: &str = "popgate_dlq_record_failures_total";
/// Successful broker ACKs; each follows a stored subscriber ACK or a DLQ write (the chaos checker compares).
pub const BROKER_ACKS: &str = "popgate_broker_acks_total";
/// ACK requests sent to brokers, by `kind`: single (one message) or batch (`BATCH_ACK_MESSAGE`, many).
pub const BROKER_ACK_REQUESTS: &str = "popgate_broker_ack_requests_total";
/// Failed broker ACKs (retried from the stored ACK intent).
pub const BROKER_ACK_FAILURES: &str = "popgate_broker_ack_failures_total";
/// State-store writes that failed (disk full, I/O error): the seed's offsetWriteFailures.
pub const OFFSET_WRITE_FAILURES: &str = "popgate_offset_write_failures_total";
/// Records replayed at boot, by `outcome` (redispatched, lease_lapsed, ack_pending, dead_letter_pending, corrupt).
pub const RECOVERED_DELIVERIES: &str = "popgate_recovered_deliveries_total";
/// Deliveries whose broker lease lapsed or could not be renewed: popgate gave them up to the broker.
pub const LEASES_LOST: &str = "popgate_leases_lost_total";
/// Counter: broker leases renewed (ChangeInvisibleTime) of held deliveries; with `delivery.lease_renewals_per_sec`
/// the broker requests that holding deliveries costs.
pub const LEASE_RENEWALS: &str = "popgate_lease_renewals_total";
/// Gauge: the broker lease (seconds) popgate asks for now, from what it holds: about how long the deliveries of
/// an instance lost now would take to come back through the broker.
pub const LEASE_ASKED: &str = "popgate_lease_asked_seconds";
/// Counter: POPs answered by a broker, by `result` (`messages`, `empty`: the POP waited out its wait).
pub const POPS: &str = "popgate_pops_total";
/// Gauge: how long a POP waits at the broker now, from how many wait (`delivery::pop_wait`).
pub const POP_WAIT: &str = "popgate_pop_wait_seconds";
/// Failed broker requests of the consume path, by `op` (pop, renew, give_back).
pub const CONSUME_REQUEST_FAILURES: &str = "popgate_consume_request_failures_total";
/// Counter: popped messages without a readable receipt handle (`POP_CK`); the broker redelivers them.
pub const POPPED_UNUSABLE: &str = "popgate_popped_unusable_total";
/// Counter (`reason`): messages handed back to the broker unACKed (`unsubscribed`, `not_admitted`).
pub const DELIVERIES_GIVEN_BACK: &str = "popgate_deliveries_given_back_total";
/// Counter (`family`): stored records that no longer decode, found outside boot recovery.
pub const STORE_UNDECODABLE: &str = "popgate_store_undecodable_records_total";
/// Receives whose filter differed from their subscription's but were not allowed to change it (changed too
/// recently: consumers of one group with different filters).
pub const SUBSCRIPTION_FILTER_CONFLICTS: &str = "popgate_subscription_filter_conflicts_total";
/// Implicit subscriptions (made by a receive) removed after being idle.
pub const SUBSCRIPTIONS_EXPIRED: &str = "popgate_subscriptions_expired_total";
/// Histogram: callers' writes committed together by one state-store group commit (one batch, one sync).
pub const STORE_GROUP_COMMIT_WRITES: &str = "popgate_store_group_commit_writes";
/// Histogram: how long one state-store group commit took (the write, its sync, a requested WAL sync).
pub const STORE_COMMIT_DURATION: &str = "popgate_store_commit_duration_seconds";
/// Counter (`rpc`, `code`): gRPC calls answered, by RPC and RocketMQ status code.
pub const GRPC_REQUESTS: &str = "popgate_grpc_requests_total";
/// Histogram (`rpc`): how long a gRPC call took to answer.
pub const GRPC_REQUEST_DURATION: &str = "popgate_grpc_request_duration_seconds";
/// Deliveries a gRPC receive handed out whose response its client did not take in (the stream broke, or the
/// client stopped reading before their deadline): never renewed, they come back at their deadline.
pub const GRPC_UNWRITTEN_DELIVERIES: &str = "popgate_grpc_unwritten_deliveries_total";
/// Counter (`resolution`, `result`): transaction ends, by resolution (commit, rollback) and result (landed:
/// the broker has it; refused: the broker no longer has the half message).
pub const TRANSACTIONS_ENDED: &str = "popgate_transactions_ended_total";
/// Counter (`outcome`): the brokers' transaction check-backs: forwarded to a producer, answered from popgate's
/// record (its end was known), or dropped with no producer to ask (no_producer).
pub const TRANSACTION_CHECKS: &str = "popgate_transaction_checks_total";
/// Counter (`result`: ok, failed): reads of the cluster's ACL 2.0 users and ACLs (`auth.cluster_acl`).
pub const CLUSTER_ACL_READS: &str = "popgate_cluster_acl_reads_total";
/// Counter (`front`, `answer`): producers' answers to forwarded check-backs: commit, rollback, unknown, or
/// failed (an HTTP checker that did not answer, or answered something else).
pub const TRANSACTION_CHECK_ANSWERS: &str = "popgate_transaction_check_answers_total";
/// Counter (`action`, `result`): settlements of deliveries another instance of the tier handed out, asked of
/// that instance (`result`: ok, refused, unreachable).
pub const TIER_FORWARDED: &str = "popgate_tier_settlements_forwarded_total";
/// Counter (`action`, `result`): settlements another instance of the tier asked of this one, transaction ends
/// (`action` end) and peer look-ups refused (`action` identify; `unknown`: a settlement naming no action)
/// (`result`: ok, refused, not_here, unauthenticated, replayed, busy).
pub const TIER_SERVED: &str = "popgate_tier_settlements_served_total";
/// Counter (`action`, `result`): settlements of deliveries whose owner could not be reached, made at the
/// broker with the lease the handle carries (`action`: ack, nack; `result`: ok, stale, busy).
pub const TIER_SETTLED_AT_BROKER: &str = "popgate_tier_settled_at_broker_total";
/// Counter (`result`): ACKs another instance made at the broker while this one could not be reached, learned
/// from it afterwards (`result`: acked, or why the delivery could not take it: unknown, superseded, …).
pub const TIER_ACKS_LEARNED: &str = "popgate_tier_acks_learned_total";
/// Counter: such ACKs dropped before their owner learned of them (more were owed than a peer keeps).
pub const TIER_ACKS_UNTOLD: &str = "popgate_tier_acks_untold_total";
/// Counter (`way`, `result`): changes of the tier's shared subscriptions, `way` = sent (to each peer: ok,
/// unreachable; dropped: the queue to the peer link was full) or received (taken, older, refused).
pub const TIER_SUBSCRIPTION_CHANGES: &str = "popgate_tier_subscription_changes_total";
/// Counter (`way`, `result`): renewed broker leases of held deliveries, `way` = sent (to each peer: ok,
/// unreachable; dropped: the queue to the peer link was full) or received (kept, refused: not sealed by the tier).
pub const TIER_LEASES_TOLD: &str = "popgate_tier_leases_told_total";
/// Gauge: the other instances of the tier this one knows an address of.
pub const TIER_PEERS: &str = "popgate_tier_peers";
/// Counter (`reason`): connections to a TLS peer link closed before they were served: `plaintext` (no TLS
/// handshake), `no_certificate`, `bad_certificate` (not of the tier's CA, expired, not for a client), `timeout`,
/// `handshake` (any other failed handshake). The client fronts' failed handshakes are [`TLS_HANDSHAKE_FAILURES`].
pub const TIER_CONNECTIONS_REFUSED: &str = "popgate_tier_connections_refused_total";
/// Gauge: transaction resolutions the broker could not be given yet (retried until it has them).
pub const TRANSACTIONS_OWED: &str = "popgate_transactions_owed";
/// Counter (`code`, `result`): remoting requests answered, by request code (RocketMQ's name in lower case, or
/// `other`) and result (`ok`, or the response code's name).
pub const REMOTING_REQUESTS: &str = "popgate_remoting_requests_total";
/// Counter (`code`, `result`): remoting requests relayed to a broker, by request code and result (`ok`: the
/// broker answered, whatever it said; `refused`; `unreachable`).
pub const REMOTING_RELAYS: &str = "popgate_remoting_relays_total";
/// Counter (`result`: `ok`, `failed`, `coalesced`): remoting consumers' registrations passed on to a broker again
/// because one of their pulls found the broker without their group's subscription (popgate's connection to it
/// closed); `coalesced`: a refused pull that took the outcome of its group's re-registration made just before.
pub const REMOTING_REREGISTRATIONS: &str = "popgate_remoting_reregistrations_total";
/// Counter (`source`: `cache`, `name_server`, `stale`): remoting route requests (`GET_ROUTEINFO_BY_TOPIC`)
/// answered, by where the answer came from (`stale`: a cached route, because the name server could not be asked).
pub const REMOTING_ROUTE_ANSWERS: &str = "popgate_remoting_route_answers_total";
/// Gauge (`kind`): remoting clients with a live heartbeat (producer, push_consumer, pull_consumer).
pub const REMOTING_CLIENTS: &str = "popgate_remoting_clients";
/// Gauge: remoting connections open now.
pub const REMOTING_CONNECTIONS: &str = "popgate_remoting_connections";
/// Counter: remoting connections closed at once because `remoting.max_connections` were open.
pub const REMOTING_CONNECTIONS_REFUSED: &str = "popgate_remoting_connections_refused_total";
/// Counter (`reason`): remoting frames that cannot be read: the connection closed on one over the limit
/// (`oversize`), one that does not decode (`undecodable`), or cut off (`truncated`: the client left in the middle
/// of it); or a request answered with an error on a connection kept (`bad_header`: a header field of a type no
/// RocketMQ server reads).
pub const REMOTING_FRAME_ERRORS: &str = "popgate_remoting_frame_errors_total";
/// Counter (`reason`): remoting connections popgate closed on a client that went quiet (`idle`: no frame
/// completed for `remoting.idle_timeout_secs`) or stopped reading its answers (`not_reading`).
pub const REMOTING_CONNECTIONS_CLOSED: &str = "popgate_remoting_connections_closed_total";
/// Counter: times popgate stopped reading a remoting connection because it had
/// `remoting.max_requests_per_connection` requests in flight (back-pressure on a client that pipelines).
pub const REMOTING_READS_PAUSED: &str = "popgate_remoting_reads_paused_total";
/// Counter: times a remoting connection waited to read a large frame because the front's connections had
/// `remoting.max_frame_bytes_in_flight` bytes of large frames in already.
pub const REMOTING_FRAME_BUDGET_WAITS: &str = "popgate_remoting_frame_budget_waits_total";
/// Gauge: remoting requests being served now, over every connection.
pub const REMOTING_REQUESTS_IN_FLIGHT: &str = "popgate_remoting_requests_in_flight";
/// Counter: gRPC connections closed at once because `grpc.max_connections` were open.
pub const GRPC_CONNECTIONS_REFUSED: &str = "popgate_grpc_connections_refused_total";
/// Counter: HTTP connections closed at once because `server.max_connections` were open.
pub const HTTP_CONNECTIONS_REFUSED: &str = "popgate_http_connections_refused_total";
/// Counter (`reason`): HTTP connections popgate closed on a client that went quiet (`idle`: no request head
/// completed for `server.idle_timeout_secs`).
pub const HTTP_CONNECTIONS_CLOSED: &str = "popgate_http_connections_closed_total";
/// Gauge (`kind`): gRPC clients seen in the last minute (producer, push_consumer, simple_consumer, other).
pub const GRPC_CLIENTS: &str = "popgate_grpc_clients";
/// 1 while the broker is weaker than the reliability profile (flush or replication), else 0.
pub const PROFILE_MISMATCH: &str = "popgate_profile_mismatch";
/// Requests refused before or by their handler for a limit or for authentication (`body_too_large`: an HTTP
/// body, or a gRPC message over the front's decoding limit), by `reason`
/// (unauthenticated, forbidden, uri_too_long, headers_too_large, body_too_large, batch_too_large,
/// body_timeout, too_many_waiters, too_many_streams, too_many_open_calls, too_many_clients, stale_signature,
/// too_many_tier_ends).
pub const REQUESTS_REJECTED: &str = "popgate_requests_rejected_total";
/// Connections dropped before they were served on the client fronts (HTTP, gRPC, remoting) and the peer link's
/// plaintext port: a TLS handshake that failed, or no first byte, handshake or HTTP/2 preface in time (the peer
/// link's refused TLS connections are [`TIER_CONNECTIONS_REFUSED`]).
pub const TLS_HANDSHAKE_FAILURES: &str = "popgate_tls_handshake_failures_total";
/// DLQ events replayed by the admin plane, by `result` (replayed, failed).
pub const DLQ_REPLAYS: &str = "popgate_dlq_replays_total";
/// Time from dispatch to the subscriber's ACK.
pub const ACK_LATENCY: &str = "popgate_ack_latency_seconds";
/// Gauge (`group`, `topic`): messages at the brokers the group has not consumed yet (popped), the topic's and
/// its POP retry topics', from the brokers' GET_CONSUME_STATS; as of the last refresh.
pub const SUBSCRIPTION_BACKLOG: &str = "popgate_subscription_backlog_messages";
/// Gauge (`group`, `topic`): seconds since the oldest unsettled delivery popgate holds for the subscription
/// (ready, or handed out and not yet ACKed, NACKed or TERMed) was popped; 0 when it holds none.
pub const OLDEST_UNACKED_AGE: &str = "popgate_subscription_oldest_unacked_age_seconds";
/// Gauge (`group`): messages in `%DLQ%<group>` (per queue, max offset minus min offset, summed).
pub const DLQ_DEPTH: &str = "popgate_dlq_depth_messages";
/// Counter (`op`: backlog, dlq_depth): gauge refreshes that could not ask the brokers; the gauge keeps its
/// last value.
pub const STATS_REFRESH_FAILURES: &str = "popgate_stats_refresh_failures_total";

/// Buckets for [`ACK_LATENCY`]: a fast in-process consumer (5 ms) up to the 30 s default ACK timeout.
pub const ACK_LATENCY_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// Buckets for [`PUBLISH_DURATION`] and [`SEND_DURATION`]: from a fast local send (1 ms) to three full 3 s
/// timeouts plus slack.
pub const PUBLISH_DURATION_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Buckets for [`STORE_GROUP_COMMIT_WRITES`]: one write alone up to the writer's largest group (1024).
pub const STORE_GROUP_COMMIT_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];

/// Buckets for [`STORE_COMMIT_DURATION`]: an unsynced write (0.1 ms) up to a disk stalled for seconds.
pub const STORE_COMMIT_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

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
                .set_buckets_for_metric(Matcher::Full(ACK_LATENCY.to_owned()), ACK_LATENCY_BUCKETS)
                .map_err(|e| e.to_string())?
                .set_buckets_for_metric(Matcher::Full(SEND_DURATION.to_owned()), PUBLISH_DURATION_BUCKETS)
                .map_err(|e| e.to_string())?
                .set_buckets_for_metric(Matcher::Full(GRPC_REQUEST_DURATION.to_owned()), PUBLISH_DURATION_BUCKETS)
                .map_err(|e| e.to_string())?
                .set_buckets_for_metric(Matcher::Full(STORE_GROUP_COMMIT_WRITES.to_owned()), STORE_GROUP_COMMIT_BUCKETS)
                .map_err(|e| e.to_string())?
                .set_buckets_for_metric(Matcher::Full(STORE_COMMIT_DURATION.to_owned()), STORE_COMMIT_BUCKETS)
                .map_err(|e| e.to_string())?
                .install_recorder()
                .map_err(|e| e.to_string())?;
            describe_all();
            register_zeroes();
            Ok(handle)
        })
        .clone()
}

/// Label values of each fixed set, registered at 0 at start: a series that exists before its first event
/// lets `rate()` and dashboards show 0 instead of "no data", and alerts tell "never happened" from "not
/// scraped".
const ZERO_SERIES: &[(&str, &str, &[&str])] = &[
    (SEND_FAILURES, "reason", &["timeout", "network", "broker_error", "not_stored", "no_route", "client"]),
    (SEND_DEGRADED, "status", &["FLUSH_DISK_TIMEOUT", "FLUSH_SLAVE_TIMEOUT", "SLAVE_NOT_AVAILABLE"]),
    (DELIVERIES_DISPATCHED, "transport", &["poll", "sse", "websocket", "webhook", "grpc"]),
    (PUSH_WRITE_FAILURES, "transport", &["sse", "websocket", "webhook"]),
    (REMOTING_FRAME_ERRORS, "reason", &["oversize", "undecodable", "truncated", "bad_header"]),
    (REMOTING_CONNECTIONS_CLOSED, "reason", &["idle", "not_reading"]),
    (HTTP_CONNECTIONS_CLOSED, "reason", &["idle"]),
    (REMOTING_REREGISTRATIONS, "result", &["ok", "failed", "coalesced"]),
    (REMOTING_ROUTE_ANSWERS, "source", &["cache", "name_server", "stale"]),
    (CLUSTER_ACL_READS, "result", &["ok", "failed"]),
    (WEBHOOK_TARGETS_REFUSED, "reason", &["literal", "dns"]),
    (WEBHOOK_HEADERS_SKIPPED, "reason", &crate::api::webhook::headers::Skip::LABELS),
    (ACKS, "result", &["acked", "repeated", "unknown", "stale", "superseded", "not_in_flight", "busy", "store_error"]),
    (REDELIVERIES, "reason", &["timeout", "nack", "push_failure", "recovery"]),
    (
        RECOVERED_DELIVERIES,
        "outcome",
        &["redispatched", "lease_lapsed", "ack_pending", "dead_letter_pending", "corrupt"],
    ),
    (CONSUME_REQUEST_FAILURES, "op", &["pop", "renew", "give_back"]),
    (DELIVERIES_GIVEN_BACK, "reason", &["unsubscribed", "not_admitted", "fifo_head_lost", "unclaimed"]),
    (STORE_UNDECODABLE, "family", &["dlq_replays", "payloads"]),
    (
        REQUESTS_REJECTED,
        "reason",
        &[
            "unauthenticated",
            "forbidden",
            "uri_too_long",
            "headers_too_large",
            "body_too_large",
            "body_timeout",
            "batch_too_large",
            "too_many_waiters",
            "too_many_streams",
            "too_many_open_calls",
            "too_many_clients",
            "stale_signature",
            "too_many_tier_ends",
        ],
    ),
    (DLQ_REPLAYS, "result", &["replayed", "failed"]),
    (BROKER_ACK_REQUESTS, "kind", &["single", "batch"]),
    (STATS_REFRESH_FAILURES, "op", STATS_REFRESH_OPS),
    (TRANSACTION_CHECKS, "outcome", &["forwarded", "answered_from_record", "no_producer"]),
    (TIER_CONNECTIONS_REFUSED, "reason", &crate::tier::tls::Refusal::LABELS),
];

/// Label pairs of [`TRANSACTIONS_ENDED`], registered at 0 at start.
const TRANSACTION_END_SERIES: [(&str, &str); 4] =
    [("commit", "landed"), ("rollback", "landed"), ("commit", "refused"), ("rollback", "refused")];

/// The `op` label values of [`STATS_REFRESH_FAILURES`].
pub const STATS_REFRESH_OPS: &[&str] = &["backlog", "dlq_depth"];

/// Counters without labels, registered at 0 at start for the same reason.
const ZERO_COUNTERS: &[&str] = &[
    HTTP_CONNECTIONS_REFUSED,
    GRPC_CONNECTIONS_REFUSED,
    REMOTING_CONNECTIONS_REFUSED,
    REMOTING_READS_PAUSED,
    REMOTING_FRAME_BUDGET_WAITS,
    SEND_RETRIES,
    PUBLISH_DEDUPLICATED,
    PUBLISH_DEDUP_WRITE_FAILURES,
    DLQ_RECORD_FAILURES,
    BROKER_ACK_FAILURES,
    OFFSET_WRITE_FAILURES,
    LEASES_LOST,
    LEASE_RENEWALS,
    SUBSCRIPTION_FILTER_CONFLICTS,
    SUBSCRIPTIONS_EXPIRED,
    TLS_HANDSHAKE_FAILURES,
    POPPED_UNUSABLE,
    GRPC_UNWRITTEN_DELIVERIES,
];

/// The gRPC RPCs popgate serves, registered at 0 with code OK.
const GRPC_RPCS: &[&str] = &[
    "QueryRoute",
    "Heartbeat",
    "Telemetry",
    "SendMessage",
    "NotifyClientTermination",
    "QueryAssignment",
    "ReceiveMessage",
    "AckMessage",
    "ChangeInvisibleDuration",
    "ForwardMessageToDeadLetterQueue",
    "EndTransaction",
];

fn register_zeroes() {
    for (name, label, values) in ZERO_SERIES {
        for value in *values {
            metrics::counter!(*name, *label => *value).increment(0);
        }
    }
    for name in ZERO_COUNTERS {
        metrics::counter!(*name).increment(0);
    }
    for transport in ["http", "grpc", "remoting"] {
        for result in ["ok", "accepted", "bad_request", "too_large", "not_found", "unavailable"] {
            metrics::counter!(PUBLISH_REQUESTS, "result" => result, "transport" => transport).increment(0);
        }
    }
    metrics::gauge!(PENDING_DELIVERIES).set(0.0);
    metrics::gauge!(REMOTING_CONNECTIONS).set(0.0);
    metrics::gauge!(REMOTING_REQUESTS_IN_FLIGHT).set(0.0);
    for rpc in GRPC_RPCS.iter().copied() {
        metrics::counter!(GRPC_REQUESTS, "rpc" => rpc, "code" => "OK").increment(0);
    }
    for kind in ["producer", "push_consumer", "simple_consumer", "other"] {
        metrics::gauge!(GRPC_CLIENTS, "kind" => kind).set(0.0);
    }
    for (resolution, result) in TRANSACTION_END_SERIES {
        metrics::counter!(TRANSACTIONS_ENDED, "resolution" => resolution, "result" => result).increment(0);
    }
    metrics::gauge!(TRANSACTIONS_OWED).set(0.0);
    for action in ["ack", "nack", "term", "extend"] {
        for result in ["ok", "refused", "unreachable"] {
            metrics::counter!(TIER_FORWARDED, "action" => action, "result" => result).increment(0);
        }
        for result in ["ok", "refused", "unauthenticated", "replayed"] {
            metrics::counter!(TIER_SERVED, "action" => action, "result" => result).increment(0);
        }
    }
    for action in ["ack", "nack"] {
        for result in ["ok", "stale", "busy", "unconfirmed"] {
            metrics::counter!(TIER_SETTLED_AT_BROKER, "action" => action, "result" => result).increment(0);
        }
    }
    for (way, results) in [("sent", ["ok", "unreachable", "dropped"]), ("received", ["taken", "older", "refused"])] {
        for result in results {
            metrics::counter!(TIER_SUBSCRIPTION_CHANGES, "way" => way, "result" => result).increment(0);
        }
    }
    for (way, results) in [("sent", ["ok", "unreachable", "dropped"]), ("received", ["kept", "refused", "refused"])] {
        for result in results {
            metrics::counter!(TIER_LEASES_TOLD, "way" => way, "result" => result).increment(0);
        }
    }
    metrics::counter!(TIER_ACKS_LEARNED, "result" => "acked").increment(0);
    metrics::counter!(TIER_ACKS_UNTOLD).increment(0);
    metrics::gauge!(TIER_PEERS).set(0.0);
    for front in ["http", "grpc", "remoting"] {
        for answer in ["commit", "rollback", "unknown", "failed"] {
            metrics::counter!(TRANSACTION_CHECK_ANSWERS, "front" => front, "answer" => answer).increment(0);
        }
    }
}

fn describe_all() {
    describe_counter!(
        PUBLISH_REQUESTS,
        Unit::Count,
        "Publish requests answered (a gRPC send counts each message), by result and transport."
    );
    describe_counter!(GRPC_REQUESTS, Unit::Count, "gRPC calls answered, by RPC and RocketMQ status code.");
    describe_histogram!(GRPC_REQUEST_DURATION, Unit::Seconds, "gRPC call duration, by RPC.");
    describe_gauge!(GRPC_CLIENTS, "gRPC clients seen in the last minute, by kind.");
    describe_counter!(REMOTING_REQUESTS, Unit::Count, "Remoting requests answered, by request code and result.");
    describe_counter!(
        REMOTING_RELAYS,
        Unit::Count,
        "Remoting requests relayed to a broker, by request code and result."
    );
    describe_counter!(
        REMOTING_REREGISTRATIONS,
        Unit::Count,
        "Remoting consumer groups registered again at a broker that had lost them, by result."
    );
    describe_counter!(
        REMOTING_ROUTE_ANSWERS,
        Unit::Count,
        "Remoting route requests answered, by source (cache, name_server, stale: the name server could not be asked)."
    );
    describe_gauge!(REMOTING_CLIENTS, "Remoting clients with a live heartbeat, by kind.");
    describe_gauge!(REMOTING_CONNECTIONS, "Remoting connections open now.");
    describe_counter!(
        REMOTING_CONNECTIONS_REFUSED,
        Unit::Count,
        "Remoting connections closed at once because remoting.max_connections were open."
    );
    describe_counter!(
        REMOTING_FRAME_ERRORS,
        Unit::Count,
        "Remoting connections closed on a frame that cannot be read, by reason."
    );
    describe_counter!(
        REMOTING_CONNECTIONS_CLOSED,
        Unit::Count,
        "Remoting connections closed on a client that went idle or stopped reading, by reason."
    );
    describe_counter!(
        REMOTING_READS_PAUSED,
        Unit::Count,
        "Times a remoting connection was not read because it had its most requests in flight."
    );
    describe_counter!(
        REMOTING_FRAME_BUDGET_WAITS,
        Unit::Count,
        "Times a remoting connection waited to read a large frame: the front had its most bytes of them in."
    );
    describe_gauge!(REMOTING_REQUESTS_IN_FLIGHT, "Remoting requests being served now.");
    describe_counter!(
        GRPC_CONNECTIONS_REFUSED,
        Unit::Count,
        "gRPC connections closed at once because grpc.max_connections were open."
    );
    describe_counter!(
        HTTP_CONNECTIONS_REFUSED,
        Unit::Count,
        "HTTP connections closed at once because server.max_connections were open."
    );
    describe_counter!(
        HTTP_CONNECTIONS_CLOSED,
        Unit::Count,
        "HTTP connections closed on a client that completed no request head in time, by reason."
    );
    describe_counter!(TRANSACTIONS_ENDED, Unit::Count, "Transaction ends, by resolution and result.");
    describe_counter!(TRANSACTION_CHECKS, Unit::Count, "Brokers' transaction check-backs, by outcome.");
    describe_counter!(CLUSTER_ACL_READS, Unit::Count, "Reads of the cluster's ACL 2.0 users and ACLs, by result.");
    describe_counter!(
        TRANSACTION_CHECK_ANSWERS,
        Unit::Count,
        "Producers' answers to forwarded transaction check-backs, by front and answer."
    );
    describe_counter!(
        TIER_FORWARDED,
        Unit::Count,
        "Settlements of deliveries another instance handed out, asked of that instance, by action and result."
    );
    describe_counter!(
        TIER_SERVED,
        Unit::Count,
        "Settlements other instances of the tier asked of this one, by action and result."
    );
    describe_counter!(
        TIER_SETTLED_AT_BROKER,
        Unit::Count,
        "Settlements of deliveries whose owner could not be reached, made at the broker, by action and result."
    );
    describe_counter!(
        TIER_ACKS_LEARNED,
        Unit::Count,
        "ACKs a peer made at the broker while this instance could not be reached, learned afterwards, by result."
    );
    describe_counter!(
        TIER_SUBSCRIPTION_CHANGES,
        Unit::Count,
        "Changes of the tier's shared subscriptions sent to each peer or received from one, by result."
    );
    describe_counter!(
        TIER_LEASES_TOLD,
        Unit::Count,
        "Renewed broker leases of held deliveries told to each peer or received from one, by result."
    );
    describe_counter!(
        TIER_ACKS_UNTOLD,
        Unit::Count,
        "ACKs made at the broker for an unreachable owner, dropped before it learned of them (bound reached)."
    );
    describe_gauge!(TIER_PEERS, "Other instances of the tier this one knows an address of.");
    describe_counter!(
        TIER_CONNECTIONS_REFUSED,
        Unit::Count,
        "Connections to the TLS peer link refused before they were served (no TLS, no or a bad client certificate, \
         a failed or slow handshake), by reason."
    );
    describe_gauge!(TRANSACTIONS_OWED, "Transaction resolutions owed to an unreachable broker (retried).");
    describe_counter!(
        GRPC_UNWRITTEN_DELIVERIES,
        Unit::Count,
        "Deliveries whose gRPC receive response the client did not take in: not renewed, back at their deadline."
    );
    describe_counter!(SEND_ATTEMPTS, Unit::Count, "Send attempts to the broker, by broker name.");
    describe_counter!(SEND_RETRIES, Unit::Count, "Send attempts that retried a failed attempt.");
    describe_counter!(SEND_FAILURES, Unit::Count, "Failed send attempts, by reason.");
    describe_gauge!(BROKER_ISOLATED, "1 while fault avoidance isolates the broker, else 0.");
    describe_counter!(SEND_DEGRADED, Unit::Count, "Sends accepted with a store status weaker than SEND_OK, by status.");
    describe_counter!(BROKER_ISOLATIONS, Unit::Count, "Broker isolations started, by broker and cause.");
    describe_histogram!(PUBLISH_DURATION, Unit::Seconds, "Publish request duration, arrival to answer.");
    describe_histogram!(SEND_DURATION, Unit::Seconds, "One send attempt, by broker.");
    describe_gauge!(PENDING_DELIVERIES, "In-flight deliveries held (popped, not yet retired).");
    describe_counter!(DELIVERIES_DISPATCHED, Unit::Count, "Deliveries handed to a subscriber, by transport.");
    describe_counter!(ACKS, Unit::Count, "Subscriber ACKs, by result.");
    describe_counter!(
        PUBLISH_DEDUPLICATED,
        Unit::Count,
        "Sends answered with an earlier send's receipt (same key within the de-duplication window)."
    );
    describe_counter!(
        PUBLISH_DEDUP_WRITE_FAILURES,
        Unit::Count,
        "De-duplication keys the state store could not keep (remembered by this process only)."
    );
    describe_counter!(PUSH_WRITE_FAILURES, Unit::Count, "Deliveries a push transport could not write, by transport.");
    describe_counter!(
        WEBHOOK_TARGETS_REFUSED,
        Unit::Count,
        "Webhook deliveries refused before connecting: the target is not a permitted address, by reason."
    );
    describe_counter!(
        WEBHOOK_HEADERS_SKIPPED,
        Unit::Count,
        "Event ce_* properties not sent as webhook headers, by reason."
    );
    describe_gauge!(PUSH_SUBSCRIBERS, "Push subscribers connected now, by transport.");
    describe_counter!(REDELIVERIES, Unit::Count, "Redeliveries scheduled, by reason.");
    describe_counter!(DLQ_MESSAGES, Unit::Count, "Events dead-lettered to %DLQ%<group>, by group.");
    describe_counter!(DLQ_RECORD_FAILURES, Unit::Count, "Failed DLQ writes (retried).");
    describe_counter!(BROKER_ACKS, Unit::Count, "Successful broker ACKs (after a subscriber ACK or a DLQ write).");
    describe_counter!(
        BROKER_ACK_REQUESTS,
        Unit::Count,
        "ACK requests sent to brokers, by kind (single message, or batch of many)."
    );
    describe_counter!(BROKER_ACK_FAILURES, Unit::Count, "Failed broker ACKs (retried from the ACK intent).");
    describe_counter!(OFFSET_WRITE_FAILURES, Unit::Count, "Failed state-store writes (disk full, I/O error).");
    describe_counter!(RECOVERED_DELIVERIES, Unit::Count, "Records replayed at boot, by outcome.");
    describe_counter!(LEASES_LOST, Unit::Count, "Deliveries given back to the broker because their lease lapsed.");
    describe_counter!(LEASE_RENEWALS, Unit::Count, "Broker leases of held deliveries renewed (ChangeInvisibleTime).");
    describe_gauge!(LEASE_ASKED, Unit::Seconds, "The broker lease a POP or renewal asks for now, from what is held.");
    describe_counter!(POPS, Unit::Count, "POPs answered by a broker, by result (messages, empty).");
    describe_gauge!(POP_WAIT, Unit::Seconds, "How long a POP waits at the broker now, from how many POPs wait.");
    describe_counter!(
        CONSUME_REQUEST_FAILURES,
        Unit::Count,
        "Failed POP, lease-renewal and give-back requests, by op."
    );
    describe_counter!(
        POPPED_UNUSABLE,
        Unit::Count,
        "Popped messages without a readable receipt handle (redelivered by the broker)."
    );
    describe_counter!(DELIVERIES_GIVEN_BACK, Unit::Count, "Messages handed back to the broker unACKed, by reason.");
    describe_counter!(STORE_UNDECODABLE, Unit::Count, "Stored records that no longer decode, by family.");
    describe_histogram!(
        STORE_GROUP_COMMIT_WRITES,
        Unit::Count,
        "Callers' writes committed together by one state-store group commit (one batch, one sync)."
    );
    describe_histogram!(STORE_COMMIT_DURATION, Unit::Seconds, "Duration of one state-store group commit.");
    describe_counter!(
        SUBSCRIPTION_FILTER_CONFLICTS,
        Unit::Count,
        "Receives whose filter was not taken: the subscription's filter changed less than 10 s before."
    );
    describe_counter!(SUBSCRIPTIONS_EXPIRED, Unit::Count, "Idle implicit subscriptions removed.");
    describe_counter!(REQUESTS_REJECTED, Unit::Count, "Requests refused for a limit or authentication, by reason.");
    describe_counter!(
        TLS_HANDSHAKE_FAILURES,
        Unit::Count,
        "Connections dropped before they were served: a TLS handshake that failed, or no first byte, handshake or \
         HTTP/2 preface in time."
    );
    describe_counter!(DLQ_REPLAYS, Unit::Count, "DLQ events replayed to their origin topic, by result.");
    describe_histogram!(ACK_LATENCY, Unit::Seconds, "Time from dispatch to the subscriber's ACK.");
    describe_gauge!(PROFILE_MISMATCH, "1 while the broker is weaker than the reliability profile, else 0.");
    describe_gauge!(
        SUBSCRIPTION_BACKLOG,
        Unit::Count,
        "Messages at the brokers the group has not popped yet (topic and its POP retry topics, max offset minus \
         the group's committed offset per queue), by group and topic; as of the last refresh."
    );
    describe_gauge!(
        OLDEST_UNACKED_AGE,
        Unit::Seconds,
        "Age of the oldest delivery held unsettled (ready or handed out, not yet ACKed, NACKed or TERMed), since \
         it was popped from the broker, by group and topic; 0 when none is held."
    );
    describe_gauge!(
        DLQ_DEPTH,
        Unit::Count,
        "Messages in %DLQ%<group> (max offset minus min offset per queue), by group."
    );
    describe_counter!(
        STATS_REFRESH_FAILURES,
        Unit::Count,
        "Gauge refreshes that could not ask the brokers, by op (the gauge keeps its last value)."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/metrics` as a fresh recorder renders it once every metric is described, the fixed sets are registered
    /// and each labelled gauge of `touched` has one series.
    fn rendered(touched: &[(&'static str, &[(&'static str, &'static str)])]) -> String {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe_all();
            register_zeroes();
            for (name, labels) in touched {
                let labels: Vec<metrics::Label> = labels.iter().map(|(k, v)| metrics::Label::new(*k, *v)).collect();
                metrics::gauge!(*name, labels).set(1.0);
            }
        });
        handle.render()
    }

    #[test]
    fn the_operators_gauges_are_described_and_named_by_the_conventions() {
        let subscription: &[(&str, &str)] = &[("group", "g"), ("topic", "t")];
        let text = rendered(&[
            (SUBSCRIPTION_BACKLOG, subscription),
            (OLDEST_UNACKED_AGE, subscription),
            (DLQ_DEPTH, &[("group", "g")]),
        ]);
        for (name, kind) in [
            (SUBSCRIPTION_BACKLOG, "gauge"),
            (OLDEST_UNACKED_AGE, "gauge"),
            (DLQ_DEPTH, "gauge"),
            (STATS_REFRESH_FAILURES, "counter"),
        ] {
            assert!(name.starts_with("popgate_"), "{name}");
            assert!(!name.contains("gauge") && !name.contains("counter"), "{name}: promtool refuses a type in a name");
            assert_eq!(name.ends_with("_total"), kind == "counter", "{name}: `_total` on counters only");
            assert!(text.contains(&format!("# HELP {name} ")), "{name} has help text:\n{text}");
            assert!(text.contains(&format!("# TYPE {name} {kind}")), "{name} is a {kind}:\n{text}");
        }
        assert!(SUBSCRIPTION_BACKLOG.ends_with("_messages") && DLQ_DEPTH.ends_with("_messages"));
        assert!(OLDEST_UNACKED_AGE.ends_with("_seconds"));
        for op in STATS_REFRESH_OPS {
            assert!(
                text.contains(&format!("{STATS_REFRESH_FAILURES}{{op=\"{op}\"}} 0")),
                "{op} registered at 0:\n{text}"
            );
        }
    }
}
