//! Deliveries held by gRPC clients: kept alive, written, released.

use super::*;

impl Deliveries {
    /// Extends to `now + hold` the ACK deadline of every delivery one of `clients` holds with `auto_renew`,
    /// handed out less than `max_hold` ago; stored first, as every change. One pass over the table for all
    /// clients. Returns how many were extended.
    pub(in crate::delivery) async fn keep_held(
        &self,
        clients: &std::collections::HashSet<String>,
        hold: Duration,
        max_hold: Duration,
    ) -> Result<usize, DeliveryError> {
        let now = Epoch::now();
        let new_deadline = now + hold;
        let hold_half = hold / 2;
        let oldest = now - max_hold;
        let mut extended: Vec<DeliveryRecord> = Vec::new();
        {
            let mut table = self.table.lock();
            // Only what the live clients hold (the holder index), not the whole table.
            let held: Vec<Id> = clients.iter().flat_map(|client| table.held_by_client(client)).collect();
            for id in held {
                let Some(tracked) = table.deliveries.get_mut(&id) else { continue };
                let Phase::AwaitingAck { deadline_ms, dispatched_ms, holder: Some(holder) } = &tracked.record.phase
                else {
                    continue;
                };
                // Rewritten only once half the hold is used up, so a live client costs a write per delivery
                // every hold/2, not every keep-alive tick.
                // Only what the client took in: a message it never got must come back by its deadline.
                let due = holder.auto_renew && holder.written && *deadline_ms < now + hold_half;
                if !due || tracked.claimed || *dispatched_ms < oldest {
                    continue;
                }
                tracked.claimed = true;
                let mut record = tracked.record.clone();
                if let Phase::AwaitingAck { deadline_ms, .. } = &mut record.phase {
                    *deadline_ms = new_deadline;
                }
                extended.push(record);
            }
        }
        self.commit_claimed(extended).await
    }

    /// Stores `records` (each claimed by the caller) in one write and makes them the tracked ones, ending the
    /// claims; on a store failure nothing changes but the claims end all the same. Returns how many.
    pub(super) async fn commit_claimed(&self, records: Vec<DeliveryRecord>) -> Result<usize, DeliveryError> {
        if records.is_empty() {
            return Ok(0);
        }
        let stored = self.persist(&records.iter().collect::<Vec<_>>()).await;
        let mut table = self.table.lock();
        for record in &records {
            if stored.is_ok() {
                table.set_record(record.clone());
            }
            if let Some(tracked) = table.deliveries.get_mut(&*record.id) {
                tracked.claimed = false;
            }
            table.wake(&record.id, Epoch::ZERO);
        }
        stored.map(|()| records.len()).map_err(DeliveryError::from)
    }

    /// The hand-outs `handed` (delivery id, hand-out number) reached their gRPC client: each one still held
    /// as that hand-out is stored as written, in one write. One being settled meanwhile is left alone (its
    /// settlement decides). Returns how many were marked.
    pub(in crate::delivery) async fn mark_written(&self, handed: &[(String, u32)]) -> Result<usize, DeliveryError> {
        let mut marked: Vec<DeliveryRecord> = Vec::new();
        {
            let mut table = self.table.lock();
            for (id, handout) in handed {
                let Some(tracked) = table.deliveries.get_mut(id.as_str()) else { continue };
                if tracked.claimed || !tracked.held_as(*handout) {
                    continue;
                }
                let mut record = tracked.record.clone();
                let Phase::AwaitingAck { holder: Some(holder), .. } = &mut record.phase else { continue };
                if holder.written {
                    continue;
                }
                holder.written = true;
                tracked.claimed = true;
                marked.push(record);
            }
        }
        self.commit_claimed(marked).await
    }

    /// The ids of the deliveries `client_id` holds.
    pub(in crate::delivery) fn held_by_client(&self, client_id: &str) -> Vec<String> {
        self.table.lock().held_by_client(client_id).iter().map(|id| id.to_string()).collect()
    }

    /// Sets the ACK deadline of a handed-out delivery to `now + by` (a SimpleConsumer's
    /// ChangeInvisibleDuration); returns the new deadline.
    pub(in crate::delivery) async fn extend<'a>(
        &self,
        target: impl Into<Target<'a>>,
        by: Duration,
    ) -> Result<Epoch, DeliveryError> {
        let mut record = self.claim_settleable(target.into()).await?;
        let new_deadline = Epoch::now() + by;
        if let Phase::AwaitingAck { deadline_ms, .. } = &mut record.phase {
            *deadline_ms = new_deadline;
        }
        self.commit(record, OwedWork::NotFailed).await?;
        Ok(new_deadline)
    }

    /// Who holds a tracked delivery, and for which group and topic.
    pub(in crate::delivery) fn hold_of(&self, id: &str) -> Option<(String, String, Option<Holder>)> {
        let table = self.table.lock();
        let record = &table.deliveries.get(id)?.record;
        let holder = match &record.phase {
            Phase::AwaitingAck { holder, .. } => holder.clone(),
            _ => None,
        };
        Some((record.group.to_string(), record.topic.to_string(), holder))
    }
}
