//! Turning an HTTP publish request into one RocketMQ message.
//!
//! Three request shapes are accepted, so existing producers can point at popgate unchanged:
//!
//! ```text
//! popgate JSON     Content-Type: application/json
//!                  {"topic","data"|"dataBase64","tags","keys","properties","messageGroup","delayMs"}
//! CloudEvents      Content-Type: application/cloudevents+json
//!   structured     {"specversion":"1.0","id","source","type", "data"|"data_base64", ...extensions}
//! CloudEvents      ce-specversion, ce-id, ce-source, ce-type, ce-* headers; the body is the data
//!   binary
//! ```
//!
//! `?topic=` names the topic in every mode (it wins over a `topic` field). A transactional publish (a half
//! message, ended later) says `"transaction": true` (and its checker's `"producerGroup"`) in popgate JSON, or
//! `?transaction=true&producerGroup=` in any mode. CloudEvents attributes become
//! message properties `ce_<attribute>`, and the event id is also the message key, so RocketMQ tooling can find
//! an event by its id. Every rejection names the field at fault.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::http::HeaderMap;
use base64::Engine;
use bytes::Bytes;
use serde_json::{Map, Value};

use super::limits::{MessageLimits, Part, WithinLimits};
use crate::broker::content::{DataKind, PROPERTY_CONTENT_TYPE};
use crate::broker::message::{
    is_reserved_property, is_valid_name, OutgoingMessage, MAX_NAME_LEN, PROPERTY_SHARDING_KEY,
    PROPERTY_TIMER_DELIVER_MS,
};
use crate::clock::Epoch;

/// Why a publish request was refused before anything reached the broker. The HTTP layer turns it into its
/// 400 or 413 answer; this module knows nothing of HTTP statuses.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// A field is missing, malformed or has the wrong type.
    #[error("{message}")]
    InvalidField {
        /// The field at fault.
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// The body as a whole cannot be read (not JSON, wrong content type).
    #[error("{0}")]
    MalformedBody(String),
}

impl RequestError {
    fn invalid_field(field: &str, message: impl Into<String>) -> RequestError {
        RequestError::InvalidField { field: field.to_owned(), message: message.into() }
    }

    fn malformed_body(message: impl Into<String>) -> RequestError {
        RequestError::MalformedBody(message.into())
    }

    /// The field at fault, when there is one.
    pub fn field(&self) -> Option<&str> {
        match self {
            RequestError::InvalidField { field, .. } => Some(field),
            RequestError::MalformedBody(_) => None,
        }
    }
}

/// The content type of a structured-mode CloudEvent.
const CLOUDEVENTS_JSON: &str = "application/cloudevents+json";
/// CloudEvents attributes that must be present (spec 1.0).
const CE_REQUIRED: [&str; 4] = ["specversion", "id", "source", "type"];

/// One publish request, parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishRequest {
    /// The message to send, within the limits.
    pub message: WithinLimits,
    /// It starts a transaction: it is sent as a half message, and ended later.
    pub transaction: Option<Transactional>,
}

/// What a transactional publish asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transactional {
    /// The producer group whose checker the broker's check-backs go to (`transactions.checkers`), if any.
    pub producer_group: Option<String>,
}

/// The `?transaction=` and `?producerGroup=` parameters of a request, each `None` when absent.
type TransactionParams<'a> = (Option<&'a str>, Option<&'a str>);

