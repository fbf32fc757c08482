//! The latency fault-avoidance table: popgate's own copy of RocketMQ's `MQFaultStrategy`.
//!
//! After every send the broker's latency is looked up in `latency_max_ms`; the matching entry of
//! `not_available_ms` is how long the broker is *isolated* (skipped while any other broker can take the message).
//! A network error, timeout or retriable broker error isolates it for `network_error_isolation_ms`.
//! popgate owns this policy, whatever the client crate does inside, so it is observable (`/metrics`,
//! `popgate_broker_isolated{broker}`) and configurable.
//!
//! The table is pure logic over an explicit `now`, so its boundaries are unit-tested without sleeping.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::config::FaultAvoidanceConfig;

/// Why a broker was isolated; a low-cardinality metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsolationCause {
    /// A send answered, but slower than a latency step with a non-zero isolation.
    Latency,
    /// The broker could not be reached, did not answer in time, or answered with a retriable error.
    Unreachable,
}

impl IsolationCause {
    /// The `cause` label value.
    pub fn as_label(self) -> &'static str {
        match self {
            IsolationCause::Latency => "latency",
            IsolationCause::Unreachable => "unreachable",
        }
    }
}

/// What one broker's entry in the table says.
#[derive(Debug, Clone, PartialEq)]
pub struct BrokerFault {
    /// Latency of the last send (or the timeout, for a failed one).
    pub last_latency: Duration,
    /// The broker is skipped until this instant.
    pub isolated_until: Instant,
    /// The last failure, if the last send failed.
    pub last_error: Option<String>,
}

/// Latency steps and isolation periods, mirroring MQFaultStrategy, keyed by broker name.
#[derive(Debug)]
pub struct FaultTable {
    enabled: bool,
    latency_max: Vec<Duration>,
    not_available: Vec<Duration>,
    network_error_isolation: Duration,
    brokers: HashMap<String, BrokerFault>,
}

impl FaultTable {
    /// A table with the configured steps (validated by [`crate::config::Config::validate`]).
    pub fn new(config: &FaultAvoidanceConfig) -> FaultTable {
        FaultTable {
            enabled: config.enabled,
            latency_max: config.latency_max_ms.iter().map(|ms| Duration::from_millis(*ms)).collect(),
            not_available: config.not_available_ms.iter().map(|ms| Duration::from_millis(*ms)).collect(),
            network_error_isolation: Duration::from_millis(config.network_error_isolation_ms),
            brokers: HashMap::new(),
        }
    }

    /// How long a send of this latency isolates its broker: the entry of the largest step it reaches.
    pub fn isolation_for_latency(&self, latency: Duration) -> Duration {
        self.latency_max
            .iter()
            .zip(&self.not_available)
            .rev()
            .find(|(step, _)| latency >= **step)
            .map(|(_, period)| *period)
            .unwrap_or(Duration::ZERO)
    }

    /// Records a send that the broker answered, after `latency`. Returns the isolation it caused, if any.
    pub fn record_success(&mut self, broker: &str, latency: Duration, now: Instant) -> Option<Duration> {
        let isolation = self.isolation_for_latency(latency);
        self.brokers.insert(
            broker.to_owned(),
            BrokerFault { last_latency: latency, isolated_until: now + isolation, last_error: None },
        );
        (self.enabled && !isolation.is_zero()).then_some(isolation)
    }

    /// Records a send that failed for a reason that says the broker is unhealthy. Returns the isolation.
    pub fn record_failure(&mut self, broker: &str, latency: Duration, error: &str, now: Instant) -> Option<Duration> {
        let isolation = self.network_error_isolation;
        self.brokers.insert(
            broker.to_owned(),
            BrokerFault { last_latency: latency, isolated_until: now + isolation, last_error: Some(error.to_owned()) },
        );
        (self.enabled && !isolation.is_zero()).then_some(isolation)
    }

    /// Whether `broker` may be chosen now. Always true when fault avoidance is off.
    pub fn is_available(&self, broker: &str, now: Instant) -> bool {
        !self.enabled || self.brokers.get(broker).is_none_or(|fault| now >= fault.isolated_until)
    }

    /// The table's entry for `broker`, if it was ever used.
    pub fn fault(&self, broker: &str) -> Option<&BrokerFault> {
        self.brokers.get(broker)
    }

    /// Every broker the table knows, with its entry.
    pub fn entries(&self) -> impl Iterator<Item = (&String, &BrokerFault)> {
        self.brokers.iter()
    }
}

