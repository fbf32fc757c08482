//! Subscriptions: made, changed, removed, and what each asks of the POP loop.

use super::*;

impl Deliveries {
    /// Stores `sub` and serves it. Returns the new POP loop's stop flag when the subscription is new (the
    /// caller starts the loop), `None` when an existing one was updated.
    pub(in crate::delivery) async fn put_subscription(
        &self,
        sub: Subscription,
        policy: RetryPolicy,
    ) -> Result<Option<Arc<AtomicBool>>, DeliveryError> {
        let key = sub.key();
        let value = serde_json::to_vec(&sub).map_err(StoreError::from)?;
        self.store.apply(&[Change::Put(Family::Subscriptions, &key, value)]).await?;
        Ok(self.serve_subscription(sub, policy))
    }

    /// Serves a subscription already in the store (boot recovery). As [`Deliveries::put_subscription`].
    pub(in crate::delivery) fn restore_subscription(
        &self,
        sub: Subscription,
        policy: RetryPolicy,
    ) -> Option<Arc<AtomicBool>> {
        if self.table.lock().subs.contains_key(&sub.key()) {
            return None;
        }
        self.serve_subscription(sub, policy)
    }

    pub(super) fn serve_subscription(&self, sub: Subscription, policy: RetryPolicy) -> Option<Arc<AtomicBool>> {
        let key = sub.key();
        let mut table = self.table.lock();
        if let Some(active) = table.subs.get_mut(&key) {
            if active.sub.filter != sub.filter || active.sub.filter_type != sub.filter_type {
                active.filter_changed = Some(Epoch::now());
                active.filter_refusal = None;
            }
            active.sub = sub;
            active.policy = policy;
            return None;
        }
        let active = ActiveSubscription::new(sub, policy, Epoch::now());
        let stop = active.stop.clone();
        table.subs.insert(key.clone(), active);
        // Deliveries left from an earlier subscription of the same key are queued here again.
        table.refile_subscription(&key);
        Some(stop)
    }

    /// Stops serving `group`/`topic`. Its unsettled deliveries are given back to the broker (unACKed) by the
    /// sweeper; owed broker ACKs and DLQ writes are finished.
    pub(in crate::delivery) async fn remove_subscription(&self, group: &str, topic: &str) -> Result<(), DeliveryError> {
        let key = Subscription::key_of(group, topic);
        if !self.table.lock().subs.contains_key(&key) {
            return Err(DeliveryError::Unknown);
        }
        self.store.apply(&[Change::Delete(Family::Subscriptions, &key)]).await?;
        let mut table = self.table.lock();
        if let Some(active) = table.subs.remove(&key) {
            active.stop.store(true, Ordering::Relaxed);
        }
        table.refile_subscription(&key);
        drop(table);
        // Its waiters wake and find it gone; a later subscription of the same key gets a new bell.
        if let Some(bells) = self.bells.lock().remove(&key) {
            bells.wake_everyone();
        }
        Ok(())
    }

    pub(in crate::delivery) fn subscription(&self, group: &str, topic: &str) -> Option<Subscription> {
        self.table.lock().subs.get(&Subscription::key_of(group, topic)).map(|a| a.sub.clone())
    }

    pub(in crate::delivery) fn subscriptions(&self) -> Vec<Subscription> {
        self.table.lock().subs.values().map(|a| a.sub.clone()).collect()
    }

    /// The POP loop of `key` found its filter refused by the broker (`Some`, the broker's words), or taken
    /// (`None`). A refusal wakes the long polls, which answer it.
    pub(in crate::delivery) fn set_filter_refusal(&self, key: &str, refusal: Option<String>) {
        let refused = refusal.is_some();
        if let Some(active) = self.table.lock().subs.get_mut(key) {
            active.filter_refusal = refusal;
        }
        if refused {
            if let Some(bells) = self.bells.lock().get(key) {
                bells.polls.notify_waiters();
            }
        }
    }

    /// The broker's refusal of `key`'s filter, if it refused it.
    pub(in crate::delivery) fn filter_refusal(&self, key: &str) -> Option<String> {
        self.table.lock().subs.get(key).and_then(|active| active.filter_refusal.clone())
    }

    /// Waiting subscribers of `key` want `count` more deliveries.
    pub(in crate::delivery) fn add_demand(&self, key: &str, count: usize) {
        if let Some(active) = self.table.lock().subs.get_mut(key) {
            active.demand += count;
            active.last_used = Epoch::now();
        }
        self.ring(key);
    }

    /// Whether a receive may change `key`'s filter now: at most one change per [`FILTER_CHANGE_INTERVAL`].
    pub(in crate::delivery) fn may_change_filter(&self, key: &str) -> bool {
        self.table.lock().subs.get(key).is_none_or(|active| {
            active.filter_changed.is_none_or(|changed| Epoch::now().since(changed) >= FILTER_CHANGE_INTERVAL)
        })
    }

    /// Removes the implicit subscriptions (made by a receive, not asked for) idle since `idle_since`: nobody
    /// waiting on them, nothing held for them. Their POP loops stop; the next receive creates them again.
    /// Returns how many were removed.
    pub(in crate::delivery) async fn expire_idle_subscriptions(&self, idle_since: Epoch) -> usize {
        let expired: Vec<ActiveSubscription> = {
            let mut table = self.table.lock();
            let keys: Vec<String> = table
                .subs
                .iter()
                .filter(|(key, active)| active.idle_implicit(table.held_by(key), idle_since))
                .map(|(key, _)| key.clone())
                .collect();
            keys.iter().filter_map(|key| table.subs.remove(key)).collect()
        };
        for active in &expired {
            active.stop.store(true, Ordering::Relaxed);
            let key = active.sub.key();
            // A failed delete leaves it stored: restored after a restart, it expires again.
            let _ = self.store.apply(&[Change::Delete(Family::Subscriptions, &key)]).await;
            if let Some(bells) = self.bells.lock().remove(&key) {
                bells.wake_everyone();
            }
            tracing::debug!(group = %active.sub.group, topic = %active.sub.topic, "Idle implicit subscription removed.");
        }
        counter!(m::SUBSCRIPTIONS_EXPIRED).increment(expired.len() as u64);
        expired.len()
    }

    /// A wait ended: its demand is withdrawn.
    pub(in crate::delivery) fn withdraw_demand(&self, key: &str, count: usize) {
        if let Some(active) = self.table.lock().subs.get_mut(key) {
            active.demand = active.demand.saturating_sub(count);
            active.last_used = Epoch::now();
        }
    }
}
