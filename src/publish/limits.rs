//! What a message may carry, checked the same way for every front before anything reaches the broker.
//!
//! The defaults are Apache's RocketMQ Proxy's (`ProxyConfig`), and so are the rules and the start of each
//! message, so an application that moves to popgate sees the same refusals (apps and tests match on them):
//!
//! | rule | default | Apache's setting |
//! |---|---|---|
//! | user properties | at most 128 | `userPropertyMaxNum` |
//! | their size: UTF-8 bytes of every key and value, the tag and each message key | at most 16 KiB | `maxUserPropertySize` |
//! | message group | under 64 UTF-8 bytes | `maxMessageGroupSize` (Apache refuses a group *of* 64 bytes too) |
//! | delivery time | at most 1 day ahead | `maxDelayTimeMills` |
//! | tag | not blank, no `\|`, no control character | |
//! | each key, each property name and value | not blank (keys), no control character | |

use std::collections::BTreeMap;
use std::time::Duration;

use crate::broker::content::PROPERTY_CONTENT_TYPE;
use crate::broker::message::{
    is_reserved_property, OutgoingMessage, PROPERTY_SHARDING_KEY, PROPERTY_TIMER_DELIVER_MS, PROPERTY_UNIQ_KEY,
};
use crate::clock::Epoch;
pub use crate::config::MessageLimits;

/// Which part of a message broke a limit: each front names it its own way (an HTTP field, a gRPC code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The tag.
    Tag,
    /// A message key.
    Key,
    /// The FIFO message group.
    MessageGroup,
    /// A user property's name or value.
    Property,
    /// The user properties' number or size.
    PropertiesTooLarge,
    /// The delivery time.
    DeliveryTime,
    /// The body: empty (a remoting client's; Apache's client refuses it before sending).
    BodyEmpty,
}

/// A limit the message broke, with Apache's message for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct LimitError {
    /// What broke it.
    pub part: Part,
    /// Apache's words for it.
    pub message: String,
}

fn refuse(part: Part, message: impl Into<String>) -> Result<(), LimitError> {
    Err(LimitError { part, message: message.into() })
}

/// Java's `Character.isISOControl`, which Apache's proxy applies (U+0000..=U+001F, U+007F..=U+009F).
fn has_control_character(text: &str) -> bool {
    text.chars().any(char::is_control)
}

/// A message's tag, as a remoting client sets it (`MessageConst.PROPERTY_TAGS`).
const PROPERTY_TAGS: &str = "TAGS";
/// A message's keys, as a remoting client sets them (`MessageConst.PROPERTY_KEYS`), separated by
/// [`KEY_SEPARATOR`].
const PROPERTY_KEYS: &str = "KEYS";
const KEY_SEPARATOR: char = ' ';
/// A delay in seconds or milliseconds from now, as a 5.x remoting client sets it (`PROPERTY_TIMER_DELAY_*`).
const PROPERTY_TIMER_DELAY_SEC: &str = "TIMER_DELAY_SEC";
const PROPERTY_TIMER_DELAY_MS: &str = "TIMER_DELAY_MS";

/// When a remoting client's message is to be delivered (epoch ms), if it says: its `TIMER_DELIVER_MS`, or now plus
/// its `TIMER_DELAY_SEC` / `TIMER_DELAY_MS`. A value that is not a number is as far ahead as can be.
fn client_delivery_time(message: &OutgoingMessage) -> Option<i64> {
    let number = |name: &str| message.properties.get(name).map(|v| v.trim().parse::<i64>().unwrap_or(i64::MAX));
    if let Some(at) = number(PROPERTY_TIMER_DELIVER_MS) {
        return Some(at);
    }
    let delay_ms = number(PROPERTY_TIMER_DELAY_SEC)
        .map(|secs| secs.saturating_mul(1000))
        .or_else(|| number(PROPERTY_TIMER_DELAY_MS))?;
    Some(Epoch::now().as_millis().saturating_add(delay_ms))
}

/// Properties a front sets itself: not the user's, so not counted against the user's limits. (An app on
/// another front may set [`PROPERTY_CONTENT_TYPE`] too; its value is still checked for control characters.)
fn is_set_by_popgate(name: &str) -> bool {
    matches!(name, PROPERTY_SHARDING_KEY | PROPERTY_TIMER_DELIVER_MS | PROPERTY_UNIQ_KEY | PROPERTY_CONTENT_TYPE)
}

