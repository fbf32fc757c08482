//! The publish path (checkpoint 1 of seed 004): RocketMQ's producer policy, owned by popgate.
//!
//! A synchronous publish makes at most `1 + retry_times_when_send_failed` attempts. Each attempt picks a
//! broker with [`fault::choose_broker`]: never the one that just failed while another exists, and never an
//! isolated one while a healthy one exists. After every attempt the broker's latency (or failure) is recorded
//! in the fault table. The answer is a success only when the broker's store status satisfies the reliability
//! profile ([`judge_store_status`]), so a 200 means "stored as the profile demands".
//!
//! `mode=async` keeps its retries on the broker it started with (the seed's async semantics); `mode=oneway`
//! makes one attempt and does not wait for the broker.

pub mod dedup;
pub mod limits;
pub mod message_group;
pub mod request;
pub mod topic_type;

// The message a front builds and hands to [`Publisher::publish`], with the property names fronts set.
pub use crate::broker::message::{
    is_valid_name, PROPERTY_SHARDING_KEY as MESSAGE_GROUP_PROPERTY, PROPERTY_TIMER_DELIVER_MS as DELIVER_AT_PROPERTY,
    PROPERTY_UNIQ_KEY as MESSAGE_ID_PROPERTY,
};
pub use crate::broker::{OutgoingMessage, SendReceipt, TopicRoute};
pub use message_group::group_queue;
pub use topic_type::TopicMessageType;

use dedup::{Claim, DedupWindow};
use limits::WithinLimits;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::{counter, gauge, histogram};
use parking_lot::Mutex;
use serde::Serialize;

use crate::broker::fault::{self, FaultTable, IsolationCause};
use crate::broker::message::PROPERTY_SHARDING_KEY;
use crate::broker::transaction::HalfMessage;
use crate::broker::{BrokerClient, BrokerError, BrokerRoute, StoreStatus};
use crate::config::{FaultAvoidanceConfig, Profile, PublishConfig};
use crate::metrics as m;

/// RocketMQ's `ResponseCode.SERVICE_NOT_AVAILABLE`: what a broker placement that fault avoidance refuses is
/// answered with.
const SERVICE_NOT_AVAILABLE: i32 = 14;

/// The least time an attempt is started with: a send given less would only time out.
const MIN_ATTEMPT: Duration = Duration::from_millis(200);

/// How a publish request waits for the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendMode {
    /// Wait for the broker; retries go to other brokers.
    Sync,
    /// Wait for the broker; retries stay on the first broker chosen.
    Async,
    /// Do not wait: one attempt, no failure detection.
    Oneway,
}

impl SendMode {
    /// Parses the `mode` query parameter.
    pub fn parse(text: &str) -> Option<SendMode> {
        match text {
            "sync" => Some(SendMode::Sync),
            "async" => Some(SendMode::Async),
            "oneway" => Some(SendMode::Oneway),
            _ => None,
        }
    }
}

/// Where a publish's attempts go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// popgate's producer policy: a queue chosen round-robin, retries on another broker, fault avoidance.
    Policy,
    /// One attempt at this queue of this broker: where a remoting client chose to send the message. Its client
    /// retries on another broker itself, as it does straight at the cluster, and a message a
    /// `MessageQueueSelector` put in a queue stays in that queue.
    Queue {
        /// The broker's name.
        broker: String,
        /// The queue id within that broker.
        queue_id: i32,
    },
}

/// One attempt of a publish, as reported to the client and in logs.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Attempt {
    /// The broker tried.
    pub broker: String,
    /// What went wrong, or `None` for the successful attempt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The broker's response code when the broker itself refused the message (a remoting front answers
    /// its client with it, as the broker would have).
    #[serde(skip)]
    pub broker_code: Option<i32>,
}

/// A publish the broker accepted.
#[derive(Debug, Clone)]
pub struct Published {
    /// The broker's receipt; `None` for a oneway send.
    pub receipt: Option<SendReceipt>,
    /// The topic written.
    pub topic: String,
    /// Every attempt made, the successful one last (none when `deduplicated`).
    pub attempts: Vec<Attempt>,
    /// Answered from the de-duplication window: an earlier send with the same key was stored, and this is
    /// its receipt; nothing was sent this time.
    pub deduplicated: bool,
}

