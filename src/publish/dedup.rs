//! The publish de-duplication window: a message sent again under the same key (the SDK's retry of one message
//! carries its message id; an HTTP producer names its request with `Idempotency-Key` or a CloudEvents id) is
//! answered with the first send's receipt instead of being stored twice. Neither RocketMQ's producers nor
//! Apache's proxy have one: a send that timed out at the client but was stored is sent, and stored, again.
//!
//! Keys are remembered for the window (10 minutes by default) in memory and in the state store, written
//! before the send is answered, so a retry that comes after a popgate restart is still recognised. A failed
//! store write does not fail the send (the message is stored at the broker): that key is remembered by this
//! process only, and a retry after a restart costs one duplicate, never a lost message. Sends of one key that
//! arrive together are serialised: the second waits for the first and then gets its receipt.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use metrics::counter;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::broker::{SendReceipt, StoreStatus};
use crate::clock::Epoch;
use crate::metrics as m;
use crate::store::{expiry_key, Change, Family, StateStore};

/// How many remembered keys stay in memory; older ones are found in the store.
const MEMORY_MAX: usize = 100_000;
/// How long a send waits for another send of the same key that is still in flight.
const IN_FLIGHT_WAIT: Duration = Duration::from_secs(30);

/// A first send's receipt, as remembered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Remembered {
    message_id: String,
    broker: String,
    queue_id: i32,
    queue_offset: u64,
    /// A half message's commit-log offset, which ending its transaction needs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    commit_log_offset: Option<i64>,
    /// The broker's offset message id (a remoting producer's `offsetMsgId`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    offset_message_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    transaction_id: Option<String>,
    stored_at_ms: Epoch,
}

impl Remembered {
    fn receipt(&self) -> SendReceipt {
        SendReceipt {
            message_id: self.message_id.clone(),
            status: StoreStatus::SendOk,
            broker: self.broker.clone(),
            queue_id: self.queue_id,
            queue_offset: self.queue_offset,
            commit_log_offset: self.commit_log_offset,
            offset_message_id: self.offset_message_id.clone(),
            transaction_id: self.transaction_id.clone(),
        }
    }
}

/// The window: the keys of recent sends and their receipts.
pub struct DedupWindow {
    store: Arc<StateStore>,
    window: Duration,
    memory: Mutex<Memory>,
    in_flight: Mutex<HashSet<String>>,
}

#[derive(Default)]
struct Memory {
    receipts: HashMap<String, Remembered>,
    order: VecDeque<String>,
}

/// What a send under a key is to do.
pub enum Claim {
    /// Sent before, within the window: answer this receipt.
    Duplicate(SendReceipt),
    /// Send it; [`Pending::sent`] remembers the receipt (dropping it unremembered lets the next try send).
    Send(Pending),
}

/// A send the window waits to hear about.
pub struct Pending {
    window: Arc<DedupWindow>,
    key: String,
}

impl Pending {
    /// The send was stored: its key now answers with `receipt`.
    pub async fn sent(self, receipt: &SendReceipt) {
        self.window.remember(&self.key, receipt).await;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.window.in_flight.lock().remove(&self.key);
    }
}

