//! Settlement by subscribers: ACK, NACK, TERM, a new deadline, and what a peer settled.

use super::*;

impl Deliveries {
    /// Marks the target delivery claimed for the caller and returns a copy of its record, waiting while another
    /// task has it. A target naming an earlier hand-out than the current one is refused.
    pub(super) async fn claim(&self, target: impl Into<Target<'_>>) -> Result<DeliveryRecord, DeliveryError> {
        let Target { id, handout } = target.into();
        let started = tokio::time::Instant::now();
        loop {
            {
                let mut table = self.table.lock();
                match table.deliveries.get_mut(id) {
                    None => {
                        return Err(if table.stale.contains_key(id) {
                            DeliveryError::Stale
                        } else {
                            DeliveryError::Unknown
                        });
                    }
                    // Surrendered to the broker with its FIFO group's lost head: popgate no longer owns it.
                    Some(tracked) if tracked.surrender => return Err(DeliveryError::Stale),
                    // Handed out again since the hand-out the caller settles, or that hand-out's time ran out:
                    // not the caller's to settle any more.
                    Some(tracked) if handout.is_some_and(|n| !tracked.held_as(n)) => {
                        return Err(DeliveryError::Superseded)
                    }
                    Some(tracked) if !tracked.claimed => {
                        tracked.claimed = true;
                        return Ok(tracked.record.clone());
                    }
                    Some(_) => {}
                }
            }
            if started.elapsed() > CLAIM_WAIT {
                return Err(DeliveryError::Busy);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Ends a claim without a change; `owed` tells whether owed broker work failed (it is tried again after
    /// its backoff).
    pub(super) fn release(&self, id: &str, owed: OwedWork) {
        let mut table = self.table.lock();
        if let Some(tracked) = table.deliveries.get_mut(id) {
            tracked.claimed = false;
            if owed == OwedWork::Failed {
                tracked.owed_work_failed(Epoch::now());
            }
            table.wake(id, Epoch::ZERO);
        }
    }

    /// Persists `record` and makes it the tracked one, ending the claim; on a store failure nothing changes
    /// (the claim ends all the same, so the next tick or request can try again).
    pub(super) async fn commit(&self, mut record: DeliveryRecord, owed: OwedWork) -> Result<(), DeliveryError> {
        let id = record.id.clone();
        if let Err(error) = self.persist(&[&record]).await {
            self.release(&id, owed);
            return Err(error.into());
        }
        let mut table = self.table.lock();
        table.intern(&mut record);
        table.set_record(record);
        if let Some(tracked) = table.deliveries.get_mut(&*id) {
            tracked.claimed = false;
            if owed == OwedWork::Failed {
                tracked.owed_work_failed(Epoch::now());
            }
        }
        table.wake(&id, Epoch::ZERO);
        Ok(())
    }

    /// Claims `target` for a subscriber's settlement: refused (and the claim released, nothing changed) unless
    /// it is settleable ([`Deliveries::check_settleable`]).
    pub(super) async fn claim_settleable(&self, target: Target<'_>) -> Result<DeliveryRecord, DeliveryError> {
        let id = target.id;
        let record = self.claim(target).await?;
        self.settleable_or_released(id, record)
    }

    /// `record` (claimed as `id`) if a subscriber may settle it; else its claim is released and the refusal
    /// returned.
    fn settleable_or_released(&self, id: &str, record: DeliveryRecord) -> Result<DeliveryRecord, DeliveryError> {
        match self.check_settleable(&record) {
            Ok(()) => Ok(record),
            Err(refused) => {
                self.release(id, OwedWork::NotFailed);
                Err(refused)
            }
        }
    }

    /// Only a delivery that is handed out (or was, before a crash) may be settled by a subscriber.
    pub(super) fn check_settleable(&self, record: &DeliveryRecord) -> Result<(), DeliveryError> {
        match record.phase {
            Phase::AwaitingAck { .. } => {}
            Phase::Acked => return Err(DeliveryError::Unknown),
            Phase::Ready { .. } | Phase::DeadLetter { .. } => return Err(DeliveryError::NotInFlight),
        }
        if record.handle.lease_deadline() <= Epoch::now() {
            // The broker answers SUCCESS even to a lapsed handle, so the check is ours.
            return Err(DeliveryError::Stale);
        }
        Ok(())
    }

    /// The subscriber's ACK: the ACK intent is stored, then the broker is ACKed; a failed broker ACK is
    /// retried from the intent, so the client's answer does not depend on it.
    pub(in crate::delivery) async fn ack(&self, target: impl Into<Target<'_>>) -> Result<(), DeliveryError> {
        self.ack_many(&[target.into()]).await.pop().unwrap_or(Err(DeliveryError::Unknown))
    }

    /// A batch of subscriber ACKs, each answered as [`Deliveries::ack`] would. Cheaper than one by one: the
    /// ACK intents are stored in one write, and the broker gets one batch ACK request per broker instead of
    /// one request per message. An id given again in the same batch is ACKed again after the batch, as two
    /// single ACKs would be (so it is answered "unknown": already acknowledged).
    pub(in crate::delivery) async fn ack_many(&self, ids: &[Target<'_>]) -> Vec<Result<(), DeliveryError>> {
        let mut seen = HashSet::new();
        let (first, again): (Vec<usize>, Vec<usize>) = (0..ids.len()).partition(|&i| seen.insert(ids[i].id));
        let first_ids: Vec<Target<'_>> = first.iter().map(|&i| ids[i]).collect();
        let mut answers: Vec<Option<Result<(), DeliveryError>>> =
            std::iter::repeat_with(|| None).take(ids.len()).collect();
        for (&index, answer) in first.iter().zip(self.ack_unique(&first_ids).await) {
            answers[index] = Some(answer);
        }
        for index in again {
            answers[index] = self.ack_unique(&[ids[index]]).await.pop();
        }
        answers.into_iter().map(|answer| answer.unwrap_or(Err(DeliveryError::Unknown))).collect()
    }

    /// ACKs distinct ids: each is claimed and checked, the ACK intents of those that may be ACKed are stored
    /// in one write, then the broker is ACKed. Every answer is counted in `popgate_acks_total`.
    pub(super) async fn ack_unique(&self, ids: &[Target<'_>]) -> Vec<Result<(), DeliveryError>> {
        let claims = futures::future::join_all(ids.iter().map(|target| self.claim(*target))).await;
        let keys: Vec<String> =
            claims.iter().flatten().map(|record| Subscription::key_of(&record.group, &record.topic)).collect();
        let mut answers = Vec::with_capacity(ids.len());
        let mut acked: Vec<(usize, DeliveryRecord)> = Vec::new();
        let mut repeated = Vec::new();
        for (index, (target, claim)) in ids.iter().zip(claims).enumerate() {
            let checked = claim.and_then(|record| self.settleable_or_released(target.id, record));
            // The same hand-out ACKed again (its answer was lost on the way): answered as the first ACK was.
            let checked = match checked {
                Err(DeliveryError::Unknown) if self.was_acked(*target) => {
                    repeated.push(index);
                    answers.push(Ok(()));
                    continue;
                }
                other => other,
            };
            answers.push(checked.map(|mut record| {
                if let Phase::AwaitingAck { dispatched_ms, .. } = record.phase {
                    histogram!(m::ACK_LATENCY).record(Epoch::now().since(dispatched_ms).as_secs_f64());
                }
                record.phase = Phase::Acked;
                acked.push((index, record));
            }));
        }
        if let Err(error) = self.persist(&acked.iter().map(|(_, r)| r).collect::<Vec<_>>()).await {
            // Nothing of the batch was stored: each intent is stored alone, so each gets its own answer.
            tracing::debug!(%error, "Storing a batch of ACK intents failed; storing them one by one.");
            let mut stored = Vec::with_capacity(acked.len());
            for (index, record) in acked {
                match self.persist(&[&record]).await {
                    Ok(()) => stored.push((index, record)),
                    Err(error) => {
                        self.release(&record.id, OwedWork::NotFailed);
                        answers[index] = Err(error.into());
                    }
                }
            }
            acked = stored;
        }
        // Counted where the intents are stored, before the broker ACKs they allow.
        for (index, answer) in answers.iter().enumerate() {
            let result = match answer {
                Ok(()) if repeated.contains(&index) => "repeated",
                Ok(()) => "acked",
                Err(error) => error.code(),
            };
            counter!(m::ACKS, "result" => result).increment(1);
        }
        let acked: Vec<DeliveryRecord> = acked.into_iter().map(|(_, record)| record).collect();
        {
            let mut table = self.table.lock();
            let now = Epoch::now();
            for record in &acked {
                table.acked.remember(record.id.clone(), record.handouts, now);
                table.set_record(record.clone());
                if let Some(tracked) = table.deliveries.get_mut(&*record.id) {
                    tracked.redispatch = false;
                }
            }
        }
        self.broker_ack_many(&acked).await;
        // A settled delivery frees a push subscriber's prefetch slot and may unblock its message group.
        self.ring_each(keys);
        answers
    }

    /// [`Deliveries::broker_ack`] for many claimed deliveries: one batch ACK request per broker; what the
    /// broker did not take in the batch is ACKed alone.
    pub(super) async fn broker_ack_many(&self, records: &[DeliveryRecord]) {
        if let [record] = records {
            return self.broker_ack(record).await;
        }
        if records.is_empty() {
            return;
        }
        let entries: Vec<AckEntry<'_>> =
            records.iter().map(|r| AckEntry { group: &r.group, topic: &r.topic, handle: &r.handle }).collect();
        let answers = self.cluster.ack_batch(&entries).await;
        let mut alone = Vec::new();
        for (record, answer) in records.iter().zip(answers) {
            match answer {
                Ok(true) => self.broker_acked(record, Ok(())).await,
                Ok(false) => alone.push(record),
                Err(error) => self.broker_acked(record, Err(error)).await,
            }
        }
        futures::future::join_all(alone.into_iter().map(|r| self.broker_ack(r))).await;
    }

    /// ACKs the broker for a claimed delivery whose ACK intent (or DLQ write) is done, and retires it; on
    /// failure the claim ends and the sweeper retries after a pause.
    pub(super) async fn broker_ack(&self, record: &DeliveryRecord) {
        let result = self.cluster.ack(&record.group, &record.handle).await;
        self.broker_acked(record, result).await;
    }

    /// The end of a broker ACK: retired when the broker took it; otherwise the claim ends and the sweeper
    /// retries from the ACK intent after a pause.
    pub(super) async fn broker_acked(&self, record: &DeliveryRecord, result: Result<(), BrokerError>) {
        match result {
            Ok(()) => {
                counter!(m::BROKER_ACKS).increment(1);
                self.retire(&record.id).await;
            }
            Err(error) => {
                counter!(m::BROKER_ACK_FAILURES).increment(1);
                tracing::warn!(%error, delivery = %record.id, "Broker ACK failed; retrying from the ACK intent.");
                self.release(&record.id, OwedWork::Failed);
            }
        }
    }

    /// Whether `target` names a hand-out whose ACK was stored lately (a repeated ACK). Only targets that name
    /// their hand-out: an HTTP delivery id ACKed twice is answered "unknown", as it always was.
    pub(super) fn was_acked(&self, target: Target<'_>) -> bool {
        target.handout.is_some_and(|handout| self.table.lock().acked.contains(target.id, handout, Epoch::now()))
    }

    /// The subscriber's NACK: the attempt is spent; the next is scheduled after `delay` (or the backoff).
    pub(in crate::delivery) async fn nack<'a>(
        &self,
        target: impl Into<Target<'a>>,
        delay: Option<Duration>,
    ) -> Result<NackOutcome, DeliveryError> {
        let target = target.into();
        let id = target.id;
        let mut record = self.claim_settleable(target).await?;
        let outcome = self.spend_attempt(&mut record, "nack", delay);
        self.commit(record, OwedWork::NotFailed).await?;
        self.after_spent(id, &outcome, "nack");
        Ok(outcome)
    }

    /// The subscriber's TERM: straight to the DLQ with its reason.
    pub(in crate::delivery) async fn term<'a>(
        &self,
        target: impl Into<Target<'a>>,
        reason: &str,
    ) -> Result<(), DeliveryError> {
        let target = target.into();
        let id = target.id;
        let mut record = self.claim_settleable(target).await?;
        record.last_failure = Some(format!("terminated: {reason}"));
        record.phase = Phase::DeadLetter { reason: format!("terminated by the subscriber: {reason}") };
        self.commit(record, OwedWork::NotFailed).await?;
        self.after_spent(id, &NackOutcome::DeadLetter, "term");
        Ok(())
    }

    /// Applies a failed attempt to `record`: the next attempt after the backoff (or `delay`), or the DLQ.
    pub(super) fn spend_attempt(
        &self,
        record: &mut DeliveryRecord,
        reason: &str,
        delay: Option<Duration>,
    ) -> NackOutcome {
        record.last_failure = Some(reason.to_owned());
        let policy = self
            .table
            .lock()
            .subs
            .get(&Subscription::key_of(&record.group, &record.topic))
            .map(|a| a.policy)
            .unwrap_or_else(|| RetryPolicy::from_config(&self.config).unwrap_or(RetryPolicy::SEED_DEFAULT));
        match policy.next(record.attempt, &mut rand::rng()) {
            NextStep::RetryAfter(backoff, next) => {
                let due = Epoch::now() + delay.unwrap_or(backoff);
                record.attempt = next;
                record.phase = Phase::Ready { due_ms: due };
                NackOutcome::Retry { attempt: next, due }
            }
            NextStep::DeadLetter => {
                record.phase = Phase::DeadLetter { reason: reason.to_owned() };
                NackOutcome::DeadLetter
            }
        }
    }

    /// After an attempt was spent (stored): the delivery leaves its holder, and its group may move on.
    pub(super) fn after_spent(&self, id: &str, outcome: &NackOutcome, reason: &'static str) {
        let key = self.table.lock().deliveries.get_mut(id).map(|tracked| {
            tracked.holder = None;
            tracked.redispatch = false;
            tracked.key()
        });
        if matches!(outcome, NackOutcome::Retry { .. }) {
            counter!(m::REDELIVERIES, "reason" => reason).increment(1);
        }
        self.ring_each(key);
    }

    /// A push transport could not hand these deliveries to its subscriber (the write failed, the connection
    /// is gone): they are dispatched again at once, to any subscriber. The subscriber never saw them, so no
    /// attempt is spent.
    pub(in crate::delivery) async fn push_failed(&self, ids: &[String], transport: &'static str, reason: &'static str) {
        for id in ids {
            let Ok(mut record) = self.claim(id).await else { continue };
            if !matches!(record.phase, Phase::AwaitingAck { .. }) {
                self.release(id, OwedWork::NotFailed);
                continue;
            }
            record.phase = Phase::Ready { due_ms: Epoch::now() };
            if self.commit(record, OwedWork::NotFailed).await.is_err() {
                continue;
            }
            if reason == "push_failure" {
                counter!(m::PUSH_WRITE_FAILURES, "transport" => transport).increment(1);
            }
            counter!(m::REDELIVERIES, "reason" => "push_failure").increment(1);
            if let Some(tracked) = self.table.lock().deliveries.get_mut(id.as_str()) {
                tracked.holder = None;
            }
        }
        self.queue_now(ids);
    }
}
