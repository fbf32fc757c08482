//! Transactional messages through popgate, sent and ended by Apache's Java SDK (`transact` scenario of the
//! driver, under both SDK versions) and by raw gRPC for what the SDK never sends. Each test checks what the SDK
//! saw and what the broker holds: the committed message in the real topic, once, only after the commit.

use std::time::{Duration, Instant};

use popgate::grpc::proto::{self as pb, Code};
use serde_json::{json, Value};

use crate::grpc_raw::{connect, request};
use crate::harness::direct::Direct;
use crate::harness::popgate::Popgate;
use crate::harness::rocketmq::Cluster;
use crate::harness::sdk::Sdk;
use crate::harness::unique_topic;
use crate::publish::shared_cluster;

/// How long one driver run may take on a loaded machine.
const DRIVER_TIMEOUT: Duration = Duration::from_secs(180);

on_every_sdk!(
    a_commit_while_the_broker_is_stopped_is_owed_and_lands_once_after_it_continues,
    a_committed_message_is_stored_once_after_its_commit_and_a_rolled_back_one_never,
    a_commit_after_popgate_was_killed_between_send_and_commit_lands_at_once,
    an_unended_transaction_is_checked_back_through_a_producer_of_its_topic_on_another_popgate,
);

/// A topic typed for transactional messages on every broker of `cluster`.
pub(crate) async fn create_transaction_topic(cluster: &Cluster, topic: &str) {
    let addrs: Vec<String> = cluster.brokers.iter().map(|b| format!("127.0.0.1:{}", b.port)).collect();
    Direct::connect(&cluster.namesrv_addr).await.create_transaction_topic(topic, &addrs).await;
}

fn args(popgate: &Popgate, mut extra: Value) -> Value {
    extra["endpoint"] = json!(popgate.grpc);
    extra
}

/// The bodies stored in `topic`'s queues (committed messages; half messages live in the broker's own topic).
pub(crate) async fn stored_bodies(cluster: &Cluster, topic: &str) -> Vec<String> {
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let mut bodies: Vec<String> =
        direct.read_all(topic).await.into_iter().map(|m| String::from_utf8_lossy(&m.body).into_owned()).collect();
    bodies.sort();
    bodies
}

