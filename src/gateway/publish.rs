//! Publishing, the same for every front: the caller's `Pub` on the topic, the body's size
//! (`publish.max_message_bytes`), no one-way send under the financial profile, a transactional message only to a
//! topic typed for transactions (on the fronts whose yardstick is Apache's proxy; a broker takes it on any
//! topic, and so does the remoting front), the send under the front's placement and retry key, a half message's
//! record stored before the publish is answered (a commit must find it, after a restart too), and the count of
//! every publish request by its outcome (`popgate_publish_requests_total`), a front's own refusals of what did
//! not decode included ([`count_refused_publish`]).
//!
//! What the front decides, because its protocol says it: the message itself (decoded, and checked against the
//! limits with the protocol's own error words: a [`WithinLimits`] is the only message the gateway takes), where it goes (`Placement`), and what a retry of it is known by
//! (`retry_key`: the SDK's message id, a remoting `UNIQ_KEY`, an HTTP `Idempotency-Key`).

use std::sync::Arc;
use std::time::Instant;

use metrics::{counter, histogram};

use super::{may_publish, GatewayError};
use crate::auth::Caller;
use crate::config::Profile;
use crate::metrics as m;
use crate::publish::limits::WithinLimits;
use crate::publish::{Placement, PublishError, Published, Publisher, SendMode};
use crate::transaction::Transactions;

/// One message to publish, as a front decoded it.
pub struct PublishRequest {
    /// The message, within the limits (a half message already marked as popgate's, when `half`).
    pub message: WithinLimits,
    /// Where it goes: popgate's producer policy, or the queue a remoting client chose.
    pub placement: Placement,
    /// Sync, async or one-way.
    pub mode: SendMode,
    /// When the caller stops waiting.
    pub deadline: Option<Instant>,
    /// What a retry of this publish is known by; `None`: never taken for a retry.
    pub retry_key: Option<String>,
    /// A transaction's half message.
    pub half: bool,
    /// When the front received the request: the publish's duration is counted from here.
    pub received_at: Instant,
}

/// Why a front refused a publish before it reached the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishRefused {
    /// The message is larger than `publish.max_message_bytes`.
    TooLarge,
    /// The request did not decode, or its message broke a limit.
    BadRequest,
}

/// Counts a publish request its front refused before it reached the gateway, received at `received_at`.
pub fn count_refused_publish(front: &'static str, why: PublishRefused, received_at: Instant) {
    let result = match why {
        PublishRefused::TooLarge => "too_large",
        PublishRefused::BadRequest => "bad_request",
    };
    count_publish(front, result, received_at);
}

fn count_publish(front: &'static str, result: &'static str, received_at: Instant) {
    counter!(m::PUBLISH_REQUESTS, "result" => result, "transport" => front).increment(1);
    histogram!(m::PUBLISH_DURATION).record(received_at.elapsed().as_secs_f64());
}

/// A publish's result label: `accepted` for a send the broker does not confirm (one-way), none for a refusal
/// of the caller's rights (counted in `popgate_requests_rejected_total` instead).
fn result_of(outcome: &Result<Published, GatewayError>) -> Option<&'static str> {
    match outcome {
        Ok(published) if published.receipt.is_none() => Some("accepted"),
        Ok(_) => Some("ok"),
        Err(refused) => match refused.code() {
            "forbidden" => None,
            "not_found" => Some("not_found"),
            "bad_request" => Some("bad_request"),
            "too_large" => Some("too_large"),
            _ => Some("unavailable"),
        },
    }
}

/// What publishing needs from the rest of popgate.
pub struct Publishing<'a> {
    /// The publish path to the brokers.
    pub publisher: &'a Arc<Publisher>,
    /// Where half messages are recorded.
    pub transactions: &'a Transactions,
    /// The front, as `popgate_publish_requests_total` labels it (`transport`).
    pub front: &'static str,
}

