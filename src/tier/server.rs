//! The peer link's server: another instance of the tier asks this one to settle a delivery this one handed
//! out, or to end a transaction this one recorded. The request must be signed whole with the tier's secret, for
//! this instance, and come once (`signing.rs`); the caller it names is looked up here (a token or a cluster user
//! of the same name) and settles as it would on any front of this instance, through the gateway, with its
//! rights checked here, from the source address the request names (one that is not an address is refused).

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;

use std::time::Duration;

use metrics::counter;
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use super::proto::peer_server::{Peer, PeerServer};
use super::proto::{self as pb};
use super::signing::{Recipient, Refused, Verifier};
use super::tls::PeerTls;
use super::{wire, InstanceId};
use crate::auth::{Caller, TokenTable};
use crate::gateway::below::{DeliveryError, Transactions};
use crate::gateway::{Deliveries, Ending, GatewayError};
use crate::metrics as m;
use crate::opening::Opening;

/// Longest time a connection may take to send its HTTP/2 preface.
const OPENING_TIMEOUT: Duration = Duration::from_secs(10);
/// Most calls one connection may have open at once (tonic sets no bound); an instance's settlements past it
/// wait in its client for a place.
const MAX_STREAMS: u32 = 1_000;

/// What the peer link's server needs.
pub struct PeerService {
    instance: InstanceId,
    /// Checks each request's signature, and remembers the requests taken so none is taken twice.
    verifier: Verifier,
    deliveries: Deliveries,
    transactions: Arc<Transactions>,
    tokens: Arc<TokenTable>,
}

/// The parts of popgate the peer link's server settles and ends with.
pub struct PeerParts {
    /// The delivery core.
    pub deliveries: Deliveries,
    /// Transactional messages' records.
    pub transactions: Arc<Transactions>,
    /// The tokens (and cluster users) callers are looked up in by name.
    pub tokens: Arc<TokenTable>,
}

impl PeerService {
    /// The server of instance `instance`, which checks requests against `secret`.
    pub fn new(instance: InstanceId, secret: &str, parts: PeerParts) -> Self {
        let PeerParts { deliveries, transactions, tokens } = parts;
        let verifier = Verifier::new(secret.as_bytes(), instance.clone());
        PeerService { instance, verifier, deliveries, transactions, tokens }
    }
}

/// The request `checked` (call `rpc`, for `action`) only if signed for this instance by name; a refusal is
/// counted, and logged at debug only: anyone who reaches the port can send refusals without end, and the
/// instance whose requests are refused logs that it could not ask.
fn for_this_instance(checked: Result<Recipient, Refused>, rpc: &str, action: &'static str) -> Result<(), Status> {
    match checked {
        Ok(Recipient::This) => Ok(()),
        Ok(Recipient::Unnamed) => Err(refusal(Refused::NotForMe, rpc, action)),
        Err(refused) => Err(refusal(refused, rpc, action)),
    }
}

fn refusal(refused: Refused, rpc: &str, action: &'static str) -> Status {
    counter!(m::TIER_SERVED, "action" => action, "result" => refused.label()).increment(1);
    tracing::debug!(rpc, error = %refused, "A peer request was refused.");
    refused.status()
}

/// The caller `name` another instance authenticated, its request from `source_ip` (empty: not known there), as
/// this instance knows it: its grants are this instance's; `Ok(None)` when it knows no such caller.
///
/// # Errors
/// `INVALID_ARGUMENT` when `source_ip` is not an address: taking the caller as one from nowhere would skip the
/// ACL entries limited to networks, `Deny` ones included.
fn caller_of(tokens: &TokenTable, name: &str, source_ip: &str) -> Result<Option<Caller>, Status> {
    let source = match source_ip {
        "" => None,
        ip => Some(ip.parse::<IpAddr>().map_err(|_| {
            Status::invalid_argument(format!("the caller's source address `{ip}` is not an IP address"))
        })?),
    };
    let Some(caller) = tokens.caller_named(name) else { return Ok(None) };
    Ok(Some(match source {
        Some(ip) => caller.with_address(ip),
        None => caller,
    }))
}

