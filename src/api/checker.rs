//! The brokers' check-backs of HTTP producers' transactions: POSTed to the checker URL of the producer group
//! the publish named (`transactions.checkers.<group>`), signed as webhook deliveries are.
//!
//! ```text
//! POST <url>
//! content-type: application/json
//! X-Popgate-Transaction-Id: <id>    X-Popgate-Timestamp: <unix seconds>
//! X-Popgate-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>.<transactionId>.<body>")>
//!
//! {"transactionId","topic","producerGroup","event":{"id","topic","tags","keys","properties","bornTimestamp",
//!  "data"|"dataBase64"}}
//! ```
//!
//! The checker answers 2xx `{"resolution": "commit" | "rollback" | "unknown"}`. A commit or rollback ends
//! the transaction (as a check-back's answer); `unknown`, any other answer, a timeout or a connection failure
//! leave it to the broker, which asks again at its next check (every `transactionCheckInterval`, 15 times).

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use metrics::counter;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::Semaphore;

use super::events::event_json;
use super::webhook::signature;
use crate::auth::Caller;
use crate::config::CheckerConfig;
use crate::gateway::below::{CheckForwarder, Orphan, Resolution, Transactions};
use crate::gateway::{EndRequest, Ending};
use crate::metrics as m;

/// Check-back requests in flight at once to one checker; more wait.
const MAX_IN_FLIGHT: usize = 16;

/// The HTTP checkers, by producer group.
pub struct HttpCheckers {
    client: reqwest::Client,
    checkers: HashMap<String, Checker>,
    transactions: Weak<Transactions>,
}

struct Checker {
    group: String,
    config: CheckerConfig,
    in_flight: Arc<Semaphore>,
}

#[derive(Deserialize)]
struct Answer {
    resolution: String,
}

impl HttpCheckers {
    /// The checkers of `configured`, asking on behalf of `transactions`; registers them as its first
    /// forwarder, so a check-back whose producer named a checker goes there before any gRPC producer.
    ///
    /// # Errors
    /// When the HTTP client cannot be built.
    pub fn register(
        configured: &std::collections::BTreeMap<String, CheckerConfig>,
        transactions: &Arc<Transactions>,
    ) -> reqwest::Result<Arc<HttpCheckers>> {
        let client = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build()?;
        let checkers = configured
            .iter()
            .map(|(group, config)| {
                let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
                (group.clone(), Checker { group: group.clone(), config: config.clone(), in_flight })
            })
            .collect();
        let checkers = Arc::new(HttpCheckers { client, checkers, transactions: Arc::downgrade(transactions) });
        let forwarder: Weak<dyn CheckForwarder> = Arc::downgrade(&checkers) as _;
        transactions.add_forwarder(forwarder);
        Ok(checkers)
    }
}

impl CheckForwarder for HttpCheckers {
    fn forward(&self, orphan: &Orphan) -> bool {
        let Some(checker) = orphan.http_checker.as_ref().and_then(|group| self.checkers.get(group)) else {
            return false;
        };
        let ask = ask(
            self.client.clone(),
            checker.group.clone(),
            checker.config.clone(),
            checker.in_flight.clone(),
            self.transactions.clone(),
            orphan.clone(),
        );
        tokio::spawn(ask);
        true
    }
}

/// Asks the checker, and ends the transaction as it answers.
async fn ask(
    client: reqwest::Client,
    group: String,
    config: CheckerConfig,
    in_flight: Arc<Semaphore>,
    transactions: Weak<Transactions>,
    orphan: Orphan,
) {
    let Ok(_permit) = in_flight.acquire_owned().await else { return };
    let id = &orphan.transaction_id;
    let answer = match post(&client, &group, &config, &orphan).await {
        Ok(answer) => answer,
        Err(why) => {
            tracing::warn!(transaction = %id, producer_group = %group, error = %why, "A transaction checker did not answer; the broker will ask again.");
            counter!(m::TRANSACTION_CHECK_ANSWERS, "front" => "http", "answer" => "failed").increment(1);
            return;
        }
    };
    let resolution = match answer.as_str() {
        "commit" => Some(Resolution::Commit),
        "rollback" => Some(Resolution::Rollback),
        _ => None,
    };
    let Some(transactions) = transactions.upgrade() else { return };
    // Ended through the gateway, as every front ends a transaction (it counts the answer, `unknown` included).
    // The checker is the operator's configuration (`transactions.checkers.<group>`), not a client: it answers
    // for the producer group the broker asked, with the rights the operator gave it by naming it.
    let ending = Ending { transactions: &transactions, front: "http", owners: None };
    let request = EndRequest { id, topic: Some(&orphan.event.topic), resolution, from_check: true, answer_by: None };
    if let Err(error) = ending.end(&Caller::unrestricted(), request).await {
        tracing::warn!(transaction = %id, %error, "Could not end a transaction as its checker answered; the broker will ask again.");
    }
}

/// POSTs the check-back and reads the checker's resolution word (`unknown` for anything it does not say).
async fn post(
    client: &reqwest::Client,
    group: &str,
    config: &CheckerConfig,
    orphan: &Orphan,
) -> Result<String, String> {
    let body = json!({
        "transactionId": orphan.transaction_id,
        "topic": orphan.event.topic,
        "producerGroup": group,
        "event": event_json(&orphan.event),
    });
    let body = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
    let timestamp = crate::clock::wall_clock_secs();
    let response = client
        .post(&config.url)
        .timeout(Duration::from_millis(config.timeout_ms))
        .header("content-type", "application/json")
        .header("X-Popgate-Transaction-Id", &orphan.transaction_id)
        .header("X-Popgate-Timestamp", timestamp.to_string())
        .header("X-Popgate-Signature", signature(&config.secret, timestamp, &orphan.transaction_id, &body))
        .body(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status();
    if !status.is_success() {
        return Err(format!("answered {status}"));
    }
    let answer: Answer = response.json().await.map_err(|e| format!("answered no {{\"resolution\"}}: {e}"))?;
    Ok(answer.resolution)
}
