use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

fn full_record(phase: Phase) -> DeliveryRecord {
    DeliveryRecord {
        id: "node-1~00112233445566778899aabbccddeeff".into(),
        group: "orders-g".into(),
        topic: "orders".into(),
        event: Event {
            id: "7F0000010001".into(),
            topic: "orders".into(),
            tags: Some("paid".into()),
            keys: vec!["k1".into(), "ключ".into()],
            properties: BTreeMap::from([("a".into(), "1".into()), ("".into(), "empty key".into())]),
            body: vec![0, 1, 2, 0xff, b'{'],
            born_timestamp: -1,
            reconsume_times: u32::MAX,
            retry_topic: Some("%RETRY%orders-g".into()),
            message_group: Some("customer-7".into()),
            stored: StoredFacts {
                born_host: "10.0.0.1".into(),
                store_host: "10.0.0.2:10911".into(),
                store_timestamp: i64::MAX,
                queue_id: i32::MIN,
                queue_offset: i64::MIN,
                system: BTreeMap::from([("TRAN_MSG".into(), "true".into())]),
                commit_log_offset: 1 << 40,
                flag: -7,
            },
        },
        handle: ReceiptHandle {
            broker_name: "broker-a".into(),
            broker_addr: "127.0.0.1:10911".into(),
            extra_info: "0 1700000000000 60000 0 0 broker-a 3 42".into(),
            ack_topic: "%RETRY%orders-g".into(),
            queue_id: 3,
            queue_offset: 42,
            pop_time_ms: 1_700_000_000_000,
            invisible_ms: 60_000,
            lease_until_ms: Epoch::from_millis(1_700_000_060_000),
        },
        attempt: 3,
        phase,
        last_failure: Some("nacked: \"busy\"".into()),
        seq: u64::MAX,
        handouts: 2,
        body_apart: true,
    }
}

fn every_phase() -> Vec<Phase> {
    let holder = |auto_renew, written| Some(Holder { client_id: "app@1".into(), auto_renew, written });
    vec![
        Phase::Ready { due_ms: Epoch::ZERO },
        Phase::Ready { due_ms: Epoch::from_millis(-5) },
        Phase::AwaitingAck { deadline_ms: Epoch::from_millis(10), dispatched_ms: Epoch::from_millis(9), holder: None },
        Phase::AwaitingAck { deadline_ms: Epoch::ZERO, dispatched_ms: Epoch::ZERO, holder: holder(false, false) },
        Phase::AwaitingAck { deadline_ms: Epoch::ZERO, dispatched_ms: Epoch::ZERO, holder: holder(true, false) },
        Phase::AwaitingAck { deadline_ms: Epoch::ZERO, dispatched_ms: Epoch::ZERO, holder: holder(false, true) },
        Phase::AwaitingAck {
            deadline_ms: Epoch::from_millis(i64::MAX),
            dispatched_ms: Epoch::from_millis(i64::MIN),
            holder: holder(true, true),
        },
        Phase::Acked,
        Phase::DeadLetter { reason: String::new() },
        Phase::DeadLetter { reason: "attempts exhausted".into() },
    ]
}

#[test]
fn every_phase_round_trips_and_starts_with_the_version_byte() {
    for phase in every_phase() {
        let record = full_record(phase);
        let bytes = record.encode();
        assert_eq!(bytes[0], VERSION_1);
        assert!(!DeliveryRecord::is_legacy_json(&bytes));
        assert_eq!(DeliveryRecord::decode(&bytes).expect("decodes"), record);
    }
}

#[test]
fn a_record_with_nothing_optional_round_trips() {
    let mut record = full_record(Phase::Acked);
    record.event = Event {
        id: String::new(),
        topic: "".into(),
        tags: None,
        keys: Vec::new(),
        properties: BTreeMap::new(),
        body: Vec::new(),
        born_timestamp: 0,
        reconsume_times: 0,
        retry_topic: None,
        message_group: None,
        stored: StoredFacts::default(),
    };
    record.last_failure = None;
    record.seq = 0;
    record.body_apart = false;
    assert_eq!(DeliveryRecord::decode(&record.encode()).expect("decodes"), record);
}

