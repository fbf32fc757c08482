//! A fake cluster for the delivery state's unit tests and model test: it can be down on command, and it
//! checks every broker ACK against the store (never an ACK without a stored intent).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;

use super::cluster::Cluster;
use crate::broker::consumer::{AckEntry, ReceiptHandle};
use crate::broker::BrokerError;
use crate::clock::Epoch;
use crate::delivery::record::{DeliveryRecord, Phase};
use crate::publish::PublishError;
use crate::store::{Family, StateStore};

/// The cluster as the model sees it: it can be down, and it checks every broker ACK against the store.
pub(super) struct FakeCluster {
    /// The store popgate writes (swapped at a crash); the fake reads ACK intents from it.
    pub(super) store: Mutex<Option<Arc<StateStore>>>,
    /// While set, every request fails as if the broker were unreachable.
    pub(super) down: AtomicBool,
    /// Checkpoints (`extra_info`) ACKed at the broker, with the event each was for.
    pub(super) acked: Mutex<HashMap<String, String>>,
    /// Events written to the DLQ.
    pub(super) dead_lettered: Mutex<HashSet<String>>,
    /// What the fake saw that must never happen.
    pub(super) violations: Mutex<Vec<String>>,
}

impl FakeCluster {
    pub(super) fn new(store: Arc<StateStore>) -> FakeCluster {
        FakeCluster {
            store: Mutex::new(Some(store)),
            down: AtomicBool::new(false),
            acked: Mutex::new(HashMap::new()),
            dead_lettered: Mutex::new(HashSet::new()),
            violations: Mutex::new(Vec::new()),
        }
    }

    fn unreachable(&self) -> Option<BrokerError> {
        self.down.load(Ordering::Relaxed).then(|| BrokerError::Unreachable("the model's broker is down".into()))
    }

    /// A broker ACK is allowed only for a stored ACK intent, or a dead-lettered event already in the DLQ.
    fn take_ack(&self, handle: &ReceiptHandle) -> Result<(), BrokerError> {
        if let Some(down) = self.unreachable() {
            return Err(down);
        }
        let store = self.store.lock().clone();
        let stored = store
            .map(|store| {
                store
                    .list_with(Family::Deliveries, |bytes| DeliveryRecord::decode(bytes).ok())
                    .map(|l| l.records)
                    .unwrap_or_default()
            })
            .unwrap_or_default();
        let record = stored.into_iter().map(|(_, r)| r).find(|r| r.handle.extra_info == handle.extra_info);
        let allowed = match &record {
            Some(r) if r.phase == Phase::Acked => true,
            Some(r) if matches!(r.phase, Phase::DeadLetter { .. }) => self.dead_lettered.lock().contains(&r.event.id),
            _ => false,
        };
        if !allowed {
            self.violations
                .lock()
                .push(format!("broker ACK of {} without a stored intent: {record:?}", handle.extra_info));
        }
        let event = record.map(|r| r.event.id).unwrap_or_default();
        self.acked.lock().insert(handle.extra_info.clone(), event);
        Ok(())
    }
}

impl Cluster for FakeCluster {
    fn ack<'a>(&'a self, _group: &'a str, handle: &'a ReceiptHandle) -> BoxFuture<'a, Result<(), BrokerError>> {
        Box::pin(async move { self.take_ack(handle) })
    }

    fn ack_batch<'a>(&'a self, entries: &'a [AckEntry<'a>]) -> BoxFuture<'a, Vec<Result<bool, BrokerError>>> {
        Box::pin(async move { entries.iter().map(|entry| self.take_ack(entry.handle).map(|()| true)).collect() })
    }

    fn renew<'a>(
        &'a self,
        _group: &'a str,
        handle: &'a ReceiptHandle,
        invisible_ms: u64,
    ) -> BoxFuture<'a, Result<ReceiptHandle, BrokerError>> {
        Box::pin(async move {
            if let Some(down) = self.unreachable() {
                return Err(down);
            }
            let lease_until_ms = Epoch::now() + Duration::from_millis(invisible_ms);
            Ok(ReceiptHandle { lease_until_ms, ..handle.clone() })
        })
    }

    fn dead_letter<'a>(&'a self, record: &'a DeliveryRecord) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            if self.down.load(Ordering::Relaxed) {
                return Err(PublishError::Exhausted { attempts: Vec::new(), last_error: "broker down".into() });
            }
            self.dead_lettered.lock().insert(record.event.id.clone());
            Ok(())
        })
    }
}
