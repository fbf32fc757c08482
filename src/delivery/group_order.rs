//! Which consumer groups the cluster makes orderly. RocketMQ apps make a group FIFO at the broker
//! (`mqadmin updateSubGroup -o true`: the subscription group's `consumeMessageOrderly`), and Apache's proxy
//! reads that to decide FIFO. popgate does the same: each group's config is read from the brokers when the
//! group is first seen, kept, and read again in the background once it is 20 s old (Apache's proxy refreshes
//! every 20 s too).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::broker::BrokerClient;

/// How long a group's config is used before it is read again.
const FRESH_FOR: Duration = Duration::from_secs(20);
/// How long the first receive of a group waits for its config (a Settings answer must come within seconds).
const FIRST_READ_WAIT: Duration = Duration::from_secs(2);

/// The orderliness of the groups seen so far.
pub(super) struct GroupOrder {
    broker: Arc<BrokerClient>,
    enabled: bool,
    known: Mutex<HashMap<String, Known>>,
}

struct Known {
    orderly: bool,
    read_at: Instant,
    reading: bool,
}

impl GroupOrder {
    pub(super) fn new(broker: Arc<BrokerClient>, enabled: bool) -> Arc<GroupOrder> {
        Arc::new(GroupOrder { broker, enabled, known: Mutex::new(HashMap::new()) })
    }

    /// Whether the cluster makes `group` orderly. A group seen before answers at once (its config is read
    /// again in the background when stale); a new one waits for the brokers at most [`FIRST_READ_WAIT`].
    /// A group no broker can be asked about is not orderly, until the next read says otherwise.
    pub(super) async fn orderly(self: &Arc<Self>, group: &str) -> bool {
        if !self.enabled {
            return false;
        }
        let first_read = {
            let mut known = self.known.lock();
            match known.get_mut(group) {
                Some(entry) => {
                    if entry.read_at.elapsed() >= FRESH_FOR && !entry.reading {
                        entry.reading = true;
                        let (me, group) = (Arc::clone(self), group.to_owned());
                        tokio::spawn(async move { me.read(&group).await });
                    }
                    return entry.orderly;
                }
                None => {
                    known.insert(group.to_owned(), Known { orderly: false, read_at: Instant::now(), reading: true });
                    let (me, group) = (Arc::clone(self), group.to_owned());
                    tokio::spawn(async move { me.read(&group).await })
                }
            }
        };
        // The read goes on if this wait ends first; it lands for the next call.
        matches!(tokio::time::timeout(FIRST_READ_WAIT, first_read).await, Ok(Ok(true)))
    }

    async fn read(&self, group: &str) -> bool {
        let orderly = match self.broker.group_consumes_orderly(group).await {
            Ok(orderly) => orderly.unwrap_or(false),
            Err(error) => {
                tracing::debug!(%error, group, "Could not read the group's config; keeping what is known.");
                self.known.lock().get(group).is_some_and(|k| k.orderly)
            }
        };
        self.remember(group, orderly);
        orderly
    }

    fn remember(&self, group: &str, orderly: bool) {
        let mut known = self.known.lock();
        let entry = known.entry(group.to_owned()).or_insert(Known { orderly, read_at: Instant::now(), reading: false });
        if entry.orderly != orderly {
            tracing::info!(group, orderly, "The cluster's config of the group changed its ordering.");
        }
        *entry = Known { orderly, read_at: Instant::now(), reading: false };
    }
}
