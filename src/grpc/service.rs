//! `MessagingService`: each RPC checks the caller, then calls the publish or the delivery layer. It holds no
//! message or delivery state of its own: only which clients are alive (for the gauge, and so the deliveries a
//! live PushConsumer holds stay handed out: [`keep_alive_loop`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use metrics::{counter, gauge, histogram};
use parking_lot::Mutex;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::codegen::BoxStream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Streaming};

use super::consume::{self, AUTO_RENEW_HOLD, AUTO_RENEW_MAX};
use super::deadline;
use super::limits::OpenCalls;
use super::names;
use super::producers::Producers;
use super::proto::messaging_service_server::MessagingService;
use super::proto::{self as pb, settings::PubSub as settings_pub_sub, telemetry_command, Code};
use super::send;
use super::settings;
use super::status::{code_label, ok, status};
use super::transaction;
use super::written;
use crate::auth::{Caller, TokenTable};
use crate::config::Config;
use crate::gateway::below::Transactions;
use crate::gateway::{self, ClientIds, GatewayError};
use crate::metrics as m;
use crate::publish::Publisher;

/// A client that stops heartbeating (it heartbeats every 10 s) is forgotten after this long.
const CLIENT_EXPIRY: Duration = Duration::from_secs(60);
/// A client seen this recently (any call: heartbeats every 10 s, receives all the time) counts as alive, and
/// the deliveries it holds with `auto_renew` are kept handed out to it.
const ALIVE_WINDOW: Duration = Duration::from_secs(20);
/// How often the deadlines of live clients' auto-renewed deliveries are pushed forward.
const KEEP_ALIVE_EVERY: Duration = Duration::from_secs(5);

/// What the front needs from the rest of popgate.
pub struct Front {
    pub(super) publisher: Arc<Publisher>,
    pub(super) deliveries: crate::gateway::Deliveries,
    /// The tier's other instances, when this one is in a tier: deliveries they handed out are settled there.
    owners: Option<Arc<dyn crate::gateway::Owners>>,
    pub(super) transactions: Arc<Transactions>,
    pub(super) tokens: Arc<TokenTable>,
    pub(super) config: Arc<Config>,
    clients: Mutex<Liveness>,
    /// True once popgate is shutting down: open receives are answered at once, new ones get nothing.
    stop_asked: tokio::sync::watch::Receiver<bool>,
    /// Open receives and Telemetry streams, per token.
    receives: OpenCalls,
    streams: OpenCalls,
    /// The Telemetry streams of producers, by topic: where transaction check-backs go.
    producers: Producers,
}

/// Commands a Telemetry stream may have waiting for its client (Settings answers, check-backs).
const TELEMETRY_BACKLOG: usize = 64;

/// The client kinds of the `popgate_grpc_clients{kind}` gauge.
const CLIENT_KINDS: [&str; 4] = ["producer", "push_consumer", "simple_consumer", "other"];

/// Which clients were seen when, with a count per kind kept at every change: a call costs a map update and
/// four gauge sets, never a pass over the clients. Whose each client id is, and how many are kept, is the
/// gateway's rule ([`ClientIds`]).
struct Liveness {
    seen: ClientIds<Seen>,
    per_kind: [usize; CLIENT_KINDS.len()],
}

/// A client id's kind, when it was last seen, and the request timeout its Settings gave (a long poll keeps
/// half of it back, see `deadline`).
struct Seen {
    kind: &'static str,
    at: Instant,
    request_timeout: Option<Duration>,
}

impl Liveness {
    fn new(max_clients: usize, owners: crate::gateway::ClientOwners) -> Liveness {
        Liveness { seen: ClientIds::new(max_clients, "grpc.max_clients", owners), per_kind: [0; CLIENT_KINDS.len()] }
    }

    fn kind_index(kind: &str) -> usize {
        CLIENT_KINDS.iter().position(|k| *k == kind).unwrap_or(CLIENT_KINDS.len() - 1)
    }