/// Why a publish did not succeed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PublishError {
    /// The topic does not exist and the broker will not create it.
    #[error("topic `{0}` does not exist")]
    TopicNotFound(String),
    /// Every attempt failed (or the route could not be fetched: no attempts).
    #[error("all {} send attempts failed", .attempts.len())]
    Exhausted {
        /// The attempts made.
        attempts: Vec<Attempt>,
        /// The last failure.
        last_error: String,
    },
}

impl PublishError {
    /// The response code the broker refused the last attempt with, when it answered with one.
    pub fn broker_code(&self) -> Option<i32> {
        match self {
            PublishError::TopicNotFound(_) => None,
            PublishError::Exhausted { attempts, .. } => attempts.last().and_then(|a| a.broker_code),
        }
    }
}

/// A keyed send the caller stopped waiting for: it goes on, and a retry under the same key gets its receipt.
fn still_in_flight(why: &str) -> PublishError {
    let last_error = format!("{why}; the send goes on, and a retry of the same message is answered with its receipt");
    PublishError::Exhausted { attempts: Vec::new(), last_error }
}

/// What a broker's store status means under the reliability profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreVerdict {
    /// Stored as the profile demands.
    Stored,
    /// Stored, but short of a guarantee the profile does not demand (e.g. the flush timed out under async
    /// flush): accepted, returned in `status`, counted in `popgate_send_degraded_total`.
    Degraded,
    /// Short of a guarantee the profile demands: a failed attempt, retried.
    NotStored,
}

/// The single decision point for "is this store status a success?" (seed 004, checkpoint 2):
/// - `SEND_OK` is always stored;
/// - `FLUSH_DISK_TIMEOUT` fails under sync-flush profiles (`financial`, `durable`), is degraded otherwise;
/// - `FLUSH_SLAVE_TIMEOUT` / `SLAVE_NOT_AVAILABLE` fail under sync-replication profiles (`financial`,
///   `balanced`), are degraded otherwise.
pub fn judge_store_status(profile: Profile, status: StoreStatus) -> StoreVerdict {
    let demanded = match status {
        StoreStatus::SendOk => return StoreVerdict::Stored,
        StoreStatus::FlushDiskTimeout => profile.sync_flush(),
        StoreStatus::FlushSlaveTimeout | StoreStatus::SlaveNotAvailable => profile.sync_replication(),
    };
    if demanded {
        StoreVerdict::NotStored
    } else {
        StoreVerdict::Degraded
    }
}

/// Sends messages under RocketMQ's producer policy with popgate's own fault avoidance.
pub struct Publisher {
    broker: Arc<BrokerClient>,
    faults: Mutex<FaultTable>,
    config: PublishConfig,
    profile: Profile,
    /// Round-robin position (`sendWhichQueue`), shared by every topic as in the Java client per topic.
    rotation: AtomicUsize,
    /// The de-duplication window for keyed sends, when one is kept.
    dedup: Option<Arc<DedupWindow>>,
    /// The message types of the topics asked about.
    topic_types: topic_type::TopicTypes,
}

impl Publisher {
    /// A publisher over `broker` with the configured policy and reliability profile.
    pub fn new(
        broker: Arc<BrokerClient>,
        config: PublishConfig,
        faults: &FaultAvoidanceConfig,
        profile: Profile,
    ) -> Publisher {
        Publisher {
            broker,
            faults: Mutex::new(FaultTable::new(faults)),
            config,
            profile,
            rotation: AtomicUsize::new(0),
            dedup: None,
            topic_types: topic_type::TopicTypes::default(),
        }
    }

    /// Keyed sends ([`Publisher::publish_once`]) are de-duplicated within `window`.
    #[must_use]
    pub fn with_dedup(mut self, window: Arc<DedupWindow>) -> Publisher {
        self.dedup = Some(window);
        self
    }

