//! FIFO message groups against a real broker: per-group order holds through random NACKs, a poison event is
//! dead-lettered and its group continues, and different groups proceed in parallel.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::harness::direct::Direct;
use crate::harness::popgate::Popgate;
use crate::harness::{eventually, unique_topic};
use crate::publish::shared_cluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_groups_keep_their_order_through_nacks_and_a_poison_event_does_not_block_its_group() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "[delivery]\nlease_ms = 20000\npop_poll_ms = 500\n").await;
    let (topic, group) = (unique_topic("fifo"), unique_topic("g_fifo"));
    // FIFO needs a topic whose queues do not change while it is used (as in RocketMQ, a group maps to
    // hash % queue count): create it on both brokers up front instead of relying on auto-creation.
    let addrs: Vec<String> = cluster.brokers.iter().map(|b| format!("127.0.0.1:{}", b.port)).collect();
    Direct::connect(&cluster.namesrv_addr).await.create_topic(&topic, &addrs).await;
    let (status, answer) = popgate
        .post_json(
            "/events/subscribe",
            &json!({"group": group, "topic": topic, "ordered": true, "maxAttempts": 3,
                "initialBackoffMs": 100, "maxBackoffMs": 200, "ackTimeoutMs": 10000}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    let groups = ["A", "B", "C"];
    let per_group = 50;
    for i in 0..per_group {
        for g in groups {
            let (status, answer) =
                popgate.publish(&json!({"topic": topic, "data": format!("{g}-{i}"), "messageGroup": g})).await;
            assert_eq!(status, 200, "{answer}");
        }
    }
    let poison = "B-10";

    let mut rng = StdRng::seed_from_u64(7);
    let mut expected: HashMap<String, usize> = groups.iter().map(|g| ((*g).to_owned(), 0)).collect();
    let mut acked = 0;
    let mut nacks = 0;
    let mut in_parallel = 0;
    let mut history: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while acked < groups.len() * per_group - 1 && Instant::now() < deadline {
        let batch = popgate.poll(&group, &topic, 10, 500).await;
        let distinct: std::collections::HashSet<String> =
            batch.iter().filter_map(|d| d["event"]["data"].as_str()).map(|d| d[..1].to_owned()).collect();
        if distinct.len() > 1 {
            in_parallel += 1;
        }
        for delivery in batch {
            let data = delivery["event"]["data"].as_str().expect("data").to_owned();
            let (g, i) = data.split_once('-').expect("group-index");
            let i: usize = i.parse().expect("index");
            let id = delivery["deliveryId"].as_str().expect("id").to_owned();
            history.push(format!("{data} attempt {} id {}", delivery["attempt"], &id[..8]));
            assert_eq!(
                i,
                expected[g],
                "group {g} delivered {data} while {g}-{} is unsettled; history: {:?}",
                expected[g],
                &history[history.len().saturating_sub(12)..]
            );
            if data == poison {
                let (status, answer) =
                    popgate.post_json("/events/nack", &json!({"deliveryId": id, "delayMs": 0})).await;
                assert_eq!(status, 200, "{answer}");
                if answer["status"] == "dead_letter" {
                    expected.insert(g.to_owned(), i + 1);
                }
            } else if delivery["attempt"] == 1 && rng.random_bool(0.2) {
                // At most one random NACK per event, so only the poison one can exhaust its 3 attempts.
                let (status, _) = popgate.post_json("/events/nack", &json!({"deliveryId": id, "delayMs": 50})).await;
                assert_eq!(status, 200);
                history.push(format!("nacked {data}"));
                nacks += 1;
            } else {
                assert_eq!(popgate.ack(&id).await.0, 200);
                history.push(format!("acked {data}"));
                expected.insert(g.to_owned(), i + 1);
                acked += 1;
            }
        }
    }
    assert_eq!(acked, groups.len() * per_group - 1, "every event but the poison one is consumed, in order");
    assert!(nacks > 10, "the random NACKs happened ({nacks})");
    assert!(in_parallel > 0, "different groups were in flight at the same time");
    eventually(Duration::from_secs(20), "the poison event is in the DLQ", || async {
        popgate.metric(&format!("popgate_dlq_messages_total{{group=\"{group}\"}}")).await == 1.0
    })
    .await;
}

/// What the subscriber knows of one event it received (its own record; popgate's answers are not trusted
/// beyond what they literally say).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Held {
    /// Received, ACK not sent yet.
    Holding,
    /// ACK sent; no answer yet, or none came (the instance died): the broker may have it.
    AckUnanswered,
    /// ACK answered 200.
    Acked,
    /// ACK refused (stale lease, not in flight): the event is still unsettled and comes back.
    Refused,
}

