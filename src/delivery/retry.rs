//! When a delivery is tried again: exponential backoff with jitter and an attempt budget.
//!
//! Attempt *n* (1-based) that was not ACKed is followed by attempt *n + 1* after
//! `min(initial × 2^(n-1), max)` scaled by a random factor in `1 ± jitter` (seed 000: 1 s, 2 s, 4 s, 8 s, 16 s,
//! ±20 %), until `max_attempts` attempts were made; then the event is dead-lettered. Whether to retry is kept
//! apart from when: [`RetryPolicy::next`] answers both from the attempt number alone.

use std::time::Duration;

use rand::Rng;

use crate::config::DeliveryConfig;

/// The retry schedule of one subscription.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Delay after the first failed attempt.
    pub initial: Duration,
    /// Delays never grow past this.
    pub max: Duration,
    /// Each delay is scaled by a random factor in `1 ± jitter`.
    pub jitter: f64,
    /// Attempts in all, the first included.
    pub max_attempts: u32,
}

/// What follows a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NextStep {
    /// Try again after this delay; the next attempt's number.
    RetryAfter(Duration, u32),
    /// The budget is spent: dead-letter the event.
    DeadLetter,
}

/// Why a policy cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid retry policy: {0}")]
pub struct InvalidRetryPolicy(&'static str);

impl RetryPolicy {
    /// Seed 000's defaults: 1 s doubling to 16 s, ±20 %, 6 attempts in all.
    pub const SEED_DEFAULT: RetryPolicy =
        RetryPolicy { initial: Duration::from_secs(1), max: Duration::from_secs(16), jitter: 0.2, max_attempts: 6 };

    /// A validated policy.
    ///
    /// # Errors
    /// When a delay is zero, `max < initial`, jitter is outside `[0, 1)` or no attempt is allowed.
    pub fn try_new(
        initial: Duration,
        max: Duration,
        jitter: f64,
        max_attempts: u32,
    ) -> Result<Self, InvalidRetryPolicy> {
        if initial.is_zero() {
            return Err(InvalidRetryPolicy("initial backoff must be > 0"));
        }
        if max < initial {
            return Err(InvalidRetryPolicy("max backoff must be >= initial backoff"));
        }
        if !(0.0..1.0).contains(&jitter) {
            return Err(InvalidRetryPolicy("jitter must be in [0, 1)"));
        }
        if max_attempts == 0 {
            return Err(InvalidRetryPolicy("max attempts must be >= 1"));
        }
        Ok(RetryPolicy { initial, max, jitter, max_attempts })
    }

    /// The configured defaults (validated with the rest of the config).
    pub fn from_config(config: &DeliveryConfig) -> Result<Self, InvalidRetryPolicy> {
        Self::try_new(
            Duration::from_millis(config.initial_backoff_ms),
            Duration::from_millis(config.max_backoff_ms),
            config.jitter_ratio,
            config.max_attempts,
        )
    }

    /// The delay before attempt `failed + 1`, without jitter.
    pub fn base_delay(&self, failed: u32) -> Duration {
        let doublings = failed.saturating_sub(1).min(31);
        self.initial.saturating_mul(1u32 << doublings).min(self.max)
    }

    /// The delays between attempts, without jitter (1, 2, 4, 8, 16 s by default): one per retry.
    pub fn schedule(&self) -> Vec<Duration> {
        (1..self.max_attempts).map(|failed| self.base_delay(failed)).collect()
    }

    /// What follows the failure of attempt `failed` (1-based), with a jittered delay from `rng`.
    pub fn next(&self, failed: u32, rng: &mut impl Rng) -> NextStep {
        if failed >= self.max_attempts {
            return NextStep::DeadLetter;
        }
        let factor = if self.jitter > 0.0 { rng.random_range(1.0 - self.jitter..=1.0 + self.jitter) } else { 1.0 };
        NextStep::RetryAfter(self.base_delay(failed).mul_f64(factor), failed + 1)
    }
}

/// Broker work popgate owes (a broker ACK, a DLQ write): retried after 1 s, doubling to 30 s, ±20 %, for as
/// long as it takes. After a broker outage the owed work of many deliveries is then spread out instead of
/// all of it being tried again every second.
pub const OWED_WORK_BACKOFF: RetryPolicy =
    RetryPolicy { initial: Duration::from_secs(1), max: Duration::from_secs(30), jitter: 0.2, max_attempts: u32::MAX };

/// Lease renewals that failed: 1 s doubling to 4 s, ±20 %. Capped low because the lease runs out meanwhile
/// (a renewal starts with half the lease left, 30 s by default): a few tries must fit before it lapses.
pub const RENEWAL_BACKOFF: RetryPolicy =
    RetryPolicy { initial: Duration::from_secs(1), max: Duration::from_secs(4), jitter: 0.2, max_attempts: u32::MAX };

impl RetryPolicy {
    /// The jittered delay after the `failures`-th failure in a row of work that is never abandoned.
    pub fn delay_after(&self, failures: u32, rng: &mut impl Rng) -> Duration {
        match self.next(failures.max(1), rng) {
            NextStep::RetryAfter(delay, _) => delay,
            NextStep::DeadLetter => self.max,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn seed_policy() -> RetryPolicy {
        RetryPolicy::from_config(&DeliveryConfig::default()).expect("defaults are valid")
    }

    #[test]
    fn the_seed_schedule_is_1_2_4_8_16_seconds_then_the_dlq() {
        let policy = seed_policy();
        let delays: Vec<u64> = (1..=5).map(|n| policy.base_delay(n).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16]);
        assert_eq!(policy.base_delay(6), Duration::from_secs(16), "capped");
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(policy.next(6, &mut rng), NextStep::DeadLetter, "6 attempts in all");
        assert!(matches!(policy.next(5, &mut rng), NextStep::RetryAfter(_, 6)));
    }

    #[test]
    fn jitter_stays_within_twenty_percent_and_actually_varies() {
        let policy = seed_policy();
        let mut rng = StdRng::seed_from_u64(42);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            let NextStep::RetryAfter(delay, 4) = policy.next(3, &mut rng) else { panic!("attempt 3 is retried") };
            let ms = delay.as_millis();
            assert!((3200..=4800).contains(&ms), "{ms} ms outside 4 s ± 20 %");
            seen.insert(ms);
        }
        assert!(seen.len() > 100, "jitter spreads the delays");
    }

    #[test]
    fn the_constant_default_is_the_configured_default() {
        assert_eq!(RetryPolicy::SEED_DEFAULT, seed_policy());
    }

    #[test]
    fn invalid_policies_are_refused() {
        let s = Duration::from_secs(1);
        assert!(RetryPolicy::try_new(Duration::ZERO, s, 0.2, 6).is_err());
        assert!(RetryPolicy::try_new(s * 2, s, 0.2, 6).is_err());
        assert!(RetryPolicy::try_new(s, s, 1.0, 6).is_err());
        assert!(RetryPolicy::try_new(s, s, 0.2, 0).is_err());
        assert!(RetryPolicy::try_new(s, s, 0.0, 1).is_ok());
    }

    #[test]
    fn owed_broker_work_backs_off_exponentially_with_jitter_up_to_thirty_seconds() {
        let mut rng = StdRng::seed_from_u64(7);
        for (failures, base_ms) in [(1u32, 1_000u128), (2, 2_000), (3, 4_000), (5, 16_000), (6, 30_000), (1000, 30_000)]
        {
            let ms = OWED_WORK_BACKOFF.delay_after(failures, &mut rng).as_millis();
            assert!((base_ms * 8 / 10..=base_ms * 12 / 10).contains(&ms), "failure {failures}: {ms} ms");
        }
        let ms = RENEWAL_BACKOFF.delay_after(10, &mut rng).as_millis();
        assert!((3_200..=4_800).contains(&ms), "renewals cap at 4 s: {ms} ms");
    }

    #[test]
    fn a_single_attempt_budget_dead_letters_at_once() {
        let policy = RetryPolicy::try_new(Duration::from_secs(1), Duration::from_secs(1), 0.0, 1).expect("valid");
        assert_eq!(policy.next(1, &mut StdRng::seed_from_u64(0)), NextStep::DeadLetter);
    }
}