/// Parses one publish request into a message ready to send. `query_transaction` are the `?transaction=` and
/// `?producerGroup=` parameters; they win over the body's fields, as `?topic=` does.
///
/// # Errors
/// [`RequestError`] 400 naming the field for malformed, missing or wrong-typed input or a message past the
/// [`MessageLimits`]. The data's size is publishing's to judge (`gateway::Publishing`), the same for every front.
pub fn parse(
    headers: &HeaderMap,
    topic_param: Option<&str>,
    query_transaction: TransactionParams<'_>,
    body: &Bytes,
    limits: &MessageLimits,
) -> Result<PublishRequest, RequestError> {
    let content_type = header_str(headers, "content-type").unwrap_or_default().to_ascii_lowercase();
    let mut body_transaction = (None, None);
    let message = if headers.contains_key("ce-specversion") {
        parse_cloudevent_binary(headers, topic_param, body)?
    } else if content_type.starts_with(CLOUDEVENTS_JSON) {
        parse_cloudevent_structured(topic_param, &parse_json_object(body)?)?
    } else if content_type.is_empty() || content_type.starts_with("application/json") {
        let map = parse_json_object(body)?;
        body_transaction = transaction_fields(&map)?;
        parse_popgate_json(topic_param, &map)?
    } else {
        return Err(RequestError::invalid_field(
            "content-type",
            format!(
                "unsupported content type `{content_type}`: use application/json, {CLOUDEVENTS_JSON} or ce-* headers"
            ),
        ));
    };
    let message =
        limits.admit(message).map_err(|broken| RequestError::invalid_field(field_of(broken.part), broken.message))?;
    let wanted = query_transaction.0.map(parse_flag).transpose()?.or(body_transaction.0);
    let producer_group = query_transaction.1.or(body_transaction.1.as_deref());
    let transaction = transactional(wanted, producer_group, message.message())?;
    Ok(PublishRequest { message, transaction })
}

/// The content type of a batch of structured-mode CloudEvents (the CloudEvents HTTP binding's batched mode).
const CLOUDEVENTS_BATCH_JSON: &str = "application/cloudevents-batch+json";

/// Whether the request publishes a batch: CloudEvents' batched content type, or a popgate JSON body that is an
/// array.
pub fn is_batch(headers: &HeaderMap, body: &Bytes) -> bool {
    let content_type = header_str(headers, "content-type").unwrap_or_default().to_ascii_lowercase();
    if content_type.starts_with(CLOUDEVENTS_BATCH_JSON) {
        return true;
    }
    let json = content_type.is_empty() || content_type.starts_with("application/json");
    json && !headers.contains_key("ce-specversion") && body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[')
}

/// Parses a batch publish ([`is_batch`]): a JSON array whose every element is what one publish's body would be
/// (popgate JSON, or a structured CloudEvent under CloudEvents' batched content type), at most `max_messages`.
/// A field at fault is named by its element: `[2].data`. What a batch cannot hold is refused: a transactional or
/// delayed message (the broker stores a batch at once, and delays none of it), another topic than the first
/// message's, or another message group than the first's (a batch goes to one queue).
///
/// # Errors
/// [`RequestError`] for an empty or malformed array, or the first element at fault.
pub fn parse_batch(
    headers: &HeaderMap,
    topic_param: Option<&str>,
    body: &Bytes,
    limits: &MessageLimits,
    max_messages: usize,
) -> Result<Vec<WithinLimits>, RequestError> {
    let cloudevents =
        header_str(headers, "content-type").is_some_and(|t| t.to_ascii_lowercase().starts_with(CLOUDEVENTS_BATCH_JSON));
    let elements = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Array(elements)) => elements,
        Ok(_) => return Err(RequestError::malformed_body("a batch body must be a JSON array")),
        Err(e) => return Err(RequestError::malformed_body(format!("the body is not valid JSON: {e}"))),
    };
    if elements.is_empty() {
        return Err(RequestError::malformed_body("the batch is empty: give at least one message"));
    }
    if elements.len() > max_messages {
        return Err(RequestError::invalid_field(
            &format!("[{max_messages}]"),
            format!("a batch holds at most {max_messages} messages (publish.max_batch_messages)"),
        ));
    }
    let mut batch: Vec<WithinLimits> = Vec::with_capacity(elements.len());
    for (index, element) in elements.iter().enumerate() {
        let in_element = |error: RequestError| match error {
            RequestError::InvalidField { field, message } => {
                RequestError::InvalidField { field: format!("[{index}].{field}"), message }
            }
            RequestError::MalformedBody(message) => RequestError::InvalidField { field: format!("[{index}]"), message },
        };
        let message = batch_element(element, cloudevents, topic_param, limits).map_err(in_element)?;
        if let Some(first) = batch.first() {
            fits_batch_of(message.message(), first.message()).map_err(in_element)?;
        }
        batch.push(message);
    }
    Ok(batch)
}

