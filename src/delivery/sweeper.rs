//! The timer side of the dispatcher, every 100 ms, for the deliveries filed as due (see `State::timers`):
//! - a retry whose backoff is over becomes ready to hand out;
//! - a delivery not ACKed by its deadline spends its attempt (next attempt, or the DLQ);
//! - an owed broker ACK or DLQ write is (re)tried;
//! - a lease with less than half its time left is renewed (ChangeInvisibleTime), and one that lapsed is given
//!   up: the broker will redeliver that message, so popgate stops claiming it.

use std::cmp::Reverse;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, gauge};

use super::dispatcher::{NackOutcome, Shared, RETRY_PAUSE_MS};
use super::dlq;
use super::record::{DeliveryRecord, Phase, Subscription};
use crate::broker::client::now_millis;
use crate::metrics as m;

/// How often the sweeper looks at the deliveries that are due.
const TICK: Duration = Duration::from_millis(100);

/// Work the sweeper hands to a task of its own (it involves the broker). Lease renewals are not among them:
/// they go, by id, to the renewal workers (see [`RENEWAL_WORKERS`]).
enum Task {
    BrokerAck(DeliveryRecord),
    DeadLetter(DeliveryRecord),
    GiveUp(String),
}

/// Runs until shutdown.
pub(super) async fn run(shared: Arc<Shared>) {
    let (renewals, queue) = tokio::sync::mpsc::unbounded_channel::<String>();
    let queue = Arc::new(tokio::sync::Mutex::new(queue));
    for _ in 0..RENEWAL_WORKERS {
        let (shared, queue) = (shared.clone(), queue.clone());
        tokio::spawn(async move {
            loop {
                let next = queue.lock().await.recv().await;
                let Some(id) = next else { break };
                renew(&shared, id).await;
            }
        });
    }
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !shared.shutting_down.load(Ordering::Relaxed) {
        tick.tick().await;
        sweep(&shared, &renewals);
    }
    // Dropping the sender stops the workers once the queue is empty.
}

fn sweep(shared: &Arc<Shared>, renewals: &tokio::sync::mpsc::UnboundedSender<String>) {
    let now = now_millis();
    let half_lease = (shared.config.lease_ms / 2) as i64;
    let mut newly_ready: Vec<(String, String)> = Vec::new();
    let mut timed_out: Vec<DeliveryRecord> = Vec::new();
    let mut tasks: Vec<Task> = Vec::new();
    let mut renewals_due: Vec<String> = Vec::new();
    {
        let mut guard = shared.state.lock();
        let state = &mut *guard;
        state.stale.retain(|_, until| *until > now);
        // Only deliveries filed as due by now; each is filed again at its next due time after the look.
        let mut due: Vec<String> = Vec::new();
        while state.timers.peek().is_some_and(|Reverse((at, _))| *at <= now) {
            if let Some(Reverse((_, id))) = state.timers.pop() {
                due.push(id);
            }
        }
        due.sort_unstable();
        due.dedup();
        for id in due {
            let Some(live) = state.records.get_mut(&id) else { continue };
            if live.busy {
                // The task working on it files it again when done (release, commit or retire).
                continue;
            }
            let lease_deadline = live.record.handle.lease_deadline_ms();
            if lease_deadline <= now {
                live.busy = true;
                tasks.push(Task::GiveUp(id));
                continue;
            }
            let retry_due = live.next_try_ms <= now;
            // The next time something about this delivery is due, if nothing is due now.
            let mut next = lease_deadline.min((lease_deadline - half_lease).max(live.next_try_ms));
            match &live.record.phase {
                Phase::Ready { due_ms } if *due_ms <= now && !live.queued => {
                    live.queued = true;
                    newly_ready.push((Subscription::key_of(&live.record.group, &live.record.topic), id.clone()));
                }
                Phase::Ready { due_ms } if !live.queued => next = next.min(*due_ms),
                Phase::AwaitingAck { deadline_ms, .. } if *deadline_ms <= now => {
                    live.busy = true;
                    timed_out.push(live.record.clone());
                    continue;
                }
                Phase::AwaitingAck { deadline_ms, .. } => next = next.min(*deadline_ms),
                Phase::Acked if retry_due => {
                    live.busy = true;
                    tasks.push(Task::BrokerAck(live.record.clone()));
                    continue;
                }
                Phase::DeadLetter { .. } if retry_due => {
                    live.busy = true;
                    tasks.push(Task::DeadLetter(live.record.clone()));
                    continue;
                }
                Phase::Acked | Phase::DeadLetter { .. } => next = next.min(live.next_try_ms),
                _ => {}
            }
            if lease_deadline - now < half_lease && retry_due {
                // Not marked busy here: it stays ACKable while it waits for a renewal permit.
                renewals_due.push(id);
                continue;
            }
            state.timers.push(Reverse((next.max(now + 1), id)));
        }
        for (key, id) in &newly_ready {
            if let Some(sub) = state.subs.get_mut(key) {
                sub.ready.push_back(id.clone());
            }
        }
        gauge!(m::PENDING_DELIVERIES).set(state.records.len() as f64);
    }
    if !newly_ready.is_empty() {
        shared.changed.notify_waiters();
    }
    let expired = !timed_out.is_empty();
    for record in timed_out {
        expire(shared, record);
    }
    if expired {
        // A delivery that went to the DLQ unblocks its FIFO message group.
        shared.changed.notify_waiters();
    }
    // Renewals are queued, not spawned: with many deliveries held they fall due together, and a task each
    // (sized for the largest task) cost more memory than the deliveries themselves.
    for id in renewals_due {
        let _ = renewals.send(id);
    }
    for task in tasks {
        tokio::spawn(run_task(shared.clone(), task));
    }
}

