//! The HTTP API.
//!
//! ```text
//! POST /events/publish[?topic=&mode=sync|async|oneway]   publish one event (popgate JSON or CloudEvents)
//! POST /events/subscribe, /events/unsubscribe            manage subscriptions (see [`events`])
//! GET  /events/poll                                      long-poll deliveries
//! GET  /events/stream, /events/ws                        push deliveries over SSE or WebSocket (see [`push`])
//! POST /events/ack, /events/nack, /events/term           settle deliveries
//! GET  /healthz                                          the process is up
//! GET  /readyz                                           a name server answers and the state store writes
//! GET  /metrics                                          Prometheus text format
//! GET  /admin/brokers                                    each broker: fault-avoidance state and profile check
//! ```
//!
//! Every error is `{"error":{"code","message","field"}}` ([`ApiError`]).

mod admin;
mod error;
pub mod events;
mod health;
mod publish;
mod push;

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;

pub use error::ApiError;

use crate::broker::BrokerClient;
use crate::config::Config;
use crate::delivery::Dispatcher;
use crate::publish::Publisher;
use crate::reliability::ProfileMonitor;

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    /// The effective configuration.
    pub config: Arc<Config>,
    /// The cluster connection (readiness).
    pub broker: Arc<BrokerClient>,
    /// The publish path.
    pub publisher: Arc<Publisher>,
    /// The consume path.
    pub dispatcher: Arc<Dispatcher>,
    /// The reliability profile's broker checks.
    pub profile: Arc<ProfileMonitor>,
    /// Renders `/metrics`.
    pub metrics: PrometheusHandle,
}

/// Room for JSON framing and base64 (4/3) around the largest message body.
fn body_limit(max_message_bytes: usize) -> usize {
    max_message_bytes.saturating_mul(4) / 3 + 64 * 1024
}

/// The router with every route of the API.
pub fn router(state: AppState) -> Router {
    let limit = body_limit(state.config.publish.max_message_bytes);
    Router::new()
        .route("/events/publish", post(publish::publish))
        .route("/events/subscribe", post(events::subscribe))
        .route("/events/unsubscribe", post(events::unsubscribe))
        .route("/events/poll", get(events::poll))
        .route("/events/stream", get(push::stream))
        .route("/events/ws", get(push::websocket))
        .route("/events/ack", post(events::ack))
        .route("/events/nack", post(events::nack))
        .route("/events/term", post(events::term))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .route("/admin/brokers", get(admin::brokers))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}
