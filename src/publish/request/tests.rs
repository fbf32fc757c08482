use super::*;
use axum::http::{HeaderName, HeaderValue};

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.insert(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_str(value).unwrap());
    }
    map
}

fn json(body: &str) -> Result<OutgoingMessage, RequestError> {
    json_request(body, (None, None)).map(|r| r.message.message().clone())
}

fn json_request(body: &str, query: TransactionParams<'_>) -> Result<PublishRequest, RequestError> {
    parse(
        &headers(&[("content-type", "application/json")]),
        None,
        query,
        &Bytes::from(body.to_owned()),
        &MessageLimits::default(),
    )
}

/// `parse` of a request with no transaction parameters in its query, for its message.
fn parse_message(
    h: &HeaderMap,
    topic: Option<&str>,
    body: &Bytes,
    limits: &MessageLimits,
) -> Result<OutgoingMessage, RequestError> {
    parse(h, topic, (None, None), body, limits).map(|r| r.message.message().clone())
}

fn field_of(result: Result<OutgoingMessage, RequestError>) -> String {
    result.expect_err("must be rejected").field().unwrap_or_default().to_owned()
}

#[test]
fn popgate_json_maps_every_field() {
    let m = json(
        r#"{"topic":"orders","data":"hi","tags":"created","keys":["k1","k2"],
        "properties":{"tenant":"t1"},"messageGroup":"cust-7","delayMs":5000}"#,
    )
    .unwrap();
    assert_eq!(m.topic, "orders");
    assert_eq!(&m.body[..], b"hi");
    assert_eq!(m.tags.as_deref(), Some("created"));
    assert_eq!(m.keys, vec!["k1", "k2"]);
    assert_eq!(m.properties.get("tenant").map(String::as_str), Some("t1"));
    assert_eq!(m.properties.get(PROPERTY_SHARDING_KEY).map(String::as_str), Some("cust-7"));
    assert!(m.properties.contains_key(PROPERTY_TIMER_DELIVER_MS));
}

