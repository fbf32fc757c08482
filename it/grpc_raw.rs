//! The gRPC front spoken to directly (plaintext, the generated client) for what the official SDK never
//! sends: handles popgate did not issue, another group's handle, out-of-range fields, unsigned or
//! out-of-scope calls, RPCs popgate does not serve, and a client's termination. Each refusal carries its
//! RocketMQ code, and nothing is lost or half-written.

use std::time::Duration;

use hmac::{Hmac, Mac};
use popgate::grpc::proto::{self as pb, messaging_service_client::MessagingServiceClient, Code};
use serde_json::json;
use tonic::transport::Channel;

use crate::grpc::create_topic;
use crate::harness::direct::Direct;
use crate::harness::popgate::Popgate;
use crate::harness::{eventually, unique_topic};
use crate::publish::shared_cluster;

const CLIENT_ID: &str = "it-raw@1@0@test";

pub async fn connect(popgate: &Popgate) -> MessagingServiceClient<Channel> {
    MessagingServiceClient::connect(format!("http://{}", popgate.grpc)).await.expect("plaintext gRPC connection")
}

/// A request with the SDK's client id header (and, when given, its signature, dated now).
pub fn request<T>(message: T, signed_by: Option<(&str, &str)>) -> tonic::Request<T> {
    let now = chrono::Utc::now().format("%Y%m%dT%H%M%SZ").to_string();
    request_dated(message, signed_by, &now)
}

/// [`request`] signed with `date_time` as its `x-mq-date-time`.
fn request_dated<T>(message: T, signed_by: Option<(&str, &str)>, date_time: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    let metadata = request.metadata_mut();
    metadata.insert("x-mq-client-id", CLIENT_ID.parse().expect("ascii"));
    if let Some((access_key, secret)) = signed_by {
        let mut mac = Hmac::<sha1::Sha1>::new_from_slice(secret.as_bytes()).expect("hmac key");
        mac.update(date_time.as_bytes());
        let signature = hex::encode_upper(mac.finalize().into_bytes());
        let header =
            format!("MQv2-HMAC-SHA1 Credential={access_key}, SignedHeaders=x-mq-date-time, Signature={signature}");
        metadata.insert("x-mq-date-time", date_time.parse().expect("ascii"));
        metadata.insert("authorization", header.parse().expect("ascii"));
    }
    request
}

/// [`request`] from another client than the tests' usual one.
fn request_from<T>(message: T, client_id: &str) -> tonic::Request<T> {
    let mut request = request(message, None);
    request.metadata_mut().insert("x-mq-client-id", client_id.parse().expect("ascii"));
    request
}

pub(crate) fn resource(name: &str) -> Option<pb::Resource> {
    Some(pb::Resource { resource_namespace: String::new(), name: name.to_owned() })
}

