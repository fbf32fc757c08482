//! The RocketMQ 5 gRPC front, driven by Apache's official Java SDK (5.0.3 and 5.2.0, see `on_every_sdk!`)
//! with a stock `ClientConfiguration` (only the endpoint, and credentials in the auth test): producer,
//! SimpleConsumer, PushConsumer, the retry schedule and the DLQ, FIFO, durability across `kill -9`, HTTP and
//! gRPC together, the client's deadline. Each test checks what the SDK saw and what the broker holds.
//! `grpc_raw` covers what the SDK never sends (foreign handles).

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::direct::{Direct, DirectConsumer};
use crate::harness::popgate::Popgate;
use crate::harness::rocketmq::{Cluster, ClusterSpec};
use crate::harness::sdk::{bodies, Sdk};
use crate::harness::{eventually, unique_topic};
use crate::publish::shared_cluster;

/// Each scenario below runs as two tests, `<scenario>::sdk_5_0_3` and `<scenario>::sdk_5_2_0`: apps run every
/// SDK version since 5.0, and the oldest and the newest differ in what they send.
macro_rules! on_every_sdk {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sdk_5_0_3() {
                super::$scenario(crate::harness::sdk::Sdk::OLDEST).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sdk_5_2_0() {
                super::$scenario(crate::harness::sdk::Sdk::NEWEST).await;
            }
        }
    )*};
}

on_every_sdk!(
    sdk_producer_sends_normal_fifo_delayed_and_tagged_messages_that_the_broker_stores_as_sent,
    sdk_producer_is_served_past_a_stopped_broker_by_popgates_retry_policy,
    an_sdk_send_retried_while_its_broker_was_stopped_is_stored_once,
    a_receive_on_an_empty_topic_long_polls_and_answers_before_the_clients_deadline,
    sigterm_answers_the_open_receives_then_the_grpc_front_drains_and_popgate_exits,
    simple_consumer_receives_what_its_tag_filter_selects_and_acks_it_at_the_broker,
    simple_consumer_changes_the_invisible_duration_then_acks_and_an_unacked_message_returns_as_attempt_2,
    a_consumer_whose_invisible_time_ran_out_cannot_ack_the_message_another_consumer_now_holds,
    an_sql92_filter_selects_by_property_for_sdk_and_http_consumers_and_a_broken_one_is_refused,
    push_consumer_failures_are_retried_on_popgates_schedule_then_dead_lettered_with_origin_properties,
    push_consumer_of_an_ordered_group_keeps_each_message_group_in_order_through_a_failure,
    a_group_made_orderly_at_the_broker_is_fifo_through_popgate,
    a_fifo_receive_carries_consecutive_messages_of_a_group_in_order,
    push_consumer_acks_with_handles_issued_before_popgate_was_killed_and_nothing_is_delivered_twice,
    http_publishes_reach_grpc_consumers_and_grpc_publishes_reach_http_subscribers,
    sdk_credentials_map_onto_popgates_tokens_and_a_bad_secret_or_scope_is_refused,
);

/// How long one driver run may take on a loaded machine (JVM start, SDK start, the scenario).
const DRIVER_TIMEOUT: Duration = Duration::from_secs(180);

/// Creates `topic` on every broker of `cluster` (QueryRoute does not auto-create topics, as Apache's proxy).
pub async fn create_topic(cluster: &Cluster, topic: &str) {
    let addrs: Vec<String> = cluster.brokers.iter().map(|b| format!("127.0.0.1:{}", b.port)).collect();
    Direct::connect(&cluster.namesrv_addr).await.create_topic(topic, &addrs).await;
}

