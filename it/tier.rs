//! popgate as a tier (issue #35): three instances behind a real round-robin load balancer (HAProxy, no
//! stickiness), each with its own state directory, one peer link between them. A subscriber that polls and
//! ACKs through the balancer reaches a different instance for its ACK than for its poll most of the time; the
//! ACK must land anyway (asked of the instance that handed the delivery out), so nothing is redelivered or
//! dead-lettered; another token's ACK is refused by that instance as it would refuse it itself.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use reqwest::Client;
use serde_json::{json, Value};

use popgate::grpc::proto::{self as pb, Code};
use popgate::tier::proto::{self as peer, peer_client::PeerClient};

use crate::grpc_raw::{connect, handle_of, receive_published_signed, receive_request, request, resource};
use crate::harness::balancer::{Backend, Balancer};
use crate::harness::direct::Direct;
use crate::harness::popgate::{status_and_json, Popgate};
use crate::harness::push::SseClient;
use crate::harness::remoting::RemotingClient;
use crate::harness::rocketmq::Cluster;
use crate::harness::sdk::Sdk;
use crate::harness::{eventually, free_port, unique_topic};
use crate::publish::shared_cluster;
use crate::transaction::{create_transaction_topic, stored_bodies};

/// The app whose events the tier delivers, and another app that reaches for them.
pub(crate) const APP: (&str, &str) = ("tier-app", "tier-app-secret-0123456789");
const OTHER: (&str, &str) = ("tier-other", "tier-other-secret-0123456789");
/// The token the tests read the admin API with.
const ADMIN: (&str, &str) = ("tier-admin", "tier-admin-secret-0123456789");
pub(crate) const SECRET: &str = "tier-secret-it-0123456789";
const EVENTS: usize = 30;

/// The config of instance `n`, its peer link on `port`, looking for peers on `peer_ports`, with `tier_lines` in
/// its `[tier]` section.
pub(crate) fn peer_toml(n: usize, port: u16, peer_ports: &[u16], delivery: &str, tier_lines: &str) -> String {
    let peers: Vec<String> = peer_ports.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
    format!(
        "{delivery}\n\
         [tier]\ninstance_id = \"it-tier-{n}\"\nlisten = \"127.0.0.1:{port}\"\npeers = [{peers}]\nsecret = \"{SECRET}\"\n\
         refresh_secs = 1\n{tier_lines}\n\
         [auth]\nenabled = true\n\n\
         [[auth.tokens]]\nname = \"{}\"\ntoken = \"{}\"\npublish = [\"tier_*\"]\nconsume = [\"tier_g*\"]\n\n\
         [[auth.tokens]]\nname = \"{}\"\ntoken = \"{}\"\npublish = [\"other_*\"]\nconsume = [\"other_g*\"]\n\n\
         [[auth.tokens]]\nname = \"{}\"\ntoken = \"{}\"\nadmin = true\n",
        APP.0,
        APP.1,
        OTHER.0,
        OTHER.1,
        ADMIN.0,
        ADMIN.1,
        peers = peers.join(", "),
    )
}

