//! Transactional producers (`TransactionMQProducer`): their `END_TRANSACTION`, and the brokers' check-backs,
//! asked of a live producer of the client's group as `CHECK_TRANSACTION_STATE`.
//!
//! A half message a remoting producer sent through popgate has popgate's durable record (see `send`), so its
//! end goes through `transaction::Transactions`: to the broker that stored it, whatever broker the client
//! names, after a popgate restart too, and owed (retried) while that broker cannot be reached. Apache's proxy
//! keeps no record for a remoting producer's half message: its first `END_TRANSACTION` ends nothing, and the
//! message is committed only when the broker checks it back. An end popgate has no record of (a half message
//! sent straight to a broker, or older than `transactions.record_retention_secs`) is relayed to the broker
//! the client names, as a broker would take it.

use metrics::counter;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;

use super::codes;
use super::relay;
use super::service::{error, field, Front, Refusal};
use crate::auth::Caller;
use crate::gateway::below::{CheckForwarder, Orphan, Resolution};
use crate::gateway::below::{PROPERTY_PRODUCER_GROUP, PROPERTY_TRANSACTION_PREPARED};
use crate::gateway::{self, EndRequest, GatewayError};
use crate::metrics as m;

/// `commitOrRollback` values (`MessageSysFlag.TRANSACTION_*_TYPE`).
const COMMIT: i32 = 8;
const ROLLBACK: i32 = 12;
const NOT_DECIDED: i32 = 0;
/// What a broker answers an end whose offsets name no half message (`SYSTEM_ERROR`, "Find prepared transaction
/// message failed").
const NOT_A_HALF_MESSAGE: i32 = codes::SYSTEM_ERROR;
/// The broker's topic of half messages (`TransactionalMessageUtil.buildHalfTopic`).
const HALF_TOPIC: &str = "RMQ_SYS_TRANS_HALF_TOPIC";
/// Where a half message keeps its own topic (`MessageConst.PROPERTY_REAL_TOPIC`).
const PROPERTY_REAL_TOPIC: &str = "REAL_TOPIC";

/// `END_TRANSACTION` (one-way from the client; the answer is for a client that asks two-way).
pub(super) async fn end_transaction(front: &Front, caller: &Caller, request: &RemotingCommand) -> RemotingCommand {
    let from_check = field(request, "fromTransactionCheck") == Some("true");
    let resolution = match field(request, "commitOrRollback").and_then(|v| v.parse::<i32>().ok()) {
        Some(COMMIT) => Some(Resolution::Commit),
        Some(ROLLBACK) => Some(Resolution::Rollback),
        // The producer does not know yet: the broker asks again at its next check.
        Some(NOT_DECIDED) => None,
        other => return error(codes::SYSTEM_ERROR, format!("END_TRANSACTION with commitOrRollback {other:?}")),
    };
    let id = match recorded(front, request) {
        Some(id) => id,
        None if resolution.is_none() => String::new(),
        None => return end_unrecorded(front, caller, request).await,
    };
    let end = EndRequest { id: &id, topic: None, resolution, from_check, answer_by: None };
    match front.ending().end(caller, end).await {
        Ok(_) => RemotingCommand::create_success_response_command(),
        Err(refused) => {
            if matches!(refused, GatewayError::Transaction(_)) {
                tracing::info!(error = %refused, transaction = %id, "A remoting producer's END_TRANSACTION was refused.");
            }
            Refusal::from(refused).answer()
        }
    }
}

/// An end popgate has no record of: relayed to the broker the client names, once that broker says the half
/// message at the end's `commitLogOffset` is one whose topic the caller may publish to. The broker itself acts on
/// the offsets and the producer group alone, so without this look-up anyone who learnt another producer's offsets
/// could end its transaction. A half message popgate sent (under its own producer group: a second one under an id
/// popgate has a record of, say) is ended under that group, which the broker checks.
async fn end_unrecorded(front: &Front, caller: &Caller, request: &RemotingCommand) -> RemotingCommand {
    let half = match half_message(front, request).await {
        Ok(half) => half,
        Err(refusal) => return refusal,
    };
    if let Err(refused) = gateway::may_publish(caller, &half.topic) {
        return Refusal::from(refused).answer();
    }
    let popgates_group = front.transactions.producer_group();
    if half.producer_group == popgates_group && field(request, "producerGroup") != Some(popgates_group) {
        let mut as_popgate = request.clone();
        as_popgate.add_ext_field("producerGroup", popgates_group);
        return relay::ended_elsewhere(front, &as_popgate).await;
    }
    relay::ended_elsewhere(front, request).await
}

