//! The remoting front against hostile or careless clients, by raw frames: connections that go quiet, send a
//! frame a byte at a time, or pipeline requests without reading the answers; and signed requests that reach for
//! another token's groups, transactions and client ids. Each case asserts the answer a RocketMQ client expects
//! and that nothing changed at the brokers, read straight from them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use base64::Engine;
use hmac::{Hmac, Mac};
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::direct::Direct;
use crate::harness::rocketmq::Cluster;
use crate::harness::{eventually, unique_topic};
use crate::publish::shared_cluster;
use crate::remoting::{
    ask, consumer_heartbeat, create_topic, popgate_with_remoting, raw_request, read_answer, send, stored_bodies,
};

/// Response codes the cases expect (`ResponseCode`).
const SUCCESS: i32 = 0;
const SYSTEM_BUSY: i32 = 2;
const MESSAGE_ILLEGAL: i32 = 13;
const NO_PERMISSION: i32 = 16;

/// The app whose groups, transactions and client ids the cases reach for, and the app that reaches for them.
const VICTIM: (&str, &str) = ("hv-app", "hv-app-secret-0123456789");
const STRANGER: (&str, &str) = ("hs-app", "hs-app-secret-0123456789");

fn tokens_toml() -> String {
    format!(
        "[auth]\nenabled = true\n\n\
         [[auth.tokens]]\nname = \"{}\"\ntoken = \"{}\"\npublish = [\"hv_*\"]\nconsume = [\"hv_*\"]\n\n\
         [[auth.tokens]]\nname = \"{}\"\ntoken = \"{}\"\npublish = [\"hs_*\"]\nconsume = [\"hs_*\"]\n",
        VICTIM.0, VICTIM.1, STRANGER.0, STRANGER.1
    )
}

/// `request` signed as Apache's `AclClientRPCHook` signs it: its `AccessKey` added, then the HMAC-SHA1 of every
/// header field's value by field name, then the body, keyed by the secret, in base64.
pub(crate) fn signed(mut request: RemotingCommand, (access_key, secret): (&str, &str)) -> RemotingCommand {
    request.add_ext_field("AccessKey", access_key);
    let fields: BTreeMap<String, String> =
        request.ext_fields().into_iter().flatten().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let mut mac = Hmac::<sha1::Sha1>::new_from_slice(secret.as_bytes()).expect("hmac key");
    for value in fields.values() {
        mac.update(value.as_bytes());
    }
    if let Some(body) = request.body() {
        mac.update(body);
    }
    let signature = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    request.add_ext_field("Signature", signature);
    request
}

pub(crate) fn field(answer: &RemotingCommand, name: &str) -> String {
    answer.ext_fields().and_then(|f| f.get(name)).map(|v| v.to_string()).unwrap_or_default()
}

/// A `SEND_MESSAGE_V2` of a 5.x client to queue 0 of `broker`, with `properties` (name, value) beside its id;
/// and that id (`UNIQ_KEY`).
pub(crate) fn raw_send(
    topic: &str,
    broker: &str,
    body: &str,
    sys_flag: i32,
    properties: &[(&str, &str)],
) -> (RemotingCommand, String) {
    let uniq_key = format!("7F0000010000{:020X}", rand::random::<u64>());
    (raw_send_keyed(topic, broker, body, sys_flag, properties, &uniq_key), uniq_key)
}

/// [`raw_send`] with `uniq_key` as the message's id (a client sending the same `Message` again keeps its id).
pub(crate) fn raw_send_keyed(
    topic: &str,
    broker: &str,
    body: &str,
    sys_flag: i32,
    properties: &[(&str, &str)],
    uniq_key: &str,
) -> RemotingCommand {
    let mut encoded = format!("UNIQ_KEY\u{1}{uniq_key}\u{2}WAIT\u{1}true\u{2}");
    for (name, value) in properties {
        encoded.push_str(&format!("{name}\u{1}{value}\u{2}"));
    }
    let sys_flag = sys_flag.to_string();
    let mut send = RemotingCommand::create_remoting_command(310).set_body(body.as_bytes().to_vec());
    for (name, value) in [
        ("a", "hv_pg"),
        ("b", topic),
        ("c", "TBW102"),
        ("d", "4"),
        ("e", "0"),
        ("f", sys_flag.as_str()),
        ("g", "1796000000000"),
        ("h", "0"),
        ("i", encoded.as_str()),
        ("j", "0"),
        ("k", "false"),
        ("m", "false"),
        ("n", broker),
    ] {
        send.add_ext_field(name, value);
    }
    send
}

