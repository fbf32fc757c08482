//! Security and limits against the real binary: bearer tokens (401/403 on every admin route, ACK only by a
//! caller allowed on the delivery's group), request ids, size and concurrency limits, TLS.

use std::path::PathBuf;
use std::time::Duration;

use reqwest::{Client, Method, StatusCode};
use serde_json::{json, Value};

use crate::harness::popgate::{id, status_and_json, Popgate};
use crate::harness::unique_topic;
use crate::publish::shared_cluster;

const ADMIN: &str = "admin-token-0123456789";
const CONSUMER: &str = "consume-token-0123456789";
const PUBLISHER: &str = "publish-token-0123456789";

/// Three tokens: an operator, a consumer of `g_sec_*`, a publisher to `sec_*` that may also consume `other_*`.
fn tokens_toml(extra: &str) -> String {
    format!(
        "[[auth.tokens]]\nname = \"ops\"\ntoken = \"{ADMIN}\"\nadmin = true\n\
         [[auth.tokens]]\nname = \"consumer\"\ntoken = \"{CONSUMER}\"\nconsume = [\"g_sec_*\"]\n\
         [[auth.tokens]]\nname = \"publisher\"\ntoken = \"{PUBLISHER}\"\npublish = [\"sec_*\"]\nconsume = [\"other_*\"]\n\
         {extra}"
    )
}

async fn call(popgate: &Popgate, method: Method, path: &str, token: Option<&str>, body: Option<Value>) -> (u16, Value) {
    let mut request = Client::new().request(method, format!("{}{path}", popgate.base));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    status_and_json(request.send().await.expect("request")).await
}