/// The scenario's arguments with popgate's gRPC endpoint added.
fn args(popgate: &Popgate, mut extra: Value) -> Value {
    extra["endpoint"] = json!(popgate.grpc);
    extra
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// The `received` entries of a result, by body.
fn received_by_body(result: &Value) -> HashMap<String, Vec<Value>> {
    let mut by_body: HashMap<String, Vec<Value>> = HashMap::new();
    for entry in result["received"].as_array().cloned().unwrap_or_default() {
        by_body.entry(entry["body"].as_str().unwrap_or_default().to_owned()).or_default().push(entry);
    }
    by_body
}

async fn sdk_producer_sends_normal_fifo_delayed_and_tagged_messages_that_the_broker_stores_as_sent(sdk: Sdk) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_produce");
    create_topic(cluster, &topic).await;

    let tagged = json!({"topic": topic, "count": 3, "prefix": "tagged", "tag": "t{i}",
        "keys": ["order-{i}", "cust"]});
    let fifo = json!({"topic": topic, "count": 3, "prefix": "fifo", "messageGroup": "g1", "async": true});
    // 12 s: on a loaded machine a send can take seconds to reach the broker, and a message whose delivery
    // time has already passed when it arrives is stored as a plain message (the broker drops its timer).
    let delayed = json!({"topic": topic, "count": 1, "prefix": "delayed", "deliveryDelayMs": 12_000});
    let mut sent: HashMap<String, String> = HashMap::new();
    for scenario in [tagged, fifo, delayed] {
        let result = sdk.run("produce", &args(&popgate, scenario), DRIVER_TIMEOUT).await;
        assert_eq!(result["errors"], json!([]), "{result}");
        for entry in result["sent"].as_array().cloned().unwrap_or_default() {
            sent.insert(
                entry["body"].as_str().unwrap_or_default().to_owned(),
                entry["messageId"].as_str().unwrap_or_default().to_owned(),
            );
        }
    }
    assert_eq!(sent.len(), 7, "{sent:?}");

    // The delayed message is a timer message: it reaches the topic only once it is due.
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let mut stored = Vec::new();
    for _ in 0..300 {
        stored = direct.read_all(&topic).await;
        if stored.len() >= 7 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let arrived_ms = now_ms();
    let stored: HashMap<String, _> =
        stored.into_iter().map(|m| (String::from_utf8_lossy(&m.body).into_owned(), m)).collect();
    assert_eq!(stored.len(), 7, "every message stored once: {:?}", stored.keys().collect::<Vec<_>>());
    for (body, message_id) in &sent {
        let m = &stored[body];
        assert_eq!(m.property("UNIQ_KEY"), Some(message_id.as_str()), "the SDK's message id is kept for {body}");
    }
    assert_eq!(stored["tagged-1"].property("TAGS"), Some("t1"));
    assert_eq!(stored["tagged-1"].property("KEYS"), Some("order-1 cust"));
    for n in 0..3 {
        assert_eq!(stored[&format!("fifo-{n}")].property("__SHARDINGKEY"), Some("g1"), "message group → FIFO");
    }
    let deliver_at: i64 = stored["delayed-0"].property("TIMER_DELIVER_MS").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(deliver_at > 0, "the delivery timestamp became a timer message: {:?}", stored["delayed-0"].properties);
    assert!(arrived_ms >= deliver_at - 1_000, "it was not in the topic before its delivery time");

    let metrics = popgate.metrics_text().await;
    let sends =
        crate::harness::popgate::metric_value(&metrics, "popgate_grpc_requests_total{rpc=\"SendMessage\",code=\"OK\"}");
    assert!(sends >= 7.0, "gRPC sends are counted: {sends}");
    assert!(
        crate::harness::popgate::metric_value(
            &metrics,
            "popgate_publish_requests_total{result=\"ok\",transport=\"grpc\"}"
        ) >= 7.0
    );
}

async fn sdk_producer_is_served_past_a_stopped_broker_by_popgates_retry_policy(sdk: Sdk) {
    let cluster = Cluster::start(&ClusterSpec::brokers(&["broker-a", "broker-b"]));
    let popgate = Popgate::start(&cluster.namesrv_addr, "[publish]\nsend_timeout_ms = 1500\n").await;
    let topic = unique_topic("grpc_failover");
    create_topic(&cluster, &topic).await;
    cluster.pause_broker("broker-a");

    let result =
        sdk.run("produce", &args(&popgate, json!({"topic": topic, "count": 6, "prefix": "f"})), DRIVER_TIMEOUT).await;
    cluster.resume_broker("broker-a");
    assert_eq!(result["errors"], json!([]), "every send was stored despite the stopped broker: {result}");

    let stored = Direct::connect(&cluster.namesrv_addr).await.read_all(&topic).await;
    let mut on_b: Vec<String> = stored
        .iter()
        .filter(|m| m.broker == "broker-b")
        .map(|m| String::from_utf8_lossy(&m.body).into_owned())
        .collect();
    on_b.sort();
    on_b.dedup();
    assert_eq!(on_b.len(), 6, "all six are on broker-b: {on_b:?}");
    assert!(popgate.metric("popgate_send_retries_total").await >= 1.0, "the stopped broker cost retries");
}

/// The SDK gives up on a send whose broker is stopped (its request timeout, 5 s) and retries it with the same
/// message id. popgate's send to the stopped broker goes on past the SDK's deadline instead of being abandoned;
/// the SDK's retry waits for it, and once the broker answers, the retry gets the first send's receipt. The
/// message is stored once and the SDK sees success. Before the de-duplication window, each SDK attempt was a
/// new send to the stopped broker, and the broker stored every one of them once it came back.
async fn an_sdk_send_retried_while_its_broker_was_stopped_is_stored_once(sdk: Sdk) {
    let cluster = Cluster::start(&ClusterSpec::brokers(&["broker-a"]));
    // Long enough that popgate's one attempt outlives the stop: a retry on the same broker would be a copy.
    let popgate = Popgate::start(&cluster.namesrv_addr, "[publish]\nsend_timeout_ms = 60000\n").await;
    let topic = unique_topic("grpc_dedup");
    create_topic(&cluster, &topic).await;
    cluster.pause_broker("broker-a");

    let produce = json!({"topic": topic, "count": 1, "prefix": "once", "requestTimeoutMs": 5000});
    let producer = sdk.start("produce", &args(&popgate, produce));
    // The SDK's first attempt was answered (a failure, by its deadline); its retry is waiting.
    eventually(Duration::from_secs(120), "the SDK's first attempt answered", || async {
        popgate.metric("popgate_grpc_requests_total{rpc=\"SendMessage\",code=\"INTERNAL_SERVER_ERROR\"}").await >= 1.0
    })
    .await;
    cluster.resume_broker("broker-a");
    let result = producer.finish(DRIVER_TIMEOUT).await;
    assert_eq!(result["errors"], json!([]), "the SDK's retry got the stored send's receipt: {result}");

    // Every request the SDK or popgate sent had reached the broker before the SDK's answer: a copy is stored by now.
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let stored = eventually_stored(&direct, &topic, 1).await;
    let stored_bodies: Vec<String> = stored.iter().map(|m| String::from_utf8_lossy(&m.body).into_owned()).collect();
    assert_eq!(stored_bodies, ["once-0"], "stored once: {result}");
    assert_eq!(result["sent"][0]["messageId"], stored[0].property("UNIQ_KEY").unwrap_or_default(), "{result}");
    assert!(popgate.metric("popgate_publish_deduplicated_total").await >= 1.0);
}

/// What `topic` holds once it holds at least `count` messages (polled for at most 60 s).
async fn eventually_stored(direct: &Direct, topic: &str, count: usize) -> Vec<crate::harness::direct::StoredMessage> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut stored = direct.read_all(topic).await;
    while stored.len() < count && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        stored = direct.read_all(topic).await;
    }
    stored
}

