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
//!
//! One file per concern, each an `impl Deliveries` block (the fields stay private to this module and its files):
//! construction and persistence here; [`subscriptions`]; the POP loop's side ([`pop_side`]: what to POP,
//! admitting what it brought, giving back); [`hand_out`]; the gRPC clients' [`holds`]; [`settle`] (ACK, NACK,
//! TERM, deadlines, what peers settled); the [`sweeper`]'s timers, owed broker work and leases; boot
//! [`recovery`] and the admin view. The in-memory index is [`table`], what the state asks of the cluster
//! [`cluster`]; the unit tests are `tests.rs` and the model test of the state machine `model.rs`.

mod cluster;
#[cfg(test)]
mod fake_cluster;
mod hand_out;
mod holds;
mod lease_tells;
#[cfg(test)]
mod model;
mod pop_side;
mod recovery;
mod settle;
mod subscriptions;
mod sweeper;
mod table;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use parking_lot::Mutex;
use rand::RngCore;
use tokio::sync::{watch, Notify};

use self::cluster::{BrokerCluster, Cluster};
use self::table::{ActiveSubscription, Id, Table, Tracked};
use super::lease::{Lease, LeaseSeal};
use super::lease_plan::LeasePlan;
use super::pop_wait::PopWaitPlan;
use super::record::{DeliveryRecord, Holder, Phase, Subscription};
use super::retry::{NextStep, RetryPolicy};
use super::{DeliveryError, Dispatched, HandOut, InFlight, NackOutcome, Target};
use crate::broker::consumer::{AckEntry, Popped};
use crate::broker::{BrokerClient, BrokerError};
use crate::clock::Epoch;
use crate::config::DeliveryConfig;
use crate::metrics as m;
use crate::publish::Publisher;
use crate::store::{Change, Family, StateStore, StoreError};

/// How long an id whose lease was lost is remembered, to answer its late ACK with 409 rather than 404.
const STALE_MEMORY: Duration = Duration::from_secs(10 * 60);
/// How long a client request waits for a delivery another task is acting on.
const CLAIM_WAIT: Duration = Duration::from_secs(10);
/// How long a given-back message stays invisible at the broker: long enough for the change to land, short
/// enough that the next consumer gets it at once instead of after the whole lease.
const GIVE_BACK_INVISIBLE_MS: u64 = 1_000;
/// Filter changes made by receives (consumers of one group with different filters) are taken at most this
/// often per subscription, so they cannot rewrite it on every receive.
const FILTER_CHANGE_INTERVAL: Duration = Duration::from_secs(10);
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
    /// Unsettled, but its broker lease lapsed while popgate was down: never handed out again here, the
    /// sweeper's first pass gives it up to the broker, which redelivers it, unless it was settled meanwhile
    /// elsewhere (another instance of a tier ACKs at the broker what this one handed out).
    LeaseLapsed,
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

/// A POP counted as waiting at a broker while this lives (see [`Deliveries::pop_waiting`]).
pub(super) struct PopWaiting {
    waiting: Arc<AtomicUsize>,
    /// How long it waits.
    pub(super) wait_ms: u64,
}

impl Drop for PopWaiting {
    fn drop(&mut self) {
        self.waiting.fetch_sub(1, Ordering::Relaxed);
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
    /// How long a broker lease to ask for, from how much is held (see `delivery::lease_plan`).
    lease_plan: LeasePlan,
    /// How long a POP waits at the broker, from how many wait (see `delivery::pop_wait`).
    pop_wait_plan: PopWaitPlan,
    /// The POPs waiting at the brokers now, of every POP loop.
    pops_waiting: Arc<AtomicUsize>,
    /// The bells of each subscription, rung when its deliveries become ready or are settled, or its demand
    /// changes. Per subscription, so a change wakes only the waiters it concerns.
    bells: Mutex<HashMap<String, Arc<Bells>>>,
    /// The next admission sequence number (see [`DeliveryRecord::seq`]).
    next_seq: AtomicU64,
    /// `true` once popgate shuts down: the POP loops stop, a POP waiting at a broker is abandoned.
    shutting_down: watch::Sender<bool>,
    /// This instance's id, the start of every delivery id it mints (empty: ids name no instance).
    instance: String,
    /// Seals each hand-out's broker lease into its handles, in a tier (see `delivery::lease`).
    lease_seal: Option<LeaseSeal>,
    /// In a tier, how long a subscription may go without a waiting consumer before what is due on it is given
    /// back to the broker.
    give_back_unclaimed: Option<Duration>,
    /// In a tier, where renewed leases go to be told to the peers (`lease_tells`).
    renewal_outbox: Mutex<Option<tokio::sync::mpsc::Sender<(String, String)>>>,
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
            lease_plan: LeasePlan::new(&config),
            pop_wait_plan: PopWaitPlan::new(&config),
            pops_waiting: Arc::default(),
            config,
            bells: Mutex::new(HashMap::new()),
            next_seq: AtomicU64::new(1),
            shutting_down: watch::Sender::new(false),
            instance: String::new(),
            lease_seal: None,
            give_back_unclaimed: None,
            renewal_outbox: Mutex::new(None),
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
        self.give_back_unclaimed = after;
        self
    }

