//! The remoting clients popgate knows of, from their heartbeats: which producer and consumer groups each is
//! in, and the connection it is on. A consumer group's members are what `GET_CONSUMER_LIST_BY_GROUP` answers,
//! which the client's rebalance divides the queues by; when they change, every member is told at once
//! (`NOTIFY_CONSUMER_IDS_CHANGED`, as a broker does), instead of at its next 20 s rebalance.
//!
//! A client leaves its groups when it unregisters, when its connection closes, or when it has sent no
//! heartbeat for `remoting.client_expiry_secs`.
//!
//! A client id belongs to the token that first registered it, for as long as it stays registered, and at most
//! `remoting.max_clients` ids are kept: the gateway's rule for every front ([`gateway::ClientIds`]). So nobody
//! can take over another app's client entry (and with it the check-backs of its producer groups).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Weak;
use std::time::Duration;

use bytes::Bytes;
use metrics::{counter, gauge};
use parking_lot::Mutex;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use rocketmq_protocol::protocol::LanguageCode;
use serde::Deserialize;
use sha2::Digest;
// Tokio's clock, so a unit test on paused time can let heartbeats lapse.
use tokio::time::Instant;

mod heartbeat;

pub(super) use self::heartbeat::{Heartbeat, Registration};
use super::codes;
use super::connection::Connection;
use crate::auth::Caller;
use crate::gateway::{self, ClientIds, ClientOwners, GatewayError};
use crate::metrics as m;

/// How often clients are checked for a missed heartbeat.
const EXPIRY_CHECK: Duration = Duration::from_secs(10);

/// What kind of client a heartbeat says this is, for the clients gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Producer,
    PushConsumer,
    PullConsumer,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Producer, Kind::PushConsumer, Kind::PullConsumer];

    fn label(self) -> &'static str {
        match self {
            Kind::Producer => "producer",
            Kind::PushConsumer => "push_consumer",
            Kind::PullConsumer => "pull_consumer",
        }
    }
}

/// What popgate keeps of a remoting client, beside its id and owner.
struct Client {
    connection: Connection,
    last_heartbeat: Instant,
    /// The heartbeat last passed on to the brokers, and when.
    forwarded: Option<(Registration, Instant)>,
    producer_groups: BTreeSet<String>,
    consumer_groups: BTreeMap<String, Membership>,
}

/// A client's membership of one consumer group, as its heartbeat says.
#[derive(Debug, Clone, Copy)]
struct Membership {
    kind: Kind,
    /// A broadcasting member reads every queue whoever else is in the group: it is not told when the members
    /// change (a broker does not tell it either), so no rebalance of its runs in the middle of its heartbeats.
    broadcasting: bool,
}

impl Client {
    fn new(connection: &Connection) -> Client {
        Client {
            connection: connection.clone(),
            last_heartbeat: Instant::now(),
            forwarded: None,
            producer_groups: BTreeSet::new(),
            consumer_groups: BTreeMap::new(),
        }
    }

    /// The bytes of the heartbeat kept for it ([`Clients::kept_bytes`]).
    fn kept_len(&self) -> usize {
        self.forwarded.as_ref().map_or(0, |(kept, _)| kept.body.len())
    }

    fn kinds(&self) -> BTreeSet<Kind> {
        let mut kinds: BTreeSet<Kind> = self.consumer_groups.values().map(|m| m.kind).collect();
        if !self.producer_groups.is_empty() {
            kinds.insert(Kind::Producer);
        }
        kinds
    }
}

/// Producer groups every client names, whatever its token: Apache's client puts its consumers' inner producer
/// (`MixAll.CLIENT_INNER_PRODUCER_GROUP`) in every heartbeat, and a producer whose group is not set has
/// `DEFAULT_PRODUCER`. Neither is bound to a token.
const SHARED_PRODUCER_GROUPS: [&str; 2] = ["CLIENT_INNER_PRODUCER", "DEFAULT_PRODUCER"];

