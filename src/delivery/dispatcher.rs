//! The dispatcher: the one owner of every in-flight delivery and of the state machine in [`super`].
//!
//! State lives in memory (for speed) and in the state store (for crashes); every transition is written to
//! the store *before* it takes effect in memory or at the broker. A record being worked on by a task (a
//! broker call in progress) is marked `busy`, so no two tasks act on it at once; the lock itself is never
//! held across an `.await` or a store write.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use parking_lot::Mutex;
use rand::RngCore;
use tokio::sync::Notify;

use super::record::{DeliveryRecord, Event, Phase, Subscription};
use super::retry::{NextStep, RetryPolicy};
use crate::broker::client::now_millis;
use crate::broker::consumer::{Popped, ReceiptHandle};
use crate::broker::{BrokerClient, BrokerError};
use crate::config::DeliveryConfig;
use crate::metrics as m;
use crate::publish::Publisher;
use crate::store::{Change, Family, StateStore, StoreError};

/// How long an id whose lease was lost is remembered, to answer its late ACK with 409 rather than 404.
const STALE_MEMORY_MS: i64 = 10 * 60 * 1000;
/// Pause before retrying a broker ACK, a DLQ write or a lease renewal that failed.
pub(super) const RETRY_PAUSE_MS: i64 = 1_000;
/// How long an ACK waits for a record another task is working on.
const BUSY_WAIT: Duration = Duration::from_secs(10);

/// Why a delivery request could not be served.
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    /// No such delivery, or it was already ACKed.
    #[error("unknown or already acknowledged delivery")]
    Unknown,
    /// popgate no longer owns the message (its lease lapsed or a renewal failed): the broker may have handed it
    /// to someone else, and will redeliver it.
    #[error("the delivery's broker lease was lost; the broker will redeliver the event")]
    Stale,
    /// The delivery is not handed out (it is waiting for a retry or for the DLQ).
    #[error("the delivery is not awaiting an ACK")]
    NotInFlight,
    /// The state store could not record the change; nothing was changed.
    #[error("state store unavailable: {0}")]
    Store(#[from] StoreError),
    /// A request value is out of range.
    #[error("{1}")]
    Invalid(&'static str, String),
}

/// One delivery handed to a subscriber.
#[derive(Debug, Clone)]
pub struct Dispatched {
    /// The delivery id to ACK.
    pub id: String,
    /// Attempt number (1-based).
    pub attempt: u32,
    /// ACK by this time (epoch ms).
    pub ack_deadline_ms: i64,
    /// The event.
    pub event: Event,
}

/// The outcome of a NACK.
#[derive(Debug, Clone, PartialEq)]
pub enum NackOutcome {
    /// Attempt `attempt` is due at `due_ms`.
    Retry {
        /// The next attempt's number.
        attempt: u32,
        /// When (epoch ms).
        due_ms: i64,
    },
    /// It was the last attempt: the event goes to the DLQ.
    DeadLetter,
}

pub(super) struct Live {
    pub record: DeliveryRecord,
    /// A task is acting on this record; others leave it alone.
    pub busy: bool,
    /// The id sits in its subscription's ready queue.
    pub queued: bool,
    /// Earliest time to retry a failed broker ACK / DLQ write / renewal.
    pub next_try_ms: i64,
    /// The push subscriber the delivery is handed to (memory only: a restart hands everything out anew).
    pub holder: Option<u64>,
}

pub(super) struct SubState {
    pub sub: Subscription,
    pub policy: RetryPolicy,
    /// Ids ready to hand out, oldest first.
    pub ready: VecDeque<String>,
    /// Deliveries requested by waiting pollers: the POP loop only pops what is asked for.
    pub demand: usize,
    /// Tells this subscription's POP loop to stop.
    pub stop: Arc<AtomicBool>,
}

impl SubState {
    pub fn new(sub: Subscription, policy: RetryPolicy) -> SubState {
        SubState { sub, policy, ready: VecDeque::new(), demand: 0, stop: Arc::new(AtomicBool::new(false)) }
    }
}

#[derive(Default)]
pub(super) struct State {
    pub subs: HashMap<String, SubState>,
    pub records: HashMap<String, Live>,
    /// Ids given up to the broker, with the time until which they are remembered.
    pub stale: HashMap<String, i64>,
    /// How many of `records` each subscription key holds, kept with every insert and removal so the POP
    /// loop's backpressure check does not count them one by one.
    pub held: HashMap<String, usize>,
    /// When the sweeper must look at a delivery next (epoch ms, id), earliest first. Entries may be stale (the
    /// delivery changed or is gone): the sweeper looks, then files the delivery again at its next due time.
    /// Anything that changes a delivery files it for the next tick ([`State::wake`]), so the sweeper only
    /// visits deliveries with something due instead of scanning all of them every tick.
    pub timers: BinaryHeap<Reverse<(i64, String)>>,
}

impl State {
    /// Files `id` for the sweeper at `at_ms` (0: the next tick).
    pub fn wake(&mut self, id: &str, at_ms: i64) {
        self.timers.push(Reverse((at_ms, id.to_owned())));
    }

    /// Adds a live delivery (replacing one of the same id).
    pub fn insert_record(&mut self, live: Live) {
        let key = Subscription::key_of(&live.record.group, &live.record.topic);
        self.wake(&live.record.id, 0);
        if let Some(old) = self.records.insert(live.record.id.clone(), live) {
            self.uncount(&old);
        }
        *self.held.entry(key).or_default() += 1;
    }

    /// Removes a live delivery.
    pub fn remove_record(&mut self, id: &str) -> Option<Live> {
        let live = self.records.remove(id)?;
        self.uncount(&live);
        Some(live)
    }

    fn uncount(&mut self, live: &Live) {
        let key = Subscription::key_of(&live.record.group, &live.record.topic);
        if let Some(count) = self.held.get_mut(&key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.held.remove(&key);
            }
        }
    }

    /// Deliveries held for the subscription `key`.
    pub fn held_by(&self, key: &str) -> usize {
        self.held.get(key).copied().unwrap_or(0)
    }
}

