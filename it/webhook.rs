//! Webhook push against a real broker and a small real HTTP receiver in the test: 5xx is a failed attempt,
//! 429 with `Retry-After` is honoured, 2xx ACKs, and every request is a signed CloudEvent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use hmac::{Hmac, Mac};
use serde_json::json;
use sha2::Sha256;

use crate::harness::eventually;
use crate::harness::popgate::Popgate;
use crate::harness::unique_topic;
use crate::publish::shared_cluster;

const SECRET: &str = "s3cret";

#[derive(Clone, Debug)]
struct Received {
    at: Instant,
    headers: HeaderMap,
    body: String,
}

#[derive(Clone, Default)]
struct Receiver {
    requests: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    fn for_body(&self, body: &str) -> Vec<Received> {
        self.requests.lock().expect("lock").iter().filter(|r| r.body == body).cloned().collect()
    }
}

/// `flaky`: 500, 500, then 200. `busy`: 429 with `Retry-After: 2`, then 200. Anything else: 200.
async fn receive(State(receiver): State<Receiver>, headers: HeaderMap, body: String) -> impl IntoResponse {
    let seen_before = {
        let mut requests = receiver.requests.lock().expect("lock");
        let before = requests.iter().filter(|r| r.body == body).count();
        requests.push(Received { at: Instant::now(), headers, body: body.clone() });
        before
    };
    match (body.as_str(), seen_before) {
        ("flaky", 0 | 1) => (StatusCode::INTERNAL_SERVER_ERROR, HeaderMap::new()),
        ("busy", 0) => {
            let mut headers = HeaderMap::new();
            headers.insert("retry-after", "2".parse().expect("header"));
            (StatusCode::TOO_MANY_REQUESTS, headers)
        }
        _ => (StatusCode::OK, HeaderMap::new()),
    }
}