/// A producer group of `groups` that a client of another token than `caller`'s holds now, of those client
/// `client_id` does not hold already (a heartbeat that names no new group costs no look through the clients).
/// A producer group is asked a transaction's check-backs, half message included: it is the token's whose
/// client registered it first, as a client id is, while that token's clients hold it.
fn producer_group_of_another(
    clients: &ClientIds<Client>,
    client_id: &str,
    caller: &Caller,
    groups: &BTreeSet<String>,
) -> Option<String> {
    let held = clients.get(client_id).map(|client| &client.producer_groups);
    let mut new = groups
        .iter()
        .filter(|group| !SHARED_PRODUCER_GROUPS.contains(&group.as_str()))
        .filter(|group| held.is_none_or(|held| !held.contains(*group)))
        .peekable();
    new.peek()?;
    let new: Vec<&String> = new.collect();
    clients
        .iter()
        .filter(|(_, owner, _)| owner.name != caller.name)
        .find_map(|(_, _, client)| new.iter().find(|group| client.producer_groups.contains(**group)))
        .map(|group| (*group).clone())
}

/// The clients, by client id.
pub(super) struct Clients {
    clients: Mutex<ClientIds<Client>>,
    expiry: Duration,
    /// The bytes of the heartbeats kept to register groups again ([`Client::forwarded`]), all clients together;
    /// changed under the `clients` lock.
    kept_bytes: AtomicUsize,
    /// The most of them ([`MAX_KEPT_HEARTBEAT_BYTES`]).
    max_kept_bytes: usize,
    /// The connection each recent half message came on, by transaction id, and its caller: asked at a
    /// check-back when no producer of the group has registered (yet) by a heartbeat.
    half_senders: moka::sync::Cache<String, (Connection, Caller)>,
}

/// The most half messages whose connection is remembered for their check-back, and for how long: a broker
/// checks a transaction back from `transactionTimeOut` (6 s) on, every `transactionCheckInterval` (30 s), and a
/// producer that keeps its connection heartbeats within 30 s, after which its registration answers instead.
const MAX_HALF_SENDERS: u64 = 100_000;
const HALF_SENDER_KEPT: Duration = Duration::from_secs(600);

/// The largest heartbeat body taken: a client's groups and subscriptions, a few hundred bytes each (a client
/// subscribing to thousands of topics stays under it). A larger one is refused.
pub(super) const MAX_HEARTBEAT_BYTES: usize = 1024 * 1024;
/// The most bytes of heartbeats kept to register groups again, all clients together: past it a client's
/// heartbeat is still passed on to the brokers, but not kept (its group is registered again from its next one).
const MAX_KEPT_HEARTBEAT_BYTES: usize = 256 * 1024 * 1024;

impl Clients {
    /// No clients yet; at most `max` of them, each forgotten `expiry` after its last heartbeat; whose each id
    /// is, `owners` says for every front.
    pub fn new(expiry: Duration, max: usize, owners: ClientOwners) -> Clients {
        for kind in Kind::ALL {
            gauge!(m::REMOTING_CLIENTS, "kind" => kind.label()).set(0.0);
        }
        Clients {
            clients: Mutex::new(ClientIds::new(max, "remoting.max_clients", owners)),
            expiry,
            kept_bytes: AtomicUsize::new(0),
            max_kept_bytes: MAX_KEPT_HEARTBEAT_BYTES,
            half_senders: moka::sync::Cache::builder()
                .max_capacity(MAX_HALF_SENDERS)
                .time_to_live(HALF_SENDER_KEPT)
                .build(),
        }
    }

    /// `caller` sent the half message of transaction `transaction_id` on `connection`.
    pub fn sent_half(&self, transaction_id: &str, connection: &Connection, caller: &Caller) {
        self.half_senders.insert(transaction_id.to_owned(), (connection.clone(), caller.clone()));
    }