/// `method path` through `base` as `token`.
async fn call(
    client: &Client,
    base: &str,
    method: reqwest::Method,
    path: &str,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = client.request(method, format!("{base}{path}")).bearer_auth(token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    status_and_json(request.send().await.expect("HTTP request")).await
}

/// Three instances of one tier, each with `delivery` in its `[delivery]` section.
async fn start_tier(namesrv: &str, delivery: &str) -> [Popgate; 3] {
    start_tier_each(namesrv, "", |_| delivery.to_owned()).await
}

/// Three instances of one tier, each with `tier_lines` in its `[tier]` section, instance `n` with `delivery(n)`
/// in its `[delivery]` section (and any sections of its own after it).
async fn start_tier_each(namesrv: &str, tier_lines: &str, delivery: impl Fn(usize) -> String) -> [Popgate; 3] {
    let peer_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let configs: Vec<String> =
        (0..3).map(|n| peer_toml(n, peer_ports[n], &peer_ports, &delivery(n), tier_lines)).collect();
    let (a, b, c) = tokio::join!(
        Popgate::start(namesrv, &configs[0]),
        Popgate::start(namesrv, &configs[1]),
        Popgate::start(namesrv, &configs[2]),
    );
    [a, b, c]
}

async fn forwarded(instances: &[Popgate], action: &str, result: &str) -> f64 {
    let series = format!("popgate_tier_settlements_forwarded_total{{action=\"{action}\",result=\"{result}\"}}");
    let mut sum = 0.0;
    for instance in instances {
        sum += instance.metric(&series).await;
    }
    sum
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_settles_through_a_round_robin_balancer_whatever_instance_each_request_reaches() {
    let cluster = shared_cluster();
    let (topic, group) = (unique_topic("tier"), unique_topic("tier_g"));
    let mut instances = start_tier(&cluster.namesrv_addr, "ack_timeout_ms = 5000").await;
    let backends: Vec<Backend> =
        instances.iter().map(|p| Backend::of(p, p.base.trim_start_matches("http://"))).collect();
    let balancer = Balancer::http(&backends).await;
    let (base, client) = (balancer.base(), Client::new());

    for n in 0..EVENTS {
        let event = json!({"topic": topic, "data": format!("event-{n}")});
        let (status, answer) = call(&client, &base, reqwest::Method::POST, "/events/publish", APP.1, Some(event)).await;
        assert_eq!(status, 200, "{answer}");
    }

    // Poll and ACK through the balancer until every event is ACKed. Every ACK must land, whichever instance
    // it reaches; the other token's ACK of each delivery first, refused by the instance that handed it out.
    let poll = format!("/events/poll?group={group}&topic={topic}&max=8&waitMs=1000");
    let mut acked: BTreeSet<String> = BTreeSet::new();
    let mut owners: BTreeMap<String, usize> = BTreeMap::new();
    let mut refusals = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    while acked.len() < EVENTS && Instant::now() < deadline {
        let (status, polled) = call(&client, &base, reqwest::Method::GET, &poll, APP.1, None).await;
        assert_eq!(status, 200, "{polled}");
        for delivery in polled["deliveries"].as_array().cloned().unwrap_or_default() {
            let id = delivery["deliveryId"].as_str().expect("an id").to_owned();
            let data = delivery["event"]["data"].as_str().expect("data").to_owned();
            assert_eq!(delivery["attempt"], 1, "nothing comes back: every ACK landed ({data})");
            *owners.entry(id.split_once('~').expect("an instance").0.to_owned()).or_default() += 1;
            let ack = json!({"deliveryId": id});
            let (status, answer) =
                call(&client, &base, reqwest::Method::POST, "/events/ack", OTHER.1, Some(ack.clone())).await;
            assert_eq!((status, answer["error"]["field"].as_str()), (403, Some("deliveryId")), "{answer}");
            refusals += 1;
            let (status, answer) = call(&client, &base, reqwest::Method::POST, "/events/ack", APP.1, Some(ack)).await;
            assert_eq!((status, &answer["status"]), (200, &json!("acked")), "{data}: {answer}");
            assert!(acked.insert(data.clone()), "{data} delivered twice");
        }
    }
    assert_eq!(acked.len(), EVENTS, "every event delivered and ACKed once");
    println!("tier: deliveries by the instance that handed them out: {owners:?}");
    assert!(owners.len() >= 2, "the balancer spread the polls over the instances: {owners:?}");

    // Round robin: most ACKs reached another instance than the one that handed the delivery out, and were
    // asked of it; the other token's were refused there.
    let asked = forwarded(&instances, "ack", "ok").await;
    let refused = forwarded(&instances, "ack", "refused").await;
    println!("tier: ACKs asked of another instance: {asked} landed, {refused} refused (of {refusals} refusals)");
    assert!(asked >= 1.0, "some ACK reached an instance that did not hand the delivery out");
    assert!(refused >= 1.0, "some refusal came from the instance that handed the delivery out");
    assert_eq!(forwarded(&instances, "ack", "unreachable").await, 0.0);

    // Past every ACK timeout (5 s) and backoff: nothing comes back on any instance, nothing was dead-lettered.
    tokio::time::sleep(Duration::from_secs(8)).await;
    for _ in 0..instances.len() {
        let (status, polled) = call(&client, &base, reqwest::Method::GET, &poll, APP.1, None).await;
        assert_eq!((status, &polled["deliveries"]), (200, &json!([])), "nothing redelivered: {polled}");
    }
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    let dead = direct.try_read_all(&format!("%DLQ%{group}")).await.unwrap_or_default();
    assert!(dead.is_empty(), "nothing dead-lettered: {} messages", dead.len());

    an_sse_subscribers_acks_land_whatever_instance_they_reach(&base, &topic).await;
    a_grpc_handle_is_settled_on_another_instance_than_the_one_that_issued_it(&instances, &base).await;
    a_transaction_ends_on_another_instance_than_the_one_that_recorded_it(cluster, &instances).await;
    a_killed_instance_is_taken_out_by_the_balancers_readyz_check(&mut instances[2], &balancer, &topic).await;
}

/// The balancer checks `/readyz` (the README's HAProxy configuration): an instance `kill -9`ed is taken out
/// within a few checks, and every request after that is served by the others.
async fn a_killed_instance_is_taken_out_by_the_balancers_readyz_check(
    instance: &mut Popgate,
    balancer: &Balancer,
    topic: &str,
) {
    instance.kill9();
    let taken_out = Instant::now();
    eventually(Duration::from_secs(20), "HAProxy's /readyz checks take the killed instance out", || async {
        balancer.is_down(2).await
    })
    .await;
    println!("tier: a killed instance was taken out by the balancer in {:?}", taken_out.elapsed());
    let client = Client::new();
    for n in 0..12 {
        let event = json!({"topic": topic, "data": format!("after-{n}")});
        let (status, answer) =
            call(&client, &balancer.base(), reqwest::Method::POST, "/events/publish", APP.1, Some(event)).await;
        assert_eq!(status, 200, "every request served by the instances left: {answer}");
    }
}

/// An SSE stream opened through the balancer stays on one instance; its subscriber's ACKs, each a request of
/// its own through the balancer, mostly reach the others, and land: every event once, nothing back.
async fn an_sse_subscribers_acks_land_whatever_instance_they_reach(base: &str, topic: &str) {
    let group = unique_topic("tier_gs");
    let mut stream = SseClient::connect_as(base, &format!("group={group}&topic={topic}"), APP.1).await;
    let client = Client::new();
    let mut acked = BTreeSet::new();
    while acked.len() < EVENTS {
        let delivery = stream.next(Duration::from_secs(60)).await.expect("the next event over SSE");
        assert_eq!(delivery["attempt"], 1, "nothing comes back: {delivery}");
        let ack = json!({"deliveryId": delivery["deliveryId"]});
        let (status, answer) = call(&client, base, reqwest::Method::POST, "/events/ack", APP.1, Some(ack)).await;
        assert_eq!((status, &answer["status"]), (200, &json!("acked")), "{answer}");
        assert!(acked.insert(delivery["event"]["data"].as_str().expect("data").to_owned()), "{delivery}");
    }
    assert!(stream.next(Duration::from_secs(7)).await.is_none(), "nothing redelivered past the ACK timeout");
}

/// A gRPC client whose connection moved to another instance (a pod restarted, the balancer rebalanced) goes on
/// with the handles the first one issued: a new invisible duration on the second instance, the ACK on the
/// third, both asked of the first.
async fn a_grpc_handle_is_settled_on_another_instance_than_the_one_that_issued_it(instances: &[Popgate], base: &str) {
    let (topic, group) = (unique_topic("tier_grpc"), unique_topic("tier_gg"));
    let event = json!({"topic": topic, "data": "over grpc"});
    let (status, answer) =
        call(&Client::new(), base, reqwest::Method::POST, "/events/publish", APP.1, Some(event)).await;
    assert_eq!(status, 200, "{answer}");
    let mut first = connect(&instances[0]).await;
    let (code, messages) =
        receive_published_signed(&mut first, receive_request(&group, &topic, false), Some(APP)).await;
    assert_eq!((code, messages.len()), (Code::Ok as i32, 1), "{messages:?}");
    let handle = handle_of(&messages[0]);
    assert!(handle.starts_with("pg2:it-tier-0~"), "the handle names the instance that issued it: {handle}");

    let later = pb::ChangeInvisibleDurationRequest {
        group: resource(&group),
        topic: resource(&topic),
        receipt_handle: handle,
        invisible_duration: Some(prost_types::Duration { seconds: 60, nanos: 0 }),
        message_id: messages[0].system_properties.as_ref().map(|p| p.message_id.clone()).unwrap_or_default(),
        lite_topic: None,
        suspend: None,
    };
    let mut second = connect(&instances[1]).await;
    let answer = second.change_invisible_duration(request(later, Some(APP))).await.expect("call").into_inner();
    assert_eq!(answer.status.as_ref().map(|s| s.code), Some(Code::Ok as i32), "{answer:?}");

    let ack = pb::AckMessageRequest {
        group: resource(&group),
        topic: resource(&topic),
        entries: vec![pb::AckMessageEntry {
            message_id: String::new(),
            receipt_handle: answer.receipt_handle.clone(),
            lite_topic: None,
        }],
    };
    let mut third = connect(&instances[2]).await;
    let acked = third.ack_message(request(ack, Some(APP))).await.expect("call").into_inner();
    assert_eq!(acked.entries[0].status.as_ref().map(|s| s.code), Some(Code::Ok as i32), "{acked:?}");
    let extended =
        instances.iter().map(|i| i.metric(r#"popgate_tier_settlements_served_total{action="extend",result="ok"}"#));
    let served: f64 = futures::future::join_all(extended).await.into_iter().sum();
    assert_eq!(served, 1.0, "the new invisible duration was asked of the instance that issued the handle");
}

/// A transaction whose half message one instance recorded is ended through another: asked of every peer, ended
/// by the one that recorded it, with its checks (another token's commit is refused there). An id no instance
/// knows is still unknown.
async fn a_transaction_ends_on_another_instance_than_the_one_that_recorded_it(
    cluster: &Cluster,
    instances: &[Popgate],
) {
    let topic = unique_topic("tier_tx");
    create_transaction_topic(cluster, &topic).await;
    let client = Client::new();
    let post = |instance: &Popgate, path: String, token: &'static str, body: Value| {
        let (client, base) = (client.clone(), instance.base.clone());
        async move { call(&client, &base, reqwest::Method::POST, &path, token, Some(body)).await }
    };
    let half = json!({"topic": topic, "data": "half", "transaction": true});
    let (status, sent) = post(&instances[0], "/events/publish".into(), APP.1, half).await;
    assert_eq!(status, 200, "{sent}");
    let id = sent["transactionId"].as_str().expect("a transaction id").to_owned();
    let commit = json!({"resolution": "commit"});

    let path = format!("/events/transactions/{id}");
    let (status, answer) = post(&instances[1], path.clone(), OTHER.1, commit.clone()).await;
    assert_eq!(
        (status, answer["error"]["field"].as_str()),
        (403, Some("id")),
        "refused where it is recorded: {answer}"
    );
    assert!(stored_bodies(cluster, &topic).await.is_empty(), "nothing committed");
    let (status, answer) = post(&instances[2], path.clone(), APP.1, commit.clone()).await;
    assert_eq!((status, &answer["state"], &answer["topic"]), (200, &json!("ended"), &json!(topic)), "{answer}");
    let (status, shown) = call(&client, &instances[0].base, reqwest::Method::GET, &path, APP.1, None).await;
    assert_eq!((status, &shown["state"]), (200, &json!("ended")), "ended at the instance that recorded it: {shown}");
    assert_eq!(stored_bodies(cluster, &topic).await, vec!["half".to_owned()]);

    let (status, answer) = post(&instances[1], "/events/transactions/no-such-id".into(), APP.1, commit).await;
    assert_eq!(status, 404, "no instance knows it: {answer}");
}

/// Polls `group` on instance `instance` (straight, not through the balancer) until it has handed out `count`
/// deliveries: those deliveries.
pub(crate) async fn hand_out(instance: &Popgate, group: &str, topic: &str, count: usize) -> Vec<Value> {
    let poll = format!("/events/poll?group={group}&topic={topic}&max=16&waitMs=1000");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut held = Vec::new();
    while held.len() < count && Instant::now() < deadline {
        let (status, polled) = call(&Client::new(), &instance.base, reqwest::Method::GET, &poll, APP.1, None).await;
        assert_eq!(status, 200, "{polled}");
        held.extend(polled["deliveries"].as_array().cloned().unwrap_or_default());
    }
    assert_eq!(held.len(), count, "{held:?}");
    held
}

pub(crate) fn id_of(delivery: &Value) -> String {
    delivery["deliveryId"].as_str().expect("an id").to_owned()
}

fn data_of(delivery: &Value) -> String {
    delivery["event"]["data"].as_str().expect("data").to_owned()
}

async fn ack_at(instance: &Popgate, id: &str) -> (u16, Value) {
    call(&Client::new(), &instance.base, reqwest::Method::POST, "/events/ack", APP.1, Some(json!({"deliveryId": id})))
        .await
}

pub(crate) async fn assert_acked_at(instance: &Popgate, id: &str) {
    let (status, answer) = ack_at(instance, id).await;
    assert_eq!((status, &answer["status"]), (200, &json!("acked")), "{id}: {answer}");
}

const SETTLED_AT_BROKER: &str = "popgate_tier_settled_at_broker_total{action=\"ack\",result=\"ok\"}";
const LEARNED: &str = "popgate_tier_acks_learned_total{result=\"acked\"}";

/// Polls `group` on `instance` for `wait`: what it hands out (nothing, when everything was settled).
async fn handed_out_within(instance: &Popgate, group: &str, topic: &str, wait: Duration) -> Vec<Value> {
    let poll = format!("/events/poll?group={group}&topic={topic}&max=16&waitMs=1000");
    let deadline = Instant::now() + wait;
    let mut handed = Vec::new();
    while Instant::now() < deadline {
        let (status, polled) = call(&Client::new(), &instance.base, reqwest::Method::GET, &poll, APP.1, None).await;
        assert_eq!(status, 200, "{polled}");
        handed.extend(polled["deliveries"].as_array().cloned().unwrap_or_default());
    }
    handed
}

/// One instance stopped for good with its state directory deleted, one `kill -9`ed and restarted. Each
/// instance holds every event of its own consumer group (`tier_gk0`, `…1`, `…2`), handed out and not ACKed.
/// - The lost instance: one of its deliveries is ACKed on another instance, which cannot reach it and ACKs at
///   the broker with the lease the delivery id carries; that event never comes back. The others come back
///   through the broker within their lease and are ACKed on the survivors.
/// - The killed instance: an ACK of its delivery while it is down is made at the broker the same way; after
///   its restart (same state directory) it learns of it from the peer before it serves anyone, and does not
///   hand it out again; its other deliveries' ACKs land on it from any instance.
/// Nothing is lost; only the lost instance's unACKed deliveries are delivered twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_instances_deliveries_come_back_within_their_lease_and_a_killed_one_learns_what_was_acked_meanwhile() {
    const COUNT: usize = 6;
    let cluster = shared_cluster();
    let topic = unique_topic("tier_kill");
    let groups: Vec<String> = (0..3).map(|n| unique_topic(&format!("tier_gk{n}"))).collect();
    // The lease is renewed with half of it left (10 s): the lost instance's ACK below is made well before, and the
    // killed instance is back (after its peer's restart) before its own deliveries' lease runs out.
    let instances = start_tier(&cluster.namesrv_addr, "ack_timeout_ms = 120000\nlease_ms = 20000").await;
    for n in 0..COUNT {
        let event = json!({"topic": topic, "data": format!("event-{n}")});
        let (status, answer) =
            call(&Client::new(), &instances[0].base, reqwest::Method::POST, "/events/publish", APP.1, Some(event))
                .await;
        assert_eq!(status, 200, "{answer}");
    }
    // Instance 1 hands its group's events out only before it is killed, below: a sealed lease is good for a lease
    // (20 s), and the lost instance's part takes longer.
    let mut held: Vec<Vec<Value>> = vec![Vec::new(); 3];
    for n in [0, 2] {
        held[n] = hand_out(&instances[n], &groups[n], &topic, COUNT).await;
    }

    // Instance 2 is lost for good, state directory and all. One of its deliveries is ACKed on instance 0, at the
    // broker; the rest come back through the broker once their lease (20 s) runs out, handed out by another
    // instance.
    let [first, mut second, third] = instances;
    let state_dir = third.state_dir.clone();
    drop(third);
    let _ = std::fs::remove_dir_all(&state_dir);
    let gone_at = Instant::now();
    let (acked_lost, rest) = held[2].split_first().expect("held");
    assert_acked_at(&first, &id_of(acked_lost)).await;
    assert_eq!(first.metric(SETTLED_AT_BROKER).await, 1.0, "ACKed at the broker without its owner");
    let back = hand_out(&first, &groups[2], &topic, COUNT - 1).await;
    let took = gone_at.elapsed();
    let unacked: BTreeSet<String> = rest.iter().map(data_of).collect();
    assert_eq!(
        back.iter().map(data_of).collect::<BTreeSet<_>>(),
        unacked,
        "every event it held came back but the ACKed one"
    );
    for delivery in &back {
        assert_eq!(delivery["attempt"], 2, "the broker's redelivery: {delivery}");
        assert_acked_at(&second, &id_of(delivery)).await;
    }
    println!(
        "tier: the lost instance's {} unACKed deliveries came back in {took:?} (lease 20 s); delivered twice: {}, \
         lost: 0; its delivery ACKed at the broker by a peer: not back",
        COUNT - 1,
        COUNT - 1
    );
    assert!(took < Duration::from_secs(50), "within the lease and a POP or two: {took:?}");

    // Instance 1 is killed: an ACK of its delivery on instance 0 is made at the broker, and instance 0 is
    // killed and restarted too before instance 1 is back: its note of the ACK was kept in its state store. After
    // its restart (same state directory) instance 1 has learned of it, and the ACKs of its other deliveries land
    // from any instance.
    held[1] = hand_out(&second, &groups[1], &topic, COUNT).await;
    let killed = id_of(&held[1][0]);
    second.kill9();
    assert_acked_at(&first, &killed).await;
    assert_eq!(first.metric(SETTLED_AT_BROKER).await, 2.0);
    let mut first = first;
    first.kill9();
    first.restart().await;
    second.restart().await;
    assert_eq!(second.metric(LEARNED).await, 1.0, "told by its peer when it looked it up at its start");
    for delivery in &held[1][1..] {
        assert_acked_at(&first, &id_of(delivery)).await;
    }
    for delivery in &held[0] {
        assert_acked_at(&second, &id_of(delivery)).await;
    }

    // Nothing else comes back on the survivors: the killed instance's delivery ACKed without it is not handed
    // out again.
    for (instance, group) in [(&first, &groups[0]), (&second, &groups[1]), (&first, &groups[2])] {
        let again = handed_out_within(instance, group, &topic, Duration::from_secs(3)).await;
        assert_eq!(again, Vec::<Value>::new(), "{group}");
    }
}

/// Peers that cannot reach each other: instance 1's peer link cannot reach instance 0 (it knows a port nobody
/// listens on), while instance 0 reaches instance 1. An ACK of instance 0's delivery on instance 1 is made at
/// the broker and counted; instance 0, at its next look-up of its peers (every second here), learns of it and
/// ACKs with its current lease: the event is not handed out again, not even once its ACK timeout and its lease
/// have passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_whose_owner_cannot_be_reached_is_made_at_the_broker_and_the_owner_learns_of_it() {
    let cluster = shared_cluster();
    let (topic, group) = (unique_topic("tier_cut"), unique_topic("tier_gcut"));
    let (port_0, port_1, nobody) = (free_port(), free_port(), free_port());
    // An 8 s lease: the ACK, right after the hand-out, reaches the broker well before the owner would renew it
    // (with 4 s left), so it is answered as done.
    let delivery = "ack_timeout_ms = 8000\nlease_ms = 8000";
    let (owner_toml, other_toml) =
        (peer_toml(0, port_0, &[port_1], delivery, ""), peer_toml(1, port_1, &[nobody], delivery, ""));
    let (owner, other) = tokio::join!(
        Popgate::start(&cluster.namesrv_addr, &owner_toml),
        Popgate::start(&cluster.namesrv_addr, &other_toml),
    );
    let event = json!({"topic": topic, "data": "cut-off"});
    let (status, answer) =
        call(&Client::new(), &owner.base, reqwest::Method::POST, "/events/publish", APP.1, Some(event)).await;
    assert_eq!(status, 200, "{answer}");
    let held = hand_out(&owner, &group, &topic, 1).await;

    assert_acked_at(&other, &id_of(&held[0])).await;
    assert_eq!(other.metric(SETTLED_AT_BROKER).await, 1.0);
    let learned_by = Instant::now() + Duration::from_secs(20);
    while owner.metric(LEARNED).await < 1.0 && Instant::now() < learned_by {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(owner.metric(LEARNED).await, 1.0, "the owner learned of the ACK from its peer");
    // Past the ACK timeout and the lease (8 s each): neither popgate nor the broker hands it out again.
    let again = handed_out_within(&owner, &group, &topic, Duration::from_secs(12)).await;
    assert_eq!(again, Vec::<Value>::new());
    assert_eq!(forwarded(std::slice::from_ref(&other), "ack", "unreachable").await, 1.0);
}

/// Ends of transactions an instance has no record of are asked of every peer: at most
/// `tier.max_ends_asked_at_once` (2 here) at a time. The one peer is stopped (SIGSTOP: its port takes the
/// connection and never answers), so each end asked of it waits out `tier.forward_timeout_ms`; of six ends of
/// made-up ids sent at once, two ask and answer "unknown" (404) when the peer's time is up, the other four are
/// answered "try again" (503) at once and counted. A publish meanwhile is served; once the peer runs again, an
/// end asks it again (nothing stayed taken).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ends_of_unknown_transactions_are_asked_of_the_peers_a_bounded_number_at_a_time() {
    let cluster = shared_cluster();
    let (port_0, port_1) = (free_port(), free_port());
    let peer = Popgate::start(&cluster.namesrv_addr, &peer_toml(0, port_0, &[port_1], "", "")).await;
    // Looked up once, at the start (the peer is up by then), and not again during the test.
    let bounded = peer_toml(1, port_1, &[port_0], "", "max_ends_asked_at_once = 2\nforward_timeout_ms = 5000")
        .replace("refresh_secs = 1\n", "refresh_secs = 3600\n");
    let asked = Popgate::start(&cluster.namesrv_addr, &bounded).await;
    assert_eq!(asked.metric("popgate_tier_peers").await, 1.0, "the second instance knows the first");

    let stop = |signal| {
        let pid = libc::pid_t::try_from(peer.pid()).expect("a pid");
        // SAFETY: kill(2) with a child process's pid and a signal number; no memory is involved.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "signal {signal} to the peer");
    };
    stop(libc::SIGSTOP);
    let client = Client::new();
    let end = |n: usize| {
        let (client, base) = (client.clone(), asked.base.clone());
        let path = format!("/events/transactions/made-up-{n}");
        async move {
            let sent = Instant::now();
            let (status, answer) =
                call(&client, &base, reqwest::Method::POST, &path, APP.1, Some(json!({"resolution": "commit"}))).await;
            (status, answer, sent.elapsed())
        }
    };
    let publish = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let event = json!({"topic": unique_topic("tier_flood"), "data": "served"});
        call(&client, &asked.base, reqwest::Method::POST, "/events/publish", APP.1, Some(event)).await.0
    };
    let (answers, published) = tokio::join!(futures::future::join_all((0..6).map(end)), publish);
    stop(libc::SIGCONT);

    let statuses: Vec<u16> = answers.iter().map(|(status, _, _)| *status).collect();
    println!("six ends of made-up transactions while the peer was stopped: {answers:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 404).count(), 2, "two asked the peer: {answers:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 503).count(), 4, "four were told to try again: {answers:?}");
    for (status, answer, took) in &answers {
        if *status == 503 {
            assert_eq!(answer["error"]["code"], "unavailable", "{answer}");
            let message = answer["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("tier.max_ends_asked_at_once"), "{answer}");
            assert!(*took < Duration::from_secs(4), "answered without waiting for the peer: {took:?}");
        }
    }
    assert_eq!(asked.metric(r#"popgate_requests_rejected_total{reason="too_many_tier_ends"}"#).await, 4.0);
    assert_eq!(published, 200, "a publish is served while the ends wait");

    let (status, answer, _) = end(6).await;
    assert_eq!(status, 404, "asked of the running peer again, which does not know it either: {answer}");
    assert_eq!(asked.metric(r#"popgate_requests_rejected_total{reason="too_many_tier_ends"}"#).await, 4.0);
}

/// The peer link's signature of `message` for call `rpc` to instance `to`, made here as the README and
/// `src/tier/signing.rs` describe it: `<unix ms>:<nonce>:<to>:<HMAC-SHA256>` over the call, the time, the nonce,
/// the recipient and the message's protobuf encoding.
pub(crate) fn peer_signature<M: prost::Message>(rpc: &str, to: &str, message: &M) -> String {
    use hmac::{Hmac, Mac};
    let at_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_millis();
    let nonce = format!("{:032x}", rand::random::<u128>());
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(SECRET.as_bytes()).expect("any key length");
    mac.update(format!("popgate-peer/2\n{rpc}\n{at_ms}\n{nonce}\n{to}\n").as_bytes());
    mac.update(&message.encode_to_vec());
    format!("{at_ms}:{nonce}:{to}:{}", hex::encode(mac.finalize().into_bytes()))
}

/// `message` carrying `signature` as the peer link's signature.
pub(crate) fn with_signature<M>(message: M, signature: &str) -> tonic::Request<M> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert("x-popgate-peer-signature", signature.parse().expect("ascii"));
    request
}

/// What a stranger who reads the peer link (it is plaintext) can do with what it captured: nothing. A raw
/// client of the peer port sends a request signed with the tier's secret; the same request sent again (a
/// replayed `Identify` would collect the untold-ACK notes for its asker) is refused, and so is a signed
/// settlement whose caller was changed, or one signed for another instance. The instance's counter names the
/// replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_request_is_taken_once_unchanged_and_only_by_the_instance_it_was_signed_for() {
    let cluster = shared_cluster();
    let port = free_port();
    let instance = Popgate::start(&cluster.namesrv_addr, &peer_toml(0, port, &[], "", "")).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .expect("an address")
        .connect()
        .await
        .expect("the peer port");
    let mut client = PeerClient::new(channel);

    let identify = peer::IdentifyRequest { asker: "it-tier-9".into() };
    let captured = peer_signature("identify", "it-tier-0", &identify);
    let reply = client.identify(with_signature(identify.clone(), &captured)).await.expect("taken once");
    assert_eq!(reply.into_inner().instance_id, "it-tier-0");
    let replayed = client.identify(with_signature(identify, &captured)).await.expect_err("not twice");
    assert_eq!(replayed.code(), tonic::Code::Unauthenticated, "{replayed:?}");
    assert!(replayed.message().contains("replayed"), "{replayed:?}");

    let settle = peer::SettleRequest {
        caller: OTHER.0.into(),
        source_ip: "127.0.0.1".into(),
        delivery_id: "it-tier-0~00".into(),
        hand_out: None,
        group: None,
        action: Some(peer::settle_request::Action::Ack(peer::Ack {})),
    };
    let signed = peer_signature("settle", "it-tier-0", &settle);
    let changed = peer::SettleRequest { caller: APP.0.into(), ..settle.clone() };
    let refused = client.settle(with_signature(changed, &signed)).await.expect_err("another caller");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    let for_another = peer_signature("settle", "it-tier-1", &settle);
    let refused = client.settle(with_signature(settle.clone(), &for_another)).await.expect_err("another instance");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    // Unchanged, for this instance, once: taken (and answered by the gateway: no such delivery here).
    let answered = client.settle(with_signature(settle, &signed)).await.expect("taken").into_inner();
    assert!(matches!(answered.outcome, Some(peer::settle_reply::Outcome::Refused(_))), "{answered:?}");

    let served = |action: &str, result: &str| {
        format!("popgate_tier_settlements_served_total{{action=\"{action}\",result=\"{result}\"}}")
    };
    assert_eq!(instance.metric(&served("identify", "replayed")).await, 1.0);
    assert_eq!(instance.metric(&served("ack", "unauthenticated")).await, 2.0);
    assert_eq!(instance.metric(&served("ack", "refused")).await, 1.0);
}

/// How many messages the consumers behind the TCP balancer each consume, published one every
/// [`PUBLISH_EVERY`] while the balancer moves connections.
const STREAMED: usize = 36;
const PUBLISH_EVERY: Duration = Duration::from_millis(300);
/// Every this long the balancer closes the connections of one instance (the next each time).
const CUT_EVERY: Duration = Duration::from_millis(2000);

/// The RocketMQ clients apps run, behind a TCP balancer (round robin, no stickiness, as a Kubernetes Service
/// or an L4 load balancer): gRPC PushConsumers and SimpleConsumers of both SDK versions and a remoting POP
/// consumer (5.x `rocketmq-client`), one consumer group each, under a steady stream of published messages,
/// while the balancer closes one instance's connections every 2 s (a drained node, a rebalance). Each client
/// connects again, to the next instance, and settles there what the previous one handed out: those ACKs are
/// asked of the instance that handed the message out. Counted at the end: every message consumed and settled
/// by every consumer (0 lost), nothing dead-lettered; the messages a consumer saw twice (a receive or an ACK
/// cut in flight) are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rocketmq_clients_settle_through_a_tcp_balancer_that_moves_their_connections_between_instances() {
    let cluster = shared_cluster();
    let topic = unique_topic("tier_lb");
    crate::remoting::create_topic(cluster, &topic).await;
    // The remoting front gives clients one address for every broker: the balancer's, so that a client's
    // connections to "the name server" and to "the brokers" all go through it.
    let remoting_balancer_port = free_port();
    let remoting_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    // A delivery due again where none of its group's consumers waits any more goes back to the broker after 3 s.
    let instances = start_tier_each(&cluster.namesrv_addr, "give_back_unclaimed_ms = 3000\n", |n| {
        format!(
            "ack_timeout_ms = 10000\n\n[remoting]\nlisten = \"127.0.0.1:{}\"\nadvertised_addr = \"127.0.0.1:{remoting_balancer_port}\"\n",
            remoting_ports[n]
        )
    })
    .await;
    let grpc_backends: Vec<Backend> = instances.iter().map(|p| Backend::of(p, &p.grpc)).collect();
    let remoting_backends: Vec<Backend> =
        instances.iter().zip(&remoting_ports).map(|(p, port)| Backend::of(p, &format!("127.0.0.1:{port}"))).collect();
    let grpc = Balancer::tcp_on(free_port(), &grpc_backends).await;
    let remoting = Balancer::tcp_on(remoting_balancer_port, &remoting_backends).await;

    let signed = |mut args: Value| {
        args["accessKey"] = json!(APP.0);
        args["secretKey"] = json!(APP.1);
        args
    };
    let mut consumers = Vec::new();
    for sdk in Sdk::ALL {
        let group = unique_topic(&format!("tier_g_push_{}", sdk.0.replace('.', "")));
        let push = json!({"endpoint": grpc.address, "group": group, "topic": topic, "expectSuccess": STREAMED,
            "distinct": true, "holdMillis": 300, "consumptionThreadCount": 4, "timeoutSeconds": 150,
            "closeTimeoutMillis": 3000});
        consumers.push((format!("gRPC PushConsumer, SDK {}", sdk.0), group, sdk.start("push-consume", &signed(push))));
        let group = unique_topic(&format!("tier_g_simple_{}", sdk.0.replace('.', "")));
        let simple = json!({"endpoint": grpc.address, "group": group, "topic": topic, "expect": STREAMED,
            "distinct": true, "invisibleSeconds": 10, "maxMessageNum": 4, "ackAfterMs": 150,
            "ackFailedGraceSeconds": ACK_FAILED_GRACE_SECS, "stopOnRejection": false, "timeoutSeconds": 150});
        consumers.push((
            format!("gRPC SimpleConsumer, SDK {}", sdk.0),
            group,
            sdk.start("simple-consume", &signed(simple)),
        ));
    }
    let group = unique_topic("tier_g_pop");
    let dir = tempfile::tempdir().expect("tempdir");
    let started = dir.path().join("started");
    let pop = json!({"namesrv": remoting.address, "pollNameServerIntervalMs": 1000, "heartbeatBrokerIntervalMs": 2000,
        "clientRebalance": false, "popInvisibleTimeMs": 10_000, "group": group, "topic": topic, "expect": STREAMED,
        "holdMs": 300, "settleMs": 3000, "timeoutMs": 150_000, "startedFile": started});
    let client = RemotingClient::V5;
    // As the gRPC consumers below, the remoting one has started before any cut: a route query cut during its
    // start() fails the start.
    let pop_consumer =
        client.start("push-consume", &signed(pop)).once_file_exists(&started, Duration::from_secs(120)).await;
    consumers.push((format!("remoting POP consumer, rocketmq-client {}", client.0), group, pop_consumer));

    // Every gRPC consumer has started (and received once, which subscribes its group) before the balancer moves
    // connections: the SDK fails its start when its telemetry stream is cut while it waits for its settings,
    // which on a loaded machine (six JVMs starting on two cores) took 11 s in a clean-clone run. An app would
    // start it again; here it would end the test before anything was measured.
    let grpc_groups: Vec<String> =
        consumers.iter().filter(|(what, ..)| what.starts_with("gRPC")).map(|(_, group, _)| group.clone()).collect();
    eventually(Duration::from_secs(120), "every gRPC consumer started and subscribed", || async {
        let mut subscribed = BTreeSet::new();
        for instance in &instances {
            let view = admin_view(instance, "/admin/subscriptions").await;
            for subscription in view["subscriptions"].as_array().into_iter().flatten() {
                if let Some((group, _)) = subscription["id"].as_str().and_then(|id| id.split_once(':')) {
                    subscribed.insert(group.to_owned());
                }
            }
        }
        grpc_groups.iter().all(|group| subscribed.contains(group))
    })
    .await;

    // A steady stream of messages while the balancer moves connections, one instance's at a time; it goes on
    // moving them a while after the last message, while the last ones are being settled.
    let publisher = Client::new();
    let mut cuts = 0;
    let mut next_cut = Instant::now() + CUT_EVERY;
    for n in 0..STREAMED {
        let event = json!({"topic": topic, "data": format!("m-{n}")});
        let base = &instances[n % instances.len()].base;
        let (status, answer) =
            call(&publisher, base, reqwest::Method::POST, "/events/publish", APP.1, Some(event)).await;
        assert_eq!(status, 200, "{answer}");
        tokio::time::sleep(PUBLISH_EVERY).await;
        if Instant::now() >= next_cut {
            cut_one(&[&grpc, &remoting], cuts).await;
            cuts += 1;
            next_cut += CUT_EVERY;
        }
    }
    for _ in 0..4 {
        tokio::time::sleep(CUT_EVERY).await;
        cut_one(&[&grpc, &remoting], cuts).await;
        cuts += 1;
    }

    let sent: BTreeSet<String> = (0..STREAMED).map(|n| format!("m-{n}")).collect();
    let direct = Direct::connect(&cluster.namesrv_addr).await;
    for (what, group, consumer) in consumers {
        let result = consumer.finish(Duration::from_secs(200)).await;
        assert_eq!(result["timedOut"], false, "{what} consumed every message: {result}");
        let settled = settled_bodies(&result);
        let missing: Vec<&String> = sent.difference(&settled).collect();
        // A SimpleConsumer's ACK can fail on its side when the balancer cuts the connection under it, whether or
        // not popgate got it first; one that got there is not redelivered. Those, and only those, may be missing.
        let unconfirmed = strings(&result["ackUnconfirmed"]);
        let ack_errors = &result["ackErrors"];
        // The failed ACKs come first: CI keeps only the start of a long panic message.
        assert!(
            missing.iter().all(|body| unconfirmed.contains(*body)),
            "{what}: consumed and settled every message, not {missing:?}; ACK errors: {ack_errors}; result: {result}"
        );
        if !missing.is_empty() {
            nothing_in_flight(&instances, &group, &what).await;
        }
        let dead = direct.try_read_all(&format!("%DLQ%{group}")).await.unwrap_or_default();
        assert!(dead.is_empty(), "{what}: nothing dead-lettered: {} messages", dead.len());
        let failed_acks = ack_errors.as_array().map_or(0, Vec::len);
        println!(
            "tier behind a TCP balancer: {what}: {} of {STREAMED} seen twice or more; {failed_acks} ACKs failed at the \
             client, {} of those messages not redelivered (their ACK had landed)",
            twice(&result),
            missing.len()
        );
    }
    let asked = forwarded(&instances, "ack", "ok").await;
    let refused = forwarded(&instances, "ack", "refused").await;
    let unreachable = forwarded(&instances, "ack", "unreachable").await;
    println!("tier behind a TCP balancer: {cuts} cuts; ACKs asked of another instance: {asked} landed, {refused} refused, {unreachable} unreachable");
    assert!(asked >= 1.0, "clients whose connections moved settled on another instance what the first handed out");
    assert_eq!(unreachable, 0.0, "every instance stayed reachable");

    a_delivery_due_where_nobody_waits_reaches_its_consumers_on_another_instance(&instances).await;
}

/// A consumer NACKs a delivery on instance 0 and then waits on instance 1 only (its connection moved): the
/// delivery, due again on 0 where nobody waits for it, goes back to the broker after `give_back_unclaimed_ms`
/// (3 s), which hands it to instance 1's next POP. Alone, instance 0 would keep it for a consumer that may
/// never come back to it.
async fn a_delivery_due_where_nobody_waits_reaches_its_consumers_on_another_instance(instances: &[Popgate]) {
    let (topic, group) = (unique_topic("tier_u"), unique_topic("tier_gu"));
    let event = json!({"topic": topic, "data": "unclaimed"});
    let (status, answer) =
        call(&Client::new(), &instances[0].base, reqwest::Method::POST, "/events/publish", APP.1, Some(event)).await;
    assert_eq!(status, 200, "{answer}");
    const GIVEN_BACK: &str = "popgate_deliveries_given_back_total{reason=\"unclaimed\"}";
    let given_back_before = instances[0].metric(GIVEN_BACK).await;
    let held = hand_out(&instances[0], &group, &topic, 1).await;
    let nack = json!({"deliveryId": id_of(&held[0]), "delayMs": 0});
    let (status, answer) =
        call(&Client::new(), &instances[0].base, reqwest::Method::POST, "/events/nack", APP.1, Some(nack)).await;
    assert_eq!((status, &answer["status"]), (200, &json!("retry")), "{answer}");

    let nacked = Instant::now();
    let again = hand_out(&instances[1], &group, &topic, 1).await;
    println!("tier: a delivery NACKed on an instance nobody waits on came back on another in {:?}", nacked.elapsed());
    assert_eq!(data_of(&again[0]), "unclaimed");
    assert!(id_of(&again[0]).starts_with("it-tier-1~"), "handed out by the instance its consumer waits on: {again:?}");
    let given_back = instances[0].metric(GIVEN_BACK).await - given_back_before;
    assert_eq!(given_back, 1.0, "given back to the broker by the instance nobody waited on");
}

/// How long a SimpleConsumer whose ACK failed goes on receiving for the message to come back: its invisible
/// time (10 s), the first backoff, and, when its connection moved meanwhile, the time after which the instance
/// holding it gives it back to the broker (`tier.give_back_unclaimed_ms`, 20 s) with room to spare.
const ACK_FAILED_GRACE_SECS: u64 = 45;

/// The strings of a JSON array.
fn strings(list: &Value) -> BTreeSet<String> {
    list.as_array().into_iter().flatten().filter_map(|v| v.as_str().map(str::to_owned)).collect()
}

/// Waits until no instance holds a delivery of `group` (an ACK made and answered at the broker retires it).
/// `GET path` of `instance`'s admin API, as the admin token; the answer must be 200.
async fn admin_view(instance: &Popgate, path: &str) -> Value {
    let (status, view) = call(&Client::new(), &instance.base, reqwest::Method::GET, path, ADMIN.1, None).await;
    assert_eq!(status, 200, "{path}: {view}");
    view
}

async fn nothing_in_flight(instances: &[Popgate], group: &str, what: &str) {
    let mut held = Value::Null;
    let settled = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let mut all = Vec::new();
            for instance in instances {
                let view = admin_view(instance, &format!("/admin/deliveries?group={group}")).await;
                all.extend(view["deliveries"].as_array().cloned().unwrap_or_default());
            }
            if all.is_empty() {
                return;
            }
            held = Value::Array(all);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    assert!(
        settled.is_ok(),
        "{what}: a message whose ACK failed at the client was not redelivered, so no instance may hold it: {held}"
    );
}

/// Cut number `cut`: the balancers close their connections to instance `cut % 3`.
async fn cut_one(balancers: &[&Balancer], cut: usize) {
    for balancer in balancers {
        let answer = balancer.cut_connections_to(cut % 3).await;
        assert!(answer.is_empty(), "haproxy closed the connections: {answer}");
    }
}

/// The bodies a consumer driver consumed and settled: a SimpleConsumer's ACKed ones, a PushConsumer's answered
/// with success (the SDK ACKs those), a remoting consumer's consumed ones.
fn settled_bodies(result: &Value) -> BTreeSet<String> {
    let entries = result["received"].as_array().cloned().unwrap_or_default();
    entries
        .iter()
        .filter(|e| e["acked"] == true || e["result"] == "SUCCESS" || e["result"] == "CONSUME_SUCCESS")
        .filter_map(|e| e["body"].as_str().map(str::to_owned))
        .collect()
}

/// How many bodies a consumer saw more than once.
fn twice(result: &Value) -> usize {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for entry in result["received"].as_array().cloned().unwrap_or_default() {
        *seen.entry(entry["body"].as_str().unwrap_or_default().to_owned()).or_default() += 1;
    }
    seen.values().filter(|n| **n > 1).count()
}

/// PEM files of a CA made for a test, and of the certificates it signs.
struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// The CA's certificate.
    pem: std::path::PathBuf,
    dir: std::path::PathBuf,
}

impl TestCa {
    fn new(dir: &std::path::Path, name: &str) -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().expect("a key");
        let pem = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&pem, params.self_signed(&key).expect("a CA certificate").pem()).expect("write");
        TestCa { issuer: rcgen::Issuer::new(params, key), pem, dir: dir.to_owned() }
    }

    /// A certificate for server and client use naming only `name` (not the address peers dial), and its key.
    fn sign(&self, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let mut params = rcgen::CertificateParams::new(vec![name.to_owned()]).expect("params");
        params.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let key = rcgen::KeyPair::generate().expect("a key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        let (cert_path, key_path) = (self.dir.join(format!("{name}.pem")), self.dir.join(format!("{name}.key")));
        std::fs::write(&cert_path, cert.pem()).expect("write");
        std::fs::write(&key_path, key.serialize_pem()).expect("write");
        (cert_path, key_path)
    }

    /// The `[tier]` lines of an instance with the certificate `sign(name)` makes.
    fn tier_lines(&self, name: &str) -> String {
        let (cert, key) = self.sign(name);
        format!(
            "tls_cert_path = \"{}\"\ntls_key_path = \"{}\"\ntls_ca_path = \"{}\"\n",
            cert.display(),
            key.display(),
            self.pem.display()
        )
    }
}

