//! The in-memory side of the delivery state: every tracked delivery, every active subscription with its
//! ready queue, and the timer heap the sweeper works from. Only [`super::Deliveries`] touches it; its
//! fields are visible to that module alone.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Epoch;
use crate::delivery::record::{DeliveryRecord, Phase, Subscription};
use crate::delivery::retry::{RetryPolicy, OWED_WORK_BACKOFF, RENEWAL_BACKOFF};

fn delay(policy: &RetryPolicy, failures: u32) -> Duration {
    policy.delay_after(failures, &mut rand::rng())
}

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
    /// Earliest retry of an owed broker ACK or DLQ write that failed.
    pub(super) owed_retry_at: Epoch,
    /// Failures in a row of that owed work, for its backoff.
    pub(super) owed_failures: u32,
    /// Its DLQ write is under way. That write runs unclaimed (its send attempts may outlast a lease), so
    /// renewals go on meanwhile; this flag alone keeps a second write from starting.
    pub(super) dlq_write_in_flight: bool,
    /// Earliest retry of a lease renewal that failed; kept apart from owed work so a failing broker ACK never
    /// holds a renewal back.
    pub(super) renew_retry_at: Epoch,
    /// Failed renewals in a row, for their backoff.
    pub(super) renew_failures: u32,
    /// The push subscriber it is handed to (memory only: a restart hands everything out anew).
    pub(super) holder: Option<u64>,
    /// An earlier event of its FIFO message group lost its lease: the broker will redeliver that one, and
    /// this one must not overtake it, so it is never handed out or settled again and the sweeper gives it
    /// back to the broker (which then redelivers the group in order) as soon as nobody acts on it.
    pub(super) surrender: bool,
    /// When popgate popped it, for the oldest-unacknowledged-age gauge; see [`admission_time`].
    pub(super) admitted_at: Epoch,
}

impl Tracked {
    /// Handed out and held by its subscriber (not waiting to be dispatched again after a restart).
    pub(super) fn handed_out(&self) -> bool {
        matches!(self.record.phase, Phase::AwaitingAck { .. }) && !self.redispatch && !self.surrender
    }

    /// Whether hand-out `handout` is the current one and still in time (or was ACKed: a repeated ACK). Its
    /// time runs out at its ACK deadline, whether or not the sweeper has seen that yet.
    pub(super) fn held_as(&self, handout: u32) -> bool {
        handout == self.record.handouts
            && match self.record.phase {
                Phase::AwaitingAck { deadline_ms, .. } => deadline_ms > Epoch::now(),
                Phase::Acked => true,
                Phase::Ready { .. } | Phase::DeadLetter { .. } => false,
            }
    }

    pub(super) fn new(record: DeliveryRecord) -> Tracked {
        Tracked {
            claimed: false,
            queued: false,
            redispatch: false,
            owed_retry_at: Epoch::ZERO,
            owed_failures: 0,
            dlq_write_in_flight: false,
            renew_retry_at: Epoch::ZERO,
            renew_failures: 0,
            holder: None,
            surrender: false,
            admitted_at: admission_time(&record),
            record,
        }
    }

    /// Its owed broker work (ACK, DLQ write) failed again: the next try waits longer
    /// ([`OWED_WORK_BACKOFF`]).
    pub(super) fn owed_work_failed(&mut self, now: Epoch) {
        self.owed_failures = self.owed_failures.saturating_add(1);
        self.owed_retry_at = now + delay(&OWED_WORK_BACKOFF, self.owed_failures);
    }

    /// Its lease renewal failed again ([`RENEWAL_BACKOFF`]).
    pub(super) fn renewal_failed(&mut self, now: Epoch) {
        self.renew_failures = self.renew_failures.saturating_add(1);
        self.renew_retry_at = now + delay(&RENEWAL_BACKOFF, self.renew_failures);
    }

    pub(super) fn key(&self) -> String {
        Subscription::key_of(&self.record.group, &self.record.topic)
    }

