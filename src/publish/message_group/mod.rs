//! The queue a FIFO message group is written to: the very queue Apache's RocketMQ Proxy picks for it.
//!
//! A group sent partly through popgate and partly through Apache's proxy (a rolling migration, or both fronts
//! behind one load balancer) must land in one queue, or its order is lost. So popgate does not choose its own
//! hash: it repeats Apache's selection, written here from its description.
//!
//! Apache's proxy (`proxy/…/grpc/v2/producer/SendMessageActivity.java`, class `SendMessageQueueSelector`; read
//! at apache/rocketmq 8fc57f1 and checked against the 5.4.0 jar, which printed the vectors of the tests) sends a
//! one-message `SendMessage` whose message has a group to
//! `writeQueues[Hashing.consistentHash(group.hashCode(), writeQueues.size())]`, whatever the brokers' health.
//! `writeQueues` comes from `proxy/…/service/route/MessageQueueSelector.java` (`buildWrite`): for every queue
//! data of the topic's route whose `perm` has the write bit and whose broker has a master (brokerId 0), the queue
//! ids `0..writeQueueNums` of that broker, as a set sorted by `MessageQueue.compareTo`: broker name by Java's
//! `String.compareTo` (UTF-16 code units), then queue id.
//!
//! Two differences, both off the path of Apache's Java SDK, which sends one message per `SendMessage`: with
//! several messages in one `SendMessage`, Apache ignores their group and writes the batch to one queue of its
//! round robin, while popgate sends each message to its own group's queue. And a route with `orderTopicConf`
//! (the name server sends one only with `orderMessageEnable=true`, off by default) makes Apache list the conf's
//! brokers instead; popgate ignores it.

use std::cmp::Ordering;

use super::TopicRoute;

/// The queue (broker name, queue id) Apache's proxy writes a message of `group` to on `route`, or `None` when the
/// topic has no writable queue.
pub fn group_queue(route: &TopicRoute, group: &str) -> Option<(String, i32)> {
    let queues = write_queues(route);
    let buckets = i32::try_from(queues.len()).ok().filter(|n| *n > 0)?;
    let bucket = consistent_hash(i64::from(java_string_hash(group)), buckets);
    let (broker, queue_id) = queues.get(usize::try_from(bucket).ok()?)?;
    Some(((*broker).to_owned(), *queue_id))
}

/// The topic's write queues in the order Apache's proxy lists them (`MessageQueueSelector.buildWrite`): each
/// writable broker's queue ids `0..write_queues`, sorted by broker name in UTF-16 order, then queue id, without
/// duplicates. `TopicRoute` keeps only brokers with a master, as Apache does.
fn write_queues(route: &TopicRoute) -> Vec<(&str, i32)> {
    let mut queues: Vec<(&str, i32)> = route
        .writable()
        .flat_map(|broker| {
            let count = i32::try_from(broker.write_queues).unwrap_or(i32::MAX);
            (0..count).map(move |queue_id| (broker.name.as_str(), queue_id))
        })
        .collect();
    queues.sort_by(|a, b| java_string_order(a.0, b.0).then(a.1.cmp(&b.1)));
    queues.dedup();
    queues
}

/// Java's `String.compareTo`: lexicographic over UTF-16 code units. It differs from Rust's byte order only
/// between a character above U+FFFF (a surrogate pair, 0xD800…) and one in U+E000..=U+FFFF.
fn java_string_order(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// Java's `String.hashCode()`: `s[0]·31^(n-1) + s[1]·31^(n-2) + … + s[n-1]` over the string's UTF-16 code units,
/// in 32-bit arithmetic that wraps, so a character above U+FFFF counts as its two surrogates.
pub fn java_string_hash(text: &str) -> i32 {
    text.encode_utf16().fold(0i32, |hash, unit| hash.wrapping_mul(31).wrapping_add(i32::from(unit)))
}

/// Guava's `Hashing.consistentHash(long input, int buckets)` (Lamping and Veach's jump consistent hash): a bucket
/// in `0..buckets` for `input`, moving to a new bucket with probability 1/n only as `buckets` grows to n.
///
/// It jumps from bucket `candidate` to `(candidate + 1) / r` while that stays below `buckets`, drawing each `r`
/// in (0, 1] from a 64-bit linear congruential generator seeded with `input`: `state = 2862933555777941757 ·
/// state + 1` (wrapping), `r = (int(state >>> 33) + 1) / 2^31`, where the `+ 1` is 32-bit and wraps to −2^31 for
/// the largest draw, which ends the jumps. The quotient is truncated to an `int` as Java does (saturating).
/// `buckets` ≤ 0, which Guava refuses, gives 0.
pub fn consistent_hash(input: i64, buckets: i32) -> i32 {
    const MULTIPLIER: i64 = 2_862_933_555_777_941_757;
    const TWO_POW_31: f64 = 2_147_483_648.0;
    let mut state = input;
    let mut candidate = 0i32;
    loop {
        state = state.wrapping_mul(MULTIPLIER).wrapping_add(1);
        let high_bits = i32::try_from((state as u64) >> 33).unwrap_or(i32::MAX);
        let draw = f64::from(high_bits.wrapping_add(1)) / TWO_POW_31;
        // Java's double-to-int cast and Rust's `as` agree: truncation, saturating at the int range.
        let next = (f64::from(candidate + 1) / draw) as i32;
        if !(0..buckets).contains(&next) {
            return candidate;
        }
        candidate = next;
    }
}

#[cfg(test)]
mod tests;
