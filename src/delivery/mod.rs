//! The consume path: at-least-once delivery with the broker ACK deferred until the subscriber ACKs.
//!
//! A delivery's life (every arrow is "write the new state, then act"):
//!
//! ```text
//! POP ──record──▶ ready(attempt n) ──hand out──▶ awaiting ACK ──ACK──▶ ACK intent ──broker ACK──▶ retired
//!                     ▲                               │
//!                     └── backoff (1 s ×2 ≤ 16 s ±20 %) ◀── timeout / NACK
//! awaiting ACK or ready with n = max ──▶ dead-letter pending ──%DLQ% write──▶ broker ACK ──▶ retired
//! TERM ──▶ dead-letter pending
//! lease lapsed (renewal failed too long) ──▶ given up: ACKs get 409, the broker redelivers the message
//! ```
//!
//! While popgate owns a delivery it keeps the message invisible at the broker by renewing its lease
//! (ChangeInvisibleTime) ahead of expiry; if popgate dies, the lease running out is the backstop and the
//! broker redelivers. Nothing but a subscriber ACK, or a successful DLQ write, ever ACKs the broker.
//!
//! - [`dispatcher`]: the state machine and the client operations (poll, ack, nack, term).
//! - [`popper`]: one demand-paced POP loop per subscription.
//! - [`sweeper`]: timeouts, retries, lease renewal, owed broker ACKs and DLQ writes.
//! - [`subscriber`]: a push subscriber's session (prefetch, write failures, disconnects).
//! - [`webhook`]: pushing a subscription's deliveries to an HTTP endpoint (CloudEvents, HMAC-signed).
//! - [`recovery`]: boot replay of the stored state. [`dlq`]: the dead-letter message. [`retry`]: the backoff.

pub mod dispatcher;
pub mod dlq;
mod popper;
pub mod record;
pub mod recovery;
pub mod retry;
pub mod subscriber;
mod sweeper;
pub mod webhook;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;

pub use dispatcher::{DeliveryError, Dispatched, NackOutcome};
pub use record::Subscription;
pub use subscriber::Subscriber;

use dispatcher::{Shared, State, SubState};
use recovery::RecoveryReport;
use retry::RetryPolicy;

use crate::broker::BrokerClient;
use crate::config::DeliveryConfig;
use crate::publish::Publisher;
use crate::store::{Family, StateStore};

/// Longest long-poll wait a client may ask for.
pub const MAX_POLL_WAIT: Duration = Duration::from_secs(30);
/// Most deliveries one poll may return.
pub const MAX_POLL_BATCH: usize = 256;

/// What a subscriber may set on its subscription; unset fields take the configured defaults.
#[derive(Debug, Clone, Default)]
pub struct SubscriptionRequest {
    /// Consumer group.
    pub group: String,
    /// Topic.
    pub topic: String,
    /// Tag expression (default `*`).
    pub filter: Option<String>,
    /// ACK timeout.
    pub ack_timeout_ms: Option<u64>,
    /// Attempts in all.
    pub max_attempts: Option<u32>,
    /// First retry delay.
    pub initial_backoff_ms: Option<u64>,
    /// Largest retry delay.
    pub max_backoff_ms: Option<u64>,
    /// FIFO message groups (default false).
    pub ordered: Option<bool>,
    /// Push deliveries to a webhook.
    pub push: Option<webhook::WebhookPush>,
}

/// One in-flight delivery as the admin plane shows it.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InFlight {
    /// The delivery id.
    pub delivery_id: String,
    /// Consumer group.
    pub group: String,
    /// Topic.
    pub topic: String,
    /// The event's message id.
    pub event_id: String,
    /// Current (or next) attempt, 1-based.
    pub attempt: u32,
    /// `ready`, `awaiting_ack`, `ack_pending` or `dead_letter_pending`.
    pub phase: &'static str,
    /// The ACK deadline (awaiting ACK) or when the next attempt is due (ready), epoch ms.
    pub due_ms: Option<i64>,
    /// The push subscriber holding it, if one does (long-poll hand-outs have none).
    pub subscriber: Option<String>,
    /// Why the last attempt failed.
    pub last_failure: Option<String>,
    /// Until when the broker keeps it invisible (epoch ms).
    pub lease_deadline_ms: i64,
}

