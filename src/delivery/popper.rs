//! One POP loop per subscription, paced by demand: it pops only what waiting subscribers asked for and the
//! ready queue cannot already give, so one instance never hoards a group's messages while another instance's
//! subscribers wait. Every broker serving the topic is popped at once (each long-poll on a handle of its own),
//! so a quiet broker never delays a busy one.
//!
//! An ordered subscription uses the broker's orderly POP: the broker hands out a queue's next messages only
//! once the ones it handed out before are ACKed or their invisible time is over, and then it hands out the
//! same messages again. That keeps a FIFO message group in order across popgate instances and crashes, not
//! only within one instance's memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use metrics::counter;

use super::state::{Admission, Deliveries};
use crate::broker::client::SpreadHandle;
use crate::broker::consumer::{PopRequest, Popped};
use crate::broker::BrokerError;
use crate::clock::Epoch;
use crate::metrics as m;

/// The broker's answer to a filter it cannot compile (`ResponseCode.SUBSCRIPTION_PARSE_FAILED`).
const SUBSCRIPTION_PARSE_FAILED: i32 = 23;

/// Pause after a failed POP round or store write, so a down broker is not hammered.
const ERROR_PAUSE: Duration = Duration::from_secs(1);
/// How long the loop sleeps without demand before looking again (it is also woken on demand).
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// Runs until `stop` is set, the subscription disappears or popgate shuts down.
pub(super) async fn run(deliveries: Arc<Deliveries>, key: String, stop: Arc<AtomicBool>) {
    // One handle per broker, each on a POP client instance with room; given back when the loop ends.
    let mut handles: HashMap<String, SpreadHandle> = HashMap::new();
    // Messages popped but not yet recorded (the store refused the write): admitted again before anything newer
    // is popped, while their lease lasts. Dropping them would let newer messages of their FIFO group overtake
    // them (the broker redelivers a dropped message only when its lease lapses).
    let mut unadmitted: Vec<Popped> = Vec::new();
    let mut group = String::new();
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
        if plan.wanted == 0 {
            // Rung by this subscription's changes (demand, settlements). Room freed by another subscription
            // under the global in-flight cap rings no bell here: the timeout notices it.
            let _ = tokio::time::timeout(IDLE_WAIT, notified).await;
            continue;
        }
        let sub = plan.sub;
        let route = match deliveries.broker().route(&sub.topic).await {
            Ok(route) => route,
            Err(error) => {
                tracing::debug!(%error, topic = %sub.topic, "No route for a subscribed topic yet.");
                tokio::time::sleep(ERROR_PAUSE).await;
                continue;
            }
        };
        let brokers: Vec<_> = route.readable().cloned().collect();
        for broker in &brokers {
            if !handles.contains_key(&broker.name) {
                match deliveries.broker().dedicated_handle().await {
                    Ok(handle) => {
                        handles.insert(broker.name.clone(), handle);
                    }
                    Err(error) => tracing::warn!(%error, "Cannot create a POP handle."),
                }
            }
        }
        let config = deliveries.config();
        let waiting = deliveries.pops_waiting(brokers.len());
        let request = PopRequest {
            group: &sub.group,
            topic: &sub.topic,
            filter: &sub.filter,
            filter_type: sub.filter_type.as_str(),
            max: u32::try_from(plan.wanted).unwrap_or(u32::MAX).clamp(1, config.pop_batch),
            invisible_ms: deliveries.lease_ms_to_ask(),
            poll_ms: waiting.wait_ms,
            orderly: sub.ordered,
        };
        // Each broker's answer is admitted as it comes: a message one broker has at once does not wait for
        // another broker's long poll to end.
        let mut rounds: FuturesUnordered<_> = brokers
            .iter()
            .filter_map(|b| handles.get(&b.name).map(|h| (b, h)))
            .map(|(broker, handle)| deliveries.broker().pop(handle.handle(), broker, &request))
            .collect();
        let mut failed = false;
        let mut filter_refused = None;
        tracing::debug!(topic = %sub.topic, brokers = brokers.len(), wanted = plan.wanted, "POP round.");
        loop {
            // At shutdown a POP waiting at a broker is abandoned (it may wait a minute): what the broker hands
            // out to it meanwhile comes back after its lease.
            let result = tokio::select! {
                result = rounds.next() => result,
                () = deliveries.shutdown_asked() => break,
            };
            let Some(result) = result else { break };
            match result {
                Ok(popped) => {
                    let result = if popped.is_empty() { "empty" } else { "messages" };
                    counter!(m::POPS, "result" => result).increment(1);
                    if !admit(&deliveries, &key, &sub.group, popped, &mut unadmitted).await {
                        failed = true;
                    }
                }
                Err(error) => {
                    failed = true;
                    counter!(m::CONSUME_REQUEST_FAILURES, "op" => "pop").increment(1);
                    if matches!(error, BrokerError::Response { code: 17, .. }) {
                        // The topic is not (yet) on that broker: ask the name server again next round.
                        deliveries.broker().invalidate_route(&sub.topic);
                    }
                    if let BrokerError::Response { code: SUBSCRIPTION_PARSE_FAILED, detail } = &error {
                        filter_refused = Some(detail.clone());
                    }
                    tracing::debug!(%error, topic = %sub.topic, "POP failed.");
                }
            }
        }
        drop(waiting);
        // The broker could not compile the filter (an SQL92 syntax error): receivers are told, not left waiting.
        // A round without failures clears it (the filter was changed to one the broker takes).
        match filter_refused {
            Some(refusal) => deliveries.set_filter_refusal(&key, Some(refusal)),
            None if !failed => deliveries.set_filter_refusal(&key, None),
            None => {}
        }
        if failed {
            tokio::time::sleep(ERROR_PAUSE).await;
        }
    }
    // What could not be recorded goes back to the broker rather than waiting out its lease.
    deliveries.give_back_popped(&group, unadmitted, "not_admitted").await;
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
