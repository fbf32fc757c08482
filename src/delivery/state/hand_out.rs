//! Hand-out: taking ready deliveries for a subscriber, recorded before they leave.

use super::*;

impl Deliveries {
    /// Hands out up to `max` ready deliveries of `key` to `holder` (a push subscriber, or none for a
    /// long-poll or a gRPC client, which `to` names), marking them awaiting ACK in the store first. Nothing is
    /// handed out when that write fails.
    ///
    /// Only one long poll is woken per change, so when this leaves ready deliveries behind (or puts back what
    /// it could not hand out) it wakes the next one.
    pub(in crate::delivery) async fn hand_out(
        &self,
        key: &str,
        max: usize,
        to: &HandOut,
        holder: Option<u64>,
    ) -> Result<Vec<Dispatched>, DeliveryError> {
        let now = Epoch::now();
        let transport = to.transport;
        let mut taken: Vec<DeliveryRecord> = Vec::new();
        {
            let mut guard = self.table.lock();
            let table = &mut *guard;
            let Some(active) = table.subs.get(key) else { return Ok(Vec::new()) };
            let ack_timeout = to.ack_timeout.unwrap_or(Duration::from_millis(active.sub.ack_timeout_ms));
            let ordered = active.sub.ordered;
            let Table { subs, deliveries, timers, fifo, .. } = table;
            let Some(active) = subs.get_mut(key) else { return Ok(Vec::new()) };
            let mut blocked = Vec::new();
            let mut batch: HashSet<Id> = HashSet::new();
            let no_batch: HashSet<Id> = HashSet::new();
            while taken.len() < max {
                let Some(id) = active.ready.pop_front() else { break };
                let Some(tracked) = deliveries.get(&id) else { continue };
                // A lapsed lease (popgate was hung) means the broker may have handed the event to someone
                // else already: it is not handed out, and the sweeper gives it up.
                let lapsed = tracked.record.handle.lease_deadline() <= now;
                let unavailable = tracked.claimed || !tracked.dispatchable(now) || lapsed;
                // An earlier event of its message group still unsettled: it waits its turn.
                // (or, for a FIFO batch, behind deliveries of its group that this hand-out did not take).
                let behind_its_head = ordered
                    && !unavailable
                    && tracked.record.event.message_group.as_deref().is_some_and(|group| {
                        let joined = if to.fifo_batch { &batch } else { &no_batch };
                        !Table::fifo_view(fifo, deliveries).may_join(key, group, tracked.record.seq, joined)
                    });
                let Some(tracked) = deliveries.get_mut(&id) else { continue };
                if unavailable {
                    // Out of the queue: the sweeper queues it again when it is due.
                    tracked.queued = false;
                    timers.push(std::cmp::Reverse((Epoch::ZERO, id)));
                    continue;
                }
                if behind_its_head {
                    blocked.push(id);
                    continue;
                }
                tracked.queued = false;
                tracked.claimed = true;
                batch.insert(id.clone());
                let mut record = tracked.record.clone();
                record.handouts = record.handouts.saturating_add(1);
                record.phase = Phase::AwaitingAck {
                    deadline_ms: now + ack_timeout,
                    dispatched_ms: now,
                    holder: to.holder.clone(),
                };
                taken.push(record);
            }
            // Blocked ids go back in their order, ahead of what was not looked at.
            for id in blocked.into_iter().rev() {
                active.ready.push_front(id);
            }
        }
        if taken.is_empty() {
            return Ok(Vec::new());
        }
        // From here the records are claimed; a caller that stops waiting (its client went away, popgate is
        // shutting down) drops this future at an await below, and the guard puts them back for the next waiter.
        let mut unclaim = PutBackOnDrop { deliveries: self, key, ids: taken.iter().map(|r| r.id.clone()).collect() };
        // The bodies are read before the hand-out is stored: a read that fails hands nothing out.
        let bodies = match self.read_bodies(&taken) {
            Ok(bodies) => bodies,
            Err(error) => return Err(error.into()),
        };
        let (taken, bodies) = self.drop_bodiless(taken, bodies).await;
        if let Err(error) = self.persist(&taken.iter().collect::<Vec<_>>()).await {
            return Err(error.into());
        }
        // Stored: from here the hand-out happens, whatever the caller does.
        unclaim.ids.clear();
        let mut table = self.table.lock();
        let mut out = Vec::with_capacity(taken.len());
        for (record, body) in taken.into_iter().zip(bodies) {
            let Phase::AwaitingAck { deadline_ms, .. } = record.phase else { continue };
            let mut event = record.event.clone();
            if let Some(body) = body {
                event.body = body;
            }
            out.push(Dispatched {
                id: record.id.to_string(),
                attempt: record.attempt,
                handout: record.handouts,
                ack_deadline: deadline_ms,
                event,
                lease: self.lease_seal.as_ref().and_then(|seal| seal.seal(&record)),
            });
            let id = record.id.clone();
            table.set_record(record);
            if let Some(tracked) = table.deliveries.get_mut(&*id) {
                tracked.claimed = false;
                tracked.redispatch = false;
                tracked.holder = holder;
            }
            table.wake(&id, Epoch::ZERO);
        }
        let more_ready = table.subs.get(key).is_some_and(|active| !active.ready.is_empty());
        drop(table);
        if more_ready {
            self.pass_turn(key);
        }
        counter!(m::DELIVERIES_DISPATCHED, "transport" => transport).increment(out.len() as u64);
        Ok(out)
    }