/// The consume path's entry point, shared by every transport.
pub struct Dispatcher {
    shared: Arc<Shared>,
    tasks: parking_lot::Mutex<Vec<JoinHandle<()>>>,
    /// This dispatcher, for the webhook pushers it starts (they hold it as subscribers do).
    me: std::sync::Weak<Dispatcher>,
    /// Stop flags of the running webhook pushers, by subscription key.
    webhooks: parking_lot::Mutex<std::collections::HashMap<String, Arc<AtomicBool>>>,
}

impl Dispatcher {
    /// Opens nothing itself: takes the store, replays it ([`recovery`]), starts the sweeper and a POP loop per
    /// subscription.
    ///
    /// # Errors
    /// [`DeliveryError::Store`] when the store cannot be read.
    ///
    /// `group_commit` is the WAL sync interval when the store does not sync each write (async-flush profiles).
    pub fn start(
        store: Arc<StateStore>,
        broker: Arc<BrokerClient>,
        publisher: Arc<Publisher>,
        config: DeliveryConfig,
        group_commit: Option<Duration>,
    ) -> Result<(Arc<Dispatcher>, RecoveryReport), DeliveryError> {
        let shared = Arc::new(Shared {
            state: parking_lot::Mutex::new(State::default()),
            store,
            broker,
            publisher,
            config,
            changed: Notify::new(),
            next_seq: std::sync::atomic::AtomicU64::new(1),
            store_healthy: AtomicBool::new(true),
            shutting_down: AtomicBool::new(false),
        });
        let report = recovery::recover(&shared)?;
        let dispatcher = Arc::new_cyclic(|me| Dispatcher {
            shared: shared.clone(),
            tasks: parking_lot::Mutex::new(Vec::new()),
            me: me.clone(),
            webhooks: parking_lot::Mutex::new(std::collections::HashMap::new()),
        });
        dispatcher.tasks.lock().push(tokio::spawn(sweeper::run(shared.clone())));
        if let Some(interval) = group_commit {
            dispatcher.tasks.lock().push(tokio::spawn(group_commit_loop(shared.clone(), interval)));
        }
        let keys: Vec<String> = shared.state.lock().subs.keys().cloned().collect();
        for key in keys {
            dispatcher.start_popper(&key);
        }
        for sub in dispatcher.subscriptions() {
            dispatcher.restart_webhook(&sub);
        }
        Ok((dispatcher, report))
    }

    /// Runs recovery again (it is idempotent: live records are skipped). For operators and tests.
    ///
    /// # Errors
    /// [`DeliveryError::Store`] when the store cannot be read.
    pub fn recover_again(&self) -> Result<RecoveryReport, DeliveryError> {
        Ok(recovery::recover(&self.shared)?)
    }

    /// Stops the subscription's webhook pusher, if any, and starts one for its current `push` config.
    fn restart_webhook(&self, sub: &Subscription) {
        let key = sub.key();
        if let Some(stop) = self.webhooks.lock().remove(&key) {
            stop.store(true, Ordering::Relaxed);
        }
        let (Some(push), Some(me)) = (sub.push.clone(), self.me.upgrade()) else { return };
        let stop = Arc::new(AtomicBool::new(false));
        self.webhooks.lock().insert(key, stop.clone());
        let task = tokio::spawn(webhook::run(me, sub.group.clone(), sub.topic.clone(), push, stop));
        self.tasks.lock().push(task);
    }

    fn start_popper(&self, key: &str) {
        let stop = match self.shared.state.lock().subs.get(key) {
            Some(sub) => sub.stop.clone(),
            None => return,
        };
        let task = tokio::spawn(popper::run(self.shared.clone(), key.to_owned(), stop));
        self.tasks.lock().push(task);
    }

