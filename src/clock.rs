//! popgate's one clock: every deadline the core keeps (leases, ACK deadlines, retries, transaction expiries)
//! is an [`Epoch`] made here, and the wall clock is read here only.
//!
//! An [`Epoch`] is a point in time as milliseconds since the Unix epoch: the form the stores and the wire
//! already use (it serializes as that plain number, so stored records keep their format), and the form the
//! brokers and the peer link speak. Inside popgate it moves only by a [`Duration`], saturating, so a delay a
//! client chose can never overflow a deadline; [`Epoch::since`] and [`Epoch::until`] give `Duration`s back.
//! Integers of epoch milliseconds appear only where a value crosses the wire or the store
//! ([`Epoch::from_millis`], [`Epoch::as_millis`]).

use std::ops::{Add, Sub};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// A point on popgate's clock, in milliseconds since the Unix epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Epoch(i64);

impl Epoch {
    /// The epoch itself (a record that never had the time set, as older stores wrote `0`).
    pub const ZERO: Epoch = Epoch(0);

    /// Now, on popgate's clock: the wall clock read once, at the first call, then advanced by the monotonic
    /// clock. A wall clock stepped by an operator or NTP moves no deadline popgate keeps; a restart (and the
    /// stored records it reads back) re-anchors to the wall clock.
    pub fn now() -> Epoch {
        static ANCHOR: std::sync::OnceLock<(Instant, i64)> = std::sync::OnceLock::new();
        let (started, wall_at_start) = ANCHOR.get_or_init(|| (Instant::now(), millis_of(wall_clock())));
        Epoch(wall_at_start.saturating_add(millis_i64(elapsed_since(*started))))
    }

    /// A time read from the wire or the store.
    pub const fn from_millis(millis: i64) -> Epoch {
        Epoch(millis)
    }

    /// The time as the wire and the store write it.
    pub const fn as_millis(self) -> i64 {
        self.0
    }

    /// How long after `earlier` this is; zero when it is not after it.
    pub fn since(self, earlier: Epoch) -> Duration {
        Duration::from_millis(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }

    /// How long until `later`; zero when it has passed.
    pub fn until(self, later: Epoch) -> Duration {
        later.since(self)
    }
}

/// `time + delay`, saturating: delays reach the core from clients (a NACK's `delayMs`, a gRPC invisible
/// duration); the fronts bound them, and this keeps a deadline from overflowing should any get past them.
impl Add<Duration> for Epoch {
    type Output = Epoch;
    fn add(self, delay: Duration) -> Epoch {
        Epoch(self.0.saturating_add(millis_i64(delay)))
    }
}

/// `time - span`, saturating.
impl Sub<Duration> for Epoch {
    type Output = Epoch;
    fn sub(self, span: Duration) -> Epoch {
        Epoch(self.0.saturating_sub(millis_i64(span)))
    }
}

impl std::fmt::Display for Epoch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The wall clock, for what must be judged against another machine's wall clock (a signature's timestamp, a
/// protobuf `Timestamp` a client compares with its own): the only place popgate reads it.
pub fn wall_clock() -> SystemTime {
    SystemTime::now()
}

/// Whole seconds since the Unix epoch on the wall clock (signature timestamps).
pub fn wall_clock_secs() -> u64 {
    wall_clock().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn millis_of(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH).map_or(0, millis_i64)
}

fn millis_i64(span: Duration) -> i64 {
    i64::try_from(span.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(not(test))]
fn elapsed_since(started: Instant) -> Duration {
    started.elapsed()
}

/// Unit tests read Tokio's clock, so a test on paused time (`start_paused`, `time::advance`) moves popgate's
/// clock with its timers: deadlines and backoffs are tested without sleeping.
#[cfg(test)]
fn elapsed_since(started: Instant) -> Duration {
    tokio::time::Instant::now().into_std().saturating_duration_since(started)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adding_any_delay_saturates_instead_of_overflowing() {
        let now = Epoch::from_millis(1_700_000_000_000);
        assert_eq!(now + Duration::from_millis(1_500), Epoch::from_millis(1_700_000_001_500));
        for delay in [Duration::MAX, Duration::from_secs(u64::MAX / 1000), Duration::from_millis(i64::MAX as u64)] {
            assert_eq!(now + delay, Epoch::from_millis(i64::MAX), "{delay:?}");
        }
        assert_eq!(Epoch::from_millis(i64::MIN + 1) - Duration::MAX, Epoch::from_millis(i64::MIN));
    }

    #[test]
    fn spans_between_two_times_are_never_negative() {
        let (earlier, later) = (Epoch::from_millis(1_000), Epoch::from_millis(3_500));
        assert_eq!(later.since(earlier), Duration::from_millis(2_500));
        assert_eq!(earlier.since(later), Duration::ZERO);
        assert_eq!(earlier.until(later), Duration::from_millis(2_500));
        assert_eq!(later.until(earlier), Duration::ZERO);
    }

    #[test]
    fn it_is_stored_as_the_plain_number_older_records_hold() {
        let time = Epoch::from_millis(1_796_083_200_000);
        assert_eq!(serde_json::to_string(&time).expect("serializes"), "1796083200000");
        assert_eq!(serde_json::from_str::<Epoch>("1796083200000").expect("reads"), time);
    }

    #[tokio::test(start_paused = true)]
    async fn the_clock_moves_with_paused_test_time_and_not_with_the_wall_clock() {
        let before = Epoch::now();
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(Epoch::now().since(before).as_secs(), 90);
    }
}