/// What an end popgate has no record of needs to know of its half message.
struct StoredHalf {
    /// Its own topic.
    topic: String,
    /// The producer group it was sent under.
    producer_group: String,
}

/// The half message an end names, read from its broker (`VIEW_MESSAGE_BY_ID` at the end's `commitLogOffset`: the
/// half message keeps its topic in `REAL_TOPIC`); the answer refusing the end when there is no half message there.
async fn half_message(front: &Front, request: &RemotingCommand) -> Result<StoredHalf, RemotingCommand> {
    let Some(offset) = field(request, "commitLogOffset").and_then(|v| v.parse::<i64>().ok()) else {
        return Err(error(codes::SYSTEM_ERROR, "END_TRANSACTION without a commitLogOffset"));
    };
    let message = relay::stored_message(front, request, offset, HALF_TOPIC).await.map_err(Refusal::answer)?;
    let half = message.as_ref().and_then(|message| {
        // Read as the broker reads it (`Boolean.parseBoolean`).
        let is_half = message
            .message
            .property(PROPERTY_TRANSACTION_PREPARED)
            .is_some_and(|flag| flag.eq_ignore_ascii_case("true"));
        let topic = message.message.property(PROPERTY_REAL_TOPIC).filter(|_| is_half)?;
        let producer_group = message.message.property(PROPERTY_PRODUCER_GROUP).unwrap_or_default();
        Some(StoredHalf { topic: topic.to_owned(), producer_group: producer_group.to_owned() })
    });
    half.ok_or_else(|| {
        counter!(m::REQUESTS_REJECTED, "reason" => "forbidden").increment(1);
        error(NOT_A_HALF_MESSAGE, format!("no half message at commitLogOffset {offset} of its broker"))
    })
}

/// The transaction id popgate has a record under, of the ids the request names (`msgId`, the client's
/// message id; `transactionId`), when the record is of the half message the end names by its `commitLogOffset`.
/// A client chooses its message ids: a producer that sends the same `Message` again while its first transaction
/// is open keeps the id (popgate keeps the first record), and another token may have recorded an id first. Such
/// an end names another half message than the record's, and is made as one popgate has no record of (relayed
/// once the half message's topic, read from its broker, is one the caller may publish to): it ends its own half
/// message, never the record's.
fn recorded(front: &Front, request: &RemotingCommand) -> Option<String> {
    let named_offset = field(request, "commitLogOffset").and_then(|v| v.parse::<i64>().ok());
    ["msgId", "transactionId"].iter().filter_map(|name| field(request, name)).find_map(|id| {
        match front.transactions.lookup(id) {
            Ok(Some(record)) if named_offset.is_some_and(|offset| offset != record.half.commit_log_offset) => {
                tracing::info!(transaction = id, "An end names another half message than popgate's record of its id.");
                None
            }
            Ok(Some(_)) => Some(id.to_owned()),
            Ok(None) => None,
            Err(error) => {
                tracing::warn!(%error, transaction = id, "Could not read a transaction record.");
                None
            }
        }
    })
}

impl CheckForwarder for Front {
    /// Asks the producer of the half message's group that heartbeat last (of those whose token may publish to
    /// the half message's topic), or else the connection the half message came on, one-way as a broker asks;
    /// its answer comes back as an `END_TRANSACTION` with `fromTransactionCheck`.
    fn forward(&self, orphan: &Orphan) -> bool {
        let Some(check) = &orphan.remoting else { return false };
        let topic = orphan.event.topic.as_ref();
        let connection = self.clients.check_back_connection(&orphan.transaction_id, &check.producer_group, topic);
        let Some(connection) = connection else { return false };
        let mut push = RemotingCommand::create_remoting_command(codes::CHECK_TRANSACTION_STATE)
            .mark_oneway_rpc()
            .set_body(check.encoded.clone());
        push.add_ext_field("tranStateTableOffset", check.tran_state_table_offset.to_string());
        push.add_ext_field("commitLogOffset", check.commit_log_offset.to_string());
        push.add_ext_field("msgId", orphan.transaction_id.as_str());
        push.add_ext_field("transactionId", orphan.transaction_id.as_str());
        push.add_ext_field("offsetMsgId", check.offset_message_id.as_str());
        push.add_ext_field("topic", orphan.event.topic.as_ref());
        connection.push(push)
    }
}
