//! The gateway's rules for settling deliveries and ending transactions, through the HTTP and gRPC fronts alike
//! (issue #33; the remoting front's cases are in `remoting_hostile.rs`): a token reaches neither another token's
//! deliveries nor its transactions, whatever front, group or topic its request names, and nothing changes:
//! the delivery is still the owner's to ACK, the transaction still the owner's to commit, and the broker holds
//! nothing the owner did not commit.

use popgate::grpc::proto::{self as pb, Code};
use serde_json::{json, Value};

use crate::grpc_raw::{connect, request, resource};
use crate::harness::popgate::Popgate;
use crate::harness::unique_topic;
use crate::publish::shared_cluster;
use crate::scopes::http;
use crate::transaction::{create_transaction_topic, stored_bodies};

/// The token whose delivery and transaction the cases reach for, and the token that reaches for them.
const OWNER: (&str, &str) = ("gw-owner", "gw-owner-secret-0123456789");
const OTHER: (&str, &str) = ("gw-other", "gw-other-secret-0123456789");

fn tokens_toml() -> String {
    format!(
        "[auth]\nenabled = true\n\n\
         [[auth.tokens]]\nname = \"{}\"\ntoken = \"{}\"\npublish = [\"gw_*\"]\nconsume = [\"gw_g*\"]\n\n\
         [[auth.tokens]]\nname = \"{}\"\ntoken = \"{}\"\npublish = [\"gwo_*\"]\nconsume = [\"gwo_g*\"]\n",
        OWNER.0, OWNER.1, OTHER.0, OTHER.1
    )
}

async fn post(popgate: &Popgate, path: &str, token: (&str, &str), body: Value) -> (u16, Value) {
    http(popgate, "POST", path, token.1, Some(body)).await
}

