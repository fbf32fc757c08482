//! The timer side of the delivery state, every 100 ms: [`Deliveries::sweep`] looks at the deliveries filed
//! as due (queues what is ready, spends the attempt of what missed its ACK deadline, gives up what lost its
//! lease) and returns the broker work that is owed: broker ACKs, DLQ writes, lease renewals, give-backs.
//! This loop only runs that work: renewals through a bounded pool of workers (they fall due together when
//! many deliveries are held), the rest in a task each.

use std::sync::Arc;
use std::time::Duration;

use super::state::{Deliveries, Owed};
use crate::broker::client::now_millis;

/// How often the sweeper looks at the deliveries that are due.
const TICK: Duration = Duration::from_millis(100);

/// Workers renewing leases. With many deliveries held, their renewals fall due together: they wait in a queue
/// (an id each) and this many run at once, so memory and broker load stay bounded. A delivery waiting in the
/// queue is not claimed: an ACK meanwhile goes through.
const RENEWAL_WORKERS: usize = 64;

/// Runs until shutdown.
pub(super) async fn run(deliveries: Arc<Deliveries>) {
    let (renewals, queue) = tokio::sync::mpsc::unbounded_channel::<Owed>();
    let queue = Arc::new(tokio::sync::Mutex::new(queue));
    for _ in 0..RENEWAL_WORKERS {
        let (deliveries, queue) = (deliveries.clone(), queue.clone());
        tokio::spawn(async move {
            loop {
                let next = queue.lock().await.recv().await;
                let Some(owed) = next else { break };
                deliveries.perform(owed).await;
            }
        });
    }
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !deliveries.is_shutting_down() {
        tick.tick().await;
        for owed in deliveries.sweep(now_millis()) {
            match owed {
                Owed::Renew(_) => {
                    let _ = renewals.send(owed);
                }
                other => {
                    let deliveries = deliveries.clone();
                    tokio::spawn(async move { deliveries.perform(other).await });
                }
            }
        }
    }
    // Dropping the sender stops the workers once the queue is empty.
}
