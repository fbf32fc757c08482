//! The Grafana dashboards, proven against reality: a real Prometheus (Debian's `prometheus`) scrapes a real
//! popgate under a short real load, and every panel's query is evaluated through Prometheus' HTTP API. A
//! query that does not parse, or that returns nothing, fails the test. The same Prometheus loads the shipped
//! alert rules (docker/alerts.yml) and must evaluate every one without error. Also: the shipped Prometheus
//! config passes `promtool check config`, the alert rules pass `promtool check rules` and their own unit tests
//! (`promtool test rules`), and every compose mount exists in the repo.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::popgate::Popgate;
use crate::harness::{eventually, free_port, unique_topic};
use crate::publish::shared_cluster;

/// Grafana's macros, as Grafana would substitute them for a short time range with a 1 s scrape interval.
const MACROS: [(&str, &str); 3] = [("$__rate_interval", "1m"), ("$__range", "5m"), ("$__interval", "5s")];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A Prometheus server scraping `target` every second and evaluating the shipped alert rules, killed on drop.
struct Prometheus {
    child: Child,
    base: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(target: &str) -> Prometheus {
        let dir = tempfile::Builder::new().prefix("popgate-prom-").tempdir().expect("tempdir");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - '{rules}'\n\
                 scrape_configs:\n  - job_name: popgate\n    static_configs:\n      - targets: ['{target}']\n",
                rules = repo().join("docker/alerts.yml").display()
            ),
        )
        .expect("write prometheus.yml");
        let port = free_port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("prometheus.log")).expect("log"))
            .spawn()
            .expect("prometheus is installed by docker/setup.sh (Debian package prometheus)");
        Prometheus { child, base: format!("http://127.0.0.1:{port}"), _dir: dir }
    }

    /// The answer of a GET on the API (`/api/v1/...`); `Null` while Prometheus is not up yet.
    async fn get(&self, path: &str) -> Value {
        match reqwest::get(format!("{}{path}", self.base)).await {
            Ok(resp) => resp.json::<Value>().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        }
    }

    /// The API's answer; `Null` while Prometheus is not up yet.
    async fn query(&self, expr: &str) -> Value {
        let request = reqwest::Client::new().get(format!("{}/api/v1/query", self.base)).query(&[("query", expr)]);
        match request.send().await {
            Ok(resp) => resp.json::<Value>().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every `(dashboard, panel title, expr)` of the shipped dashboards.
fn panel_queries() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("grafana/dashboards"))
        .expect("grafana/dashboards")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 4, "Overview, Failure matrix, Brokers and Subscriptions");
    for file in files {
        let dashboard: Value =
            serde_json::from_str(&std::fs::read_to_string(&file).expect("read")).expect("valid JSON");
        let title = dashboard["title"].as_str().unwrap_or_default().to_owned();
        for panel in dashboard["panels"].as_array().expect("panels") {
            for target in panel["targets"].as_array().expect("targets") {
                let expr = target["expr"].as_str().expect("a PromQL expr").to_owned();
                out.push((title.clone(), panel["title"].as_str().unwrap_or_default().to_owned(), expr));
            }
        }
    }
    out
}