/// The code of a gRPC answer's status.
fn code(status: Option<&pb::Status>) -> i32 {
    status.map_or(Code::Ok as i32, |s| s.code)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_reaches_no_other_tokens_deliveries_or_transactions_on_any_front() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, &tokens_toml()).await;
    let topic = unique_topic("gw");
    create_transaction_topic(cluster, &topic).await;
    let (group, other_group) = (unique_topic("gw_g"), unique_topic("gwo_g"));
    let mut grpc = connect(&popgate).await;

    // The owner's delivery, handed out to it over HTTP.
    let (status, sent) = post(&popgate, "/events/publish", OWNER, json!({"topic": topic, "data": "plain"})).await;
    assert_eq!(status, 200, "{sent}");
    let poll = format!("/events/poll?group={group}&topic={topic}&max=1&waitMs=20000");
    let (status, polled) = http(&popgate, "GET", &poll, OWNER.1, None).await;
    assert_eq!(status, 200, "{polled}");
    let id = polled["deliveries"][0]["deliveryId"].as_str().expect("a delivery").to_owned();

    // HTTP: another token's ACK, NACK, TERM and batch ACK are refused, naming the delivery.
    for (path, body) in [
        ("/events/ack", json!({"deliveryId": id})),
        ("/events/nack", json!({"deliveryId": id})),
        ("/events/term", json!({"deliveryId": id})),
    ] {
        let (status, answer) = post(&popgate, path, OTHER, body).await;
        assert_eq!((status, answer["error"]["field"].as_str()), (403, Some("deliveryId")), "{path}: {answer}");
    }
    let (status, answer) = post(&popgate, "/events/ack", OTHER, json!({"deliveryIds": [id, "no-such-id"]})).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["results"][0]["status"], "forbidden", "{answer}");
    assert_eq!(answer["results"][1]["status"], "unknown", "each id answered in the order asked: {answer}");

    // gRPC: the same delivery, by its handle, as the owner's group (refused: not the token's group) and as the
    // token's own group (refused: the handle is another group's).
    let handle = format!("pg1:{id}");
    let entry = |group: &str| pb::AckMessageRequest {
        group: resource(group),
        topic: resource(&topic),
        entries: vec![pb::AckMessageEntry {
            message_id: String::new(),
            receipt_handle: handle.clone(),
            lite_topic: None,
        }],
    };
    let answer = grpc.ack_message(request(entry(&group), Some(OTHER))).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::Unauthorized as i32, "{answer:?}");
    let answer = grpc.ack_message(request(entry(&other_group), Some(OTHER))).await.expect("call").into_inner();
    assert_eq!(code(answer.entries[0].status.as_ref()), Code::InvalidReceiptHandle as i32, "{answer:?}");
    let later = pb::ChangeInvisibleDurationRequest {
        group: resource(&other_group),
        topic: resource(&topic),
        receipt_handle: handle.clone(),
        invisible_duration: Some(prost_types::Duration { seconds: 60, nanos: 0 }),
        message_id: String::new(),
        lite_topic: None,
        suspend: None,
    };
    let answer = grpc.change_invisible_duration(request(later, Some(OTHER))).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::InvalidReceiptHandle as i32, "{answer:?}");
    let to_dlq = pb::ForwardMessageToDeadLetterQueueRequest {
        group: resource(&group),
        topic: resource(&topic),
        receipt_handle: handle.clone(),
        message_id: String::new(),
        delivery_attempt: 1,
        max_delivery_attempts: 16,
        lite_topic: None,
    };
    let answer = grpc.forward_message_to_dead_letter_queue(request(to_dlq, Some(OTHER))).await.expect("call");
    assert_eq!(code(answer.into_inner().status.as_ref()), Code::Unauthorized as i32);

    // Nothing changed: the delivery is still the owner's, on its first attempt.
    let (status, answer) = post(&popgate, "/events/ack", OWNER, json!({"deliveryId": id})).await;
    assert_eq!((status, &answer["status"]), (200, &json!("acked")), "{answer}");

    // The owner's transaction, sent over HTTP.
    let half = json!({"topic": topic, "data": "half", "transaction": true});
    let (status, sent) = post(&popgate, "/events/publish", OWNER, half).await;
    assert_eq!(status, 200, "{sent}");
    let tx = sent["transactionId"].as_str().expect("a transaction id").to_owned();

    // Another token may not end it: over HTTP, over gRPC naming its topic, nor naming a topic of its own.
    let (status, answer) =
        post(&popgate, &format!("/events/transactions/{tx}"), OTHER, json!({"resolution": "commit"})).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (403, Some("id")), "{answer}");
    let end = |topic: &str| pb::EndTransactionRequest {
        topic: resource(topic),
        message_id: tx.clone(),
        transaction_id: tx.clone(),
        resolution: pb::TransactionResolution::Commit as i32,
        source: pb::TransactionSource::SourceClient as i32,
        trace_context: String::new(),
    };
    let answer = grpc.end_transaction(request(end(&topic), Some(OTHER))).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::Unauthorized as i32, "{answer:?}");
    let answer = grpc.end_transaction(request(end("gwo_mine"), Some(OTHER))).await.expect("call").into_inner();
    let status = answer.status.expect("a status");
    assert!(
        status.message.contains("cannot found transaction data"),
        "another topic knows no such transaction: {status:?}"
    );

    // Nothing changed: the transaction is open, nothing of it is stored; the owner's commit lands.
    let (status, shown) = http(&popgate, "GET", &format!("/events/transactions/{tx}"), OWNER.1, None).await;
    assert_eq!((status, &shown["state"]), (200, &json!("open")), "{shown}");
    assert_eq!(stored_bodies(cluster, &topic).await, vec!["plain".to_owned()]);
    let (status, ended) =
        post(&popgate, &format!("/events/transactions/{tx}"), OWNER, json!({"resolution": "commit"})).await;
    assert_eq!((status, &ended["state"]), (200, &json!("ended")), "{ended}");
    // Each refusal of the token is counted (a handle of another group, or a transaction unknown on a topic, is
    // an answer about the handle or the id, not a refusal of the token).
    assert_eq!(popgate.metric(r#"popgate_requests_rejected_total{reason="forbidden"}"#).await, 8.0);
}