    /// Who to ask about transaction `transaction_id` of `topic` and producer `group`: the producer of the group
    /// that heartbeat last (of those whose token may publish to the topic), or else the connection its half
    /// message came on, as a broker asks the channel of a producer it knows (an app checked back before its
    /// first heartbeat reached popgate).
    pub fn check_back_connection(&self, transaction_id: &str, group: &str, topic: &str) -> Option<Connection> {
        self.producer_connection(group, topic).or_else(|| {
            let (connection, caller) = self.half_senders.get(transaction_id)?;
            gateway::may_be_checked_back(&caller, topic).then_some(connection)
        })
    }

    /// Takes a heartbeat of `caller` from `connection`; the consumer groups it joined or left, whose members are
    /// to be told ([`Clients::tell_members`]) once the brokers have its subscriptions.
    ///
    /// # Errors
    /// [`GatewayError::ClientIdTaken`] when the id is another token's, [`GatewayError::TooManyClients`] when a
    /// new id finds `max_clients` registered (counted by the gateway; nothing changes).
    pub fn heartbeat(
        &self,
        connection: &Connection,
        caller: &Caller,
        heartbeat: &Heartbeat,
    ) -> Result<Vec<String>, GatewayError> {
        let producer_groups: BTreeSet<String> =
            heartbeat.producer_data_set.iter().map(|p| p.group_name.clone()).collect();
        let changed = {
            let mut clients = self.clients.lock();
            if let Some(taken) = producer_group_of_another(&clients, &heartbeat.client_id, caller, &producer_groups) {
                counter!(m::REQUESTS_REJECTED, "reason" => "forbidden").increment(1);
                return Err(GatewayError::ProducerGroupTaken(taken));
            }
            let known = clients.len();
            let client = clients.claim(&heartbeat.client_id, caller, || Client::new(connection))?;
            let kinds_before = client.kinds();
            client.connection = connection.clone();
            client.last_heartbeat = Instant::now();
            client.producer_groups = producer_groups;
            let before: BTreeSet<String> = client.consumer_groups.keys().cloned().collect();
            client.consumer_groups = heartbeat
                .consumer_data_set
                .iter()
                .map(|c| {
                    let kind =
                        if c.consume_type == "CONSUME_ACTIVELY" { Kind::PullConsumer } else { Kind::PushConsumer };
                    (c.group_name.clone(), Membership { kind, broadcasting: c.message_model == "BROADCASTING" })
                })
                .collect();
            let after: BTreeSet<String> = client.consumer_groups.keys().cloned().collect();
            let changed: Vec<String> = after.symmetric_difference(&before).cloned().collect();
            let kinds_changed = client.kinds() != kinds_before;
            // The gauge is counted again only when a client's kinds changed: most heartbeats change nothing.
            if kinds_changed || known != clients.len() {
                Self::count(&clients);
            }
            changed
        };
        Ok(changed)
    }

    /// `client_id` of `caller` leaves `producer_group` and `consumer_group` (either may be absent); when it is
    /// then in no group, it is forgotten. Whether it left `consumer_group` (it was a member, registered here by
    /// `caller`): only then does it give back what it holds there.
    ///
    /// # Errors
    /// [`GatewayError::ClientIdTaken`] when another token registered the id (counted; nothing changes).
    pub fn unregister(
        &self,
        client_id: &str,
        caller: &Caller,
        producer_group: Option<&str>,
        consumer_group: Option<&str>,
    ) -> Result<bool, GatewayError> {
        let left: Vec<String> = {
            let mut clients = self.clients.lock();
            let Some(client) = clients.of_caller(client_id, caller)? else { return Ok(false) };
            if let Some(group) = producer_group {
                client.producer_groups.remove(group);
            }
            let left = consumer_group.filter(|g| client.consumer_groups.remove(*g).is_some()).map(str::to_owned);
            let in_no_group = client.producer_groups.is_empty() && client.consumer_groups.is_empty();
            if in_no_group {
                self.kept_bytes.fetch_sub(client.kept_len(), Ordering::Relaxed);
                clients.remove(client_id);
            }
            Self::count(&clients);
            left.into_iter().collect()
        };
        self.tell_members(&left);
        Ok(!left.is_empty())
    }

