//! The gateway's door for reads: every front's subscribe, poll, push stream, gRPC receive and remoting POP
//! starts from a [`Reader`], which only [`Reader::check`] makes (`Sub` on the group and on the topic), and goes
//! to the delivery core through [`Deliveries`], the only handle of it a front holds. So a read cannot skip the
//! check, and what every front's receive does (the topic must exist before a subscription is made for it, the
//! request's filter becomes the group's, the hand-out is stored with its holder under the front's name) is
//! written once, here.

use std::sync::Arc;
use std::time::Duration;

use super::settle::{Owners, Settling};
use super::{holder_id, may_consume, may_read, GatewayError};
use crate::auth::Caller;
use crate::delivery::{
    Dispatched, Dispatcher, FilterType, HandOut, Holder, InFlight, Subscriber, Subscription, SubscriptionRequest,
    Target,
};
use crate::publish::Publisher;

/// A caller's right to read a topic as a consumer group, checked. Every read of the delivery core takes one.
#[derive(Debug, Clone)]
pub struct Reader {
    group: String,
    topic: String,
}

impl Reader {
    /// `caller` reading `topic` as `group`: `Sub` on both ([`super::may_read`]); a refusal is counted.
    ///
    /// # Errors
    /// [`GatewayError::MayNotConsume`], [`GatewayError::MayNotRead`].
    pub fn check(caller: &Caller, group: &str, topic: &str) -> Result<Reader, GatewayError> {
        may_read(caller, group, topic)?;
        Ok(Reader { group: group.to_owned(), topic: topic.to_owned() })
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }
}

/// A gRPC `ReceiveMessage` or a remoting `POP_MESSAGE`, as its front read it from the request.
pub struct ReceiveRequest<'r> {
    /// The group's filter as the request states it (a tag expression, `*` for every message, or SQL92).
    pub filter: String,
    /// How `filter` reads.
    pub filter_type: FilterType,
    /// The front (`grpc`, `remoting`): the hand-out's transport and its holders' namespace.
    pub front: &'static str,
    /// The client the deliveries are handed out to.
    pub client: ReceivingClient<'r>,
    /// Kept handed out while the client is alive (a gRPC PushConsumer's).
    pub auto_renew: bool,
    /// Time to settle each delivery; the subscription's ACK timeout when `None`.
    pub ack_timeout: Option<Duration>,
    /// Consecutive messages of one message group handed out together (a gRPC FIFO consumer's batch).
    pub fifo_batch: bool,
}

/// Who a receive hands its deliveries to: the holder a client's leaving gives back, and a live client keeps.
pub enum ReceivingClient<'r> {
    /// A client that named itself (a gRPC client's `x-mq-client-id`, a remoting consumer's heartbeat `clientID`).
    Named(&'r str),
    /// A client that never said who it is (a remoting POP without a heartbeat), known by its connection's peer
    /// address. Its holder is in a namespace of its own: no client id names it, so no client's leaving gives
    /// its deliveries back; they come back at their deadline.
    Unnamed {
        /// The connection's peer address.
        connection: &'r str,
    },
}

impl ReceivingClient<'_> {
    /// The holder's name in the delivery core, for a client of `front`.
    fn holder_id(&self, front: &str) -> String {
        match self {
            ReceivingClient::Named(id) => holder_id(front, id),
            ReceivingClient::Unnamed { connection } => format!("{front}-connection:{connection}"),
        }
    }
}

/// A receive ready to run: its subscription (made or refiltered as the request asked) and how its deliveries
/// are handed out. Only [`Deliveries::open_receive`] makes one.
pub struct Receive {
    sub: Subscription,
    hand_out: HandOut,
}

impl Receive {
    /// The subscription the receive reads (its retry policy and ordering tell the client how to consume).
    pub fn subscription(&self) -> &Subscription {
        &self.sub
    }
}

/// The delivery core as a front holds it: reads start from a [`Reader`], settlements go through
/// [`Deliveries::settling`], and a client's liveness and leaving are told here. No front names the core itself.
#[derive(Clone)]
pub struct Deliveries {
    pub(super) dispatcher: Arc<Dispatcher>,
}

impl Deliveries {
    /// The fronts' handle of `dispatcher`.
    pub fn new(dispatcher: Arc<Dispatcher>) -> Deliveries {
        Deliveries { dispatcher }
    }

    /// Settling deliveries, at the instance that handed them out (`owners`: the tier's other instances).
    pub fn settling<'a>(&'a self, owners: Option<&'a Arc<dyn Owners>>) -> Settling<'a> {
        Settling { dispatcher: &self.dispatcher, owners }
    }