/// Java SDK 5.0.x sends no `long_polling_timeout`, and its call deadline is its request timeout plus its await
/// duration (here 10 s + 10 s). popgate takes the long poll from that deadline as Apache's proxy does (the time
/// left less half the request timeout, within 5 s ..= 20 s), so every empty receive is a long poll that ends
/// before the client gives up: no DEADLINE_EXCEEDED. 5.2.0 asks for its await duration, which fits.
async fn a_receive_on_an_empty_topic_long_polls_and_answers_before_the_clients_deadline(sdk: Sdk) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_deadline");
    create_topic(cluster, &topic).await;
    let consume = json!({"group": format!("g_{topic}"), "topic": topic, "requestTimeoutMs": 10000, "awaitSeconds": 10,
        "timeoutSeconds": 25});
    let result = sdk.run("simple-consume", &args(&popgate, consume), DRIVER_TIMEOUT).await;
    assert_eq!(result["receiveErrors"], json!([]), "SDK {}: {result}", sdk.0);
    let took: Vec<i64> = result["receiveMs"].as_array().into_iter().flatten().filter_map(Value::as_i64).collect();
    assert!(!took.is_empty(), "{result}");
    for ms in &took {
        assert!((4_500..20_000).contains(ms), "SDK {}: a long poll, ended before the 20 s deadline: {took:?}", sdk.0);
    }
}

/// SIGTERM while a consumer long-polls: popgate answers the open receive at once (no message, as when the
/// wait ends), sends GOAWAY and exits inside its grace period, instead of cutting the connection under the
/// call.
async fn sigterm_answers_the_open_receives_then_the_grpc_front_drains_and_popgate_exits(sdk: Sdk) {
    let cluster = shared_cluster();
    // The harness's grace period is 2 s: far shorter than the receive's 20 s long poll.
    let mut popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_drain");
    create_topic(cluster, &topic).await;
    let consume = json!({"group": format!("g_{topic}"), "topic": topic, "awaitSeconds": 20, "timeoutSeconds": 20,
        "stopOnRejection": false});
    let consumer = sdk.start("simple-consume", &args(&popgate, consume));
    eventually(Duration::from_secs(120), "the consumer is up", || async {
        popgate.metric("popgate_grpc_clients{kind=\"simple_consumer\"}").await >= 1.0
    })
    .await;
    // Its first receive (a 20 s long poll on an empty topic) is open by now.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let terminated_at = now_ms();
    popgate.signal("TERM");
    assert_eq!(popgate.wait_exit(Duration::from_secs(25)).await, Some(0), "popgate drains and exits on its own");
    let exit_ms = now_ms() - terminated_at;

    let result = consumer.finish(DRIVER_TIMEOUT).await;
    let first_start = result["receiveStartedAtMs"][0].as_i64();
    let first_took = result["receiveMs"][0].as_i64();
    assert!(
        first_start.is_some_and(|at| at < terminated_at),
        "SDK {}: the first receive was answered: {result}",
        sdk.0
    );
    let answered_after = first_start.unwrap_or(0) + first_took.unwrap_or(0) - terminated_at;
    assert!(
        answered_after < 10_000,
        "SDK {}: answered {answered_after} ms after SIGTERM, not at the poll's end",
        sdk.0
    );
    assert!(exit_ms < 15_000, "SDK {}: exited {exit_ms} ms after SIGTERM", sdk.0);
}