    /// Every client of connection `id` leaves its groups.
    pub fn connection_closed(&self, id: u64) {
        self.remove_where(|client| client.connection.id == id);
    }

    /// The client ids of consumer group `group`'s members.
    pub fn consumers_of(&self, group: &str) -> Vec<String> {
        let clients = self.clients.lock();
        let mut members: Vec<String> = clients
            .iter()
            .filter(|(_, _, c)| c.consumer_groups.contains_key(group))
            .map(|(id, _, _)| id.to_owned())
            .collect();
        members.sort();
        members
    }

    /// The id of the client on connection `connection_id` that said in its heartbeat it consumes as `group`.
    pub fn consumer_on(&self, connection_id: u64, group: &str) -> Option<String> {
        let clients = self.clients.lock();
        let consumer = clients
            .iter()
            .find(|(_, _, c)| c.connection.id == connection_id && c.consumer_groups.contains_key(group))
            .map(|(id, _, _)| id.to_owned());
        consumer
    }

    /// Whether `client_id`'s heartbeat `registration` is to be passed on to the brokers: when it changed, or the
    /// last one passed on is `interval` old. A client sends the same heartbeat once per broker of its routes, and
    /// all of them reach popgate. Kept with the client, so it goes when the client does.
    pub fn should_forward(&self, client_id: &str, registration: &Registration, interval: Duration) -> bool {
        let mut clients = self.clients.lock();
        let Some(client) = clients.get_mut(client_id) else { return true };
        let fresh = client
            .forwarded
            .as_ref()
            .is_some_and(|(seen, at)| seen.digest == registration.digest && at.elapsed() < interval);
        if !fresh {
            let kept = self.kept_bytes.load(Ordering::Relaxed).saturating_sub(client.kept_len());
            client.forwarded = None;
            let room = kept + registration.body.len() <= self.max_kept_bytes;
            if room {
                client.forwarded = Some((registration.clone(), Instant::now()));
            }
            let kept = if room { kept + registration.body.len() } else { kept };
            self.kept_bytes.store(kept, Ordering::Relaxed);
        }
        !fresh
    }

    /// The registrations last passed on to the brokers of consumer group `group`'s members.
    pub fn registrations_of(&self, group: &str) -> Vec<Registration> {
        let clients = self.clients.lock();
        clients
            .iter()
            .filter(|(_, _, c)| c.consumer_groups.contains_key(group))
            .filter_map(|(_, _, c)| c.forwarded.as_ref().map(|(registration, _)| registration.clone()))
            .collect()
    }

    /// The connection of the producer of `group` that sent a heartbeat last and whose token may publish to
    /// `topic`, if one is connected: a check-back carries the half message, which only a producer allowed on its
    /// topic may see (anyone may name any producer group in a heartbeat).
    pub fn producer_connection(&self, group: &str, topic: &str) -> Option<Connection> {
        let clients = self.clients.lock();
        clients
            .iter()
            .filter(|(_, owner, c)| c.producer_groups.contains(group) && gateway::may_be_checked_back(owner, topic))
            .max_by_key(|(_, _, c)| c.last_heartbeat)
            .map(|(_, _, c)| c.connection.clone())
    }

    fn expire(&self) {
        let expiry = self.expiry;
        self.remove_where(|client| client.last_heartbeat.elapsed() > expiry);
    }

    fn remove_where(&self, gone: impl Fn(&Client) -> bool) {
        let left: BTreeSet<String> = {
            let mut clients = self.clients.lock();
            let mut left = BTreeSet::new();
            clients.retain(|_, client| {
                if gone(client) {
                    left.extend(client.consumer_groups.keys().cloned());
                    self.kept_bytes.fetch_sub(client.kept_len(), Ordering::Relaxed);
                    return false;
                }
                true
            });
            Self::count(&clients);
            left
        };
        self.tell_members(&left.into_iter().collect::<Vec<_>>());
    }