fn expected_signature(headers: &HeaderMap, body: &str) -> String {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET.as_bytes()).expect("any key length");
    mac.update(format!("{}.{}.{body}", header("x-popgate-timestamp"), header("x-popgate-delivery-id")).as_bytes());
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_retries_failures_honours_retry_after_and_signs_every_request() {
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let app = Router::new().route("/hook", post(receive)).with_state(receiver.clone());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "[delivery]\nlease_ms = 20000\npop_poll_ms = 500\n").await;
    let (topic, group) = (unique_topic("hook"), unique_topic("g_hook"));
    let (status, answer) = popgate
        .post_json(
            "/events/subscribe",
            &json!({"group": group, "topic": topic, "initialBackoffMs": 200, "maxBackoffMs": 400,
                "push": {"url": url, "secret": SECRET, "timeoutMs": 2000, "maxConcurrency": 4}}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["subscription"]["push"]["secret"], "<redacted>", "the secret is never read back");
    for body in ["flaky", "busy", "plain"] {
        let (status, answer) = popgate.publish(&json!({"topic": topic, "data": body})).await;
        assert_eq!(status, 200, "{answer}");
    }

    eventually(Duration::from_secs(40), "every event reaches the receiver until it answers 200", || async {
        receiver.for_body("flaky").len() >= 3
            && receiver.for_body("busy").len() >= 2
            && !receiver.for_body("plain").is_empty()
    })
    .await;
    let flaky = receiver.for_body("flaky");
    let attempts: Vec<String> =
        flaky.iter().map(|r| r.headers["x-popgate-attempt"].to_str().unwrap_or_default().to_owned()).collect();
    assert_eq!(attempts, vec!["1", "2", "3"], "two 500s are failed attempts; the 200 is attempt 3");
    let busy = receiver.for_body("busy");
    let waited = busy[1].at.duration_since(busy[0].at);
    assert!(waited >= Duration::from_millis(1_800), "Retry-After: 2 honoured, retried after {waited:?}");

    let mut by_id: HashMap<String, usize> = HashMap::new();
    for request in receiver.requests.lock().expect("lock").iter() {
        let h = &request.headers;
        assert_eq!(h["x-popgate-signature"].to_str().ok(), Some(expected_signature(h, &request.body).as_str()));
        assert_eq!(h["ce-specversion"], "1.0");
        assert_eq!(h["ce-type"], "popgate.event");
        assert_eq!(h["ce-source"].to_str().ok(), Some(format!("/popgate/{topic}").as_str()));
        assert!(!h["ce-id"].is_empty());
        *by_id.entry(h["x-popgate-delivery-id"].to_str().unwrap_or_default().to_owned()).or_default() += 1;
    }
    assert_eq!(by_id.len(), 3, "one delivery per event, retried under its id");
    eventually(Duration::from_secs(10), "every delivery is ACKed and retired", || async {
        popgate.metric("popgate_pending_deliveries").await == 0.0
    })
    .await;
    assert!(popgate.metric("popgate_deliveries_dispatched_total{transport=\"webhook\"}").await >= 6.0);
    assert!(receiver.for_body("plain").len() == 1, "a 200 is never retried");

    let (status, answer) = popgate
        .post_json(
            "/events/subscribe",
            &json!({"group": group, "topic": topic, "push": {"url": "ftp://x/y", "secret": "s"}}),
        )
        .await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("push.url")), "{answer}");
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_webhook_is_counted_and_its_events_end_in_the_dlq() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "[delivery]\nlease_ms = 20000\npop_poll_ms = 500\n").await;
    let (topic, group) = (unique_topic("hook_down"), unique_topic("g_hook_down"));
    // A port nobody listens on: every POST fails to connect.
    let dead = format!("http://127.0.0.1:{}/hook", crate::harness::free_port());
    let (status, answer) = popgate
        .post_json(
            "/events/subscribe",
            &json!({"group": group, "topic": topic, "maxAttempts": 2, "initialBackoffMs": 100, "maxBackoffMs": 100,
                "push": {"url": dead, "secret": SECRET, "timeoutMs": 1000, "maxConcurrency": 2}}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    let (status, _) = popgate.publish(&json!({"topic": topic, "data": "nobody home"})).await;
    assert_eq!(status, 200);
    eventually(Duration::from_secs(30), "both failed attempts are counted", || async {
        popgate.metric("popgate_push_write_failures_total{transport=\"webhook\"}").await >= 2.0
    })
    .await;
    eventually(Duration::from_secs(20), "the event is dead-lettered after its attempts", || async {
        popgate.metric(&format!("popgate_dlq_messages_total{{group=\"{group}\"}}")).await == 1.0
    })
    .await;
}

/// Starts a receiver on 127.0.0.1; returns it, its port and the server task.
async fn loopback_receiver() -> (Receiver, u16, tokio::task::JoinHandle<std::io::Result<()>>) {
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
    let port = listener.local_addr().expect("addr").port();
    let app = Router::new().route("/hook", post(receive)).with_state(receiver.clone());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    (receiver, port, server)
}

/// Without `webhook.allowed_networks`, popgate reaches no internal address (SSRF guard): a literal loopback,
/// mapped or metadata address is a 400 naming `push.url` at subscribe; a host name that resolves to loopback
/// (`localhost`) passes subscribe but is refused at every attempt, before connecting. Each refusal is counted
/// and is a failed attempt, so the event ends in the DLQ after its attempts: refused, never lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_allowed_networks_loopback_webhooks_are_refused_at_subscribe_and_at_delivery() {
    let (receiver, port, server) = loopback_receiver().await;
    let cluster = shared_cluster();
    let config = "[delivery]\nlease_ms = 20000\npop_poll_ms = 500\n[webhook]\nallowed_networks = []\n";
    let popgate = Popgate::start(&cluster.namesrv_addr, config).await;
    let (topic, group) = (unique_topic("hook_ssrf"), unique_topic("g_hook_ssrf"));
    let subscribe = |url: String| {
        json!({"group": group, "topic": topic, "maxAttempts": 2, "initialBackoffMs": 100, "maxBackoffMs": 100,
            "push": {"url": url, "secret": SECRET, "timeoutMs": 1000, "maxConcurrency": 2}})
    };
    for url in [
        format!("http://127.0.0.1:{port}/hook"),
        format!("http://[::1]:{port}/hook"),
        format!("http://[::ffff:127.0.0.1]:{port}/hook"),
        format!("http://2130706433:{port}/hook"),
        "http://169.254.169.254/latest/meta-data/".to_owned(),
        "http://10.0.0.1/hook".to_owned(),
    ] {
        let (status, answer) = popgate.post_json("/events/subscribe", &subscribe(url.clone())).await;
        assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("push.url")), "{url}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("webhook.allowed_networks"), "{url}: the 400 says what to change: {message}");
    }

    let (status, answer) =
        popgate.post_json("/events/subscribe", &subscribe(format!("http://localhost:{port}/hook"))).await;
    assert_eq!(status, 200, "a host name is checked when it is resolved, not at subscribe: {answer}");
    let (status, answer) = popgate.publish(&json!({"topic": topic, "data": "to localhost"})).await;
    assert_eq!(status, 200, "{answer}");
    eventually(Duration::from_secs(30), "both attempts are refused before connecting, and counted", || async {
        popgate.metric("popgate_webhook_targets_refused_total{reason=\"dns\"}").await >= 2.0
    })
    .await;
    eventually(Duration::from_secs(20), "the refused event is dead-lettered after its attempts", || async {
        popgate.metric(&format!("popgate_dlq_messages_total{{group=\"{group}\"}}")).await == 1.0
    })
    .await;
    assert!(receiver.requests.lock().expect("lock").is_empty(), "nothing ever reached the loopback receiver");
    assert_eq!(popgate.metric("popgate_webhook_targets_refused_total{reason=\"literal\"}").await, 0.0);
    assert_eq!(
        popgate.metric("popgate_push_write_failures_total{transport=\"webhook\"}").await,
        0.0,
        "a refusal is not a connection failure"
    );
    assert!(popgate.output().contains("Webhook target refused"), "and it is logged");
    server.abort();
}

