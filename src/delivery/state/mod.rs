//! The one owner of the delivery state machine. [`Deliveries`] is the only way to admit, hand out, ACK,
//! NACK, TERM, time out, renew, dead-letter, give back and retire a delivery; its fields (and the
//! in-memory [`table`]) are private to this module. The POP loop, the sweeper, boot recovery and every
//! transport call its methods and touch nothing else.
//!
//! Invariants, each kept by one method here:
//! - **Write, then act.** Every transition is persisted to the state store before it shows in memory, is
//!   answered to a client, or reaches the broker. A failed write changes nothing (the caller may retry).
//! - **Only a subscriber ACK or a DLQ write ACKs the broker.** [`Deliveries::ack`] accepts a delivery only
//!   in its awaiting-ACK phase (handed out, or recovered while handed out); a delivery that is ready,
//!   dead-lettering or already ACKed is refused.
//! - **One actor per delivery.** A task acting on a delivery claims it; others wait (client requests) or
//!   skip it until the claim ends (loops). The lock is never held across an `.await` or a store write.
//! - **Nothing is stranded.** A delivery whose subscription is gone is given back to the broker by the
//!   sweeper, whichever path left it behind; one that comes back to a re-created subscription is queued
//!   there. Owed work (broker ACK, DLQ write) keeps its lease renewed until it is done.
//! - **FIFO groups.** In an ordered subscription only the head of a message group is handed out.

mod cluster;
#[cfg(test)]
mod fake_cluster;
#[cfg(test)]
mod model;
mod table;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use parking_lot::Mutex;
use rand::RngCore;
use tokio::sync::Notify;

use self::cluster::{BrokerCluster, Cluster};
use self::table::{ActiveSubscription, Id, Table, Tracked};
use super::lease::{Lease, LeaseSeal};
use super::record::{DeliveryRecord, Holder, Phase, Subscription};
use super::retry::{epoch_ms_after, NextStep, RetryPolicy};
use super::{DeliveryError, Dispatched, HandOut, InFlight, NackOutcome, Target};
use crate::broker::client::now_millis;
use crate::broker::consumer::{AckEntry, Popped};
use crate::broker::{BrokerClient, BrokerError};
use crate::config::DeliveryConfig;
use crate::metrics as m;
use crate::publish::Publisher;
use crate::store::{Change, Family, StateStore, StoreError};

/// How long an id whose lease was lost is remembered, to answer its late ACK with 409 rather than 404.
const STALE_MEMORY_MS: i64 = 10 * 60 * 1000;
/// How long a client request waits for a delivery another task is acting on.
const CLAIM_WAIT: Duration = Duration::from_secs(10);
/// How long a given-back message stays invisible at the broker: long enough for the change to land, short
/// enough that the next consumer gets it at once instead of after the whole lease.
const GIVE_BACK_INVISIBLE_MS: u64 = 1_000;
/// Filter changes made by receives (consumers of one group with different filters) are taken at most this
/// often per subscription, so they cannot rewrite it on every receive.
const FILTER_CHANGE_INTERVAL_MS: i64 = 10_000;
/// How many ready events an ordered subscription may hold beyond its demand, so events blocked behind their
/// message group's head do not stop other groups.
const ORDERED_LOOKAHEAD: usize = 256;

/// Whether owed broker work (a broker ACK, a DLQ write) failed when a claim on it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwedWork {
    /// Nothing owed failed: no change to its schedule.
    NotFailed,
    /// It failed again: tried after its backoff ([`super::retry::OWED_WORK_BACKOFF`]).
    Failed,
}

/// Broker work the sweeper found due; it runs each through [`Deliveries::perform`].
#[derive(Debug)]
pub(super) enum Owed {
    /// The subscribers ACKed (the intents are stored): ACK the broker, then retire. All the ACKs one sweep
    /// finds due travel together, as one batch request per broker.
    BrokerAcks(Vec<Id>),
    /// Write the event to `%DLQ%<group>`, then ACK the broker, then retire.
    DeadLetter(Id),
    /// Extend the lease (ChangeInvisibleTime) and store the new handle.
    Renew(Id),
    /// Hand the message back to the broker unACKed, then forget it: its subscription is gone
    /// (`"unsubscribed"`), an earlier event of its FIFO group lost its lease (`"fifo_head_lost"`), or, in a
    /// tier, no consumer of its group waits on this instance (`"unclaimed"`).
    GiveBack(Id, &'static str),
}

/// What became of a batch of popped messages.
pub(super) enum Admission {
    /// Recorded and queued.
    Admitted,
    /// The store refused the write (it counted the failure): nothing was recorded; the caller holds the
    /// messages (under their lease) and admits them again before it pops anything newer.
    Refused(Vec<Popped>),
    /// The subscription is gone: the caller gives the messages back ([`Deliveries::give_back_popped`]).
    NoSubscription(Vec<Popped>),
}

/// What the POP loop should ask the broker for next.
pub(super) struct PopPlan {
    pub(super) sub: Subscription,
    /// How many messages subscribers are waiting for that the ready queue cannot give, within the bounds.
    pub(super) wanted: usize,
}

/// What boot recovery did with one stored record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Restored {
    /// Already tracked (recovery ran before): left alone.
    Skipped,
    /// Dispatched again, attempt kept; `was_handed_out` when a subscriber held it at the crash.
    Redispatched {
        /// It was awaiting an ACK (a redelivery), not waiting for its attempt.
        was_handed_out: bool,
    },
    /// The subscriber's ACK was stored: only the broker ACK is owed.
    AckPending,
    /// Owed to the DLQ.
    DeadLetterPending,
}

/// What a subscription's waiters wait on.
///
/// Push subscribers and the POP loop each wait for something of their own (a freed prefetch slot, new
/// demand), so every change wakes them all (`all`). Long polls all wait for the same thing, a ready delivery,
/// and any one of them may take it: a change wakes one (`polls`), and one that took deliveries while more
/// are ready wakes the next. A thousand long polls on one group then cost one wake-up per change, not a
/// thousand.
#[derive(Default)]
pub(super) struct Bells {
    /// Push subscribers and the POP loop.
    pub(super) all: Notify,
    /// Long polls (HTTP and gRPC receives).
    pub(super) polls: Notify,
}

impl Bells {
    /// Wakes every waiter, long polls included (shut-down, the subscription removed).
    fn wake_everyone(&self) {
        self.all.notify_waiters();
        self.polls.notify_waiters();
    }
}

/// The owner of every in-flight delivery and every active subscription.
pub(super) struct Deliveries {
    table: Mutex<Table>,
    store: Arc<StateStore>,
    /// For the POP loop (routes, POP handles); the state itself reaches the cluster through `cluster`.
    broker: Arc<BrokerClient>,
    /// Broker ACKs, lease renewals, DLQ writes.
    cluster: Arc<dyn Cluster>,
    config: DeliveryConfig,
    /// The bells of each subscription, rung when its deliveries become ready or are settled, or its demand
    /// changes. Per subscription, so a change wakes only the waiters it concerns.
    bells: Mutex<HashMap<String, Arc<Bells>>>,
    /// The next admission sequence number (see [`DeliveryRecord::seq`]).
    next_seq: AtomicU64,
    shutting_down: AtomicBool,
    /// This instance's id, the start of every delivery id it mints (empty: ids name no instance).
    instance: String,
    /// Seals each hand-out's broker lease into its handles, in a tier (see `delivery::lease`).
    lease_seal: Option<LeaseSeal>,
    /// In a tier, how long a subscription may go without a waiting consumer before what is due on it is given
    /// back to the broker (ms).
    give_back_unclaimed_ms: Option<i64>,
}

// === construction, configuration, persistence ===

impl Deliveries {
    pub(super) fn new(
        store: Arc<StateStore>,
        broker: Arc<BrokerClient>,
        publisher: Arc<Publisher>,
        config: DeliveryConfig,
    ) -> Deliveries {
        let cluster = Arc::new(BrokerCluster { broker: broker.clone(), publisher });
        Self::with_cluster(store, broker, cluster, config)
    }

    /// As [`Deliveries::new`], reaching the cluster through `cluster` (a fake, in unit tests).
    pub(super) fn with_cluster(
        store: Arc<StateStore>,
        broker: Arc<BrokerClient>,
        cluster: Arc<dyn Cluster>,
        config: DeliveryConfig,
    ) -> Deliveries {
        Deliveries {
            table: Mutex::new(Table::default()),
            store,
            broker,
            cluster,
            config,
            bells: Mutex::new(HashMap::new()),
            next_seq: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            instance: String::new(),
            lease_seal: None,
            give_back_unclaimed_ms: None,
        }
    }

    /// These deliveries' ids start with `instance`, so any instance of a tier can tell whose they are; with
    /// `lease_seal`, each hand-out carries its broker lease, sealed, for a peer to ACK it without this one.
    pub(super) fn with_instance(mut self, instance: &str, lease_seal: Option<LeaseSeal>) -> Deliveries {
        self.instance = instance.to_owned();
        self.lease_seal = lease_seal;
        self
    }

    /// In a tier: deliveries due again on a subscription no consumer has waited on for `after` are given back
    /// to the broker (see [`ActiveSubscription::unclaimed`]).
    pub(super) fn giving_back_unclaimed(mut self, after: Option<Duration>) -> Deliveries {
        self.give_back_unclaimed_ms = after.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        self
    }

    /// The lease `token` carries, when this tier sealed it for delivery `id`.
    pub(super) fn open_lease(&self, id: &str, token: &str) -> Option<Lease> {
        self.lease_seal.as_ref()?.open(id, token)
    }

    /// ACKs a lease another instance handed out, at the broker, without any record of it here (its owner
    /// cannot be reached). Refused as the owner would refuse an ACK of a lapsed lease.
    pub(super) async fn ack_lease(&self, lease: &Lease) -> Result<(), DeliveryError> {
        if lease.handle.lease_deadline_ms() <= now_millis() {
            return Err(DeliveryError::Stale);
        }
        self.cluster.ack(&lease.group, &lease.handle).await.map_err(|why| {
            tracing::warn!(group = %lease.group, %why, "A broker ACK for an absent owner failed.");
            DeliveryError::Busy
        })
    }

    pub(super) fn config(&self) -> &DeliveryConfig {
        &self.config
    }

    pub(super) fn broker(&self) -> &BrokerClient {
        &self.broker
    }

    pub(super) fn store(&self) -> &StateStore {
        &self.store
    }

    /// The bells of subscription `key`. A `notified()` resolves at the next change there (ready deliveries,
    /// settlements, demand); create and enable it before looking at the state, so a change in between is
    /// not missed.
    pub(super) fn bells(&self, key: &str) -> Arc<Bells> {
        self.bells.lock().entry(key.to_owned()).or_default().clone()
    }

    /// Wakes the push subscribers and POP loop of subscription `key`, and one of its long polls.
    fn ring(&self, key: &str) {
        if let Some(bells) = self.bells.lock().get(key) {
            bells.all.notify_waiters();
            bells.polls.notify_one();
        }
    }

