//! The broker lease apart from the subscriber's deadline (issue #49): popgate keeps the subscriber's ACK deadline
//! and retries itself, and holds the message at the broker on a lease whose length follows how much the instance
//! holds (`delivery.lease_ms` .. `delivery.max_lease_ms`, `delivery.lease_renewals_per_sec`).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::direct::DirectConsumer;
use crate::harness::popgate::{data, id, subscribe, Popgate};
use crate::harness::{eventually, unique_topic};
use crate::publish::shared_cluster;

/// A delivery nobody ACKs is handed out again by popgate, attempt after attempt, past several ACK timeouts and
/// several broker leases: its lease is renewed all along, so the broker never hands the message out again (which
/// popgate would see as a new delivery of the same event), and once ACKed it never comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_held_past_several_ack_timeouts_and_leases_is_never_redelivered_by_the_broker() {
    let cluster = shared_cluster();
    // A 6 s lease, renewed with 3 s left: about one renewal every 3 s.
    let lease_ms = 6_000u64;
    let popgate =
        Popgate::start(&cluster.namesrv_addr, &format!("[delivery]\nlease_ms = {lease_ms}\npop_poll_ms = 500\n")).await;
    let (topic, group) = (unique_topic("held_long"), unique_topic("g_held_long"));
    subscribe(
        &popgate,
        json!({"group": group, "topic": topic, "ackTimeoutMs": 2000, "maxAttempts": 20,
               "initialBackoffMs": 500, "maxBackoffMs": 500}),
    )
    .await;
    popgate.publish_bodies(&topic, &["held"]).await;

    // Hand-outs, never ACKed, for longer than three leases (and several ACK timeouts).
    let held_for = Duration::from_millis(3 * lease_ms + 2_000);
    let started = Instant::now();
    let mut ids = BTreeSet::new();
    let mut attempts = Vec::new();
    while started.elapsed() < held_for {
        for delivery in popgate.poll(&group, &topic, 4, 1_000).await {
            assert_eq!(data(&delivery), "held");
            ids.insert(id(&delivery).split('!').next().unwrap_or_default().to_owned());
            attempts.push(delivery["attempt"].as_u64().unwrap_or(0));
        }
    }
    let renewals = popgate.metric("popgate_lease_renewals_total").await;
    assert!(renewals >= 3.0, "the lease was renewed all along: {renewals} renewals in {held_for:?}");
    assert_eq!(popgate.metric("popgate_leases_lost_total").await, 0.0);
    assert_eq!(ids.len(), 1, "one delivery, handed out again by popgate, never a second from the broker: {ids:?}");
    assert!(attempts.windows(2).all(|w| w[0] < w[1]), "each hand-out a new attempt: {attempts:?}");
    assert!(attempts.len() >= 3, "handed out again after each ACK timeout: {attempts:?}");

    // Settled on its next hand-out, it never comes back: not from popgate, not from the broker.
    let last = popgate.poll_until(&group, &topic, 1, Duration::from_secs(30)).await;
    assert_eq!(last.len(), 1);
    let (status, answer) = popgate.ack(&id(&last[0])).await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("acked")), "{answer}");
    eventually(Duration::from_secs(30), "the broker ACK", || async {
        popgate.metric("popgate_broker_acks_total").await >= 1.0
    })
    .await;
    assert!(popgate.poll(&group, &topic, 4, 2_000).await.is_empty());
    drop(popgate);
    let direct = DirectConsumer::connect(&cluster.namesrv_addr).await;
    let back = direct.drain(&group, &topic, Duration::from_millis(lease_ms + 10_000)).await;
    assert!(back.is_empty(), "the broker handed an ACKed event out again: {back:?}");
}

/// The lease grows with what an instance holds, and an instance lost for good (killed, never restarted) gives
/// what it held back through the broker within that lease: no sooner than the lease popgate recorded, no later
/// than `delivery.max_lease_ms` (and a POP) after the loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_instance_gives_back_what_it_held_within_its_lease_which_grows_with_what_it_holds() {
    let cluster = shared_cluster();
    // One renewal a second planned: 8 held take a 16 s lease (2 × 8 / 1), more than the 6 s `lease_ms`.
    let (lease_ms, max_lease_ms, held) = (6_000u64, 30_000u64, 8usize);
    let config = format!(
        "[delivery]\nlease_ms = {lease_ms}\nmax_lease_ms = {max_lease_ms}\nlease_renewals_per_sec = 1\npop_poll_ms = 500\n"
    );
    let mut popgate = Popgate::start(&cluster.namesrv_addr, &config).await;
    let (topic, group) = (unique_topic("lost_lease"), unique_topic("g_lost_lease"));
    subscribe(&popgate, json!({"group": group, "topic": topic, "ackTimeoutMs": 600000})).await;
    let bodies: Vec<String> = (0..held).map(|i| format!("held-{i}")).collect();
    popgate.publish_bodies(&topic, &bodies).await;
    let got = popgate.poll_until(&group, &topic, held, Duration::from_secs(30)).await;
    assert_eq!(got.len(), held);

    // The first POP asked for `lease_ms` (nothing was held yet); each renewal asks for the lease 8 held take.
    let planned_ms = 2_000 * held as u64;
    eventually(Duration::from_secs(30), "every held delivery renewed on the longer lease", || async {
        popgate.metric("popgate_lease_renewals_total").await >= held as f64
            && popgate.metric("popgate_lease_asked_seconds").await * 1000.0 == planned_ms as f64
    })
    .await;
    let (_, view) = popgate.get_json(&format!("/admin/deliveries?group={group}")).await;
    let deadlines: Vec<i64> = view["deliveries"]
        .as_array()
        .map(|d| d.iter().filter_map(|d| d["leaseDeadlineMs"].as_i64()).collect())
        .unwrap_or_default();
    assert_eq!(deadlines.len(), held, "{view}");
    popgate.kill9();
    let lost_at = epoch_ms();
    let earliest = deadlines.iter().copied().min().unwrap_or_default();
    assert!(
        earliest - lost_at > lease_ms as i64,
        "the renewed leases outlast lease_ms: {} ms left at the loss",
        earliest - lost_at
    );

    // Nothing comes back before the earliest lease ends; all of it within the longest lease (and a POP).
    let direct = DirectConsumer::connect(&cluster.namesrv_addr).await;
    let mut back: Vec<(String, i64)> = Vec::new();
    let give_up = Instant::now() + Duration::from_millis(max_lease_ms + 20_000);
    while back.len() < held && Instant::now() < give_up {
        for body in direct.drain(&group, &topic, Duration::from_secs(1)).await {
            back.push((body, epoch_ms()));
        }
    }
    let mut returned: Vec<&str> = back.iter().map(|(body, _)| body.as_str()).collect();
    returned.sort_unstable();
    let mut expected: Vec<&str> = bodies.iter().map(String::as_str).collect();
    expected.sort_unstable();
    assert_eq!(returned, expected, "everything it held came back through the broker");
    let first_back = back.iter().map(|(_, at)| *at).min().unwrap_or_default();
    let last_back = back.iter().map(|(_, at)| *at).max().unwrap_or_default();
    assert!(first_back >= earliest, "nothing back before its lease ended ({} ms early)", earliest - first_back);
    assert!(
        last_back - lost_at <= max_lease_ms as i64 + 15_000,
        "all back within max_lease_ms (and the broker's revive and a POP): {} ms",
        last_back - lost_at
    );
}

fn epoch_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}