/// A message stored straight at `broker` (no popgate between): its answer, and its commit-log offset (the last
/// 16 hex digits of the broker's offset message id).
async fn stored_straight_at(cluster: &Cluster, broker: usize, request: RemotingCommand) -> (RemotingCommand, i64) {
    let mut stream = TcpStream::connect(("127.0.0.1", cluster.brokers[broker].port)).await.expect("connect");
    let answer = ask(&mut stream, request).await.expect("the broker answers");
    assert_eq!(answer.code(), SUCCESS, "stored straight at the broker: {:?}", answer.remark());
    let offset = commit_log_offset(&answer);
    (answer, offset)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_may_not_touch_another_tokens_groups_transactions_or_client_ids() {
    let cluster = shared_cluster();
    // `max_clients` before the tokens: the line goes into the `[remoting]` section.
    let (popgate, namesrv) = popgate_with_remoting(cluster, &format!("max_clients = 3\n{}", tokens_toml())).await;
    let plain_topic = unique_topic("hv_plain");
    let tx_topic = unique_topic("hv_tx");
    let victim_group = unique_topic("hv_g");
    create_topic(cluster, &plain_topic).await;
    crate::transaction::create_transaction_topic(cluster, &tx_topic).await;
    let broker = cluster.brokers[0].name.clone();

    // The victim's message, and its half message, stored straight at the broker: popgate has no record of them.
    let (plain, _) = raw_send(&plain_topic, &broker, "plain", 0, &[]);
    let (_, plain_offset) = stored_straight_at(cluster, 0, plain).await;
    // sysFlag 4: TRANSACTION_PREPARED_TYPE.
    let (half, half_id) = raw_send(&tx_topic, &broker, "half", 4, &[("TRAN_MSG", "true"), ("PGROUP", "hv_pg")]);
    let (half_answer, half_offset) = stored_straight_at(cluster, 0, half).await;
    let end = |topic: &str| {
        raw_request(
            37,
            &[
                ("producerGroup", "hv_pg"),
                ("tranStateTableOffset", &field(&half_answer, "queueOffset")),
                ("commitLogOffset", &half_offset.to_string()),
                ("commitOrRollback", "8"),
                ("fromTransactionCheck", "false"),
                ("msgId", &half_id),
                ("topic", topic),
                ("bname", &broker),
            ],
        )
    };

    // The victim's consumer registers its client id.
    let mut victim = TcpStream::connect(&namesrv).await.expect("connect");
    let joined = ask(&mut victim, signed(consumer_heartbeat("victim@1", &victim_group, &plain_topic), VICTIM)).await;
    assert_eq!(joined.map(|a| a.code()), Some(SUCCESS));

    // Each case: what the stranger sends (signed with its own token, or not at all), and why it must be refused.
    let offset = plain_offset.to_string();
    let send_back = raw_request(
        36,
        &[
            ("offset", &offset),
            ("group", &victim_group),
            // Its own group where popgate used to look, the victim's where the broker acts.
            ("consumerGroup", "hs_g"),
            ("delayLevel", "0"),
            ("originTopic", &plain_topic),
            ("maxReconsumeTimes", "16"),
            ("bname", &broker),
        ],
    );
    let check_config = RemotingCommand::create_remoting_command(46).set_body(
        json!({"clientId": "s@1", "group": victim_group, "subscriptionData": {"topic": plain_topic,
            "subString": "*", "expressionType": "TAG"}})
        .to_string()
        .into_bytes(),
    );
    let unsigned_commit = raw_request(
        15,
        &[("topic", &plain_topic), ("consumerGroup", &victim_group), ("queueId", "0"), ("commitOffset", "1000")],
    );
    let cases: Vec<(&str, RemotingCommand)> = vec![
        ("a send-back into the victim's retry topic", signed(send_back, STRANGER)),
        ("an end of the victim's half message, naming the victim's topic", signed(end(&tx_topic), STRANGER)),
        ("an end of the victim's half message, naming a topic of its own", signed(end("hs_lie"), STRANGER)),
        ("a heartbeat under the victim's client id", signed(consumer_heartbeat("victim@1", "hs_g", "hs_t"), STRANGER)),
        (
            "an unregistration of the victim's client from the victim's group",
            signed(raw_request(35, &[("clientID", "victim@1"), ("consumerGroup", &victim_group)]), STRANGER),
        ),
        (
            "an unregistration of the victim's client from a group of its own",
            signed(raw_request(35, &[("clientID", "victim@1"), ("consumerGroup", "hs_g")]), STRANGER),
        ),
        ("a check of the victim group's subscription", signed(check_config, STRANGER)),
        ("an unsigned offset commit in the victim's group", unsigned_commit),
    ];
    let mut stranger = TcpStream::connect(&namesrv).await.expect("connect");
    let mut let_through = Vec::new();
    for (case, request) in cases {
        let answer = ask(&mut stranger, request).await.expect("answered, the connection kept");
        if answer.code() != NO_PERMISSION {
            let_through.push(format!("{case}: code {} {:?}", answer.code(), answer.remark()));
        }
    }
    assert!(let_through.is_empty(), "refused with NO_PERMISSION, each of:\n{}", let_through.join("\n"));

    // Nothing changed at the brokers: no copy in the victim's retry topic, the half message not committed, the
    // victim's offset not moved; and the victim's client is still its group's member.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(stored_bodies(cluster, &format!("%RETRY%{victim_group}")).await.is_empty(), "nothing copied");
    assert!(stored_bodies(cluster, &tx_topic).await.is_empty(), "the half message is not committed");
    let offsets = Direct::connect(&cluster.namesrv_addr).await.consumer_offsets(&victim_group, &plain_topic).await;
    assert!(offsets.unwrap_or_default().values().all(|o| *o != 1000), "the victim's offset did not move");
    let members = ask(&mut victim, signed(raw_request(38, &[("consumerGroup", &victim_group)]), VICTIM)).await;
    let members = members.and_then(|a| a.body().map(|b| String::from_utf8_lossy(b).into_owned())).unwrap_or_default();
    assert!(members.contains("victim@1"), "still a member: {members}");

    // The victim itself ends its half message through popgate: the look-up finds its topic, the end lands.
    let ended = ask(&mut victim, signed(end(&tx_topic), VICTIM)).await.expect("answered");
    assert_eq!(ended.code(), SUCCESS, "{:?}", ended.remark());
    eventually(Duration::from_secs(20), "the victim's commit lands", || async {
        stored_bodies(cluster, &tx_topic).await == ["half"]
    })
    .await;

    // The message limits hold for remoting sends too: 129 user properties are refused, nothing is stored.
    let own_topic = unique_topic("hs_t");
    create_topic(cluster, &own_topic).await;
    let many: Vec<(String, String)> = (0..129).map(|i| (format!("p{i}"), "v".to_owned())).collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (crowded, _) = raw_send(&own_topic, &broker, "many", 0, &many);
    let answer = ask(&mut stranger, signed(crowded, STRANGER)).await;
    let answer = answer.expect("answered");
    assert_eq!(answer.code(), MESSAGE_ILLEGAL, "{:?}", answer.remark());
    assert_eq!(answer.remark().map(|r| r.to_string()), Some("too many user properties, max is 128".to_owned()));

    // At most `max_clients` (3 here) client ids are kept: the victim's, two of the stranger's, then no more.
    for (id, expected) in [("s@1", SUCCESS), ("s@2", SUCCESS), ("s@3", SYSTEM_BUSY)] {
        let answer = ask(&mut stranger, signed(consumer_heartbeat(id, "hs_g", &own_topic), STRANGER)).await;
        assert_eq!(answer.map(|a| a.code()), Some(expected), "{id}");
    }
    assert!(
        stored_bodies(cluster, &own_topic).await.is_empty(),
        "nothing stored: {:?}",
        stored_bodies(cluster, &own_topic).await
    );
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"forbidden\"}").await >= 6.0);
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"too_many_clients\"}").await >= 1.0);
}

