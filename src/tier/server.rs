//! The peer link's server: another instance of the tier asks this one to settle a delivery this one handed
//! out, or to end a transaction this one recorded. The request must be signed with the tier's secret; the caller it names is looked up here (a token or a
//! cluster user of the same name) and settles as it would on any front of this instance, through the
//! gateway, with its rights checked here.

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;

use metrics::counter;
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use super::proto::peer_server::{Peer, PeerServer};
use super::proto::{self as pb};
use super::{signed_by_the_tier, wire, InstanceId};
use crate::auth::{Caller, TokenTable};
use crate::gateway::below::{DeliveryError, Dispatcher, Transactions};
use crate::gateway::{Ending, GatewayError, Settling};
use crate::metrics as m;

/// What the peer link's server needs.
pub struct PeerService {
    instance: InstanceId,
    secret: Vec<u8>,
    dispatcher: Arc<Dispatcher>,
    transactions: Arc<Transactions>,
    tokens: Arc<TokenTable>,
}

/// The parts of popgate the peer link's server settles and ends with.
pub struct PeerParts {
    /// The delivery core.
    pub dispatcher: Arc<Dispatcher>,
    /// Transactional messages' records.
    pub transactions: Arc<Transactions>,
    /// The tokens (and cluster users) callers are looked up in by name.
    pub tokens: Arc<TokenTable>,
}

impl PeerService {
    /// The server of instance `instance`, which checks requests against `secret`.
    pub fn new(instance: InstanceId, secret: &str, parts: PeerParts) -> Self {
        let PeerParts { dispatcher, transactions, tokens } = parts;
        PeerService { instance, secret: secret.as_bytes().to_vec(), dispatcher, transactions, tokens }
    }

    /// The caller `name` another instance authenticated (its request came from `source_ip`), as this instance
    /// knows it: its grants are this instance's.
    fn caller_of(&self, name: &str, source_ip: &str) -> Option<Caller> {
        let caller = self.tokens.caller_named(name)?;
        Some(match source_ip.parse::<IpAddr>() {
            Ok(ip) => caller.from_address(ip),
            Err(_) => caller,
        })
    }
}

#[tonic::async_trait]
impl Peer for PeerService {
    async fn identify(&self, request: Request<pb::IdentifyRequest>) -> Result<Response<pb::IdentifyReply>, Status> {
        let asker = request.get_ref().asker.clone();
        if !signed_by_the_tier(&request, &self.secret, "identify", &asker) {
            return Err(Status::unauthenticated("not signed with the tier's secret"));
        }
        let acked_without_you = self
            .dispatcher
            .take_untold(&asker)
            .await
            .into_iter()
            .map(|(delivery_id, hand_out)| pb::AckedWithoutYou { delivery_id, hand_out })
            .collect();
        Ok(Response::new(pb::IdentifyReply { instance_id: self.instance.to_string(), acked_without_you }))
    }

    async fn settle(&self, request: Request<pb::SettleRequest>) -> Result<Response<pb::SettleReply>, Status> {
        let subject = request.get_ref().delivery_id.clone();
        let signed = signed_by_the_tier(&request, &self.secret, "settle", &subject);
        let request = request.into_inner();
        let Some((settlement, action)) = wire::asked(&request) else {
            return Err(Status::invalid_argument("a settlement names its action"));
        };
        let label = wire::action_label(&action);
        if !signed {
            counter!(m::TIER_SERVED, "action" => label, "result" => "unauthenticated").increment(1);
            return Err(Status::unauthenticated("not signed with the tier's secret"));
        }
        let outcome = match self.caller_of(&request.caller, &request.source_ip) {
            // Only what this instance handed out is settled here: no asking on (a loop between instances).
            Some(caller) => {
                let settling = Settling { dispatcher: &self.dispatcher, owners: None };
                settling.settle(&caller, settlement, &action).await
            }
            // A caller this instance does not know (its config differs): nothing it may do here.
            None => Err(GatewayError::Delivery(DeliveryError::Unknown)),
        };
        let result = if outcome.is_ok() { "ok" } else { "refused" };
        counter!(m::TIER_SERVED, "action" => label, "result" => result).increment(1);
        Ok(Response::new(wire::reply(outcome)))
    }

    async fn end(&self, request: Request<pb::EndRequest>) -> Result<Response<pb::EndReply>, Status> {
        let subject = request.get_ref().transaction_id.clone();
        if !signed_by_the_tier(&request, &self.secret, "end", &subject) {
            counter!(m::TIER_SERVED, "action" => "end", "result" => "unauthenticated").increment(1);
            return Err(Status::unauthenticated("not signed with the tier's secret"));
        }
        let request = request.into_inner();
        let outcome = match self.caller_of(&request.caller, &request.source_ip) {
            // Only what this instance recorded is ended here: no asking on.
            Some(caller) => {
                let ending = Ending { transactions: &self.transactions, front: "tier", owners: None };
                ending.end(&caller, wire::asked_end(&request)).await
            }
            None => Ok(None),
        };
        let reply = wire::end_reply(outcome);
        let result = match &reply.outcome {
            Some(pb::end_reply::Outcome::Ended(_)) => "ok",
            Some(pb::end_reply::Outcome::Refused(_)) => "refused",
            _ => "not_here",
        };
        counter!(m::TIER_SERVED, "action" => "end", "result" => result).increment(1);
        Ok(Response::new(reply))
    }
}

/// Serves the peer link on `listener` until `shutdown` resolves.
///
/// # Errors
/// When the server fails.
pub async fn serve(
    listener: TcpListener,
    service: PeerService,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(PeerServer::new(service))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
