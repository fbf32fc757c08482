//! popgate: at-least-once HTTP delivery in front of an Apache RocketMQ 5.x cluster.
//!
//! # Layout
//!
//! - [`config`]: the TOML file and `POPGATE_*` overrides, validated before anything binds.
//! - [`broker`]: the cluster connection (routes, sends), the fault-avoidance table, popgate's message type.
//! - [`publish`]: the publish path: request parsing and RocketMQ's producer policy (retries, broker choice).
//! - [`delivery`]: the consume path: POP, deferred broker ACK, retries, the DLQ, boot recovery.
//! - [`store`]: the RocksDB state store the consume path writes before it acts.
//! - [`reliability`]: the reliability profile checked against each broker's running settings.
//! - [`auth`]: bearer tokens and what each may do.
//! - [`dlq`]: browsing and replaying dead-lettered events (the admin plane's DLQ).
//! - [`api`]: the HTTP routes and the one error type they answer with.
//! - [`metrics`]: every metric's name, help text and buckets.
//! - [`cli`]: the operator CLI's client of the admin API.
//! - [`app`]: wiring and the serve loop; `main.rs` only parses the CLI and waits for a signal.

#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod api;
pub mod app;
pub mod auth;
pub mod broker;
pub mod cli;
pub mod config;
pub mod delivery;
pub mod dlq;
pub mod metrics;
pub mod publish;
pub mod reliability;
pub mod store;

pub use app::{serve, AppError};
pub use config::Config;
