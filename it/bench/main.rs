//! popgate-bench: the same broker, message size and concurrency, two paths.
//!
//! - **direct**: rocketmq-client-rust's `DefaultMQProducer` sends; POP consumers (popgate's raw
//!   `BrokerClient::pop`/`ack`, no popgate process) pop and ACK straight at the broker.
//! - **popgate**: HTTP `POST /events/publish`; subscribers consume through popgate, once by long-poll with batch
//!   ACK and once over SSE with batch ACK.
//!
//! Each path prints publish msgs/s, end-to-end deliver+ACK msgs/s, publish and end-to-end latency p50/p99/p999
//! and (for popgate) its CPU time and peak RSS, then the ratios popgate/direct; a half-load run compares the
//! added p99; and two state measurements: RSS with N deliveries in flight, and boot recovery of M stored
//! in-flight records. A table and a JSON document are printed (JSON also written to `BENCH_JSON`, default
//! `<target>/tmp/popgate-bench.json`).
//!
//! `cargo bench --bench popgate-bench` runs the full measurement. `cargo test --all-targets` runs this binary
//! without `--bench`: a smoke run of a few seconds that only checks every phase works and loses nothing.
//!
//! A tier's forwarded ACK against a local one (`tier.rs`, issue #35). The remoting front against the same
//! remoting Java client straight at the cluster and through Apache's proxy (`remoting.rs`), and how popgate's
//! cost per message grows with groups and subscribers (`scale.rs`, issue #49).
//! Parameters (environment): `BENCH_SIZE` (bytes, 1024), `BENCH_PRODUCERS` (8), `BENCH_SUBSCRIBERS` (4),
//! `BENCH_SECS` (per phase, 15), `BENCH_IN_FLIGHT` (100000), `BENCH_RECOVERY_RECORDS` (1000000),
//! `BENCH_RECOVERY_FORMAT` (`compact`, or `json`: the records as earlier versions stored them).

#[path = "../harness/mod.rs"]
#[allow(dead_code)]
mod harness;

mod apache_proxy;
mod churn;
mod fan_in;
mod remoting;
mod scale;
mod tier;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use parking_lot::Mutex;
use serde_json::{json, Value};

use harness::direct::Direct;
use harness::env_or;
use harness::popgate::{proc_status_kib, Popgate};
use harness::rocketmq::{Cluster, ClusterSpec};
use harness::unique_topic;

use popgate::broker::consumer::{PopRequest, PoppedEvent, ReceiptHandle};
use popgate::delivery::record::{DeliveryRecord, Phase, Subscription};
use popgate::store::{Change, Family, StateStore};

#[derive(Clone, Debug)]
struct Params {
    full: bool,
    size: usize,
    producers: usize,
    subscribers: usize,
    secs: f64,
    in_flight: usize,
    recovery_records: usize,
    /// Messages per publish request in the throughput phase (`BENCH_PUBLISH_BATCH`): one, or a batch publish
    /// (popgate: a JSON array body; direct: the client's `send_batch`).
    publish_batch: usize,
}

impl Params {
    fn from_env(full: bool) -> Params {
        if full {
            Params {
                full,
                size: env_or("BENCH_SIZE", 1024),
                producers: env_or("BENCH_PRODUCERS", 8),
                subscribers: env_or("BENCH_SUBSCRIBERS", 4),
                secs: env_or("BENCH_SECS", 15.0),
                in_flight: env_or("BENCH_IN_FLIGHT", 100_000),
                recovery_records: env_or("BENCH_RECOVERY_RECORDS", 1_000_000),
                publish_batch: env_or("BENCH_PUBLISH_BATCH", 1_usize).max(1),
            }
        } else {
            Params {
                full,
                size: 1024,
                producers: 2,
                subscribers: 2,
                secs: 1.5,
                in_flight: 1_000,
                recovery_records: 5_000,
                publish_batch: env_or("BENCH_PUBLISH_BATCH", 1_usize).max(1),
            }
        }
    }
}

fn t0() -> Instant {
    static T0: OnceLock<Instant> = OnceLock::new();
    *T0.get_or_init(Instant::now)
}

fn micros() -> u64 {
    t0().elapsed().as_micros() as u64
}

/// A body of exactly `size` bytes (ASCII) starting with its send time, so the receiver measures end to end.
fn body(size: usize) -> String {
    let mut text = format!("{:016}|", micros());
    text.extend(std::iter::repeat_n('x', size.saturating_sub(text.len())));
    text
}

fn sent_micros(data: &[u8]) -> Option<u64> {
    std::str::from_utf8(data.get(..16)?).ok()?.parse().ok()
}

/// What one run of one path measured.
#[derive(Default)]
struct Sample {
    sent: AtomicU64,
    acked: AtomicU64,
    publish_failures: AtomicU64,
    publish_us: Mutex<Vec<u64>>,
    e2e_us: Mutex<Vec<u64>>,
    last_ack_us: AtomicU64,
    stop_publish: AtomicBool,
}

impl Sample {
    fn received(&self, data: &[u8]) {
        if let Some(at) = sent_micros(data) {
            self.e2e_us.lock().push(micros().saturating_sub(at));
        }
    }

    fn acked(&self, n: u64) {
        self.acked.fetch_add(n, Ordering::Relaxed);
        self.last_ack_us.fetch_max(micros(), Ordering::Relaxed);
    }
}

