//! The remoting front, driven by the Rust RocketMQ client (`rocketmq-client-rust`, the one popgate uses for
//! its brokers) as an application would use it: `DefaultMQProducer`, `DefaultMQPushConsumer` and
//! `TransactionMQProducer` with popgate's remoting address as their name server. Each test checks what the
//! client saw and what the brokers hold, read straight from them ([`Direct`]); where it is cheap, the same
//! scenario runs straight at the cluster's name server too, and both outcomes are compared.
//!
//! Each application is a [`RustApp`]: a client runtime of its own with an instance name of its own, so two
//! applications of one test are two clients (client ids) to popgate and the broker, as two processes would be.
//!
//! Not driven: the consumer's retry delay. The client hands its listener a `&ConsumeConcurrentlyContext`
//! (`consume_message` in the crate's src/consumer/listener/message_listener_concurrently.rs), so an app cannot
//! set `delay_level_when_next_consume`; a message returned with `ReconsumeLater` comes back on the broker's
//! default level for its first retry (3: 10 s).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cheetah_string::CheetahString;
use rocketmq_client_rust::{
    ClientConfig, ClientRuntime, ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus, ConsumeOrderlyContext,
    ConsumeOrderlyStatus, DefaultMQProducer, DefaultMQPushConsumer, LocalTransactionState, MQPushConsumer, SendResult,
    SendStatus, TransactionListener, TransactionMQProducer,
};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::common::message::MessageTrait;

use rocketmq_protocol::protocol::heartbeat::message_model::MessageModel;
use rocketmq_runtime::RuntimeOwner;

use crate::harness::direct::{Direct, StoredMessage};
use crate::harness::popgate::Popgate;
use crate::harness::rocketmq::{Cluster, ClusterSpec};
use crate::harness::{free_port, unique_topic};
use crate::publish::shared_cluster;
use crate::remoting::{create_topic, popgate_with_remoting};
use crate::transaction::create_transaction_topic;

/// How long a test waits for what a client should see or a broker should hold.
const WAIT: Duration = Duration::from_secs(45);

/// One application's RocketMQ client: a client runtime and an instance name of its own, with the client's
/// refresh intervals as short as it allows (a route and a heartbeat every 10 s; the defaults are 30 s, and
/// `ClientConfigValidator` refuses less than 10 s).
struct RustApp {
    runtime: Arc<ClientRuntime>,
    namesrv: String,
    instance: String,
    /// Owns the runtime's tasks; dropped last.
    _owner: RuntimeOwner,
}

impl RustApp {
    fn new(namesrv: &str) -> RustApp {
        let (owner, runtime) = popgate::broker::client::start_client_runtime().expect("client runtime");
        RustApp { runtime, namesrv: namesrv.to_owned(), instance: unique_topic("rust_app"), _owner: owner }
    }

    fn config(&self) -> ClientConfig {
        let mut config = ClientConfig::default();
        config.set_instance_name(CheetahString::from(self.instance.as_str()));
        config.set_poll_name_server_interval(10_000);
        config.set_heartbeat_broker_interval(10_000);
        config
    }

    /// A started producer of `group`. A first send asks for a route and opens connections, which takes seconds
    /// on a loaded machine: a send may take 10 s (the client's default is 3 s).
    async fn producer(&self, group: &str) -> DefaultMQProducer {
        let mut producer = DefaultMQProducer::builder(self.runtime.clone())
            .client_config(self.config())
            .name_server_addr(self.namesrv.as_str())
            .producer_group(group)
            .send_msg_timeout(10_000)
            .build();
        producer.start().await.expect("producer starts");
        producer
    }

    /// A push consumer of `group` on every message of `topic`, from the first offset, not started yet.
    async fn push_consumer(&self, group: &str, topic: &str, model: MessageModel) -> DefaultMQPushConsumer {
        let mut consumer = DefaultMQPushConsumer::builder(self.runtime.clone())
            .client_config(self.config())
            .name_server_addr(self.namesrv.as_str())
            .consumer_group(group)
            .message_model(model)
            .consume_from_where(ConsumeFromWhere::ConsumeFromFirstOffset)
            .max_reconsume_times(1)
            .build();
        consumer.subscribe(topic, "*").await.expect("subscribe");
        consumer
    }
}

