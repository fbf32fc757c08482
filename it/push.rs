//! Push transports against a real broker: SSE and WebSocket deliver each event once while healthy, a killed
//! connection hands its events to another subscriber, and prefetch bounds a slow subscriber.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::eventually;
use crate::harness::popgate::{data, id, Popgate};
use crate::harness::push::{tight_sse, tight_ws, SseClient, WsClient};
use crate::harness::rocketmq::{Cluster, ClusterSpec};
use crate::harness::unique_topic;
use crate::publish::shared_cluster;

const CONFIG: &str = "[delivery]\nlease_ms = 20000\npop_poll_ms = 500\n";

/// [`CONFIG`] for a test that publishes megabyte bodies: on a loaded machine a broker took longer than the
/// default 3 s (RocketMQ's `sendMsgTimeout`) to store one, on both brokers, and the publish failed before the
/// test reached what it checks. The longer send timeout is the operator's setting for such a machine.
const CONFIG_LARGE_BODIES: &str =
    "[delivery]\nlease_ms = 20000\npop_poll_ms = 500\n[publish]\nsend_timeout_ms = 15000\n";

async fn publish_n(popgate: &Popgate, topic: &str, n: usize) -> BTreeSet<String> {
    publish_sized(popgate, topic, n, 0).await
}

/// Publishes `n` events whose bodies are padded to about `pad` bytes.
async fn publish_sized(popgate: &Popgate, topic: &str, n: usize, pad: usize) -> BTreeSet<String> {
    let bodies: Vec<String> = (0..n).map(|i| format!("event-{i}{}", "x".repeat(pad))).collect();
    popgate.publish_bodies(topic, &bodies).await;
    bodies.into_iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_delivers_every_event_once_and_takes_acks_by_post() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, CONFIG).await;
    let (topic, group) = (unique_topic("sse"), unique_topic("g_sse"));
    let mut sse = SseClient::connect(&popgate.base, &format!("group={group}&topic={topic}")).await;
    let published = publish_n(&popgate, &topic, 12).await;

    let mut seen = Vec::new();
    while seen.len() < published.len() {
        let delivery = sse.next(Duration::from_secs(30)).await.expect("every event is pushed");
        assert_eq!(popgate.ack(&id(&delivery)).await.0, 200);
        seen.push(data(&delivery));
    }
    assert_eq!(seen.iter().cloned().collect::<BTreeSet<_>>(), published);
    assert_eq!(seen.len(), published.len(), "each exactly once");
    assert!(sse.next(Duration::from_secs(2)).await.is_none(), "nothing more");
    assert_eq!(popgate.metric("popgate_deliveries_dispatched_total{transport=\"sse\"}").await, 12.0);
    eventually(Duration::from_secs(10), "every delivery retired", || async {
        popgate.metric("popgate_pending_deliveries").await == 0.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_delivers_every_event_once_and_settles_in_band() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, CONFIG).await;
    let (topic, group) = (unique_topic("ws"), unique_topic("g_ws"));
    let mut ws = WsClient::connect(&popgate.base, &format!("group={group}&topic={topic}")).await;
    let published = publish_n(&popgate, &topic, 12).await;

    let mut seen = Vec::new();
    let mut nacked = false;
    while seen.len() < published.len() {
        let delivery = ws.next(Duration::from_secs(30)).await.expect("every event is pushed");
        if !nacked {
            // A delay that is no integer, or longer than an hour, is refused naming it; the delivery stays held.
            for delay in [json!(u64::MAX), json!(1_000_000_000_000_000u64), json!(-1), json!("soon")] {
                let result = ws.settle(json!({"nack": id(&delivery), "delayMs": delay})).await;
                assert_eq!(
                    (result["status"].as_str(), result["field"].as_str()),
                    (Some("invalid_field"), Some("delayMs")),
                    "{result}"
                );
            }
            // One NACK in band: the same event comes back as attempt 2.
            let result = ws.settle(json!({"nack": id(&delivery), "delayMs": 100})).await;
            assert_eq!((result["op"].as_str(), result["status"].as_str()), (Some("nack"), Some("retry")), "{result}");
            nacked = true;
            continue;
        }
        let result = ws.settle(json!({"ack": id(&delivery)})).await;
        assert_eq!(result["status"], "acked", "{result}");
        seen.push(data(&delivery));
    }
    assert_eq!(seen.iter().cloned().collect::<BTreeSet<_>>(), published);
    let result = ws.settle(json!({"ack": "0123456789abcdef0123456789abcdef"})).await;
    assert_eq!(result["status"], "unknown", "{result}");
    let result = ws.settle(json!({"hello": 1})).await;
    assert_eq!(result["type"], "error", "{result}");
    assert!(ws.next(Duration::from_secs(2)).await.is_none(), "nothing more");
}

