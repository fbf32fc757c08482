//! Every expected value below was printed by Apache's own classes, run once with Java 17 on the jars popgate's
//! tests start Apache's proxy from (`docker/rocketmq/rocketmq.sh proxy-jars`: rocketmq-proxy 5.4.0, Guava
//! 32.0.1): `String.hashCode()`, `Hashing.consistentHash(long, int)`, and for the routes,
//! `SendMessageActivity.SendMessageQueueSelector.select` over a `MessageQueueView` of the same route.

use super::*;
use crate::broker::BrokerRoute;

/// A broker route with `write_queues` queues, as `brokers_with_master` builds it (0 when not writable).
fn broker(name: &str, write_queues: u32) -> BrokerRoute {
    BrokerRoute { name: name.into(), addr: String::new(), write_queues, read_queues: write_queues }
}

fn route(brokers: Vec<BrokerRoute>) -> TopicRoute {
    TopicRoute { brokers }
}

fn assert_selects(route: &TopicRoute, expected: &[(&str, (&str, i32))]) {
    for (group, (broker, queue_id)) in expected {
        assert_eq!(group_queue(route, group), Some(((*broker).to_owned(), *queue_id)), "group {group:?}");
    }
}

#[test]
fn java_string_hash_matches_java_over_utf16_code_units_with_int_overflow() {
    let vectors = [
        ("", 0),
        ("a", 97),
        ("order-7", -1_207_111_304),
        ("group-0", 293_427_298),
        ("the quick brown fox jumps over the lazy dog", -2_082_818_701),
        ("订单-0", 1_085_411_542),
        // Outside the BMP: two UTF-16 code units, 0xD83D 0xDE80.
        ("🚀-1", 1_703_880_391),
        ("Ünïcödé", 1_055_431_381),
        ("😀", 1_772_899),
    ];
    for (text, java) in vectors {
        assert_eq!(java_string_hash(text), java, "{text:?}");
    }
}

#[test]
fn consistent_hash_matches_guava() {
    let buckets = [1, 2, 3, 8, 10, 100, 1000, 65536, i32::MAX];
    let vectors: [(i64, [i32; 9]); 10] = [
        (0, [0, 0, 0, 0, 0, 0, 0, 0, 0]),
        (1, [0, 0, 0, 6, 6, 55, 549, 21134, 262_355_607]),
        (-1, [0, 1, 2, 7, 9, 92, 313, 18311, 699_554_662]),
        (42, [0, 1, 2, 2, 2, 43, 571, 5747, 1_603_940_301]),
        (i64::from(i32::MIN), [0, 1, 2, 2, 2, 58, 185, 39408, 665_541_240]),
        (i64::from(i32::MAX), [0, 0, 0, 0, 9, 56, 231, 51833, 1_876_666_846]),
        (i64::MIN, [0, 1, 1, 5, 5, 84, 453, 53854, 1_119_800_965]),
        (i64::MAX, [0, 0, 2, 7, 8, 97, 972, 8550, 213_047_985]),
        (0x0123_4567_89ab_cdef, [0, 0, 0, 0, 0, 57, 194, 33301, 1_651_575_352]),
        (-2_023_398_767, [0, 1, 2, 6, 9, 29, 473, 26673, 1_640_518_055]),
    ];
    for (input, expected) in vectors {
        for (n, bucket) in buckets.iter().zip(expected) {
            assert_eq!(consistent_hash(input, *n), bucket, "consistentHash({input}, {n})");
        }
    }
    assert_eq!(consistent_hash(42, 0), 0, "no buckets: 0, where Guava throws");
}

