//! Replaying dead-lettered events to their origin topics, paced, one DLQ at a time, with the progress kept in
//! the replay ledger (see [`super`] for why a crash neither loses an event nor makes a new one).

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;
use metrics::counter;
use serde::{Deserialize, Serialize};

use super::browse::{user_properties, BrowseRequest, BrowsedMessage};
use super::{ledger_key, DlqAdmin, DlqError};
use crate::broker::message::{PROPERTY_SHARDING_KEY, PROPERTY_UNIQ_KEY};
use crate::broker::OutgoingMessage;
use crate::clock::Epoch;
use crate::delivery::dlq::POPGATE_MESSAGE_GROUP;
use crate::metrics as m;
use crate::publish::SendMode;
use crate::store::Family;

/// Property on a replayed event: the DLQ message it was replayed from.
pub const POPGATE_REPLAYED_FROM: &str = "POPGATE_REPLAYED_FROM";

/// Where a message's replay stands in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ReplayState {
    /// Started: the event may or may not have reached its topic.
    Replaying,
    /// The broker stored it on its origin topic.
    Replayed,
}

/// The ledger entry of one DLQ message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplayRecord {
    /// Where it stands.
    pub state: ReplayState,
    /// The topic it is replayed to.
    pub origin_topic: String,
    /// When the latest replay of it started (epoch ms).
    pub started_ms: i64,
    /// When it was stored on its topic (epoch ms).
    pub replayed_ms: Option<i64>,
}

/// What to replay.
#[derive(Debug, Clone)]
pub struct ReplayRequest {
    /// `%DLQ%<group>`.
    pub dlq_topic: String,
    /// At most this many messages, oldest first.
    pub max: usize,
    /// Messages per second.
    pub rate_per_sec: u32,
    /// Only these message ids.
    pub ids: Option<HashSet<String>>,
    /// Only events dead-lettered from this topic.
    pub origin_topic: Option<String>,
}

/// The result of one message's replay.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplayOutcome {
    /// The DLQ message.
    pub message_id: String,
    /// Where it went.
    pub origin_topic: Option<String>,
    /// `replayed`, `failed` (it stays in the DLQ view), or `skipped` (no origin topic recorded).
    pub status: &'static str,
    /// The id it was published under (the one it had when dead-lettered).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// An interrupted earlier replay of it was finished.
    pub resumed: bool,
    /// Why it failed or was skipped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Marks a DLQ as being replayed for as long as it lives.
struct Running<'a> {
    admin: &'a DlqAdmin,
    topic: String,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.admin.replaying.lock().remove(&self.topic);
    }
}

impl DlqAdmin {
    /// Replays up to `request.max` messages, paced at `request.rate_per_sec`, answering one outcome each.
    ///
    /// # Errors
    /// [`DlqError::Busy`] when this DLQ is being replayed already; browse errors; [`DlqError::Store`] when the
    /// ledger cannot record progress (the replay stops there, before publishing anything unrecorded).
    pub async fn replay(&self, request: &ReplayRequest) -> Result<Vec<ReplayOutcome>, DlqError> {
        if !(1..=10_000).contains(&request.rate_per_sec) {
            return Err(DlqError::Invalid("rate", "must be in 1..=10000 messages per second".to_owned()));
        }
        let _running = self.start_running(&request.dlq_topic)?;
        let page = self
            .browse(&BrowseRequest {
                dlq_topic: request.dlq_topic.clone(),
                max: request.max,
                cursor: None,
                origin_topic: request.origin_topic.clone(),
                ids: request.ids.clone(),
            })
            .await?;
        let mut pace = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(request.rate_per_sec)));
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut outcomes = Vec::with_capacity(page.messages.len());
        for message in &page.messages {
            pace.tick().await;
            outcomes.push(self.replay_one(&request.dlq_topic, message).await?);
        }
        Ok(outcomes)
    }

    fn start_running(&self, topic: &str) -> Result<Running<'_>, DlqError> {
        if !self.replaying.lock().insert(topic.to_owned()) {
            return Err(DlqError::Busy(topic.to_owned()));
        }
        Ok(Running { admin: self, topic: topic.to_owned() })
    }

    async fn replay_one(&self, dlq_topic: &str, message: &BrowsedMessage) -> Result<ReplayOutcome, DlqError> {
        let mut outcome = ReplayOutcome {
            message_id: message.message_id.clone(),
            origin_topic: message.origin_topic.clone(),
            status: "skipped",
            event_id: None,
            resumed: message.interrupted_replay.is_some(),
            error: None,
        };
        let Some(origin_topic) = &message.origin_topic else {
            outcome.error = Some("the message names no origin topic (DLQ_ORIGIN_TOPIC)".to_owned());
            return Ok(outcome);
        };
        let key = ledger_key(dlq_topic, &message.message_id);
        let mut record = ReplayRecord {
            state: ReplayState::Replaying,
            origin_topic: origin_topic.clone(),
            started_ms: Epoch::now().as_millis(),
            replayed_ms: None,
        };
        self.record(&key, &record).await?;
        let replayed = replay_message(message, origin_topic);
        let event_id = replayed.properties.get(PROPERTY_UNIQ_KEY).cloned();
        match self.publisher.publish(&replayed, SendMode::Sync).await {
            Ok(_) => {
                record.state = ReplayState::Replayed;
                record.replayed_ms = Some(Epoch::now().as_millis());
                self.record(&key, &record).await?;
                counter!(m::DLQ_REPLAYS, "result" => "replayed").increment(1);
                tracing::info!(dlq = dlq_topic, message_id = %message.message_id, event_id = ?event_id, "DLQ event replayed.");
                outcome.status = "replayed";
                outcome.event_id = event_id;
            }
            Err(error) => {
                // The ledger keeps `replaying`: the broker may have stored it after all (a timeout), so the next
                // replay sends it again under the same id rather than treat it as never sent.
                counter!(m::DLQ_REPLAYS, "result" => "failed").increment(1);
                tracing::warn!(dlq = dlq_topic, message_id = %message.message_id, %error, "DLQ replay failed.");
                outcome.status = "failed";
                outcome.error = Some(error.to_string());
            }
        }
        Ok(outcome)
    }

    /// Writes a ledger entry and syncs it, so progress survives a power loss as well as a crash.
    async fn record(&self, key: &str, record: &ReplayRecord) -> Result<(), DlqError> {
        self.store.put(Family::DlqReplays, key, record).await?;
        self.store.sync_wal().await?;
        Ok(())
    }
}

/// The event as it goes back to its origin topic: body, tag, keys, user properties and FIFO group as
/// dead-lettered, under the id it had then.
fn replay_message(message: &BrowsedMessage, origin_topic: &str) -> OutgoingMessage {
    let stored = &message.stored;
    let mut replayed = OutgoingMessage::new(origin_topic.to_owned(), Bytes::from(stored.body.clone()));
    replayed.tags = stored.tags.clone();
    replayed.keys = stored.keys.clone();
    replayed.properties = user_properties(&stored.properties);
    let event_id = message.origin_message_id.clone().unwrap_or_else(|| message.message_id.clone());
    replayed.properties.insert(PROPERTY_UNIQ_KEY.to_owned(), event_id);
    replayed.properties.insert(POPGATE_REPLAYED_FROM.to_owned(), message.message_id.clone());
    if let Some(group) = stored.properties.get(POPGATE_MESSAGE_GROUP) {
        replayed.properties.insert(PROPERTY_SHARDING_KEY.to_owned(), group.clone());
    }
    replayed
}
