//! The remoting front, spoken to by Apache's Go client (`rocketmq-client-go` v2, through `it/go-driver`) pointed
//! at popgate as its name server, as a Go app would be. Each test checks what the client saw and what the
//! brokers hold, read straight from them; where it is cheap, the same scenario also runs straight at the
//! cluster's name server and the two are compared.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::direct::{Direct, StoredMessage};
use crate::harness::go_client;
use crate::harness::rocketmq::{Cluster, ClusterSpec};
use crate::harness::sdk::bodies;
use crate::harness::{eventually, unique_topic};
use crate::publish::shared_cluster;
use crate::remoting::{create_topic, popgate_with_remoting, stored, stored_bodies};

/// How long one driver run may take on a loaded machine.
const DRIVER_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a consumer whose committed offsets a test reads stays up after its last message: the Go client
/// commits every 5 s, and the commits it sends as it shuts down are one-way frames its connection may close on
/// before they leave (straight at the cluster too; a loaded run lost one queue's commit that way).
const OFFSETS_COMMITTED_MS: u64 = 6_000;

/// A scenario's arguments: `extra` and the name server (popgate's remoting address, or the cluster's own). A
/// first send asks for the topic's route and opens connections, seconds on a loaded machine, so a send may
/// take 10 s (the client's default is 3 s).
fn args(namesrv: &str, mut extra: Value) -> Value {
    extra["namesrv"] = json!(namesrv);
    if extra.get("sendTimeoutMs").is_none() {
        extra["sendTimeoutMs"] = json!(10_000);
    }
    extra
}

/// What `topic` holds, by body label (a padded body's text up to its first space), once it holds `count`
/// messages (at most 30 s).
async fn stored_by_label(cluster: &Cluster, topic: &str, count: usize) -> BTreeMap<String, StoredMessage> {
    let messages: BTreeMap<String, StoredMessage> = stored(cluster, topic, count)
        .await
        .into_values()
        .map(|m| (String::from_utf8_lossy(&m.body).split(' ').next().unwrap_or_default().to_owned(), m))
        .collect();
    assert_eq!(messages.len(), count, "exactly {count} messages in {topic}: {:?}", messages.keys());
    messages
}

/// Every kind of send the Go producer has, each run as one driver process: what `produce` is run with.
fn every_kind_of_send(topic: &str) -> Vec<Value> {
    let run = |extra: Value| {
        let mut run = json!({"topic": topic, "group": "go_send_p"});
        for (k, v) in extra.as_object().expect("object") {
            run[k] = v.clone();
        }
        run
    };
    vec![
        run(json!({"mode": "sync", "count": 3, "bodyPrefix": "sync", "tag": "TagA", "keys": "k1 k2",
            "properties": {"color": "red"}})),
        run(json!({"mode": "async", "count": 2, "bodyPrefix": "async"})),
        run(json!({"mode": "oneway", "count": 2, "bodyPrefix": "oneway"})),
        run(json!({"mode": "batch", "count": 2, "bodyPrefix": "batch"})),
        // An app's own queue selector, and the client's hash selector on a sharding key.
        run(json!({"mode": "sync", "count": 2, "bodyPrefix": "selected", "queueId": 2})),
        run(json!({"mode": "sync", "count": 3, "bodyPrefix": "keyed", "orderKey": "order-1"})),
        run(json!({"mode": "sync", "count": 1, "bodyPrefix": "delayed", "delayLevel": 1})),
        // Over 4 KiB: the client compresses the body.
        run(json!({"mode": "sync", "count": 1, "bodyPrefix": "big", "bodyBytes": 6000})),
    ]
}

/// The bodies [`every_kind_of_send`] sends, and the remoting sends popgate counts for them (a batch is one).
const SENT_BODIES: usize = 3 + 2 + 2 + 2 + 2 + 3 + 1 + 1;
const SEND_REQUESTS: f64 = 3.0 + 2.0 + 2.0 + 1.0 + 2.0 + 3.0 + 1.0 + 1.0;

