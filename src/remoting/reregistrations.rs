//! Registering a consumer group again at a broker that forgot it: once per burst, not once per refused pull.
//!
//! When popgate's connection to a broker closes, the broker forgets every group whose heartbeats came over it,
//! and the next pull of every queue of every member of those groups is refused at once. Each refused pull
//! would pass the group's heartbeats on again (one per member): members × queues heartbeats where one round
//! does. Here the first refused pull of a group at a broker registers it; the pulls refused meanwhile wait for
//! that and take its outcome, and so do those refused within [`FRESH_FOR`] after it (they were on their way
//! when it landed). Pulls refused for naming a newer subscription version than the broker's are registered by
//! that version: an outcome of registering an older one does not cure them.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use metrics::counter;
use moka::sync::Cache;
// tokio's clock: the same as std's, and the tests can move it.
use tokio::time::Instant;

use crate::metrics as m;

/// How long a re-registration's outcome stands for the group's other refused pulls.
const FRESH_FOR: Duration = Duration::from_secs(1);
/// Groups and brokers remembered at most (least recently used dropped); an entry idle this long goes.
const MAX_REMEMBERED: u64 = 10_000;
const FORGET_AFTER: Duration = Duration::from_secs(60);

/// The last re-registration of a group at a broker: when, and whether the broker took it.
#[derive(Clone, Copy)]
struct Outcome {
    at: Instant,
    taken: bool,
}

type Slot = Arc<tokio::sync::Mutex<Option<Outcome>>>;

/// The recent re-registrations, by consumer group, broker address and subscription version (0: any).
pub(super) struct Reregistrations {
    recent: Cache<(String, String, i64), Slot>,
}

impl Default for Reregistrations {
    fn default() -> Self {
        Reregistrations { recent: Cache::builder().max_capacity(MAX_REMEMBERED).time_to_idle(FORGET_AFTER).build() }
    }
}

impl Reregistrations {
    /// Registers `group` again at `broker` with `register` (whether the broker took it), unless another refused
    /// pull is doing so now or did within [`FRESH_FOR`] for the same subscription `version` (0: any): then its
    /// outcome, counted as `coalesced`.
    pub async fn once<F, Fut>(&self, group: &str, broker: &str, version: i64, register: F) -> bool
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = bool>,
    {
        let slot = self.recent.get_with((group.to_owned(), broker.to_owned(), version), Slot::default);
        // Held while registering: the pulls refused meanwhile wait here for the outcome.
        let mut last = slot.lock().await;
        if let Some(outcome) = last.filter(|outcome| outcome.at.elapsed() < FRESH_FOR) {
            counter!(m::REMOTING_REREGISTRATIONS, "result" => "coalesced").increment(1);
            return outcome.taken;
        }
        let taken = register().await;
        *last = Some(Outcome { at: Instant::now(), taken });
        taken
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_refused_pulls_registers_a_group_once_per_broker_and_again_after_a_while() {
        let reregistrations = Arc::new(Reregistrations::default());
        let registered = Arc::new(AtomicUsize::new(0));
        let register = |registered: Arc<AtomicUsize>| async move {
            registered.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
            true
        };
        let burst: Vec<_> = (0..8)
            .map(|_| {
                let (reregistrations, registered) = (reregistrations.clone(), registered.clone());
                tokio::spawn(
                    async move { reregistrations.once("g", "broker-a:10911", 0, || register(registered)).await },
                )
            })
            .collect();
        for pull in burst {
            assert!(pull.await.expect("a pull's task"), "every pull takes the one outcome");
        }
        assert_eq!(registered.load(Ordering::SeqCst), 1, "eight refused pulls, one re-registration");

        assert!(reregistrations.once("g", "broker-b:10911", 0, || register(registered.clone())).await);
        assert_eq!(registered.load(Ordering::SeqCst), 2, "another broker is registered on its own");
        assert!(reregistrations.once("g", "broker-b:10911", 7, || register(registered.clone())).await);
        assert_eq!(registered.load(Ordering::SeqCst), 3, "and a newer subscription version on its own");

        tokio::time::sleep(FRESH_FOR).await;
        assert!(reregistrations.once("g", "broker-a:10911", 0, || register(registered.clone())).await);
        assert_eq!(registered.load(Ordering::SeqCst), 4, "a later loss is registered again");
    }
}
