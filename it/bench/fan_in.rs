//! Fan-in: many subscribers on one popgate at once (`BENCH_FAN_IN` long-poll subscribers and as many SSE
//! streams; 1 000 each by default), spread over `BENCH_FAN_IN_GROUPS` consumer groups per transport (100 by
//! default: ten instances of each of a hundred applications; 1 puts them all in one group). Each long-poll
//! subscriber loops on `GET /events/poll` (one delivery, 20 s
//! wait) and ACKs what it gets; each SSE stream ACKs each delivery as it reads it. While all are connected, a
//! publisher sends a steady trickle to both topics.
//!
//! Printed: popgate's RSS per connection (connected minus idle), its CPU with every connection open and no
//! traffic, its CPU per connection under the trickle, and every error a subscriber saw (a refused or broken
//! request or stream); everything published must be ACKed at the end.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

use crate::harness::popgate::{proc_status_kib, Popgate};
use crate::harness::{env_or, unique_topic};
use crate::{cpu_time, sse_deliveries, Params};

/// What the subscribers saw, shared by all their tasks.
#[derive(Default)]
struct Seen {
    delivered_long_poll: AtomicU64,
    delivered_sse: AtomicU64,
    acked: AtomicU64,
    sse_open: AtomicU64,
    errors: AtomicU64,
    first_error: parking_lot::Mutex<Option<String>>,
    stop: AtomicBool,
}

impl Seen {
    fn error(&self, what: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.first_error.lock().get_or_insert(what);
    }
}

/// Deliveries per second to each transport's subscribers while everyone is connected (each group gets every
/// message of its topic, so the publish rate is this over the groups): enough to touch connections' paths,
/// little enough that the figure is about holding connections, not throughput.
const TRICKLE_PER_SEC: f64 = 100.0;

