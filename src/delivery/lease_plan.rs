//! How long a broker lease popgate asks for (issue #49): long enough that renewing every held delivery stays
//! within a planned rate of broker requests, and no longer.
//!
//! The broker has no batch ChangeInvisibleTime: each held delivery costs one renewal request per half lease.
//! `held` deliveries on a lease `L` cost `held / (L / 2)` renewals a second, so a fixed 60 s lease needs
//! 33 000 a second for a million held, which neither the broker nor popgate carries. The subscriber's own
//! deadline (its ACK timeout, NACK delays, retries) is popgate's and needs no broker lease of the same length,
//! so the lease follows what popgate holds instead:
//!
//! ```text
//! lease = clamp(2 × held / lease_renewals_per_sec, lease_ms, max_lease_ms)
//! ```
//!
//! With few deliveries held (every instance below `lease_renewals_per_sec × lease_ms / 2`, 30 000 by default)
//! every lease is `lease_ms` (60 s), so an instance lost for good gives its deliveries back through the broker
//! within a minute, as before. Holding more, each new lease (a POP or a renewal) is longer, so the renewals of
//! everything held stay at about `lease_renewals_per_sec`, up to `max_lease_ms`. The cost is the bound on a lost
//! instance: its deliveries come back when their lease runs out, up to `max_lease_ms` for one that held a lot.

use std::time::Duration;

use crate::config::DeliveryConfig;

/// The lease to ask for, given how much this instance holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LeasePlan {
    shortest: Duration,
    longest: Duration,
    renewals_per_sec: f64,
}

impl LeasePlan {
    /// The plan of a validated `[delivery]` section (`lease_ms` ≤ `max_lease_ms`, a rate of at least 1).
    pub(crate) fn new(config: &DeliveryConfig) -> LeasePlan {
        let shortest = Duration::from_millis(config.lease_ms);
        LeasePlan {
            shortest,
            longest: Duration::from_millis(config.max_lease_ms).max(shortest),
            renewals_per_sec: f64::from(config.lease_renewals_per_sec.max(1)),
        }
    }

    /// The lease for a POP or a renewal made while `held` deliveries are held.
    pub(crate) fn lease(&self, held: usize) -> Duration {
        // Each held delivery is renewed once per half lease: held / (lease / 2) renewals a second.
        let wanted = Duration::try_from_secs_f64(2.0 * held as f64 / self.renewals_per_sec).unwrap_or(self.longest);
        wanted.clamp(self.shortest, self.longest)
    }

    /// [`LeasePlan::lease`] in whole milliseconds, as the broker's requests carry it.
    pub(crate) fn lease_ms(&self, held: usize) -> u64 {
        u64::try_from(self.lease(held).as_millis()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(lease_ms: u64, max_lease_ms: u64, lease_renewals_per_sec: u32) -> LeasePlan {
        LeasePlan::new(&DeliveryConfig { lease_ms, max_lease_ms, lease_renewals_per_sec, ..Default::default() })
    }

    #[test]
    fn few_held_get_the_shortest_lease() {
        let plan = plan(60_000, 3_600_000, 1_000);
        assert_eq!(plan.lease_ms(0), 60_000);
        assert_eq!(plan.lease_ms(30_000), 60_000, "30 000 on 60 s leases are 1 000 renewals a second");
    }

    #[test]
    fn more_held_get_a_lease_that_keeps_renewals_at_the_planned_rate() {
        let plan = plan(60_000, 3_600_000, 1_000);
        assert_eq!(plan.lease_ms(100_000), 200_000);
        let held = 1_000_000;
        let lease = plan.lease(held);
        assert_eq!(lease, Duration::from_secs(2_000));
        let renewals_per_sec = held as f64 / (lease.as_secs_f64() / 2.0);
        assert!((renewals_per_sec - 1_000.0).abs() < 1e-6, "{renewals_per_sec}");
    }

    #[test]
    fn the_lease_never_passes_the_longest() {
        let plan = plan(60_000, 600_000, 1_000);
        assert_eq!(plan.lease_ms(1_000_000), 600_000);
        assert_eq!(plan.lease_ms(usize::MAX), 600_000);
    }

    #[test]
    fn a_longest_below_the_shortest_is_the_shortest() {
        // Validation refuses it; the plan still never asks for less than lease_ms.
        assert_eq!(plan(60_000, 1_000, 1_000).lease_ms(1_000_000), 60_000);
    }
}