/// `ce_*` properties come from any producer: a value with CR/LF or non-ASCII is percent-encoded as the
/// CloudEvents HTTP binding says, a name that is no CloudEvents attribute is skipped (and counted), and the
/// event is delivered all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_ce_properties_are_encoded_or_skipped_and_the_event_is_still_delivered() {
    let (receiver, port, server) = loopback_receiver().await;
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "[delivery]\nlease_ms = 20000\npop_poll_ms = 500\n").await;
    let (topic, group) = (unique_topic("hook_props"), unique_topic("g_hook_props"));
    let (status, answer) = popgate
        .post_json(
            "/events/subscribe",
            &json!({"group": group, "topic": topic, "maxAttempts": 2, "initialBackoffMs": 100, "maxBackoffMs": 100,
                "push": {"url": format!("http://127.0.0.1:{port}/hook"), "secret": SECRET, "timeoutMs": 2000}}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    let properties = [
        ("ce_tenant", "acme"),
        ("ce_note", "line 1\r\nX-Popgate-Signature: forged"),
        ("ce_city", "Zürich"),
        ("ce_Evil", "uppercase is no attribute name"),
        ("ce_x-popgate-attempt", "99"),
        ("ce_data", "reserved"),
        ("ce_source", "/shop\nHost: evil"),
        ("ce_datacontenttype", "text/plain\r\nX-Injected: 1"),
    ];
    // popgate's own fronts refuse control characters in properties (Apache's proxy's rule): another producer,
    // straight at the broker, sends them.
    crate::harness::direct::Direct::produce_unchecked(&cluster.namesrv_addr, &topic, "hostile", &properties).await;

    eventually(Duration::from_secs(30), "the event is delivered despite its properties", || async {
        !receiver.for_body("hostile").is_empty()
    })
    .await;
    let request = &receiver.for_body("hostile")[0];
    let header = |name: &str| request.headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    assert_eq!(header("ce-tenant").as_deref(), Some("acme"));
    assert_eq!(header("ce-note").as_deref(), Some("line%201%0D%0AX-Popgate-Signature:%20forged"));
    assert_eq!(header("ce-city").as_deref(), Some("Z%C3%BCrich"));
    assert_eq!(header("ce-source").as_deref(), Some("/shop%0AHost:%20evil"));
    assert_eq!(header("content-type").as_deref(), Some("application/octet-stream"), "not a media type");
    for absent in ["ce-evil", "ce-x-popgate-attempt", "ce-data", "x-injected", "ce-datacontenttype"] {
        assert_eq!(header(absent), None, "{absent}");
    }
    assert_eq!(header("x-popgate-attempt").as_deref(), Some("1"), "popgate's own headers are untouched");
    assert_eq!(
        header("x-popgate-signature").as_deref(),
        Some(expected_signature(&request.headers, "hostile").as_str())
    );
    assert!(popgate.metric("popgate_webhook_headers_skipped_total{reason=\"name\"}").await >= 2.0);
    assert!(popgate.metric("popgate_webhook_headers_skipped_total{reason=\"reserved\"}").await >= 1.0);
    assert!(popgate.metric("popgate_webhook_headers_skipped_total{reason=\"value\"}").await >= 1.0);
    eventually(Duration::from_secs(10), "the delivery is ACKed", || async {
        popgate.metric("popgate_pending_deliveries").await == 0.0
    })
    .await;
    server.abort();
}
