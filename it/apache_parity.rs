//! popgate beside Apache's own RocketMQ 5 proxy, in front of one cluster: where the two make a choice a client
//! can see, they make the same one, so an application can move from one to the other (or use both during a
//! rolling migration) without losing anything.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::json;

use crate::harness::direct::{Direct, StoredMessage};
use crate::harness::rocketmq::ApacheProxy;
use crate::harness::sdk::Scenario;
use crate::harness::unique_topic;
use crate::publish::shared_cluster;

/// How long one driver run may take on a loaded machine (JVM start, SDK start, the scenario).
const DRIVER_TIMEOUT: Duration = Duration::from_secs(180);

/// Distinct message groups sent through each front.
const GROUPS: usize = 50;

/// Messages per group sent through each front.
const PER_GROUP: usize = 2;

/// The message groups the test sends: mostly ASCII, some outside ASCII (Java hashes UTF-16 code units) and some
/// outside the BMP (a surrogate pair, two code units).
fn message_groups() -> Vec<String> {
    (0..GROUPS)
        .map(|i| match i % 5 {
            0 => format!("订单-{i}"),
            1 => format!("🚀-{i}"),
            _ => format!("group-{i}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_group_lands_in_the_same_single_queue_through_popgate_and_through_apaches_proxy() {
    let cluster = shared_cluster();
    let topic = unique_topic("group_parity");
    let addrs: Vec<String> = cluster.brokers.iter().map(|b| format!("127.0.0.1:{}", b.port)).collect();
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    // 2 brokers × 4 queues; FIFO-typed, or Apache's proxy refuses messages with a group.
    direct.create_fifo_topic(&topic, &addrs).await;
    let popgate = crate::harness::popgate::Popgate::start(&cluster.namesrv_addr, "").await;
    let proxy = tokio::task::block_in_place(|| ApacheProxy::start(cluster));

    let groups = message_groups();
    let produce = |front: &str, endpoint: &str| {
        let args = json!({"endpoint": endpoint, "topic": topic, "count": GROUPS * PER_GROUP, "prefix": front,
            "messageGroups": groups});
        Scenario::start("produce", &args)
    };
    let through_popgate = produce("popgate", &popgate.grpc);
    let through_apache = produce("apache", &proxy.endpoint);
    for result in [through_popgate.finish(DRIVER_TIMEOUT).await, through_apache.finish(DRIVER_TIMEOUT).await] {
        assert_eq!(result["errors"], json!([]), "every send stored: {result}");
    }
    // popgate's HTTP front takes the same path as its gRPC front: one more message per group over HTTP.
    for group in &groups {
        let (status, answer) =
            popgate.publish(&json!({"topic": topic, "data": format!("http-{group}"), "messageGroup": group})).await;
        assert_eq!(status, 200, "{answer}");
    }

    let expected = GROUPS * (2 * PER_GROUP + 1);
    let stored = read_at_least(&direct, &topic, expected).await;
    assert_eq!(stored.len(), expected, "every message stored once");
    let queues = queues_by_group_and_front(&stored);
    let split: Vec<_> = queues.iter().filter(|(_, by_front)| distinct_queues(by_front).len() != 1).collect();
    assert!(split.is_empty(), "groups whose messages are not all in one queue, by front: {split:#?}");
    assert_eq!(queues.len(), GROUPS, "every group was sent: {queues:?}");
    for (group, by_front) in &queues {
        let fronts: BTreeSet<&str> = by_front.keys().map(String::as_str).collect();
        assert_eq!(fronts, BTreeSet::from(["apache", "http", "popgate"]), "{group}: {by_front:?}");
    }
    // Not a vacuous pass: the groups spread over the topic's queues on both brokers.
    let used: BTreeSet<(String, i32)> = queues.values().flat_map(distinct_queues).collect();
    assert!(used.len() >= 6, "50 groups use most of the 8 queues: {used:?}");
}

/// What `topic` holds once it holds `count` messages (polled for at most 30 s).
async fn read_at_least(direct: &Direct, topic: &str, count: usize) -> Vec<StoredMessage> {
    let mut stored = Vec::new();
    for _ in 0..150 {
        stored = direct.read_all(topic).await;
        if stored.len() >= count {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stored
}

/// For each message group (`__SHARDINGKEY`), for each front (the body's prefix: `popgate`, `apache`, `http`),
/// the queues (broker, queue id) its messages are stored in.
fn queues_by_group_and_front(stored: &[StoredMessage]) -> BTreeMap<String, BTreeMap<String, BTreeSet<(String, i32)>>> {
    let mut queues: BTreeMap<String, BTreeMap<String, BTreeSet<(String, i32)>>> = BTreeMap::new();
    for message in stored {
        let group = message.property("__SHARDINGKEY").unwrap_or("(none)").to_owned();
        let body = String::from_utf8_lossy(&message.body);
        let front = body.split('-').next().unwrap_or_default().to_owned();
        queues.entry(group).or_default().entry(front).or_default().insert((message.broker.clone(), message.queue_id));
    }
    queues
}

fn distinct_queues(by_front: &BTreeMap<String, BTreeSet<(String, i32)>>) -> BTreeSet<(String, i32)> {
    by_front.values().flatten().cloned().collect()
}
