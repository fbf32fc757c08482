//! Property test of the whole HTTP surface: random bodies, headers and query strings thrown at every route of
//! the real binary in front of the real broker. No request may crash popgate or get a 5xx other than 503 (a
//! real broker or store failure); every error body follows the one schema.

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use reqwest::{Client, Method};
use serde_json::Value;

use crate::harness::env_or;
use crate::harness::popgate::Popgate;
use crate::publish::shared_cluster;

const EVERYTHING: &str = "fuzz-token-0123456789";

/// One generated request.
#[derive(Debug, Clone)]
struct Input {
    route: usize,
    query: Vec<(String, String)>,
    content_type: Option<&'static str>,
    extra_headers: Vec<(String, String)>,
    token: Option<&'static str>,
    body: Vec<u8>,
}

/// Parameter and field names popgate knows, mixed with noise, so inputs get past the first check often.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "group",
            "topic",
            "max",
            "waitMs",
            "mode",
            "cursor",
            "ids",
            "rate",
            "prefetch",
            "originTopic",
            "deliveryId",
            "deliveryIds",
            "delayMs",
            "reason",
            "data",
            "dataBase64",
            "tags",
            "keys",
            "properties",
            "messageGroup",
            "filter",
            "ackTimeoutMs",
            "maxAttempts",
            "ordered",
            "push",
            "specversion",
            "id",
            "transaction",
            "producerGroup",
            "resolution",
        ])
        .prop_map(str::to_owned),
        "[a-zA-Z%_]{0,10}",
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9_%-]{0,12}".prop_map(|s| format!("fuzz_{s}")),
        any::<i64>().prop_map(|n| n.to_string()),
        Just("%DLQ%fuzz_g".to_owned()),
        Just(String::new()),
        "\\PC{0,24}",
    ]
}

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((name(), inner), 0..6).prop_map(|fields| Value::Object(fields.into_iter().collect())),
        ]
    })
}

fn input(routes: usize) -> impl Strategy<Value = Input> {
    let body =
        prop_oneof![prop::collection::vec(any::<u8>(), 0..256), json().prop_map(|v| v.to_string().into_bytes()),];
    let header = prop_oneof![
        Just("ce-specversion".to_owned()),
        Just("ce-id".to_owned()),
        Just("ce-type".to_owned()),
        Just("ce-source".to_owned()),
        Just("x-request-id".to_owned()),
        Just("last-event-id".to_owned()),
        "x-[a-z]{1,8}",
    ];
    (
        0..routes,
        prop::collection::vec((name(), text()), 0..5),
        prop::option::of(prop::sample::select(vec![
            "application/json",
            "application/cloudevents+json",
            "text/plain",
            "application/octet-stream",
        ])),
        prop::collection::vec((header, "[ -~]{0,32}"), 0..3),
        prop::option::of(prop::sample::select(vec![EVERYTHING, "not-a-token-at-all"])),
        body,
    )
        .prop_map(|(route, query, content_type, extra_headers, token, body)| Input {
            route,
            query,
            content_type,
            extra_headers,
            token,
            body,
        })
}

async fn send(client: &Client, base: &str, input: &Input) -> Result<(), TestCaseError> {
    let routes = popgate::api::routes();
    let route = routes[input.route];
    let path = route.path.replace("{id}", "fuzz_g:fuzz_t");
    let method = Method::from_bytes(route.method.as_bytes()).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut request = client.request(method, format!("{base}{path}")).query(&input.query).body(input.body.clone());
    if let Some(content_type) = input.content_type {
        request = request.header("content-type", content_type);
    }
    for (name, value) in &input.extra_headers {
        request = request.header(name.as_str(), value.as_str());
    }
    if let Some(token) = input.token {
        request = request.bearer_auth(token);
    }
    let response = match request.send().await {
        Ok(response) => response,
        // A long-poll or stream that is still open when the client gives up is a success, not a crash.
        Err(error) if error.is_timeout() => return Ok(()),
        Err(error) => return Err(TestCaseError::fail(format!("{} {path}: {error}", route.method))),
    };
    let status = response.status().as_u16();
    let is_stream =
        response.headers().get("content-type").is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    prop_assert!(status < 500 || status == 503, "{} {path} {input:?} -> {status}", route.method);
    if status >= 400 && !is_stream {
        let body = tokio::time::timeout(Duration::from_secs(2), response.text()).await;
        let text = body.map_err(|_| TestCaseError::fail("error body not sent"))?.unwrap_or_default();
        let parsed: Value =
            serde_json::from_str(&text).map_err(|_| TestCaseError::fail(format!("{status}: {text}")))?;
        prop_assert!(parsed["error"]["code"].is_string() && parsed["error"]["message"].is_string(), "{status}: {text}");
    }
    Ok(())
}

/// popgate with authentication on and one token allowed everything (publishing only to `publish`).
async fn start_with_everything_token(publish: &str) -> Popgate {
    let config = format!(
        "[[auth.tokens]]\nname = \"fuzz\"\ntoken = \"{EVERYTHING}\"\npublish = [\"{publish}\"]\nconsume = [\"*\"]\nadmin = true\n"
    );
    Popgate::start(&shared_cluster().namesrv_addr, &config).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_to_every_route_never_crash_popgate_or_get_a_5xx() {
    let popgate = start_with_everything_token("fuzz_*").await;
    let client = Client::builder().timeout(Duration::from_secs(2)).build().expect("client");
    let routes = popgate::api::routes().len();
    let cases = env_or("FUZZ_CASES", 400);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let handle = tokio::runtime::Handle::current();
    let base = popgate.base.clone();
    let outcome = tokio::task::block_in_place(|| {
        runner.run(&input(routes), |input| handle.block_on(send(&client, &base, &input))).map_err(|f| f.to_string())
    });
    if let Err(failure) = outcome {
        panic!("{failure}\n--- popgate output ---\n{}", popgate.output());
    }
    let (status, _) = popgate.get_json("/healthz").await;
    assert_eq!(status, 200, "popgate is still up after {cases} random requests");
    assert!(!popgate.output().contains("panicked"), "popgate logged a panic");
}

/// Schemathesis (installed by docker/setup.sh; `SCHEMATHESIS` names it) generates requests from the served
/// `/openapi.json` and checks every answer: no server error, every status and content type documented, every
/// body matching its documented schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_every_answer_documented_and_no_server_error() {
    let popgate = start_with_everything_token("*").await;
    let tool = std::env::var("SCHEMATHESIS").expect("SCHEMATHESIS names the schemathesis binary (docker/setup.sh)");
    let schema = format!("{}/openapi.json", popgate.base);
    // It keeps a cache in its working directory: not in the repo.
    let workdir = tempfile::tempdir().expect("tempdir");
    let run = std::process::Command::new(tool)
        .current_dir(workdir.path())
        .args(["run", &schema, "--max-examples", "20", "--request-timeout", "3", "--seed", "1"])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
        ])
        .args(["--header", &format!("Authorization: Bearer {EVERYTHING}")])
        .env("NO_COLOR", "1")
        .output();
    let output = tokio::task::spawn_blocking(move || run).await.expect("join").expect("run schemathesis");
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "schemathesis failed:\n{printed}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(printed.contains(" passed"), "schemathesis ran no test case:\n{printed}");
}
