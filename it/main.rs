//! Integration tests: popgate (the real binary) in front of a real Apache RocketMQ 5.x name server and
//! brokers, started by [`harness`] on 127.0.0.1, spoken to with a real HTTP client.

// The async state machines of the longer tests nest deeply enough to pass the default limit of 128.
#![recursion_limit = "256"]

mod apache_parity;
mod cluster_acl;
mod config;
mod dashboards;
mod data;
mod delivery;
mod delivery_core;
mod dlq;
mod fuzz;
mod gateway;
mod gauges;
mod go_client;
#[macro_use]
mod grpc;
mod grpc_raw;
mod harness;
mod hostile;
mod lease;
mod metrics;
mod ordered;
mod publish;
mod push;
mod reliability;
mod remoting;
mod remoting_hostile;
mod rust_client;
mod scopes;
mod security;
mod tier;
mod transaction;
mod transaction_http;
mod webhook;