pub async fn fan_in(params: &Params, namesrv: &str, topics: [&str; 2]) -> Value {
    let n: usize = env_or("BENCH_FAN_IN", if params.full { 1_000 } else { 50 });
    let groups: usize = env_or("BENCH_FAN_IN_GROUPS", if params.full { 100 } else { 5 }).clamp(1, n);
    // The per-token limits protect popgate from one runaway client; this one client is all subscribers.
    let limits = format!("[server]\nmax_waiters_per_token = {}\nmax_streams_per_token = {}\n", n + 16, n + 16);
    let popgate = Popgate::start(namesrv, &limits).await;
    let [poll_topic, sse_topic] = topics;
    let prefix = unique_topic("g_fan");
    let group = |kind: &str, i: usize| format!("{prefix}_{kind}{}", i % groups);
    for i in 0..groups {
        for (group, topic) in [(group("poll", i), poll_topic), (group("sse", i), sse_topic)] {
            let (status, answer) =
                popgate.post_json("/events/subscribe", &json!({"group": group, "topic": topic})).await;
            assert_eq!(status, 200, "{answer}");
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_rss = proc_status_kib(popgate.pid(), "VmRSS:");

    let seen = Arc::new(Seen::default());
    // One connection per subscriber, as separate applications would have: no pooling across them.
    let http = reqwest::Client::builder().pool_max_idle_per_host(2 * n).build().expect("http client");
    let mut tasks = Vec::new();
    for i in 0..n {
        let query = format!("group={}&topic={sse_topic}&prefetch=4", group("sse", i));
        let (client, shared, base) = (http.clone(), seen.clone(), popgate.base.clone());
        tasks.push(tokio::spawn(async move { sse_stream(&client, &base, &query, &shared).await }));
        let query = format!("group={}&topic={poll_topic}&max=1&waitMs=20000", group("poll", i));
        let (client, shared, base) = (http.clone(), seen.clone(), popgate.base.clone());
        tasks.push(tokio::spawn(async move { long_poll(&client, &base, &query, &shared).await }));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while (seen.sse_open.load(Ordering::Relaxed) as usize) < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await; // the long polls are all parked by now
    let connected_rss = proc_status_kib(popgate.pid(), "VmRSS:");
    let idle_cpu = cpu_percent(popgate.pid(), Duration::from_secs(5)).await;

    let cpu_before = cpu_time(popgate.pid());
    let published = publish_trickle(&popgate, topics, TRICKLE_PER_SEC / groups as f64, params.secs).await;
    let trickle_cpu = cpu_time(popgate.pid()).saturating_sub(cpu_before);
    // Every group of a topic gets every message.
    let expected = published * groups as u64;
    let drain_deadline = Instant::now() + Duration::from_secs(30);
    while seen.acked.load(Ordering::Relaxed) < expected && Instant::now() < drain_deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    seen.stop.store(true, Ordering::Relaxed);
    let peak_rss = proc_status_kib(popgate.pid(), "VmHWM:");
    for task in tasks {
        task.abort();
    }
    let connections = 2 * n;
    let acked = seen.acked.load(Ordering::Relaxed);
    json!({
        "longPollSubscribers": n,
        "sseStreams": n,
        "groupsPerTransport": groups,
        "sseStreamsOpen": seen.sse_open.load(Ordering::Relaxed),
        "idleRssKib": idle_rss,
        "connectedRssKib": connected_rss,
        "peakRssKib": peak_rss,
        "rssKibPerConnection": round2(connected_rss.saturating_sub(idle_rss) as f64 / connections as f64),
        "cpuPercentConnectedIdle": idle_cpu,
        "deliveriesPerSecPerTransport": TRICKLE_PER_SEC,
        "cpuPercentUnderTrickle": round2(trickle_cpu.as_secs_f64() * 100.0 / params.secs),
        "cpuUsPerConnectionPerSec": round2(trickle_cpu.as_secs_f64() * 1e6 / params.secs / connections as f64),
        "published": published,
        "expectedDeliveries": expected,
        "deliveredLongPoll": seen.delivered_long_poll.load(Ordering::Relaxed),
        "deliveredSse": seen.delivered_sse.load(Ordering::Relaxed),
        "acked": acked,
        "lost": expected.saturating_sub(acked),
        "errors": seen.errors.load(Ordering::Relaxed),
        "firstError": seen.first_error.lock().clone(),
    })
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// popgate's CPU use over `window`, in percent of one core.
async fn cpu_percent(pid: u32, window: Duration) -> f64 {
    let before = cpu_time(pid);
    tokio::time::sleep(window).await;
    round2(cpu_time(pid).saturating_sub(before).as_secs_f64() * 100.0 / window.as_secs_f64())
}

/// Publishes `rate` messages per second to each topic for `secs`; returns how many popgate accepted.
async fn publish_trickle(popgate: &Popgate, topics: [&str; 2], rate: f64, secs: f64) -> u64 {
    let http = reqwest::Client::new();
    let mut accepted = 0;
    let mut next = tokio::time::Instant::now();
    let end = next + Duration::from_secs_f64(secs);
    while next < end {
        for topic in topics {
            let body = json!({"topic": topic, "data": "fan-in"});
            let sent = http.post(format!("{}/events/publish", popgate.base)).json(&body).send().await;
            accepted += u64::from(sent.is_ok_and(|r| r.status().as_u16() == 200));
        }
        next += Duration::from_secs_f64(1.0 / rate);
        tokio::time::sleep_until(next).await;
    }
    accepted
}

async fn ack(http: &reqwest::Client, base: &str, id: &str, seen: &Seen) {
    match http.post(format!("{base}/events/ack")).json(&json!({ "deliveryId": id })).send().await {
        Ok(resp) if resp.status().as_u16() == 200 => {
            seen.acked.fetch_add(1, Ordering::Relaxed);
        }
        Ok(resp) => seen.error(format!("ACK answered {}", resp.status())),
        Err(error) => seen.error(format!("ACK failed: {error}")),
    }
}

async fn long_poll(http: &reqwest::Client, base: &str, query: &str, seen: &Seen) {
    while !seen.stop.load(Ordering::Relaxed) {
        let resp = match http.get(format!("{base}/events/poll?{query}")).send().await {
            Ok(resp) if resp.status().as_u16() == 200 => resp,
            Ok(resp) => return seen.error(format!("poll answered {}", resp.status())),
            Err(error) => return seen.error(format!("poll failed: {error}")),
        };
        let answer: Value = resp.json().await.unwrap_or(Value::Null);
        for delivery in answer["deliveries"].as_array().into_iter().flatten() {
            seen.delivered_long_poll.fetch_add(1, Ordering::Relaxed);
            ack(http, base, delivery["deliveryId"].as_str().unwrap_or_default(), seen).await;
        }
    }
}

async fn sse_stream(http: &reqwest::Client, base: &str, query: &str, seen: &Seen) {
    let resp = match http.get(format!("{base}/events/stream?{query}")).send().await {
        Ok(resp) if resp.status().as_u16() == 200 => resp,
        Ok(resp) => return seen.error(format!("stream answered {}", resp.status())),
        Err(error) => return seen.error(format!("stream failed: {error}")),
    };
    seen.sse_open.fetch_add(1, Ordering::Relaxed);
    let mut stream = resp.bytes_stream();
    let mut buffer = String::new();
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else {
            if !seen.stop.load(Ordering::Relaxed) {
                seen.error("stream broke".to_owned());
            }
            return;
        };
        for delivery in sse_deliveries(&mut buffer, &chunk) {
            if let Some(id) = delivery["deliveryId"].as_str() {
                seen.delivered_sse.fetch_add(1, Ordering::Relaxed);
                ack(http, base, id, seen).await;
            }
        }
    }
    if !seen.stop.load(Ordering::Relaxed) {
        seen.error("stream ended".to_owned());
    }
}
