//! A model test of the delivery state machine: random sequences of admit, hand-out, ACK, NACK, TERM, ACK
//! timeout, lease loss, broker failure, time passing and crash-with-recovery are run against [`Deliveries`]
//! over a real store, with a fake cluster ([`FakeCluster`]) that fails on command and checks what it is
//! asked. After every step:
//! - **never a broker ACK without a stored intent**: the fake refuses (and records) an ACK whose delivery is
//!   not stored as ACKed, or dead-lettered and written to the DLQ first;
//! - **never two holders**: a delivery is not handed out again while the subscriber it was handed to may
//!   still settle it, and a delivery whose lease was given up cannot be settled any more;
//! - **FIFO heads**: the handed-out deliveries of a message group are its head and the deliveries right after
//!   it, all from one hand-out (a FIFO batch; one delivery, the head, for a hand-out that asks for none);
//! - **the store agrees with memory** about which deliveries are held.
//!
//! At the end the broker comes back and everything handed out is ACKed until nothing is left: every event
//! admitted (the broker's redeliveries of lost leases included) ends ACKed at the broker or in the DLQ.
//!
//! The run prints its seed; `MODEL_SEED=<n>` replays one, `MODEL_CASES=<n>` runs more cases.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

use super::fake_cluster::FakeCluster;
use super::{Admission, Deliveries};
use crate::broker::consumer::{Popped, PoppedEvent, ReceiptHandle};
use crate::clock::Epoch;
use crate::delivery::record::{DeliveryRecord, Phase, Subscription};
use crate::delivery::retry::RetryPolicy;
use crate::delivery::test_support::{offline_parts, subscription};
use crate::delivery::{DeliveryError, HandOut, Holder, Target};
use crate::store::{Family, StateStore};

/// One step of a run.
#[derive(Debug, Clone)]
enum Step {
    /// The broker hands out `count` new messages (its redeliveries of lost leases first), of message group
    /// `group` (`None`: no group).
    Admit {
        count: usize,
        group: Option<u8>,
    },
    /// A subscriber asks for up to `max` deliveries, as a FIFO batch (`batch`) or heads only.
    HandOut {
        max: usize,
        batch: bool,
    },
    /// The subscriber settles the `pick`-th delivery it holds.
    Ack {
        pick: usize,
    },
    Nack {
        pick: usize,
    },
    Term {
        pick: usize,
    },
    /// Every handed-out delivery misses its ACK deadline.
    AckTimeout,
    /// The `pick`-th tracked delivery's broker lease lapses (popgate could not renew it in time).
    LeaseLoss {
        pick: usize,
    },
    /// The broker goes down or comes back.
    Broker {
        up: bool,
    },
    /// Retries and backoffs fall due; the sweeper runs and its owed work is done.
    TimePasses,
    /// popgate is killed and restarts on the same store.
    Crash,
    /// gRPC client `client` receives up to `max` deliveries: held as its own, auto-renewed, not yet written.
    HandOutHeld {
        max: usize,
        client: u8,
    },
    /// Client `client` took in every response it was sent: what it holds is stored as written.
    Written {
        client: u8,
    },
    /// The live clients' keep-alive: what they hold, written and auto-renewed, gets a new deadline.
    KeepHeld,
    /// A settlement reaches popgate forwarded by a peer, naming the hand-out it was for (`stale`: an earlier
    /// hand-out's, which must be refused and change nothing).
    AckForwarded {
        pick: usize,
        stale: bool,
    },
    /// The subscription is removed and made again: what was unsettled goes back to the broker.
    Resubscribe,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (1..4usize, prop::option::of(0..3u8)).prop_map(|(count, group)| Step::Admit { count, group }),
        4 => (1..5usize, any::<bool>()).prop_map(|(max, batch)| Step::HandOut { max, batch }),
        3 => any::<usize>().prop_map(|pick| Step::Ack { pick }),
        1 => any::<usize>().prop_map(|pick| Step::Nack { pick }),
        1 => any::<usize>().prop_map(|pick| Step::Term { pick }),
        1 => Just(Step::AckTimeout),
        1 => any::<usize>().prop_map(|pick| Step::LeaseLoss { pick }),
        1 => any::<bool>().prop_map(|up| Step::Broker { up }),
        2 => Just(Step::TimePasses),
        1 => Just(Step::Crash),
        2 => (1..4usize, 0..2u8).prop_map(|(max, client)| Step::HandOutHeld { max, client }),
        1 => (0..2u8).prop_map(|client| Step::Written { client }),
        1 => Just(Step::KeepHeld),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(pick, stale)| Step::AckForwarded { pick, stale }),
        1 => Just(Step::Resubscribe),
    ]
}

