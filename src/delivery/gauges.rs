//! The figures operators watch, per subscription, refreshed every `delivery.gauge_refresh_ms` until shutdown:
//!
//! - `popgate_subscription_backlog_messages{group,topic}`: messages at the brokers the group has not popped
//!   yet (see [`crate::broker::stats`] for what the broker counts);
//! - `popgate_subscription_oldest_unacked_age_seconds{group,topic}`: how long ago the oldest delivery popgate
//!   holds unsettled (ready, or handed out and not yet ACKed, NACKed or TERMed) was popped; 0 when none;
//! - `popgate_dlq_depth_messages{group}`: messages in `%DLQ%<group>`; 0 while that topic does not exist.
//!
//! The broker requests of a refresh are paced at `delivery.gauge_requests_per_sec`, so however many
//! subscriptions an instance serves its gauges cost the brokers and popgate at most that many requests a
//! second: with many subscriptions a refresh takes longer than `gauge_refresh_ms`, and the gauges are older.
//!
//! A refresh that cannot ask the brokers is counted (`popgate_stats_refresh_failures_total{op}`) and logged,
//! and that gauge keeps its last value: a dashboard goes on showing the last known figure, and the failure
//! counter (and the log) says it is stale. When a subscription is removed, its series (and its group's DLQ
//! depth, once no subscription of the group is left) are set to 0: popgate stops watching them, and the
//! exporter cannot delete a series.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, gauge};
use tokio::time::Instant;

use super::dlq::dlq_topic;
use super::record::Subscription;
use super::state::Deliveries;
use crate::broker::BrokerError;
use crate::clock::Epoch;
use crate::metrics as m;

/// How often a pause between refreshes looks for shutdown, so the loop ends well within the dispatcher's wait.
const SHUTDOWN_CHECK: Duration = Duration::from_millis(200);

/// Runs until shutdown: a refresh at once, then one every `delivery.gauge_refresh_ms`.
pub(super) async fn run(deliveries: Arc<Deliveries>) {
    let period = Duration::from_millis(deliveries.config().gauge_refresh_ms);
    let mut watched = Watched::default();
    let mut pace = broker_request_pace(deliveries.config().gauge_requests_per_sec);
    while !deliveries.is_shutting_down() {
        let started = Instant::now();
        refresh(&deliveries, &mut watched, &mut pace).await;
        pause_until(&deliveries, started + period).await;
    }
}

/// What the last refresh exported and which of its broker figures are failing, to zero what is gone and to
/// log a failure once when it starts rather than at every refresh.
#[derive(Default)]
struct Watched {
    /// (group, topic) of every subscription exported.
    subscriptions: BTreeSet<(String, String)>,
    /// Every group exported.
    groups: BTreeSet<String>,
    /// `op` and series of each figure whose last refresh failed.
    failed_before: BTreeSet<(&'static str, String)>,
    /// Likewise for the refresh under way.
    failing: BTreeSet<(&'static str, String)>,
}

/// One tick per broker request, `per_sec` a second. A tick missed (a slow request) is not made up for with a
/// burst: the next one follows a full interval later.
fn broker_request_pace(per_sec: u32) -> tokio::time::Interval {
    let mut pace = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(per_sec.max(1))));
    pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    pace
}

async fn refresh(deliveries: &Deliveries, watched: &mut Watched, pace: &mut tokio::time::Interval) {
    let subscriptions: BTreeSet<(String, String)> =
        deliveries.subscriptions().into_iter().map(|s| (s.group, s.topic)).collect();
    export_ages(deliveries, &subscriptions);
    for (group, topic) in &subscriptions {
        if deliveries.is_shutting_down() {
            return;
        }
        pace.tick().await;
        let backlog = deliveries.broker().consumer_backlog(group, topic).await;
        if let Some(messages) = watched.outcome("backlog", &format!("{group}/{topic}"), backlog) {
            gauge!(m::SUBSCRIPTION_BACKLOG, "group" => group.clone(), "topic" => topic.clone()).set(messages as f64);
        }
    }
    let groups: BTreeSet<String> = subscriptions.iter().map(|(group, _)| group.clone()).collect();
    for group in &groups {
        if deliveries.is_shutting_down() {
            return;
        }
        pace.tick().await;
        let depth = deliveries.broker().topic_depth(&dlq_topic(group)).await;
        if let Some(messages) = watched.outcome("dlq_depth", group, depth) {
            gauge!(m::DLQ_DEPTH, "group" => group.clone()).set(messages as f64);
        }
    }
    watched.finish(subscriptions, groups);
}

