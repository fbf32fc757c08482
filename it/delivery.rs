//! The consume path against a real broker (seed 000's contract): deferred broker ACK, backoff redelivery,
//! %DLQ%, NACK/TERM, kill -9 recovery, two instances on one group, a broker restart.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use popgate::delivery::record::DeliveryRecord;
use popgate::store::{Family, StateStore};

use crate::harness::direct::{Direct, DirectConsumer};
use crate::harness::popgate::{data, id, subscribe, Popgate};
use crate::harness::rocketmq::{Cluster, ClusterSpec};
use crate::harness::unique_topic;
use crate::harness::{eventually, Tmpfs};
use crate::publish::shared_cluster;

/// Short leases and POP waits so broker-side redelivery happens within a test.
const FAST_LEASE: &str = "[delivery]\nlease_ms = 4000\npop_poll_ms = 1000\n";

async fn publish_all(popgate: &Popgate, topic: &str, bodies: &[&str]) {
    popgate.publish_bodies(topic, bodies).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_sees_only_acked_events_as_consumed() {
    let cluster = shared_cluster();
    let mut popgate = Popgate::start(&cluster.namesrv_addr, FAST_LEASE).await;
    let (topic, group) = (unique_topic("ack_progress"), unique_topic("g_ack"));
    publish_all(&popgate, &topic, &["acked", "unacked"]).await;

    let deliveries = popgate.poll_until(&group, &topic, 2, Duration::from_secs(30)).await;
    assert_eq!(deliveries.len(), 2, "{deliveries:?}");
    for d in &deliveries {
        assert_eq!(d["attempt"], 1);
        // `<instance id>~<128-bit hex>`: the instance that handed it out, then the id's random part.
        let (instance, random) = d["deliveryId"].as_str().and_then(|id| id.split_once('~')).expect("an instance");
        assert!(!instance.is_empty() && random.len() == 32, "{d}");
        assert!(d["ackDeadline"].as_i64().is_some());
    }
    let acked = deliveries.iter().find(|d| data(d) == "acked").expect("delivered");
    let (status, answer) = popgate.ack(&id(acked)).await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("acked")), "{answer}");
    let (status, answer) = popgate.ack(&id(acked)).await;
    assert_eq!((status, answer["status"].as_str()), (404, Some("unknown")), "a double ACK is a no-op: {answer}");

    // popgate dies holding "unacked": no renewal, no ACK. The broker's own redelivery must bring back that one
    // event, and never the ACKed one, to a second consumer of the group.
    popgate.kill9();
    let consumer = DirectConsumer::connect(&cluster.namesrv_addr).await;
    let bodies = consumer.drain(&group, &topic, Duration::from_secs(30)).await;
    assert_eq!(bodies, vec!["unacked".to_owned()], "the broker redelivers exactly the unacknowledged event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_ack_reaches_the_broker_as_batch_requests_and_only_unacked_events_come_back() {
    let cluster = shared_cluster();
    let mut popgate = Popgate::start(&cluster.namesrv_addr, FAST_LEASE).await;
    let (topic, group) = (unique_topic("batch_ack"), unique_topic("g_batch_ack"));
    let mut bodies: Vec<String> = (0..24).map(|i| format!("acked-{i}")).collect();
    bodies.extend(["kept-1".to_owned(), "kept-2".to_owned()]);
    popgate.publish_bodies(&topic, &bodies).await;
    let deliveries = popgate.poll_until(&group, &topic, bodies.len(), Duration::from_secs(30)).await;
    assert_eq!(deliveries.len(), bodies.len());

    let single = "popgate_broker_ack_requests_total{kind=\"single\"}";
    let batch = "popgate_broker_ack_requests_total{kind=\"batch\"}";
    let (single_before, batch_before) = (popgate.metric(single).await, popgate.metric(batch).await);
    let mut ids: Vec<String> = deliveries.iter().filter(|d| data(d).starts_with("acked-")).map(id).collect();
    ids.push(ids[0].clone()); // the same id twice: the second is answered as a second ACK would be
    let (status, answer) = popgate.post_json("/events/ack", &json!({ "deliveryIds": ids })).await;
    assert_eq!(status, 200, "{answer}");
    let statuses: Vec<&str> =
        answer["results"].as_array().expect("results").iter().filter_map(|r| r["status"].as_str()).collect();
    let mut expected = vec!["acked"; 24];
    expected.push("unknown");
    assert_eq!(statuses, expected, "{answer}");
    // The 24 went as BATCH_ACK_MESSAGE requests, one per broker (the shared cluster has two), none one by one.
    // A broker that refused the batch format would show as single requests (popgate's fallback).
    let batches = popgate.metric(batch).await - batch_before;
    assert!((1.0..=2.0).contains(&batches), "one batch request per broker, not {batches}");
    assert_eq!(popgate.metric(single).await, single_before, "no fallback to single ACKs");
    assert_eq!(popgate.metric("popgate_acks_total{result=\"acked\"}").await, 24.0);

    // popgate dies holding the two kept ones: the broker brings back exactly those, never a batch-ACKed one.
    popgate.kill9();
    let consumer = DirectConsumer::connect(&cluster.namesrv_addr).await;
    let mut back = consumer.drain(&group, &topic, Duration::from_secs(30)).await;
    back.sort();
    assert_eq!(back, vec!["kept-1".to_owned(), "kept-2".to_owned()], "the broker took every batch-ACKed offset");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_never_acked_event_is_redelivered_at_the_backoff_times_then_dead_lettered() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, FAST_LEASE).await;
    let (topic, group) = (unique_topic("backoff"), unique_topic("g_backoff"));
    let (initial_ms, max_ms, ack_timeout_ms) = (300u64, 1_200u64, 1_000u64);
    subscribe(
        &popgate,
        json!({"group": group, "topic": topic, "ackTimeoutMs": ack_timeout_ms, "maxAttempts": 6,
        "initialBackoffMs": initial_ms, "maxBackoffMs": max_ms}),
    )
    .await;
    publish_all(&popgate, &topic, &["poison"]).await;

    let mut arrivals: Vec<(Instant, Value)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while arrivals.len() < 6 && Instant::now() < deadline {
        for d in popgate.poll(&group, &topic, 1, 500).await {
            arrivals.push((Instant::now(), d));
        }
    }
    let attempts: Vec<i64> = arrivals.iter().map(|(_, d)| d["attempt"].as_i64().unwrap_or(0)).collect();
    assert_eq!(attempts, vec![1, 2, 3, 4, 5, 6], "one delivery per attempt, counted");
    let ids: BTreeSet<String> = arrivals.iter().map(|(_, d)| id(d)).collect();
    assert_eq!(ids.len(), 1, "a redelivery keeps its deliveryId");
    for (n, pair) in arrivals.windows(2).enumerate() {
        let backoff = (initial_ms << n).min(max_ms) as f64;
        let gap = pair[1].0.duration_since(pair[0].0).as_millis() as f64;
        let (low, high) = (ack_timeout_ms as f64 + 0.8 * backoff - 50.0, ack_timeout_ms as f64 + 1.2 * backoff + 700.0);
        assert!((low..=high).contains(&gap), "gap before attempt {} was {gap} ms, expected {low}..{high}", n + 2);
    }

    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let dlq = format!("%DLQ%{group}");
    let mut stored = Vec::new();
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if popgate.metric(&format!("popgate_dlq_messages_total{{group=\"{group}\"}}")).await == 1.0 {
            stored = direct.read_all(&dlq).await;
            break;
        }
    }
    assert_eq!(stored.len(), 1, "the event is in {dlq}");
    let dead = &stored[0];
    assert_eq!(dead.body, b"poison");
    assert_eq!(dead.property("DLQ_ORIGIN_TOPIC"), Some(topic.as_str()));
    assert_eq!(dead.property("DLQ_ORIGIN_MESSAGE_ID"), arrivals[0].1["event"]["id"].as_str());
    assert_eq!(dead.property("POPGATE_ATTEMPTS"), Some("6"));
    assert_eq!(dead.property("POPGATE_LAST_FAILURE"), Some("ack timeout"));
    assert!(dead.property("POPGATE_DEAD_LETTERED_AT").is_some());

    assert!(popgate.poll(&group, &topic, 1, 6_000).await.is_empty(), "the original is retired, not redelivered");
    assert_eq!(popgate.metric("popgate_redeliveries_total{reason=\"timeout\"}").await, 5.0);
    assert_eq!(popgate.metric("popgate_pending_deliveries").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_term_double_ack_and_unknown_ids_behave_as_documented() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, FAST_LEASE).await;
    let (topic, group) = (unique_topic("settle"), unique_topic("g_settle"));
    subscribe(&popgate, json!({"group": group, "topic": topic, "ackTimeoutMs": 30000})).await;
    publish_all(&popgate, &topic, &["to-nack", "to-term"]).await;
    let deliveries = popgate.poll_until(&group, &topic, 2, Duration::from_secs(30)).await;
    let by_data: HashMap<String, Value> = deliveries.into_iter().map(|d| (data(&d), d)).collect();
    let nacked = id(&by_data["to-nack"]);
    let termed = id(&by_data["to-term"]);

    let nacked_at = Instant::now();
    let (status, answer) = popgate.post_json("/events/nack", &json!({"deliveryId": nacked, "delayMs": 700})).await;
    assert_eq!(
        (status, answer["status"].as_str(), answer["attempt"].as_i64()),
        (200, Some("retry"), Some(2)),
        "{answer}"
    );
    let again = popgate.poll_until(&group, &topic, 1, Duration::from_secs(10)).await;
    assert_eq!(again.len(), 1);
    assert_eq!((id(&again[0]), again[0]["attempt"].as_i64()), (nacked.clone(), Some(2)));
    assert!(nacked_at.elapsed() >= Duration::from_millis(650), "the NACK delay is honoured");

    let (status, answer) =
        popgate.post_json("/events/term", &json!({"deliveryId": termed, "reason": "bad payload"})).await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("terminated")), "{answer}");
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let dlq = format!("%DLQ%{group}");
    eventually(Duration::from_secs(20), "the terminated event reaches the DLQ", || async {
        popgate.metric(&format!("popgate_dlq_messages_total{{group=\"{group}\"}}")).await == 1.0
    })
    .await;
    let dead = direct.read_all(&dlq).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].body, b"to-term");
    assert!(dead[0].property("POPGATE_LAST_FAILURE").is_some_and(|r| r.contains("bad payload")));
    assert_eq!(dead[0].property("POPGATE_ATTEMPTS"), Some("1"));

    assert_eq!(popgate.ack(&nacked).await.0, 200);
    let (status, answer) = popgate.ack(&nacked).await;
    assert_eq!((status, answer["status"].as_str()), (404, Some("unknown")), "{answer}");
    let (status, answer) = popgate.ack("0123456789abcdef0123456789abcdef").await;
    assert_eq!((status, answer["status"].as_str()), (404, Some("unknown")), "{answer}");
    let (status, _) = popgate.post_json("/events/nack", &json!({"deliveryId": "nope"})).await;
    assert_eq!(status, 404);
    let (status, answer) = popgate.post_json("/events/ack", &json!({})).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("deliveryId")), "{answer}");
    let (status, answer) = popgate.post_json("/events/ack", &json!({"deliveryId": 7})).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("deliveryId")), "{answer}");
    let (status, answer) = popgate.get_json(&format!("/events/poll?group={group}&topic={topic}&max=0")).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("max")), "{answer}");
    let (status, answer) =
        popgate.post_json("/events/subscribe", &json!({"group": "g", "topic": "t", "maxAttempts": 0})).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("maxAttempts")), "{answer}");

    let (status, answer) = popgate.post_json("/events/ack", &json!({"deliveryIds": [nacked, "ffff"]})).await;
    assert_eq!(status, 200, "{answer}");
    let statuses: Vec<&str> =
        answer["results"].as_array().expect("results").iter().filter_map(|r| r["status"].as_str()).collect();
    assert_eq!(statuses, vec!["unknown", "unknown"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_delay_past_an_hour_is_a_400_naming_delay_ms_and_the_delivery_can_still_be_settled() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, FAST_LEASE).await;
    let (topic, group) = (unique_topic("nack_bound"), unique_topic("g_nack_bound"));
    subscribe(&popgate, json!({"group": group, "topic": topic, "ackTimeoutMs": 30000})).await;
    publish_all(&popgate, &topic, &["held"]).await;
    let delivery = popgate.poll_until(&group, &topic, 1, Duration::from_secs(30)).await.pop().expect("delivered");
    let held = id(&delivery);

    // i64::MAX overflowed the due time (a panic while the delivery was claimed, so it stayed claimed for
    // good); u64::MAX wrapped to a due time in the past; 10^15 ms scheduled the retry 30 000 years ahead.
    for delay in [i64::MAX as u64, u64::MAX, 1_000_000_000_000_000, 3_600_001] {
        let (status, answer) = popgate.post_json("/events/nack", &json!({"deliveryId": held, "delayMs": delay})).await;
        assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("delayMs")), "{delay}: {answer}");
        assert!(answer["error"]["message"].as_str().is_some_and(|m| m.contains("3600000")), "{answer}");
    }

    // Refused before the delivery was touched: still handed out, as attempt 1, and neither NACK nor ACK waits
    // for a claim someone left behind.
    let (status, answer) = popgate.post_json("/events/nack", &json!({"deliveryId": held, "delayMs": 0})).await;
    assert_eq!(
        (status, answer["status"].as_str(), answer["attempt"].as_i64()),
        (200, Some("retry"), Some(2)),
        "{answer}"
    );
    let again = popgate.poll_until(&group, &topic, 1, Duration::from_secs(10)).await;
    assert_eq!(again.iter().map(id).collect::<Vec<_>>(), vec![held.clone()], "redelivered at once");
    let (status, answer) = popgate.ack(&held).await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("acked")), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_keeps_attempts_and_ids_finishes_acks_and_retires_corrupt_records() {
    let cluster = shared_cluster();
    let mut popgate = Popgate::start(&cluster.namesrv_addr, "[delivery]\nlease_ms = 30000\npop_poll_ms = 1000\n").await;
    let (topic, group) = (unique_topic("crash"), unique_topic("g_crash"));
    subscribe(&popgate, json!({"group": group, "topic": topic, "ackTimeoutMs": 60000})).await;
    publish_all(&popgate, &topic, &["acked-before", "nacked-once", "in-flight"]).await;
    let first = popgate.poll_until(&group, &topic, 3, Duration::from_secs(30)).await;
    let by_data: HashMap<String, String> = first.iter().map(|d| (data(d), id(d))).collect();
    assert_eq!(by_data.len(), 3);
    assert_eq!(popgate.ack(&by_data["acked-before"]).await.0, 200);
    let (status, _) =
        popgate.post_json("/events/nack", &json!({"deliveryId": by_data["nacked-once"], "delayMs": 0})).await;
    assert_eq!(status, 200);
    let second = popgate.poll_until(&group, &topic, 1, Duration::from_secs(10)).await;
    assert_eq!((data(&second[0]), second[0]["attempt"].as_i64()), ("nacked-once".to_owned(), Some(2)));

    popgate.kill9();
    {
        let store = popgate::store::StateStore::open(&popgate.state_dir, true).expect("open the crashed store");
        store.put_raw(popgate::store::Family::Deliveries, "corrupt-record", b"{not json").await.expect("plant");
    }
    popgate.restart().await;

    // A deliveryId from before the crash still settles its delivery.
    let (status, answer) = popgate.ack(&by_data["in-flight"]).await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("acked")), "{answer}");
    let redelivered = popgate.poll_until(&group, &topic, 2, Duration::from_secs(10)).await;
    assert_eq!(redelivered.len(), 1, "only the unacknowledged event comes back: {redelivered:?}");
    assert_eq!(data(&redelivered[0]), "nacked-once");
    assert_eq!(id(&redelivered[0]), by_data["nacked-once"], "same deliveryId");
    assert_eq!(redelivered[0]["attempt"], 2, "the attempt counter survives the crash");
    let now_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0);
    let ack_window = redelivered[0]["ackDeadline"].as_i64().unwrap_or(0) - now_ms;
    assert!(ack_window > 45_000, "the restored subscription keeps its 60 s ACK timeout, not the 30 s default");
    assert_eq!(popgate.ack(&id(&redelivered[0])).await.0, 200);

    assert_eq!(popgate.metric("popgate_recovered_deliveries_total{outcome=\"corrupt\"}").await, 1.0);
    assert_eq!(popgate.metric("popgate_recovered_deliveries_total{outcome=\"redispatched\"}").await, 2.0);
    assert!(popgate.poll(&group, &topic, 5, 3_000).await.is_empty(), "nothing else comes back");
    let store_listing = {
        popgate.kill9();
        let store = popgate::store::StateStore::open(&popgate.state_dir, true).expect("reopen");
        store.list::<Value>(popgate::store::Family::Deliveries).expect("list")
    };
    assert!(store_listing.records.is_empty() && store_listing.undecodable.is_empty(), "every record retired");
}