/// Whether popgate closed `stream` (a read returns nothing) within `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buffer = [0u8; 4096];
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            _ => {}
        }
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_slow_and_unread_connections_are_closed_and_pipelined_frames_wait_for_their_turn() {
    let cluster = shared_cluster();
    let limits = "idle_timeout_secs = 2\nmax_requests_per_connection = 8\n";
    let (popgate, namesrv) = popgate_with_remoting(cluster, limits).await;
    let topic = unique_topic("rm_flood");
    create_topic(cluster, &topic).await;

    // One byte, then nothing: closed after the idle timeout, not kept forever.
    let mut quiet = TcpStream::connect(&namesrv).await.expect("connect");
    quiet.write_all(&[0]).await.expect("write");
    assert!(closed_within(&mut quiet, Duration::from_secs(15)).await, "a quiet connection is closed");

    // A frame sent a byte a second never completes: closed as idle too, while it is still sending.
    let mut slow = TcpStream::connect(&namesrv).await.expect("connect");
    slow.write_all(&100u32.to_be_bytes()).await.expect("write");
    let started = Instant::now();
    let mut closed = false;
    while started.elapsed() < Duration::from_secs(15) && !closed {
        if slow.write_all(&[0]).await.is_err() {
            closed = true;
            break;
        }
        closed = closed_within(&mut slow, Duration::from_secs(1)).await;
    }
    assert!(closed, "a frame trickled byte by byte is not waited for forever");
    eventually(Duration::from_secs(10), "both counted as idle", || async {
        popgate.metric("popgate_remoting_connections_closed_total{reason=\"idle\"}").await >= 2.0
    })
    .await;

    // 100 000 route queries in one stream, no answer read: popgate stops reading the connection at 8 requests
    // in flight, and closes it once its answers cannot be written; its memory stays flat.
    let rss_before = popgate.rss_kib();
    let mut route = RemotingCommand::create_remoting_command(105);
    route.add_ext_field("topic", topic.as_str());
    let frame =
        rocketmq_protocol::protocol::encoded_frame::EncodedFrame::from_command(route).expect("encodes").into_bytes();
    let mut flood = Vec::with_capacity(frame.len() * 100_000);
    for _ in 0..100_000 {
        flood.extend_from_slice(&frame);
    }
    let mut flooder = TcpStream::connect(&namesrv).await.expect("connect");
    let writing = tokio::spawn(async move {
        // Blocks once popgate stops reading; ends when popgate closes the connection.
        let _ = tokio::time::timeout(Duration::from_secs(60), flooder.write_all(&flood)).await;
        flooder
    });
    let mut most_in_flight = 0.0f64;
    let mut everyone_else = Duration::ZERO;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        most_in_flight = most_in_flight.max(popgate.metric("popgate_remoting_requests_in_flight").await);
        // Another client is served meanwhile.
        let started = Instant::now();
        let mut other = TcpStream::connect(&namesrv).await.expect("connect");
        let mut route = RemotingCommand::create_remoting_command(105);
        route.add_ext_field("topic", topic.as_str());
        assert_eq!(ask(&mut other, route).await.map(|a| a.code()), Some(SUCCESS), "another client is served");
        everyone_else = everyone_else.max(started.elapsed());
    }
    println!("most requests in flight {most_in_flight}, slowest other client {everyone_else:?}");
    assert!(most_in_flight <= 8.0 + 1.0, "at most 8 of the flood (and the other client's 1) at once: {most_in_flight}");
    assert!(popgate.metric("popgate_remoting_reads_paused_total").await >= 1.0, "the reader waited");
    eventually(Duration::from_secs(30), "the connection that reads no answers is closed", || async {
        popgate.metric("popgate_remoting_connections_closed_total{reason=\"not_reading\"}").await >= 1.0
    })
    .await;
    let mut flooder = writing.await.expect("the writer ends");
    assert!(closed_within(&mut flooder, Duration::from_secs(10)).await, "closed by popgate");
    let rss_after = popgate.rss_kib();
    println!("popgate RSS {rss_before} KiB before the flood, {rss_after} KiB after");
    assert!(rss_after < rss_before + 64 * 1024, "RSS grew by less than 64 MiB: {rss_before} -> {rss_after} KiB");
    eventually(Duration::from_secs(10), "nothing left in flight", || async {
        popgate.metric("popgate_remoting_requests_in_flight").await == 0.0
    })
    .await;

    // The front serves a well-behaved client as before.
    let mut after = TcpStream::connect(&namesrv).await.expect("connect");
    send(&mut after, raw_request(38, &[("consumerGroup", "rm_flood_g")])).await;
    assert!(read_answer(&mut after).await.is_some(), "served");
}

