//! Integration tests: popgate (the real binary) in front of a real Apache RocketMQ 5.x name server and
//! brokers, started by [`harness`] on 127.0.0.1, spoken to with a real HTTP client.

mod dashboards;
mod delivery;
mod dlq;
mod fuzz;
mod harness;
mod metrics;
mod ordered;
mod publish;
mod push;
mod reliability;
mod security;
mod webhook;
