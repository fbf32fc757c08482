//! `MessagingService`: each RPC checks the caller, then calls the publish or the delivery layer. It holds no
//! message or delivery state of its own: only which clients are alive (for the gauge, and so the deliveries a
//! live PushConsumer holds stay handed out: [`keep_alive_loop`]).
//!
//! Beside this file: [`caller`] (the signature check) and [`clients`] (which clients are alive).

mod caller;
mod clients;

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use metrics::{counter, histogram};
use parking_lot::Mutex;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Streaming};

pub(super) use self::clients::keep_alive_loop;
use self::clients::{client_id, client_version, Liveness};
use super::consume;
use super::deadline;
use super::limits::OpenCalls;
use super::producers::Producers;
use super::proto::messaging_service_server::MessagingService;
use super::proto::{self as pb, settings::PubSub as settings_pub_sub, telemetry_command, Code};
use super::send;
use super::settings;
use super::status::{bad, code_label, ok};
use super::transaction;
use super::written;
use crate::auth::{Caller, TokenTable};
use crate::config::Config;
use crate::gateway::below::Transactions;
use crate::gateway::{self, GatewayError};
use crate::metrics as m;
use crate::publish::Publisher;

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

/// Counts one answered RPC and its duration.
fn observe(rpc: &'static str, code: i32, started: Instant) {
    counter!(m::GRPC_REQUESTS, "rpc" => rpc, "code" => code_label(code)).increment(1);
    histogram!(m::GRPC_REQUEST_DURATION, "rpc" => rpc).record(started.elapsed().as_secs_f64());
}

/// What a call's caller must pass before the call is made.
#[derive(Debug, Clone, Copy)]
enum Admission {
    /// Authenticated, and its client id marked alive, with the client's kind when the call tells it
    /// ([`Front::authenticated`]).
    Client(Option<&'static str>),
    /// Authenticated only ([`Front::caller`]): a client saying goodbye is not marked alive again.
    Caller,
}

/// A unary RPC's request: the answer it gets, and what that answer is when its caller is refused.
trait Unary {
    /// The response message.
    type Answer;
    /// The answer to a caller refused before the call was made, `refused` as its status.
    fn refusal(&self, refused: pb::Status) -> Self::Answer;
    /// The status code `answer` carries, for the metrics (`OK` when it carries none).
    fn code(answer: &Self::Answer) -> i32;
}

/// [`Unary`] for the RPCs whose refusal is the response with its status and the other fields (named) empty.
macro_rules! unary {
    ($($request:ident => $answer:ident { $($empty:ident),* }),* $(,)?) => {$(
        impl Unary for pb::$request {
            type Answer = pb::$answer;

            fn refusal(&self, refused: pb::Status) -> pb::$answer {
                pb::$answer { status: Some(refused), $($empty: Default::default()),* }
            }

            fn code(answer: &pb::$answer) -> i32 {
                answer.status.as_ref().map_or(0, |s| s.code)
            }
        }
    )*};
}

unary! {
    QueryRouteRequest => QueryRouteResponse { message_queues },
    HeartbeatRequest => HeartbeatResponse {},
    SendMessageRequest => SendMessageResponse { entries },
    NotifyClientTerminationRequest => NotifyClientTerminationResponse {},
    QueryAssignmentRequest => QueryAssignmentResponse { assignments },
    AckMessageRequest => AckMessageResponse { entries },
    ForwardMessageToDeadLetterQueueRequest => ForwardMessageToDeadLetterQueueResponse {},
    EndTransactionRequest => EndTransactionResponse {},
}

/// A refused ChangeInvisibleDuration still carries the handle it named.
impl Unary for pb::ChangeInvisibleDurationRequest {
    type Answer = pb::ChangeInvisibleDurationResponse;

    fn refusal(&self, refused: pb::Status) -> pb::ChangeInvisibleDurationResponse {
        pb::ChangeInvisibleDurationResponse { status: Some(refused), receipt_handle: self.receipt_handle.clone() }
    }