pub(crate) fn receive_request(group: &str, topic: &str, auto_renew: bool) -> pb::ReceiveMessageRequest {
    pb::ReceiveMessageRequest {
        group: resource(group),
        message_queue: Some(pb::MessageQueue { topic: resource(topic), id: -1, ..Default::default() }),
        filter_expression: Some(pb::FilterExpression { r#type: pb::FilterType::Tag as i32, expression: "*".into() }),
        batch_size: 16,
        invisible_duration: (!auto_renew).then_some(prost_types::Duration { seconds: 30, nanos: 0 }),
        auto_renew,
        long_polling_timeout: Some(prost_types::Duration { seconds: 5, nanos: 0 }),
        attempt_id: None,
    }
}

/// Receives until a receive carries messages (each one a long poll; at most 60 s in all): the first receive of a
/// new group can end before its first POP has brought anything in on a loaded machine. Its status code and
/// messages.
async fn receive_published(
    client: &mut MessagingServiceClient<Channel>,
    req: pb::ReceiveMessageRequest,
) -> (i32, Vec<pb::Message>) {
    receive_published_signed(client, req, None).await
}

/// [`receive_published`], signed by `signed_by` when given.
pub(crate) async fn receive_published_signed(
    client: &mut MessagingServiceClient<Channel>,
    req: pb::ReceiveMessageRequest,
    signed_by: Option<(&str, &str)>,
) -> (i32, Vec<pb::Message>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (code, messages) = receive_signed(client, req.clone(), signed_by).await;
        if !messages.is_empty() || code != Code::MessageNotFound as i32 || std::time::Instant::now() > deadline {
            return (code, messages);
        }
    }
}

/// Runs one receive: its first status code, and the messages it carried.
async fn receive(
    client: &mut MessagingServiceClient<Channel>,
    req: pb::ReceiveMessageRequest,
) -> (i32, Vec<pb::Message>) {
    receive_signed(client, req, None).await
}

/// [`receive`], signed by `signed_by` when given.
pub(crate) async fn receive_signed(
    client: &mut MessagingServiceClient<Channel>,
    req: pb::ReceiveMessageRequest,
    signed_by: Option<(&str, &str)>,
) -> (i32, Vec<pb::Message>) {
    receive_signed_as(client, req, signed_by, CLIENT_ID).await
}

/// [`receive_signed`] by the client with id `client_id` (a client id belongs to the token that first used it).
pub(crate) async fn receive_signed_as(
    client: &mut MessagingServiceClient<Channel>,
    req: pb::ReceiveMessageRequest,
    signed_by: Option<(&str, &str)>,
    client_id: &str,
) -> (i32, Vec<pb::Message>) {
    let mut request = request(req, signed_by);
    request.metadata_mut().insert("x-mq-client-id", client_id.parse().expect("ascii"));
    let mut stream = client.receive_message(request).await.expect("receive call").into_inner();
    let (mut code, mut messages) = (0, Vec::new());
    while let Some(item) = stream.message().await.expect("receive stream") {
        match item.content {
            Some(pb::receive_message_response::Content::Status(status)) if code == 0 => code = status.code,
            Some(pb::receive_message_response::Content::Message(message)) => messages.push(message),
            _ => {}
        }
    }
    (code, messages)
}

pub(crate) fn handle_of(message: &pb::Message) -> String {
    message.system_properties.as_ref().and_then(|p| p.receipt_handle.clone()).unwrap_or_default()
}

pub async fn ack(
    client: &mut MessagingServiceClient<Channel>,
    group: &str,
    topic: &str,
    handles: &[&str],
) -> pb::AckMessageResponse {
    let entries = handles
        .iter()
        .map(|h| pb::AckMessageEntry { message_id: String::new(), receipt_handle: (*h).to_owned(), lite_topic: None })
        .collect();
    let req = pb::AckMessageRequest { group: resource(group), topic: resource(topic), entries };
    client.ack_message(request(req, None)).await.expect("ack call").into_inner()
}

fn code(status: Option<&pb::Status>) -> i32 {
    status.map_or(0, |s| s.code)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_handles_other_groups_and_bad_fields_get_their_codes_and_change_nothing() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "[publish]\nmax_message_bytes = 1024\n").await;
    let topic = unique_topic("grpc_raw");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    popgate.publish_bodies(&topic, &["kept"]).await;
    let mut client = connect(&popgate).await;

    let (status, messages) = receive_published(&mut client, receive_request(&group, &topic, false)).await;
    assert_eq!(status, Code::Ok as i32);
    assert_eq!(messages.len(), 1);
    let handle = handle_of(&messages[0]);
    assert!(handle.starts_with("pg2:") && handle.ends_with(".1"), "popgate's own handle, first hand-out: {handle}");
    let digest = messages[0].system_properties.as_ref().and_then(|p| p.body_digest.clone()).expect("digest");
    // MD5, as Apache's proxy digests a body (the SDK checks it).
    assert_eq!(digest.r#type, pb::DigestType::Md5 as i32);
    assert_eq!(digest.checksum, "4D8B6084F3D167B76CAC66A22A91BE02", "MD5 of `kept`, upper-case hex");

    // Handles popgate did not issue, and another group's use of a real one.
    let stale = handle.replace(".1", ".0");
    for foreign in [
        "pg1:00000000000000000000000000000000",
        "pg2:00000000000000000000000000000000.1",
        &stale,
        "0 1 2 broker-a 0 0 0",
        "",
    ] {
        let answer = ack(&mut client, &group, &topic, &[foreign]).await;
        assert_eq!(code(answer.status.as_ref()), Code::InvalidReceiptHandle as i32, "{foreign}: {answer:?}");
    }
    let answer = ack(&mut client, "another_group", &topic, &[&handle]).await;
    assert_eq!(code(answer.status.as_ref()), Code::InvalidReceiptHandle as i32, "{answer:?}");
    let changed = client
        .change_invisible_duration(request(
            pb::ChangeInvisibleDurationRequest {
                group: resource(&group),
                topic: resource(&topic),
                receipt_handle: "pg1:unknown".into(),
                invisible_duration: Some(prost_types::Duration { seconds: 10, nanos: 0 }),
                ..Default::default()
            },
            None,
        ))
        .await
        .expect("call")
        .into_inner();
    assert_eq!(code(changed.status.as_ref()), Code::InvalidReceiptHandle as i32);
    assert_eq!(changed.receipt_handle, "pg1:unknown", "the handle is echoed back");

    // The real handle still works after all that; a batch with a bad entry answers per entry.
    let answer = ack(&mut client, &group, &topic, &[&handle, "pg1:nope"]).await;
    assert_eq!(code(answer.status.as_ref()), Code::MultipleResults as i32, "{answer:?}");
    assert_eq!(code(answer.entries[0].status.as_ref()), Code::Ok as i32);
    assert_eq!(code(answer.entries[1].status.as_ref()), Code::InvalidReceiptHandle as i32);
    // The SDK retries an ACK whose answer it lost: a repeated ACK of the same hand-out is answered OK, as by
    // Apache's proxy, and the message stays ACKed once.
    let again = ack(&mut client, &group, &topic, &[&handle]).await;
    assert_eq!(code(again.status.as_ref()), Code::Ok as i32, "a repeated ACK: {again:?}");
    assert_eq!(popgate.metric("popgate_acks_total{result=\"repeated\"}").await, 1.0);

    // Receives that cannot be served.
    let mut sql = receive_request(&group, &topic, false);
    sql.filter_expression = Some(pb::FilterExpression { r#type: pb::FilterType::Sql as i32, expression: " ".into() });
    assert_eq!(receive(&mut client, sql).await.0, Code::IllegalFilterExpression as i32);
    let missing = receive_request(&group, &unique_topic("grpc_raw_missing"), false);
    assert_eq!(receive(&mut client, missing).await.0, Code::TopicNotFound as i32);
    let mut zero = receive_request(&group, &topic, false);
    zero.batch_size = 0;
    assert_eq!(receive(&mut client, zero).await.0, Code::BadRequest as i32);
    let mut no_client_id = tonic::Request::new(receive_request(&group, &topic, false));
    no_client_id.metadata_mut().remove("x-mq-client-id");
    let mut stream = client.receive_message(no_client_id).await.expect("call").into_inner();
    let first = stream.message().await.expect("stream").and_then(|r| r.content);
    assert!(
        matches!(first, Some(pb::receive_message_response::Content::Status(s)) if s.code == Code::ClientIdRequired as i32)
    );

    // Sends that cannot be stored: an empty topic, a body over the limit. Neither reaches the broker.
    let message = |topic: &str, body: Vec<u8>| pb::Message {
        topic: resource(topic),
        user_properties: Default::default(),
        system_properties: Some(pb::SystemProperties { message_id: "raw-1".into(), ..Default::default() }),
        body: body.into(),
    };
    for (bad, expected) in [
        (message("", b"x".to_vec()), Code::IllegalTopic),
        (message(&topic, vec![b'x'; 2048]), Code::MessageBodyTooLarge),
    ] {
        let answer = client
            .send_message(request(pb::SendMessageRequest { messages: vec![bad] }, None))
            .await
            .expect("send call")
            .into_inner();
        assert_eq!(code(answer.status.as_ref()), expected as i32, "{answer:?}");
    }
    let stored = Direct::connect(&cluster.namesrv_addr).await.read_all(&topic).await;
    assert_eq!(stored.len(), 1, "only the one good message is stored");
    assert_eq!(popgate.metric("popgate_publish_requests_total{result=\"too_large\",transport=\"grpc\"}").await, 1.0);

    // An RPC popgate does not serve answers at once, with gRPC's UNIMPLEMENTED.
    let unserved = tokio::time::timeout(
        Duration::from_secs(10),
        client.recall_message(request(pb::RecallMessageRequest::default(), None)),
    )
    .await
    .expect("an answer, not a hang");
    assert_eq!(unserved.expect_err("not served").code(), tonic::Code::Unimplemented);
    let metrics = popgate.metrics_text().await;
    assert!(metrics.contains("popgate_grpc_requests_total{rpc=\"AckMessage\",code=\"INVALID_RECEIPT_HANDLE\"}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_signature_is_unauthorized_and_a_group_out_of_scope_is_forbidden() {
    let cluster = shared_cluster();
    let tokens = "[auth]\nenabled = true\n[[auth.tokens]]\nname = \"app\"\ntoken = \"app-secret-0123456789\"\n\
                  publish = [\"grpc_raw_*\"]\nconsume = [\"g_mine_*\"]\n";
    let popgate = Popgate::start(&cluster.namesrv_addr, tokens).await;
    let topic = unique_topic("grpc_raw_auth");
    create_topic(cluster, &topic).await;
    let mut client = connect(&popgate).await;

    let heartbeat = pb::HeartbeatRequest { group: None, client_type: pb::ClientType::Producer as i32 };
    let unsigned = client.heartbeat(request(heartbeat.clone(), None)).await.expect("call").into_inner();
    assert_eq!(code(unsigned.status.as_ref()), Code::Unauthorized as i32);
    let forged =
        client.heartbeat(request(heartbeat.clone(), Some(("app", "not-the-secret")))).await.expect("call").into_inner();
    assert_eq!(code(forged.status.as_ref()), Code::Unauthorized as i32);
    // A correct signature of an hour ago (a captured header, replayed) is outside the 15-minute skew window.
    let an_hour_ago = (chrono::Utc::now() - chrono::Duration::hours(1)).format("%Y%m%dT%H%M%SZ").to_string();
    let replayed = request_dated(heartbeat.clone(), Some(("app", "app-secret-0123456789")), &an_hour_ago);
    let replayed = client.heartbeat(replayed).await.expect("call").into_inner();
    assert_eq!(code(replayed.status.as_ref()), Code::Unauthorized as i32, "{replayed:?}");
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"stale_signature\"}").await >= 1.0);
    let route = pb::QueryRouteRequest { topic: resource(&topic), endpoints: None };
    let unsigned = client.query_route(request(route, None)).await.expect("call").into_inner();
    assert_eq!(code(unsigned.status.as_ref()), Code::Unauthorized as i32);
    // An unauthenticated peer is never counted as a live client (nor could it keep deliveries held as one).
    for kind in ["producer", "push_consumer", "simple_consumer", "other"] {
        let series = format!("popgate_grpc_clients{{kind=\"{kind}\"}}");
        assert_eq!(popgate.metric(&series).await, 0.0, "{series} after unauthenticated calls only");
    }
    let signed =
        client.heartbeat(request(heartbeat, Some(("app", "app-secret-0123456789")))).await.expect("call").into_inner();
    assert_eq!(code(signed.status.as_ref()), Code::Ok as i32);
    assert_eq!(popgate.metric("popgate_grpc_clients{kind=\"producer\"}").await, 1.0, "the signed heartbeat counts");

    let req = pb::AckMessageRequest {
        group: resource("g_theirs"),
        topic: resource(&topic),
        entries: vec![pb::AckMessageEntry {
            message_id: String::new(),
            receipt_handle: "pg1:x".into(),
            lite_topic: None,
        }],
    };
    let answer =
        client.ack_message(request(req, Some(("app", "app-secret-0123456789")))).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::Unauthorized as i32);
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"unauthenticated\"}").await >= 2.0);
}