/// Reads `keep` deliveries from a push connection, then kills it; returns what it held unACKed.
async fn kill_mid_stream(popgate: &Popgate, transport: &str, group: &str, topic: &str, keep: usize) -> Vec<String> {
    let query = format!("group={group}&topic={topic}");
    let mut held = Vec::new();
    if transport == "sse" {
        let mut sse = SseClient::connect(&popgate.base, &query).await;
        while held.len() < keep {
            held.push(data(&sse.next(Duration::from_secs(30)).await.expect("pushed")));
        }
    } else {
        let mut ws = WsClient::connect(&popgate.base, &query).await;
        while held.len() < keep {
            held.push(data(&ws.next(Duration::from_secs(30)).await.expect("pushed")));
        }
    }
    held
}

/// Reads `keep` deliveries over a connection with a tiny receive buffer, stops reading until popgate's writes
/// block (its dispatch count stops moving), then kills the connection: popgate is mid-write when it dies.
async fn kill_while_writing(popgate: &Popgate, transport: &str, group: &str, topic: &str, keep: usize) -> Vec<String> {
    let query = format!("group={group}&topic={topic}");
    if transport == "sse" {
        let (held, connection) = tight_sse(&popgate.base, &query, keep).await;
        wait_until_writes_block(popgate, transport).await;
        drop(connection);
        held.iter().map(data).collect()
    } else {
        let (held, connection) = tight_ws(&popgate.base, &query, keep).await;
        wait_until_writes_block(popgate, transport).await;
        drop(connection);
        held.iter().map(data).collect()
    }
}

