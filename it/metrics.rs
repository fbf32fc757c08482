//! `/metrics` is valid Prometheus text: `promtool check metrics` finds nothing to complain about, and every
//! metric family the README's table lists is there with its HELP and TYPE once the paths behind it ran (HTTP
//! gRPC and remoting).

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;

use crate::harness::popgate::Popgate;
use crate::harness::unique_topic;
use crate::publish::shared_cluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_pass_promtool_and_describe_every_family() {
    let cluster = shared_cluster();
    // The remoting front on too, so its families are there.
    let remoting = format!("127.0.0.1:{}", crate::harness::free_port());
    let config = format!(
        "[delivery]\nlease_ms = 10000\npop_poll_ms = 500\ngauge_refresh_ms = 500\n\n[remoting]\nlisten = \"{remoting}\"\n"
    );
    let popgate = Popgate::start(&cluster.namesrv_addr, &config).await;
    let (topic, group) = (unique_topic("metrics"), unique_topic("g_metrics"));
    let (status, _) = popgate.publish(&json!({"topic": topic, "data": "m"})).await;
    assert_eq!(status, 200);
    let (status, _) = popgate.publish(&json!({"data": "no topic"})).await;
    assert_eq!(status, 400);
    let got = popgate.poll_until(&group, &topic, 1, Duration::from_secs(30)).await;
    let id = got[0]["deliveryId"].as_str().expect("id").to_owned();
    assert_eq!(popgate.ack(&id).await.0, 200);
    // A dead letter and a push subscriber, so their families exist too.
    let (status, _) = popgate.publish(&json!({"topic": topic, "data": "dead"})).await;
    assert_eq!(status, 200);
    let got = popgate.poll_until(&group, &topic, 1, Duration::from_secs(30)).await;
    let id = got[0]["deliveryId"].as_str().expect("id").to_owned();
    assert_eq!(popgate.post_json("/events/term", &json!({"deliveryId": id, "reason": "metrics"})).await.0, 200);
    crate::harness::eventually(Duration::from_secs(30), "the DLQ write", || async {
        popgate.metric(&format!("popgate_dlq_messages_total{{group=\"{group}\"}}")).await == 1.0
    })
    .await;
    // The subscription's gauges follow at their next refresh.
    crate::harness::eventually(Duration::from_secs(30), "the DLQ depth gauge", || async {
        popgate.metric(&format!("popgate_dlq_depth_messages{{group=\"{group}\"}}")).await == 1.0
    })
    .await;
    let _sse = crate::harness::push::SseClient::connect(&popgate.base, &format!("group={group}&topic={topic}")).await;
    // A gRPC call, so the front's duration histogram exists.
    let mut grpc = crate::grpc_raw::connect(&popgate).await;
    let heartbeat = popgate::grpc::proto::HeartbeatRequest { group: None, client_type: 1 };
    grpc.heartbeat(crate::grpc_raw::request(heartbeat, None)).await.expect("heartbeat");

    let text = popgate.metrics_text().await;
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is installed by docker/setup.sh (Debian package prometheus)");
    promtool.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("feed promtool");
    let output = promtool.wait_with_output().expect("promtool ran");
    let complaints = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success() && complaints.trim().is_empty(), "promtool: {complaints}\n{text}");

    let documented = documented_families();
    assert!(documented.len() >= 30, "the README's metric table was found: {documented:?}");
    let missing: Vec<&String> = documented
        .iter()
        .filter(|family| !text.contains(&format!("# HELP {family} ")) || !text.contains(&format!("# TYPE {family} ")))
        .collect();
    assert!(missing.is_empty(), "families the README documents but /metrics lacks: {missing:?}\n{text}");
    assert!(
        text.contains("popgate_ack_latency_seconds_bucket{le=\"0.005\"}"),
        "explicit histogram buckets, not a summary:\n{text}"
    );
}

/// Every metric family in the README's table (its rows start with `` | `popgate_ ``).
fn documented_families() -> Vec<String> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README.md");
    readme
        .lines()
        .filter_map(|line| line.strip_prefix("| `popgate_"))
        .filter_map(|rest| rest.split('`').next())
        .map(|name| format!("popgate_{name}"))
        .collect()
}