    /// Creates or updates a subscription (persisted) and starts its POP loop.
    ///
    /// # Errors
    /// [`DeliveryError::Invalid`] naming a bad field; [`DeliveryError::Store`] when it cannot be stored.
    pub fn subscribe(&self, request: SubscriptionRequest) -> Result<Subscription, DeliveryError> {
        let config = &self.shared.config;
        validate_name("group", &request.group)?;
        validate_name("topic", &request.topic)?;
        let sub = Subscription {
            group: request.group,
            topic: request.topic,
            filter: request.filter.unwrap_or_else(|| "*".to_owned()),
            ack_timeout_ms: request.ack_timeout_ms.unwrap_or(config.ack_timeout_ms),
            max_attempts: request.max_attempts.unwrap_or(config.max_attempts),
            initial_backoff_ms: request.initial_backoff_ms.unwrap_or(config.initial_backoff_ms),
            max_backoff_ms: request.max_backoff_ms.unwrap_or(config.max_backoff_ms),
            ordered: request.ordered.unwrap_or(false),
            push: request.push,
        };
        if let Some(push) = &sub.push {
            push.validate()?;
        }
        if sub.filter.trim().is_empty() {
            return Err(DeliveryError::Invalid("filter", "must be a tag expression such as `*` or `a || b`".into()));
        }
        if !(100..=3_600_000).contains(&sub.ack_timeout_ms) {
            return Err(DeliveryError::Invalid("ackTimeoutMs", "must be in 100..=3600000".into()));
        }
        if !(1..=100).contains(&sub.max_attempts) {
            return Err(DeliveryError::Invalid("maxAttempts", "must be in 1..=100".into()));
        }
        let policy = RetryPolicy::try_new(
            Duration::from_millis(sub.initial_backoff_ms),
            Duration::from_millis(sub.max_backoff_ms),
            config.jitter_ratio,
            sub.max_attempts,
        )
        .map_err(|e| DeliveryError::Invalid("initialBackoffMs", e.to_string()))?;
        let key = sub.key();
        self.shared.write(&[crate::store::Change::Put(
            Family::Subscriptions,
            &key,
            serde_json::to_vec(&sub).map_err(crate::store::StoreError::from)?,
        )])?;
        let is_new = {
            let mut state = self.shared.state.lock();
            match state.subs.get_mut(&key) {
                Some(existing) => {
                    existing.sub = sub.clone();
                    existing.policy = policy;
                    false
                }
                None => {
                    state.subs.insert(key.clone(), SubState::new(sub.clone(), policy));
                    true
                }
            }
        };
        if is_new {
            self.start_popper(&key);
        }
        self.restart_webhook(&sub);
        Ok(sub)
    }

    /// Removes a subscription: its POP loop stops, and its undelivered events are given back to the broker
    /// (not ACKed), which redelivers them to whoever subscribes next.
    ///
    /// # Errors
    /// [`DeliveryError::Unknown`] when there is no such subscription; [`DeliveryError::Store`].
    pub fn unsubscribe(&self, group: &str, topic: &str) -> Result<(), DeliveryError> {
        let key = Subscription::key_of(group, topic);
        if !self.shared.state.lock().subs.contains_key(&key) {
            return Err(DeliveryError::Unknown);
        }
        self.shared.write(&[crate::store::Change::Delete(Family::Subscriptions, &key)])?;
        let released: Vec<String> = {
            let mut state = self.shared.state.lock();
            if let Some(sub) = state.subs.remove(&key) {
                sub.stop.store(true, Ordering::Relaxed);
            }
            if let Some(stop) = self.webhooks.lock().remove(&key) {
                stop.store(true, Ordering::Relaxed);
            }
            state
                .records
                .iter()
                .filter(|(_, live)| live.record.group == group && live.record.topic == topic && !live.busy)
                .filter(|(_, live)| {
                    !matches!(live.record.phase, record::Phase::Acked | record::Phase::DeadLetter { .. })
                })
                .map(|(id, _)| id.clone())
                .collect()
        };
        for id in released {
            self.shared.retire(&id);
        }
        self.shared.changed.notify_waiters();
        Ok(())
    }

