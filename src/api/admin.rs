//! The admin plane: every route needs a token with the admin right.
//!
//! ```text
//! GET    /admin/dlq/browse?topic=%DLQ%<g>|group=<g>[&max=&cursor=&originTopic=&ids=a,b]
//!                                   200 {"topic","messages":[{"messageId","originTopic","originMessageId","attempts",
//!                                        "lastFailure","deadLetteredAt","tags","keys","properties","data"|"dataBase64",
//!                                        ...}],"nextCursor"?}   (reads only: browsing twice shows the same)
//! POST   /admin/dlq/replay?topic=|group=[&max=&rate=&ids=&originTopic=]
//!                                   200 {"topic","results":[{"messageId","originTopic","status","eventId","resumed"}]}
//! GET    /admin/deliveries[?group=&max=]   in-flight deliveries (attempt, phase, deadline, subscriber)
//! GET    /admin/subscriptions              every subscription, with its `id` (`<group>:<topic>`)
//! DELETE /admin/subscriptions/{id}         unsubscribe (undelivered events go back to the broker unACKed)
//! GET    /admin/brokers                    each broker: fault-avoidance state and profile check
//! GET    /admin/config                     the effective configuration, secrets redacted
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use super::events::{number_param, subscription_json};
use super::{ApiError, AppState};
use crate::dlq::{dlq_topic_of, BrowseRequest, DlqError, ReplayRequest};

/// Page size when `max` is absent.
const DEFAULT_BROWSE_MAX: usize = 32;
/// Most in-flight deliveries one listing returns.
const MAX_DELIVERIES: usize = 10_000;
/// What stands in for a secret in answers.
const REDACTED: &str = "<redacted>";

/// The HTTP answer for a DLQ failure.
fn dlq_error(error: DlqError) -> ApiError {
    match error {
        DlqError::Invalid(field, message) => ApiError::invalid_field(field, message),
        DlqError::Busy(_) => ApiError::conflict(error.to_string()),
        DlqError::Broker(_) | DlqError::Store(_) => {
            tracing::warn!(%error, "DLQ request failed.");
            ApiError::unavailable(error.to_string(), json!({}))
        }
    }
}

fn ids(query: &HashMap<String, String>) -> Option<HashSet<String>> {
    query.get("ids").map(|ids| ids.split(',').map(str::trim).filter(|id| !id.is_empty()).map(str::to_owned).collect())
}

fn dlq_topic(query: &HashMap<String, String>) -> Result<String, ApiError> {
    dlq_topic_of(query.get("topic").map(String::as_str), query.get("group").map(String::as_str)).map_err(dlq_error)
}

/// `GET /admin/dlq/browse`.
pub async fn dlq_browse(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let request = BrowseRequest {
        dlq_topic: dlq_topic(&query)?,
        max: number_param(&query, "max", DEFAULT_BROWSE_MAX)?,
        cursor: query.get("cursor").cloned(),
        origin_topic: query.get("originTopic").cloned(),
        ids: ids(&query),
    };
    let page = state.dlq.browse(&request).await.map_err(dlq_error)?;
    Ok(Json(json!(page)))
}

/// `POST /admin/dlq/replay`.
pub async fn dlq_replay(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let topic = dlq_topic(&query)?;
    let rate = number_param(&query, "rate", state.config.admin.replay_rate_per_sec)?;
    let request = ReplayRequest {
        dlq_topic: topic.clone(),
        max: number_param(&query, "max", DEFAULT_BROWSE_MAX)?,
        rate_per_sec: rate,
        ids: ids(&query),
        origin_topic: query.get("originTopic").cloned(),
    };
    let results = state.dlq.replay(&request).await.map_err(dlq_error)?;
    Ok(Json(json!({"topic": topic, "results": results})))
}

/// `GET /admin/deliveries`.
pub async fn deliveries(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let max = number_param(&query, "max", 100)?;
    if !(1..=MAX_DELIVERIES).contains(&max) {
        return Err(ApiError::invalid_field("max", format!("must be in 1..={MAX_DELIVERIES}")));
    }
    let group = query.get("group").map(String::as_str).filter(|g| !g.is_empty());
    Ok(Json(json!({"deliveries": state.deliveries.in_flight(group, max)})))
}

/// `GET /admin/subscriptions`.
pub async fn subscriptions(State(state): State<AppState>) -> Json<Value> {
    let mut subs = state.deliveries.subscriptions();
    subs.sort_by(|a, b| (&a.group, &a.topic).cmp(&(&b.group, &b.topic)));
    let subs: Vec<Value> = subs.iter().map(subscription_json).collect();
    Json(json!({ "subscriptions": subs }))
}

/// `DELETE /admin/subscriptions/{id}` where `id` is `<group>:<topic>`.
pub async fn delete_subscription(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let (group, topic) =
        id.split_once(':').ok_or_else(|| ApiError::invalid_field("id", "a subscription id is <group>:<topic>"))?;
    state.deliveries.remove_subscription(group, topic).await?;
    Ok((StatusCode::OK, Json(json!({"status": "unsubscribed", "id": id}))))
}

/// `GET /admin/config`: the effective configuration with every secret replaced.
pub async fn config(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let mut config = state.config.as_ref().clone();
    for token in &mut config.auth.tokens {
        token.token = token.token.as_ref().map(|_| REDACTED.to_owned());
        token.sha256 = token.sha256.as_ref().map(|_| REDACTED.to_owned());
    }
    for checker in config.transactions.checkers.values_mut() {
        checker.secret = REDACTED.to_owned();
    }
    if !config.tier.secret.is_empty() {
        config.tier.secret = REDACTED.to_owned();
    }
    if !config.broker.secret_key.is_empty() {
        config.broker.secret_key = REDACTED.to_owned();
    }
    let value = serde_json::to_value(&config).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(Json(value))
}

/// `GET /admin/brokers`: each broker as popgate sees it: its fault-avoidance entry (isolated until when, last
/// send latency, last error) and its last reliability-profile check (flush, role, in-sync replicas).
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