/// One element of a batch, as one publish's body, within the limits.
fn batch_element(
    element: &Value,
    cloudevent: bool,
    topic_param: Option<&str>,
    limits: &MessageLimits,
) -> Result<WithinLimits, RequestError> {
    let Value::Object(map) = element else {
        return Err(RequestError::malformed_body("each message of a batch is a JSON object"));
    };
    let message = if cloudevent {
        parse_cloudevent_structured(topic_param, map)?
    } else {
        if let Some(field) = ["transaction", "producerGroup"].into_iter().find(|f| map.contains_key(*f)) {
            return Err(RequestError::invalid_field(field, "a batch cannot hold a transactional message"));
        }
        parse_popgate_json(topic_param, map)?
    };
    if message.properties.contains_key(PROPERTY_TIMER_DELIVER_MS) {
        return Err(RequestError::invalid_field("delayMs", "a batch cannot hold a delayed message"));
    }
    limits.admit(message).map_err(|broken| RequestError::invalid_field(field_of(broken.part), broken.message))
}

/// A batch goes to one topic and one queue: a message must have the first's topic and message group.
fn fits_batch_of(message: &OutgoingMessage, first: &OutgoingMessage) -> Result<(), RequestError> {
    if message.topic != first.topic {
        return Err(RequestError::invalid_field("topic", format!("a batch goes to one topic, `{}`", first.topic)));
    }
    let group = |m: &OutgoingMessage| m.properties.get(PROPERTY_SHARDING_KEY).cloned();
    if group(message) != group(first) {
        return Err(RequestError::invalid_field(
            "messageGroup",
            "a batch goes to one queue: every message has the first's message group, or none has one",
        ));
    }
    Ok(())
}

/// `?transaction=`: `true` or `false`.
fn parse_flag(text: &str) -> Result<bool, RequestError> {
    text.parse().map_err(|_| RequestError::invalid_field("transaction", "must be true or false"))
}

/// The body's `transaction` (a boolean) and `producerGroup` (a string) fields.
fn transaction_fields(map: &Map<String, Value>) -> Result<(Option<bool>, Option<String>), RequestError> {
    let transaction = match map.get("transaction") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => return Err(RequestError::invalid_field("transaction", "must be true or false")),
    };
    Ok((transaction, optional_str(map, "producerGroup")?.map(str::to_owned)))
}

/// Whether the request starts a transaction, and with which checker. A half message cannot also be delayed
/// or ordered: the broker would deliver it at its commit anyway, and RocketMQ's SDKs refuse the mix.
fn transactional(
    wanted: Option<bool>,
    producer_group: Option<&str>,
    message: &OutgoingMessage,
) -> Result<Option<Transactional>, RequestError> {
    if wanted != Some(true) {
        return match producer_group {
            Some(_) => Err(RequestError::invalid_field("producerGroup", "only a transactional publish names one")),
            None => Ok(None),
        };
    }
    if let Some(group) = producer_group.filter(|g| !is_valid_name(g)) {
        return Err(RequestError::invalid_field(
            "producerGroup",
            format!("`{group}` is not a RocketMQ group name (letters, digits, `_`, `-`, `%`, `|`)"),
        ));
    }
    let conflict = [(PROPERTY_SHARDING_KEY, "messageGroup"), (PROPERTY_TIMER_DELIVER_MS, "delayMs")]
        .into_iter()
        .find(|(property, _)| message.properties.contains_key(*property));
    if let Some((_, field)) = conflict {
        return Err(RequestError::invalid_field(field, "a transactional message cannot also have this"));
    }
    Ok(Some(Transactional { producer_group: producer_group.map(str::to_owned) }))
}

