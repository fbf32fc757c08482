//! The admin plane's DLQ against a real broker: events exhausted to `%DLQ%<group>` are browsed without being
//! consumed, replayed to their origin topic (reaching its subscribers again), and a `kill -9` mid-replay loses
//! nothing. The operator CLI runs over the same API.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::popgate::{data, id, Popgate};
use crate::harness::unique_topic;
use crate::publish::shared_cluster;

/// Short backoff so six attempts take well under a second each.
const FAST: &str = "[delivery]\nlease_ms = 8000\npop_poll_ms = 1000\n";

async fn subscribe(popgate: &Popgate, group: &str, topic: &str) {
    let body = json!({"group": group, "topic": topic, "maxAttempts": 6, "initialBackoffMs": 20, "maxBackoffMs": 40,
                      "ackTimeoutMs": 30000});
    let (status, answer) = popgate.post_json("/events/subscribe", &body).await;
    assert_eq!(status, 200, "{answer}");
}

/// Publishes `bodies` and NACKs every delivery until all of them are dead-lettered after 6 attempts.
async fn exhaust(popgate: &Popgate, group: &str, topic: &str, bodies: &[String]) {
    popgate.publish_bodies(topic, bodies).await;
    let dead = format!("popgate_dlq_messages_total{{group=\"{group}\"}}");
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while popgate.metric(&dead).await < bodies.len() as f64 {
        assert!(std::time::Instant::now() < deadline, "events not dead-lettered in time");
        for delivery in popgate.poll(group, topic, 32, 500).await {
            let (status, answer) =
                popgate.post_json("/events/nack", &json!({"deliveryId": id(&delivery), "delayMs": 0})).await;
            assert_eq!(status, 200, "{answer}");
        }
    }
}

async fn browse(popgate: &Popgate, group: &str) -> Vec<Value> {
    let (status, page) = popgate.get_json(&format!("/admin/dlq/browse?group={group}&max=100")).await;
    assert_eq!(status, 200, "{page}");
    page["messages"].as_array().cloned().unwrap_or_default()
}