    /// Tells every member of each of `groups` that its members changed: they rebalance at once (one-way,
    /// as a broker does). After a heartbeat, only once the brokers have its subscriptions and its answer is
    /// queued ([`super::relay::heartbeat`] says why).
    ///
    /// A broadcasting member is not told, as a broker does not tell it (`ConsumerManager` skips
    /// `BROADCASTING` groups): its queues do not depend on the members, and the rebalance the push would start
    /// gives its subscription a new version whose heartbeat the client skips when another of its heartbeats is
    /// under way ("lock heartBeat, but failed"); the broker then refuses its pulls until its next heartbeat,
    /// up to 30 s later (seen: two broadcasting consumers of one app, 29.9 s).
    pub fn tell_members(&self, groups: &[String]) {
        if groups.is_empty() {
            return;
        }
        let clients = self.clients.lock();
        for group in groups {
            let told = |c: &Client| c.consumer_groups.get(group).is_some_and(|m| !m.broadcasting);
            for (_, _, client) in clients.iter().filter(|(_, _, c)| told(c)) {
                let mut push =
                    RemotingCommand::create_remoting_command(codes::NOTIFY_CONSUMER_IDS_CHANGED).mark_oneway_rpc();
                push.add_ext_field("consumerGroup", group.as_str());
                client.connection.push(push);
            }
        }
    }

    fn count(clients: &ClientIds<Client>) {
        let mut counts: BTreeMap<Kind, usize> = Kind::ALL.iter().map(|k| (*k, 0)).collect();
        for (_, _, client) in clients.iter() {
            for kind in client.kinds() {
                *counts.entry(kind).or_default() += 1;
            }
        }
        for (kind, count) in counts {
            gauge!(m::REMOTING_CLIENTS, "kind" => kind.label()).set(count as f64);
        }
    }
}

/// Drops clients whose heartbeats stopped, until the front is gone.
pub(super) async fn expiry_loop(clients: Weak<Clients>) {
    let mut tick = tokio::time::interval(EXPIRY_CHECK);
    loop {
        tick.tick().await;
        let Some(clients) = clients.upgrade() else { return };
        clients.expire();
    }
}

#[cfg(test)]
mod tests {
    use bytes::BytesMut;
    use tokio::sync::mpsc;

    use super::*;
    use crate::remoting::connection::Outbound;

    fn anyone() -> Caller {
        Caller::unrestricted()
    }

    fn heartbeat(client_id: &str, consumer_groups: &[&str]) -> Heartbeat {
        heartbeat_of(client_id, consumer_groups, "CLUSTERING")
    }

    fn heartbeat_of(client_id: &str, consumer_groups: &[&str], message_model: &str) -> Heartbeat {
        let body = serde_json::json!({
            "clientID": client_id,
            "producerDataSet": [{"groupName": "CLIENT_INNER_PRODUCER"}],
            "consumerDataSet": consumer_groups.iter().map(|g| serde_json::json!({
                "groupName": g, "consumeType": "CONSUME_PASSIVELY", "messageModel": message_model,
                "consumeFromWhere": "CONSUME_FROM_LAST_OFFSET", "subscriptionDataSet": [], "unitMode": false
            })).collect::<Vec<_>>(),
        });
        serde_json::from_value(body).expect("a client's HeartbeatData")
    }

    /// The groups named by the NOTIFY_CONSUMER_IDS_CHANGED pushes queued so far.
    fn notified(queued: &mut mpsc::Receiver<Outbound>) -> Vec<String> {
        let mut groups = Vec::new();
        while let Ok(outbound) = queued.try_recv() {
            let mut buffer = BytesMut::from(&outbound.frame()[..]);
            let push = RemotingCommand::decode(&mut buffer).expect("decodes").expect("a whole frame");
            assert_eq!(push.code(), codes::NOTIFY_CONSUMER_IDS_CHANGED);
            assert!(push.is_oneway_rpc(), "a push is one-way");
            groups.push(
                push.ext_fields().and_then(|f| f.get("consumerGroup")).map(|g| g.to_string()).unwrap_or_default(),
            );
        }
        groups
    }