#[tonic::async_trait]
impl Peer for PeerService {
    async fn identify(&self, request: Request<pb::IdentifyRequest>) -> Result<Response<pb::IdentifyReply>, Status> {
        let instance_id = self.instance.to_string();
        match self.verifier.check(&request, "identify") {
            Ok(Recipient::This) => {}
            // Asked who answers on this address: the id alone, what is noted for the asker only when asked of
            // this instance by name (so a request captured on its way to another peer takes nothing here).
            Ok(Recipient::Unnamed) => {
                return Ok(Response::new(pb::IdentifyReply { instance_id, acked_without_you: Vec::new() }))
            }
            Err(refused) => return Err(refusal(refused, "identify", "identify")),
        }
        let asker = &request.get_ref().asker;
        let acked_without_you = self
            .deliveries
            .take_untold(asker)
            .await
            .into_iter()
            .map(|(delivery_id, hand_out)| pb::AckedWithoutYou { delivery_id, hand_out })
            .collect();
        Ok(Response::new(pb::IdentifyReply { instance_id, acked_without_you }))
    }

    async fn settle(&self, request: Request<pb::SettleRequest>) -> Result<Response<pb::SettleReply>, Status> {
        let checked = self.verifier.check(&request, "settle");
        let request = request.into_inner();
        let asked = wire::asked(&request);
        // The signature first: a request nobody signed is told nothing about what it carries.
        let label = asked.as_ref().map_or("unknown", |(_, action)| wire::action_label(action));
        for_this_instance(checked, "settle", label)?;
        let Some((settlement, action)) = asked else {
            counter!(m::TIER_SERVED, "action" => label, "result" => "refused").increment(1);
            return Err(Status::invalid_argument("a settlement names its action"));
        };
        let caller = caller_of(&self.tokens, &request.caller, &request.source_ip).inspect_err(|_| {
            counter!(m::TIER_SERVED, "action" => label, "result" => "refused").increment(1);
        })?;
        let outcome = match caller {
            // Only what this instance handed out is settled here: no asking on (a loop between instances).
            Some(caller) => {
                let settling = self.deliveries.settling(None);
                settling.settle(&caller, settlement, &action).await
            }
            // A caller this instance does not know (its config differs): nothing it may do here.
            None => Err(GatewayError::Delivery(DeliveryError::Unknown)),
        };
        let result = if outcome.is_ok() { "ok" } else { "refused" };
        counter!(m::TIER_SERVED, "action" => label, "result" => result).increment(1);
        Ok(Response::new(wire::reply(outcome)))
    }

    async fn share(&self, request: Request<pb::ShareRequest>) -> Result<Response<pb::ShareReply>, Status> {
        for_this_instance(self.verifier.check(&request, "share"), "share", "share")?;
        super::sharing::apply_all(&self.deliveries, request.into_inner().changes).await;
        Ok(Response::new(pb::ShareReply {}))
    }

    async fn subscriptions(
        &self,
        request: Request<pb::SubscriptionsRequest>,
    ) -> Result<Response<pb::SubscriptionsReply>, Status> {
        for_this_instance(self.verifier.check(&request, "subscriptions"), "subscriptions", "subscriptions")?;
        if request.get_ref().digest == self.deliveries.shared_digest() {
            return Ok(Response::new(pb::SubscriptionsReply { same: true, changes: Vec::new() }));
        }
        let changes = self.deliveries.shared_set().iter().filter_map(super::sharing::to_wire).collect();
        Ok(Response::new(pb::SubscriptionsReply { same: false, changes }))
    }

    async fn leases(&self, request: Request<pb::LeasesRequest>) -> Result<Response<pb::LeasesReply>, Status> {
        for_this_instance(self.verifier.check(&request, "leases"), "leases", "leases")?;
        for told in request.into_inner().leases.into_iter().take(super::sharing::MAX_SET) {
            self.deliveries.learn_lease(&told.delivery_id, told.lease);
        }
        Ok(Response::new(pb::LeasesReply {}))
    }

