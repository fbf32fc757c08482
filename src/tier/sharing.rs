//! What the tier's instances keep in step over the peer link (issue #48, "a tier that acts as one"):
//! - **Shared subscriptions** (`delivery::shared`): each change made on an instance is sent to every peer at
//!   once (`Share`); at every look-up of its peers an instance sends each one the digest of its whole set and
//!   takes theirs when it differs (`Subscriptions`), so a change a peer missed (down, unreachable, a full queue)
//!   and the whole set, for an instance that starts or joins, arrive within `tier.refresh_secs`. Every change
//!   carries its version and each instance keeps the latest, so the order they arrive in does not matter.
//! - **Renewed leases** (`delivery::told_leases`): each lease an instance renews is sent to every peer at once
//!   (`Leases`), so a peer that ACKs one of its deliveries while it cannot be reached ACKs with the live handle.
//!
//! Both go through bounded queues drained by one task each, in batches: a flood of changes costs one call per
//! peer per batch, and what does not fit is dropped and counted (subscriptions then arrive with the next
//! comparison of digests; a lease not told makes a peer's ACK answer "unconfirmed" once the lease it knows is
//! due for renewal).

use std::sync::{Arc, Weak};

use metrics::counter;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use super::proto::{self as pb, peer_client::PeerClient};
use super::signing::sign_request;
use super::Tier;
use crate::gateway::below::{
    Applied, RenewedLease, SharedChange, SubVersion, Subscription, MAX_QUEUED_CHANGES, MAX_QUEUED_RENEWALS,
};
use crate::gateway::Deliveries;
use crate::metrics as m;

/// Most changes (or leases) sent in one call.
const BATCH: usize = 500;
/// Most changes a peer's whole set may hold (at most 10 000 subscriptions asked for and 10 000 remembered
/// removals, `delivery::shared`): what more a message carries is left.
pub(super) const MAX_SET: usize = 20_000;
/// The largest subscription (its JSON) taken from a peer.
const MAX_SUBSCRIPTION_BYTES: usize = 64 * 1024;
/// The largest message a peer's answer may be (a whole set of subscriptions).
pub(super) const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
/// Most renewed leases waiting to be told; past it, dropped and counted.
const MAX_QUEUED_LEASES: usize = MAX_QUEUED_RENEWALS;

/// A change as the peer link carries it.
pub(super) fn to_wire(change: &SharedChange) -> Option<pb::SharedSubscription> {
    let (group, topic) = change.names();
    let (version, removed, subscription_json) = match change {
        SharedChange::Put(sub) => (sub.version.clone()?, false, serde_json::to_string(sub).ok()?),
        SharedChange::Removed { version, .. } => (version.clone(), true, String::new()),
    };
    Some(pb::SharedSubscription {
        group: group.to_owned(),
        topic: topic.to_owned(),
        version_ms: version.at_ms,
        version_instance: version.instance,
        removed,
        subscription_json,
    })
}

/// The change a peer sent; `None` when it does not read (too large, not a subscription, another key than it
/// names, an implicit one).
pub(super) fn from_wire(wire: pb::SharedSubscription) -> Option<SharedChange> {
    let version = SubVersion { at_ms: wire.version_ms, instance: wire.version_instance };
    if wire.removed {
        return Some(SharedChange::Removed { group: wire.group, topic: wire.topic, version });
    }
    if wire.subscription_json.len() > MAX_SUBSCRIPTION_BYTES {
        return None;
    }
    let mut sub: Subscription = serde_json::from_str(&wire.subscription_json).ok()?;
    if sub.group != wire.group || sub.topic != wire.topic || sub.implicit {
        return None;
    }
    sub.version = Some(version);
    Some(SharedChange::Put(sub))
}

/// Applies what a peer sent (at most [`MAX_SET`] changes), each counted by what became of it.
pub(super) async fn apply_all(deliveries: &Deliveries, changes: Vec<pb::SharedSubscription>) {
    for wire in changes.into_iter().take(MAX_SET) {
        let applied = match from_wire(wire) {
            Some(change) => deliveries.apply_shared(change).await,
            None => Applied::Refused,
        };
        counter!(m::TIER_SUBSCRIPTION_CHANGES, "way" => "received", "result" => applied.label()).increment(1);
    }
}

