//! The remoting front, spoken to by Apache's remoting Java client (`rocketmq-client`, through
//! `it/remoting-driver`, under every version of [`RemotingClient::ALL`]) pointed at popgate as its name
//! server, and by raw frames for what the client never sends. Each test checks what the client saw and what
//! the brokers hold, read straight from them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use bytes::BytesMut;
use rocketmq_protocol::protocol::encoded_frame::EncodedFrame;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::balancer::{Backend, Balancer};
use crate::harness::direct::{Direct, DirectConsumer, StoredMessage};
use crate::harness::popgate::Popgate;
use crate::harness::remoting::RemotingClient;
use crate::harness::rocketmq::Cluster;
use crate::harness::sdk::{bodies, Sdk};
use crate::harness::{eventually, free_port, unique_topic};
use crate::publish::shared_cluster;

/// How long one driver run may take on a loaded machine.
const DRIVER_TIMEOUT: Duration = Duration::from_secs(180);

/// Runs each scenario under every remoting client version, as a test of its own.
macro_rules! on_every_remoting_client {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn client_4_9_3() {
                super::$scenario(crate::harness::remoting::RemotingClient::V4_9_3).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn client_4_9_8() {
                super::$scenario(crate::harness::remoting::RemotingClient::V4).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn client_5_4_0() {
                super::$scenario(crate::harness::remoting::RemotingClient::V5).await;
            }
        }
    )*};
}

on_every_remoting_client!(
    every_kind_of_send_is_stored_at_the_broker_with_its_properties_in_the_queue_the_client_chose,
    a_push_consumer_gets_every_message_and_one_it_asks_to_reconsume_later_comes_back_then_goes_to_the_dlq,
    an_orderly_push_consumer_gets_each_queue_in_order,
    broadcasting_consumers_each_get_every_message,
    two_broadcasting_consumers_of_one_group_in_one_app_each_get_every_message_promptly,
    a_lite_pull_consumer_resumes_from_its_committed_offset_after_a_restart,
    messages_sent_over_remoting_reach_http_and_grpc_consumers_and_the_reverse,
    a_client_that_uses_tls_sends_and_consumes_through_popgate,
);

/// Runs each POP consumer scenario under every client version that consumes by POP, as a test of its own.
macro_rules! on_every_pop_client {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn client_5_1_0() {
                super::$scenario(crate::harness::remoting::RemotingClient::V5_1).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn client_5_4_0() {
                super::$scenario(crate::harness::remoting::RemotingClient::V5).await;
            }
        }
    )*};
}

on_every_pop_client!(
    a_pop_consumer_acks_with_handles_issued_before_popgate_was_killed_and_nothing_is_delivered_twice,
    a_pop_consumers_reconsume_later_comes_back_on_popgates_backoff_then_goes_to_the_dlq,
);

/// popgate with its remoting front on a port of its own; the address is what clients set as `namesrvAddr`.
pub(crate) async fn popgate_with_remoting(cluster: &Cluster, extra_toml: &str) -> (Popgate, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let popgate =
        Popgate::start(&cluster.namesrv_addr, &format!("[remoting]\nlisten = \"{addr}\"\n{extra_toml}")).await;
    (popgate, addr)
}

pub(crate) async fn create_topic(cluster: &Cluster, topic: &str) {
    let addrs: Vec<String> = cluster.brokers.iter().map(|b| format!("127.0.0.1:{}", b.port)).collect();
    Direct::connect(&cluster.namesrv_addr).await.create_topic(topic, &addrs).await;
}

/// A scenario's arguments: `extra`, the name server (popgate), and the client's refresh intervals shortened
/// (a route every second: a consumer sees its group's new retry topic at once; a heartbeat every 2 s: a 5.x
/// consumer that skipped its first one is not left without a subscription at the broker for 30 s).
fn args(namesrv: &str, mut extra: Value) -> Value {
    extra["namesrv"] = json!(namesrv);
    extra["pollNameServerIntervalMs"] = json!(1000);
    extra["heartbeatBrokerIntervalMs"] = json!(2000);
    extra
}

/// [`args`] for a producer: a first send asks for the topic's route and opens connections, which takes
/// seconds on a loaded machine, so a send may take 10 s (the client's default is 3 s) unless the test says.
fn send_args(namesrv: &str, mut extra: Value) -> Value {
    if extra.get("sendTimeoutMs").is_none() {
        extra["sendTimeoutMs"] = json!(10_000);
    }
    args(namesrv, extra)
}

/// What the brokers hold in `topic`, by body, once there are at least `count` messages (at most 30 s).
pub(crate) async fn stored(cluster: &Cluster, topic: &str, count: usize) -> BTreeMap<String, StoredMessage> {
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let messages: BTreeMap<String, StoredMessage> = direct
            .try_read_all(topic)
            .await
            .unwrap_or_default()
            .into_iter()
            .map(|m| (String::from_utf8_lossy(&m.body).into_owned(), m))
            .collect();
        if messages.len() >= count || std::time::Instant::now() > deadline {
            assert!(messages.len() >= count, "{count} messages stored in {topic}: {:?}", messages.keys());
            return messages;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn every_kind_of_send_is_stored_at_the_broker_with_its_properties_in_the_queue_the_client_chose(
    client: RemotingClient,
) {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_send");
    create_topic(cluster, &topic).await;

    let sync = json!({"topic": topic, "group": "rm_send_p", "mode": "sync", "count": 3, "bodyPrefix": "sync",
        "tag": "TagA", "keys": "k1 k2", "properties": {"color": "red"}});
    let result = client.run("produce", &send_args(&namesrv, sync), DRIVER_TIMEOUT).await;
    assert_eq!(result["errors"], json!([]), "{result}");
    for sent in result["sent"].as_array().expect("sent") {
        assert_eq!(sent["status"], "SEND_OK", "{result}");
        assert!(sent["offsetMsgId"].as_str().is_some_and(|id| id.len() == 32), "the broker's offset id: {result}");
    }
    for (mode, extra) in [
        ("async", json!({})),
        ("oneway", json!({})),
        ("batch", json!({})),
        ("sync", json!({"queueId": 2, "bodyPrefix": "selected"})),
        ("sync", json!({"delayLevel": 1, "bodyPrefix": "delayed"})),
        // Over 4 KiB: the client compresses the body; the broker stores it compressed, consumers get it back.
        ("sync", json!({"bodyBytes": 6000, "bodyPrefix": "big"})),
    ] {
        let mut run = json!({"topic": topic, "group": "rm_send_p", "mode": mode, "count": 2, "bodyPrefix": mode});
        for (k, v) in extra.as_object().expect("object") {
            run[k] = v.clone();
        }
        let result = client.run("produce", &send_args(&namesrv, run), DRIVER_TIMEOUT).await;
        assert_eq!(result["errors"], json!([]), "{mode} {extra}: {result}");
    }
    let messages = stored(cluster, &topic, 3 + 6 * 2).await;
    let first = &messages["sync-0"];
    assert_eq!(first.property("TAGS"), Some("TagA"));
    assert_eq!(first.property("KEYS"), Some("k1 k2"));
    assert_eq!(first.property("color"), Some("red"));
    assert!(first.property("UNIQ_KEY").is_some(), "the client's message id");
    assert_eq!(
        result_ids(&result_of(&messages, "sync")),
        result_ids(&ids_of(&result)),
        "the client's ids are the stored ones"
    );
    for body in ["async-0", "async-1", "oneway-0", "oneway-1", "batch-0", "batch-1", "delayed-0", "big-0"] {
        assert!(messages.contains_key(body) || messages.keys().any(|k| k.starts_with(body)), "{body} stored");
    }
    for body in ["selected-0", "selected-1"] {
        assert_eq!(messages[body].queue_id, 2, "a selector's queue is kept");
    }
    assert_eq!(messages["delayed-0"].property("DELAY"), Some("1"), "the delay level reached the broker");
    // Each send once through the publish path: the one-way ones are not confirmed by the broker (`accepted`).
    assert!(popgate.metric("popgate_publish_requests_total{result=\"ok\",transport=\"remoting\"}").await >= 12.0);
    assert!(popgate.metric("popgate_publish_requests_total{result=\"accepted\",transport=\"remoting\"}").await >= 2.0);
    assert!(
        popgate.metric("popgate_remoting_requests_total{code=\"get_routeinfo_by_topic\",result=\"ok\"}").await >= 1.0
    );
}

fn ids_of(result: &Value) -> Vec<String> {
    result["sent"].as_array().into_iter().flatten().filter_map(|s| s["msgId"].as_str().map(str::to_owned)).collect()
}

fn result_of(messages: &BTreeMap<String, StoredMessage>, prefix: &str) -> Vec<String> {
    messages
        .iter()
        .filter(|(body, _)| body.starts_with(&format!("{prefix}-")))
        .filter_map(|(_, m)| m.property("UNIQ_KEY").map(str::to_owned))
        .collect()
}

fn result_ids(ids: &[String]) -> Vec<String> {
    let mut ids = ids.to_vec();
    ids.sort();
    ids
}

async fn a_push_consumer_gets_every_message_and_one_it_asks_to_reconsume_later_comes_back_then_goes_to_the_dlq(
    client: RemotingClient,
) {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_push");
    let group = unique_topic("rm_push_g");
    create_topic(cluster, &topic).await;
    let produce = json!({"topic": topic, "group": "rm_push_p", "count": 4, "bodyPrefix": "p"});
    let sent = client.run("produce", &send_args(&namesrv, produce), DRIVER_TIMEOUT).await;
    assert_eq!(sent["errors"], json!([]), "{sent}");

    // Every message once; "p-0" is asked to be reconsumed every time: after the group's limit of one
    // reconsumption it is dead-lettered (RocketMQ's retry topic, then %DLQ%<group>).
    let consume = json!({"topic": topic, "group": group, "expect": 4, "failBodies": ["p-0"], "failTimes": 99,
        "maxReconsumeTimes": 1, "retryDelayLevel": 1, "settleMs": 25000});
    let result = client.run("push-consume", &args(&namesrv, consume), DRIVER_TIMEOUT).await;
    assert_eq!(result["timedOut"], false, "{result}");
    let mut got = bodies(&result, "received");
    got.sort();
    let deliveries_of = |body: &str| got.iter().filter(|b| *b == body).count();
    for body in ["p-1", "p-2", "p-3"] {
        assert_eq!(deliveries_of(body), 1, "{body} once: {result}");
    }
    assert_eq!(deliveries_of("p-0"), 2, "p-0 delivered, then once more from the retry topic: {result}");
    let retried =
        result["received"].as_array().expect("received").iter().filter(|r| r["body"] == "p-0").nth(1).cloned();
    assert_eq!(retried.as_ref().map(|r| r["reconsumeTimes"].clone()), Some(json!(1)), "{result}");
    let dead = stored(cluster, &format!("%DLQ%{group}"), 1).await;
    assert!(dead.contains_key("p-0"), "p-0 is in the group's DLQ: {:?}", dead.keys());
    assert!(popgate.metric("popgate_remoting_relays_total{code=\"pull_message\",result=\"ok\"}").await >= 1.0);
    assert!(
        popgate.metric("popgate_remoting_relays_total{code=\"consumer_send_msg_back\",result=\"ok\"}").await >= 1.0
    );
}

async fn an_orderly_push_consumer_gets_each_queue_in_order(client: RemotingClient) {
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_order");
    let group = unique_topic("rm_order_g");
    create_topic(cluster, &topic).await;
    for key in ["order-a", "order-b"] {
        // Order is what this test is about: a fresh client's first send may wait out popgate's first route and
        // broker connection on a loaded machine (fresh-clone runs saw it miss the 3 s default), so it gets 10 s.
        let produce = json!({"topic": topic, "group": "rm_order_p", "count": 10, "orderKey": key, "bodyPrefix": key,
            "sendTimeoutMs": 10000});
        let sent = client.run("produce", &send_args(&namesrv, produce), DRIVER_TIMEOUT).await;
        assert_eq!(sent["errors"], json!([]), "{sent}");
    }
    // The second message of order-a fails once: the queue is held and it comes back before what follows.
    let consume = json!({"topic": topic, "group": group, "expect": 20, "orderly": true,
        "failBodies": ["order-a-1"], "failTimes": 1});
    let result = client.run("push-consume", &args(&namesrv, consume), DRIVER_TIMEOUT).await;
    assert_eq!(result["timedOut"], false, "{result}");
    for key in ["order-a", "order-b"] {
        let seen: Vec<String> = bodies(&result, "received").into_iter().filter(|b| b.starts_with(key)).collect();
        let mut expected: Vec<String> = (0..10).map(|i| format!("{key}-{i}")).collect();
        if key == "order-a" {
            expected.insert(1, "order-a-1".to_owned());
        }
        assert_eq!(seen, expected, "{key} in order, its failed message again before the next: {result}");
    }
}

async fn broadcasting_consumers_each_get_every_message(client: RemotingClient) {
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_bcast");
    let group = unique_topic("rm_bcast_g");
    create_topic(cluster, &topic).await;
    let consume = |instance: &str| {
        json!({"topic": topic, "group": group, "expect": 5, "broadcasting": true, "consumeFromWhere": "first",
            "instanceName": instance})
    };
    let first = client.start("push-consume", &args(&namesrv, consume("one")));
    let second = client.start("push-consume", &args(&namesrv, consume("two")));
    let produce = json!({"topic": topic, "group": "rm_bcast_p", "count": 5, "bodyPrefix": "b"});
    let sent = client.run("produce", &send_args(&namesrv, produce), DRIVER_TIMEOUT).await;
    assert_eq!(sent["errors"], json!([]), "{sent}");
    for consumer in [first, second] {
        let result = consumer.finish(DRIVER_TIMEOUT).await;
        let mut got = bodies(&result, "received");
        got.sort();
        assert_eq!(got, ["b-0", "b-1", "b-2", "b-3", "b-4"], "each consumer gets every message: {result}");
    }
}

/// Two push consumers of one broadcasting group in one app (two `DefaultMQPushConsumer`s, each its own
/// `instanceName`), with the client's default 30 s heartbeat, each get every message with none of their pulls
/// refused, in each of [`BROADCASTING_ROUNDS`] fresh groups.
///
/// Seen before: popgate told each member of the group to rebalance when the other joined (a broker does not
/// tell broadcasting members), the push came while the member was still sending its first heartbeats, the
/// rebalance's heartbeat with the subscription's new version was skipped ("lock heartBeat, but failed"), and the
/// broker refused the member's pulls as `SUBSCRIPTION_NOT_LATEST` until its next heartbeat: 1 to 3 s (4.9.x,
/// most rounds), 29.9 s once.
async fn two_broadcasting_consumers_of_one_group_in_one_app_each_get_every_message_promptly(client: RemotingClient) {
    let cluster = shared_cluster();
    let namesrv = format!("127.0.0.1:{}", free_port());
    // Relayed pulls logged (debug): what each was answered.
    let log_relays = ("RUST_LOG", "info,popgate::remoting=debug,rocketmq_client_rust=warn,rocketmq_transport=warn");
    let remoting = format!("[remoting]\nlisten = \"{namesrv}\"\n");
    let popgate = Popgate::start_with_env(&cluster.namesrv_addr, &remoting, &[log_relays]).await;
    for round in 0..BROADCASTING_ROUNDS {
        let topic = unique_topic("rm_bcast_app");
        let group = unique_topic("rm_bcast_app_g");
        create_topic(cluster, &topic).await;
        // A consumer that starts before its topic's route is known rebalances only later (4.x: 20 s on).
        route_known(&namesrv, &topic).await;
        // The client's own heartbeat interval (30 s), so a refused subscription shows as the stall it is.
        let consume = json!({"namesrv": namesrv, "pollNameServerIntervalMs": 1000, "topic": topic, "group": group,
            "expect": 5, "broadcasting": true, "consumeFromWhere": "first", "instances": ["one", "two"],
            "timeoutMs": 25_000});
        let consumers = client.start_logging("push-consume", &consume);
        let produce = json!({"topic": topic, "group": "rm_bcast_app_p", "count": 5, "bodyPrefix": "b"});
        let sent = client.run("produce", &send_args(&namesrv, produce), DRIVER_TIMEOUT).await;
        assert_eq!(sent["errors"], json!([]), "{sent}");
        let (result, log) = consumers.finish_with_log(DRIVER_TIMEOUT).await;
        // Should it fail: what the clients said of their heartbeats, rebalances and pulls.
        let said: Vec<&str> = log
            .lines()
            .filter(|l| {
                ["heartBeat", "Rebalance", "rebalance", "WARN", "Exception", "CODE:"].iter().any(|w| l.contains(w))
            })
            .take(60)
            .collect();
        let said = said.join("\n");
        let refused: Vec<String> = popgate
            .output()
            .lines()
            .filter(|line| line.contains("code=\"pull_message\"") && line.contains(&format!("\"{group}\"")))
            .filter(|line| line.contains("answer=24 ") || line.contains("answer=25 "))
            .map(str::to_owned)
            .collect();
        assert!(refused.is_empty(), "round {round}: no pull of theirs is refused:\n{}\n{said}", refused.join("\n"));
        let each = result["consumers"].as_array().cloned().unwrap_or_default();
        assert_eq!(each.len(), 2, "two consumers in the one app: {result}");
        for consumer in each {
            let mut got = bodies(&consumer, "received");
            got.sort();
            assert_eq!(
                got,
                ["b-0", "b-1", "b-2", "b-3", "b-4"],
                "round {round}: each gets every message: {consumer}\n{said}"
            );
        }
    }
}

/// A pull naming a newer subscription version than any heartbeat of its group brought (the client skipped the
/// heartbeat that carried it) is refused by its broker as `SUBSCRIPTION_NOT_LATEST` until the client's next
/// heartbeat, up to 30 s later, straight at the cluster; through popgate it is served (after a wait of 2 s for that
/// heartbeat) with the group's subscription as popgate has it, as Apache's proxy relays every pull.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_whose_newer_subscription_version_never_came_is_served_with_the_groups_subscription() {
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_skipped_hb");
    let group = unique_topic("rm_skipped_hb_g");
    create_topic(cluster, &topic).await;
    // Subscription version 0, passed on to every master before the answer.
    let mut member = registered_member(&namesrv, push_consumer_heartbeat("skipped@1", &group, &topic)).await;
    let mut pull = raw_pull(&group, &topic, "0", None);
    pull.add_ext_field("subVersion", "5000");
    let answer = ask(&mut member, pull).await.expect("answered");
    assert_eq!(answer.code(), 19, "served (PULL_NOT_FOUND: the queue is empty), not refused: {:?}", answer.remark());
}

/// Waits until `topic`'s route is answered through popgate at `namesrv` (a new topic reaches the name server
/// with its broker's next registration; popgate keeps an absence for a second).
async fn route_known(namesrv: &str, topic: &str) {
    eventually(Duration::from_secs(30), "the topic's route is known", || async {
        let Ok(mut stream) = TcpStream::connect(namesrv).await else { return false };
        let answer = ask(&mut stream, raw_request(105, &[("topic", topic)])).await;
        answer.is_some_and(|answer| answer.code() == 0)
    })
    .await;
}

/// Fresh groups [`two_broadcasting_consumers_of_one_group_in_one_app_each_get_every_message_promptly`] starts in
/// turn: before the fix, 3 rounds in 4 of a 4.9.x client had pulls refused.
const BROADCASTING_ROUNDS: usize = 2;

/// Apache's remoting e2e `NormalMessageTest.testConsumeNormalMessage` (client 4.9.3): a push consumer of a
/// fresh group (from the last offset, the default; one tag) on a topic of 8 queues on each broker, and 10
/// messages its app sends as soon as it started: every one consumed, in each of [`NEW_GROUP_ROUNDS`] fresh
/// groups, under the two 4.9.x clients.
///
/// Seen before: 1 message of 10 never consumed. The consumer asked its offset in an empty queue (`QUERY_NOT_FOUND`),
/// then the queue's end (`GET_MAX_OFFSET`), and the message stored between the two relayed answers was skipped
/// (`popgate::remoting::relay::offset_of_a_new_group`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_push_consumer_gets_every_message_its_app_sends_as_it_starts() {
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let brokers: Vec<String> = cluster.brokers.iter().map(|b| format!("127.0.0.1:{}", b.port)).collect();
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    for client in [RemotingClient::V4_9_3, RemotingClient::V4] {
        for round in 0..NEW_GROUP_ROUNDS {
            let topic = unique_topic("rm_new_group");
            direct.create_topic_with_queues(&topic, 8, &brokers).await;
            // As in the e2e suite, whose topics exist well before its consumers start.
            route_known(&namesrv, &topic).await;
            // The client's defaults, as the e2e suite has them (from the last offset, a route every 30 s).
            let consume = json!({"namesrv": namesrv, "topic": topic, "group": unique_topic("rm_new_group_g"),
                "consumeFromWhere": "last", "subExpression": "TagA", "expect": 10, "sendOnStart": 10,
                "sendTag": "TagA", "timeoutMs": 30_000});
            let result = client.run("push-consume", &consume, DRIVER_TIMEOUT).await;
            let sent = result["sentOnStart"].as_array().cloned().unwrap_or_default();
            assert!(sent.iter().all(|m| m["status"] == "SEND_OK"), "{} round {round}: {result}", client.0);
            let mut got = bodies(&result, "received");
            got.sort();
            got.dedup();
            let every: Vec<String> = (0..10).map(|i| format!("m-{i}")).collect();
            assert_eq!(got, every, "{} round {round}: every message consumed; sent: {sent:?}", client.0);
        }
    }
}

