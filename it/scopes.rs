//! Topic scopes in RocketMQ's ACL 2.0 model, through every front from one list of cases: reading a topic as a
//! group needs `Sub` on the group **and** on the topic (issue #33, defect 9: a token allowed to consume as a
//! group could subscribe it to any topic). Each case is tried over HTTP (subscribe, poll), the gRPC front
//! (signed `ReceiveMessage`) and the remoting front (signed `HEART_BEAT`, `PULL_MESSAGE`, `POP_MESSAGE`); a
//! refused case leaves no subscription behind, and every allowed one gets past authorization on every front.
//! Publishing (`Pub` on the topic) has a list of its own, through HTTP, gRPC `SendMessage` and remoting
//! `SEND_MESSAGE_V2`.

use std::collections::HashMap;
use std::fmt::Write as _;

use popgate::grpc::proto::{self as pb, Code};
use reqwest::Client;
use serde_json::{json, Value};
use tokio::net::TcpStream;

use crate::grpc_raw::{connect, receive_request, receive_signed_as, request, resource};
use crate::harness::popgate::{status_and_json, Popgate};
use crate::harness::unique_topic;
use crate::publish::shared_cluster;
use crate::remoting::{ask, consumer_heartbeat, create_topic, popgate_with_remoting, raw_pull, raw_request};
use crate::remoting_hostile::{raw_send, signed};

const NO_PERMISSION: i32 = 16;
const SUCCESS: i32 = 0;

/// A token's name and secret (its access key and secret key on the RocketMQ fronts).
type Token = (&'static str, &'static str);

/// Reads only the topics it names (`subscribe`), as the groups it names.
const READER: Token = ("sc-reader", "sc-reader-secret-0123456789");
/// Reads every `sc_` topic but one it is denied by an ACL entry.
const DENIED: Token = ("sc-denied", "sc-denied-secret-0123456789");
/// May read every topic only from 10.0.0.0/8, and the open topics from 127.0.0.1.
const OFFICE: Token = ("sc-office", "sc-office-secret-0123456789");
/// A token written before topics were scoped (no `subscribe`): it still reads every topic as its groups.
const LEGACY: Token = ("sc-legacy", "sc-legacy-secret-0123456789");
const OPS: &str = "sc-ops-secret-0123456789";

fn tokens_toml(open: &str, secret: &str) -> String {
    format!(
        r#"[auth]
enabled = true

[[auth.tokens]]
name = "{reader}"
token = "{reader_secret}"
consume = ["sc_g*"]
subscribe = ["{open}"]

[[auth.tokens]]
name = "{denied}"
token = "{denied_secret}"
consume = ["sc_g*"]
subscribe = []
acl = [
  {{ resource = "Topic:sc_*", actions = ["Sub"] }},
  {{ resource = "Topic:{secret}", actions = ["Sub"], decision = "Deny" }},
]

[[auth.tokens]]
name = "{office}"
token = "{office_secret}"
consume = ["sc_g*"]
subscribe = []
acl = [
  {{ resource = "Topic:*", actions = ["Sub"], source_ips = ["10.0.0.0/8"] }},
  {{ resource = "Topic:{open}", actions = ["Pub", "Sub"], source_ips = ["127.0.0.1"] }},
]

[[auth.tokens]]
name = "{legacy}"
token = "{legacy_secret}"
consume = ["sc_g*"]

[[auth.tokens]]
name = "sc-ops"
token = "{OPS}"
admin = true
"#,
        reader = READER.0,
        reader_secret = READER.1,
        denied = DENIED.0,
        denied_secret = DENIED.1,
        office = OFFICE.0,
        office_secret = OFFICE.1,
        legacy = LEGACY.0,
        legacy_secret = LEGACY.1,
    )
}

/// What a case expects of every front.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Allowed,
    /// Refused for the topic (HTTP names the field `topic`).
    NoTopic,
    /// Refused for the group (HTTP names the field `group`).
    NoGroup,
}

/// Which of the two topics a case reads.
#[derive(Debug, Clone, Copy)]
enum Which {
    Open,
    Secret,
}

