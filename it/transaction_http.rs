//! Transactional publishes over HTTP: `POST /events/publish {"transaction": true}`, ended with
//! `POST /events/transactions/{id}`, checked back through the producer group's checker URL. Each test checks
//! what the HTTP client saw and what the broker holds.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;

use crate::harness::direct::Direct;
use crate::harness::popgate::{data, Popgate};
use crate::harness::rocketmq::{Cluster, ClusterSpec};
use crate::harness::unique_topic;
use crate::publish::shared_cluster;
use crate::transaction::{create_transaction_topic, stored_bodies};

const CHECKER_SECRET: &str = "checker-secret-0123456789";

/// A transactional publish of `body`; asserts a 200 and returns the answer.
async fn publish_half(popgate: &Popgate, topic: &str, body: &str, extra: Value) -> Value {
    let mut request = json!({"topic": topic, "data": body, "transaction": true});
    if let (Some(request), Some(extra)) = (request.as_object_mut(), extra.as_object()) {
        request.extend(extra.clone());
    }
    let (status, answer) = popgate.publish(&request).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["transactionId"], answer["messageId"], "the transaction id is the message id: {answer}");
    answer
}

async fn end(popgate: &Popgate, id: &str, resolution: &str) -> (u16, Value) {
    popgate.post_json(&format!("/events/transactions/{id}"), &json!({ "resolution": resolution })).await
}

/// The half-topic queue offsets the broker `broker` recorded as removed (its op-half topic: every commit or
/// rollback writes one, and the broker never checks a removed half message back).
async fn removed_half_offsets(cluster: &Cluster, broker: &str) -> Vec<i64> {
    let Some(port) = cluster.brokers.iter().find(|b| b.name == broker).map(|b| b.port) else { return vec![] };
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let ops = direct.read_queue(broker, &format!("127.0.0.1:{port}"), "RMQ_SYS_TRANS_OP_HALF_TOPIC", 0).await;
    ops.iter()
        .flat_map(|m| {
            let body = String::from_utf8_lossy(&m.body).into_owned();
            body.split(',').filter_map(|o| o.trim().parse().ok()).collect::<Vec<i64>>()
        })
        .collect()
}