async fn simple_consumer_receives_what_its_tag_filter_selects_and_acks_it_at_the_broker(sdk: Sdk) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_simple");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    for (n, tag) in ["keep", "drop", "keep", "drop", "keep"].iter().enumerate() {
        let (status, answer) = popgate.publish(&json!({"topic": topic, "data": format!("s-{n}"), "tags": tag})).await;
        assert_eq!(status, 200, "{answer}");
    }

    let consume = json!({"group": group, "topic": topic, "tag": "keep", "expect": 3, "invisibleSeconds": 30,
        "awaitSeconds": 3, "timeoutSeconds": 60});
    let result = sdk.run("simple-consume", &args(&popgate, consume), DRIVER_TIMEOUT).await;
    assert_eq!(result["ackErrors"], json!([]), "{result}");
    let mut got = bodies(&result, "received");
    got.sort();
    assert_eq!(got, ["s-0", "s-2", "s-4"], "{result}");
    for entry in result["received"].as_array().cloned().unwrap_or_default() {
        assert_eq!(entry["tag"], "keep");
        assert_eq!(entry["deliveryAttempt"], 1);
        assert_eq!(entry["acked"], true);
    }

    // Every ACK reached the broker (nothing left in flight), and the group has nothing more to give.
    eventually(Duration::from_secs(15), "the ACKs are settled at the broker", || async {
        popgate.get_json(&format!("/admin/deliveries?group={group}")).await.1["deliveries"]
            .as_array()
            .is_some_and(Vec::is_empty)
    })
    .await;
    assert!(popgate.metric("popgate_deliveries_dispatched_total{transport=\"grpc\"}").await >= 3.0);
    drop(popgate);
    let again =
        DirectConsumer::connect(&cluster.namesrv_addr).await.drain(&group, &topic, Duration::from_secs(5)).await;
    assert!(
        again.iter().all(|b| !["s-0", "s-2", "s-4"].contains(&b.as_str())),
        "ACKed messages never come back: {again:?}"
    );
}

async fn simple_consumer_changes_the_invisible_duration_then_acks_and_an_unacked_message_returns_as_attempt_2(
    sdk: Sdk,
) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_invisible");
    create_topic(cluster, &topic).await;
    popgate.publish_bodies(&topic, &["c-0"]).await;

    // changeInvisibleDuration, then ack: the handle stays valid (popgate's never changes).
    let changed = json!({"group": format!("g1_{topic}"), "topic": topic, "expect": 1, "changeInvisibleFirst": 20,
        "awaitSeconds": 3, "timeoutSeconds": 60});
    let result = sdk.run("simple-consume", &args(&popgate, changed), DRIVER_TIMEOUT).await;
    assert_eq!(result["changeInvisibleErrors"], json!([]), "{result}");
    assert_eq!(result["ackErrors"], json!([]), "{result}");
    assert_eq!(result["received"][0]["changedInvisible"], true, "{result}");

    // An invisible duration under Apache's 10 s minimum is refused as Apache's proxy refuses it.
    let group = format!("g2_{topic}");
    let too_short = json!({"group": group, "topic": topic, "expect": 1, "invisibleSeconds": 2, "awaitSeconds": 3,
        "timeoutSeconds": 30});
    let result = sdk.run("simple-consume", &args(&popgate, too_short), DRIVER_TIMEOUT).await;
    assert_eq!(result["received"], json!([]), "{result}");
    let refusal = result["receiveErrors"][0]["message"].as_str().unwrap_or_default();
    assert!(refusal.contains("the invisibleTime is too small. min is 10000"), "{result}");
    assert!(refusal.contains("ILLEGAL_INVISIBLE_TIME") || refusal.contains("40011"), "{result}");

    // Not acked within its 10 s: it comes back (after popgate's 1 s backoff) as attempt 2.
    let unacked = json!({"group": group, "topic": topic, "expect": 2, "ack": false, "invisibleSeconds": 10,
        "awaitSeconds": 3, "timeoutSeconds": 60});
    let result = sdk.run("simple-consume", &args(&popgate, unacked), DRIVER_TIMEOUT).await;
    let received = result["received"].as_array().cloned().unwrap_or_default();
    assert_eq!(received.len(), 2, "{result}");
    assert_eq!(received[0]["body"], "c-0");
    assert_eq!(received[1]["body"], "c-0");
    assert_eq!(received[0]["deliveryAttempt"], 1);
    assert_eq!(received[1]["deliveryAttempt"], 2);
    let gap = received[1]["receivedAtMs"].as_i64().unwrap_or(0) - received[0]["receivedAtMs"].as_i64().unwrap_or(0);
    // popgate's deadline runs from its hand-out, and the redelivery waits popgate's backoff (at least 0.8 s)
    // on top: at least 10.8 s after the hand-out. The driver stamps each receipt when the SDK gives it the
    // message, which on a loaded machine is up to a second after the hand-out (a fresh-clone run measured
    // 9.7 s between the receipts). A message back before its invisible duration would be ~1 s apart.
    assert!(gap >= 9_000, "not before its invisible duration ended: {gap} ms");
    assert!(popgate.metric("popgate_redeliveries_total{reason=\"timeout\"}").await >= 1.0);
}

