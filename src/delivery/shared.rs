//! One subscription per group and topic for a whole tier (issue #48).
//!
//! A subscription asked for (`POST /events/subscribe`, a change a receive makes to one, the admin plane) is
//! one the tier's instances share: each change carries a version ([`SubVersion`]: when it was made, on the
//! instance that made it, then that instance's id), and every instance keeps the change with the highest
//! version, so two instances that see the same changes in any order keep the same one (last writer wins). A
//! removal is a change too: its version is kept (durably, in `RemovedSubscriptions`) so that an older copy
//! an instance still has, or sends later, does not bring the subscription back.
//!
//! What is shared is the asked-for subscriptions only. An implicit one (made by a receive on its own, with the
//! defaults) stays the instance's: a shared one replaces it, and a shared removal leaves it alone (the next
//! receive there would make it again anyway).
//!
//! This module keeps the versions and the removals, and hands each local change to the tier's peer link
//! (`tier::sharing`) through a bounded queue; the peer link sends it to every peer, and at every look-up of
//! its peers compares a digest of the whole set with each one's and takes theirs when they differ, so a change
//! a peer missed (it was down, its queue was full) reaches it within `tier.refresh_secs`.

use std::collections::HashMap;
use std::sync::Arc;

use metrics::counter;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use super::record::{SubVersion, Subscription};
use super::DeliveryError;
use crate::clock::Epoch;
use crate::metrics as m;
use crate::store::{Change, Family, StateStore, StoreError};

/// Most removals remembered; past it the oldest is forgotten (an instance that kept the subscription through
/// that many later removals could bring it back).
pub const MAX_REMOVED: usize = 10_000;
/// Most subscriptions asked for (not implicit) an instance keeps: each is a POP loop on every instance of a
/// tier, and a whole set travels in one message. A new one past it is refused, made here or told by a peer.
pub const MAX_ASKED_SUBSCRIPTIONS: usize = 10_000;
/// Most local changes waiting for the peer link; past it a change is dropped from the queue (counted), and
/// reaches the peers at their next comparison of digests instead.
pub const MAX_QUEUED_CHANGES: usize = 1_000;

/// One change of a tier's subscriptions, as instances tell each other.
#[derive(Debug, Clone, PartialEq)]
pub enum SharedChange {
    /// Made or changed: this is the subscription now (its `version` set).
    Put(Subscription),
    /// Removed, by the change `version`.
    Removed {
        /// Consumer group.
        group: String,
        /// Topic.
        topic: String,
        /// The removal's version.
        version: SubVersion,
    },
}

impl SharedChange {
    /// The group and topic the change is about.
    pub fn names(&self) -> (&str, &str) {
        match self {
            SharedChange::Put(sub) => (&sub.group, &sub.topic),
            SharedChange::Removed { group, topic, .. } => (group, topic),
        }
    }

    /// The subscription key (group and topic) the change is about.
    pub fn key(&self) -> String {
        let (group, topic) = self.names();
        Subscription::key_of(group, topic)
    }
}

/// What became of a change another instance told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// It is the latest: in force here now.
    Taken,
    /// This instance has the same change or a later one: nothing to do.
    Older,
    /// It could not be taken here (a field this instance refuses, its store); logged.
    Refused,
}

impl Applied {
    /// The label of `popgate_tier_subscription_changes_total{result}`.
    pub fn label(self) -> &'static str {
        match self {
            Applied::Taken => "taken",
            Applied::Older => "older",
            Applied::Refused => "refused",
        }
    }
}

/// The removals remembered, and the queue of local changes for the peer link.
pub(super) struct Shared {
    /// This instance's id: the tie-breaker of its changes' versions.
    instance: String,
    removed: Mutex<HashMap<String, SubVersion>>,
    store: Arc<StateStore>,
    /// Where local changes go (the peer link's sender task); `None` outside a tier.
    outbox: Mutex<Option<mpsc::Sender<SharedChange>>>,
    /// Held while a change is judged and made, so a local change and a peer's of the same subscription do not
    /// interleave between the version check and the write.
    pub(super) changing: tokio::sync::Mutex<()>,
}

