//! Webhook push: a subscription with `push: {"url","secret","timeoutMs","maxConcurrency"}` has its deliveries
//! POSTed to `url`, one request per delivery, at most `maxConcurrency` at once (the session's prefetch).
//!
//! The request is a CloudEvent in binary mode, so CloudEvents receivers work unchanged:
//!
//! ```text
//! POST <url>
//! ce-specversion: 1.0            ce-id: <event id>      ce-source: <the producer's, or /popgate/<topic>>
//! ce-type: <the producer's, or popgate.event>           (each extension attribute of the event as ce-*)
//! content-type: <the producer's datacontenttype, else what the body holds (broker::content), e.g. application/json>
//! X-Popgate-Delivery-Id: <deliveryId>    X-Popgate-Attempt: <n>    X-Popgate-Timestamp: <unix seconds>
//! X-Popgate-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>.<deliveryId>.<body>")>
//!
//! <the event body>
//! ```
//!
//! The answer settles the delivery: 2xx ACKs it; 429 or 503 with `Retry-After: <seconds>` retries after that
//! delay; any other status (a redirect too: it is not followed), a timeout, a connection failure or a target
//! the guard refuses is a failed attempt (backoff, then the DLQ).
//!
//! - [`target`]: which addresses a webhook may connect to (the SSRF guard, `webhook.allowed_networks`).
//! - [`headers`]: which `ce_*` properties become headers, and how their values are encoded.

pub mod headers;
pub mod target;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use metrics::counter;
use parking_lot::Mutex;
use sha2::Sha256;

use crate::auth::Caller;
use crate::gateway::below::{content, DeliveryError, Dispatched, Subscription, SubscriptionWatcher, WebhookPush};
use crate::gateway::{Deliveries, GatewayError, Reader, Settlement};
use crate::metrics as m;
pub use target::TargetPolicy;

