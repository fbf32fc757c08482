//! The CloudEvents headers of a webhook request, built from the event's `ce_*` properties.
//!
//! Properties are set by producers, and not only through popgate: any RocketMQ client may publish to the
//! topic. So a property becomes a header only if it is a valid CloudEvents attribute (lower-case letters
//! and digits, at most 20 characters, as the CloudEvents spec's naming convention says), and its value is
//! percent-encoded as the CloudEvents HTTP binding (3.1.3.2) says: space, `"`, `%`, and everything outside
//! printable ASCII (control characters, CR and LF included) become `%XX` of their UTF-8 bytes, so every value
//! is a valid header value and none can start a header of its own.
//!
//! Every extension header is named `ce-<name>`, so none can be `host`, `content-length`, `authorization`,
//! `content-type` or an `X-Popgate-*` header. The attributes popgate sets itself are not taken from
//! extensions: `id` and `specversion` (popgate's own), `source` and `type` (checked, then used as
//! `ce-source` and `ce-type`), `datacontenttype` (it is the `content-type` header in binary mode) and `data`
//! (reserved by the spec). A property that cannot be a header is skipped, never an error: the event is still
//! delivered, without it, and the skip is counted in `popgate_webhook_headers_dropped_total`.

use std::collections::BTreeMap;
use std::fmt::Write;

use reqwest::header::{HeaderName, HeaderValue};

/// The prefix of a CloudEvents attribute among an event's properties.
const PROPERTY_PREFIX: &str = "ce_";
/// The CloudEvents spec: attribute names "SHOULD NOT exceed 20 characters in length".
pub const MAX_NAME_CHARS: usize = 20;
/// Longest header value (after encoding): common receivers refuse header lines of 8 KiB and more.
pub const MAX_VALUE_BYTES: usize = 4 * 1024;
/// Most extension headers per request: common receivers refuse requests with about 100 headers.
pub const MAX_EXTENSIONS: usize = 32;
/// Most bytes of extension headers (names and values) per request, within receivers' header limits.
pub const MAX_EXTENSION_BYTES: usize = 16 * 1024;

/// Attributes that are not extensions: popgate sets `id` and `specversion` itself, and `source`, `type` and
/// `datacontenttype` have headers of their own (checked in [`cloudevent_headers`]).
const NOT_EXTENSIONS: [&str; 5] = ["id", "specversion", "source", "type", "datacontenttype"];
/// The spec: "CloudEvent attributes MUST NOT have the name `data`".
const RESERVED: &str = "data";

/// Why a property did not become a header (the `reason` label of the metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// Not a CloudEvents attribute name.
    Name,
    /// `data`: reserved by the spec.
    Reserved,
    /// The value cannot be a header value, or is too long.
    Value,
    /// More extensions than a request carries.
    Limit,
}

impl Skip {
    /// The `reason` label value.
    pub fn label(self) -> &'static str {
        match self {
            Skip::Name => "name",
            Skip::Reserved => "reserved",
            Skip::Value => "value",
            Skip::Limit => "limit",
        }
    }

    /// Every label value, for the metric's zero series.
    pub const LABELS: [&'static str; 4] = ["name", "reserved", "value", "limit"];
}

/// One header to send.
pub type Header = (HeaderName, HeaderValue);
/// A property that was not sent (its name as the producer wrote it), and why.
pub type Skipped = (String, Skip);

/// The CloudEvents headers of one request.
#[derive(Debug)]
pub struct CloudEventHeaders {
    /// `ce-source`: the producer's, or `/popgate/<topic>`.
    pub source: HeaderValue,
    /// `ce-type`: the producer's, or `popgate.event`.
    pub event_type: HeaderValue,
    /// `content-type`: the producer's `datacontenttype`, or else what the body holds (`data_type`).
    pub content_type: HeaderValue,
    /// `ce-<name>` for each extension attribute, by name.
    pub extensions: Vec<Header>,
    /// The properties that were skipped (their names as sent, which may be anything) and why.
    pub skipped: Vec<Skipped>,
}

