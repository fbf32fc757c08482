//! popgate as a tier: several instances behind one load balancer, any of which settles any delivery.
//!
//! Each instance has an id ([`InstanceId`]) that starts every delivery id it mints, and so every handle of
//! every front (`pg2:<delivery id>.<hand-out>`, `pgr:…`, an HTTP `deliveryId`). A settlement (ACK, NACK, TERM,
//! a new deadline) that reaches an instance which did not hand the delivery out is asked of the one that did,
//! over the peer link: popgate's own small gRPC service (`proto/popgate/peer/v1`), on its own port
//! (`tier.listen`), each request signed whole with the tier's shared secret, for one instance, and taken once
//! (`signing.rs`); with `tier.tls_*` set, over mutual TLS with the tier's own CA ([`tls`]). The owner applies
//! it as it would its own client's: the same caller's rights, stale holders fenced, the ACK intent stored
//! before the broker ACK.
//!
//! Peers are the addresses of `tier.peers` and of `tier.peer_dns` (a Kubernetes headless Service), looked up
//! every `tier.refresh_secs` and asked who they are; a settlement for an instance not known yet looks again
//! at once (at most once a second).
//!
//! This module is a front (the peer link's server, [`server`]) and the gateway's way to the other instances
//! ([`Tier`], the gateway's [`Owners`]).

mod identity;
/// The peer link's generated messages, server and client (public for it/, which speaks the link raw).
pub mod proto;
pub(crate) mod server;
mod sharing;
mod signing;
pub mod tls;
mod wire;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use metrics::{counter, gauge};
use parking_lot::Mutex;
use tonic::transport::{Channel, Endpoint};

pub use identity::{IdentityError, InstanceId};
use proto::peer_client::PeerClient;
use signing::sign_request;
use tls::PeerTls;

use crate::auth::Caller;
use crate::config::TierConfig;
use crate::gateway::below::{instance_of, Target};
use crate::gateway::{Deliveries, EndOutcome, EndRequest, GatewayError, Owners, Settle, Settled, Settlement};
use crate::metrics as m;

/// The soonest the peers are looked up again for a settlement of an instance not known yet.
const LOOKUP_AGAIN_AFTER: Duration = Duration::from_secs(1);
/// This instance in its tier: its id, and the other instances' peer links.
pub struct Tier {
    instance: InstanceId,
    secret: Vec<u8>,
    config: TierConfig,
    /// The other instances' peer links, by instance id.
    peers: Mutex<HashMap<String, PeerClient<Channel>>>,
    /// The channel of each peer address, kept across look-ups (a channel reconnects by itself).
    channels: Mutex<HashMap<String, Channel>>,
    /// When the peers were last looked up.
    looked_up: tokio::sync::Mutex<Option<Instant>>,
    /// This instance's deliveries, to which what the peers ACKed without it is applied.
    deliveries: Option<Deliveries>,
    /// Transaction ends being asked of the peers now, at most `tier.max_ends_asked_at_once`.
    ends_asked: tokio::sync::Semaphore,
    /// The link's TLS (`tier.tls_*`); `None`: plaintext.
    tls: Option<Arc<PeerTls>>,
}

impl Tier {
    /// This instance (`instance`) in the tier `config` describes, its deliveries those of `deliveries`, its
    /// peers reached over `tls` (`None`: plaintext); nobody known yet ([`Tier::look_up`]).
    pub fn new(
        config: &TierConfig,
        instance: InstanceId,
        deliveries: Option<Deliveries>,
        tls: Option<Arc<PeerTls>>,
    ) -> Arc<Tier> {
        Arc::new(Tier {
            instance,
            secret: config.secret.as_bytes().to_vec(),
            config: config.clone(),
            peers: Mutex::new(HashMap::new()),
            channels: Mutex::new(HashMap::new()),
            looked_up: tokio::sync::Mutex::new(None),
            deliveries,
            ends_asked: tokio::sync::Semaphore::new(config.max_ends_asked_at_once),
            tls,
        })
    }