/// The it test's route (`it/apache_parity.rs`) and its 50 groups, listed broker-b first as a name server may.
#[test]
fn groups_on_two_brokers_of_four_queues_select_apaches_queues() {
    let two_by_four = route(vec![broker("broker-b", 4), broker("broker-a", 4)]);
    let expected: [(&str, (&str, i32)); 50] = [
        ("订单-0", ("broker-b", 2)),
        ("🚀-1", ("broker-a", 2)),
        ("group-2", ("broker-a", 0)),
        ("group-3", ("broker-b", 2)),
        ("group-4", ("broker-a", 2)),
        ("订单-5", ("broker-b", 1)),
        ("🚀-6", ("broker-b", 3)),
        ("group-7", ("broker-b", 3)),
        ("group-8", ("broker-a", 0)),
        ("group-9", ("broker-b", 2)),
        ("订单-10", ("broker-a", 1)),
        ("🚀-11", ("broker-b", 1)),
        ("group-12", ("broker-b", 1)),
        ("group-13", ("broker-b", 2)),
        ("group-14", ("broker-b", 1)),
        ("订单-15", ("broker-b", 3)),
        ("🚀-16", ("broker-b", 0)),
        ("group-17", ("broker-b", 3)),
        ("group-18", ("broker-a", 0)),
        ("group-19", ("broker-a", 3)),
        ("订单-20", ("broker-b", 3)),
        ("🚀-21", ("broker-b", 3)),
        ("group-22", ("broker-a", 1)),
        ("group-23", ("broker-b", 3)),
        ("group-24", ("broker-b", 1)),
        ("订单-25", ("broker-a", 2)),
        ("🚀-26", ("broker-b", 3)),
        ("group-27", ("broker-b", 0)),
        ("group-28", ("broker-a", 2)),
        ("group-29", ("broker-a", 0)),
        ("订单-30", ("broker-b", 0)),
        ("🚀-31", ("broker-a", 3)),
        ("group-32", ("broker-a", 1)),
        ("group-33", ("broker-b", 3)),
        ("group-34", ("broker-a", 0)),
        ("订单-35", ("broker-b", 0)),
        ("🚀-36", ("broker-a", 0)),
        ("group-37", ("broker-b", 2)),
        ("group-38", ("broker-b", 2)),
        ("group-39", ("broker-a", 3)),
        ("订单-40", ("broker-b", 2)),
        ("🚀-41", ("broker-a", 0)),
        ("group-42", ("broker-a", 2)),
        ("group-43", ("broker-a", 1)),
        ("group-44", ("broker-b", 1)),
        ("订单-45", ("broker-a", 0)),
        ("🚀-46", ("broker-b", 2)),
        ("group-47", ("broker-a", 2)),
        ("group-48", ("broker-b", 1)),
        ("group-49", ("broker-a", 3)),
    ];
    assert_selects(&two_by_four, &expected);
}

/// Queue counts that differ per broker, a read-only broker (`perm` without the write bit: no write queues) and
/// a broker without a master (absent from `TopicRoute`): Apache lists `broker-a` 0..5 then `broker-b` 0..3.
#[test]
fn uneven_queue_counts_and_unwritable_brokers_select_apaches_queues() {
    let uneven = route(vec![broker("broker-b", 3), broker("broker-c", 0), broker("broker-a", 5)]);
    assert_selects(
        &uneven,
        &[
            ("a", ("broker-a", 0)),
            ("order-7", ("broker-a", 4)),
            ("group-0", ("broker-a", 1)),
            ("group-1", ("broker-b", 2)),
            ("group-2", ("broker-a", 0)),
            ("group-3", ("broker-b", 1)),
            ("group-4", ("broker-a", 2)),
            ("group-5", ("broker-b", 1)),
            ("customer-1234", ("broker-b", 0)),
        ],
    );
}

/// Java orders broker names by UTF-16 code units: "b😀" (0xD83D…) sorts before "b！" (0xFF01), the reverse of
/// their UTF-8 byte order.
#[test]
fn broker_names_sort_in_javas_utf16_order() {
    let (fullwidth, emoji) = ("b\u{ff01}", "b\u{1f600}");
    let utf16 = route(vec![broker(fullwidth, 1), broker(emoji, 1)]);
    for (group, broker) in
        [("a", emoji), ("b", emoji), ("c", emoji), ("d", fullwidth), ("e", fullwidth), ("g", fullwidth), ("h", emoji)]
    {
        assert_eq!(group_queue(&utf16, group), Some((broker.to_owned(), 0)), "group {group:?}");
    }
}

#[test]
fn a_topic_without_writable_queues_has_no_group_queue() {
    assert_eq!(group_queue(&route(vec![]), "g"), None);
    assert_eq!(group_queue(&route(vec![broker("broker-a", 0)]), "g"), None);
}

/// A broker listed twice (two queue datas of one name) still counts each queue once, as Apache's set does.
#[test]
fn a_broker_listed_twice_counts_its_queues_once() {
    let once = route(vec![broker("broker-a", 4), broker("broker-b", 4)]);
    let twice = route(vec![broker("broker-a", 4), broker("broker-b", 4), broker("broker-a", 4)]);
    for group in ["group-2", "group-3", "订单-0", "🚀-1"] {
        assert_eq!(group_queue(&twice, group), group_queue(&once, group), "{group}");
    }
}