/// `Identify` asked of instance `it-tier-0` on `port` through `connector` (`None`: plaintext), signed with the
/// tier's secret: the id that answers, or why nothing did.
async fn identify_over(port: u16, connector: Option<popgate::tier::tls::PeerConnector>) -> Result<String, String> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .expect("an address")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5));
    let channel = match connector {
        Some(connector) => endpoint.connect_with_connector(connector).await,
        None => endpoint.connect().await,
    };
    let mut client = PeerClient::new(channel.map_err(|e| format!("connect: {e:?}"))?);
    let identify = peer::IdentifyRequest { asker: "it-tier-9".into() };
    let signature = peer_signature("identify", "", &identify);
    let reply = client.identify(with_signature(identify, &signature)).await.map_err(|status| format!("{status:?}"))?;
    Ok(reply.into_inner().instance_id)
}

/// Mutual TLS on the peer link (issue #46). Two instances each with a certificate of the tier's CA that names
/// neither the address the other dials nor anything it checks (the chain to the CA is what is checked): an ACK
/// of one's delivery made on the other is asked of it over the link, and lands. The peer port speaks nothing
/// else: a request signed with the tier's secret is refused over plaintext (a plaintext link takes it) and over
/// TLS with a certificate of another CA, and taken over TLS with one of the tier's CA; an instance without TLS
/// (which warns that its link is plaintext) cannot join. The refusals are counted by reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_mutual_tls_peers_settle_and_the_peer_port_refuses_plaintext_and_other_cas_certificates() {
    let cluster = shared_cluster();
    let dir = tempfile::tempdir().expect("tempdir");
    let (tier, stranger) = (TestCa::new(dir.path(), "tier"), TestCa::new(dir.path(), "stranger"));
    let (port_0, port_1) = (free_port(), free_port());
    let (first_toml, second_toml) = (
        peer_toml(0, port_0, &[port_1], "", &tier.tier_lines("popgate-0.peers.invalid")),
        peer_toml(1, port_1, &[port_0], "", &tier.tier_lines("popgate-1.peers.invalid")),
    );
    let (first, second) = tokio::join!(
        Popgate::start(&cluster.namesrv_addr, &first_toml),
        Popgate::start(&cluster.namesrv_addr, &second_toml),
    );
    for instance in [&first, &second] {
        assert!(instance.output().contains("(mutual TLS)"), "{}", instance.output());
        assert!(!instance.output().contains("The peer link is plaintext"), "{}", instance.output());
        crate::harness::eventually(Duration::from_secs(20), "each instance knows the other", || async {
            instance.metric("popgate_tier_peers").await == 1.0
        })
        .await;
    }

    // Handed out by the first, ACKed on the second: asked of the first over TLS, and landed there.
    let (topic, group) = (unique_topic("tier_tls"), unique_topic("tier_gtls"));
    let event = json!({"topic": topic, "data": "over tls"});
    let (status, answer) =
        call(&Client::new(), &first.base, reqwest::Method::POST, "/events/publish", APP.1, Some(event)).await;
    assert_eq!(status, 200, "{answer}");
    let held = hand_out(&first, &group, &topic, 1).await;
    assert!(id_of(&held[0]).starts_with("it-tier-0~"), "{held:?}");
    assert_acked_at(&second, &id_of(&held[0])).await;
    assert_eq!(forwarded(std::slice::from_ref(&second), "ack", "ok").await, 1.0, "asked of the owner");
    assert_eq!(second.metric(SETTLED_AT_BROKER).await, 0.0, "not made at the broker: the owner was reached");
    let served = r#"popgate_tier_settlements_served_total{action="ack",result="ok"}"#;
    assert_eq!(first.metric(served).await, 1.0, "settled by the owner");
    let again = handed_out_within(&first, &group, &topic, Duration::from_secs(2)).await;
    assert_eq!(again, Vec::<Value>::new(), "ACKed");

    // A signed request: refused over plaintext, and over TLS with another CA's certificate; taken over TLS
    // with a certificate of the tier's CA (so what refused the others is the transport, not the request).
    let refused = |reason: &str| format!("popgate_tier_connections_refused_total{{reason=\"{reason}\"}}");
    let plaintext = identify_over(port_0, None).await;
    assert!(plaintext.is_err(), "a plaintext client is not served: {plaintext:?}");
    let (cert, key) = stranger.sign("it-stranger");
    let other_ca = popgate::tier::tls::PeerTls::from_files(&cert, &key, &tier.pem, None).expect("files");
    let stranger_answer = identify_over(port_0, Some(other_ca.connector())).await;
    assert!(stranger_answer.is_err(), "another CA's client certificate is refused: {stranger_answer:?}");
    let (cert, key) = tier.sign("it-raw-client");
    let of_the_tier = popgate::tier::tls::PeerTls::from_files(&cert, &key, &tier.pem, None).expect("files");
    assert_eq!(identify_over(port_0, Some(of_the_tier.connector())).await, Ok("it-tier-0".to_owned()));
    crate::harness::eventually(Duration::from_secs(5), "the refusals are counted", || async {
        first.metric(&refused("plaintext")).await >= 1.0 && first.metric(&refused("bad_certificate")).await >= 1.0
    })
    .await;
    assert_eq!(first.metric(&refused("no_certificate")).await, 0.0);

    // An instance without TLS warns that its link is plaintext, and cannot reach the TLS peers.
    let plain_before = first.metric(&refused("plaintext")).await;
    let plain = Popgate::start(&cluster.namesrv_addr, &peer_toml(2, free_port(), &[port_0], "", "")).await;
    assert!(plain.output().contains("The peer link is plaintext"), "{}", plain.output());
    assert_eq!(plain.metric("popgate_tier_peers").await, 0.0, "it does not get in");
    assert!(first.metric(&refused("plaintext")).await > plain_before, "its attempt was refused and counted");
}

