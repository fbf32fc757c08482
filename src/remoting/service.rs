//! The front's request dispatch: which request code is served how, and the counting every request gets.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{watch, Semaphore};

use metrics::counter;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;

use super::clients::Clients;
use super::codes;
use super::connection::Connection;
use super::offset_turns::OffsetTurns;
use super::ports::{self, BrokerPorts};
use super::reregistrations::Reregistrations;
use super::{auth, pop, relay, route, send, transaction, Parts};
use crate::auth::{Caller, TokenTable};
use crate::config::Config;
use crate::gateway::below::DeliveryError;
use crate::gateway::below::{TransactionError, Transactions};
use crate::gateway::GatewayError;
use crate::metrics as m;
use crate::publish::Publisher;

/// The remoting front's shared state.
pub(super) struct Front {
    pub publisher: Arc<Publisher>,
    pub broker: crate::gateway::Relay,
    pub deliveries: crate::gateway::Deliveries,
    /// The tier's other instances, when this one is in a tier: deliveries they handed out are settled there.
    pub owners: Option<Arc<dyn crate::gateway::Owners>>,
    pub tokens: Arc<TokenTable>,
    pub transactions: Arc<Transactions>,
    pub config: Arc<Config>,
    pub clients: Arc<Clients>,
    /// The address clients are given as every broker's.
    pub advertised: String,
    /// The brokers' own ports, for clients before 4.9.5.
    pub broker_ports: BrokerPorts,
    /// The TLS handshakes of the clients that use TLS.
    pub tls: tokio_rustls::TlsAcceptor,
    /// The connections all of the front's ports may keep open together.
    pub connection_slots: Arc<Semaphore>,
    /// The bytes of large frames all of the front's connections may read in at once (one permit a byte).
    pub frame_bytes: Arc<Semaphore>,
    /// A broker's offset commits and queries of a topic and group, relayed one at a time in the order they came.
    pub offset_turns: OffsetTurns,
    /// The groups lately registered again at a broker that forgot them, so a burst of refused pulls does it once.
    pub reregistrations: Reregistrations,
    /// The name server's recent route answers.
    pub routes: super::route::RouteCache,
    /// Turns true when popgate stops.
    stopping: watch::Receiver<bool>,
    /// The cluster's master brokers (name to address), and when they were asked for.
    masters: Mutex<Option<(Instant, HashMap<String, String>)>>,
}