/// An SQL92 filter is the broker's to evaluate: the SDK's SimpleConsumer (and an HTTP subscription of another
/// group) receive the messages whose properties match, and nothing else. One the broker cannot compile is
/// refused with `ILLEGAL_FILTER_EXPRESSION`, not left to wait. Before, popgate refused every SQL92 filter.
async fn an_sql92_filter_selects_by_property_for_sdk_and_http_consumers_and_a_broken_one_is_refused(sdk: Sdk) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_sql");
    create_topic(cluster, &topic).await;
    for (body, amount) in [("small", Some("1")), ("big", Some("10")), ("bigger", Some("20")), ("none", None)] {
        let mut event = json!({"topic": topic, "data": body});
        if let Some(amount) = amount {
            event["properties"] = json!({"amount": amount});
        }
        let (status, answer) = popgate.publish(&event).await;
        assert_eq!(status, 200, "{answer}");
    }

    let consume = json!({"group": format!("g_{topic}"), "topic": topic, "sql": "amount > 5", "expect": 2,
        "awaitSeconds": 3, "timeoutSeconds": 60});
    let result = sdk.run("simple-consume", &args(&popgate, consume), DRIVER_TIMEOUT).await;
    let mut got = crate::harness::sdk::bodies(&result, "received");
    got.sort();
    assert_eq!(got, ["big", "bigger"], "{result}");
    let more = json!({"group": format!("g_{topic}"), "topic": topic, "sql": "amount > 5", "expect": 0,
        "awaitSeconds": 3, "timeoutSeconds": 8});
    let rest = sdk.run("simple-consume", &args(&popgate, more), DRIVER_TIMEOUT).await;
    assert_eq!(rest["received"], json!([]), "nothing else matches: {rest}");

    // The same filter for an HTTP subscriber of another group.
    let http_group = format!("h_{topic}");
    let subscribe = json!({"group": http_group, "topic": topic, "filter": "amount > 5", "filterType": "SQL92"});
    let (status, answer) = popgate.post_json("/events/subscribe", &subscribe).await;
    assert_eq!(status, 200, "{answer}");
    let polled = popgate.poll_until(&http_group, &topic, 2, Duration::from_secs(60)).await;
    let mut http_bodies: Vec<String> = polled.iter().map(crate::harness::popgate::data).collect();
    http_bodies.sort();
    assert_eq!(http_bodies, ["big", "bigger"]);

    // An expression the broker cannot compile: refused at once, with RocketMQ's code.
    let broken = json!({"group": format!("b_{topic}"), "topic": topic, "sql": "amount >>> 5", "expect": 1,
        "awaitSeconds": 3, "timeoutSeconds": 30});
    let result = sdk.run("simple-consume", &args(&popgate, broken), DRIVER_TIMEOUT).await;
    assert_eq!(result["received"], json!([]), "{result}");
    let refusal = result["receiveErrors"][0]["message"].as_str().unwrap_or_default();
    assert!(refusal.contains("ILLEGAL_FILTER_EXPRESSION") || refusal.contains("40010"), "{result}");
    assert!(refusal.contains("the broker refused the filter"), "{result}");
}

/// Consumer A holds a message past its invisible time; consumer B gets it next (attempt 2). A's late ACK is
/// refused (`INVALID_RECEIPT_HANDLE`: A no longer holds it), B's is taken, and the broker is ACKed once. Before
/// each hand-out had its own handle, A's ACK settled B's message and B's ACK was refused.
async fn a_consumer_whose_invisible_time_ran_out_cannot_ack_the_message_another_consumer_now_holds(sdk: Sdk) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_fenced");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    popgate.publish_bodies(&topic, &["held-too-long"]).await;

    // A: receives with 10 s of invisibility, acks after 16 s. B starts once A holds the message, acks 8 s after
    // its receive (at about 11 s + 8 s), so A's ACK (at 16 s) comes while B holds it.
    let slow = json!({"group": group, "topic": topic, "expect": 1, "invisibleSeconds": 10, "ackAfterMs": 16_000,
        "awaitSeconds": 3, "timeoutSeconds": 60});
    let consumer_a = sdk.start("simple-consume", &args(&popgate, slow));
    eventually(Duration::from_secs(120), "A holds the message", || async {
        popgate.metric("popgate_deliveries_dispatched_total{transport=\"grpc\"}").await >= 1.0
    })
    .await;
    let next = json!({"group": group, "topic": topic, "expect": 1, "invisibleSeconds": 30, "ackAfterMs": 8_000,
        "awaitSeconds": 3, "timeoutSeconds": 90});
    let consumer_b = sdk.start("simple-consume", &args(&popgate, next));
    let (a, b) = (consumer_a.finish(DRIVER_TIMEOUT).await, consumer_b.finish(DRIVER_TIMEOUT).await);

    assert_eq!(a["received"][0]["deliveryAttempt"], 1, "{a}");
    assert_eq!(b["received"][0]["deliveryAttempt"], 2, "{b}");
    assert_eq!(b["received"][0]["body"], "held-too-long", "{b}");
    let (a_acked_at, b_acked_at) = (a["received"][0]["ackAtMs"].as_i64(), b["received"][0]["ackAtMs"].as_i64());
    assert!(a_acked_at < b_acked_at, "A's ACK came while B held the message: {a} {b}");
    assert_eq!(a["received"][0]["acked"], false, "A's late ACK is refused: {a}");
    let refusal = a["ackErrors"][0]["message"].as_str().unwrap_or_default();
    // Apache's proxy answers the request with the code's name (apps match on it), each entry with its reason.
    assert!(refusal.contains("INVALID_RECEIPT_HANDLE"), "{a}");
    assert_eq!(b["ackErrors"], json!([]), "B holds the message and settles it: {b}");
    assert_eq!(b["received"][0]["acked"], true, "{b}");
    // Settled once: nothing is held, and the group has nothing more to receive.
    eventually(Duration::from_secs(30), "nothing held", || async {
        popgate.metric("popgate_pending_deliveries").await == 0.0
    })
    .await;
    let after = json!({"group": group, "topic": topic, "expect": 0, "awaitSeconds": 3, "timeoutSeconds": 8});
    let result = sdk.run("simple-consume", &args(&popgate, after), DRIVER_TIMEOUT).await;
    assert_eq!(result["received"], json!([]), "ACKed once, never back: {result}");
}