    /// `id` was seen now, used by `caller`; its kind is updated when the call tells it.
    ///
    /// # Errors
    /// [`GatewayError::ClientIdTaken`] when another token uses the id, [`GatewayError::TooManyClients`] for a
    /// new id past `grpc.max_clients` (nothing changes).
    fn saw(&mut self, id: &str, kind: Option<&'static str>, now: Instant, caller: &Caller) -> Result<(), GatewayError> {
        let mut new = false;
        let seen = self.seen.claim(id, caller, || {
            new = true;
            Seen { kind: kind.unwrap_or("other"), at: now, request_timeout: None }
        })?;
        if new {
            self.per_kind[Self::kind_index(seen.kind)] += 1;
            return Ok(());
        }
        seen.at = now;
        if let Some(kind) = kind.filter(|k| *k != seen.kind) {
            self.per_kind[Self::kind_index(seen.kind)] -= 1;
            self.per_kind[Self::kind_index(kind)] += 1;
            seen.kind = kind;
        }
        Ok(())
    }

    fn forget(&mut self, id: &str) {
        if let Some(seen) = self.seen.remove(id) {
            self.per_kind[Self::kind_index(seen.kind)] -= 1;
        }
    }

    /// Forgets the clients not seen for [`CLIENT_EXPIRY`].
    fn expire(&mut self, now: Instant) {
        let per_kind = &mut self.per_kind;
        self.seen.retain(|_, seen| {
            let keep = now.duration_since(seen.at) < CLIENT_EXPIRY;
            if !keep {
                per_kind[Self::kind_index(seen.kind)] -= 1;
            }
            keep
        });
    }

    fn publish_gauge(&self) {
        for (kind, count) in CLIENT_KINDS.iter().zip(self.per_kind) {
            gauge!(m::GRPC_CLIENTS, "kind" => *kind).set(count as f64);
        }
    }
}

