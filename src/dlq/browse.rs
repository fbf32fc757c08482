//! Browsing a DLQ: every queue of `%DLQ%<group>` on every broker, in (broker, queue, offset) order, read by
//! PULL without committing anything, minus the messages already replayed. A page ends after `max` messages
//! with a cursor naming where the next page starts.

use std::collections::{BTreeMap, HashSet};

use base64::Engine;
use serde::Serialize;
use serde_json::Value;

use super::replay::{ReplayRecord, ReplayState};
use super::{ledger_key, DlqAdmin, DlqError};
use crate::broker::content;
use crate::broker::pull::StoredMessage;
use crate::delivery::dlq::{
    DLQ_ORIGIN_MESSAGE_ID, DLQ_ORIGIN_TOPIC, POPGATE_ATTEMPTS, POPGATE_DEAD_LETTERED_AT, POPGATE_DELIVERY_ID,
    POPGATE_LAST_FAILURE, POPGATE_MESSAGE_GROUP, RETRY_TOPIC,
};
use crate::store::{Family, StoreError};

/// Messages read from a queue per PULL (the broker's own browse batch).
const PULL_BATCH: i32 = 32;
/// Most messages one page may hold.
pub const MAX_PAGE: usize = 1_000;

/// What to browse.
#[derive(Debug, Clone, Default)]
pub struct BrowseRequest {
    /// `%DLQ%<group>`.
    pub dlq_topic: String,
    /// At most this many messages (1..=[`MAX_PAGE`]).
    pub max: usize,
    /// Where to start: the previous page's `nextCursor`.
    pub cursor: Option<String>,
    /// Only events dead-lettered from this topic.
    pub origin_topic: Option<String>,
    /// Only these message ids.
    pub ids: Option<HashSet<String>>,
}

/// One page of a DLQ.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Page {
    /// The DLQ topic.
    pub topic: String,
    /// The messages, in queue order.
    pub messages: Vec<BrowsedMessage>,
    /// Give this as `cursor` for the next page; absent when the DLQ has no more.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// One dead-lettered event as an operator sees it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BrowsedMessage {
    /// The DLQ message's id: what `ids=` of a replay names.
    pub message_id: String,
    /// Broker and queue position of the DLQ message.
    pub broker: String,
    /// Queue id in the DLQ topic.
    pub queue_id: i32,
    /// Offset in that queue.
    pub queue_offset: i64,
    /// The topic the event was consumed from.
    pub origin_topic: Option<String>,
    /// The event's message id on its origin topic.
    pub origin_message_id: Option<String>,
    /// Delivery attempts made before it was dead-lettered.
    pub attempts: Option<u32>,
    /// Why the last attempt failed (or the subscriber's TERM reason).
    pub last_failure: Option<String>,
    /// When popgate dead-lettered it (epoch ms).
    pub dead_lettered_at: Option<i64>,
    /// The delivery id that was dead-lettered.
    pub delivery_id: Option<String>,
    /// When the broker stored the DLQ message (epoch ms).
    pub store_timestamp: i64,
    /// RocketMQ tag.
    pub tags: Option<String>,
    /// Message keys.
    pub keys: Vec<String>,
    /// The event's user properties (popgate's content type left out: `data` shows it).
    pub properties: BTreeMap<String, String>,
    /// The body as a subscriber gets it: the JSON value, or text ([`content::http_data`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// The body in base64, when it is bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_base64: Option<String>,
    /// A replay that started and did not finish (popgate stopped mid-way): the next replay sends it again
    /// under the same id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interrupted_replay: Option<ReplayRecord>,
    /// The message as stored, for the replay.
    #[serde(skip)]
    pub stored: StoredMessage,
}

/// The markers popgate and RocketMQ add when dead-lettering; shown as fields, not as user properties.
const DLQ_MARKERS: [&str; 8] = [
    POPGATE_MESSAGE_GROUP,
    DLQ_ORIGIN_TOPIC,
    DLQ_ORIGIN_MESSAGE_ID,
    RETRY_TOPIC,
    POPGATE_ATTEMPTS,
    POPGATE_LAST_FAILURE,
    POPGATE_DEAD_LETTERED_AT,
    POPGATE_DELIVERY_ID,
];