/// Maps an event's properties to its CloudEvents headers. `data_type` is the `content-type` when the producer
/// gave no `datacontenttype` (or no media type): what the body holds, by
/// [`crate::gateway::below::content::HttpData::media_type`].
pub fn cloudevent_headers(
    properties: &BTreeMap<String, String>,
    topic: &str,
    data_type: &'static str,
) -> CloudEventHeaders {
    let mut skipped = Vec::new();
    let mut attribute = |name: &str, encode: fn(&str) -> Option<HeaderValue>| {
        let key = format!("{PROPERTY_PREFIX}{name}");
        let value = properties.get(&key)?;
        let header = encode(value);
        if header.is_none() {
            skipped.push((key, Skip::Value));
        }
        header
    };
    let source = attribute("source", percent_encoded)
        .or_else(|| percent_encoded(&format!("/popgate/{topic}")))
        .unwrap_or_else(|| HeaderValue::from_static("/popgate"));
    let event_type = attribute("type", percent_encoded).unwrap_or_else(|| HeaderValue::from_static("popgate.event"));
    let content_type = attribute("datacontenttype", media_type).unwrap_or_else(|| HeaderValue::from_static(data_type));
    let (extensions, extension_skips) = extensions(properties);
    skipped.extend(extension_skips);
    CloudEventHeaders { source, event_type, content_type, extensions, skipped }
}

/// The extension attributes among `properties`, in name order (so the limits always keep the same ones).
fn extensions(properties: &BTreeMap<String, String>) -> (Vec<Header>, Vec<Skipped>) {
    let candidates = properties
        .iter()
        .filter_map(|(key, value)| Some((key.strip_prefix(PROPERTY_PREFIX)?, value.as_str())))
        .filter(|(name, _)| !NOT_EXTENSIONS.contains(name));
    let (mut headers, mut skipped, mut bytes) = (Vec::new(), Vec::new(), 0);
    for (name, value) in candidates {
        let header = extension_header(name, value).and_then(|(header, value)| {
            let size = header.as_str().len() + value.len();
            if headers.len() >= MAX_EXTENSIONS || bytes + size > MAX_EXTENSION_BYTES {
                return Err(Skip::Limit);
            }
            bytes += size;
            Ok((header, value))
        });
        match header {
            Ok(header) => headers.push(header),
            Err(skip) => skipped.push((format!("{PROPERTY_PREFIX}{name}"), skip)),
        }
    }
    (headers, skipped)
}

/// `ce-<name>: <percent-encoded value>` for one extension attribute.
fn extension_header(name: &str, value: &str) -> Result<Header, Skip> {
    if !is_attribute_name(name) {
        return Err(Skip::Name);
    }
    if name == RESERVED {
        return Err(Skip::Reserved);
    }
    let header = HeaderName::try_from(format!("ce-{name}")).map_err(|_| Skip::Name)?;
    Ok((header, percent_encoded(value).ok_or(Skip::Value)?))
}

