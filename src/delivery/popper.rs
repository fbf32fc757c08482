//! One POP loop per subscription, paced by demand: it pops only what waiting subscribers asked for and the
//! ready queue cannot already give, so one instance never hoards a group's messages while another instance's
//! subscribers wait. Every broker serving the topic is popped at once (each long-poll on a handle of its own),
//! so a quiet broker never delays a busy one.
//!
//! An ordered subscription uses the broker's orderly POP: the broker hands out a queue's next messages only
//! once the ones it handed out before are ACKed or their invisible time is over, and then it hands out the
//! same messages again. That keeps a FIFO message group in order across popgate instances and crashes, not
//! only within one instance's memory.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use metrics::counter;
use tokio::time::Instant;

use super::record::Subscription;
use super::retry::RetryPolicy;
use super::state::{Admission, Deliveries, PopPlan};
use crate::broker::client::SpreadHandle;
use crate::broker::consumer::{PopRequest, Popped};
use crate::broker::{BrokerError, BrokerRoute};
use crate::clock::Epoch;
use crate::metrics as m;

/// The broker's answer to a POP for a topic it does not have (`ResponseCode.TOPIC_NOT_EXIST`).
const TOPIC_NOT_EXIST: i32 = 17;
/// The broker's answer to a filter it cannot compile (`ResponseCode.SUBSCRIPTION_PARSE_FAILED`).
const SUBSCRIPTION_PARSE_FAILED: i32 = 23;

/// Pause after a store write failed, before it is tried again.
const ERROR_PAUSE: Duration = Duration::from_secs(1);
/// Pause of a broker after failed POPs in a row: 1 s doubling to 4 s, ±20 % (a topic the broker does not have
/// yet: 1 s ±20 % each time). A broker that refuses POPs because it is busy (`SYSTEM_BUSY`: with 10 000 new
/// groups it refused them for minutes while it made the groups) is then not asked again by every subscription
/// in the same second, as a fixed pause made them do in waves; the cap keeps a broker that is back from waiting
/// long for its next POP.
const POP_FAILURE_BACKOFF: RetryPolicy =
    RetryPolicy { initial: Duration::from_secs(1), max: Duration::from_secs(4), jitter: 0.2, max_attempts: u32::MAX };
/// How long the loop sleeps without demand before looking again (it is also woken on demand).
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// One broker's POP, and what comes back with its answer: the broker, the handle it used.
type PopOutcome = (String, SpreadHandle, Result<Vec<Popped>, BrokerError>);