    #[tokio::test]
    async fn every_member_is_told_when_a_group_gains_or_loses_one() {
        let clients = Clients::new(Duration::from_secs(120), 100, ClientOwners::default());
        let (first, mut first_queue) = Connection::for_test(1);
        let (second, mut second_queue) = Connection::for_test(2);
        let joined = clients.heartbeat(&first, &anyone(), &heartbeat("a@1", &["orders"])).expect("taken");
        assert!(notified(&mut first_queue).is_empty(), "not before the brokers have the subscription");
        clients.tell_members(&joined);
        assert_eq!(notified(&mut first_queue), ["orders"], "the first member too: it rebalances at once");
        let unchanged = clients.heartbeat(&first, &anyone(), &heartbeat("a@1", &["orders"])).expect("taken");
        assert!(unchanged.is_empty(), "a heartbeat that changes nothing tells no one");
        let joined = clients.heartbeat(&second, &anyone(), &heartbeat("b@2", &["orders"])).expect("taken");
        clients.tell_members(&joined);
        assert_eq!(notified(&mut first_queue), ["orders"]);
        assert_eq!(notified(&mut second_queue), ["orders"]);
        assert_eq!(clients.consumers_of("orders"), ["a@1", "b@2"]);

        clients.connection_closed(2);
        assert_eq!(clients.consumers_of("orders"), ["a@1"], "a closed connection's clients leave");
        assert_eq!(notified(&mut first_queue), ["orders"], "and the others are told");
        clients.unregister("a@1", &anyone(), None, Some("orders")).expect("its own");
        assert!(clients.consumers_of("orders").is_empty());
    }

    #[test]
    fn a_registration_tells_whether_it_carries_a_groups_subscription_at_a_version() {
        let body = serde_json::json!({"clientID": "a@1", "consumerDataSet": [{"groupName": "g",
            "subscriptionDataSet": [{"topic": "t", "subString": "*", "subVersion": 100}]}]});
        let request =
            RemotingCommand::create_remoting_command(codes::HEART_BEAT).set_body(body.to_string().into_bytes());
        let registration = Registration::of(&request).expect("a body");
        assert!(registration.subscribes_at_least("g", "t", 100));
        assert!(registration.subscribes_at_least("g", "t", 99));
        assert!(!registration.subscribes_at_least("g", "t", 101), "a pull of a later version");
        assert!(!registration.subscribes_at_least("other", "t", 1));
        assert!(!registration.subscribes_at_least("g", "u", 1));
    }

