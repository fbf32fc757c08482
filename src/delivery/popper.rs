//! One POP loop per subscription, paced by demand: it pops only what waiting subscribers asked for and the
//! ready queue cannot already give, so one instance never hoards a group's messages while another instance's
//! subscribers wait. Every broker serving the topic is popped at once (each long-poll on a handle of its own),
//! so a quiet broker never delays a busy one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use metrics::counter;
use rocketmq_client_rust::ClientInstanceHandle;

use super::dispatcher::Shared;
use crate::broker::client::now_millis;
use crate::broker::consumer::{PopRequest, Popped};
use crate::broker::BrokerError;
use crate::metrics as m;

/// Pause after a failed POP round or store write, so a down broker is not hammered.
const ERROR_PAUSE: Duration = Duration::from_secs(1);
/// How many ready events an ordered subscription may hold beyond its demand, so events blocked behind their
/// message group's head do not stop other groups.
const ORDERED_LOOKAHEAD: usize = 256;
/// How long the loop sleeps without demand before looking again (it is also woken on demand).
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// Runs until `stop` is set, the subscription disappears or popgate shuts down.
pub(super) async fn run(shared: Arc<Shared>, key: String, stop: Arc<AtomicBool>) {
    let mut handles: HashMap<String, ClientInstanceHandle> = HashMap::new();
    // Messages popped but not yet recorded (the store refused the write): admitted again before anything newer
    // is popped, while their lease lasts. Dropping them would let newer messages of their FIFO group overtake
    // them (the broker redelivers a dropped message only when its lease lapses, through the retry topic).
    let mut unadmitted: Vec<Popped> = Vec::new();
    while !stop.load(Ordering::Relaxed) && !shared.shutting_down.load(Ordering::Relaxed) {
        if !unadmitted.is_empty() {
            // Keep only what the broker still leases to us, with a margin for the write itself.
            let now = now_millis();
            unadmitted.retain(|p| p.handle.lease_deadline_ms() > now + 1_000);
            let Some((sub, policy)) = shared.state.lock().subs.get(&key).map(|s| (s.sub.clone(), s.policy)) else {
                break;
            };
            if !unadmitted.is_empty() {
                if let Err((_, back)) = shared.admit(&sub, &policy, std::mem::take(&mut unadmitted)) {
                    unadmitted = back;
                    tokio::time::sleep(ERROR_PAUSE).await;
                    continue;
                }
            }
        }
        let notified = shared.changed.notified();
        let (sub, policy, wanted) = {
            let state = shared.state.lock();
            let Some(sub_state) = state.subs.get(&key) else { break };
            // An ordered subscription's ready queue may hold events waiting for their group's head: pop past
            // them (within a bound) so other groups keep flowing.
            let queued = if sub_state.sub.ordered {
                sub_state.ready.len().saturating_sub(ORDERED_LOOKAHEAD)
            } else {
                sub_state.ready.len()
            };
            let wanted = sub_state.demand.saturating_sub(queued);
            // Backpressure: at the instance's (or this subscription's) in-flight bound nothing more is popped
            // until deliveries retire.
            let held = state.held_by(&key);
            let room = shared
                .config
                .max_in_flight
                .saturating_sub(state.records.len())
                .min(shared.config.max_in_flight_per_subscription.saturating_sub(held));
            (sub_state.sub.clone(), sub_state.policy, wanted.min(room))
        };
        if wanted == 0 {
            let _ = tokio::time::timeout(IDLE_WAIT, notified).await;
            continue;
        }
        let route = match shared.broker.route(&sub.topic).await {
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
                match shared.broker.dedicated_handle() {
                    Ok(handle) => {
                        handles.insert(broker.name.clone(), handle);
                    }
                    Err(error) => tracing::warn!(%error, "Cannot create a POP handle."),
                }
            }
        }
        let request = PopRequest {
            group: &sub.group,
            topic: &sub.topic,
            filter: &sub.filter,
            max: u32::try_from(wanted).unwrap_or(u32::MAX).clamp(1, shared.config.pop_batch),
            invisible_ms: shared.config.lease_ms,
            poll_ms: shared.config.pop_poll_ms,
        };
        let rounds = brokers
            .iter()
            .filter_map(|b| handles.get(&b.name).map(|h| (b, h)))
            .map(|(broker, handle)| shared.broker.pop(handle, broker, &request));
        let mut popped = Vec::new();
        let mut failed = false;
        tracing::debug!(topic = %sub.topic, brokers = brokers.len(), wanted, "POP round.");
        for result in join_all(rounds).await {
            match result {
                Ok(messages) => popped.extend(messages),
                Err(error) => {
                    failed = true;
                    counter!(m::CONSUME_REQUEST_FAILURES, "op" => "pop").increment(1);
                    if matches!(error, BrokerError::Response { code: 17, .. }) {
                        // The topic is not (yet) on that broker: ask the name server again next round.
                        shared.broker.invalidate_route(&sub.topic);
                    }
                    tracing::debug!(%error, topic = %sub.topic, "POP failed.");
                }
            }
        }
        if !popped.is_empty() {
            if let Err((_, back)) = shared.admit(&sub, &policy, popped) {
                unadmitted = back;
                failed = true;
            }
        }
        if failed {
            tokio::time::sleep(ERROR_PAUSE).await;
        }
    }
    for handle in handles.values() {
        handle.shutdown_owned().await;
    }
}