    async fn end(&self, request: Request<pb::EndRequest>) -> Result<Response<pb::EndReply>, Status> {
        for_this_instance(self.verifier.check(&request, "end"), "end", "end")?;
        let request = request.into_inner();
        let caller = caller_of(&self.tokens, &request.caller, &request.source_ip).inspect_err(|_| {
            counter!(m::TIER_SERVED, "action" => "end", "result" => "refused").increment(1);
        })?;
        let outcome = match caller {
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

/// Serves the peer link on `listener` until `shutdown` resolves: over mutual TLS when `tls` is given (a
/// connection without it, or without a certificate of the tier's CA, is refused), else plaintext. A connection
/// has OPENING_TIMEOUT to send its HTTP/2 preface (see `crate::opening`), after its TLS handshake's own deadline;
/// a call must be read in and answered within `call_timeout` (`tier.forward_timeout_ms`, the deadline the
/// instances give their own calls); at most `max_connections` are open at once.
///
/// # Errors
/// When the server fails.
pub async fn serve(
    listener: TcpListener,
    service: PeerService,
    tls: Option<Arc<PeerTls>>,
    call_timeout: Duration,
    max_connections: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS)
        // A call that names no deadline (the instances name theirs) gets theirs: a request sent a byte at a time
        // is not waited for for ever.
        .timeout(call_timeout)
        .add_service(PeerServer::new(service));
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    match tls {
        Some(tls) => {
            let incoming = super::tls::incoming(listener, &tls, slots, OPENING_TIMEOUT);
            server.serve_with_incoming_shutdown(incoming, shutdown).await
        }
        None => {
            let incoming =
                crate::tls::accept_each(listener, "peer link", slots, super::tls::too_many, |tcp, peer, slot| {
                    let due = tokio::time::Instant::now() + OPENING_TIMEOUT;
                    std::future::ready(Some(Opening::new(tcp, peer, due).holding(slot)))
                });
            server.serve_with_incoming_shutdown(incoming, shutdown).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Action;
    use crate::config::{AclEntryConfig, AuthConfig, TokenConfig};

    /// A caller whose ACL denies it a topic from one network: what the request names as its source address
    /// decides whether the deny applies, so a source address that is not one is refused, never dropped.
    #[test]
    fn a_source_address_that_is_not_an_address_is_refused() {
        let deny = AclEntryConfig {
            resource: "Topic:payroll".into(),
            actions: vec!["Sub".into()],
            decision: Some("Deny".into()),
            source_ips: vec!["10.0.0.0/8".parse().expect("a network")],
        };
        let token = TokenConfig {
            name: "app".into(),
            token: Some("app-secret-0123456789".into()),
            consume: vec!["g".into()],
            acl: vec![deny],
            ..TokenConfig::default()
        };
        let tokens = TokenTable::new(&AuthConfig { enabled: true, tokens: vec![token], ..AuthConfig::default() });

        for unparseable in ["not-an-address", "10.1.2.3:80", "10.1.2", " 10.1.2.3", "10.0.0.0/8"] {
            let refused = caller_of(&tokens, "app", unparseable).expect_err(unparseable);
            assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{unparseable}");
        }
        let from_inside = caller_of(&tokens, "app", "10.1.2.3").expect("an address").expect("known");
        assert_eq!(from_inside.source_ip(), Some("10.1.2.3".parse().expect("ip")));
        assert!(!from_inside.may(Action::Subscribe("payroll")), "denied from 10.0.0.0/8");
        let unknown = caller_of(&tokens, "app", "").expect("none given").expect("known");
        assert_eq!(unknown.source_ip(), None, "not known where the request came in, as there");
        assert!(unknown.may(Action::Subscribe("payroll")), "what an address that is not one would have become");
        assert!(caller_of(&tokens, "nobody", "10.1.2.3").expect("an address").is_none());
    }
}