    /// The subscription `request` describes, for `reader`'s group and topic (the request's own are replaced),
    /// made or changed.
    ///
    /// # Errors
    /// [`GatewayError::Delivery`] when the delivery core refuses it (a field out of bounds, the store).
    pub async fn subscribe(
        &self,
        reader: &Reader,
        mut request: SubscriptionRequest,
    ) -> Result<Subscription, GatewayError> {
        request.group = reader.group.clone();
        request.topic = reader.topic.clone();
        Ok(self.dispatcher.subscribe(request).await?)
    }

    /// Removes `group`'s subscription to `topic`, when `caller` may consume as `group`.
    ///
    /// # Errors
    /// [`GatewayError::MayNotConsume`]; [`GatewayError::Delivery`] when there is none or the store fails.
    pub async fn unsubscribe(&self, caller: &Caller, group: &str, topic: &str) -> Result<(), GatewayError> {
        may_consume(caller, group)?;
        Ok(self.dispatcher.unsubscribe(group, topic).await?)
    }

    /// Long-polls up to `max` deliveries for `reader` (an HTTP poll), waiting at most `wait`.
    ///
    /// # Errors
    /// [`GatewayError::Delivery`] when nothing can be handed out (the store, a refused filter).
    pub async fn poll(&self, reader: &Reader, max: usize, wait: Duration) -> Result<Vec<Dispatched>, GatewayError> {
        Ok(self.dispatcher.poll(&reader.group, &reader.topic, max, wait).await?)
    }

    /// A push subscriber (SSE, WebSocket: `transport`) of `reader`'s group and topic, at most `prefetch`
    /// unsettled.
    ///
    /// # Errors
    /// [`GatewayError::Delivery`] for a prefetch out of bounds or a subscription that cannot be made.
    pub async fn attach(
        &self,
        reader: &Reader,
        prefetch: Option<usize>,
        transport: &'static str,
    ) -> Result<Subscriber, GatewayError> {
        Ok(self.dispatcher.attach(&reader.group, &reader.topic, prefetch, transport).await?)
    }

    /// A gRPC receive's or a remoting POP's subscription, made for `reader` with the request's filter: a new
    /// one only for a topic that exists (as Apache's proxy and the broker answer a receive of an unknown topic),
    /// an existing one refiltered as the request asks.
    ///
    /// # Errors
    /// [`GatewayError::TopicNotFound`]; [`GatewayError::Unavailable`] when the name server cannot say;
    /// [`GatewayError::Delivery`] when the subscription cannot be made.
    pub async fn open_receive(
        &self,
        reader: &Reader,
        publisher: &Publisher,
        request: ReceiveRequest<'_>,
    ) -> Result<Receive, GatewayError> {
        let (group, topic) = (&reader.group, &reader.topic);
        if self.dispatcher.subscription(group, topic).is_none() {
            match publisher.existing_topic(topic).await {
                Ok(Some(_)) => {}
                Ok(None) => return Err(GatewayError::TopicNotFound(topic.clone())),
                Err(why) => return Err(GatewayError::Unavailable(format!("the name server did not answer: {why}"))),
            }
        }
        let sub = self.dispatcher.ensure_filtered(group, topic, &request.filter, request.filter_type).await?;
        let holder = Holder {
            client_id: request.client.holder_id(request.front),
            auto_renew: request.auto_renew,
            written: false,
        };
        let hand_out = HandOut {
            transport: request.front,
            ack_timeout: request.ack_timeout,
            holder: Some(holder),
            fifo_batch: request.fifo_batch,
        };
        Ok(Receive { sub, hand_out })
    }