    /// Can be handed to a subscriber now.
    pub(super) fn dispatchable(&self, now: Epoch) -> bool {
        if self.surrender {
            return false;
        }
        match self.record.phase {
            Phase::Ready { due_ms } => due_ms <= now,
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

/// When a delivery being tracked was popped: when the request behind its current lease was sent, on popgate's
/// clock (`lease_until_ms - invisible_ms`; the broker's `pop_time_ms` for records from before popgate kept
/// that), never later than popgate's now. For a new delivery that is its POP. For one recovered after a restart
/// it is the checkpoint it held then: its POP if its lease was never renewed, else its last renewal (which moves
/// the checkpoint), so a restart can make a long-held delivery look younger, down to under one lease old, but not
/// new. Memory only: the stored record's format is unchanged.
fn admission_time(record: &DeliveryRecord) -> Epoch {
    let now = Epoch::now();
    // When the last POP or renewal was sent, on popgate's own clock (never the broker's `popTime`); records
    // stored before popgate kept that fall back to the broker's figure.
    let handle = &record.handle;
    let checkpoint = if handle.lease_until_ms > Epoch::ZERO {
        handle.lease_until_ms - Duration::from_millis(u64::try_from(handle.invisible_ms).unwrap_or(0))
    } else {
        Epoch::from_millis(handle.pop_time_ms)
    };
    if checkpoint > Epoch::ZERO {
        checkpoint.min(now)
    } else {
        now
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
    /// When a receive last waited on it: an implicit subscription idle for long is removed.
    pub(super) last_used: Epoch,
    /// When a receive last changed its filter (`None`: never), to take such changes at most once per interval.
    pub(super) filter_changed: Option<Epoch>,
    /// The broker's refusal of the filter (it cannot compile an SQL92 expression), until a POP succeeds or
    /// the filter changes: receives are answered with it instead of waiting for what cannot come.
    pub(super) filter_refusal: Option<String>,
}

impl ActiveSubscription {
    pub(super) fn new(sub: Subscription, policy: RetryPolicy, now: Epoch) -> ActiveSubscription {
        ActiveSubscription {
            sub,
            policy,
            ready: VecDeque::new(),
            demand: 0,
            stop: Arc::new(AtomicBool::new(false)),
            last_used: now,
            filter_changed: None,
            filter_refusal: None,
        }
    }

    /// Nobody waits on it, and nobody has since `since`: in a tier, its consumers may be connected to another
    /// instance, and what is due here is better given back to the broker, which hands it to the next POP of
    /// any instance. Not an ordered subscription's: the broker's orderly POP keeps its queues' order, and a
    /// message given back would be popped by no one sooner anyway.
    pub(super) fn unclaimed(&self, since: Epoch) -> bool {
        !self.sub.ordered && self.demand == 0 && self.last_used <= since
    }

    /// Created by a receive, with nobody waiting on it and nothing held for it since `idle_since`.
    pub(super) fn idle_implicit(&self, held: usize, idle_since: Epoch) -> bool {
        self.sub.implicit && self.demand == 0 && held == 0 && self.last_used <= idle_since
    }
}

/// The tracked deliveries by id.
pub(super) type DeliveryMap = foldhash::HashMap<Id, Box<Tracked>>;

#[derive(Default)]
pub(super) struct Table {
    pub(super) subs: HashMap<String, ActiveSubscription>,
    /// Boxed: a map slot then costs a pointer, not a whole `Tracked`, in the table's spare capacity. Hashed
    /// with foldhash, not SipHash: the ids are popgate's own random ones, and SipHash was a tenth of the boot
    /// over a million records.
    pub(super) deliveries: DeliveryMap,
    /// Ids given up to the broker, with the time until which a late ACK is answered 409 rather than 404.
    pub(super) stale: HashMap<String, Epoch>,
    /// How many deliveries each subscription key holds, kept with every insert and removal.
    held: HashMap<String, usize>,
    /// When the sweeper must look at a delivery next (time, id), earliest first. Entries may be stale
    /// (the delivery changed or is gone): the sweeper looks, then files the delivery at its next due time.
    pub(super) timers: BinaryHeap<Reverse<(Epoch, Id)>>,
    /// Group, topic and broker names, one copy each, shared by every record that carries them (a million
    /// deliveries of one subscription would otherwise hold a million copies of each).
    /// foldhash too: six look-ups per record restored. Its per-process random seed keeps the names an app
    /// chooses from being aimed at one bucket.
    names: foldhash::HashSet<Arc<str>>,
    /// The deliveries of each FIFO message group: subscription key, then message group, then admission order
    /// (`seq`). Kept with every insert and removal, so finding a group's head looks at that group alone, not
    /// the whole table.
    pub(super) fifo: HashMap<String, HashMap<String, BTreeMap<u64, Id>>>,
    /// The deliveries each gRPC client holds (handed out to it, awaiting its ACK), kept with every record
    /// change: a client's departure and the keep-alive of live clients look at what those clients hold, not
    /// at the whole table.
    holders: HashMap<String, HashSet<Id>>,
    /// The hand-outs ACKed lately, so a client that ACKs one again (it lost the first answer) hears `OK`.
    pub(super) acked: RecentlyAcked,
}

/// How long an ACKed hand-out is remembered: the official SDKs retry a lost ACK answer within seconds.
const ACKED_MEMORY: Duration = Duration::from_secs(2 * 60);
/// The most ACKed hand-outs remembered; past it the oldest are forgotten early (their repeat is then
/// answered as an unknown handle, which tells an SDK to stop retrying: never a wrong settlement).
const ACKED_MEMORY_MAX: usize = 200_000;

/// ACKed hand-outs by delivery id, each remembered for `ACKED_MEMORY`.
#[derive(Default)]
pub(super) struct RecentlyAcked {
    /// Id → (hand-out, forget at).
    handouts: HashMap<Id, (u32, Epoch)>,
    /// Ids in the order remembered (so, by when to forget them).
    order: VecDeque<Id>,
}

impl RecentlyAcked {
    pub(super) fn remember(&mut self, id: Id, handout: u32, now: Epoch) {
        if self.handouts.insert(id.clone(), (handout, now + ACKED_MEMORY)).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > ACKED_MEMORY_MAX {
            self.forget_oldest();
        }
    }

    /// Expired entries linger until the next sweep; they no longer count.
    pub(super) fn contains(&self, id: &str, handout: u32, now: Epoch) -> bool {
        self.handouts.get(id).is_some_and(|&(remembered, until)| remembered == handout && until > now)
    }

    pub(super) fn expire(&mut self, now: Epoch) {
        while let Some(oldest) = self.order.front() {
            if self.handouts.get(oldest).is_some_and(|&(_, until)| until > now) {
                break;
            }
            self.forget_oldest();
        }
    }

    fn forget_oldest(&mut self) {
        if let Some(id) = self.order.pop_front() {
            self.handouts.remove(&id);
        }
    }
}

/// The FIFO index and the deliveries it points into, borrowed together so a hand-out can read both while it
/// holds a subscription's ready queue.
pub(super) struct FifoView<'a> {
    fifo: &'a HashMap<String, HashMap<String, BTreeMap<u64, Id>>>,
    deliveries: &'a DeliveryMap,
}

impl FifoView<'_> {
    /// Whether delivery `seq` of message group `group` may be handed out with `taken` (the deliveries of the
    /// hand-out so far, or none when the hand-out takes heads only): every earlier unsettled delivery of its
    /// group is among them, and no other delivery of its group is handed out. So a group is held by one
    /// hand-out at a time, which holds its head and the deliveries right after it, in order.
    pub(super) fn may_join(&self, key: &str, group: &str, seq: u64, taken: &HashSet<Id>) -> bool {
        let Some(members) = self.fifo.get(key).and_then(|groups| groups.get(group)) else { return false };
        members.iter().all(|(member_seq, id)| {
            let Some(tracked) = self.deliveries.get(&**id) else { return true };
            if *member_seq == seq || taken.contains(id) {
                return true;
            }
            let blocks = if *member_seq < seq { tracked.unsettled() } else { tracked.handed_out() };
            !blocks
        })
    }
}

impl Table {
    /// The shared id of a tracked delivery.
    pub(super) fn id(&self, id: &str) -> Option<Id> {
        self.deliveries.get_key_value(id).map(|(id, _)| id.clone())
    }

    /// Files `id` for the sweeper at `at` ([`Epoch::ZERO`]: the next tick); an id no longer tracked needs no
    /// timer.
    pub(super) fn wake(&mut self, id: &str, at: Epoch) {
        if let Some(id) = self.id(id) {
            self.timers.push(Reverse((at, id)));
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
        self.timers.push(Reverse((Epoch::ZERO, id.clone())));
        let fifo_entry = tracked.record.event.message_group.clone().map(|group| (group, tracked.record.seq));
        if let Some(old) = self.deliveries.insert(id.clone(), Box::new(tracked)) {
            self.uncount(&old);
        }
        if let Some((group, seq)) = fifo_entry {
            self.fifo.entry(key.clone()).or_default().entry(group).or_default().insert(seq, id.clone());
        }
        if let Some(client) = grpc_holder(&self.deliveries[&id].record) {
            self.holders.entry(client.to_owned()).or_default().insert(id);
        }
        *self.held.entry(key).or_default() += 1;
    }

    /// Makes `record` the tracked record of its delivery (memory follows the store), keeping the holder index
    /// true; the caller ends any claim. False when the delivery is no longer tracked.
    pub(super) fn set_record(&mut self, record: DeliveryRecord) -> bool {
        let Some(id) = self.id(&record.id) else { return false };
        let Some(tracked) = self.deliveries.get_mut(&id) else { return false };
        let before = grpc_holder(&tracked.record).map(str::to_owned);
        tracked.record = record;
        let after = grpc_holder(&tracked.record).map(str::to_owned);
        if before != after {
            if let Some(client) = before {
                self.forget_held(&client, &id);
            }
            if let Some(client) = after {
                self.holders.entry(client).or_default().insert(id);
            }
        }
        true
    }

    /// The ids of the deliveries gRPC client `client_id` holds.
    pub(super) fn held_by_client(&self, client_id: &str) -> Vec<Id> {
        self.holders.get(client_id).map(|ids| ids.iter().cloned().collect()).unwrap_or_default()
    }

    fn forget_held(&mut self, client: &str, id: &Id) {
        if let Some(ids) = self.holders.get_mut(client) {
            ids.remove(id);
            if ids.is_empty() {
                self.holders.remove(client);
            }
        }
    }

    /// Removes a delivery.
    pub(super) fn remove(&mut self, id: &str) -> Option<Tracked> {
        let tracked = self.deliveries.remove(id)?;
        self.uncount(&tracked);
        Some(*tracked)
    }

    /// The FIFO index, to be read with the deliveries while a ready queue is borrowed.
    pub(super) fn fifo_view<'a>(
        fifo: &'a HashMap<String, HashMap<String, BTreeMap<u64, Id>>>,
        deliveries: &'a DeliveryMap,
    ) -> FifoView<'a> {
        FifoView { fifo, deliveries }
    }

    /// The unsettled deliveries of `tracked`'s message group admitted after it, in order: what must not
    /// overtake it.
    pub(super) fn followers(&self, tracked: &Tracked) -> Vec<Id> {
        let Some(group) = &tracked.record.event.message_group else { return Vec::new() };
        let Some(members) = self.fifo.get(&tracked.key()).and_then(|groups| groups.get(group)) else {
            return Vec::new();
        };
        members
            .range(tracked.record.seq + 1..)
            .filter(|(_, id)| self.deliveries.get(&**id).is_some_and(|t| t.unsettled()))
            .map(|(_, id)| id.clone())
            .collect()
    }

    /// Takes a delivery that left the table out of the per-subscription count and the FIFO and holder indexes.
    fn uncount(&mut self, tracked: &Tracked) {
        if let Some(client) = grpc_holder(&tracked.record) {
            // A replacement of the same id (`insert`) is indexed again after this.
            self.forget_held(client, &tracked.record.id);
        }
        let key = tracked.key();
        if let Some(count) = self.held.get_mut(&key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.held.remove(&key);
            }
        }
        let Some(group) = &tracked.record.event.message_group else { return };
        let Some(groups) = self.fifo.get_mut(&key) else { return };
        if let Some(members) = groups.get_mut(group) {
            // Only its own entry: a replacement of the same id may sit under another seq.
            if members.get(&tracked.record.seq).is_some_and(|id| *id == tracked.record.id) {
                members.remove(&tracked.record.seq);
            }
            if members.is_empty() {
                groups.remove(group);
            }
        }
        if groups.is_empty() {
            self.fifo.remove(&key);
        }
    }

    /// Deliveries held for the subscription `key`.
    pub(super) fn held_by(&self, key: &str) -> usize {
        self.held.get(key).copied().unwrap_or(0)
    }

    /// Takes every delivery of `key` out of any ready queue and files it for the next tick: after a
    /// subscription is created, replaced or removed, the sweeper decides again where each one belongs.
    pub(super) fn refile_subscription(&mut self, key: &str) {
        if let Some(active) = self.subs.get_mut(key) {
            active.ready.clear();
        }
        // Most subscriptions come and go holding nothing: no need to look through the table then.
        if self.held_by(key) == 0 {
            return;
        }
        let ids: Vec<Id> = self
            .deliveries
            .iter_mut()
            .filter(|(_, t)| t.key() == key)
            .map(|(id, t)| {
                t.queued = false;
                id.clone()
            })
            .collect();
        for id in ids {
            self.timers.push(Reverse((Epoch::ZERO, id)));
        }
    }
}

/// The gRPC client a record is handed to, if it is.
fn grpc_holder(record: &DeliveryRecord) -> Option<&str> {
    match &record.phase {
        Phase::AwaitingAck { holder: Some(holder), .. } => Some(&holder.client_id),
        _ => None,
    }
}