    /// This instance's id.
    pub fn instance(&self) -> &InstanceId {
        &self.instance
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.config.forward_timeout_ms)
    }

    /// Looks the peers up: every address of `tier.peers` and `tier.peer_dns`, each asked who it is (and told
    /// who asks: it answers with the ACKs it made at the broker for this instance meanwhile, which are applied
    /// here), then for its shared subscriptions when they differ from this instance's (`sharing`). An address
    /// that does not answer is left out until the next look-up.
    pub async fn look_up(&self) {
        let mut looked_up = self.looked_up.lock().await;
        let addresses = self.addresses().await;
        let asked = addresses.iter().map(|address| self.identify(address));
        let answers = futures::future::join_all(asked).await;
        let mut found = HashMap::new();
        let mut acked_without_me = Vec::new();
        for (address, answer) in addresses.iter().zip(answers) {
            match answer {
                Ok((id, _, _)) if id == self.instance.as_str() => {}
                Ok((id, client, acked)) => {
                    found.insert(id, client);
                    acked_without_me.extend(acked);
                }
                Err(why) => tracing::debug!(%address, %why, "A tier peer did not say who it is."),
            }
        }
        gauge!(m::TIER_PEERS).set(found.len() as f64);
        let peers: Vec<(String, PeerClient<Channel>)> =
            found.iter().map(|(id, client)| (id.clone(), client.clone())).collect();
        *self.peers.lock() = found;
        // Only the addresses of this look-up keep a channel: a restarted pod comes back at a new address, and
        // the old one's channel would otherwise stay for good.
        self.channels.lock().retain(|address, _| addresses.binary_search(address).is_ok());
        *looked_up = Some(Instant::now());
        drop(looked_up);
        // The tier's shared subscriptions, from each peer whose set differs (the whole set at the start).
        self.sync_subscriptions(&peers).await;
        if let Some(deliveries) = &self.deliveries {
            let settling = deliveries.settling(None);
            for acked in acked_without_me {
                settling.acked_by_a_peer(Target { id: &acked.delivery_id, handout: acked.hand_out }).await;
            }
        }
    }

    /// Looks the peers up every `tier.refresh_secs`, for as long as the tier lives.
    pub async fn keep_looking_up(tier: std::sync::Weak<Tier>) {
        let every = match tier.upgrade() {
            Some(tier) => Duration::from_secs(tier.config.refresh_secs),
            None => return,
        };
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let Some(tier) = tier.upgrade() else { return };
            tier.look_up().await;
        }
    }

    /// The peer addresses: the configured ones and those `tier.peer_dns` resolves to.
    async fn addresses(&self) -> Vec<String> {
        let mut addresses: Vec<String> = self.config.peers.clone();
        if !self.config.peer_dns.is_empty() {
            match tokio::net::lookup_host(self.config.peer_dns.as_str()).await {
                Ok(resolved) => addresses.extend(resolved.map(|addr| addr.to_string())),
                Err(why) => tracing::warn!(name = %self.config.peer_dns, %why, "tier.peer_dns did not resolve."),
            }
        }
        addresses.sort();
        addresses.dedup();
        addresses
    }

    /// Who answers on `address`, a client of it, and what it ACKed at the broker for this instance meanwhile.
    ///
    /// Asked twice: who it is (signed for nobody: the answer is the id alone), then, signed for that id, what
    /// it ACKed. A request signed for one instance is refused by any other, so a captured one taken to another
    /// peer does not collect that peer's notes for this instance.
    async fn identify(
        &self,
        address: &str,
    ) -> Result<(String, PeerClient<Channel>, Vec<proto::AckedWithoutYou>), String> {
        let channel = self.channel(address)?;
        let mut client = PeerClient::new(channel);
        let id = self.identify_as(&mut client, "").await?.instance_id;
        if id == self.instance.as_str() {
            return Ok((id, client, Vec::new()));
        }
        let reply = self.identify_as(&mut client, &id).await?;
        if reply.instance_id != id {
            return Err(format!("it said it is `{id}`, then `{}`", reply.instance_id));
        }
        Ok((id, client, reply.acked_without_you))
    }

    /// Asks `client` who it is, signed for instance `to` (empty: nobody).
    async fn identify_as(&self, client: &mut PeerClient<Channel>, to: &str) -> Result<proto::IdentifyReply, String> {
        let mut request = tonic::Request::new(proto::IdentifyRequest { asker: self.instance.to_string() });
        request.set_timeout(self.timeout());
        sign_request(&mut request, &self.secret, "identify", to);
        Ok(client.identify(request).await.map_err(|status| status.message().to_owned())?.into_inner())
    }

    fn channel(&self, address: &str) -> Result<Channel, String> {
        let mut channels = self.channels.lock();
        if let Some(channel) = channels.get(address) {
            return Ok(channel.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| format!("`{address}` is not an address: {e}"))?
            .connect_timeout(self.timeout())
            .tcp_nodelay(true);
        // The connect timeout covers the TLS handshake too.
        let channel = match &self.tls {
            Some(tls) => endpoint.connect_with_connector_lazy(tls.connector()),
            None => endpoint.connect_lazy(),
        };
        channels.insert(address.to_owned(), channel.clone());
        Ok(channel)
    }

    /// The peer link of instance `owner`; looked up again once when it is not known (at most once a second).
    async fn client_of(&self, owner: &str) -> Option<PeerClient<Channel>> {
        if let Some(client) = self.peers.lock().get(owner) {
            return Some(client.clone());
        }
        let stale = self.looked_up.lock().await.is_none_or(|at| at.elapsed() >= LOOKUP_AGAIN_AFTER);
        if stale {
            self.look_up().await;
        }
        self.peers.lock().get(owner).cloned()
    }

    async fn forward(
        &self,
        owner: &str,
        caller: &Caller,
        settlement: Settlement<'_>,
        action: &Settle,
    ) -> Result<Settled, GatewayError> {
        let label = wire::action_label(action);
        let unreachable = |why: String| {
            counter!(m::TIER_FORWARDED, "action" => label, "result" => "unreachable").increment(1);
            tracing::warn!(owner, delivery = settlement.target.id, %why, "A settlement could not be asked of the instance that handed the delivery out.");
            GatewayError::Unavailable(format!(
                "the delivery was handed out by instance `{owner}`, which cannot be reached now ({why}); try again"
            ))
        };
        let Some(mut client) = self.client_of(owner).await else {
            return Err(unreachable("it is not among the tier's peers".to_owned()));
        };
        let mut request = tonic::Request::new(wire::settle_request(caller, settlement, action));
        request.set_timeout(self.timeout());
        sign_request(&mut request, &self.secret, "settle", owner);
        let reply = client.settle(request).await.map_err(|status| unreachable(status.message().to_owned()))?;
        let outcome = wire::outcome_of(reply.into_inner(), settlement.target.id);
        let result = if outcome.is_ok() { "ok" } else { "refused" };
        counter!(m::TIER_FORWARDED, "action" => label, "result" => result).increment(1);
        outcome
    }
}

