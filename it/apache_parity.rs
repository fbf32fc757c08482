//! popgate beside Apache's own RocketMQ 5 proxy, in front of one cluster: where the two make a choice a client
//! can see, they make the same one, so an application can move from one to the other (or use both during a
//! rolling migration) without losing anything.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use popgate::grpc::proto::{self as pb, messaging_service_client::MessagingServiceClient, Code};
use serde_json::json;

use crate::grpc_raw::request;
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

/// One message Apache's proxy refuses, and the code it answers.
struct Refused {
    what: &'static str,
    message: pb::Message,
    code: Code,
}

fn message_to(topic: &str, body: &str) -> pb::Message {
    pb::Message {
        topic: Some(pb::Resource { resource_namespace: String::new(), name: topic.to_owned() }),
        user_properties: Default::default(),
        system_properties: Some(pb::SystemProperties {
            message_id: format!("01{:030X}", rand::random::<u128>() >> 8),
            ..Default::default()
        }),
        body: body.as_bytes().to_vec().into(),
    }
}

fn refused_sends(topic: &str) -> Vec<Refused> {
    let with = |what, code, change: &dyn Fn(&mut pb::Message)| {
        let mut message = message_to(topic, what);
        change(&mut message);
        Refused { what, message, code }
    };
    fn system(m: &mut pb::Message) -> &mut pb::SystemProperties {
        m.system_properties.get_or_insert_with(Default::default)
    }
    let in_two_days = prost_types::Timestamp {
        seconds: (std::time::SystemTime::now() + Duration::from_secs(2 * 86_400))
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64),
        nanos: 0,
    };
    vec![
        with("tag with a bar", Code::IllegalMessageTag, &|m| system(m).tag = Some("a|b".into())),
        with("blank tag", Code::IllegalMessageTag, &|m| system(m).tag = Some("  ".into())),
        with("tag with a control character", Code::IllegalMessageTag, &|m| system(m).tag = Some("a\u{7}".into())),
        with("key with a control character", Code::IllegalMessageKey, &|m| system(m).keys = vec!["k\u{1}".into()]),
        with("blank key", Code::IllegalMessageKey, &|m| system(m).keys = vec![" ".into()]),
        with("129 user properties", Code::MessagePropertiesTooLarge, &|m| {
            m.user_properties = (0..129).map(|i| (format!("p{i}"), "v".to_owned())).collect();
        }),
        with("17 KiB of user properties", Code::MessagePropertiesTooLarge, &|m| {
            m.user_properties.insert("big".into(), "v".repeat(17 * 1024));
        }),
        with("reserved property", Code::IllegalMessagePropertyKey, &|m| {
            m.user_properties.insert("KEYS".into(), "v".into());
        }),
        // The keys popgate sets itself (the message id, a delivery time) are refused from the app too.
        with("UNIQ_KEY as a user property", Code::IllegalMessagePropertyKey, &|m| {
            m.user_properties.insert("UNIQ_KEY".into(), "mine".into());
        }),
        with("TIMER_DELIVER_MS as a user property", Code::IllegalMessagePropertyKey, &|m| {
            m.user_properties.insert("TIMER_DELIVER_MS".into(), "0".into());
        }),
        with("property value with a control character", Code::IllegalMessagePropertyKey, &|m| {
            m.user_properties.insert("p".into(), "v\u{0}".into());
        }),
        with("delivery two days ahead", Code::IllegalDeliveryTime, &|m| {
            system(m).delivery_timestamp = Some(in_two_days);
        }),
        with("message group of 64 bytes", Code::IllegalMessageGroup, &|m| {
            system(m).message_group = Some("g".repeat(64));
        }),
        with("no message id", Code::IllegalMessageId, &|m| system(m).message_id = String::new()),
        with("empty body", Code::MessageBodyEmpty, &|m| m.body = Vec::new().into()),
    ]
}

async fn send_raw(endpoint: &str, messages: Vec<pb::Message>) -> pb::SendMessageResponse {
    let mut client =
        MessagingServiceClient::connect(format!("http://{endpoint}")).await.expect("plaintext gRPC connection");
    let answer = client.send_message(request(pb::SendMessageRequest { messages }, None)).await;
    answer.expect("send call").into_inner()
}

