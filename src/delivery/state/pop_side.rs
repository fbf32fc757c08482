//! The POP loop's side: what to POP, admitting what it brought, giving back.

use super::*;

impl Deliveries {
    /// What to POP for `key` now; `None` once the subscription is gone.
    pub(in crate::delivery) fn pop_plan(&self, key: &str) -> Option<PopPlan> {
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
    pub(in crate::delivery) async fn admit(&self, key: &str, popped: Vec<Popped>) -> Admission {
        let Some((sub, policy)) = self.table.lock().subs.get(key).map(|a| (a.sub.clone(), a.policy)) else {
            return Admission::NoSubscription(popped);
        };
        let now = Epoch::now();
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
    pub(in crate::delivery) async fn give_back_popped(&self, group: &str, popped: Vec<Popped>, reason: &'static str) {
        for p in popped {
            self.give_back_at_broker(group, &p.handle, reason).await;
        }
    }

    /// Best effort: makes the message visible again at once (ChangeInvisibleTime to a second). If the
    /// broker cannot be asked, the lease running out gives it back all the same. Returns the handle the
    /// broker gave (a second's lease), when it took the change.
    pub(super) async fn give_back_at_broker(
        &self,
        group: &str,
        handle: &crate::broker::consumer::ReceiptHandle,
        reason: &'static str,
    ) -> Option<crate::broker::consumer::ReceiptHandle> {
        counter!(m::DELIVERIES_GIVEN_BACK, "reason" => reason).increment(1);
        match self.cluster.renew(group, handle, GIVE_BACK_INVISIBLE_MS).await {
            Ok(given_back) => Some(given_back),
            Err(error) => {
                counter!(m::CONSUME_REQUEST_FAILURES, "op" => "give_back").increment(1);
                tracing::debug!(%error, "Giving a message back failed; its lease running out gives it back.");
                None
            }
        }
    }
}