impl Front {
    /// The gateway's publish path.
    pub(super) fn publishing(&self) -> crate::gateway::Publishing<'_> {
        crate::gateway::Publishing { publisher: &self.publisher, transactions: &self.transactions, front: "grpc" }
    }

    pub(super) fn ending(&self) -> crate::gateway::Ending<'_> {
        crate::gateway::Ending { transactions: &self.transactions, front: "grpc", owners: self.owners.as_ref() }
    }

    pub(super) fn settling(&self) -> crate::gateway::Settling<'_> {
        self.deliveries.settling(self.owners.as_ref())
    }

    pub(super) fn new(
        parts: super::Parts,
        config: Arc<Config>,
        stop_asked: tokio::sync::watch::Receiver<bool>,
    ) -> Front {
        let receives = OpenCalls::new("receives", config.grpc.max_receives_per_token);
        let streams = OpenCalls::new("Telemetry streams", config.grpc.max_streams_per_token);
        let super::Parts { publisher, deliveries, transactions, tokens, owners, client_owners } = parts;
        let clients = Mutex::new(Liveness::new(config.grpc.max_clients, client_owners));
        let producers = Producers::default();
        Front {
            publisher,
            deliveries,
            owners,
            transactions,
            tokens,
            config,
            clients,
            stop_asked,
            receives,
            streams,
            producers,
        }
    }

    /// Resolves once popgate is shutting down (at once when it already is).
    pub(super) async fn stopping(&self) {
        let mut stop_asked = self.stop_asked.clone();
        if stop_asked.wait_for(|stop| *stop).await.is_err() {
            // The server is gone without asking: nothing will ever stop this front.
            std::future::pending::<()>().await;
        }
    }

    /// The caller of a request, from the SDK's signature (`authorization: MQv2-HMAC-SHA1 Credential=<AK>,
    /// SignedHeaders=x-mq-date-time, Signature=<hex>`); everyone when authentication is off.
    pub(super) fn caller<T>(&self, request: &Request<T>) -> Result<Caller, pb::Status> {
        let caller = self.signer(request.metadata())?;
        Ok(match request.remote_addr() {
            Some(peer) => caller.from_address(peer.ip()),
            None => caller,
        })
    }

    /// The caller a request's signature stands for, wherever it came from.
    fn signer(&self, metadata: &MetadataMap) -> Result<Caller, pb::Status> {
        if !self.tokens.enabled() {
            return Ok(Caller::unrestricted());
        }
        let header = |name: &str| metadata.get(name).and_then(|v| v.to_str().ok());
        let refused = |why: &str| {
            counter!(m::REQUESTS_REJECTED, "reason" => "unauthenticated").increment(1);
            status(Code::Unauthorized, why.to_owned())
        };
        let Some(authorization) = header("authorization") else {
            return Err(refused("authentication is required: configure the client's credentials"));
        };
        let Some((access_key, signature)) = parse_authorization(authorization) else {
            return Err(refused("the authorization header is not MQv2-HMAC-SHA1"));
        };
        let signed = header("x-mq-date-time").unwrap_or_default();
        let caller = self
            .tokens
            .authenticate_signature(access_key, signed, signature)
            .ok_or_else(|| refused("unknown access key or bad signature"))?;
        // The signature covers only the date: an old one would be a lasting credential for whoever saw it.
        let skew = Duration::from_secs(self.config.auth.max_clock_skew_secs);
        if !within_skew(signed, crate::clock::wall_clock(), skew) {
            counter!(m::REQUESTS_REJECTED, "reason" => "stale_signature").increment(1);
            let why = format!("x-mq-date-time `{signed}` is more than {} s away from popgate's clock", skew.as_secs());
            return Err(status(Code::Unauthorized, why));
        }
        Ok(caller)
    }

    /// The caller of a request ([`Front::caller`]); only an authenticated call marks its client alive (with
    /// its kind, when known), so an unauthenticated peer cannot insert client ids or keep another client's
    /// auto-renewed deliveries held.
    fn authenticated<T>(&self, request: &Request<T>, kind: Option<&'static str>) -> Result<Caller, pb::Status> {
        let caller = self.caller(request)?;
        self.saw_client(&caller, request.metadata(), kind)?;
        Ok(caller)
    }

    /// Notes that the calling client is alive (its kind, when known). Constant time: expiry is the keep-alive
    /// loop's ([`Front::prune_clients`]), not every call's. A new client past `grpc.max_clients` is refused, and
    /// so is a client id another token uses (it is that token's until it expires): a client id names whose
    /// deliveries are kept alive and given back at termination.
    fn saw_client(
        &self,
        caller: &Caller,
        metadata: &MetadataMap,
        kind: Option<&'static str>,
    ) -> Result<(), pb::Status> {
        let Some(id) = client_id(metadata) else { return Ok(()) };
        let mut clients = self.clients.lock();
        clients.saw(id, kind, Instant::now(), caller).map_err(|refused| super::status::refused(&refused))?;
        clients.publish_gauge();
        Ok(())
    }

    /// A client that terminated is forgotten; a consumer gives back what it holds in its group (and only there,
    /// when it may consume as that group: a client may be in several groups, and anyone may name any client id).
    async fn terminate_client(&self, caller: &Caller, id: &str, group: Option<&pb::Resource>) -> pb::Status {
        // A producer names no group (or a blank one).
        let group = group.filter(|g| !g.name.trim().is_empty());
        let group = match group.map(|g| names::group(Some(g))).transpose() {
            Ok(group) => group,
            Err(refused) => return refused,
        };
        let mine = self.clients.lock().seen.of_caller(id, caller).map(|_| ());
        if let Err(taken) = mine {
            return super::status::refused(&taken);
        }
        if let Some(group) = group {
            match self.deliveries.leave_group(caller, "grpc", id, &group).await {
                Ok(0) => {}
                Ok(released) => {
                    tracing::info!(client = %id, group, released, "gRPC client terminated; what it held is due again.")
                }
                Err(refused) => return super::status::refused(&refused),
            }
        }
        self.forget_client(id);
        ok()
    }

    fn forget_client(&self, id: &str) {
        let mut clients = self.clients.lock();
        clients.forget(id);
        clients.publish_gauge();
    }

    /// Keeps the request timeout a client's Settings give (the SDK's default when they give none).
    fn note_request_timeout(&self, metadata: &MetadataMap, settings: &pb::Settings) {
        let Some(id) = client_id(metadata) else { return };
        let timeout = settings.request_timeout.and_then(consume::to_std).unwrap_or(deadline::DEFAULT_REQUEST_TIMEOUT);
        let mut clients = self.clients.lock();
        if let Some(seen) = clients.seen.get_mut(id) {
            seen.request_timeout = Some(timeout);
        }
    }

    /// The request timeout of a client, as its Settings gave it.
    pub(super) fn request_timeout_of(&self, client_id: &str) -> Duration {
        let timeout = self.clients.lock().seen.get(client_id).and_then(|seen| seen.request_timeout);
        timeout.unwrap_or(deadline::DEFAULT_REQUEST_TIMEOUT)
    }

    /// Forgets the clients not seen for [`CLIENT_EXPIRY`]: one pass per keep-alive tick, so a hundred thousand
    /// clients coming and going cost one pass every few seconds, not one per call.
    fn prune_clients(&self) {
        let mut clients = self.clients.lock();
        clients.expire(Instant::now());
        clients.publish_gauge();
    }

    /// The ids of the clients seen within [`ALIVE_WINDOW`].
    fn live_clients(&self) -> HashSet<String> {
        let now = Instant::now();
        let clients = self.clients.lock();
        clients
            .seen
            .iter()
            .filter(|(_, _, seen)| now.duration_since(seen.at) < ALIVE_WINDOW)
            .map(|(id, _, _)| id.to_owned())
            .collect()
    }
}