/// Two tokens whose topics are scoped (`subscribe`): each reads only its own topics, as its own groups.
fn scoped_tokens_toml() -> String {
    format!(
        "[auth]\nenabled = true\n\n\
         [[auth.tokens]]\nname = \"{}\"\ntoken = \"{}\"\npublish = [\"sv_*\"]\nconsume = [\"sv_*\"]\nsubscribe = [\"sv_*\"]\n\n\
         [[auth.tokens]]\nname = \"{}\"\ntoken = \"{}\"\npublish = [\"ss_*\"]\nconsume = [\"ss_*\"]\nsubscribe = [\"ss_*\"]\n",
        VICTIM.0, VICTIM.1, STRANGER.0, STRANGER.1
    )
}

/// Issue #46: a send-back names its message only by its commit-log offset, and the broker copies whatever is stored
/// there into the group's retry topic, which the group's consumers pull. popgate relays with the cluster's
/// credentials, so without a look at that message any token could read any topic by walking offsets with a
/// group of its own. A topic's queue offsets likewise need a grant on the topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_reads_no_other_tokens_topic_through_a_send_back_or_an_offset_query() {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, &scoped_tokens_toml()).await;
    let (victim_topic, own_topic) = (unique_topic("sv_t"), unique_topic("ss_t"));
    let stranger_group = unique_topic("ss_g");
    create_topic(cluster, &victim_topic).await;
    create_topic(cluster, &own_topic).await;
    let broker = cluster.brokers[0].name.clone();
    let (victim_message, _) = raw_send(&victim_topic, &broker, "the victim's secret", 0, &[]);
    let (_, victim_offset) = stored_straight_at(cluster, 0, victim_message).await;
    let (own_message, _) = raw_send(&own_topic, &broker, "the stranger's own", 0, &[]);
    let (_, own_offset) = stored_straight_at(cluster, 0, own_message).await;

    let mut stranger = TcpStream::connect(&namesrv).await.expect("connect");
    let joined = ask(&mut stranger, signed(consumer_heartbeat("s@1", &stranger_group, &own_topic), STRANGER)).await;
    assert_eq!(joined.map(|a| a.code()), Some(SUCCESS));
    let send_back = |offset: i64| {
        let offset = offset.to_string();
        let fields = [
            ("offset", offset.as_str()),
            ("group", stranger_group.as_str()),
            ("delayLevel", "1"),
            // What the client says the message's topic is: the broker does not read it, neither does popgate.
            ("originTopic", own_topic.as_str()),
            ("maxReconsumeTimes", "16"),
            ("bname", broker.as_str()),
        ];
        signed(raw_request(36, &fields), STRANGER)
    };
    let walked = ask(&mut stranger, send_back(victim_offset)).await.expect("answered");
    assert_eq!(walked.code(), NO_PERMISSION, "the victim's message: {:?}", walked.remark());
    let remark = walked.remark().map(ToString::to_string).unwrap_or_default();
    assert!(remark.contains(&victim_topic), "the refusal names the message's topic: {remark}");
    let own = ask(&mut stranger, send_back(own_offset)).await.expect("answered");
    assert_eq!(own.code(), SUCCESS, "its own message: {:?}", own.remark());
    let nowhere = ask(&mut stranger, send_back(own_offset + 1_000_000_000)).await.expect("answered");
    assert_ne!(nowhere.code(), SUCCESS, "an offset with no message: {:?}", nowhere.remark());

    // The queue offsets of a topic: only with a grant on it (ACL 2.0's `Get`).
    for (code, name) in [(30, "GET_MAX_OFFSET"), (31, "GET_MIN_OFFSET"), (32, "GET_EARLIEST_MSG_STORETIME")] {
        let offsets_of = |topic: &str| {
            signed(raw_request(code, &[("topic", topic), ("queueId", "0"), ("bname", &broker)]), STRANGER)
        };
        let refused = ask(&mut stranger, offsets_of(&victim_topic)).await.map(|a| a.code());
        assert_eq!(refused, Some(NO_PERMISSION), "{name} of the victim's topic");
        let answered = ask(&mut stranger, offsets_of(&own_topic)).await.map(|a| a.code());
        assert_eq!(answered, Some(SUCCESS), "{name} of its own topic");
    }

    // A producer group is the token's whose client registered it first: the stranger cannot claim the victim's
    // (its check-backs carry the victim's half messages).
    let producer = |id: &str, group: &str| {
        let body = json!({"clientID": id, "producerDataSet": [{"groupName": group}], "consumerDataSet": []});
        RemotingCommand::create_remoting_command(34).set_body(body.to_string().into_bytes())
    };
    let mut victim = TcpStream::connect(&namesrv).await.expect("connect");
    let registered = ask(&mut victim, signed(producer("v@1", "sv_pg"), VICTIM)).await.map(|a| a.code());
    assert_eq!(registered, Some(SUCCESS));
    let claimed = ask(&mut stranger, signed(producer("s@2", "sv_pg"), STRANGER)).await.expect("answered");
    assert_eq!(claimed.code(), NO_PERMISSION, "another token's producer group: {:?}", claimed.remark());

    // The stranger's retry topic gets its own message (delay level 1: 1 s), never the victim's.
    let retry_topic = format!("%RETRY%{stranger_group}");
    eventually(Duration::from_secs(60), "the stranger's own message is in its retry topic", || async {
        !stored_bodies(cluster, &retry_topic).await.is_empty()
    })
    .await;
    assert_eq!(stored_bodies(cluster, &retry_topic).await, ["the stranger's own"], "nothing of the victim's");
    assert!(popgate.metric("popgate_requests_rejected_total{reason=\"forbidden\"}").await >= 4.0);
}