async fn a_committed_message_is_stored_once_after_its_commit_and_a_rolled_back_one_never(sdk: Sdk) {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("tx_commit");
    create_transaction_topic(cluster, &topic).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ready = dir.path().join("sent");

    // The checker does not know: a message that comes through was committed by the SDK's commit().
    let commit = json!({"topic": topic, "prefix": "kept", "resolution": "commit", "checker": "unknown",
        "endAfterMs": 3000, "readyFile": ready});
    let producer = sdk.start("transact", &args(&popgate, commit)).once_file_exists(&ready, DRIVER_TIMEOUT).await;
    assert_eq!(stored_bodies(cluster, &topic).await, Vec::<String>::new(), "nothing is visible before the commit");
    let result = producer.finish(DRIVER_TIMEOUT).await;
    assert_eq!(result["errors"], json!([]), "{result}");
    assert_eq!(result["ended"][0]["ok"], true, "{result}");
    let sent_id = result["sent"][0]["messageId"].as_str().unwrap_or_default().to_owned();
    crate::harness::eventually(Duration::from_secs(20), "the committed message is stored", || async {
        !stored_bodies(cluster, &topic).await.is_empty()
    })
    .await;
    assert_eq!(stored_bodies(cluster, &topic).await, ["kept-0"], "stored once");
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let stored = direct.read_all(&topic).await;
    assert_eq!(stored[0].property("UNIQ_KEY"), Some(sent_id.as_str()), "the message id the SDK was given");

    let rollback = json!({"topic": topic, "prefix": "dropped", "resolution": "rollback", "checker": "commit"});
    let result = sdk.run("transact", &args(&popgate, rollback), DRIVER_TIMEOUT).await;
    assert_eq!(result["ended"][0]["ok"], true, "{result}");
    // Long enough for a commit to have shown: the rolled-back message never appears.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(stored_bodies(cluster, &topic).await, ["kept-0"], "the rolled-back message is never stored");
    assert_eq!(popgate.metric(r#"popgate_transactions_ended_total{resolution="commit",result="landed"}"#).await, 1.0);
    assert_eq!(popgate.metric(r#"popgate_transactions_ended_total{resolution="rollback",result="landed"}"#).await, 1.0);
}

async fn a_commit_after_popgate_was_killed_between_send_and_commit_lands_at_once(sdk: Sdk) {
    let cluster = shared_cluster();
    let mut popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("tx_killed");
    create_transaction_topic(cluster, &topic).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ready = dir.path().join("sent");

    // The SDK commits 20 s after its send; popgate is killed (-9) and restarted meanwhile. The checker does not
    // know (a check-back in between ends nothing), so only the SDK's own commit can store the message.
    let commit = json!({"topic": topic, "prefix": "survives", "resolution": "commit", "checker": "unknown",
        "endAfterMs": 20000, "readyFile": ready});
    let producer = sdk.start("transact", &args(&popgate, commit)).once_file_exists(&ready, DRIVER_TIMEOUT).await;
    popgate.restart().await;
    let result = producer.finish(DRIVER_TIMEOUT).await;
    assert_eq!(result["errors"], json!([]), "{result}");
    assert_eq!(result["ended"][0]["ok"], true, "the commit after the restart succeeded: {result}");
    let commit_ms = result["ended"][0]["endMs"].as_i64().unwrap_or(i64::MAX);
    assert!(commit_ms < 5_000, "answered at once, not after a check-back: {commit_ms} ms");
    crate::harness::eventually(Duration::from_secs(20), "the committed message is stored", || async {
        !stored_bodies(cluster, &topic).await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(stored_bodies(cluster, &topic).await, ["survives-0"], "stored once");
}

/// A cluster whose broker checks a transaction back 3 s after its send, then every 3 s (defaults: 6 s, 30 s).
fn quickly_checking_cluster() -> Cluster {
    let mut spec = crate::harness::rocketmq::ClusterSpec::brokers(&["broker-a"]);
    spec.broker_conf = vec!["transactionTimeOut=3000".into(), "transactionCheckInterval=3000".into()];
    Cluster::start(&spec)
}

async fn an_unended_transaction_is_checked_back_through_a_producer_of_its_topic_on_another_popgate(sdk: Sdk) {
    let cluster = quickly_checking_cluster();
    let first = Popgate::start(&cluster.namesrv_addr, "").await;
    let second = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("tx_check");
    create_transaction_topic(&cluster, &topic).await;

    // The producer sends through the first popgate and goes away without ending its transaction.
    let orphaned = json!({"topic": topic, "prefix": "orphan", "resolution": "none", "checker": "unknown"});
    let result = sdk.run("transact", &args(&first, orphaned), DRIVER_TIMEOUT).await;
    assert_eq!(result["errors"], json!([]), "{result}");
    assert_eq!(stored_bodies(&cluster, &topic).await, Vec::<String>::new(), "not ended: not stored");

    // A new producer of the topic, on the second popgate, answers the broker's check-back with COMMIT.
    let checker = json!({"topic": topic, "count": 0, "resolution": "none", "checker": "commit", "stayMs": 45000});
    let producer = sdk.start("transact", &args(&second, checker));
    crate::harness::eventually(Duration::from_secs(90), "the checked-back message is committed", || async {
        !stored_bodies(&cluster, &topic).await.is_empty()
    })
    .await;
    let result = producer.finish(DRIVER_TIMEOUT).await;
    let checks = result["checks"].as_array().cloned().unwrap_or_default();
    assert!(!checks.is_empty(), "the new producer was asked: {result}");
    assert_eq!(checks[0]["body"], "orphan-0", "{result}");
    assert_eq!(checks[0]["topic"], json!(topic));
    let stored = Direct::connect(&cluster.namesrv_addr).await.read_all(&topic).await;
    let described: Vec<String> = stored.iter().map(|m| format!("queue {} {:?}", m.queue_id, m.properties)).collect();
    assert_eq!(stored.len(), 1, "committed once: {described:#?}");
    assert!(second.metric(r#"popgate_transaction_checks_total{outcome="forwarded"}"#).await >= 1.0);
    assert_eq!(
        second.metric(r#"popgate_transactions_ended_total{resolution="commit",result="landed"}"#).await,
        1.0,
        "the second popgate ended a transaction it never saw sent"
    );
}

fn resource(name: &str) -> Option<pb::Resource> {
    Some(pb::Resource { resource_namespace: String::new(), name: name.to_owned() })
}

fn transactional(topic: &str, id: &str) -> pb::Message {
    pb::Message {
        topic: resource(topic),
        user_properties: Default::default(),
        system_properties: Some(pb::SystemProperties {
            message_id: id.to_owned(),
            message_type: pb::MessageType::Transaction as i32,
            ..Default::default()
        }),
        body: b"raw".to_vec().into(),
    }
}

fn end(topic: &str, id: &str, resolution: pb::TransactionResolution) -> pb::EndTransactionRequest {
    pb::EndTransactionRequest {
        topic: resource(topic),
        message_id: id.to_owned(),
        transaction_id: id.to_owned(),
        resolution: resolution as i32,
        source: pb::TransactionSource::SourceClient as i32,
        trace_context: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ends_of_unknown_repeated_or_contradicting_transactions_and_a_transactional_send_to_a_normal_topic() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("tx_raw");
    create_transaction_topic(cluster, &topic).await;
    let normal = unique_topic("tx_raw_normal");
    crate::grpc::create_topic(cluster, &normal).await;
    let mut client = connect(&popgate).await;
    let send = |topic: &str, id: &str| pb::SendMessageRequest { messages: vec![transactional(topic, id)] };
    let code = |status: Option<&pb::Status>| status.map_or(0, |s| s.code);

    // To a topic not typed for transactions: Apache's proxy's code and words; nothing is stored.
    let refused = client.send_message(request(send(&normal, "0A0000000000000000000000000000A1"), None)).await;
    let refused = refused.expect("call").into_inner();
    let status = refused.status.clone().unwrap_or_default();
    assert_eq!(status.code, Code::MessagePropertyConflictWithType as i32, "{refused:?}");
    assert_eq!(
        status.message,
        "org.apache.rocketmq.proxy.common.ProxyException: TopicMessageType validate failed, the expected type is NORMAL, but actual type is TRANSACTION"
    );

    // Unknown: Apache's proxy's code and words.
    let unknown = end(&topic, "0A0000000000000000000000000000B2", pb::TransactionResolution::Commit);
    let answer = client.end_transaction(request(unknown, None)).await.expect("call").into_inner();
    let status = answer.status.unwrap_or_default();
    assert_eq!(status.code, Code::InternalServerError as i32);
    assert_eq!(status.message, "org.apache.rocketmq.proxy.common.ProxyException: cannot found transaction data");
    let mut blank = end(&topic, " ", pb::TransactionResolution::Commit);
    blank.transaction_id = " ".into();
    let answer = client.end_transaction(request(blank, None)).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::InvalidTransactionId as i32);

    // Rolled back, then rolled back again (a retry: OK), then committed (refused, saying why).
    let id = "0A0000000000000000000000000000C3";
    let sent = client.send_message(request(send(&topic, id), None)).await.expect("call").into_inner();
    assert_eq!(code(sent.status.as_ref()), Code::Ok as i32, "{sent:?}");
    assert_eq!(sent.entries[0].transaction_id, id, "the transaction id is the message id");
    for _ in 0..2 {
        let rollback = end(&topic, id, pb::TransactionResolution::Rollback);
        let answer = client.end_transaction(request(rollback, None)).await.expect("call").into_inner();
        assert_eq!(code(answer.status.as_ref()), Code::Ok as i32, "{answer:?}");
    }
    let commit = end(&topic, id, pb::TransactionResolution::Commit);
    let answer = client.end_transaction(request(commit, None)).await.expect("call").into_inner();
    let status = answer.status.unwrap_or_default();
    assert_eq!(status.code, Code::InternalServerError as i32);
    assert!(status.message.contains("already ended with rollback"), "{}", status.message);
    // The same transaction id on another topic is not that transaction.
    let elsewhere = end(&normal, id, pb::TransactionResolution::Rollback);
    let answer = client.end_transaction(request(elsewhere, None)).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::InternalServerError as i32);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(stored_bodies(cluster, &topic).await, Vec::<String>::new(), "nothing was committed");
    assert_eq!(stored_bodies(cluster, &normal).await, Vec::<String>::new());
}

async fn a_commit_while_the_broker_is_stopped_is_owed_and_lands_once_after_it_continues(sdk: Sdk) {
    let cluster = Cluster::start(&crate::harness::rocketmq::ClusterSpec::brokers(&["broker-a"]));
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("tx_stopped");
    create_transaction_topic(&cluster, &topic).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let ready = dir.path().join("sent");

    // The broker is SIGSTOPped after the send and before the SDK's commit (8 s after the send).
    let commit = json!({"topic": topic, "prefix": "owed", "resolution": "commit", "checker": "unknown",
        "endAfterMs": 8000, "readyFile": ready});
    let producer = sdk.start("transact", &args(&popgate, commit)).once_file_exists(&ready, DRIVER_TIMEOUT).await;
    cluster.pause_broker("broker-a");
    let result = producer.finish(DRIVER_TIMEOUT).await;
    assert_eq!(result["errors"], json!([]), "{result}");
    assert_eq!(result["ended"][0]["ok"], true, "the commit is answered while the broker is stopped: {result}");
    assert_eq!(popgate.metric("popgate_transactions_owed").await, 1.0, "the resolution is owed");
    tokio::time::sleep(Duration::from_secs(5)).await;
    cluster.resume_broker("broker-a");

    crate::harness::eventually(Duration::from_secs(90), "the owed commit lands", || async {
        popgate.metric("popgate_transactions_owed").await == 0.0 && !stored_bodies(&cluster, &topic).await.is_empty()
    })
    .await;
    // The first try may have reached the broker before it stopped answering: the retry looked first.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(stored_bodies(&cluster, &topic).await, ["owed-0"], "committed once");
    assert_eq!(popgate.metric(r#"popgate_transactions_ended_total{resolution="commit",result="landed"}"#).await, 1.0);
}

/// The figure the README compares popgate's durable records with: Apache's proxy keeps a transaction's data in
/// memory, so after a `kill -9` and restart between the send and the commit the SDK's commit fails, and the
/// message waits for the broker's check-back. The newest SDK only: the popgate side runs under both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_after_apaches_proxy_was_killed_between_send_and_commit_fails_and_leaves_the_message_unstored() {
    let cluster = shared_cluster();
    let mut proxy = tokio::task::block_in_place(|| crate::harness::rocketmq::ApacheProxy::start(cluster));
    let topic = unique_topic("tx_apache_killed");
    create_transaction_topic(cluster, &topic).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (ready, restarted) = (dir.path().join("sent"), dir.path().join("restarted"));

    let commit = json!({"endpoint": proxy.endpoint, "topic": topic, "prefix": "lost", "resolution": "commit",
        "checker": "unknown", "readyFile": ready, "endWhenFile": restarted, "retryUnavailableMs": 30000,
        "stayMs": 5000});
    let producer = Sdk::NEWEST.start("transact", &commit).once_file_exists(&ready, DRIVER_TIMEOUT).await;
    let restart_started = Instant::now();
    tokio::task::block_in_place(|| proxy.kill9_and_restart());
    let restart_took = restart_started.elapsed();
    std::fs::write(&restarted, b"").expect("restarted file");
    let result = producer.finish(DRIVER_TIMEOUT).await;
    assert_eq!(result["errors"], json!([]), "the send went through: {result}");
    let ended = &result["ended"][0];
    let sent_at = result["sent"][0]["sentAtMs"].as_i64().or(result["startedAtMs"].as_i64()).unwrap_or(0);
    let ended_at = ended["endedAtMs"].as_i64().unwrap_or(0);
    println!(
        "apache proxy restarted in {restart_took:?}; commit {} ms after the send (its data lives 30 s): {ended}",
        ended_at - sent_at
    );
    assert_eq!(ended["ok"], false, "Apache's proxy forgot the transaction: {result}");
    let error = ended.to_string();
    assert!(error.contains("cannot found transaction data"), "{error}");
    assert_eq!(stored_bodies(cluster, &topic).await, Vec::<String>::new(), "only a check-back could store it now");
}