/// The status a send was answered with: the first entry's, or the response's when it has no entries.
fn send_status(answer: &pb::SendMessageResponse) -> (i32, String) {
    let status = answer.entries.first().and_then(|e| e.status.clone()).or_else(|| answer.status.clone());
    status.map_or((0, String::new()), |s| (s.code, s.message))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_apaches_proxy_refuses_is_refused_by_popgate_with_the_same_code_and_words_over_grpc_and_http() {
    let cluster = shared_cluster();
    let topic = unique_topic("limits_parity");
    let other = unique_topic("limits_parity_other");
    crate::grpc::create_topic(cluster, &topic).await;
    crate::grpc::create_topic(cluster, &other).await;
    let popgate = crate::harness::popgate::Popgate::start(&cluster.namesrv_addr, "").await;
    let proxy = tokio::task::block_in_place(|| ApacheProxy::start(cluster));

    let mut cases: Vec<(String, Vec<pb::Message>, Code)> =
        refused_sends(&topic).into_iter().map(|r| (r.what.to_owned(), vec![r.message], r.code)).collect();
    cases.push(("no message".into(), Vec::new(), Code::MessageCorrupted));
    cases.push((
        "two topics in one request".into(),
        vec![message_to(&topic, "one"), message_to(&other, "two")],
        Code::MessageCorrupted,
    ));
    for (what, messages, code) in cases {
        let (apache_code, apache_words) = send_status(&send_raw(&proxy.endpoint, messages.clone()).await);
        let (popgate_code, popgate_words) = send_status(&send_raw(&popgate.grpc, messages).await);
        assert_eq!(apache_code, code as i32, "{what}: Apache's proxy answered {apache_code} {apache_words:?}");
        assert_eq!(popgate_code, apache_code, "{what}: popgate {popgate_words:?}, Apache {apache_words:?}");
        assert_eq!(popgate_words, apache_words, "{what}: the same words");
    }

    // popgate's HTTP front applies the same limits, naming the field.
    let props: serde_json::Map<String, serde_json::Value> = (0..129).map(|i| (format!("p{i}"), json!("v"))).collect();
    for (body, field, words) in [
        (json!({"topic": topic, "data": "x", "tags": "a|b"}), "tags", "tag cannot contain '|'"),
        (
            json!({"topic": topic, "data": "x", "properties": props}),
            "properties",
            "too many user properties, max is 128",
        ),
        (
            json!({"topic": topic, "data": "x", "delayMs": 2 * 86_400_000u64}),
            "delayMs",
            "the max delay time of message is too large, max is 86400000",
        ),
        (
            json!({"topic": topic, "data": "x", "messageGroup": "g".repeat(64)}),
            "messageGroup",
            "message group exceed the max size 64",
        ),
    ] {
        let (status, answer) = popgate.publish(&body).await;
        assert_eq!(status, 400, "{answer}");
        assert_eq!(answer["error"]["field"], field, "{answer}");
        assert_eq!(answer["error"]["message"], words, "{answer}");
    }

    // Nothing refused reached the broker, through either front.
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    assert_eq!(direct.read_all(&topic).await.len(), 0, "nothing stored");
    assert_eq!(direct.read_all(&other).await.len(), 0, "nothing stored");
}

/// A delivery time already past: Apache's proxy stores it (`TIMER_DELIVER_MS`; the broker keeps a past one as it
/// is and delivers the message at once), so the consumer sees it as a DELAY message with its delivery timestamp
/// (Apache's 5.x e2e suite fails with "DeliveryTimestamp is empty" otherwise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_time_already_past_is_stored_and_received_as_through_apaches_proxy() {
    let cluster = shared_cluster();
    let topic = unique_topic("past_delivery");
    // One broker, so the receive names it; typed DELAY, which Apache's proxy checks.
    let broker = &cluster.brokers[0];
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    direct.create_delay_topic(&topic, &[format!("127.0.0.1:{}", broker.port)]).await;
    let popgate = crate::harness::popgate::Popgate::start(&cluster.namesrv_addr, "").await;
    let proxy = tokio::task::block_in_place(|| ApacheProxy::start(cluster));

    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let a_minute_ago_ms = i64::try_from(now_ms).expect("ms fit") - 60_000;
    let past = prost_types::Timestamp {
        seconds: a_minute_ago_ms / 1000,
        nanos: i32::try_from(a_minute_ago_ms % 1000).expect("ms") * 1_000_000,
    };
    for (front, endpoint) in [("apache", &proxy.endpoint), ("popgate", &popgate.grpc)] {
        let mut message = message_to(&topic, front);
        message.system_properties.get_or_insert_with(Default::default).delivery_timestamp = Some(past);
        let answer = send_raw(endpoint, vec![message]).await;
        assert_eq!(send_status(&answer).0, Code::Ok as i32, "{front}: {answer:?}");
    }
    let stored = read_at_least(&direct, &topic, 2).await;
    assert_eq!(stored.len(), 2, "both stored at once");
    for message in &stored {
        let front = String::from_utf8_lossy(&message.body);
        let deliver_at = message.properties.get("TIMER_DELIVER_MS");
        assert_eq!(deliver_at, Some(&a_minute_ago_ms.to_string()), "sent through {front}: {:?}", message.properties);
    }

    let mut client = crate::grpc_raw::connect(&popgate).await;
    let received = receive_raw(&mut client, &format!("g_{topic}"), &topic, &broker.name, 2).await;
    assert_eq!(received.len(), 2, "{received:#?}");
    for message in &received {
        let system = message.system_properties.clone().unwrap_or_default();
        assert_eq!(system.delivery_timestamp, Some(past), "{message:?}");
        assert_eq!(system.message_type, pb::MessageType::Delay as i32, "{message:?}");
    }
}