/// Checks a subscription's `push`: the URL (http/https with a host that `targets` permits, when it is an
/// address), the secret and the bounds. A host name is checked at every connection instead, as it resolves then.
///
/// # Errors
/// [`DeliveryError::Invalid`] naming the field.
pub fn validate(push: &WebhookPush, targets: &TargetPolicy) -> Result<(), DeliveryError> {
    let url =
        reqwest::Url::parse(&push.url).map_err(|e| DeliveryError::Invalid("push.url", format!("not a URL: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err(DeliveryError::Invalid("push.url", "must be an http or https URL with a host".into()));
    }
    targets.check_url(&url).map_err(|forbidden| {
        DeliveryError::Invalid(
            "push.url",
            format!("{forbidden}; webhooks may only reach public addresses and webhook.allowed_networks"),
        )
    })?;
    if push.secret.is_empty() {
        return Err(DeliveryError::Invalid("push.secret", "must not be empty".into()));
    }
    if !(100..=300_000).contains(&push.timeout_ms) {
        return Err(DeliveryError::Invalid("push.timeoutMs", "must be in 100..=300000".into()));
    }
    if !(1..=1024).contains(&push.max_concurrency) {
        return Err(DeliveryError::Invalid("push.maxConcurrency", "must be in 1..=1024".into()));
    }
    Ok(())
}

/// The webhook pushers, one per subscription with a `push`: started and stopped as the delivery core says its
/// subscriptions change (and, at boot, for each one it recovered). One per subscription key, so the map is
/// bounded by the subscriptions popgate keeps.
pub struct Webhooks {
    deliveries: Deliveries,
    targets: Arc<TargetPolicy>,
    running: Mutex<HashMap<String, Arc<AtomicBool>>>,
}

impl Webhooks {
    /// Pushers over `deliveries`, connecting only where `targets` permits.
    pub fn new(deliveries: Deliveries, targets: TargetPolicy) -> Arc<Webhooks> {
        Arc::new(Webhooks { deliveries, targets: Arc::new(targets), running: Mutex::new(HashMap::new()) })
    }

    /// Which addresses a webhook may reach.
    pub fn targets(&self) -> &TargetPolicy {
        &self.targets
    }

    fn stop(&self, key: &str) {
        if let Some(stop) = self.running.lock().remove(key) {
            stop.store(true, Ordering::Relaxed);
        }
    }
}

impl SubscriptionWatcher for Webhooks {
    /// Stops the subscription's pusher, if any, and starts one for its current `push`.
    fn subscribed(&self, sub: &Subscription) {
        let key = sub.key();
        self.stop(&key);
        let Some(push) = sub.push.clone() else { return };
        let stop = Arc::new(AtomicBool::new(false));
        self.running.lock().insert(key, stop.clone());
        let pusher =
            run(self.deliveries.clone(), sub.group.clone(), sub.topic.clone(), push, self.targets.clone(), stop);
        tokio::spawn(pusher);
    }

    fn unsubscribed(&self, key: &str) {
        self.stop(key);
    }

    fn shut_down(&self) {
        for stop in self.running.lock().values() {
            stop.store(true, Ordering::Relaxed);
        }
    }
}

/// The signature header's value for a delivery: `sha256=<hex>` over `"<timestamp>.<deliveryId>.<body>"`.
pub fn signature(secret: &str, timestamp: u64, delivery_id: &str, body: &[u8]) -> String {
    // HMAC accepts a key of any length, so this cannot fail.
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret.as_bytes()) {
        Ok(mac) => mac,
        Err(_) => return String::new(),
    };
    mac.update(format!("{timestamp}.{delivery_id}.").as_bytes());
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

/// Pushes one subscription's deliveries until `stop` is set. Every connection goes through `targets`. The
/// pusher reads and settles through the gateway as every front does; it acts for the subscription, whose
/// maker's rights were checked when it was made, so it holds no token of its own.
async fn run(
    deliveries: Deliveries,
    group: String,
    topic: String,
    push: WebhookPush,
    targets: Arc<TargetPolicy>,
    stop: Arc<AtomicBool>,
) {
    let client = match client(&push, targets.clone()) {
        Ok(client) => client,
        Err(error) => {
            tracing::error!(%error, "Cannot build the webhook HTTP client.");
            return;
        }
    };
    let caller = Caller::unrestricted();
    let attached = match Reader::check(&caller, &group, &topic) {
        Ok(reader) => deliveries.attach(&reader, Some(push.max_concurrency), "webhook").await,
        Err(refused) => Err(refused),
    };
    let mut subscriber = match attached {
        Ok(subscriber) => subscriber,
        Err(error) => {
            tracing::error!(%error, %group, %topic, "Cannot attach the webhook pusher.");
            return;
        }
    };
    let pusher =
        Arc::new(Pusher { client, deliveries, caller, push, targets, warned_of_skips: AtomicBool::new(false) });
    while !stop.load(Ordering::Relaxed) {
        let batch = match subscriber.next(Duration::from_secs(1)).await {
            Ok(batch) => batch,
            Err(error) => {
                tracing::warn!(%error, "Webhook pusher cannot take deliveries now.");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        for delivery in batch {
            tokio::spawn(pusher.clone().deliver(delivery));
        }
    }
}

/// The HTTP client of one subscription's pusher. It resolves host names through the guard, follows no
/// redirect (a redirect target would escape the checks made on the URL, and would receive the signed
/// request), and ignores `HTTP(S)_PROXY`: through a proxy the addresses checked would be the proxy's, not
/// the receiver's.
fn client(push: &WebhookPush, targets: Arc<TargetPolicy>) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(push.timeout_ms))
        .dns_resolver(Arc::new(target::GuardedResolver::new(targets)))
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .build()
}

/// One subscription's pusher: what every delivery's POST needs.
struct Pusher {
    client: reqwest::Client,
    deliveries: Deliveries,
    caller: Caller,
    push: WebhookPush,
    targets: Arc<TargetPolicy>,
    /// Whether skipped `ce_*` properties were logged at warn level yet (once per pusher; then debug).
    warned_of_skips: AtomicBool,
}

impl Pusher {
    /// POSTs one delivery and settles it from the answer.
    async fn deliver(self: Arc<Self>, delivery: Dispatched) {
        let settling = self.deliveries.settling(None);
        let settlement = Settlement::of(&delivery.id, None, None);
        let settled: Result<(), GatewayError> = match self.post(&delivery).await {
            Outcome::Accepted => settling.ack(&self.caller, settlement).await,
            Outcome::RetryAfter(delay) => settling.nack(&self.caller, settlement, Some(delay)).await.map(|_| ()),
            Outcome::Failed(reason) => {
                tracing::info!(delivery = %delivery.id, %reason, "Webhook delivery attempt failed.");
                settling.nack(&self.caller, settlement, None).await.map(|_| ())
            }
        };
        if let Err(error) = settled {
            tracing::warn!(%error, delivery = %delivery.id, "Webhook result could not be applied.");
        }
    }

    async fn post(&self, delivery: &Dispatched) -> Outcome {
        let (push, event) = (&self.push, &delivery.event);
        let url = match reqwest::Url::parse(&push.url) {
            Ok(url) => url,
            Err(error) => return Outcome::Failed(format!("not a URL: {error}")),
        };
        // A literal address never reaches the resolver: check it here (the subscription may predate the
        // guard, or the allowed networks may have been narrowed since).
        if let Err(forbidden) = self.targets.check_url(&url) {
            return refused(delivery, "literal", &forbidden.to_string());
        }
        let timestamp = crate::clock::wall_clock_secs();
        let data_type = content::http_data(&event.properties, &event.body).media_type();
        let ce = headers::cloudevent_headers(&event.properties, &event.topic, data_type);
        self.report_skips(delivery, &ce.skipped);
        let mut request = self
            .client
            .post(url)
            .header("ce-specversion", "1.0")
            .header("ce-id", event.id.as_str())
            .header("ce-source", ce.source)
            .header("ce-type", ce.event_type)
            .header("content-type", ce.content_type)
            .header("X-Popgate-Delivery-Id", delivery.id.as_str())
            .header("X-Popgate-Attempt", delivery.attempt.to_string())
            .header("X-Popgate-Timestamp", timestamp.to_string())
            .header("X-Popgate-Signature", signature(&push.secret, timestamp, &delivery.id, &event.body));
        for (name, value) in ce.extensions {
            request = request.header(name, value);
        }
        let response = match request.body(event.body.clone()).send().await {
            Ok(response) => response,
            Err(error) => {
                if let Some(forbidden) = target::refused_by(&error) {
                    return refused(delivery, "dns", &forbidden.to_string());
                }
                counter!(m::PUSH_WRITE_FAILURES, "transport" => "webhook").increment(1);
                return Outcome::Failed(if error.is_timeout() {
                    "timeout".into()
                } else {
                    format!("request failed: {error}")
                });
            }
        };
        outcome_of(&response)
    }

    /// Counts each skipped property; logs them at warn level the first time, at debug level after.
    fn report_skips(&self, delivery: &Dispatched, skipped: &[headers::Skipped]) {
        if skipped.is_empty() {
            return;
        }
        for (_, skip) in skipped {
            counter!(m::WEBHOOK_HEADERS_SKIPPED, "reason" => skip.label()).increment(1);
        }
        // `?`: property names are producer input; Debug escapes control characters.
        let listed: Vec<String> = skipped.iter().map(|(name, skip)| format!("{name:?} ({})", skip.label())).collect();
        let skipped = listed.join(", ");
        if self.warned_of_skips.swap(true, Ordering::Relaxed) {
            tracing::debug!(delivery = %delivery.id, %skipped, "Event properties not sent as webhook headers.");
        } else {
            tracing::warn!(
                delivery = %delivery.id,
                %skipped,
                "Event properties that cannot be CloudEvents headers are not sent (logged once per subscription; \
                 counted in popgate_webhook_headers_skipped_total)."
            );
        }
    }
}

/// A target the guard refused: counted and logged, and a failed attempt like any other (so the event is
/// retried, and dead-lettered after its last attempt, never lost).
fn refused(delivery: &Dispatched, reason: &'static str, why: &str) -> Outcome {
    counter!(m::WEBHOOK_TARGETS_REFUSED, "reason" => reason).increment(1);
    tracing::warn!(delivery = %delivery.id, %why, "Webhook target refused: not a permitted address.");
    Outcome::Failed(format!("target refused: {why}"))
}

/// How the receiver's answer settles the delivery.
fn outcome_of(response: &reqwest::Response) -> Outcome {
    let status = response.status();
    if status.is_success() {
        return Outcome::Accepted;
    }
    let retry_after =
        response.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    match (status.as_u16(), retry_after) {
        (429 | 503, Some(seconds)) => Outcome::RetryAfter(Duration::from_secs(seconds.min(3_600))),
        _ => Outcome::Failed(format!("receiver answered {status}")),
    }
}

enum Outcome {
    Accepted,
    RetryAfter(Duration),
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push(url: &str) -> WebhookPush {
        WebhookPush { url: url.into(), secret: "s".into(), timeout_ms: 1000, max_concurrency: 4 }
    }

    fn public_only() -> TargetPolicy {
        TargetPolicy::default()
    }

    #[test]
    fn only_http_and_https_urls_with_a_host_are_accepted() {
        assert!(validate(&push("http://93.184.215.14:9000/hook"), &public_only()).is_ok());
        assert!(validate(&push("https://example.invalid/hook"), &public_only()).is_ok());
        for bad in ["ftp://h/x", "file:///etc/passwd", "not a url", "http://"] {
            assert!(
                matches!(validate(&push(bad), &public_only()), Err(DeliveryError::Invalid("push.url", _))),
                "{bad}"
            );
        }
        let no_secret = WebhookPush { secret: String::new(), ..push("http://h/x") };
        assert!(matches!(validate(&no_secret, &public_only()), Err(DeliveryError::Invalid("push.secret", _))));
    }

    #[test]
    fn a_literal_internal_address_is_refused_at_subscribe_unless_allowed() {
        for internal in [
            "http://127.0.0.1:9000/hook",
            "http://[::1]/hook",
            "http://[::ffff:127.0.0.1]/hook",
            "http://169.254.169.254/latest/meta-data/",
            "http://10.0.0.5/hook",
            "https://192.168.1.1/hook",
            "http://0.0.0.0:8080/hook",
            "http://2130706433/hook",
        ] {
            match validate(&push(internal), &public_only()) {
                Err(DeliveryError::Invalid("push.url", message)) => {
                    assert!(message.contains("webhook.allowed_networks"), "{internal}: {message}");
                }
                other => panic!("{internal} accepted: {other:?}"),
            }
        }
        let loopback = TargetPolicy::new(vec!["127.0.0.0/8".parse().expect("net")]);
        assert!(validate(&push("http://127.0.0.1:9000/hook"), &loopback).is_ok());
        assert!(validate(&push("http://[::1]/hook"), &loopback).is_err(), "only what is listed");
    }

    #[test]
    fn the_signature_is_hmac_sha256_over_timestamp_id_and_body() {
        // RFC 4231-style check against an independently known value is impractical here; check the shape and
        // that every input matters.
        let base = signature("secret", 1, "d", b"body");
        assert!(base.starts_with("sha256=") && base.len() == 7 + 64, "{base}");
        assert_ne!(base, signature("other", 1, "d", b"body"));
        assert_ne!(base, signature("secret", 2, "d", b"body"));
        assert_ne!(base, signature("secret", 1, "e", b"body"));
        assert_ne!(base, signature("secret", 1, "d", b"bodz"));
        assert_eq!(base, signature("secret", 1, "d", b"body"), "deterministic");
    }
}