/// What the subscribers know of one event: its latest receipt (numbered), what they know of that receipt,
/// and whether any receipt's ACK was answered 200 (then the event is settled for good: a refused ACK of a
/// later duplicate does not undo it).
#[derive(Clone, Copy, Debug)]
struct EventRecord {
    receipt: usize,
    held: Held,
    ever_acked: bool,
}

/// The subscribers' shared record, per message group: event index → [`EventRecord`]. An answer about an
/// older receipt (a late 409 from an instance that hung) does not overwrite what a newer receipt learned.
#[derive(Default)]
struct OrderRecord {
    groups: HashMap<String, HashMap<usize, EventRecord>>,
    violations: Vec<String>,
    receipts: usize,
}

impl OrderRecord {
    /// Notes a receipt of `g-i`: every earlier event of `g` must be settled, or its ACK at least sent.
    /// Returns the receipt's number, for [`OrderRecord::set`].
    fn received(&mut self, g: &str, i: usize, via: &str) -> usize {
        self.receipts += 1;
        let events = self.groups.entry(g.to_owned()).or_default();
        let unsettled = |j: &usize| match events.get(j) {
            None => true,
            Some(event) => !event.ever_acked && matches!(event.held, Held::Holding | Held::Refused),
        };
        if let Some(j) = (0..i).find(unsettled) {
            self.violations.push(format!("{g}-{i} via {via} while {g}-{j} was {:?}", events.get(&j)));
        }
        let ever_acked = events.get(&i).is_some_and(|e| e.ever_acked);
        events.insert(i, EventRecord { receipt: self.receipts, held: Held::Holding, ever_acked });
        self.receipts
    }

    fn set(&mut self, g: &str, i: usize, receipt: usize, held: Held) {
        let Some(event) = self.groups.get_mut(g).and_then(|events| events.get_mut(&i)) else { return };
        event.ever_acked |= held == Held::Acked;
        if event.receipt == receipt {
            event.held = held;
        }
    }

    /// The events never ACKed whose latest receipt's ACK went unanswered (`g-i`).
    fn unanswered(&self, groups: &[&str], per_group: usize) -> Vec<String> {
        let mut unanswered = Vec::new();
        for g in groups {
            for i in 0..per_group {
                let event = self.groups.get(*g).and_then(|e| e.get(&i));
                if event.is_some_and(|e| !e.ever_acked && e.held == Held::AckUnanswered) {
                    unanswered.push(format!("{g}-{i}"));
                }
            }
        }
        unanswered
    }

    fn acked(&self, groups: &[&str], per_group: usize) -> usize {
        groups
            .iter()
            .map(|g| {
                (0..per_group)
                    .filter(|i| self.groups.get(*g).and_then(|e| e.get(i)).is_some_and(|e| e.ever_acked))
                    .count()
            })
            .sum()
    }
}

