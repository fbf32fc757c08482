//! `/metrics` is valid Prometheus text: `promtool check metrics` finds nothing to complain about, and every
//! metric popgate documents is described (HELP/TYPE) once it has been touched.

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
    let popgate = Popgate::start(&cluster.namesrv_addr, "[delivery]\nlease_ms = 10000\npop_poll_ms = 500\n").await;
    let (topic, group) = (unique_topic("metrics"), unique_topic("g_metrics"));
    let (status, _) = popgate.publish(&json!({"topic": topic, "data": "m"})).await;
    assert_eq!(status, 200);
    let (status, _) = popgate.publish(&json!({"data": "no topic"})).await;
    assert_eq!(status, 400);
    let got = popgate.poll_until(&group, &topic, 1, Duration::from_secs(30)).await;
    let id = got[0]["deliveryId"].as_str().expect("id").to_owned();
    assert_eq!(popgate.ack(&id).await.0, 200);

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

    for family in [
        "popgate_publish_requests_total",
        "popgate_send_attempts_total",
        "popgate_publish_duration_seconds",
        "popgate_deliveries_dispatched_total",
        "popgate_acks_total",
        "popgate_ack_latency_seconds",
        "popgate_pending_deliveries",
    ] {
        assert!(text.contains(&format!("# HELP {family} ")), "{family} has HELP text:\n{text}");
        assert!(text.contains(&format!("# TYPE {family} ")), "{family} has a TYPE:\n{text}");
    }
    assert!(
        text.contains("popgate_ack_latency_seconds_bucket{le=\"0.005\"}"),
        "explicit histogram buckets, not a summary:\n{text}"
    );
}
