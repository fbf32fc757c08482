//! The bounds of a subscription's delivery settings: one definition, used both for the defaults in the
//! config file (`popgate check-config`) and for every subscription created over the API, so a default the
//! config accepts is never refused by a subscription.

use std::ops::RangeInclusive;

/// Time a subscriber has to ACK one delivery.
pub const ACK_TIMEOUT_MS: RangeInclusive<u64> = 100..=3_600_000;
/// Attempts in all before the DLQ.
pub const MAX_ATTEMPTS: RangeInclusive<u32> = 1..=100;
/// The first and the largest retry delay.
pub const BACKOFF_MS: RangeInclusive<u64> = 1..=3_600_000;
/// Unacknowledged deliveries in flight to one push subscriber.
pub const PREFETCH: RangeInclusive<usize> = 1..=1024;
/// The longest delay a NACK may ask for before the next attempt: the longest ACK timeout. The broker lease is
/// renewed while the retry waits, so a longer delay would pin the message for as long; and the delay is added
/// to a clock in epoch milliseconds, where an unbounded one overflows.
pub const MAX_NACK_DELAY_MS: u64 = *ACK_TIMEOUT_MS.end();

/// A subscription setting, named as the API and the config file name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// `ackTimeoutMs` / `delivery.ack_timeout_ms`.
    AckTimeout,
    /// `maxAttempts` / `delivery.max_attempts`.
    MaxAttempts,
    /// `initialBackoffMs` / `delivery.initial_backoff_ms`.
    InitialBackoff,
    /// `maxBackoffMs` / `delivery.max_backoff_ms`.
    MaxBackoff,
}

impl Setting {
    /// The field name in API bodies.
    pub fn api_field(self) -> &'static str {
        match self {
            Setting::AckTimeout => "ackTimeoutMs",
            Setting::MaxAttempts => "maxAttempts",
            Setting::InitialBackoff => "initialBackoffMs",
            Setting::MaxBackoff => "maxBackoffMs",
        }
    }

    /// The key of the default in the config file.
    pub fn config_key(self) -> &'static str {
        match self {
            Setting::AckTimeout => "delivery.ack_timeout_ms",
            Setting::MaxAttempts => "delivery.max_attempts",
            Setting::InitialBackoff => "delivery.initial_backoff_ms",
            Setting::MaxBackoff => "delivery.max_backoff_ms",
        }
    }
}

/// Every setting out of bounds, with the reason.
pub fn check(
    ack_timeout_ms: u64,
    max_attempts: u32,
    initial_backoff_ms: u64,
    max_backoff_ms: u64,
) -> Vec<(Setting, String)> {
    let mut out = Vec::new();
    let range = |r: &RangeInclusive<u64>| format!("must be in {}..={}", r.start(), r.end());
    if !ACK_TIMEOUT_MS.contains(&ack_timeout_ms) {
        out.push((Setting::AckTimeout, range(&ACK_TIMEOUT_MS)));
    }
    if !MAX_ATTEMPTS.contains(&max_attempts) {
        out.push((Setting::MaxAttempts, format!("must be in {}..={}", MAX_ATTEMPTS.start(), MAX_ATTEMPTS.end())));
    }
    if !BACKOFF_MS.contains(&initial_backoff_ms) {
        out.push((Setting::InitialBackoff, range(&BACKOFF_MS)));
    }
    if !BACKOFF_MS.contains(&max_backoff_ms) {
        out.push((Setting::MaxBackoff, range(&BACKOFF_MS)));
    } else if max_backoff_ms < initial_backoff_ms {
        out.push((
            Setting::MaxBackoff,
            format!("must be >= {} ({initial_backoff_ms})", Setting::InitialBackoff.api_field()),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_setting_is_checked_against_its_one_range() {
        assert!(check(30_000, 6, 1_000, 16_000).is_empty(), "the seed's defaults are within bounds");
        let settings: Vec<Setting> = check(99, 0, 0, 3_600_001).into_iter().map(|(s, _)| s).collect();
        assert_eq!(
            settings,
            vec![Setting::AckTimeout, Setting::MaxAttempts, Setting::InitialBackoff, Setting::MaxBackoff]
        );
        assert_eq!(check(1_000, 1, 500, 100)[0].0, Setting::MaxBackoff, "max below initial");
    }
}