/// Waits for the next item on `queue`, then takes what else is queued, up to [`BATCH`]; `None` once closed.
async fn next_batch<T>(queue: &mut mpsc::Receiver<T>) -> Option<Vec<T>> {
    let first = queue.recv().await?;
    let mut batch = vec![first];
    while batch.len() < BATCH {
        match queue.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
    Some(batch)
}

impl Tier {
    /// Starts telling the peers this instance's changes of shared subscriptions and its renewed leases, for as
    /// long as the tier lives. Outside a tier (no deliveries) nothing is told.
    pub fn start_telling(self: &Arc<Tier>) {
        let Some(deliveries) = &self.deliveries else { return };
        let (changes, changes_queue) = mpsc::channel(MAX_QUEUED_CHANGES);
        deliveries.send_shared_changes_to(changes);
        tokio::spawn(share_changes(Arc::downgrade(self), changes_queue));
        let (leases, leases_queue) = mpsc::channel(MAX_QUEUED_LEASES);
        deliveries.send_renewals_to(leases);
        tokio::spawn(tell_leases(Arc::downgrade(self), leases_queue));
    }

    /// The known peers and their links.
    fn peer_list(&self) -> Vec<(String, PeerClient<Channel>)> {
        self.peers.lock().iter().map(|(id, client)| (id.clone(), client.clone())).collect()
    }

    /// Asks each of `peers` for its set of shared subscriptions, unless it keeps the same as this instance,
    /// and applies what is later than what this one has.
    pub(super) async fn sync_subscriptions(&self, peers: &[(String, PeerClient<Channel>)]) {
        let Some(deliveries) = &self.deliveries else { return };
        for (peer, client) in peers {
            let mut request = tonic::Request::new(pb::SubscriptionsRequest { digest: deliveries.shared_digest() });
            request.set_timeout(self.timeout());
            sign_request(&mut request, &self.secret, "subscriptions", peer);
            let mut client = client.clone().max_decoding_message_size(MAX_MESSAGE_BYTES);
            match client.subscriptions(request).await {
                Ok(reply) => {
                    let reply = reply.into_inner();
                    if !reply.same {
                        tracing::debug!(%peer, changes = reply.changes.len(), "Taking a peer's shared subscriptions.");
                        apply_all(deliveries, reply.changes).await;
                    }
                }
                Err(status) => {
                    tracing::debug!(%peer, error = %status.message(), "A peer's shared subscriptions could not be asked for.");
                }
            }
        }
    }
}

/// Sends each batch of local subscription changes to every known peer.
async fn share_changes(tier: Weak<Tier>, mut queue: mpsc::Receiver<SharedChange>) {
    while let Some(batch) = next_batch(&mut queue).await {
        let Some(tier) = tier.upgrade() else { return };
        let changes: Vec<pb::SharedSubscription> = batch.iter().filter_map(to_wire).collect();
        let sends = tier.peer_list().into_iter().map(|(peer, mut client)| {
            let mut request = tonic::Request::new(pb::ShareRequest { changes: changes.clone() });
            request.set_timeout(tier.timeout());
            sign_request(&mut request, &tier.secret, "share", &peer);
            async move { (peer, client.share(request).await) }
        });
        for (peer, sent) in futures::future::join_all(sends).await {
            let result = match sent {
                Ok(_) => "ok",
                Err(status) => {
                    tracing::warn!(%peer, error = %status.message(), "A subscription change could not be told to a peer; it gets it at its next look-up.");
                    "unreachable"
                }
            };
            counter!(m::TIER_SUBSCRIPTION_CHANGES, "way" => "sent", "result" => result).increment(changes.len() as u64);
        }
    }
}

/// Sends each batch of renewed leases to every known peer.
async fn tell_leases(tier: Weak<Tier>, mut queue: mpsc::Receiver<RenewedLease>) {
    while let Some(batch) = next_batch(&mut queue).await {
        let Some(tier) = tier.upgrade() else { return };
        let leases: Vec<pb::RenewedLease> =
            batch.into_iter().map(|(delivery_id, lease)| pb::RenewedLease { delivery_id, lease }).collect();
        let sends = tier.peer_list().into_iter().map(|(peer, mut client)| {
            let mut request = tonic::Request::new(pb::LeasesRequest { leases: leases.clone() });
            request.set_timeout(tier.timeout());
            sign_request(&mut request, &tier.secret, "leases", &peer);
            async move { (peer, client.leases(request).await) }
        });
        for (peer, sent) in futures::future::join_all(sends).await {
            let result = match sent {
                Ok(_) => "ok",
                Err(status) => {
                    tracing::debug!(%peer, error = %status.message(), "Renewed leases could not be told to a peer.");
                    "unreachable"
                }
            };
            counter!(m::TIER_LEASES_TOLD, "way" => "sent", "result" => result).increment(leases.len() as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub() -> Subscription {
        Subscription {
            group: "g".into(),
            topic: "t".into(),
            filter: "a || b".into(),
            filter_type: Default::default(),
            ack_timeout_ms: 5_000,
            max_attempts: 2,
            initial_backoff_ms: 1_000,
            max_backoff_ms: 2_000,
            ordered: false,
            push: None,
            implicit: false,
            version: Some(SubVersion { at_ms: 7, instance: "popgate-1".into() }),
        }
    }

    #[test]
    fn a_change_reads_back_as_it_was_sent() {
        let put = SharedChange::Put(sub());
        assert_eq!(from_wire(to_wire(&put).expect("sent")), Some(put));
        let removed = SharedChange::Removed {
            group: "g".into(),
            topic: "t".into(),
            version: SubVersion { at_ms: 9, instance: "popgate-0".into() },
        };
        assert_eq!(from_wire(to_wire(&removed).expect("sent")), Some(removed));
    }

    #[test]
    fn a_subscription_under_another_key_or_implicit_is_not_taken() {
        let mut wire = to_wire(&SharedChange::Put(sub())).expect("sent");
        wire.group = "other".into();
        assert_eq!(from_wire(wire), None);
        let implicit = Subscription { implicit: true, ..sub() };
        let wire = to_wire(&SharedChange::Put(implicit)).expect("sent");
        assert_eq!(from_wire(wire), None);
        let mut wire = to_wire(&SharedChange::Put(sub())).expect("sent");
        wire.subscription_json = "x".repeat(MAX_SUBSCRIPTION_BYTES + 1);
        assert_eq!(from_wire(wire), None);
    }
}