/// The request field a broken limit is reported on.
fn field_of(part: Part) -> &'static str {
    match part {
        Part::Tag => "tags",
        Part::Key => "keys",
        Part::MessageGroup => "messageGroup",
        Part::Property | Part::PropertiesTooLarge => "properties",
        Part::DeliveryTime => "delayMs",
        Part::BodyEmpty => "data",
    }
}

/// Longest `Idempotency-Key` accepted.
const MAX_IDEMPOTENCY_KEY_LEN: usize = 256;

/// The key a repeat of this publish is known by in the de-duplication window: the `Idempotency-Key` header,
/// else a CloudEvent's source and id (which the CloudEvents spec makes unique per event), else none.
///
/// # Errors
/// [`RequestError::InvalidField`] naming `Idempotency-Key` when the header is empty, too long or not
/// visible ASCII.
pub fn dedup_key(headers: &HeaderMap, message: &OutgoingMessage) -> Result<Option<String>, RequestError> {
    if let Some(value) = headers.get("idempotency-key") {
        let key = value.to_str().ok().filter(|k| {
            (1..=MAX_IDEMPOTENCY_KEY_LEN).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
        });
        return key.map(|k| Some(format!("key:{k}"))).ok_or_else(|| {
            RequestError::invalid_field(
                "Idempotency-Key",
                format!("must be 1..={MAX_IDEMPOTENCY_KEY_LEN} visible ASCII characters"),
            )
        });
    }
    let cloudevent = message.properties.get("ce_source").zip(message.properties.get("ce_id"));
    Ok(cloudevent.map(|(source, id)| format!("ce:{source}\n{id}")))
}

fn parse_json_object(body: &Bytes) -> Result<Map<String, Value>, RequestError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(RequestError::malformed_body("the body must be a JSON object")),
        Err(e) => Err(RequestError::malformed_body(format!("the body is not valid JSON: {e}"))),
    }
}

fn parse_popgate_json(topic_param: Option<&str>, map: &Map<String, Value>) -> Result<OutgoingMessage, RequestError> {
    const KNOWN: [&str; 10] = [
        "topic",
        "data",
        "dataBase64",
        "tags",
        "keys",
        "properties",
        "messageGroup",
        "delayMs",
        "transaction",
        "producerGroup",
    ];
    if let Some(unknown) = map.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(RequestError::invalid_field(unknown, format!("unknown field `{unknown}`")));
    }
    let topic = topic(topic_param, optional_str(map, "topic")?)?;
    let (body, kind) = data(map, "data", "dataBase64")?;
    let mut message = OutgoingMessage::new(topic, body);
    set_content_type(&mut message, kind);
    message.tags = optional_str(map, "tags")?.map(|t| validated_tags(t.to_owned())).transpose()?;
    message.keys = keys(map.get("keys"))?;
    for (name, value) in string_map(map.get("properties"), "properties")? {
        add_user_property(&mut message, name, value)?;
    }
    if let Some(group) = optional_str(map, "messageGroup")? {
        if group.is_empty() {
            return Err(RequestError::invalid_field("messageGroup", "must not be empty"));
        }
        message.properties.insert(PROPERTY_SHARDING_KEY.to_owned(), group.to_owned());
    }
    if let Some(delay) = map.get("delayMs") {
        let delay = delay
            .as_u64()
            .ok_or_else(|| RequestError::invalid_field("delayMs", "must be a non-negative integer (milliseconds)"))?;
        set_delay(&mut message, Duration::from_millis(delay));
    }
    Ok(message)
}

