//! The Telemetry settings handshake: a client sends its Settings when it starts, and does not finish
//! starting until the server answers with the settings it is to use (the Java SDK gives up after ~6 s).
//! popgate answers at once with the client's settings completed by its own values: the producer's body limit
//! and backoff, and for consumers popgate's retry policy, so the SDK and popgate agree on it.

use std::time::Duration;

use super::proto::{
    retry_policy, settings, ClientType, CustomizedBackoff, ExponentialBackoff, Metric, RetryPolicy, Settings,
};
use crate::config::Config;
use crate::gateway::below::RetryPolicy as DeliveryRetryPolicy;
use crate::gateway::below::Subscription;

/// Messages a consumer receives per call, when it does not say.
const RECEIVE_BATCH_SIZE: i32 = 32;
/// How long a consumer's receive waits for messages at most, when it does not say.
const LONG_POLLING_TIMEOUT: Duration = Duration::from_secs(20);

/// The settings to answer `client` with; `group_sub` is popgate's subscription of a consumer's group, when
/// there is one: its retry policy and ordering win over the configured defaults. `group_orderly`: the
/// cluster's config makes the consumer's group orderly (FIFO, as Apache's proxy decides it).
pub fn reply(client: Settings, config: &Config, group_sub: Option<&Subscription>, group_orderly: bool) -> Settings {
    let mut reply = client;
    reply.metric = Some(Metric { on: false, endpoints: None });
    match reply.pub_sub.take() {
        Some(settings::PubSub::Publishing(mut publishing)) => {
            publishing.max_body_size = i32::try_from(config.publish.max_message_bytes).unwrap_or(i32::MAX);
            // Only the types popgate's queues accept (see QueryRoute) pass the SDK's own check, unless the check is
            // switched off (Apache's proxy answers its `enableTopicMessageTypeCheck` here).
            publishing.validate_message_type = config.publish.check_topic_message_type;
            reply.backoff_policy = Some(producer_backoff(reply.backoff_policy.take(), config));
            reply.pub_sub = Some(settings::PubSub::Publishing(publishing));
        }
        Some(settings::PubSub::Subscription(mut subscription)) => {
            subscription.receive_batch_size = Some(subscription.receive_batch_size.unwrap_or(RECEIVE_BATCH_SIZE));
            subscription.long_polling_timeout =
                Some(subscription.long_polling_timeout.unwrap_or_else(|| duration(LONG_POLLING_TIMEOUT)));
            subscription.fifo = Some(group_orderly || group_sub.is_some_and(|s| s.ordered));
            reply.backoff_policy = Some(consumer_backoff(config, group_sub));
            reply.pub_sub = Some(settings::PubSub::Subscription(subscription));
        }
        None => {}
    }
    reply
}

/// The producer's backoff: the SDK only accepts an exponential one. Its attempt count stays the client's
/// (each SDK attempt is a whole popgate publish, with popgate's own retries on other brokers).
fn producer_backoff(client: Option<RetryPolicy>, config: &Config) -> RetryPolicy {
    let max_attempts = client
        .map(|p| p.max_attempts)
        .filter(|n| *n > 0)
        .unwrap_or(1 + config.publish.retry_times_when_send_failed as i32);
    RetryPolicy {
        max_attempts,
        strategy: Some(retry_policy::Strategy::ExponentialBackoff(ExponentialBackoff {
            initial: Some(duration(Duration::from_millis(10))),
            max: Some(duration(Duration::from_secs(1))),
            multiplier: 2.0,
        })),
    }
}

/// popgate's delivery policy as a customized list (1, 2, 4, 8, 16 s by default): the one form every official
/// SDK reads. popgate still adds its jitter and counts the attempts itself.
fn consumer_backoff(config: &Config, group_sub: Option<&Subscription>) -> RetryPolicy {
    let configured = DeliveryRetryPolicy::from_config(&config.delivery).unwrap_or(DeliveryRetryPolicy::SEED_DEFAULT);
    let policy = group_sub
        .and_then(|s| {
            let (initial, max) = (Duration::from_millis(s.initial_backoff_ms), Duration::from_millis(s.max_backoff_ms));
            DeliveryRetryPolicy::try_new(initial, max, 0.0, s.max_attempts).ok()
        })
        .unwrap_or(configured);
    RetryPolicy {
        max_attempts: i32::try_from(policy.max_attempts).unwrap_or(i32::MAX),
        strategy: Some(retry_policy::Strategy::CustomizedBackoff(CustomizedBackoff {
            next: policy.schedule().into_iter().map(duration).collect(),
        })),
    }
}

/// The kind of client, for the `popgate_grpc_clients{kind}` gauge.
pub fn kind_label(client_type: Option<i32>) -> &'static str {
    match client_type.and_then(|t| ClientType::try_from(t).ok()) {
        Some(ClientType::Producer) => "producer",
        Some(ClientType::PushConsumer) => "push_consumer",
        Some(ClientType::SimpleConsumer) => "simple_consumer",
        _ => "other",
    }
}

/// A protobuf duration.
pub fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}