async fn push_consumer_failures_are_retried_on_popgates_schedule_then_dead_lettered_with_origin_properties(sdk: Sdk) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_push_dlq");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    popgate.publish_bodies(&topic, &["ok-0", "bad", "ok-1"]).await;

    let consume = json!({"group": group, "topic": topic, "failBodies": ["bad"], "expect": 8, "timeoutSeconds": 120,
        "settleMillis": 500});
    let result = sdk.run("push-consume", &args(&popgate, consume), DRIVER_TIMEOUT).await;
    assert_eq!(result["timedOut"], false, "{result}");
    let by_body = received_by_body(&result);
    assert_eq!(by_body["ok-0"].len(), 1, "{result}");
    assert_eq!(by_body["ok-1"].len(), 1, "{result}");
    let bad = &by_body["bad"];
    assert_eq!(bad.len(), 6, "6 attempts in all: {result}");
    let attempts: Vec<i64> = bad.iter().map(|e| e["deliveryAttempt"].as_i64().unwrap_or(0)).collect();
    assert_eq!(attempts, [1, 2, 3, 4, 5, 6], "popgate counts the attempts");
    let at: Vec<i64> = bad.iter().map(|e| e["atMs"].as_i64().unwrap_or(0)).collect();
    for (n, pair) in at.windows(2).enumerate() {
        let expected = 1_000i64 << n;
        let gap = pair[1] - pair[0];
        // ±20 % jitter; the upper bound also allows for a loaded machine's receive and listener latency.
        assert!(
            gap >= expected * 8 / 10 - 100 && gap <= expected * 12 / 10 + 2_000,
            "retry {} after {gap} ms, not {expected} ms ±20 %: {at:?}",
            n + 1
        );
    }

    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let dlq = format!("%DLQ%{group}");
    let dead = direct.read_when_present(&dlq, Duration::from_secs(30)).await;
    assert_eq!(dead.len(), 1, "the failed message is in {dlq}");
    assert_eq!(dead[0].body, b"bad");
    assert_eq!(dead[0].property("DLQ_ORIGIN_TOPIC"), Some(topic.as_str()));
    assert_eq!(dead[0].property("DLQ_ORIGIN_MESSAGE_ID"), bad[0]["messageId"].as_str());
    assert!(popgate.metric(&format!("popgate_dlq_messages_total{{group=\"{group}\"}}")).await >= 1.0);
}

async fn push_consumer_of_an_ordered_group_keeps_each_message_group_in_order_through_a_failure(sdk: Sdk) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_fifo");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    let (status, answer) =
        popgate.post_json("/events/subscribe", &json!({"group": group, "topic": topic, "ordered": true})).await;
    assert_eq!(status, 200, "{answer}");
    two_message_groups_reach_a_push_consumer_in_order(sdk, &popgate, &topic, &group).await;
}

/// A new topic, and a consumer group made orderly on every broker the RocketMQ way (`mqadmin updateSubGroup -g
/// <group> -o true`); popgate is told nothing.
async fn topic_of_an_orderly_group(cluster: &Cluster, prefix: &str) -> (String, String) {
    let topic = unique_topic(prefix);
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    let addrs: Vec<String> = cluster.brokers.iter().map(|b| format!("127.0.0.1:{}", b.port)).collect();
    Direct::connect(&cluster.namesrv_addr).await.create_orderly_group(&group, &addrs).await;
    (topic, group)
}

/// The group is made orderly the RocketMQ way, at the broker (`mqadmin updateSubGroup -o true`), and nothing is
/// said to popgate: its Settings tell the SDK `fifo` (so the SDK runs its FIFO consume service) and it hands
/// out each message group in order. Before, popgate ignored the group's config: the SDK consumed concurrently
/// and a failed message was passed by the next of its group.
async fn a_group_made_orderly_at_the_broker_is_fifo_through_popgate(sdk: Sdk) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let (topic, group) = topic_of_an_orderly_group(cluster, "grpc_fifo_subgroup").await;
    two_message_groups_reach_a_push_consumer_in_order(sdk, &popgate, &topic, &group).await;
    let (_, subscriptions) = popgate.get_json("/admin/subscriptions").await;
    assert!(
        subscriptions.to_string().contains("\"ordered\":true"),
        "the subscription follows the group: {subscriptions}"
    );
}