    /// [`Publisher::publish_before`] for a message a producer may send again under the same `key` (the SDK's
    /// message id, an HTTP `Idempotency-Key`, a CloudEvents id): a repeat within the de-duplication window is
    /// answered with the first send's receipt and not sent again. Oneway sends and sends without a key are not
    /// de-duplicated (there is no receipt to answer with, or nothing to know a repeat by).
    ///
    /// A keyed send is not cut short by the caller's deadline: a broker that answers late would store a
    /// message whose sender was told it failed, and the sender's retry would store it again. The send goes on
    /// under popgate's own policy; the caller is answered by its deadline, and its retry (same key) waits for
    /// the send still in flight and gets its receipt.
    ///
    /// # Errors
    /// As [`Publisher::publish_before`]; [`PublishError::Exhausted`] without attempts when the deadline came
    /// first (the send goes on).
    pub async fn publish_once(
        self: &Arc<Self>,
        message: &OutgoingMessage,
        mode: SendMode,
        deadline: Option<Instant>,
        key: Option<&str>,
    ) -> Result<Published, PublishError> {
        self.publish_once_at(message, &Placement::Policy, mode, deadline, key).await
    }

    /// [`Publisher::publish_once`] with the attempts placed as `placement` says.
    ///
    /// # Errors
    /// As [`Publisher::publish_once`].
    pub async fn publish_once_at(
        self: &Arc<Self>,
        message: &OutgoingMessage,
        placement: &Placement,
        mode: SendMode,
        deadline: Option<Instant>,
        key: Option<&str>,
    ) -> Result<Published, PublishError> {
        let (Some(window), Some(key)) = (self.dedup.as_ref(), key.filter(|_| mode != SendMode::Oneway)) else {
            return self.publish_at(message, placement, mode, deadline).await;
        };
        let claimed = match deadline {
            None => window.claim(&message.topic, key).await,
            Some(deadline) => match tokio::time::timeout_at(deadline.into(), window.claim(&message.topic, key)).await {
                Ok(claimed) => claimed,
                Err(_) => {
                    return Err(still_in_flight("an earlier send of this message is still waiting for the broker"))
                }
            },
        };
        let pending = match claimed {
            Claim::Duplicate(receipt) => {
                let topic = message.topic.clone();
                return Ok(Published { receipt: Some(receipt), topic, attempts: Vec::new(), deduplicated: true });
            }
            Claim::Send(pending) => pending,
        };
        let (publisher, owned, placement) = (Arc::clone(self), message.clone(), placement.clone());
        let send = tokio::spawn(async move {
            let published = publisher.publish_at(&owned, &placement, mode, None).await;
            if let Some(receipt) = published.as_ref().ok().and_then(|p| p.receipt.as_ref()) {
                pending.sent(receipt).await;
            }
            published
        });
        let joined = match deadline {
            None => send.await,
            Some(deadline) => match tokio::time::timeout_at(deadline.into(), send).await {
                Ok(joined) => joined,
                Err(_) => return Err(still_in_flight("the broker did not answer before the client's deadline")),
            },
        };
        joined.unwrap_or_else(|error| {
            Err(PublishError::Exhausted { attempts: Vec::new(), last_error: format!("the send task failed: {error}") })
        })
    }

    /// Whether a publish could be taken now: a name server answers and knows a master broker (one that is
    /// still starting has not registered yet). `Err` says what is missing.
    pub async fn readiness(&self) -> Result<(), String> {
        match self.broker.cluster_masters().await {
            Ok(masters) if masters.is_empty() => Err("no broker has registered with the name server yet".to_owned()),
            Ok(_) => Ok(()),
            Err(error) => Err(error.to_string()),
        }
    }

    /// The brokers of `topic` as the name server knows it (no auto-creation), or `None` when the cluster does
    /// not have the topic. Cached (a route for `broker.route_ttl_ms`, its absence for a second), since every
    /// gRPC route query and every receive of a new group asks.
    ///
    /// # Errors
    /// What went wrong when no name server answered.
    pub async fn existing_topic(&self, topic: &str) -> Result<Option<TopicRoute>, String> {
        self.broker.existing_route_cached(topic).await.map_err(|e| e.to_string())
    }