/// One subscriber of one instance: polls, holds each event a moment (so a second holder would overlap it),
/// ACKs it, and retries the ACK against the restarted instance when the first one was refused a connection.
async fn subscribe_in_order(
    base: Arc<std::sync::Mutex<String>>,
    via: &'static str,
    group: String,
    topic: String,
    record: Arc<std::sync::Mutex<OrderRecord>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client");
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let url = format!("{}/events/poll?group={group}&topic={topic}&max=4&waitMs=1000", current_base(&base));
        let Ok(Ok(body)) = http.get(url).send().await.map(|r| r.error_for_status()) else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let Ok(answer) = body.json::<serde_json::Value>().await else { continue };
        for delivery in answer["deliveries"].as_array().cloned().unwrap_or_default() {
            let data = delivery["event"]["data"].as_str().unwrap_or_default().to_owned();
            let Some((g, i)) = data.split_once('-').and_then(|(g, i)| Some((g.to_owned(), i.parse::<usize>().ok()?)))
            else {
                continue;
            };
            let receipt = record.lock().expect("record").received(&g, i, via);
            tokio::time::sleep(Duration::from_millis(100)).await;
            record.lock().expect("record").set(&g, i, receipt, Held::AckUnanswered);
            let id = delivery["deliveryId"].as_str().unwrap_or_default().to_owned();
            let outcome = ack_retrying_refused_connections(&http, &base, &id).await;
            record.lock().expect("record").set(&g, i, receipt, outcome);
        }
    }
}

/// The instance's base URL as of now (a restart changes its port).
fn current_base(base: &std::sync::Mutex<String>) -> String {
    base.lock().expect("base").clone()
}