impl Front {
    /// popgate's subscription for a consumer's Settings (its group and first topic with one), whose retry
    /// policy and ordering the reply carries.
    fn subscription_of(&self, client: &pb::Settings) -> Option<crate::gateway::below::Subscription> {
        let Some(settings_pub_sub::Subscription(subscription)) = &client.pub_sub else { return None };
        let group = subscription.group.as_ref()?;
        subscription.subscriptions.iter().find_map(|entry| {
            let topic = entry.topic.as_ref()?;
            self.deliveries.subscription(&group.name, &topic.name)
        })
    }
}

/// Whether `caller` may announce the client a Telemetry `Settings` describes, as RocketMQ's ACL 2.0 checks one:
/// `Pub` on each topic a producer names; `Sub` on a consumer's group and on each topic it subscribes to.
/// Apache's proxy answers a refusal with the status alone and ends the stream; so does popgate.
fn may_announce(caller: &Caller, client: &pb::Settings) -> Result<(), GatewayError> {
    match &client.pub_sub {
        Some(settings_pub_sub::Publishing(publishing)) => {
            publishing.topics.iter().try_for_each(|topic| gateway::may_publish(caller, &topic.name))
        }
        Some(settings_pub_sub::Subscription(subscription)) => {
            let group = subscription.group.as_ref().map_or("", |group| group.name.as_str());
            let topics =
                subscription.subscriptions.iter().map(|entry| entry.topic.as_ref().map_or("", |t| t.name.as_str()));
            gateway::may_subscribe(caller, group, topics)
        }
        None => Ok(()),
    }
}

/// The SDK's version (`x-mq-client-version`), when it sent one.
fn client_version(metadata: &MetadataMap) -> Option<&str> {
    metadata.get("x-mq-client-version").and_then(|v| v.to_str().ok())
}

/// The SDK's client id (`x-mq-client-id`), when it sent a usable one.
fn client_id(metadata: &MetadataMap) -> Option<&str> {
    metadata.get("x-mq-client-id").and_then(|v| v.to_str().ok()).filter(|id| !id.trim().is_empty())
}

