//! Liveness, readiness and the metrics endpoint.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde_json::json;

use super::AppState;

/// `GET /healthz`: the process serves HTTP.
pub async fn healthz() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

/// `GET /readyz`: 200 when a name server answers, else 503 with the reason.
pub async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    match state.broker.ping().await {
        Ok(()) => (StatusCode::OK, Json(json!({"status": "ready", "broker": "ok"}))),
        Err(error) => {
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "not_ready", "broker": error.to_string()})))
        }
    }
}

/// `GET /metrics`: Prometheus text exposition.
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    state.publisher.refresh_isolation_gauges();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render())
}