/// Everything the dispatcher's tasks share.
pub(super) struct Shared {
    pub state: Mutex<State>,
    pub store: Arc<StateStore>,
    pub broker: Arc<BrokerClient>,
    pub publisher: Arc<Publisher>,
    pub config: DeliveryConfig,
    /// Woken when deliveries become ready or demand changes.
    pub changed: Notify,
    /// The next admission sequence number (see [`DeliveryRecord::seq`]).
    pub next_seq: std::sync::atomic::AtomicU64,
    /// False from a failed store write until the next successful one (`/readyz`).
    pub store_healthy: AtomicBool,
    pub shutting_down: AtomicBool,
}

impl Shared {
    /// Writes `changes`, keeping the store-health flag and the failure counter true to the outcome.
    pub fn write(&self, changes: &[Change<'_>]) -> Result<(), StoreError> {
        let result = self.store.apply(changes);
        match &result {
            Ok(()) => self.store_healthy.store(true, Ordering::Relaxed),
            Err(error) => {
                self.store_healthy.store(false, Ordering::Relaxed);
                counter!(m::OFFSET_WRITE_FAILURES).increment(1);
                tracing::warn!(%error, "State store write failed.");
            }
        }
        result
    }

    /// Syncs the store's WAL (group commit), counted like any failed write.
    pub fn sync_wal(&self) {
        match self.store.sync_wal() {
            Ok(()) => {}
            Err(error) => {
                self.store_healthy.store(false, Ordering::Relaxed);
                counter!(m::OFFSET_WRITE_FAILURES).increment(1);
                tracing::warn!(%error, "State store WAL sync failed.");
            }
        }
    }

    /// Stores `record` (one batch with any extra changes).
    pub fn save(&self, record: &DeliveryRecord) -> Result<(), StoreError> {
        let value = serde_json::to_vec(record)?;
        self.write(&[Change::Put(Family::Deliveries, &record.id, value)])
    }

    /// Forgets a delivery everywhere (retired: ACKed at the broker, dead-lettered, or given up).
    pub fn retire(&self, id: &str) {
        // A failed delete leaves a record that boot recovery retires again (its lease will have lapsed, or
        // its ACK intent is replayed): harmless.
        let _ = self.write(&[Change::Delete(Family::Deliveries, id)]);
        let mut state = self.state.lock();
        state.remove_record(id);
        gauge!(m::PENDING_DELIVERIES).set(state.records.len() as f64);
    }

    /// Gives a delivery up to the broker without ACKing it: its lease lapsed (or a renewal failed until it
    /// did), so the broker may already have handed it elsewhere and will redeliver it.
    pub fn give_up_lease(&self, id: &str) {
        counter!(m::LEASES_LOST).increment(1);
        self.retire(id);
        self.state.lock().stale.insert(id.to_owned(), now_millis() + STALE_MEMORY_MS);
    }

    /// Clears `busy` (and sets the next retry time) after a task is done with a record.
    pub fn release(&self, id: &str, retry_at_ms: Option<i64>) {
        let mut state = self.state.lock();
        if let Some(live) = state.records.get_mut(id) {
            live.busy = false;
            if let Some(at) = retry_at_ms {
                live.next_try_ms = at;
            }
            state.wake(id, 0);
        }
    }

    /// Marks `id` busy for the caller and returns a copy of its record, waiting while another task has it.
    async fn claim(&self, id: &str) -> Result<DeliveryRecord, DeliveryError> {
        let started = tokio::time::Instant::now();
        loop {
            {
                let mut state = self.state.lock();
                match state.records.get_mut(id) {
                    None => {
                        return Err(if state.stale.contains_key(id) {
                            DeliveryError::Stale
                        } else {
                            DeliveryError::Unknown
                        });
                    }
                    Some(live) if !live.busy => {
                        live.busy = true;
                        return Ok(live.record.clone());
                    }
                    Some(_) => {}
                }
            }
            if started.elapsed() > BUSY_WAIT {
                return Err(DeliveryError::NotInFlight);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Writes `record` and makes it the live one, releasing the claim; on a store failure nothing changes
    /// (the claim is released all the same, so the next tick or request can try again).
    pub fn commit(&self, record: DeliveryRecord) -> Result<(), DeliveryError> {
        self.commit_then_retry_at(record, None)
    }

    /// [`Shared::commit`], also setting when an owed broker call may be tried next.
    pub fn commit_then_retry_at(&self, record: DeliveryRecord, retry_at_ms: Option<i64>) -> Result<(), DeliveryError> {
        let id = record.id.clone();
        if let Err(error) = self.save(&record) {
            self.release(&id, retry_at_ms);
            return Err(error.into());
        }
        let mut state = self.state.lock();
        if let Some(live) = state.records.get_mut(&id) {
            live.record = record;
            live.busy = false;
            if let Some(at) = retry_at_ms {
                live.next_try_ms = at;
            }
            state.wake(&id, 0);
        }
        Ok(())
    }

    /// The retry policy of the delivery's subscription (the configured defaults if it is gone).
    pub fn policy_for(&self, record: &DeliveryRecord) -> RetryPolicy {
        let key = Subscription::key_of(&record.group, &record.topic);
        self.state
            .lock()
            .subs
            .get(&key)
            .map(|s| s.policy)
            .unwrap_or_else(|| RetryPolicy::from_config(&self.config).unwrap_or(RetryPolicy::SEED_DEFAULT))
    }

    /// Applies a failed attempt to `record`: the next attempt after the backoff (or `delay`), or the DLQ.
    pub fn after_failure(&self, record: &mut DeliveryRecord, reason: &str, delay: Option<Duration>) -> NackOutcome {
        record.last_failure = Some(reason.to_owned());
        match self.policy_for(record).next(record.attempt, &mut rand::rng()) {
            NextStep::RetryAfter(backoff, next) => {
                let due_ms = now_millis() + delay.unwrap_or(backoff).as_millis() as i64;
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

    /// Records the popped messages of one subscription before anything else sees them, and queues them.
    /// On a store failure nothing is recorded or handed out, and the messages are given back to the caller,
    /// which holds them (under their broker lease) and admits them again before it pops anything newer, so a
    /// full disk does not reorder a FIFO message group.
    pub fn admit(
        &self,
        sub: &Subscription,
        policy: &RetryPolicy,
        popped: Vec<Popped>,
    ) -> Result<(), (StoreError, Vec<Popped>)> {
        let now = now_millis();
        let records: Vec<DeliveryRecord> = popped
            .into_iter()
            .map(|p| {
                // The broker's count survives popgate's crashes: a crash loop cannot reset the budget.
                let attempt = p.event.reconsume_times.saturating_add(1).max(1);
                let phase = if attempt > policy.max_attempts {
                    Phase::DeadLetter { reason: format!("the broker redelivered it {} times", p.event.reconsume_times) }
                } else {
                    Phase::Ready { due_ms: now }
                };
                DeliveryRecord {
                    id: new_delivery_id(),
                    group: sub.group.clone(),
                    topic: sub.topic.clone(),
                    event: p.event,
                    handle: p.handle,
                    attempt,
                    phase,
                    last_failure: None,
                    seq: self.next_seq.fetch_add(1, Ordering::Relaxed),
                }
            })
            .collect();
        let give_back = |records: Vec<DeliveryRecord>| -> Vec<Popped> {
            records.into_iter().map(|r| Popped { event: r.event, handle: r.handle }).collect()
        };
        let encoded = match records.iter().map(serde_json::to_vec).collect::<Result<Vec<_>, _>>() {
            Ok(encoded) => encoded,
            Err(error) => return Err((error.into(), give_back(records))),
        };
        let written = {
            let changes: Vec<Change<'_>> =
                records.iter().zip(encoded).map(|(r, v)| Change::Put(Family::Deliveries, &r.id, v)).collect();
            self.write(&changes)
        };
        if let Err(error) = written {
            return Err((error, give_back(records)));
        }
        let mut state = self.state.lock();
        for record in records {
            let id = record.id.clone();
            let ready = matches!(record.phase, Phase::Ready { .. });
            state.insert_record(Live { record, busy: false, queued: ready, next_try_ms: 0, holder: None });
            if ready {
                if let Some(sub_state) = state.subs.get_mut(&sub.key()) {
                    sub_state.ready.push_back(id);
                }
            }
        }
        gauge!(m::PENDING_DELIVERIES).set(state.records.len() as f64);
        drop(state);
        self.changed.notify_waiters();
        Ok(())
    }
}

/// For an ordered subscription: each message group's head, the lowest `seq` among its unsettled deliveries
/// (ready or awaiting an ACK). Only the head may be handed out; ACKed and dead-lettered ones no longer block.
fn group_heads(records: &HashMap<String, Live>, sub: &Subscription) -> HashMap<String, u64> {
    let mut heads: HashMap<String, u64> = HashMap::new();
    for live in records.values() {
        let record = &live.record;
        if record.group != sub.group || record.topic != sub.topic {
            continue;
        }
        if !matches!(record.phase, Phase::Ready { .. } | Phase::AwaitingAck { .. }) {
            continue;
        }
        if let Some(group) = &record.event.message_group {
            let head = heads.entry(group.clone()).or_insert(record.seq);
            *head = (*head).min(record.seq);
        }
    }
    heads
}

/// A fresh 128-bit random delivery id (32 hex chars): unguessable and never reused across restarts.
pub fn new_delivery_id() -> String {
    let mut bytes = [0u8; 16];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}

// === client operations ===

impl Shared {
    /// Hands out up to `max` ready deliveries of `key`, marking them awaiting ACK (written first).
    pub fn take_ready(
        &self,
        key: &str,
        max: usize,
        transport: &'static str,
        holder: Option<u64>,
    ) -> Result<Vec<Dispatched>, DeliveryError> {
        let now = now_millis();
        let mut taken: Vec<DeliveryRecord> = Vec::new();
        {
            let mut state = self.state.lock();
            let State { subs, records, timers, .. } = &mut *state;
            let Some(sub_state) = subs.get_mut(key) else { return Ok(Vec::new()) };
            let ack_timeout = sub_state.sub.ack_timeout_ms as i64;
            let heads = if sub_state.sub.ordered { Some(group_heads(records, &sub_state.sub)) } else { None };
            let mut blocked = Vec::new();
            while taken.len() < max {
                let Some(id) = sub_state.ready.pop_front() else { break };
                let Some(live) = records.get_mut(&id) else { continue };
                live.queued = false;
                if live.busy || !matches!(live.record.phase, Phase::Ready { due_ms } if due_ms <= now) {
                    // Out of the queue: the sweeper queues it again when it is due.
                    timers.push(Reverse((0, id)));
                    continue;
                }
                if let (Some(heads), Some(group)) = (&heads, &live.record.event.message_group) {
                    if heads.get(group).is_some_and(|head| *head != live.record.seq) {
                        // An earlier event of its message group is still unsettled: it waits its turn.
                        live.queued = true;
                        blocked.push(id);
                        continue;
                    }
                }
                live.busy = true;
                let mut record = live.record.clone();
                record.phase = Phase::AwaitingAck { deadline_ms: now + ack_timeout, dispatched_ms: now };
                taken.push(record);
            }
            // Blocked ids go back in their order, ahead of what was not looked at.
            for id in blocked.into_iter().rev() {
                sub_state.ready.push_front(id);
            }
        }
        if taken.is_empty() {
            return Ok(Vec::new());
        }
        let encoded = taken.iter().map(serde_json::to_vec).collect::<Result<Vec<_>, _>>().map_err(StoreError::from)?;
        let changes: Vec<Change<'_>> =
            taken.iter().zip(encoded).map(|(r, v)| Change::Put(Family::Deliveries, &r.id, v)).collect();
        if let Err(error) = self.write(&changes) {
            // Not handed out: put them back at the head of the queue, unchanged.
            let mut state = self.state.lock();
            let State { subs, records, .. } = &mut *state;
            for record in taken.iter().rev() {
                if let Some(live) = records.get_mut(&record.id) {
                    live.busy = false;
                    live.queued = true;
                }
                if let Some(sub_state) = subs.get_mut(key) {
                    sub_state.ready.push_front(record.id.clone());
                }
            }
            return Err(error.into());
        }
        let mut state = self.state.lock();
        let mut out = Vec::with_capacity(taken.len());
        for record in taken {
            let Phase::AwaitingAck { deadline_ms, .. } = record.phase else { continue };
            out.push(Dispatched {
                id: record.id.clone(),
                attempt: record.attempt,
                ack_deadline_ms: deadline_ms,
                event: record.event.clone(),
            });
            if let Some(live) = state.records.get_mut(&record.id) {
                live.record = record;
                live.busy = false;
                live.holder = holder;
                let id = live.record.id.clone();
                state.wake(&id, 0);
            }
        }
        counter!(m::DELIVERIES_DISPATCHED, "transport" => transport).increment(out.len() as u64);
        Ok(out)
    }

    /// The subscriber's ACK: recorded durably (the ACK intent), then the broker ACK; a failed broker ACK is
    /// retried from the intent, so the client's answer does not depend on it.
    pub async fn ack(&self, id: &str) -> Result<(), DeliveryError> {
        let result = self.ack_inner(id).await;
        // A settled delivery frees a push subscriber's prefetch slot.
        self.changed.notify_waiters();
        let label = match &result {
            // Counted where the ACK intent is stored, before the broker ACK it allows.
            Ok(()) => return result,
            Err(DeliveryError::Stale) => "stale",
            Err(DeliveryError::Store(_)) => "store_error",
            Err(_) => "unknown",
        };
        counter!(m::ACKS, "result" => label).increment(1);
        result
    }

    async fn ack_inner(&self, id: &str) -> Result<(), DeliveryError> {
        let mut record = self.claim(id).await?;
        if record.phase == Phase::Acked {
            self.release(id, None);
            return Err(DeliveryError::Unknown);
        }
        if record.handle.lease_deadline_ms() <= now_millis() {
            // The broker answers SUCCESS even to a lapsed handle, so the check is ours. Write nothing.
            self.release(id, None);
            return Err(DeliveryError::Stale);
        }
        if let Phase::AwaitingAck { dispatched_ms, .. } = record.phase {
            histogram!(m::ACK_LATENCY).record((now_millis() - dispatched_ms).max(0) as f64 / 1000.0);
        }
        record.phase = Phase::Acked;
        if let Err(error) = self.save(&record) {
            self.release(id, None);
            return Err(error.into());
        }
        counter!(m::ACKS, "result" => "acked").increment(1);
        let handle = record.handle.clone();
        let group = record.group.clone();
        if let Some(live) = self.state.lock().records.get_mut(id) {
            live.record = record;
        }
        self.ack_at_broker_or_retry(id, &group, &handle).await;
        Ok(())
    }

    /// ACKs the message at the broker and retires the delivery. A failure is counted and returned; the
    /// delivery stays as it is for the caller to retry.
    pub async fn ack_at_broker(&self, id: &str, group: &str, handle: &ReceiptHandle) -> Result<(), BrokerError> {
        match self.broker.ack(group, handle).await {
            Ok(()) => {
                counter!(m::BROKER_ACKS).increment(1);
                self.retire(id);
                Ok(())
            }
            Err(error) => {
                counter!(m::BROKER_ACK_FAILURES).increment(1);
                Err(error)
            }
        }
    }

    /// [`Shared::ack_at_broker`] for a delivery whose ACK intent is stored: on failure it is released to be
    /// retried from that intent.
    pub async fn ack_at_broker_or_retry(&self, id: &str, group: &str, handle: &ReceiptHandle) {
        if let Err(error) = self.ack_at_broker(id, group, handle).await {
            tracing::warn!(%error, delivery = id, "Broker ACK failed; retrying from the ACK intent.");
            self.release(id, Some(now_millis() + RETRY_PAUSE_MS));
        }
    }

    /// The subscriber's NACK: the attempt is spent; the next one is scheduled (after `delay` if given).
    pub async fn nack(&self, id: &str, delay: Option<Duration>) -> Result<NackOutcome, DeliveryError> {
        let mut record = self.claim(id).await?;
        if !matches!(record.phase, Phase::AwaitingAck { .. }) {
            self.release(id, None);
            return Err(if record.phase == Phase::Acked { DeliveryError::Unknown } else { DeliveryError::NotInFlight });
        }
        let outcome = self.after_failure(&mut record, "nack", delay);
        self.commit(record)?;
        self.changed.notify_waiters();
        if matches!(outcome, NackOutcome::Retry { .. }) {
            counter!(m::REDELIVERIES, "reason" => "nack").increment(1);
        }
        Ok(outcome)
    }

    /// The subscriber's TERM: straight to the DLQ with its reason.
    pub async fn term(&self, id: &str, reason: &str) -> Result<(), DeliveryError> {
        let mut record = self.claim(id).await?;
        if matches!(record.phase, Phase::Acked | Phase::DeadLetter { .. }) {
            self.release(id, None);
            return Err(DeliveryError::Unknown);
        }
        record.last_failure = Some(format!("terminated: {reason}"));
        record.phase = Phase::DeadLetter { reason: format!("terminated by the subscriber: {reason}") };
        self.commit(record)?;
        self.changed.notify_waiters();
        Ok(())
    }

    /// A push transport could not hand these deliveries to its subscriber (the write failed, the connection is
    /// gone): they go straight back and are dispatched again at once, to any subscriber of the group. The
    /// subscriber never saw them, so no attempt is spent.
    pub async fn push_failed(&self, ids: &[String], transport: &'static str, reason: &'static str) {
        for id in ids {
            let Ok(mut record) = self.claim(id).await else { continue };
            if !matches!(record.phase, Phase::AwaitingAck { .. }) {
                self.release(id, None);
                continue;
            }
            record.phase = Phase::Ready { due_ms: now_millis() };
            if self.commit(record).is_err() {
                continue;
            }
            if reason == "push_failure" {
                counter!(m::PUSH_WRITE_FAILURES, "transport" => transport).increment(1);
            }
            counter!(m::REDELIVERIES, "reason" => "push_failure").increment(1);
            let key = {
                let mut state = self.state.lock();
                let Some(live) = state.records.get_mut(id) else { continue };
                live.holder = None;
                live.queued = true;
                Subscription::key_of(&live.record.group, &live.record.topic)
            };
            if let Some(sub) = self.state.lock().subs.get_mut(&key) {
                sub.ready.push_front(id.clone());
            }
        }
        self.changed.notify_waiters();
    }

    /// A push subscriber left: its deliveries stay in flight (their ACK timeout will bring them back) but no
    /// longer count against it.
    pub fn forget_holder(&self, holder: u64) {
        for live in self.state.lock().records.values_mut() {
            if live.holder == Some(holder) {
                live.holder = None;
            }
        }
    }

    /// How many of `held` are still handed to `holder` and unsettled; the others are dropped from the set.
    pub fn prune_held(&self, holder: u64, held: &mut std::collections::HashSet<String>) -> usize {
        let state = self.state.lock();
        held.retain(|id| {
            state.records.get(id).is_some_and(|live| {
                live.holder == Some(holder) && matches!(live.record.phase, Phase::AwaitingAck { .. })
            })
        });
        held.len()
    }
}