/// Fresh groups per client of [`a_new_push_consumer_gets_every_message_its_app_sends_as_it_starts`].
const NEW_GROUP_ROUNDS: usize = 3;

/// A new group's offset query in an empty queue is answered with offset 0 (where every way to start starts in
/// an empty queue) when a member of the group subscribes to the topic (a push consumer: its rebalance would take
/// "not found" to mean "ask the queue's end next", and skip what is stored in between); when the client asks for
/// "not found" (`setZeroIfNotFound` false), it gets it. A group that subscribes to nothing here (a
/// `DefaultMQPullConsumer`, which hands the answer to its app: -1 for "not found"), or that never sent a
/// heartbeat, gets the broker's "not found", as straight at the broker: Apache's e2e `PullOrderParamTest` pulls
/// every queue whose offset is not -1 for 30 s, and told 0 for its 7 empty queues it outlasted its 60 s wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_groups_offset_in_an_empty_queue_is_its_start_for_a_subscriber_and_not_found_for_a_pull_consumer() {
    const QUERY_NOT_FOUND: i32 = 22;
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_new_offset");
    create_topic(cluster, &topic).await;
    let broker = cluster.brokers[0].name.clone();
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    let query = |group: &str, extra: &[(&str, &str)]| {
        let mut fields =
            vec![("topic", topic.as_str()), ("queueId", "0"), ("consumerGroup", group), ("bname", &broker)];
        fields.extend_from_slice(extra);
        raw_request(14, &fields)
    };

    let push_group = unique_topic("rm_new_offset_push");
    let heartbeat = push_consumer_heartbeat("raw@new_offset_push", &push_group, &topic);
    assert_eq!(ask(&mut stream, heartbeat).await.expect("answered").code(), 0);
    let answer = ask(&mut stream, query(&push_group, &[])).await.expect("an answer");
    assert_eq!(answer.code(), 0, "a push consumer, an empty queue: start at 0 ({:?})", answer.remark());
    assert_eq!(answer.ext_fields().and_then(|f| f.get("offset")).map(|o| o.to_string()), Some("0".to_owned()));
    let asked = ask(&mut stream, query(&push_group, &[("setZeroIfNotFound", "false")])).await.expect("an answer");
    assert_eq!(asked.code(), QUERY_NOT_FOUND, "not found, as the client asked: {:?}", asked.remark());

    // As a 4.9.3 and 5.4.0 `DefaultMQPullConsumer` heartbeats: its group, no subscription.
    let pull_group = unique_topic("rm_new_offset_pull");
    let body = json!({"clientID": "raw@new_offset_pull", "producerDataSet": [], "consumerDataSet": [{"groupName":
        pull_group, "consumeType": "CONSUME_ACTIVELY", "messageModel": "CLUSTERING", "consumeFromWhere":
        "CONSUME_FROM_LAST_OFFSET", "subscriptionDataSet": [], "unitMode": false}]});
    let heartbeat = RemotingCommand::create_remoting_command(34).set_body(body.to_string().into_bytes());
    assert_eq!(ask(&mut stream, heartbeat).await.expect("answered").code(), 0);
    let answer = ask(&mut stream, query(&pull_group, &[])).await.expect("an answer");
    assert_eq!(answer.code(), QUERY_NOT_FOUND, "a pull consumer gets the broker's answer: {:?}", answer.ext_fields());

    let unknown = ask(&mut stream, query(&unique_topic("rm_new_offset_none"), &[])).await.expect("an answer");
    assert_eq!(unknown.code(), QUERY_NOT_FOUND, "no heartbeat: the broker's answer: {:?}", unknown.ext_fields());
}

async fn a_lite_pull_consumer_resumes_from_its_committed_offset_after_a_restart(client: RemotingClient) {
    let cluster = shared_cluster();
    // Relayed requests logged (debug), for the failure message below.
    let namesrv = format!("127.0.0.1:{}", free_port());
    let log_relays = ("RUST_LOG", "info,popgate::remoting=debug,rocketmq_client_rust=warn,rocketmq_transport=warn");
    let remoting = format!("[remoting]\nlisten = \"{namesrv}\"\n");
    let popgate = Popgate::start_with_env(&cluster.namesrv_addr, &remoting, &[log_relays]).await;
    let topic = unique_topic("rm_lite");
    let group = unique_topic("rm_lite_g");
    create_topic(cluster, &topic).await;
    let produce = json!({"topic": topic, "group": "rm_lite_p", "count": 6, "bodyPrefix": "l"});
    let sent = client.run("produce", &send_args(&namesrv, produce), DRIVER_TIMEOUT).await;
    assert_eq!(sent["errors"], json!([]), "{sent}");
    let pull = json!({"topic": topic, "group": group, "expect": 6, "autoCommit": false});
    let first = client.run("lite-pull", &args(&namesrv, pull.clone()), DRIVER_TIMEOUT).await;
    assert_eq!(first["timedOut"], false, "{first}");
    let produce = json!({"topic": topic, "group": "rm_lite_p", "count": 2, "bodyPrefix": "later"});
    client.run("produce", &send_args(&namesrv, produce), DRIVER_TIMEOUT).await;
    // A new consumer of the group starts at the committed offsets: only what came after.
    let again = json!({"topic": topic, "group": group, "expect": 2, "autoCommit": false, "settleMs": 3000});
    let second = client.run("lite-pull", &args(&namesrv, again), DRIVER_TIMEOUT).await;
    let mut got = bodies(&second, "received");
    got.sort();
    // Should it fail: how popgate relayed the commits, and every offset request and answer of both consumers. (It
    // did, 1 run in 6 to 12, before a group's offset requests took turns: the broker had lost one of the first
    // consumer's commits, relayed at the same instant as another; see offset_commits_sent_back_to_back_... below.)
    let mut relayed = Vec::new();
    for result in ["ok", "unreachable"] {
        relayed.push(format!("{result}: {}", popgate.metric(&offset_commit_relays(result)).await));
    }
    let log = popgate.output();
    let offsets: Vec<&str> =
        log.lines().filter(|line| line.contains("Relayed a request") && line.contains("consumer_offset")).collect();
    assert_eq!(
        got,
        ["later-0", "later-1"],
        "the committed messages are not read again (commits relayed {relayed:?}): {second}\nfirst: {first}\n{}",
        offsets.join("\n")
    );
}