impl Shared {
    /// The removals `store` remembers.
    ///
    /// # Errors
    /// [`StoreError::Read`] when the store cannot be read.
    pub(super) fn load(store: Arc<StateStore>, instance: &str) -> Result<Shared, StoreError> {
        let mut removed = HashMap::new();
        store.for_each::<SubVersion>(Family::RemovedSubscriptions, |key, version| {
            if let Some(version) = version {
                removed.insert(key, version);
            }
        })?;
        Ok(Shared {
            instance: instance.to_owned(),
            removed: Mutex::new(removed),
            store,
            outbox: Mutex::new(None),
            changing: tokio::sync::Mutex::new(()),
        })
    }

    /// Local changes are sent to `outbox` from now on.
    pub(super) fn send_changes_to(&self, outbox: mpsc::Sender<SharedChange>) {
        *self.outbox.lock() = Some(outbox);
    }

    /// The version of a new local change of subscription `key`, whose current version (if any) is `current`:
    /// now, and later than both that and the subscription's last removal, so the change wins over them even
    /// when this instance's clock is behind the one that made them.
    pub(super) fn next_version(&self, key: &str, current: Option<&SubVersion>) -> SubVersion {
        let removed = self.removed.lock().get(key).cloned();
        let after = [current, removed.as_ref()].into_iter().flatten().map(|v| v.at_ms.saturating_add(1)).max();
        SubVersion { at_ms: Epoch::now().as_millis().max(after.unwrap_or(0)), instance: self.instance.clone() }
    }

    /// The version a subscription counts with: its own, or, for one stored before versions, the earliest this
    /// instance can give (so any versioned change wins over it).
    pub(super) fn version_of(&self, sub: &Subscription) -> SubVersion {
        sub.version.clone().unwrap_or_else(|| SubVersion { at_ms: 0, instance: self.instance.clone() })
    }

    /// The last removal of subscription `key`, if one is remembered.
    pub(super) fn removal_of(&self, key: &str) -> Option<SubVersion> {
        self.removed.lock().get(key).cloned()
    }

    /// Remembers (durably) that subscription `key` was removed by the change `version`; the oldest removal is
    /// forgotten past [`MAX_REMOVED`].
    pub(super) async fn remember_removal(&self, key: &str, version: &SubVersion) -> Result<(), StoreError> {
        let value = serde_json::to_vec(version)?;
        let dropped = {
            let removed = self.removed.lock();
            (removed.len() >= MAX_REMOVED && !removed.contains_key(key))
                .then(|| removed.iter().min_by(|a, b| a.1.cmp(b.1)).map(|(k, _)| k.clone()))
                .flatten()
        };
        let mut changes = vec![Change::Put(Family::RemovedSubscriptions, key, value)];
        if let Some(dropped) = &dropped {
            changes.push(Change::Delete(Family::RemovedSubscriptions, dropped));
        }
        self.store.apply(&changes).await?;
        let mut removed = self.removed.lock();
        if let Some(dropped) = &dropped {
            removed.remove(dropped);
        }
        removed.insert(key.to_owned(), version.clone());
        Ok(())
    }

    /// Forgets the removal of subscription `key`: a later change made it again.
    pub(super) async fn forget_removal(&self, key: &str) {
        if self.removed.lock().remove(key).is_some() {
            // Left in the store, it is older than the subscription's version: harmless after a restart.
            let _ = self.store.apply(&[Change::Delete(Family::RemovedSubscriptions, key)]).await;
        }
    }

    /// Hands a local change to the peer link, when this instance is in a tier; a full queue drops it (counted):
    /// the peers get it at their next comparison of digests.
    pub(super) fn announce(&self, change: SharedChange) {
        let Some(outbox) = self.outbox.lock().clone() else { return };
        if outbox.try_send(change).is_err() {
            counter!(m::TIER_SUBSCRIPTION_CHANGES, "way" => "sent", "result" => "dropped").increment(1);
        }
    }

    /// Every removal remembered, as changes.
    pub(super) fn removals(&self) -> Vec<SharedChange> {
        self.removed
            .lock()
            .iter()
            .filter_map(|(key, version)| {
                let (group, topic) = key.split_once('\n')?;
                Some(SharedChange::Removed {
                    group: group.to_owned(),
                    topic: topic.to_owned(),
                    version: version.clone(),
                })
            })
            .collect()
    }
}