    /// The message type of `topic` (of its route `route`), from its brokers' config; cached for 20 s.
    ///
    /// # Errors
    /// What went wrong when none of its brokers answered.
    pub async fn topic_message_type(&self, topic: &str, route: &TopicRoute) -> Result<TopicMessageType, String> {
        self.topic_types.of(&self.broker, topic, route).await.map_err(|e| e.to_string())
    }

    /// `messages` (of one topic, with one message group or none, checked by the front) as one batch message
    /// (`broker::batch_message`), and each message's id in order; `None` for no messages.
    pub fn batch(&self, messages: Vec<WithinLimits>) -> Option<(WithinLimits, Vec<String>)> {
        let mut ids = Vec::new();
        let batch = WithinLimits::joined(messages, |messages| {
            crate::broker::batch_message(&messages, self.broker.producer_group()).map(|(batch, batch_ids)| {
                ids = batch_ids;
                batch
            })
        })?;
        Some((batch, ids))
    }

    /// The largest message body popgate sends (`publish.max_message_bytes`; a batch's body as a whole).
    pub fn max_message_bytes(&self) -> usize {
        self.config.max_message_bytes
    }

    /// Whether a message's type is checked against its topic's (`publish.check_topic_message_type`).
    pub fn checks_topic_message_type(&self) -> bool {
        self.config.check_topic_message_type
    }

    /// The message type of `topic`, from its brokers' config (cached); `None` when the topic does not exist.
    ///
    /// # Errors
    /// What went wrong when the name server or none of its brokers answered.
    pub async fn message_type_of(&self, topic: &str) -> Result<Option<TopicMessageType>, String> {
        let Some(route) = self.existing_topic(topic).await? else { return Ok(None) };
        self.topic_message_type(topic, &route).await.map(Some)
    }

    /// Where the half message of producer group `producer_group` that `receipt` acknowledges is, as ending
    /// its transaction names it.
    ///
    /// # Errors
    /// Why it cannot be said: the broker's answer lacked a receipt or a commit-log offset.
    pub async fn half_message(
        &self,
        topic: &str,
        producer_group: &str,
        receipt: Option<&SendReceipt>,
    ) -> Result<HalfMessage, String> {
        let receipt = receipt.ok_or("the broker gave no receipt")?;
        let commit_log_offset = receipt.commit_log_offset.ok_or("the broker's answer has no commit-log offset")?;
        Ok(HalfMessage {
            topic: topic.to_owned(),
            producer_group: producer_group.to_owned(),
            message_id: receipt.message_id.clone(),
            broker_name: receipt.broker.clone(),
            broker_addr: self.broker.master_addr(topic, &receipt.broker).await.unwrap_or_default(),
            tran_state_table_offset: i64::try_from(receipt.queue_offset).unwrap_or(i64::MAX),
            commit_log_offset,
        })
    }

    /// The reliability profile sends are judged by.
    pub fn profile(&self) -> Profile {
        self.profile
    }

    /// Publishes one message.
    ///
    /// # Errors
    /// [`PublishError::TopicNotFound`] for a topic that cannot exist; [`PublishError::Exhausted`] when no
    /// attempt was stored as required.
    pub async fn publish(&self, message: &OutgoingMessage, mode: SendMode) -> Result<Published, PublishError> {
        self.publish_before(message, mode, None).await
    }

    /// [`Publisher::publish`] for a caller who stops listening at `deadline`: no attempt outlasts it, and no
    /// retry starts once it is too near for one (a gRPC client's deadline: its SDK retries on its own).
    ///
    /// # Errors
    /// As [`Publisher::publish`]; the attempts made before the deadline.
    pub async fn publish_before(
        &self,
        message: &OutgoingMessage,
        mode: SendMode,
        deadline: Option<Instant>,
    ) -> Result<Published, PublishError> {
        self.publish_at(message, &Placement::Policy, mode, deadline).await
    }