    fn code(answer: &pb::ChangeInvisibleDurationResponse) -> i32 {
        answer.status.as_ref().map_or(0, |s| s.code)
    }
}

impl Front {
    /// Every unary RPC's one path: admits the caller, makes the call, and counts the answer under `rpc` (its
    /// code and its duration, from before the caller was checked). A refused caller gets the request's
    /// [`Unary::refusal`]. The gRPC status is OK either way: RocketMQ's status travels in the answer.
    ///
    /// The streaming RPCs (ReceiveMessage, Telemetry) admit their caller the same way but count each answer
    /// when it is given, in the task that serves the stream, so they do not go through here.
    async fn unary<Req, F, Fut>(
        &self,
        rpc: &'static str,
        request: Request<Req>,
        admission: Admission,
        call: F,
    ) -> Result<Response<Req::Answer>, tonic::Status>
    where
        Req: Unary,
        F: FnOnce(Caller, Request<Req>) -> Fut,
        Fut: Future<Output = Req::Answer>,
    {
        let started = Instant::now();
        let admitted = match admission {
            Admission::Client(kind) => self.authenticated(&request, kind),
            Admission::Caller => self.caller(&request),
        };
        let answer = match admitted {
            Err(refused) => request.get_ref().refusal(refused),
            Ok(caller) => call(caller, request).await,
        };
        observe(rpc, Req::code(&answer), started);
        Ok(Response::new(answer))
    }
}

#[tonic::async_trait]
impl MessagingService for Arc<Front> {
    async fn query_route(
        &self,
        request: Request<pb::QueryRouteRequest>,
    ) -> Result<Response<pb::QueryRouteResponse>, tonic::Status> {
        self.unary("QueryRoute", request, Admission::Client(None), |caller, request| async move {
            super::route::query_route(self, &caller, request.into_inner()).await
        })
        .await
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, tonic::Status> {
        // The Go SDK heartbeats with an empty request while reconnecting: no field is required.
        let kind = settings::kind_label(Some(request.get_ref().client_type));
        let admission = Admission::Client((kind != "other").then_some(kind));
        self.unary("Heartbeat", request, admission, |_, _| async { pb::HeartbeatResponse { status: Some(ok()) } }).await
    }

    async fn send_message(
        &self,
        request: Request<pb::SendMessageRequest>,
    ) -> Result<Response<pb::SendMessageResponse>, tonic::Status> {
        self.unary("SendMessage", request, Admission::Client(Some("producer")), |caller, request| async move {
            let deadline = deadline::answer_by(request.metadata());
            send::send_messages(self, &caller, request.into_inner(), deadline).await
        })
        .await
    }

    async fn notify_client_termination(
        &self,
        request: Request<pb::NotifyClientTerminationRequest>,
    ) -> Result<Response<pb::NotifyClientTerminationResponse>, tonic::Status> {
        self.unary("NotifyClientTermination", request, Admission::Caller, |caller, request| async move {
            let answer = match client_id(request.metadata()) {
                None => ok(),
                Some(id) => self.terminate_client(&caller, id, request.get_ref().group.as_ref()).await,
            };
            pb::NotifyClientTerminationResponse { status: Some(answer) }
        })
        .await
    }

    async fn query_assignment(
        &self,
        request: Request<pb::QueryAssignmentRequest>,
    ) -> Result<Response<pb::QueryAssignmentResponse>, tonic::Status> {
        self.unary("QueryAssignment", request, Admission::Client(Some("push_consumer")), |caller, request| async move {
            consume::query_assignment(self, &caller, request.into_inner()).await
        })
        .await
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
            (Ok(_), None) => Err(bad(Code::ClientIdRequired, "the x-mq-client-id header is required")),
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
        self.unary("AckMessage", request, Admission::Client(None), |caller, request| async move {
            consume::ack_messages(self, &caller, request.into_inner()).await
        })
        .await
    }

    async fn change_invisible_duration(
        &self,
        request: Request<pb::ChangeInvisibleDurationRequest>,
    ) -> Result<Response<pb::ChangeInvisibleDurationResponse>, tonic::Status> {
        self.unary("ChangeInvisibleDuration", request, Admission::Client(None), |caller, request| async move {
            consume::change_invisible_duration(self, &caller, request.into_inner()).await
        })
        .await
    }

    async fn forward_message_to_dead_letter_queue(
        &self,
        request: Request<pb::ForwardMessageToDeadLetterQueueRequest>,
    ) -> Result<Response<pb::ForwardMessageToDeadLetterQueueResponse>, tonic::Status> {
        self.unary("ForwardMessageToDeadLetterQueue", request, Admission::Client(None), |caller, request| async move {
            let answer = consume::forward_to_dead_letter_queue(self, &caller, request.into_inner()).await;
            pb::ForwardMessageToDeadLetterQueueResponse { status: Some(answer) }
        })
        .await
    }

    async fn end_transaction(
        &self,
        request: Request<pb::EndTransactionRequest>,
    ) -> Result<Response<pb::EndTransactionResponse>, tonic::Status> {
        self.unary("EndTransaction", request, Admission::Client(Some("producer")), |caller, request| async move {
            let answer_by = deadline::answer_by(request.metadata());
            let answer = transaction::end_transaction(self, &caller, request.into_inner(), answer_by).await;
            pb::EndTransactionResponse { status: Some(answer) }
        })
        .await
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