impl super::Dispatcher {
    /// Changes of shared subscriptions made here are sent to `outbox` (the peer link's sender) from now on.
    pub fn send_shared_changes_to(&self, outbox: mpsc::Sender<SharedChange>) {
        self.shared.send_changes_to(outbox);
    }

    /// Every shared subscription this instance has (each with its version) and every removal it remembers:
    /// what a peer that differs takes.
    pub fn shared_set(&self) -> Vec<SharedChange> {
        let subs = self.subscriptions().into_iter().filter(|sub| !sub.implicit).map(|mut sub| {
            sub.version = Some(self.shared.version_of(&sub));
            SharedChange::Put(sub)
        });
        subs.chain(self.shared.removals()).collect()
    }

    /// The digest of [`super::Dispatcher::shared_set`].
    pub fn shared_digest(&self) -> Vec<u8> {
        digest_of(&self.shared_set())
    }

    /// Applies a change another instance made, when it is later than what this instance has of the same
    /// subscription (its version against the subscription's and the last removal's): a subscription made or
    /// changed is served as told (replacing an implicit one), a removal removes a shared one (an implicit one
    /// is this instance's own and stays). Nothing is told on.
    pub async fn apply_shared(&self, change: SharedChange) -> Applied {
        let _changing = self.shared.changing.lock().await;
        let key = change.key();
        let version = match &change {
            SharedChange::Put(sub) => sub.version.clone(),
            SharedChange::Removed { version, .. } => Some(version.clone()),
        };
        let Some(version) = version else { return Applied::Refused };
        let (group, topic) = change.names();
        let current = self.deliveries.subscription(group, topic);
        let newer_here = self.shared.removal_of(&key).is_some_and(|removed| removed >= version)
            || current.as_ref().is_some_and(|sub| !sub.implicit && self.shared.version_of(sub) >= version);
        if newer_here {
            return Applied::Older;
        }
        let applied = match change {
            SharedChange::Put(sub) => {
                let (group, topic) = (sub.group.clone(), sub.topic.clone());
                let mut request = super::SubscriptionRequest::from(sub);
                request.implicit = false;
                request.shared_version = Some(version);
                self.subscribe_now(request).await.map(|_| ()).inspect_err(|refused| {
                    tracing::warn!(%group, %topic, %refused, "A subscription another instance made could not be taken here.");
                })
            }
            SharedChange::Removed { group, topic, version } => {
                let remembered = self.shared.remember_removal(&key, &version).await.map_err(DeliveryError::Store);
                match current.filter(|sub| !sub.implicit) {
                    Some(_) => match remembered {
                        Ok(()) => self.remove_now(&group, &topic).await,
                        Err(error) => Err(error),
                    },
                    None => remembered,
                }
            }
        };
        match applied {
            Ok(()) => Applied::Taken,
            Err(_) => Applied::Refused,
        }
    }
}

