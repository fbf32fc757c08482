//! The sweeper's side: timers, owed broker work, leases.

use super::*;

impl Deliveries {
    /// Queues `ids` for hand-out now if they are dispatchable and subscribed (newly admitted, handed back),
    /// without waiting for the next sweep, and wakes waiting subscribers. The others are the sweeper's.
    pub(super) fn queue_now(&self, ids: &[String]) {
        let now = Epoch::now();
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
    pub(in crate::delivery) async fn sweep(&self, now: Epoch) -> Vec<Owed> {
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
                let lease_deadline = tracked.record.handle.lease_deadline();
                let half_lease = tracked.record.handle.half_lease();
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
                let owed_due = tracked.owed_retry_at <= now;
                let mut next = lease_deadline.min((lease_deadline - half_lease).max(tracked.renew_retry_at));
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
                    Phase::Acked | Phase::DeadLetter { .. } => next = next.min(tracked.owed_retry_at),
                    Phase::Ready { due_ms } if *due_ms > now => next = next.min(*due_ms),
                    _ => {}
                }
                if let Some(after) = self.give_back_unclaimed.filter(|_| tracked.dispatchable(now)) {
                    let unclaimed = table.subs.get(&key).is_some_and(|a| a.unclaimed(now - after));
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
                if now.until(lease_deadline) < half_lease && tracked.renew_retry_at <= now {
                    owed.push(Owed::Renew(id));
                    continue;
                }
                table.timers.push(std::cmp::Reverse((next.max(now + Duration::from_millis(1)), id)));
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
    pub(super) async fn expire(&self, mut record: DeliveryRecord) {
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
    pub(super) async fn give_up_lease(&self, id: &str) {
        tracing::warn!(
            delivery = %id,
            "Broker lease lapsed; the broker redelivers the event, unless it was settled there meanwhile (by another \
             instance of the tier while this one was down)."
        );
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
                table.wake(&follower, Epoch::ZERO);
            }
        }
        self.retire(id).await;
        self.remember_stale(id);
    }

    /// A late ACK of `id` is answered "stale" (409) rather than "unknown" for a while.
    pub(super) fn remember_stale(&self, id: &str) {
        self.table.lock().stale.insert(id.to_owned(), Epoch::now() + STALE_MEMORY);
    }

    /// Forgets a delivery everywhere: ACKed at the broker, dead-lettered, given back, or given up.
    pub(super) async fn retire(&self, id: &str) {
        // A failed delete leaves a record that boot recovery settles again (its lease will have lapsed, or
        // its ACK intent is replayed): harmless, and the store counts the failure.
        let _ = self.store.apply(&[Change::Delete(Family::Deliveries, id), Change::Delete(Family::Payloads, id)]).await;
        let mut table = self.table.lock();
        table.remove(id);
        Self::set_pending_gauge(&table);
    }

    /// Runs one piece of owed broker work found by [`Deliveries::sweep`].
    pub(in crate::delivery) async fn perform(&self, owed: Owed) {
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
                    if let Some(handle) = self.give_back_at_broker(&record.group, &record.handle, reason).await {
                        // The peers learn that the lease their ACKs would use ends now.
                        self.tell_renewed(&DeliveryRecord { handle, ..record.clone() });
                    }
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
    pub(super) fn tracked_record(&self, id: &str) -> Option<DeliveryRecord> {
        self.table.lock().deliveries.get(id).map(|t| t.record.clone())
    }

    /// Writes the event to `%DLQ%<group>`; only then ACKs the original at the broker and retires it.
    ///
    /// The write runs unclaimed: with its retries on other brokers it may take longer than a lease, and the
    /// lease must be renewed meanwhile or the broker redelivers the event. The broker ACK does claim it, so
    /// it waits for a renewal in progress and carries the handle that renewal returned.
    pub(super) async fn dead_letter(&self, record: DeliveryRecord) {
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
    pub(super) fn end_dlq_write(&self, id: &str, owed: OwedWork) {
        let mut table = self.table.lock();
        if let Some(tracked) = table.deliveries.get_mut(id) {
            tracked.dlq_write_in_flight = false;
            if owed == OwedWork::Failed {
                tracked.owed_work_failed(Epoch::now());
            }
            table.wake(id, Epoch::ZERO);
        }
    }

    /// Extends the lease. The new handle is stored before it is relied on; the old one is dead either way.
    pub(super) async fn renew(&self, id: &str) {
        let (record, lease_ms) = {
            let mut table = self.table.lock();
            let now = Epoch::now();
            let held = table.deliveries.len();
            let Some(tracked) = table.deliveries.get_mut(id) else { return };
            let half_lease = tracked.record.handle.half_lease();
            if tracked.claimed {
                // Another task has it; the sweeper gets it back when that claim ends.
                return;
            }
            let lease_deadline = tracked.record.handle.lease_deadline();
            if lease_deadline <= now || now.until(lease_deadline) >= half_lease || tracked.renew_retry_at > now {
                // Lapsed meanwhile (the sweeper gives it up) or no longer due.
                table.wake(id, Epoch::ZERO);
                return;
            }
            tracked.claimed = true;
            (tracked.record.clone(), self.lease_ms_for(held))
        };
        match self.cluster.renew(&record.group, &record.handle, lease_ms).await {
            Ok(handle) => {
                counter!(m::LEASE_RENEWALS).increment(1);
                if let Some(tracked) = self.table.lock().deliveries.get_mut(id) {
                    tracked.renew_failures = 0;
                }
                let mut renewed = record;
                renewed.handle = handle.clone();
                // The peers learn the new handle: the old one, which the client's handle carries, is dead.
                self.tell_renewed(&renewed);
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
                    tracked.renewal_failed(Epoch::now());
                }
                table.wake(id, Epoch::ZERO);
            }
        }
    }
}