/// Keeps the auto-renewed deliveries of every live client handed out: their deadlines move [`AUTO_RENEW_HOLD`]
/// ahead every [`KEEP_ALIVE_EVERY`]. A client that goes away without a word stops being seen, and what it held
/// comes back through the retry policy once that deadline passes. Ends when the front is dropped.
pub(super) async fn keep_alive_loop(front: std::sync::Weak<Front>) {
    let mut tick = tokio::time::interval(KEEP_ALIVE_EVERY);
    loop {
        tick.tick().await;
        let Some(front) = front.upgrade() else { return };
        front.prune_clients();
        // Holders are named by front (`gateway::holder_id`); records written before that by the bare client id,
        // so both are kept (a bare id names no other front's holder).
        let bare = front.live_clients();
        if bare.is_empty() {
            continue;
        }
        let mut live: std::collections::HashSet<String> =
            bare.iter().map(|id| gateway::holder_id("grpc", id)).collect();
        live.extend(bare);
        if let Err(error) = front.deliveries.keep_held(&live, AUTO_RENEW_HOLD, AUTO_RENEW_MAX).await {
            tracing::warn!(%error, "Could not extend the deliveries live gRPC clients hold; will retry.");
        }
    }
}

/// Whether `date_time` (the SDK's `x-mq-date-time`, `yyyyMMdd'T'HHmmss'Z'` in UTC) is within `skew` of `now`.
fn within_skew(date_time: &str, now: SystemTime, skew: Duration) -> bool {
    let Ok(signed) = chrono::NaiveDateTime::parse_from_str(date_time, "%Y%m%dT%H%M%SZ") else { return false };
    let now = chrono::DateTime::<chrono::Utc>::from(now).naive_utc();
    let apart = (now - signed).abs().to_std().unwrap_or(Duration::MAX);
    apart <= skew
}

/// `Credential=<AK>[/…], SignedHeaders=…, Signature=<hex>` after the algorithm name.
fn parse_authorization(header: &str) -> Option<(&str, &str)> {
    let rest = header.trim().strip_prefix("MQv2-HMAC-SHA1")?.trim();
    let mut access_key = None;
    let mut signature = None;
    for part in rest.split(',') {
        let (name, value) = part.trim().split_once('=')?;
        match name.trim() {
            // The Go SDK sends `AK//Rocketmq`; the access key is what comes before the first slash.
            "Credential" => access_key = value.split('/').next(),
            "Signature" => signature = Some(value.trim()),
            _ => {}
        }
    }
    Some((access_key?, signature?))
}

/// Counts one answered RPC and its duration.
pub(super) fn observe(rpc: &'static str, code: i32, started: Instant) {
    counter!(m::GRPC_REQUESTS, "rpc" => rpc, "code" => code_label(code)).increment(1);
    histogram!(m::GRPC_REQUEST_DURATION, "rpc" => rpc).record(started.elapsed().as_secs_f64());
}