/// One token's open receives are bounded (`grpc.max_receives_per_token`), and so are the client ids the front
/// tracks (`grpc.max_clients`): past either, a call is refused with `TOO_MANY_REQUESTS` and nothing else
/// changes; a place freed is taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_receives_per_token_and_tracked_clients_are_bounded() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "[grpc]\nmax_receives_per_token = 1\nmax_clients = 1\n").await;
    let topic = unique_topic("grpc_raw_limits");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    let (mut first, mut second) = (connect(&popgate).await, connect(&popgate).await);
    // Two receives at once on an empty topic: one long-polls for its 20 s, the other is refused at once.
    let long_poll = || {
        let mut req = receive_request(&group, &topic, false);
        req.long_polling_timeout = Some(prost_types::Duration { seconds: 20, nanos: 0 });
        req
    };
    let (a, b) = tokio::join!(receive(&mut first, long_poll()), receive(&mut second, long_poll()));
    let mut codes = [a.0, b.0];
    codes.sort_unstable();
    assert_eq!(codes, [Code::MessageNotFound as i32, Code::TooManyRequests as i32], "{codes:?}");
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"too_many_open_calls\"}").await >= 1.0);
    // The long poll is over: its place is free again.
    let mut quick = receive_request(&group, &topic, false);
    quick.long_polling_timeout = Some(prost_types::Duration { seconds: 5, nanos: 0 });
    assert_eq!(receive(&mut first, quick).await.0, Code::MessageNotFound as i32);

    // A second client id while the first is tracked: refused.
    let heartbeat = pb::HeartbeatRequest { group: None, client_type: pb::ClientType::Producer as i32 };
    let mut other = request(heartbeat, None);
    other.metadata_mut().insert("x-mq-client-id", "it-raw@2@0@other".parse().expect("ascii"));
    let answer = first.heartbeat(other).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::TooManyRequests as i32, "{answer:?}");
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"too_many_clients\"}").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_clients_auto_renewed_deliveries_of_the_group_it_left_are_due_again_at_once() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_raw_term");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    popgate.publish_bodies(&topic, &["held"]).await;
    let mut client = connect(&popgate).await;

    // The same client also consumes as a second group (one client instance, two consumers).
    let other_group = format!("g2_{topic}");
    for group in [&group, &other_group] {
        let (_, messages) = receive_published(&mut client, receive_request(group, &topic, true)).await;
        assert_eq!(messages.len(), 1);
        let deliveries = popgate.get_json(&format!("/admin/deliveries?group={group}")).await.1;
        assert_eq!(deliveries["deliveries"][0]["phase"], "awaiting_ack", "{deliveries}");
    }

    let bye = pb::NotifyClientTerminationRequest { group: resource(&group) };
    let answer = client.notify_client_termination(request(bye, None)).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::Ok as i32);
    // Due at once as attempt 2, not after the 30 s hold.
    eventually(Duration::from_secs(5), "the delivery is ready again", || async {
        let d = popgate.get_json(&format!("/admin/deliveries?group={group}")).await.1;
        d["deliveries"][0]["phase"] == "ready" && d["deliveries"][0]["attempt"] == 2
    })
    .await;
    // What the client holds as the other group, which it did not leave, stays held.
    let others = popgate.get_json(&format!("/admin/deliveries?group={other_group}")).await.1;
    assert_eq!(others["deliveries"][0]["phase"], "awaiting_ack", "the other group's hand-out is kept: {others}");
    assert_eq!(others["deliveries"][0]["attempt"], 1, "{others}");
    let polled = popgate.poll(&group, &topic, 1, 5_000).await;
    assert_eq!(polled.len(), 1, "another subscriber gets it at once");
    assert_eq!(polled[0]["attempt"], json!(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_message_goes_to_the_dlq_with_its_origin_and_is_acked() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_raw_fwd");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    popgate.publish_bodies(&topic, &["poison"]).await;
    let mut client = connect(&popgate).await;

    let (_, messages) = receive_published(&mut client, receive_request(&group, &topic, true)).await;
    assert_eq!(messages.len(), 1);
    let message_id = messages[0].system_properties.as_ref().map(|p| p.message_id.clone()).unwrap_or_default();
    let forward = pb::ForwardMessageToDeadLetterQueueRequest {
        group: resource(&group),
        topic: resource(&topic),
        receipt_handle: handle_of(&messages[0]),
        message_id: message_id.clone(),
        delivery_attempt: 1,
        max_delivery_attempts: 6,
        lite_topic: None,
    };
    let answer = client.forward_message_to_dead_letter_queue(request(forward, None)).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::Ok as i32);

    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let dlq = format!("%DLQ%{group}");
    let dead = direct.read_when_present(&dlq, Duration::from_secs(30)).await;
    assert_eq!(dead.len(), 1, "the message is in {dlq}");
    assert_eq!(dead[0].body, b"poison");
    assert_eq!(dead[0].property("DLQ_ORIGIN_TOPIC"), Some(topic.as_str()));
    assert_eq!(dead[0].property("DLQ_ORIGIN_MESSAGE_ID"), Some(message_id.as_str()));
    eventually(Duration::from_secs(15), "the original is ACKed and retired", || async {
        popgate.get_json(&format!("/admin/deliveries?group={group}")).await.1["deliveries"]
            .as_array()
            .is_some_and(Vec::is_empty)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auto_renewed_delivery_comes_back_once_its_client_has_gone_silent() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, "").await;
    let topic = unique_topic("grpc_raw_gone");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    popgate.publish_bodies(&topic, &["orphan"]).await;
    let mut client = connect(&popgate).await;

    let (_, messages) = receive_published(&mut client, receive_request(&group, &topic, true)).await;
    assert_eq!(messages.len(), 1);
    let received = std::time::Instant::now();
    // The client never calls again. Its hold (30 s, extended while it was seen in the last 20 s) runs out,
    // and the delivery's attempt is spent as for any missed ACK deadline.
    eventually(Duration::from_secs(90), "the delivery is due again as attempt 2", || async {
        let d = popgate.get_json(&format!("/admin/deliveries?group={group}")).await.1;
        d["deliveries"][0]["attempt"] == 2
    })
    .await;
    let held_for = received.elapsed();
    assert!(held_for >= Duration::from_secs(30), "held while the client might still be alive: {held_for:?}");
    let polled = popgate.poll_until(&group, &topic, 1, Duration::from_secs(10)).await;
    assert_eq!(polled[0]["attempt"], json!(2));
    assert!(popgate.metric("popgate_redeliveries_total{reason=\"timeout\"}").await >= 1.0);
}

/// The client that receives a message and never reads it.
const STALLED_CLIENT_ID: &str = "it-stalled@1@0@test";

/// Heartbeats as `client_id` every 2 s, on a connection of its own, until aborted: the client stays alive to
/// popgate (across a restart too: the channel reconnects).
fn keep_alive(popgate: &Popgate, client_id: &'static str) -> tokio::task::JoinHandle<()> {
    let endpoint = format!("http://{}", popgate.grpc);
    tokio::spawn(async move {
        let channel = tonic::transport::Endpoint::from_shared(endpoint).expect("endpoint").connect_lazy();
        let mut client = MessagingServiceClient::new(channel);
        loop {
            let heartbeat = pb::HeartbeatRequest { group: None, client_type: pb::ClientType::PushConsumer as i32 };
            let _ = client.heartbeat(request_from(heartbeat, client_id)).await;
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    })
}

/// A body far larger than what the stalled client's HTTP/2 window lets in (16 KiB, one frame read for the
/// first status and one more after it): it never reaches the client whole.
const STALLING_BODY_BYTES: usize = 256 * 1024;

/// popgate for the stalled-client tests: a send of a [`STALLING_BODY_BYTES`] body has time on a loaded machine.
async fn popgate_for_large_bodies(cluster: &crate::harness::rocketmq::Cluster) -> Popgate {
    Popgate::start(&cluster.namesrv_addr, "[publish]\nsend_timeout_ms = 15000\n").await
}

/// An auto-renewed receive by [`STALLED_CLIENT_ID`] that carries a message far larger than the client's
/// HTTP/2 window (16 KiB) and is never read past its first status: the message is recorded as held by the
/// client, which never takes it in. Returns the client and the unread stream, to be kept open.
async fn stalled_receive(
    popgate: &Popgate,
    group: &str,
    topic: &str,
) -> (MessagingServiceClient<Channel>, tonic::Streaming<pb::ReceiveMessageResponse>) {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", popgate.grpc))
        .expect("endpoint")
        .initial_stream_window_size(16_384)
        .initial_connection_window_size(65_535)
        .connect()
        .await
        .expect("connect");
    let mut client = MessagingServiceClient::new(channel);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut req = receive_request(group, topic, true);
        req.batch_size = 1;
        let mut stream = client.receive_message(request_from(req, STALLED_CLIENT_ID)).await.expect("call").into_inner();
        let first = stream.message().await.expect("stream").and_then(|r| r.content);
        if matches!(first, Some(pb::receive_message_response::Content::Status(s)) if s.code == Code::Ok as i32) {
            return (client, stream);
        }
        // Nothing yet (a new group's first receive on a loaded machine): the next receive.
        while let Ok(Some(_)) = stream.message().await {}
        assert!(std::time::Instant::now() < deadline, "the stalled client never received the message");
    }
}

/// Receives (without auto-renew) until a message comes, for at most `within`.
async fn first_message(
    client: &mut MessagingServiceClient<Channel>,
    group: &str,
    topic: &str,
    within: Duration,
) -> Option<pb::Message> {
    let deadline = std::time::Instant::now() + within;
    while std::time::Instant::now() < deadline {
        let mut req = receive_request(group, topic, false);
        req.batch_size = 1;
        if let Some(message) = receive(client, req).await.1.into_iter().next() {
            return Some(message);
        }
    }
    None
}

fn attempt_of(message: &pb::Message) -> Option<i32> {
    message.system_properties.as_ref().and_then(|p| p.delivery_attempt)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_its_client_never_took_in_comes_back_at_its_deadline_though_the_client_stays_alive() {
    let cluster = shared_cluster();
    let popgate = popgate_for_large_bodies(cluster).await;
    let topic = unique_topic("grpc_raw_stall");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    let large = "x".repeat(STALLING_BODY_BYTES);
    popgate.publish_bodies(&topic, &[&large]).await;
    let heartbeats = keep_alive(&popgate, STALLED_CLIENT_ID);

    let (_stalled_client, _unread) = stalled_receive(&popgate, &group, &topic).await;
    let stalled_at = std::time::Instant::now();
    // The stalled client heartbeats all along, but it never took the message in: its 30 s hold is not
    // renewed, and another consumer of the group gets the message once the hold is over.
    let mut other = connect(&popgate).await;
    let message = first_message(&mut other, &group, &topic, Duration::from_secs(90)).await.unwrap_or_else(|| {
        panic!(
            "the message stayed held by a client that never took it in ({:?} after it stalled)",
            stalled_at.elapsed()
        )
    });
    assert_eq!(message.body.len(), large.len());
    assert_eq!(attempt_of(&message), Some(2), "its first attempt was spent at the deadline");
    let waited = stalled_at.elapsed();
    assert!(waited >= Duration::from_secs(20), "not taken from the stalled client before its hold ran out: {waited:?}");
    eventually(Duration::from_secs(20), "the unwritten delivery is counted", || async {
        popgate.metric("popgate_grpc_unwritten_deliveries_total").await >= 1.0
    })
    .await;
    heartbeats.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_out_popgate_was_killed_before_its_client_took_it_in_is_dispatched_again_at_once_after_the_restart() {
    let cluster = shared_cluster();
    let mut popgate = popgate_for_large_bodies(cluster).await;
    let topic = unique_topic("grpc_raw_killed");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    let large = "y".repeat(STALLING_BODY_BYTES);
    popgate.publish_bodies(&topic, &[&large]).await;
    let heartbeats = keep_alive(&popgate, STALLED_CLIENT_ID);

    let stalled = stalled_receive(&popgate, &group, &topic).await;
    // kill -9 while the record says the stalled client holds the message and the client has not taken it in.
    popgate.restart().await;
    drop(stalled);
    // The client is alive (it heartbeats to the restarted popgate), but recovery does not keep for it what
    // it never took in: the message is handed out again at once, its attempt kept (a hold that ran out
    // would have spent it).
    let mut other = connect(&popgate).await;
    let message = first_message(&mut other, &group, &topic, Duration::from_secs(60))
        .await
        .expect("the message stayed held by a client that never took it in");
    assert_eq!(message.body.len(), large.len());
    assert_eq!(attempt_of(&message), Some(1), "dispatched again by recovery, not after its hold ran out");
    assert!(popgate.metric("popgate_recovered_deliveries_total{outcome=\"redispatched\"}").await >= 1.0);
    heartbeats.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_id_belongs_to_the_token_that_first_used_it() {
    // Two tokens that may both consume as the group: the client id is what tells their clients apart. Before,
    // another token could send calls under a client id (keeping its auto-renewed deliveries held) and terminate
    // it, giving back what the real client held.
    let cluster = shared_cluster();
    const ALICE: (&str, &str) = ("alice", "alice-secret-0123456789");
    const BOB: (&str, &str) = ("bob", "bob-secret-0123456789");
    let tokens = format!(
        "[auth]\nenabled = true\n\
         [[auth.tokens]]\nname = \"{}\"\ntoken = \"{}\"\npublish = [\"*\"]\nconsume = [\"*\"]\n\
         [[auth.tokens]]\nname = \"{}\"\ntoken = \"{}\"\npublish = [\"*\"]\nconsume = [\"*\"]\n\
         [[auth.tokens]]\nname = \"ops\"\ntoken = \"{OPS}\"\nadmin = true\n",
        ALICE.0, ALICE.1, BOB.0, BOB.1
    );
    const OPS: &str = "ops-secret-0123456789";
    let popgate = Popgate::start(&cluster.namesrv_addr, &tokens).await;
    let topic = unique_topic("grpc_raw_owner");
    let group = format!("g_{topic}");
    create_topic(cluster, &topic).await;
    let http = reqwest::Client::new();
    let published = http
        .post(format!("{}/events/publish", popgate.base))
        .bearer_auth(ALICE.1)
        .json(&json!({"topic": topic, "data": "held"}))
        .send()
        .await
        .expect("publish");
    assert_eq!(published.status(), 200);
    let deliveries = || async {
        let url = format!("{}/admin/deliveries?group={group}", popgate.base);
        let answer = http.get(url).bearer_auth(OPS).send().await.expect("deliveries");
        answer.json::<serde_json::Value>().await.expect("json")
    };
    let mut client = connect(&popgate).await;

    // Alice's client holds the message, kept held while it is alive (auto_renew).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let messages = loop {
        let (_, messages) = receive_signed(&mut client, receive_request(&group, &topic, true), Some(ALICE)).await;
        if !messages.is_empty() || std::time::Instant::now() > deadline {
            break messages;
        }
    };
    assert_eq!(messages.len(), 1, "alice's client received the message");

    // Bob, under alice's client id: refused, and counted.
    let forbidden_before = popgate.metric(r#"popgate_requests_rejected_total{reason="forbidden"}"#).await;
    let heartbeat = pb::HeartbeatRequest { group: resource(&group), client_type: pb::ClientType::PushConsumer as i32 };
    let answer = client.heartbeat(request(heartbeat.clone(), Some(BOB))).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::Forbidden as i32, "{answer:?}");
    let bye = pb::NotifyClientTerminationRequest { group: resource(&group) };
    let answer = client.notify_client_termination(request(bye.clone(), Some(BOB))).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::Forbidden as i32, "{answer:?}");
    let forbidden = popgate.metric(r#"popgate_requests_rejected_total{reason="forbidden"}"#).await - forbidden_before;
    assert_eq!(forbidden, 2.0, "both refusals counted");
    // Nothing changed: alice's client still holds its delivery, as attempt 1.
    let held = deliveries().await;
    assert_eq!(held["deliveries"][0]["phase"], "awaiting_ack", "still held: {held}");
    assert_eq!(held["deliveries"][0]["attempt"], 1, "{held}");

    // Alice's own calls under the id go on, and her termination gives the delivery back.
    let answer = client.heartbeat(request(heartbeat, Some(ALICE))).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::Ok as i32, "{answer:?}");
    let answer = client.notify_client_termination(request(bye, Some(ALICE))).await.expect("call").into_inner();
    assert_eq!(code(answer.status.as_ref()), Code::Ok as i32, "{answer:?}");
    eventually(Duration::from_secs(5), "alice's termination gave the delivery back", || async {
        let d = deliveries().await;
        d["deliveries"][0]["phase"] == "ready" && d["deliveries"][0]["attempt"] == 2
    })
    .await;
}

/// Tokens for the ACL tests of routes and Settings: one that only publishes to the `grpc_acl_` topics, one that
/// only reads them as the `g_acl_` groups, and one whose grants are all elsewhere.
const WRITER: (&str, &str) = ("acl-writer", "acl-writer-secret-0123456789");
const READER: (&str, &str) = ("acl-reader", "acl-reader-secret-0123456789");
const STRANGER: (&str, &str) = ("acl-stranger", "acl-stranger-secret-0123456789");

fn acl_tokens() -> String {
    let token = |(name, secret): (&str, &str), grants: &str| {
        format!("[[auth.tokens]]\nname = \"{name}\"\ntoken = \"{secret}\"\n{grants}\n")
    };
    [
        "[auth]\nenabled = true\n".to_owned(),
        token(WRITER, "publish = [\"grpc_acl_*\"]\nsubscribe = []"),
        token(READER, "consume = [\"g_acl_*\"]\nsubscribe = [\"grpc_acl_*\"]"),
        token(STRANGER, "publish = [\"other_*\"]\nconsume = [\"g_other_*\"]\nsubscribe = [\"other_*\"]"),
    ]
    .join("\n")
}

/// [`request`] signed by `token`, from a client of that token's own (a client id belongs to the token that first
/// used it).
fn signed_request<T>(message: T, token: (&str, &str)) -> tonic::Request<T> {
    let mut call = request(message, Some(token));
    call.metadata_mut().insert("x-mq-client-id", format!("it-acl@{}", token.0).parse().expect("ascii"));
    call
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_is_given_only_to_a_token_that_may_publish_to_or_read_the_topic() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, &acl_tokens()).await;
    let topic = unique_topic("grpc_acl_route");
    create_topic(cluster, &topic).await;
    let mut client = connect(&popgate).await;
    let endpoints = Some(pb::Endpoints {
        scheme: pb::AddressScheme::IPv4 as i32,
        addresses: vec![pb::Address { host: "127.0.0.1".into(), port: 8081 }],
    });
    let route = |topic: &str| pb::QueryRouteRequest { topic: resource(topic), endpoints: endpoints.clone() };

    for token in [WRITER, READER] {
        let answer = client.query_route(signed_request(route(&topic), token)).await.expect("call").into_inner();
        assert_eq!(code(answer.status.as_ref()), Code::Ok as i32, "{}: {answer:?}", token.0);
        assert!(!answer.message_queues.is_empty(), "{}: {answer:?}", token.0);
    }
    let forbidden_before = popgate.metric(r#"popgate_requests_rejected_total{reason="forbidden"}"#).await;
    // A token with no grant on the topic learns nothing of it: not its queues, nor whether it exists.
    for unseen in [topic.clone(), unique_topic("grpc_acl_missing")] {
        let answer = client.query_route(signed_request(route(&unseen), STRANGER)).await.expect("call").into_inner();
        assert_eq!(code(answer.status.as_ref()), Code::Unauthorized as i32, "{unseen}: {answer:?}");
        assert!(answer.message_queues.is_empty(), "{answer:?}");
        let said = answer.status.map(|s| s.message).unwrap_or_default();
        assert!(said.contains(&unseen), "the refusal names the topic: {said}");
    }
    let forbidden = popgate.metric(r#"popgate_requests_rejected_total{reason="forbidden"}"#).await - forbidden_before;
    assert_eq!(forbidden, 2.0, "both refusals counted");
}

/// Settings naming `group` as a SimpleConsumer's, subscribed to `topics`.
fn consumer_settings(group: &str, topics: &[&str]) -> pb::Settings {
    let entry = |topic: &&str| pb::SubscriptionEntry {
        topic: resource(topic),
        expression: Some(pb::FilterExpression { r#type: pb::FilterType::Tag as i32, expression: "*".into() }),
    };
    pb::Settings {
        client_type: Some(pb::ClientType::SimpleConsumer as i32),
        pub_sub: Some(pb::settings::PubSub::Subscription(pb::Subscription {
            group: resource(group),
            subscriptions: topics.iter().map(entry).collect(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Settings of a producer of `topics`.
fn producer_settings(topics: &[&str]) -> pb::Settings {
    pb::Settings {
        client_type: Some(pb::ClientType::Producer as i32),
        pub_sub: Some(pb::settings::PubSub::Publishing(pb::Publishing {
            topics: topics
                .iter()
                .map(|topic| pb::Resource { name: (*topic).to_owned(), ..Default::default() })
                .collect(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Sends `settings` on a new Telemetry stream signed by `token`: popgate's first answer, and whether popgate
/// ended the stream after it (the client's side stays open throughout).
async fn telemetry_answer(
    client: &mut MessagingServiceClient<Channel>,
    settings: pb::Settings,
    token: (&str, &str),
) -> (pb::TelemetryCommand, bool) {
    let (commands, outgoing) = tokio::sync::mpsc::channel(4);
    let command =
        pb::TelemetryCommand { status: None, command: Some(pb::telemetry_command::Command::Settings(settings)) };
    commands.send(command).await.expect("queue the settings");
    let stream = tokio_stream::wrappers::ReceiverStream::new(outgoing);
    let mut answers = client.telemetry(signed_request(stream, token)).await.expect("telemetry call").into_inner();
    let first = tokio::time::timeout(Duration::from_secs(30), answers.message())
        .await
        .expect("an answer within 30 s")
        .expect("the stream")
        .expect("an answer, not the stream's end");
    let ended = matches!(tokio::time::timeout(Duration::from_secs(3), answers.message()).await, Ok(Ok(None) | Err(_)));
    drop(commands);
    (first, ended)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_naming_a_group_or_topic_outside_the_tokens_grants_are_refused_and_end_the_stream() {
    let cluster = shared_cluster();
    let popgate = Popgate::start(&cluster.namesrv_addr, &acl_tokens()).await;
    let topic = unique_topic("grpc_acl_settings");
    let group = format!("g_acl_{topic}");
    let mut client = connect(&popgate).await;
    let other_topic = unique_topic("other_settings");

    // (case, token, settings, allowed): Sub on the group and on every topic subscribed; Pub on every topic published.
    let cases = [
        ("a reader announces its group on its topic", READER, consumer_settings(&group, &[&topic]), true),
        ("a stranger may not announce the group", STRANGER, consumer_settings(&group, &[&topic]), false),
        (
            "a reader's group on a topic it may not read",
            READER,
            consumer_settings(&group, &[&topic, &other_topic]),
            false,
        ),
        ("a reader as a group it may not consume as", READER, consumer_settings("g_other_x", &[&topic]), false),
        ("a writer announces its topic", WRITER, producer_settings(&[&topic]), true),
        (
            "a writer may not announce a topic it may not publish to",
            WRITER,
            producer_settings(&[&topic, &other_topic]),
            false,
        ),
        ("a stranger may not announce the topic", STRANGER, producer_settings(&[&topic]), false),
    ];
    let forbidden_before = popgate.metric(r#"popgate_requests_rejected_total{reason="forbidden"}"#).await;
    let mut wrong = String::new();
    for (case, token, settings, allowed) in cases {
        let (answer, ended) = telemetry_answer(&mut client, settings, token).await;
        let code = code(answer.status.as_ref());
        let as_expected = if allowed {
            code == Code::Ok as i32
                && matches!(answer.command, Some(pb::telemetry_command::Command::Settings(_)))
                && !ended
        } else {
            // As Apache's proxy answers: the status alone, then the stream's end.
            code == Code::Unauthorized as i32 && answer.command.is_none() && ended
        };
        if !as_expected {
            wrong.push_str(&format!("{case}: {answer:?}, stream ended: {ended}\n"));
        }
    }
    assert!(wrong.is_empty(), "Settings not decided as expected:\n{wrong}");
    let forbidden = popgate.metric(r#"popgate_requests_rejected_total{reason="forbidden"}"#).await - forbidden_before;
    assert_eq!(forbidden, 5.0, "each refusal counted once");
    // A refused client was never noted alive: only the two allowed ones are counted.
    let clients = popgate.metric(r#"popgate_grpc_clients{kind="simple_consumer"}"#).await
        + popgate.metric(r#"popgate_grpc_clients{kind="producer"}"#).await;
    assert_eq!(clients, 2.0, "{}", popgate.metrics_text().await);
}