/// A short real load touching every panel: publishes, deliveries, ACKs, a NACK and a dead letter.
async fn load(popgate: &Popgate) {
    let (topic, group) = (unique_topic("dash"), unique_topic("g_dash"));
    let (status, _) =
        popgate.post_json("/events/subscribe", &json!({"group": group, "topic": topic, "initialBackoffMs": 100})).await;
    assert_eq!(status, 200);
    for i in 0..20 {
        let (status, _) = popgate.publish(&json!({"topic": topic, "data": format!("e{i}")})).await;
        assert_eq!(status, 200);
    }
    let (status, _) = popgate.publish(&json!({"topic": "bad topic", "data": "x"})).await;
    assert_eq!(status, 400);
    let deliveries = popgate.poll_until(&group, &topic, 20, Duration::from_secs(30)).await;
    assert_eq!(deliveries.len(), 20);
    let id = |d: &Value| d["deliveryId"].as_str().unwrap_or_default().to_owned();
    let (status, _) =
        popgate.post_json("/events/nack", &json!({"deliveryId": id(&deliveries[0]), "delayMs": 100})).await;
    assert_eq!(status, 200);
    let (status, _) =
        popgate.post_json("/events/term", &json!({"deliveryId": id(&deliveries[1]), "reason": "dash"})).await;
    assert_eq!(status, 200);
    for d in &deliveries[2..] {
        assert_eq!(popgate.ack(&id(d)).await.0, 200);
    }
    let again = popgate.poll_until(&group, &topic, 1, Duration::from_secs(10)).await;
    assert_eq!(popgate.ack(&id(&again[0])).await.0, 200);
    // gRPC calls for the front's panels: a heartbeat, and an ACK with a handle popgate never issued.
    let mut client = crate::grpc_raw::connect(popgate).await;
    let heartbeat = popgate::grpc::proto::HeartbeatRequest { group: None, client_type: 1 };
    client.heartbeat(crate::grpc_raw::request(heartbeat, None)).await.expect("heartbeat");
    let refused = crate::grpc_raw::ack(&mut client, &group, &topic, &["pg1:unknown"]).await;
    assert_eq!(refused.status.map(|s| s.code), Some(popgate::grpc::proto::Code::InvalidReceiptHandle as i32));
    eventually(Duration::from_secs(20), "the dead letter is written", || async {
        popgate.metric(&format!("popgate_dlq_messages_total{{group=\"{group}\"}}")).await == 1.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_panel_query_returns_data_from_a_real_prometheus() {
    let cluster = shared_cluster();
    // The remoting front on too, so its panels have series.
    let remoting = format!("127.0.0.1:{}", crate::harness::free_port());
    let config = format!(
        "[delivery]\nlease_ms = 10000\npop_poll_ms = 500\ngauge_refresh_ms = 500\n\n[remoting]\nlisten = \"{remoting}\"\n"
    );
    let popgate = Popgate::start(&cluster.namesrv_addr, &config).await;
    let target = popgate.base.trim_start_matches("http://").to_owned();
    let prometheus = Prometheus::start(&target);
    eventually(Duration::from_secs(30), "prometheus scrapes popgate", || async {
        let answer = prometheus.query("up{job=\"popgate\"}").await;
        answer["data"]["result"][0]["value"][1] == "1"
    })
    .await;
    load(&popgate).await;
    // A few more scrapes after the load, so every rate() has two samples that differ.
    tokio::time::sleep(Duration::from_secs(4)).await;

    let mut failures = Vec::new();
    let queries = panel_queries();
    for (dashboard, panel, expr) in &queries {
        let mut query = expr.clone();
        for (macro_name, value) in MACROS {
            query = query.replace(macro_name, value);
        }
        let answer = prometheus.query(&query).await;
        let empty = answer["data"]["result"].as_array().is_none_or(Vec::is_empty);
        if answer["status"] != "success" || empty {
            failures.push(format!("{dashboard} / {panel}: `{query}` -> {answer}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} panel queries failed:\n{}",
        failures.len(),
        queries.len(),
        failures.join("\n")
    );
    every_alert_rule_evaluates_without_error(&prometheus).await;
}

/// The alert names of docker/alerts.yml.
fn shipped_alerts() -> BTreeSet<String> {
    let text = std::fs::read_to_string(repo().join("docker/alerts.yml")).expect("docker/alerts.yml");
    let rules: serde_norway::Value = serde_norway::from_str(&text).expect("valid YAML");
    let groups = rules.get("groups").and_then(|g| g.as_sequence()).expect("groups");
    groups
        .iter()
        .filter_map(|g| g.get("rules").and_then(|r| r.as_sequence()))
        .flatten()
        .filter_map(|rule| rule.get("alert").and_then(|a| a.as_str()).map(str::to_owned))
        .collect()
}

/// Prometheus loaded every shipped alert and evaluated each against popgate's real series without error.
async fn every_alert_rule_evaluates_without_error(prometheus: &Prometheus) {
    let expected = shipped_alerts();
    assert!(expected.len() >= 3, "backlog, oldest unacked age and DLQ depth each have an alert: {expected:?}");
    let mut last = Value::Null;
    let evaluated = |answer: &Value| -> BTreeSet<String> {
        let groups = answer["data"]["groups"].as_array().cloned().unwrap_or_default();
        groups
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .filter(|r| r["health"] == "ok" && r["lastEvaluation"].as_str().is_some_and(|t| !t.starts_with("0001")))
            .filter_map(|r| r["name"].as_str().map(str::to_owned))
            .collect()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        last = prometheus.get("/api/v1/rules").await;
        if evaluated(&last) == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("alert rules not all evaluated with health ok; expected {expected:?}, Prometheus says {last}");
}

#[test]
fn the_alert_rules_pass_promtool_check_and_their_unit_tests() {
    for args in [["check", "rules", "alerts.yml"], ["test", "rules", "alerts.test.yml"]] {
        let output = Command::new("promtool")
            .args(args)
            .current_dir(repo().join("docker"))
            .output()
            .expect("promtool is installed by docker/setup.sh");
        assert!(
            output.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[test]
fn the_shipped_prometheus_config_passes_promtool() {
    let output = Command::new("promtool")
        .args(["check", "config", "--syntax-only"])
        .arg(repo().join("docker/prometheus.yml"))
        .output()
        .expect("promtool is installed by docker/setup.sh");
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Host paths a compose service mounts (`./x:/y[:ro]`), relative to the compose file.
fn mounted_paths(service: &serde_norway::Value) -> Vec<String> {
    service
        .get("volumes")
        .and_then(|v| v.as_sequence())
        .map(|volumes| {
            volumes
                .iter()
                .filter_map(|v| v.as_str())
                // The container side always starts with `/`; the host side may hold `${VAR:-default}`.
                .filter_map(|v| v.split(":/").next())
                .filter(|host| host.starts_with('.'))
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn the_compose_file_names_every_service_and_mounts_only_files_that_exist() {
    let compose_path = repo().join("docker/compose.yaml");
    let text = std::fs::read_to_string(&compose_path).expect("docker/compose.yaml");
    let mut compose: serde_norway::Value = serde_norway::from_str(&text).expect("valid YAML");
    compose.apply_merge().expect("YAML merge keys (<<) resolve");
    let services = compose.get("services").and_then(|s| s.as_mapping()).expect("services");
    let names: BTreeSet<String> = services.keys().filter_map(|k| k.as_str().map(str::to_owned)).collect();
    let expected: BTreeSet<String> = ["namesrv", "broker", "broker-slave", "popgate", "prometheus", "grafana"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    assert_eq!(names, expected);
    let base = compose_path.parent().expect("docker/");
    for (name, service) in services {
        for host in mounted_paths(service) {
            // `${ROCKETMQ_PROFILE:-balanced}` picks the broker config: every profile must be there.
            let candidates: Vec<String> = if host.contains("${ROCKETMQ_PROFILE") {
                ["financial", "durable", "balanced", "throughput"]
                    .iter()
                    .map(|p| host.replace("${ROCKETMQ_PROFILE:-balanced}", p))
                    .collect()
            } else {
                vec![host.clone()]
            };
            for candidate in candidates {
                assert!(
                    Path::new(base).join(&candidate).exists(),
                    "{:?} mounts {candidate}, which is not in the repo",
                    name.as_str()
                );
            }
        }
        let image_or_build = service.get("image").is_some() || service.get("build").is_some();
        assert!(image_or_build, "{:?} has an image or a build", name.as_str());
    }
    let dockerfile = std::fs::read_to_string(repo().join("docker/Dockerfile")).expect("docker/Dockerfile");
    assert!(dockerfile.matches("FROM ").count() >= 2, "a multi-stage build");
}