/// A concrete request path for a route (path parameters filled in).
fn concrete(path: &str) -> String {
    path.replace("{id}", "g_x:t_x")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_route_needs_an_admin_token() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, &tokens_toml("")).await;
    let admin_routes: Vec<_> = popgate::api::routes().into_iter().filter(|r| r.path.starts_with("/admin/")).collect();
    assert!(admin_routes.len() >= 7, "{admin_routes:?}");
    for route in &admin_routes {
        let method = Method::from_bytes(route.method.as_bytes()).expect("method");
        let path = concrete(route.path);
        let (status, answer) = call(&popgate, method.clone(), &path, None, None).await;
        assert_eq!((status, answer["error"]["code"].as_str()), (401, Some("unauthenticated")), "{path}: {answer}");
        let (status, _) = call(&popgate, method.clone(), &path, Some("wrong-token-0123456789"), None).await;
        assert_eq!(status, 401, "{path} with an unknown token");
        let (status, answer) = call(&popgate, method.clone(), &path, Some(CONSUMER), None).await;
        assert_eq!((status, answer["error"]["code"].as_str()), (403, Some("forbidden")), "{path}: {answer}");
        let (status, answer) = call(&popgate, method, &path, Some(ADMIN), None).await;
        assert!(status != 401 && status != 403, "{path} with the admin token: {status} {answer}");
    }
    let response = Client::new().get(format!("{}/admin/config", popgate.base)).send().await.expect("request");
    assert_eq!(response.headers().get("www-authenticate").and_then(|v| v.to_str().ok()), Some("Bearer"));

    // Probes stay open; the data plane does not.
    assert_eq!(call(&popgate, Method::GET, "/healthz", None, None).await.0, 200);
    assert_eq!(call(&popgate, Method::GET, "/openapi.json", None, None).await.0, 200);
    assert_eq!(call(&popgate, Method::GET, "/events/poll?group=g_sec_1&topic=t", None, None).await.0, 401);

    // The effective config never shows a secret.
    let (status, config) = call(&popgate, Method::GET, "/admin/config", Some(ADMIN), None).await;
    assert_eq!(status, 200);
    let text = config.to_string();
    for secret in [ADMIN, CONSUMER, PUBLISHER] {
        assert!(!text.contains(secret), "a token leaked in /admin/config");
    }
    assert_eq!(config["auth"]["tokens"][0]["token"], "<redacted>");
    assert!(!popgate.output().contains(ADMIN), "a token leaked into the log");
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"unauthenticated\"}").await >= 8.0);
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"forbidden\"}").await >= 7.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_scope_publish_to_topics_and_settlement_to_groups() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, &tokens_toml("")).await;
    let topic = unique_topic("sec_orders");
    let group = unique_topic("g_sec_a");

    let publish = |topic: String, token: &'static str| {
        let popgate = &popgate;
        async move {
            call(popgate, Method::POST, "/events/publish", Some(token), Some(json!({"topic": topic, "data": "x"})))
                .await
        }
    };
    assert_eq!(publish(topic.clone(), PUBLISHER).await.0, 200);
    let (status, answer) = publish(unique_topic("payments"), PUBLISHER).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (403, Some("topic")), "{answer}");
    assert_eq!(publish(topic.clone(), CONSUMER).await.0, 403, "a consume-only token cannot publish");

    let poll = format!("/events/poll?group={group}&topic={topic}&max=1&waitMs=3000");
    let (status, answer) = call(&popgate, Method::GET, &poll, Some(PUBLISHER), None).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (403, Some("group")), "{answer}");
    let mut delivery = None;
    for _ in 0..10 {
        let (status, answer) = call(&popgate, Method::GET, &poll, Some(CONSUMER), None).await;
        assert_eq!(status, 200, "{answer}");
        if let Some(first) = answer["deliveries"].as_array().and_then(|d| d.first()) {
            delivery = Some(first.clone());
            break;
        }
    }
    let delivery_id = id(&delivery.expect("the consumer gets the event"));

    // The publisher may consume other groups, but not this delivery's group: ACK, NACK, TERM and batch ACK.
    for path in ["/events/ack", "/events/nack", "/events/term"] {
        let (status, answer) =
            call(&popgate, Method::POST, path, Some(PUBLISHER), Some(json!({"deliveryId": delivery_id}))).await;
        assert_eq!((status, answer["error"]["code"].as_str()), (403, Some("forbidden")), "{path}: {answer}");
    }
    let (status, answer) =
        call(&popgate, Method::POST, "/events/ack", Some(PUBLISHER), Some(json!({"deliveryIds": [delivery_id]}))).await;
    assert_eq!((status, answer["results"][0]["status"].as_str()), (200, Some("forbidden")), "{answer}");
    let (status, answer) =
        call(&popgate, Method::POST, "/events/ack", Some(CONSUMER), Some(json!({"deliveryId": delivery_id}))).await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("acked")), "the group's own consumer ACKs: {answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_and_limits_answer_clearly_and_are_counted() {
    let cluster = shared_cluster();
    let limits = "[server]\nmax_uri_bytes = 512\nmax_header_bytes = 2048\nmax_waiters_per_token = 1\n\
                  max_streams_per_token = 1\nmax_ack_batch = 3\n[publish]\nmax_message_bytes = 1024\n";
    let popgate = Popgate::start(&cluster.namesrv_addr, &tokens_toml(limits)).await;
    let client = Client::new();
    let base = &popgate.base;

    let response = client.get(format!("{base}/healthz")).header("x-request-id", "req-42").send().await.expect("req");
    assert_eq!(response.headers().get("x-request-id").and_then(|v| v.to_str().ok()), Some("req-42"));
    let response = client.get(format!("{base}/healthz")).send().await.expect("req");
    let made_up = response.headers().get("x-request-id").and_then(|v| v.to_str().ok()).map(str::len);
    assert_eq!(made_up, Some(24), "an id is made up when the client sends none");

    let long = "x".repeat(600);
    let (status, answer) = call(&popgate, Method::GET, &format!("/healthz?{long}"), None, None).await;
    assert_eq!((status, answer["error"]["code"].as_str()), (414, Some("uri_too_long")), "{answer}");
    let response =
        client.get(format!("{base}/healthz")).header("x-padding", "y".repeat(3000)).send().await.expect("req");
    assert_eq!(response.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    let (status, answer) = call(
        &popgate,
        Method::POST,
        "/events/publish",
        Some(PUBLISHER),
        Some(json!({"topic": "sec_big", "data": "z".repeat(200_000)})),
    )
    .await;
    assert_eq!(status, 413, "{answer}");
    let ids: Vec<String> = (0..4).map(|i| format!("{i:032x}")).collect();
    let (status, answer) =
        call(&popgate, Method::POST, "/events/ack", Some(CONSUMER), Some(json!({"deliveryIds": ids}))).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (413, Some("deliveryIds")), "{answer}");

    // One waiting long-poll per token: a second one at the same time is refused with 429.
    let group = unique_topic("g_sec_wait");
    let poll = format!("/events/poll?group={group}&topic={}&waitMs=3000", unique_topic("sec_wait"));
    let (first, second) = tokio::join!(call(&popgate, Method::GET, &poll, Some(CONSUMER), None), async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        call(&popgate, Method::GET, &poll, Some(CONSUMER), None).await
    });
    assert_eq!(first.0, 200, "{first:?}");
    assert_eq!((second.0, second.1["error"]["code"].as_str()), (429, Some("too_many_requests")), "{second:?}");
    // ... and the slot comes back when the first ends.
    let (status, _) = call(&popgate, Method::GET, &poll.replace("3000", "10"), Some(CONSUMER), None).await;
    assert_eq!(status, 200);

    // One open stream per token: a second SSE stream is refused while the first is open.
    let stream = format!("{base}/events/stream?group={group}&topic={}", unique_topic("sec_stream"));
    let open = client.get(&stream).bearer_auth(CONSUMER).send().await.expect("first stream");
    assert_eq!(open.status(), StatusCode::OK);
    let refused = client.get(&stream).bearer_auth(CONSUMER).send().await.expect("second stream");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    drop(open);

    for reason in [
        "uri_too_long",
        "headers_too_large",
        "body_too_large",
        "batch_too_large",
        "too_many_waiters",
        "too_many_streams",
    ] {
        let count = popgate.metric(&format!("popgate_requests_rejected_total{{reason=\"{reason}\"}}")).await;
        assert!(count >= 1.0, "{reason} not counted");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_https_with_the_configured_certificate_and_refuses_plain_http() {
    let cluster = shared_cluster();
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, cert, key) = make_certificates(dir.path());
    let config = format!("[server]\ntls_cert_path = \"{}\"\ntls_key_path = \"{}\"\n", cert.display(), key.display());
    let popgate = Popgate::start(&cluster.namesrv_addr, &config).await;
    assert!(popgate.base.starts_with("https://"), "{}", popgate.base);

    let pem = std::fs::read(&ca).expect("CA certificate");
    let client = Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).expect("pem"))
        .build()
        .expect("client");
    let answer = client.get(format!("{}/healthz", popgate.base)).send().await.expect("https request");
    assert_eq!(answer.status(), StatusCode::OK);
    // Without trusting the certificate the handshake fails; plain HTTP gets no answer.
    assert!(Client::new().get(format!("{}/healthz", popgate.base)).send().await.is_err());
    let plain = popgate.base.replace("https://", "http://");
    assert!(Client::new().get(format!("{plain}/healthz")).send().await.is_err());
    crate::harness::eventually(Duration::from_secs(5), "failed handshakes are counted", || async {
        popgate_metric_https(&client, &popgate.base).await >= 2.0
    })
    .await;
}