/// A SimpleConsumer of a FIFO group that asks for 3 gets up to 3 consecutive messages of a message group in one
/// receive, in order, as from Apache's proxy; the group's next messages come once those are settled. Before,
/// every receive of a FIFO group carried one message.
async fn a_fifo_receive_carries_consecutive_messages_of_a_group_in_order(sdk: Sdk) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let (topic, group) = topic_of_an_orderly_group(cluster, "grpc_fifo_batch").await;
    let produce = json!({"topic": topic, "count": 6, "prefix": "f", "messageGroup": "only-group"});
    let result = sdk.run("produce", &args(&popgate, produce), DRIVER_TIMEOUT).await;
    assert_eq!(result["errors"], json!([]), "{result}");

    let consume = json!({"group": group, "topic": topic, "expect": 6, "maxMessageNum": 3, "invisibleSeconds": 30,
        "awaitSeconds": 3, "timeoutSeconds": 90});
    let result = sdk.run("simple-consume", &args(&popgate, consume), DRIVER_TIMEOUT).await;
    let received = result["received"].as_array().cloned().unwrap_or_default();
    let bodies: Vec<&str> = received.iter().filter_map(|r| r["body"].as_str()).collect();
    assert_eq!(bodies, ["f-0", "f-1", "f-2", "f-3", "f-4", "f-5"], "in order, each once: {result}");
    // Messages of one receive share its `receivedAtMs`.
    let mut per_receive: Vec<usize> = Vec::new();
    let mut last = None;
    for entry in &received {
        let at = entry["receivedAtMs"].as_i64();
        if at == last {
            *per_receive.last_mut().expect("a receive") += 1;
        } else {
            per_receive.push(1);
            last = at;
        }
    }
    assert!(per_receive.iter().all(|n| *n <= 3), "never more than asked for: {per_receive:?}");
    assert!(per_receive.iter().any(|n| *n > 1), "a receive carried consecutive messages: {per_receive:?} {result}");
}

/// Eight messages in two message groups, the third failing once: each group reaches the SDK's listener in
/// order, and nothing of a group passes its failed message.
async fn two_message_groups_reach_a_push_consumer_in_order(sdk: Sdk, popgate: &Popgate, topic: &str, group: &str) {
    let produce = json!({"topic": topic, "count": 8, "prefix": "o", "messageGroup": "mg{i}"});
    // Two message groups: even and odd indexes (the driver substitutes {i}, so map them by hand).
    let mut produced = Vec::new();
    for parity in 0..2 {
        for n in (parity..8).step_by(2) {
            let mut one = produce.clone();
            one["count"] = json!(1);
            one["startIndex"] = json!(n);
            one["messageGroup"] = json!(format!("mg{parity}"));
            produced.push(one);
        }
    }
    // Sent in index order, each its own send, so the broker holds each group in index order.
    produced.sort_by_key(|one| one["startIndex"].as_i64());
    for one in produced {
        let result = sdk.run("produce", &args(popgate, one), DRIVER_TIMEOUT).await;
        assert_eq!(result["errors"], json!([]), "{result}");
    }

    let consume = json!({"group": group, "topic": topic, "failOnce": ["o-2"], "expectSuccess": 8, "timeoutSeconds": 90,
        "settleMillis": 1000});
    let result = sdk.run("push-consume", &args(popgate, consume), DRIVER_TIMEOUT).await;
    assert_eq!(result["timedOut"], false, "{result}");
    let mut per_group: HashMap<String, Vec<(String, String)>> = HashMap::new();
    let mut calls = result["received"].as_array().cloned().unwrap_or_default();
    calls.sort_by_key(|c| c["seq"].as_i64());
    for call in calls {
        let group = call["messageGroup"].as_str().unwrap_or_default().to_owned();
        per_group.entry(group).or_default().push((
            call["body"].as_str().unwrap_or_default().to_owned(),
            call["result"].as_str().unwrap_or_default().to_owned(),
        ));
    }
    let even: Vec<&str> = per_group["mg0"].iter().map(|(b, _)| b.as_str()).collect();
    let odd: Vec<&str> = per_group["mg1"].iter().map(|(b, _)| b.as_str()).collect();
    assert_eq!(even, ["o-0", "o-2", "o-2", "o-4", "o-6"], "o-2 failed once and nothing passed it: {per_group:?}");
    assert_eq!(odd, ["o-1", "o-3", "o-5", "o-7"], "{per_group:?}");
}

async fn push_consumer_acks_with_handles_issued_before_popgate_was_killed_and_nothing_is_delivered_twice(sdk: Sdk) {
    let cluster = shared_cluster();
    // A short broker lease: a message whose ACK were lost would come back from the broker within seconds.
    let mut popgate = Popgate::start(&cluster.namesrv_addr, "lease_ms = 5000\n").await;
    let topic = unique_topic("grpc_durable");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    let bodies_sent: Vec<String> = (0..4).map(|n| format!("d-{n}")).collect();
    popgate.publish_bodies(&topic, &bodies_sent).await;

    // Each listener call holds its message for 75 s: longer than popgate's 30 s hold of an auto-renewed
    // delivery (so the hold is renewed, across the restart too), and longer than the 60 s invisible time of
    // Apache's proxy, past which the same scenario against the proxy delivers every message twice.
    let consume = json!({"group": group, "topic": topic, "holdMillis": 75_000, "expect": 4, "timeoutSeconds": 150,
        "settleMillis": 3000});
    let consumer = sdk.start("push-consume", &args(&popgate, consume));
    eventually(Duration::from_secs(90), "the listener holds all four", || async {
        let (_, body) = popgate.get_json(&format!("/admin/deliveries?group={group}")).await;
        body["deliveries"].as_array().is_some_and(|d| d.len() == 4 && d.iter().all(|d| d["phase"] == "awaiting_ack"))
    })
    .await;
    // The SDK hands received messages to its listener threads a moment later.
    tokio::time::sleep(Duration::from_secs(2)).await;
    popgate.restart().await;

    let result = consumer.finish(DRIVER_TIMEOUT).await;
    assert_eq!(result["timedOut"], false, "{result}");
    let by_body = received_by_body(&result);
    for body in &bodies_sent {
        assert_eq!(by_body.get(body).map(Vec::len), Some(1), "{body} reached the listener exactly once: {result}");
    }
    eventually(Duration::from_secs(20), "the post-crash ACKs are settled at the broker", || async {
        popgate.get_json(&format!("/admin/deliveries?group={group}")).await.1["deliveries"]
            .as_array()
            .is_some_and(Vec::is_empty)
    })
    .await;
    assert!(popgate.metric("popgate_acks_total{result=\"acked\"}").await >= 4.0, "the restarted popgate took the ACKs");
    drop(popgate);
    // Past the 5 s lease: an unACKed message would be back at the broker by now.
    let again =
        DirectConsumer::connect(&cluster.namesrv_addr).await.drain(&group, &topic, Duration::from_secs(10)).await;
    assert_eq!(again, Vec::<String>::new(), "nothing comes back from the broker");
}

