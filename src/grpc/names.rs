//! Topic and consumer-group names as Apache's proxy checks them (`GrpcValidator`), with its codes and words:
//! apps written against it match on them. popgate's own naming rule (`config::names`) is the same character set
//! and the same 127-character topic limit.

use super::proto::{self as pb, Code};
use super::status::bad;
use crate::publish::is_valid_name;

/// Apache's description of the allowed characters, quoted in its refusals.
const ALLOWED: &str = "^[%|a-zA-Z0-9_-]+$";
/// Topics RocketMQ keeps for itself (`TopicValidator.SYSTEM_TOPIC_SET`); `rmq_sys_…` are system topics too.
const SYSTEM_TOPICS: [&str; 10] = [
    "TBW102",
    "SCHEDULE_TOPIC_XXXX",
    "BenchmarkTest",
    "RMQ_SYS_TRANS_HALF_TOPIC",
    "RMQ_SYS_TRACE_TOPIC",
    "RMQ_SYS_TRANS_OP_HALF_TOPIC",
    "TRANS_CHECK_MAX_TIME_TOPIC",
    "SELF_TEST_TOPIC",
    "OFFSET_MOVED_EVENT",
    "CHECKPOINT_TOPIC",
];

fn allowed_characters(name: &str) -> bool {
    name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '%' | '|'))
}

/// The topic a resource names, or `ILLEGAL_TOPIC`.
pub(super) fn topic(resource: Option<&pb::Resource>) -> Result<String, pb::Status> {
    let name = resource.map(|r| r.name.clone()).unwrap_or_default();
    let refusal = if name.trim().is_empty() {
        "The specified topic is blank".to_owned()
    } else if name.chars().count() > 127 {
        "The specified topic is longer than topic max length 127.".to_owned()
    } else if !allowed_characters(&name) {
        format!("The specified topic[{name}] contains illegal characters, allowing only {ALLOWED}")
    } else if SYSTEM_TOPICS.contains(&name.as_str()) || name.starts_with("rmq_sys_") {
        "cannot access system topic".to_owned()
    } else {
        return Ok(name);
    };
    Err(bad(Code::IllegalTopic, refusal))
}

/// The consumer group a resource names, or `ILLEGAL_CONSUMER_GROUP`. Apache allows 255 characters; popgate's
/// delivery state keys groups like topics (at most 127), and says so.
pub(super) fn group(resource: Option<&pb::Resource>) -> Result<String, pb::Status> {
    let name = resource.map(|r| r.name.clone()).unwrap_or_default();
    let refusal = if name.trim().is_empty() {
        "the specified group is blank".to_owned()
    } else if !allowed_characters(&name) {
        format!("the specified group[{name}] contains illegal characters, allowing only {ALLOWED}")
    } else if name.starts_with("CID_RMQ_SYS_") {
        "cannot use system consumer group".to_owned()
    } else if !is_valid_name(&name) {
        "the specified group is longer than popgate's group max length 127.".to_owned()
    } else {
        return Ok(name);
    };
    Err(bad(Code::IllegalConsumerGroup, refusal))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str) -> Option<pb::Resource> {
        Some(pb::Resource { resource_namespace: String::new(), name: name.to_owned() })
    }

    #[test]
    fn names_are_refused_in_apaches_words() {
        let message = |r: Result<String, pb::Status>| r.expect_err("refused").message;
        assert_eq!(message(topic(named("").as_ref())), "The specified topic is blank");
        assert_eq!(
            message(topic(named(&"t".repeat(128)).as_ref())),
            "The specified topic is longer than topic max length 127."
        );
        assert_eq!(
            message(topic(named("a b").as_ref())),
            "The specified topic[a b] contains illegal characters, allowing only ^[%|a-zA-Z0-9_-]+$"
        );
        assert_eq!(message(topic(named("rmq_sys_x").as_ref())), "cannot access system topic");
        assert_eq!(message(group(named(" ").as_ref())), "the specified group is blank");
        assert_eq!(message(group(named("CID_RMQ_SYS_x").as_ref())), "cannot use system consumer group");
        assert_eq!(topic(named("orders").as_ref()).expect("valid"), "orders");
        assert_eq!(group(named("%RETRY%g").as_ref()).expect("valid"), "%RETRY%g");
    }
}