impl Front {
    /// The gateway's publish path.
    pub(super) fn publishing(&self) -> crate::gateway::Publishing<'_> {
        crate::gateway::Publishing { publisher: &self.publisher, transactions: &self.transactions, front: "remoting" }
    }

    pub(super) fn ending(&self) -> crate::gateway::Ending<'_> {
        crate::gateway::Ending { transactions: &self.transactions, front: "remoting", owners: self.owners.as_ref() }
    }

    pub(super) fn settling(&self) -> crate::gateway::Settling<'_> {
        self.deliveries.settling(self.owners.as_ref())
    }

    pub fn new(parts: Parts, config: Arc<Config>, advertised: String, stopping: watch::Receiver<bool>) -> Front {
        for (_, label) in codes::SERVED {
            counter!(m::REMOTING_REQUESTS, "code" => *label, "result" => "ok").increment(0);
        }
        for label in ["pull_message", "heart_beat"] {
            counter!(m::REMOTING_RELAYS, "code" => label, "result" => "ok").increment(0);
        }
        let expiry = Duration::from_secs(config.remoting.client_expiry_secs);
        Front {
            publisher: parts.publisher,
            broker: parts.broker,
            deliveries: parts.deliveries,
            owners: parts.owners,
            tokens: parts.tokens,
            transactions: parts.transactions,
            clients: Arc::new(Clients::new(expiry, config.remoting.max_clients, parts.client_owners)),
            broker_ports: BrokerPorts::default(),
            tls: tokio_rustls::TlsAcceptor::from(parts.tls),
            connection_slots: Arc::new(Semaphore::new(config.remoting.max_connections)),
            frame_bytes: Arc::new(Semaphore::new(config.remoting.max_frame_bytes_in_flight)),
            offset_turns: OffsetTurns::default(),
            reregistrations: Reregistrations::default(),
            routes: super::route::RouteCache::new(config.broker.route_ttl()),
            config,
            advertised,
            stopping,
            masters: Mutex::new(None),
        }
    }

    /// Resolves when popgate stops (each of the front's ports stops accepting then).
    pub fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut stopping = self.stopping.clone();
        async move {
            let _ = stopping.wait_for(|stop| *stop).await;
        }
    }

    /// The master brokers asked for less than `ttl` ago.
    pub fn cached_masters(&self, ttl: Duration) -> Option<HashMap<String, String>> {
        self.masters.lock().as_ref().filter(|(at, _)| at.elapsed() < ttl).map(|(_, masters)| masters.clone())
    }

    pub fn remember_masters(&self, masters: HashMap<String, String>) {
        *self.masters.lock() = Some((Instant::now(), masters));
    }

    /// The next request asks for the master brokers again (one was missing).
    pub fn forget_masters(&self) {
        *self.masters.lock() = None;
    }

    /// Who sent `request` from `source`: checked as its frame is read, before anything is kept for it.
    pub fn admit(&self, request: &RemotingCommand, source: IpAddr) -> Result<Admitted, Refusal> {
        // As RocketMQ's name server, popgate answers route queries unsigned: a client whose signature is missing
        // or wrong then learns why from the refusal of its first broker request, not from a missing route.
        if request.code() == codes::GET_ROUTEINFO_BY_TOPIC {
            return Ok(Admitted::NameServerQuery);
        }
        auth::caller(&self.tokens, request).map(|caller| Admitted::Caller(caller.with_address(source)))
    }

    /// Whether `caller` may have `request` relayed to a broker (see [`relay::permission`]).
    pub fn may_relay(&self, caller: &Caller, request: &RemotingCommand) -> bool {
        relay::permission(caller, request).is_ok()
    }

    /// Serves one request, admitted (or refused) by [`Front::admit`]; `None` when it has no answer (a one-way
    /// request's is dropped by the caller anyway).
    pub async fn serve(
        self: &Arc<Self>,
        connection: &Connection,
        admitted: Result<Admitted, Refusal>,
        request: RemotingCommand,
    ) -> Option<Reply> {
        let code = request.code();
        let reply = match admitted {
            Ok(Admitted::NameServerQuery) => Some(route::topic_route(self, &request).await.into()),
            // After the signature check: the name is popgate's, not signed by the client.
            Ok(Admitted::Caller(caller)) => {
                self.serve_as(connection, &caller, ports::name_the_broker(connection, request)).await
            }
            Err(refusal) => Some(refusal.answer().into()),
        };
        let result = reply.as_ref().map_or("ok", |r| codes::result_label(r.command.code()));
        counter!(m::REMOTING_REQUESTS, "code" => codes::request_label(code), "result" => result).increment(1);
        reply
    }

    /// What follows writing `reply` (`written`: it left for the client): its hand-outs are stored as written,
    /// or handed out again.
    pub async fn after_reply(&self, handed: Vec<(String, u32)>, written: bool) {
        pop::after_answer(self, handed, written).await;
    }

    async fn serve_as(&self, connection: &Connection, caller: &Caller, request: RemotingCommand) -> Option<Reply> {
        let answer = match request.code() {
            codes::SEND_MESSAGE | codes::SEND_MESSAGE_V2 | codes::SEND_BATCH_MESSAGE => {
                send::send_message(self, connection, caller, request).await
            }
            codes::END_TRANSACTION => transaction::end_transaction(self, caller, &request).await,
            codes::HEART_BEAT => return Some(relay::heartbeat(self, connection, caller, &request).await),
            codes::UNREGISTER_CLIENT => relay::unregister(self, caller, &request).await,
            codes::GET_CONSUMER_LIST_BY_GROUP => relay::consumer_list(self, caller, &request),
            codes::CHECK_CLIENT_CONFIG => relay::check_client_config(self, caller, &request).await,
            codes::PULL_MESSAGE
            | codes::LITE_PULL_MESSAGE
            | codes::QUERY_CONSUMER_OFFSET
            | codes::UPDATE_CONSUMER_OFFSET
            | codes::SEARCH_OFFSET_BY_TIMESTAMP
            | codes::GET_MAX_OFFSET
            | codes::GET_MIN_OFFSET
            | codes::GET_EARLIEST_MSG_STORETIME
            | codes::CONSUMER_SEND_MSG_BACK
            | codes::LOCK_BATCH_MQ
            | codes::UNLOCK_BATCH_MQ => return relay::to_queue_broker(self, caller, &request).await.map(Reply::from),
            codes::QUERY_ASSIGNMENT => pop::query_assignment(self, caller, &request).await,
            codes::POP_MESSAGE => return Some(pop::pop_message(self, connection, caller, &request).await),
            codes::ACK_MESSAGE => pop::ack_message(self, caller, &request).await,
            codes::CHANGE_MESSAGE_INVISIBLETIME => pop::change_invisible_time(self, caller, &request).await,
            codes::BATCH_ACK_MESSAGE => error(
                codes::REQUEST_CODE_NOT_SUPPORTED,
                "popgate settles POP messages one by one (ACK_MESSAGE, as Apache's clients send them)",
            ),
            code => not_supported(code),
        };
        Some(answer.into())
    }
}

/// Who a request is from, as [`Front::admit`] found.
pub(super) enum Admitted {
    /// A route query, which a name server answers whoever asks.
    NameServerQuery,
    /// A signed request (or any request, when authentication is off).
    Caller(Caller),
}

/// An answer, and the deliveries it hands out (a POP's): stored as written once the answer has left.
pub(super) struct Reply {
    pub command: RemotingCommand,
    /// The hand-outs it carries (delivery id, hand-out number).
    pub handed: Vec<(String, u32)>,
    /// Consumer groups whose members are told to rebalance once this answer is on its way, behind it on the
    /// connection ([`super::relay::heartbeat`] says why).
    pub then_tell: Vec<String>,
}