    /// Wakes one more long poll (or push subscriber with room) of subscription `key`: a hand-out left ready
    /// deliveries behind, or put some back. Only one is woken per change, so the turn is passed on here.
    fn pass_turn(&self, key: &str) {
        if let Some(bells) = self.bells.lock().get(key) {
            bells.polls.notify_one();
        }
    }

    /// Wakes the waiters of each subscription in `keys` once.
    fn ring_each(&self, keys: impl IntoIterator<Item = String>) {
        let keys: HashSet<String> = keys.into_iter().collect();
        for key in &keys {
            self.ring(key);
        }
    }

    pub(super) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    pub(super) fn shut_down(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
        for bells in self.bells.lock().values() {
            bells.wake_everyone();
        }
    }

    /// The one way delivery state reaches the store: every change of the batch, or none.
    async fn persist(&self, records: &[&DeliveryRecord]) -> Result<(), StoreError> {
        let encoded = records.iter().map(serde_json::to_vec).collect::<Result<Vec<_>, _>>()?;
        let changes: Vec<Change<'_>> =
            records.iter().zip(encoded).map(|(r, value)| Change::Put(Family::Deliveries, &r.id, value)).collect();
        self.store.apply(&changes).await
    }

    /// Stores newly admitted records and, apart, their bodies, in one atomic batch.
    async fn persist_admitted(&self, records: &[DeliveryRecord], bodies: &[Vec<u8>]) -> Result<(), StoreError> {
        let encoded = records.iter().map(serde_json::to_vec).collect::<Result<Vec<_>, _>>()?;
        let mut changes: Vec<Change<'_>> =
            records.iter().zip(encoded).map(|(r, value)| Change::Put(Family::Deliveries, &r.id, value)).collect();
        changes.extend(records.iter().zip(bodies).map(|(r, body)| Change::Put(Family::Payloads, &r.id, body.clone())));
        self.store.apply(&changes).await
    }

    /// Syncs the store's WAL (group commit of async-flush profiles); a failure is counted by the store.
    pub(super) async fn sync_wal(&self) {
        let _ = self.store.sync_wal().await;
    }

    fn set_pending_gauge(table: &Table) {
        gauge!(m::PENDING_DELIVERIES).set(table.deliveries.len() as f64);
    }
}

// === subscriptions ===

