//! What a message's body holds, and how the HTTP front hands it back: the one rule for an event's `data`.
//!
//! An HTTP publish says what its data is by its shape (`data` a JSON value, `data` a string, `dataBase64`),
//! and a broker keeps only bytes. So the publish path writes the kind into a popgate-owned message property,
//! [`PROPERTY_CONTENT_TYPE`], and every HTTP way out (poll, SSE, WebSocket, webhook, DLQ browse, a transaction
//! check-back) reads it back through [`http_data`]:
//!
//! ```text
//! POPGATE_CONTENT_TYPE       body                      HTTP event              webhook content-type
//! application/json (+json)   parses as JSON            "data": <the value>     application/json
//! text/*                     UTF-8                     "data": "<text>"        text/plain; charset=utf-8
//! application/octet-stream   anything                  "dataBase64": "..."     application/octet-stream
//! absent, or another type    UTF-8                     "data": "<text>"        application/octet-stream
//!                            not UTF-8                 "dataBase64": "..."     application/octet-stream
//! ```
//!
//! A declared kind the body does not match falls back, never fails: JSON that does not parse (a remoting app
//! set the property by hand) is shown as text (or base64 when it is not UTF-8 either), text that is not UTF-8
//! as base64. Messages from the gRPC and remoting fronts carry no such property unless their app set one,
//! and keep the rule that held before the property existed (the last two rows).

use std::collections::BTreeMap;

use base64::Engine;
use serde_json::{Map, Value};

/// The message property that says what the body holds: one of [`DataKind::media_type`]'s values when popgate
/// set it. popgate owns it (an HTTP publish may not set it in `properties`); an app on another front may set
/// it by hand, which is why its value is checked against the body.
pub const PROPERTY_CONTENT_TYPE: &str = "POPGATE_CONTENT_TYPE";

/// What a body holds, as far as the HTTP front cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataKind {
    /// JSON text: handed back as the JSON value itself.
    Json,
    /// UTF-8 text: handed back as a string.
    Text,
    /// Bytes: handed back in base64, whatever they hold.
    Binary,
}

impl DataKind {
    /// The property value popgate writes for this kind (and the webhook's `content-type` for it).
    pub fn media_type(self) -> &'static str {
        match self {
            DataKind::Json => "application/json",
            DataKind::Text => "text/plain; charset=utf-8",
            DataKind::Binary => "application/octet-stream",
        }
    }

    /// The kind a media type names (parameters and case ignored): JSON for `application/json`, `text/json`
    /// and any `+json` type, text for `text/*`, binary for `application/octet-stream`; `None` for any other
    /// type, whose body is shown by the rule for undeclared bodies.
    pub fn of_media_type(media_type: &str) -> Option<DataKind> {
        let essence = media_type.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
        let (kind, subtype) = essence.split_once('/')?;
        match (kind, subtype) {
            ("application" | "text", "json") => Some(DataKind::Json),
            (_, subtype) if subtype.ends_with("+json") => Some(DataKind::Json),
            ("text", _) => Some(DataKind::Text),
            ("application", "octet-stream") => Some(DataKind::Binary),
            _ => None,
        }
    }
}

/// An event's data as the HTTP front hands it back.
#[derive(Debug, Clone, PartialEq)]
pub enum Data<'a> {
    /// `"data": <value>`.
    Json(Value),
    /// `"data": "<text>"`.
    Text(&'a str),
    /// `"dataBase64": "<base64>"`.
    Binary(&'a [u8]),
}

/// [`Data`], and whether the message said what its body holds.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpData<'a> {
    /// What is handed back.
    pub data: Data<'a>,
    /// The message carried a [`PROPERTY_CONTENT_TYPE`] popgate understands.
    pub declared: bool,
}

/// The one rule for how the HTTP front hands back a message's body (see the module doc's table).
pub fn http_data<'a>(properties: &BTreeMap<String, String>, body: &'a [u8]) -> HttpData<'a> {
    let declared = properties.get(PROPERTY_CONTENT_TYPE).and_then(|value| DataKind::of_media_type(value));
    let text = || std::str::from_utf8(body).ok();
    let data = match declared {
        Some(DataKind::Binary) => Data::Binary(body),
        Some(DataKind::Json) => match serde_json::from_slice(body) {
            Ok(value) => Data::Json(value),
            Err(_) => text().map_or(Data::Binary(body), Data::Text),
        },
        Some(DataKind::Text) | None => text().map_or(Data::Binary(body), Data::Text),
    };
    HttpData { data, declared: declared.is_some() }
}