/// A message as a listener saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    body: String,
    reconsume_times: i32,
    queue: (String, i32),
}

impl Seen {
    fn of(message: &MessageExt) -> Seen {
        Seen {
            body: body_of(message.body().as_deref()),
            reconsume_times: message.reconsume_times(),
            queue: (message.broker_name().to_owned(), message.queue_id()),
        }
    }
}

fn body_of(body: Option<&[u8]>) -> String {
    String::from_utf8_lossy(body.unwrap_or_default()).into_owned()
}

/// What listeners saw, shared with the test.
type Log = Arc<Mutex<Vec<Seen>>>;

fn seen(log: &Log) -> Vec<Seen> {
    log.lock().expect("log").clone()
}

/// Waits until `log` holds at least `count` messages, then `settle` more for any that should not come.
async fn wait_seen(log: &Log, count: usize, settle: Duration) -> Vec<Seen> {
    let deadline = Instant::now() + WAIT;
    while seen(log).len() < count && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(settle).await;
    seen(log)
}

fn sorted_bodies(seen: &[Seen]) -> Vec<String> {
    let mut bodies: Vec<String> = seen.iter().map(|s| s.body.clone()).collect();
    bodies.sort();
    bodies
}

fn message(topic: &str, body: &str) -> Message {
    Message::builder().topic(topic).body_slice(body.as_bytes()).build_unchecked()
}

/// What the brokers hold in `topic`, by body, once they hold at least `count` messages (at most [`WAIT`]);
/// panics when they hold fewer by then.
async fn stored(cluster: &Cluster, topic: &str, count: usize) -> BTreeMap<String, Vec<StoredMessage>> {
    let held = stored_within(cluster, topic, count, WAIT).await;
    let total: usize = held.values().map(Vec::len).sum();
    assert!(total >= count, "{count} messages stored in {topic}: {:?}", held.keys());
    held
}