    /// [`Publisher::publish_before`] with the attempts placed as `placement` says.
    ///
    /// # Errors
    /// As [`Publisher::publish_before`]; for [`Placement::Queue`], when the broker named has no writable
    /// queue of the topic (no attempt).
    pub async fn publish_at(
        &self,
        message: &OutgoingMessage,
        placement: &Placement,
        mode: SendMode,
        deadline: Option<Instant>,
    ) -> Result<Published, PublishError> {
        let route = self.broker.route(&message.topic).await.map_err(|e| match e {
            BrokerError::TopicNotFound(topic) => PublishError::TopicNotFound(topic),
            other => {
                counter!(m::SEND_FAILURES, "reason" => other.reason_label()).increment(1);
                PublishError::Exhausted { attempts: Vec::new(), last_error: format!("route lookup failed: {other}") }
            }
        })?;
        let start = self.rotation.fetch_add(1, Ordering::Relaxed);
        let mut brokers: Vec<String> = route.writable().map(|b| b.name.clone()).collect();
        let first = start % brokers.len().max(1);
        brokers.rotate_left(first);

        let max_attempts = match mode {
            SendMode::Sync => 1 + self.config.retry_times_when_send_failed,
            SendMode::Async => 1 + self.config.retry_times_when_send_async_failed,
            SendMode::Oneway => 1,
        };
        // A FIFO message group always goes to the queue Apache's proxy picks for it, retries included and whatever
        // the fault table says: order over availability, as in Apache's proxy (one attempt on that queue; the
        // SDK's retries come back to the same queue).
        let (pinned, max_attempts) = match placement {
            Placement::Policy => (
                message.properties.get(PROPERTY_SHARDING_KEY).and_then(|group| group_queue(&route, group)),
                max_attempts,
            ),
            Placement::Queue { broker, queue_id } => {
                if !route.writable().any(|b| b.name == *broker) {
                    let last_error = format!("broker `{broker}` has no writable queue of topic `{}`", message.topic);
                    return Err(PublishError::Exhausted { attempts: Vec::new(), last_error });
                }
                if let Some(refused) = self.refuse_isolated(broker, &brokers) {
                    return Err(refused);
                }
                (Some((broker.clone(), *queue_id)), 1)
            }
        };
        let mut attempts = Vec::new();
        let mut last_failed: Option<String> = None;
        let mut last_error = String::new();
        for attempt in 0..max_attempts {
            let Some(timeout) = attempt_timeout(self.config.send_timeout(), deadline, Instant::now()) else {
                if attempts.is_empty() {
                    last_error = "no time left before the client's deadline".to_owned();
                }
                break;
            };
            let chosen = match (&pinned, mode, attempts.first()) {
                (Some((broker, _)), _, _) => broker.clone(),
                (None, SendMode::Async, Some(Attempt { broker, .. })) => broker.clone(),
                _ => self.choose(&brokers, last_failed.as_deref()),
            };
            let Some(broker) = route.brokers.iter().find(|b| b.name == chosen) else { break };
            let queue_id = match &pinned {
                Some((_, queue)) => *queue,
                None => i32::try_from((start + attempt as usize) % broker.write_queues.max(1) as usize).unwrap_or(0),
            };
            counter!(m::SEND_ATTEMPTS, "broker" => broker.name.clone()).increment(1);
            if attempt > 0 {
                counter!(m::SEND_RETRIES).increment(1);
            }
            match self.attempt(message, broker, queue_id, mode, timeout).await {
                Ok(receipt) => {
                    attempts.push(Attempt { broker: broker.name.clone(), error: None, broker_code: None });
                    return Ok(Published { receipt, topic: message.topic.clone(), attempts, deduplicated: false });
                }
                Err(AttemptError::Fatal(error, broker_code)) => {
                    attempts.push(Attempt { broker: broker.name.clone(), error: Some(error.to_string()), broker_code });
                    return Err(PublishError::Exhausted { attempts, last_error: error.to_string() });
                }
                Err(AttemptError::Retriable(error, broker_code)) => {
                    last_error = error.clone();
                    attempts.push(Attempt { broker: broker.name.clone(), error: Some(error), broker_code });
                    last_failed = Some(broker.name.clone());
                }
            }
        }
        self.broker.invalidate_route(&message.topic);
        Err(PublishError::Exhausted { attempts, last_error })
    }