    /// The subscription of `group`/`topic`, created with the defaults when there is none.
    ///
    /// # Errors
    /// As [`Dispatcher::subscribe`].
    pub fn ensure_subscription(&self, group: &str, topic: &str) -> Result<Subscription, DeliveryError> {
        if let Some(sub) = self.shared.state.lock().subs.get(&Subscription::key_of(group, topic)) {
            return Ok(sub.sub.clone());
        }
        self.subscribe(SubscriptionRequest { group: group.to_owned(), topic: topic.to_owned(), ..Default::default() })
    }

    /// The consumer group of an in-flight delivery (to authorize its ACK, NACK or TERM).
    pub fn group_of(&self, id: &str) -> Option<String> {
        self.shared.state.lock().records.get(id).map(|live| live.record.group.clone())
    }

    /// Up to `max` in-flight deliveries (of `group`, when given), oldest admission first: the admin view.
    pub fn in_flight(&self, group: Option<&str>, max: usize) -> Vec<InFlight> {
        let state = self.shared.state.lock();
        let mut found: Vec<&dispatcher::Live> =
            state.records.values().filter(|live| group.is_none_or(|g| live.record.group == g)).collect();
        found.sort_by_key(|live| live.record.seq);
        found
            .into_iter()
            .take(max)
            .map(|live| {
                let record = &live.record;
                let (phase, due_ms) = match &record.phase {
                    record::Phase::Ready { due_ms } => ("ready", Some(*due_ms)),
                    record::Phase::AwaitingAck { deadline_ms, .. } => ("awaiting_ack", Some(*deadline_ms)),
                    record::Phase::Acked => ("ack_pending", None),
                    record::Phase::DeadLetter { .. } => ("dead_letter_pending", None),
                };
                InFlight {
                    delivery_id: record.id.clone(),
                    group: record.group.clone(),
                    topic: record.topic.clone(),
                    event_id: record.event.id.clone(),
                    attempt: record.attempt,
                    phase,
                    due_ms,
                    subscriber: live.holder.map(|h| format!("push-{h}")),
                    last_failure: record.last_failure.clone(),
                    lease_deadline_ms: record.handle.lease_deadline_ms(),
                }
            })
            .collect()
    }

    /// Every subscription.
    pub fn subscriptions(&self) -> Vec<Subscription> {
        self.shared.state.lock().subs.values().map(|s| s.sub.clone()).collect()
    }