async fn ack_retrying_refused_connections(http: &reqwest::Client, base: &std::sync::Mutex<String>, id: &str) -> Held {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let sent =
            http.post(format!("{}/events/ack", current_base(base))).json(&json!({"deliveryId": id})).send().await;
        match sent {
            Ok(resp) if resp.status().as_u16() == 200 => return Held::Acked,
            Ok(_) => return Held::Refused,
            // Nothing reached popgate: it is down; its restarted self still knows the delivery.
            Err(error) if error.is_connect() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => return Held::AckUnanswered,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_ordered_group_keep_each_message_group_in_order_through_a_kill9_and_a_hang() {
    let cluster = shared_cluster();
    let lease_ms = 6_000u64;
    let config = format!("[delivery]\nlease_ms = {lease_ms}\npop_poll_ms = 500\n");
    let publisher = Popgate::start(&cluster.namesrv_addr, "").await;
    let mut first = Popgate::start(&cluster.namesrv_addr, &config).await;
    let second = Popgate::start(&cluster.namesrv_addr, &config).await;
    let (topic, group) = (unique_topic("fifo2"), unique_topic("g_fifo2"));
    let addrs: Vec<String> = cluster.brokers.iter().map(|b| format!("127.0.0.1:{}", b.port)).collect();
    Direct::connect(&cluster.namesrv_addr).await.create_topic(&topic, &addrs).await;
    let subscription = json!({"group": group, "topic": topic, "ordered": true, "ackTimeoutMs": 30000});
    for instance in [&first, &second] {
        let (status, answer) = instance.post_json("/events/subscribe", &subscription).await;
        assert_eq!(status, 200, "{answer}");
    }

    let groups = ["A", "B", "C", "D"];
    let per_group = 60;
    let record = Arc::new(std::sync::Mutex::new(OrderRecord::default()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let first_base = Arc::new(std::sync::Mutex::new(first.base.clone()));
    let second_base = Arc::new(std::sync::Mutex::new(second.base.clone()));
    let subscribers = [(first_base.clone(), "first"), (second_base, "second")].map(|(base, via)| {
        tokio::spawn(subscribe_in_order(base, via, group.clone(), topic.clone(), record.clone(), stop.clone()))
    });
    // Published while the subscribers consume, so the faults land mid-stream.
    let publishing = {
        let (base, topic) = (publisher.base.clone(), topic.clone());
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            for i in 0..per_group {
                for g in groups {
                    let event = json!({"topic": topic, "data": format!("{g}-{i}"), "messageGroup": g});
                    let sent = http.post(format!("{base}/events/publish")).json(&event).send().await;
                    assert!(sent.is_ok_and(|r| r.status().is_success()), "publish {g}-{i}");
                }
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        })
    };
    let holds_something = |instance: &Popgate| {
        let path = format!("/admin/deliveries?group={group}");
        let instance_base = instance.base.clone();
        async move {
            let answer =
                reqwest::get(format!("{instance_base}{path}")).await.ok()?.json::<serde_json::Value>().await.ok()?;
            answer["deliveries"].as_array().map(|d| !d.is_empty())
        }
    };

    // Fault 1: the first instance is killed while it holds deliveries, and comes back.
    eventually(Duration::from_secs(30), "the first instance holds deliveries", || async {
        holds_something(&first).await == Some(true)
    })
    .await;
    first.kill9();
    tokio::time::sleep(Duration::from_secs(1)).await;
    first.restart().await;
    *first_base.lock().expect("base") = first.base.clone();
    assert!(
        first.metric("popgate_recovered_deliveries_total{outcome=\"redispatched\"}").await
            + first.metric("popgate_recovered_deliveries_total{outcome=\"ack_pending\"}").await
            >= 1.0,
        "the kill caught deliveries in flight"
    );
    // Fault 2: the second instance hangs for longer than two leases while it holds deliveries. The test takes
    // one from it itself and never ACKs it, so it surely holds one when it stops: a delivery seen held a moment
    // before could be ACKed by its subscriber before the STOP lands (a loaded clean-clone run saw no lease lost).
    eventually(Duration::from_secs(30), "the second instance hands the test a delivery", || async {
        !second.poll(&group, &topic, 1, 1_000).await.is_empty()
    })
    .await;
    second.signal("STOP");
    tokio::time::sleep(Duration::from_millis(2 * lease_ms + 3_000)).await;
    second.signal("CONT");
    eventually(Duration::from_secs(30), "the hung instance gave up its lapsed leases", || async {
        second.metric("popgate_leases_lost_total").await >= 1.0
    })
    .await;

    publishing.await.expect("publisher");
    let total = groups.len() * per_group;
    let deadline = Instant::now() + Duration::from_secs(180);
    // Since when every event not ACKed is one whose ACK went unanswered: such an event comes back within its
    // ACK timeout (30 s) unless that ACK landed, so 45 s of that ends the wait.
    let mut only_unanswered_left_since: Option<Instant> = None;
    while Instant::now() < deadline {
        let (acked, unanswered) = {
            let record = record.lock().expect("record");
            (record.acked(&groups, per_group), record.unanswered(&groups, per_group).len())
        };
        if acked == total {
            break;
        }
        if acked + unanswered == total {
            let since = *only_unanswered_left_since.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(45) {
                break;
            }
        } else {
            only_unanswered_left_since = None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for subscriber in subscribers {
        subscriber.await.expect("subscriber");
    }
    let record = std::mem::take(&mut *record.lock().expect("record"));
    assert_eq!(record.violations, Vec::<String>::new(), "a message group moved past an unsettled event");
    // An ACK the killed instance had recorded but not yet answered is completed when it restarts
    // (`recovered{outcome="ack_pending"}`): its subscriber saw no answer, and the event never comes back. Such
    // events count as settled only if nothing of the group is left, in popgate or at the broker.
    let unanswered = record.unanswered(&groups, per_group);
    assert_eq!(
        record.acked(&groups, per_group) + unanswered.len(),
        total,
        "every event was received and ACKed, or its ACK sent to the instance killed before it answered ({} receipts; unanswered: {unanswered:?})",
        record.receipts
    );
    if !unanswered.is_empty() {
        for instance in [&first, &second] {
            let (status, answer) = instance.get_json(&format!("/admin/deliveries?group={group}")).await;
            assert_eq!((status, answer["deliveries"].as_array().map(Vec::len)), (200, Some(0)), "{answer}");
        }
        let consumer = crate::harness::direct::DirectConsumer::connect(&cluster.namesrv_addr).await;
        let left = consumer.drain_as(&group, &topic, Duration::from_secs(10), true).await;
        assert!(left.is_empty(), "the events whose ACK went unanswered ({unanswered:?}) were settled: left {left:?}");
    }
}