#[test]
fn the_compact_form_is_well_under_the_json_one() {
    let record = full_record(Phase::AwaitingAck {
        deadline_ms: Epoch::from_millis(1_700_000_060_000),
        dispatched_ms: Epoch::from_millis(1_700_000_000_000),
        holder: None,
    });
    let (compact, json) = (record.encode().len(), serde_json::to_vec(&record).expect("json").len());
    assert!(compact * 2 < json, "{compact} bytes against {json} in JSON");
}

/// A record exactly as the popgate before this format wrote it (bodies apart, no holder), and one from
/// before `seq`, `handouts`, `bodyApart`, `leaseUntilMs`, `stored` and `written` existed.
#[test]
fn records_in_the_json_form_of_earlier_versions_still_decode() {
    let today = br#"{"id":"ab","group":"g","topic":"t","event":{"id":"MSG1","topic":"t","tags":null,"keys":[],"properties":{},"body":"","bornTimestamp":5,"reconsumeTimes":0,"retryTopic":null,"messageGroup":null,"stored":{"bornHost":"","storeHost":"","storeTimestamp":0,"queueId":0,"queueOffset":0,"commitLogOffset":0,"flag":0}},"handle":{"brokerName":"broker-a","brokerAddr":"127.0.0.1:1","extraInfo":"0 5 3600000 0 0 broker-a 0 1","ackTopic":"t","queueId":0,"queueOffset":1,"popTimeMs":5,"invisibleMs":3600000,"leaseUntilMs":3600005},"attempt":1,"phase":"awaitingAck","deadline_ms":3600005,"dispatched_ms":5,"lastFailure":null,"seq":2,"handouts":1,"bodyApart":true}"#;
    let record = DeliveryRecord::decode(today).expect("today's JSON decodes");
    assert!(DeliveryRecord::is_legacy_json(today));
    assert_eq!(
        record.phase,
        Phase::AwaitingAck {
            deadline_ms: Epoch::from_millis(3_600_005),
            dispatched_ms: Epoch::from_millis(5),
            holder: None
        }
    );
    assert_eq!((record.seq, record.handouts, record.body_apart), (2, 1, true));
    assert_eq!(DeliveryRecord::decode(&record.encode()).expect("rewritten form decodes"), record);

    let oldest = br#"{"id":"cd","group":"g","topic":"t","event":{"id":"MSG2","topic":"t","tags":"x","keys":["k"],"properties":{"p":"v"},"body":"aGk=","bornTimestamp":5,"reconsumeTimes":1,"retryTopic":null},"handle":{"brokerName":"b","brokerAddr":"a:1","extraInfo":"e","ackTopic":"t","queueId":1,"queueOffset":2,"popTimeMs":3,"invisibleMs":4},"attempt":2,"phase":"awaitingAck","deadline_ms":9,"dispatched_ms":8,"holder":{"clientId":"app@1","autoRenew":true},"lastFailure":"boom"}"#;
    let record = DeliveryRecord::decode(oldest).expect("the oldest JSON decodes");
    assert_eq!(record.event.body, b"hi");
    assert_eq!(
        (record.seq, record.handouts, record.body_apart, record.handle.lease_until_ms),
        (0, 0, false, Epoch::ZERO)
    );
    let Phase::AwaitingAck { holder: Some(holder), .. } = &record.phase else { panic!("{:?}", record.phase) };
    assert!(holder.written, "counted as written, as it was then");
    assert_eq!(DeliveryRecord::decode(&record.encode()).expect("rewritten form decodes"), record);
}

#[test]
fn damaged_records_are_errors_never_panics() {
    let bytes = full_record(every_phase()[6].clone()).encode();
    for cut in 0..bytes.len() {
        assert!(DeliveryRecord::decode(&bytes[..cut]).is_err(), "cut at {cut} of {}", bytes.len());
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(matches!(DeliveryRecord::decode(&longer), Err(DecodeError::Length)));
    assert!(matches!(DeliveryRecord::decode(&[0x02, 0]), Err(DecodeError::UnknownVersion(2))));
    assert!(matches!(DeliveryRecord::decode(b"{not json"), Err(DecodeError::Json(_))));
    assert!(matches!(
        DeliveryRecord::decode(&[0x01, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]),
        Err(DecodeError::Number)
    ));
}

// === property: JSON and the compact form agree ===

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 %~@.:é\"\\\\{}]{0,12}"
}

fn shared() -> impl Strategy<Value = Arc<str>> {
    text().prop_map(Arc::from)
}