fn pct(values: &mut [u64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_unstable();
    let i = ((values.len() as f64 * p).ceil() as usize).clamp(1, values.len()) - 1;
    values[i] as f64 / 1000.0
}

/// One path's figures.
fn summarize(
    name: &str,
    sample: &Sample,
    started_us: u64,
    publish_secs: f64,
    popgate: Option<(Duration, u64)>,
) -> Value {
    let sent = sample.sent.load(Ordering::Relaxed);
    let acked = sample.acked.load(Ordering::Relaxed);
    let e2e_secs = (sample.last_ack_us.load(Ordering::Relaxed).saturating_sub(started_us)) as f64 / 1e6;
    let mut publish = sample.publish_us.lock().clone();
    let mut e2e = sample.e2e_us.lock().clone();
    json!({
        "path": name,
        "sent": sent,
        "acked": acked,
        "publishFailures": sample.publish_failures.load(Ordering::Relaxed),
        "publishMsgsPerSec": (sent as f64 / publish_secs).round(),
        "endToEndMsgsPerSec": if e2e_secs > 0.0 { (acked as f64 / e2e_secs).round() } else { 0.0 },
        "publishLatencyMs": {"p50": pct(&mut publish, 0.5), "p99": pct(&mut publish, 0.99), "p999": pct(&mut publish, 0.999)},
        "endToEndLatencyMs": {"p50": pct(&mut e2e, 0.5), "p99": pct(&mut e2e, 0.99), "p999": pct(&mut e2e, 0.999)},
        "popgateCpuSecs": popgate.map(|(cpu, _)| (cpu.as_secs_f64() * 100.0).round() / 100.0),
        "popgateCpuMsPer1kMsgs": popgate.map(|(cpu, _)| if acked > 0 { (cpu.as_secs_f64() * 1e6 / acked as f64).round() } else { 0.0 }),
        "popgatePeakRssKib": popgate.map(|(_, rss)| rss),
    })
}

// === /proc readings ===

/// User + system CPU time of `pid` (`/proc/<pid>/stat` fields 14 and 15, in 10 ms clock ticks).
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let ticks: u64 = [11usize, 12].iter().filter_map(|i| fields.get(*i)?.parse::<u64>().ok()).sum();
    Duration::from_millis(ticks * 10)
}

// === load: producers ===

/// Rate limit per producer (msgs/s), or none.
type Rate = Option<f64>;