/// One list, every front: the token, whether the group is one of its own, the topic, the outcome.
const CASES: &[(&str, Token, bool, Which, Expect)] = &[
    ("a reader reads its topic as its group", READER, true, Which::Open, Expect::Allowed),
    ("a reader's group may not read another topic (defect 9)", READER, true, Which::Secret, Expect::NoTopic),
    ("a reader may not read its topic as another group", READER, false, Which::Open, Expect::NoGroup),
    ("a prefix allows", DENIED, true, Which::Open, Expect::Allowed),
    ("a literal deny beats a prefix allow", DENIED, true, Which::Secret, Expect::NoTopic),
    ("an entry for another network does not apply", OFFICE, true, Which::Secret, Expect::NoTopic),
    ("an entry for this network does", OFFICE, true, Which::Open, Expect::Allowed),
    ("an old token without `subscribe` reads every topic", LEGACY, true, Which::Secret, Expect::Allowed),
];

/// Publishing, through every front: the token, the topic, whether it may.
const PUBLISH_CASES: &[(&str, Token, Which, bool)] = &[
    ("an entry for this network allows Pub", OFFICE, Which::Open, true),
    ("no entry allows Pub on another topic", OFFICE, Which::Secret, false),
    ("a reader may not publish", READER, Which::Open, false),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_needs_sub_on_group_and_topic_and_publishing_pub_on_the_topic_on_every_front() {
    let cluster = shared_cluster();
    let (open, secret) = (unique_topic("sc_open"), unique_topic("sc_secret"));
    create_topic(cluster, &open).await;
    create_topic(cluster, &secret).await;
    let (popgate, remoting_addr) = popgate_with_remoting(cluster, &tokens_toml(&open, &secret)).await;
    let mut grpc = connect(&popgate).await;

    let mut wrong = String::new();
    let mut refused_groups = Vec::new();
    for (i, (case, token, own_group, which, expect)) in CASES.iter().enumerate() {
        let group = if *own_group { format!("sc_g{i}_{}", unique_topic("x")) } else { unique_topic("zz_other") };
        let topic = match which {
            Which::Open => open.as_str(),
            Which::Secret => secret.as_str(),
        };
        let mut seen = Vec::new();

        // HTTP: subscribing and polling.
        let (status, answer) =
            http(&popgate, "POST", "/events/subscribe", token.1, Some(json!({"group": group, "topic": topic}))).await;
        seen.push(("HTTP subscribe", http_outcome(status, &answer)));
        let poll = format!("/events/poll?group={group}&topic={topic}&waitMs=0");
        let (status, answer) = http(&popgate, "GET", &poll, token.1, None).await;
        seen.push(("HTTP poll", http_outcome(status, &answer)));

        // gRPC: a signed receive of the topic as the group.
        let mut receive = receive_request(&group, topic, false);
        receive.long_polling_timeout = Some(prost_types::Duration { seconds: 1, nanos: 0 });
        // Each token's client has an id of its own: an id belongs to the token that first used it.
        let client_id = format!("scopes@{}", token.0);
        let (code, _) = receive_signed_as(&mut grpc, receive, Some(*token), &client_id).await;
        seen.push(("gRPC ReceiveMessage", if code == Code::Unauthorized as i32 { Some("refused") } else { None }));

        // Remoting: a heartbeat subscribing the group to the topic, a pull and a pop of it.
        let mut remoting = TcpStream::connect(&remoting_addr).await.expect("connect to the remoting front");
        let heartbeat = signed(consumer_heartbeat(&format!("sc-{i}@1"), &group, topic), *token);
        let answer = ask(&mut remoting, heartbeat).await.expect("a heartbeat answer");
        seen.push(("remoting HEART_BEAT", remoting_outcome(answer.code(), SUCCESS)));
        let pull = signed(raw_pull(&group, topic, "0", None), *token);
        let answer = ask(&mut remoting, pull).await.expect("a pull answer");
        seen.push(("remoting PULL_MESSAGE", remoting_outcome(answer.code(), -1)));
        let pop = signed(
            raw_request(
                200050,
                &[
                    ("consumerGroup", group.as_str()),
                    ("topic", topic),
                    ("queueId", "-1"),
                    ("maxMsgNums", "1"),
                    ("invisibleTime", "60000"),
                    ("pollTime", "0"),
                    ("bornTime", "0"),
                    ("initMode", "0"),
                    ("bname", "broker-a"),
                ],
            ),
            *token,
        );
        let answer = ask(&mut remoting, pop).await.expect("a pop answer");
        seen.push(("remoting POP_MESSAGE", remoting_outcome(answer.code(), -1)));

        for (front, outcome) in seen {
            let as_expected = match (expect, outcome) {
                (Expect::Allowed, outcome) => outcome.is_none(),
                (Expect::NoTopic, Some(why)) => why == "refused" || why == "topic",
                (Expect::NoGroup, Some(why)) => why == "refused" || why == "group",
                (_, None) => false,
            };
            if !as_expected {
                let _ = writeln!(wrong, "{case}: {front} gave {outcome:?}, expected {expect:?}");
            }
        }
        if *expect != Expect::Allowed {
            refused_groups.push(group);
        }
    }
    assert!(wrong.is_empty(), "cases not decided as expected (seed-free; names above):\n{wrong}");

    // A refused case left nothing behind: no subscription of its group, on any front.
    let (status, subscriptions) = http(&popgate, "GET", "/admin/subscriptions", OPS, None).await;
    assert_eq!(status, 200, "{subscriptions}");
    let kept = subscriptions.to_string();
    for group in &refused_groups {
        assert!(!kept.contains(group.as_str()), "a refused group `{group}` got a subscription: {kept}");
    }
    // Publishing: `Pub` on the topic, the same list for every front.
    let mut wrong = String::new();
    for (case, token, which, allowed) in PUBLISH_CASES {
        let topic = match which {
            Which::Open => open.as_str(),
            Which::Secret => secret.as_str(),
        };
        let mut seen = Vec::new();
        let (status, answer) =
            http(&popgate, "POST", "/events/publish", token.1, Some(json!({"topic": topic, "data": "scoped"}))).await;
        seen.push((
            "HTTP publish",
            i32::from(status),
            answer.to_string(),
            status == 200,
            http_outcome(status, &answer).is_some(),
        ));
        let message = pb::Message {
            topic: resource(topic),
            user_properties: HashMap::default(),
            system_properties: Some(pb::SystemProperties {
                message_id: format!("01{:030X}", rand::random::<u64>()),
                ..Default::default()
            }),
            body: b"scoped".to_vec().into(),
        };
        let mut send = request(pb::SendMessageRequest { messages: vec![message] }, Some(*token));
        send.metadata_mut().insert("x-mq-client-id", format!("scopes@{}", token.0).parse().expect("ascii"));
        let answer = grpc.send_message(send).await.expect("a send answer").into_inner();
        let code = answer.status.as_ref().map_or(0, |s| s.code);
        seen.push((
            "gRPC SendMessage",
            0,
            format!("{answer:?}"),
            code == Code::Ok as i32,
            code == Code::Unauthorized as i32,
        ));
        let mut remoting = TcpStream::connect(&remoting_addr).await.expect("connect to the remoting front");
        let (send, _) = raw_send(topic, "broker-a", "scoped", 0, &[]);
        let answer = ask(&mut remoting, signed(send, *token)).await.expect("a send answer");
        let remark = format!("{:?}", answer.remark());
        seen.push((
            "remoting SEND_MESSAGE_V2",
            answer.code(),
            remark,
            answer.code() == SUCCESS,
            answer.code() == NO_PERMISSION,
        ));
        for (front, status, answer, stored, refused) in seen {
            if (*allowed && !stored) || (!*allowed && !refused) {
                let _ = writeln!(wrong, "{case}: {front} answered {status} {answer}, expected allowed={allowed}");
            }
        }
    }
    assert!(wrong.is_empty(), "publishes not decided as expected:\n{wrong}");

    let forbidden = popgate.metric("popgate_requests_rejected_total{reason=\"forbidden\"}").await;
    eprintln!("forbidden refusals counted: {forbidden}");
    assert!(forbidden >= 20.0, "{}", popgate.metrics_text().await);
}

/// An HTTP request with bearer token `token`, and its answer.
pub(crate) async fn http(
    popgate: &Popgate,
    method: &str,
    path: &str,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
    let mut request = Client::new().request(method, format!("{}{path}", popgate.base)).bearer_auth(token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    status_and_json(request.send().await.expect("HTTP request")).await
}

/// `None` for an HTTP answer that is not a refusal; the field a 403 names otherwise.
fn http_outcome(status: u16, answer: &Value) -> Option<&'static str> {
    if status != 403 {
        return None;
    }
    match answer["error"]["field"].as_str() {
        Some("topic") => Some("topic"),
        Some("group") => Some("group"),
        _ => Some("refused"),
    }
}

/// `None` for a remoting answer that is not `NO_PERMISSION` (and is `must_be`, when that is not -1).
fn remoting_outcome(code: i32, must_be: i32) -> Option<&'static str> {
    match code {
        NO_PERMISSION => Some("refused"),
        _ if must_be != -1 && code != must_be => Some("unexpected code"),
        _ => None,
    }
}