#[tonic::async_trait]
impl MessagingService for Arc<Front> {
    async fn query_route(
        &self,
        request: Request<pb::QueryRouteRequest>,
    ) -> Result<Response<pb::QueryRouteResponse>, tonic::Status> {
        let started = Instant::now();
        let answer = match self.authenticated(&request, None) {
            Err(refused) => pb::QueryRouteResponse { status: Some(refused), message_queues: Vec::new() },
            Ok(caller) => super::route::query_route(self, &caller, request.into_inner()).await,
        };
        observe("QueryRoute", answer.status.as_ref().map_or(0, |s| s.code), started);
        Ok(Response::new(answer))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, tonic::Status> {
        let started = Instant::now();
        // The Go SDK heartbeats with an empty request while reconnecting: no field is required.
        let kind = settings::kind_label(Some(request.get_ref().client_type));
        let answer = match self.authenticated(&request, (kind != "other").then_some(kind)) {
            Err(refused) => refused,
            Ok(_) => ok(),
        };
        observe("Heartbeat", answer.code, started);
        Ok(Response::new(pb::HeartbeatResponse { status: Some(answer) }))
    }

    async fn send_message(
        &self,
        request: Request<pb::SendMessageRequest>,
    ) -> Result<Response<pb::SendMessageResponse>, tonic::Status> {
        let started = Instant::now();
        let answer = match self.authenticated(&request, Some("producer")) {
            Err(refused) => pb::SendMessageResponse { status: Some(refused), entries: Vec::new() },
            Ok(caller) => {
                let deadline = deadline::answer_by(request.metadata());
                send::send_messages(self, &caller, request.into_inner(), deadline).await
            }
        };
        observe("SendMessage", answer.status.as_ref().map_or(0, |s| s.code), started);
        Ok(Response::new(answer))
    }

    async fn notify_client_termination(
        &self,
        request: Request<pb::NotifyClientTerminationRequest>,
    ) -> Result<Response<pb::NotifyClientTerminationResponse>, tonic::Status> {
        let started = Instant::now();
        let answer = match self.caller(&request) {
            Err(refused) => refused,
            Ok(caller) => match client_id(request.metadata()) {
                None => ok(),
                Some(id) => self.terminate_client(&caller, id, request.get_ref().group.as_ref()).await,
            },
        };
        observe("NotifyClientTermination", answer.code, started);
        Ok(Response::new(pb::NotifyClientTerminationResponse { status: Some(answer) }))
    }

    async fn query_assignment(
        &self,
        request: Request<pb::QueryAssignmentRequest>,
    ) -> Result<Response<pb::QueryAssignmentResponse>, tonic::Status> {
        let started = Instant::now();
        let answer = match self.authenticated(&request, Some("push_consumer")) {
            Err(refused) => pb::QueryAssignmentResponse { status: Some(refused), assignments: Vec::new() },
            Ok(caller) => consume::query_assignment(self, &caller, request.into_inner()).await,
        };
        observe("QueryAssignment", answer.status.as_ref().map_or(0, |s| s.code), started);
        Ok(Response::new(answer))
    }

    async fn receive_message(
        &self,
        request: Request<pb::ReceiveMessageRequest>,
    ) -> Result<Response<BoxStream<pb::ReceiveMessageResponse>>, tonic::Status> {
        let started = Instant::now();
        let (out, stream) = tokio::sync::mpsc::channel(16);
        let taken_in = written::TakenIn::of(request.extensions());
        let checked = match (self.authenticated(&request, None), client_id(request.metadata())) {
            (Err(refused), _) => Err(refused),
            (Ok(_), None) => Err(status(Code::ClientIdRequired, "the x-mq-client-id header is required")),
            (Ok(caller), Some(id)) => match self.receives.take(&caller) {
                Err(refused) => Err(refused),
                Ok(slot) => {
                    let call = consume::Call {
                        client_id: id.to_owned(),
                        time_left: deadline::time_left(request.metadata()),
                        client_version: client_version(request.metadata()).map(str::to_owned),
                    };
                    consume::prepare_receive(self, &caller, &call, request.into_inner()).await.map(|r| (r, slot))
                }
            },
        };
        match checked {
            Err(refused) => {
                observe("ReceiveMessage", refused.code, started);
                let refusal = pb::ReceiveMessageResponse {
                    content: Some(pb::receive_message_response::Content::Status(refused)),
                };
                let _ = out.send(Ok(refusal)).await;
            }
            Ok((receive, slot)) => {
                let front = self.clone();
                tokio::spawn(async move {
                    // The receive holds one of its token's places until it is answered.
                    let _slot = slot;
                    if let Some(answered) = consume::run_receive(&front, receive, out).await {
                        observe("ReceiveMessage", answered.code, started);
                        consume::when_taken_in(&front, answered, taken_in).await;
                    }
                });
            }
        }
        Ok(Response::new(Box::pin(ReceiverStream::new(stream))))
    }

    async fn ack_message(
        &self,
        request: Request<pb::AckMessageRequest>,
    ) -> Result<Response<pb::AckMessageResponse>, tonic::Status> {
        let started = Instant::now();
        let answer = match self.authenticated(&request, None) {
            Err(refused) => pb::AckMessageResponse { status: Some(refused), entries: Vec::new() },
            Ok(caller) => consume::ack_messages(self, &caller, request.into_inner()).await,
        };
        observe("AckMessage", answer.status.as_ref().map_or(0, |s| s.code), started);
        Ok(Response::new(answer))
    }

    async fn change_invisible_duration(
        &self,
        request: Request<pb::ChangeInvisibleDurationRequest>,
    ) -> Result<Response<pb::ChangeInvisibleDurationResponse>, tonic::Status> {
        let started = Instant::now();
        let answer = match self.authenticated(&request, None) {
            Err(refused) => {
                let handle = request.get_ref().receipt_handle.clone();
                pb::ChangeInvisibleDurationResponse { status: Some(refused), receipt_handle: handle }
            }
            Ok(caller) => consume::change_invisible_duration(self, &caller, request.into_inner()).await,
        };
        observe("ChangeInvisibleDuration", answer.status.as_ref().map_or(0, |s| s.code), started);
        Ok(Response::new(answer))
    }

    async fn forward_message_to_dead_letter_queue(
        &self,
        request: Request<pb::ForwardMessageToDeadLetterQueueRequest>,
    ) -> Result<Response<pb::ForwardMessageToDeadLetterQueueResponse>, tonic::Status> {
        let started = Instant::now();
        let answer = match self.authenticated(&request, None) {
            Err(refused) => refused,
            Ok(caller) => consume::forward_to_dead_letter_queue(self, &caller, request.into_inner()).await,
        };
        observe("ForwardMessageToDeadLetterQueue", answer.code, started);
        Ok(Response::new(pb::ForwardMessageToDeadLetterQueueResponse { status: Some(answer) }))
    }

    async fn end_transaction(
        &self,
        request: Request<pb::EndTransactionRequest>,
    ) -> Result<Response<pb::EndTransactionResponse>, tonic::Status> {
        let started = Instant::now();
        let answer = match self.authenticated(&request, Some("producer")) {
            Err(refused) => refused,
            Ok(caller) => {
                let answer_by = deadline::answer_by(request.metadata());
                transaction::end_transaction(self, &caller, request.into_inner(), answer_by).await
            }
        };
        observe("EndTransaction", answer.code, started);
        Ok(Response::new(pb::EndTransactionResponse { status: Some(answer) }))
    }

    /// Answers each Settings the client sends at once (it waits for that answer to finish starting), and
    /// keeps the stream open: the client re-sends its Settings on it every 5 minutes.
    async fn telemetry(
        &self,
        request: Request<Streaming<pb::TelemetryCommand>>,
    ) -> Result<Response<BoxStream<pb::TelemetryCommand>>, tonic::Status> {
        let started = Instant::now();
        // The stream holds one of its token's Telemetry places while it is open.
        let admitted = self.caller(&request).and_then(|caller| self.streams.take(&caller).map(|slot| (caller, slot)));
        let metadata = request.metadata().clone();
        let mut inbound = request.into_inner();
        let (replies, stream) = tokio::sync::mpsc::channel(TELEMETRY_BACKLOG);
        let front = self.clone();
        tokio::spawn(async move {
            let stream_no = front.producers.open();
            let (caller, _slot) = match admitted {
                Ok(admitted) => admitted,
                Err(refused) => {
                    observe("Telemetry", refused.code, started);
                    let _ = replies.send(Ok(pb::TelemetryCommand { status: Some(refused), command: None })).await;
                    return;
                }
            };
            while let Some(Ok(command)) = inbound.next().await {
                let Some(telemetry_command::Command::Settings(client)) = command.command else { continue };
                let started = Instant::now();
                // The caller's grants first: a client it may not announce is neither noted alive nor asked about.
                let admitted =
                    may_announce(&caller, &client).map_err(|refusal| super::status::refused(&refusal)).and_then(|()| {
                        front.saw_client(&caller, &metadata, Some(settings::kind_label(client.client_type)))
                    });
                if let Err(refused) = admitted {
                    observe("Telemetry", refused.code, started);
                    let _ = replies.send(Ok(pb::TelemetryCommand { status: Some(refused), command: None })).await;
                    break;
                }
                front.note_request_timeout(&metadata, &client);
                if let Some(settings_pub_sub::Publishing(publishing)) = &client.pub_sub {
                    // Check-backs carry the half message: a stream is asked only for topics its token may
                    // publish to (each topic its Settings name passed `may_announce` above).
                    let topics = publishing
                        .topics
                        .iter()
                        .map(|t| t.name.clone())
                        .filter(|topic| gateway::may_be_checked_back(&caller, topic))
                        .collect();
                    front.producers.publishes(stream_no, topics, &replies);
                }
                let group_sub = front.subscription_of(&client);
                // A broker request for a group the caller may consume as (checked above), and a named one.
                let group_orderly = match &client.pub_sub {
                    Some(settings_pub_sub::Subscription(s)) => {
                        match s.group.as_ref().filter(|g| !g.name.trim().is_empty()) {
                            Some(group) => front.deliveries.group_orderly(&group.name).await,
                            None => false,
                        }
                    }
                    _ => false,
                };
                let reply = settings::reply(client, &front.config, group_sub.as_ref(), group_orderly);
                observe("Telemetry", Code::Ok as i32, started);
                let answer = pb::TelemetryCommand {
                    status: Some(ok()),
                    command: Some(telemetry_command::Command::Settings(reply)),
                };
                if replies.send(Ok(answer)).await.is_err() {
                    break;
                }
            }
            front.producers.closed(stream_no);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(stream))))
    }
}

