//! The HTTP API.
//!
//! ```text
//! POST /events/publish[?topic=&mode=sync|async|oneway]   publish one event (popgate JSON or CloudEvents)
//! POST /events/subscribe, /events/unsubscribe            manage subscriptions (see [`events`])
//! GET  /events/poll                                      long-poll deliveries
//! GET  /events/stream, /events/ws                        push deliveries over SSE or WebSocket (see [`push`])
//! (a subscription's `push`)                              push deliveries to a webhook (see [`webhook`])
//! POST /events/ack, /events/nack, /events/term           settle deliveries
//! POST /events/transactions/{id}, GET the same            end a transactional publish, or read it (see [`transactions`])
//! GET  /healthz                                          the process is up
//! GET  /readyz                                           a name server answers and the state store writes
//! GET  /metrics                                          Prometheus text format
//! GET  /openapi.json                                     the OpenAPI 3 description of all of this
//! /admin/...                                             the admin plane (see [`admin`])
//! ```
//!
//! Every error is `{"error":{"code","message","field"}}` ([`ApiError`]). Every request passes [`guard`]
//! first: a request id (`X-Request-Id`), URI/header/body size limits, then a bearer token for the `/events`
//! and `/admin` routes, whose body is then read in within its time. [`server`] serves the connections.

mod admin;
pub(crate) mod checker;
mod error;
pub(crate) mod events;
pub(crate) mod guard;
mod health;
pub(crate) mod listener;
mod openapi;
mod publish;
mod push;
pub(crate) mod server;
pub(crate) mod tls;
mod transactions;
pub(crate) mod webhook;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::response::IntoResponse;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;

pub use error::ApiError;

use crate::auth::TokenTable;
use crate::config::Config;
use crate::dlq::DlqAdmin;
use crate::gateway::below::Transactions;
use crate::gateway::Deliveries;
use crate::publish::Publisher;
use crate::reliability::ProfileMonitor;
use guard::{ConnectionLimits, SizeLimits};

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    /// The effective configuration.
    pub config: Arc<Config>,
    /// The publish path.
    pub publisher: Arc<Publisher>,
    /// The consume path.
    pub deliveries: Deliveries,
    /// The reliability profile's broker checks.
    pub profile: Arc<ProfileMonitor>,
    /// Transactional publishes' records and ends.
    pub transactions: Arc<Transactions>,
    /// DLQ browse and replay.
    pub dlq: Arc<DlqAdmin>,
    /// The bearer tokens.
    pub tokens: Arc<TokenTable>,
    /// Per-token limits on waiting long-polls and open streams.
    pub limits: Arc<ConnectionLimits>,
    /// Renders `/metrics`.
    pub metrics: PrometheusHandle,
    /// The tier's other instances, when this one is in a tier.
    pub owners: Option<Arc<dyn crate::gateway::Owners>>,
    /// The webhook pushers (and which addresses a webhook may reach).
    pub webhooks: Arc<webhook::Webhooks>,
}

impl AppState {
    /// The gateway's publish path.
    pub fn publishing(&self) -> crate::gateway::Publishing<'_> {
        crate::gateway::Publishing { publisher: &self.publisher, transactions: &self.transactions, front: "http" }
    }

    /// Ending transactions, through the gateway.
    pub fn ending(&self) -> crate::gateway::Ending<'_> {
        crate::gateway::Ending { transactions: &self.transactions, front: "http", owners: self.owners.as_ref() }
    }

    /// Settling deliveries, through the gateway.
    pub fn settling(&self) -> crate::gateway::Settling<'_> {
        self.deliveries.settling(self.owners.as_ref())
    }
}

/// One route of the API: its method and path (axum's `{param}` syntax, which is OpenAPI's too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Route {
    /// `GET`, `POST`, `DELETE`.
    pub method: &'static str,
    /// The path.
    pub path: &'static str,
}