/// One run: the system under test and what the model knows.
struct Run {
    dir: tempfile::TempDir,
    cluster: Arc<FakeCluster>,
    /// `None` only while a crash is being replayed.
    deliveries: Option<Deliveries>,
    sub: Subscription,
    /// Deliveries handed out and not settled or released, as the subscriber sees them (in hand-out order).
    held: Vec<String>,
    /// The hand-out (a number, and whether it was a FIFO batch) each delivery was last handed out in.
    hand_outs: HashMap<String, (u64, bool)>,
    /// The hand-out number each held delivery was last handed out as, and the gRPC client holding it (if one).
    handout_of: HashMap<String, (u32, Option<u8>)>,
    /// Deliveries whose lease was given up: never settleable again.
    given_up: HashSet<String>,
    /// Every event the broker handed out (by event id), and the ones it must hand out again (lease lost).
    events: HashSet<String>,
    redeliveries: Vec<(String, Option<String>, u32)>,
    next_event: AtomicU64,
}

fn store_at(dir: &std::path::Path) -> Arc<StateStore> {
    Arc::new(StateStore::open(dir, true).expect("open the store"))
}

async fn deliveries_over(store: Arc<StateStore>, cluster: Arc<FakeCluster>) -> Deliveries {
    let (broker, _publisher, config) = offline_parts().await;
    Deliveries::with_cluster(store, broker, cluster, config)
}

fn popped(event_id: &str, group: Option<String>, reconsume_times: u32, checkpoint: u64) -> Popped {
    let now = Epoch::now();
    let event = PoppedEvent {
        id: event_id.to_owned(),
        topic: "t".into(),
        tags: None,
        keys: Vec::new(),
        properties: BTreeMap::new(),
        body: event_id.as_bytes().to_vec(),
        born_timestamp: now.as_millis(),
        reconsume_times,
        retry_topic: None,
        message_group: group,
        stored: Default::default(),
    };
    let handle = ReceiptHandle {
        broker_name: "broker-a".into(),
        broker_addr: "127.0.0.1:1".into(),
        extra_info: format!("ck-{checkpoint}"),
        ack_topic: "t".into(),
        queue_id: 0,
        queue_offset: checkpoint as i64,
        pop_time_ms: now.as_millis(),
        invisible_ms: 3_600_000,
        lease_until_ms: now + Duration::from_millis(3_600_000),
    };
    Popped { event, handle }
}

impl Run {
    async fn new() -> Run {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = store_at(dir.path());
        let cluster = Arc::new(FakeCluster::new(store.clone()));
        let deliveries = deliveries_over(store, cluster.clone()).await;
        let sub = Subscription { ordered: true, ..subscription() };
        deliveries.put_subscription(sub.clone(), RetryPolicy::SEED_DEFAULT).await.expect("subscribe");
        Run {
            dir,
            cluster,
            deliveries: Some(deliveries),
            sub,
            held: Vec::new(),
            hand_outs: HashMap::new(),
            handout_of: HashMap::new(),
            given_up: HashSet::new(),
            events: HashSet::new(),
            redeliveries: Vec::new(),
            next_event: AtomicU64::new(1),
        }
    }

    fn d(&self) -> &Deliveries {
        self.deliveries.as_ref().expect("deliveries are replaced only inside a crash step")
    }

    fn pick(&self, pick: usize) -> Option<String> {
        (!self.held.is_empty()).then(|| self.held[pick % self.held.len()].clone())
    }

