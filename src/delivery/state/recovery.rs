//! Boot recovery and the admin view.

use super::*;

impl Deliveries {
    /// Tracks a stored record again after a restart (see `recovery`). A delivery that was handed out stays
    /// ACKable by its holder and is dispatched again at once, attempt kept; one a gRPC client took in stays
    /// with that client until its deadline.
    pub(in crate::delivery) fn restore(&self, record: DeliveryRecord) -> Restored {
        let mut table = self.table.lock();
        if table.deliveries.contains_key(&*record.id) {
            return Restored::Skipped;
        }
        self.next_seq.fetch_max(record.seq + 1, Ordering::Relaxed);
        let lapsed = record.handle.lease_deadline() <= Epoch::now();
        let outcome = match record.phase {
            Phase::AwaitingAck { .. } | Phase::Ready { .. } if lapsed => Restored::LeaseLapsed,
            Phase::AwaitingAck { .. } => Restored::Redispatched { was_handed_out: true },
            Phase::Ready { .. } => Restored::Redispatched { was_handed_out: false },
            Phase::Acked => Restored::AckPending,
            Phase::DeadLetter { .. } => Restored::DeadLetterPending,
        };
        let mut tracked = Tracked::new(record);
        // A gRPC client keeps its handles across the restart and ACKs with them: what it took in stays handed
        // out until its deadline. Any other hand-out is dispatched again at once, and so is one recorded for a
        // gRPC client that popgate died before writing to it (it never got the message).
        tracked.redispatch = match &tracked.record.phase {
            Phase::AwaitingAck { holder: Some(holder), .. } => !holder.written,
            Phase::AwaitingAck { holder: None, .. } => true,
            _ => false,
        };
        table.insert(tracked);
        outcome
    }

    /// Sets the pending-deliveries gauge once recovery has restored every record (not once per record: a
    /// million gauge look-ups would be a noticeable part of the boot).
    pub(in crate::delivery) fn publish_pending_gauge(&self) {
        Self::set_pending_gauge(&self.table.lock());
    }

    /// Removes a stored record that no longer decodes, without any broker ACK.
    pub(in crate::delivery) async fn discard_undecodable(&self, key: &str) {
        let _ =
            self.store.apply(&[Change::Delete(Family::Deliveries, key), Change::Delete(Family::Payloads, key)]).await;
    }

    /// The consumer group of a tracked delivery (to authorize its ACK, NACK or TERM).
    pub(in crate::delivery) fn source_of(&self, id: &str) -> Option<(String, String)> {
        self.table.lock().deliveries.get(id).map(|t| (t.record.group.to_string(), t.record.topic.to_string()))
    }

    /// When the oldest unsettled delivery (ready or handed out) of each subscription key was popped, for the
    /// oldest-unacknowledged-age gauge; keys with none are absent. Read-only.
    pub(in crate::delivery) fn oldest_unsettled(&self) -> HashMap<String, Epoch> {
        let table = self.table.lock();
        let mut oldest: HashMap<(Arc<str>, Arc<str>), Epoch> = HashMap::new();
        for tracked in table.deliveries.values().filter(|t| t.unsettled()) {
            let (record, at) = (&tracked.record, tracked.admitted_at);
            oldest.entry((record.group.clone(), record.topic.clone())).and_modify(|o| *o = (*o).min(at)).or_insert(at);
        }
        drop(table);
        oldest.into_iter().map(|((group, topic), at)| (Subscription::key_of(&group, &topic), at)).collect()
    }

    /// Up to `max` tracked deliveries (of `group`, when given), oldest admission first.
    pub(in crate::delivery) fn in_flight(&self, group: Option<&str>, max: usize) -> Vec<InFlight> {
        let table = self.table.lock();
        let mut found: Vec<&Tracked> =
            table.deliveries.values().map(|t| &**t).filter(|t| group.is_none_or(|g| &*t.record.group == g)).collect();
        found.sort_by_key(|t| t.record.seq);
        found
            .into_iter()
            .take(max)
            .map(|tracked| {
                let record = &tracked.record;
                let (phase, due_ms) = match &record.phase {
                    Phase::Ready { due_ms } => ("ready", Some(*due_ms)),
                    Phase::AwaitingAck { deadline_ms, .. } => ("awaiting_ack", Some(*deadline_ms)),
                    Phase::Acked => ("ack_pending", None),
                    Phase::DeadLetter { .. } => ("dead_letter_pending", None),
                };
                InFlight {
                    delivery_id: record.id.to_string(),
                    group: record.group.to_string(),
                    topic: record.topic.to_string(),
                    event_id: record.event.id.clone(),
                    attempt: record.attempt,
                    phase,
                    due_ms: due_ms.map(Epoch::as_millis),
                    subscriber: tracked.holder.map(|h| format!("push-{h}")),
                    last_failure: record.last_failure.clone(),
                    lease_deadline_ms: record.handle.lease_deadline().as_millis(),
                }
            })
            .collect()
    }
}
