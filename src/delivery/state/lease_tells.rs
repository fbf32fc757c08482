//! Telling the tier's other instances each renewed lease (see `delivery::told_leases`).

use super::*;

impl Deliveries {
    /// Renewed leases are sent to `outbox` from now on (a tier's peer link; never outside a tier).
    pub(in crate::delivery) fn send_renewals_to(&self, outbox: tokio::sync::mpsc::Sender<(String, String)>) {
        *self.renewal_outbox.lock() = Some(outbox);
    }

    /// Hands `record`'s lease, just renewed and stored, to the peer link, sealed; a full queue drops it
    /// (counted): a peer that ACKs without this instance then says it cannot be sure its ACK lands.
    pub(super) fn tell_renewed(&self, record: &DeliveryRecord) {
        let Some(outbox) = self.renewal_outbox.lock().clone() else { return };
        let Some(token) = self.lease_seal.as_ref().and_then(|seal| seal.seal(record)) else { return };
        if outbox.try_send((record.id.to_string(), token)).is_err() {
            counter!(m::TIER_LEASES_TOLD, "way" => "sent", "result" => "dropped").increment(1);
        }
    }
}