async fn popgate_metric_https(client: &Client, base: &str) -> f64 {
    let text = client.get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    crate::harness::popgate::metric_value(&text, "popgate_tls_handshake_failures_total")
}

/// A test CA and a server certificate it signed for 127.0.0.1 (webpki refuses a self-signed CA as the
/// server's own certificate): returns the CA, certificate and key paths.
fn make_certificates(dir: &std::path::Path) -> (PathBuf, PathBuf, PathBuf) {
    let path = |name: &str| dir.join(name);
    let ext = path("ext.cnf");
    std::fs::write(
        &ext,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .expect("write ext");
    let steps: [Vec<String>; 3] = [
        "req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=popgate-test-ca -keyout ca.key -out ca.pem"
            .split(' ')
            .map(str::to_owned)
            .collect(),
        "req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout key.pem -out leaf.csr"
            .split(' ')
            .map(str::to_owned)
            .collect(),
        "x509 -req -in leaf.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -out cert.pem -extfile ext.cnf"
            .split(' ')
            .map(str::to_owned)
            .collect(),
    ];
    for args in steps {
        let made = std::process::Command::new("openssl").args(&args).current_dir(dir).output().expect("run openssl");
        assert!(made.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&made.stderr));
    }
    (path("ca.pem"), path("cert.pem"), path("key.pem"))
}