    /// Taken for a hand-out that did not happen: back at the head of the queue, unchanged, for the next
    /// waiter (the caller may have been the one woken for them). A record retired meanwhile (its body was
    /// missing) is skipped.
    pub(super) fn put_back(&self, key: &str, taken: &[Id]) {
        let mut table = self.table.lock();
        for id in taken.iter().rev() {
            let Some(tracked) = table.deliveries.get_mut(id) else { continue };
            tracked.claimed = false;
            tracked.queued = true;
            if let Some(active) = table.subs.get_mut(key) {
                active.ready.push_front(id.clone());
            }
        }
        drop(table);
        self.pass_turn(key);
    }

    /// The stored body of each record, in order: `None` for a record that carries its body inline, and
    /// `Some(None)` for one whose kept-apart body is missing from the store.
    pub(super) fn read_bodies(&self, records: &[DeliveryRecord]) -> Result<Vec<Option<Option<Vec<u8>>>>, StoreError> {
        let apart: Vec<&str> = records.iter().filter(|r| r.body_apart).map(|r| &*r.id).collect();
        let mut found = self.store.get_raw_many(Family::Payloads, &apart)?.into_iter();
        Ok(records.iter().map(|r| r.body_apart.then(|| found.next().flatten())).collect())
    }

    /// Leaves out (and retires, without a broker ACK) the records whose kept-apart body is missing from the
    /// store: handing out an empty event would lose it, while the broker redelivers a retired one once its
    /// lease lapses. Returns the rest with their bodies (`None`: inline).
    pub(super) async fn drop_bodiless(
        &self,
        taken: Vec<DeliveryRecord>,
        bodies: Vec<Option<Option<Vec<u8>>>>,
    ) -> (Vec<DeliveryRecord>, Vec<Option<Vec<u8>>>) {
        let mut kept = (Vec::with_capacity(taken.len()), Vec::with_capacity(taken.len()));
        for (record, body) in taken.into_iter().zip(bodies) {
            let body = match body {
                None => None,
                Some(Some(body)) => Some(body),
                Some(None) => {
                    tracing::warn!(delivery = %record.id, "Stored body missing; the broker will redeliver the event.");
                    counter!(m::STORE_UNDECODABLE, "family" => "payloads").increment(1);
                    self.retire(&record.id).await;
                    continue;
                }
            };
            kept.0.push(record);
            kept.1.push(body);
        }
        kept
    }

    /// `record` with its body read back from the store when it is kept apart (for the DLQ write).
    pub(super) fn with_body(&self, mut record: DeliveryRecord) -> Result<Option<DeliveryRecord>, StoreError> {
        if !record.body_apart {
            return Ok(Some(record));
        }
        match self.store.get_raw_many(Family::Payloads, &[&record.id])?.pop().flatten() {
            Some(body) => {
                record.event.body = body;
                Ok(Some(record))
            }
            None => Ok(None),
        }
    }

    /// How many of `ids` are still handed to `holder` and unsettled; the others are dropped from the set.
    pub(in crate::delivery) fn retain_held(&self, holder: u64, ids: &mut std::collections::HashSet<String>) -> usize {
        let table = self.table.lock();
        ids.retain(|id| {
            table.deliveries.get(id.as_str()).is_some_and(|t| {
                t.holder == Some(holder) && matches!(t.record.phase, Phase::AwaitingAck { .. }) && !t.redispatch
            })
        });
        ids.len()
    }

    /// A push subscriber left: the deliveries it held (`ids`, its own record of them) stay in flight (their
    /// ACK timeout brings them back) but no longer count against it. Only those are looked at, not the table.
    pub(in crate::delivery) fn forget_holder(&self, holder: u64, ids: &[String]) {
        let mut table = self.table.lock();
        for id in ids {
            if let Some(tracked) = table.deliveries.get_mut(id.as_str()) {
                if tracked.holder == Some(holder) {
                    tracked.holder = None;
                }
            }
        }
    }
}

/// The records a hand-out claimed, put back in the queue if the hand-out ends early: by an error, or because
/// its future was dropped (cancelled) before it stored them. A stored hand-out empties it.
pub(super) struct PutBackOnDrop<'a> {
    deliveries: &'a Deliveries,
    key: &'a str,
    ids: Vec<Id>,
}

impl Drop for PutBackOnDrop<'_> {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.deliveries.put_back(self.key, &self.ids);
        }
    }
}
