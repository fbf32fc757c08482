//! The current broker leases of other instances' deliveries, as their owners told them (issue #48, "a
//! settlement answered as done is done").
//!
//! A lease renewal (ChangeInvisibleTime) gives a delivery a new broker handle and kills the old one. The
//! handle a client holds carries the lease *at the hand-out* (`delivery::lease`), so when its owner cannot be
//! reached, the instance the ACK reaches would ACK at the broker with a dead handle: the broker answers
//! SUCCESS, does nothing, and redelivers the message when the renewed lease runs out. So an owner tells its
//! peers each renewed lease (sealed as handles carry theirs), and they keep the latest per delivery here; an
//! ACK made without the owner uses the latest lease it knows ([`Dispatcher::latest_lease`]), and whether that
//! is surely the current one is judged from when the owner would renew it next ([`renewal_due`]).

use std::time::Duration;

use metrics::counter;
use tokio::sync::mpsc;

use super::{Dispatcher, Lease};
use crate::clock::Epoch;
use crate::metrics as m;

/// Most leases kept (one per delivery: an id and a token of a few hundred bytes).
const MAX_TOLD_LEASES: u64 = 100_000;
/// How long a told lease is kept: far past any lease, whose end makes it useless anyway.
const KEEP_FOR: Duration = Duration::from_secs(600);
/// Most renewals waiting for the peer link; past it a renewal is not told (counted), and an ACK made without
/// the owner is answered as unconfirmed once the lease it knows is due for renewal.
pub const MAX_QUEUED_RENEWALS: usize = 10_000;
/// How far two instances' clocks may differ (NTP keeps them within milliseconds): a lease is judged surely
/// current only until this long before its owner would renew it.
pub const CLOCK_MARGIN: Duration = Duration::from_secs(1);

/// A delivery id and its renewed lease, sealed: what an owner tells its peers (a renewal, or a give-back to
/// the broker, whose lease of a second ends the old one).
pub type RenewedLease = (String, String);

/// The leases told by the peers, by delivery id.
pub(super) struct ToldLeases {
    leases: moka::sync::Cache<String, String>,
}

impl ToldLeases {
    pub(super) fn new() -> ToldLeases {
        ToldLeases { leases: moka::sync::Cache::builder().max_capacity(MAX_TOLD_LEASES).time_to_live(KEEP_FOR).build() }
    }
}

/// Whether lease `a` is a later checkpoint of the message than `b`: the broker's `popTime` of each
/// ChangeInvisibleTime is later than the last (one broker, one clock). A tie (an orderly message's change keeps
/// its `popTime`) is not later: the lease told last stands.
fn newer(a: &Lease, b: &Lease) -> bool {
    a.handle.pop_time_ms > b.handle.pop_time_ms
}

/// When the owner renews `lease` (on its clock): once less than half of it is left, as its sweeper
/// does ([`ReceiptHandle::half_lease`]). Before that the handle it carries is the broker's current one,
/// whatever happened to the owner.
pub fn renewal_due(lease: &Lease) -> Epoch {
    lease.handle.lease_deadline() - lease.handle.half_lease()
}

impl Dispatcher {
    /// Keeps `token`, the renewed lease another instance told for its delivery `id`, when the tier sealed it
    /// for that delivery and it is later than the one kept. Returns whether it was kept.
    pub fn learn_lease(&self, id: &str, token: String) -> bool {
        let Some(told) = self.deliveries.open_lease(id, &token) else {
            counter!(m::TIER_LEASES_TOLD, "way" => "received", "result" => "refused").increment(1);
            return false;
        };
        let kept_later = self
            .told_leases
            .leases
            .get(id)
            .and_then(|kept| self.deliveries.open_lease(id, &kept))
            .is_some_and(|kept| newer(&kept, &told));
        if !kept_later {
            self.told_leases.leases.insert(id.to_owned(), token);
        }
        counter!(m::TIER_LEASES_TOLD, "way" => "received", "result" => "kept").increment(1);
        true
    }

    /// The latest lease of delivery `id` this instance knows: the one its owner told last, or `sealed` (the one
    /// the client's handle carries) when that is the newer checkpoint.
    pub fn latest_lease(&self, id: &str, sealed: Option<Lease>) -> Option<Lease> {
        let told = self.told_leases.leases.get(id).and_then(|token| self.deliveries.open_lease(id, &token));
        match (told, sealed) {
            (Some(told), Some(sealed)) if newer(&sealed, &told) => Some(sealed),
            (Some(told), _) => Some(told),
            (None, sealed) => sealed,
        }
    }

    /// Renewed leases of this instance's deliveries are sent to `outbox` (the peer link's sender) from now on.
    pub fn send_renewals_to(&self, outbox: mpsc::Sender<RenewedLease>) {
        self.deliveries.send_renewals_to(outbox);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::test_support::popped;

    fn lease(pop_time_ms: i64, lease_until_ms: i64) -> Lease {
        let mut handle = popped("m-1", b"body", 0).handle;
        (handle.pop_time_ms, handle.invisible_ms) = (pop_time_ms, 16_000);
        handle.lease_until_ms = Epoch::from_millis(lease_until_ms);
        Lease { group: "g".into(), topic: "t".into(), handle }
    }

    #[test]
    fn a_renewed_lease_is_surely_current_until_half_of_it_is_left() {
        assert_eq!(renewal_due(&lease(1_000, 17_000)), Epoch::from_millis(9_000), "renewed with 8 s of 16 s left");
    }

    #[test]
    fn the_later_checkpoint_wins_and_a_tie_keeps_the_one_told_last() {
        let (handed_out, renewed, given_back) = (lease(1_000, 17_000), lease(9_000, 25_000), lease(10_000, 11_000));
        assert!(newer(&renewed, &handed_out) && !newer(&handed_out, &renewed));
        assert!(newer(&given_back, &renewed), "a give-back's short lease is the latest, though it ends sooner");
        assert!(!newer(&lease(9_000, 40_000), &renewed), "an orderly message's change keeps its popTime");
    }
}