impl Deliveries {
    /// Stores `sub` and serves it. Returns the new POP loop's stop flag when the subscription is new (the
    /// caller starts the loop), `None` when an existing one was updated.
    pub(super) async fn put_subscription(
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
    pub(super) fn restore_subscription(&self, sub: Subscription, policy: RetryPolicy) -> Option<Arc<AtomicBool>> {
        if self.table.lock().subs.contains_key(&sub.key()) {
            return None;
        }
        self.serve_subscription(sub, policy)
    }

    fn serve_subscription(&self, sub: Subscription, policy: RetryPolicy) -> Option<Arc<AtomicBool>> {
        let key = sub.key();
        let mut table = self.table.lock();
        if let Some(active) = table.subs.get_mut(&key) {
            if active.sub.filter != sub.filter || active.sub.filter_type != sub.filter_type {
                active.filter_changed_ms = now_millis();
                active.filter_refusal = None;
            }
            active.sub = sub;
            active.policy = policy;
            return None;
        }
        let active = ActiveSubscription::new(sub, policy, now_millis());
        let stop = active.stop.clone();
        table.subs.insert(key.clone(), active);
        // Deliveries left from an earlier subscription of the same key are queued here again.
        table.refile_subscription(&key);
        Some(stop)
    }

    /// Stops serving `group`/`topic`. Its unsettled deliveries are given back to the broker (unACKed) by the
    /// sweeper; owed broker ACKs and DLQ writes are finished.
    pub(super) async fn remove_subscription(&self, group: &str, topic: &str) -> Result<(), DeliveryError> {
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

    pub(super) fn subscription(&self, group: &str, topic: &str) -> Option<Subscription> {
        self.table.lock().subs.get(&Subscription::key_of(group, topic)).map(|a| a.sub.clone())
    }

    pub(super) fn subscriptions(&self) -> Vec<Subscription> {
        self.table.lock().subs.values().map(|a| a.sub.clone()).collect()
    }

    /// The POP loop of `key` found its filter refused by the broker (`Some`, the broker's words), or taken
    /// (`None`). A refusal wakes the long polls, which answer it.
    pub(super) fn set_filter_refusal(&self, key: &str, refusal: Option<String>) {
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
    pub(super) fn filter_refusal(&self, key: &str) -> Option<String> {
        self.table.lock().subs.get(key).and_then(|active| active.filter_refusal.clone())
    }

    /// Waiting subscribers of `key` want `count` more deliveries.
    pub(super) fn add_demand(&self, key: &str, count: usize) {
        if let Some(active) = self.table.lock().subs.get_mut(key) {
            active.demand += count;
            active.last_used_ms = now_millis();
        }
        self.ring(key);
    }

    /// Whether a receive may change `key`'s filter now: at most one change per [`FILTER_CHANGE_INTERVAL_MS`].
    pub(super) fn may_change_filter(&self, key: &str) -> bool {
        self.table.lock().subs.get(key).is_none_or(|active| {
            active.filter_changed_ms == 0 || now_millis() - active.filter_changed_ms >= FILTER_CHANGE_INTERVAL_MS
        })
    }

    /// Removes the implicit subscriptions (made by a receive, not asked for) idle since `idle_since_ms`: nobody
    /// waiting on them, nothing held for them. Their POP loops stop; the next receive creates them again.
    /// Returns how many were removed.
    pub(super) async fn expire_idle_subscriptions(&self, idle_since_ms: i64) -> usize {
        let expired: Vec<ActiveSubscription> = {
            let mut table = self.table.lock();
            let keys: Vec<String> = table
                .subs
                .iter()
                .filter(|(key, active)| active.idle_implicit(table.held_by(key), idle_since_ms))
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
    pub(super) fn withdraw_demand(&self, key: &str, count: usize) {
        if let Some(active) = self.table.lock().subs.get_mut(key) {
            active.demand = active.demand.saturating_sub(count);
            active.last_used_ms = now_millis();
        }
    }
}

// === the POP loop's side: plan, admit, give back ===

impl Deliveries {
    /// What to POP for `key` now; `None` once the subscription is gone.
    pub(super) fn pop_plan(&self, key: &str) -> Option<PopPlan> {
        let table = self.table.lock();
        let active = table.subs.get(key)?;
        // An ordered subscription's ready queue may hold events waiting for their group's head: pop past
        // them (within a bound) so other groups keep flowing.
        let queued =
            if active.sub.ordered { active.ready.len().saturating_sub(ORDERED_LOOKAHEAD) } else { active.ready.len() };
        let wanted = active.demand.saturating_sub(queued);
        // Backpressure: at the instance's (or this subscription's) in-flight bound nothing more is popped.
        let room = self
            .config
            .max_in_flight
            .saturating_sub(table.deliveries.len())
            .min(self.config.max_in_flight_per_subscription.saturating_sub(table.held_by(key)));
        Some(PopPlan { sub: active.sub.clone(), wanted: wanted.min(room) })
    }

    /// Records popped messages before anyone sees them, then queues them. The attempt counter starts at
    /// the broker's own `reconsumeTimes + 1`, so a crash loop cannot reset the budget.
    pub(super) async fn admit(&self, key: &str, popped: Vec<Popped>) -> Admission {
        let Some((sub, policy)) = self.table.lock().subs.get(key).map(|a| (a.sub.clone(), a.policy)) else {
            return Admission::NoSubscription(popped);
        };
        let now = now_millis();
        let mut bodies: Vec<Vec<u8>> = Vec::with_capacity(popped.len());
        let records: Vec<DeliveryRecord> = popped
            .into_iter()
            .map(|mut p| {
                bodies.push(std::mem::take(&mut p.event.body));
                let attempt = p.event.reconsume_times.saturating_add(1).max(1);
                let phase = if attempt > policy.max_attempts {
                    Phase::DeadLetter { reason: format!("the broker redelivered it {} times", p.event.reconsume_times) }
                } else {
                    Phase::Ready { due_ms: now }
                };
                DeliveryRecord {
                    id: new_delivery_id(&self.instance).into(),
                    group: sub.group.as_str().into(),
                    topic: sub.topic.as_str().into(),
                    event: p.event,
                    handle: p.handle,
                    attempt,
                    phase,
                    last_failure: None,
                    seq: self.next_seq.fetch_add(1, Ordering::Relaxed),
                    body_apart: true,
                    handouts: 0,
                }
            })
            .collect();
        if self.persist_admitted(&records, &bodies).await.is_err() {
            let back = records
                .into_iter()
                .zip(bodies)
                .map(|(mut r, body)| {
                    r.event.body = body;
                    Popped { event: r.event, handle: r.handle }
                })
                .collect();
            return Admission::Refused(back);
        }
        let ids: Vec<String> = records.iter().map(|r| r.id.to_string()).collect();
        let mut table = self.table.lock();
        // Each is also filed for the sweeper, which gives it back if the subscription went away meanwhile: an
        // unsubscribe racing this POP strands nothing.
        for record in records {
            table.insert(Tracked::new(record));
        }
        Self::set_pending_gauge(&table);
        drop(table);
        self.queue_now(&ids);
        Admission::Admitted
    }

    /// Hands messages that were popped but never recorded back to the broker, unACKed.
    pub(super) async fn give_back_popped(&self, group: &str, popped: Vec<Popped>, reason: &'static str) {
        for p in popped {
            self.give_back_at_broker(group, &p.handle, reason).await;
        }
    }

    /// Best effort: makes the message visible again at once (ChangeInvisibleTime to a second). If the
    /// broker cannot be asked, the lease running out gives it back all the same.
    async fn give_back_at_broker(
        &self,
        group: &str,
        handle: &crate::broker::consumer::ReceiptHandle,
        reason: &'static str,
    ) {
        counter!(m::DELIVERIES_GIVEN_BACK, "reason" => reason).increment(1);
        if let Err(error) = self.cluster.renew(group, handle, GIVE_BACK_INVISIBLE_MS).await {
            counter!(m::CONSUME_REQUEST_FAILURES, "op" => "give_back").increment(1);
            tracing::debug!(%error, "Giving a message back failed; its lease running out gives it back.");
        }
    }
}

// === hand-out ===

impl Deliveries {
    /// Hands out up to `max` ready deliveries of `key` to `holder` (a push subscriber, or none for a
    /// long-poll or a gRPC client, which `to` names), marking them awaiting ACK in the store first. Nothing is
    /// handed out when that write fails.
    ///
    /// Only one long poll is woken per change, so when this leaves ready deliveries behind (or puts back what
    /// it could not hand out) it wakes the next one.
    pub(super) async fn hand_out(
        &self,
        key: &str,
        max: usize,
        to: &HandOut,
        holder: Option<u64>,
    ) -> Result<Vec<Dispatched>, DeliveryError> {
        let now = now_millis();
        let transport = to.transport;
        let mut taken: Vec<DeliveryRecord> = Vec::new();
        {
            let mut guard = self.table.lock();
            let table = &mut *guard;
            let Some(active) = table.subs.get(key) else { return Ok(Vec::new()) };
            let ack_timeout = to.ack_timeout.map_or(active.sub.ack_timeout_ms as i64, |t| t.as_millis() as i64);
            let ordered = active.sub.ordered;
            let Table { subs, deliveries, timers, fifo, .. } = table;
            let Some(active) = subs.get_mut(key) else { return Ok(Vec::new()) };
            let mut blocked = Vec::new();
            let mut batch: HashSet<Id> = HashSet::new();
            let no_batch: HashSet<Id> = HashSet::new();
            while taken.len() < max {
                let Some(id) = active.ready.pop_front() else { break };
                let Some(tracked) = deliveries.get(&id) else { continue };
                // A lapsed lease (popgate was hung) means the broker may have handed the event to someone
                // else already: it is not handed out, and the sweeper gives it up.
                let lapsed = tracked.record.handle.lease_deadline_ms() <= now;
                let unavailable = tracked.claimed || !tracked.dispatchable(now) || lapsed;
                // An earlier event of its message group still unsettled: it waits its turn.
                // (or, for a FIFO batch, behind deliveries of its group that this hand-out did not take).
                let behind_its_head = ordered
                    && !unavailable
                    && tracked.record.event.message_group.as_deref().is_some_and(|group| {
                        let joined = if to.fifo_batch { &batch } else { &no_batch };
                        !Table::fifo_view(fifo, deliveries).may_join(key, group, tracked.record.seq, joined)
                    });
                let Some(tracked) = deliveries.get_mut(&id) else { continue };
                if unavailable {
                    // Out of the queue: the sweeper queues it again when it is due.
                    tracked.queued = false;
                    timers.push(std::cmp::Reverse((0, id)));
                    continue;
                }
                if behind_its_head {
                    blocked.push(id);
                    continue;
                }
                tracked.queued = false;
                tracked.claimed = true;
                batch.insert(id.clone());
                let mut record = tracked.record.clone();
                record.handouts = record.handouts.saturating_add(1);
                record.phase = Phase::AwaitingAck {
                    deadline_ms: now + ack_timeout,
                    dispatched_ms: now,
                    holder: to.holder.clone(),
                };
                taken.push(record);
            }
            // Blocked ids go back in their order, ahead of what was not looked at.
            for id in blocked.into_iter().rev() {
                active.ready.push_front(id);
            }
        }
        if taken.is_empty() {
            return Ok(Vec::new());
        }
        // From here the records are claimed; a caller that stops waiting (its client went away, popgate is
        // shutting down) drops this future at an await below, and the guard puts them back for the next waiter.
        let mut unclaim = PutBackOnDrop { deliveries: self, key, ids: taken.iter().map(|r| r.id.clone()).collect() };
        // The bodies are read before the hand-out is stored: a read that fails hands nothing out.
        let bodies = match self.read_bodies(&taken) {
            Ok(bodies) => bodies,
            Err(error) => return Err(error.into()),
        };
        let (taken, bodies) = self.drop_bodiless(taken, bodies).await;
        if let Err(error) = self.persist(&taken.iter().collect::<Vec<_>>()).await {
            return Err(error.into());
        }
        // Stored: from here the hand-out happens, whatever the caller does.
        unclaim.ids.clear();
        let mut table = self.table.lock();
        let mut out = Vec::with_capacity(taken.len());
        for (record, body) in taken.into_iter().zip(bodies) {
            let Phase::AwaitingAck { deadline_ms, .. } = record.phase else { continue };
            let mut event = record.event.clone();
            if let Some(body) = body {
                event.body = body;
            }
            out.push(Dispatched {
                id: record.id.to_string(),
                attempt: record.attempt,
                handout: record.handouts,
                ack_deadline_ms: deadline_ms,
                event,
                lease: self.lease_seal.as_ref().and_then(|seal| seal.seal(&record)),
            });
            let id = record.id.clone();
            table.set_record(record);
            if let Some(tracked) = table.deliveries.get_mut(&*id) {
                tracked.claimed = false;
                tracked.redispatch = false;
                tracked.holder = holder;
            }
            table.wake(&id, 0);
        }
        let more_ready = table.subs.get(key).is_some_and(|active| !active.ready.is_empty());
        drop(table);
        if more_ready {
            self.pass_turn(key);
        }
        counter!(m::DELIVERIES_DISPATCHED, "transport" => transport).increment(out.len() as u64);
        Ok(out)
    }

    /// Taken for a hand-out that did not happen: back at the head of the queue, unchanged, for the next
    /// waiter (the caller may have been the one woken for them). A record retired meanwhile (its body was
    /// missing) is skipped.
    fn put_back(&self, key: &str, taken: &[Id]) {
        let mut table = self.table.lock();
        for id in taken.iter().rev() {
            let Some(tracked) = table.deliveries.get_mut(id) else { continue };
            tracked.claimed = false;
            tracked.queued = true;
            if let Some(active) = table.subs.get_mut(key) {
                active.ready.push_front(id.clone());
            }
        }
        drop(table);
        self.pass_turn(key);
    }

    /// The stored body of each record, in order: `None` for a record that carries its body inline, and
    /// `Some(None)` for one whose kept-apart body is missing from the store.
    fn read_bodies(&self, records: &[DeliveryRecord]) -> Result<Vec<Option<Option<Vec<u8>>>>, StoreError> {
        let apart: Vec<&str> = records.iter().filter(|r| r.body_apart).map(|r| &*r.id).collect();
        let mut found = self.store.get_raw_many(Family::Payloads, &apart)?.into_iter();
        Ok(records.iter().map(|r| r.body_apart.then(|| found.next().flatten())).collect())
    }

    /// Leaves out (and retires, without a broker ACK) the records whose kept-apart body is missing from the
    /// store: handing out an empty event would lose it, while the broker redelivers a retired one once its
    /// lease lapses. Returns the rest with their bodies (`None`: inline).
    async fn drop_bodiless(
        &self,
        taken: Vec<DeliveryRecord>,
        bodies: Vec<Option<Option<Vec<u8>>>>,
    ) -> (Vec<DeliveryRecord>, Vec<Option<Vec<u8>>>) {
        let mut kept = (Vec::with_capacity(taken.len()), Vec::with_capacity(taken.len()));
        for (record, body) in taken.into_iter().zip(bodies) {
            let body = match body {
                None => None,
                Some(Some(body)) => Some(body),
                Some(None) => {
                    tracing::warn!(delivery = %record.id, "Stored body missing; the broker will redeliver the event.");
                    counter!(m::STORE_UNDECODABLE, "family" => "payloads").increment(1);
                    self.retire(&record.id).await;
                    continue;
                }
            };
            kept.0.push(record);
            kept.1.push(body);
        }
        kept
    }

    /// `record` with its body read back from the store when it is kept apart (for the DLQ write).
    fn with_body(&self, mut record: DeliveryRecord) -> Result<Option<DeliveryRecord>, StoreError> {
        if !record.body_apart {
            return Ok(Some(record));
        }
        match self.store.get_raw_many(Family::Payloads, &[&record.id])?.pop().flatten() {
            Some(body) => {
                record.event.body = body;
                Ok(Some(record))
            }
            None => Ok(None),
        }
    }

    /// How many of `ids` are still handed to `holder` and unsettled; the others are dropped from the set.
    pub(super) fn retain_held(&self, holder: u64, ids: &mut std::collections::HashSet<String>) -> usize {
        let table = self.table.lock();
        ids.retain(|id| {
            table.deliveries.get(id.as_str()).is_some_and(|t| {
                t.holder == Some(holder) && matches!(t.record.phase, Phase::AwaitingAck { .. }) && !t.redispatch
            })
        });
        ids.len()
    }

    /// A push subscriber left: the deliveries it held (`ids`, its own record of them) stay in flight (their
    /// ACK timeout brings them back) but no longer count against it. Only those are looked at, not the table.
    pub(super) fn forget_holder(&self, holder: u64, ids: &[String]) {
        let mut table = self.table.lock();
        for id in ids {
            if let Some(tracked) = table.deliveries.get_mut(id.as_str()) {
                if tracked.holder == Some(holder) {
                    tracked.holder = None;
                }
            }
        }
    }
}

// === deliveries held by gRPC clients ===

impl Deliveries {
    /// Extends to `now + hold` the ACK deadline of every delivery one of `clients` holds with `auto_renew`,
    /// handed out less than `max_hold` ago; stored first, as every change. One pass over the table for all
    /// clients. Returns how many were extended.
    pub(super) async fn keep_held(
        &self,
        clients: &std::collections::HashSet<String>,
        hold: Duration,
        max_hold: Duration,
    ) -> Result<usize, DeliveryError> {
        let now = now_millis();
        let new_deadline = now + hold.as_millis() as i64;
        let hold_half = hold.as_millis() as i64 / 2;
        let oldest = now - max_hold.as_millis() as i64;
        let mut extended: Vec<DeliveryRecord> = Vec::new();
        {
            let mut table = self.table.lock();
            // Only what the live clients hold (the holder index), not the whole table.
            let held: Vec<Id> = clients.iter().flat_map(|client| table.held_by_client(client)).collect();
            for id in held {
                let Some(tracked) = table.deliveries.get_mut(&id) else { continue };
                let Phase::AwaitingAck { deadline_ms, dispatched_ms, holder: Some(holder) } = &tracked.record.phase
                else {
                    continue;
                };
                // Rewritten only once half the hold is used up, so a live client costs a write per delivery
                // every hold/2, not every keep-alive tick.
                // Only what the client took in: a message it never got must come back by its deadline.
                let due = holder.auto_renew && holder.written && *deadline_ms < now + hold_half;
                if !due || tracked.claimed || *dispatched_ms < oldest {
                    continue;
                }
                tracked.claimed = true;
                let mut record = tracked.record.clone();
                if let Phase::AwaitingAck { deadline_ms, .. } = &mut record.phase {
                    *deadline_ms = new_deadline;
                }
                extended.push(record);
            }
        }
        self.commit_claimed(extended).await
    }

    /// Stores `records` (each claimed by the caller) in one write and makes them the tracked ones, ending the
    /// claims; on a store failure nothing changes but the claims end all the same. Returns how many.
    async fn commit_claimed(&self, records: Vec<DeliveryRecord>) -> Result<usize, DeliveryError> {
        if records.is_empty() {
            return Ok(0);
        }
        let stored = self.persist(&records.iter().collect::<Vec<_>>()).await;
        let mut table = self.table.lock();
        for record in &records {
            if stored.is_ok() {
                table.set_record(record.clone());
            }
            if let Some(tracked) = table.deliveries.get_mut(&*record.id) {
                tracked.claimed = false;
            }
            table.wake(&record.id, 0);
        }
        stored.map(|()| records.len()).map_err(DeliveryError::from)
    }

    /// The hand-outs `handed` (delivery id, hand-out number) reached their gRPC client: each one still held
    /// as that hand-out is stored as written, in one write. One being settled meanwhile is left alone (its
    /// settlement decides). Returns how many were marked.
    pub(super) async fn mark_written(&self, handed: &[(String, u32)]) -> Result<usize, DeliveryError> {
        let mut marked: Vec<DeliveryRecord> = Vec::new();
        {
            let mut table = self.table.lock();
            for (id, handout) in handed {
                let Some(tracked) = table.deliveries.get_mut(id.as_str()) else { continue };
                if tracked.claimed || !tracked.held_as(*handout) {
                    continue;
                }
                let mut record = tracked.record.clone();
                let Phase::AwaitingAck { holder: Some(holder), .. } = &mut record.phase else { continue };
                if holder.written {
                    continue;
                }
                holder.written = true;
                tracked.claimed = true;
                marked.push(record);
            }
        }
        self.commit_claimed(marked).await
    }

    /// The ids of the deliveries `client_id` holds.
    pub(super) fn held_by_client(&self, client_id: &str) -> Vec<String> {
        self.table.lock().held_by_client(client_id).iter().map(|id| id.to_string()).collect()
    }

    /// Sets the ACK deadline of a handed-out delivery to `now + by` (a SimpleConsumer's
    /// ChangeInvisibleDuration); returns the new deadline.
    pub(super) async fn extend<'a>(&self, target: impl Into<Target<'a>>, by: Duration) -> Result<i64, DeliveryError> {
        let target = target.into();
        let id = target.id;
        let mut record = self.claim(target).await?;
        if let Err(refused) = self.check_settleable(&record) {
            self.release(id, OwedWork::NotFailed);
            return Err(refused);
        }
        let new_deadline = epoch_ms_after(now_millis(), by);
        if let Phase::AwaitingAck { deadline_ms, .. } = &mut record.phase {
            *deadline_ms = new_deadline;
        }
        self.commit(record, OwedWork::NotFailed).await?;
        Ok(new_deadline)
    }

    /// Who holds a tracked delivery, and for which group and topic.
    pub(super) fn hold_of(&self, id: &str) -> Option<(String, String, Option<Holder>)> {
        let table = self.table.lock();
        let record = &table.deliveries.get(id)?.record;
        let holder = match &record.phase {
            Phase::AwaitingAck { holder, .. } => holder.clone(),
            _ => None,
        };
        Some((record.group.to_string(), record.topic.to_string(), holder))
    }
}

// === settlement by subscribers ===

impl Deliveries {
    /// Marks the target delivery claimed for the caller and returns a copy of its record, waiting while another
    /// task has it. A target naming an earlier hand-out than the current one is refused.
    async fn claim(&self, target: impl Into<Target<'_>>) -> Result<DeliveryRecord, DeliveryError> {
        let Target { id, handout } = target.into();
        let started = tokio::time::Instant::now();
        loop {
            {
                let mut table = self.table.lock();
                match table.deliveries.get_mut(id) {
                    None => {
                        return Err(if table.stale.contains_key(id) {
                            DeliveryError::Stale
                        } else {
                            DeliveryError::Unknown
                        });
                    }
                    // Surrendered to the broker with its FIFO group's lost head: popgate no longer owns it.
                    Some(tracked) if tracked.surrender => return Err(DeliveryError::Stale),
                    // Handed out again since the hand-out the caller settles, or that hand-out's time ran out:
                    // not the caller's to settle any more.
                    Some(tracked) if handout.is_some_and(|n| !tracked.held_as(n)) => {
                        return Err(DeliveryError::Superseded)
                    }
                    Some(tracked) if !tracked.claimed => {
                        tracked.claimed = true;
                        return Ok(tracked.record.clone());
                    }
                    Some(_) => {}
                }
            }
            if started.elapsed() > CLAIM_WAIT {
                return Err(DeliveryError::Busy);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Ends a claim without a change; `owed` tells whether owed broker work failed (it is tried again after
    /// its backoff).
    fn release(&self, id: &str, owed: OwedWork) {
        let mut table = self.table.lock();
        if let Some(tracked) = table.deliveries.get_mut(id) {
            tracked.claimed = false;
            if owed == OwedWork::Failed {
                tracked.owed_work_failed(now_millis());
            }
            table.wake(id, 0);
        }
    }

    /// Persists `record` and makes it the tracked one, ending the claim; on a store failure nothing changes
    /// (the claim ends all the same, so the next tick or request can try again).
    async fn commit(&self, mut record: DeliveryRecord, owed: OwedWork) -> Result<(), DeliveryError> {
        let id = record.id.clone();
        if let Err(error) = self.persist(&[&record]).await {
            self.release(&id, owed);
            return Err(error.into());
        }
        let mut table = self.table.lock();
        table.intern(&mut record);
        table.set_record(record);
        if let Some(tracked) = table.deliveries.get_mut(&*id) {
            tracked.claimed = false;
            if owed == OwedWork::Failed {
                tracked.owed_work_failed(now_millis());
            }
        }
        table.wake(&id, 0);
        Ok(())
    }

    /// Only a delivery that is handed out (or was, before a crash) may be settled by a subscriber.
    fn check_settleable(&self, record: &DeliveryRecord) -> Result<(), DeliveryError> {
        match record.phase {
            Phase::AwaitingAck { .. } => {}
            Phase::Acked => return Err(DeliveryError::Unknown),
            Phase::Ready { .. } | Phase::DeadLetter { .. } => return Err(DeliveryError::NotInFlight),
        }
        if record.handle.lease_deadline_ms() <= now_millis() {
            // The broker answers SUCCESS even to a lapsed handle, so the check is ours.
            return Err(DeliveryError::Stale);
        }
        Ok(())
    }

    /// The subscriber's ACK: the ACK intent is stored, then the broker is ACKed; a failed broker ACK is
    /// retried from the intent, so the client's answer does not depend on it.
    pub(super) async fn ack(&self, target: impl Into<Target<'_>>) -> Result<(), DeliveryError> {
        self.ack_many(&[target.into()]).await.pop().unwrap_or(Err(DeliveryError::Unknown))
    }

    /// A batch of subscriber ACKs, each answered as [`Deliveries::ack`] would. Cheaper than one by one: the
    /// ACK intents are stored in one write, and the broker gets one batch ACK request per broker instead of
    /// one request per message. An id given again in the same batch is ACKed again after the batch, as two
    /// single ACKs would be (so it is answered "unknown": already acknowledged).
    pub(super) async fn ack_many(&self, ids: &[Target<'_>]) -> Vec<Result<(), DeliveryError>> {
        let mut seen = HashSet::new();
        let (first, again): (Vec<usize>, Vec<usize>) = (0..ids.len()).partition(|&i| seen.insert(ids[i].id));
        let first_ids: Vec<Target<'_>> = first.iter().map(|&i| ids[i]).collect();
        let mut answers: Vec<Option<Result<(), DeliveryError>>> =
            std::iter::repeat_with(|| None).take(ids.len()).collect();
        for (&index, answer) in first.iter().zip(self.ack_unique(&first_ids).await) {
            answers[index] = Some(answer);
        }
        for index in again {
            answers[index] = self.ack_unique(&[ids[index]]).await.pop();
        }
        answers.into_iter().map(|answer| answer.unwrap_or(Err(DeliveryError::Unknown))).collect()
    }

    /// ACKs distinct ids: each is claimed and checked, the ACK intents of those that may be ACKed are stored
    /// in one write, then the broker is ACKed. Every answer is counted in `popgate_acks_total`.
    async fn ack_unique(&self, ids: &[Target<'_>]) -> Vec<Result<(), DeliveryError>> {
        let claims = futures::future::join_all(ids.iter().map(|target| self.claim(*target))).await;
        let keys: Vec<String> =
            claims.iter().flatten().map(|record| Subscription::key_of(&record.group, &record.topic)).collect();
        let mut answers = Vec::with_capacity(ids.len());
        let mut acked: Vec<(usize, DeliveryRecord)> = Vec::new();
        let mut repeated = Vec::new();
        for (index, (target, claim)) in ids.iter().zip(claims).enumerate() {
            let checked = claim.and_then(|record| match self.check_settleable(&record) {
                Ok(()) => Ok(record),
                Err(refused) => {
                    self.release(target.id, OwedWork::NotFailed);
                    Err(refused)
                }
            });
            // The same hand-out ACKed again (its answer was lost on the way): answered as the first ACK was.
            let checked = match checked {
                Err(DeliveryError::Unknown) if self.was_acked(*target) => {
                    repeated.push(index);
                    answers.push(Ok(()));
                    continue;
                }
                other => other,
            };
            answers.push(checked.map(|mut record| {
                if let Phase::AwaitingAck { dispatched_ms, .. } = record.phase {
                    histogram!(m::ACK_LATENCY).record((now_millis() - dispatched_ms).max(0) as f64 / 1000.0);
                }
                record.phase = Phase::Acked;
                acked.push((index, record));
            }));
        }
        if let Err(error) = self.persist(&acked.iter().map(|(_, r)| r).collect::<Vec<_>>()).await {
            // Nothing of the batch was stored: each intent is stored alone, so each gets its own answer.
            tracing::debug!(%error, "Storing a batch of ACK intents failed; storing them one by one.");
            let mut stored = Vec::with_capacity(acked.len());
            for (index, record) in acked {
                match self.persist(&[&record]).await {
                    Ok(()) => stored.push((index, record)),
                    Err(error) => {
                        self.release(&record.id, OwedWork::NotFailed);
                        answers[index] = Err(error.into());
                    }
                }
            }
            acked = stored;
        }
        // Counted where the intents are stored, before the broker ACKs they allow.
        for (index, answer) in answers.iter().enumerate() {
            let result = match answer {
                Ok(()) if repeated.contains(&index) => "repeated",
                Ok(()) => "acked",
                Err(error) => error.code(),
            };
            counter!(m::ACKS, "result" => result).increment(1);
        }
        let acked: Vec<DeliveryRecord> = acked.into_iter().map(|(_, record)| record).collect();
        {
            let mut table = self.table.lock();
            let now = now_millis();
            for record in &acked {
                table.acked.remember(record.id.clone(), record.handouts, now);
                table.set_record(record.clone());
                if let Some(tracked) = table.deliveries.get_mut(&*record.id) {
                    tracked.redispatch = false;
                }
            }
        }
        self.broker_ack_many(&acked).await;
        // A settled delivery frees a push subscriber's prefetch slot and may unblock its message group.
        self.ring_each(keys);
        answers
    }

    /// [`Deliveries::broker_ack`] for many claimed deliveries: one batch ACK request per broker; what the
    /// broker did not take in the batch is ACKed alone.
    async fn broker_ack_many(&self, records: &[DeliveryRecord]) {
        if let [record] = records {
            return self.broker_ack(record).await;
        }
        if records.is_empty() {
            return;
        }
        let entries: Vec<AckEntry<'_>> =
            records.iter().map(|r| AckEntry { group: &r.group, topic: &r.topic, handle: &r.handle }).collect();
        let answers = self.cluster.ack_batch(&entries).await;
        let mut alone = Vec::new();
        for (record, answer) in records.iter().zip(answers) {
            match answer {
                Ok(true) => self.broker_acked(record, Ok(())).await,
                Ok(false) => alone.push(record),
                Err(error) => self.broker_acked(record, Err(error)).await,
            }
        }
        futures::future::join_all(alone.into_iter().map(|r| self.broker_ack(r))).await;
    }

    /// ACKs the broker for a claimed delivery whose ACK intent (or DLQ write) is done, and retires it; on
    /// failure the claim ends and the sweeper retries after a pause.
    async fn broker_ack(&self, record: &DeliveryRecord) {
        let result = self.cluster.ack(&record.group, &record.handle).await;
        self.broker_acked(record, result).await;
    }

    /// The end of a broker ACK: retired when the broker took it; otherwise the claim ends and the sweeper
    /// retries from the ACK intent after a pause.
    async fn broker_acked(&self, record: &DeliveryRecord, result: Result<(), BrokerError>) {
        match result {
            Ok(()) => {
                counter!(m::BROKER_ACKS).increment(1);
                self.retire(&record.id).await;
            }
            Err(error) => {
                counter!(m::BROKER_ACK_FAILURES).increment(1);
                tracing::warn!(%error, delivery = %record.id, "Broker ACK failed; retrying from the ACK intent.");
                self.release(&record.id, OwedWork::Failed);
            }
        }
    }

    /// Whether `target` names a hand-out whose ACK was stored lately (a repeated ACK). Only targets that name
    /// their hand-out: an HTTP delivery id ACKed twice is answered "unknown", as it always was.
    fn was_acked(&self, target: Target<'_>) -> bool {
        target.handout.is_some_and(|handout| self.table.lock().acked.contains(target.id, handout, now_millis()))
    }

    /// The subscriber's NACK: the attempt is spent; the next is scheduled after `delay` (or the backoff).
    pub(super) async fn nack<'a>(
        &self,
        target: impl Into<Target<'a>>,
        delay: Option<Duration>,
    ) -> Result<NackOutcome, DeliveryError> {
        let target = target.into();
        let id = target.id;
        let mut record = self.claim(target).await?;
        if let Err(refused) = self.check_settleable(&record) {
            self.release(id, OwedWork::NotFailed);
            return Err(refused);
        }
        let outcome = self.spend_attempt(&mut record, "nack", delay);
        self.commit(record, OwedWork::NotFailed).await?;
        self.after_spent(id, &outcome, "nack");
        Ok(outcome)
    }

    /// The subscriber's TERM: straight to the DLQ with its reason.
    pub(super) async fn term<'a>(&self, target: impl Into<Target<'a>>, reason: &str) -> Result<(), DeliveryError> {
        let target = target.into();
        let id = target.id;
        let mut record = self.claim(target).await?;
        if let Err(refused) = self.check_settleable(&record) {
            self.release(id, OwedWork::NotFailed);
            return Err(refused);
        }
        record.last_failure = Some(format!("terminated: {reason}"));
        record.phase = Phase::DeadLetter { reason: format!("terminated by the subscriber: {reason}") };
        self.commit(record, OwedWork::NotFailed).await?;
        self.after_spent(id, &NackOutcome::DeadLetter, "term");
        Ok(())
    }

    /// Applies a failed attempt to `record`: the next attempt after the backoff (or `delay`), or the DLQ.
    fn spend_attempt(&self, record: &mut DeliveryRecord, reason: &str, delay: Option<Duration>) -> NackOutcome {
        record.last_failure = Some(reason.to_owned());
        let policy = self
            .table
            .lock()
            .subs
            .get(&Subscription::key_of(&record.group, &record.topic))
            .map(|a| a.policy)
            .unwrap_or_else(|| RetryPolicy::from_config(&self.config).unwrap_or(RetryPolicy::SEED_DEFAULT));
        match policy.next(record.attempt, &mut rand::rng()) {
            NextStep::RetryAfter(backoff, next) => {
                let due_ms = epoch_ms_after(now_millis(), delay.unwrap_or(backoff));
                record.attempt = next;
                record.phase = Phase::Ready { due_ms };
                NackOutcome::Retry { attempt: next, due_ms }
            }
            NextStep::DeadLetter => {
                record.phase = Phase::DeadLetter { reason: reason.to_owned() };
                NackOutcome::DeadLetter
            }
        }
    }

    /// After an attempt was spent (stored): the delivery leaves its holder, and its group may move on.
    fn after_spent(&self, id: &str, outcome: &NackOutcome, reason: &'static str) {
        let key = self.table.lock().deliveries.get_mut(id).map(|tracked| {
            tracked.holder = None;
            tracked.redispatch = false;
            tracked.key()
        });
        if matches!(outcome, NackOutcome::Retry { .. }) {
            counter!(m::REDELIVERIES, "reason" => reason).increment(1);
        }
        self.ring_each(key);
    }

    /// A push transport could not hand these deliveries to its subscriber (the write failed, the connection
    /// is gone): they are dispatched again at once, to any subscriber. The subscriber never saw them, so no
    /// attempt is spent.
    pub(super) async fn push_failed(&self, ids: &[String], transport: &'static str, reason: &'static str) {
        for id in ids {
            let Ok(mut record) = self.claim(id).await else { continue };
            if !matches!(record.phase, Phase::AwaitingAck { .. }) {
                self.release(id, OwedWork::NotFailed);
                continue;
            }
            record.phase = Phase::Ready { due_ms: now_millis() };
            if self.commit(record, OwedWork::NotFailed).await.is_err() {
                continue;
            }
            if reason == "push_failure" {
                counter!(m::PUSH_WRITE_FAILURES, "transport" => transport).increment(1);
            }
            counter!(m::REDELIVERIES, "reason" => "push_failure").increment(1);
            if let Some(tracked) = self.table.lock().deliveries.get_mut(id.as_str()) {
                tracked.holder = None;
            }
        }
        self.queue_now(ids);
    }
}

// === the sweeper's side: timers, owed broker work, leases ===

impl Deliveries {
    /// Queues `ids` for hand-out now if they are dispatchable and subscribed (newly admitted, handed back),
    /// without waiting for the next sweep, and wakes waiting subscribers. The others are the sweeper's.
    fn queue_now(&self, ids: &[String]) {
        let now = now_millis();
        let mut keys = Vec::new();
        let mut guard = self.table.lock();
        for id in ids {
            let Some(id) = guard.id(id) else { continue };
            let Table { subs, deliveries, .. } = &mut *guard;
            let Some(tracked) = deliveries.get_mut(&id) else { continue };
            if tracked.queued || tracked.claimed || !tracked.dispatchable(now) {
                continue;
            }
            let key = tracked.key();
            if let Some(active) = subs.get_mut(&key) {
                tracked.queued = true;
                active.ready.push_back(id);
                keys.push(key);
            }
        }
        drop(guard);
        self.ring_each(keys);
    }

    /// One sweeper tick over the deliveries filed as due: queues what is ready, spends the attempt of what
    /// missed its ACK deadline, gives up what lost its lease, and returns the broker work that is owed.
    pub(super) async fn sweep(&self, now: i64) -> Vec<Owed> {
        let half_lease = (self.config.lease_ms / 2) as i64;
        let mut owed = Vec::new();
        let mut broker_acks = Vec::new();
        let mut expired = Vec::new();
        let mut lapsed = Vec::new();
        let mut newly_ready: Vec<String> = Vec::new();
        {
            let mut guard = self.table.lock();
            let table = &mut *guard;
            table.stale.retain(|_, until| *until > now);
            table.acked.expire(now);
            let mut due: Vec<Id> = Vec::new();
            while table.timers.peek().is_some_and(|std::cmp::Reverse((at, _))| *at <= now) {
                if let Some(std::cmp::Reverse((_, id))) = table.timers.pop() {
                    due.push(id);
                }
            }
            due.sort_unstable();
            due.dedup();
            for id in due {
                let Some(tracked) = table.deliveries.get_mut(&id) else { continue };
                if tracked.claimed {
                    // The task acting on it files it again when its claim ends.
                    continue;
                }
                let key = tracked.key();
                let subscribed = table.subs.contains_key(&key);
                let lease_deadline = tracked.record.handle.lease_deadline_ms();
                if tracked.unsettled() && !subscribed {
                    tracked.claimed = true;
                    owed.push(Owed::GiveBack(id, "unsubscribed"));
                    continue;
                }
                if tracked.surrender {
                    tracked.claimed = true;
                    owed.push(Owed::GiveBack(id, "fifo_head_lost"));
                    continue;
                }
                if tracked.unsettled() && lease_deadline <= now {
                    tracked.claimed = true;
                    lapsed.push(id);
                    continue;
                }
                let owed_due = tracked.owed_retry_ms <= now;
                let mut next = lease_deadline.min((lease_deadline - half_lease).max(tracked.renew_retry_ms));
                match &tracked.record.phase {
                    Phase::AwaitingAck { deadline_ms, .. } if *deadline_ms <= now && !tracked.redispatch => {
                        tracked.claimed = true;
                        expired.push(tracked.record.clone());
                        continue;
                    }
                    Phase::AwaitingAck { deadline_ms, .. } if !tracked.redispatch => next = next.min(*deadline_ms),
                    Phase::Acked if owed_due => {
                        tracked.claimed = true;
                        broker_acks.push(id);
                        continue;
                    }
                    // A DLQ write runs unclaimed and wakes its delivery when it ends; until then the sweeper
                    // still owes it its lease renewals (below), so no `continue` here.
                    Phase::DeadLetter { .. } if tracked.dlq_write_in_flight => {}
                    Phase::DeadLetter { .. } if owed_due => {
                        tracked.dlq_write_in_flight = true;
                        owed.push(Owed::DeadLetter(id.clone()));
                    }
                    Phase::Acked | Phase::DeadLetter { .. } => next = next.min(tracked.owed_retry_ms),
                    Phase::Ready { due_ms } if *due_ms > now => next = next.min(*due_ms),
                    _ => {}
                }
                if let Some(after) = self.give_back_unclaimed_ms.filter(|_| tracked.dispatchable(now)) {
                    let unclaimed = table.subs.get(&key).is_some_and(|a| a.unclaimed(now.saturating_sub(after)));
                    if unclaimed {
                        tracked.claimed = true;
                        owed.push(Owed::GiveBack(id, "unclaimed"));
                        continue;
                    }
                    // Looked at again once it may have become so.
                    next = next.min(now + after);
                }
                if tracked.dispatchable(now) && !tracked.queued {
                    if let Some(active) = table.subs.get_mut(&key) {
                        tracked.queued = true;
                        active.ready.push_back(id.clone());
                        newly_ready.push(key);
                    }
                }
                // Every owned delivery is renewed, owed work included: a broker outage longer than the lease
                // must not turn a recorded ACK or a pending DLQ write into a redelivery.
                if lease_deadline - now < half_lease && tracked.renew_retry_ms <= now {
                    owed.push(Owed::Renew(id));
                    continue;
                }
                table.timers.push(std::cmp::Reverse((next.max(now + 1), id)));
            }
            Self::set_pending_gauge(table);
        }
        if !broker_acks.is_empty() {
            owed.push(Owed::BrokerAcks(broker_acks));
        }
        // Each is its own write; together they share the store's group commits.
        futures::future::join_all(lapsed.iter().map(|id| self.give_up_lease(id))).await;
        let spent: Vec<String> = expired.iter().map(|r| Subscription::key_of(&r.group, &r.topic)).collect();
        futures::future::join_all(expired.into_iter().map(|record| self.expire(record))).await;
        if !newly_ready.is_empty() || !spent.is_empty() {
            self.ring_each(newly_ready.into_iter().chain(spent));
        }
        owed
    }

    /// An unACKed delivery past its deadline: the attempt is spent. A failed write leaves it as it was
    /// (still awaiting ACK, past its deadline), so the next tick tries again.
    async fn expire(&self, mut record: DeliveryRecord) {
        let id = record.id.clone();
        let outcome = self.spend_attempt(&mut record, "ack timeout", None);
        if self.commit(record, OwedWork::NotFailed).await.is_ok() {
            self.after_spent(&id, &outcome, "timeout");
        }
    }

    /// The lease lapsed (popgate was down, hung, or could not renew): the broker may already have handed
    /// the message to someone else and will redeliver it, so popgate stops claiming it.
    ///
    /// In an ordered subscription the later events of its message group go with it: the broker redelivers
    /// the lapsed one, and any of them handed out meanwhile would overtake it. They are marked to surrender
    /// (never handed out or settled again) and filed, so the next sweep gives each back to the broker as
    /// soon as nobody acts on it, and the broker's orderly POP brings the group back in order.
    async fn give_up_lease(&self, id: &str) {
        tracing::warn!(delivery = %id, "Broker lease lapsed; the broker will redeliver the event.");
        counter!(m::LEASES_LOST).increment(1);
        {
            let mut table = self.table.lock();
            let followers = match table.deliveries.get(id) {
                Some(head) if table.subs.get(&head.key()).is_some_and(|a| a.sub.ordered) => table.followers(head),
                _ => Vec::new(),
            };
            for follower in followers {
                if let Some(tracked) = table.deliveries.get_mut(&follower) {
                    tracked.surrender = true;
                }
                table.wake(&follower, 0);
            }
        }
        self.retire(id).await;
        self.remember_stale(id);
    }

    /// A late ACK of `id` is answered "stale" (409) rather than "unknown" for a while.
    fn remember_stale(&self, id: &str) {
        self.table.lock().stale.insert(id.to_owned(), now_millis() + STALE_MEMORY_MS);
    }

    /// Forgets a delivery everywhere: ACKed at the broker, dead-lettered, given back, or given up.
    async fn retire(&self, id: &str) {
        // A failed delete leaves a record that boot recovery settles again (its lease will have lapsed, or
        // its ACK intent is replayed): harmless, and the store counts the failure.
        let _ = self.store.apply(&[Change::Delete(Family::Deliveries, id), Change::Delete(Family::Payloads, id)]).await;
        let mut table = self.table.lock();
        table.remove(id);
        Self::set_pending_gauge(&table);
    }

    /// Runs one piece of owed broker work found by [`Deliveries::sweep`].
    pub(super) async fn perform(&self, owed: Owed) {
        match owed {
            Owed::BrokerAcks(ids) => {
                let records: Vec<DeliveryRecord> = ids.iter().filter_map(|id| self.tracked_record(id)).collect();
                self.broker_ack_many(&records).await;
            }
            Owed::DeadLetter(id) => {
                if let Some(record) = self.tracked_record(&id) {
                    self.dead_letter(record).await;
                }
            }
            Owed::Renew(id) => self.renew(&id).await,
            Owed::GiveBack(id, reason) => {
                if let Some(record) = self.tracked_record(&id) {
                    self.give_back_at_broker(&record.group, &record.handle, reason).await;
                    self.retire(&id).await;
                    if reason == "fifo_head_lost" {
                        self.remember_stale(&id);
                    }
                    self.ring(&Subscription::key_of(&record.group, &record.topic));
                }
            }
        }
    }

    /// A copy of a tracked delivery's record (the sweeper claimed it, or marked its DLQ write).
    fn tracked_record(&self, id: &str) -> Option<DeliveryRecord> {
        self.table.lock().deliveries.get(id).map(|t| t.record.clone())
    }

    /// Writes the event to `%DLQ%<group>`; only then ACKs the original at the broker and retires it.
    ///
    /// The write runs unclaimed: with its retries on other brokers it may take longer than a lease, and the
    /// lease must be renewed meanwhile or the broker redelivers the event. The broker ACK does claim it, so
    /// it waits for a renewal in progress and carries the handle that renewal returned.
    async fn dead_letter(&self, record: DeliveryRecord) {
        let id = record.id.clone();
        let record = match self.with_body(record) {
            Ok(Some(record)) => record,
            Ok(None) => {
                // Nothing to write: retired without a broker ACK, so the broker redelivers the event.
                tracing::warn!(delivery = %id, "Stored body missing; the broker will redeliver the event.");
                counter!(m::STORE_UNDECODABLE, "family" => "payloads").increment(1);
                self.end_dlq_write(&id, OwedWork::NotFailed);
                self.retire(&id).await;
                return;
            }
            Err(error) => {
                counter!(m::DLQ_RECORD_FAILURES).increment(1);
                tracing::warn!(%error, delivery = %id, "Could not read the body for the DLQ write; will retry.");
                self.end_dlq_write(&id, OwedWork::Failed);
                return;
            }
        };
        if let Err(error) = self.cluster.dead_letter(&record).await {
            counter!(m::DLQ_RECORD_FAILURES).increment(1);
            tracing::warn!(%error, delivery = %id, "DLQ write failed; the delivery stays in flight and will retry.");
            self.end_dlq_write(&id, OwedWork::Failed);
            return;
        }
        counter!(m::DLQ_MESSAGES, "group" => record.group.clone()).increment(1);
        // Claimed before the in-flight mark is cleared, so the sweeper never starts a second write between.
        let claimed = self.claim(&id).await;
        self.end_dlq_write(&id, OwedWork::NotFailed);
        let Ok(mut record) = claimed else {
            // Held by a renewal for longer than a claim waits: the next sweep writes the DLQ again, a
            // duplicate there and never a loss.
            tracing::warn!(delivery = %id, "Could not claim a dead-lettered delivery for its broker ACK.");
            return;
        };
        match self.cluster.ack(&record.group, &record.handle).await {
            Ok(()) => {
                counter!(m::BROKER_ACKS).increment(1);
                self.retire(&record.id).await;
                self.ring(&Subscription::key_of(&record.group, &record.topic));
            }
            Err(error) => {
                counter!(m::BROKER_ACK_FAILURES).increment(1);
                tracing::warn!(%error, delivery = %record.id, "Broker ACK after the DLQ write failed; will retry.");
                // The DLQ has the event: from here only the broker ACK is owed, never a second DLQ write. If
                // this write fails too, the next try writes the DLQ again: a duplicate there, never a loss.
                record.phase = Phase::Acked;
                let _ = self.commit(record, OwedWork::Failed).await;
            }
        }
    }

    /// Ends a DLQ write: on failure the next try waits for its backoff.
    fn end_dlq_write(&self, id: &str, owed: OwedWork) {
        let mut table = self.table.lock();
        if let Some(tracked) = table.deliveries.get_mut(id) {
            tracked.dlq_write_in_flight = false;
            if owed == OwedWork::Failed {
                tracked.owed_work_failed(now_millis());
            }
            table.wake(id, 0);
        }
    }

    /// Extends the lease. The new handle is stored before it is relied on; the old one is dead either way.
    async fn renew(&self, id: &str) {
        let half_lease = (self.config.lease_ms / 2) as i64;
        let record = {
            let mut table = self.table.lock();
            let now = now_millis();
            let Some(tracked) = table.deliveries.get_mut(id) else { return };
            if tracked.claimed {
                // Another task has it; the sweeper gets it back when that claim ends.
                return;
            }
            let lease_deadline = tracked.record.handle.lease_deadline_ms();
            if lease_deadline <= now || lease_deadline - now >= half_lease || tracked.renew_retry_ms > now {
                // Lapsed meanwhile (the sweeper gives it up) or no longer due.
                table.wake(id, 0);
                return;
            }
            tracked.claimed = true;
            tracked.record.clone()
        };
        match self.cluster.renew(&record.group, &record.handle, self.config.lease_ms).await {
            Ok(handle) => {
                if let Some(tracked) = self.table.lock().deliveries.get_mut(id) {
                    tracked.renew_failures = 0;
                }
                let mut renewed = record;
                renewed.handle = handle.clone();
                if self.commit(renewed, OwedWork::NotFailed).await.is_err() {
                    // The old handle is dead whatever the store says: memory must hold the new one. After a
                    // crash the stored (dead) handle only means the broker redelivers: a duplicate, no loss.
                    if let Some(tracked) = self.table.lock().deliveries.get_mut(id) {
                        tracked.record.handle = handle;
                    }
                }
            }
            Err(error) => {
                counter!(m::CONSUME_REQUEST_FAILURES, "op" => "renew").increment(1);
                tracing::warn!(%error, delivery = %id, "Lease renewal failed; will retry until the lease lapses.");
                let mut table = self.table.lock();
                if let Some(tracked) = table.deliveries.get_mut(id) {
                    tracked.claimed = false;
                    tracked.renewal_failed(now_millis());
                }
                table.wake(id, 0);
            }
        }
    }
}

// === boot recovery and the admin view ===

impl Deliveries {
    /// Tracks a stored record again after a restart (see `recovery`). A delivery that was handed out stays
    /// ACKable by its holder and is dispatched again at once, attempt kept; one a gRPC client took in stays
    /// with that client until its deadline.
    pub(super) fn restore(&self, record: DeliveryRecord) -> Restored {
        let mut table = self.table.lock();
        if table.deliveries.contains_key(&*record.id) {
            return Restored::Skipped;
        }
        self.next_seq.fetch_max(record.seq + 1, Ordering::Relaxed);
        let outcome = match record.phase {
            Phase::AwaitingAck { .. } => Restored::Redispatched { was_handed_out: true },
            Phase::Ready { .. } => Restored::Redispatched { was_handed_out: false },
            Phase::Acked => Restored::AckPending,
            Phase::DeadLetter { .. } => Restored::DeadLetterPending,
        };
        let mut tracked = Tracked::new(record);
        // A gRPC client keeps its handles across the restart and ACKs with them: what it took in stays handed
        // out until its deadline. Any other hand-out is dispatched again at once, and so is one recorded for a
        // gRPC client that popgate died before writing to it (it never got the message).
        tracked.redispatch = match &tracked.record.phase {
            Phase::AwaitingAck { holder: Some(holder), .. } => !holder.written,
            Phase::AwaitingAck { holder: None, .. } => true,
            _ => false,
        };
        table.insert(tracked);
        Self::set_pending_gauge(&table);
        outcome
    }

    /// Removes a stored record that no longer decodes, without any broker ACK.
    pub(super) async fn discard_undecodable(&self, key: &str) {
        let _ =
            self.store.apply(&[Change::Delete(Family::Deliveries, key), Change::Delete(Family::Payloads, key)]).await;
    }

    /// The consumer group of a tracked delivery (to authorize its ACK, NACK or TERM).
    pub(super) fn source_of(&self, id: &str) -> Option<(String, String)> {
        self.table.lock().deliveries.get(id).map(|t| (t.record.group.to_string(), t.record.topic.to_string()))
    }

    /// When the oldest unsettled delivery (ready or handed out) of each subscription key was popped (epoch
    /// ms), for the oldest-unacknowledged-age gauge; keys with none are absent. Read-only.
    pub(super) fn oldest_unsettled_ms(&self) -> HashMap<String, i64> {
        let table = self.table.lock();
        let mut oldest: HashMap<(Arc<str>, Arc<str>), i64> = HashMap::new();
        for tracked in table.deliveries.values().filter(|t| t.unsettled()) {
            let (record, at) = (&tracked.record, tracked.admitted_ms);
            oldest.entry((record.group.clone(), record.topic.clone())).and_modify(|o| *o = (*o).min(at)).or_insert(at);
        }
        drop(table);
        oldest.into_iter().map(|((group, topic), at)| (Subscription::key_of(&group, &topic), at)).collect()
    }

    /// Up to `max` tracked deliveries (of `group`, when given), oldest admission first.
    pub(super) fn in_flight(&self, group: Option<&str>, max: usize) -> Vec<InFlight> {
        let table = self.table.lock();
        let mut found: Vec<&Tracked> =
            table.deliveries.values().map(|t| &**t).filter(|t| group.is_none_or(|g| &*t.record.group == g)).collect();
        found.sort_by_key(|t| t.record.seq);
        found
            .into_iter()
            .take(max)
            .map(|tracked| {
                let record = &tracked.record;
                let (phase, due_ms) = match &record.phase {
                    Phase::Ready { due_ms } => ("ready", Some(*due_ms)),
                    Phase::AwaitingAck { deadline_ms, .. } => ("awaiting_ack", Some(*deadline_ms)),
                    Phase::Acked => ("ack_pending", None),
                    Phase::DeadLetter { .. } => ("dead_letter_pending", None),
                };
                InFlight {
                    delivery_id: record.id.to_string(),
                    group: record.group.to_string(),
                    topic: record.topic.to_string(),
                    event_id: record.event.id.clone(),
                    attempt: record.attempt,
                    phase,
                    due_ms,
                    subscriber: tracked.holder.map(|h| format!("push-{h}")),
                    last_failure: record.last_failure.clone(),
                    lease_deadline_ms: record.handle.lease_deadline_ms(),
                }
            })
            .collect()
    }
}

/// The records a hand-out claimed, put back in the queue if the hand-out ends early: by an error, or because
/// its future was dropped (cancelled) before it stored them. A stored hand-out empties it.
struct PutBackOnDrop<'a> {
    deliveries: &'a Deliveries,
    key: &'a str,
    ids: Vec<Id>,
}

impl Drop for PutBackOnDrop<'_> {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.deliveries.put_back(self.key, &self.ids);
        }
    }
}

/// A fresh 128-bit random delivery id (32 hex chars): unguessable and never reused across restarts.
pub fn new_delivery_id(instance: &str) -> String {
    let mut bytes = [0u8; 16];
    rand::rng().fill_bytes(&mut bytes);
    if instance.is_empty() {
        return hex::encode(bytes);
    }
    format!("{instance}{INSTANCE_SEPARATOR}{}", hex::encode(bytes))
}

/// Between the instance that minted a delivery id and the id's random part: a character no instance id and no
/// hex digit has, and that every front carries as it is (URLs, gRPC and remoting handles).
const INSTANCE_SEPARATOR: char = '~';

/// The instance that minted delivery id `id`, when the id names one (ids of a popgate before tiers name none).
pub fn instance_of(id: &str) -> Option<&str> {
    id.split_once(INSTANCE_SEPARATOR).map(|(instance, _)| instance).filter(|instance| !instance.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::test_support::{offline_parts, subscription};

    /// Deliveries over a fresh store, with a broker client that reaches nothing (none of this needs one).
    async fn offline(dir: &std::path::Path) -> Deliveries {
        let store = Arc::new(StateStore::open(dir, true).expect("open"));
        let (broker, publisher, config) = offline_parts().await;
        Deliveries::new(store, broker, publisher, config)
    }

    /// [`offline`] deliveries with `sub` in place (the seed's retry policy).
    async fn subscribed(dir: &std::path::Path, sub: &Subscription) -> Deliveries {
        let deliveries = offline(dir).await;
        deliveries.put_subscription(sub.clone(), RetryPolicy::SEED_DEFAULT).await.expect("subscribe");
        deliveries
    }

    fn popped(body: &[u8]) -> Popped {
        crate::delivery::test_support::popped("msg-1", body, 0)
    }

    /// A popped event of FIFO message group `group`.
    fn popped_in_group(body: &[u8], group: &str) -> Popped {
        let mut popped = popped(body);
        popped.event.message_group = Some(group.to_owned());
        popped
    }

    fn long_poll() -> HandOut {
        HandOut { transport: "poll", ack_timeout: None, holder: None, fifo_batch: false }
    }

    /// The tracked id of the delivery whose body is `body`.
    fn id_of(deliveries: &Deliveries, body: &[u8]) -> Id {
        let table = deliveries.table.lock();
        let ids: Vec<Id> = table.deliveries.keys().cloned().collect();
        drop(table);
        let bodies = ids.iter().map(|id| deliveries.store.get_raw_many(Family::Payloads, &[id]).expect("read"));
        ids.iter()
            .zip(bodies)
            .find(|(_, b)| b.first().cloned().flatten().as_deref() == Some(body))
            .expect("found")
            .0
            .clone()
    }

    #[tokio::test]
    async fn a_hand_out_cancelled_while_it_is_stored_puts_its_deliveries_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = subscription();
        let deliveries = subscribed(dir.path(), &sub).await;
        assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"e")]).await, Admission::Admitted));
        // The caller stops waiting (its client went away) while the hand-out is being stored.
        deliveries.store.slow_down_commits(Duration::from_millis(500));
        let (key, to) = (sub.key(), long_poll());
        let cancelled = tokio::time::timeout(Duration::from_millis(100), deliveries.hand_out(&key, 1, &to, None));
        assert!(cancelled.await.is_err(), "the hand-out was still being stored");
        deliveries.store.slow_down_commits(Duration::ZERO);