impl Tier {
    /// Asks every known peer to end the transaction; the answer of the one that recorded it.
    async fn end_at_peers(&self, caller: &Caller, request: EndRequest<'_>) -> Option<Result<EndOutcome, GatewayError>> {
        let peers: Vec<(String, PeerClient<Channel>)> =
            self.peers.lock().iter().map(|(id, client)| (id.clone(), client.clone())).collect();
        let asked = wire::end_request(caller, request)?;
        if peers.is_empty() {
            return None;
        }
        // Each such end becomes a call to every peer: bounded, so ends of made-up ids cannot multiply into them.
        let Ok(_asking) = self.ends_asked.try_acquire() else {
            counter!(m::REQUESTS_REJECTED, "reason" => "too_many_tier_ends").increment(1);
            return Some(Err(GatewayError::Unavailable(format!(
                "{} transaction ends are being asked of the tier's peers already (tier.max_ends_asked_at_once); try again",
                self.config.max_ends_asked_at_once
            ))));
        };
        let ends = peers.into_iter().map(|(peer, mut client)| {
            let mut call = tonic::Request::new(asked.clone());
            call.set_timeout(self.timeout());
            sign_request(&mut call, &self.secret, "end", &peer);
            async move { client.end(call).await }
        });
        let mut unreachable = 0;
        let mut found = None;
        for answer in futures::future::join_all(ends).await {
            match answer.map(|reply| wire::end_outcome_of(reply.into_inner(), request.id)) {
                Ok(Some(outcome)) => found = Some(outcome),
                Ok(None) => {}
                Err(status) => {
                    unreachable += 1;
                    tracing::warn!(transaction = request.id, error = %status.message(), "A peer could not be asked to end a transaction.");
                }
            }
        }
        let result = match &found {
            Some(Ok(_)) => "ok",
            Some(Err(_)) => "refused",
            None if unreachable > 0 => "unreachable",
            None => return None,
        };
        counter!(m::TIER_FORWARDED, "action" => "end", "result" => result).increment(1);
        found
    }
}

impl Owners for Tier {
    fn elsewhere(&self, id: &str) -> Option<String> {
        instance_of(id).filter(|owner| *owner != self.instance.as_str()).map(str::to_owned)
    }

    fn settle_at<'a>(
        &'a self,
        owner: &'a str,
        caller: &'a Caller,
        settlement: Settlement<'a>,
        action: &'a Settle,
    ) -> BoxFuture<'a, Result<Settled, GatewayError>> {
        Box::pin(self.forward(owner, caller, settlement, action))
    }

    fn end_elsewhere<'a>(
        &'a self,
        caller: &'a Caller,
        request: EndRequest<'a>,
    ) -> BoxFuture<'a, Option<Result<EndOutcome, GatewayError>>> {
        Box::pin(self.end_at_peers(caller, request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_is_elsewhere_when_another_instance_minted_its_id() {
        let config = TierConfig { secret: "tier-secret-0123456789".into(), ..TierConfig::default() };
        let tier = Tier::new(&config, InstanceId::parse("popgate-0").expect("id"), None, None);
        assert_eq!(tier.elsewhere("popgate-1~0a1b"), Some("popgate-1".to_owned()));
        assert_eq!(tier.elsewhere("popgate-0~0a1b"), None, "its own");
        assert_eq!(tier.elsewhere("0a1b2c"), None, "an id of a popgate before tiers");
    }
}