/// A batch body as Apache's client encodes one (`MessageDecoder.encodeMessages`), of `bodies`, no properties.
fn batch_body(bodies: &[&[u8]]) -> Vec<u8> {
    let mut encoded = Vec::new();
    for body in bodies {
        let total = i32::try_from(4 + 4 + 4 + 4 + 4 + body.len() + 2).expect("small");
        for word in [total, 0, 0, 0, i32::try_from(body.len()).expect("small")] {
            encoded.extend_from_slice(&word.to_be_bytes());
        }
        encoded.extend_from_slice(body);
        encoded.extend_from_slice(&0i16.to_be_bytes());
    }
    encoded
}

/// Issue #46: what Apache's client refuses before sending (`Validators.checkMessage`: an empty body, one over the
/// size limit; each message of a batch) popgate refuses too, with the client's words, before any broker sees it;
/// a message the broker itself refuses is the message's fault, not the broker's: it isolates no broker, so the
/// next sends of every other app go where they would have gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remoting_send_is_checked_as_apaches_client_checks_it_and_a_refused_one_isolates_no_broker() {
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_checked");
    create_topic(cluster, &topic).await;
    let broker = cluster.brokers[0].name.clone();
    let mut client = TcpStream::connect(&namesrv).await.expect("connect");

    // The broker refuses a send to its schedule topic (NO_PERMISSION): the broker is well all the same, and
    // the next send placed there is taken (it used to be refused SERVICE_NOT_AVAILABLE for 10 min).
    let (forbidden, _) = raw_send("SCHEDULE_TOPIC_XXXX", &broker, "x", 0, &[]);
    let refused = ask(&mut client, forbidden).await.expect("answered");
    assert_eq!(refused.code(), NO_PERMISSION, "{:?}", refused.remark());
    let isolations = format!("popgate_broker_isolations_total{{broker=\"{broker}\",cause=\"unreachable\"}}");
    assert_eq!(popgate.metric(&isolations).await, 0.0, "a refused message isolates no broker");
    let (next, _) = raw_send(&topic, &broker, "next", 0, &[]);
    let next = ask(&mut client, next).await.expect("answered");
    assert_eq!(next.code(), SUCCESS, "the next send to that broker: {:?}", next.remark());

    let (empty, _) = raw_send(&topic, &broker, "", 0, &[]);
    let (mut large, _) = raw_send(&topic, &broker, "", 0, &[]);
    large = large.set_body(vec![b'x'; 4 * 1024 * 1024 + 1]);
    let (single, _) = raw_send(&topic, &broker, "", 0, &[]);
    let batch_of = |bodies: &[&[u8]]| {
        let mut batch = RemotingCommand::create_remoting_command(320).set_body(batch_body(bodies));
        for (name, value) in single.ext_fields().into_iter().flatten() {
            batch.add_ext_field(name.as_str(), if name.as_str() == "m" { "true" } else { value.as_str() });
        }
        batch
    };
    let cases = [
        ("an empty body", empty, "the message body length is zero"),
        ("a body over 4 MiB", large, "the message body size over max value, MAX: 4194304"),
        ("a batch with an empty message", batch_of(&[b"one", b""]), "the message body length is zero"),
    ];
    for (case, request, words) in cases {
        let answer = ask(&mut client, request).await.expect("answered, the connection kept");
        let remark = answer.remark().map(ToString::to_string).unwrap_or_default();
        assert_eq!(answer.code(), MESSAGE_ILLEGAL, "{case}: {remark}");
        assert!(remark.contains(words), "{case}: {remark}");
    }
    let stored = ask(&mut client, batch_of(&[b"one", b"two"])).await.expect("answered");
    assert_eq!(stored.code(), SUCCESS, "a batch of two: {:?}", stored.remark());

    assert_eq!(stored_bodies(cluster, &topic).await, ["next", "one", "two"], "nothing refused was stored");

    // `TRAN_MSG` as Java's Boolean.parseBoolean reads it: a half message at the broker, so a half message
    // popgate records (its end is made from the record, and counted as such).
    let (shouting_half, id) = raw_send(&topic, &broker, "half", 0, &[("TRAN_MSG", "TRUE"), ("PGROUP", "rm_p")]);
    let half = ask(&mut client, shouting_half).await.expect("answered");
    assert_eq!(half.code(), SUCCESS, "{:?}", half.remark());
    let commit = raw_request(
        37,
        &[
            ("producerGroup", "rm_p"),
            ("tranStateTableOffset", &field(&half, "queueOffset")),
            ("commitLogOffset", &commit_log_offset(&half).to_string()),
            ("commitOrRollback", "8"),
            ("fromTransactionCheck", "false"),
            ("msgId", &id),
            ("topic", &topic),
            ("bname", &broker),
        ],
    );
    assert_eq!(ask(&mut client, commit).await.map(|a| a.code()), Some(SUCCESS));
    let landed = popgate.metric("popgate_transactions_ended_total{resolution=\"commit\",result=\"landed\"}").await;
    assert_eq!(landed, 1.0, "ended from popgate's record of the half message");
}