/// Declares a group of routes once: the router that serves them and the table [`routes`] (and the OpenAPI
/// test) read, so the two cannot drift apart.
macro_rules! route_group {
    ($table:ident, $build:ident, [$($method:ident $path:literal => $handler:path),* $(,)?]) => {
        const $table: &[Route] = &[$(Route { method: route_group!(@upper $method), path: $path }),*];
        fn $build() -> Router<AppState> {
            Router::new()$(.route($path, axum::routing::$method($handler)))*
        }
    };
    (@upper get) => { "GET" };
    (@upper post) => { "POST" };
    (@upper delete) => { "DELETE" };
}

// Open to anyone: probes, scraping and the API description.
route_group!(PUBLIC_ROUTES, public_routes, [
    get "/healthz" => health::healthz,
    get "/readyz" => health::readyz,
    get "/metrics" => health::metrics,
    get "/openapi.json" => openapi::document,
]);

// A token allowed on the topic (publish) or group (everything else).
route_group!(DATA_ROUTES, data_routes, [
    post "/events/publish" => publish::publish,
    post "/events/subscribe" => events::subscribe,
    post "/events/unsubscribe" => events::unsubscribe,
    get "/events/poll" => events::poll,
    get "/events/stream" => push::stream,
    get "/events/ws" => push::websocket,
    post "/events/ack" => events::ack,
    post "/events/nack" => events::nack,
    post "/events/term" => events::term,
    post "/events/transactions/{id}" => transactions::end,
    get "/events/transactions/{id}" => transactions::show,
]);

// A token with the admin right.
route_group!(ADMIN_ROUTES, admin_routes, [
    get "/admin/dlq/browse" => admin::dlq_browse,
    post "/admin/dlq/replay" => admin::dlq_replay,
    get "/admin/deliveries" => admin::deliveries,
    get "/admin/subscriptions" => admin::subscriptions,
    delete "/admin/subscriptions/{id}" => admin::delete_subscription,
    get "/admin/brokers" => admin::brokers,
    get "/admin/config" => admin::config,
]);

/// Every route the router serves, sorted.
pub fn routes() -> Vec<Route> {
    let mut all: Vec<Route> = [PUBLIC_ROUTES, DATA_ROUTES, ADMIN_ROUTES].concat();
    all.sort();
    all
}

/// Room for JSON framing and base64 (4/3) around the largest message body.
fn body_limit(max_message_bytes: usize) -> usize {
    max_message_bytes.saturating_mul(4) / 3 + 64 * 1024
}

/// The router with every route of the API, behind its guards: request ids, size limits, authentication
/// (data and admin routes), the admin right (admin routes).
pub fn router(state: AppState) -> Router {
    let limits = SizeLimits {
        max_uri_bytes: state.config.server.max_uri_bytes,
        max_header_bytes: state.config.server.max_header_bytes,
        max_body_bytes: body_limit(state.config.publish.max_message_bytes),
    };
    let body = guard::BodyLimits {
        max_body_bytes: limits.max_body_bytes,
        timeout: Duration::from_secs(state.config.server.body_timeout_secs),
    };
    let admin = admin_routes().route_layer(axum::middleware::from_fn(guard::require_admin));
    // A body is read in (in time, within its limit) only for an authenticated caller.
    let guarded = data_routes()
        .merge(admin)
        .route_layer(axum::middleware::from_fn_with_state(body, guard::read_body_in_time))
        .route_layer(axum::middleware::from_fn_with_state(state.tokens.clone(), guard::authenticate));
    guarded
        .merge(public_routes())
        .fallback(|| async { ApiError::not_found("no such route").into_response() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed().into_response() })
        .layer(DefaultBodyLimit::max(limits.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(limits, guard::size_limits))
        .layer(axum::middleware::from_fn(guard::json_errors))
        .layer(axum::middleware::from_fn(guard::request_id))
        .with_state(state)
}