async fn browse_until(popgate: &Popgate, group: &str, count: usize) -> Vec<Value> {
    // A DLQ topic the broker auto-created reaches the name server's route a moment later.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let found = browse(popgate, group).await;
        if found.len() == count {
            return found;
        }
        assert!(std::time::Instant::now() < deadline, "{count} events not browsable in the DLQ: {found:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn bodies(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Polls and ACKs until `expected` bodies arrived; returns the event id of each delivery seen, by body.
async fn receive_all(
    popgate: &Popgate,
    group: &str,
    topic: &str,
    expected: &BTreeSet<String>,
) -> HashMap<String, Vec<String>> {
    let mut seen: HashMap<String, Vec<String>> = HashMap::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !expected.iter().all(|b| seen.contains_key(b)) {
        assert!(std::time::Instant::now() < deadline, "replayed events not delivered: saw {seen:?}");
        for delivery in popgate.poll(group, topic, 32, 1000).await {
            assert_eq!(delivery["attempt"], 1, "a replayed event starts its attempts afresh: {delivery}");
            seen.entry(data(&delivery))
                .or_default()
                .push(delivery["event"]["id"].as_str().unwrap_or_default().to_owned());
            popgate.ack(&id(&delivery)).await;
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_events_are_browsed_without_consuming_and_replayed_to_their_topic() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, FAST).await;
    let (topic, group) = (unique_topic("dlq_browse"), unique_topic("g_dlq_browse"));
    subscribe(&popgate, &group, &topic).await;
    let sent = bodies("dead", 8);
    exhaust(&popgate, &group, &topic, &sent).await;

    let first = browse_until(&popgate, &group, 8).await;
    let second = browse(&popgate, &group).await;
    assert_eq!(first, second, "browsing consumes nothing: twice in a row shows the same");
    let browsed: BTreeSet<String> = first.iter().map(|m| m["data"].as_str().unwrap_or_default().to_owned()).collect();
    assert_eq!(browsed, sent.iter().cloned().collect());
    for message in &first {
        assert_eq!(message["originTopic"].as_str(), Some(topic.as_str()), "{message}");
        assert_eq!(message["attempts"], 6, "{message}");
        assert!(message["originMessageId"].as_str().is_some_and(|v| !v.is_empty()), "{message}");
        assert!(message["lastFailure"].as_str().is_some(), "{message}");
        assert!(message["deadLetteredAt"].as_i64().is_some(), "{message}");
    }

    // Paging: 3 + 3 + 2 with cursors, the same 8 in the same order.
    let mut paged = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/admin/dlq/browse?group={group}&max=3&cursor={c}"),
            None => format!("/admin/dlq/browse?group={group}&max=3"),
        };
        let (status, page) = popgate.get_json(&path).await;
        assert_eq!(status, 200, "{page}");
        paged.extend(page["messages"].as_array().cloned().unwrap_or_default());
        match page["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(paged, first, "paging shows the same events in the same order");
    let (status, answer) = popgate.get_json(&format!("/admin/dlq/browse?group={group}&cursor=bogus")).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("cursor")), "{answer}");

    // Replay 5: they reach the origin topic's subscribers (the same group) and leave the DLQ view.
    let (status, answer) =
        popgate.post_json(&format!("/admin/dlq/replay?topic=%25DLQ%25{group}&max=5&rate=50"), &json!({})).await;
    assert_eq!(status, 200, "{answer}");
    let results = answer["results"].as_array().cloned().unwrap_or_default();
    assert_eq!(results.len(), 5, "{answer}");
    assert!(results.iter().all(|r| r["status"] == "replayed"), "{answer}");
    let replayed: BTreeSet<String> =
        first[..5].iter().map(|m| m["data"].as_str().unwrap_or_default().to_owned()).collect();
    let seen = receive_all(&popgate, &group, &topic, &replayed).await;
    for message in &first[..5] {
        let ids = &seen[message["data"].as_str().unwrap_or_default()];
        assert_eq!(ids[0], message["originMessageId"].as_str().unwrap_or_default(), "replayed under its own id");
    }
    let left = browse(&popgate, &group).await;
    assert_eq!(left.len(), 3, "{left:?}");
    assert_eq!(left, first[5..].to_vec());
    assert_eq!(popgate.metric("popgate_dlq_replays_total{result=\"replayed\"}").await, 5.0);

    // The in-flight view shows a delivery handed out and not ACKed; the subscription can be deleted by id.
    popgate.publish_bodies(&topic, &["held"]).await;
    let held = popgate.poll_until(&group, &topic, 1, Duration::from_secs(30)).await;
    let (status, view) = popgate.get_json(&format!("/admin/deliveries?group={group}")).await;
    assert_eq!(status, 200, "{view}");
    let listed = view["deliveries"].as_array().cloned().unwrap_or_default();
    let entry = listed.iter().find(|d| d["deliveryId"] == held[0]["deliveryId"]).expect("the held delivery is listed");
    assert_eq!((entry["attempt"].as_i64(), entry["phase"].as_str()), (Some(1), Some("awaiting_ack")), "{entry}");
    assert!(entry["dueMs"].as_i64().is_some() && entry["topic"] == topic.as_str(), "{entry}");
    let (status, subs) = popgate.get_json("/admin/subscriptions").await;
    assert_eq!(status, 200);
    let id = format!("{group}:{topic}");
    assert!(subs["subscriptions"].as_array().is_some_and(|s| s.iter().any(|s| s["id"] == id.as_str())), "{subs}");
    let deleted = reqwest::Client::new()
        .delete(format!("{}/admin/subscriptions/{id}", popgate.base))
        .send()
        .await
        .expect("delete");
    assert_eq!(deleted.status(), 200);
    let (_, subs) = popgate.get_json("/admin/subscriptions").await;
    assert!(subs["subscriptions"].as_array().is_some_and(|s| s.iter().all(|s| s["id"] != id.as_str())), "{subs}");

    // The operator CLI over the same API.
    let cli = std::process::Command::new(env!("CARGO_BIN_EXE_popgate"))
        .args(["dlq", "browse", "--group", &group, "--url", &popgate.base])
        .output()
        .expect("run the CLI");
    assert!(cli.status.success(), "{}", String::from_utf8_lossy(&cli.stderr));
    let printed: Value = serde_json::from_slice(&cli.stdout).expect("the CLI prints JSON");
    assert_eq!(printed["messages"].as_array().map(Vec::len), Some(3), "{printed}");
    let cli = std::process::Command::new(env!("CARGO_BIN_EXE_popgate"))
        .args(["deliveries", "--url", &popgate.base])
        .output()
        .expect("run the CLI");
    assert!(cli.status.success(), "{}", String::from_utf8_lossy(&cli.stderr));
    let printed: Value = serde_json::from_slice(&cli.stdout).expect("the CLI prints JSON");
    assert!(printed["deliveries"].is_array(), "{printed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill9_in_the_middle_of_a_replay_loses_no_event_and_makes_none_new() {
    let cluster = shared_cluster();
    let mut popgate = Popgate::start(&cluster.namesrv_addr, FAST).await;
    let (topic, group) = (unique_topic("dlq_crash"), unique_topic("g_dlq_crash"));
    subscribe(&popgate, &group, &topic).await;
    let sent = bodies("crash", 8);
    exhaust(&popgate, &group, &topic, &sent).await;
    let dead = browse_until(&popgate, &group, 8).await;
    let origin_ids: HashMap<String, String> = dead
        .iter()
        .map(|m| {
            (
                m["data"].as_str().unwrap_or_default().to_owned(),
                m["originMessageId"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();

    // 2 messages a second: the kill lands after a few of the 8.
    let replay_url = format!("{}/admin/dlq/replay?group={group}&max=100&rate=2", popgate.base);
    let replay = tokio::spawn(async move { reqwest::Client::new().post(replay_url).send().await });
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    popgate.kill9();
    assert!(replay.await.expect("join").is_err(), "the replay request died with popgate");

    popgate.restart().await;
    let left = browse(&popgate, &group).await;
    assert!(!left.is_empty() && left.len() < 8, "part of the replay happened: {} left", left.len());
    let (status, answer) = popgate.post_json(&format!("/admin/dlq/replay?group={group}&max=100"), &json!({})).await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer["results"].as_array().is_some_and(|r| r.iter().all(|r| r["status"] == "replayed")), "{answer}");
    assert!(browse(&popgate, &group).await.is_empty(), "every event left the DLQ view");

    let expected: BTreeSet<String> = sent.iter().cloned().collect();
    let seen = receive_all(&popgate, &group, &topic, &expected).await;
    for (body, ids) in &seen {
        assert!(ids.iter().all(|id| id == &origin_ids[body]), "{body}: every copy carries its original id {ids:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_ledger_cannot_be_written_stops_is_counted_and_finishes_once_the_disk_is_back() {
    let cluster = shared_cluster();
    let disk = crate::harness::Tmpfs::mount(16 * 1024);
    let popgate = Popgate::start_on_disk(&cluster.namesrv_addr, &disk, "lease_ms = 60000\npop_poll_ms = 500\n").await;
    let (topic, group) = (unique_topic("ledger_full"), unique_topic("g_ledger_full"));
    let body = json!({"group": group, "topic": topic, "maxAttempts": 1});
    let (status, answer) = popgate.post_json("/events/subscribe", &body).await;
    assert_eq!(status, 200, "{answer}");
    let count = 40;
    exhaust(&popgate, &group, &topic, &bodies("ledger", count)).await;
    browse_until(&popgate, &group, count).await;

    // Each replay syncs two small ledger entries; the disk's last free page takes a few dozen at most, so one
    // of these replays must fail to record its progress. It stops there and answers 503.
    let full = disk.keep_full();
    let failures_before = popgate.metric("popgate_offset_write_failures_total").await;
    let mut refused = None;
    for attempt in 0..count {
        let (status, answer) = popgate.post_json(&format!("/admin/dlq/replay?group={group}&max=1"), &json!({})).await;
        if status == 503 {
            refused = Some((attempt, answer));
            break;
        }
        assert_eq!(status, 200, "{answer}");
    }
    let (attempt, answer) = refused.expect("a replay hit the full disk");
    assert!(answer.to_string().contains("store"), "the answer names the store: {answer}");
    assert!(
        popgate.metric("popgate_offset_write_failures_total").await > failures_before,
        "the ledger's failed write is counted like every other store write"
    );
    let (status, ready) = popgate.get_json("/readyz").await;
    assert_eq!(status, 503, "the failing ledger is surfaced: {ready}");

    drop(full);
    disk.free();
    popgate.wait_ready(Duration::from_secs(30)).await;
    let (status, answer) = popgate.post_json(&format!("/admin/dlq/replay?group={group}&max=100"), &json!({})).await;
    assert_eq!(status, 200, "{answer}");
    let results = answer["results"].as_array().cloned().unwrap_or_default();
    // The refused replay's message is replayed now, unless the write that failed was its second entry's sync
    // (`replayed`, after the publish): then it went out, the entry stands, and it is not sent again.
    let not_yet_replayed = [count - attempt, count - attempt - 1];
    assert!(not_yet_replayed.contains(&results.len()), "everything not yet replayed is replayed now: {answer}");
    assert!(results.iter().all(|r| r["status"] == "replayed"), "{answer}");
    assert!(browse(&popgate, &group).await.is_empty(), "the DLQ view is empty");
}