/// The CloudEvents naming convention: lower-case ASCII letters and digits, at most 20 of them.
pub fn is_attribute_name(name: &str) -> bool {
    (1..=MAX_NAME_CHARS).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// The CloudEvents HTTP binding's percent-encoding of a string value, `None` when it comes out too long.
pub fn percent_encoded(value: &str) -> Option<HeaderValue> {
    let mut encoded = String::with_capacity(value.len());
    for byte in value.bytes() {
        if matches!(byte, 0x21..=0x7e) && !matches!(byte, b'"' | b'%') {
            encoded.push(char::from(byte));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(encoded, "%{byte:02X}");
        }
        if encoded.len() > MAX_VALUE_BYTES {
            return None;
        }
    }
    HeaderValue::try_from(encoded).ok()
}

/// A `content-type` value: a media type is printable ASCII (RFC 2046), so anything else (control characters,
/// CR/LF, non-ASCII) means the producer's value is not one, and the default is used.
fn media_type(value: &str) -> Option<HeaderValue> {
    let printable = !value.trim().is_empty() && value.bytes().all(|b| matches!(b, 0x20..=0x7e));
    if !printable || value.len() > MAX_VALUE_BYTES {
        return None;
    }
    HeaderValue::try_from(value).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(properties: &[(&str, &str)]) -> CloudEventHeaders {
        let map = properties.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        cloudevent_headers(&map, "orders", "application/octet-stream")
    }

    fn extension<'a>(h: &'a CloudEventHeaders, name: &str) -> Option<&'a str> {
        h.extensions.iter().find(|(n, _)| n.as_str() == name).and_then(|(_, v)| v.to_str().ok())
    }

    fn skip_of(h: &CloudEventHeaders, property: &str) -> Option<Skip> {
        h.skipped.iter().find(|(p, _)| p == property).map(|(_, s)| *s)
    }

    #[test]
    fn a_plain_cloudevent_maps_to_the_binding_headers() {
        let h = headers(&[
            ("ce_id", "e-1"),
            ("ce_specversion", "1.0"),
            ("ce_source", "/shop"),
            ("ce_type", "order.created"),
            ("ce_datacontenttype", "application/json; charset=utf-8"),
            ("ce_subject", "o-9"),
            ("ce_tenant", "acme"),
            ("UNIQ_KEY", "not a cloudevents property"),
        ]);
        assert_eq!((h.source.to_str().ok(), h.event_type.to_str().ok()), (Some("/shop"), Some("order.created")));
        assert_eq!(h.content_type, "application/json; charset=utf-8");
        let mut names: Vec<&str> = h.extensions.iter().map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["ce-subject", "ce-tenant"], "id and specversion are popgate's own");
        assert!(h.skipped.is_empty(), "{:?}", h.skipped);
    }

    #[test]
    fn defaults_stand_in_for_a_plain_event() {
        let h = headers(&[]);
        assert_eq!(h.source, "/popgate/orders");
        assert_eq!(h.event_type, "popgate.event");
        assert_eq!(h.content_type, "application/octet-stream");
        assert!(h.extensions.is_empty() && h.skipped.is_empty());
    }

    #[test]
    fn hostile_names_never_become_headers() {
        let long = format!("ce_{}", "a".repeat(MAX_NAME_CHARS + 1));
        let exactly = format!("ce_{}", "a".repeat(MAX_NAME_CHARS));
        let hostile = [
            "ce_",
            "ce_Tenant",
            "ce_content-length",
            "ce_x-popgate-signature",
            "ce_x\r\nInjected",
            "ce_a b",
            "ce_a:b",
            "ce_ümlaut",
            "ce_trace_parent",
            long.as_str(),
        ];
        let mut properties: Vec<(&str, &str)> = hostile.iter().map(|name| (*name, "v")).collect();
        properties.push((exactly.as_str(), "v"));
        let h = headers(&properties);
        for name in hostile {
            assert_eq!(skip_of(&h, name), Some(Skip::Name), "{name:?}");
        }
        assert_eq!(h.extensions.len(), 1, "only the 20-character name passes: {:?}", h.extensions);
        for (name, _) in &h.extensions {
            assert!(name.as_str().starts_with("ce-"), "{name}");
        }
    }

    #[test]
    fn attributes_popgate_sets_cannot_be_overridden_as_extensions() {
        let h = headers(&[("ce_id", "forged"), ("ce_specversion", "0.3"), ("ce_data", "x"), ("ce_host", "evil")]);
        assert!(extension(&h, "ce-id").is_none() && extension(&h, "ce-specversion").is_none());
        assert_eq!(skip_of(&h, "ce_data"), Some(Skip::Reserved));
        assert_eq!(extension(&h, "ce-host"), Some("evil"), "a ce- header, never `host`");
        assert!(h.extensions.iter().all(|(n, _)| !matches!(n.as_str(), "host" | "content-type" | "authorization")));
    }

    #[test]
    fn values_are_percent_encoded_as_the_http_binding_says() {
        let h = headers(&[
            ("ce_euro", "Euro € 😀"),
            ("ce_crlf", "a\r\nX-Popgate-Signature: forged"),
            ("ce_ctl", "\u{0}\u{7}\u{7f}\u{9f}"),
            ("ce_quote", "say \"100%\""),
            ("ce_source", "/shop\r\nHost: evil"),
            ("ce_type", "t\u{1}"),
        ]);
        // The binding's own example.
        assert_eq!(extension(&h, "ce-euro"), Some("Euro%20%E2%82%AC%20%F0%9F%98%80"));
        assert_eq!(extension(&h, "ce-crlf"), Some("a%0D%0AX-Popgate-Signature:%20forged"));
        assert_eq!(extension(&h, "ce-ctl"), Some("%00%07%7F%C2%9F"));
        assert_eq!(extension(&h, "ce-quote"), Some("say%20%22100%25%22"));
        assert_eq!(h.source, "/shop%0D%0AHost:%20evil");
        assert_eq!(h.event_type, "t%01");
        assert!(h.skipped.is_empty(), "encoded, not skipped: {:?}", h.skipped);
    }

    #[test]
    fn without_a_datacontenttype_the_content_type_is_what_the_body_holds() {
        let none = BTreeMap::new();
        assert_eq!(cloudevent_headers(&none, "t", "application/json").content_type, "application/json");
        let producers = BTreeMap::from([("ce_datacontenttype".to_owned(), "application/xml".to_owned())]);
        assert_eq!(cloudevent_headers(&producers, "t", "application/json").content_type, "application/xml");
    }

    #[test]
    fn a_content_type_that_is_no_media_type_falls_back_to_the_default() {
        for bad in ["text/plain\r\nX-Evil: 1", "", "  ", "text/plän", "a\u{0}b"] {
            let h = headers(&[("ce_datacontenttype", bad)]);
            assert_eq!(h.content_type, "application/octet-stream", "{bad:?}");
            assert_eq!(skip_of(&h, "ce_datacontenttype"), Some(Skip::Value), "{bad:?}");
        }
    }

    #[test]
    fn oversized_values_and_too_many_extensions_are_skipped_not_sent() {
        let huge = "x".repeat(MAX_VALUE_BYTES + 1);
        // Encoding triples a byte: this one fits before encoding and not after.
        let grows = "\n".repeat(MAX_VALUE_BYTES / 2);
        let h = headers(&[("ce_huge", &huge), ("ce_grows", &grows), ("ce_source", &huge)]);
        assert_eq!(skip_of(&h, "ce_huge"), Some(Skip::Value));
        assert_eq!(skip_of(&h, "ce_grows"), Some(Skip::Value));
        assert_eq!(skip_of(&h, "ce_source"), Some(Skip::Value));
        assert_eq!(h.source, "/popgate/orders", "the default stands in");

        let names: Vec<String> = (0..MAX_EXTENSIONS + 5).map(|i| format!("ce_x{i:03}")).collect();
        let many: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "v")).collect();
        let h = headers(&many);
        assert_eq!(h.extensions.len(), MAX_EXTENSIONS);
        assert_eq!(h.skipped.iter().filter(|(_, s)| *s == Skip::Limit).count(), 5);
        assert_eq!(h.extensions[0].0.as_str(), "ce-x000", "the first names by order are kept");

        let big = "y".repeat(MAX_VALUE_BYTES - 16);
        let names: Vec<String> = (0..8).map(|i| format!("ce_big{i}")).collect();
        let big_ones: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), big.as_str())).collect();
        let h = headers(&big_ones);
        let bytes: usize = h.extensions.iter().map(|(n, v)| n.as_str().len() + v.len()).sum();
        assert!(bytes <= MAX_EXTENSION_BYTES && !h.extensions.is_empty(), "{bytes}");
        assert!(h.skipped.iter().all(|(_, s)| *s == Skip::Limit) && !h.skipped.is_empty());
    }

    #[test]
    fn any_property_map_gives_valid_headers_without_panicking() {
        use proptest::prelude::*;
        let names = "(ce_)?[a-zA-Z0-9_\\-:\\r\\n ]{0,24}|ce_\\PC{0,24}";
        proptest!(|(properties in proptest::collection::btree_map(names, "\\PC{0,64}", 0..12))| {
            let h = cloudevent_headers(&properties, "t", "application/octet-stream");
            let own = [
                (HeaderName::from_static("ce-source"), h.source.clone()),
                (HeaderName::from_static("ce-type"), h.event_type.clone()),
            ];
            for (name, value) in h.extensions.iter().chain(own.iter()) {
                prop_assert!(name.as_str().starts_with("ce-"));
                prop_assert!(value.as_bytes().iter().all(|b| (0x21..=0x7e).contains(b)), "{value:?}");
            }
            // Every extension candidate is either sent or counted as skipped.
            for key in properties.keys() {
                let Some(attr) = key.strip_prefix("ce_") else { continue };
                if NOT_EXTENSIONS.contains(&attr) {
                    continue;
                }
                let sent = h.extensions.iter().any(|(n, _)| n.as_str() == format!("ce-{attr}"));
                let skipped = h.skipped.iter().any(|(p, _)| p == key);
                prop_assert!(sent != skipped, "{key:?}: sent {sent}, skipped {skipped}");
            }
        });
    }
}