/// Picks the broker for one attempt from `candidates` (broker names, in round-robin order starting at the
/// caller's index).
///
/// Preference, first match wins:
/// 1. available and not the broker that just failed;
/// 2. not the broker that just failed (each retry goes to another broker, even an isolated one);
/// 3. available;
/// 4. anything (a lone broker is still tried).
pub fn choose_broker<'a>(
    candidates: &'a [String],
    last_failed: Option<&str>,
    is_available: impl Fn(&str) -> bool,
) -> Option<&'a str> {
    let not_last = |name: &&String| Some(name.as_str()) != last_failed;
    candidates
        .iter()
        .find(|name| not_last(name) && is_available(name))
        .or_else(|| candidates.iter().find(not_last))
        .or_else(|| candidates.iter().find(|name| is_available(name)))
        .or_else(|| candidates.first())
        .map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> FaultTable {
        FaultTable::new(&FaultAvoidanceConfig::default())
    }

    #[test]
    fn each_latency_step_maps_to_its_isolation_at_the_boundaries() {
        let t = table();
        let cases = [
            (0, 0),
            (49, 0),
            (50, 0),
            (99, 0),
            (100, 0),
            (549, 0),
            (550, 30_000),
            (999, 30_000),
            (1_000, 60_000),
            (1_999, 60_000),
            (2_000, 120_000),
            (2_999, 120_000),
            (3_000, 180_000),
            (14_999, 180_000),
            (15_000, 600_000),
            (60_000, 600_000),
        ];
        for (latency_ms, isolation_ms) in cases {
            assert_eq!(
                t.isolation_for_latency(Duration::from_millis(latency_ms)),
                Duration::from_millis(isolation_ms),
                "latency {latency_ms} ms"
            );
        }
    }

    #[test]
    fn a_slow_send_isolates_the_broker_until_the_period_ends() {
        let mut t = table();
        let now = Instant::now();
        assert_eq!(t.record_success("a", Duration::from_millis(2_000), now), Some(Duration::from_secs(120)));
        assert!(!t.is_available("a", now + Duration::from_secs(119)));
        assert!(t.is_available("a", now + Duration::from_secs(120)));
        assert!(t.is_available("b", now), "an unknown broker is available");
    }

    #[test]
    fn a_network_error_isolates_for_ten_minutes() {
        let mut t = table();
        let now = Instant::now();
        assert_eq!(t.record_failure("a", Duration::from_secs(3), "timeout", now), Some(Duration::from_secs(600)));
        assert!(!t.is_available("a", now + Duration::from_secs(599)));
        assert!(t.is_available("a", now + Duration::from_secs(600)));
        assert_eq!(t.fault("a").and_then(|f| f.last_error.clone()).as_deref(), Some("timeout"));
    }

    #[test]
    fn a_fast_send_clears_an_isolation() {
        let mut t = table();
        let now = Instant::now();
        t.record_failure("a", Duration::from_secs(3), "timeout", now);
        assert_eq!(t.record_success("a", Duration::from_millis(10), now), None);
        assert!(t.is_available("a", now));
    }

    #[test]
    fn disabled_table_never_isolates() {
        let config = FaultAvoidanceConfig { enabled: false, ..FaultAvoidanceConfig::default() };
        let mut t = FaultTable::new(&config);
        let now = Instant::now();
        assert_eq!(t.record_failure("a", Duration::from_secs(3), "timeout", now), None);
        assert!(t.is_available("a", now));
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_retry_goes_to_another_broker_than_the_one_that_failed() {
        let brokers = names(&["a", "b"]);
        assert_eq!(choose_broker(&brokers, Some("a"), |_| true), Some("b"));
        assert_eq!(choose_broker(&brokers, Some("b"), |_| true), Some("a"));
    }

    #[test]
    fn isolated_brokers_are_skipped_while_another_is_available() {
        let brokers = names(&["a", "b", "c"]);
        assert_eq!(choose_broker(&brokers, None, |n| n != "a"), Some("b"));
        assert_eq!(choose_broker(&brokers, Some("b"), |n| n != "a"), Some("c"));
    }

    #[test]
    fn another_broker_is_preferred_even_when_isolated_over_the_one_that_just_failed() {
        let brokers = names(&["a", "b"]);
        assert_eq!(choose_broker(&brokers, Some("a"), |n| n != "b"), Some("b"));
    }

    #[test]
    fn a_lone_broker_is_still_tried() {
        let brokers = names(&["a"]);
        assert_eq!(choose_broker(&brokers, Some("a"), |_| false), Some("a"));
        assert_eq!(choose_broker(&[], None, |_| true), None);
    }
}
