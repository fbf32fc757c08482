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
use super::service::{error, field, Front};
use crate::auth::{Action, Caller};
use crate::metrics as m;
use crate::transaction::{CheckForwarder, Orphan, Resolution, TransactionError};

/// `commitOrRollback` values (`MessageSysFlag.TRANSACTION_*_TYPE`).
const COMMIT: i32 = 8;
const ROLLBACK: i32 = 12;
const NOT_DECIDED: i32 = 0;
/// `ResponseCode.TRANSACTION_FAILED`.
const TRANSACTION_FAILED: i32 = 4;

/// `END_TRANSACTION` (one-way from the client; the answer is for a client that asks two-way).
pub(super) async fn end_transaction(front: &Front, caller: &Caller, request: &RemotingCommand) -> RemotingCommand {
    let from_check = field(request, "fromTransactionCheck") == Some("true");
    let resolution = match field(request, "commitOrRollback").and_then(|v| v.parse::<i32>().ok()) {
        Some(COMMIT) => Resolution::Commit,
        Some(ROLLBACK) => Resolution::Rollback,
        Some(NOT_DECIDED) => {
            // The producer does not know yet: the broker asks again at its next check.
            if from_check {
                counter!(m::TRANSACTION_CHECK_ANSWERS, "front" => "remoting", "answer" => "unknown").increment(1);
            }
            return RemotingCommand::create_success_response_command();
        }
        other => return error(codes::SYSTEM_ERROR, format!("END_TRANSACTION with commitOrRollback {other:?}")),
    };
    let Some((id, topic)) = recorded(front, request) else {
        return relay::to_queue_broker(front, caller, request)
            .await
            .unwrap_or_else(|| error(codes::SYSTEM_ERROR, "the transaction's broker could not be asked"));
    };
    if !caller.may(Action::Publish(&topic)) {
        counter!(m::REQUESTS_REJECTED, "reason" => "forbidden").increment(1);
        return error(codes::NO_PERMISSION, format!("may not publish to `{topic}`"));
    }
    if from_check {
        counter!(m::TRANSACTION_CHECK_ANSWERS, "front" => "remoting", "answer" => resolution.as_str()).increment(1);
    }
    match front.transactions.end(&topic, &id, resolution, from_check, None).await {
        Ok(_) => RemotingCommand::create_success_response_command(),
        Err(failed @ TransactionError::Busy(_)) => error(codes::SYSTEM_BUSY, failed.to_string()),
        Err(failed) => {
            tracing::info!(error = %failed, transaction = %id, "A remoting producer's END_TRANSACTION was refused.");
            error(TRANSACTION_FAILED, failed.to_string())
        }
    }
}

/// The transaction id popgate has a record under, of the ids the request names (`msgId`, the client's
/// message id; `transactionId`), and its topic.
fn recorded(front: &Front, request: &RemotingCommand) -> Option<(String, String)> {
    ["msgId", "transactionId"].iter().filter_map(|name| field(request, name)).find_map(|id| {
        match front.transactions.lookup(id) {
            Ok(Some(record)) => Some((id.to_owned(), record.half.topic)),
            Ok(None) => None,
            Err(error) => {
                tracing::warn!(%error, transaction = id, "Could not read a transaction record.");
                None
            }
        }
    })
}

impl CheckForwarder for Front {
    /// Asks the producer of the half message's group that heartbeat last, one-way as a broker asks; its
    /// answer comes back as an `END_TRANSACTION` with `fromTransactionCheck`.
    fn forward(&self, orphan: &Orphan) -> bool {
        let Some(check) = &orphan.remoting else { return false };
        let Some(connection) = self.clients.producer_connection(&check.producer_group) else { return false };
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