async fn messages_sent_over_remoting_reach_http_and_grpc_consumers_and_the_reverse(client: RemotingClient) {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_mixed");
    create_topic(cluster, &topic).await;
    let produce = json!({"topic": topic, "group": "rm_mixed_p", "count": 3, "bodyPrefix": "r", "tag": "T"});
    let sent = client.run("produce", &send_args(&namesrv, produce), DRIVER_TIMEOUT).await;
    assert_eq!(sent["errors"], json!([]), "{sent}");

    let over_http = popgate.poll_until("rm_mixed_http", &topic, 3, Duration::from_secs(60)).await;
    let mut got: Vec<String> = over_http.iter().map(crate::harness::popgate::data).collect();
    got.sort();
    assert_eq!(got, ["r-0", "r-1", "r-2"], "HTTP consumers get remoting sends");
    for delivery in &over_http {
        assert_eq!(popgate.ack(&crate::harness::popgate::id(delivery)).await.0, 200);
    }
    let grpc = json!({"endpoint": popgate.grpc, "group": "rm_mixed_grpc", "topic": topic, "expect": 3});
    let over_grpc = Sdk::NEWEST.run("simple-consume", &grpc, DRIVER_TIMEOUT).await;
    let mut got = bodies(&over_grpc, "received");
    got.sort();
    assert_eq!(got, ["r-0", "r-1", "r-2"], "gRPC consumers get remoting sends: {over_grpc}");

    popgate.publish_bodies(&topic, &["h-0", "h-1"]).await;
    let consume = json!({"topic": topic, "group": unique_topic("rm_mixed_g"), "expect": 5});
    let result = client.run("push-consume", &args(&namesrv, consume), DRIVER_TIMEOUT).await;
    let mut got = bodies(&result, "received");
    got.sort();
    assert_eq!(got, ["h-0", "h-1", "r-0", "r-1", "r-2"], "remoting consumers get HTTP sends: {result}");
}

/// One request over a raw connection: its frame, then the answer (or `None` when the connection closed).
pub(crate) async fn ask(stream: &mut TcpStream, request: RemotingCommand) -> Option<RemotingCommand> {
    send(stream, request).await;
    read_answer(stream).await
}

/// A frame of a JSON `header` and no body, as a client that writes its own headers sends it.
fn raw_frame(header: &str) -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(&u32::try_from(4 + header.len()).expect("small").to_be_bytes());
    frame.extend_from_slice(&u32::try_from(header.len()).expect("small").to_be_bytes());
    frame.extend_from_slice(header.as_bytes());
    frame
}

/// Writes one request's frame to a raw connection.
pub(crate) async fn send(stream: &mut TcpStream, request: RemotingCommand) {
    let frame = EncodedFrame::from_command(request).expect("encodes").into_bytes();
    stream.write_all(&frame).await.expect("write");
}

/// The series counting how popgate's relays of `UPDATE_CONSUMER_OFFSET` ended (`ok`, `unreachable`).
fn offset_commit_relays(result: &str) -> String {
    format!("popgate_remoting_relays_total{{code=\"update_consumer_offset\",result=\"{result}\"}}")
}

/// The next answer on a raw connection, past popgate's own one-way pushes (`NOTIFY_CONSUMER_IDS_CHANGED` after
/// a heartbeat, say); `None` when the connection closed.
pub(crate) async fn read_answer(stream: &mut TcpStream) -> Option<RemotingCommand> {
    read_answer_within(stream, Duration::from_secs(30)).await
}

/// [`read_answer`], waiting up to `quiet` for each frame. Reads frame by frame, never past the answer: a push
/// popgate queued behind it (`NOTIFY_CONSUMER_IDS_CHANGED` after a heartbeat) is left for the next read.
async fn read_answer_within(stream: &mut TcpStream, quiet: Duration) -> Option<RemotingCommand> {
    loop {
        let frame = tokio::time::timeout(quiet, read_frame(stream)).await.expect("answered")?;
        if frame.is_response_type() {
            return Some(frame);
        }
    }
}

/// The next whole frame on a raw connection; `None` when the connection closed.
pub(crate) async fn read_frame(stream: &mut TcpStream) -> Option<RemotingCommand> {
    let mut length = [0u8; 4];
    if let Err(closed) = stream.read_exact(&mut length).await {
        assert_eq!(closed.kind(), std::io::ErrorKind::UnexpectedEof, "read");
        return None;
    }
    let mut frame = BytesMut::from(&length[..]);
    frame.resize(4 + u32::from_be_bytes(length) as usize, 0);
    if let Err(closed) = stream.read_exact(&mut frame[4..]).await {
        assert_eq!(closed.kind(), std::io::ErrorKind::UnexpectedEof, "read");
        return None;
    }
    Some(RemotingCommand::decode(&mut frame).expect("a frame decodes").expect("a whole frame"))
}