    fn tracked_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.d().table.lock().deliveries.keys().map(|id| id.to_string()).collect();
        ids.sort();
        ids
    }

    /// Runs the sweeper once at `now` and does all the owed work it returns.
    async fn sweep_and_perform(&self) {
        for owed in self.d().sweep(Epoch::now()).await {
            self.d().perform(owed).await;
        }
    }

    /// What the table holds now: delivery id, and its event as the broker would redeliver it.
    fn snapshot(&self) -> HashMap<String, (String, Option<String>, u32, String)> {
        let table = self.d().table.lock();
        table
            .deliveries
            .values()
            .map(|t| {
                let (record, event) = (&t.record, &t.record.event);
                let redelivered = (event.id.clone(), event.message_group.clone(), event.reconsume_times + 1);
                (record.id.to_string(), (redelivered.0, redelivered.1, redelivered.2, record.handle.extra_info.clone()))
            })
            .collect()
    }

    /// Deliveries that left the table without a broker ACK of their checkpoint: popgate gave them up (or
    /// back), so the broker hands their events out again, as a new delivery each.
    fn note_vanished(&mut self, before: HashMap<String, (String, Option<String>, u32, String)>) {
        let now_tracked: HashSet<String> = self.tracked_ids().into_iter().collect();
        let acked = self.cluster.acked.lock().clone();
        for (id, (event, group, times, checkpoint)) in before {
            if now_tracked.contains(&id) || acked.contains_key(&checkpoint) {
                continue;
            }
            self.given_up.insert(id);
            self.redeliveries.push((event, group, times));
        }
    }

    async fn apply(&mut self, step: &Step) -> Result<(), TestCaseError> {
        let before = self.snapshot();
        let outcome = self.apply_step(step).await;
        self.note_vanished(before);
        outcome?;
        self.check()
    }

    async fn apply_step(&mut self, step: &Step) -> Result<(), TestCaseError> {
        match step {
            Step::Admit { count, group } => {
                let mut batch = Vec::new();
                for _ in 0..*count {
                    let checkpoint = self.next_event.fetch_add(1, Ordering::Relaxed);
                    let (id, group, times) = self
                        .redeliveries
                        .pop()
                        .unwrap_or_else(|| (format!("e{checkpoint}"), group.map(|g| format!("g{g}")), 0));
                    self.events.insert(id.clone());
                    batch.push(popped(&id, group, times, checkpoint));
                }
                let admitted = self.d().admit(&self.sub.key(), batch).await;
                prop_assert!(matches!(admitted, Admission::Admitted), "the store takes the admission");
            }
            Step::HandOut { max, batch } => self.hand_out(*max, *batch, None).await?,
            Step::HandOutHeld { max, client } => self.hand_out(*max, false, Some(*client)).await?,
            Step::Written { client } => {
                let handed: Vec<(String, u32)> = self
                    .held
                    .iter()
                    .filter_map(|id| match self.handout_of.get(id) {
                        Some((handout, Some(holder))) if holder == client => Some((id.clone(), *handout)),
                        _ => None,
                    })
                    .collect();
                let _ = self.d().mark_written(&handed).await;
            }
            Step::KeepHeld => {
                let clients: HashSet<String> = (0..2u8).map(holder_id).collect();
                let _ = self.d().keep_held(&clients, Duration::from_secs(60), Duration::from_secs(3_600)).await;
            }
            Step::AckForwarded { pick, stale } => self.ack_forwarded(*pick, *stale).await?,
            Step::Resubscribe => {
                let sub = self.sub.clone();
                let _ = self.d().remove_subscription(&sub.group, &sub.topic).await;
                self.sweep_and_perform().await;
                self.d().put_subscription(sub, RetryPolicy::SEED_DEFAULT).await.expect("subscribe");
                // What was given back left the table: the broker hands it out again (noted as vanished).
                let gone: Vec<String> =
                    self.held.iter().filter(|id| self.d().tracked_record(id).is_none()).cloned().collect();
                self.held.retain(|id| !gone.contains(id));
            }
            Step::Ack { pick } => self.settle(*pick, Settle::Ack).await?,
            Step::Nack { pick } => self.settle(*pick, Settle::Nack).await?,
            Step::Term { pick } => self.settle(*pick, Settle::Term).await?,
            Step::AckTimeout => {
                {
                    let mut table = self.d().table.lock();
                    for tracked in table.deliveries.values_mut() {
                        if let Phase::AwaitingAck { deadline_ms, .. } = &mut tracked.record.phase {
                            *deadline_ms = Epoch::now() - Duration::from_millis(1);
                        }
                    }
                }
                self.sweep_and_perform().await;
                // The memory-only deadline change is what the sweeper acted on; whatever it could not store
                // stays handed out in the store, so a crash redispatches it: the subscriber lets go of all.
                self.held.clear();
            }
            Step::LeaseLoss { pick } => {
                let ids = self.tracked_ids();
                if ids.is_empty() {
                    return Ok(());
                }
                let id = ids[pick % ids.len()].clone();
                let checkpoint = {
                    let mut table = self.d().table.lock();
                    let checkpoint = table.deliveries.get_mut(id.as_str()).map(|tracked| {
                        tracked.record.handle.lease_until_ms = Epoch::now() - Duration::from_millis(1);
                        tracked.record.handle.extra_info.clone()
                    });
                    table.wake(&id, Epoch::ZERO);
                    checkpoint.unwrap_or_default()
                };
                self.sweep_and_perform().await;
                let given_up =
                    self.d().tracked_record(&id).is_none() && !self.cluster.acked.lock().contains_key(&checkpoint);
                if given_up && self.held.contains(&id) {
                    let late = self.d().ack(&id).await;
                    prop_assert!(matches!(late, Err(DeliveryError::Stale)), "late ACK of a lost lease: {late:?}");
                    self.held.retain(|held| *held != id);
                }
            }
            Step::Broker { up } => self.cluster.down.store(!up, Ordering::Relaxed),
            Step::TimePasses => {
                {
                    let mut table = self.d().table.lock();
                    let now = Epoch::now();
                    let ids: Vec<_> = table.deliveries.keys().cloned().collect();
                    for tracked in table.deliveries.values_mut() {
                        if let Phase::Ready { due_ms } = &mut tracked.record.phase {
                            *due_ms = (*due_ms).min(now - Duration::from_millis(1));
                        }
                        tracked.owed_retry_at = Epoch::ZERO;
                        tracked.renew_retry_at = Epoch::ZERO;
                    }
                    for id in ids {
                        table.wake(&id, Epoch::ZERO);
                    }
                }
                self.sweep_and_perform().await;
                // Surrendered followers and give-backs leave in the next pass.
                self.sweep_and_perform().await;
                let gone: Vec<String> =
                    self.held.iter().filter(|id| self.d().tracked_record(id).is_none()).cloned().collect();
                self.held.retain(|id| !gone.contains(id));
            }
            Step::Crash => {
                // Everything that holds the old store goes, so its writer ends and the directory is free.
                *self.cluster.store.lock() = None;
                self.deliveries = None;
                let store = store_at(self.dir.path());
                *self.cluster.store.lock() = Some(store.clone());
                self.deliveries = Some(deliveries_over(store, self.cluster.clone()).await);
                crate::delivery::recovery::recover(self.d())
                    .await
                    .map_err(|e| TestCaseError::fail(format!("recovery failed: {e}")))?;
                // HTTP hand-outs (and what a gRPC client never took in) are dispatched again after a restart: the
                // subscriber may still ACK, but the model lets go of them (a redelivery of the same id is then
                // expected). What a gRPC client took in stays with it, and it settles it.
                let kept_by_client = |record: Option<DeliveryRecord>| matches!(record.map(|r| r.phase), Some(Phase::AwaitingAck { holder: Some(holder), .. }) if holder.written);
                let held = std::mem::take(&mut self.held);
                self.held = held.into_iter().filter(|id| kept_by_client(self.d().tracked_record(id))).collect();
            }
        }
        Ok(())
    }

    /// A subscriber asks for up to `max` deliveries, as a FIFO batch (`batch`) or heads only; a gRPC client
    /// (`client`) holds what it gets as its own, auto-renewed.
    async fn hand_out(&mut self, max: usize, batch: bool, client: Option<u8>) -> Result<(), TestCaseError> {
        let holder = client.map(|c| Holder { client_id: holder_id(c), auto_renew: true, written: false });
        let to = HandOut { transport: "poll", ack_timeout: None, holder, fifo_batch: batch };
        let before = self.fifo_groups();
        let handed = self.d().hand_out(&self.sub.key(), max, &to, None).await;
        let handed = handed.map_err(|e| TestCaseError::fail(format!("hand-out failed: {e}")))?;
        // What it took of each message group: the group's first unsettled deliveries, of a group nobody held.
        let mut taken: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for delivery in &handed {
            if let (Some(group), Some(record)) =
                (delivery.event.message_group.clone(), self.d().tracked_record(&delivery.id))
            {
                taken.entry(group).or_default().push(record.seq);
            }
        }
        for (group, mut seqs) in taken {
            seqs.sort_unstable();
            let (unsettled, held) = before.get(&group).cloned().unwrap_or_default();
            prop_assert!(!held, "group {group} was handed out while another hand-out held it");
            prop_assert_eq!(&unsettled[..seqs.len().min(unsettled.len())], &seqs[..], "group {}: its first", group);
        }
        let hand_out = self.next_event.fetch_add(1, Ordering::Relaxed);
        for delivery in handed {
            prop_assert!(!self.held.contains(&delivery.id), "{} handed out twice", delivery.id);
            prop_assert!(!self.given_up.contains(&delivery.id), "{} handed out after its lease", delivery.id);
            self.hand_outs.insert(delivery.id.clone(), (hand_out, batch));
            self.handout_of.insert(delivery.id.clone(), (delivery.handout, client));
            self.held.push(delivery.id);
        }
        Ok(())
    }

    /// An ACK forwarded by a peer, naming the hand-out: the current one settles as an ACK does; an earlier one
    /// (`stale`) is refused and changes nothing.
    async fn ack_forwarded(&mut self, pick: usize, stale: bool) -> Result<(), TestCaseError> {
        let Some(id) = self.pick(pick) else { return Ok(()) };
        let Some(&(handout, _)) = self.handout_of.get(&id) else { return Ok(()) };
        if stale {
            if handout < 2 {
                return Ok(());
            }
            let before = self.d().tracked_record(&id);
            let answer = self.d().ack(Target { id: &id, handout: Some(handout - 1) }).await;
            prop_assert!(answer.is_err(), "an earlier hand-out's ACK of {id} was taken");
            prop_assert_eq!(self.d().tracked_record(&id), before, "a refused ACK changed {}", id);
            return Ok(());
        }
        match self.d().ack(Target { id: &id, handout: Some(handout) }).await {
            Ok(()) | Err(DeliveryError::Stale) => self.held.retain(|held| *held != id),
            Err(DeliveryError::Store(_)) => {}
            Err(other) => return Err(TestCaseError::fail(format!("forwarded ACK of held {id} refused: {other}"))),
        }
        Ok(())
    }

    async fn settle(&mut self, pick: usize, how: Settle) -> Result<(), TestCaseError> {
        let Some(id) = self.pick(pick) else { return Ok(()) };
        let answer = match how {
            Settle::Ack => self.d().ack(&id).await,
            Settle::Nack => self.d().nack(&id, None).await.map(|_| ()),
            Settle::Term => self.d().term(&id, "model").await,
        };
        match answer {
            Ok(()) => self.held.retain(|held| *held != id),
            // Given up or surrendered with its FIFO group's lost head: popgate no longer owns it.
            Err(DeliveryError::Stale) => self.held.retain(|held| *held != id),
            Err(DeliveryError::Store(_)) => {}
            Err(other) => return Err(TestCaseError::fail(format!("{how:?} of held {id} refused: {other}"))),
        }
        Ok(())
    }

    /// Each message group's unsettled deliveries (by `seq`) and whether one of its deliveries is handed out.
    fn fifo_groups(&self) -> BTreeMap<String, (Vec<u64>, bool)> {
        let table = self.d().table.lock();
        let mut groups: BTreeMap<String, (Vec<u64>, bool)> = BTreeMap::new();
        for tracked in table.deliveries.values() {
            let Some(group) = tracked.record.event.message_group.clone() else { continue };
            let entry = groups.entry(group).or_default();
            if tracked.unsettled() {
                entry.0.push(tracked.record.seq);
            }
            entry.1 |= tracked.handed_out();
        }
        for (unsettled, _) in groups.values_mut() {
            unsettled.sort_unstable();
        }
        groups
    }

    /// The invariants, after every step.
    fn check(&self) -> Result<(), TestCaseError> {
        let violations = self.cluster.violations.lock().clone();
        prop_assert!(violations.is_empty(), "{violations:?}");
        for id in &self.given_up {
            prop_assert!(self.d().tracked_record(id).is_none(), "{id} still tracked after its lease");
        }
        let table = self.d().table.lock();
        // FIFO: a message group is held by one hand-out (a batch, or its head alone).
        let mut handed_per_group: HashMap<&str, Vec<(u64, String)>> = HashMap::new();
        for tracked in table.deliveries.values() {
            let record = &tracked.record;
            let handed = matches!(record.phase, Phase::AwaitingAck { .. }) && !tracked.redispatch && !tracked.surrender;
            if let (true, Some(group)) = (handed, record.event.message_group.as_deref()) {
                handed_per_group.entry(group).or_default().push((record.seq, record.id.to_string()));
            }
        }
        for (group, mut handed) in handed_per_group {
            handed.sort();
            let hand_outs: HashSet<Option<(u64, bool)>> =
                handed.iter().map(|(_, id)| self.hand_outs.get(id).copied()).collect();
            prop_assert!(hand_outs.len() == 1, "group {group} is held by {} hand-outs: {hand_outs:?}", hand_outs.len());
            let batched = hand_outs.iter().flatten().any(|(_, batch)| *batch);
            prop_assert!(batched || handed.len() == 1, "group {group}: {} heads at once", handed.len());
        }
        // Memory never runs ahead of the store: every tracked delivery is stored.
        let stored: HashSet<String> = self
            .d()
            .store
            .list_with(Family::Deliveries, |bytes| DeliveryRecord::decode(bytes).ok())
            .map(|l| l.records.into_iter().map(|(id, _)| id).collect())
            .unwrap_or_default();
        for id in table.deliveries.keys() {
            prop_assert!(stored.contains(&**id), "{id} tracked but not stored");
        }
        Ok(())
    }

    /// With `MODEL_DEBUG` set, prints what a step left: the subscriber's holdings, the table, the redeliveries.
    fn trace(&self, step: &Step) {
        if std::env::var("MODEL_DEBUG").is_err() {
            return;
        }
        let table = self.d().table.lock();
        let view: Vec<String> = table
            .deliveries
            .values()
            .map(|t| format!("{}:{}:{:?}", t.record.event.id, &t.record.id[..6], t.record.phase))
            .collect();
        eprintln!("{step:?} -> held {:?} table {view:?} redeliveries {:?}", self.held, self.redeliveries);
    }

    /// The broker comes back and the subscriber ACKs everything it is given until nothing is left.
    async fn drain(&mut self) -> Result<(), TestCaseError> {
        self.cluster.down.store(false, Ordering::Relaxed);
        for _ in 0..60 {
            if !self.redeliveries.is_empty() {
                let count = self.redeliveries.len();
                self.apply(&Step::Admit { count, group: None }).await?;
            }
            self.apply(&Step::TimePasses).await?;
            self.apply(&Step::HandOut { max: 64, batch: false }).await?;
            while !self.held.is_empty() {
                self.apply(&Step::Ack { pick: 0 }).await?;
            }
            self.apply(&Step::TimePasses).await?;
            if self.d().table.lock().deliveries.is_empty() && self.redeliveries.is_empty() {
                break;
            }
        }
        if std::env::var("MODEL_DEBUG").is_ok() {
            eprintln!(
                "acked {:?} dead {:?} events {:?}",
                self.cluster.acked.lock(),
                self.cluster.dead_lettered.lock(),
                self.events
            );
        }
        let left = self.tracked_ids();
        prop_assert!(left.is_empty(), "still tracked after the drain: {left:?}");
        let acked: HashSet<String> = self.cluster.acked.lock().values().cloned().collect();
        let dead = self.cluster.dead_lettered.lock().clone();
        for event in &self.events {
            prop_assert!(acked.contains(event) || dead.contains(event), "{event} neither ACKed nor dead-lettered");
        }
        Ok(())
    }
}