const TAKEN: &str = "popgate_tier_subscription_changes_total{way=\"received\",result=\"taken\"}";
const LEASES_KEPT: &str = "popgate_tier_leases_told_total{way=\"received\",result=\"kept\"}";

fn epoch_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970");
    i64::try_from(since.as_millis()).expect("fits")
}

/// Publishes `data` tagged `tag` to `topic` through `instance`.
async fn publish_tagged(instance: &Popgate, topic: &str, data: &str, tag: &str) {
    let event = json!({"topic": topic, "data": data, "tags": tag});
    let (status, answer) =
        call(&Client::new(), &instance.base, reqwest::Method::POST, "/events/publish", APP.1, Some(event)).await;
    assert_eq!(status, 200, "{answer}");
}

/// How long `delivery` was given to be ACKed, from `polled_at` (epoch ms) on.
fn ack_time_ms(delivery: &Value, polled_at: i64) -> i64 {
    delivery["ackDeadline"].as_i64().expect("an ACK deadline") - polled_at
}

/// Waits until `instance` has taken at least `count` subscription changes from its peers.
async fn taken_at_least(instance: &Popgate, count: f64, what: &str) {
    eventually(Duration::from_secs(20), what, || async { instance.metric(TAKEN).await >= count }).await;
}

/// One subscription for the whole tier (issue #48): subscriptions made through instance 0 (ACK timeout 2 s,
/// 2 attempts, only messages tagged `keep`; one group on two topics) govern what instance 1 hands out, and
/// instance 2, started after they were made, has them before it serves anyone: its delivery has the 2 s
/// deadline, comes back once (attempt 2) and then goes to the DLQ, and a message tagged otherwise is never
/// handed out. One unsubscribe, through instance 1, removes one on the other two: their next poll makes the
/// default subscription (30 s to ACK, no filter). (Each instance reads a topic of its own: a POP an instance
/// still has open at the broker when its poll ends may take the next message there.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_made_through_one_instance_governs_every_instance_and_one_unsubscribe_removes_it_everywhere() {
    let cluster = shared_cluster();
    let group = unique_topic("tier_gsub");
    let topics = [unique_topic("tier_sub"), unique_topic("tier_sub")];
    let peer_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let configs: Vec<String> = (0..3).map(|n| peer_toml(n, peer_ports[n], &peer_ports, "", "")).collect();
    let (first, second) = tokio::join!(
        Popgate::start(&cluster.namesrv_addr, &configs[0]),
        Popgate::start(&cluster.namesrv_addr, &configs[1]),
    );
    let client = Client::new();
    for topic in &topics {
        let subscription = json!({"group": group, "topic": topic, "filter": "keep", "ackTimeoutMs": 2000,
            "maxAttempts": 2, "initialBackoffMs": 500, "maxBackoffMs": 500});
        let (status, answer) =
            call(&client, &first.base, reqwest::Method::POST, "/events/subscribe", APP.1, Some(subscription)).await;
        assert_eq!(status, 200, "{answer}");
    }
    taken_at_least(&second, 2.0, "instance 1 to take the subscriptions made on instance 0").await;

    // Instance 1: only the `keep` message, with 2 s to ACK it.
    publish_tagged(&first, &topics[0], "dropped", "drop").await;
    publish_tagged(&first, &topics[0], "kept-1", "keep").await;
    let polled_at = epoch_ms();
    let held = hand_out(&second, &group, &topics[0], 1).await;
    assert_eq!(data_of(&held[0]), "kept-1");
    assert!(ack_time_ms(&held[0], polled_at) <= 4_000, "the subscription's 2 s, not 30 s: {}", held[0]);
    assert_acked_at(&second, &id_of(&held[0])).await;

    // Instance 2, started now, has them before it serves anyone (taken at its first look-up of its peers).
    let third = Popgate::start(&cluster.namesrv_addr, &configs[2]).await;
    assert!(third.metric(TAKEN).await >= 2.0, "taken before it served");
    publish_tagged(&first, &topics[1], "dropped", "drop").await;
    publish_tagged(&first, &topics[1], "kept-2", "keep").await;
    let polled_at = epoch_ms();
    let held = hand_out(&third, &group, &topics[1], 1).await;
    assert_eq!((data_of(&held[0]), &held[0]["attempt"]), ("kept-2".to_owned(), &json!(1)));
    assert!(ack_time_ms(&held[0], polled_at) <= 4_000, "the subscription's 2 s: {}", held[0]);
    // Not ACKed: back once after its 2 s (and 0.5 s backoff), then, its two attempts spent, to the DLQ.
    let again = hand_out(&third, &group, &topics[1], 1).await;
    assert_eq!((data_of(&again[0]), &again[0]["attempt"]), ("kept-2".to_owned(), &json!(2)));
    let dlq = format!("popgate_dlq_messages_total{{group=\"{group}\"}}");
    eventually(Duration::from_secs(20), "the DLQ write after two attempts", || async {
        third.metric(&dlq).await >= 1.0
    })
    .await;
    let after = handed_out_within(&third, &group, &topics[1], Duration::from_secs(2)).await;
    assert_eq!(after, Vec::<Value>::new(), "nothing after the last attempt, and never the `drop` message");

    // One unsubscribe, through instance 1, removes it on instances 0 and 2 too.
    let (taken_first, taken_third) = (first.metric(TAKEN).await, third.metric(TAKEN).await);
    let unsubscribe = json!({"group": group, "topic": topics[1]});
    let (status, answer) =
        call(&client, &second.base, reqwest::Method::POST, "/events/unsubscribe", APP.1, Some(unsubscribe)).await;
    assert_eq!(status, 200, "{answer}");
    taken_at_least(&first, taken_first + 1.0, "instance 0 to take the removal").await;
    taken_at_least(&third, taken_third + 1.0, "instance 2 to take the removal").await;
    for (instance, data) in [(&first, "after-0"), (&third, "after-2")] {
        publish_tagged(&first, &topics[1], data, "other").await;
        let polled_at = epoch_ms();
        let held = hand_out(instance, &group, &topics[1], 1).await;
        assert_eq!(data_of(&held[0]), data, "no filter any more");
        assert!(ack_time_ms(&held[0], polled_at) >= 20_000, "the default 30 s: {}", held[0]);
        assert_acked_at(instance, &id_of(&held[0])).await;
    }
}