    /// Long-polls up to `max` deliveries for `group`/`topic`, waiting at most `wait` when none is ready.
    ///
    /// # Errors
    /// [`DeliveryError::Store`] when the hand-out cannot be recorded (nothing is handed out then).
    pub async fn poll(
        &self,
        group: &str,
        topic: &str,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Dispatched>, DeliveryError> {
        let key = self.ensure_subscription(group, topic)?.key();
        let max = max.clamp(1, MAX_POLL_BATCH);
        let _demand = Demand::register(&self.shared, &key, max);
        let deadline = tokio::time::Instant::now() + wait.min(MAX_POLL_WAIT);
        loop {
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let taken = self.shared.take_ready(&key, max, "poll", None)?;
            if !taken.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(taken);
            }
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    /// Attaches a push subscriber (SSE, WebSocket) to `group`/`topic`, creating the subscription with the
    /// defaults if there is none. `prefetch` (default `delivery.prefetch`) bounds its unACKed deliveries.
    ///
    /// # Errors
    /// As [`Dispatcher::subscribe`]; [`DeliveryError::Invalid`] for a prefetch outside 1..=1024.
    pub fn attach(
        &self,
        group: &str,
        topic: &str,
        prefetch: Option<usize>,
        transport: &'static str,
    ) -> Result<Subscriber, DeliveryError> {
        let prefetch = prefetch.unwrap_or(self.shared.config.prefetch);
        if !(1..=1024).contains(&prefetch) {
            return Err(DeliveryError::Invalid("prefetch", "must be in 1..=1024".into()));
        }
        let key = self.ensure_subscription(group, topic)?.key();
        Ok(Subscriber::new(self.shared.clone(), key, prefetch, transport))
    }

    /// See [`Shared::ack`].
    ///
    /// # Errors
    /// [`DeliveryError::Unknown`] (404), [`DeliveryError::Stale`] (409), [`DeliveryError::Store`] (503).
    pub async fn ack(&self, id: &str) -> Result<(), DeliveryError> {
        self.shared.ack(id).await
    }

    /// ACKs a batch: every id at once (each as [`Dispatcher::ack`], so their broker ACKs overlap instead of
    /// waiting for one another); the results in the order of `ids`.
    pub async fn ack_many(&self, ids: &[String]) -> Vec<Result<(), DeliveryError>> {
        futures::future::join_all(ids.iter().map(|id| self.shared.ack(id))).await
    }

    /// NACK: the attempt is spent; the next is scheduled after `delay` (or the backoff), or the DLQ.
    ///
    /// # Errors
    /// As [`Dispatcher::ack`], and [`DeliveryError::NotInFlight`] for a delivery not handed out.
    pub async fn nack(&self, id: &str, delay: Option<Duration>) -> Result<NackOutcome, DeliveryError> {
        self.shared.nack(id, delay).await
    }

    /// TERM: straight to the DLQ with `reason`.
    ///
    /// # Errors
    /// As [`Dispatcher::ack`].
    pub async fn term(&self, id: &str, reason: &str) -> Result<(), DeliveryError> {
        self.shared.term(id, reason).await
    }

    /// False after a failed state-store write, until a write succeeds again.
    pub fn store_healthy(&self) -> bool {
        self.shared.store_healthy.load(Ordering::Relaxed)
    }

    /// Stops every background task (POP loops, sweeper). In-flight state stays in the store.
    pub async fn shutdown(&self) {
        self.shared.shutting_down.store(true, Ordering::Relaxed);
        for stop in self.webhooks.lock().values() {
            stop.store(true, Ordering::Relaxed);
        }
        self.shared.changed.notify_waiters();
        let tasks: Vec<JoinHandle<()>> = self.tasks.lock().drain(..).collect();
        for task in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
    }
}

/// Syncs the WAL every `interval` until shutdown: bounded loss for async-flush profiles, whose writes are not
/// synced one by one. One last sync runs on the way out.
async fn group_commit_loop(shared: Arc<Shared>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    while !shared.shutting_down.load(Ordering::Relaxed) {
        tick.tick().await;
        shared.sync_wal();
    }
    shared.sync_wal();
}

/// A waiting poller's demand on its subscription, withdrawn when the poll ends (or its client goes away).
struct Demand {
    shared: Arc<Shared>,
    key: String,
    count: usize,
}

impl Demand {
    fn register(shared: &Arc<Shared>, key: &str, count: usize) -> Demand {
        if let Some(sub) = shared.state.lock().subs.get_mut(key) {
            sub.demand += count;
        }
        shared.changed.notify_waiters();
        Demand { shared: shared.clone(), key: key.to_owned(), count }
    }
}

impl Drop for Demand {
    fn drop(&mut self) {
        if let Some(sub) = self.shared.state.lock().subs.get_mut(&self.key) {
            sub.demand = sub.demand.saturating_sub(self.count);
        }
    }
}

/// Group and topic names: RocketMQ's character set, at most 127 characters.
fn validate_name(field: &'static str, name: &str) -> Result<(), DeliveryError> {
    if crate::broker::message::is_valid_name(name) {
        Ok(())
    } else {
        Err(DeliveryError::Invalid(field, format!("`{name}` must be 1..=127 letters, digits, `_`, `-`, `%`, `|`")))
    }
}
