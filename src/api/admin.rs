//! The admin plane (read-only so far).
//!
//! ```text
//! GET /admin/brokers   [{"broker","addr","isolated","isolatedForMs","lastLatencyMs","lastError","profile":{...}}]
//! ```
//! Each broker as popgate sees it: its fault-avoidance entry (isolated until when, last send latency, last
//! error) and its last reliability-profile check (flush, role, in-sync replicas, shortfalls).

use std::collections::BTreeMap;
use std::time::Instant;

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::AppState;

/// `GET /admin/brokers`.
pub async fn brokers(State(state): State<AppState>) -> Json<Value> {
    let now = Instant::now();
    let mut by_name: BTreeMap<String, Value> = BTreeMap::new();
    for (name, fault) in state.publisher.fault_entries() {
        let remaining = fault.isolated_until.saturating_duration_since(now);
        by_name.insert(
            name.clone(),
            json!({
                "broker": name,
                "isolated": !remaining.is_zero(),
                "isolatedForMs": remaining.as_millis() as u64,
                "lastLatencyMs": fault.last_latency.as_millis() as u64,
                "lastError": fault.last_error,
            }),
        );
    }
    for report in state.profile.reports() {
        let entry = by_name
            .entry(report.broker.clone())
            .or_insert_with(|| json!({"broker": report.broker, "isolated": false, "isolatedForMs": 0}));
        entry["addr"] = Value::String(report.addr.clone());
        entry["profile"] = json!(report);
    }
    Json(json!({"profile": state.profile.profile().name(), "brokers": by_name.into_values().collect::<Vec<_>>()}))
}