/// A settlement answered as done is done (issue #48). The owner of two deliveries renews their broker leases
/// (ChangeInvisibleTime: new handles, the ones the clients' handles carry are dead) and tells its peers, then is
/// `kill -9`ed and kept down past the renewed lease. An ACK through a survivor right away is made with the
/// renewed lease and answered as done; one made once that lease is due for renewal (the survivor cannot know
/// whether the owner renewed it again) is made the same way and answered "unconfirmed" (202). Neither message
/// comes back: not past the renewed lease, nor past the broker's revive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_through_survivors_after_the_owners_lease_renewal_land_and_nothing_comes_back() {
    let cluster = shared_cluster();
    let (topic, group) = (unique_topic("tier_renew"), unique_topic("tier_grenew"));
    // A 16 s lease is renewed with 8 s left, and the renewed one is surely current for 8 - 1 s after that.
    let instances = start_tier(&cluster.namesrv_addr, "ack_timeout_ms = 120000\nlease_ms = 16000").await;
    for n in 0..2 {
        let event = json!({"topic": topic, "data": format!("renewed-{n}")});
        let (status, answer) =
            call(&Client::new(), &instances[0].base, reqwest::Method::POST, "/events/publish", APP.1, Some(event))
                .await;
        assert_eq!(status, 200, "{answer}");
    }
    let held = hand_out(&instances[0], &group, &topic, 2).await;
    eventually(Duration::from_secs(30), "the owner to renew both leases and tell its peers", || async {
        instances[1].metric(LEASES_KEPT).await >= 2.0 && instances[2].metric(LEASES_KEPT).await >= 2.0
    })
    .await;
    let renewed = Instant::now();
    let [mut owner, second, third] = instances;
    owner.kill9();

    assert_acked_at(&second, &id_of(&held[0])).await;
    // Past the point where the owner, had it lived, would have renewed the lease again (8 s after the renewal).
    tokio::time::sleep(Duration::from_secs(9).saturating_sub(renewed.elapsed())).await;
    let (status, answer) = ack_at(&third, &id_of(&held[1])).await;
    assert_eq!((status, &answer["status"]), (202, &json!("unconfirmed")), "{answer}");

    // The renewed lease ends 16 s after the renewal; the broker would put an unACKed message back some seconds
    // later. Neither comes back.
    let until = renewed + Duration::from_secs(36);
    let again = handed_out_within(&second, &group, &topic, until.saturating_duration_since(Instant::now())).await;
    assert_eq!(again, Vec::<Value>::new(), "an ACK answered as done is done");
    let settled = "popgate_tier_settled_at_broker_total{action=\"ack\",result=\"unconfirmed\"}";
    assert_eq!(third.metric(settled).await, 1.0);
}