/// Waits until the transport's dispatch count has not moved for 2 s: the connection is full and popgate's
/// pump is blocked writing.
async fn wait_until_writes_block(popgate: &Popgate, transport: &str) {
    let series = format!("popgate_deliveries_dispatched_total{{transport=\"{transport}\"}}");
    let mut last = popgate.metric(&series).await;
    let mut still_since = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(120);
    while still_since.elapsed() < Duration::from_secs(2) {
        assert!(Instant::now() < deadline, "dispatches never settled");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = popgate.metric(&series).await;
        if now != last {
            last = now;
            still_since = Instant::now();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_sse_or_websocket_connection_hands_its_events_to_another_subscriber() {
    // Its own broker. On the shared cluster, loaded by the tests beside it, sends of this test went unanswered
    // past the send timeout (3 s, then 15 s) on both brokers, three attempts running, in CI and in a fresh clone.
    let cluster = Cluster::start(&ClusterSpec::brokers(&["broker-a"]));
    let popgate = Popgate::start(&cluster.namesrv_addr, CONFIG_LARGE_BODIES).await;
    for transport in ["sse", "websocket"] {
        let (topic, group) = (unique_topic(&format!("kill_{transport}")), unique_topic("g_kill"));
        let (status, _) = popgate
            .post_json("/events/subscribe", &json!({"group": group, "topic": topic, "ackTimeoutMs": 8000}))
            .await;
        assert_eq!(status, 200);
        // Events far larger than the tight connection's buffers: popgate is still writing when it dies.
        // (24 MiB against the server's send buffer, at most 4 MiB here, and a 4 KiB receive buffer.)
        let published = publish_sized(&popgate, &topic, 24, 1024 * 1024).await;
        let failures_before =
            popgate.metric(&format!("popgate_push_write_failures_total{{transport=\"{transport}\"}}")).await;
        let held = kill_while_writing(&popgate, transport, &group, &topic, 2).await;
        assert_eq!(held.len(), 2);
        // popgate notices the dead connection on its blocked write and hands the unwritten events back. (Only
        // the failed write moves this counter, whatever the ACK timeout does, so the bound is for a loaded
        // machine, not a measure of how fast it is.)
        let series = format!("popgate_push_write_failures_total{{transport=\"{transport}\"}}");
        eventually(Duration::from_secs(60), "the failed write is counted", || async {
            popgate.metric(&series).await > failures_before
        })
        .await;

        // Another subscriber gets everything: the unwritten events at once, the ones the dead connection took
        // (written, never ACKed) after their ACK timeout. Each poll waits at most a second; the bound is for a
        // loaded machine, where a POP round can wait seconds for a slow broker. Small batches, so each is ACKed
        // soon after it is handed out; an ACK that still comes after the 8 s ACK timeout is stale, and that event
        // comes back once more (it counts only once it is ACKed).
        let mut received = BTreeSet::new();
        let deadline = Instant::now() + Duration::from_secs(180);
        while received.len() < published.len() && Instant::now() < deadline {
            for d in popgate.poll(&group, &topic, 4, 1_000).await {
                let (status, answer) = popgate.ack(&id(&d)).await;
                if status == 409 && answer["status"] == "stale" {
                    continue;
                }
                assert_eq!(status, 200, "{answer}");
                received.insert(data(&d));
            }
        }
        assert_eq!(received.len(), published.len(), "{transport}: no event stranded by the dead connection");
        assert_eq!(received, published);
    }
    assert!(popgate.metric("popgate_redeliveries_total{reason=\"push_failure\"}").await >= 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_bounds_what_a_slow_subscriber_holds() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, CONFIG).await;
    let (topic, group) = (unique_topic("prefetch"), unique_topic("g_prefetch"));
    let mut slow = SseClient::connect(&popgate.base, &format!("group={group}&topic={topic}&prefetch=4")).await;
    let published = publish_n(&popgate, &topic, 10).await;

    let mut held = Vec::new();
    while let Some(d) = slow.next(Duration::from_secs(if held.len() < 4 { 30 } else { 3 })).await {
        held.push(d);
    }
    assert_eq!(held.len(), 4, "never more than the prefetch unACKed");
    assert_eq!(popgate.ack(&id(&held[0])).await.0, 200);
    let one_more = slow.next(Duration::from_secs(10)).await.expect("an ACK frees a slot");
    assert!(slow.next(Duration::from_secs(2)).await.is_none(), "and only one");

    // The rest of the group's events go to a sibling subscriber, not to the slow one.
    let others = popgate.poll_until(&group, &topic, 5, Duration::from_secs(20)).await;
    let mut all: BTreeSet<String> = held.iter().chain(std::iter::once(&one_more)).map(data).collect();
    all.extend(others.iter().map(data));
    assert_eq!(all, published);
    let (status, answer) = popgate.get_json(&format!("/events/stream?group={group}&topic={topic}&prefetch=0")).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("prefetch")), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_can_hand_unacked_deliveries_back_at_once() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, &format!("{CONFIG}redeliver_on_disconnect = true\n")).await;
    let (topic, group) = (unique_topic("bye"), unique_topic("g_bye"));
    let (status, _) =
        popgate.post_json("/events/subscribe", &json!({"group": group, "topic": topic, "ackTimeoutMs": 60000})).await;
    assert_eq!(status, 200);
    let published = publish_n(&popgate, &topic, 6).await;
    let held = kill_mid_stream(&popgate, "sse", &group, &topic, 2).await;
    assert_eq!(held.len(), 2);
    let started = Instant::now();
    let mut received = BTreeSet::new();
    while received.len() < published.len() && started.elapsed() < Duration::from_secs(20) {
        for d in popgate.poll(&group, &topic, 6, 1_000).await {
            assert_eq!(popgate.ack(&id(&d)).await.0, 200);
            received.insert(data(&d));
        }
    }
    assert_eq!(received, published, "the dead subscriber's events come back long before their 60 s ACK timeout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_queued_events_stay_within_the_in_flight_bound() {
    let cluster = shared_cluster();
    let bound = 300;
    let config = format!("{CONFIG}max_in_flight = {bound}\nmax_in_flight_per_subscription = {bound}\n");
    let popgate = Popgate::start(&cluster.namesrv_addr, &config).await;
    let (topic, group) = (unique_topic("bounded"), unique_topic("g_bounded"));
    // Nothing handed out may time out during the test, however slow the machine: a timed-out delivery leaves
    // its holder's prefetch and would be handed out again as a new attempt.
    let (status, _) =
        popgate.post_json("/events/subscribe", &json!({"group": group, "topic": topic, "ackTimeoutMs": 3600000})).await;
    assert_eq!(status, 200);
    let mut slow = SseClient::connect(&popgate.base, &format!("group={group}&topic={topic}&prefetch=4")).await;
    let rss_before = popgate.rss_kib();

    let total = 10_000;
    let client = reqwest::Client::new();
    let url = format!("{}/events/publish", popgate.base);
    let publishers = (0..16).map(|worker| {
        let (client, url, topic) = (client.clone(), url.clone(), topic.clone());
        tokio::spawn(async move {
            for i in (worker..total).step_by(16) {
                let resp = client.post(&url).json(&json!({"topic": topic, "data": format!("q{i}")})).send().await;
                assert!(resp.is_ok_and(|r| r.status().is_success()), "publish {i}");
            }
        })
    });
    let publishing = futures::future::join_all(publishers);
    // A greedy long-poller that never ACKs asks for far more than the bound: in flight must reach the bound,
    // and stop there.
    let mut greedy: BTreeSet<String> = BTreeSet::new();
    let mut peak = 0.0f64;
    tokio::pin!(publishing);
    let mut published = None;
    let deadline = Instant::now() + Duration::from_secs(300);
    while (published.is_none() || peak < f64::from(bound)) && Instant::now() < deadline {
        tokio::select! {
            results = &mut publishing, if published.is_none() => published = Some(results),
            batch = popgate.poll(&group, &topic, 256, 500) => greedy.extend(batch.iter().map(id)),
        }
        peak = peak.max(popgate.metric("popgate_pending_deliveries").await);
    }
    let results = published.expect("publishing finished");
    assert!(results.iter().all(Result::is_ok), "every publish succeeded");
    // POP may overshoot the bound by one batch per broker (2 × 16) before it sees the count.
    assert!(peak >= f64::from(bound), "in flight reached its bound of {bound} (peak {peak})");
    assert!(peak <= f64::from(bound + 32), "in flight peaked at {peak} with a bound of {bound}");
    assert!(greedy.len() <= bound as usize + 32, "the greedy poller holds {} deliveries", greedy.len());

    let mut held: BTreeSet<String> = BTreeSet::new();
    while let Some(d) = slow.next(Duration::from_secs(2)).await {
        held.insert(id(&d));
    }
    assert_eq!(held.len(), 4, "the slow subscriber holds its prefetch and no more");
    let grown_mib = popgate.rss_kib().saturating_sub(rss_before) / 1024;
    assert!(grown_mib < 64, "memory stays bounded with {total} events queued at the broker: grew {grown_mib} MiB");
}