/// A message whose limits were checked ([`MessageLimits::admit`] and its kin): the only kind the gateway
/// publishes, so no front can send a message past them (the remoting front once did). What popgate sets itself
/// after the check (a half message's marks, the SDK's message id) goes through [`WithinLimits::amend`]: the
/// limits are the app's, and refuse those names from it.
#[derive(Debug, Clone, PartialEq)]
pub struct WithinLimits(OutgoingMessage);

impl WithinLimits {
    /// The message.
    pub fn message(&self) -> &OutgoingMessage {
        &self.0
    }

    /// One message made of several, each within the limits, by `join` (a batch: publishing judges its size
    /// as a whole); `None` when `join` makes none.
    pub fn joined(
        parts: Vec<WithinLimits>,
        join: impl FnOnce(Vec<OutgoingMessage>) -> Option<OutgoingMessage>,
    ) -> Option<WithinLimits> {
        join(parts.into_iter().map(|part| part.0).collect()).map(WithinLimits)
    }

    /// Sets what popgate itself adds to the message, which the limits are not for.
    pub fn amend(&mut self, set_by_popgate: impl FnOnce(&mut OutgoingMessage)) {
        set_by_popgate(&mut self.0);
    }
}

impl MessageLimits {
    /// `message`, made by popgate from an app's request (HTTP), once [`MessageLimits::check`] passed it.
    ///
    /// # Errors
    /// The first [`LimitError`] found.
    pub fn admit(&self, message: OutgoingMessage) -> Result<WithinLimits, LimitError> {
        self.check(&message)?;
        Ok(WithinLimits(message))
    }

    /// `message`, made from an SDK's message whose user properties are `user` (gRPC), once
    /// [`MessageLimits::check_with_user_properties`] passed it.
    ///
    /// # Errors
    /// The first [`LimitError`] found.
    pub fn admit_sdk_message(
        &self,
        message: OutgoingMessage,
        user: &BTreeMap<String, String>,
    ) -> Result<WithinLimits, LimitError> {
        self.check_with_user_properties(&message, user)?;
        Ok(WithinLimits(message))
    }

    /// `message`, as a RocketMQ remoting client made it, once [`MessageLimits::check_client_made`] passed it,
    /// and its body is not empty, as Apache's client checks it before sending (`Validators.checkMessage`; the
    /// body's size is publishing's to judge, for every front). A batch (its `wire` says) has each message inside
    /// it checked as a message of its own, properties and body.
    ///
    /// # Errors
    /// The first [`LimitError`] found.
    pub fn admit_client_made(&self, message: OutgoingMessage) -> Result<WithinLimits, LimitError> {
        check_body(&message.body)?;
        if message.wire.as_ref().is_some_and(|wire| wire.batch) {
            self.check_batch(&message)?;
        } else {
            self.check_client_made(&message)?;
        }
        Ok(WithinLimits(message))
    }

    /// Each message inside batch `message`'s body, as [`MessageLimits::check_client_made`] checks one message;
    /// a body that is not a batch's encoding is refused.
    fn check_batch(&self, message: &OutgoingMessage) -> Result<(), LimitError> {
        let inner = decode_batch(&message.body)
            .ok_or_else(|| LimitError { part: Part::BodyEmpty, message: "the batch body does not decode".into() })?;
        if inner.is_empty() {
            return refuse(Part::BodyEmpty, "the message body length is zero");
        }
        for (body, properties) in inner {
            check_body(&body)?;
            if let Some(name) = properties.keys().find(|name| name.starts_with(POPGATE_PROPERTY_PREFIX)) {
                return refuse(Part::Property, format!("the message property {name} is reserved by popgate"));
            }
            let mut one = OutgoingMessage::new(message.topic.clone(), body);
            one.properties = properties;
            self.check_client_made(&one)?;
        }
        Ok(())
    }
}

/// The start of the names of the properties popgate sets itself on a client's message (a half message's
/// producer group): a client may not set them.
pub const POPGATE_PROPERTY_PREFIX: &str = "__POPGATE";

/// A remoting client's body as Apache's client checks it before sending, in its words.
fn check_body(body: &[u8]) -> Result<(), LimitError> {
    if body.is_empty() {
        return refuse(Part::BodyEmpty, "the message body length is zero");
    }
    Ok(())
}

