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

/// `GET /readyz`: 200 when a name server answers and knows a master broker, and the state store's last write
/// succeeded (and, with
/// `reliability.fail_on_mismatch`, no broker is weaker than the profile); else 503 naming what is wrong. The
/// profile check is always reported.
pub async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let broker = state.publisher.readiness().await;
    let store_ok = state.deliveries.store_healthy();
    let mismatch = state.profile.any_mismatch();
    let mismatch_blocks = mismatch && state.config.reliability.fail_on_mismatch;
    let ready = broker.is_ok() && store_ok && !mismatch_blocks;
    let weaker: Vec<_> = state
        .profile
        .reports()
        .into_iter()
        .filter(|r| !r.shortfalls.is_empty())
        .map(|r| json!({"broker": r.broker, "shortfalls": r.shortfalls}))
        .collect();
    let body = json!({
        "status": if ready { "ready" } else { "not_ready" },
        "broker": broker.as_ref().map_or_else(Clone::clone, |()| "ok".to_owned()),
        "store": if store_ok { "ok" } else { "unhealthy: the last state write failed" },
        "profile": {"name": state.profile.profile().name(), "mismatch": mismatch, "weakerBrokers": weaker},
    });
    (if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, Json(body))
}

/// `GET /metrics`: Prometheus text exposition.
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    state.publisher.refresh_isolation_gauges();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render())
}