/// Sets each subscription's oldest-unacknowledged age from the in-flight table (0 when it holds nothing).
fn export_ages(deliveries: &Deliveries, subscriptions: &BTreeSet<(String, String)>) {
    let oldest = deliveries.oldest_unsettled();
    let now = Epoch::now();
    for (group, topic) in subscriptions {
        let popped = oldest.get(&Subscription::key_of(group, topic)).copied().unwrap_or(now);
        let age_secs = now.since(popped).as_secs_f64();
        gauge!(m::OLDEST_UNACKED_AGE, "group" => group.clone(), "topic" => topic.clone()).set(age_secs);
    }
}

impl Watched {
    /// The figure when the brokers answered; else counts and logs the failure and gives `None`, so the gauge
    /// keeps its last value.
    fn outcome(&mut self, op: &'static str, series: &str, result: Result<u64, BrokerError>) -> Option<u64> {
        let key = (op, series.to_owned());
        let failed_before = self.failed_before.contains(&key);
        match result {
            Ok(messages) => {
                if failed_before {
                    tracing::info!(op, series, "Gauge refresh works again.");
                }
                Some(messages)
            }
            Err(error) => {
                counter!(m::STATS_REFRESH_FAILURES, "op" => op).increment(1);
                if failed_before {
                    tracing::debug!(op, series, %error, "Gauge refresh failed again.");
                } else {
                    tracing::warn!(op, series, %error, "Gauge refresh failed; the gauge keeps its last value.");
                }
                self.failing.insert(key);
                None
            }
        }
    }

    /// Ends a refresh: sets to 0 the series of subscriptions and groups gone since the last one.
    fn finish(&mut self, subscriptions: BTreeSet<(String, String)>, groups: BTreeSet<String>) {
        for (group, topic) in self.subscriptions.difference(&subscriptions) {
            gauge!(m::SUBSCRIPTION_BACKLOG, "group" => group.clone(), "topic" => topic.clone()).set(0.0);
            gauge!(m::OLDEST_UNACKED_AGE, "group" => group.clone(), "topic" => topic.clone()).set(0.0);
        }
        for group in self.groups.difference(&groups) {
            gauge!(m::DLQ_DEPTH, "group" => group.clone()).set(0.0);
        }
        self.failed_before = std::mem::take(&mut self.failing);
        self.subscriptions = subscriptions;
        self.groups = groups;
    }
}