/// The messages of a batch's body (`MessageDecoder.encodeMessages`: per message its total size, magic code,
/// body CRC, flag, body length and body, properties length and properties), each as its body and properties;
/// `None` when the body is not such an encoding (a size that overruns it, properties that are not text).
fn decode_batch(mut body: &[u8]) -> Option<Vec<(bytes::Bytes, BTreeMap<String, String>)>> {
    fn take<'a>(rest: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (taken, left) = (rest.get(..n)?, rest.get(n..)?);
        *rest = left;
        Some(taken)
    }
    fn int(rest: &mut &[u8]) -> Option<usize> {
        usize::try_from(i32::from_be_bytes(take(rest, 4)?.try_into().ok()?)).ok()
    }
    let mut messages = Vec::new();
    while !body.is_empty() {
        let total = int(&mut body)?;
        let mut message = take(&mut body, total.checked_sub(4)?)?;
        let _magic_crc_flag = take(&mut message, 12)?;
        let body_len = int(&mut message)?;
        let inner_body = bytes::Bytes::copy_from_slice(take(&mut message, body_len)?);
        let properties_len = usize::try_from(i16::from_be_bytes(take(&mut message, 2)?.try_into().ok()?)).ok()?;
        let properties = std::str::from_utf8(take(&mut message, properties_len)?).ok()?;
        let properties = properties
            .split('\u{2}')
            .filter_map(|pair| pair.split_once('\u{1}'))
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect();
        messages.push((inner_body, properties));
    }
    Some(messages)
}

impl MessageLimits {
    /// Checks `message` in the order Apache's proxy does: properties, tag, keys, total size, delivery time,
    /// message group.
    ///
    /// # Errors
    /// The first [`LimitError`] found.
    fn check(&self, message: &OutgoingMessage) -> Result<(), LimitError> {
        let user: Vec<(&String, &String)> = message.properties.iter().filter(|(k, _)| !is_set_by_popgate(k)).collect();
        self.check_with(message, &user)
    }

    /// [`MessageLimits::check`] for a message whose user properties came apart from the ones popgate sets (an
    /// SDK's, over gRPC): `user` are the app's own, so one named like a property popgate sets itself
    /// (`UNIQ_KEY`, `TIMER_DELIVER_MS`) is refused as every name RocketMQ reserves is, as by Apache's proxy,
    /// where [`MessageLimits::check`] cannot tell it from popgate's.
    ///
    /// # Errors
    /// The first [`LimitError`] found.
    fn check_with_user_properties(
        &self,
        message: &OutgoingMessage,
        user: &BTreeMap<String, String>,
    ) -> Result<(), LimitError> {
        self.check_with(message, &user.iter().collect::<Vec<_>>())
    }

    fn check_with(&self, message: &OutgoingMessage, user: &[(&String, &String)]) -> Result<(), LimitError> {
        if user.len() > self.max_user_properties {
            return refuse(
                Part::PropertiesTooLarge,
                format!("too many user properties, max is {}", self.max_user_properties),
            );
        }
        for (name, value) in user {
            if is_reserved_property(name) {
                return refuse(Part::Property, format!("property is used by system: {name}"));
            }
            if has_control_character(name) {
                return refuse(Part::Property, "the key of property cannot contain control character");
            }
            if has_control_character(value) {
                return refuse(Part::Property, "the value of property cannot contain control character");
            }
        }
        if message.properties.get(PROPERTY_CONTENT_TYPE).is_some_and(|value| has_control_character(value)) {
            return refuse(Part::Property, "the value of property cannot contain control character");
        }
        if let Some(tag) = message.tags.as_deref() {
            Self::check_tag(tag)?;
        }
        for key in &message.keys {
            if !key.is_empty() && key.trim().is_empty() {
                return refuse(Part::Key, "key cannot be the char sequence of whitespace");
            }
            if has_control_character(key) {
                return refuse(Part::Key, "key cannot contain control character");
            }
        }
        let size = user.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
            + message.tags.as_deref().map_or(0, str::len)
            + message.keys.iter().map(String::len).sum::<usize>();
        if size > self.max_user_property_bytes {
            return refuse(
                Part::PropertiesTooLarge,
                format!("the total size of user property is too large, max is {}", self.max_user_property_bytes),
            );
        }
        if let Some(at) = message.properties.get(PROPERTY_TIMER_DELIVER_MS) {
            self.check_delivery_time(at.parse().unwrap_or(i64::MAX))?;
        }
        if let Some(group) = message.properties.get(PROPERTY_SHARDING_KEY) {
            self.check_message_group(group)?;
        }
        Ok(())
    }

