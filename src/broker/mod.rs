//! Everything that talks to, or decides about, the RocketMQ brokers.
//!
//! - [`admin`]: the cluster's brokers and their running configuration.
//! - [`client`]: the connection (routes, sends) over rocketmq-client-rust; no policy.
//! - `error`: [`BrokerError`], what every file here returns.
//! - [`fault`]: the latency fault-avoidance table (MQFaultStrategy) and the broker choice for one attempt.
//! - [`consumer`]: POP, ACK and ChangeInvisibleTime, and the receipt handle they use.
//! - [`pull`]: reading a queue by offset without consuming it (DLQ browsing).
//! - [`relay`]: a remoting client's request passed to a broker or name server unchanged (the remoting front).
//! - [`stats`]: the broker's figures behind the operators' gauges (a group's backlog, a topic's depth).
//! - [`message`]: popgate's message type, free of client-crate types.
//! - [`content`]: what a message's body holds (`POPGATE_CONTENT_TYPE`), and the one rule for how HTTP hands it back.
//! - [`transaction`]: half messages' END_TRANSACTION, and a topic's message type.

pub(crate) mod admin;
pub mod client;
pub mod consumer;
pub(crate) mod content;
mod error;
#[cfg(test)]
pub(crate) mod fake_peer;
pub(crate) mod fault;
pub(crate) mod message;
pub(crate) mod pull;
pub(crate) mod relay;
pub(crate) mod stats;
pub(crate) mod transaction;

pub use client::{batch_message, BrokerClient, BrokerError, BrokerRoute, SendReceipt, StoreStatus, TopicRoute};
pub use message::OutgoingMessage;