fn epoch() -> impl Strategy<Value = Epoch> {
    // JSON numbers round-trip exactly for every i64.
    any::<i64>().prop_map(Epoch::from_millis)
}

fn phase() -> impl Strategy<Value = Phase> {
    let holder = (text(), any::<bool>(), any::<bool>()).prop_map(|(client_id, auto_renew, written)| Holder {
        client_id,
        auto_renew,
        written,
    });
    prop_oneof![
        epoch().prop_map(|due_ms| Phase::Ready { due_ms }),
        (epoch(), epoch(), proptest::option::of(holder))
            .prop_map(|(deadline_ms, dispatched_ms, holder)| Phase::AwaitingAck { deadline_ms, dispatched_ms, holder }),
        Just(Phase::Acked),
        text().prop_map(|reason| Phase::DeadLetter { reason }),
    ]
}

fn event() -> impl Strategy<Value = Event> {
    let head = (
        text(),
        shared(),
        proptest::option::of(text()),
        proptest::collection::vec(text(), 0..3),
        proptest::collection::btree_map(text(), text(), 0..3),
        proptest::collection::vec(any::<u8>(), 0..40),
    );
    let tail = (any::<i64>(), any::<u32>(), proptest::option::of(text()), proptest::option::of(text()));
    let stored = (
        text(),
        text(),
        any::<i64>(),
        any::<i32>(),
        any::<i64>(),
        proptest::collection::btree_map(text(), text(), 0..2),
        any::<i64>(),
        any::<i32>(),
    )
        .prop_map(
            |(born_host, store_host, store_timestamp, queue_id, queue_offset, system, commit_log_offset, flag)| {
                StoredFacts {
                    born_host,
                    store_host,
                    store_timestamp,
                    queue_id,
                    queue_offset,
                    system,
                    commit_log_offset,
                    flag,
                }
            },
        );
    (head, tail, stored).prop_map(
        |(
            (id, topic, tags, keys, properties, body),
            (born_timestamp, reconsume_times, retry_topic, message_group),
            stored,
        )| {
            Event {
                id,
                topic,
                tags,
                keys,
                properties,
                body,
                born_timestamp,
                reconsume_times,
                retry_topic,
                message_group,
                stored,
            }
        },
    )
}

fn handle() -> impl Strategy<Value = ReceiptHandle> {
    (shared(), shared(), text(), shared(), any::<i32>(), any::<i64>(), any::<i64>(), any::<i64>(), epoch()).prop_map(
        |(
            broker_name,
            broker_addr,
            extra_info,
            ack_topic,
            queue_id,
            queue_offset,
            pop_time_ms,
            invisible_ms,
            lease_until_ms,
        )| {
            ReceiptHandle {
                broker_name,
                broker_addr,
                extra_info,
                ack_topic,
                queue_id,
                queue_offset,
                pop_time_ms,
                invisible_ms,
                lease_until_ms,
            }
        },
    )
}

fn record() -> impl Strategy<Value = DeliveryRecord> {
    let head = (shared(), shared(), shared(), event(), handle());
    let tail = (any::<u32>(), phase(), proptest::option::of(text()), any::<u64>(), any::<u32>(), any::<bool>());
    (head, tail).prop_map(
        |((id, group, topic, event, handle), (attempt, phase, last_failure, seq, handouts, body_apart))| {
            DeliveryRecord { id, group, topic, event, handle, attempt, phase, last_failure, seq, handouts, body_apart }
        },
    )
}

proptest! {
    /// Whatever an earlier popgate stored as JSON reads as the same record, and the form it is rewritten in
    /// reads back as that record too.
    #[test]
    fn a_json_record_decodes_to_the_same_record_and_survives_its_rewrite(record in record()) {
        let json = serde_json::to_vec(&record).expect("json");
        let from_json = DeliveryRecord::decode(&json).expect("JSON decodes");
        prop_assert_eq!(&from_json, &record);
        let rewritten = from_json.encode();
        prop_assert_eq!(rewritten[0], VERSION_1);
        prop_assert_eq!(DeliveryRecord::decode(&rewritten).expect("compact decodes"), record);
    }

    /// No input panics the decoder (recovery reads whatever the disk holds).
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = DeliveryRecord::decode(&bytes);
    }
}
