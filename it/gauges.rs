//! The operators' gauges against a real broker (issue #21): a subscription's backlog at the brokers, the age
//! of its oldest unacknowledged delivery, and its group's DLQ depth, as `/metrics` shows them.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::popgate::{id, Popgate};
use crate::harness::{eventually, unique_topic};
use crate::publish::shared_cluster;

/// Short refreshes, so the figures follow within a second; a long lease so nothing held lapses meanwhile.
const CONFIG: &str = "[delivery]\nlease_ms = 30000\npop_poll_ms = 500\ngauge_refresh_ms = 300\n";
/// Messages published to the subscription.
const PUBLISHED: usize = 10;
/// How many of them popgate is made to pop and hold unACKed.
const HELD: usize = 3;
/// Bound of every wait: a shared, loaded machine is slow, but not this slow.
const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlog_oldest_unacked_age_and_dlq_depth_follow_what_the_broker_and_popgate_hold() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, CONFIG).await;
    let (topic, group) = (unique_topic("gauges"), unique_topic("g_gauges"));
    let backlog = format!("popgate_subscription_backlog_messages{{group=\"{group}\",topic=\"{topic}\"}}");
    let age = format!("popgate_subscription_oldest_unacked_age_seconds{{group=\"{group}\",topic=\"{topic}\"}}");
    let depth = format!("popgate_dlq_depth_messages{{group=\"{group}\"}}");

    // Subscribed, but nobody polls: popgate pops only what subscribers ask for, so all of it waits at the broker.
    let (status, answer) = popgate.post_json("/events/subscribe", &json!({"group": group, "topic": topic})).await;
    assert_eq!(status, 200, "{answer}");
    let bodies: Vec<String> = (0..PUBLISHED).map(|i| format!("g{i}")).collect();
    popgate.publish_bodies(&topic, &bodies).await;
    let published_at = Instant::now();
    eventually(WAIT, "the backlog counts every published message", || async {
        popgate.metric(&backlog).await == PUBLISHED as f64
    })
    .await;
    let text = popgate.metrics_text().await;
    assert!(text.contains(&format!("{age} 0\n")), "nothing held yet, so the age is 0:\n{text}");
    assert!(text.contains(&format!("{depth} 0\n")), "a group without a DLQ topic has depth 0:\n{text}");
    assert_eq!(popgate.metric("popgate_stats_refresh_failures_total{op=\"dlq_depth\"}").await, 0.0);
    assert_eq!(popgate.metric("popgate_stats_refresh_failures_total{op=\"backlog\"}").await, 0.0);

    // Some popped and held unACKed: they leave the broker's backlog, and their age grows.
    let held = popgate.poll_until(&group, &topic, HELD, WAIT).await;
    assert_eq!(held.len(), HELD);
    eventually(WAIT, "the held messages leave the backlog", || async {
        let left = popgate.metric(&backlog).await;
        left > 0.0 && left <= (PUBLISHED - HELD) as f64
    })
    .await;
    let first_age = positive(&popgate, &age).await;
    assert!(
        first_age <= published_at.elapsed().as_secs_f64() + 1.0,
        "the age ({first_age} s) is not older than the messages ({:?})",
        published_at.elapsed()
    );
    eventually(WAIT, "the age grows while they stay unACKed", || async {
        popgate.metric(&age).await >= first_age + 1.0
    })
    .await;

    // Everything ACKed and the rest consumed: no backlog, nothing held.
    for delivery in &held {
        assert_eq!(popgate.ack(&id(delivery)).await.0, 200);
    }
    let rest = popgate.poll_until(&group, &topic, PUBLISHED - HELD, WAIT).await;
    assert_eq!(rest.len(), PUBLISHED - HELD);
    for delivery in &rest {
        assert_eq!(popgate.ack(&id(delivery)).await.0, 200);
    }
    eventually(WAIT, "the backlog returns to 0 and the age with it", || async {
        popgate.metric(&backlog).await == 0.0 && popgate.metric(&age).await == 0.0
    })
    .await;

    // Dozens of refreshes looked for retry and DLQ topics that do not exist, without a warning each time.
    let output = popgate.output();
    for missing in [format!("[%RETRY%{group}"), format!("[%DLQ%{group}]")] {
        assert!(!output.contains(&missing), "a warning per refresh for the missing topic {missing}:\n{output}");
    }

    // One more, TERMed: it is dead-lettered, and the DLQ depth counts it.
    popgate.publish_bodies(&topic, &["dead"]).await;
    let dead = popgate.poll_until(&group, &topic, 1, WAIT).await;
    assert_eq!(dead.len(), 1);
    let (status, answer) =
        popgate.post_json("/events/term", &json!({"deliveryId": id(&dead[0]), "reason": "gauges"})).await;
    assert_eq!(status, 200, "{answer}");
    eventually(WAIT, "the DLQ depth counts the dead letter", || async { popgate.metric(&depth).await == 1.0 }).await;
    assert_eq!(popgate.metric("popgate_stats_refresh_failures_total{op=\"dlq_depth\"}").await, 0.0);
    assert_eq!(popgate.metric("popgate_stats_refresh_failures_total{op=\"backlog\"}").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_that_cannot_reach_the_brokers_is_counted_and_the_age_still_follows() {
    // A name server nobody listens on: every broker figure fails, the in-memory one does not.
    let unreachable = format!("127.0.0.1:{}", crate::harness::free_port());
    let popgate =
        Popgate::start(&unreachable, "[delivery]\ngauge_refresh_ms = 300\n[broker]\nrequest_timeout_ms = 300\n").await;
    let (topic, group) = (unique_topic("gauges_down"), unique_topic("g_gauges_down"));
    let (status, answer) = popgate.post_json("/events/subscribe", &json!({"group": group, "topic": topic})).await;
    assert_eq!(status, 200, "{answer}");
    eventually(WAIT, "failed refreshes are counted by op", || async {
        popgate.metric("popgate_stats_refresh_failures_total{op=\"backlog\"}").await >= 2.0
            && popgate.metric("popgate_stats_refresh_failures_total{op=\"dlq_depth\"}").await >= 2.0
    })
    .await;
    let text = popgate.metrics_text().await;
    let age = format!("popgate_subscription_oldest_unacked_age_seconds{{group=\"{group}\",topic=\"{topic}\"}} 0\n");
    assert!(text.contains(&age), "the age is refreshed all the same:\n{text}");
    assert!(
        !text.contains(&format!("popgate_subscription_backlog_messages{{group=\"{group}\"")),
        "no backlog figure was ever read, so none is made up:\n{text}"
    );
    assert!(popgate.output().contains("Gauge refresh failed"), "the failure is logged");
}

/// The value of `series` once it is above 0, polled within [`WAIT`].
async fn positive(popgate: &Popgate, series: &str) -> f64 {
    let deadline = Instant::now() + WAIT;
    loop {
        let value = popgate.metric(series).await;
        if value > 0.0 {
            return value;
        }
        assert!(Instant::now() < deadline, "{series} stayed 0 for {WAIT:?}:\n{}", popgate.metrics_text().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_given_back_to_the_broker_count_as_backlog_through_the_pop_retry_topic() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, CONFIG).await;
    let (topic, group) = (unique_topic("gauges_retry"), unique_topic("g_gauges_retry"));
    let backlog = format!("popgate_subscription_backlog_messages{{group=\"{group}\",topic=\"{topic}\"}}");
    let (status, answer) = popgate.post_json("/events/subscribe", &json!({"group": group, "topic": topic})).await;
    assert_eq!(status, 200, "{answer}");
    popgate.publish_bodies(&topic, &["r1", "r2"]).await;
    assert_eq!(popgate.poll_until(&group, &topic, 2, WAIT).await.len(), 2);
    eventually(WAIT, "both popped, none left at the broker", || async { popgate.metric(&backlog).await == 0.0 }).await;

    // Unsubscribed while held: both go back to the broker unACKed, which re-puts them to the group's POP retry
    // topic once their (shortened) invisible time is over. Subscribed again, nobody polls: that is backlog.
    let (status, answer) = popgate.post_json("/events/unsubscribe", &json!({"group": group, "topic": topic})).await;
    assert_eq!(status, 200, "{answer}");
    eventually(WAIT, "both given back", || async {
        popgate.metric("popgate_deliveries_given_back_total{reason=\"unsubscribed\"}").await == 2.0
            && popgate.metric("popgate_pending_deliveries").await == 0.0
    })
    .await;
    let (status, answer) = popgate.post_json("/events/subscribe", &json!({"group": group, "topic": topic})).await;
    assert_eq!(status, 200, "{answer}");
    eventually(WAIT, "the retry topic's messages count as backlog", || async { popgate.metric(&backlog).await == 2.0 })
        .await;
    assert_eq!(popgate.poll_until(&group, &topic, 2, WAIT).await.len(), 2);
    eventually(WAIT, "popped from the retry topic, the backlog is 0 again", || async {
        popgate.metric(&backlog).await == 0.0
    })
    .await;
}