impl DedupWindow {
    /// A window of `window` over `store`, forgetting what has expired every `window / 10` (at least every
    /// second, at most every minute) on a background task.
    pub fn start(store: Arc<StateStore>, window: Duration) -> Arc<DedupWindow> {
        let dedup = Arc::new(DedupWindow {
            store,
            window,
            memory: Mutex::new(Memory::default()),
            in_flight: Mutex::new(HashSet::new()),
        });
        let every = (window / 10).clamp(Duration::from_secs(1), Duration::from_secs(60));
        let weak = Arc::downgrade(&dedup);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let Some(dedup) = weak.upgrade() else { return };
                dedup.forget_expired().await;
            }
        });
        dedup
    }

    /// Claims `key` of `topic` for a send, or answers the receipt of the send it repeats. Waits while another
    /// send of the same key is in flight.
    pub async fn claim(self: &Arc<Self>, topic: &str, key: &str) -> Claim {
        let key = format!("{topic}\n{key}");
        let started = tokio::time::Instant::now();
        loop {
            if let Some(remembered) = self.recall(&key) {
                counter!(m::PUBLISH_DEDUPLICATED).increment(1);
                return Claim::Duplicate(remembered.receipt());
            }
            if self.in_flight.lock().insert(key.clone()) || started.elapsed() > IN_FLIGHT_WAIT {
                return Claim::Send(Pending { window: Arc::clone(self), key });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The receipt remembered for `key`, if it is still within the window: memory first, then the store.
    fn recall(&self, key: &str) -> Option<Remembered> {
        let now = Epoch::now();
        let fresh = |r: &Remembered| r.stored_at_ms + self.window > now;
        if let Some(remembered) = self.memory.lock().receipts.get(key).filter(|r| fresh(r)) {
            return Some(remembered.clone());
        }
        match self.store.get::<Remembered>(Family::Published, key) {
            Ok(found) => found.filter(fresh),
            Err(error) => {
                // Unreadable: sent again rather than refused (at-least-once; a duplicate at worst).
                tracing::warn!(%error, "Could not read the de-duplication window; sending.");
                None
            }
        }
    }

    async fn remember(&self, key: &str, receipt: &SendReceipt) {
        let remembered = Remembered {
            message_id: receipt.message_id.clone(),
            broker: receipt.broker.clone(),
            queue_id: receipt.queue_id,
            queue_offset: receipt.queue_offset,
            commit_log_offset: receipt.commit_log_offset,
            offset_message_id: receipt.offset_message_id.clone(),
            transaction_id: receipt.transaction_id.clone(),
            stored_at_ms: Epoch::now(),
        };
        let Ok(value) = serde_json::to_vec(&remembered) else { return };
        let expiry = expiry_key(remembered.stored_at_ms, key);
        {
            let mut memory = self.memory.lock();
            if memory.receipts.insert(key.to_owned(), remembered).is_none() {
                memory.order.push_back(key.to_owned());
            }
            while memory.order.len() > MEMORY_MAX {
                if let Some(oldest) = memory.order.pop_front() {
                    memory.receipts.remove(&oldest);
                }
            }
        }
        let changes = [Change::Put(Family::Published, key, value), Change::Put(Family::Published, &expiry, Vec::new())];
        if let Err(error) = self.store.apply(&changes).await {
            counter!(m::PUBLISH_DEDUP_WRITE_FAILURES).increment(1);
            tracing::warn!(%error, "Could not store a de-duplication key; only this process remembers it.");
        }
    }

    /// Forgets the keys whose window has passed, in memory and in the store.
    async fn forget_expired(&self) {
        let cutoff = Epoch::now() - self.window;
        {
            let mut memory = self.memory.lock();
            while let Some(oldest) = memory.order.front() {
                if memory.receipts.get(oldest).is_some_and(|r| r.stored_at_ms > cutoff) {
                    break;
                }
                if let Some(oldest) = memory.order.pop_front() {
                    memory.receipts.remove(&oldest);
                }
            }
        }
        // The index is by the time a key was stored: what was stored before the cutoff is due.
        let due = match self.store.due(Family::Published, cutoff) {
            Ok(due) => due,
            Err(error) => {
                tracing::warn!(%error, "Could not read the de-duplication window's expiry index.");
                return;
            }
        };
        if let Err(error) = self.store.remove_due(Family::Published, &due).await {
            tracing::warn!(%error, "Could not forget expired de-duplication keys; trying again later.");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receipt(id: &str) -> SendReceipt {
        SendReceipt {
            message_id: id.to_owned(),
            status: StoreStatus::SendOk,
            broker: "broker-a".into(),
            queue_id: 1,
            queue_offset: 7,
            commit_log_offset: None,
            offset_message_id: None,
            transaction_id: None,
        }
    }

    /// A ten-minute window over the store in `dir`, and the store.
    fn window_over(dir: &std::path::Path) -> (Arc<DedupWindow>, Arc<StateStore>) {
        let store = Arc::new(StateStore::open(dir, true).expect("open"));
        (DedupWindow::start(store.clone(), Duration::from_secs(600)), store)
    }

    #[tokio::test]
    async fn a_repeat_is_answered_with_the_first_receipt_even_after_a_restart_until_the_window_ends() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let (window, _store) = window_over(dir.path());
            let Claim::Send(first) = window.claim("t", "id-1").await else { panic!("first send") };
            first.sent(&receipt("MSG-1")).await;
            let Claim::Duplicate(again) = window.claim("t", "id-1").await else { panic!("a repeat") };
            assert_eq!(again.message_id, "MSG-1");
            assert!(matches!(window.claim("other-topic", "id-1").await, Claim::Send(_)), "keys are per topic");
        }
        let (window, store) = window_over(dir.path());
        let Claim::Duplicate(after_restart) = window.claim("t", "id-1").await else { panic!("remembered") };
        assert_eq!((after_restart.broker.as_str(), after_restart.queue_offset), ("broker-a", 7));
        // A window of zero length has forgotten it at once, and the expiry removes both keys.
        let short = DedupWindow::start(store.clone(), Duration::ZERO);
        assert!(matches!(short.claim("t", "id-1").await, Claim::Send(_)));
        short.forget_expired().await;
        assert!(store.get::<Remembered>(Family::Published, "t\nid-1").expect("read").is_none());
    }

    #[tokio::test]
    async fn a_send_that_failed_leaves_its_key_free_and_a_concurrent_one_waits_for_the_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (window, _store) = window_over(dir.path());
        let Claim::Send(failed) = window.claim("t", "k").await else { panic!("send") };
        drop(failed);
        let Claim::Send(first) = window.claim("t", "k").await else { panic!("free again") };
        let (second, ()) = tokio::join!(window.claim("t", "k"), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            first.sent(&receipt("MSG-K")).await;
        });
        assert!(matches!(second, Claim::Duplicate(r) if r.message_id == "MSG-K"));
    }
}
