//! The in-memory side of the delivery state: every tracked delivery, every active subscription with its
//! ready queue, and the timer heap the sweeper works from. Only [`super::Deliveries`] touches it; its
//! fields are visible to that module alone.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::broker::client::now_millis;
use crate::delivery::record::{DeliveryRecord, Phase, Subscription};
use crate::delivery::retry::RetryPolicy;

/// A delivery id as memory holds it: one allocation shared by the table's key, the ready queue and every
/// timer entry (a million held deliveries would otherwise carry a copy of the id in each).
pub(super) type Id = Arc<str>;

/// One delivery popgate holds: its stored record and what only memory needs to know about it.
pub(super) struct Tracked {
    /// The record exactly as stored (memory never runs ahead of the store).
    pub(super) record: DeliveryRecord,
    /// A task is acting on this delivery (a store write or a broker call in progress): others wait or skip.
    pub(super) claimed: bool,
    /// It sits in its subscription's ready queue.
    pub(super) queued: bool,
    /// Recovered after a crash while handed out: dispatched again at once with its attempt kept, and until
    /// then still ACKable by the subscriber that held it before the crash.
    pub(super) redispatch: bool,
    /// Earliest retry of an owed broker ACK or DLQ write that failed (epoch ms).
    pub(super) owed_retry_ms: i64,
    /// Its DLQ write is under way. That write runs unclaimed (its send attempts may outlast a lease), so
    /// renewals go on meanwhile; this flag alone keeps a second write from starting.
    pub(super) dlq_write_in_flight: bool,
    /// Earliest retry of a lease renewal that failed (epoch ms); kept apart from owed work so a failing
    /// broker ACK never holds a renewal back.
    pub(super) renew_retry_ms: i64,
    /// The push subscriber it is handed to (memory only: a restart hands everything out anew).
    pub(super) holder: Option<u64>,
    /// When popgate popped it (epoch ms), for the oldest-unacknowledged-age gauge; see [`admission_time`].
    pub(super) admitted_ms: i64,
}

impl Tracked {
    pub(super) fn new(record: DeliveryRecord) -> Tracked {
        Tracked {
            claimed: false,
            queued: false,
            redispatch: false,
            owed_retry_ms: 0,
            dlq_write_in_flight: false,
            renew_retry_ms: 0,
            holder: None,
            admitted_ms: admission_time(&record),
            record,
        }
    }

    pub(super) fn key(&self) -> String {
        Subscription::key_of(&self.record.group, &self.record.topic)
    }

    /// Can be handed to a subscriber now.
    pub(super) fn dispatchable(&self, now_ms: i64) -> bool {
        match self.record.phase {
            Phase::Ready { due_ms } => due_ms <= now_ms,
            Phase::AwaitingAck { .. } => self.redispatch,
            Phase::Acked | Phase::DeadLetter { .. } => false,
        }
    }

    /// Not yet settled by a subscriber: it blocks its FIFO message group, and it is what a removed
    /// subscription gives back to the broker.
    pub(super) fn unsettled(&self) -> bool {
        matches!(self.record.phase, Phase::Ready { .. } | Phase::AwaitingAck { .. })
    }
}

/// When a delivery being tracked was popped: the record's lease checkpoint time (`pop_time_ms`, the broker's
/// clock), never later than popgate's now. For a new delivery that is its POP. For one recovered after a restart
/// it is the checkpoint it held then: its POP if its lease was never renewed, else its last renewal (which moves
/// the checkpoint), so a restart can make a long-held delivery look younger, down to under one lease old, but not
/// new. Memory only: the stored record's format is unchanged.
fn admission_time(record: &DeliveryRecord) -> i64 {
    let now = now_millis();
    match record.handle.pop_time_ms {
        checkpoint if checkpoint > 0 => checkpoint.min(now),
        _ => now,
    }
}

/// A subscription popgate serves, with its hand-out queue and the demand of its waiting subscribers.
pub(super) struct ActiveSubscription {
    pub(super) sub: Subscription,
    pub(super) policy: RetryPolicy,
    /// Ids ready to hand out, oldest first.
    pub(super) ready: VecDeque<Id>,
    /// Deliveries asked for by waiting subscribers: the POP loop pops only what is asked for.
    pub(super) demand: usize,
    /// Tells this subscription's POP loop to stop.
    pub(super) stop: Arc<AtomicBool>,
}

impl ActiveSubscription {
    pub(super) fn new(sub: Subscription, policy: RetryPolicy) -> ActiveSubscription {
        ActiveSubscription { sub, policy, ready: VecDeque::new(), demand: 0, stop: Arc::new(AtomicBool::new(false)) }
    }
}