    /// A send placed on `broker` while fault avoidance isolates it because a send to it failed, and another of
    /// `writable` is available: refused at once (`SERVICE_NOT_AVAILABLE`, which RocketMQ's producer retries on
    /// another broker) instead of waiting out the send timeout on a broker known to be failing.
    ///
    /// A broker isolated only for a slow answer is not refused: the client chose the queue (its selector, an
    /// ordered send that retries on the same queue), and a slow first send on a loaded machine would otherwise
    /// refuse every message of an ordered stream for the isolation's length, which straight at the broker all
    /// land. Latency steers popgate's own choices of broker only, as it steers a Java producer's.
    fn refuse_isolated(&self, broker: &str, writable: &[String]) -> Option<PublishError> {
        let faults = self.faults.lock();
        let now = Instant::now();
        let failed = faults.fault(broker).is_some_and(|fault| fault.last_error.is_some());
        if !failed || faults.is_available(broker, now) || !writable.iter().any(|b| faults.is_available(b, now)) {
            return None;
        }
        let error = format!("broker `{broker}` is isolated by popgate's fault avoidance; send to another broker");
        let attempt =
            Attempt { broker: broker.to_owned(), error: Some(error.clone()), broker_code: Some(SERVICE_NOT_AVAILABLE) };
        Some(PublishError::Exhausted { attempts: vec![attempt], last_error: error })
    }

    fn choose(&self, brokers: &[String], last_failed: Option<&str>) -> String {
        let faults = self.faults.lock();
        let now = Instant::now();
        fault::choose_broker(brokers, last_failed, |name| faults.is_available(name, now)).unwrap_or_default().to_owned()
    }

    /// One send to one queue, with its outcome recorded in the fault table and the metrics.
    async fn attempt(
        &self,
        message: &OutgoingMessage,
        route: &BrokerRoute,
        queue_id: i32,
        mode: SendMode,
        timeout: Duration,
    ) -> Result<Option<SendReceipt>, AttemptError> {
        if mode == SendMode::Oneway {
            self.broker.send_oneway(message, route, queue_id);
            return Ok(None);
        }
        let broker = route.name.as_str();
        self.first_sight(broker);
        let started = Instant::now();
        let result = self.broker.send(message, route, queue_id, timeout).await;
        let latency = started.elapsed();
        histogram!(m::SEND_DURATION, "broker" => broker.to_owned()).record(latency.as_secs_f64());
        match result {
            Ok(receipt) => {
                let isolation = self.faults.lock().record_success(broker, latency, Instant::now());
                if isolation.is_some() {
                    note_isolation(broker, IsolationCause::Latency);
                }
                match judge_store_status(self.profile, receipt.status) {
                    StoreVerdict::Stored => Ok(Some(receipt)),
                    StoreVerdict::Degraded => {
                        counter!(m::SEND_DEGRADED, "status" => receipt.status.as_str()).increment(1);
                        Ok(Some(receipt))
                    }
                    StoreVerdict::NotStored => {
                        counter!(m::SEND_FAILURES, "reason" => "not_stored").increment(1);
                        Err(AttemptError::Retriable(
                            format!(
                                "broker answered {}, short of the {} profile",
                                receipt.status.as_str(),
                                self.profile.name()
                            ),
                            None,
                        ))
                    }
                }
            }
            Err(error) => {
                counter!(m::SEND_FAILURES, "reason" => error.reason_label()).increment(1);
                if !error.is_retriable() {
                    return Err(AttemptError::Fatal(error.to_string(), error.response_code()));
                }
                if error.is_brokers_own_failure() {
                    let isolation =
                        self.faults.lock().record_failure(broker, latency, &error.to_string(), Instant::now());
                    if isolation.is_some() {
                        note_isolation(broker, IsolationCause::Unreachable);
                    }
                }
                Err(AttemptError::Retriable(error.to_string(), error.response_code()))
            }
        }
    }