impl Publishing<'_> {
    /// Publishes `request` for `caller`, and counts it.
    ///
    /// # Errors
    /// [`GatewayError::MayNotPublish`] (counted), [`GatewayError::MessageTooLarge`],
    /// [`GatewayError::OneWayUnconfirmed`], [`GatewayError::TopicNotFound`],
    /// [`GatewayError::TakesNoTransactions`] for a half message to a topic not typed for them,
    /// [`GatewayError::NotStored`] when no attempt stored it, [`GatewayError::Unavailable`] when the topic's type
    /// could not be read or a stored half message could not be recorded.
    pub async fn publish(&self, caller: &Caller, request: PublishRequest) -> Result<Published, GatewayError> {
        let received_at = request.received_at;
        let outcome = self.publish_uncounted(caller, request).await;
        if let Some(result) = result_of(&outcome) {
            count_publish(self.front, result, received_at);
        }
        outcome
    }

    async fn publish_uncounted(&self, caller: &Caller, request: PublishRequest) -> Result<Published, GatewayError> {
        let PublishRequest { message, placement, mode, deadline, retry_key, half, received_at: _ } = request;
        let message = message.message();
        may_publish(caller, &message.topic)?;
        self.check_size(message.body.len())?;
        if mode == SendMode::Oneway && self.publisher.profile() == Profile::Financial {
            return Err(GatewayError::OneWayUnconfirmed);
        }
        if half && self.checks_topic_types() {
            self.check_takes_transactions(&message.topic).await?;
        }
        let published = self
            .publisher
            .publish_once_at(message, &placement, mode, deadline, retry_key.as_deref())
            .await
            .map_err(not_published)?;
        if half {
            self.record_half(&message.topic, &published).await?;
        }
        Ok(published)
    }

    /// A body over `publish.max_message_bytes` is not sent, whatever front it came through (a front may refuse
    /// a request body far larger before decoding it, to bound what it reads).
    fn check_size(&self, body_bytes: usize) -> Result<(), GatewayError> {
        let max = self.publisher.max_message_bytes();
        if body_bytes > max {
            return Err(GatewayError::MessageTooLarge { max });
        }
        Ok(())
    }

    /// Whether a half message sent through this front must go to a topic typed for transactions. On the gRPC
    /// and HTTP fronts, yes, as Apache's proxy checks it (unless its `enableTopicMessageTypeCheck` is off:
    /// `publish.check_topic_message_type`). On the remoting front, no: its yardstick is the cluster itself, and
    /// a broker stores a half message on any topic (it reads a topic's type only for its metrics); a 4.x app's
    /// topics were made by 4.x tools and have no type, and its transactions must work through popgate as they
    /// do straight at the cluster.
    fn checks_topic_types(&self) -> bool {
        self.front != "remoting" && self.publisher.checks_topic_message_type()
    }

    /// A transactional message may only go to a topic typed TRANSACTION (or MIXED).
    async fn check_takes_transactions(&self, topic: &str) -> Result<(), GatewayError> {
        match self.publisher.message_type_of(topic).await {
            Ok(Some(kind)) if kind.takes_transactions() => Ok(()),
            Ok(Some(kind)) => {
                Err(GatewayError::TakesNoTransactions { topic: topic.to_owned(), topic_type: kind.as_str() })
            }
            Ok(None) => Err(GatewayError::TopicNotFound(topic.to_owned())),
            Err(why) => Err(GatewayError::Unavailable(format!("could not read the topic's type: {why}"))),
        }
    }

    /// Stores what ending the transaction of the half message just published needs, before the publish is
    /// answered. When it cannot be stored the publish fails: its transaction could not be ended through
    /// popgate (the broker's check-back ends it).
    async fn record_half(&self, topic: &str, published: &Published) -> Result<(), GatewayError> {
        let unrecorded = |why: String| {
            tracing::warn!(topic, error = %why, "A half message was stored but its transaction could not be recorded.");
            GatewayError::Unavailable(format!("the transaction could not be recorded: {why}"))
        };
        let group = self.transactions.producer_group();
        let half = self.publisher.half_message(topic, group, published.receipt.as_ref()).await.map_err(unrecorded)?;
        self.transactions.record(half).await.map_err(|e| unrecorded(e.to_string()))
    }
}

fn not_published(error: PublishError) -> GatewayError {
    match error {
        PublishError::TopicNotFound(topic) => GatewayError::TopicNotFound(topic),
        PublishError::Exhausted { attempts, last_error } => GatewayError::NotStored { attempts, last_error },
    }
}