impl HttpData<'_> {
    /// The `content-type` for the body sent as is (a webhook request): the kind shown, when the message
    /// declared one, else `application/octet-stream` as before the property existed.
    pub fn media_type(&self) -> &'static str {
        let kind = match (&self.data, self.declared) {
            (_, false) | (Data::Binary(_), true) => DataKind::Binary,
            (Data::Json(_), true) => DataKind::Json,
            (Data::Text(_), true) => DataKind::Text,
        };
        kind.media_type()
    }

    /// The event's `data` and `dataBase64` fields: exactly one of them is `Some`.
    pub fn into_fields(self) -> (Option<Value>, Option<String>) {
        match self.data {
            Data::Json(value) => (Some(value), None),
            Data::Text(text) => (Some(Value::String(text.to_owned())), None),
            Data::Binary(bytes) => (None, Some(base64::engine::general_purpose::STANDARD.encode(bytes))),
        }
    }

    /// Sets `data` or `dataBase64` in an HTTP event object.
    pub fn insert_into(self, event: &mut Map<String, Value>) {
        match self.into_fields() {
            (Some(data), _) => event.insert("data".to_owned(), data),
            (None, data_base64) => event.insert("dataBase64".to_owned(), Value::from(data_base64)),
        };
    }
}

/// The properties an HTTP event shows as its own: all but [`PROPERTY_CONTENT_TYPE`], which its data's shape
/// already says.
pub fn user_properties(properties: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    properties.iter().filter(|(name, _)| *name != PROPERTY_CONTENT_TYPE).map(|(k, v)| (k.clone(), v.clone())).collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn declared(content_type: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(PROPERTY_CONTENT_TYPE.to_owned(), content_type.to_owned())])
    }

    fn shown(properties: &BTreeMap<String, String>, body: &[u8]) -> (Value, &'static str) {
        let data = http_data(properties, body);
        let media_type = data.media_type();
        let mut event = Map::new();
        data.insert_into(&mut event);
        (Value::Object(event), media_type)
    }

    #[test]
    fn json_is_handed_back_as_the_json_value() {
        let json = declared("application/json");
        assert_eq!(
            shown(&json, br#"{"id":1,"tags":["a"]}"#),
            (json!({"data": {"id": 1, "tags": ["a"]}}), "application/json")
        );
        assert_eq!(shown(&json, b"42"), (json!({"data": 42}), "application/json"));
        assert_eq!(shown(&json, br#""quoted""#), (json!({"data": "quoted"}), "application/json"));
        assert_eq!(shown(&json, b"null"), (json!({"data": null}), "application/json"));
    }

    #[test]
    fn a_json_type_whose_body_does_not_parse_falls_back_to_text_or_base64() {
        let json = declared("application/json");
        assert_eq!(shown(&json, b"{not json"), (json!({"data": "{not json"}), "text/plain; charset=utf-8"));
        assert_eq!(shown(&json, b""), (json!({"data": ""}), "text/plain; charset=utf-8"));
        assert_eq!(shown(&json, &[0xff, 0x00]), (json!({"dataBase64": "/wA="}), "application/octet-stream"));
    }

    #[test]
    fn text_stays_text_and_bytes_stay_base64_even_when_they_are_utf8() {
        let text = declared("text/plain; charset=utf-8");
        assert_eq!(shown(&text, br#"{"id":1}"#), (json!({"data": "{\"id\":1}"}), "text/plain; charset=utf-8"));
        assert_eq!(shown(&text, &[0xff]), (json!({"dataBase64": "/w=="}), "application/octet-stream"));
        let binary = declared("application/octet-stream");
        assert_eq!(shown(&binary, b"hello"), (json!({"dataBase64": "aGVsbG8="}), "application/octet-stream"));
        assert_eq!(shown(&binary, b"{}"), (json!({"dataBase64": "e30="}), "application/octet-stream"));
    }

    #[test]
    fn a_message_without_the_property_keeps_the_rule_from_before() {
        let none = BTreeMap::new();
        assert_eq!(shown(&none, br#"{"id":1}"#), (json!({"data": "{\"id\":1}"}), "application/octet-stream"));
        assert_eq!(shown(&none, b"text"), (json!({"data": "text"}), "application/octet-stream"));
        assert_eq!(shown(&none, &[0xff, 0x00]), (json!({"dataBase64": "/wA="}), "application/octet-stream"));
        let unknown = declared("image/png");
        assert_eq!(shown(&unknown, b"text"), (json!({"data": "text"}), "application/octet-stream"));
        assert!(!http_data(&unknown, b"text").declared);
    }

    #[test]
    fn media_types_name_their_kind_whatever_their_case_and_parameters() {
        for (media_type, kind) in [
            ("application/json", Some(DataKind::Json)),
            ("Application/JSON; charset=utf-8", Some(DataKind::Json)),
            ("text/json", Some(DataKind::Json)),
            ("application/cloudevents+json", Some(DataKind::Json)),
            ("text/plain", Some(DataKind::Text)),
            ("text/xml", Some(DataKind::Text)),
            ("application/octet-stream", Some(DataKind::Binary)),
            ("application/xml", None),
            ("json", None),
            ("", None),
        ] {
            assert_eq!(DataKind::of_media_type(media_type), kind, "{media_type:?}");
        }
        for kind in [DataKind::Json, DataKind::Text, DataKind::Binary] {
            assert_eq!(DataKind::of_media_type(kind.media_type()), Some(kind), "what popgate writes, it reads back");
        }
    }

    #[test]
    fn the_property_is_no_user_property_of_an_http_event() {
        let mut properties = declared("application/json");
        properties.insert("color".to_owned(), "red".to_owned());
        assert_eq!(user_properties(&properties), BTreeMap::from([("color".to_owned(), "red".to_owned())]));
    }
}