/// A broker's transaction check-back goes to a producer of its topic with an open Telemetry stream.
impl crate::gateway::below::CheckForwarder for Front {
    fn forward(&self, orphan: &crate::gateway::below::Orphan) -> bool {
        let recover = pb::RecoverOrphanedTransactionCommand {
            message: Some(consume::message_of(&orphan.event, "", None)),
            transaction_id: orphan.transaction_id.clone(),
        };
        let command = pb::TelemetryCommand {
            status: None,
            command: Some(telemetry_command::Command::RecoverOrphanedTransactionCommand(recover)),
        };
        self.producers.send_to_one(&orphan.event.topic, command)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_date_counts_only_within_the_skew_window_either_way() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_083_200); // 2026-12-01T00:00:00Z
        let window = Duration::from_secs(900);
        assert!(within_skew("20261201T000000Z", now, window));
        assert!(within_skew("20261130T234500Z", now, window), "15 minutes behind");
        assert!(within_skew("20261201T001500Z", now, window), "15 minutes ahead");
        assert!(!within_skew("20261130T234459Z", now, window));
        assert!(!within_skew("20261201T001501Z", now, window));
        assert!(!within_skew("not a date", now, window));
        assert!(!within_skew("", now, window));
    }

    #[test]
    fn the_authorization_header_of_each_sdk_is_read() {
        let java = "MQv2-HMAC-SHA1 Credential=app, SignedHeaders=x-mq-date-time, Signature=ABCD";
        assert_eq!(parse_authorization(java), Some(("app", "ABCD")));
        let go = "MQv2-HMAC-SHA1 Credential=app//Rocketmq, SignedHeaders=x-mq-date-time, Signature=ABCD";
        assert_eq!(parse_authorization(go), Some(("app", "ABCD")));
        assert_eq!(parse_authorization("Bearer token"), None);
    }
}