/// An unACKed delivery past its deadline: the attempt is spent. A failed write leaves the record as it was
/// (still awaiting ACK, past its deadline), so the next tick tries again and the delivery stays in flight
/// until the store recovers.
fn expire(shared: &Shared, mut record: DeliveryRecord) {
    let outcome = shared.after_failure(&mut record, "ack timeout", None);
    if shared.commit(record).is_ok() && matches!(outcome, NackOutcome::Retry { .. }) {
        counter!(m::REDELIVERIES, "reason" => "timeout").increment(1);
    }
}

async fn run_task(shared: Arc<Shared>, task: Task) {
    match task {
        Task::GiveUp(id) => {
            tracing::warn!(delivery = %id, "Broker lease lapsed; the broker will redeliver the event.");
            shared.give_up_lease(&id);
        }
        Task::BrokerAck(record) => shared.ack_at_broker_or_retry(&record.id, &record.group, &record.handle).await,
        Task::DeadLetter(record) => dead_letter(&shared, record).await,
    }
}

/// Writes the event to `%DLQ%<group>`; only then ACKs the original at the broker and retires the delivery.
async fn dead_letter(shared: &Shared, mut record: DeliveryRecord) {
    if let Err(error) = dlq::send(&shared.publisher, &record).await {
        counter!(m::DLQ_RECORD_FAILURES).increment(1);
        tracing::warn!(%error, delivery = %record.id, "DLQ write failed; the delivery stays in flight and will retry.");
        shared.release(&record.id, Some(now_millis() + RETRY_PAUSE_MS));
        return;
    }
    counter!(m::DLQ_MESSAGES, "group" => record.group.clone()).increment(1);
    match shared.ack_at_broker(&record.id, &record.group, &record.handle).await {
        Ok(()) => {}
        Err(error) => {
            tracing::warn!(%error, delivery = %record.id, "Broker ACK after the DLQ write failed; will retry.");
            // The DLQ has the event: from here only the broker ACK is owed, never a second DLQ write. If even
            // this write fails, the next attempt writes the DLQ again: a duplicate there, never a loss.
            record.phase = Phase::Acked;
            let _ = shared.commit_then_retry_at(record, Some(now_millis() + RETRY_PAUSE_MS));
        }
    }
}

/// Workers renewing leases. With many deliveries held, their renewals fall due together: they wait in a queue
/// (an id each) and this many run at once, so memory and broker load stay bounded. A delivery waiting in the
/// queue is not busy: an ACK meanwhile goes through.
const RENEWAL_WORKERS: usize = 64;

/// Extends the lease. The new handle is written before it is relied on; the old one is dead either way.
async fn renew(shared: &Shared, id: String) {
    let half_lease = (shared.config.lease_ms / 2) as i64;
    let (group, handle) = {
        let mut state = shared.state.lock();
        let now = now_millis();
        let Some(live) = state.records.get_mut(&id) else { return };
        if live.busy {
            // Someone else has it; they file it for the sweeper when done.
            return;
        }
        let lease_deadline = live.record.handle.lease_deadline_ms();
        if lease_deadline <= now || lease_deadline - now >= half_lease || live.next_try_ms > now {
            // Lapsed meanwhile (the sweeper gives it up) or no longer due: back to the sweeper.
            state.wake(&id, 0);
            return;
        }
        live.busy = true;
        (live.record.group.clone(), live.record.handle.clone())
    };
    match shared.broker.renew(&group, &handle, shared.config.lease_ms).await {
        Ok(handle) => {
            let record = shared.state.lock().records.get(&id).map(|live| {
                let mut record = live.record.clone();
                record.handle = handle.clone();
                record
            });
            let Some(record) = record else { return };
            if shared.commit(record).is_err() {
                // The old handle is dead whatever the store says: memory must hold the new one. After a crash
                // the stored (dead) handle only means the broker redelivers: a duplicate, never a loss.
                if let Some(live) = shared.state.lock().records.get_mut(&id) {
                    live.record.handle = handle;
                }
            }
        }
        Err(error) => {
            counter!(m::CONSUME_REQUEST_FAILURES, "op" => "renew").increment(1);
            tracing::warn!(%error, delivery = %id, "Lease renewal failed; will retry until the lease lapses.");
            shared.release(&id, Some(now_millis() + RETRY_PAUSE_MS));
        }
    }
}