/// Runs until `stop` is set, the subscription disappears or popgate shuts down.
///
/// Each broker of the topic is popped on its own: a broker whose POP came back is popped again at once (while
/// subscribers want more), whatever the others' POPs are still waiting for. Popped in rounds, a message at one
/// broker waited for the round's POP at another broker to end, up to a whole POP wait on a quiet topic.
pub(super) async fn run(deliveries: Arc<Deliveries>, key: String, stop: Arc<AtomicBool>) {
    // One handle per broker, each on a POP client instance with room; out with its POP while one is in flight.
    let mut handles: HashMap<String, SpreadHandle> = HashMap::new();
    let mut popping: FuturesUnordered<BoxFuture<'static, PopOutcome>> = FuturesUnordered::new();
    // Brokers with a POP in flight, and brokers paused after a failure until the instant given.
    let mut in_flight: HashSet<String> = HashSet::new();
    let mut paused: HashMap<String, Instant> = HashMap::new();
    // Failed POPs in a row per broker, for its pause (cleared by a POP it answers).
    let mut failures: HashMap<String, u32> = HashMap::new();
    // Messages popped but not yet recorded (the store refused the write): admitted again before anything newer
    // is popped, while their lease lasts. Dropping them would let newer messages of their FIFO group overtake
    // them (the broker redelivers a dropped message only when its lease lapses).
    let mut unadmitted: Vec<Popped> = Vec::new();
    let mut group = String::new();
    // The readable brokers of the topic, as of the last look at its route.
    let mut brokers = 0;
    while !stop.load(Ordering::Relaxed) && !deliveries.is_shutting_down() {
        if !unadmitted.is_empty() {
            // Keep only what the broker still leases to us, with a margin for the write itself.
            let now = Epoch::now();
            unadmitted.retain(|p| p.handle.lease_deadline() > now + Duration::from_secs(1));
            if !admit(&deliveries, &key, &group, std::mem::take(&mut unadmitted), &mut unadmitted).await {
                tokio::time::sleep(ERROR_PAUSE).await;
                continue;
            }
        }
        let bells = deliveries.bells(&key);
        let notified = bells.all.notified();
        let Some(plan) = deliveries.pop_plan(&key) else { break };
        group.clone_from(&plan.sub.group);
        paused.retain(|_, until| *until > Instant::now());
        if plan.wanted > 0 {
            if let Some(readable) =
                start_pops(&deliveries, &plan, &mut handles, &mut in_flight, &paused, &mut popping).await
            {
                brokers = readable;
            }
        }
        // Rung by this subscription's changes (demand, settlements): a broker without a POP may get one. Not
        // listened to while every broker has one (under load a bell rings for every message). Room freed by
        // another subscription under the global in-flight cap rings no bell here: the timeout notices it, and
        // the end of a pause.
        let every_broker_popped = brokers > 0 && in_flight.len() >= brokers;
        let look_again =
            paused.values().min().map_or(IDLE_WAIT, |until| until.saturating_duration_since(Instant::now()));
        let outcome = tokio::select! {
            Some(outcome) = popping.next() => outcome,
            _ = tokio::time::timeout(look_again, notified), if !every_broker_popped => continue,
            // At shutdown a POP waiting at a broker is abandoned (it may wait a minute): what the broker hands
            // out to it meanwhile comes back after its lease.
            () = deliveries.shutdown_asked() => break,
        };
        let (broker, handle, result) = outcome;
        in_flight.remove(&broker);
        handles.insert(broker.clone(), handle);
        let pop_failed = result.is_err();
        match &result {
            // The topic is not on that broker yet (its first message creates it): not the broker's trouble,
            // so the pause does not grow, and the first message is popped within about a second.
            Err(BrokerError::Response { code: TOPIC_NOT_EXIST, .. }) => {
                failures.insert(broker.clone(), 1);
            }
            Err(_) => *failures.entry(broker.clone()).or_default() += 1,
            Ok(_) => {
                failures.remove(&broker);
            }
        }
        if !popped(&deliveries, &key, &plan.sub, result, &mut unadmitted).await {
            let pause = if pop_failed {
                POP_FAILURE_BACKOFF.delay_after(failures.get(&broker).copied().unwrap_or(1), &mut rand::rng())
            } else {
                ERROR_PAUSE
            };
            paused.insert(broker, Instant::now() + pause);
            if !unadmitted.is_empty() {
                // The store refused the write: it is not asked again at once (RocksDB frees space of its own
                // after a failed write, and a write at once would take what the operator is freeing).
                tokio::time::sleep(ERROR_PAUSE).await;
            }
        }
    }
    // Unsubscribed: what the POPs still waiting bring is given back (`admit` finds no subscription).
    while !popping.is_empty() && !deliveries.is_shutting_down() {
        let outcome = tokio::select! {
            Some(outcome) = popping.next() => outcome,
            () = deliveries.shutdown_asked() => break,
        };
        if let (_, _, Ok(popped)) = outcome {
            admit(&deliveries, &key, &group, popped, &mut unadmitted).await;
        }
    }
    // What could not be recorded goes back to the broker rather than waiting out its lease.
    deliveries.give_back_popped(&group, unadmitted, "not_admitted").await;
}

/// Starts a POP at each broker of the subscription's topic that has none in flight and is not paused; the
/// number of readable brokers, or `None` when the topic has no route yet.
async fn start_pops(
    deliveries: &Arc<Deliveries>,
    plan: &PopPlan,
    handles: &mut HashMap<String, SpreadHandle>,
    in_flight: &mut HashSet<String>,
    paused: &HashMap<String, Instant>,
    popping: &mut FuturesUnordered<BoxFuture<'static, PopOutcome>>,
) -> Option<usize> {
    let sub = &plan.sub;
    let route = match deliveries.broker().route(&sub.topic).await {
        Ok(route) => route,
        Err(error) => {
            tracing::debug!(%error, topic = %sub.topic, "No route for a subscribed topic yet.");
            return None;
        }
    };
    let idle: Vec<BrokerRoute> = route
        .readable()
        .filter(|broker| !in_flight.contains(&broker.name) && !paused.contains_key(&broker.name))
        .cloned()
        .collect();
    for broker in idle {
        let handle = match handles.remove(&broker.name) {
            Some(handle) => handle,
            None => match deliveries.broker().dedicated_handle().await {
                Ok(handle) => handle,
                Err(error) => {
                    tracing::warn!(%error, "Cannot create a POP handle.");
                    continue;
                }
            },
        };
        in_flight.insert(broker.name.clone());
        let max = u32::try_from(plan.wanted).unwrap_or(u32::MAX).clamp(1, deliveries.config().pop_batch);
        tracing::debug!(topic = %sub.topic, broker = %broker.name, wanted = plan.wanted, "POP.");
        popping.push(Box::pin(pop_one(deliveries.clone(), sub.clone(), broker, handle, max)));
    }
    Some(route.readable().count())
}

