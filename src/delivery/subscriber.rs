//! A push subscriber's session with the dispatcher: the one thing SSE and WebSocket share. A transport only
//! moves deliveries and ACKs; every delivery rule (deferred broker ACK, backoff, DLQ, recovery) stays in the
//! dispatcher.
//!
//! - **Prefetch.** At most `prefetch` unACKed deliveries are handed to one subscriber, so a slow subscriber
//!   never holds the group's messages; the rest go to its siblings (several subscribers of a group share it,
//!   one message in flight to one subscriber).
//! - **Write failure.** What could not be written goes straight back ([`Subscriber::push_failed`]): it is
//!   dispatched again at once to any subscriber, counted in `popgate_push_write_failures_total{transport}` and
//!   `popgate_redeliveries_total{reason="push_failure"}`.
//! - **Disconnect.** Dropping the session withdraws it. Its unACKed deliveries are redelivered after their ACK
//!   timeout (the client may still ACK them by POST), or at once with `delivery.redeliver_on_disconnect`.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics::gauge;

use super::dispatcher::Demand;
use super::state::Deliveries;
use super::{DeliveryError, Dispatched, HandOut};
use crate::metrics as m;

/// How long a subscriber waits after the state store refused a hand-out before it asks again: the store
/// reopens at most once a second, and a transport must not spin on it meanwhile.
const STORE_PAUSE: Duration = Duration::from_secs(1);

/// Session ids, unique within the process.
static NEXT_SUBSCRIBER: AtomicU64 = AtomicU64::new(1);

/// One connected push subscriber of a group/topic.
pub struct Subscriber {
    deliveries: Arc<Deliveries>,
    key: String,
    id: u64,
    prefetch: usize,
    transport: &'static str,
    /// Deliveries handed to this subscriber and not yet known to be settled.
    held: HashSet<String>,
    /// After a refused hand-out: no new one before this instant.
    paused_until: Option<tokio::time::Instant>,
}

impl Subscriber {
    pub(super) fn new(
        deliveries: Arc<Deliveries>,
        key: String,
        prefetch: usize,
        transport: &'static str,
    ) -> Subscriber {
        gauge!(m::PUSH_SUBSCRIBERS, "transport" => transport).increment(1.0);
        Subscriber {
            deliveries,
            key,
            id: NEXT_SUBSCRIBER.fetch_add(1, Ordering::Relaxed),
            prefetch,
            transport,
            held: HashSet::new(),
            paused_until: None,
        }
    }

    /// Waits up to `wait` for deliveries, handing out no more than the prefetch allows; empty on timeout.
    /// Cancel-safe: deliveries are taken only in the instant before it returns. After the store refused a
    /// hand-out, the next call first waits out a pause (every transport backs off the same way).
    ///
    /// # Errors
    /// [`DeliveryError::Store`] when the hand-out cannot be recorded (counted by the store, shown by
    /// `/readyz`).
    pub async fn next(&mut self, wait: Duration) -> Result<Vec<Dispatched>, DeliveryError> {
        let deadline = tokio::time::Instant::now() + wait;
        if let Some(until) = self.paused_until.take() {
            tokio::time::sleep_until(until.min(deadline)).await;
        }
        // The demand this wait asks the POP loop for; registered again only when the free room changes, since
        // registering wakes every waiter (this one included).
        let mut demand: Option<(usize, Demand)> = None;
        let bells = self.deliveries.bells(&self.key);
        loop {
            // Both enabled before the state is read, so no change in between is missed; the one that does not
            // apply is dropped before waiting, which passes on a long poll's turn it may have caught (a turn
            // held by a future nobody awaits would be lost to the long polls).
            let mut any_change = Box::pin(bells.all.notified());
            let mut ready = Box::pin(bells.polls.notified());
            any_change.as_mut().enable();
            ready.as_mut().enable();
            let room = self.prefetch.saturating_sub(self.deliveries.retain_held(self.id, &mut self.held));
            if room == 0 {
                demand = None;
            } else {
                if demand.as_ref().is_none_or(|(registered, _)| *registered != room) {
                    drop(demand.take());
                    demand = Some((room, Demand::register(&self.deliveries, &self.key, room)));
                }
                let to = HandOut { transport: self.transport, ack_timeout: None, holder: None, fifo_batch: false };
                let taken = match self.deliveries.hand_out(&self.key, room, &to, Some(self.id)).await {
                    Ok(taken) => taken,
                    Err(error) => {
                        self.paused_until = Some(tokio::time::Instant::now() + STORE_PAUSE);
                        return Err(error);
                    }
                };
                if !taken.is_empty() {
                    self.held.extend(taken.iter().map(|d| d.id.clone()));
                    return Ok(taken);
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(Vec::new());
            }
            // With room, this subscriber waits like a long poll: one of them is woken per change. Without,
            // it waits for a settlement of its own, which wakes every push subscriber of the subscription.
            let wake = if room > 0 {
                drop(any_change);
                ready
            } else {
                drop(ready);
                any_change
            };
            tokio::select! {
                () = wake => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    /// These deliveries could not be written to the subscriber: they are dispatched again at once.
    pub async fn push_failed(&mut self, ids: &[String]) {
        for id in ids {
            self.held.remove(id);
        }
        self.deliveries.push_failed(ids, self.transport, "push_failure").await;
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        gauge!(m::PUSH_SUBSCRIBERS, "transport" => self.transport).decrement(1.0);
        let held: Vec<String> = self.held.drain().collect();
        let deliveries = self.deliveries.clone();
        let id = self.id;
        if deliveries.config().redeliver_on_disconnect && !held.is_empty() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let transport = self.transport;
                runtime.spawn(async move { deliveries.push_failed(&held, transport, "disconnect").await });
                return;
            }
        }
        deliveries.forget_holder(id, &held);
    }
}