    /// Registers a broker's isolation series at 0 the first time it is used, so "never isolated" shows as 0.
    fn first_sight(&self, broker: &str) {
        if self.faults.lock().fault(broker).is_some() {
            return;
        }
        for cause in [IsolationCause::Latency, IsolationCause::Unreachable] {
            counter!(m::BROKER_ISOLATIONS, "broker" => broker.to_owned(), "cause" => cause.as_label()).increment(0);
        }
        gauge!(m::BROKER_ISOLATED, "broker" => broker.to_owned()).set(0.0);
    }

    /// A copy of every broker's fault-avoidance entry.
    pub fn fault_entries(&self) -> Vec<(String, crate::broker::fault::BrokerFault)> {
        self.faults.lock().entries().map(|(name, fault)| (name.clone(), fault.clone())).collect()
    }

    /// Sets `popgate_broker_isolated{broker}` from the table, so an isolation that ended shows as 0 again.
    pub fn refresh_isolation_gauges(&self) {
        let faults = self.faults.lock();
        let now = Instant::now();
        for (broker, _) in faults.entries() {
            let isolated = if faults.is_available(broker, now) { 0.0 } else { 1.0 };
            gauge!(m::BROKER_ISOLATED, "broker" => broker.clone()).set(isolated);
        }
    }
}

/// Why one attempt failed, and the broker's response code when the broker answered with one.
enum AttemptError {
    /// Another attempt may succeed (the broker was unreachable, slow to store, or busy).
    Retriable(String, Option<i32>),
    /// Retrying cannot help (the message was refused as such).
    Fatal(String, Option<i32>),
}

fn note_isolation(broker: &str, cause: IsolationCause) {
    counter!(m::BROKER_ISOLATIONS, "broker" => broker.to_owned(), "cause" => cause.as_label()).increment(1);
    gauge!(m::BROKER_ISOLATED, "broker" => broker.to_owned()).set(1.0);
    tracing::warn!(broker, cause = cause.as_label(), "Broker isolated by fault avoidance.");
}

/// How long the next attempt may wait for the broker: the send timeout, or less when the caller's deadline is
/// nearer; `None` when less than [`MIN_ATTEMPT`] is left.
fn attempt_timeout(send_timeout: Duration, deadline: Option<Instant>, now: Instant) -> Option<Duration> {
    let Some(deadline) = deadline else { return Some(send_timeout) };
    let left = deadline.saturating_duration_since(now);
    (left >= MIN_ATTEMPT).then(|| send_timeout.min(left))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_never_outlasts_the_callers_deadline_and_none_starts_too_close_to_it() {
        let (now, send_timeout) = (Instant::now(), Duration::from_secs(3));
        assert_eq!(attempt_timeout(send_timeout, None, now), Some(send_timeout), "no deadline: the send timeout");
        let far = now + Duration::from_secs(10);
        assert_eq!(attempt_timeout(send_timeout, Some(far), now), Some(send_timeout));
        let near = now + Duration::from_millis(1_200);
        assert_eq!(attempt_timeout(send_timeout, Some(near), now), Some(Duration::from_millis(1_200)));
        let too_near = now + MIN_ATTEMPT - Duration::from_millis(1);
        assert_eq!(attempt_timeout(send_timeout, Some(too_near), now), None);
        assert_eq!(attempt_timeout(send_timeout, Some(now), now + Duration::from_secs(1)), None, "already past");
    }

    #[test]
    fn each_profile_accepts_exactly_the_guarantees_it_does_not_demand() {
        use StoreStatus::*;
        use StoreVerdict::*;
        let statuses = [SendOk, FlushDiskTimeout, FlushSlaveTimeout, SlaveNotAvailable];
        let expected = [
            (Profile::Financial, [Stored, NotStored, NotStored, NotStored]),
            (Profile::Durable, [Stored, NotStored, Degraded, Degraded]),
            (Profile::Balanced, [Stored, Degraded, NotStored, NotStored]),
            (Profile::Throughput, [Stored, Degraded, Degraded, Degraded]),
        ];
        for (profile, verdicts) in expected {
            for (status, verdict) in statuses.iter().zip(verdicts) {
                assert_eq!(judge_store_status(profile, *status), verdict, "{profile:?} {status:?}");
            }
        }
    }
}