    /// Up to `max` deliveries for `receive`, waiting at most `wait` when none is ready; each recorded with its
    /// holder before it is returned.
    ///
    /// # Errors
    /// [`GatewayError::Delivery`] when nothing can be handed out (the store, a refused filter).
    pub async fn receive(
        &self,
        receive: &Receive,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Dispatched>, GatewayError> {
        Ok(self.dispatcher.poll_as(&receive.sub, max, wait, &receive.hand_out).await?)
    }

    /// The hand-outs `handed` (delivery id, hand-out) reached their client: stored as written.
    ///
    /// # Errors
    /// [`GatewayError::Delivery`] when the store fails (they come back at their deadline then).
    pub async fn written(&self, handed: &[(String, u32)]) -> Result<usize, GatewayError> {
        Ok(self.dispatcher.written(handed).await?)
    }

    /// Deliveries `ids` could not be written to their client (`transport`): due again at once, their attempt
    /// not spent.
    pub async fn unsent(&self, ids: &[String], transport: &'static str) {
        self.dispatcher.unsent(ids, transport).await;
    }

    /// Hand-outs no client of the front can be sent (it cannot encode them): their attempt is spent, so such
    /// a message ends in the DLQ after its last attempt instead of coming back forever.
    pub async fn undeliverable(&self, handed: &[(String, u32)]) {
        for (id, handout) in handed {
            if let Err(why) = self.dispatcher.nack(Target { id, handout: Some(*handout) }, None).await {
                tracing::warn!(delivery = %id, %why, "An undeliverable delivery could not be NACKed; it comes back at its deadline.");
            }
        }
    }

    /// The holders `clients` (as [`super::holder_id`] names them) are alive: what they hold auto-renewed stays
    /// handed out for `hold` more, up to `max_hold` after its hand-out.
    ///
    /// # Errors
    /// [`GatewayError::Delivery`] when the store fails.
    pub async fn keep_held(
        &self,
        clients: &std::collections::HashSet<String>,
        hold: Duration,
        max_hold: Duration,
    ) -> Result<(), GatewayError> {
        self.dispatcher.keep_held(clients, hold, max_hold).await?;
        Ok(())
    }

    /// Client `client_id` of `front` and `caller` left consumer group `group`: what it holds of that group and
    /// did not settle is due again at once. Returns how many deliveries that was. The front has checked that
    /// the client id is the caller's.
    ///
    /// # Errors
    /// [`GatewayError::MayNotConsume`] when the caller may not consume as `group` (nothing is released).
    pub async fn leave_group(
        &self,
        caller: &Caller,
        front: &str,
        client_id: &str,
        group: &str,
    ) -> Result<usize, GatewayError> {
        may_consume(caller, group)?;
        Ok(self.dispatcher.release_client(&holder_id(front, client_id), group).await)
    }

    /// popgate's subscription of `group` to `topic`, if any (its retry policy and ordering, told to a client
    /// whose Settings the front checked).
    pub fn subscription(&self, group: &str, topic: &str) -> Option<Subscription> {
        self.dispatcher.subscription(group, topic)
    }

    /// Whether `group` consumes in order, as the brokers say.
    pub async fn group_orderly(&self, group: &str) -> bool {
        self.dispatcher.group_orderly(group).await
    }

    /// The deliveries another instance of the tier settled for instance `asker` while it could not be told.
    pub async fn take_untold(&self, asker: &str) -> Vec<(String, Option<u32>)> {
        self.dispatcher.take_untold(asker).await
    }

    /// False after a failed state-store write, until a write succeeds again (`/readyz`).
    pub fn store_healthy(&self) -> bool {
        self.dispatcher.store_healthy()
    }

    /// The admin plane's view: up to `max` in-flight deliveries (of `group` only, when named). The admin
    /// routes are admitted only for admin tokens ([`super::may_administer`]).
    pub fn in_flight(&self, group: Option<&str>, max: usize) -> Vec<InFlight> {
        self.dispatcher.in_flight(group, max)
    }

    /// The admin plane's view: every subscription.
    pub fn subscriptions(&self) -> Vec<Subscription> {
        self.dispatcher.subscriptions()
    }

    /// The admin plane's removal of `group`'s subscription to `topic`.
    ///
    /// # Errors
    /// [`GatewayError::Delivery`] when there is none or the store fails.
    pub async fn remove_subscription(&self, group: &str, topic: &str) -> Result<(), GatewayError> {
        Ok(self.dispatcher.unsubscribe(group, topic).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unnamed_clients_holder_is_named_by_no_client_id() {
        let unnamed = ReceivingClient::Unnamed { connection: "10.0.0.7:52311" }.holder_id("remoting");
        // Whatever id a client chooses, its holder starts `remoting:`; the unnamed one's does not.
        for chosen in ["10.0.0.7:52311", "remoting@10.0.0.7:52311", "-connection:10.0.0.7:52311", ""] {
            assert_ne!(ReceivingClient::Named(chosen).holder_id("remoting"), unnamed, "{chosen}");
            assert!(ReceivingClient::Named(chosen).holder_id("remoting").starts_with("remoting:"));
        }
        assert!(!unnamed.starts_with("remoting:"), "{unnamed}");
    }
}