impl From<RemotingCommand> for Reply {
    fn from(command: RemotingCommand) -> Reply {
        Reply { command, handed: Vec::new(), then_tell: Vec::new() }
    }
}

/// The answer to a request code popgate does not serve, in the words of Apache's broker.
fn not_supported(code: i32) -> RemotingCommand {
    tracing::debug!(code, "A remoting request code popgate does not serve.");
    error(codes::REQUEST_CODE_NOT_SUPPORTED, format!(" request type {code} not supported"))
}

/// An answer with `code` and `remark`.
pub(super) fn error(code: i32, remark: impl Into<String>) -> RemotingCommand {
    RemotingCommand::create_response_command_with_code_remark(code, remark.into())
}

/// A request refused before it was served: the response code and the words the client is given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Refusal {
    pub code: i32,
    pub remark: String,
}

impl Refusal {
    pub fn new(code: i32, remark: impl Into<String>) -> Refusal {
        Refusal { code, remark: remark.into() }
    }

    /// The answer that says so.
    pub fn answer(self) -> RemotingCommand {
        error(self.code, self.remark)
    }
}

/// The remoting front's one mapping of the gateway's errors (the gateway counted its refusals), in the codes
/// and words the broker and Apache's proxy answer with.
impl From<GatewayError> for Refusal {
    fn from(refused: GatewayError) -> Refusal {
        match refused {
            GatewayError::MayNotConsume(_)
            | GatewayError::MayNotRead(_)
            | GatewayError::MayNotRoute(_)
            | GatewayError::MayNotPublish(_)
            | GatewayError::MayNotAdminister
            | GatewayError::ClientIdTaken(_)
            | GatewayError::ProducerGroupTaken(_) => Refusal::new(codes::NO_PERMISSION, refused.to_string()),
            GatewayError::TooManyClients { .. } => Refusal::new(codes::SYSTEM_BUSY, refused.to_string()),
            GatewayError::TopicNotFound(topic) => {
                Refusal::new(codes::TOPIC_NOT_EXIST, format!("topic[{topic}] not exist, apply first please!"))
            }
            // Apache's client's words (`Validators.checkMessage`), which a 4.x app sees straight at the cluster.
            GatewayError::MessageTooLarge { max } => {
                Refusal::new(codes::MESSAGE_ILLEGAL, format!("the message body size over max value, MAX: {max}"))
            }
            GatewayError::OneWayUnconfirmed => Refusal::new(codes::MESSAGE_ILLEGAL, refused.to_string()),
            GatewayError::TakesNoTransactions { topic_type, .. } => Refusal::new(
                codes::MESSAGE_ILLEGAL,
                format!("TopicMessageType validate failed, the expected type is {topic_type}, but actual type is TRANSACTION"),
            ),
            GatewayError::NotStored { .. } => {
                Refusal::new(refused.broker_code().unwrap_or(codes::SYSTEM_ERROR), refused.to_string())
            }
            GatewayError::Unavailable(why) | GatewayError::AckUnconfirmed(why) => Refusal::new(codes::SYSTEM_ERROR, why),
            GatewayError::MayNotSettle { refusal, .. } => Refusal::new(codes::NO_PERMISSION, refusal.to_string()),
            GatewayError::HandleOfAnotherGroup { owner, named } => Refusal::new(
                codes::INVALID_PARAMETER,
                format!("the message was popped by group `{owner}`, not `{named}`"),
            ),
            GatewayError::Delivery(refusal) => delivery_refusal(&refusal),
            GatewayError::Transaction(failed @ TransactionError::Busy(_)) => {
                Refusal::new(codes::SYSTEM_BUSY, failed.to_string())
            }
            GatewayError::Transaction(failed) => Refusal::new(codes::TRANSACTION_FAILED, failed.to_string()),
        }
    }
}

/// A delivery-core refusal in the broker's codes: a handle that no longer settles anything is `NO_MESSAGE`
/// with Apache's proxy's words.
fn delivery_refusal(refusal: &DeliveryError) -> Refusal {
    let code = match refusal {
        DeliveryError::Unknown | DeliveryError::Stale | DeliveryError::NotInFlight | DeliveryError::Superseded => {
            return Refusal::new(codes::NO_MESSAGE, format!("receipt handle is expired: {refusal}"));
        }
        DeliveryError::Busy => codes::SYSTEM_BUSY,
        DeliveryError::Store(_) => codes::SYSTEM_ERROR,
        DeliveryError::Invalid("filter", _) => codes::SUBSCRIPTION_PARSE_FAILED,
        DeliveryError::Invalid(..) => codes::INVALID_PARAMETER,
    };
    Refusal::new(code, refusal.to_string())
}

/// The value of header field `name` of `request`.
pub(super) fn field<'a>(request: &'a RemotingCommand, name: &str) -> Option<&'a str> {
    request.ext_fields().and_then(|fields| fields.get(name)).map(|v| v.as_str())
}
