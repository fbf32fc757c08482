//! The timer side of the delivery state, every 100 ms: [`Deliveries::sweep`] looks at the deliveries filed
//! as due (queues what is ready, spends the attempt of what missed its ACK deadline, gives up what lost its
//! lease) and returns the broker work that is owed: broker ACKs, DLQ writes, lease renewals, give-backs.
//! This loop only runs that work, through two bounded pools of workers: one for lease renewals, one for the
//! rest. After a broker outage many deliveries owe work at once; a bounded pool (with each delivery's own
//! backoff, see `retry::OWED_WORK_BACKOFF`) keeps that from becoming a storm of tasks and requests, and two
//! pools keep slow DLQ writes (they retry on other brokers) from ever holding a renewal back.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

use super::state::{Deliveries, Owed};
use crate::clock::Epoch;

/// How often the sweeper looks at the deliveries that are due.
const TICK: Duration = Duration::from_millis(100);

/// How often idle implicit subscriptions are looked for (at most; sooner when the expiry itself is shorter).
const EXPIRY_PASS_EVERY: Duration = Duration::from_secs(10);

/// Workers renewing leases. With many deliveries held, their renewals fall due together: they wait in a queue
/// (an id each) and this many run at once, so memory and broker load stay bounded. A delivery waiting in the
/// queue is not claimed: an ACK meanwhile goes through.
const RENEWAL_WORKERS: usize = 64;

/// Workers for the other owed work: broker ACKs (one batch request per broker and sweep), DLQ writes and
/// give-backs. Each queued item is one delivery's (or one sweep's ACKs'), claimed or marked until it ends, so
/// the queue never holds more than the table.
const OWED_WORKERS: usize = 16;

/// Runs until shutdown.
pub(super) async fn run(deliveries: Arc<Deliveries>) {
    let renewals = worker_pool(&deliveries, RENEWAL_WORKERS);
    let owed_work = worker_pool(&deliveries, OWED_WORKERS);
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let idle_expiry = Duration::from_secs(deliveries.config().idle_subscription_expiry_secs);
    let mut next_expiry_pass = Epoch::now();
    while !deliveries.is_shutting_down() {
        tick.tick().await;
        let now = Epoch::now();
        for owed in deliveries.sweep(now).await {
            let pool = if matches!(owed, Owed::Renew(_)) { &renewals } else { &owed_work };
            let _ = pool.send(owed);
        }
        if now >= next_expiry_pass {
            deliveries.expire_idle_subscriptions(now - idle_expiry).await;
            next_expiry_pass = now + EXPIRY_PASS_EVERY.min(idle_expiry.max(Duration::from_millis(1)));
        }
    }
    // Dropping the senders stops the workers once their queues are empty.
}

/// `workers` tasks that run the owed work sent to the returned queue, one item at a time each.
fn worker_pool(deliveries: &Arc<Deliveries>, workers: usize) -> UnboundedSender<Owed> {
    let (sender, queue) = unbounded_channel::<Owed>();
    let queue = Arc::new(tokio::sync::Mutex::new(queue));
    for _ in 0..workers {
        let (deliveries, queue) = (deliveries.clone(), queue.clone());
        tokio::spawn(async move {
            loop {
                let next = queue.lock().await.recv().await;
                let Some(owed) = next else { break };
                deliveries.perform(owed).await;
            }
        });
    }
    sender
}