    /// Checks a message a RocketMQ remoting client made (its `wire` is set), whose properties hold the system
    /// ones the client sets itself: the same rules as [`MessageLimits::check`], on its user properties (those
    /// RocketMQ does not reserve), its tag (`TAGS`), its keys (`KEYS`, space-separated) and its delivery time.
    ///
    /// # Errors
    /// The first [`LimitError`] found.
    fn check_client_made(&self, message: &OutgoingMessage) -> Result<(), LimitError> {
        let mut view = OutgoingMessage::new(message.topic.clone(), bytes::Bytes::new());
        view.tags = message.properties.get(PROPERTY_TAGS).cloned();
        view.keys = message
            .properties
            .get(PROPERTY_KEYS)
            .map(|keys| keys.split(KEY_SEPARATOR).map(str::to_owned).collect())
            .unwrap_or_default();
        view.properties = message
            .properties
            .iter()
            .filter(|(name, _)| !is_reserved_property(name) || is_set_by_popgate(name))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        if let Some(deliver_at) = client_delivery_time(message) {
            view.properties.insert(PROPERTY_TIMER_DELIVER_MS.to_owned(), deliver_at.to_string());
        }
        self.check(&view)
    }

    fn check_tag(tag: &str) -> Result<(), LimitError> {
        if !tag.is_empty() && tag.trim().is_empty() {
            return refuse(Part::Tag, "tag cannot be the char sequence of whitespace");
        }
        if tag.contains('|') {
            return refuse(Part::Tag, "tag cannot contain '|'");
        }
        if has_control_character(tag) {
            return refuse(Part::Tag, "tag cannot contain control character");
        }
        Ok(())
    }

    /// A delivery time (epoch ms) no further ahead than the limit; one already past is delivered at once.
    fn check_delivery_time(&self, deliver_at_ms: i64) -> Result<(), LimitError> {
        let ahead = deliver_at_ms.saturating_sub(Epoch::now().as_millis());
        if ahead > i64::try_from(self.max_delay_ms).unwrap_or(i64::MAX) {
            return refuse(
                Part::DeliveryTime,
                format!("the max delay time of message is too large, max is {}", self.max_delay_ms),
            );
        }
        Ok(())
    }

    fn check_message_group(&self, group: &str) -> Result<(), LimitError> {
        if group.trim().is_empty() {
            return refuse(Part::MessageGroup, "message group cannot be the char sequence of whitespace");
        }
        // `>=` as in Apache's proxy: a group of exactly the limit is refused too.
        if group.len() >= self.max_message_group_bytes {
            return refuse(
                Part::MessageGroup,
                format!("message group exceed the max size {}", self.max_message_group_bytes),
            );
        }
        if has_control_character(group) {
            return refuse(Part::MessageGroup, "message group cannot contain control character");
        }
        Ok(())
    }