#[test]
fn non_string_data_is_sent_as_json_text_and_base64_as_bytes() {
    assert_eq!(&json(r#"{"topic":"t","data":{"a":1}}"#).unwrap().body[..], br#"{"a":1}"#);
    assert_eq!(&json(r#"{"topic":"t","dataBase64":"AAEC"}"#).unwrap().body[..], &[0u8, 1, 2]);
}

#[test]
fn the_shape_of_data_is_kept_as_the_content_type() {
    let content_type = |body: &str| json(body).unwrap().properties.get(PROPERTY_CONTENT_TYPE).cloned();
    assert_eq!(content_type(r#"{"topic":"t","data":{"a":1}}"#).as_deref(), Some("application/json"));
    assert_eq!(content_type(r#"{"topic":"t","data":42}"#).as_deref(), Some("application/json"));
    assert_eq!(content_type(r#"{"topic":"t","data":"{\"a\":1}"}"#).as_deref(), Some("text/plain; charset=utf-8"));
    assert_eq!(content_type(r#"{"topic":"t","dataBase64":"aGk="}"#).as_deref(), Some("application/octet-stream"));
    let h = headers(&[("content-type", "application/cloudevents+json")]);
    let structured = |data: &str| {
        let body = format!(r#"{{"specversion":"1.0","id":"e","source":"/s","type":"x",{data}}}"#);
        let m = parse_message(&h, Some("t"), &Bytes::from(body), &MessageLimits::default());
        m.unwrap().properties.get(PROPERTY_CONTENT_TYPE).cloned()
    };
    assert_eq!(structured(r#""data":[1]"#).as_deref(), Some("application/json"));
    assert_eq!(structured(r#""data":"x""#).as_deref(), Some("text/plain; charset=utf-8"));
    assert_eq!(structured(r#""data_base64":"AA==""#).as_deref(), Some("application/octet-stream"));
}

#[test]
fn the_content_type_property_is_popgates_own() {
    assert_eq!(
        field_of(json(r#"{"topic":"t","data":"x","properties":{"POPGATE_CONTENT_TYPE":"application/json"}}"#)),
        "properties.POPGATE_CONTENT_TYPE"
    );
}

#[test]
fn the_topic_parameter_wins_over_the_body() {
    let h = headers(&[("content-type", "application/json")]);
    let m = parse_message(
        &h,
        Some("fromquery"),
        &Bytes::from_static(br#"{"topic":"x","data":"d"}"#),
        &MessageLimits::default(),
    )
    .unwrap();
    assert_eq!(m.topic, "fromquery");
}

#[test]
fn bad_input_names_the_field() {
    assert_eq!(field_of(json(r#"{"data":"x"}"#)), "topic");
    assert_eq!(field_of(json(r#"{"topic":"a b","data":"x"}"#)), "topic");
    assert_eq!(field_of(json(r#"{"topic":"t"}"#)), "data");
    assert_eq!(field_of(json(r#"{"topic":"t","data":"x","dataBase64":"AA=="}"#)), "dataBase64");
    assert_eq!(field_of(json(r#"{"topic":"t","dataBase64":"!!"}"#)), "dataBase64");
    assert_eq!(field_of(json(r#"{"topic":"t","data":"x","tags":5}"#)), "tags");
    assert_eq!(field_of(json(r#"{"topic":"t","data":"x","keys":[1]}"#)), "keys");
    assert_eq!(field_of(json(r#"{"topic":"t","data":"x","properties":{"a":1}}"#)), "properties.a");
    assert_eq!(field_of(json(r#"{"topic":"t","data":"x","properties":{"TAGS":"x"}}"#)), "properties.TAGS");
    assert_eq!(field_of(json(r#"{"topic":"t","data":"x","delayMs":-1}"#)), "delayMs");
    assert_eq!(field_of(json(r#"{"topic":"t","data":"x","delayMs":999999999999}"#)), "delayMs");
    assert_eq!(field_of(json(r#"{"topic":"t","data":"x","colour":"red"}"#)), "colour");
}

#[test]
fn a_body_that_is_not_a_json_object_is_malformed() {
    for body in ["", "nope", "[1,2]", "\"s\""] {
        let err = json(body).expect_err(body);
        assert!(matches!(err, RequestError::MalformedBody(_)), "{body}: {err:?}");
    }
}

#[test]
fn structured_cloudevents_map_attributes_to_properties_and_the_id_to_the_key() {
    let h = headers(&[("content-type", "application/cloudevents+json")]);
    let body = br#"{"specversion":"1.0","id":"e-1","source":"/shop","type":"order.created",
        "subject":"o-9","datacontenttype":"application/json","data":{"n":1},"tenant":"acme"}"#;
    let m = parse_message(&h, Some("orders"), &Bytes::from_static(body), &MessageLimits::default()).unwrap();
    assert_eq!(&m.body[..], br#"{"n":1}"#);
    assert_eq!(m.keys, vec!["e-1"]);
    for (name, value) in [
        ("ce_id", "e-1"),
        ("ce_source", "/shop"),
        ("ce_type", "order.created"),
        ("ce_subject", "o-9"),
        ("ce_specversion", "1.0"),
        ("ce_tenant", "acme"),
    ] {
        assert_eq!(m.properties.get(name).map(String::as_str), Some(value), "{name}");
    }
}

#[test]
fn binary_cloudevents_read_ce_headers_and_keep_the_body() {
    let h = headers(&[
        ("ce-specversion", "1.0"),
        ("ce-id", "e-2"),
        ("ce-source", "/s"),
        ("ce-type", "t.x"),
        ("content-type", "application/octet-stream"),
    ]);
    let m = parse_message(&h, Some("orders"), &Bytes::from_static(&[9, 8, 7]), &MessageLimits::default()).unwrap();
    assert_eq!(&m.body[..], &[9, 8, 7]);
    assert_eq!(m.properties.get("ce_datacontenttype").map(String::as_str), Some("application/octet-stream"));
    assert_eq!(m.properties.get(PROPERTY_CONTENT_TYPE).map(String::as_str), Some("application/octet-stream"));
    assert_eq!(m.keys, vec!["e-2"]);
    let ce = [("ce-specversion", "1.0"), ("ce-id", "e-3"), ("ce-source", "/s"), ("ce-type", "t.x")];
    for (content_type, kept) in [
        ("application/json; charset=utf-8", Some("application/json")),
        ("text/plain", Some("text/plain; charset=utf-8")),
        ("application/xml", None),
    ] {
        let h = headers(&[ce.as_slice(), &[("content-type", content_type)]].concat());
        let m = parse_message(&h, Some("orders"), &Bytes::from_static(b"{}"), &MessageLimits::default()).unwrap();
        assert_eq!(m.properties.get(PROPERTY_CONTENT_TYPE).map(String::as_str), kept, "{content_type}");
    }
}

#[test]
fn cloudevents_without_a_required_attribute_name_it() {
    let h = headers(&[("ce-specversion", "1.0"), ("ce-id", "e-2"), ("ce-source", "/s")]);
    assert_eq!(field_of(parse_message(&h, Some("t"), &Bytes::new(), &MessageLimits::default())), "type");
    let h = headers(&[("content-type", "application/cloudevents+json")]);
    let body = br#"{"specversion":"0.3","id":"1","source":"s","type":"t","data":"x"}"#;
    assert_eq!(
        field_of(parse_message(&h, Some("t"), &Bytes::from_static(body), &MessageLimits::default())),
        "specversion"
    );
}

#[test]
fn an_unsupported_content_type_is_named() {
    let h = headers(&[("content-type", "text/plain")]);
    assert_eq!(
        field_of(parse_message(&h, Some("t"), &Bytes::from_static(b"x"), &MessageLimits::default())),
        "content-type"
    );
}

#[test]
fn a_transactional_publish_names_its_checker_in_the_body_or_the_query() {
    let plain = json_request(r#"{"topic":"t","data":"x"}"#, (None, None)).unwrap();
    assert_eq!(plain.transaction, None);
    let body = json_request(r#"{"topic":"t","data":"x","transaction":true,"producerGroup":"payments"}"#, (None, None));
    assert_eq!(body.unwrap().transaction, Some(Transactional { producer_group: Some("payments".into()) }));
    let query = json_request(r#"{"topic":"t","data":"x"}"#, (Some("true"), None)).unwrap();
    assert_eq!(query.transaction, Some(Transactional { producer_group: None }));
    // The query wins, as `?topic=` does.
    let off = json_request(r#"{"topic":"t","data":"x","transaction":true}"#, (Some("false"), None)).unwrap();
    assert_eq!(off.transaction, None);
}

#[test]
fn a_transactional_publish_that_cannot_be_one_names_the_field() {
    let field = |body: &str, query: TransactionParams<'_>| {
        json_request(body, query).expect_err("must be rejected").field().unwrap_or_default().to_owned()
    };
    assert_eq!(field(r#"{"topic":"t","data":"x","transaction":"yes"}"#, (None, None)), "transaction");
    assert_eq!(field(r#"{"topic":"t","data":"x"}"#, (Some("1"), None)), "transaction");
    assert_eq!(field(r#"{"topic":"t","data":"x","producerGroup":"p"}"#, (None, None)), "producerGroup");
    assert_eq!(
        field(r#"{"topic":"t","data":"x","transaction":true,"producerGroup":"a b"}"#, (None, None)),
        "producerGroup"
    );
    assert_eq!(field(r#"{"topic":"t","data":"x","transaction":true,"delayMs":5000}"#, (None, None)), "delayMs");
    assert_eq!(
        field(r#"{"topic":"t","data":"x","transaction":true,"messageGroup":"g"}"#, (None, None)),
        "messageGroup"
    );
}

use proptest::strategy::Strategy as _;

proptest::proptest! {
    /// Whatever bytes an HTTP client sends as a publish body, under each content type popgate reads, it is a
    /// message or a 4xx naming a field: never a panic. A seed that fails is a bug.
    #[test]
    fn arbitrary_publish_bodies_are_a_message_or_a_clear_refusal(
        body in proptest::collection::vec(proptest::num::u8::ANY, 0..256),
        content_type in proptest::sample::select(vec!["application/json", "application/cloudevents+json", "text/plain", ""]),
    ) {
        let h = headers(&[("content-type", content_type)]);
        if let Err(refused) = parse(&h, Some("t"), (None, None), &Bytes::from(body), &MessageLimits::default()) {
            proptest::prop_assert!(refused.field().is_some() || !refused.to_string().is_empty());
        }
    }

    /// A JSON object with arbitrary values in popgate's fields: the same.
    #[test]
    fn arbitrary_field_values_are_a_message_or_a_clear_refusal(
        name in proptest::sample::select(vec!["topic", "data", "tags", "keys", "properties", "messageGroup", "delayMs", "deliverAt", "transaction", "producerGroup", "id"]),
        value in proptest::prop_oneof![
            proptest::prelude::any::<i64>().prop_map(|n| serde_json::json!(n)),
            "\\PC{0,40}".prop_map(|s: String| serde_json::json!(s)),
            proptest::prelude::Just(serde_json::json!({"a": [1, null, true]})),
            proptest::prelude::Just(serde_json::json!(null)),
            proptest::prelude::Just(serde_json::json!([1.5, "x"])),
        ],
    ) {
        let body = serde_json::json!({"topic": "t", "data": "x", name: value}).to_string();
        let _ = json_request(&body, (None, None));
    }
}

fn batch(content_type: &str, body: &str, max: usize) -> Result<Vec<WithinLimits>, RequestError> {
    parse_batch(
        &headers(&[("content-type", content_type)]),
        None,
        &Bytes::from(body.to_owned()),
        &MessageLimits::default(),
        max,
    )
}

#[test]
fn an_array_body_or_cloudevents_batched_mode_is_a_batch_and_nothing_else_is() {
    let is = |pairs: &[(&str, &str)], body: &str| is_batch(&headers(pairs), &Bytes::from(body.to_owned()));
    assert!(is(&[("content-type", "application/json")], " \n[{}]"));
    assert!(is(&[], "[]"));
    assert!(is(&[("content-type", "application/cloudevents-batch+json; charset=utf-8")], "{}"));
    assert!(!is(&[("content-type", "application/json")], "{\"data\": [1]}"));
    assert!(!is(&[("content-type", "application/cloudevents+json")], "[{}]"));
    assert!(!is(&[("content-type", "text/plain"), ("ce-specversion", "1.0")], "[1]"), "binary mode: the data");
}

#[test]
fn a_batch_names_the_element_at_fault_and_refuses_what_one_queue_cannot_hold() {
    let ok = batch("application/json", r#"[{"topic":"t","data":"a"},{"topic":"t","data":"b","tags":"x"}]"#, 10);
    let ok = ok.expect("a valid batch");
    assert_eq!(ok.len(), 2);
    assert_eq!(ok[1].message().tags.as_deref(), Some("x"));
    let field = |body: &str, max| batch("application/json", body, max).expect_err("refused").field().map(str::to_owned);
    assert_eq!(field("[]", 10), None, "an empty batch is a malformed body");
    assert_eq!(field(r#"{"topic":"t","data":"a"}"#, 10), None, "an object is no batch");
    assert_eq!(field(r#"[{"topic":"t","data":"a"},{"topic":"u","data":"b"}]"#, 10).as_deref(), Some("[1].topic"));
    assert_eq!(field(r#"[{"topic":"t","data":"a"},{"topic":"t"}]"#, 10).as_deref(), Some("[1].data"));
    assert_eq!(field(r#"[{"topic":"t","data":"a","delayMs":5}]"#, 10).as_deref(), Some("[0].delayMs"));
    assert_eq!(field(r#"[{"topic":"t","data":"a","producerGroup":"p"}]"#, 10).as_deref(), Some("[0].producerGroup"));
    assert_eq!(
        field(r#"[{"topic":"t","data":"a"},{"topic":"t","data":"b","messageGroup":"g"}]"#, 10).as_deref(),
        Some("[1].messageGroup")
    );
    assert_eq!(field(r#"[{"topic":"t","data":"a"},7]"#, 10).as_deref(), Some("[1]"));
    assert_eq!(field(r#"[{"topic":"t","data":"a"},{"topic":"t","data":"b"}]"#, 1).as_deref(), Some("[1]"));
    let events = r#"[{"specversion":"1.0","id":"1","source":"s","type":"t","data":"x"},{"specversion":"1.0","source":"s","type":"t","data":"y"}]"#;
    let refused = parse_batch(
        &headers(&[("content-type", "application/cloudevents-batch+json")]),
        Some("t"),
        &Bytes::from(events),
        &MessageLimits::default(),
        10,
    );
    assert_eq!(refused.expect_err("no id").field(), Some("[1].id"));
}