/// Runs [`every_kind_of_send`] against `namesrv`, one run after the other; every client-side result.
async fn send_every_kind(namesrv: &str, topic: &str) -> Vec<Value> {
    let mut results = Vec::new();
    for run in every_kind_of_send(topic) {
        let result = go_client::run("produce", &args(namesrv, run.clone()), DRIVER_TIMEOUT).await;
        assert_eq!(result["errors"], json!([]), "{run}: {result}");
        assert_eq!(result["timedOut"], false, "{run}: {result}");
        let count = run["count"].as_u64().unwrap_or(1) as usize;
        assert_eq!(result["sent"].as_array().map(Vec::len), Some(count), "every send answered: {result}");
        results.push(result);
    }
    results
}

/// What the client was told of each send, by body (oneway sends are told nothing).
fn sent_by_body(results: &[Value]) -> BTreeMap<String, Value> {
    results
        .iter()
        .filter(|r| r["mode"] != "oneway")
        .flat_map(|r| r["sent"].as_array().cloned().unwrap_or_default())
        .map(|s| (s["body"].as_str().unwrap_or_default().to_owned(), s))
        .collect()
}

/// The properties a stored message carries that the sending client chose (the broker's and the client's
/// bookkeeping left out: ids, offsets, the cluster, wait flags, a delayed message's own topic and queue), for
/// comparing two stored copies.
fn chosen_properties(m: &StoredMessage) -> BTreeMap<String, String> {
    const BOOKKEEPING: [&str; 8] =
        ["UNIQ_KEY", "MIN_OFFSET", "MAX_OFFSET", "CLUSTER", "WAIT", "TRACE_ON", "REAL_TOPIC", "REAL_QID"];
    m.properties
        .iter()
        .filter(|(k, _)| !BOOKKEEPING.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_go_send_is_stored_with_its_properties_in_its_queue_as_straight_at_the_cluster() {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let (through, straight) = (unique_topic("go_send"), unique_topic("go_send_direct"));
    create_topic(cluster, &through).await;
    create_topic(cluster, &straight).await;

    let (through_results, straight_results) =
        tokio::join!(send_every_kind(&namesrv, &through), send_every_kind(&cluster.namesrv_addr, &straight));
    let through_stored = stored_by_label(cluster, &through, SENT_BODIES).await;
    let straight_stored = stored_by_label(cluster, &straight, SENT_BODIES).await;

    let expected: BTreeSet<String> = every_kind_of_send(&through)
        .iter()
        .flat_map(|run| {
            let prefix = run["bodyPrefix"].as_str().unwrap_or_default().to_owned();
            (0..run["count"].as_u64().unwrap_or(1)).map(move |i| format!("{prefix}-{i}"))
        })
        .collect();
    assert_eq!(through_stored.keys().cloned().collect::<BTreeSet<_>>(), expected, "each send stored once");

    // What the client was told is what the broker stored: its message id, broker, queue.
    let told = sent_by_body(&through_results);
    for (body, sent) in &told {
        let m = &through_stored[body];
        assert_eq!(sent["status"], "SEND_OK", "{sent}");
        assert!(sent["offsetMsgId"].as_str().is_some_and(|id| id.len() == 32), "the broker's offset id: {sent}");
        // The Go client gives a batch's messages no id of their own ("").
        let id = sent["msgId"].as_str().filter(|id| !id.is_empty());
        assert_eq!(id, m.property("UNIQ_KEY"), "{body}: the client's id is the stored one: {sent}");
        assert_eq!(sent["broker"].as_str(), Some(m.broker.as_str()), "{body}: {sent}");
        assert_eq!(sent["queueId"].as_i64(), Some(i64::from(m.queue_id)), "{body}: {sent}");
    }
    let first = &through_stored["sync-0"];
    assert_eq!(first.property("TAGS"), Some("TagA"));
    assert_eq!(first.property("KEYS"), Some("k1 k2"));
    assert_eq!(first.property("color"), Some("red"));
    for body in ["selected-0", "selected-1"] {
        assert_eq!(through_stored[body].queue_id, 2, "the app's selector chose queue 2");
    }
    let keyed: BTreeSet<(String, i32)> =
        (0..3).map(|i| &through_stored[&format!("keyed-{i}")]).map(|m| (m.broker.clone(), m.queue_id)).collect();
    assert_eq!(keyed.len(), 1, "one sharding key, one queue: {keyed:?}");
    let delayed = &through_stored["delayed-0"];
    assert_eq!(delayed.property("DELAY"), Some("1"), "the delay level reached the broker");
    assert_eq!(delayed.property("REAL_TOPIC"), Some(through.as_str()), "delivered to its topic when due");
    let big = &through_stored["big-0"];
    assert_eq!(big.body.len(), 6000, "the compressed body comes back whole");
    assert!(big.body[6..].iter().all(|b| *b == b'x'), "the compressed body comes back as sent");

    // The same sends straight at the cluster store the same messages, with the same properties and queues.
    for (body, m) in &through_stored {
        let direct = &straight_stored[body];
        assert_eq!(chosen_properties(m), chosen_properties(direct), "{body}: as straight at the cluster");
        assert_eq!(m.property("UNIQ_KEY").is_some(), direct.property("UNIQ_KEY").is_some(), "{body}");
        if body.starts_with("selected") {
            assert_eq!(m.queue_id, direct.queue_id, "{body}");
        }
    }
    assert_eq!(sent_by_body(&straight_results).len(), told.len());
    let ok = popgate.metric("popgate_publish_requests_total{result=\"ok\",transport=\"remoting\"}").await;
    let accepted = popgate.metric("popgate_publish_requests_total{result=\"accepted\",transport=\"remoting\"}").await;
    // The Go client does not flag its one-way sends as one-way (`InvokeOneWay` sends an ordinary request and
    // reads no answer), so popgate sends them as it would a synchronous send, and counts them `ok`.
    assert_eq!((ok, accepted), (SEND_REQUESTS, 0.0), "each send went through popgate's publish path once");
}

/// The deliveries of `body` in a push consumer's result, in arrival order.
fn deliveries_of<'a>(result: &'a Value, body: &str) -> Vec<&'a Value> {
    result["received"].as_array().into_iter().flatten().filter(|r| r["body"] == body).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_push_consumers_get_every_message_a_retried_one_again_from_the_retry_topic_and_broadcast_to_each() {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let (topic, group) = (unique_topic("go_push"), unique_topic("go_push_g"));
    let (bcast_topic, bcast_group) = (unique_topic("go_bcast"), unique_topic("go_bcast_g"));
    create_topic(cluster, &topic).await;
    create_topic(cluster, &bcast_topic).await;
    // The Go client asks for a topic's route every 30 s (not configurable): its group's retry topic exists
    // before it starts, as for any group that ever retried, so it pulls it from the start.
    let retry_topic = format!("%RETRY%{group}");
    create_topic(cluster, &retry_topic).await;

    let produce = json!({"topic": topic, "group": "go_push_p", "count": 4, "bodyPrefix": "p"});
    let sent = go_client::run("produce", &args(&namesrv, produce), DRIVER_TIMEOUT).await;
    assert_eq!(sent["errors"], json!([]), "{sent}");

    // Two broadcasting instances of one group, started before their messages are sent.
    let broadcast = |instance: &str| {
        json!({"topic": bcast_topic, "group": bcast_group, "expect": 5, "broadcasting": true,
            "consumeFromWhere": "first", "instanceName": instance, "timeoutMs": 60000, "settleMs": 1000})
    };
    let one = go_client::start("push-consume", &args(&namesrv, broadcast("one")));
    let two = go_client::start("push-consume", &args(&namesrv, broadcast("two")));

    // "p-0" is answered ConsumeRetryLater once: it comes back through %RETRY%<group> after delay level 1 (1 s).
    let consume = json!({"topic": topic, "group": group, "expect": 4, "expectDeliveries": 5, "failBodies": ["p-0"],
        "failTimes": 1, "retryDelayLevel": 1, "consumeFromWhere": "first", "timeoutMs": 60000,
        "settleMs": OFFSETS_COMMITTED_MS});
    let clustering = go_client::start("push-consume", &args(&namesrv, consume));
    let produce = json!({"topic": bcast_topic, "group": "go_bcast_p", "count": 5, "bodyPrefix": "b"});
    let sent = go_client::run("produce", &args(&namesrv, produce), DRIVER_TIMEOUT).await;
    assert_eq!(sent["errors"], json!([]), "{sent}");

    let result = clustering.finish(DRIVER_TIMEOUT).await;
    assert_eq!(result["timedOut"], false, "{result}");
    for body in ["p-1", "p-2", "p-3"] {
        let got = deliveries_of(&result, body);
        assert_eq!(got.len(), 1, "{body} once: {result}");
        assert_eq!(got[0]["result"], "CONSUME_SUCCESS", "{result}");
        assert_eq!(got[0]["queueTopic"], topic.as_str(), "{result}");
    }
    let retried = deliveries_of(&result, "p-0");
    assert_eq!(retried.len(), 2, "p-0, then once more from the retry topic: {result}");
    assert_eq!((&retried[0]["result"], &retried[0]["reconsumeTimes"]), (&json!("RECONSUME_LATER"), &json!(0)));
    assert_eq!((&retried[1]["result"], &retried[1]["reconsumeTimes"]), (&json!("CONSUME_SUCCESS"), &json!(1)));
    assert_eq!(retried[1]["queueTopic"], retry_topic.as_str(), "pulled from the retry topic: {result}");
    assert_eq!(retried[1]["topic"], topic.as_str(), "shown to the app under its own topic: {result}");
    assert_eq!(result["deliveries"], 5, "{result}");

    // At the broker: the retry topic holds p-0 once, and the group's committed offsets cover all four.
    assert_eq!(stored_bodies(cluster, &retry_topic).await, ["p-0"]);
    // The client's offset commits are one-way: relayed (and retried) after it committed, they may land a moment
    // later on a loaded machine (CI once read 3 of 4 at once).
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let committed_at_the_broker = || async {
        let offsets = direct.consumer_offsets(&group, &topic).await;
        (offsets.iter().flat_map(|o| o.values()).sum::<i64>(), offsets)
    };
    eventually(Duration::from_secs(15), "every consumed offset is committed at the broker", || async {
        committed_at_the_broker().await.0 == 4
    })
    .await;
    let (committed, offsets) = committed_at_the_broker().await;
    assert_eq!(committed, 4, "the group's offsets at the broker: {offsets:?}");
    assert_eq!(
        popgate.metric("popgate_remoting_relays_total{code=\"consumer_send_msg_back\",result=\"ok\"}").await,
        1.0,
        "the one retry was sent back through popgate"
    );
    assert!(popgate.metric("popgate_remoting_relays_total{code=\"pull_message\",result=\"ok\"}").await >= 1.0);

    for consumer in [one, two] {
        let result = consumer.finish(DRIVER_TIMEOUT).await;
        assert_eq!(result["timedOut"], false, "{result}");
        let mut got = bodies(&result, "received");
        got.sort();
        assert_eq!(got, ["b-0", "b-1", "b-2", "b-3", "b-4"], "each instance gets every message once: {result}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_go_orderly_consumer_gets_each_queue_in_order_and_a_suspended_message_again_before_the_next() {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let (topic, group) = (unique_topic("go_order"), unique_topic("go_order_g"));
    create_topic(cluster, &topic).await;
    for key in ["order-a", "order-b"] {
        let produce = json!({"topic": topic, "group": "go_order_p", "count": 10, "orderKey": key, "bodyPrefix": key});
        let sent = go_client::run("produce", &args(&namesrv, produce), DRIVER_TIMEOUT).await;
        if sent["errors"] != json!([]) {
            // The client sends a key's messages to one queue, retries included: a refusal there loses them.
            let text = popgate.metrics_text().await;
            let isolations: Vec<&str> = text.lines().filter(|l| l.starts_with("popgate_broker_isolations")).collect();
            panic!(
                "{key}: every send stored: {sent}
{}",
                isolations.join("\n")
            );
        }
        let queues: BTreeSet<String> = sent["sent"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| format!("{}/{}", s["broker"], s["queueId"]))
            .collect();
        assert_eq!(queues.len(), 1, "{key}: one queue: {sent}");
    }

    // The second message of order-a is suspended once: its queue is held, and it comes back before order-a-2.
    let consume = json!({"topic": topic, "group": group, "expect": 20, "expectDeliveries": 21, "orderly": true,
        "failBodies": ["order-a-1"], "failTimes": 1, "consumeFromWhere": "first", "timeoutMs": 60000,
        "settleMs": OFFSETS_COMMITTED_MS});
    let result = go_client::run("push-consume", &args(&namesrv, consume), DRIVER_TIMEOUT).await;
    assert_eq!(result["timedOut"], false, "{result}");
    for key in ["order-a", "order-b"] {
        let seen: Vec<String> = bodies(&result, "received").into_iter().filter(|b| b.starts_with(key)).collect();
        let mut expected: Vec<String> = (0..10).map(|i| format!("{key}-{i}")).collect();
        if key == "order-a" {
            expected.insert(1, "order-a-1".to_owned());
        }
        assert_eq!(seen, expected, "{key} in order, its suspended message again before the next: {result}");
    }
    // The client's last commits are one-way: relayed (and retried) after it exited, they may land a moment later.
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    eventually(Duration::from_secs(15), "every consumed offset is committed at the broker", || async {
        let offsets = direct.consumer_offsets(&group, &topic).await;
        let committed: i64 = offsets.iter().flat_map(|o| o.values()).sum();
        println!("the group's offsets at the broker: {offsets:?}");
        committed == 20
    })
    .await;
}

/// Runs the three transactions (commit, rollback, and an undecided one the broker checks back and the checker
/// commits) against `namesrv` on `topic`; the undecided one's result and the others'.
async fn transact_three_ways(namesrv: &str, topic: &str) -> (Value, Vec<Value>) {
    // Each in a group of its own: a check-back goes to a producer of the transaction's group, so the checker
    // can only be asked about its own message.
    let undecided = json!({"topic": topic, "group": "go_tx_check_p", "resolution": "unknown",
        "checkResolution": "commit", "bodyPrefix": "checked", "expectChecks": 1, "lingerMs": 60000,
        "timeoutMs": 90000});
    let checked = go_client::start("transact", &args(namesrv, undecided));
    let mut decided = Vec::new();
    for (resolution, prefix) in [("commit", "kept"), ("rollback", "dropped")] {
        let transact = json!({"topic": topic, "group": format!("go_tx_{resolution}_p"), "resolution": resolution,
            "bodyPrefix": prefix, "checkResolution": "unknown"});
        let result = go_client::run("transact", &args(namesrv, transact), DRIVER_TIMEOUT).await;
        assert_eq!(result["errors"], json!([]), "{resolution}: {result}");
        assert_eq!(result["sent"][0]["status"], "SEND_OK", "{result}");
        decided.push(result);
    }
    (checked.finish(DRIVER_TIMEOUT).await, decided)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_transactions_commit_roll_back_and_are_checked_back_through_their_producer_as_straight_at_the_cluster() {
    // A broker that checks an undecided transaction back after 3 s (the defaults are 6 s, then every 30 s).
    let mut spec = ClusterSpec::brokers(&["broker-a"]);
    spec.broker_conf = vec!["transactionTimeOut=3000".into(), "transactionCheckInterval=3000".into()];
    let cluster = Cluster::start(&spec);
    let (popgate, namesrv) = popgate_with_remoting(&cluster, "").await;
    let (through, straight) = (unique_topic("go_tx"), unique_topic("go_tx_direct"));
    crate::transaction::create_transaction_topic(&cluster, &through).await;
    crate::transaction::create_transaction_topic(&cluster, &straight).await;

    let ((checked, decided), (straight_checked, _)) =
        tokio::join!(transact_three_ways(&namesrv, &through), transact_three_ways(&cluster.namesrv_addr, &straight));
    for result in [&checked, &straight_checked] {
        assert_eq!(result["errors"], json!([]), "{result}");
        assert_eq!(result["sent"][0]["localState"], "UNKNOW", "{result}");
        let checks = result["checks"].as_array().cloned().unwrap_or_default();
        assert_eq!(checks.len(), 1, "the producer was asked once: {result}");
        assert_eq!(checks[0]["body"], "checked-0", "about its own message: {result}");
        assert_eq!(checks[0]["uniqKey"], result["sent"][0]["msgId"], "{result}");
        assert_eq!(checks[0]["producerGroup"], "go_tx_check_p", "its own group, as the broker sends it: {result}");
    }
    assert_eq!(decided[0]["sent"][0]["localState"], "COMMIT_MESSAGE", "{decided:?}");
    assert_eq!(decided[1]["sent"][0]["localState"], "ROLLBACK_MESSAGE", "{decided:?}");

    for topic in [&through, &straight] {
        eventually(Duration::from_secs(20), "both commits are stored", || async {
            stored_bodies(&cluster, topic).await.len() >= 2
        })
        .await;
    }
    // A rollback never lands, a commit lands once: give a late one time to show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(stored_bodies(&cluster, &through).await, ["checked-0", "kept-0"], "through popgate");
    assert_eq!(stored_bodies(&cluster, &straight).await, ["checked-0", "kept-0"], "straight at the cluster");
    assert!(popgate.metric("popgate_transactions_ended_total{resolution=\"commit\",result=\"landed\"}").await >= 1.0);
    assert!(popgate.metric("popgate_transactions_ended_total{resolution=\"rollback\",result=\"landed\"}").await >= 1.0);
    assert_eq!(
        popgate.metric("popgate_transaction_check_answers_total{front=\"remoting\",answer=\"commit\"}").await,
        1.0,
        "the check-back went through popgate to the Go producer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_go_client_must_sign_with_a_token_and_may_only_publish_where_the_token_allows() {
    let cluster = shared_cluster();
    let auth = "[auth]\nenabled = true\n\n[[auth.tokens]]\nname = \"go-app\"\ntoken = \"go-app-secret-0123456789\"\n\
                publish = [\"go_auth_*\"]\nconsume = [\"go_auth_g*\"]\n";
    let (popgate, namesrv) = popgate_with_remoting(cluster, auth).await;
    let (topic, other) = (unique_topic("go_auth"), unique_topic("go_other"));
    create_topic(cluster, &topic).await;
    create_topic(cluster, &other).await;
    let send = |topic: &str, prefix: &str, keys: Value| {
        let mut send = json!({"topic": topic, "group": "go_auth_p", "count": 2, "bodyPrefix": prefix, "retryTimes": 0});
        for (k, v) in keys.as_object().expect("object") {
            send[k] = v.clone();
        }
        args(&namesrv, send)
    };
    let signed = json!({"accessKey": "go-app", "secretKey": "go-app-secret-0123456789"});
    let wrong = json!({"accessKey": "go-app", "secretKey": "not-the-secret-0123456789"});

    // All four at once, each a client of its own.
    let unsigned = go_client::start("produce", &send(&topic, "unsigned", json!({})));
    let badly_signed = go_client::start("produce", &send(&topic, "wrong", wrong));
    let served = go_client::start("produce", &send(&topic, "signed", signed.clone()));
    let elsewhere = go_client::start("produce", &send(&other, "elsewhere", signed));
    let (unsigned, badly_signed, served, elsewhere) = tokio::join!(
        unsigned.finish(DRIVER_TIMEOUT),
        badly_signed.finish(DRIVER_TIMEOUT),
        served.finish(DRIVER_TIMEOUT),
        elsewhere.finish(DRIVER_TIMEOUT),
    );
    // The client reports a refused send as `CODE: <code>, DESC: <popgate's words>`.
    let refusals = |result: &Value| -> Vec<String> {
        result["errors"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| e["error"].as_str().unwrap_or("").to_owned())
            .collect()
    };
    for (result, why) in [(&unsigned, "AccessKey"), (&badly_signed, "Signature"), (&elsewhere, "may not publish")] {
        let refused = refusals(result);
        assert_eq!(refused.len(), 2, "both sends refused: {result}");
        assert!(refused.iter().all(|e| e.contains("CODE: 16") && e.contains(why)), "NO_PERMISSION, {why}: {result}");
    }
    assert_eq!(served["errors"], json!([]), "a signed client is served: {served}");
    assert_eq!(stored_bodies(cluster, &topic).await, ["signed-0", "signed-1"], "only the signed sends are stored");
    assert_eq!(stored_bodies(cluster, &other).await, Vec::<String>::new(), "nothing where the token may not publish");
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"unauthenticated\"}").await >= 4.0);
}