/// The stored delivery records, each with whether it is in the JSON form of earlier versions.
fn stored_records(state_dir: &std::path::Path) -> HashMap<String, (DeliveryRecord, bool)> {
    stored_records_of(&StateStore::open(state_dir, true).expect("open the stopped store"))
}

fn stored_records_of(store: &StateStore) -> HashMap<String, (DeliveryRecord, bool)> {
    let mut records = HashMap::new();
    store
        .scan(Family::Deliveries, |_, value| {
            let record = DeliveryRecord::decode(value).expect("every record decodes");
            records.insert(record.id.to_string(), (record, DeliveryRecord::is_legacy_json(value)));
        })
        .expect("scan");
    records
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_json_records_from_an_earlier_version_is_recovered_and_each_record_rewritten_at_its_first_change() {
    let cluster = shared_cluster();
    // A lease long enough that no renewal rewrites a record during the test.
    let mut popgate = Popgate::start(&cluster.namesrv_addr, "[delivery]\nlease_ms = 120000\npop_poll_ms = 500\n").await;
    let (topic, group) = (unique_topic("legacy"), unique_topic("g_legacy"));
    subscribe(&popgate, json!({"group": group, "topic": topic, "ackTimeoutMs": 60000})).await;
    publish_all(&popgate, &topic, &["first", "second", "parked"]).await;
    let handed = popgate.poll_until(&group, &topic, 3, Duration::from_secs(30)).await;
    let by_data: HashMap<String, String> = handed.iter().map(|d| (data(d), id(d))).collect();
    assert_eq!(by_data.len(), 3);
    // Parked for an hour: nothing changes its record while the test runs.
    let parked = json!({"deliveryId": by_data["parked"], "delayMs": 3_600_000});
    assert_eq!(popgate.post_json("/events/nack", &parked).await.0, 200);

    // The store as the popgate before the compact form wrote it: every record JSON.
    popgate.kill9();
    {
        let store = StateStore::open(&popgate.state_dir, true).expect("open the crashed store");
        for (id, (record, legacy)) in stored_records_of(&store) {
            assert!(!legacy, "this version writes the compact form");
            store.put(Family::Deliveries, &id, &record).await.expect("rewrite as JSON");
        }
    }
    assert!(stored_records(&popgate.state_dir).values().all(|(_, legacy)| *legacy), "planted as JSON");

    popgate.restart().await;
    assert_eq!(popgate.metric("popgate_recovered_deliveries_total{outcome=\"redispatched\"}").await, 3.0);
    let again = popgate.poll_until(&group, &topic, 2, Duration::from_secs(10)).await;
    let mut seen: Vec<(String, String, i64)> =
        again.iter().map(|d| (data(d), id(d), d["attempt"].as_i64().unwrap_or(0))).collect();
    seen.sort();
    let expected = |name: &str| (name.to_owned(), by_data[name].clone(), 1);
    assert_eq!(seen, vec![expected("first"), expected("second")], "same ids, attempt kept; the parked one waits");

    // Handing them out again was their first change: rewritten in the compact form. The parked one, never
    // changed since, is still JSON: nothing rewrites the store in bulk.
    popgate.kill9();
    let stored = stored_records(&popgate.state_dir);
    assert_eq!(stored.len(), 3);
    assert!(!stored[&by_data["first"]].1 && !stored[&by_data["second"]].1, "rewritten compact");
    assert!(stored[&by_data["parked"]].1, "untouched, still JSON");

    // Recovered from the mixed store, the two complete.
    popgate.restart().await;
    let last = popgate.poll_until(&group, &topic, 2, Duration::from_secs(10)).await;
    assert_eq!(last.len(), 2, "{last:?}");
    for delivery in &last {
        let (status, answer) = popgate.ack(&id(delivery)).await;
        assert_eq!((status, answer["status"].as_str()), (200, Some("acked")), "{answer}");
    }
    eventually(Duration::from_secs(10), "the two broker ACKs made and their records retired", || async {
        popgate.metric("popgate_pending_deliveries").await == 1.0
    })
    .await;
    popgate.kill9();
    let stored = stored_records(&popgate.state_dir);
    assert_eq!(stored.keys().collect::<Vec<_>>(), vec![&by_data["parked"]], "only the parked one is left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_a_group_and_a_stale_ack_gets_409() {
    let cluster = shared_cluster();
    let config = "[delivery]\nlease_ms = 3000\npop_poll_ms = 500\n";
    let a = Popgate::start(&cluster.namesrv_addr, config).await;
    let b = Popgate::start(&cluster.namesrv_addr, config).await;
    let (topic, group) = (unique_topic("shared"), unique_topic("g_shared"));
    let bodies: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
    publish_all(&a, &topic, &bodies.iter().map(String::as_str).collect::<Vec<_>>()).await;

    let mut consumed = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(40);
    while consumed.len() < bodies.len() && Instant::now() < deadline {
        for instance in [&a, &b] {
            for d in instance.poll(&group, &topic, 4, 300).await {
                assert_eq!(instance.ack(&id(&d)).await.0, 200);
                consumed.insert(data(&d));
            }
        }
    }
    assert_eq!(consumed, bodies.iter().cloned().collect::<BTreeSet<_>>(), "every message consumed");

    // Let B's last long-polling POP (500 ms) end, so the next event can only go to a POP that A issues.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    publish_all(&a, &topic, &["contested"]).await;
    let held = a.poll_until(&group, &topic, 1, Duration::from_secs(20)).await;
    assert_eq!(data(&held[0]), "contested");
    a.signal("STOP");
    // A is frozen past its lease: the broker hands the message to B.
    let taken = b.poll_until(&group, &topic, 1, Duration::from_secs(40)).await;
    a.signal("CONT");
    assert_eq!(taken.iter().map(data).collect::<Vec<_>>(), vec!["contested".to_owned()]);
    let (status, answer) = a.ack(&id(&held[0])).await;
    assert_eq!((status, answer["status"].as_str()), (409, Some("stale")), "{answer}");
    assert_eq!(b.ack(&id(&taken[0])).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_with_deliveries_in_flight_loses_nothing_and_the_dlq_write_is_retried() {
    let mut cluster = Cluster::start(&ClusterSpec::brokers(&["broker-a"]));
    // A lease longer than the broker's downtime, so popgate still owns its deliveries when it comes back.
    let popgate = Popgate::start(&cluster.namesrv_addr, "[delivery]\nlease_ms = 120000\npop_poll_ms = 1000\n").await;
    let (topic, group) = (unique_topic("brokerbounce"), unique_topic("g_bounce"));
    subscribe(&popgate, json!({"group": group, "topic": topic, "ackTimeoutMs": 2000, "initialBackoffMs": 200})).await;
    let bodies = ["b0", "b1", "b2", "doomed"];
    publish_all(&popgate, &topic, &bodies).await;
    let in_flight = popgate.poll_until(&group, &topic, 4, Duration::from_secs(30)).await;
    assert_eq!(in_flight.len(), 4);
    let by_data: HashMap<String, String> = in_flight.iter().map(|d| (data(d), id(d))).collect();

    cluster.kill_broker("broker-a");
    // While the broker is down: an ACK is recorded (the broker ACK is owed), and a TERM's DLQ write fails,
    // is counted, and stays owed.
    let (status, answer) = popgate.ack(&by_data["b0"]).await;
    assert_eq!(status, 200, "a recorded ACK does not depend on the broker: {answer}");
    let (status, _) = popgate.post_json("/events/term", &json!({"deliveryId": by_data["doomed"], "reason": "x"})).await;
    assert_eq!(status, 200);
    eventually(Duration::from_secs(20), "the failed DLQ write is counted", || async {
        popgate.metric("popgate_dlq_record_failures_total").await >= 1.0
    })
    .await;
    assert!(popgate.metric("popgate_broker_ack_failures_total").await >= 1.0, "the owed broker ACK failed");
    cluster.restart_broker("broker-a");

    // The subscriber ACKs whatever it is handed until popgate holds nothing: the unACKed events come back, and
    // so may copies of any of the four. A broker killed within its consumer-offset flush interval (5 s) of
    // the POP forgets it and hands the same messages out again as new deliveries: duplicates, never losses.
    let mut acked: BTreeSet<String> = BTreeSet::from(["b0".to_owned()]);
    let mut duplicates = 0;
    let deadline = Instant::now() + Duration::from_secs(150);
    loop {
        for d in popgate.poll(&group, &topic, 4, 1_000).await {
            if popgate.ack(&id(&d)).await.0 == 200 && !acked.insert(data(&d)) {
                duplicates += 1;
            }
        }
        let all_in = ["b0", "b1", "b2"].iter().all(|b| acked.contains(*b));
        if all_in && popgate.metric("popgate_pending_deliveries").await == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the owed DLQ write and broker ACKs never completed, or an event was lost: acked {acked:?}"
        );
    }
    eprintln!("copies the restarted broker handed out again: {duplicates}, events acked: {acked:?}");
    assert_eq!(popgate.metric("popgate_leases_lost_total").await, 0.0, "popgate owned every delivery throughout");
    assert_eq!(popgate.metric(&format!("popgate_dlq_messages_total{{group=\"{group}\"}}")).await, 1.0);
    let dead = Direct::connect(&cluster.namesrv_addr).await.read_all(&format!("%DLQ%{group}")).await;
    assert_eq!(dead.iter().map(|m| m.body.clone()).collect::<Vec<_>>(), vec![b"doomed".to_vec()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_pops_at_a_down_broker_back_off_with_jitter_and_popping_resumes_when_it_is_back() {
    let mut cluster = Cluster::start(&ClusterSpec::brokers(&["broker-a"]));
    let popgate = Popgate::start(&cluster.namesrv_addr, "[delivery]\npop_poll_ms = 1000\n").await;
    let (topic, group) = (unique_topic("popbackoff"), unique_topic("g_popbackoff"));
    subscribe(&popgate, json!({"group": group, "topic": topic})).await;
    publish_all(&popgate, &topic, &["before"]).await;
    let first = popgate.poll_until(&group, &topic, 1, Duration::from_secs(30)).await;
    assert_eq!(popgate.ack(&id(&first[0])).await.0, 200);

    cluster.kill_broker("broker-a");
    let pop_failures = "popgate_consume_request_failures_total{op=\"pop\"}";
    let before = popgate.metric(pop_failures).await;
    // A subscriber keeps asking while the broker is down, so the POP loop keeps wanting to POP.
    let down = Duration::from_secs(16);
    let started = Instant::now();
    while started.elapsed() < down {
        assert!(popgate.poll(&group, &topic, 1, 1_000).await.is_empty());
    }
    let failed = popgate.metric(pop_failures).await - before;
    // After the n-th failure in a row the broker is asked again in 1, 2, 4, 4 ... s (±20 %): about six POPs in
    // 16 s. A fixed 1 s pause asked it about sixteen times.
    eprintln!("POPs failed while the broker was down for {down:?}: {failed}");
    assert!((2.0..=8.0).contains(&failed), "POPs failed in {down:?}: {failed}");

    cluster.restart_broker("broker-a");
    eventually(Duration::from_secs(60), "a publish is stored again", || async {
        popgate.post_json("/events/publish", &json!({"topic": topic, "data": "after"})).await.0 == 200
    })
    .await;
    let after = popgate.poll_until(&group, &topic, 1, Duration::from_secs(30)).await;
    assert_eq!(after.iter().map(data).collect::<Vec<_>>(), vec!["after".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_state_disk_dispatches_and_acks_nothing_then_delivery_resumes() {
    let cluster = shared_cluster();
    let disk = Tmpfs::mount(16 * 1024);
    let popgate = Popgate::start_on_disk(&cluster.namesrv_addr, &disk, "lease_ms = 5000\npop_poll_ms = 1000\n").await;
    let (topic, group) = (unique_topic("diskfull"), unique_topic("g_diskfull"));
    subscribe(&popgate, json!({"group": group, "topic": topic, "ackTimeoutMs": 30000})).await;
    publish_all(&popgate, &topic, &["before"]).await;
    let first = popgate.poll_until(&group, &topic, 1, Duration::from_secs(30)).await;
    assert_eq!(popgate.ack(&id(&first[0])).await.0, 200);

    let full = disk.keep_full();
    // Each record is larger than any slack left in the WAL's last page, so none of them fits.
    let during: Vec<String> = (0..5).map(|i| format!("during-{i}-{}", "x".repeat(4096))).collect();
    publish_all(&popgate, &topic, &during.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert!(
        popgate.poll(&group, &topic, 5, 4_000).await.is_empty(),
        "an event that cannot be recorded is not handed out"
    );
    assert!(popgate.metric("popgate_offset_write_failures_total").await >= 1.0);
    let (status, ready) = popgate.get_json("/readyz").await;
    assert_eq!(status, 503, "{ready}");
    assert!(ready["store"].as_str().is_some_and(|s| s.starts_with("unhealthy")), "{ready}");

    drop(full);
    disk.free();
    // Nothing was ACKed for them: the broker redelivers each once its lease lapses, and popgate records it now.
    let mut resumed = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    while resumed.len() < during.len() && Instant::now() < deadline {
        for d in popgate.poll(&group, &topic, 5, 1_000).await {
            assert_eq!(popgate.ack(&id(&d)).await.0, 200);
            resumed.insert(data(&d));
        }
    }
    assert_eq!(resumed, during.iter().cloned().collect::<BTreeSet<_>>(), "every event is delivered once space is free");
    popgate.wait_ready(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tag_filter_delivers_only_matching_events() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, FAST_LEASE).await;
    let (topic, group) = (unique_topic("filtered"), unique_topic("g_filtered"));
    subscribe(&popgate, json!({"group": group, "topic": topic, "filter": "keep || also"})).await;
    for (tag, body) in [("keep", "k1"), ("drop", "d1"), ("also", "a1"), ("drop", "d2")] {
        let (status, answer) = popgate.publish(&json!({"topic": topic, "data": body, "tags": tag})).await;
        assert_eq!(status, 200, "{answer}");
    }
    let got = popgate.poll_until(&group, &topic, 2, Duration::from_secs(30)).await;
    let bodies: BTreeSet<String> = got.iter().map(data).collect();
    assert_eq!(bodies, BTreeSet::from(["k1".to_owned(), "a1".to_owned()]));
    for d in &got {
        assert_eq!(popgate.ack(&id(d)).await.0, 200);
    }
    assert!(popgate.poll(&group, &topic, 4, 3_000).await.is_empty(), "events outside the filter are never delivered");
}

/// Each subscription with a waiting subscriber holds a POP long poll at every broker of its topic, and one
/// instance of the RocketMQ client crate carries at most 512 requests at once. popgate spreads its long polls
/// over as many client instances as they need: with 600 subscriptions none is refused and every group gets the
/// message. (Before, the POPs past 512 were refused at once, again every second, and sends beside them timed
/// out: issue #49's scale phase.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_subscriptions_than_one_client_instance_carries_long_polls_each_get_every_message() {
    use futures::StreamExt;
    const GROUPS: usize = 600;
    let cluster = shared_cluster();
    let limits = format!("[server]\nmax_waiters_per_token = {}\n", GROUPS + 16);
    let popgate = Popgate::start(&cluster.namesrv_addr, &limits).await;
    let topic = unique_topic("many_subs");
    crate::grpc::create_topic(cluster, &topic).await;
    let groups: Vec<String> = (0..GROUPS).map(|n| format!("{topic}_g{n}")).collect();
    futures::stream::iter(&groups)
        .for_each_concurrent(32, |group| subscribe(&popgate, json!({"group": group, "topic": topic})))
        .await;

    // Every group's subscriber waits, each on a connection of its own.
    let http = reqwest::Client::builder().pool_max_idle_per_host(GROUPS + 16).build().expect("http client");
    let waiting: Vec<_> = groups
        .iter()
        .map(|group| {
            let url = format!("{}/events/poll?group={group}&topic={topic}&max=1&waitMs=60000", popgate.base);
            let http = http.clone();
            tokio::spawn(async move {
                let answer = http.get(url).send().await.expect("poll");
                assert_eq!(answer.status(), 200);
                answer.json::<Value>().await.expect("JSON")["deliveries"].as_array().cloned().unwrap_or_default()
            })
        })
        .collect();
    // Longer than one POP long poll (`delivery.pop_poll_ms`, 5 s): every POP was placed, and a refused one
    // would have been counted and tried again.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let published = Instant::now();
    let (status, answer) = popgate.publish(&json!({"topic": topic, "data": "to-all"})).await;
    assert_eq!(status, 200, "{answer}");
    println!("publish beside {GROUPS} long polls answered in {:?}", published.elapsed());

    let mut received = 0;
    for (group, waited) in groups.iter().zip(waiting) {
        let deliveries = waited.await.expect("a subscriber's task");
        assert_eq!(deliveries.iter().map(data).collect::<Vec<_>>(), ["to-all"], "group {group}");
        assert_eq!(popgate.ack(&id(&deliveries[0])).await.0, 200);
        received += 1;
    }
    println!("{received} groups got the message in {:?}", published.elapsed());
    let refused = popgate.metric("popgate_consume_request_failures_total{op=\"pop\"}").await;
    assert_eq!(refused, 0.0, "no POP failed");
}

/// Each broker of a topic is popped on its own: a broker whose POP brought a message is popped again at once,
/// not once the POP waiting at the other broker ends. With POPs waiting 20 s (`pop_poll_ms`), five messages of
/// one message group (so one queue, at one broker of the two) published one after another, each once the one
/// before was received and ACKed, each arrive within 3 s. (Popped in rounds, each message after the first
/// waited for the other broker's POP to end: up to 20 s.) The subscription is not ordered: a plain POP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_pop_brought_a_message_is_popped_again_without_waiting_for_the_other_brokers() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "[delivery]\npop_poll_ms = 20000\n").await;
    let topic = unique_topic("per_broker_pops");
    let group = format!("{topic}_g");
    let addrs: Vec<String> = cluster.brokers.iter().map(|b| format!("127.0.0.1:{}", b.port)).collect();
    assert!(addrs.len() >= 2, "a topic on two brokers");
    // FIFO-typed: a message with a group is refused on a normal topic, as Apache's proxy refuses it.
    Direct::connect(&cluster.namesrv_addr).await.create_fifo_topic(&topic, &addrs).await;
    subscribe(&popgate, json!({"group": group, "topic": topic})).await;
    let mut brokers = Vec::new();
    for n in 0..5 {
        let url = format!("{}/events/poll?group={group}&topic={topic}&max=1&waitMs=30000", popgate.base);
        let waiting = tokio::spawn(async move { reqwest::get(url).await.expect("poll").json::<Value>().await });
        // The poll's demand is in, and the POPs it started wait at both brokers.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let published = Instant::now();
        let message = json!({"topic": topic, "data": format!("m{n}"), "messageGroup": "one"});
        let (status, answer) = popgate.publish(&message).await;
        assert_eq!(status, 200, "{answer}");
        brokers.push(answer["broker"].as_str().unwrap_or_default().to_owned());
        let got = waiting.await.expect("task").expect("JSON");
        let took = published.elapsed();
        let deliveries = got["deliveries"].as_array().cloned().unwrap_or_default();
        assert_eq!(deliveries.iter().map(data).collect::<Vec<_>>(), [format!("m{n}")], "message {n}: {got}");
        assert!(took < Duration::from_secs(3), "message {n} (broker {}) came {took:?} after its publish", brokers[n]);
        assert_eq!(popgate.ack(&id(&deliveries[0])).await.0, 200);
    }
    println!("five messages, each within 3 s of its publish, at brokers {brokers:?}");
    assert!(brokers.windows(2).all(|pair| pair[0] == pair[1]), "one message group, one broker: {brokers:?}");
}

/// Issue #49: each subscription with a waiting subscriber keeps a POP waiting at every broker of its topic, and
/// an empty POP ends after its wait and starts again. With more POPs waiting than `pop_polls_per_sec ×
/// pop_poll_ms / 1000` each waits `waiting / pop_polls_per_sec` seconds (`delivery::pop_wait`), so an idle
/// instance's empty POPs stay near the planned rate: 30 groups, `pop_poll_ms` 1 s and 3 planned a second, where
/// the fixed 1 s wait made 30 a second and more (one per group and broker). A message still ends the POPs at once,
/// and shutdown abandons the POPs waiting instead of waiting them out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_waiting_pops_wait_longer_yet_a_message_ends_them_at_once_and_shutdown_does_not_wait_for_them() {
    const GROUPS: usize = 30;
    let cluster = shared_cluster();
    let mut popgate =
        Popgate::start(&cluster.namesrv_addr, "[delivery]\npop_poll_ms = 1000\npop_polls_per_sec = 3\n").await;
    let topic = unique_topic("long_pops");
    crate::grpc::create_topic(cluster, &topic).await;
    let groups: Vec<String> = (0..GROUPS).map(|n| format!("{topic}_g{n}")).collect();
    for group in &groups {
        subscribe(&popgate, json!({"group": group, "topic": topic})).await;
    }
    let wait_for_one = |group: &String| {
        let url = format!("{}/events/poll?group={group}&topic={topic}&max=1&waitMs=60000", popgate.base);
        // `None` when popgate went away meanwhile (the last wait, cut by the shutdown).
        tokio::spawn(async move {
            let answer = reqwest::get(url).await.ok()?;
            assert_eq!(answer.status(), 200);
            answer.json::<Value>().await.ok()?["deliveries"].as_array().cloned()
        })
    };
    let waiting: Vec<_> = groups.iter().map(wait_for_one).collect();
    // Every group's POPs placed, and those made before all were waiting (shorter waits) started again.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let wait = popgate.metric("popgate_pop_wait_seconds").await;
    assert!(wait >= 10.0, "30 groups' POPs at 3 a second wait 10 s or more (one per broker): {wait} s");
    let empty = || popgate.metric(r#"popgate_pops_total{result="empty"}"#);
    let before = empty().await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let empty_in_10s = empty().await - before;
    println!("POPs wait {wait} s; {empty_in_10s} came back empty in 10 s");
    assert!(empty_in_10s <= 45.0, "about 3 empty POPs a second, not one per group and broker: {empty_in_10s}");

    let published = Instant::now();
    let (status, answer) = popgate.publish(&json!({"topic": topic, "data": "to-all"})).await;
    assert_eq!(status, 200, "{answer}");
    for (group, waited) in groups.iter().zip(waiting) {
        let deliveries = waited.await.expect("a subscriber's task").expect("answered");
        assert_eq!(deliveries.iter().map(data).collect::<Vec<_>>(), ["to-all"], "group {group}");
        assert_eq!(popgate.ack(&id(&deliveries[0])).await.0, 200);
    }
    let took = published.elapsed();
    println!("every group got the message {took:?} after its publish");
    assert!(took < Duration::from_secs(5), "the message ended the long POPs: {took:?}");

    let _waiting_again: Vec<_> = groups.iter().map(wait_for_one).collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stopping = Instant::now();
    popgate.signal("TERM");
    assert_eq!(popgate.wait_exit(Duration::from_secs(15)).await, Some(0), "popgate exits on its own");
    println!("popgate stopped {:?} after SIGTERM with its POPs waiting", stopping.elapsed());
    assert!(
        stopping.elapsed() < Duration::from_secs(10),
        "shutdown did not wait the POPs out: {:?}",
        stopping.elapsed()
    );
}