#[derive(Default)]
pub(super) struct Table {
    pub(super) subs: HashMap<String, ActiveSubscription>,
    /// Boxed: a map slot then costs a pointer, not a whole `Tracked`, in the table's spare capacity.
    pub(super) deliveries: HashMap<Id, Box<Tracked>>,
    /// Ids given up to the broker, with the time until which a late ACK is answered 409 rather than 404.
    pub(super) stale: HashMap<String, i64>,
    /// How many deliveries each subscription key holds, kept with every insert and removal.
    held: HashMap<String, usize>,
    /// When the sweeper must look at a delivery next (epoch ms, id), earliest first. Entries may be stale
    /// (the delivery changed or is gone): the sweeper looks, then files the delivery at its next due time.
    pub(super) timers: BinaryHeap<Reverse<(i64, Id)>>,
    /// Group, topic and broker names, one copy each, shared by every record that carries them (a million
    /// deliveries of one subscription would otherwise hold a million copies of each).
    names: std::collections::HashSet<Arc<str>>,
}

impl Table {
    /// The shared id of a tracked delivery.
    pub(super) fn id(&self, id: &str) -> Option<Id> {
        self.deliveries.get_key_value(id).map(|(id, _)| id.clone())
    }

    /// Files `id` for the sweeper at `at_ms` (0: the next tick); an id no longer tracked needs no timer.
    pub(super) fn wake(&mut self, id: &str, at_ms: i64) {
        if let Some(id) = self.id(id) {
            self.timers.push(Reverse((at_ms, id)));
        }
    }

    /// Makes `record`'s group, topic and broker names the shared copies.
    pub(super) fn intern(&mut self, record: &mut DeliveryRecord) {
        let handle = &mut record.handle;
        for name in [
            &mut record.group,
            &mut record.topic,
            &mut record.event.topic,
            &mut handle.broker_name,
            &mut handle.broker_addr,
            &mut handle.ack_topic,
        ] {
            match self.names.get(&**name) {
                Some(shared) => *name = shared.clone(),
                None => {
                    self.names.insert(name.clone());
                }
            }
        }
    }

    /// Adds a delivery (replacing one of the same id) and files it for the next tick.
    pub(super) fn insert(&mut self, mut tracked: Tracked) {
        self.intern(&mut tracked.record);
        let key = tracked.key();
        let id: Id = tracked.record.id.clone();
        self.timers.push(Reverse((0, id.clone())));
        if let Some(old) = self.deliveries.insert(id, Box::new(tracked)) {
            self.uncount(&old.key());
        }
        *self.held.entry(key).or_default() += 1;
    }

    /// Removes a delivery.
    pub(super) fn remove(&mut self, id: &str) -> Option<Tracked> {
        let tracked = self.deliveries.remove(id)?;
        self.uncount(&tracked.key());
        Some(*tracked)
    }

    fn uncount(&mut self, key: &str) {
        if let Some(count) = self.held.get_mut(key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.held.remove(key);
            }
        }
    }

    /// Deliveries held for the subscription `key`.
    pub(super) fn held_by(&self, key: &str) -> usize {
        self.held.get(key).copied().unwrap_or(0)
    }

    /// Takes every delivery of `key` out of any ready queue and files it for the next tick: after a
    /// subscription is created, replaced or removed, the sweeper decides again where each one belongs.
    pub(super) fn refile_subscription(&mut self, key: &str) {
        let ids: Vec<Id> = self
            .deliveries
            .iter_mut()
            .filter(|(_, t)| t.key() == key)
            .map(|(id, t)| {
                t.queued = false;
                id.clone()
            })
            .collect();
        if let Some(active) = self.subs.get_mut(key) {
            active.ready.clear();
        }
        for id in ids {
            self.timers.push(Reverse((0, id)));
        }
    }

    /// For an ordered subscription: each message group's head, the lowest `seq` among its unsettled
    /// deliveries. Only the head may be handed out; settled ones (ACKed, dead-lettering) no longer block.
    pub(super) fn group_heads(&self, sub: &Subscription) -> HashMap<String, u64> {
        let mut heads: HashMap<String, u64> = HashMap::new();
        for tracked in self.deliveries.values() {
            let record = &tracked.record;
            if *record.group != *sub.group || *record.topic != *sub.topic || !tracked.unsettled() {
                continue;
            }
            if let Some(group) = &record.event.message_group {
                let head = heads.entry(group.clone()).or_insert(record.seq);
                *head = (*head).min(record.seq);
            }
        }
        heads
    }
}