/// Waits until `deadline`, or less once shutdown begins.
async fn pause_until(deliveries: &Deliveries, deadline: Instant) {
    while !deliveries.is_shutting_down() && Instant::now() < deadline {
        tokio::time::sleep_until(deadline.min(Instant::now() + SHUTDOWN_CHECK)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::consumer::Popped;
    use crate::delivery::retry::RetryPolicy;
    use crate::delivery::test_support::{offline_parts, subscription};
    use crate::delivery::HandOut;
    use crate::store::StateStore;

    #[tokio::test(start_paused = true)]
    async fn the_refresh_asks_the_brokers_at_most_gauge_requests_per_sec_times_a_second() {
        let mut pace = broker_request_pace(200);
        let started = Instant::now();
        for _ in 0..=200 {
            pace.tick().await;
        }
        // The first request at once, then one every 5 ms: 10 000 subscriptions take 50 s, not a burst.
        assert_eq!(started.elapsed(), Duration::from_secs(1));
    }

    async fn offline(dir: &std::path::Path) -> Arc<Deliveries> {
        let store = Arc::new(StateStore::open(dir, true).expect("open"));
        let (broker, publisher, config) = offline_parts().await;
        Arc::new(Deliveries::new(store, broker, publisher, config))
    }

    /// A message the broker handed out `ago_ms` ago.
    fn popped(id: &str, ago_ms: u64) -> Popped {
        crate::delivery::test_support::popped(id, b"b", ago_ms)
    }

    /// The value of `series` in what `deliveries`' ages render to, through a recorder of the test's own.
    fn rendered_age(deliveries: &Deliveries, subscriptions: &BTreeSet<(String, String)>, series: &str) -> Option<f64> {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || export_ages(deliveries, subscriptions));
        let text = handle.render();
        text.lines().find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
    }

    #[tokio::test]
    async fn the_age_is_the_oldest_unsettled_pop_of_each_subscription_and_0_without_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let deliveries = offline(dir.path()).await;
        let sub = subscription();
        deliveries.put_subscription(sub.clone(), RetryPolicy::SEED_DEFAULT).await.expect("subscribe");
        let key = sub.key();
        let subscriptions: BTreeSet<(String, String)> =
            [("g".to_owned(), "t".to_owned()), ("idle".to_owned(), "t".to_owned())].into();
        let series = "popgate_subscription_oldest_unacked_age_seconds{group=\"g\",topic=\"t\"}";
        let idle = "popgate_subscription_oldest_unacked_age_seconds{group=\"idle\",topic=\"t\"}";
        assert_eq!(rendered_age(&deliveries, &subscriptions, series), Some(0.0), "nothing held");

        deliveries.admit(&key, vec![popped("young", 2_000), popped("old", 7_000)]).await;
        let oldest = deliveries.oldest_unsettled().get(&key).copied().expect("held");
        let age = Epoch::now().since(oldest);
        assert!(age.abs_diff(Duration::from_secs(7)) < Duration::from_secs(1), "the older of the two counts: {age:?}");
        let age = rendered_age(&deliveries, &subscriptions, series).expect("exported");
        assert!((7.0..8.0).contains(&age), "ready deliveries count: {age}");
        assert_eq!(rendered_age(&deliveries, &subscriptions, idle), Some(0.0));

        let handed = deliveries.hand_out(&key, 10, &HandOut::long_poll(), None).await.expect("hand out");
        assert_eq!(handed.len(), 2);
        let age = rendered_age(&deliveries, &subscriptions, series).expect("exported");
        assert!((7.0..8.0).contains(&age), "handed-out, unACKed deliveries count: {age}");
    }

    #[test]
    fn a_failed_figure_is_counted_and_keeps_no_value_and_recovers() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let mut watched = Watched::default();
        let outcomes = metrics::with_local_recorder(&recorder, || {
            let failed = watched.outcome("backlog", "g/t", Err(BrokerError::Timeout(Duration::from_secs(3))));
            watched.finish(BTreeSet::new(), BTreeSet::new());
            let again = watched.outcome("backlog", "g/t", Err(BrokerError::Unreachable("down".into())));
            watched.finish(BTreeSet::new(), BTreeSet::new());
            let recovered = watched.outcome("backlog", "g/t", Ok(4));
            (failed, again, recovered)
        });
        assert_eq!(outcomes, (None, None, Some(4)));
        assert!(watched.failed_before.contains(&("backlog", "g/t".to_owned())), "still failed as of the last finish");
        assert!(handle.render().contains("popgate_stats_refresh_failures_total{op=\"backlog\"} 2"));
    }

    #[test]
    fn a_removed_subscription_and_group_read_0() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let mut watched = Watched::default();
        metrics::with_local_recorder(&recorder, || {
            gauge!(m::SUBSCRIPTION_BACKLOG, "group" => "g", "topic" => "t").set(12.0);
            gauge!(m::DLQ_DEPTH, "group" => "g").set(3.0);
            watched.finish([("g".to_owned(), "t".to_owned())].into(), ["g".to_owned()].into());
            watched.finish(BTreeSet::new(), BTreeSet::new());
        });
        let text = handle.render();
        assert!(text.contains("popgate_subscription_backlog_messages{group=\"g\",topic=\"t\"} 0"), "{text}");
        assert!(text.contains("popgate_dlq_depth_messages{group=\"g\"} 0"), "{text}");
    }
}
