//! What the tier's peer link keeps in step between instances, through the gateway's handle of the delivery
//! core: the shared subscriptions (`delivery::shared`) and the renewed leases of held deliveries
//! (`delivery::told_leases`). Peers are instances of the same tier (their requests signed with its secret), so
//! no caller's rights are checked here: a subscription was checked where it was made.

use tokio::sync::mpsc;

use super::below::{Applied, RenewedLease, SharedChange};
use super::Deliveries;

impl Deliveries {
    /// Changes of shared subscriptions made on this instance go to `outbox` from now on.
    pub fn send_shared_changes_to(&self, outbox: mpsc::Sender<SharedChange>) {
        self.dispatcher.send_shared_changes_to(outbox);
    }

    /// Every shared subscription and remembered removal, with its version.
    pub fn shared_set(&self) -> Vec<SharedChange> {
        self.dispatcher.shared_set()
    }

    /// A digest of [`Deliveries::shared_set`]: equal on two instances that keep the same versions.
    pub fn shared_digest(&self) -> Vec<u8> {
        self.dispatcher.shared_digest()
    }

    /// Applies a change another instance made, when it is later than what this one has.
    pub async fn apply_shared(&self, change: SharedChange) -> Applied {
        self.dispatcher.apply_shared(change).await
    }

    /// Renewed leases of this instance's deliveries go to `outbox` from now on.
    pub fn send_renewals_to(&self, outbox: mpsc::Sender<RenewedLease>) {
        self.dispatcher.send_renewals_to(outbox);
    }

    /// Keeps the renewed lease another instance told for its delivery `id` (when the tier sealed it).
    pub fn learn_lease(&self, id: &str, token: String) -> bool {
        self.dispatcher.learn_lease(id, token)
    }
}
