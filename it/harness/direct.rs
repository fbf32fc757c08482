//! A direct RocketMQ client (rocketmq-client-rust, no popgate), to check what actually reached the broker.
//! Reads use PULL through the admin tool's consumer group, which commits no offset: browsing changes nothing.

use std::collections::HashMap;

use cheetah_string::CheetahString;
use rocketmq_client_rust::{ConsumerAdmin, DefaultMQAdminExt, TopicAdmin};
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_runtime::RuntimeOwner;

/// One message as read back from the broker.
#[derive(Debug, Clone)]
pub struct StoredMessage {
    /// Broker that stores it.
    pub broker: String,
    /// Its queue on that broker.
    pub queue_id: i32,
    /// Body bytes.
    pub body: Vec<u8>,
    /// Every property (TAGS, KEYS, UNIQ_KEY and the user's).
    pub properties: HashMap<String, String>,
}

impl StoredMessage {
    fn from_ext(broker: &str, m: &MessageExt) -> StoredMessage {
        StoredMessage {
            broker: broker.to_owned(),
            queue_id: m.queue_id(),
            body: m.body().map(|b| b.to_vec()).unwrap_or_default(),
            properties: m.properties().iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    /// A property's value.
    pub fn property(&self, name: &str) -> Option<&str> {
        self.properties.get(name).map(String::as_str)
    }
}

/// The direct client; drop order keeps the runtime owner last.
pub struct Direct {
    admin: DefaultMQAdminExt,
    _owner: RuntimeOwner,
}

impl Direct {
    /// Connects an admin client to `namesrv_addr`.
    pub async fn connect(namesrv_addr: &str) -> Direct {
        let (owner, runtime) = popgate::broker::client::start_client_runtime().expect("client runtime");
        let mut admin = DefaultMQAdminExt::new(runtime);
        admin.set_namesrv_addr(namesrv_addr);
        admin.start().await.expect("admin client starts");
        Direct { admin, _owner: owner }
    }

    /// [`Direct::connect`] for a cluster with authentication on: every request signed with `access_key` and
    /// `secret_key` (RocketMQ's `AclClientRPCHook`).
    #[allow(dead_code)]
    pub async fn connect_as(namesrv_addr: &str, access_key: &str, secret_key: &str) -> Direct {
        let (owner, runtime) = popgate::broker::client::start_client_runtime().expect("client runtime");
        let credentials = rocketmq_client_rust::SessionCredentials::with_keys(access_key, secret_key);
        let hook = std::sync::Arc::new(rocketmq_client_rust::AclClientRPCHook::new(credentials));
        let mut admin = DefaultMQAdminExt::with_rpc_hook(runtime, hook);
        admin.set_namesrv_addr(namesrv_addr);
        admin.start().await.expect("admin client starts");
        Direct { admin, _owner: owner }
    }

    /// Sends one message straight to a broker, as any RocketMQ producer could, with properties that popgate's
    /// fronts would refuse (control characters, …): what a consumer of popgate must cope with. Auto-creates
    /// the topic as the broker allows.
    pub async fn produce_unchecked(namesrv_addr: &str, topic: &str, body: &str, properties: &[(&str, &str)]) {
        let config = popgate::config::BrokerConfig { namesrv_addr: namesrv_addr.to_owned(), ..Default::default() };
        let client = popgate::broker::BrokerClient::connect(&config, "it-direct-producer").await.expect("client");
        let mut message = popgate::broker::OutgoingMessage::new(topic.to_owned(), body.to_owned().into());
        message.properties.extend(properties.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        let route = client.route(topic).await.expect("a route for the topic");
        let broker = route.writable().next().expect("a writable broker").clone();
        let timeout = std::time::Duration::from_secs(10);
        client.send(&message, &broker, 0, timeout).await.expect("stored by the broker");
        client.shutdown().await;
    }

    /// Creates `topic` with 4 queues on each broker address given (the way an operator pre-creates topics
    /// when auto-creation is off), so its route names all of them from the start.
    pub async fn create_topic(&self, topic: &str, broker_addrs: &[String]) {
        let config = rocketmq_model::common::config::TopicConfig::with_queues(topic, 4, 4);
        self.create_topic_as(config, broker_addrs).await;
    }

    /// As [`Direct::create_topic`], with `queues` read and write queues on each broker.
    pub async fn create_topic_with_queues(&self, topic: &str, queues: u32, broker_addrs: &[String]) {
        let config = rocketmq_model::common::config::TopicConfig::with_queues(topic, queues, queues);
        self.create_topic_as(config, broker_addrs).await;
    }

    /// As [`Direct::create_topic`], typed for FIFO messages (`+message.type=FIFO`, as `mqadmin updateTopic -a`
    /// sets it): Apache's proxy refuses a message with a group on a topic of another type.
    pub async fn create_fifo_topic(&self, topic: &str, broker_addrs: &[String]) {
        let mut config = rocketmq_model::common::config::TopicConfig::with_queues(topic, 4, 4);
        config.attributes.insert(CheetahString::from("+message.type"), CheetahString::from("FIFO"));
        self.create_topic_as(config, broker_addrs).await;
    }

    /// As [`Direct::create_topic`], typed for delayed messages (`+message.type=DELAY`): Apache's proxy refuses
    /// a message with a delivery timestamp on a topic of another type.
    pub async fn create_delay_topic(&self, topic: &str, broker_addrs: &[String]) {
        let mut config = rocketmq_model::common::config::TopicConfig::with_queues(topic, 4, 4);
        config.attributes.insert(CheetahString::from("+message.type"), CheetahString::from("DELAY"));
        self.create_topic_as(config, broker_addrs).await;
    }

    /// As [`Direct::create_topic`], typed for transactional messages (`+message.type=TRANSACTION`): a
    /// transactional send goes only to a topic of that type (or MIXED), through Apache's proxy and popgate.
    pub async fn create_transaction_topic(&self, topic: &str, broker_addrs: &[String]) {
        let mut config = rocketmq_model::common::config::TopicConfig::with_queues(topic, 4, 4);
        config.attributes.insert(CheetahString::from("+message.type"), CheetahString::from("TRANSACTION"));
        self.create_topic_as(config, broker_addrs).await;
    }

    /// Makes consumer group `group` orderly on each broker given, as `mqadmin updateSubGroup -g <group> -o true`
    /// does (the subscription group's `consumeMessageOrderly`).
    pub async fn create_orderly_group(&self, group: &str, broker_addrs: &[String]) {
        let mut config =
            rocketmq_protocol::protocol::subscription::subscription_group_config::SubscriptionGroupConfig::new(
                CheetahString::from(group),
            );
        config.set_consume_message_orderly(true);
        for addr in broker_addrs {
            ConsumerAdmin::create_and_update_subscription_group_config(
                &self.admin,
                CheetahString::from(addr.as_str()),
                config.clone(),
            )
            .await
            .unwrap_or_else(|e| panic!("make {group} orderly on {addr}: {e}"));
        }
    }

    async fn create_topic_as(&self, config: rocketmq_model::common::config::TopicConfig, broker_addrs: &[String]) {
        for addr in broker_addrs {
            TopicAdmin::create_and_update_topic_config(&self.admin, CheetahString::from(addr.as_str()), config.clone())
                .await
                .expect("create topic");
        }
    }

    /// The group's committed consumer offset of each queue of `topic`, by (broker name, queue id): with the
    /// broker's orderly POP, everything below it was ACKed at the broker. (The chaos checker's; the `it`
    /// binary compiles the harness too.)
    #[allow(dead_code)]
    pub async fn consumer_offsets(&self, group: &str, topic: &str) -> Option<HashMap<(String, i32), i64>> {
        use rocketmq_client_rust::ConsumerAdmin;
        let stats = ConsumerAdmin::examine_consume_stats(
            &self.admin,
            CheetahString::from(group),
            Some(CheetahString::from(topic)),
            None,
            None,
            Some(5_000),
        )
        .await
        .ok()?;
        Some(
            stats
                .get_offset_table()
                .iter()
                .map(|(queue, offsets)| {
                    ((queue.broker_name().to_string(), queue.queue_id()), offsets.get_consumer_offset())
                })
                .collect(),
        )
    }

    /// Every message currently stored in `topic`, on every broker and queue.
    pub async fn read_all(&self, topic: &str) -> Vec<StoredMessage> {
        self.try_read_all(topic).await.expect("topic has a route")
    }

    /// What `topic` holds once it holds anything (a `%DLQ%` topic is created by its first message), polling
    /// for at most `timeout`; empty if nothing arrived by then.
    pub async fn read_when_present(&self, topic: &str, timeout: std::time::Duration) -> Vec<StoredMessage> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let read = tokio::time::timeout(std::time::Duration::from_secs(10), self.try_read_all(topic)).await;
            let found = read.ok().flatten().unwrap_or_default();
            if !found.is_empty() || std::time::Instant::now() >= deadline {
                return found;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }

    /// Every message of queue `queue_id` of `topic` at the broker `broker` (name) at `addr`, read without a
    /// route (the brokers' own system topics have none at the name server).
    pub async fn read_queue(&self, broker: &str, addr: &str, topic: &str, queue_id: i32) -> Vec<StoredMessage> {
        let queue = MessageQueue::from_parts(topic, broker, queue_id);
        let mut out = Vec::new();
        let mut offset = 0i64;
        loop {
            let pulled = self.admin.inner().pull_message_from_queue(addr, &queue, "*", offset, 32, 5_000).await;
            let Ok(pulled) = pulled else { return out };
            let found = pulled.msg_found_list().map(<[MessageExt]>::to_vec).unwrap_or_default();
            if found.is_empty() {
                return out;
            }
            out.extend(found.iter().map(|m| StoredMessage::from_ext(broker, m)));
            offset = pulled.next_begin_offset() as i64;
        }
    }

    /// As [`Direct::read_all`], or `None` while the topic has no route (a `%DLQ%` topic before its first
    /// message).
    pub async fn try_read_all(&self, topic: &str) -> Option<Vec<StoredMessage>> {
        let route = TopicAdmin::examine_topic_route_info(&self.admin, CheetahString::from(topic)).await.ok()??;
        let mut out = Vec::new();
        for queue_data in &route.queue_datas {
            let broker = route
                .broker_datas
                .iter()
                .find(|b| b.broker_name() == &queue_data.broker_name)
                .and_then(|b| b.broker_addrs().get(&0).cloned())
                .expect("broker has a master");
            for queue_id in 0..queue_data.read_queue_nums {
                let queue = MessageQueue::from_parts(topic, queue_data.broker_name.as_str(), queue_id as i32);
                let mut offset = 0i64;
                loop {
                    let pulled = self
                        .admin
                        .inner()
                        .pull_message_from_queue(broker.as_str(), &queue, "*", offset, 32, 5_000)
                        .await
                        .expect("pull");
                    let found = pulled.msg_found_list().map(<[MessageExt]>::to_vec).unwrap_or_default();
                    if found.is_empty() {
                        break;
                    }
                    out.extend(found.iter().map(|m| StoredMessage::from_ext(queue_data.broker_name.as_str(), m)));
                    offset = pulled.next_begin_offset() as i64;
                }
            }
        }
        Some(out)
    }
}

/// A second, direct POP consumer on a group (no popgate in between), to observe what the broker itself
/// considers consumed: a message popgate ACKed at the broker never reaches it; one popgate did not ACK comes
/// back to it once its lease lapses.
pub struct DirectConsumer {
    client: popgate::broker::BrokerClient,
}

impl DirectConsumer {
    /// Connects to `namesrv_addr`.
    pub async fn connect(namesrv_addr: &str) -> DirectConsumer {
        let config = popgate::config::BrokerConfig { namesrv_addr: namesrv_addr.to_owned(), ..Default::default() };
        let client = popgate::broker::BrokerClient::connect(&config, "popgate_test_direct").await.expect("client");
        DirectConsumer { client }
    }

    /// POPs (and ACKs) whatever `group` can get from `topic` within `window`, returning the event bodies.
    pub async fn drain(&self, group: &str, topic: &str, window: std::time::Duration) -> Vec<String> {
        self.drain_as(group, topic, window, false).await
    }

    /// [`DirectConsumer::drain`] with the broker's orderly POP (for a group popgate consumed orderly).
    pub async fn drain_as(&self, group: &str, topic: &str, window: std::time::Duration, orderly: bool) -> Vec<String> {
        let deadline = std::time::Instant::now() + window;
        let handle = self.client.dedicated_handle().await.expect("handle");
        let mut bodies = Vec::new();
        while std::time::Instant::now() < deadline {
            let Ok(route) = self.client.route(topic).await else { continue };
            for broker in route.readable() {
                let request = popgate::broker::consumer::PopRequest {
                    group,
                    topic,
                    filter: "*",
                    filter_type: "TAG",
                    max: 32,
                    invisible_ms: 60_000,
                    poll_ms: 1_000,
                    orderly,
                };
                for popped in self.client.pop(handle.handle(), broker, &request).await.unwrap_or_default() {
                    self.client.ack(group, &popped.handle).await.expect("direct ack");
                    bodies.push(String::from_utf8_lossy(&popped.event.body).into_owned());
                }
            }
        }
        drop(handle);
        bodies
    }
}