/// One POP at `broker`, counted among the POPs waiting while it waits.
async fn pop_one(
    deliveries: Arc<Deliveries>,
    sub: Subscription,
    broker: BrokerRoute,
    handle: SpreadHandle,
    max: u32,
) -> PopOutcome {
    let waiting = deliveries.pop_waiting();
    let request = PopRequest {
        group: &sub.group,
        topic: &sub.topic,
        filter: &sub.filter,
        filter_type: sub.filter_type.as_str(),
        max,
        invisible_ms: deliveries.lease_ms_to_ask(),
        poll_ms: waiting.wait_ms,
        orderly: sub.ordered,
    };
    let result = deliveries.broker().pop(handle.handle(), &broker, &request).await;
    drop(waiting);
    (broker.name, handle, result)
}

/// Takes one POP's answer: admits what it brought, or counts its failure. False when the broker should be
/// paused (a failed POP, a store write refused).
async fn popped(
    deliveries: &Deliveries,
    key: &str,
    sub: &Subscription,
    result: Result<Vec<Popped>, BrokerError>,
    unadmitted: &mut Vec<Popped>,
) -> bool {
    match result {
        Ok(popped) => {
            let result = if popped.is_empty() { "empty" } else { "messages" };
            counter!(m::POPS, "result" => result).increment(1);
            // A POP the broker took clears a filter refusal (the filter was changed to one it takes).
            deliveries.set_filter_refusal(key, None);
            admit(deliveries, key, &sub.group, popped, unadmitted).await
        }
        Err(error) => {
            counter!(m::CONSUME_REQUEST_FAILURES, "op" => "pop").increment(1);
            if matches!(error, BrokerError::Response { code: TOPIC_NOT_EXIST, .. }) {
                // The topic is not (yet) on that broker: ask the name server again next time.
                deliveries.broker().invalidate_route(&sub.topic);
            }
            if let BrokerError::Response { code: SUBSCRIPTION_PARSE_FAILED, detail } = &error {
                // The broker could not compile the filter (an SQL92 syntax error): receivers are told, not left
                // waiting.
                deliveries.set_filter_refusal(key, Some(detail.clone()));
            }
            tracing::debug!(%error, topic = %sub.topic, "POP failed.");
            false
        }
    }
}

/// Admits `popped`; false (and the messages added to `unadmitted`) when the store refused them. Messages of a
/// subscription removed meanwhile are given back to the broker at once.
async fn admit(
    deliveries: &Deliveries,
    key: &str,
    group: &str,
    popped: Vec<Popped>,
    unadmitted: &mut Vec<Popped>,
) -> bool {
    if popped.is_empty() {
        return true;
    }
    match deliveries.admit(key, popped).await {
        Admission::Admitted => true,
        Admission::Refused(back) => {
            unadmitted.extend(back);
            false
        }
        Admission::NoSubscription(back) => {
            deliveries.give_back_popped(group, back, "unsubscribed").await;
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_failing_pops_is_asked_again_after_1_2_4_then_4_seconds_with_jitter() {
        let mut rng = rand::rng();
        for (failures, base) in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 4.0), (50, 4.0)] {
            let pauses: Vec<f64> =
                (0..200).map(|_| POP_FAILURE_BACKOFF.delay_after(failures, &mut rng).as_secs_f64()).collect();
            assert!(pauses.iter().all(|p| (base * 0.8..=base * 1.2).contains(p)), "{failures}: {pauses:?}");
            // Jittered: the subscriptions that failed together are not asked again together.
            assert!(pauses.iter().any(|p| (p - pauses[0]).abs() > 0.01), "{failures}: {pauses:?}");
        }
    }
}