impl BrowsedMessage {
    fn new(stored: StoredMessage, broker: &str, interrupted_replay: Option<ReplayRecord>) -> BrowsedMessage {
        let property = |name: &str| stored.properties.get(name).cloned();
        let (data, data_base64) = content::http_data(&stored.properties, &stored.body).into_fields();
        BrowsedMessage {
            message_id: stored.id().to_owned(),
            broker: broker.to_owned(),
            queue_id: stored.queue_id,
            queue_offset: stored.queue_offset,
            origin_topic: property(DLQ_ORIGIN_TOPIC),
            origin_message_id: property(DLQ_ORIGIN_MESSAGE_ID),
            attempts: property(POPGATE_ATTEMPTS).and_then(|a| a.parse().ok()),
            last_failure: property(POPGATE_LAST_FAILURE),
            dead_lettered_at: property(POPGATE_DEAD_LETTERED_AT).and_then(|a| a.parse().ok()),
            delivery_id: property(POPGATE_DELIVERY_ID),
            store_timestamp: stored.store_timestamp,
            tags: stored.tags.clone(),
            keys: stored.keys.clone(),
            properties: content::user_properties(&user_properties(&stored.properties)),
            data,
            data_base64,
            interrupted_replay,
            stored,
        }
    }
}

/// The event's own properties: neither RocketMQ's system ones nor the dead-letter markers.
pub(super) fn user_properties(all: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    all.iter()
        .filter(|(name, _)| {
            !crate::broker::message::is_reserved_property(name) && !DLQ_MARKERS.contains(&name.as_str())
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// A position in the DLQ: a queue of a broker, and the offset to read next.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Position {
    broker: String,
    queue_id: i32,
    offset: i64,
}

impl Position {
    fn encode(&self) -> String {
        let text = format!("{}\n{}\n{}", self.broker, self.queue_id, self.offset);
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text)
    }

    fn decode(cursor: &str) -> Option<Position> {
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(cursor).ok()?;
        let text = String::from_utf8(bytes).ok()?;
        let mut parts = text.split('\n');
        let broker = parts.next()?.to_owned();
        let queue_id = parts.next()?.parse().ok()?;
        let offset = parts.next()?.parse().ok()?;
        (parts.next().is_none() && offset >= 0).then_some(Position { broker, queue_id, offset })
    }
}

/// One queue of the DLQ topic.
struct Queue {
    broker: String,
    addr: String,
    queue_id: i32,
}

impl DlqAdmin {
    /// One page of the DLQ, replayed messages left out.
    ///
    /// # Errors
    /// [`DlqError::Invalid`] for a bad cursor or `max`; [`DlqError::Broker`] when a broker cannot be read.
    pub async fn browse(&self, request: &BrowseRequest) -> Result<Page, DlqError> {
        if !(1..=MAX_PAGE).contains(&request.max) {
            return Err(DlqError::Invalid("max", format!("must be in 1..={MAX_PAGE}")));
        }
        let start = match &request.cursor {
            None => None,
            Some(cursor) => Some(
                Position::decode(cursor)
                    .ok_or_else(|| DlqError::Invalid("cursor", "not a cursor this DLQ gave out".to_owned()))?,
            ),
        };
        let queues = self.queues(&request.dlq_topic).await?;
        let first = match &start {
            None => 0,
            Some(position) => queues
                .iter()
                .position(|q| q.broker == position.broker && q.queue_id == position.queue_id)
                .ok_or_else(|| DlqError::Invalid("cursor", "names a queue the DLQ no longer has".to_owned()))?,
        };
        let mut page = Page { topic: request.dlq_topic.clone(), messages: Vec::new(), next_cursor: None };
        for (index, queue) in queues.iter().enumerate().skip(first) {
            let from = match &start {
                Some(position) if index == first => position.offset,
                _ => 0,
            };
            if let Some(next) = self.browse_queue(request, queue, from, &mut page.messages).await? {
                page.next_cursor = Some(next.encode());
                break;
            }
        }
        Ok(page)
    }

    /// Appends the queue's matching messages from `offset` on; returns where to continue once the page is full.
    async fn browse_queue(
        &self,
        request: &BrowseRequest,
        queue: &Queue,
        mut offset: i64,
        out: &mut Vec<BrowsedMessage>,
    ) -> Result<Option<Position>, DlqError> {
        loop {
            let pulled = self.broker.pull(&queue.addr, &request.dlq_topic, queue.queue_id, offset, PULL_BATCH).await?;
            if pulled.messages.is_empty() {
                // An offset before the queue's first message moves up to it; otherwise the queue is done.
                if pulled.next_offset > offset {
                    offset = pulled.next_offset;
                    continue;
                }
                return Ok(None);
            }
            for stored in pulled.messages {
                let after = stored.queue_offset + 1;
                offset = offset.max(after);
                if let Some(message) = self.visible(request, queue, stored)? {
                    out.push(message);
                    if out.len() >= request.max {
                        return Ok(Some(Position {
                            broker: queue.broker.clone(),
                            queue_id: queue.queue_id,
                            offset: after,
                        }));
                    }
                }
            }
            offset = offset.max(pulled.next_offset);
        }
    }

    /// The message as browsed, or `None` when a filter leaves it out or it was replayed.
    fn visible(
        &self,
        request: &BrowseRequest,
        queue: &Queue,
        stored: StoredMessage,
    ) -> Result<Option<BrowsedMessage>, DlqError> {
        if let Some(ids) = &request.ids {
            if !ids.contains(stored.id()) {
                return Ok(None);
            }
        }
        if let Some(origin) = &request.origin_topic {
            if stored.properties.get(DLQ_ORIGIN_TOPIC) != Some(origin) {
                return Ok(None);
            }
        }
        let key = ledger_key(&request.dlq_topic, stored.id());
        let ledger: Option<ReplayRecord> = match self.store.get(Family::DlqReplays, &key) {
            Err(StoreError::Decode { source, .. }) => {
                // Counted and shown as an interrupted replay: the message stays in view, and a replay sends it
                // again under its own id, so a subscriber can de-duplicate whatever the lost entry said.
                metrics::counter!(crate::metrics::STORE_UNDECODABLE, "family" => "dlq_replays").increment(1);
                tracing::warn!(%source, key = %key, "DLQ replay ledger entry does not decode; shown as interrupted.");
                Some(ReplayRecord {
                    state: ReplayState::Replaying,
                    origin_topic: stored.properties.get(DLQ_ORIGIN_TOPIC).cloned().unwrap_or_default(),
                    started_ms: 0,
                    replayed_ms: None,
                })
            }
            other => other?,
        };
        match ledger {
            Some(record) if record.state == ReplayState::Replayed => Ok(None),
            interrupted => Ok(Some(BrowsedMessage::new(stored, &queue.broker, interrupted))),
        }
    }

    /// Every readable queue of the DLQ topic, sorted; none when the group never dead-lettered anything.
    async fn queues(&self, dlq_topic: &str) -> Result<Vec<Queue>, DlqError> {
        let Some(route) = self.broker.existing_route(dlq_topic).await? else { return Ok(Vec::new()) };
        let mut queues: Vec<Queue> = route
            .readable()
            .flat_map(|broker| {
                (0..broker.read_queues).map(move |queue_id| Queue {
                    broker: broker.name.clone(),
                    addr: broker.addr.clone(),
                    queue_id: queue_id as i32,
                })
            })
            .collect();
        queues.sort_by(|a, b| (&a.broker, a.queue_id).cmp(&(&b.broker, b.queue_id)));
        Ok(queues)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_round_trips_and_garbage_is_refused() {
        let position = Position { broker: "broker-a".into(), queue_id: 3, offset: 42 };
        assert_eq!(Position::decode(&position.encode()), Some(position));
        assert_eq!(Position::decode("not base64!"), None);
        assert_eq!(Position::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("a\nb\nc")), None);
        assert_eq!(Position::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("a\n1\n-5")), None);
    }

    #[test]
    fn dead_letter_markers_are_not_user_properties() {
        let all: BTreeMap<String, String> = [
            ("color", "red"),
            (DLQ_ORIGIN_TOPIC, "orders"),
            (POPGATE_ATTEMPTS, "6"),
            ("UNIQ_KEY", "abc"),
            ("TAGS", "t"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let user = user_properties(&all);
        assert_eq!(user.into_iter().collect::<Vec<_>>(), vec![("color".to_owned(), "red".to_owned())]);
    }
}
