//! What an event's `data` looks like when it comes back over HTTP (issue #34): a JSON value published as
//! `data` comes back as that JSON value, a string as a string, bytes given as `dataBase64` as `dataBase64`,
//! the same on every way out (poll, SSE, webhook, DLQ browse). Before, JSON came back as a string holding
//! JSON (`"data":"{\"id\":1}"`), bytes that happened to be UTF-8 as `data`, and the webhook said
//! `application/octet-stream` for all of them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::Router;
use serde_json::{json, Map, Value};

use crate::harness::eventually;
use crate::harness::popgate::{id, Popgate};
use crate::harness::push::SseClient;
use crate::harness::unique_topic;
use crate::publish::shared_cluster;

const CONFIG: &str = "[delivery]\nlease_ms = 20000\npop_poll_ms = 500\n";

/// Each published event, named by its key: the publish request's data fields, and the fields (`data` or
/// `dataBase64`) it must come back with.
fn cases() -> Vec<(&'static str, Value, Value)> {
    vec![
        ("object", json!({"data": {"id": 1, "tags": ["a"]}}), json!({"data": {"id": 1, "tags": ["a"]}})),
        ("text", json!({"data": "text"}), json!({"data": "text"})),
        ("json-text", json!({"data": "{\"id\":1}"}), json!({"data": "{\"id\":1}"})),
        ("number", json!({"data": 42}), json!({"data": 42})),
        // "hello": bytes that happen to be UTF-8 stay bytes.
        ("utf8-bytes", json!({"dataBase64": "aGVsbG8="}), json!({"dataBase64": "aGVsbG8="})),
        ("bytes", json!({"dataBase64": "/wAB"}), json!({"dataBase64": "/wAB"})),
    ]
}

/// The `data`/`dataBase64` fields of an event, keyed by its first key.
fn data_fields(event: &Value) -> (String, Value) {
    let key = event["keys"][0].as_str().unwrap_or_default().to_owned();
    let fields: Map<String, Value> = ["data", "dataBase64"]
        .into_iter()
        .filter_map(|name| Some((name.to_owned(), event.get(name)?.clone())))
        .collect();
    (key, Value::Object(fields))
}

fn expected() -> BTreeMap<String, Value> {
    cases().into_iter().map(|(key, _, back)| (key.to_owned(), back)).collect()
}

#[derive(Clone, Default)]
struct Receiver {
    requests: Arc<Mutex<Vec<(HeaderMap, Bytes)>>>,
}

async fn receive(State(receiver): State<Receiver>, headers: HeaderMap, body: Bytes) -> &'static str {
    receiver.requests.lock().expect("lock").push((headers, body));
    "ok"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_data_comes_back_as_json_strings_as_strings_and_bytes_as_base64_on_every_way_out() {
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
    let hook = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let app = Router::new().route("/hook", post(receive)).with_state(receiver.clone());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, CONFIG).await;
    let topic = unique_topic("data_shapes");
    let (polled, streamed, pushed) = (unique_topic("g_poll"), unique_topic("g_sse"), unique_topic("g_hook"));
    for (group, push) in [(&polled, None), (&pushed, Some(json!({"url": hook, "secret": "s", "timeoutMs": 2000})))] {
        // One attempt, long enough to last the whole test: each delivery of the polled group is TERMed below.
        let mut body = json!({"group": group, "topic": topic, "maxAttempts": 1, "ackTimeoutMs": 600_000});
        if let Some(push) = push {
            body["push"] = push;
        }
        let (status, answer) = popgate.post_json("/events/subscribe", &body).await;
        assert_eq!(status, 200, "{answer}");
    }
    let mut sse = SseClient::connect(&popgate.base, &format!("group={streamed}&topic={topic}")).await;
    for (key, data, _) in cases() {
        let mut request = data.clone();
        request["topic"] = json!(topic);
        request["keys"] = json!([key]);
        let (status, answer) = popgate.publish(&request).await;
        assert_eq!(status, 200, "{key}: {answer}");
    }
    let count = cases().len();

    let deliveries = popgate.poll_until(&polled, &topic, count, Duration::from_secs(30)).await;
    let got: BTreeMap<String, Value> = deliveries.iter().map(|d| data_fields(&d["event"])).collect();
    assert_eq!(got, expected(), "poll");

    let mut got = BTreeMap::new();
    while got.len() < count {
        let delivery = sse.next(Duration::from_secs(30)).await.expect("every event is pushed over SSE");
        assert_eq!(popgate.ack(&id(&delivery)).await.0, 200);
        let (key, fields) = data_fields(&delivery["event"]);
        got.insert(key, fields);
    }
    assert_eq!(got, expected(), "SSE");

    eventually(Duration::from_secs(30), "every event reaches the webhook", || async {
        receiver.requests.lock().expect("lock").len() >= count
    })
    .await;
    let pushed_as: BTreeMap<Vec<u8>, String> = receiver
        .requests
        .lock()
        .expect("lock")
        .iter()
        .map(|(headers, body)| {
            let content_type = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default();
            (body.to_vec(), content_type.to_owned())
        })
        .collect();
    let webhook_expected: BTreeMap<Vec<u8>, String> = [
        (&br#"{"id":1,"tags":["a"]}"#[..], "application/json"),
        (b"text", "text/plain; charset=utf-8"),
        (br#"{"id":1}"#, "text/plain; charset=utf-8"),
        (b"42", "application/json"),
        (b"hello", "application/octet-stream"),
        (&[0xff, 0x00, 0x01], "application/octet-stream"),
    ]
    .into_iter()
    .map(|(body, content_type)| (body.to_vec(), content_type.to_owned()))
    .collect();
    assert_eq!(pushed_as, webhook_expected, "webhook: the body as stored, with its content type");

    for delivery in &deliveries {
        let (status, answer) =
            popgate.post_json("/events/term", &json!({"deliveryId": id(delivery), "reason": "shape test"})).await;
        assert_eq!(status, 200, "{answer}");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let browsed = loop {
        let (status, page) = popgate.get_json(&format!("/admin/dlq/browse?group={polled}&max=100")).await;
        assert_eq!(status, 200, "{page}");
        let messages = page["messages"].as_array().cloned().unwrap_or_default();
        if messages.len() >= count {
            break messages;
        }
        assert!(std::time::Instant::now() < deadline, "the termed events are not browsable in the DLQ: {page}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let got: BTreeMap<String, Value> = browsed.iter().map(data_fields).collect();
    assert_eq!(got, expected(), "DLQ browse");
    for message in &browsed {
        assert_eq!(message["properties"], json!({}), "popgate's content type is no user property: {message}");
    }
    server.abort();
}
