//! What popgate stores about one transaction: its half message, and how far its end has come. Its JSON
//! form is what the state store's `transactions` family holds, keyed by transaction id.

use serde::{Deserialize, Serialize};

use crate::broker::transaction::{HalfMessage, Resolution};
use crate::clock::Epoch;

/// One transaction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TransactionRecord {
    /// The transaction id the producer was given (the message id, as in RocketMQ).
    pub transaction_id: String,
    /// Where the broker keeps the half message.
    pub half: HalfMessage,
    /// When it was sent.
    pub sent_ms: Epoch,
    /// When the record is removed: an end after it is refused as unknown.
    pub expires_ms: Epoch,
    /// How far its end has come.
    pub state: State,
}

/// How far a transaction's end has come.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "camelCase")]
pub enum State {
    /// Sent, not ended yet.
    Open,
    /// Ended by its producer, but the broker could not be reached: tried again at `next_try_ms`.
    #[serde(rename_all = "camelCase")]
    Owed {
        /// The producer's resolution.
        resolution: Resolution,
        /// It answers the broker's check-back.
        from_check: bool,
        /// A try may have reached the broker (its answer was lost): a commit is looked up before it is sent
        /// again.
        maybe_landed: bool,
        /// Tries that failed since the first.
        attempts: u32,
        /// When.
        next_try_ms: Epoch,
    },
    /// The broker has the resolution.
    #[serde(rename_all = "camelCase")]
    Ended {
        /// How it ended.
        resolution: Resolution,
        /// When.
        at_ms: Epoch,
    },
}
