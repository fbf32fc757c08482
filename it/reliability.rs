//! Reliability profiles against a real master + slave pair (seed 004, checkpoint 2): what each profile
//! accepts as stored, the broker check, the fatal flag, and a profile switch that keeps in-flight deliveries.

use std::time::Duration;

use serde_json::json;

use crate::harness::eventually;
use crate::harness::popgate::Popgate;
use crate::harness::rocketmq::{Cluster, ClusterSpec};
use crate::harness::unique_topic;
use crate::publish::shared_cluster;

fn profile(name: &str) -> String {
    format!("[reliability]\nprofile = \"{name}\"\nbroker_check_interval_secs = 2\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slave_fails_sync_replication_profiles_and_degrades_throughput() {
    // The shipped `balanced` broker profile: one ASYNC_FLUSH + SYNC_MASTER (inSyncReplicas=2) master with its
    // slave. Right for `balanced`, weaker than `financial` on flush.
    let spec = ClusterSpec::profile("balanced");
    assert!(spec.with_slaves && spec.sync_replication, "balanced replicates synchronously");
    let mut cluster = Cluster::start(&spec);
    let financial = Popgate::start(&cluster.namesrv_addr, &profile("financial")).await;
    let balanced = Popgate::start(&cluster.namesrv_addr, &profile("balanced")).await;
    let throughput = Popgate::start(&cluster.namesrv_addr, &profile("throughput")).await;
    let topic = unique_topic("profiles");

    eventually(Duration::from_secs(60), "the slave replicates: SEND_OK", || async {
        let (status, answer) = balanced.publish(&json!({"topic": topic, "data": "both copies"})).await;
        status == 200 && answer["status"] == "SEND_OK"
    })
    .await;
    eventually(Duration::from_secs(15), "the financial instance flags the ASYNC_FLUSH broker", || async {
        financial.metric("popgate_profile_mismatch{broker=\"broker-a\"}").await == 1.0
    })
    .await;
    assert_eq!(balanced.metric("popgate_profile_mismatch{broker=\"broker-a\"}").await, 0.0);
    assert_eq!(throughput.metric("popgate_profile_mismatch{broker=\"broker-a\"}").await, 0.0);
    let (status, ready) = financial.get_json("/readyz").await;
    assert_eq!(status, 200, "a mismatch is reported, not fatal, by default: {ready}");
    assert_eq!(ready["profile"]["mismatch"], true, "{ready}");
    let (_, brokers) = financial.get_json("/admin/brokers").await;
    let shortfalls = brokers["brokers"][0]["profile"]["shortfalls"].to_string();
    assert!(shortfalls.contains("SYNC_FLUSH"), "{brokers}");

    let (status, answer) =
        financial.post_json("/events/publish?mode=oneway", &json!({"topic": topic, "data": "x"})).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("mode")), "{answer}");

    cluster.kill_slave("broker-a");
    // RocketMQ 5.x reports a slave that does not confirm as FLUSH_SLAVE_TIMEOUT (SLAVE_NOT_AVAILABLE is 4.x's).
    for (name, popgate) in [("financial", &financial), ("balanced", &balanced)] {
        let (status, answer) = popgate.publish(&json!({"topic": topic, "data": "one copy"})).await;
        assert_eq!(status, 503, "{name}: {answer}");
        let attempts = answer["error"]["attempts"].as_array().expect("attempts");
        assert_eq!(attempts.len(), 3, "{name} retries a store short of the profile: {answer}");
        // Each attempt is refused; on a loaded machine one may outlast popgate's deadline before the broker's
        // own FLUSH_SLAVE_TIMEOUT comes, but none is taken as stored.
        let refused_short = attempts.iter().filter(|a| a["error"].to_string().contains("FLUSH_SLAVE_TIMEOUT")).count();
        assert!(refused_short >= 1, "{answer}");
        assert!(popgate.metric("popgate_send_failures_total{reason=\"not_stored\"}").await >= 3.0);
    }
    let (status, answer) = throughput.publish(&json!({"topic": topic, "data": "one copy"})).await;
    assert_eq!(
        (status, answer["status"].as_str()),
        (200, Some("FLUSH_SLAVE_TIMEOUT")),
        "degraded but accepted: {answer}"
    );
    assert_eq!(throughput.metric("popgate_send_degraded_total{status=\"FLUSH_SLAVE_TIMEOUT\"}").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_on_mismatch_refuses_to_start_against_a_weaker_broker() {
    // The shared brokers are ASYNC_FLUSH + ASYNC_MASTER: weaker than `durable` on flush.
    let cluster = shared_cluster();
    let config = "[reliability]\nprofile = \"durable\"\nfail_on_mismatch = true\n";
    let (code, output) = Popgate::expect_exit(&cluster.namesrv_addr, config).await;
    assert_ne!(code, Some(0), "{output}");
    assert!(output.contains("weaker than the reliability profile") && output.contains("SYNC_FLUSH"), "{output}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_profiles_by_restart_keeps_in_flight_deliveries() {
    let cluster = shared_cluster();
    let mut popgate =
        Popgate::start(&cluster.namesrv_addr, &format!("{}[delivery]\nlease_ms = 30000\n", profile("throughput")))
            .await;
    let (topic, group) = (unique_topic("switch"), unique_topic("g_switch"));
    let (status, _) = popgate.publish(&json!({"topic": topic, "data": "survivor"})).await;
    assert_eq!(status, 200);
    let before = popgate.poll_until(&group, &topic, 1, Duration::from_secs(30)).await;
    assert_eq!(before.len(), 1);

    popgate.kill9();
    popgate.set_config_line("profile", "\"durable\"");
    popgate.restart().await;
    let (_, ready) = popgate.get_json("/readyz").await;
    assert_eq!(ready["profile"]["name"], "durable", "{ready}");
    let after = popgate.poll_until(&group, &topic, 1, Duration::from_secs(10)).await;
    assert_eq!(after.len(), 1, "the in-flight delivery survives the switch");
    assert_eq!(after[0]["deliveryId"], before[0]["deliveryId"]);
    assert_eq!(popgate.ack(after[0]["deliveryId"].as_str().unwrap_or_default()).await.0, 200);
}