async fn run_producers<F, Fut>(params: &Params, sample: Arc<Sample>, rate: Rate, secs: f64, batch: usize, send: F)
where
    F: Fn(Vec<String>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..params.producers {
        let (sample, send, size) = (sample.clone(), send.clone(), params.size);
        tasks.push(tokio::spawn(async move {
            let mut next = tokio::time::Instant::now();
            while tokio::time::Instant::now() < deadline {
                let started = micros();
                // One publish request of `batch` messages: one latency sample, `batch` messages sent.
                if send((0..batch).map(|_| body(size)).collect()).await {
                    sample.sent.fetch_add(batch as u64, Ordering::Relaxed);
                    sample.publish_us.lock().push(micros() - started);
                } else {
                    sample.publish_failures.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(rate) = rate {
                    next += Duration::from_secs_f64(batch as f64 / rate);
                    tokio::time::sleep_until(next).await;
                }
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    sample.stop_publish.store(true, Ordering::Relaxed);
}

/// Whether consumers may stop: publishing is over and everything sent was ACKed, or nothing moved for 10 s.
fn consumers_done(sample: &Sample) -> bool {
    if !sample.stop_publish.load(Ordering::Relaxed) {
        return false;
    }
    let idle_us = micros().saturating_sub(sample.last_ack_us.load(Ordering::Relaxed));
    sample.acked.load(Ordering::Relaxed) >= sample.sent.load(Ordering::Relaxed) || idle_us > 10_000_000
}

// === path (a): direct ===

/// A plain message with `body` for `topic`, as an application would build it.
fn message(
    topic: impl Into<cheetah_string::CheetahString>,
    body: &[u8],
) -> rocketmq_model::common::message::message_single::Message {
    rocketmq_model::common::message::message_single::Message::builder().topic(topic).body_slice(body).build_unchecked()
}

struct DirectPath {
    producer: Arc<rocketmq_client_rust::DefaultMQProducer>,
    client: Arc<popgate::broker::BrokerClient>,
    _owner: rocketmq_runtime::RuntimeOwner,
}

impl DirectPath {
    async fn connect(namesrv: &str) -> DirectPath {
        let (owner, runtime) = popgate::broker::client::start_client_runtime().expect("client runtime");
        let mut producer = rocketmq_client_rust::DefaultMQProducer::builder(runtime)
            .producer_group("popgate_bench_direct")
            .name_server_addr(namesrv)
            .build();
        producer.start().await.expect("producer starts");
        let config = popgate::config::BrokerConfig { namesrv_addr: namesrv.to_owned(), ..Default::default() };
        let client = popgate::broker::BrokerClient::connect(&config, "popgate_bench_pop").await.expect("pop client");
        DirectPath { producer: Arc::new(producer), client: Arc::new(client), _owner: owner }
    }

    async fn run(&self, params: &Params, topic: &str, rate: Rate, secs: f64) -> Value {
        let sample = Arc::new(Sample::default());
        let started = micros();
        let group = unique_topic("g_direct");
        let mut consumers = Vec::new();
        for _ in 0..params.subscribers {
            let (client, sample, topic, group) = (self.client.clone(), sample.clone(), topic.to_owned(), group.clone());
            consumers.push(tokio::spawn(async move {
                let handle = client.dedicated_handle().await.expect("handle");
                while !consumers_done(&sample) {
                    let Ok(route) = client.route(&topic).await else { continue };
                    for broker in route.readable() {
                        let request = PopRequest {
                            group: &group,
                            topic: &topic,
                            filter: "*",
                            filter_type: "TAG",
                            max: 32,
                            invisible_ms: 60_000,
                            poll_ms: 1_000,
                            orderly: false,
                        };
                        let popped = client.pop(handle.handle(), broker, &request).await.unwrap_or_default();
                        for p in &popped {
                            sample.received(&p.event.body);
                        }
                        let acks = popped.iter().map(|p| client.ack(&group, &p.handle));
                        let ok = futures::future::join_all(acks).await.iter().filter(|r| r.is_ok()).count();
                        sample.acked(ok as u64);
                    }
                }
                drop(handle);
            }));
        }
        let producer = self.producer.clone();
        let topic_owned = topic.to_owned();
        let send = move |texts: Vec<String>| {
            let (producer, topic) = (producer.clone(), topic_owned.clone());
            async move {
                let mut messages: Vec<_> = texts.iter().map(|text| message(topic.as_str(), text.as_bytes())).collect();
                match messages.len() {
                    1 => producer.send(messages.remove(0)).await.is_ok_and(|r| r.is_some()),
                    _ => producer.send_batch(messages).await.is_ok(),
                }
            }
        };
        run_producers(params, sample.clone(), rate, secs, params.publish_batch, send).await;
        for c in consumers {
            let _ = c.await;
        }
        summarize("direct", &sample, started, secs, None)
    }
}

// === path (b): through popgate ===

#[derive(Clone, Copy, PartialEq)]
enum Transport {
    LongPoll,
    Sse,
}

async fn popgate_run(
    params: &Params,
    popgate: &Popgate,
    topic: &str,
    transport: Transport,
    rate: Rate,
    secs: f64,
) -> Value {
    let group = unique_topic("g_popgate");
    let http = reqwest::Client::new();
    let (status, answer) = popgate.post_json("/events/subscribe", &json!({"group": group, "topic": topic})).await;
    assert_eq!(status, 200, "{answer}");
    let sample = Arc::new(Sample::default());
    let (cpu_before, pid) = (cpu_time(popgate.pid()), popgate.pid());
    // `BENCH_PERF=<dir>`: a CPU profile of popgate during the run (`perf record`), for `perf report -i`.
    let profiler = std::env::var("BENCH_PERF").ok().and_then(|dir| {
        let name = if transport == Transport::LongPoll { "long_poll" } else { "sse" };
        std::process::Command::new("perf")
            .args(["record", "-F", "499", "-g", "-p", &pid.to_string(), "-o"])
            .arg(std::path::Path::new(&dir).join(format!("popgate-{name}-{}.perf", std::process::id())))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()
    });
    let started = micros();
    let mut consumers = Vec::new();
    for _ in 0..params.subscribers {
        let (http, sample, base) = (http.clone(), sample.clone(), popgate.base.clone());
        let query = format!("group={group}&topic={topic}");
        consumers.push(tokio::spawn(async move {
            match transport {
                Transport::LongPoll => long_poll_subscriber(&http, &base, &query, 1_000, &sample).await,
                Transport::Sse => sse_subscriber(&http, &base, &query, &sample).await,
            }
        }));
    }
    let (base, topic_owned) = (popgate.base.clone(), topic.to_owned());
    let send = move |texts: Vec<String>| {
        let (http, base, topic) = (http.clone(), base.clone(), topic_owned.clone());
        async move {
            let mut events: Vec<Value> = texts.into_iter().map(|text| json!({"topic": topic, "data": text})).collect();
            // One message as popgate's single publish; several as one batch publish (a JSON array).
            let body = if events.len() == 1 { events.remove(0) } else { Value::Array(events) };
            let resp = http.post(format!("{base}/events/publish")).json(&body).send().await;
            resp.is_ok_and(|r| r.status().as_u16() == 200)
        }
    };
    run_producers(params, sample.clone(), rate, secs, params.publish_batch, send).await;
    for c in consumers {
        let _ = c.await;
    }
    let cpu = cpu_time(pid).saturating_sub(cpu_before);
    if let Some(mut perf) = profiler {
        let _ = std::process::Command::new("kill").arg("-INT").arg(perf.id().to_string()).status();
        let _ = perf.wait();
    }
    let name = if transport == Transport::LongPoll { "popgate_long_poll" } else { "popgate_sse" };
    summarize(name, &sample, started, secs, Some((cpu, proc_status_kib(pid, "VmHWM:"))))
}

async fn batch_ack(http: &reqwest::Client, base: &str, ids: Vec<String>, sample: &Sample) {
    if ids.is_empty() {
        return;
    }
    let resp = http.post(format!("{base}/events/ack")).json(&json!({ "deliveryIds": ids })).send().await;
    let Ok(resp) = resp else { return };
    let answer: Value = resp.json().await.unwrap_or(Value::Null);
    let ok = answer["results"].as_array().map(|r| r.iter().filter(|x| x["status"] == "acked").count()).unwrap_or(0);
    sample.acked(ok as u64);
}

/// Polls `max=32` at a time, waiting up to `wait_ms` for each, and ACKs each batch with one request.
async fn long_poll_subscriber(http: &reqwest::Client, base: &str, query: &str, wait_ms: u64, sample: &Sample) {
    while !consumers_done(sample) {
        let resp = http.get(format!("{base}/events/poll?{query}&max=32&waitMs={wait_ms}")).send().await;
        let Ok(resp) = resp else { continue };
        let answer: Value = resp.json().await.unwrap_or(Value::Null);
        let mut ids = Vec::new();
        for d in answer["deliveries"].as_array().into_iter().flatten() {
            sample.received(d["event"]["data"].as_str().unwrap_or_default().as_bytes());
            ids.push(d["deliveryId"].as_str().unwrap_or_default().to_owned());
        }
        batch_ack(http, base, ids, sample).await;
    }
}

/// An SSE subscriber: one task reads the stream, another ACKs what was read in batches, so reading never
/// waits for an ACK round trip (prefetch bounds what is unACKed).
async fn sse_subscriber(http: &reqwest::Client, base: &str, query: &str, sample: &Sample) {
    let Ok(resp) = http.get(format!("{base}/events/stream?{query}&prefetch=128")).send().await else { return };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let acker = async {
        while let Some(first) = rx.recv().await {
            let mut ids = vec![first];
            while ids.len() < 128 {
                match rx.try_recv() {
                    Ok(id) => ids.push(id),
                    Err(_) => break,
                }
            }
            batch_ack(http, base, ids, sample).await;
        }
    };
    let reader = async move {
        let mut stream = resp.bytes_stream();
        let mut buffer = String::new();
        while !consumers_done(sample) {
            let chunk = match tokio::time::timeout(Duration::from_millis(500), stream.next()).await {
                Err(_) => continue,
                Ok(Some(Ok(chunk))) => chunk,
                Ok(_) => break,
            };
            for d in sse_deliveries(&mut buffer, &chunk) {
                if let Some(id) = d["deliveryId"].as_str() {
                    sample.received(d["event"]["data"].as_str().unwrap_or_default().as_bytes());
                    let _ = tx.send(id.to_owned());
                }
            }
        }
        // Dropping the sender ends the acker once it has ACKed the rest.
    };
    tokio::join!(reader, acker);
}

/// Appends `chunk` of an SSE stream to `buffer` and takes out the deliveries of the events it completes.
fn sse_deliveries(buffer: &mut String, chunk: &[u8]) -> Vec<Value> {
    buffer.push_str(&String::from_utf8_lossy(chunk));
    let mut deliveries = Vec::new();
    while let Some(end) = buffer.find("\n\n") {
        let block: String = buffer.drain(..end + 2).collect();
        let data = block.lines().find_map(|l| l.strip_prefix("data: "));
        deliveries.extend(data.and_then(|data| serde_json::from_str::<Value>(data).ok()));
    }
    deliveries
}

// === state: RSS with N in flight, recovery of M records ===

async fn in_flight_rss(params: &Params, namesrv: &str, direct: &DirectPath, topic: &str) -> Value {
    let n = params.in_flight;
    let mut extra =
        format!("[delivery]\nmax_in_flight = {}\nmax_in_flight_per_subscription = {}\n", n + 1_000, n + 1_000);
    // `BENCH_LEASE_MS`: popgate's shortest broker lease (`delivery.lease_ms`); popgate lengthens it with what it
    // holds so renewals stay near `delivery.lease_renewals_per_sec`. Default: popgate's defaults.
    if let Ok(lease_ms) = std::env::var("BENCH_LEASE_MS") {
        extra.push_str(&format!("lease_ms = {lease_ms}\n"));
    }
    let popgate = Popgate::start(namesrv, &extra).await;
    let group = unique_topic("g_rss");
    let (status, answer) = popgate
        .post_json("/events/subscribe", &json!({"group": group, "topic": topic, "ackTimeoutMs": 3_600_000}))
        .await;
    assert_eq!(status, 200, "{answer}");
    // The events go in straight through the direct producer (the publish path is measured elsewhere).
    let sample = Arc::new(Sample::default());
    let per_producer = n.div_ceil(params.producers.max(1));
    let mut tasks = Vec::new();
    for _ in 0..params.producers {
        let (producer, topic, sample, size) = (direct.producer.clone(), topic.to_owned(), sample.clone(), params.size);
        tasks.push(tokio::spawn(async move {
            for _ in 0..per_producer {
                let message = message(topic.clone(), body(size).as_bytes());
                if producer.send(message).await.is_ok_and(|r| r.is_some()) {
                    sample.sent.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let sent = sample.sent.load(Ordering::Relaxed) as usize;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let baseline_kib = popgate.rss_kib();
    let started = Instant::now();
    let mut held = 0usize;
    while held < sent.min(n) && started.elapsed() < Duration::from_secs(600) {
        held += popgate.poll(&group, topic, 256, 1_000).await.len();
    }
    let fill_secs = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let pending = popgate.metric("popgate_pending_deliveries").await;
    let rss_kib = popgate.rss_kib();
    // Idle cost of holding them: CPU over 5 s with nothing to do but keep the deliveries (sweeper, renewals).
    let cpu_before = cpu_time(popgate.pid());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let idle_cpu_pct = (cpu_time(popgate.pid()).saturating_sub(cpu_before)).as_secs_f64() / 5.0 * 100.0;
    // Held on: the broker lease renewals it takes (one request each) and popgate's CPU meanwhile, over
    // `BENCH_HOLD_SECS` (full runs: 60 s; the first leases, taken while little was held, fall due in it).
    let hold = Duration::from_secs(env_or("BENCH_HOLD_SECS", if params.full { 60 } else { 2 }));
    let renewals_before = popgate.metric("popgate_lease_renewals_total").await;
    let cpu_before = cpu_time(popgate.pid());
    tokio::time::sleep(hold).await;
    let held_secs = hold.as_secs_f64().max(0.001);
    let renewals_per_sec = (popgate.metric("popgate_lease_renewals_total").await - renewals_before) / held_secs;
    let renewal_cpu_pct = (cpu_time(popgate.pid()).saturating_sub(cpu_before)).as_secs_f64() / held_secs * 100.0;
    let per_delivery = if held > 0 { (rss_kib.saturating_sub(baseline_kib)) as f64 / held as f64 } else { 0.0 };
    json!({
        "inFlight": held,
        "pendingDeliveriesMetric": pending,
        "baselineRssKib": baseline_kib,
        "rssKib": rss_kib,
        "peakRssKib": proc_status_kib(popgate.pid(), "VmHWM:"),
        "kibPerDelivery": (per_delivery * 100.0).round() / 100.0,
        "handOutSecs": (fill_secs * 10.0).round() / 10.0,
        "idleCpuPercentHoldingThem": idle_cpu_pct.round(),
        "holdSecs": hold.as_secs(),
        "cpuPercentWhileRenewingLeases": renewal_cpu_pct.round(),
        "brokerRenewalsPerSecWhileHeld": renewals_per_sec.round(),
        "leaseAskedSecs": popgate.metric("popgate_lease_asked_seconds").await,
        "rssKibAfterRenewals": popgate.rss_kib(),
        "leasesLost": popgate.metric("popgate_leases_lost_total").await,
    })
}

fn planted_record(i: usize, now_ms: i64) -> DeliveryRecord {
    let id = format!("{:032x}", 0xb0b0_0000_0000u64 as u128 * 1_000_003 + i as u128);
    DeliveryRecord {
        id: id.into(),
        group: "g_recovery".into(),
        topic: "t_recovery".into(),
        event: PoppedEvent {
            id: format!("MSG{i:020}"),
            topic: "t_recovery".into(),
            tags: None,
            keys: Vec::new(),
            properties: Default::default(),
            // The body lives in the payloads family, as popgate stores it (see the writer below).
            body: Vec::new(),
            born_timestamp: now_ms,
            reconsume_times: 0,
            retry_topic: None,
            message_group: None,
            stored: Default::default(),
        },
        handle: ReceiptHandle {
            broker_name: "broker-a".into(),
            broker_addr: "127.0.0.1:1".into(),
            extra_info: format!("0 {now_ms} 3600000 0 0 broker-a 0 {i}"),
            ack_topic: "t_recovery".into(),
            queue_id: 0,
            queue_offset: i as i64,
            // A lease an hour long: neither renewed nor given up while the boot is measured.
            pop_time_ms: now_ms,
            invisible_ms: 3_600_000,
            lease_until_ms: popgate::clock::Epoch::from_millis(now_ms + 3_600_000),
        },
        attempt: 1,
        phase: Phase::AwaitingAck {
            deadline_ms: popgate::clock::Epoch::from_millis(now_ms + 3_600_000),
            dispatched_ms: popgate::clock::Epoch::from_millis(now_ms),
            holder: None,
        },
        last_failure: None,
        seq: i as u64 + 1,
        body_apart: true,
        handouts: 1,
    }
}

async fn recovery(params: &Params, namesrv: &str) -> Value {
    let dir = tempfile::Builder::new().prefix("popgate-bench-recovery-").tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let m = params.recovery_records;
    let size = params.size;
    // `BENCH_RECOVERY_FORMAT=json`: the records in the JSON form popgate wrote before its compact one (a store
    // from an earlier version), to compare the two boots with one build.
    let legacy_json = std::env::var("BENCH_RECOVERY_FORMAT").is_ok_and(|format| format == "json");
    let state_for_writer = state.clone();
    let write_secs = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let store = StateStore::open(&state_for_writer, false).expect("open store");
        let sub = Subscription {
            group: "g_recovery".into(),
            topic: "t_recovery".into(),
            filter: "*".into(),
            filter_type: Default::default(),
            ack_timeout_ms: 3_600_000,
            max_attempts: 6,
            initial_backoff_ms: 1_000,
            max_backoff_ms: 16_000,
            ordered: false,
            push: None,
            implicit: false,
            version: None,
        };
        // A blocking thread of its own: the store's async API is waited for in place.
        futures::executor::block_on(store.put(Family::Subscriptions, &sub.key(), &sub)).expect("subscription");
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        for chunk in (0..m).collect::<Vec<_>>().chunks(10_000) {
            let records: Vec<DeliveryRecord> = chunk.iter().map(|i| planted_record(*i, now_ms)).collect();
            let encoded: Vec<Vec<u8>> = records
                .iter()
                .map(|r| if legacy_json { serde_json::to_vec(r).expect("encode") } else { r.encode() })
                .collect();
            let mut changes: Vec<Change<'_>> =
                records.iter().zip(encoded).map(|(r, v)| Change::Put(Family::Deliveries, &r.id, v)).collect();
            changes.extend(records.iter().map(|r| Change::Put(Family::Payloads, &r.id, body(size).into_bytes())));
            futures::executor::block_on(store.apply(&changes)).expect("write");
        }
        futures::executor::block_on(store.sync_wal()).expect("sync");
        started.elapsed().as_secs_f64()
    })
    .await
    .expect("writer");
    let store_bytes = dir_size(&state);
    let extra = format!(
        "[delivery]\nstate_dir = \"{}\"\nmax_in_flight = {}\nmax_in_flight_per_subscription = {}\n",
        state.display(),
        m + 1_000,
        m + 1_000
    );
    // `BENCH_PERF=<dir>`: a CPU profile of the whole machine during the boot (`perf record -a`; popgate's pid is
    // not known before it starts), for `perf report --comm popgate -i <dir>/boot-<pid>.perf`.
    let profiler = std::env::var("BENCH_PERF").ok().and_then(|dir| {
        std::process::Command::new("perf")
            .args(["record", "-F", "999", "-a", "-g", "-o"])
            .arg(std::path::Path::new(&dir).join(format!("boot-{}.perf", std::process::id())))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()
    });
    let started = Instant::now();
    let popgate = Popgate::start(namesrv, &extra).await;
    let boot_secs = started.elapsed().as_secs_f64();
    if let Some(mut perf) = profiler {
        let _ = std::process::Command::new("kill").arg("-INT").arg(perf.id().to_string()).status();
        let _ = perf.wait();
    }
    let recovered = popgate.metric("popgate_recovered_deliveries_total{outcome=\"redispatched\"}").await;
    let rss_kib = popgate.rss_kib();
    let cpu_before = cpu_time(popgate.pid());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let idle_cpu_pct = (cpu_time(popgate.pid()).saturating_sub(cpu_before)).as_secs_f64() / 5.0 * 100.0;
    // The same boot with an empty store, to tell recovery from the rest of the start.
    let started = Instant::now();
    let empty = Popgate::start(namesrv, "").await;
    let empty_boot_secs = started.elapsed().as_secs_f64();
    drop(empty);
    json!({
        "records": m,
        "format": if legacy_json { "json" } else { "compact" },
        "recordsRecovered": recovered,
        "storeWriteSecs": (write_secs * 10.0).round() / 10.0,
        "storeBytes": store_bytes,
        "bootToHealthySecs": (boot_secs * 100.0).round() / 100.0,
        "emptyBootToHealthySecs": (empty_boot_secs * 100.0).round() / 100.0,
        "rssAfterRecoveryKib": rss_kib,
        "idleCpuPercentAfterRecovery": idle_cpu_pct.round(),
    })
}

fn dir_size(path: &std::path::Path) -> u64 {
    std::fs::read_dir(path)
        .map(|entries| entries.filter_map(Result::ok).filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

// === report ===

fn ratio(b: &Value, a: &Value, path: &[&str]) -> Value {
    let get = |v: &Value| path.iter().fold(v, |v, k| &v[*k]).as_f64();
    match (get(b), get(a)) {
        (Some(b), Some(a)) if a > 0.0 => json!((b / a * 100.0).round() / 100.0),
        _ => Value::Null,
    }
}

fn ratios(b: &Value, a: &Value) -> Value {
    json!({
        "publishMsgsPerSec": ratio(b, a, &["publishMsgsPerSec"]),
        "endToEndMsgsPerSec": ratio(b, a, &["endToEndMsgsPerSec"]),
        "publishP99": ratio(b, a, &["publishLatencyMs", "p99"]),
        "endToEndP99": ratio(b, a, &["endToEndLatencyMs", "p99"]),
    })
}

fn print_table(report: &Value) {
    println!("\npopgate-bench ({})", report["parameters"]);
    println!(
        "{:<18} {:>9} {:>9} {:>24} {:>24} {:>8} {:>10}",
        "path", "pub/s", "e2e/s", "publish p50/p99/p999 ms", "e2e p50/p99/p999 ms", "cpu s", "peak RSS"
    );
    let lat = |v: &Value| {
        format!(
            "{:.2}/{:.2}/{:.2}",
            v["p50"].as_f64().unwrap_or(0.0),
            v["p99"].as_f64().unwrap_or(0.0),
            v["p999"].as_f64().unwrap_or(0.0)
        )
    };
    for run in report["runs"].as_array().into_iter().flatten() {
        println!(
            "{:<18} {:>9} {:>9} {:>24} {:>24} {:>8} {:>10}",
            run["path"].as_str().unwrap_or_default(),
            run["publishMsgsPerSec"],
            run["endToEndMsgsPerSec"],
            lat(&run["publishLatencyMs"]),
            lat(&run["endToEndLatencyMs"]),
            run["popgateCpuSecs"],
            run["popgatePeakRssKib"].as_u64().map(|k| format!("{} MiB", k / 1024)).unwrap_or_else(|| "-".into()),
        );
    }
    println!("ratios popgate/direct: long-poll {}  SSE {}", report["ratios"]["longPoll"], report["ratios"]["sse"]);
    println!("half load: {}", report["halfLoad"]);
    println!("in flight: {}", report["inFlight"]);
    println!("recovery: {}", report["recovery"]);
    println!("fan-in: {}", report["fanIn"]);
    println!("tier (ACK forwarded to the instance that handed the delivery out / ACK at it): {}", report["tier"]);
    apache_proxy::print_table(&report["againstApacheProxy"]);
    churn::print_table(&report["churn"]);
    remoting::print_table(&report["remoting"]);
    scale::print_table(&report["scale"]);
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let params = Params::from_env(full);
    t0();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("runtime");
    let report = runtime.block_on(bench(params.clone()));
    print_table(&report);
    let text = serde_json::to_string_pretty(&report).unwrap_or_default();
    println!("{text}");
    let path = std::env::var("BENCH_JSON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("popgate-bench.json"));
    match std::fs::write(&path, &text) {
        Ok(()) => println!("popgate-bench: JSON in {}", path.display()),
        Err(error) => eprintln!("popgate-bench: cannot write {}: {error}", path.display()),
    }
    if !full {
        // The smoke run checks that every phase worked and nothing was lost; its figures mean nothing.
        for run in report["runs"].as_array().into_iter().flatten() {
            assert!(run["sent"].as_u64().unwrap_or(0) > 0, "smoke: {} sent nothing", run["path"]);
            assert_eq!(run["sent"], run["acked"], "smoke: {} ACKed everything it sent", run["path"]);
        }
        for comparison in report["againstApacheProxy"].as_array().into_iter().flatten() {
            for run in comparison["runs"].as_array().into_iter().flatten() {
                let what = format!("{} {} {}", comparison["profile"], run["front"], run["mode"]);
                assert!(run["sent"].as_u64().unwrap_or(0) > 0, "smoke: {what} sent nothing: {run}");
                assert_eq!(run["lost"].as_u64(), Some(0), "smoke: {what} lost messages: {run}");
            }
        }
        // `BENCH_ONLY` runs one part: only the parts in the report are checked.
        let fan_in = &report["fanIn"];
        if !fan_in.is_null() {
            assert_eq!(fan_in["errors"].as_u64(), Some(0), "smoke: fan-in errors: {fan_in}");
            assert_eq!(fan_in["lost"].as_u64(), Some(0), "smoke: fan-in lost messages: {fan_in}");
            assert_eq!(fan_in["sseStreamsOpen"], fan_in["sseStreams"], "smoke: every SSE stream opened: {fan_in}");
        }
        if !report["inFlight"].is_null() {
            let held = report["inFlight"]["inFlight"].as_u64();
            assert_eq!(held, Some(params.in_flight as u64), "smoke: in-flight run");
            let lost = report["inFlight"]["leasesLost"].as_f64();
            assert_eq!(lost, Some(0.0), "smoke: a held delivery lost its lease");
        }
        if !report["recovery"].is_null() {
            let recovered = report["recovery"]["recordsRecovered"].as_f64();
            assert_eq!(recovered, Some(params.recovery_records as f64), "smoke: recovery");
        }
        churn::check_smoke(&report["churn"]);
        tier::check_smoke(&report["tier"]);
        remoting::check_smoke(&report["remoting"]);
        scale::check_smoke(&report["scale"]);
        println!("popgate-bench: smoke run passed (run `cargo bench --bench popgate-bench` for figures)");
    }
}

async fn bench(params: Params) -> Value {
    let cluster = tokio::task::block_in_place(|| Cluster::start(&ClusterSpec::brokers(&["broker-a"])));
    let namesrv = cluster.namesrv_addr.clone();
    let addrs = vec![format!("127.0.0.1:{}", cluster.broker("broker-a").port)];
    let admin = Direct::connect(&namesrv).await;
    let topics: Vec<String> = (0..12).map(|i| unique_topic(&format!("bench{i}"))).collect();
    for topic in &topics {
        admin.create_topic(topic, &addrs).await;
    }
    let direct = DirectPath::connect(&namesrv).await;
    // `BENCH_ONLY=state` skips the throughput runs (for iterating on memory and recovery); `BENCH_ONLY=sdk` runs
    // only the comparison with Apache's proxy, `BENCH_ONLY=fanin` only the fan-in, `BENCH_ONLY=churn` only the
    // soak with clients coming and going, `BENCH_ONLY=throughput` only the runs against the direct client (for
    // before/after figures of one change), `BENCH_ONLY=remoting` only the remoting front against the cluster and
    // Apache's proxy, `BENCH_ONLY=scale` only how cost grows with groups and subscribers.
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    if only == "churn" {
        let churn = churn::churn(&params, &namesrv, [&topics[9], &topics[10]], true).await;
        return json!({"parameters": {"full": params.full}, "runs": [], "churn": churn});
    }
    if only == "sdk" {
        drop((direct, admin, cluster));
        let sdk = against_apache_proxy(&params).await;
        return json!({"parameters": {"full": params.full}, "runs": [], "againstApacheProxy": sdk});
    }
    if only == "remoting" {
        let remoting = remoting::remoting(&params, &cluster).await;
        return json!({"parameters": {"full": params.full}, "runs": [], "remoting": remoting});
    }
    if only == "scale" {
        let scale = scale::scale(&params, &namesrv, &addrs).await;
        return json!({"parameters": {"full": params.full}, "runs": [], "scale": scale});
    }
    if only == "tier" {
        let tier = tier::tier(&params, &namesrv, &topics[11]).await;
        return json!({"parameters": {"full": params.full}, "runs": [], "tier": tier});
    }
    if only == "fanin" {
        let fan_in = fan_in::fan_in(&params, &namesrv, [&topics[7], &topics[8]]).await;
        return json!({"parameters": {"full": params.full}, "runs": [], "fanIn": fan_in});
    }
    if only == "state" {
        let in_flight = in_flight_rss(&params, &namesrv, &direct, &topics[6]).await;
        println!("in flight: {in_flight}");
        let recovered = recovery(&params, &namesrv).await;
        println!("recovery: {recovered}");
        return json!({"parameters": {"full": params.full}, "runs": [], "inFlight": in_flight, "recovery": recovered});
    }
    // Warm-up: routes, connections, the broker's JIT.
    let warm = Params { secs: if params.full { 3.0 } else { 0.5 }, ..params.clone() };
    direct.run(&warm, &topics[0], None, warm.secs).await;

    let a = direct.run(&params, &topics[1], None, params.secs).await;
    println!("direct: {a}");
    let popgate = Popgate::start(&namesrv, "").await;
    popgate_run(&warm, &popgate, &topics[0], Transport::LongPoll, None, warm.secs).await;
    let lp = popgate_run(&params, &popgate, &topics[2], Transport::LongPoll, None, params.secs).await;
    println!("popgate long-poll: {lp}");
    drop(popgate);
    let popgate = Popgate::start(&namesrv, "").await;
    let sse = popgate_run(&params, &popgate, &topics[3], Transport::Sse, None, params.secs).await;
    println!("popgate SSE: {sse}");
    drop(popgate);

    // Half of popgate's peak rate end to end, both paths: the latency popgate adds when not saturated (a batch
    // publish outruns its consumers, so its publish rate would be no load they keep up with). A p99 on shared
    // cores moves from run to run, so the pair runs `HALF_LOAD_RUNS` times and the median decides.
    let peak = lp["endToEndMsgsPerSec"].as_f64().unwrap_or(100.0).max(10.0);
    let mut half_runs = Vec::new();
    for run in 0..HALF_LOAD_RUNS {
        let pair = [unique_topic(&format!("half{run}d")), unique_topic(&format!("half{run}p"))];
        for topic in &pair {
            admin.create_topic(topic, &addrs).await;
        }
        let half = half_load(&params, &direct, &namesrv, peak, &pair).await;
        println!("half load, run {}: {half}", run + 1);
        half_runs.push(half);
    }
    let median = |key: &str| {
        let mut values: Vec<f64> = half_runs.iter().filter_map(|h| h[key].as_f64()).collect();
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied()
    };
    let half = json!({
        "ratePerSec": (peak / 2.0).round(),
        "medianAddedPublishP99Ms": median("addedPublishP99Ms"),
        "medianAddedEndToEndP99Ms": median("addedEndToEndP99Ms"),
        "runs": half_runs,
    });
    println!("half load: {half}");

    if only == "throughput" {
        return json!({"parameters": {"full": params.full}, "runs": [a, lp, sse], "halfLoad": half,
            "ratios": {"longPoll": ratios(&lp, &a), "sse": ratios(&sse, &a)}});
    }
    let in_flight = in_flight_rss(&params, &namesrv, &direct, &topics[6]).await;
    println!("in flight: {in_flight}");
    let recovered = recovery(&params, &namesrv).await;
    println!("recovery: {recovered}");
    let fan_in = fan_in::fan_in(&params, &namesrv, [&topics[7], &topics[8]]).await;
    println!("fan-in: {fan_in}");
    let churn = churn::churn(&params, &namesrv, [&topics[9], &topics[10]], false).await;
    let tier = tier::tier(&params, &namesrv, &topics[11]).await;
    println!("tier: {tier}");
    let remoting = remoting::remoting(&params, &cluster).await;
    let scale = scale::scale(&params, &namesrv, &addrs).await;
    // Its own brokers: stop these first so they take no CPU from it.
    drop((direct, admin, cluster));
    let sdk = against_apache_proxy(&params).await;

    json!({
        "parameters": {"messageBytes": params.size, "producers": params.producers, "subscribers": params.subscribers,
            "secsPerRun": params.secs, "inFlight": params.in_flight, "recoveryRecords": params.recovery_records,
            "publishBatch": params.publish_batch,
            "full": params.full, "build": if cfg!(debug_assertions) { "debug" } else { "release" }},
        "runs": [a, lp, sse],
        "ratios": {"longPoll": ratios(&lp, &a), "sse": ratios(&sse, &a)},
        "halfLoad": half,
        "inFlight": in_flight,
        "recovery": recovered,
        "fanIn": fan_in,
        "churn": churn,
        "tier": tier,
        "remoting": remoting,
        "scale": scale,
        "againstApacheProxy": sdk,
    })
}

/// How many times the half-load pair runs.
const HALF_LOAD_RUNS: usize = 3;

/// Both paths at half of popgate's `peak` end-to-end rate, on fresh topics `[direct, popgate]`: the p99s and
/// what popgate adds to them.
async fn half_load(params: &Params, direct: &DirectPath, namesrv: &str, peak: f64, topics: &[String; 2]) -> Value {
    let per_producer = peak / 2.0 / params.producers as f64;
    let half_direct = direct.run(params, &topics[0], Some(per_producer), params.secs).await;
    let popgate = Popgate::start(namesrv, "").await;
    let half_popgate =
        popgate_run(params, &popgate, &topics[1], Transport::LongPoll, Some(per_producer), params.secs).await;
    drop(popgate);
    let added = |path: &[&str]| {
        let get = |v: &Value| path.iter().fold(v, |v, k| &v[*k]).as_f64().unwrap_or(0.0);
        ((get(&half_popgate) - get(&half_direct)) * 100.0).round() / 100.0
    };
    json!({
        "direct": {"publishP99Ms": half_direct["publishLatencyMs"]["p99"], "endToEndP99Ms": half_direct["endToEndLatencyMs"]["p99"]},
        "popgate": {"publishP99Ms": half_popgate["publishLatencyMs"]["p99"], "endToEndP99Ms": half_popgate["endToEndLatencyMs"]["p99"]},
        "addedPublishP99Ms": added(&["publishLatencyMs", "p99"]),
        "addedEndToEndP99Ms": added(&["endToEndLatencyMs", "p99"]),
    })
}

/// The comparison with Apache's proxy on a `throughput` broker (async flush and replication: the proxies, not
/// the broker, bound the figures), and in the full run once more on `balanced` (sync replication to a slave).
async fn against_apache_proxy(params: &Params) -> Value {
    let profiles: &[&str] = if params.full { &["throughput", "balanced"] } else { &["throughput"] };
    let mut comparisons = Vec::new();
    for profile in profiles {
        comparisons.push(apache_proxy::compare(params, profile).await);
    }
    Value::Array(comparisons)
}