/// Issue #46: what clients can make popgate hold before they sign anything is bounded across connections, not
/// only per connection. A connection that announces a large frame takes its bytes from the front's budget
/// (`remoting.max_frame_bytes_in_flight`) before it is read in; one that stalls in the middle holds them only until
/// its idle timeout closes it. Meanwhile another client's large frame waits and small requests are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_frames_wait_for_room_in_the_fronts_budget_and_a_stalled_one_holds_it_only_until_its_idle_timeout() {
    let cluster = shared_cluster();
    let limits = "idle_timeout_secs = 8\nmax_frame_bytes = 1048580\nmax_frame_bytes_in_flight = 1048580\n";
    let (popgate, namesrv) = popgate_with_remoting(cluster, limits).await;
    let topic = unique_topic("rm_budget");
    create_topic(cluster, &topic).await;
    let route = |body: Vec<u8>| raw_request(105, &[("topic", topic.as_str())]).set_body(body);

    // The hog: a frame of 1 MiB announced (the whole budget), half of it sent, then nothing.
    let mut hog = TcpStream::connect(&namesrv).await.expect("connect");
    hog.write_all(&1_048_576u32.to_be_bytes()).await.expect("write");
    hog.write_all(&2u32.to_be_bytes()).await.expect("write");
    hog.write_all(&vec![b' '; 512 * 1024]).await.expect("write");
    tokio::time::sleep(Duration::from_secs(3)).await;

    // A well-behaved client's large request (a 600 KiB route query) waits; a small one is served at once.
    let mut big = TcpStream::connect(&namesrv).await.expect("connect");
    send(&mut big, route(vec![b'x'; 600 * 1024])).await;
    let mut small = TcpStream::connect(&namesrv).await.expect("connect");
    assert_eq!(ask(&mut small, route(Vec::new())).await.map(|a| a.code()), Some(SUCCESS), "a small request is served");
    let early = tokio::time::timeout(Duration::from_secs(2), read_answer(&mut big)).await;
    assert!(early.is_err(), "the large frame waits while the stalled one holds the budget");
    assert!(popgate.metric("popgate_remoting_frame_budget_waits_total").await >= 1.0);

    // The hog is closed as idle; its bytes go back, and the waiting frame is read and served.
    assert!(closed_within(&mut hog, Duration::from_secs(15)).await, "the stalled connection is closed");
    let answered = tokio::time::timeout(Duration::from_secs(15), read_answer(&mut big)).await;
    assert_eq!(answered.ok().flatten().map(|a| a.code()), Some(SUCCESS), "then the large frame is served");
}