    #[tokio::test]
    async fn broadcasting_members_are_not_told_when_their_group_gains_or_loses_one_as_a_broker_does_not() {
        let clients = Clients::new(Duration::from_secs(120), 100, ClientOwners::default());
        let (first, mut first_queue) = Connection::for_test(1);
        let (second, mut second_queue) = Connection::for_test(2);
        let joined =
            clients.heartbeat(&first, &anyone(), &heartbeat_of("a@1", &["news"], "BROADCASTING")).expect("taken");
        clients.tell_members(&joined);
        let joined =
            clients.heartbeat(&second, &anyone(), &heartbeat_of("b@2", &["news"], "BROADCASTING")).expect("taken");
        clients.tell_members(&joined);
        assert_eq!(clients.consumers_of("news"), ["a@1", "b@2"], "both are members");
        clients.connection_closed(2);
        assert!(notified(&mut first_queue).is_empty(), "a broadcasting member is never told");
        assert!(notified(&mut second_queue).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_same_heartbeat_is_passed_on_once_per_interval_and_a_changed_one_at_once() {
        let clients = Clients::new(Duration::from_secs(120), 100, ClientOwners::default());
        let (connection, _queue) = Connection::for_test(1);
        clients.heartbeat(&connection, &anyone(), &heartbeat("a@1", &["orders"])).expect("taken");
        let interval = Duration::from_secs(20);
        let registration = |body: &'static str| {
            let request = RemotingCommand::create_remoting_command(codes::HEART_BEAT).set_body(body.as_bytes());
            Registration::of(&request).expect("a body")
        };
        let (first, changed) = (registration("first"), registration("changed"));
        assert!(clients.registrations_of("orders").is_empty(), "nothing passed on yet");
        assert!(clients.should_forward("a@1", &first, interval));
        assert!(!clients.should_forward("a@1", &first, interval), "the same one, once per broker of its routes");
        assert!(clients.should_forward("a@1", &changed, interval), "a changed subscription goes at once");
        tokio::time::advance(Duration::from_secs(21)).await;
        assert!(clients.should_forward("a@1", &changed, interval), "and the same one again after the interval");
        let kept: Vec<Bytes> =
            clients.registrations_of("orders").iter().filter_map(|r| r.command().body().cloned()).collect();
        assert_eq!(kept, [Bytes::from_static(b"changed")], "the last one passed on, to register the group again");
        assert!(clients.registrations_of("payments").is_empty(), "only the group's members'");
    }

    fn token(name: &str, publish: &str, consume: &str) -> Caller {
        Caller::of_test_token(name, publish, consume)
    }

    #[tokio::test]
    async fn a_client_id_stays_with_the_token_that_registered_it_and_the_number_of_ids_is_bounded() {
        let clients = Clients::new(Duration::from_secs(120), 2, ClientOwners::default());
        let (connection, _queue) = Connection::for_test(1);
        let (owner, other) = (token("owner", "t", "orders"), token("other", "u", "*"));
        clients.heartbeat(&connection, &owner, &heartbeat("a@1", &["orders"])).expect("registered");
        let taken = clients.heartbeat(&connection, &other, &heartbeat("a@1", &["orders"]));
        assert!(matches!(taken, Err(GatewayError::ClientIdTaken(_))), "another token cannot take the id over");
        let left = clients.unregister("a@1", &other, None, Some("orders"));
        assert!(matches!(left, Err(GatewayError::ClientIdTaken(_))), "nor unregister it");
        assert_eq!(clients.consumers_of("orders"), ["a@1"]);
        clients.heartbeat(&connection, &owner, &heartbeat("a@1", &["orders"])).expect("its own token, again");
        clients.heartbeat(&connection, &other, &heartbeat("b@2", &["orders"])).expect("a second id");
        let third = clients.heartbeat(&connection, &other, &heartbeat("c@3", &["orders"]));
        assert!(matches!(third, Err(GatewayError::TooManyClients { max: 2, .. })), "no third id");
        // Out of all its groups (the heartbeat's inner producer's too), the id is forgotten.
        clients.unregister("b@2", &other, Some("CLIENT_INNER_PRODUCER"), Some("orders")).expect("its own");
        clients.heartbeat(&connection, &other, &heartbeat("c@3", &["orders"])).expect("room again");
    }

    #[tokio::test]
    async fn a_check_back_goes_only_to_a_producer_whose_token_may_publish_to_the_topic() {
        let clients = Clients::new(Duration::from_secs(120), 10, ClientOwners::default());
        let (allowed, _allowed_queue) = Connection::for_test(1);
        let (claimant, _claimant_queue) = Connection::for_test(2);
        let producer = |id: &str| -> Heartbeat {
            serde_json::from_value(serde_json::json!({"clientID": id, "producerDataSet": [{"groupName": "pg"}]}))
                .expect("HeartbeatData")
        };
        clients.heartbeat(&allowed, &token("app", "orders", "-"), &producer("app@1")).expect("registered");
        // Another token may not name that producer group while the app's client holds it (the last heartbeat
        // used to win); the group's check-backs go to the app only.
        let claimed = clients.heartbeat(&claimant, &token("claimant", "orders", "-"), &producer("claimant@1"));
        assert!(matches!(claimed, Err(GatewayError::ProducerGroupTaken(group)) if group == "pg"));
        assert_eq!(clients.producer_connection("pg", "orders").map(|c| c.id), Some(1), "the producer of the topic");
        assert!(clients.producer_connection("pg", "elsewhere").is_none(), "no producer may see that topic");
        // Another client of the same token may; the inner producer every consumer names is no token's.
        clients.heartbeat(&claimant, &token("app", "orders", "-"), &producer("app@2")).expect("the same token");
        clients.heartbeat(&claimant, &token("claimant", "orders", "-"), &heartbeat("claimant@2", &[])).expect("shared");
        // Once the app's clients are gone, the group is free.
        clients.connection_closed(1);
        clients.connection_closed(2);
        clients.heartbeat(&claimant, &token("claimant", "orders", "-"), &producer("claimant@1")).expect("free");
    }

    #[tokio::test]
    async fn the_heartbeats_kept_to_register_groups_again_stay_within_their_bytes() {
        let mut clients = Clients::new(Duration::from_secs(120), 1_000, ClientOwners::default());
        clients.max_kept_bytes = 10 * 1024;
        let (connection, _queue) = Connection::for_test(1);
        let interval = Duration::from_secs(20);
        for n in 0..100 {
            let id = format!("c@{n}");
            clients.heartbeat(&connection, &anyone(), &heartbeat(&id, &["orders"])).expect("taken");
            let body = vec![b' '; 1024 + n];
            let request = RemotingCommand::create_remoting_command(codes::HEART_BEAT).set_body(body);
            let registration = Registration::of(&request).expect("a body");
            assert!(clients.should_forward(&id, &registration, interval), "still passed on to the brokers");
        }
        let kept: usize = clients.registrations_of("orders").iter().map(|r| r.body.len()).sum();
        assert!(kept <= 10 * 1024, "{kept} bytes kept");
        assert_eq!(clients.kept_bytes.load(Ordering::Relaxed), kept, "the count matches what is kept");
        clients.connection_closed(1);
        assert_eq!(clients.kept_bytes.load(Ordering::Relaxed), 0, "given back with the clients");
        let huge =
            RemotingCommand::create_remoting_command(codes::HEART_BEAT).set_body(vec![b' '; MAX_HEARTBEAT_BYTES + 1]);
        assert!(Heartbeat::of(&huge).is_err(), "a heartbeat over 1 MiB is refused");
    }

    #[tokio::test]
    async fn a_million_client_ids_keep_the_clients_under_max_clients() {
        let max = 1_000;
        let clients = Clients::new(Duration::from_secs(120), max, ClientOwners::default());
        let (connection, _queue) = Connection::for_test(1);
        let mut heartbeat = heartbeat("template", &["orders"]);
        let mut full = 0;
        for n in 0..1_000_000 {
            heartbeat.client_id = format!("flood@{n}");
            match clients.heartbeat(&connection, &anyone(), &heartbeat) {
                Ok(_) => {}
                Err(GatewayError::TooManyClients { .. }) => full += 1,
                Err(other) => panic!("{other}"),
            }
        }
        assert_eq!(clients.clients.lock().len(), max, "never more than max_clients ids");
        assert_eq!(full, 1_000_000 - max, "every id past the bound was refused");
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_whose_heartbeats_stopped_leaves_its_groups() {
        let clients = Clients::new(Duration::from_secs(120), 100, ClientOwners::default());
        let (connection, _queue) = Connection::for_test(1);
        clients.heartbeat(&connection, &anyone(), &heartbeat("a@1", &["orders"])).expect("taken");
        tokio::time::advance(Duration::from_secs(121)).await;
        clients.expire();
        assert!(clients.consumers_of("orders").is_empty());
    }
}