/// Issue #34: a new member's heartbeat is answered before its group is told to rebalance. The client skips the
/// heartbeat its rebalance sends (with the rebalanced subscription's new version) while another is unanswered,
/// and the broker then refuses its pulls `SUBSCRIPTION_NOT_LATEST` until a later heartbeat: on a loaded machine
/// a new consumer's first message came 20 s late when the notification came first. Frames in wire order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_members_heartbeat_is_answered_before_its_group_is_told_to_rebalance() {
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_tell");
    create_topic(cluster, &topic).await;
    let group = unique_topic("rm_tell_g");
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    let heartbeat = consumer_heartbeat(&unique_topic("rm-tell-client"), &group, &topic);
    let opaque = heartbeat.opaque();
    send(&mut stream, heartbeat).await;

    let mut frames = Vec::new();
    while frames.len() < 2 {
        let frame = tokio::time::timeout(Duration::from_secs(30), read_frame(&mut stream)).await;
        frames.push(frame.expect("two frames within 30 s").expect("popgate kept the connection"));
    }
    let (answer, push) = (&frames[0], &frames[1]);
    let described =
        |f: &RemotingCommand| format!("code {} response {} opaque {}", f.code(), f.is_response_type(), f.opaque());
    assert!(
        answer.is_response_type() && answer.opaque() == opaque,
        "the heartbeat's answer comes first; came: {}",
        described(answer)
    );
    assert_eq!(answer.code(), 0, "{:?}", answer.remark());
    assert!(
        !push.is_response_type() && push.code() == 40,
        "then NOTIFY_CONSUMER_IDS_CHANGED; came: {}",
        described(push)
    );
    assert_eq!(push.ext_fields().and_then(|f| f.get("consumerGroup")).map(|g| g.as_str()), Some(group.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_name_popgate_as_every_broker_and_an_unknown_topic_is_answered_as_the_name_server_does() {
    let cluster = shared_cluster();
    let (mut popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_route");
    create_topic(cluster, &topic).await;
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");

    let mut request = RemotingCommand::create_remoting_command(105);
    request.add_ext_field("topic", topic.as_str());
    let answer = ask(&mut stream, request).await.expect("answered");
    assert_eq!(answer.code(), 0, "{:?}", answer.remark());
    let route: Value = serde_json::from_slice(answer.body().expect("a route")).expect("JSON");
    let brokers = route["brokerDatas"].as_array().expect("brokers");
    let mut names: Vec<&str> = brokers.iter().filter_map(|b| b["brokerName"].as_str()).collect();
    names.sort();
    assert_eq!(names, ["broker-a", "broker-b"], "the cluster's brokers: {route}");
    for broker in brokers {
        assert_eq!(broker["brokerAddrs"], json!({"0": namesrv}), "popgate is every broker: {route}");
    }
    assert_eq!(route["queueDatas"].as_array().map(Vec::len), Some(2), "the real queues: {route}");

    // A client before 4.9.5 (it names no broker in its requests) is given a port per broker, the same each time.
    let old_route = || {
        let mut request = RemotingCommand::create_remoting_command(105)
            .set_version(i32::try_from(rocketmq_model::version::RocketMqVersion::V4_9_3.ordinal()).expect("fits"));
        request.add_ext_field("topic", topic.as_str());
        request
    };
    let ports_of = |answer: RemotingCommand| -> BTreeMap<String, String> {
        let route: Value = serde_json::from_slice(answer.body().expect("a route")).expect("JSON");
        route["brokerDatas"]
            .as_array()
            .expect("brokers")
            .iter()
            .map(|b| (b["brokerName"].as_str().unwrap_or_default().to_owned(), b["brokerAddrs"]["0"].to_string()))
            .collect()
    };
    let first = ports_of(ask(&mut stream, old_route()).await.expect("answered"));
    let again = ports_of(ask(&mut stream, old_route()).await.expect("answered"));
    assert_eq!(first, again, "a broker keeps its port");
    let addrs: std::collections::BTreeSet<&String> = first.values().collect();
    assert_eq!(addrs.len(), 2, "one port per broker: {first:?}");
    assert!(!addrs.contains(&format!("\"{namesrv}\"")), "not the front's own port: {first:?}");
    // On a broker's port, a queue request that names no broker is that broker's (on the front's own port the
    // same request is refused: queue 0 is on both brokers).
    for addr in first.values() {
        let mut broker_port = TcpStream::connect(addr.trim_matches('"')).await.expect("connect");
        let mut max_offset = RemotingCommand::create_remoting_command(30);
        max_offset.add_ext_field("topic", topic.as_str());
        max_offset.add_ext_field("queueId", "0");
        let answer = ask(&mut broker_port, max_offset).await.expect("answered");
        assert_eq!(answer.code(), 0, "{addr}: {:?}", answer.remark());
    }
    // After a kill -9 the brokers' ports are listened on again at start, before any client asks: a client
    // that kept its route reaches the same broker.
    popgate.restart().await;
    for addr in first.values() {
        TcpStream::connect(addr.trim_matches('"')).await.expect("the broker's port is open again at once");
    }
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    assert_eq!(ports_of(ask(&mut stream, old_route()).await.expect("answered")), first, "the same ports");

    let mut unknown = RemotingCommand::create_remoting_command(105);
    unknown.add_ext_field("topic", "rm_route_no_such_topic");
    let answer = ask(&mut stream, unknown).await.expect("answered");
    assert_eq!(answer.code(), 17, "TOPIC_NOT_EXIST, as the name server answers: {:?}", answer.remark());
    assert!(
        popgate
            .metric("popgate_remoting_requests_total{code=\"get_routeinfo_by_topic\",result=\"topic_not_exist\"}")
            .await
            >= 1.0
    );

    // The name server's answers are cached, as Apache's proxy caches routes: a flood of route requests for one
    // topic costs the name server one request, and every answer is the route.
    let asked_name_server = || popgate.metric(r#"popgate_remoting_route_answers_total{source="name_server"}"#);
    let before = asked_name_server().await;
    for _ in 0..200 {
        let mut request = RemotingCommand::create_remoting_command(105);
        request.add_ext_field("topic", topic.as_str());
        let answer = ask(&mut stream, request).await.expect("answered");
        assert_eq!(answer.code(), 0, "{:?}", answer.remark());
    }
    let asked = asked_name_server().await - before;
    let cached = popgate.metric(r#"popgate_remoting_route_answers_total{source="cache"}"#).await;
    assert!(
        asked <= 1.0 && cached >= 199.0,
        "200 route requests asked the name server {asked} times ({cached} cached)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_get_a_clear_answer_or_a_closed_connection_and_are_counted() {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "max_frame_bytes = 65536\n").await;

    // An unknown request code: answered, and the connection stays usable.
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    let answer = ask(&mut stream, RemotingCommand::create_remoting_command(424_242)).await.expect("answered");
    assert_eq!(answer.code(), 3, "REQUEST_CODE_NOT_SUPPORTED");
    assert_eq!(answer.remark().map(|r| r.as_str()), Some(" request type 424242 not supported"));
    let answer = ask(&mut stream, RemotingCommand::create_remoting_command(38)).await.expect("still served");
    assert_eq!(answer.code(), 1, "GET_CONSUMER_LIST_BY_GROUP without a group: {:?}", answer.remark());

    // A route query as the Go client (rocketmq-client-go v2) writes it: its JSON header has no
    // `serializeTypeCurrentRPC`. Answered as a name server answers it, not closed.
    let go_header = r#"{"code":105,"language":"GO","version":317,"opaque":42,"flag":0,"remark":"","extFields":{"topic":"rm_bad_go_no_such_topic"}}"#;
    stream.write_all(&raw_frame(go_header)).await.expect("write");
    let answer = read_answer(&mut stream).await.expect("a Go client's frame is answered");
    assert_eq!((answer.code(), answer.opaque()), (17, 42), "TOPIC_NOT_EXIST, to its request: {:?}", answer.remark());

    // A header RocketMQ's servers read but the decoder would not (a language it does not know, a number where
    // Java writes text): read as they read it, and answered.
    let lenient =
        r#"{"code":105,"language":"KLINGON","version":"317","opaque":43,"extFields":{"topic":"rm_bad_lenient","n":7}}"#;
    stream.write_all(&raw_frame(lenient)).await.expect("write");
    let answer = read_answer(&mut stream).await.expect("answered");
    assert_eq!((answer.code(), answer.opaque()), (17, 43), "TOPIC_NOT_EXIST: {:?}", answer.remark());
    // A request whose header cannot be read as one: refused by its opaque, and the connection stays usable.
    stream.write_all(&raw_frame(r#"{"code":"route","opaque":44,"language":"GO"}"#)).await.expect("write");
    let answer = read_answer(&mut stream).await.expect("answered, not closed");
    assert_eq!((answer.code(), answer.opaque()), (1, 44), "SYSTEM_ERROR to that request: {:?}", answer.remark());
    assert!(answer.remark().is_some_and(|r| r.contains("`code`")), "names the field: {:?}", answer.remark());
    let answer = ask(&mut stream, RemotingCommand::create_remoting_command(38)).await.expect("still served");
    assert_eq!(answer.code(), 1);

    // A send whose header does not decode: refused as an illegal message, nothing sent.
    let mut send = RemotingCommand::create_remoting_command(310);
    send.add_ext_field("b", "rm_bad_topic");
    send.add_ext_field("e", "not-a-number");
    let answer = ask(&mut stream, send).await.expect("answered");
    assert_eq!(answer.code(), 13, "MESSAGE_ILLEGAL: {:?}", answer.remark());

    // A frame over the limit: the connection is closed before it is read.
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    stream.write_all(&(1_000_000u32).to_be_bytes()).await.expect("write");
    assert!(read_answer(&mut stream).await.is_none(), "closed");

    // A header that is not a header: closed.
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    let mut garbage = Vec::new();
    garbage.extend_from_slice(&12u32.to_be_bytes());
    garbage.extend_from_slice(&(0x0100_0000u32 | 8).to_be_bytes());
    garbage.extend_from_slice(b"{not json");
    stream.write_all(&garbage[..16]).await.expect("write");
    assert!(read_answer(&mut stream).await.is_none(), "closed");

    // Half a frame, then the client goes away.
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    stream.write_all(&100u32.to_be_bytes()).await.expect("write");
    stream.write_all(&[0u8; 10]).await.expect("write");
    drop(stream);

    eventually(Duration::from_secs(10), "every bad frame counted", || async {
        popgate.metric("popgate_remoting_frame_errors_total{reason=\"oversize\"}").await >= 1.0
            && popgate.metric("popgate_remoting_frame_errors_total{reason=\"undecodable\"}").await >= 1.0
            && popgate.metric("popgate_remoting_frame_errors_total{reason=\"truncated\"}").await >= 1.0
            && popgate.metric("popgate_remoting_frame_errors_total{reason=\"bad_header\"}").await == 1.0
    })
    .await;
    assert!(popgate.metric("popgate_remoting_requests_total{code=\"other\",result=\"not_supported\"}").await >= 1.0);
    assert!(Direct::connect(&cluster.namesrv_addr)
        .await
        .try_read_all("rm_bad_topic")
        .await
        .unwrap_or_default()
        .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_must_sign_with_a_token_and_may_only_do_what_the_token_allows() {
    let cluster = shared_cluster();
    let auth = "[auth]\nenabled = true\n\n[[auth.tokens]]\nname = \"rm-app\"\ntoken = \"rm-app-secret-0123456789\"\n\
                publish = [\"rm_auth_*\"]\nconsume = [\"rm_auth_g*\"]\n";
    let (popgate, namesrv) = popgate_with_remoting(cluster, auth).await;
    let topic = unique_topic("rm_auth");
    create_topic(cluster, &topic).await;
    let client = RemotingClient::V5;

    let unsigned = json!({"topic": topic, "group": "rm_auth_p", "count": 1, "retryTimes": 0});
    let refused = client.start("produce", &send_args(&namesrv, unsigned)).finish_allowing_error(DRIVER_TIMEOUT).await;
    assert!(refused.to_string().contains("AccessKey"), "an unsigned client is told why: {refused}");

    let wrong = json!({"topic": topic, "group": "rm_auth_p", "count": 1, "retryTimes": 0,
        "accessKey": "rm-app", "secretKey": "not-the-secret-0123456789"});
    let refused = client.start("produce", &send_args(&namesrv, wrong)).finish_allowing_error(DRIVER_TIMEOUT).await;
    assert!(refused.to_string().contains("Signature"), "a bad signature is refused: {refused}");

    let signed = json!({"topic": topic, "group": "rm_auth_p", "count": 2, "bodyPrefix": "s",
        "accessKey": "rm-app", "secretKey": "rm-app-secret-0123456789"});
    let result = client.run("produce", &send_args(&namesrv, signed.clone()), DRIVER_TIMEOUT).await;
    assert_eq!(result["errors"], json!([]), "a signed client is served: {result}");
    let mut other = signed.clone();
    other["topic"] = json!(unique_topic("rm_other"));
    create_topic(cluster, other["topic"].as_str().unwrap_or_default()).await;
    let refused = client.start("produce", &send_args(&namesrv, other)).finish_allowing_error(DRIVER_TIMEOUT).await;
    assert!(refused.to_string().contains("may not publish"), "another topic is not the token's: {refused}");

    let consume = json!({"topic": topic, "group": unique_topic("rm_auth_g"), "expect": 2,
        "accessKey": "rm-app", "secretKey": "rm-app-secret-0123456789"});
    let result = client.run("push-consume", &args(&namesrv, consume), DRIVER_TIMEOUT).await;
    assert_eq!(bodies(&result, "received").len(), 2, "a signed consumer is served: {result}");
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"unauthenticated\"}").await >= 2.0);
}

on_every_remoting_client!(
    a_send_to_a_sigstopped_broker_is_answered_in_time_for_the_client_to_retry_on_the_other,
    a_committed_transaction_is_stored_once_and_a_rolled_back_one_never,
    an_undecided_transaction_is_checked_back_through_its_producer_and_committed,
    a_commit_after_popgate_was_killed_between_send_and_commit_lands,
);

async fn a_send_to_a_sigstopped_broker_is_answered_in_time_for_the_client_to_retry_on_the_other(
    client: RemotingClient,
) {
    let cluster = Cluster::start(&crate::harness::rocketmq::ClusterSpec::brokers(&["broker-a", "broker-b"]));
    // popgate gives up on a broker within 1 s, well inside the client's send timeout; fault avoidance then
    // isolates the hung broker, and sends the client places there are refused at once. A slow send isolates
    // nothing here (`not_available_ms` all 0): on a loaded machine a warm-up send to broker-b took over 550 ms,
    // isolated it for latency before the pause, and every later send to it was refused without reaching it,
    // so the hung broker's own isolation, which this test is about, never happened.
    let config = "[publish]\nsend_timeout_ms = 1000\n\n[fault_avoidance]\nnetwork_error_isolation_ms = 30000\n\
                  latency_max_ms = [50, 100, 550, 1000, 2000, 3000, 15000]\nnot_available_ms = [0, 0, 0, 0, 0, 0, 0]\n";
    let (popgate, namesrv) = popgate_with_remoting(&cluster, config).await;
    let topic = unique_topic("rm_stop");
    create_topic(&cluster, &topic).await;
    let warm = json!({"topic": topic, "group": "rm_stop_p", "count": 4, "bodyPrefix": "warm"});
    let warmed = client.run("produce", &send_args(&namesrv, warm), DRIVER_TIMEOUT).await;
    // The warm-up only opens routes and connections: a 4.9.3 client asks for its first route with a fixed 3 s
    // timeout, which a loaded machine can miss once (the client's error, not popgate's refusal). At least
    // three warm-up sends must land, so routes and connections are there before the pause.
    let errors = warmed["errors"].as_array().map_or(0, Vec::len);
    assert!(errors <= 1 && warmed["sent"].as_array().is_some_and(|s| s.len() >= 3), "{warmed}");

    cluster.pause_broker("broker-b");
    // The client waits 6 s for each send: popgate gives up on the hung broker after 1 s, so the client's retry
    // on the other broker fits even on a loaded machine.
    let sends = json!({"topic": topic, "group": "rm_stop_p", "count": 8, "bodyPrefix": "s", "retryTimes": 2,
        "sendTimeoutMs": 6000});
    let result = client.run("produce", &send_args(&namesrv, sends), DRIVER_TIMEOUT).await;
    cluster.resume_broker("broker-b");
    assert_eq!(result["errors"], json!([]), "every send landed, retried by the client on broker-a: {result}");
    for sent in result["sent"].as_array().expect("sent") {
        assert_eq!(sent["broker"], "broker-a", "{result}");
    }
    // The eight sends, and the warm-up sends that landed (one may have missed its route in time).
    let warmed_up = warmed["sent"].as_array().map_or(0, Vec::len);
    let stored = stored(&cluster, &topic, 8 + warmed_up).await;
    assert!(
        (0..8).all(|i| stored.get(&format!("s-{i}")).is_some_and(|m| m.broker == "broker-a")),
        "{:?}",
        stored.keys()
    );
    assert!(
        popgate.metric("popgate_broker_isolations_total{broker=\"broker-b\",cause=\"unreachable\"}").await >= 1.0,
        "the hung broker was isolated"
    );
}

/// The bodies stored in `topic` now, sorted.
pub(crate) async fn stored_bodies(cluster: &Cluster, topic: &str) -> Vec<String> {
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let mut bodies: Vec<String> = direct
        .try_read_all(topic)
        .await
        .unwrap_or_default()
        .into_iter()
        .map(|m| String::from_utf8_lossy(&m.body).into_owned())
        .collect();
    bodies.sort();
    bodies
}

async fn a_committed_transaction_is_stored_once_and_a_rolled_back_one_never(client: RemotingClient) {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_tx");
    // A topic without a type, as 4.x tools make them: the broker takes transactions on it, and so does popgate.
    create_topic(cluster, &topic).await;
    for (resolution, prefix) in [("commit", "kept"), ("rollback", "dropped")] {
        let transact = json!({"topic": topic, "group": "rm_tx_p", "resolution": resolution, "bodyPrefix": prefix,
            "checkResolution": "unknown"});
        let result = client.run("transact", &send_args(&namesrv, transact), DRIVER_TIMEOUT).await;
        assert_eq!(result["errors"], json!([]), "{resolution}: {result}");
        assert_eq!(result["sent"][0]["status"], "SEND_OK", "{result}");
    }
    eventually(Duration::from_secs(20), "the committed message is stored", || async {
        !stored_bodies(cluster, &topic).await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(stored_bodies(cluster, &topic).await, ["kept-0"], "the commit once, the rollback never");
    // Ended from popgate's record at once, not left to the broker's check-back as Apache's proxy leaves it.
    assert!(popgate.metric("popgate_transactions_ended_total{resolution=\"commit\",result=\"landed\"}").await >= 1.0);
    assert!(popgate.metric("popgate_transactions_ended_total{resolution=\"rollback\",result=\"landed\"}").await >= 1.0);
}

/// The broker checks an undecided transaction back through popgate, which asks the app's checker, at the
/// broker's first check-back. Issue #34 saw the first check-back answered by nobody and the checker asked only at
/// the second, 30 s later (a heartbeat period). Tried here as the likeliest cause, and not reproduced: the app
/// sends 2 s after starting its producer, on a cluster without `autoCreateTopicEnable`, so the client's first
/// scheduled heartbeat (1 s after the start) knows no broker yet. The checker is asked within the first
/// check-backs (3 to 6 s after the send) and no check-back finds nobody to ask.
async fn an_undecided_transaction_is_checked_back_through_its_producer_and_committed(client: RemotingClient) {
    let mut spec = crate::harness::rocketmq::ClusterSpec::brokers(&["broker-a"]);
    spec.broker_conf = vec![
        "transactionTimeOut=3000".into(),
        "transactionCheckInterval=3000".into(),
        "autoCreateTopicEnable=false".into(),
    ];
    let cluster = Cluster::start(&spec);
    let (popgate, namesrv) = popgate_with_remoting(&cluster, "").await;
    let topic = unique_topic("rm_tx_check");
    // A topic without a type, as 4.x tools make them (Apache's remoting e2e suite sends its transactions so).
    create_topic(&cluster, &topic).await;
    let transact = json!({"topic": topic, "group": "rm_tx_check_p", "resolution": "unknown",
        "checkResolution": "commit", "bodyPrefix": "checked", "lingerMs": 20000, "sendAfterMs": 2000});
    let producer = client.start("transact", &send_args(&namesrv, transact));
    eventually(Duration::from_secs(60), "the checked-back message is committed", || async {
        !stored_bodies(&cluster, &topic).await.is_empty()
    })
    .await;
    let result = producer.finish(DRIVER_TIMEOUT).await;
    let checks = result["checks"].as_array().cloned().unwrap_or_default();
    assert!(!checks.is_empty(), "the producer was asked: {result}");
    assert_eq!(checks[0]["body"], "checked-0", "about its own message: {result}");
    assert_eq!(checks[0]["uniqKey"], result["sent"][0]["msgId"], "{result}");
    assert_eq!(stored_bodies(&cluster, &topic).await, ["checked-0"], "stored once");
    // The broker checks a half message older than 3 s every 3 s: the first check comes 3 to 6 s after the send.
    let sent_at = result["sent"][0]["sentAtMs"].as_i64().unwrap_or_default();
    let first_check_after = Duration::from_millis((checks[0]["atMs"].as_i64().unwrap_or_default() - sent_at) as u64);
    println!("the checker was first asked {first_check_after:?} after the send");
    let unanswered = popgate.metric("popgate_transaction_checks_total{outcome=\"no_producer\"}").await;
    assert_eq!(unanswered, 0.0, "every check-back reached the producer: {result}");
    assert!(first_check_after < Duration::from_secs(20), "asked at the first check-backs, not {first_check_after:?}");
    assert!(
        popgate.metric("popgate_transaction_check_answers_total{front=\"remoting\",answer=\"commit\"}").await >= 1.0
    );
}

async fn a_commit_after_popgate_was_killed_between_send_and_commit_lands(client: RemotingClient) {
    let cluster = shared_cluster();
    let (mut popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_tx_kill");
    crate::transaction::create_transaction_topic(cluster, &topic).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let end_now = dir.path().join("end");
    let transact = json!({"topic": topic, "group": "rm_tx_kill_p", "resolution": "commit", "bodyPrefix": "survived",
        "checkResolution": "unknown", "endWhenFile": end_now, "lingerMs": 3000, "timeoutMs": 120000});
    let producer = client.start("transact", &send_args(&namesrv, transact));
    eventually(Duration::from_secs(60), "the half message was sent", || async {
        popgate.metric("popgate_publish_requests_total{result=\"ok\",transport=\"remoting\"}").await >= 1.0
    })
    .await;
    popgate.kill9();
    popgate.restart().await;
    std::fs::write(&end_now, b"").expect("write");
    let result = producer.finish(DRIVER_TIMEOUT).await;
    assert_eq!(result["errors"], json!([]), "{result}");
    eventually(Duration::from_secs(20), "the commit landed", || async {
        !stored_bodies(cluster, &topic).await.is_empty()
    })
    .await;
    assert_eq!(stored_bodies(cluster, &topic).await, ["survived-0"], "stored once");
}

/// A `SEND_MESSAGE_V2` of one message with id `uniq_key` to queue 0 of `broker`, as a client makes it.
fn raw_send(topic: &str, broker: &str, uniq_key: &str, body: &'static [u8]) -> RemotingCommand {
    let mut send = RemotingCommand::create_remoting_command(310).set_body(bytes::Bytes::from_static(body));
    for (name, value) in [
        ("a", "rm_raw_p"),
        ("b", topic),
        ("c", "TBW102"),
        ("d", "4"),
        ("e", "0"),
        ("f", "0"),
        ("g", "1796000000000"),
        ("h", "0"),
        ("j", "0"),
        ("k", "false"),
        ("m", "false"),
        ("n", broker),
    ] {
        send.add_ext_field(name, value);
    }
    send.add_ext_field("i", format!("UNIQ_KEY\u{1}{uniq_key}\u{2}WAIT\u{1}true\u{2}"));
    send
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_retry_of_a_stored_send_to_another_broker_is_answered_with_the_first_receipt_and_not_stored_again() {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_dedup");
    create_topic(cluster, &topic).await;
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    let id = format!("7F0000010000{:020X}", rand::random::<u64>());
    let first = ask(&mut stream, raw_send(&topic, "broker-a", &id, b"once")).await.expect("answered");
    assert_eq!(first.code(), 0, "{:?}", first.remark());
    // The client's retry after a timeout goes to another broker, with the same message id.
    let retry = ask(&mut stream, raw_send(&topic, "broker-b", &id, b"once")).await.expect("answered");
    assert_eq!(retry.code(), 0, "{:?}", retry.remark());
    let field = |answer: &RemotingCommand, name: &str| {
        answer.ext_fields().and_then(|f| f.get(name)).map(|v| v.to_string()).unwrap_or_default()
    };
    assert_eq!(field(&retry, "msgId"), field(&first, "msgId"), "the first receipt");
    assert_eq!(field(&retry, "queueOffset"), field(&first, "queueOffset"));
    let stored = stored(cluster, &topic, 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let again = Direct::connect(&cluster.namesrv_addr).await.read_all(&topic).await;
    assert_eq!(again.len(), 1, "stored once: {:?}", stored.keys());
    assert_eq!(again[0].broker, "broker-a");
    assert!(popgate.metric("popgate_publish_deduplicated_total").await >= 1.0);
}

/// The listener's deliveries of each body, in arrival order.
fn received_by_body(result: &Value) -> BTreeMap<String, Vec<Value>> {
    let mut by_body: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for entry in result["received"].as_array().into_iter().flatten() {
        by_body.entry(entry["body"].as_str().unwrap_or_default().to_owned()).or_default().push(entry.clone());
    }
    by_body
}

/// The arguments of a push consumer that consumes by POP (`setClientRebalance(false)`).
fn pop_consumer_args(namesrv: &str, mut extra: Value) -> Value {
    extra["clientRebalance"] = json!(false);
    args(namesrv, extra)
}

async fn a_pop_consumer_acks_with_handles_issued_before_popgate_was_killed_and_nothing_is_delivered_twice(
    client: RemotingClient,
) {
    let cluster = shared_cluster();
    // A short broker lease: a message whose ACK were lost would come back from the broker within seconds. Not
    // shorter than a restart on a loaded machine takes to renew it (with 5 s, a restart that took 1.6 s and its
    // first renewal found the broker had put all four messages back already).
    let (mut popgate, namesrv) = popgate_with_remoting(cluster, "[delivery]\nlease_ms = 15000\n").await;
    let topic = unique_topic("rm_pop_kill");
    let group = unique_topic("rm_pop_kill_g");
    create_topic(cluster, &topic).await;
    let bodies_sent: Vec<String> = (0..4).map(|n| format!("k-{n}")).collect();
    popgate.publish_bodies(&topic, &bodies_sent).await;

    // Each listener call holds its message for 25 s: past popgate's restart, well within the 60 s invisible
    // time the client asks for. The driver counts a message when its listener call starts, and then settles
    // for 30 s: the calls end and their ACKs are sent before the consumer shuts down.
    let consume = json!({"topic": topic, "group": group, "expect": 4, "holdMs": 25_000, "settleMs": 30_000,
        "popInvisibleTimeMs": 60_000, "timeoutMs": 150_000});
    let consumer = client.start("push-consume", &pop_consumer_args(&namesrv, consume));
    eventually(Duration::from_secs(90), "the listener holds all four", || async {
        let (_, body) = popgate.get_json(&format!("/admin/deliveries?group={group}")).await;
        body["deliveries"].as_array().is_some_and(|d| d.len() == 4 && d.iter().all(|d| d["phase"] == "awaiting_ack"))
    })
    .await;
    // The client hands popped messages to its listener threads a moment later.
    tokio::time::sleep(Duration::from_secs(2)).await;
    popgate.restart().await;

    let result = consumer.finish(DRIVER_TIMEOUT).await;
    assert_eq!(result["timedOut"], false, "{result}");
    let by_body = received_by_body(&result);
    for body in &bodies_sent {
        let deliveries = by_body.get(body).map(Vec::as_slice).unwrap_or_default();
        assert_eq!(deliveries.len(), 1, "{body} reached the listener exactly once: {result}");
        let pop_ck = deliveries[0]["properties"]["POP_CK"].as_str().unwrap_or_default();
        assert!(pop_ck.contains(" pgr:"), "the message carries popgate's handle: {pop_ck}");
        assert_eq!(deliveries[0]["reconsumeTimes"], 0, "{result}");
        assert_eq!(deliveries[0]["topic"], topic.as_str(), "{result}");
    }
    eventually(Duration::from_secs(20), "the post-crash ACKs are settled at the broker", || async {
        popgate.get_json(&format!("/admin/deliveries?group={group}")).await.1["deliveries"]
            .as_array()
            .is_some_and(Vec::is_empty)
    })
    .await;
    assert!(popgate.metric("popgate_acks_total{result=\"acked\"}").await >= 4.0, "the restarted popgate took the ACKs");
    assert!(
        popgate.metric("popgate_remoting_requests_total{code=\"ack_message\",result=\"ok\"}").await >= 4.0,
        "four ACK_MESSAGE answered SUCCESS"
    );
    drop(popgate);
    // Past the 15 s lease: an unACKed message would be back at the broker by now.
    let again =
        DirectConsumer::connect(&cluster.namesrv_addr).await.drain(&group, &topic, Duration::from_secs(20)).await;
    assert_eq!(again, Vec::<String>::new(), "nothing comes back from the broker");
}

async fn a_pop_consumers_reconsume_later_comes_back_on_popgates_backoff_then_goes_to_the_dlq(client: RemotingClient) {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_pop_dlq");
    let group = unique_topic("rm_pop_dlq_g");
    create_topic(cluster, &topic).await;
    let produce = json!({"topic": topic, "group": "rm_pop_dlq_p", "count": 3, "bodyPrefix": "b", "tag": "TagA",
        "keys": "k1 k2", "properties": {"color": "red"}});
    let sent = client.run("produce", &send_args(&namesrv, produce), DRIVER_TIMEOUT).await;
    assert_eq!(sent["errors"], json!([]), "{sent}");

    // "b-1" fails every time: 6 attempts on popgate's backoff (1 s, 2 s, 4 s, 8 s, 16 s, ±20 %), then the DLQ.
    let consume = json!({"topic": topic, "group": group, "subExpression": "TagA", "expect": 3, "failBodies": ["b-1"],
        "failTimes": 99, "settleMs": 45_000, "timeoutMs": 150_000});
    let result = client.run("push-consume", &pop_consumer_args(&namesrv, consume), DRIVER_TIMEOUT).await;
    assert_eq!(result["timedOut"], false, "{result}");
    let by_body = received_by_body(&result);
    for body in ["b-0", "b-2"] {
        assert_eq!(by_body[body].len(), 1, "{body} once: {result}");
        let delivered = &by_body[body][0];
        assert_eq!(delivered["tags"], "TagA", "{result}");
        assert_eq!(delivered["keys"], "k1 k2", "{result}");
        assert_eq!(delivered["properties"]["color"], "red", "{result}");
    }
    let sent_ids = ids_of(&sent);
    assert!(sent_ids.contains(&by_body["b-0"][0]["msgId"].as_str().unwrap_or_default().to_owned()), "{result}");
    let bad = &by_body["b-1"];
    assert_eq!(bad.len(), 6, "6 attempts in all: {result}");
    let reconsumed: Vec<i64> = bad.iter().map(|e| e["reconsumeTimes"].as_i64().unwrap_or(-1)).collect();
    assert_eq!(reconsumed, [0, 1, 2, 3, 4, 5], "popgate counts the attempts: {result}");
    let at: Vec<i64> = bad.iter().map(|e| e["atMs"].as_i64().unwrap_or(0)).collect();
    for (n, pair) in at.windows(2).enumerate() {
        let expected = 1_000i64 << n;
        let gap = pair[1] - pair[0];
        // ±20 % jitter; the upper bound also allows for a loaded machine's POP and listener latency.
        assert!(
            gap >= expected * 8 / 10 - 100 && gap <= expected * 12 / 10 + 2_000,
            "retry {} after {gap} ms, not {expected} ms ±20 %: {at:?}",
            n + 1
        );
    }
    let dead = stored(cluster, &format!("%DLQ%{group}"), 1).await;
    assert_eq!(dead.keys().collect::<Vec<_>>(), ["b-1"], "only b-1 is in the group's DLQ");
    assert_eq!(dead["b-1"].property("DLQ_ORIGIN_TOPIC"), Some(topic.as_str()));
    assert!(popgate.metric(&format!("popgate_dlq_messages_total{{group=\"{group}\"}}")).await >= 1.0);
    assert!(
        popgate.metric("popgate_remoting_requests_total{code=\"change_message_invisibletime\",result=\"ok\"}").await
            >= 5.0
    );
}

/// A consumer's offset commits reach popgate back to back (at its shutdown, one one-way request per queue), and
/// Apache's broker loses one of two commits that reach it at once when they are a group's first on a topic: its
/// `ConsumerOffsetManager.commitOffset` makes the group's offset table without `computeIfAbsent`, and the later
/// table replaces the earlier. popgate relays a group's offset requests one at a time, in the order they came, so
/// every commit holds. (A lite pull consumer under load once re-read a message this way after a restart.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offset_commits_sent_back_to_back_all_hold_at_the_broker() {
    // An end-to-end check that every first commit holds, not the proof of the turns (their unit tests are): the
    // broker's window is microseconds, and this test also passed before offset requests took turns.
    const GROUPS: usize = 40;
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_commits");
    create_topic(cluster, &topic).await;
    let queues: Vec<(String, i32)> =
        cluster.brokers.iter().flat_map(|b| (0..4).map(move |q| (b.name.clone(), q))).collect();
    let groups: Vec<String> = (0..GROUPS).map(|_| unique_topic("rm_commits_g")).collect();
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    // The broker takes commits only for a group it knows: a consumer's heartbeat (passed on to every master)
    // makes it. Nothing is read from this connection: popgate may push membership changes onto it.
    for (n, group) in groups.iter().enumerate() {
        send(&mut stream, consumer_heartbeat(&format!("raw-commits-{n}"), group, &topic)).await;
    }
    let forwarded = (GROUPS * cluster.brokers.len()) as f64;
    eventually(Duration::from_secs(60), "every heartbeat reached every master", || async {
        popgate.metric("popgate_remoting_relays_total{code=\"heart_beat\",result=\"ok\"}").await >= forwarded
    })
    .await;

    let mut frames = BytesMut::new();
    for group in &groups {
        for (offset, (broker, queue)) in (1_i64..).zip(&queues) {
            let fields = [
                ("topic", topic.as_str()),
                ("consumerGroup", group.as_str()),
                ("queueId", &queue.to_string()),
                ("commitOffset", &offset.to_string()),
                ("bname", broker.as_str()),
            ];
            let commit = raw_request(15, &fields).mark_oneway_rpc();
            frames.extend_from_slice(&EncodedFrame::from_command(commit).expect("encodes").into_bytes());
        }
    }
    // In one write, as a client's shutdown sends a group's commits.
    stream.write_all(&frames).await.expect("write");
    let relayed = (GROUPS * queues.len()) as f64;
    eventually(Duration::from_secs(60), "every commit was answered by its broker", || async {
        popgate.metric(&offset_commit_relays("ok")).await >= relayed
    })
    .await;

    let expected: HashMap<(String, i32), i64> = (1_i64..).zip(&queues).map(|(o, q)| (q.clone(), o)).collect();
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let mut lost = Vec::new();
    for group in &groups {
        let held = direct.consumer_offsets(group, &topic).await.expect("the broker's consume stats");
        lost.extend(expected.iter().filter(|(queue, offset)| held.get(*queue) != Some(*offset)).map(
            |(queue, offset)| format!("{group} {queue:?}: committed {offset}, the broker holds {:?}", held.get(queue)),
        ));
    }
    assert!(lost.is_empty(), "every commit holds at the broker; lost:\n{}", lost.join("\n"));
}

/// The route of a consumer group's retry topic, asked for right after the group's first heartbeat, is the one the
/// broker created as it took that heartbeat, not the "no such topic" the name server gave a moment before. A push
/// consumer asks at its start, before its first heartbeat, and again in the rebalance the heartbeat triggers; given
/// the old answer, it pulled its retries only after its next route poll and rebalance, and a message it asked to
/// reconsume came back 40 s after its first delivery instead of at its delay level, 10 s (Apache's remoting e2e
/// suite, `PushConsumerRetryTest`, client 4.9.3: straight at the cluster 10 s). Raw frames: a real client's
/// timing depends on which of its rebalances a heartbeat's notification wakes, straight at the cluster too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_groups_retry_topic_has_its_route_right_after_the_heartbeat_that_created_it() {
    const GET_ROUTEINFO_BY_TOPIC: i32 = 105;
    const TOPIC_NOT_EXIST: i32 = 17;
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_retry_route");
    let group = unique_topic("rm_retry_route_g");
    create_topic(cluster, &topic).await;
    let retry_topic = format!("%RETRY%{group}");
    let route_of = |topic: &str| raw_request(GET_ROUTEINFO_BY_TOPIC, &[("topic", topic)]);
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");

    let before = ask(&mut stream, route_of(&retry_topic)).await.expect("answered");
    assert_eq!(before.code(), TOPIC_NOT_EXIST, "no retry topic before the group's first heartbeat");
    // A push consumer's: the broker creates the group's retry topic as it takes it.
    let heartbeat = push_consumer_heartbeat("raw@retry_route", &group, &topic);
    let registered = ask(&mut stream, heartbeat).await.expect("answered");
    assert_eq!(registered.code(), 0, "{:?}", registered.remark());

    let after = ask(&mut stream, route_of(&retry_topic)).await.expect("answered");
    assert_eq!(after.code(), 0, "the retry topic's route at once: {:?}", after.remark());
    let route: Value = serde_json::from_slice(after.body().expect("a route")).expect("JSON");
    let brokers = route["brokerDatas"].as_array().map_or(0, Vec::len);
    assert_eq!(brokers, cluster.brokers.len(), "every master took the heartbeat: {route}");
    assert!(popgate.metric("popgate_remoting_route_answers_total{source=\"name_server\"}").await >= 2.0);
}

/// A 5.x pull consumer's `HEART_BEAT` for `group`, subscribed to all of `topic`.
pub(crate) fn consumer_heartbeat(client_id: &str, group: &str, topic: &str) -> RemotingCommand {
    heartbeat_of(client_id, group, topic, "CONSUME_ACTIVELY")
}

/// A push consumer's `HEART_BEAT` for `group`, subscribed to all of `topic`.
fn push_consumer_heartbeat(client_id: &str, group: &str, topic: &str) -> RemotingCommand {
    heartbeat_of(client_id, group, topic, "CONSUME_PASSIVELY")
}

/// A `HEART_BEAT` of one consumer of `group` (`consume_type`: `CONSUME_ACTIVELY` or `CONSUME_PASSIVELY`).
fn heartbeat_of(client_id: &str, group: &str, topic: &str, consume_type: &str) -> RemotingCommand {
    let subscription = json!({"topic": topic, "subString": "*", "tagsSet": [], "codeSet": [], "subVersion": 0,
        "expressionType": "TAG", "classFilterMode": false});
    let body = json!({"clientID": client_id, "producerDataSet": [], "consumerDataSet": [{"groupName": group,
        "consumeType": consume_type, "messageModel": "CLUSTERING", "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET",
        "subscriptionDataSet": [subscription], "unitMode": false}]});
    RemotingCommand::create_remoting_command(34).set_body(body.to_string().into_bytes())
}

/// A `PULL_MESSAGE` of `group` from queue `queue_id` of `topic` at broker-a, from offset 0, for one message;
/// with `suspend_ms`, held by the broker that long until a message comes (`FLAG_SUSPEND`).
/// A connection to `namesrv` (popgate's remoting port) on which `heartbeat` was answered `SUCCESS`: a
/// registered member of its group while the connection stays open.
async fn registered_member(namesrv: &str, heartbeat: RemotingCommand) -> TcpStream {
    let mut member = TcpStream::connect(namesrv).await.expect("connect");
    let registered = ask(&mut member, heartbeat).await.expect("answered");
    assert_eq!(registered.code(), 0, "{:?}", registered.remark());
    member
}

/// Sends `request` on a new connection to `addr`, as a client of its own, and waits at most `within`: the
/// answer (none in time: `None`) and how long it took.
async fn ask_on_a_connection_of_its_own(
    addr: String,
    request: RemotingCommand,
    within: Duration,
) -> (Option<RemotingCommand>, Duration) {
    let mut stream = TcpStream::connect(&addr).await.expect("connect");
    let asked = std::time::Instant::now();
    send(&mut stream, request).await;
    let answer = read_answer_within(&mut stream, within).await;
    (answer, asked.elapsed())
}

pub(crate) fn raw_pull(group: &str, topic: &str, queue_id: &str, suspend_ms: Option<&str>) -> RemotingCommand {
    let (sys_flag, suspend_ms) = match suspend_ms {
        Some(held_for) => ("2", held_for),
        None => ("0", "0"),
    };
    raw_request(
        11,
        &[
            ("consumerGroup", group),
            ("topic", topic),
            ("queueId", queue_id),
            ("queueOffset", "0"),
            ("maxMsgNums", "1"),
            ("sysFlag", sys_flag),
            ("commitOffset", "0"),
            ("suspendTimeoutMillis", suspend_ms),
            ("subscription", "*"),
            ("subVersion", "0"),
            ("expressionType", "TAG"),
            ("bname", "broker-a"),
        ],
    )
}

/// A request with `fields` as its header, as a 5.4.0 client makes it.
pub(crate) fn raw_request(code: i32, fields: &[(&str, &str)]) -> RemotingCommand {
    let mut request = RemotingCommand::create_remoting_command(code);
    for (name, value) in fields {
        request.add_ext_field(*name, *value);
    }
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pop_requests_are_answered_as_a_pop_broker_answers_them_and_what_popgate_cannot_settle_is_refused_clearly() {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_pop_raw");
    let group = unique_topic("rm_pop_raw_g");
    create_topic(cluster, &topic).await;
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");

    // QUERY_ASSIGNMENT: every broker of the topic, one POP queue each.
    let query = json!({"topic": topic, "consumerGroup": group, "clientId": "raw@1", "strategyName": "AVG",
        "messageModel": "CLUSTERING"});
    let ask_assignment = raw_request(400, &[]).set_body(query.to_string().into_bytes());
    let answer = ask(&mut stream, ask_assignment).await.expect("answered");
    assert_eq!(answer.code(), 0, "{:?}", answer.remark());
    let body: Value = serde_json::from_slice(answer.body().expect("a body")).expect("json");
    let mut assigned: Vec<(String, String, i64)> = body["messageQueueAssignments"]
        .as_array()
        .expect("assignments")
        .iter()
        .map(|a| {
            let queue = &a["messageQueue"];
            (
                queue["brokerName"].as_str().unwrap_or_default().to_owned(),
                a["mode"].to_string(),
                queue["queueId"].as_i64().unwrap_or(0),
            )
        })
        .collect();
    assigned.sort();
    let expected: Vec<(String, String, i64)> =
        ["broker-a", "broker-b"].iter().map(|b| ((*b).to_owned(), "\"POP\"".to_owned(), -1)).collect();
    assert_eq!(assigned, expected);

    // A POP that asks for more than the broker's 32.
    let pop = |max: &str| {
        raw_request(
            200050,
            &[
                ("consumerGroup", group.as_str()),
                ("topic", topic.as_str()),
                ("queueId", "-1"),
                ("maxMsgNums", max),
                ("invisibleTime", "60000"),
                ("pollTime", "0"),
                ("bornTime", "0"),
                ("initMode", "0"),
                ("bname", "broker-a"),
            ],
        )
    };
    let answer = ask(&mut stream, pop("33")).await.expect("answered");
    assert_eq!(answer.code(), 29, "INVALID_PARAMETER: {:?}", answer.remark());
    // Nothing to pop: POLLING_TIMEOUT, with the header the client decodes.
    let answer = ask(&mut stream, pop("32")).await.expect("answered");
    assert_eq!(answer.code(), 210, "POLLING_TIMEOUT: {:?}", answer.remark());
    let header = answer.ext_fields().expect("a header");
    for field in ["popTime", "invisibleTime", "reviveQid", "restNum"] {
        assert!(header.contains_key(field), "{field} in {header:?}");
    }

    // An ACK of a message popped elsewhere (a broker's own POP_CK, no popgate handle).
    let foreign = raw_request(
        200051,
        &[
            ("consumerGroup", group.as_str()),
            ("topic", topic.as_str()),
            ("queueId", "0"),
            ("offset", "0"),
            ("extraInfo", "0 1796000000000 60000 0 0 broker-a 0 0"),
            ("bname", "broker-a"),
        ],
    );
    let answer = ask(&mut stream, foreign).await.expect("answered");
    assert_eq!(answer.code(), 29, "INVALID_PARAMETER: {:?}", answer.remark());
    // A handle popgate issued once but holds no more.
    let gone = raw_request(
        200051,
        &[
            ("consumerGroup", group.as_str()),
            ("topic", topic.as_str()),
            ("queueId", "0"),
            ("offset", "0"),
            ("extraInfo", "0 1796000000000 60000 0 0 broker-a 0 0 pgr:00ff.1"),
            ("bname", "broker-a"),
        ],
    );
    let answer = ask(&mut stream, gone).await.expect("answered");
    assert_eq!(answer.code(), 208, "NO_MESSAGE: {:?}", answer.remark());
    // BATCH_ACK_MESSAGE (sent by proxies, not clients).
    let answer = ask(&mut stream, raw_request(200151, &[]).set_body(b"{}".to_vec())).await.expect("answered");
    assert_eq!(answer.code(), 3, "REQUEST_CODE_NOT_SUPPORTED: {:?}", answer.remark());
    assert!(
        popgate.metric("popgate_remoting_requests_total{code=\"pop_message\",result=\"invalid_parameter\"}").await
            >= 1.0
    );
    assert!(popgate.metric("popgate_remoting_requests_total{code=\"ack_message\",result=\"no_message\"}").await >= 1.0);
}

async fn a_client_that_uses_tls_sends_and_consumes_through_popgate(client: RemotingClient) {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_tls");
    let group = unique_topic("rm_tls_g");
    create_topic(cluster, &topic).await;
    // A client with TLS on cannot talk to a plaintext server at all: what it sends and receives went over TLS
    // (popgate's self-signed certificate, which the client accepts in its default mode).
    let produce = json!({"topic": topic, "group": "rm_tls_p", "count": 3, "bodyPrefix": "tls", "useTLS": true});
    let sent = client.run("produce", &send_args(&namesrv, produce), DRIVER_TIMEOUT).await;
    assert_eq!(sent["errors"], json!([]), "{sent}");
    let consume = json!({"topic": topic, "group": group, "expect": 3, "useTLS": true});
    let result = client.run("push-consume", &args(&namesrv, consume), DRIVER_TIMEOUT).await;
    assert_eq!(result["timedOut"], false, "{result}");
    let mut got = bodies(&result, "received");
    got.sort();
    assert_eq!(got, ["tls-0", "tls-1", "tls-2"], "{result}");
    assert_eq!(popgate.metric("popgate_tls_handshake_failures_total").await, 0.0);
    // Plaintext clients keep the same port.
    let mut plain = TcpStream::connect(&namesrv).await.expect("connect");
    let mut route = RemotingCommand::create_remoting_command(105);
    route.add_ext_field("topic", topic.as_str());
    assert_eq!(ask(&mut plain, route).await.expect("answered").code(), 0);
}

/// A one-way request (an offset commit at a consumer's shutdown) is never answered, so its client never sends it
/// again: popgate relays it again when the broker cannot be reached, and reports it lost when it gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_way_request_popgate_cannot_relay_is_tried_again_then_reported_lost() {
    let mut cluster = Cluster::start(&crate::harness::rocketmq::ClusterSpec::brokers(&["broker-a"]));
    let (popgate, namesrv) = popgate_with_remoting(&cluster, "").await;
    let topic = unique_topic("rm_oneway");
    create_topic(&cluster, &topic).await;
    let group = unique_topic("rm_oneway_g");
    let commit = || {
        raw_request(
            15,
            &[
                ("topic", &topic),
                ("consumerGroup", &group),
                ("queueId", "0"),
                ("commitOffset", "1"),
                ("bname", "broker-a"),
            ],
        )
        .mark_oneway_rpc()
    };
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    send(&mut stream, commit()).await;
    eventually(Duration::from_secs(30), "the one-way commit reached the broker", || async {
        popgate.metric(&offset_commit_relays("ok")).await == 1.0
    })
    .await;

    cluster.kill_broker("broker-a");
    send(&mut stream, commit()).await;
    eventually(Duration::from_secs(60), "the commit was tried three times", || async {
        popgate.metric(&offset_commit_relays("unreachable")).await == 3.0
    })
    .await;
    eventually(Duration::from_secs(10), "the loss was logged", || async {
        popgate.output().contains("could not be relayed to its broker and is lost")
    })
    .await;
    assert_eq!(popgate.metric(&offset_commit_relays("ok")).await, 1.0, "nothing more reached a broker");
}

/// Issue #34: a broker forgets every consumer group registered over a connection when that connection closes,
/// and popgate passes every client's heartbeat on over its one connection to the broker. When that connection
/// closes, a running consumer's next pull finds its group missing; popgate registers the group again there with
/// the member's last heartbeat and relays the pull once more, instead of leaving the pulls refused until the
/// client's next heartbeat (here 2 minutes away; 30 s by default). One client version: the pull is the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_keeps_consuming_at_once_after_popgates_connection_to_its_broker_closed() {
    // A cluster of its own: the test cuts every connection to its broker.
    let cluster = Cluster::start(&crate::harness::rocketmq::ClusterSpec::brokers(&["broker-a"]));
    let (popgate, namesrv) = popgate_with_remoting(&cluster, "").await;
    let topic = unique_topic("rm_cut");
    let group = unique_topic("rm_cut_g");
    create_topic(&cluster, &topic).await;
    let client = RemotingClient::V5;
    let mut consume = args(&namesrv, json!({"topic": topic, "group": group, "expect": 2, "timeoutMs": 120_000}));
    consume["heartbeatBrokerIntervalMs"] = json!(120_000);
    let consumer = client.start_logging("push-consume", &consume);
    let produce = |prefix: &str| json!({"topic": topic, "group": "rm_cut_p", "count": 1, "bodyPrefix": prefix});
    let before = client.run("produce", &send_args(&namesrv, produce("before")), DRIVER_TIMEOUT).await;
    assert_eq!(before["errors"], json!([]), "{before}");
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    eventually(Duration::from_secs(60), "the first message was consumed and its offset committed", || async {
        direct.consumer_offsets(&group, &topic).await.is_some_and(|offsets| offsets.values().sum::<i64>() >= 1)
    })
    .await;

    let port = cluster.brokers[0].port;
    let cut = std::process::Command::new("ss")
        .args(["-K", "dst", "127.0.0.1", "dport", "=", &format!(":{port}")])
        .output()
        .expect("ss (iproute2) runs");
    let killed = String::from_utf8_lossy(&cut.stdout).lines().filter(|l| l.contains(&format!(":{port}"))).count();
    assert!(cut.status.success() && killed >= 1, "connections to the broker were cut: {cut:?}");

    let after = client.run("produce", &send_args(&namesrv, produce("after")), DRIVER_TIMEOUT).await;
    assert_eq!(after["errors"], json!([]), "{after}");
    let (result, client_log) = consumer.finish_with_log(DRIVER_TIMEOUT).await;
    // What the client did (its rebalances, heartbeats, refused pulls), shown when a timing below is not met.
    let log_lines: Vec<&str> = client_log.lines().collect();
    let log_tail = log_lines[log_lines.len().saturating_sub(200)..].join("\n");
    let shown = format!("{result}\nthe client's log (info, its last 200 lines):\n{log_tail}");
    assert_eq!(result["timedOut"], false, "the message sent after the cut was consumed: {shown}");
    // From the send, or from the consumer's start when it came later (a JVM starts slowly on a loaded machine).
    let started_at = result["startedMs"].as_i64().expect("startedMs");
    let latency = |sent: &Value, body: &str| {
        let sent_at = sent["sent"][0]["sentAtMs"].as_i64().expect("sentAtMs").max(started_at);
        let received = result["received"].as_array().expect("received");
        received.iter().find(|r| r["body"] == body).and_then(|r| r["atMs"].as_i64()).expect("received") - sent_at
    };
    let (first, second) = (latency(&before, "before-0"), latency(&after, "after-0"));
    println!("consumed {first} ms after its send, and {second} ms after its send once the connection was cut");
    // A new consumer's rebalance sends a heartbeat with a new subscription version, which the client skips while
    // its first heartbeat is unanswered; popgate told it to rebalance before answering that one, so its pulls
    // were refused SUBSCRIPTION_NOT_LATEST until the 20 s rebalance (seen: 22 s here, 30 s in an app).
    assert!(first < 10_000, "a new consumer's first message came {first} ms after its send: {shown}");
    // A pull held at the broker when the connection was cut fails after its suspend time and popgate's margin
    // (15 s + 10 s), the client pulls again 3 s later, and that pull is served: within 30 s, where before the
    // pulls were refused until the client's next heartbeat (2 minutes here). The client's own rebalance may
    // send a heartbeat sooner; whichever registers the group first, the message must not wait for the periodic one.
    assert!(second < 30_000, "consumed {second} ms after its send: {shown}");
    let registered_again = popgate.metric(r#"popgate_remoting_reregistrations_total{result="ok"}"#).await;
    println!("popgate registered the group again {registered_again} times");
}

/// Pulls sent together in [`a_burst_of_pulls_refused_after_the_broker_forgot_their_group_registers_it_again_once`].
const BURST: usize = 24;

/// Issue #34: when popgate's connection to a broker closes, the next pull of every queue of every member of the
/// groups registered over it is refused at once. Each refused pull used to pass the group's heartbeats on again;
/// now a burst registers the group once per broker, and the pulls refused meanwhile take its outcome.
/// [`BURST`] pulls of one group (its four queues in turn), each on its own connection, sent together once the
/// broker forgot the group: every one is served, with one re-registration (two at most, on a machine so loaded
/// that a refused pull came back to popgate more than a second after the first landed). Before, each pull the
/// broker refused before the first re-registration landed made one of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_pulls_refused_after_the_broker_forgot_their_group_registers_it_again_once() {
    // A cluster of its own: the test cuts every connection to its broker.
    let cluster = Cluster::start(&crate::harness::rocketmq::ClusterSpec::brokers(&["broker-a"]));
    let (popgate, namesrv) = popgate_with_remoting(&cluster, "").await;
    let topic = unique_topic("rm_burst");
    let group = unique_topic("rm_burst_g");
    create_topic(&cluster, &topic).await;
    let _member = registered_member(&namesrv, consumer_heartbeat("burst@1", &group, &topic)).await;
    let pull_request = |group: &str, queue_id: usize| raw_pull(group, &topic, &queue_id.to_string(), None);
    let pull = |group: &str, queue_id: usize| {
        let request = pull_request(group, queue_id);
        let namesrv = namesrv.clone();
        async move {
            let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
            ask(&mut stream, request).await.expect("answered")
        }
    };
    let served = pull(&group, 0).await;
    assert_eq!(served.code(), 19, "PULL_NOT_FOUND before the cut: {:?}", served.remark());

    let port = cluster.brokers[0].port;
    let cut = std::process::Command::new("ss")
        .args(["-K", "dst", "127.0.0.1", "dport", "=", &format!(":{port}")])
        .output()
        .expect("ss (iproute2) runs");
    assert!(cut.status.success(), "connections to the broker were cut: {cut:?}");
    // A pull of a group popgate has no registration of opens the new connection (and registers nothing); the
    // broker has forgotten the cut connection's groups by the time it answers that.
    let unknown = pull(&unique_topic("rm_burst_none"), 0).await;
    assert_eq!(unknown.code(), 24, "SUBSCRIPTION_NOT_EXIST for a group nobody registered: {:?}", unknown.remark());
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Connected first, so the pulls leave together.
    let mut members = Vec::new();
    for _ in 0..BURST {
        members.push(TcpStream::connect(&namesrv).await.expect("connect"));
    }
    for (n, stream) in members.iter_mut().enumerate() {
        send(stream, pull_request(&group, n % 4)).await;
    }
    let answers = members.iter_mut().map(|stream| async move { read_answer(stream).await.expect("answered") });
    let codes: Vec<i32> = futures::future::join_all(answers).await.iter().map(RemotingCommand::code).collect();
    let registered_again = |result: &'static str| {
        let popgate = &popgate;
        async move { popgate.metric(&format!("popgate_remoting_reregistrations_total{{result=\"{result}\"}}")).await }
    };
    let (ok, coalesced) = (registered_again("ok").await, registered_again("coalesced").await);
    println!("{BURST} pulls after the cut: codes {codes:?}; re-registrations: {ok} made, {coalesced} coalesced");
    assert!(codes.iter().all(|code| *code == 19), "every pull served (PULL_NOT_FOUND): {codes:?}");
    assert!((1.0..=2.0).contains(&ok), "the group was registered again once for the burst, not {ok} times");
    assert_eq!(registered_again("failed").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_pull_popgate_gives_up_on_does_not_fail_the_other_clients_pulls() {
    // Every client's relayed requests share popgate's one connection to a broker. A pull that outlasts popgate's
    // deadline (here one asking the broker to hold it 60 s, beyond the 30 s popgate waits for) must fail alone:
    // before, the timeout closed that connection, so every other held pull on it failed at the same moment and
    // the broker forgot every group registered over it.
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_held");
    let group = unique_topic("rm_held_g");
    create_topic(cluster, &topic).await;
    let _member = registered_member(&namesrv, consumer_heartbeat("held@1", &group, &topic)).await;
    // The broker holds each pull until a message comes or it times out.
    let held_pull = |queue_id: &str, suspend_ms: &str| raw_pull(&group, &topic, queue_id, Some(suspend_ms));
    let within = Duration::from_secs(90);
    let outlasting = tokio::spawn(ask_on_a_connection_of_its_own(namesrv.clone(), held_pull("0", "60000"), within));
    // Another client's pull, held at the broker (15 s, as the Java client asks) when the first one is given up on.
    tokio::time::sleep(Duration::from_secs(25)).await;
    let (other, other_took) = ask_on_a_connection_of_its_own(namesrv.clone(), held_pull("1", "15000"), within).await;
    let other = other.expect("answered");
    let (given_up, given_up_took) = outlasting.await.expect("the outlasting pull's task");
    let given_up = given_up.expect("answered");
    println!(
        "outlasting pull: code {} after {given_up_took:?} ({:?}); the other: code {} after {other_took:?} ({:?})",
        given_up.code(),
        given_up.remark(),
        other.code(),
        other.remark()
    );
    assert_eq!(given_up.code(), 1, "popgate gives up on a pull held beyond its deadline: {:?}", given_up.remark());
    // PULL_NOT_FOUND (19) or PULL_RETRY_IMMEDIATELY (20): the broker's own answer once the hold ended.
    assert!(
        [19, 20].contains(&other.code()) && other_took >= Duration::from_secs(14),
        "the other client's pull was held and answered by the broker, code {} after {other_took:?}: {:?}",
        other.code(),
        other.remark()
    );
    let failed = popgate.metric(r#"popgate_remoting_relays_total{code="pull_message",result="unreachable"}"#).await;
    assert_eq!(failed, 1.0, "only the pull that outlasted popgate's deadline failed");
    let registered_again = popgate.metric(r#"popgate_remoting_reregistrations_total{result="ok"}"#).await;
    assert_eq!(registered_again, 0.0, "the broker kept the group's registration: the connection stayed open");
}

/// A 4.x app's push consumers keep a pull held at the broker for every queue they consume, and popgate relays
/// each on a client instance of its own use, of which one carries at most 512 requests at once. More held
/// pulls than that are spread over more instances: every one is held and answered by the broker (before, the
/// pulls past 512 were refused at once as "queue saturated").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_held_pulls_than_one_client_instance_carries_are_each_held_and_answered_by_the_broker() {
    const HELD: usize = 600;
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_many_held");
    let group = unique_topic("rm_many_held_g");
    create_topic(cluster, &topic).await;
    let _member = registered_member(&namesrv, consumer_heartbeat("many@1", &group, &topic)).await;
    // Each client's pull on a connection of its own, held 5 s at the broker on an empty queue.
    let pulls = (0..HELD).map(|n| {
        let request = raw_pull(&group, &topic, &(n % 4).to_string(), Some("5000"));
        ask_on_a_connection_of_its_own(namesrv.clone(), request, Duration::from_secs(60))
    });
    let answers: Vec<_> = futures::future::join_all(pulls)
        .await
        .into_iter()
        .map(|(answer, took)| (answer.map(|a| (a.code(), a.remark().map(ToString::to_string))), took))
        .collect();
    let mut codes: BTreeMap<i32, usize> = BTreeMap::new();
    let mut refusals = BTreeSet::new();
    let mut held = 0;
    for (answer, took) in &answers {
        let (code, remark) = answer.clone().expect("every pull answered");
        *codes.entry(code).or_default() += 1;
        if [19, 20].contains(&code) {
            held += usize::from(*took >= Duration::from_secs(4));
        } else {
            refusals.insert(format!("{code}: {remark:?}"));
        }
    }
    println!("{HELD} held pulls at once: codes {codes:?}; {held} held 4 s or more");
    // PULL_NOT_FOUND (19) or PULL_RETRY_IMMEDIATELY (20): the broker's own answer once the hold ended.
    assert!(refusals.is_empty(), "every pull answered by the broker, none refused: {refusals:?}");
    let failed = popgate.metric(r#"popgate_remoting_relays_total{code="pull_message",result="unreachable"}"#).await;
    assert_eq!(failed, 0.0, "no relay failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_message_to_a_topic_without_a_transaction_type_is_taken_as_the_broker_takes_it() {
    // The remoting front's yardstick is the cluster: a broker stores a half message on any topic (a 4.x app's
    // topics have no type), so popgate takes it there and records it, and its end lands. (Apache's proxy refuses
    // it, as popgate's gRPC front does: `grpc::a_transaction_to_a_topic_not_typed_for_it…`.)
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let normal = unique_topic("rm_half_normal");
    let transactional = unique_topic("rm_half_tx");
    create_topic(cluster, &normal).await;
    crate::transaction::create_transaction_topic(cluster, &transactional).await;
    let broker = cluster.brokers[0].name.clone();
    let half = |topic: &str| {
        // sysFlag 4: TRANSACTION_PREPARED_TYPE.
        crate::remoting_hostile::raw_send(topic, &broker, "half", 4, &[("TRAN_MSG", "true"), ("PGROUP", "rm_half_pg")])
    };
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    for topic in [&normal, &transactional] {
        let (half, id) = half(topic);
        let taken = ask(&mut stream, half).await.expect("answered");
        assert_eq!(taken.code(), 0, "a half message to {topic} is stored: {:?}", taken.remark());
        let commit = raw_request(
            37,
            &[
                ("producerGroup", "rm_half_pg"),
                ("tranStateTableOffset", &crate::remoting_hostile::field(&taken, "queueOffset")),
                ("commitLogOffset", &crate::remoting_hostile::commit_log_offset(&taken).to_string()),
                ("commitOrRollback", "8"),
                ("fromTransactionCheck", "false"),
                ("msgId", &id),
                ("topic", topic.as_str()),
                ("bname", &broker),
            ],
        );
        let ended = ask(&mut stream, commit).await.expect("answered");
        assert_eq!(ended.code(), 0, "its commit is taken: {:?}", ended.remark());
    }
    for topic in [&normal, &transactional] {
        eventually(Duration::from_secs(20), "the committed message is stored", || async {
            stored_bodies(cluster, topic).await == ["half"]
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_message_sent_again_in_a_new_transaction_is_a_new_transaction_and_each_commit_lands() {
    // A `TransactionMQProducer` that sends the same `Message` object again keeps its id (`UNIQ_KEY`): the second
    // half message is a transaction of its own, and its commit must land, as straight at the cluster.
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_tx_again");
    crate::transaction::create_transaction_topic(cluster, &topic).await;
    let broker = cluster.brokers[0].name.clone();
    let uniq_key = format!("7F0000010000{:020X}", rand::random::<u64>());
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    for body in ["first", "again"] {
        let half = crate::remoting_hostile::raw_send_keyed(
            &topic,
            &broker,
            body,
            4, // TRANSACTION_PREPARED_TYPE
            &[("TRAN_MSG", "true"), ("PGROUP", "rm_tx_again_pg")],
            &uniq_key,
        );
        let sent = ask(&mut stream, half).await.expect("answered");
        assert_eq!(sent.code(), 0, "{body}: {:?}", sent.remark());
        let answered =
            |name: &str| sent.ext_fields().and_then(|f| f.get(name)).map(|v| v.to_string()).unwrap_or_default();
        let offset_id = answered("msgId");
        let commit_log_offset = i64::from_str_radix(&offset_id[offset_id.len().saturating_sub(16)..], 16).expect("hex");
        // What the Java client's `endTransaction` sends.
        let end = raw_request(
            37,
            &[
                ("producerGroup", "rm_tx_again_pg"),
                ("tranStateTableOffset", &answered("queueOffset")),
                ("commitLogOffset", &commit_log_offset.to_string()),
                ("commitOrRollback", "8"),
                ("fromTransactionCheck", "false"),
                ("msgId", &uniq_key),
                ("transactionId", &answered("transactionId")),
                ("topic", &topic),
                ("bname", &broker),
            ],
        );
        let ended = ask(&mut stream, end).await.expect("answered");
        assert_eq!(ended.code(), 0, "{body}'s commit: {:?}", ended.remark());
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut bodies = stored_bodies(cluster, &topic).await;
    while bodies.len() < 2 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
        bodies = stored_bodies(cluster, &topic).await;
    }
    assert_eq!(bodies, ["again", "first"], "both transactions were committed");
}

/// Issue #48: the broker's first check-back of a transaction whose app had not yet registered its producer group
/// by a heartbeat found nobody at popgate (`no_producer`), and the app's checker was asked only at a later one.
/// popgate asks the connection the half message came on, as the broker asks the channel it knows: here a raw
/// client that never heartbeats is asked on its own connection, and its answer commits the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_back_of_a_producer_that_never_heartbeat_is_asked_on_the_half_messages_connection() {
    let mut spec = crate::harness::rocketmq::ClusterSpec::brokers(&["broker-a"]);
    spec.broker_conf = vec!["transactionTimeOut=3000".into(), "transactionCheckInterval=3000".into()];
    let cluster = Cluster::start(&spec);
    let (popgate, namesrv) = popgate_with_remoting(&cluster, "").await;
    let topic = unique_topic("rm_tx_nohb");
    create_topic(&cluster, &topic).await;
    let broker = cluster.brokers[0].name.clone();
    let (half, id) = crate::remoting_hostile::raw_send(
        &topic,
        &broker,
        "asked",
        4, // TRANSACTION_PREPARED_TYPE
        &[("TRAN_MSG", "true"), ("PGROUP", "rm_tx_nohb_pg")],
    );
    // Born now: the broker skips checking a half message born longer ago than it keeps its files (72 h).
    let mut half = half;
    half.add_ext_field("g", chrono::Utc::now().timestamp_millis().to_string());
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");
    let sent = ask(&mut stream, half).await.expect("answered");
    assert_eq!(sent.code(), 0, "{:?}", sent.remark());

    // No heartbeat, no end: the broker checks the transaction back (after 3 s, every 3 s), and popgate asks here.
    let check = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let frame = read_frame(&mut stream).await.expect("the connection stays open");
            if frame.code() == 39 {
                return frame;
            }
        }
    })
    .await;
    let Ok(check) = check else {
        let asked = popgate.metric("popgate_transaction_checks_total{outcome=\"forwarded\"}").await;
        let nobody = popgate.metric("popgate_transaction_checks_total{outcome=\"no_producer\"}").await;
        panic!("no CHECK_TRANSACTION_STATE on the half message's connection within 60 s: {asked} check-backs forwarded, {nobody} to nobody");
    };
    let header = |name: &str| crate::remoting_hostile::field(&check, name);
    assert_eq!(header("msgId"), id, "about its own half message");
    let commit = raw_request(
        37,
        &[
            ("producerGroup", "rm_tx_nohb_pg"),
            ("tranStateTableOffset", &header("tranStateTableOffset")),
            ("commitLogOffset", &header("commitLogOffset")),
            ("commitOrRollback", "8"),
            ("fromTransactionCheck", "true"),
            ("msgId", &id),
            ("transactionId", &id),
            ("topic", &topic),
            ("bname", &broker),
        ],
    )
    .mark_oneway_rpc();
    send(&mut stream, commit).await;
    eventually(Duration::from_secs(30), "the checked-back message is committed", || async {
        stored_bodies(&cluster, &topic).await == ["asked"]
    })
    .await;
    assert!(popgate.metric("popgate_transaction_checks_total{outcome=\"forwarded\"}").await >= 1.0);
}

/// Issue #47: the size limit and the one-way rule are publishing's, in the gateway, for every front (HTTP
/// refused one-way sends under the financial profile, and only HTTP and gRPC checked `max_message_bytes`).
/// Through the remoting front: a body over the limit is refused in Apache's client's words, a one-way send under
/// the financial profile is not sent (it has no answer: the metric and the log say it), a sync send is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_size_limit_and_the_one_way_rule_hold_on_the_remoting_front_as_on_http() {
    let cluster = shared_cluster();
    let profile = "[reliability]\nprofile = \"financial\"\n[publish]\nmax_message_bytes = 2048\n";
    let (popgate, namesrv) = popgate_with_remoting(cluster, profile).await;
    let topic = unique_topic("rm_rules");
    create_topic(cluster, &topic).await;
    let broker = cluster.brokers[0].name.clone();
    let mut stream = TcpStream::connect(&namesrv).await.expect("connect");

    let (too_large, _) = crate::remoting_hostile::raw_send(&topic, &broker, &"x".repeat(2049), 0, &[]);
    let refused = ask(&mut stream, too_large).await.expect("answered");
    let remark = refused.remark().map(ToString::to_string).unwrap_or_default();
    assert_eq!((refused.code(), remark.as_str()), (13, "the message body size over max value, MAX: 2048"));

    let (one_way, _) = crate::remoting_hostile::raw_send(&topic, &broker, "one-way", 0, &[]);
    send(&mut stream, one_way.mark_oneway_rpc()).await;
    let (confirmed, _) = crate::remoting_hostile::raw_send(&topic, &broker, "confirmed", 0, &[]);
    let stored_it = ask(&mut stream, confirmed).await.expect("answered");
    assert_eq!(stored_it.code(), 0, "{:?}", stored_it.remark());
    let refusals = |result: &str| {
        let series = format!("popgate_publish_requests_total{{result=\"{result}\",transport=\"remoting\"}}");
        let popgate = &popgate;
        async move { popgate.metric(&series).await }
    };
    eventually(Duration::from_secs(20), "the one-way send was refused and counted", || async {
        refusals("bad_request").await == 1.0
    })
    .await;
    assert_eq!(refusals("too_large").await, 1.0);
    assert!(popgate.output().contains("A one-way send was refused"), "logged");
    eventually(Duration::from_secs(20), "only the confirmed send is stored", || async {
        stored_bodies(cluster, &topic).await == ["confirmed"]
    })
    .await;
}

/// Apps on Apache's remoting client behind a TCP balancer (HAProxy, round robin, no stickiness) in front of two
/// popgate instances, each advertising the balancer as every broker: a push consumer (client rebalance, pulls
/// relayed) and producers each reach whichever instance the balancer picks, and the balancer closes each
/// instance's connections in turn between batches of messages (a drained node): the clients connect again, to
/// the other instance. Every message sent is consumed, under a 4.9.x and a 5.x client. (A client before 4.9.5
/// is given a port per broker on the instance it asked, which a balancer in front does not balance.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_and_a_push_consumer_behind_a_tcp_balancer_lose_nothing_while_it_moves_their_connections() {
    const BATCHES: usize = 3;
    const PER_BATCH: usize = 8;
    let cluster = shared_cluster();
    let balancer_port = free_port();
    let mut instances = Vec::new();
    let mut backends = Vec::new();
    for _ in 0..2 {
        let listen = format!("127.0.0.1:{}", free_port());
        let remoting = format!("[remoting]\nlisten = \"{listen}\"\nadvertised_addr = \"127.0.0.1:{balancer_port}\"\n");
        let popgate = Popgate::start(&cluster.namesrv_addr, &remoting).await;
        backends.push(Backend::of(&popgate, &listen));
        instances.push(popgate);
    }
    let balancer = Balancer::tcp_on(balancer_port, &backends).await;
    let namesrv = balancer.address.clone();
    for client in [RemotingClient::V4, RemotingClient::V5] {
        let topic = unique_topic("rm_lb");
        create_topic(cluster, &topic).await;
        let expected: Vec<String> =
            (0..BATCHES * PER_BATCH).map(|i| format!("b{}-{}", i / PER_BATCH, i % PER_BATCH)).collect();
        // A cut during the consumer's start fails start() itself (a route query the cut broke throws), as it
        // does straight at a name server: the cuts come once the consumer runs, which is what this test is about.
        let dir = tempfile::tempdir().expect("tempdir");
        let started = dir.path().join("started");
        let consume = json!({"topic": topic, "group": unique_topic("rm_lb_g"), "expect": expected.len(),
            "consumeFromWhere": "first", "timeoutMs": 90_000, "startedFile": started});
        let consumer =
            client.start("push-consume", &args(&namesrv, consume)).once_file_exists(&started, DRIVER_TIMEOUT).await;
        for batch in 0..BATCHES {
            let produce = json!({"topic": topic, "group": "rm_lb_p", "count": PER_BATCH,
                "bodyPrefix": format!("b{batch}")});
            let sent = client.run("produce", &send_args(&namesrv, produce), DRIVER_TIMEOUT).await;
            assert_eq!(sent["errors"], json!([]), "{} batch {batch}: {sent}", client.0);
            let cut = balancer.cut_connections_to(batch % instances.len()).await;
            assert!(cut.is_empty(), "haproxy cut the connections: {cut}");
        }
        let result = consumer.finish(DRIVER_TIMEOUT).await;
        let mut got = bodies(&result, "received");
        got.sort();
        got.dedup();
        let mut expected = expected;
        expected.sort();
        assert_eq!(got, expected, "{}: every message consumed through the balancer: {result}", client.0);
    }
}