/// The commit-log offset a send's answer names (the last 16 hex digits of its offset message id).
pub(crate) fn commit_log_offset(answer: &RemotingCommand) -> i64 {
    let offset_id = field(answer, "msgId");
    i64::from_str_radix(&offset_id[offset_id.len().saturating_sub(16)..], 16).expect("hex offset")
}

/// Issue #46: transaction records are keyed by the client's message id, which a producer keeps when it sends the
/// same `Message` again (and another token could use first). An end names its own half message by its
/// commit-log offset: it ends that one, never the half message of the record under the same id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_end_ends_the_half_message_it_names_even_when_a_record_holds_its_id_for_another() {
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_tx_again");
    crate::transaction::create_transaction_topic(cluster, &topic).await;
    let broker = cluster.brokers[0].name.clone();
    let mut producer = TcpStream::connect(&namesrv).await.expect("connect");
    let uniq_key = format!("7F0000010000{:020X}", rand::random::<u64>());
    let half = |body: &str| {
        raw_send_keyed(&topic, &broker, body, 4, &[("TRAN_MSG", "true"), ("PGROUP", "rm_tx_p")], &uniq_key)
    };
    // The same message sent twice while its first transaction is open: two half messages, one id.
    let first = ask(&mut producer, half("first")).await.expect("answered");
    let second = ask(&mut producer, half("second")).await.expect("answered");
    assert_eq!((first.code(), second.code()), (SUCCESS, SUCCESS));
    let end = |answer: &RemotingCommand, commit_or_rollback: &str| {
        let offset = commit_log_offset(answer).to_string();
        raw_request(
            37,
            &[
                ("producerGroup", "rm_tx_p"),
                ("tranStateTableOffset", &field(answer, "queueOffset")),
                ("commitLogOffset", &offset),
                ("commitOrRollback", commit_or_rollback),
                ("fromTransactionCheck", "false"),
                ("msgId", &uniq_key),
                ("topic", &topic),
                ("bname", &broker),
            ],
        )
    };
    // The second transaction commits, the first rolls back: each end lands on its own half message.
    assert_eq!(ask(&mut producer, end(&second, "8")).await.map(|a| a.code()), Some(SUCCESS));
    assert_eq!(ask(&mut producer, end(&first, "12")).await.map(|a| a.code()), Some(SUCCESS));
    eventually(Duration::from_secs(20), "the second half message is committed", || async {
        !stored_bodies(cluster, &topic).await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(stored_bodies(cluster, &topic).await, ["second"], "the committed one only");
}

/// A `POP_MESSAGE` of `group` from `topic` on `broker`, waiting up to `poll_ms`, invisible for a minute.
fn pop_request(group: &str, topic: &str, broker: &str, poll_ms: u64) -> RemotingCommand {
    let poll = poll_ms.to_string();
    raw_request(
        200050,
        &[
            ("consumerGroup", group),
            ("topic", topic),
            ("queueId", "-1"),
            ("maxMsgNums", "32"),
            ("invisibleTime", "60000"),
            ("pollTime", poll.as_str()),
            ("bornTime", "0"),
            ("initMode", "0"),
            ("bname", broker),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_pop_without_a_heartbeat_holds_no_client_id_can_give_back() {
    let cluster = shared_cluster();
    let (_popgate, namesrv) = popgate_with_remoting(cluster, "").await;
    let topic = unique_topic("rm_unnamed");
    let group = unique_topic("rm_unnamed_g");
    create_topic(cluster, &topic).await;
    let broker = cluster.brokers[0].name.clone();
    let (message, _) = raw_send(&topic, &broker, "held", 0, &[]);
    stored_straight_at(cluster, 0, message).await;

    // A consumer that POPs without ever sending a heartbeat: popgate knows it only by its connection.
    let mut holder = TcpStream::connect(&namesrv).await.expect("connect");
    let mut popped = None;
    for _ in 0..10 {
        let answer = ask(&mut holder, pop_request(&group, &topic, &broker, 5_000)).await.expect("answered");
        if answer.code() == SUCCESS {
            popped = Some(answer);
            break;
        }
    }
    assert!(popped.is_some(), "the message is popped within 50 s");

    // Another client names itself after that connection (popgate once held such deliveries under
    // `remoting@<peer>`), joins the group, and leaves it again.
    let named_like_it = format!("remoting@{}", holder.local_addr().expect("local address"));
    let mut other = TcpStream::connect(&namesrv).await.expect("connect");
    let joined = ask(&mut other, consumer_heartbeat(&named_like_it, &group, &topic)).await.expect("answered");
    assert_eq!(joined.code(), SUCCESS, "{:?}", joined.remark());
    let left = raw_request(35, &[("clientID", named_like_it.as_str()), ("consumerGroup", group.as_str())]);
    let left = ask(&mut other, left).await.expect("answered");
    assert_eq!(left.code(), SUCCESS, "{:?}", left.remark());

    // What the first consumer holds stays its own until its invisible time is over: nothing to pop meanwhile.
    let answer = ask(&mut other, pop_request(&group, &topic, &broker, 3_000)).await.expect("answered");
    assert_eq!(answer.code(), 210, "POLLING_TIMEOUT, not the held message given back: {:?}", answer.remark());
}

/// A gRPC `Heartbeat` of a push consumer of `group`, signed by `token`, under client id `client_id`: its
/// status code.
async fn grpc_heartbeat(
    popgate: &crate::harness::popgate::Popgate,
    client_id: &str,
    group: &str,
    token: (&str, &str),
) -> i32 {
    use popgate::grpc::proto as pb;
    let mut client = crate::grpc_raw::connect(popgate).await;
    let heartbeat = pb::HeartbeatRequest {
        group: crate::grpc_raw::resource(group),
        client_type: pb::ClientType::PushConsumer as i32,
    };
    let mut call = crate::grpc_raw::request(heartbeat, Some(token));
    call.metadata_mut().insert("x-mq-client-id", client_id.parse().expect("ascii"));
    let answer = client.heartbeat(call).await.expect("answered").into_inner();
    answer.status.map_or(-1, |status| status.code)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_id_is_the_first_tokens_on_every_front() {
    use popgate::grpc::proto::Code;
    let cluster = shared_cluster();
    let (popgate, namesrv) = popgate_with_remoting(cluster, &tokens_toml()).await;
    let topic = unique_topic("hs_ids");
    create_topic(cluster, &topic).await;
    let mut stranger = TcpStream::connect(&namesrv).await.expect("connect");

    // The victim's gRPC client uses an id; the stranger's remoting client may not use it.
    assert_eq!(grpc_heartbeat(&popgate, "shared@1", "hv_ids_g", VICTIM).await, Code::Ok as i32);
    let answer = ask(&mut stranger, signed(consumer_heartbeat("shared@1", "hs_ids_g", &topic), STRANGER)).await;
    assert_eq!(answer.map(|a| a.code()), Some(NO_PERMISSION), "the gRPC client's id, on the remoting front");

    // The other way round: a remoting client's id is refused to another token's gRPC client.
    let answer = ask(&mut stranger, signed(consumer_heartbeat("remoting@7", "hs_ids_g", &topic), STRANGER)).await;
    assert_eq!(answer.map(|a| a.code()), Some(SUCCESS));
    assert_eq!(grpc_heartbeat(&popgate, "remoting@7", "hv_ids_g", VICTIM).await, Code::Forbidden as i32);

    // The owner uses its id on both fronts.
    let answer = ask(&mut stranger, signed(consumer_heartbeat("shared@2", "hs_ids_g", &topic), STRANGER)).await;
    assert_eq!(answer.map(|a| a.code()), Some(SUCCESS));
    assert_eq!(grpc_heartbeat(&popgate, "shared@2", "hs_ids_g", STRANGER).await, Code::Ok as i32);
}