/// popgate dies while its broker holds a commit it has taken but not answered (the broker paused); the broker
/// then commits. Nothing but popgate's stored intent tells it after the restart that the commit may have landed:
/// the producer's retry and the owed retries look the committed message up instead of committing it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_popgate_died_waiting_for_is_looked_up_after_the_restart_and_stored_once() {
    // A broker of its own: it is paused. popgate waits 60 s for a broker's answer, so it is killed while waiting.
    let cluster = Cluster::start(&ClusterSpec::brokers(&["broker-a"]));
    let debug = "info,popgate::transaction=debug,rocketmq_client_rust=warn,rocketmq_transport=warn";
    let config = "[broker]\nrequest_timeout_ms = 60000\n";
    let mut popgate = Popgate::start_with_env(&cluster.namesrv_addr, config, &[("RUST_LOG", debug)]).await;
    let topic = unique_topic("txh_lost_answer");
    create_transaction_topic(&cluster, &topic).await;
    let sent = publish_half(&popgate, &topic, "once", json!({})).await;
    let id = sent["transactionId"].as_str().unwrap_or_default().to_owned();

    cluster.pause_broker("broker-a");
    let url = format!("{}/events/transactions/{id}", popgate.base);
    let waiting = tokio::spawn(async move {
        let _ = reqwest::Client::new().post(url).json(&json!({"resolution": "commit"})).send().await;
    });
    crate::harness::eventually(Duration::from_secs(30), "popgate sends the commit", || async {
        popgate.output().contains("END_TRANSACTION")
    })
    .await;
    // The frame is in the broker's socket; popgate dies before any answer.
    tokio::time::sleep(Duration::from_millis(500)).await;
    popgate.kill9();
    waiting.abort();
    cluster.resume_broker("broker-a");
    crate::harness::eventually(Duration::from_secs(30), "the broker commits what it took", || async {
        stored_bodies(&cluster, &topic).await == ["once"]
    })
    .await;

    popgate.restart().await;
    // The producer never heard back, and commits again.
    let (status, answer) = end(&popgate, &id, "commit").await;
    assert!(status == 200 || status == 202, "{status} {answer}");
    crate::harness::eventually(Duration::from_secs(30), "the end is stored as landed", || async {
        popgate.metric("popgate_transactions_ended_total{resolution=\"commit\",result=\"landed\"}").await >= 1.0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(stored_bodies(&cluster, &topic).await, ["once"], "committed once, not twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_transaction_is_delivered_once_after_its_commit_and_never_after_its_rollback() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let (topic, group) = (unique_topic("txh_commit"), unique_topic("g_txh_commit"));
    create_transaction_topic(cluster, &topic).await;

    let kept = publish_half(&popgate, &topic, "kept", json!({})).await;
    let dropped = publish_half(&popgate, &topic, "dropped", json!({})).await;
    let kept_id = kept["transactionId"].as_str().unwrap_or_default().to_owned();
    let dropped_id = dropped["transactionId"].as_str().unwrap_or_default().to_owned();
    let (_, shown) = popgate.get_json(&format!("/events/transactions/{kept_id}")).await;
    assert_eq!(shown["state"], "open", "{shown}");
    assert!(popgate.poll(&group, &topic, 10, 3_000).await.is_empty(), "nothing is delivered before a commit");

    let (status, answer) = end(&popgate, &kept_id, "commit").await;
    assert_eq!((status, answer["state"].as_str()), (200, Some("ended")), "{answer}");
    let (status, answer) = end(&popgate, &dropped_id, "rollback").await;
    assert_eq!((status, answer["state"].as_str()), (200, Some("ended")), "{answer}");
    let deliveries = popgate.poll_until(&group, &topic, 1, Duration::from_secs(30)).await;
    assert_eq!(deliveries.iter().map(data).collect::<Vec<_>>(), ["kept"]);
    assert_eq!(deliveries[0]["event"]["id"], json!(kept_id));
    let props = &deliveries[0]["event"]["properties"];
    assert!(props.get("__POPGATE_TX_CHECKER").is_none() && props.get("TRAN_MSG").is_none(), "{props}");
    let (status, _) = popgate.ack(deliveries[0]["deliveryId"].as_str().unwrap_or_default()).await;
    assert_eq!(status, 200);
    // Long enough for the rolled-back message to have shown: it never does.
    assert!(popgate.poll(&group, &topic, 10, 5_000).await.is_empty(), "the rolled-back message is never delivered");
    assert_eq!(stored_bodies(cluster, &topic).await, ["kept"], "stored once, the rolled-back one never");

    // Both half messages are removed at their broker: it will not check them back.
    for half in [&kept, &dropped] {
        let (broker, offset) = (half["broker"].as_str().unwrap_or_default(), half["queueOffset"].as_i64());
        let offset = offset.unwrap_or(-1);
        crate::harness::eventually(Duration::from_secs(20), "the half message is removed", || async {
            removed_half_offsets(cluster, broker).await.contains(&offset)
        })
        .await;
    }

    // Repeated: answered as the first. The other way: refused, saying why. Unknown: 404.
    let (status, answer) = end(&popgate, &kept_id, "commit").await;
    assert_eq!((status, answer["state"].as_str()), (200, Some("ended")), "{answer}");
    let (status, answer) = end(&popgate, &dropped_id, "commit").await;
    assert_eq!(status, 409, "{answer}");
    assert!(
        answer["error"]["message"].as_str().unwrap_or_default().contains("already ended with rollback"),
        "{answer}"
    );
    let (status, answer) = end(&popgate, "0A0000000000000000000000000000FF", "commit").await;
    assert_eq!((status, answer["error"]["code"].as_str()), (404, Some("not_found")), "{answer}");
    let (_, shown) = popgate.get_json(&format!("/events/transactions/{dropped_id}")).await;
    assert_eq!((shown["state"].as_str(), shown["resolution"].as_str()), (Some("ended"), Some("rollback")), "{shown}");
    assert_eq!(popgate.metric(r#"popgate_transactions_ended_total{resolution="commit",result="landed"}"#).await, 1.0);
    assert_eq!(popgate.metric(r#"popgate_transactions_ended_total{resolution="rollback",result="landed"}"#).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_commit_after_popgate_was_killed_between_publish_and_commit_lands_at_once() {
    let cluster = shared_cluster();
    let mut popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("txh_killed");
    create_transaction_topic(cluster, &topic).await;
    let sent = publish_half(&popgate, &topic, "survives", json!({})).await;
    let id = sent["transactionId"].as_str().unwrap_or_default().to_owned();

    popgate.restart().await;
    let started = Instant::now();
    let (status, answer) = end(&popgate, &id, "commit").await;
    let took = started.elapsed();
    assert_eq!((status, answer["state"].as_str()), (200, Some("ended")), "{answer}");
    assert!(took < Duration::from_secs(5), "answered at once, not after a check-back: {took:?}");
    crate::harness::eventually(Duration::from_secs(20), "the committed message is stored", || async {
        !stored_bodies(cluster, &topic).await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(stored_bodies(cluster, &topic).await, ["survives"], "stored once");
}

/// One check-back the test checker received.
#[derive(Clone)]
struct Check {
    headers: HeaderMap,
    body: String,
}

/// A checker that fails the first check-back of each transaction (500), answers `unknown` to the second and
/// `commit` after.
#[derive(Clone, Default)]
struct Checker {
    checks: Arc<Mutex<Vec<Check>>>,
}

async fn answer_check(State(checker): State<Checker>, headers: HeaderMap, body: String) -> Response {
    let id_of = |h: &HeaderMap| h.get("x-popgate-transaction-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let mut checks = checker.checks.lock().expect("lock");
    let asked_before = checks.iter().filter(|c| id_of(&c.headers) == id_of(&headers)).count();
    checks.push(Check { headers, body });
    match asked_before {
        0 => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        1 => Json(json!({"resolution": "unknown"})).into_response(),
        _ => Json(json!({"resolution": "commit"})).into_response(),
    }
}

fn expected_signature(headers: &HeaderMap, body: &str) -> String {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let mut mac = Hmac::<Sha256>::new_from_slice(CHECKER_SECRET.as_bytes()).expect("any key length");
    mac.update(format!("{}.{}.{body}", header("x-popgate-timestamp"), header("x-popgate-transaction-id")).as_bytes());
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

fn checker_toml(url: &str) -> String {
    format!("[transactions.checkers.payments]\nurl = \"{url}\"\nsecret = \"{CHECKER_SECRET}\"\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_http_transaction_is_checked_back_through_its_groups_checker_by_another_popgate() {
    let checker = Checker::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind checker");
    let url = format!("http://{}/check", listener.local_addr().expect("addr"));
    let app = Router::new().route("/check", post(answer_check)).with_state(checker.clone());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    // The broker checks a transaction back 3 s after its send, then every 3 s.
    let mut spec = ClusterSpec::brokers(&["broker-a"]);
    spec.broker_conf = vec!["transactionTimeOut=3000".into(), "transactionCheckInterval=3000".into()];
    let cluster = Cluster::start(&spec);
    let mut first = Popgate::start(&cluster.namesrv_addr, &checker_toml(&url)).await;
    let topic = unique_topic("txh_check");
    create_transaction_topic(&cluster, &topic).await;
    let sent = publish_half(&first, &topic, "checked", json!({"producerGroup": "payments"})).await;
    let id = sent["transactionId"].as_str().unwrap_or_default().to_owned();

    // The popgate that took the publish is gone; another one, with its own state, serves the check-backs.
    first.kill9();
    let second = Popgate::start(&cluster.namesrv_addr, &checker_toml(&url)).await;
    crate::harness::eventually(Duration::from_secs(90), "the checked-back message is committed", || async {
        !stored_bodies(&cluster, &topic).await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(stored_bodies(&cluster, &topic).await, ["checked"], "committed once, by its checker's answer");

    let checks = checker.checks.lock().expect("lock").clone();
    assert!(checks.len() >= 3, "asked (failed), asked (unknown), asked again: {}", checks.len());
    for check in &checks {
        let signature = check.headers.get("x-popgate-signature").and_then(|v| v.to_str().ok()).unwrap_or_default();
        assert_eq!(signature, expected_signature(&check.headers, &check.body), "every check-back is signed");
        let body: Value = serde_json::from_str(&check.body).expect("JSON");
        assert_eq!(body["transactionId"], json!(id), "{body}");
        assert_eq!((body["topic"].as_str(), body["producerGroup"].as_str()), (Some(topic.as_str()), Some("payments")));
        assert_eq!(body["event"]["data"], "checked", "{body}");
    }
    let answered =
        |answer: &str| format!(r#"popgate_transaction_check_answers_total{{front="http",answer="{answer}"}}"#);
    // The first check may have reached the first popgate before it was killed; the commit is the second's.
    let (failed, unknown) = (second.metric(&answered("failed")).await, second.metric(&answered("unknown")).await);
    assert!(failed + unknown >= 1.0, "failed {failed}, unknown {unknown}");
    assert_eq!(second.metric(&answered("commit")).await, 1.0);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_publishes_and_ends_that_cannot_be_are_refused_naming_the_field() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(
        &cluster.namesrv_addr,
        "[[auth.tokens]]\nname = \"orders\"\ntoken = \"orders-token-0123456789\"\npublish = [\"txh_bad_orders*\"]\n\
         [[auth.tokens]]\nname = \"all\"\ntoken = \"all-token-0123456789ab\"\npublish = [\"*\"]\n",
    )
    .await;
    let topic = unique_topic("txh_bad_orders");
    let other = unique_topic("txh_bad_other");
    let normal = unique_topic("txh_bad_orders_normal");
    create_transaction_topic(cluster, &topic).await;
    create_transaction_topic(cluster, &other).await;
    crate::grpc::create_topic(cluster, &normal).await;
    let client = reqwest::Client::new();
    let call = |token: &'static str, path: String, body: Value| {
        let request = client.post(format!("{}{path}", popgate.base)).bearer_auth(token).json(&body);
        async move {
            let response = request.send().await.expect("request");
            crate::harness::popgate::status_and_json(response).await
        }
    };
    let orders = "orders-token-0123456789";
    let refused = |answer: &Value| answer["error"]["field"].as_str().unwrap_or_default().to_owned();

    let cases = [
        (json!({"topic": normal, "data": "x", "transaction": true}), "transaction"),
        (json!({"topic": topic, "data": "x", "transaction": "yes"}), "transaction"),
        (json!({"topic": topic, "data": "x", "transaction": true, "delayMs": 5000}), "delayMs"),
        (json!({"topic": topic, "data": "x", "transaction": true, "messageGroup": "g"}), "messageGroup"),
        (json!({"topic": topic, "data": "x", "transaction": true, "producerGroup": "nobody"}), "producerGroup"),
        (json!({"topic": topic, "data": "x", "producerGroup": "nobody"}), "producerGroup"),
    ];
    for (body, field) in cases {
        let (status, answer) = call(orders, "/events/publish".into(), body.clone()).await;
        assert_eq!((status, refused(&answer)), (400, field.to_owned()), "{body} -> {answer}");
    }
    let (status, answer) =
        call(orders, "/events/publish?mode=async".into(), json!({"topic": topic, "data": "x", "transaction": true}))
            .await;
    assert_eq!((status, refused(&answer)), (400, "mode".to_owned()), "{answer}");
    assert_eq!(stored_bodies(cluster, &normal).await, Vec::<String>::new(), "nothing was sent");

    // Ends: a malformed resolution; a transaction of a topic the token may not publish to.
    let (status, sent) =
        call(orders, "/events/publish".into(), json!({"topic": topic, "data": "x", "transaction": true})).await;
    assert_eq!(status, 200, "{sent}");
    let id = sent["transactionId"].as_str().unwrap_or_default().to_owned();
    for body in [json!({"resolution": "maybe"}), json!({}), json!({"resolution": "commit", "extra": 1})] {
        let (status, answer) = call(orders, format!("/events/transactions/{id}"), body.clone()).await;
        assert_eq!(status, 400, "{body} -> {answer}");
        assert!(answer["error"]["field"].is_string(), "{answer}");
    }
    let (status, foreign) = call(
        "all-token-0123456789ab",
        "/events/publish".into(),
        json!({"topic": other, "data": "y", "transaction": true}),
    )
    .await;
    assert_eq!(status, 200, "{foreign}");
    let foreign_id = foreign["transactionId"].as_str().unwrap_or_default();
    let (status, answer) =
        call(orders, format!("/events/transactions/{foreign_id}"), json!({"resolution": "commit"})).await;
    assert_eq!((status, refused(&answer)), (403, "id".to_owned()), "{answer}");
    let (status, answer) = call(orders, format!("/events/transactions/{id}"), json!({"resolution": "rollback"})).await;
    assert_eq!(status, 200, "{answer}");
    let (status, answer) =
        call("all-token-0123456789ab", format!("/events/transactions/{foreign_id}"), json!({"resolution": "rollback"}))
            .await;
    assert_eq!(status, 200, "{answer}");
}