fn parse_cloudevent_structured(
    topic_param: Option<&str>,
    map: &Map<String, Value>,
) -> Result<OutgoingMessage, RequestError> {
    let topic = topic(topic_param, None)?;
    let (body, kind) = data(map, "data", "data_base64")?;
    let mut message = OutgoingMessage::new(topic, body);
    set_content_type(&mut message, kind);
    for (name, value) in map {
        if name == "data" || name == "data_base64" {
            continue;
        }
        let text = match value {
            Value::String(s) => s.clone(),
            Value::Number(_) | Value::Bool(_) => value.to_string(),
            Value::Null => continue,
            _ => {
                return Err(RequestError::invalid_field(
                    name,
                    "a CloudEvents attribute must be a string, number or boolean",
                ))
            }
        };
        add_cloudevent_attribute(&mut message, name, text)?;
    }
    finish_cloudevent(message)
}

fn parse_cloudevent_binary(
    headers: &HeaderMap,
    topic_param: Option<&str>,
    body: &Bytes,
) -> Result<OutgoingMessage, RequestError> {
    let topic = topic(topic_param, None)?;
    let mut message = OutgoingMessage::new(topic, body.clone());
    for (name, value) in headers {
        let Some(attribute) = name.as_str().strip_prefix("ce-") else { continue };
        let text = value
            .to_str()
            .map_err(|_| RequestError::invalid_field(name.as_str(), "header value must be visible ASCII"))?;
        add_cloudevent_attribute(&mut message, attribute, text.to_owned())?;
    }
    if let Some(content_type) = header_str(headers, "content-type") {
        add_cloudevent_attribute(&mut message, "datacontenttype", content_type.to_owned())?;
        if let Some(kind) = DataKind::of_media_type(content_type) {
            set_content_type(&mut message, kind);
        }
    }
    finish_cloudevent(message)
}

/// Checks the required attributes and makes the event id the message key.
fn finish_cloudevent(mut message: OutgoingMessage) -> Result<OutgoingMessage, RequestError> {
    for attribute in CE_REQUIRED {
        let present = message.properties.get(&format!("ce_{attribute}")).is_some_and(|v| !v.is_empty());
        if !present {
            return Err(RequestError::invalid_field(
                attribute,
                format!("CloudEvents attribute `{attribute}` is required"),
            ));
        }
    }
    if message.properties.get("ce_specversion").map(String::as_str) != Some("1.0") {
        return Err(RequestError::invalid_field("specversion", "only CloudEvents 1.0 is supported"));
    }
    if let Some(id) = message.properties.get("ce_id").cloned() {
        message.keys.push(id);
    }
    Ok(message)
}

fn add_cloudevent_attribute(message: &mut OutgoingMessage, name: &str, value: String) -> Result<(), RequestError> {
    let valid_name = !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if !valid_name {
        return Err(RequestError::invalid_field(name, "CloudEvents attribute names are lower-case letters and digits"));
    }
    add_user_property(message, format!("ce_{name}"), value)
}

fn add_user_property(message: &mut OutgoingMessage, name: String, value: String) -> Result<(), RequestError> {
    let field = format!("properties.{name}");
    if name.is_empty() || is_reserved_property(&name) {
        return Err(RequestError::invalid_field(&field, "empty or reserved by RocketMQ"));
    }
    if name == PROPERTY_CONTENT_TYPE {
        return Err(RequestError::invalid_field(&field, "reserved by popgate: the shape of `data` sets it"));
    }
    if has_separator(&name) || has_separator(&value) {
        return Err(RequestError::invalid_field(&field, "must not contain the control characters \\u0001 or \\u0002"));
    }
    message.properties.insert(name, value);
    Ok(())
}

/// RocketMQ encodes properties as `name\u0001value\u0002`: those two characters would corrupt the message.
fn has_separator(text: &str) -> bool {
    text.contains(['\u{1}', '\u{2}'])
}