/// A digest of a set of changes: the same for two instances exactly when they keep the same versions (what
/// each change is is decided by its version, which names the instance that made it).
pub fn digest_of(changes: &[SharedChange]) -> Vec<u8> {
    let mut lines: Vec<String> = changes
        .iter()
        .map(|change| {
            let (version, kind) = match change {
                // Every listed one has its version ([`super::Dispatcher::shared_set`] gives the unversioned theirs).
                SharedChange::Put(sub) => {
                    (sub.version.clone().unwrap_or(SubVersion { at_ms: 0, instance: String::new() }), 'P')
                }
                SharedChange::Removed { version, .. } => (version.clone(), 'R'),
            };
            format!("{}\t{kind}\t{}\t{}", change.key(), version.at_ms, version.instance)
        })
        .collect();
    lines.sort_unstable();
    let mut hash = Sha256::new();
    for line in lines {
        hash.update(line.as_bytes());
        hash.update(b"\n");
    }
    hash.finalize().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn removed(group: &str, at_ms: i64, instance: &str) -> SharedChange {
        SharedChange::Removed {
            group: group.into(),
            topic: "t".into(),
            version: SubVersion { at_ms, instance: instance.into() },
        }
    }

    /// An offline dispatcher of instance `instance`, and what it tells the tier.
    async fn instance(
        instance: &str,
    ) -> (tempfile::TempDir, Arc<super::super::Dispatcher>, mpsc::Receiver<SharedChange>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(StateStore::open(dir.path(), true).expect("open"));
        let (broker, publisher, config) = crate::delivery::test_support::offline_parts().await;
        let issuer = crate::delivery::Issuer { instance, lease_seal: None, give_back_unclaimed: None };
        let (dispatcher, _) =
            super::super::Dispatcher::start(store, broker, publisher, config, None, issuer).await.expect("start");
        let (outbox, told) = mpsc::channel(16);
        dispatcher.send_shared_changes_to(outbox);
        (dir, dispatcher, told)
    }

    fn asked(ack_timeout_ms: u64) -> super::super::SubscriptionRequest {
        super::super::SubscriptionRequest {
            group: "g".into(),
            topic: "t".into(),
            ack_timeout_ms: Some(ack_timeout_ms),
            ..Default::default()
        }
    }

    /// Two instances that change one subscription, and then remove it, each taking the other's changes in
    /// whatever order they come, keep the same: the latest change.
    #[tokio::test]
    async fn two_instances_that_take_each_others_changes_keep_the_latest() {
        let (_a_dir, a, mut told_by_a) = instance("popgate-a").await;
        let (_b_dir, b, mut told_by_b) = instance("popgate-b").await;
        // b has an implicit subscription of its own (a receive's): a shared one replaces it.
        b.ensure_subscription("g", "t").await.expect("implicit");
        assert!(told_by_b.try_recv().is_err(), "an implicit subscription is not shared");

        a.subscribe(asked(2_000)).await.expect("a subscribes");
        let by_a = told_by_a.try_recv().expect("told");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        b.subscribe(asked(5_000)).await.expect("b changes it later");
        let by_b = told_by_b.try_recv().expect("told");

        assert_eq!(b.apply_shared(by_a.clone()).await, Applied::Older, "b's change is later");
        assert_eq!(a.apply_shared(by_b.clone()).await, Applied::Taken);
        assert_eq!(a.apply_shared(by_b.clone()).await, Applied::Older, "taken once");
        for dispatcher in [&a, &b] {
            let sub = dispatcher.subscription("g", "t").expect("subscribed");
            assert_eq!((sub.ack_timeout_ms, sub.implicit), (5_000, false));
        }
        assert_eq!(a.shared_digest(), b.shared_digest());
        assert!(told_by_a.try_recv().is_err(), "a change taken from a peer is not told on");

        a.unsubscribe("g", "t").await.expect("a removes it");
        let removal = told_by_a.try_recv().expect("told");
        assert_eq!(b.apply_shared(by_b).await, Applied::Older);
        assert_eq!(b.apply_shared(removal).await, Applied::Taken);
        assert_eq!(b.subscription("g", "t"), None, "removed on b too");
        assert_eq!(b.apply_shared(by_a).await, Applied::Older, "an older change does not bring it back");
        assert_eq!(a.shared_digest(), b.shared_digest());
    }

    #[test]
    fn versions_order_by_time_then_instance() {
        let v = |at_ms, instance: &str| SubVersion { at_ms, instance: instance.into() };
        assert!(v(2, "a") > v(1, "z"), "the later change wins");
        assert!(v(1, "b") > v(1, "a"), "a tie goes to the higher instance id, the same on every instance");
    }

    #[test]
    fn the_digest_depends_on_the_versions_not_their_order() {
        let one = [removed("g1", 1, "a"), removed("g2", 2, "b")];
        let other = [removed("g2", 2, "b"), removed("g1", 1, "a")];
        assert_eq!(digest_of(&one), digest_of(&other));
        assert_ne!(digest_of(&one), digest_of(&[removed("g1", 1, "a"), removed("g2", 3, "b")]));
        assert_ne!(digest_of(&one), digest_of(&one[..1]));
    }
}
