//! The publish path against real brokers: what reaches the broker, CloudEvents mapping, the documented 4xx,
//! retries onto another broker with fault avoidance, and 503 when no broker can store.

use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::direct::Direct;
use crate::harness::popgate::{status_and_json, Popgate};
use crate::harness::rocketmq::{Cluster, ClusterSpec};
use crate::harness::{eventually, unique_topic};

/// Two brokers shared by the tests that neither stop nor reconfigure a broker.
pub fn shared_cluster() -> &'static Cluster {
    static SHARED: OnceLock<Cluster> = OnceLock::new();
    SHARED.get_or_init(|| Cluster::start(&ClusterSpec::brokers(&["broker-a", "broker-b"])))
}

fn broker_addrs(cluster: &Cluster) -> Vec<String> {
    cluster.brokers.iter().map(|b| format!("127.0.0.1:{}", b.port)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_event_reaches_the_broker_with_body_tags_keys_and_properties() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("pub_roundtrip");

    let (status, answer) = popgate
        .publish(&json!({"topic": topic, "data": "hello broker", "tags": "created", "keys": ["order-1", "cust-9"],
            "properties": {"tenant": "acme"}}))
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["topic"], topic.as_str());
    assert_eq!(answer["status"], "SEND_OK");
    assert_eq!(answer["attempts"], 1);
    assert!(answer["messageId"].as_str().is_some_and(|id| !id.is_empty()), "{answer}");
    assert!(answer["broker"].as_str().is_some_and(|b| b.starts_with("broker-")), "{answer}");

    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let stored = direct.read_all(&topic).await;
    assert_eq!(stored.len(), 1, "exactly the one message is stored");
    let m = &stored[0];
    assert_eq!(m.body, b"hello broker");
    assert_eq!(m.property("TAGS"), Some("created"));
    assert_eq!(m.property("KEYS"), Some("order-1 cust-9"));
    assert_eq!(m.property("tenant"), Some("acme"));
    assert_eq!(m.property("UNIQ_KEY"), answer["messageId"].as_str());
    assert_eq!(Some(m.broker.as_str()), answer["broker"].as_str());
    assert!(popgate.metric("popgate_publish_requests_total{result=\"ok\",transport=\"http\"}").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_in_structured_and_binary_mode_map_attributes_to_properties() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("pub_ce");
    let client = reqwest::Client::new();

    let structured = json!({"specversion": "1.0", "id": "evt-1", "source": "/shop", "type": "order.created",
        "subject": "o-1", "datacontenttype": "application/json", "data": {"total": 42}});
    let resp = client
        .post(format!("{}/events/publish?topic={topic}", popgate.base))
        .header("content-type", "application/cloudevents+json")
        .body(structured.to_string())
        .send()
        .await
        .expect("request");
    let (status, answer) = status_and_json(resp).await;
    assert_eq!(status, 200, "{answer}");

    let resp = client
        .post(format!("{}/events/publish?topic={topic}", popgate.base))
        .header("ce-specversion", "1.0")
        .header("ce-id", "evt-2")
        .header("ce-source", "/billing")
        .header("ce-type", "invoice.paid")
        .header("content-type", "text/plain")
        .body("paid")
        .send()
        .await
        .expect("request");
    let (status, answer) = status_and_json(resp).await;
    assert_eq!(status, 200, "{answer}");

    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let stored = direct.read_all(&topic).await;
    assert_eq!(stored.len(), 2);
    let by_id = |id: &str| stored.iter().find(|m| m.property("ce_id") == Some(id)).expect("event stored").clone();
    let first = by_id("evt-1");
    assert_eq!(first.body, br#"{"total":42}"#);
    assert_eq!(first.property("ce_source"), Some("/shop"));
    assert_eq!(first.property("ce_type"), Some("order.created"));
    assert_eq!(first.property("ce_subject"), Some("o-1"));
    assert_eq!(first.property("ce_specversion"), Some("1.0"));
    assert_eq!(first.property("KEYS"), Some("evt-1"), "the event id is the message key");
    let second = by_id("evt-2");
    assert_eq!(second.body, b"paid");
    assert_eq!(second.property("ce_type"), Some("invoice.paid"));
    assert_eq!(second.property("ce_datacontenttype"), Some("text/plain"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_wrong_typed_and_oversized_bodies_get_the_documented_4xx() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "[publish]\nmax_message_bytes = 1024\n").await;
    let topic = unique_topic("pub_bad");
    let client = reqwest::Client::new();
    let url = format!("{}/events/publish", popgate.base);

    let resp =
        client.post(&url).header("content-type", "application/json").body("{not json").send().await.expect("req");
    let (status, body) = status_and_json(resp).await;
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("malformed_body")), "{body}");

    let cases: Vec<(Value, &str)> = vec![
        (json!({"data": "x"}), "topic"),
        (json!({"topic": "bad topic", "data": "x"}), "topic"),
        (json!({"topic": topic, "data": "x", "tags": 7}), "tags"),
        (json!({"topic": topic, "data": "x", "keys": {"a": 1}}), "keys"),
        (json!({"topic": topic, "data": "x", "properties": {"n": 1}}), "properties.n"),
        (json!({"topic": topic, "data": "x", "delayMs": "soon"}), "delayMs"),
        (json!({"topic": topic, "dataBase64": "***"}), "dataBase64"),
        (json!({"topic": topic}), "data"),
    ];
    for (body, field) in cases {
        let (status, answer) = popgate.publish(&body).await;
        assert_eq!(status, 400, "{body} -> {answer}");
        assert_eq!(answer["error"]["field"], field, "{body} -> {answer}");
        assert!(answer["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }

    let (status, answer) = popgate.publish(&json!({"topic": topic, "data": "x".repeat(2048)})).await;
    assert_eq!((status, answer["error"]["code"].as_str()), (413, Some("too_large")), "{answer}");
    // Larger than even the HTTP body limit: still a JSON 413, not a dropped connection.
    let huge = json!({"topic": topic, "data": "y".repeat(200_000)});
    let (status, answer) = popgate.publish(&huge).await;
    assert_eq!((status, answer["error"]["code"].as_str()), (413, Some("too_large")), "{answer}");

    let resp =
        client.post(format!("{url}?mode=later")).json(&json!({"topic": topic, "data": "x"})).send().await.expect("req");
    let (status, answer) = status_and_json(resp).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("mode")), "{answer}");

    assert!(popgate.metric("popgate_publish_requests_total{result=\"bad_request\",transport=\"http\"}").await >= 10.0);
    // The message over max_message_bytes is the publish path's own 413; the body over the HTTP limit is refused
    // before it is read, by the request guard.
    assert!(popgate.metric("popgate_publish_requests_total{result=\"too_large\",transport=\"http\"}").await >= 1.0);
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"body_too_large\"}").await >= 1.0);
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    direct.create_topic(&topic, &broker_addrs(cluster)).await;
    assert!(direct.read_all(&topic).await.is_empty(), "no rejected event was half-sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oneway_is_accepted_without_confirmation_and_async_is_confirmed() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("pub_modes");
    let client = reqwest::Client::new();
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    direct.create_topic(&topic, &broker_addrs(cluster)).await;

    let resp = client
        .post(format!("{}/events/publish?mode=oneway", popgate.base))
        .json(&json!({"topic": topic, "data": "fire"}))
        .send()
        .await
        .expect("req");
    let (status, answer) = status_and_json(resp).await;
    assert_eq!((status, answer["status"].as_str()), (202, Some("SENT_ONEWAY")), "{answer}");

    let resp = client
        .post(format!("{}/events/publish?mode=async", popgate.base))
        .json(&json!({"topic": topic, "data": "callback"}))
        .send()
        .await
        .expect("req");
    let (status, answer) = status_and_json(resp).await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("SEND_OK")), "{answer}");

    eventually(Duration::from_secs(10), "both messages stored", || async { direct.read_all(&topic).await.len() == 2 })
        .await;
    assert_eq!(popgate.metric("popgate_publish_requests_total{result=\"accepted\",transport=\"http\"}").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_topic_is_404_when_the_broker_does_not_auto_create() {
    let mut spec = ClusterSpec::brokers(&["broker-a"]);
    spec.broker_conf = vec!["autoCreateTopicEnable=false".to_owned()];
    let cluster = Cluster::start(&spec);
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;

    let (status, answer) = popgate.publish(&json!({"topic": unique_topic("nowhere"), "data": "x"})).await;
    assert_eq!(status, 404, "{answer}");
    assert_eq!(answer["error"]["code"], "unknown_topic");
    assert_eq!(answer["error"]["field"], "topic");
    assert_eq!(popgate.metric("popgate_publish_requests_total{result=\"not_found\",transport=\"http\"}").await, 1.0);

    let topic = unique_topic("precreated");
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    direct.create_topic(&topic, &broker_addrs(&cluster)).await;
    eventually(Duration::from_secs(15), "a pre-created topic is publishable", || async {
        popgate.publish(&json!({"topic": topic, "data": "x"})).await.0 == 200
    })
    .await;
}

/// popgate with short timeouts so a hung broker is noticed quickly and its isolation ends within the test.
/// A slow send isolates no broker here (`not_available_ms` all 0): on a loaded machine a warm-up send can
/// take a second, and latency isolation of broker-a before the pause would keep the test's sends off it.
/// The test is about the hung broker's network-error isolation alone.
const FAILOVER_CONFIG: &str =
    "[publish]\nsend_timeout_ms = 1000\n\n[fault_avoidance]\nnetwork_error_isolation_ms = 8000\n\
     latency_max_ms = [50, 100, 550, 1000, 2000, 3000, 15000]\nnot_available_ms = [0, 0, 0, 0, 0, 0, 0]\n\n\
     [broker]\nroute_ttl_ms = 300000\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_broker_is_retried_around_isolated_and_restored_after_sigcont() {
    let cluster = Cluster::start(&ClusterSpec::brokers(&["broker-a", "broker-b"]));
    let popgate = Popgate::start(&cluster.namesrv_addr, FAILOVER_CONFIG).await;
    let topic = unique_topic("failover");
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    direct.create_topic(&topic, &broker_addrs(&cluster)).await;
    eventually(Duration::from_secs(15), "both brokers take the topic", || async {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..4 {
            let (status, answer) = popgate.publish(&json!({"topic": topic, "data": "warm"})).await;
            if status == 200 {
                seen.insert(answer["broker"].as_str().unwrap_or_default().to_owned());
            }
        }
        seen.len() == 2
    })
    .await;

    cluster.pause_broker("broker-a");
    let mut answers = Vec::new();
    for i in 0..6 {
        let (status, answer) = popgate.publish(&json!({"topic": topic, "data": format!("during-{i}")})).await;
        assert_eq!(status, 200, "a send must retry onto broker-b: {answer}");
        assert_eq!(answer["broker"], "broker-b", "{answer}");
        answers.push(answer);
    }
    let retried = answers.iter().position(|a| a["attempts"] == 2).expect("one publish hit broker-a and retried");
    assert!(
        answers[retried + 1..].iter().all(|a| a["attempts"] == 1),
        "once isolated, broker-a is skipped: {answers:?}"
    );
    assert_eq!(popgate.metric("popgate_broker_isolated{broker=\"broker-a\"}").await, 1.0);
    assert!(popgate.metric("popgate_broker_isolations_total{broker=\"broker-a\",cause=\"unreachable\"}").await >= 1.0);
    assert!(popgate.metric("popgate_send_retries_total").await >= 1.0);
    assert!(popgate.metric("popgate_send_failures_total{reason=\"timeout\"}").await >= 1.0);

    cluster.resume_broker("broker-a");
    eventually(Duration::from_secs(20), "broker-a's isolation ends", || async {
        popgate.metric("popgate_broker_isolated{broker=\"broker-a\"}").await == 0.0
    })
    .await;
    eventually(Duration::from_secs(20), "sends reach broker-a again", || async {
        let (status, answer) = popgate.publish(&json!({"topic": topic, "data": "after"})).await;
        status == 200 && answer["broker"] == "broker-a"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_broker_down_is_503_with_the_attempts_and_counted() {
    let mut cluster = Cluster::start(&ClusterSpec::brokers(&["broker-a"]));
    let popgate = Popgate::start(&cluster.namesrv_addr, FAILOVER_CONFIG).await;
    let topic = unique_topic("alldown");
    let (status, answer) = popgate.publish(&json!({"topic": topic, "data": "before"})).await;
    assert_eq!(status, 200, "{answer}");

    cluster.kill_broker("broker-a");
    let (status, answer) = popgate.publish(&json!({"topic": topic, "data": "lost?"})).await;
    assert_eq!(status, 503, "{answer}");
    assert_eq!(answer["error"]["code"], "unavailable");
    let attempts = answer["error"]["attempts"].as_array().expect("attempts listed");
    assert_eq!(attempts.len(), 3, "1 + retryTimesWhenSendFailed attempts: {answer}");
    assert!(attempts.iter().all(|a| a["error"].is_string()), "{answer}");
    assert_eq!(popgate.metric("popgate_publish_requests_total{result=\"unavailable\",transport=\"http\"}").await, 1.0);
    let failures = popgate.metric("popgate_send_failures_total{reason=\"network\"}").await
        + popgate.metric("popgate_send_failures_total{reason=\"timeout\"}").await;
    assert!(failures >= 3.0, "every failed attempt is counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_a_broker_registered_with_the_name_server() {
    // A name server that answers but has no broker yet (one still starting) cannot store a publish.
    let lonely = Cluster::start(&ClusterSpec::brokers(&[]));
    let popgate = Popgate::start(&lonely.namesrv_addr, "").await;
    let (status, ready) = popgate.get_json("/readyz").await;
    assert_eq!(status, 503, "{ready}");
    assert_eq!(ready["broker"], "no broker has registered with the name server yet", "{ready}");

    let (status, ready) = Popgate::start(&shared_cluster().namesrv_addr, "").await.get_json("/readyz").await;
    assert_eq!((status, ready["broker"].as_str()), (200, Some("ok")), "{ready}");
}

/// A publish sent again (a producer retrying after a lost answer) is stored once: an `Idempotency-Key` or a
/// CloudEvent's source and id names it, and the repeat is answered with the first receipt, also after a
/// `kill -9` of popgate. Before the de-duplication window, each repeat was stored again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_repeated_under_its_idempotency_key_or_cloudevent_id_is_stored_once_across_a_restart() {
    let cluster = shared_cluster();
    let mut popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("pub_dedup");
    let client = reqwest::Client::new();
    let url = |popgate: &Popgate| format!("{}/events/publish?topic={topic}", popgate.base);
    let keyed = |popgate: &Popgate, key: &str, data: &str| {
        client
            .post(url(popgate))
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(json!({"data": data}).to_string())
    };
    let event = |id: &str| {
        client
            .post(url(&popgate))
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", "/orders")
            .header("ce-type", "order.paid")
            .body("paid")
    };

    let (status, first) = status_and_json(keyed(&popgate, "order-1", "a").send().await.expect("request")).await;
    assert_eq!((status, first["deduplicated"].clone()), (200, json!(false)), "{first}");
    let (status, again) = status_and_json(keyed(&popgate, "order-1", "a").send().await.expect("request")).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["deduplicated"], true, "{again}");
    for field in ["messageId", "broker", "queueId", "queueOffset"] {
        assert_eq!(again[field], first[field], "the first receipt's {field}: {first} {again}");
    }
    let (_, event_first) = status_and_json(event("evt-9").send().await.expect("request")).await;
    let (_, event_again) = status_and_json(event("evt-9").send().await.expect("request")).await;
    assert_eq!(event_again["deduplicated"], true, "{event_again}");
    assert_eq!(event_again["messageId"], event_first["messageId"]);

    // Remembered in the state store: a restart does not make a repeat new.
    popgate.restart().await;
    let (status, after) = status_and_json(keyed(&popgate, "order-1", "a").send().await.expect("request")).await;
    assert_eq!((status, after["deduplicated"].clone()), (200, json!(true)), "{after}");
    assert_eq!(after["messageId"], first["messageId"]);
    // Another key is another message; a key that is not one is refused, naming the header.
    let (_, other) = status_and_json(keyed(&popgate, "order-2", "b").send().await.expect("request")).await;
    assert_eq!(other["deduplicated"], false, "{other}");
    let (status, bad) = status_and_json(keyed(&popgate, "", "c").send().await.expect("request")).await;
    assert_eq!(status, 400, "{bad}");
    assert_eq!(bad["error"]["field"], "Idempotency-Key", "{bad}");

    let stored = Direct::connect(&cluster.namesrv_addr).await.read_all(&topic).await;
    let mut bodies: Vec<String> = stored.iter().map(|m| String::from_utf8_lossy(&m.body).into_owned()).collect();
    bodies.sort();
    assert_eq!(bodies, ["a", "b", "paid"], "each message stored once");
    assert_eq!(popgate.metric("popgate_publish_deduplicated_total").await, 1.0, "since the restart");
}

/// A batch publish (a JSON array body; CloudEvents' batched mode) is one broker request: every message stored
/// in one queue at consecutive offsets, each with its own id, tag, keys and properties, a message group's batch
/// in that group's queue, and each message delivered to a subscriber on its own. What a batch cannot hold is
/// refused naming its element and field, counted, and nothing of it is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_stored_whole_in_one_queue_and_each_message_is_delivered_on_its_own() {
    const SENT: usize = 12;
    let cluster = shared_cluster();
    let config = "[publish]\nmax_batch_messages = 20\nmax_message_bytes = 4096\n";
    let popgate = Popgate::start(&cluster.namesrv_addr, config).await;
    let (topic, group) = (unique_topic("pub_batch"), unique_topic("pub_batch_g"));
    let batch: Vec<Value> = (0..SENT)
        .map(|i| {
            json!({"topic": topic, "data": format!("b-{i}"), "tags": if i % 2 == 0 { "even" } else { "odd" },
                "keys": [format!("k-{i}")], "properties": {"n": i.to_string()}})
        })
        .collect();
    let (status, answer) = popgate.publish(&Value::Array(batch)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!((answer["status"].as_str(), answer["attempts"].as_u64()), (Some("SEND_OK"), Some(1)), "{answer}");
    let messages = answer["messages"].as_array().cloned().unwrap_or_default();
    assert_eq!(messages.len(), SENT, "{answer}");
    let first_offset = messages[0]["queueOffset"].as_u64().expect("an offset");
    let ids: Vec<&str> = messages.iter().map(|m| m["messageId"].as_str().unwrap_or_default()).collect();
    for (i, message) in messages.iter().enumerate() {
        assert_eq!(message["queueOffset"].as_u64(), Some(first_offset + i as u64), "consecutive: {answer}");
        assert!(!ids[i].is_empty() && !ids[..i].contains(&ids[i]), "ids are distinct: {answer}");
    }

    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let stored = direct.read_all(&topic).await;
    assert_eq!(stored.len(), SENT, "every message stored once");
    for (i, m) in stored.iter().enumerate() {
        let place = (Some(m.broker.as_str()), i64::from(m.queue_id));
        assert_eq!(place, (answer["broker"].as_str(), answer["queueId"].as_i64().unwrap_or(-1)), "one queue");
        assert_eq!(String::from_utf8_lossy(&m.body), format!("b-{i}"), "in the order sent");
        assert_eq!(m.property("UNIQ_KEY"), Some(ids[i]));
        assert_eq!(m.property("TAGS"), Some(if i % 2 == 0 { "even" } else { "odd" }));
        assert_eq!(m.property("KEYS"), Some(format!("k-{i}").as_str()));
        assert_eq!(m.property("n"), Some(i.to_string().as_str()));
    }
    let deliveries = popgate.poll_until(&group, &topic, SENT, Duration::from_secs(30)).await;
    let mut delivered: Vec<(String, String)> = deliveries
        .iter()
        .map(|d| (d["event"]["id"].as_str().unwrap_or_default().to_owned(), d["event"]["data"].to_string()))
        .collect();
    delivered.sort();
    let mut expected: Vec<(String, String)> =
        ids.iter().enumerate().map(|(i, id)| ((*id).to_owned(), json!(format!("b-{i}")).to_string())).collect();
    expected.sort();
    assert_eq!(delivered, expected, "each message delivered on its own, under its id");

    // A message group's batch goes to that group's queue, as one message of the group does.
    let (status, single) = popgate.publish(&json!({"topic": topic, "data": "one", "messageGroup": "order-7"})).await;
    assert_eq!(status, 200, "{single}");
    let grouped = json!([{"topic": topic, "data": "g-0", "messageGroup": "order-7"},
        {"topic": topic, "data": "g-1", "messageGroup": "order-7"}]);
    let (status, answer) = popgate.publish(&grouped).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!((&answer["broker"], &answer["queueId"]), (&single["broker"], &single["queueId"]), "{answer}");
    let single_offset = single["queueOffset"].as_u64().unwrap_or_default();
    assert_eq!(answer["messages"][0]["queueOffset"].as_u64(), Some(single_offset + 1), "{answer}");

    // CloudEvents' batched mode: each event a structured one, its attributes its message's properties.
    let ce_topic = unique_topic("pub_batch_ce");
    let events = json!([
        {"specversion": "1.0", "id": "e-1", "source": "/shop", "type": "order.created", "data": {"n": 1}},
        {"specversion": "1.0", "id": "e-2", "source": "/shop", "type": "order.paid", "data": "paid"}]);
    let resp = reqwest::Client::new()
        .post(format!("{}/events/publish?topic={ce_topic}", popgate.base))
        .header("content-type", "application/cloudevents-batch+json")
        .body(events.to_string())
        .send()
        .await
        .expect("request");
    let (status, answer) = status_and_json(resp).await;
    assert_eq!((status, answer["messages"].as_array().map(Vec::len)), (200, Some(2)), "{answer}");
    let stored = direct.read_all(&ce_topic).await;
    let types: Vec<Option<&str>> = stored.iter().map(|m| m.property("ce_type")).collect();
    assert_eq!(types, [Some("order.created"), Some("order.paid")]);
    assert_eq!(stored[1].property("KEYS"), Some("e-2"), "the event id is the message key");

    let refused_topic = unique_topic("pub_batch_bad");
    let ok = |data: &str| json!({"topic": refused_topic, "data": data});
    let too_many: Vec<Value> = (0..21).map(|i| ok(&format!("m-{i}"))).collect();
    let cases: Vec<(Value, u16, Option<&str>)> = vec![
        (json!([]), 400, None),
        (json!([ok("a"), {"topic": topic, "data": "b"}]), 400, Some("[1].topic")),
        (json!([ok("a"), {"topic": refused_topic, "data": "b", "delayMs": 1000}]), 400, Some("[1].delayMs")),
        (json!([{"topic": refused_topic, "data": "a", "transaction": true}]), 400, Some("[0].transaction")),
        (json!([{"topic": refused_topic, "data": "a", "messageGroup": "g1"}, ok("b")]), 400, Some("[1].messageGroup")),
        (json!([ok("a"), "text"]), 400, Some("[1]")),
        (json!([ok("a"), {"topic": refused_topic}]), 400, Some("[1].data")),
        (json!([ok("a"), {"topic": refused_topic, "data": "b", "tags": 7}]), 400, Some("[1].tags")),
        (Value::Array(too_many), 400, Some("[20]")),
        (Value::Array((0..5).map(|_| ok(&"x".repeat(1000))).collect()), 413, Some("data")),
    ];
    let bad_before = popgate.metric("popgate_publish_requests_total{result=\"bad_request\",transport=\"http\"}").await;
    for (body, code, field) in &cases {
        let (status, answer) = popgate.publish(body).await;
        assert_eq!(status, *code, "{body} -> {answer}");
        assert_eq!(answer["error"]["field"].as_str(), *field, "{body} -> {answer}");
    }
    let client = reqwest::Client::new();
    let url = format!("{}/events/publish", popgate.base);
    let keyed = client.post(&url).header("idempotency-key", "k").json(&json!([ok("a")])).send().await.expect("req");
    let (status, answer) = status_and_json(keyed).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("Idempotency-Key")), "{answer}");
    let half = client.post(format!("{url}?transaction=true")).json(&json!([ok("a")])).send().await.expect("req");
    let (status, answer) = status_and_json(half).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("transaction")), "{answer}");
    let bad = popgate.metric("popgate_publish_requests_total{result=\"bad_request\",transport=\"http\"}").await;
    assert!(bad - bad_before >= 11.0, "every refused batch is counted: {}", bad - bad_before);
    direct.create_topic(&refused_topic, &broker_addrs(cluster)).await;
    assert!(direct.read_all(&refused_topic).await.is_empty(), "nothing of a refused batch is stored");
}