        let again = deliveries.hand_out(&sub.key(), 1, &long_poll(), None).await.expect("hand out");
        assert_eq!(again.iter().map(|d| d.event.body.clone()).collect::<Vec<_>>(), vec![b"e".to_vec()]);
    }

    #[tokio::test]
    async fn a_lost_fifo_head_takes_the_later_events_of_its_group_with_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = Subscription { ordered: true, ..subscription() };
        let deliveries = subscribed(dir.path(), &sub).await;
        let events = vec![
            popped_in_group(b"g1", "g"),
            popped_in_group(b"g2", "g"),
            popped_in_group(b"g3", "g"),
            popped_in_group(b"h1", "h"),
        ];
        assert!(matches!(deliveries.admit(&sub.key(), events).await, Admission::Admitted));
        let first = deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("hand out");
        let mut bodies: Vec<Vec<u8>> = first.iter().map(|d| d.event.body.clone()).collect();
        bodies.sort();
        assert_eq!(bodies, vec![b"g1".to_vec(), b"h1".to_vec()], "only each group's head");

        // g1's lease lapses (popgate could not renew it): the broker will redeliver g1.
        let head = id_of(&deliveries, b"g1");
        let (g2, g3) = (id_of(&deliveries, b"g2"), id_of(&deliveries, b"g3"));
        let now = now_millis();
        if let Some(tracked) = deliveries.table.lock().deliveries.get_mut(&head) {
            tracked.record.handle.lease_until_ms = now - 1;
        }
        let owed = deliveries.sweep(now).await;
        assert!(owed.iter().all(|o| !matches!(o, Owed::GiveBack(..))), "the lapsed head is given up, not given back");
        assert!(deliveries.tracked_record(&head).is_none());

        // g2 must not overtake the redelivery of g1.
        assert!(deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("hand out").is_empty());
        assert!(matches!(deliveries.ack(&g2).await, Err(DeliveryError::Stale)));
        let owed = deliveries.sweep(now_millis()).await;
        let mut given_back: Vec<Id> = owed
            .iter()
            .filter_map(|o| match o {
                Owed::GiveBack(id, "fifo_head_lost") => Some(id.clone()),
                _ => None,
            })
            .collect();
        given_back.sort();
        let mut expected = vec![g2.clone(), g3.clone()];
        expected.sort();
        assert_eq!(given_back, expected, "the rest of g goes back to the broker, and nothing of h");
    }

    /// What a sweep `at` gives back to the broker as unclaimed.
    async fn given_back_unclaimed(deliveries: &Deliveries, at: i64) -> usize {
        let owed = deliveries.sweep(at).await;
        owed.iter().filter(|o| matches!(o, Owed::GiveBack(_, "unclaimed"))).count()
    }

    #[tokio::test]
    async fn in_a_tier_what_is_due_where_no_consumer_waits_goes_back_to_the_broker() {
        let after = Duration::from_secs(20);
        let sub = subscription();
        let dir = tempfile::tempdir().expect("tempdir");
        let alone = subscribed(dir.path(), &sub).await;
        assert!(matches!(alone.admit(&sub.key(), vec![popped(b"a")]).await, Admission::Admitted));
        assert_eq!(
            given_back_unclaimed(&alone, now_millis() + 60_000).await,
            0,
            "alone, it keeps it for its consumers"
        );

        let dir = tempfile::tempdir().expect("tempdir");
        let tier = subscribed(dir.path(), &sub).await.giving_back_unclaimed(Some(after));
        assert!(matches!(tier.admit(&sub.key(), vec![popped(b"b")]).await, Admission::Admitted));
        // A consumer waits here: kept, however long it has been.
        tier.add_demand(&sub.key(), 1);
        assert_eq!(given_back_unclaimed(&tier, now_millis() + 60_000).await, 0, "a consumer waits for it here");
        // It stops waiting: kept for `after`, then given back.
        tier.withdraw_demand(&sub.key(), 1);
        assert_eq!(given_back_unclaimed(&tier, now_millis() + 1_000).await, 0, "its consumer may be back soon");
        let stopped = now_millis();
        let id = id_of(&tier, b"b");
        tier.table.lock().timers.push(std::cmp::Reverse((0, id)));
        assert_eq!(given_back_unclaimed(&tier, stopped + 21_000).await, 1, "nobody waited for it here for 20 s");
        assert!(tier.hand_out(&sub.key(), 1, &long_poll(), None).await.expect("hand out").is_empty(), "claimed");
    }

    /// How long from now each tracked delivery's owed work waits, in ms.
    fn owed_waits(deliveries: &Deliveries) -> Vec<i64> {
        let now = now_millis();
        deliveries.table.lock().deliveries.values().map(|t| t.owed_retry_ms - now).collect()
    }

    #[tokio::test]
    async fn owed_broker_acks_travel_together_and_back_off_exponentially_while_the_broker_is_down() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = subscription();
        let deliveries = subscribed(dir.path(), &sub).await;
        assert!(matches!(
            deliveries.admit(&sub.key(), vec![popped(b"a"), popped(b"b"), popped(b"c")]).await,
            Admission::Admitted
        ));
        let handed = deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("hand out");
        let ids: Vec<Target<'_>> = handed.iter().map(|d| Target::from(&d.id)).collect();
        // The intents are stored (the subscribers' answers), the broker cannot be reached.
        assert!(deliveries.ack_many(&ids).await.iter().all(Result::is_ok));
        for wait in owed_waits(&deliveries) {
            assert!((700..=1_200).contains(&wait), "first retry after 1 s ± 20 %: {wait} ms");
        }

        // One sweep finds all three due: one piece of work, one batch request per broker.
        let owed = deliveries.sweep(now_millis() + 1_300).await;
        assert_eq!(owed.len(), 1, "{owed:?}");
        assert!(matches!(&owed[0], Owed::BrokerAcks(batch) if batch.len() == 3));
        for work in owed {
            deliveries.perform(work).await;
        }
        for wait in owed_waits(&deliveries) {
            assert!((1_500..=2_400).contains(&wait), "second retry after 2 s ± 20 %: {wait} ms");
        }
    }

    /// Runs one sweep at popgate's `now` and all the owed work it finds.
    async fn sweep_and_perform(deliveries: &Deliveries) {
        for owed in deliveries.sweep(now_millis()).await {
            deliveries.perform(owed).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_unacked_delivery_returns_on_the_seed_backoff_and_its_sixth_miss_goes_to_the_dlq() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(StateStore::open(dir.path(), true).expect("open"));
        let cluster = Arc::new(super::fake_cluster::FakeCluster::new(store.clone()));
        let (broker, _publisher, config) = offline_parts().await;
        let deliveries = Deliveries::with_cluster(store, broker, cluster.clone(), config);
        let sub = Subscription { ack_timeout_ms: 1_000, ..subscription() };
        deliveries.put_subscription(sub.clone(), RetryPolicy::SEED_DEFAULT).await.expect("subscribe");
        assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"x")]).await, Admission::Admitted));

        let mut waits = Vec::new();
        for attempt in 1..=6 {
            sweep_and_perform(&deliveries).await;
            let handed = deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("hand out");
            assert_eq!(handed.iter().map(|d| d.attempt).collect::<Vec<_>>(), vec![attempt]);
            assert!(deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("again").is_empty());
            // Its ACK deadline passes on paused time: the attempt is spent.
            tokio::time::advance(Duration::from_millis(1_001)).await;
            sweep_and_perform(&deliveries).await;
            let Some(record) = deliveries.tracked_record(&handed[0].id) else { panic!("still tracked") };
            match record.phase {
                Phase::Ready { due_ms } if attempt < 6 => {
                    let wait = due_ms - now_millis();
                    waits.push(wait);
                    tokio::time::advance(Duration::from_millis(u64::try_from(wait + 1).unwrap_or(0))).await;
                }
                Phase::DeadLetter { .. } if attempt == 6 => {}
                other => panic!("after attempt {attempt}: {other:?}"),
            }
        }
        for (wait, base) in waits.iter().zip([1_000, 2_000, 4_000, 8_000, 16_000]) {
            assert!((base * 8 / 10..=base * 12 / 10).contains(wait), "{wait} ms is not {base} ms ± 20 %: {waits:?}");
        }
        // The sixth miss: written to the DLQ, then ACKed at the broker, then forgotten.
        sweep_and_perform(&deliveries).await;
        assert!(cluster.dead_lettered.lock().contains("msg-1"), "in the DLQ");
        assert_eq!(cluster.acked.lock().values().cloned().collect::<Vec<_>>(), vec!["msg-1".to_owned()]);
        assert!(cluster.violations.lock().is_empty(), "{:?}", cluster.violations.lock());
        assert!(deliveries.table.lock().deliveries.is_empty(), "retired");
    }

    #[tokio::test(start_paused = true)]
    async fn a_hand_out_whose_time_ran_out_cannot_settle_the_next_one_and_a_repeated_ack_is_answered_ok() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = Subscription { ack_timeout_ms: 1_000, ..subscription() };
        let deliveries = subscribed(dir.path(), &sub).await;
        assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"x")]).await, Admission::Admitted));
        let first = deliveries.hand_out(&sub.key(), 1, &long_poll(), None).await.expect("hand out").remove(0);
        fn of(d: &Dispatched) -> Target<'_> {
            Target { id: &d.id, handout: Some(d.handout) }
        }
        // Its time runs out: before the sweeper has seen it, its holder may not settle it any more.
        tokio::time::advance(Duration::from_millis(2_000)).await;
        let late = deliveries.ack(of(&first)).await;
        assert!(matches!(late, Err(DeliveryError::Superseded)), "{late:?}");
        sweep_and_perform(&deliveries).await;
        tokio::time::advance(Duration::from_millis(2_000)).await;
        sweep_and_perform(&deliveries).await;
        let second = deliveries.hand_out(&sub.key(), 1, &long_poll(), None).await.expect("again").remove(0);
        assert_eq!((second.id.as_str(), second.handout), (first.id.as_str(), first.handout + 1));
        // The first holder is fenced; the second settles it, and may ACK again (it lost the answer).
        assert!(matches!(deliveries.ack(of(&first)).await, Err(DeliveryError::Superseded)));
        assert!(matches!(deliveries.nack(of(&first), None).await, Err(DeliveryError::Superseded)));
        assert!(deliveries.ack(of(&second)).await.is_ok());
        assert!(deliveries.ack(of(&second)).await.is_ok(), "a repeated ACK of the same hand-out");
        let late = deliveries.ack(of(&first)).await;
        assert!(
            matches!(late, Err(DeliveryError::Unknown | DeliveryError::Superseded)),
            "never the earlier one: {late:?}"
        );
        // A delivery id alone (HTTP) ACKed twice is still "already acknowledged".
        assert!(matches!(deliveries.ack(&second.id).await, Err(DeliveryError::Unknown)));
    }

    #[tokio::test]
    async fn an_auto_renewed_hand_out_is_renewed_only_once_its_client_took_it_in() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = subscription();
        let deliveries = subscribed(dir.path(), &sub).await;
        assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"x")]).await, Admission::Admitted));
        let holder = Holder { client_id: "app@1".into(), auto_renew: true, written: false };
        let to = HandOut {
            transport: "grpc",
            ack_timeout: Some(Duration::from_secs(10)),
            holder: Some(holder),
            fifo_batch: true,
        };
        let handed = deliveries.hand_out(&sub.key(), 1, &to, None).await.expect("hand out").remove(0);
        let clients = std::collections::HashSet::from(["app@1".to_owned()]);
        let (hold, max) = (Duration::from_secs(30), Duration::from_secs(3600));
        assert_eq!(deliveries.keep_held(&clients, hold, max).await.ok(), Some(0), "not renewed before it is written");

        let stale = (handed.id.clone(), handed.handout + 1);
        assert_eq!(deliveries.mark_written(&[stale]).await.ok(), Some(0), "another hand-out's mark changes nothing");
        let this = (handed.id.clone(), handed.handout);
        assert_eq!(deliveries.mark_written(std::slice::from_ref(&this)).await.ok(), Some(1));
        assert_eq!(deliveries.mark_written(&[this]).await.ok(), Some(0), "marked once");
        assert_eq!(deliveries.keep_held(&clients, hold, max).await.ok(), Some(1), "renewed once written");
        let stored: DeliveryRecord =
            deliveries.store().get(Family::Deliveries, &handed.id).expect("read").expect("kept");
        assert!(
            matches!(stored.phase, Phase::AwaitingAck { holder: Some(Holder { written: true, .. }), .. }),
            "the mark is stored: {:?}",
            stored.phase
        );
    }

    #[tokio::test]
    async fn a_broker_clock_a_minute_behind_does_not_make_fresh_leases_look_lapsed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = subscription();
        let deliveries = subscribed(dir.path(), &sub).await;
        let mut event = popped(b"x");
        // As the POP path records it: the broker's popTime a minute behind, the lease from the send time.
        event.handle.pop_time_ms = now_millis() - 60_000;
        event.handle.invisible_ms = 60_000;
        event.handle.lease_until_ms = now_millis() + 60_000;
        assert!(matches!(deliveries.admit(&sub.key(), vec![event]).await, Admission::Admitted));
        let handed = deliveries.hand_out(&sub.key(), 10, &long_poll(), None).await.expect("hand out");
        assert_eq!(handed.len(), 1, "not judged lapsed");
        assert!(
            deliveries.sweep(now_millis()).await.iter().all(|o| !matches!(o, Owed::Renew(_))),
            "nor due for renewal"
        );
    }

    #[tokio::test]
    async fn a_body_is_stored_apart_kept_out_of_memory_and_read_back_at_hand_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = subscription();
        let deliveries = subscribed(dir.path(), &sub).await;
        assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"the body")]).await, Admission::Admitted));

        let id = deliveries.table.lock().deliveries.keys().next().cloned().expect("tracked");
        let in_memory = deliveries.tracked_record(&id).expect("record");
        assert!(in_memory.body_apart && in_memory.event.body.is_empty(), "memory holds no body");
        let stored: DeliveryRecord = deliveries.store.get(Family::Deliveries, &id).expect("read").expect("stored");
        assert!(stored.event.body.is_empty(), "nor does the stored record");

        let to = HandOut { transport: "poll", ack_timeout: None, holder: None, fifo_batch: false };
        let handed = deliveries.hand_out(&sub.key(), 10, &to, None).await.expect("hand out");
        assert_eq!(handed.len(), 1);
        assert_eq!(handed[0].event.body, b"the body");

        deliveries.retire(&id).await;
        let left = deliveries.store.get_raw_many(Family::Payloads, &[&id]).expect("read");
        assert_eq!(left, vec![None], "the body goes with its delivery");
    }

    #[tokio::test]
    async fn deliveries_share_one_copy_of_their_group_topic_and_broker_names() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = subscription();
        let deliveries = subscribed(dir.path(), &sub).await;
        assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"a"), popped(b"b")]).await, Admission::Admitted));
        let table = deliveries.table.lock();
        let records: Vec<&DeliveryRecord> = table.deliveries.values().map(|t| &t.record).collect();
        assert_eq!(records.len(), 2);
        assert!(Arc::ptr_eq(&records[0].group, &records[1].group));
        assert!(Arc::ptr_eq(&records[0].topic, &records[1].topic));
        assert!(Arc::ptr_eq(&records[0].handle.broker_name, &records[1].handle.broker_name));
        assert!(Arc::ptr_eq(&records[0].handle.broker_addr, &records[1].handle.broker_addr));
    }

    #[tokio::test]
    async fn a_delivery_whose_stored_body_is_gone_is_not_handed_out_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = subscription();
        let deliveries = subscribed(dir.path(), &sub).await;
        assert!(matches!(deliveries.admit(&sub.key(), vec![popped(b"x")]).await, Admission::Admitted));
        let id = deliveries.table.lock().deliveries.keys().next().cloned().expect("tracked");
        deliveries.store.delete(Family::Payloads, &id).await.expect("delete");

        let to = HandOut { transport: "poll", ack_timeout: None, holder: None, fifo_batch: false };
        assert!(deliveries.hand_out(&sub.key(), 10, &to, None).await.expect("hand out").is_empty());
        assert!(deliveries.tracked_record(&id).is_none(), "retired; the broker redelivers it");
    }
}