    /// [`Self::max_delay_ms`] as a duration.
    pub fn max_delay(&self) -> Duration {
        Duration::from_millis(self.max_delay_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message() -> OutgoingMessage {
        OutgoingMessage::new("t".into(), bytes::Bytes::from_static(b"x"))
    }

    fn refused(message: &OutgoingMessage) -> (Part, String) {
        let error = MessageLimits::default().check(message).expect_err("refused");
        (error.part, error.message)
    }

    #[test]
    fn a_plain_message_and_the_properties_popgate_sets_pass() {
        let mut m = message();
        m.tags = Some("TagA".into());
        m.keys = vec!["k1".into(), String::new()];
        m.properties.insert(PROPERTY_SHARDING_KEY.into(), "g".repeat(63));
        m.properties.insert(PROPERTY_UNIQ_KEY.into(), "id".into());
        m.properties.insert(PROPERTY_TIMER_DELIVER_MS.into(), (Epoch::now().as_millis() + 3_600_000).to_string());
        assert_eq!(MessageLimits::default().check(&m), Ok(()));
    }

    #[test]
    fn tags_keys_and_groups_are_refused_as_apaches_proxy_refuses_them() {
        for (tag, expected) in [
            (" ", "tag cannot be the char sequence of whitespace"),
            ("a|b", "tag cannot contain '|'"),
            ("a\u{7}b", "tag cannot contain control character"),
        ] {
            let mut m = message();
            m.tags = Some(tag.into());
            assert_eq!(refused(&m), (Part::Tag, expected.to_owned()), "{tag:?}");
        }
        let mut m = message();
        m.keys = vec!["ok".into(), "bad\u{0}".into()];
        assert_eq!(refused(&m), (Part::Key, "key cannot contain control character".to_owned()));
        let mut m = message();
        m.properties.insert(PROPERTY_SHARDING_KEY.into(), "g".repeat(64));
        assert_eq!(refused(&m), (Part::MessageGroup, "message group exceed the max size 64".to_owned()));
    }

    #[test]
    fn the_content_type_popgate_sets_is_no_user_property_but_is_checked_for_control_characters() {
        let mut m = message();
        for i in 0..128 {
            m.properties.insert(format!("p{i}"), "v".into());
        }
        m.properties.insert(PROPERTY_CONTENT_TYPE.into(), "application/json".into());
        assert_eq!(MessageLimits::default().check(&m), Ok(()), "128 user properties and popgate's own");
        let mut m = message();
        m.properties.insert(PROPERTY_CONTENT_TYPE.into(), "text/plain\u{1}x".into());
        assert_eq!(refused(&m), (Part::Property, "the value of property cannot contain control character".to_owned()));
    }

    #[test]
    fn user_properties_are_limited_in_number_and_in_size() {
        let mut m = message();
        for i in 0..129 {
            m.properties.insert(format!("p{i}"), "v".into());
        }
        assert_eq!(refused(&m), (Part::PropertiesTooLarge, "too many user properties, max is 128".to_owned()));
        let mut m = message();
        m.properties.insert("big".into(), "v".repeat(16 * 1024));
        let (part, text) = refused(&m);
        assert_eq!(part, Part::PropertiesTooLarge);
        assert!(text.starts_with("the total size of user property is too large"), "{text}");
        let mut m = message();
        m.properties.insert("KEYS".into(), "v".into());
        assert_eq!(refused(&m), (Part::Property, "property is used by system: KEYS".to_owned()));
    }

    #[test]
    fn an_apps_property_named_like_one_popgate_sets_is_refused_when_its_properties_are_told_apart() {
        let mut m = message();
        m.properties.insert(PROPERTY_UNIQ_KEY.into(), "popgate's id".into());
        let limits = MessageLimits::default();
        assert_eq!(limits.check(&m), Ok(()), "popgate's own is not counted as the app's");
        for name in [PROPERTY_UNIQ_KEY, PROPERTY_TIMER_DELIVER_MS] {
            let user = BTreeMap::from([(name.to_owned(), "mine".to_owned())]);
            let error = limits.check_with_user_properties(&m, &user).expect_err("refused");
            assert_eq!((error.part, error.message), (Part::Property, format!("property is used by system: {name}")));
        }
        let user = BTreeMap::from([("color".to_owned(), "red".to_owned())]);
        assert_eq!(limits.check_with_user_properties(&m, &user), Ok(()));
    }

    #[test]
    fn a_remoting_clients_message_is_checked_on_its_own_properties_tag_keys_and_delay() {
        let client_made = |properties: &[(&str, &str)]| {
            let mut m = message();
            m.properties = properties.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
            m
        };
        let limits = MessageLimits::default();
        let plain =
            client_made(&[("TAGS", "TagA"), ("KEYS", "k1 k2"), ("UNIQ_KEY", "id"), ("WAIT", "true"), ("p", "v")]);
        assert_eq!(limits.check_client_made(&plain), Ok(()), "the client's own system properties pass");
        let refused = |m: &OutgoingMessage| limits.check_client_made(m).expect_err("refused");
        assert_eq!(refused(&client_made(&[("TAGS", "a|b")])).part, Part::Tag);
        assert_eq!(refused(&client_made(&[("KEYS", "ok bad\u{1}")])).part, Part::Key);
        let many: Vec<(String, String)> = (0..129).map(|i| (format!("p{i}"), "v".to_owned())).collect();
        let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(refused(&client_made(&many)).part, Part::PropertiesTooLarge);
        assert_eq!(refused(&client_made(&[("TIMER_DELAY_SEC", "90000")])).part, Part::DeliveryTime);
        assert_eq!(refused(&client_made(&[("TIMER_DELAY_MS", "soon")])).part, Part::DeliveryTime);
        assert_eq!(limits.check_client_made(&client_made(&[("TIMER_DELAY_SEC", "60")])), Ok(()));
    }

    #[test]
    fn a_delivery_time_past_one_day_is_refused() {
        let mut m = message();
        m.properties.insert(PROPERTY_TIMER_DELIVER_MS.into(), (Epoch::now().as_millis() + 25 * 3_600_000).to_string());
        assert_eq!(
            refused(&m),
            (Part::DeliveryTime, "the max delay time of message is too large, max is 86400000".to_owned())
        );
    }
}