/// Sets the delivery time; how far ahead it may be is one of the [`MessageLimits`].
fn set_delay(message: &mut OutgoingMessage, delay: Duration) {
    if delay.is_zero() {
        return;
    }
    let deliver_at = Epoch::now().as_millis().saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
    message.properties.insert(PROPERTY_TIMER_DELIVER_MS.to_owned(), deliver_at.to_string());
}

fn topic(param: Option<&str>, field: Option<&str>) -> Result<String, RequestError> {
    let topic =
        param.or(field).ok_or_else(|| RequestError::invalid_field("topic", "required (body field or ?topic=)"))?;
    if !is_valid_name(topic) {
        return Err(RequestError::invalid_field(
            "topic",
            format!("must be 1..={MAX_NAME_LEN} characters of letters, digits, `_`, `-`, `%`, `|`"),
        ));
    }
    Ok(topic.to_owned())
}

/// The message body and what it holds: `data` (a string is sent as its UTF-8 bytes, any other JSON value as
/// JSON text) or `dataBase64` (binary). Exactly one of them.
fn data(map: &Map<String, Value>, text_field: &str, base64_field: &str) -> Result<(Bytes, DataKind), RequestError> {
    match (map.get(text_field), map.get(base64_field)) {
        (Some(_), Some(_)) => {
            Err(RequestError::invalid_field(base64_field, format!("give `{text_field}` or `{base64_field}`, not both")))
        }
        (Some(Value::String(s)), None) => Ok((Bytes::from(s.clone().into_bytes()), DataKind::Text)),
        (Some(Value::Null), None) | (None, None) => {
            Err(RequestError::invalid_field(text_field, format!("`{text_field}` or `{base64_field}` is required")))
        }
        (Some(other), None) => Ok((Bytes::from(other.to_string().into_bytes()), DataKind::Json)),
        (None, Some(Value::String(encoded))) => base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .map(|bytes| (Bytes::from(bytes), DataKind::Binary))
            .map_err(|e| RequestError::invalid_field(base64_field, format!("not valid base64: {e}"))),
        (None, Some(_)) => Err(RequestError::invalid_field(base64_field, "must be a base64 string")),
    }
}

/// Keeps what the body holds with the message, so every HTTP way out hands it back in the shape it came in
/// ([`crate::broker::content::http_data`]).
fn set_content_type(message: &mut OutgoingMessage, kind: DataKind) {
    message.properties.insert(PROPERTY_CONTENT_TYPE.to_owned(), kind.media_type().to_owned());
}

fn optional_str<'a>(map: &'a Map<String, Value>, field: &str) -> Result<Option<&'a str>, RequestError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(RequestError::invalid_field(field, "must be a string")),
    }
}

fn validated_tags(tags: String) -> Result<String, RequestError> {
    if tags.is_empty() || tags.contains("||") || has_separator(&tags) {
        return Err(RequestError::invalid_field("tags", "must be a non-empty tag without `||`"));
    }
    Ok(tags)
}

/// `keys` is one string or an array of strings; RocketMQ joins keys with a space, so a key holds none.
fn keys(value: Option<&Value>) -> Result<Vec<String>, RequestError> {
    let list = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| item.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| RequestError::invalid_field("keys", "must be a string or an array of strings"))?,
        Some(_) => return Err(RequestError::invalid_field("keys", "must be a string or an array of strings")),
    };
    if list.iter().any(|k| k.is_empty() || k.contains(' ') || has_separator(k)) {
        return Err(RequestError::invalid_field("keys", "a key must be non-empty and contain no spaces"));
    }
    Ok(list)
}

fn string_map(value: Option<&Value>, field: &str) -> Result<BTreeMap<String, String>, RequestError> {
    match value {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(RequestError::invalid_field(&format!("{field}.{k}"), "property values must be strings")),
            })
            .collect(),
        Some(_) => Err(RequestError::invalid_field(field, "must be an object of string values")),
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

#[cfg(test)]
mod tests;
