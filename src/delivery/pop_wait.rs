//! How long a POP waits at the broker (issue #49): long enough that an idle instance's empty POPs stay near a
//! planned rate, however many subscriptions it serves.
//!
//! Each subscription with a waiting consumer keeps one POP waiting at each broker of its topic. A POP that
//! finds nothing ends after its wait and starts again, so `waiting` POPs that wait `W` each cost
//! `waiting / W` empty POP rounds a second, each a broker request and an answer for popgate and the broker
//! alike. With a fixed 5 s wait, 10 000 subscriptions made 2 000 a second and kept 88 % of popgate's core busy
//! with nothing to deliver. A message ends a POP as it arrives (the broker wakes its held POPs), so a longer
//! wait does not delay a message; the wait follows the POPs waiting instead:
//!
//! ```text
//! wait = clamp(waiting / pop_polls_per_sec, pop_poll_ms, 60 s)
//! ```
//!
//! Up to `pop_polls_per_sec × pop_poll_ms / 1000` POPs waiting (1 000 by default) every POP waits
//! `pop_poll_ms`, as before. What a longer wait costs: a topic's route is looked at again only between POPs, so
//! a broker added to a topic is popped up to one wait later.

use std::time::Duration;

use crate::config::DeliveryConfig;

/// The longest a POP waits, however many are waiting.
const LONGEST_WAIT: Duration = Duration::from_secs(60);

/// How long to wait, given how many POPs wait.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PopWaitPlan {
    shortest: Duration,
    longest: Duration,
    polls_per_sec: f64,
}

impl PopWaitPlan {
    /// The plan of a validated `[delivery]` section (`pop_poll_ms` > 0, a rate of at least 1).
    pub(crate) fn new(config: &DeliveryConfig) -> PopWaitPlan {
        let shortest = Duration::from_millis(config.pop_poll_ms);
        PopWaitPlan {
            shortest,
            longest: LONGEST_WAIT.max(shortest),
            polls_per_sec: f64::from(config.pop_polls_per_sec.max(1)),
        }
    }

    /// The wait of a POP made while `waiting` POPs (this one among them) wait.
    pub(crate) fn wait(&self, waiting: usize) -> Duration {
        let wanted = Duration::try_from_secs_f64(waiting as f64 / self.polls_per_sec).unwrap_or(self.longest);
        wanted.clamp(self.shortest, self.longest)
    }

    /// [`PopWaitPlan::wait`] in whole milliseconds, as the POP request carries it.
    pub(crate) fn wait_ms(&self, waiting: usize) -> u64 {
        u64::try_from(self.wait(waiting).as_millis()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(pop_poll_ms: u64, pop_polls_per_sec: u32) -> PopWaitPlan {
        PopWaitPlan::new(&DeliveryConfig { pop_poll_ms, pop_polls_per_sec, ..Default::default() })
    }

    #[test]
    fn few_waiting_wait_the_configured_time() {
        let plan = plan(5_000, 200);
        assert_eq!(plan.wait_ms(1), 5_000);
        assert_eq!(plan.wait_ms(1_000), 5_000, "1 000 waiting 5 s each are 200 a second");
    }

    #[test]
    fn more_waiting_wait_longer_and_keep_the_planned_rate() {
        let plan = plan(5_000, 200);
        assert_eq!(plan.wait_ms(4_000), 20_000);
        let waiting = 10_000;
        let polls_per_sec = waiting as f64 / plan.wait(waiting).as_secs_f64();
        assert!((polls_per_sec - 200.0).abs() < 1e-6, "{polls_per_sec}");
    }

    #[test]
    fn the_wait_never_passes_a_minute_nor_falls_below_the_configured_time() {
        assert_eq!(plan(5_000, 200).wait_ms(100_000), 60_000);
        assert_eq!(plan(5_000, 200).wait_ms(usize::MAX), 60_000);
        assert_eq!(plan(90_000, 200).wait_ms(usize::MAX), 90_000, "a configured wait past a minute is kept");
        assert_eq!(plan(5_000, 1).wait_ms(0), 5_000);
    }
}