/// What the brokers hold in `topic`, by body, once they hold at least `count` messages, or after `timeout`.
async fn stored_within(
    cluster: &Cluster,
    topic: &str,
    count: usize,
    timeout: Duration,
) -> BTreeMap<String, Vec<StoredMessage>> {
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let deadline = Instant::now() + timeout;
    loop {
        let mut by_body: BTreeMap<String, Vec<StoredMessage>> = BTreeMap::new();
        for m in direct.try_read_all(topic).await.unwrap_or_default() {
            by_body.entry(String::from_utf8_lossy(&m.body).into_owned()).or_default().push(m);
        }
        let held: usize = by_body.values().map(Vec::len).sum();
        if held >= count || Instant::now() > deadline {
            return by_body;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

// === producer ===

/// What the producer scenario's client saw: each acknowledged send, by the body it sent first.
#[derive(Debug)]
struct Sent {
    results: BTreeMap<String, SendResult>,
}

/// Sends, with `app`'s producer, every kind of message to `topic`: 3 sync sends with a tag, keys and a user
/// property; 2 async sends (callback); 2 one-way sends; a batch of 3; 2 sync sends through a queue selector
/// that picks queue 2 of broker-b; one with delay level 1 (1 s). 13 messages.
async fn produce_every_kind(app: &RustApp, topic: &str) -> Sent {
    let mut producer = app.producer("rust_send_p").await;
    let mut results = BTreeMap::new();
    for i in 0..3 {
        let body = format!("sync-{i}");
        let msg = Message::builder()
            .topic(topic)
            .body_slice(body.as_bytes())
            .tags("TagA")
            .keys(vec!["k1".to_owned(), "k2".to_owned()])
            .raw_property("color", "red")
            .expect("a user property")
            .build_unchecked();
        let result = producer.send(msg).await.unwrap_or_else(|e| panic!("{body}: {e}"));
        results.insert(body, result.expect("a sync send has a result"));
    }

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..2 {
        let tx = tx.clone();
        let body = format!("async-{i}");
        let callback = move |result: Option<&SendResult>, error: Option<&rocketmq_client_rust::ClientError>| {
            let _ = tx.send((body.clone(), result.cloned(), error.map(ToString::to_string)));
        };
        producer.send_with_callback(message(topic, &format!("async-{i}")), callback).await.expect("async send");
    }
    for _ in 0..2 {
        let (body, result, error) = tokio::time::timeout(WAIT, rx.recv()).await.expect("callback").expect("open");
        assert_eq!(error, None, "{body}");
        results.insert(body, result.expect("a callback result"));
    }

    for i in 0..2 {
        producer.send_oneway(message(topic, &format!("oneway-{i}"))).await.expect("one-way send");
    }

    let batch: Vec<Message> = (0..3).map(|i| message(topic, &format!("batch-{i}"))).collect();
    results.insert("batch-0".to_owned(), producer.send_batch(batch).await.expect("batch send"));

    let on_b2 = |queues: &[MessageQueue], _: &Message, wanted: &(String, i32)| {
        queues.iter().find(|q| q.broker_name().as_str() == wanted.0 && q.queue_id() == wanted.1).cloned()
    };
    for i in 0..2 {
        let body = format!("selected-{i}");
        let result = producer
            .send_with_selector(message(topic, &body), on_b2, ("broker-b".to_owned(), 2))
            .await
            .unwrap_or_else(|e| panic!("{body}: {e}"));
        results.insert(body, result.expect("a selected send has a result"));
    }

    let delayed = Message::builder().topic(topic).body_slice(b"delayed-0").delay_level(1).build_unchecked();
    results.insert("delayed-0".to_owned(), producer.send(delayed).await.expect("delayed send").expect("result"));
    producer.shutdown().await;
    Sent { results }
}

/// What a test compares of a stored message: its body, tag, keys, user property, delay level, and the queue
/// of the selector's messages.
fn summary(stored: &BTreeMap<String, Vec<StoredMessage>>) -> Vec<String> {
    stored
        .iter()
        .flat_map(|(body, copies)| copies.iter().map(move |m| (body, m)))
        .map(|(body, m)| {
            let queue = if body.starts_with("selected") { format!("{}/{}", m.broker, m.queue_id) } else { "-".into() };
            format!(
                "{body} tags={:?} keys={:?} color={:?} delay={:?} queue={queue}",
                m.property("TAGS"),
                m.property("KEYS"),
                m.property("color"),
                m.property("DELAY"),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_send_lands_as_it_does_straight_at_the_cluster() {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let (direct_topic, popgate_topic) = (unique_topic("rust_send_d"), unique_topic("rust_send_p"));
    create_topic(cluster, &direct_topic).await;
    create_topic(cluster, &popgate_topic).await;

    let direct_app = RustApp::new(&cluster.namesrv_addr);
    let popgate_app = RustApp::new(&namesrv);
    let straight = produce_every_kind(&direct_app, &direct_topic).await;
    let through = produce_every_kind(&popgate_app, &popgate_topic).await;

    // What the client saw: every acknowledged send SEND_OK, with the broker's offset id and a real broker's
    // queue (popgate names the cluster's brokers), the selector's queue as chosen.
    for sent in [&straight, &through] {
        let acknowledged: Vec<&String> = sent.results.keys().collect();
        assert_eq!(
            acknowledged,
            ["async-0", "async-1", "batch-0", "delayed-0", "selected-0", "selected-1", "sync-0", "sync-1", "sync-2"],
        );
        for (body, result) in &sent.results {
            assert_eq!(result.send_status, SendStatus::SendOk, "{body}: {result:?}");
            // A batch's ids are its messages' ids, comma-separated.
            let ids = if body.starts_with("batch") { 3 } else { 1 };
            let offset_ids: Vec<&str> = result.offset_msg_id.as_deref().unwrap_or_default().split(',').collect();
            assert_eq!(offset_ids.len(), ids, "{body}: {result:?}");
            assert!(offset_ids.iter().all(|id| id.len() == 32), "the broker's offset ids, {body}: {result:?}");
            let msg_ids = result.msg_id.as_deref().unwrap_or_default().split(',').count();
            assert_eq!(msg_ids, ids, "{body}: {result:?}");
            let queue = result.message_queue.as_ref().expect("a queue");
            assert!(["broker-a", "broker-b"].contains(&queue.broker_name().as_str()), "{body}: {result:?}");
        }
        for body in ["selected-0", "selected-1"] {
            let queue = sent.results[body].message_queue.as_ref().expect("a queue");
            assert_eq!((queue.broker_name().as_str(), queue.queue_id()), ("broker-b", 2), "{body}");
        }
    }

    // What the brokers hold: the same 13 messages each way, once each, with the same properties; the client's
    // message id (UNIQ_KEY) is the one stored.
    let held_straight = stored(cluster, &direct_topic, 13).await;
    let held_through = stored(cluster, &popgate_topic, 13).await;
    let expected: Vec<String> = [
        "async-0",
        "async-1",
        "batch-0",
        "batch-1",
        "batch-2",
        "delayed-0",
        "oneway-0",
        "oneway-1",
        "selected-0",
        "selected-1",
        "sync-0",
        "sync-1",
        "sync-2",
    ]
    .iter()
    .map(|b| (*b).to_owned())
    .collect();
    assert_eq!(held_through.keys().cloned().collect::<Vec<_>>(), expected, "through popgate");
    assert_eq!(summary(&held_through), summary(&held_straight), "through popgate as straight at the cluster");
    for (held, sent) in [(&held_straight, &straight), (&held_through, &through)] {
        assert!(held.values().all(|copies| copies.len() == 1), "each stored once: {:?}", summary(held));
        let first = &held["sync-0"][0];
        assert_eq!(
            (first.property("TAGS"), first.property("KEYS"), first.property("color")),
            (Some("TagA"), Some("k1 k2"), Some("red"))
        );
        assert_eq!(held["delayed-0"][0].property("DELAY"), Some("1"), "the delay level reached the broker");
        for body in ["selected-0", "selected-1"] {
            assert_eq!((held[body][0].broker.as_str(), held[body][0].queue_id), ("broker-b", 2), "{body}");
        }
        for body in ["sync-0", "sync-1", "sync-2", "async-0", "selected-0", "delayed-0"] {
            let id = sent.results[body].msg_id.as_ref().map(|id| id.to_string());
            assert_eq!(held[body][0].property("UNIQ_KEY").map(str::to_owned), id, "{body}");
        }
    }
    // 3 sync + 2 async + 2 one-way + 1 batch + 2 selected + 1 delayed sends, each through the publish path; the
    // one-way ones are not confirmed by the broker (`accepted`).
    assert!(popgate.metric("popgate_publish_requests_total{result=\"ok\",transport=\"remoting\"}").await >= 9.0);
    assert!(popgate.metric("popgate_publish_requests_total{result=\"accepted\",transport=\"remoting\"}").await >= 2.0);
}

// === push consumer ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_consumer_gets_every_message_and_one_returned_for_later_comes_back_through_the_retry_topic() {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rust_push");
    let group = unique_topic("rust_push_g");
    create_topic(cluster, &topic).await;
    let app = RustApp::new(&namesrv);
    let mut producer = app.producer("rust_push_p").await;
    for i in 0..4 {
        producer.send(message(&topic, &format!("p-{i}"))).await.expect("send").expect("result");
    }

    // "p-0" is returned for later once; "p-1" every time: with at most one reconsumption it goes to the
    // group's DLQ after its second delivery.
    let log: Log = Arc::default();
    let mut consumer = app.push_consumer(&group, &topic, MessageModel::Clustering).await;
    let (listener_log, failed) = (log.clone(), Arc::new(Mutex::new(0)));
    consumer.register_message_listener_concurrently(move |msgs: &[&MessageExt], _: &ConsumeConcurrentlyContext| {
        let mut status = ConsumeConcurrentlyStatus::ConsumeSuccess;
        for m in msgs {
            let seen = Seen::of(m);
            let fail_now = match seen.body.as_str() {
                "p-0" => {
                    let mut failed = failed.lock().expect("failed");
                    *failed += 1;
                    *failed == 1
                }
                "p-1" => true,
                _ => false,
            };
            if fail_now {
                status = ConsumeConcurrentlyStatus::ReconsumeLater;
            }
            listener_log.lock().expect("log").push(seen);
        }
        Ok(status)
    });
    consumer.start().await.expect("consumer starts");
    // 4 first deliveries, then p-0 and p-1 once more from %RETRY%<group> (after the broker's 10 s).
    let got = wait_seen(&log, 6, Duration::from_secs(2)).await;
    consumer.shutdown().await;

    assert_eq!(sorted_bodies(&got), ["p-0", "p-0", "p-1", "p-1", "p-2", "p-3"], "{got:?}");
    for body in ["p-0", "p-1"] {
        let times: Vec<i32> = got.iter().filter(|s| s.body == body).map(|s| s.reconsume_times).collect();
        assert_eq!(times, [0, 1], "{body}: delivered, then again as its first reconsumption: {got:?}");
    }
    let retry_topic = format!("%RETRY%{group}");
    let retried = stored(cluster, &retry_topic, 2).await;
    assert_eq!(retried.keys().collect::<Vec<_>>(), ["p-0", "p-1"], "the broker's retry topic holds the two");
    assert!(retried.values().all(|copies| copies.len() == 1), "each once: {:?}", retried.keys());
    let dead = stored(cluster, &format!("%DLQ%{group}"), 1).await;
    assert_eq!(dead.keys().collect::<Vec<_>>(), ["p-1"], "p-1 is dead-lettered after its reconsumption");
    assert!(popgate.metric("popgate_remoting_relays_total{code=\"pull_message\",result=\"ok\"}").await >= 1.0);
    assert!(
        popgate.metric("popgate_remoting_relays_total{code=\"consumer_send_msg_back\",result=\"ok\"}").await >= 2.0
    );
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orderly_push_consumer_gets_each_queue_in_order_and_a_suspended_message_again_before_the_next() {
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rust_order");
    let group = unique_topic("rust_order_g");
    create_topic(cluster, &topic).await;
    let app = RustApp::new(&namesrv);
    let mut producer = app.producer("rust_order_p").await;
    // Each key's messages to a queue of its own: order-a to broker-a's queue 1, order-b to broker-b's queue 3.
    let pick = |queues: &[MessageQueue], _: &Message, wanted: &(&str, i32)| {
        queues.iter().find(|q| q.broker_name().as_str() == wanted.0 && q.queue_id() == wanted.1).cloned()
    };
    for i in 0..10 {
        for (key, queue) in [("order-a", ("broker-a", 1)), ("order-b", ("broker-b", 3))] {
            let result = producer
                .send_with_selector(message(&topic, &format!("{key}-{i}")), pick, queue)
                .await
                .expect("send")
                .expect("result");
            let mq = result.message_queue.expect("a queue");
            assert_eq!((mq.broker_name().as_str(), mq.queue_id()), queue);
        }
    }

    let log: Log = Arc::default();
    let mut consumer = app.push_consumer(&group, &topic, MessageModel::Clustering).await;
    let (listener_log, suspended) = (log.clone(), Arc::new(Mutex::new(false)));
    consumer.register_message_listener_orderly(move |msgs: &[&MessageExt], _: &mut ConsumeOrderlyContext| {
        let mut log = listener_log.lock().expect("log");
        for m in msgs {
            let seen = Seen::of(m);
            let mut suspended = suspended.lock().expect("suspended");
            let suspend = seen.body == "order-a-1" && !*suspended;
            log.push(seen);
            if suspend {
                *suspended = true;
                return Ok(ConsumeOrderlyStatus::SuspendCurrentQueueAMoment);
            }
        }
        Ok(ConsumeOrderlyStatus::Success)
    });
    consumer.start().await.expect("consumer starts");
    let got = wait_seen(&log, 21, Duration::from_secs(2)).await;
    consumer.shutdown().await;

    for (key, queue) in [("order-a", ("broker-a", 1)), ("order-b", ("broker-b", 3))] {
        let of_key: Vec<&Seen> = got.iter().filter(|s| s.body.starts_with(key)).collect();
        let bodies: Vec<&str> = of_key.iter().map(|s| s.body.as_str()).collect();
        let mut expected: Vec<String> = (0..10).map(|i| format!("{key}-{i}")).collect();
        if key == "order-a" {
            expected.insert(1, "order-a-1".to_owned());
        }
        assert_eq!(bodies, expected, "{key} in order, its suspended message again before the next");
        assert!(of_key.iter().all(|s| s.queue == (queue.0.to_owned(), queue.1)), "{key} from {queue:?}: {got:?}");
    }
    assert_eq!(got.len(), 21, "nothing else: {got:?}");
    producer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcasting_consumers_each_get_every_message_once() {
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rust_bcast");
    let group = unique_topic("rust_bcast_g");
    create_topic(cluster, &topic).await;

    // Two applications (two client ids) in one broadcasting group.
    let apps = [RustApp::new(&namesrv), RustApp::new(&namesrv)];
    let mut consumers = Vec::new();
    let mut logs = Vec::new();
    for app in &apps {
        let log: Log = Arc::default();
        let mut consumer = app.push_consumer(&group, &topic, MessageModel::Broadcasting).await;
        let listener_log = log.clone();
        consumer.register_message_listener_concurrently(move |msgs: &[&MessageExt], _: &ConsumeConcurrentlyContext| {
            listener_log.lock().expect("log").extend(msgs.iter().map(|m| Seen::of(m)));
            Ok(ConsumeConcurrentlyStatus::ConsumeSuccess)
        });
        consumer.start().await.expect("consumer starts");
        consumers.push(consumer);
        logs.push(log);
    }
    let mut producer = apps[0].producer("rust_bcast_p").await;
    for i in 0..5 {
        producer.send(message(&topic, &format!("b-{i}"))).await.expect("send").expect("result");
    }
    for log in &logs {
        let got = wait_seen(log, 5, Duration::from_secs(2)).await;
        assert_eq!(sorted_bodies(&got), ["b-0", "b-1", "b-2", "b-3", "b-4"], "each consumer gets every message");
    }
    for consumer in &mut consumers {
        consumer.shutdown().await;
    }
    producer.shutdown().await;
    assert_eq!(stored(cluster, &topic, 5).await.len(), 5);
}

// === transactions ===

/// Decides a transaction by its body's prefix: `kept` commits, `dropped` rolls back, `checked` is left
/// unknown and committed when the broker checks it back. Records every check-back's body and transaction id.
#[derive(Default)]
struct ByPrefix {
    checks: Arc<Mutex<Vec<(String, String)>>>,
}

impl TransactionListener for ByPrefix {
    fn execute_local_transaction(
        &self,
        msg: &dyn MessageTrait,
        _arg: Option<&(dyn std::any::Any + Send + Sync)>,
    ) -> LocalTransactionState {
        let body = body_of(msg.get_body().map(|b| b.as_ref()));
        if body.starts_with("kept") {
            LocalTransactionState::CommitMessage
        } else if body.starts_with("dropped") {
            LocalTransactionState::RollbackMessage
        } else {
            LocalTransactionState::Unknown
        }
    }

    fn check_local_transaction(&self, msg: &MessageExt) -> LocalTransactionState {
        let body = body_of(msg.body().as_deref());
        let id = msg.transaction_id().map(ToString::to_string).unwrap_or_default();
        self.checks.lock().expect("checks").push((body.clone(), id));
        if body.starts_with("checked") {
            LocalTransactionState::CommitMessage
        } else {
            LocalTransactionState::Unknown
        }
    }
}

/// A started transactional producer of `group` on `app`, and the check-backs its listener records.
async fn transaction_producer(
    app: &RustApp,
    group: &str,
) -> (TransactionMQProducer, Arc<Mutex<Vec<(String, String)>>>) {
    let listener = ByPrefix::default();
    let checks = listener.checks.clone();
    let mut producer = TransactionMQProducer::builder(app.runtime.clone())
        .client_config(app.config())
        .name_server_addr(app.namesrv.as_str())
        .producer_group(group)
        .send_msg_timeout(10_000)
        .transaction_listener(listener)
        .build();
    producer.start().await.expect("transactional producer starts");
    (producer, checks)
}

/// Sends `kept-0` (committed) and `dropped-0` (rolled back) in transactions, returning each one's local state
/// as the client reports it.
async fn commit_and_roll_back(app: &RustApp, topic: &str) -> Vec<(String, Option<LocalTransactionState>)> {
    let (mut producer, checks) = transaction_producer(app, "rust_tx_p").await;
    let mut outcomes = Vec::new();
    for body in ["kept-0", "dropped-0"] {
        let result = producer
            .send_message_in_transaction::<(), _>(message(topic, body), None)
            .await
            .unwrap_or_else(|e| panic!("{body}: {e}"));
        let send = result.send_result.as_ref().expect("the half message's result");
        assert_eq!(send.send_status, SendStatus::SendOk, "{body}: {result}");
        outcomes.push((body.to_owned(), result.local_transaction_state));
    }
    producer.shutdown().await;
    assert_eq!(*checks.lock().expect("checks"), [], "nothing was left to check back");
    outcomes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_transaction_lands_once_and_a_rolled_back_one_never_as_straight_at_the_cluster() {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let (direct_topic, popgate_topic) = (unique_topic("rust_tx_d"), unique_topic("rust_tx_p"));
    create_transaction_topic(cluster, &direct_topic).await;
    create_transaction_topic(cluster, &popgate_topic).await;

    let straight = commit_and_roll_back(&RustApp::new(&cluster.namesrv_addr), &direct_topic).await;
    let through = commit_and_roll_back(&RustApp::new(&namesrv), &popgate_topic).await;
    let expected = [
        ("kept-0".to_owned(), Some(LocalTransactionState::CommitMessage)),
        ("dropped-0".to_owned(), Some(LocalTransactionState::RollbackMessage)),
    ];
    assert_eq!(straight, expected);
    assert_eq!(through, expected);

    // The commit lands once; after a moment more the rollback has still not.
    let held_straight = stored(cluster, &direct_topic, 1).await;
    let held_through = stored(cluster, &popgate_topic, 1).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (topic, held) in [(&direct_topic, held_straight), (&popgate_topic, held_through)] {
        assert_eq!(held.keys().collect::<Vec<_>>(), ["kept-0"], "{topic}");
        let now = stored(cluster, topic, 1).await;
        assert_eq!(now.keys().collect::<Vec<_>>(), ["kept-0"], "{topic}: the rollback never lands");
        assert_eq!(now["kept-0"].len(), 1, "{topic}: the commit once");
    }
    // Ended from popgate's record at once.
    assert_eq!(popgate.metric("popgate_transactions_ended_total{resolution=\"commit\",result=\"landed\"}").await, 1.0);
    assert_eq!(
        popgate.metric("popgate_transactions_ended_total{resolution=\"rollback\",result=\"landed\"}").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_transaction_is_checked_back_through_popgate_and_committed() {
    // A broker of its own that checks a transaction back 3 s after it was sent (the default waits 6 s, then
    // checks every 30 s).
    let mut spec = ClusterSpec::brokers(&["broker-a"]);
    spec.broker_conf = vec!["transactionTimeOut=3000".into(), "transactionCheckInterval=3000".into()];
    let cluster = Cluster::start(&spec);
    // The remoting front's requests and pushes logged (debug), for the failure message below.
    let namesrv = format!("127.0.0.1:{}", free_port());
    let log = ("RUST_LOG", "info,popgate::remoting=debug,popgate::transaction=debug,rocketmq_client_rust=warn");
    let remoting = format!("[remoting]\nlisten = \"{namesrv}\"\n");
    let popgate = Popgate::start_with_env(&cluster.namesrv_addr, &remoting, &[log]).await;
    let topic = unique_topic("rust_tx_check");
    create_transaction_topic(&cluster, &topic).await;
    let app = RustApp::new(&namesrv);
    let (mut producer, checks) = transaction_producer(&app, "rust_tx_check_p").await;
    let result = producer.send_message_in_transaction::<(), _>(message(&topic, "checked-0"), None).await.expect("sent");
    assert_eq!(result.local_transaction_state, Some(LocalTransactionState::Unknown), "{result}");
    let msg_id = result.send_result.as_ref().and_then(|r| r.msg_id.clone()).expect("the client's message id");

    let held = stored_within(&cluster, &topic, 1, Duration::from_secs(30)).await;
    let asked = checks.lock().expect("checks").clone();
    producer.shutdown().await;
    let output = popgate.output();
    let told: Vec<&str> = output.lines().filter(|l| l.contains("ransaction") || l.contains("heck")).collect();
    let told = told.join("\n");
    assert_eq!(
        held.keys().collect::<Vec<_>>(),
        ["checked-0"],
        "committed by the check-back's answer (the listener was asked {asked:?}): {told}"
    );
    assert_eq!(held["checked-0"].len(), 1, "stored once");
    assert!(!asked.is_empty(), "the producer's listener was asked");
    assert!(asked.iter().all(|(body, _)| body == "checked-0"), "about its own message: {asked:?}");
    assert_eq!(asked[0].1, msg_id.to_string(), "the check names the client's transaction");
    assert!(
        popgate.metric("popgate_transaction_check_answers_total{front=\"remoting\",answer=\"commit\"}").await >= 1.0
    );
}