    /// The lease `token` carries, when this tier sealed it for delivery `id`.
    pub(super) fn open_lease(&self, id: &str, token: &str) -> Option<Lease> {
        self.lease_seal.as_ref()?.open(id, token)
    }

    /// ACKs a lease another instance handed out, at the broker, without any record of it here (its owner
    /// cannot be reached). Refused as the owner would refuse an ACK of a lapsed lease.
    pub(super) async fn ack_lease(&self, lease: &Lease) -> Result<(), DeliveryError> {
        if lease.handle.lease_deadline() <= Epoch::now() {
            return Err(DeliveryError::Stale);
        }
        self.cluster.ack(&lease.group, &lease.handle).await.map_err(|why| {
            tracing::warn!(group = %lease.group, %why, "A broker ACK for an absent owner failed.");
            DeliveryError::Busy
        })
    }

    /// The broker lease (invisible time) a POP asks for now, from how much this instance holds.
    pub(super) fn lease_ms_to_ask(&self) -> u64 {
        let held = self.table.lock().deliveries.len();
        self.lease_ms_for(held)
    }

    /// The broker lease a POP or a renewal asks for while `held` deliveries are held (shown as a gauge).
    fn lease_ms_for(&self, held: usize) -> u64 {
        let lease_ms = self.lease_plan.lease_ms(held);
        gauge!(m::LEASE_ASKED).set(lease_ms as f64 / 1000.0);
        lease_ms
    }

    /// A POP about to wait at a broker, counted until the returned guard is dropped, and how long it is to
    /// wait (shown as a gauge).
    pub(super) fn pop_waiting(&self) -> PopWaiting {
        let waiting = self.pops_waiting.fetch_add(1, Ordering::Relaxed) + 1;
        let wait_ms = self.pop_wait_plan.wait_ms(waiting);
        gauge!(m::POP_WAIT).set(wait_ms as f64 / 1000.0);
        PopWaiting { waiting: self.pops_waiting.clone(), wait_ms }
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
        *self.shutting_down.borrow()
    }

    /// Resolves once popgate shuts down.
    pub(super) async fn shutdown_asked(&self) {
        let _ = self.shutting_down.subscribe().wait_for(|stopping| *stopping).await;
    }

    pub(super) fn shut_down(&self) {
        self.shutting_down.send_replace(true);
        for bells in self.bells.lock().values() {
            bells.wake_everyone();
        }
    }

    /// The one way delivery state reaches the store: every change of the batch, or none.
    /// Records are written in their current (compact) form whatever form they were read in, so a record an
    /// earlier version stored as JSON is rewritten at its first change.
    async fn persist(&self, records: &[&DeliveryRecord]) -> Result<(), StoreError> {
        let changes: Vec<Change<'_>> =
            records.iter().map(|r| Change::Put(Family::Deliveries, &r.id, r.encode())).collect();
        self.store.apply(&changes).await
    }

    /// Stores newly admitted records and, apart, their bodies, in one atomic batch.
    async fn persist_admitted(&self, records: &[DeliveryRecord], bodies: &[Vec<u8>]) -> Result<(), StoreError> {
        let mut changes: Vec<Change<'_>> =
            records.iter().map(|r| Change::Put(Family::Deliveries, &r.id, r.encode())).collect();
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
mod tests;