async fn http_publishes_reach_grpc_consumers_and_grpc_publishes_reach_http_subscribers(sdk: Sdk) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_mixed");
    create_topic(cluster, &topic).await;

    popgate.publish(&json!({"topic": topic, "data": "from-http", "properties": {"origin": "http"}})).await;
    let consume =
        json!({"group": format!("g1_{topic}"), "topic": topic, "expect": 1, "awaitSeconds": 3, "timeoutSeconds": 60});
    let result = sdk.run("simple-consume", &args(&popgate, consume), DRIVER_TIMEOUT).await;
    assert_eq!(bodies(&result, "received"), ["from-http"], "{result}");
    assert_eq!(result["received"][0]["properties"]["origin"], "http");

    let produce = json!({"topic": topic, "count": 1, "prefix": "from-grpc", "tag": "sdk"});
    let sent = sdk.run("produce", &args(&popgate, produce), DRIVER_TIMEOUT).await;
    let group = format!("g2_{topic}");
    // A new group starts at the queue's beginning, so both messages are there; the SDK's is the one tagged.
    let polled = popgate.poll_until(&group, &topic, 2, Duration::from_secs(30)).await;
    let from_sdk = polled.iter().find(|d| d["event"]["tags"] == "sdk").expect("the SDK's message reached HTTP");
    assert_eq!(crate::harness::popgate::data(from_sdk), "from-grpc-0");
    assert_eq!(from_sdk["event"]["id"], sent["sent"][0]["messageId"]);
    for delivery in &polled {
        assert_eq!(popgate.ack(&crate::harness::popgate::id(delivery)).await.0, 200);
    }
}

async fn sdk_credentials_map_onto_popgates_tokens_and_a_bad_secret_or_scope_is_refused(sdk: Sdk) {
    let cluster = shared_cluster();
    let tokens = "[auth]\nenabled = true\n[[auth.tokens]]\nname = \"app\"\ntoken = \"app-secret-0123456789\"\n\
                  publish = [\"grpc_auth_*\"]\nconsume = [\"g_grpc_auth_*\"]\n";
    let popgate = Popgate::start(&cluster.namesrv_addr, tokens).await;
    let topic = unique_topic("grpc_auth");
    create_topic(cluster, &topic).await;
    let creds = |secret: &str| json!({"accessKey": "app", "secretKey": secret});

    let mut good = creds("app-secret-0123456789");
    good["topic"] = json!(topic);
    good["count"] = json!(1);
    let result = sdk.run("produce", &args(&popgate, good), DRIVER_TIMEOUT).await;
    assert_eq!(result["errors"], json!([]), "{result}");

    let mut bad = creds("wrong-secret-0123456789");
    bad["topic"] = json!(topic);
    bad["prefix"] = json!("forged");
    let refused = sdk.start("produce", &args(&popgate, bad));
    let refused = refused.finish_allowing_error(DRIVER_TIMEOUT).await;
    assert!(refused.to_string().contains("Unauthorized"), "a bad signature is refused: {refused}");

    let other = unique_topic("grpc_other");
    create_topic(cluster, &other).await;
    let mut out_of_scope = creds("app-secret-0123456789");
    out_of_scope["topic"] = json!(other);
    // The producer's Settings name a topic its token may not publish to: refused UNAUTHORIZED, as Apache's
    // proxy (ACL 2.0) refuses them, so the SDK does not start and sends nothing.
    let refused = sdk.start("produce", &args(&popgate, out_of_scope)).finish_allowing_error(DRIVER_TIMEOUT).await;
    assert!(refused.get("cause").is_some(), "out of scope, the producer does not start: {refused}");
    let telemetry = popgate.metric(r#"popgate_grpc_requests_total{rpc="Telemetry",code="UNAUTHORIZED"}"#).await;
    assert!(telemetry >= 1.0, "its Settings were refused: {}", popgate.metrics_text().await);

    let stored = Direct::connect(&cluster.namesrv_addr).await.read_all(&topic).await;
    assert_eq!(stored.len(), 1, "only the signed message is stored");
    assert!(Direct::connect(&cluster.namesrv_addr).await.read_all(&other).await.is_empty());
    let metrics = popgate.metrics_text().await;
    assert!(metrics.contains("code=\"UNAUTHORIZED\""), "refusals are counted by code");
}
