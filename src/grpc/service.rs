//! `MessagingService`: each RPC checks the caller, then calls the publish layer (and, next, the delivery
//! layer). It holds no message or delivery state of its own: only the connected clients, for the gauge and
//! for telling producers from consumers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::{counter, gauge, histogram};
use parking_lot::Mutex;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::codegen::BoxStream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Streaming};

use super::proto::messaging_service_server::MessagingService;
use super::proto::{self as pb, telemetry_command, Code};
use super::send;
use super::settings;
use super::status::{code_label, ok, status};
use crate::auth::{Caller, TokenTable};
use crate::config::Config;
use crate::metrics as m;
use crate::publish::Publisher;

/// A client that stops heartbeating (it heartbeats every 10 s) is forgotten after this long.
const CLIENT_EXPIRY: Duration = Duration::from_secs(60);

/// What the front needs from the rest of popgate.
pub struct Front {
    pub(super) publisher: Arc<Publisher>,
    pub(super) tokens: Arc<TokenTable>,
    pub(super) config: Arc<Config>,
    clients: Mutex<HashMap<String, (&'static str, Instant)>>,
}

impl Front {
    pub(super) fn new(publisher: Arc<Publisher>, tokens: Arc<TokenTable>, config: Arc<Config>) -> Front {
        Front { publisher, tokens, config, clients: Mutex::new(HashMap::new()) }
    }

    /// The caller of a request, from the SDK's signature (`authorization: MQv2-HMAC-SHA1 Credential=<AK>,
    /// SignedHeaders=x-mq-date-time, Signature=<hex>`); everyone when authentication is off.
    pub(super) fn caller(&self, metadata: &MetadataMap) -> Result<Caller, pb::Status> {
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
        self.tokens
            .authenticate_signature(access_key, signed, signature)
            .ok_or_else(|| refused("unknown access key or bad signature"))
    }

    /// Notes that `client_id` is alive (its kind, when known), and refreshes the gauge.
    fn saw_client(&self, metadata: &MetadataMap, kind: Option<&'static str>) {
        let Some(id) = metadata.get("x-mq-client-id").and_then(|v| v.to_str().ok()) else { return };
        let mut clients = self.clients.lock();
        let now = Instant::now();
        let known = clients.get(id).map(|(k, _)| *k);
        clients.insert(id.to_owned(), (kind.or(known).unwrap_or("other"), now));
        clients.retain(|_, (_, seen)| now.duration_since(*seen) < CLIENT_EXPIRY);
        publish_client_gauge(&clients);
    }

    fn forget_client(&self, metadata: &MetadataMap) {
        let Some(id) = metadata.get("x-mq-client-id").and_then(|v| v.to_str().ok()) else { return };
        let mut clients = self.clients.lock();
        clients.remove(id);
        publish_client_gauge(&clients);
    }
}

fn publish_client_gauge(clients: &HashMap<String, (&'static str, Instant)>) {
    for kind in ["producer", "push_consumer", "simple_consumer", "other"] {
        let count = clients.values().filter(|(k, _)| *k == kind).count();
        gauge!(m::GRPC_CLIENTS, "kind" => kind).set(count as f64);
    }
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
        self.saw_client(request.metadata(), None);
        let answer = match self.caller(request.metadata()) {
            Err(refused) => pb::QueryRouteResponse { status: Some(refused), message_queues: Vec::new() },
            Ok(_) => super::route::query_route(self, request.into_inner()).await,
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
        let answer = match self.caller(request.metadata()) {
            Err(refused) => refused,
            Ok(_) => {
                self.saw_client(request.metadata(), (kind != "other").then_some(kind));
                ok()
            }
        };
        observe("Heartbeat", answer.code, started);
        Ok(Response::new(pb::HeartbeatResponse { status: Some(answer) }))
    }

    async fn send_message(
        &self,
        request: Request<pb::SendMessageRequest>,
    ) -> Result<Response<pb::SendMessageResponse>, tonic::Status> {
        let started = Instant::now();
        self.saw_client(request.metadata(), Some("producer"));
        let answer = match self.caller(request.metadata()) {
            Err(refused) => pb::SendMessageResponse { status: Some(refused), entries: Vec::new() },
            Ok(caller) => send::send_messages(self, &caller, request.into_inner()).await,
        };
        observe("SendMessage", answer.status.as_ref().map_or(0, |s| s.code), started);
        Ok(Response::new(answer))
    }

    async fn notify_client_termination(
        &self,
        request: Request<pb::NotifyClientTerminationRequest>,
    ) -> Result<Response<pb::NotifyClientTerminationResponse>, tonic::Status> {
        let started = Instant::now();
        let answer = match self.caller(request.metadata()) {
            Err(refused) => refused,
            Ok(_) => {
                self.forget_client(request.metadata());
                ok()
            }
        };
        observe("NotifyClientTermination", answer.code, started);
        Ok(Response::new(pb::NotifyClientTerminationResponse { status: Some(answer) }))
    }

    /// Answers each Settings the client sends at once (it waits for that answer to finish starting), and
    /// keeps the stream open: the client re-sends its Settings on it every 5 minutes.
    async fn telemetry(
        &self,
        request: Request<Streaming<pb::TelemetryCommand>>,
    ) -> Result<Response<BoxStream<pb::TelemetryCommand>>, tonic::Status> {
        let started = Instant::now();
        let caller = self.caller(request.metadata());
        let metadata = request.metadata().clone();
        let mut inbound = request.into_inner();
        let (replies, stream) = tokio::sync::mpsc::channel(4);
        let front = self.clone();
        tokio::spawn(async move {
            if let Err(refused) = caller {
                observe("Telemetry", refused.code, started);
                let _ = replies.send(Ok(pb::TelemetryCommand { status: Some(refused), command: None })).await;
                return;
            }
            while let Some(Ok(command)) = inbound.next().await {
                let Some(telemetry_command::Command::Settings(client)) = command.command else { continue };
                let started = Instant::now();
                front.saw_client(&metadata, Some(settings::kind_label(client.client_type)));
                let reply = settings::reply(client, &front.config);
                observe("Telemetry", Code::Ok as i32, started);
                let answer = pb::TelemetryCommand {
                    status: Some(ok()),
                    command: Some(telemetry_command::Command::Settings(reply)),
                };
                if replies.send(Ok(answer)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(stream))))
    }
}
