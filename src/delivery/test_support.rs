//! What the delivery unit tests share: the layer's dependencies with no reachable broker (admission,
//! hand-out and recovery need none), and a plain subscription.

use std::sync::Arc;
use std::time::Duration;

use super::record::Subscription;
use crate::broker::consumer::{Popped, PoppedEvent, ReceiptHandle};
use crate::broker::BrokerClient;
use crate::clock::Epoch;
use crate::config::{BrokerConfig, Config, DeliveryConfig};
use crate::publish::Publisher;

/// A broker client that reaches nothing, the publisher over it, and the default delivery config.
pub(crate) async fn offline_parts() -> (Arc<BrokerClient>, Arc<Publisher>, DeliveryConfig) {
    let config = Config::default();
    let broker_config = BrokerConfig { namesrv_addr: "127.0.0.1:1".into(), ..BrokerConfig::default() };
    let broker = Arc::new(BrokerClient::connect(&broker_config, "test").await.expect("client"));
    let publisher = Arc::new(Publisher::new(
        broker.clone(),
        config.publish.clone(),
        &config.fault_avoidance,
        config.reliability.profile,
    ));
    // No broker answers here: the group config is not asked for.
    let delivery = crate::config::DeliveryConfig { follow_group_config: false, ..config.delivery };
    (broker, publisher, delivery)
}

/// Group `g` on topic `t` with the seed's policy.
pub(crate) fn subscription() -> Subscription {
    Subscription {
        group: "g".into(),
        topic: "t".into(),
        filter: "*".into(),
        filter_type: Default::default(),
        ack_timeout_ms: 30_000,
        max_attempts: 6,
        initial_backoff_ms: 1_000,
        max_backoff_ms: 16_000,
        ordered: false,
        push: None,
        implicit: false,
        version: None,
    }
}

/// A message as the POP path records it: event `id` carrying `body`, its POP sent `ago_ms` ago (popgate's
/// clock, and the broker's), leased for an hour from then.
pub(crate) fn popped(id: &str, body: &[u8], ago_ms: u64) -> Popped {
    let popped_at = Epoch::now() - Duration::from_millis(ago_ms);
    let event = PoppedEvent {
        id: id.into(),
        topic: "t".into(),
        tags: None,
        keys: Vec::new(),
        properties: Default::default(),
        body: body.to_vec(),
        born_timestamp: 0,
        reconsume_times: 0,
        retry_topic: None,
        message_group: None,
        stored: Default::default(),
    };
    let handle = ReceiptHandle {
        broker_name: "broker-a".into(),
        broker_addr: "127.0.0.1:1".into(),
        extra_info: "0 0 0 0 0 broker-a 0 0".into(),
        ack_topic: "t".into(),
        queue_id: 0,
        queue_offset: 0,
        pop_time_ms: popped_at.as_millis(),
        invisible_ms: 3_600_000,
        lease_until_ms: popped_at + Duration::from_millis(3_600_000),
    };
    Popped { event, handle }
}
