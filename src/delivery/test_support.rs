//! What the delivery unit tests share: the layer's dependencies with no reachable broker (admission,
//! hand-out and recovery need none), and a plain subscription.

use std::sync::Arc;

use super::record::Subscription;
use crate::broker::BrokerClient;
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
    (broker, publisher, config.delivery)
}

/// Group `g` on topic `t` with the seed's policy.
pub(crate) fn subscription() -> Subscription {
    Subscription {
        group: "g".into(),
        topic: "t".into(),
        filter: "*".into(),
        ack_timeout_ms: 30_000,
        max_attempts: 6,
        initial_backoff_ms: 1_000,
        max_backoff_ms: 16_000,
        ordered: false,
        push: None,
        implicit: false,
    }
}