/// How a gRPC client is named as a holder.
fn holder_id(client: u8) -> String {
    format!("model-client-{client}")
}

#[derive(Debug, Clone, Copy)]
enum Settle {
    Ack,
    Nack,
    Term,
}

#[test]
fn random_operation_sequences_keep_every_delivery_promise() {
    let seed: u64 = std::env::var("MODEL_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    let cases: u32 = std::env::var("MODEL_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48);
    println!("delivery model: seed {seed} ({cases} cases; MODEL_SEED={seed} replays it)");
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let outcome = runner.run(&prop::collection::vec(step(), 1..40), |steps| runtime.block_on(run_steps(&steps)));
    if let Err(failure) = outcome {
        panic!("delivery model failed with seed {seed}: {failure}");
    }
}

/// Runs one fixed sequence (a shrunk failure the random runs found, kept as a regression test).
fn replay(steps: Vec<Step>) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    if let Err(failure) = runtime.block_on(run_steps(&steps)) {
        panic!("{failure}");
    }
}

/// One run: `steps` on a fresh store, the invariants after each, then the drain.
async fn run_steps(steps: &[Step]) -> Result<(), TestCaseError> {
    let mut run = Run::new().await;
    for step in steps {
        run.apply(step).await?;
        run.trace(step);
    }
    run.drain().await
}

#[test]
fn an_event_whose_lease_was_lost_before_any_hand_out_is_delivered_again() {
    let admit = || Step::Admit { count: 1, group: None };
    replay(vec![admit(), admit(), admit(), admit(), Step::AckTimeout, Step::LeaseLoss { pick: 0 }]);
}
