//! Which consumer groups the cluster makes orderly. RocketMQ apps make a group FIFO at the broker
//! (`mqadmin updateSubGroup -o true`: the subscription group's `consumeMessageOrderly`), and Apache's proxy
//! reads that to decide FIFO. popgate does the same: each group's config is read from the brokers when the
//! group is first seen, kept, and read again in the background once it is 20 s old (Apache's proxy refreshes
//! every 20 s too).
//!
//! The groups kept are bounded ([`MAX_GROUPS`], least recently used dropped, and any group unasked for
//! [`FORGET_AFTER`]): a client naming made-up groups costs a broker request each, never an entry for ever.
//! The fronts ask only about groups their caller may consume as.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use moka::ops::compute::Op;
use moka::sync::Cache;
// tokio's clock: the same as std's, and the tests can move it.
use tokio::time::Instant;

use crate::broker::BrokerClient;

/// How long a group's config is used before it is read again.
const FRESH_FOR: Duration = Duration::from_secs(20);
/// How long the first receive of a group waits for its config (a Settings answer must come within seconds).
const FIRST_READ_WAIT: Duration = Duration::from_secs(2);
/// The most groups kept; past it, the least recently used is forgotten (and read again when next asked about).
const MAX_GROUPS: u64 = 10_000;
/// A group nobody asked about for this long is forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(600);

/// Reads a group's orderliness from the brokers: `None` when none could be asked.
type ReadConfig = Box<dyn Fn(String) -> Pin<Box<dyn Future<Output = Option<bool>> + Send>> + Send + Sync>;

/// The orderliness of the groups seen lately.
pub(super) struct GroupOrder {
    read_config: ReadConfig,
    enabled: bool,
    known: Cache<String, Known>,
}

#[derive(Clone, Copy)]
struct Known {
    orderly: bool,
    read_at: Instant,
    reading: bool,
}

impl GroupOrder {
    pub(super) fn new(broker: Arc<BrokerClient>, enabled: bool) -> Arc<GroupOrder> {
        let read_config: ReadConfig = Box::new(move |group| {
            let broker = Arc::clone(&broker);
            Box::pin(async move {
                match broker.group_consumes_orderly(&group).await {
                    Ok(orderly) => Some(orderly.unwrap_or(false)),
                    Err(error) => {
                        tracing::debug!(%error, group, "Could not read the group's config; keeping what is known.");
                        None
                    }
                }
            })
        });
        GroupOrder::reading_with(read_config, enabled, MAX_GROUPS)
    }

    /// A `GroupOrder` that reads with `read_config` and keeps at most `max_groups` groups.
    fn reading_with(read_config: ReadConfig, enabled: bool, max_groups: u64) -> Arc<GroupOrder> {
        let known = Cache::builder().max_capacity(max_groups).time_to_idle(FORGET_AFTER).build();
        Arc::new(GroupOrder { read_config, enabled, known })
    }

    /// Whether the cluster makes `group` orderly. A group seen before answers at once (its config is read
    /// again in the background when stale); a new one waits for the brokers at most [`FIRST_READ_WAIT`].
    /// A group no broker can be asked about is not orderly, until the next read says otherwise.
    pub(super) async fn orderly(self: &Arc<Self>, group: &str) -> bool {
        if !self.enabled {
            return false;
        }
        // One caller starts a read (the group's first, or a stale one's), whoever else asks at the same time.
        let (mut read, mut first) = (false, false);
        let entry = self.known.entry_by_ref(group).and_compute_with(|entry| match entry.map(|e| e.into_value()) {
            Some(known) if known.read_at.elapsed() >= FRESH_FOR && !known.reading => {
                read = true;
                Op::Put(Known { reading: true, ..known })
            }
            Some(_) => Op::Nop,
            None => {
                (read, first) = (true, true);
                Op::Put(Known { orderly: false, read_at: Instant::now(), reading: true })
            }
        });
        let orderly = entry.into_entry().is_some_and(|entry| entry.into_value().orderly);
        if !read {
            return orderly;
        }
        let (me, group) = (Arc::clone(self), group.to_owned());
        let reading = tokio::spawn(async move { me.read(&group).await });
        if !first {
            return orderly;
        }
        // The read goes on if this wait ends first; it lands for the next call.
        matches!(tokio::time::timeout(FIRST_READ_WAIT, reading).await, Ok(Ok(true)))
    }

    async fn read(&self, group: &str) -> bool {
        let orderly = match (self.read_config)(group.to_owned()).await {
            Some(orderly) => orderly,
            None => self.known.get(group).is_some_and(|k| k.orderly),
        };
        self.remember(group, orderly);
        orderly
    }

    fn remember(&self, group: &str, orderly: bool) {
        if self.known.get(group).is_some_and(|known| known.orderly != orderly) {
            tracing::info!(group, orderly, "The cluster's config of the group changed its ordering.");
        }
        self.known.insert(group.to_owned(), Known { orderly, read_at: Instant::now(), reading: false });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A `GroupOrder` keeping at most `max_groups`, whose reads say "orderly" for groups named `fifo…` and count
    /// themselves in `reads`.
    fn counting(max_groups: u64, reads: &Arc<AtomicUsize>) -> Arc<GroupOrder> {
        let reads = Arc::clone(reads);
        let read_config: ReadConfig = Box::new(move |group| {
            reads.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move { Some(group.starts_with("fifo")) })
        });
        GroupOrder::reading_with(read_config, true, max_groups)
    }

    #[tokio::test(start_paused = true)]
    async fn made_up_groups_keep_a_bounded_number_of_entries_and_a_known_group_costs_one_read() {
        let reads = Arc::new(AtomicUsize::new(0));
        let order = counting(16, &reads);
        assert!(order.orderly("fifo-orders").await, "read from the brokers on first sight");
        assert!(order.orderly("fifo-orders").await);
        assert_eq!(reads.load(Ordering::SeqCst), 1, "a group seen is answered from memory while fresh");

        for i in 0..2_000 {
            assert!(!order.orderly(&format!("made-up-{i}")).await);
        }
        order.known.run_pending_tasks();
        let kept = order.known.entry_count();
        assert!(kept <= 16, "at most 16 groups kept, {kept} are");
        assert_eq!(reads.load(Ordering::SeqCst), 2_001, "one read per group, never more");
    }
}
