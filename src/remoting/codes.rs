//! The request and response codes of RocketMQ's remoting protocol the front uses (`RequestCode`,
//! `ResponseCode` of Apache's `rocketmq-remoting`), and the metric label of each request code.

// Request codes.
pub(super) const SEND_MESSAGE: i32 = 10;
pub(super) const PULL_MESSAGE: i32 = 11;
pub(super) const QUERY_CONSUMER_OFFSET: i32 = 14;
pub(super) const UPDATE_CONSUMER_OFFSET: i32 = 15;
pub(super) const SEARCH_OFFSET_BY_TIMESTAMP: i32 = 29;
pub(super) const GET_MAX_OFFSET: i32 = 30;
pub(super) const GET_MIN_OFFSET: i32 = 31;
pub(super) const GET_EARLIEST_MSG_STORETIME: i32 = 32;
pub(super) const VIEW_MESSAGE_BY_ID: i32 = 33;
pub(super) const HEART_BEAT: i32 = 34;
pub(super) const UNREGISTER_CLIENT: i32 = 35;
pub(super) const CONSUMER_SEND_MSG_BACK: i32 = 36;
pub(super) const END_TRANSACTION: i32 = 37;
pub(super) const GET_CONSUMER_LIST_BY_GROUP: i32 = 38;
pub(super) const CHECK_TRANSACTION_STATE: i32 = 39;
pub(super) const NOTIFY_CONSUMER_IDS_CHANGED: i32 = 40;
pub(super) const LOCK_BATCH_MQ: i32 = 41;
pub(super) const UNLOCK_BATCH_MQ: i32 = 42;
pub(super) const CHECK_CLIENT_CONFIG: i32 = 46;
pub(super) const GET_ROUTEINFO_BY_TOPIC: i32 = 105;
pub(super) const SEND_MESSAGE_V2: i32 = 310;
pub(super) const SEND_BATCH_MESSAGE: i32 = 320;
pub(super) const LITE_PULL_MESSAGE: i32 = 361;
pub(super) const QUERY_ASSIGNMENT: i32 = 400;
pub(super) const POP_MESSAGE: i32 = 200050;
pub(super) const ACK_MESSAGE: i32 = 200051;
pub(super) const CHANGE_MESSAGE_INVISIBLETIME: i32 = 200053;
pub(super) const BATCH_ACK_MESSAGE: i32 = 200151;

// Response codes.
pub(super) const SUCCESS: i32 = 0;
pub(super) const SYSTEM_ERROR: i32 = 1;
pub(super) const SYSTEM_BUSY: i32 = 2;
pub(super) const REQUEST_CODE_NOT_SUPPORTED: i32 = 3;
pub(super) const TRANSACTION_FAILED: i32 = 4;
pub(super) const MESSAGE_ILLEGAL: i32 = 13;
pub(super) const SERVICE_NOT_AVAILABLE: i32 = 14;
pub(super) const NO_PERMISSION: i32 = 16;
pub(super) const TOPIC_NOT_EXIST: i32 = 17;
pub(super) const PULL_NOT_FOUND: i32 = 19;
pub(super) const PULL_RETRY_IMMEDIATELY: i32 = 20;
pub(super) const PULL_OFFSET_MOVED: i32 = 21;
pub(super) const QUERY_NOT_FOUND: i32 = 22;
pub(super) const SUBSCRIPTION_PARSE_FAILED: i32 = 23;
/// A pull of a consumer group, or a topic of it, the broker has no subscription of.
pub(super) const SUBSCRIPTION_NOT_EXIST: i32 = 24;
/// A pull naming a newer subscription than the broker has of its group.
pub(super) const SUBSCRIPTION_NOT_LATEST: i32 = 25;
pub(super) const INVALID_PARAMETER: i32 = 29;
pub(super) const NO_MESSAGE: i32 = 208;
pub(super) const POLLING_TIMEOUT: i32 = 210;

/// Every request code the front serves, with its metric label (RocketMQ's name, lower case).
pub(super) const SERVED: &[(i32, &str)] = &[
    (SEND_MESSAGE, "send_message"),
    (PULL_MESSAGE, "pull_message"),
    (QUERY_CONSUMER_OFFSET, "query_consumer_offset"),
    (UPDATE_CONSUMER_OFFSET, "update_consumer_offset"),
    (SEARCH_OFFSET_BY_TIMESTAMP, "search_offset_by_timestamp"),
    (GET_MAX_OFFSET, "get_max_offset"),
    (GET_MIN_OFFSET, "get_min_offset"),
    (GET_EARLIEST_MSG_STORETIME, "get_earliest_msg_storetime"),
    (HEART_BEAT, "heart_beat"),
    (UNREGISTER_CLIENT, "unregister_client"),
    (CONSUMER_SEND_MSG_BACK, "consumer_send_msg_back"),
    (END_TRANSACTION, "end_transaction"),
    (GET_CONSUMER_LIST_BY_GROUP, "get_consumer_list_by_group"),
    (LOCK_BATCH_MQ, "lock_batch_mq"),
    (UNLOCK_BATCH_MQ, "unlock_batch_mq"),
    (CHECK_CLIENT_CONFIG, "check_client_config"),
    (GET_ROUTEINFO_BY_TOPIC, "get_routeinfo_by_topic"),
    (SEND_MESSAGE_V2, "send_message_v2"),
    (SEND_BATCH_MESSAGE, "send_batch_message"),
    (LITE_PULL_MESSAGE, "lite_pull_message"),
    (QUERY_ASSIGNMENT, "query_assignment"),
    (POP_MESSAGE, "pop_message"),
    (ACK_MESSAGE, "ack_message"),
    (CHANGE_MESSAGE_INVISIBLETIME, "change_message_invisibletime"),
];

/// Whether a request of code `code` may reach its broker twice without effect beyond the first: everything
/// the front relays reads or sets a state (a pull, an offset, a lock) but a send-back and a transaction's end,
/// each of which stores a message again when repeated.
pub(super) fn repeat_is_harmless(code: i32) -> bool {
    code != CONSUMER_SEND_MSG_BACK && code != END_TRANSACTION
}

/// The label of request code `code` in the front's metrics; `other` for a code it does not serve.
pub(super) fn request_label(code: i32) -> &'static str {
    SERVED.iter().find(|(served, _)| *served == code).map_or("other", |(_, label)| label)
}

/// The result label of an answer with response code `code`: `ok` for what a client takes as a normal answer
/// (a pull or POP that found nothing, an offset the broker does not have yet), else the code's name.
pub(super) fn result_label(code: i32) -> &'static str {
    match code {
        SUCCESS | PULL_NOT_FOUND | PULL_RETRY_IMMEDIATELY | PULL_OFFSET_MOVED | QUERY_NOT_FOUND | POLLING_TIMEOUT => {
            "ok"
        }
        SYSTEM_ERROR => "system_error",
        SYSTEM_BUSY => "system_busy",
        REQUEST_CODE_NOT_SUPPORTED => "not_supported",
        MESSAGE_ILLEGAL => "message_illegal",
        SERVICE_NOT_AVAILABLE => "service_not_available",
        NO_PERMISSION => "no_permission",
        TOPIC_NOT_EXIST => "topic_not_exist",
        SUBSCRIPTION_PARSE_FAILED => "subscription_parse_failed",
        INVALID_PARAMETER => "invalid_parameter",
        NO_MESSAGE => "no_message",
        _ => "other_error",
    }
}