/// A request with the headers the official SDKs send (Apache's proxy reads the client's language from them).
fn sdk_request<T>(message: T) -> tonic::Request<T> {
    let mut call = request(message, None);
    let metadata = call.metadata_mut();
    metadata.insert("x-mq-language", "JAVA".parse().expect("ascii"));
    metadata.insert("x-mq-client-version", "5.2.0".parse().expect("ascii"));
    metadata.insert("x-mq-protocol", "v2".parse().expect("ascii"));
    call
}

/// A raw client's Settings for Apache's proxy, which serves a receive only to a client that sent them (its
/// Telemetry stream stays open while the returned sender lives).
async fn settle_settings(
    client: &mut MessagingServiceClient<tonic::transport::Channel>,
    endpoint: &str,
    group: &str,
    topic: &str,
) -> tokio::sync::mpsc::Sender<pb::TelemetryCommand> {
    let resource = |name: &str| Some(pb::Resource { resource_namespace: String::new(), name: name.to_owned() });
    let (host, port) = endpoint.rsplit_once(':').expect("host:port");
    let settings = pb::Settings {
        client_type: Some(pb::ClientType::SimpleConsumer as i32),
        access_point: Some(pb::Endpoints {
            scheme: pb::AddressScheme::IPv4 as i32,
            addresses: vec![pb::Address { host: host.to_owned(), port: port.parse().expect("port") }],
        }),
        request_timeout: Some(prost_types::Duration { seconds: 3, nanos: 0 }),
        pub_sub: Some(pb::settings::PubSub::Subscription(pb::Subscription {
            group: resource(group),
            subscriptions: vec![pb::SubscriptionEntry {
                topic: resource(topic),
                expression: Some(pb::FilterExpression { r#type: pb::FilterType::Tag as i32, expression: "*".into() }),
            }],
            fifo: Some(false),
            ..Default::default()
        })),
        user_agent: Some(pb::Ua { language: pb::Language::Java as i32, version: "5.2.0".into(), ..Default::default() }),
        ..Default::default()
    };
    let (commands, outgoing) = tokio::sync::mpsc::channel(4);
    let command =
        pb::TelemetryCommand { status: None, command: Some(pb::telemetry_command::Command::Settings(settings)) };
    commands.send(command).await.expect("queue the settings");
    let stream = tokio_stream::wrappers::ReceiverStream::new(outgoing);
    let mut answers = client.telemetry(sdk_request(stream)).await.expect("telemetry call").into_inner();
    let first = tokio::time::timeout(Duration::from_secs(30), answers.message()).await;
    assert!(matches!(first, Ok(Ok(Some(_)))), "the proxy answered the settings: {first:?}");
    tokio::spawn(async move { while let Ok(Some(_)) = answers.message().await {} });
    commands
}

/// Receives from `endpoint` until `count` messages came (or 60 s passed), acking none.
async fn receive_raw(
    client: &mut MessagingServiceClient<tonic::transport::Channel>,
    group: &str,
    topic: &str,
    broker: &str,
    count: usize,
) -> Vec<pb::Message> {
    let resource = |name: &str| Some(pb::Resource { resource_namespace: String::new(), name: name.to_owned() });
    let mut messages = Vec::new();
    let started = std::time::Instant::now();
    let deadline = started + Duration::from_secs(60);
    while messages.len() < count && std::time::Instant::now() < deadline {
        let receive = pb::ReceiveMessageRequest {
            group: resource(group),
            message_queue: Some(pb::MessageQueue {
                topic: resource(topic),
                id: -1,
                broker: Some(pb::Broker { name: broker.to_owned(), ..Default::default() }),
                ..Default::default()
            }),
            filter_expression: Some(pb::FilterExpression {
                r#type: pb::FilterType::Tag as i32,
                expression: "*".into(),
            }),
            batch_size: 32,
            invisible_duration: Some(prost_types::Duration { seconds: 60, nanos: 0 }),
            long_polling_timeout: Some(prost_types::Duration { seconds: 5, nanos: 0 }),
            ..Default::default()
        };
        let mut call = sdk_request(receive);
        call.set_timeout(Duration::from_secs(15));
        let mut stream = client.receive_message(call).await.expect("receive call").into_inner();
        // What each receive ended with, for a failure's output (a receive that hands out nothing says why here).
        loop {
            match stream.message().await {
                Ok(Some(item)) => match item.content {
                    Some(pb::receive_message_response::Content::Message(message)) => messages.push(message),
                    Some(pb::receive_message_response::Content::Status(status)) if status.code != Code::Ok as i32 => {
                        println!("receive of {group}: status {} {:?}", status.code, status.message);
                    }
                    _ => {}
                },
                Ok(None) => break,
                Err(failed) => {
                    println!("receive of {group}: {failed:?}");
                    break;
                }
            }
        }
    }
    println!("receive of {group}: {} of {count} in {:?}", messages.len(), started.elapsed());
    messages
}

/// What must match between the two fronts: everything but the handle (each front's own) and the time left to
/// settle it (popgate reports it; Apache's proxy leaves it out).
fn comparable(message: &pb::Message) -> pb::Message {
    let mut message = message.clone();
    if let Some(system) = message.system_properties.as_mut() {
        system.receipt_handle = None;
        system.invisible_duration = None;
    }
    message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_received_message_carries_the_system_properties_apaches_proxy_gives_the_same_stored_message() {
    let cluster = shared_cluster();
    let topic = unique_topic("props_parity");
    // One broker, so both fronts' receives name it.
    let broker = &cluster.brokers[0];
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    direct.create_topic(&topic, &[format!("127.0.0.1:{}", broker.port)]).await;
    let popgate = crate::harness::popgate::Popgate::start(&cluster.namesrv_addr, "").await;
    let proxy = tokio::task::block_in_place(|| ApacheProxy::start(cluster));
    let (apache_group, popgate_group) = (format!("ga_{topic}"), format!("gp_{topic}"));

    let mut apache = MessagingServiceClient::connect(format!("http://{}", proxy.endpoint)).await.expect("connect");
    let _settings = settle_settings(&mut apache, &proxy.endpoint, &apache_group, &topic).await;
    // Apache's proxy starts a new group at the end of the queue: one empty receive first, so the group's
    // offset is set before anything is published.
    let _nothing_yet = receive_raw(&mut apache, &apache_group, &topic, &broker.name, 1).await;

    let in_two_seconds = json!({"topic": topic, "data": "timer", "delayMs": 2_000});
    for body in [
        json!({"topic": topic, "data": "tagged", "tags": "TagA", "keys": ["k1", "k2"],
            "properties": {"color": "red", "TRACE_CONTEXT": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}),
        json!({"topic": topic, "data": "grouped", "messageGroup": "order-7"}),
        in_two_seconds,
    ] {
        let (status, answer) = popgate.publish(&body).await;
        assert_eq!(status, 200, "{answer}");
    }

    let from_apache = receive_raw(&mut apache, &apache_group, &topic, &broker.name, 3).await;
    let mut client = crate::grpc_raw::connect(&popgate).await;
    let from_popgate = receive_raw(&mut client, &popgate_group, &topic, &broker.name, 3).await;
    let by_id = |messages: &[pb::Message]| -> BTreeMap<String, pb::Message> {
        messages
            .iter()
            .map(|m| (m.system_properties.as_ref().map(|p| p.message_id.clone()).unwrap_or_default(), comparable(m)))
            .collect()
    };
    let (apache, popgate) = (by_id(&from_apache), by_id(&from_popgate));
    assert_eq!(apache.len(), 3, "Apache's proxy handed out the three: {from_apache:#?}");
    assert_eq!(popgate.keys().collect::<Vec<_>>(), apache.keys().collect::<Vec<_>>(), "the same messages");
    for (id, expected) in &apache {
        let got = &popgate[id];
        assert_eq!(got.system_properties, expected.system_properties, "system properties of {id}");
        assert_eq!(got.user_properties, expected.user_properties, "user properties of {id}");
        assert_eq!(got.body, expected.body, "body of {id}");
    }
    // Not a vacuous match: the fields Apache's proxy fills are there.
    let types: BTreeSet<i32> =
        apache.values().filter_map(|m| m.system_properties.as_ref()).map(|p| p.message_type).collect();
    let expected_types = [pb::MessageType::Normal, pb::MessageType::Fifo, pb::MessageType::Delay];
    assert_eq!(types, expected_types.iter().map(|t| *t as i32).collect(), "{apache:#?}");
    for system in popgate.values().filter_map(|m| m.system_properties.as_ref()) {
        assert!(!system.store_host.is_empty() && !system.born_host.is_empty(), "{system:?}");
        assert!(system.store_timestamp.is_some() && system.queue_offset.is_some(), "{system:?}");
    }
}
