//! popgate-chaos: producers and consumers run through popgate for a while, faults are injected on a seeded
//! random schedule, and then the history is checked (openmessaging/openchaos style):
//!
//! - **lost = 0**: every publish that got 200 was ACKed by a consumer or sits in `%DLQ%<group>`;
//! - **order**: within a message group no event is handed out while an earlier one is unsettled;
//! - **ACK precedence**: popgate's broker ACKs never outnumber the subscriber ACKs, recovered ACK intents and
//!   DLQ writes that allow them (sampled from `/metrics` all along), and once everything is settled the
//!   broker's consumer progress holds nothing a subscriber did not settle;
//! - duplicates, redeliveries and dead letters are counted and reported, with the recovery time after each
//!   fault and end-to-end latency buckets.
//!
//! Faults: `kill -9` of popgate and restart, SIGSTOP/SIGCONT of the broker, `kill -9` of the broker and
//! restart, the state store's disk filling up and freeing, subscribers dying with deliveries in hand.
//!
//! Run by `cargo test` as a short version (about 2 minutes, every fault kind at least once). Longer runs:
//! `CHAOS_SECS=600 CHAOS_SEED=42 cargo test --release --test chaos`. Settings (environment):
//! `CHAOS_SEED` (default: from the clock, printed), `CHAOS_SECS` (fault phase, default 60),
//! `CHAOS_INTERVAL_SECS` (mean gap between faults, default 4), `CHAOS_GROUPS` (message groups = producers,
//! default 8), `CHAOS_RATE` (events/s per group, default 10), `CHAOS_JSON` (report path, default
//! `<target>/tmp/chaos-report.json`). A failing seed replays the same fault schedule.

#[path = "../harness/mod.rs"]
#[allow(dead_code)]
mod harness;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use parking_lot::{Mutex, RwLock};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use harness::direct::{Direct, DirectConsumer};
use harness::env_or;
use harness::popgate::{metric_value, Popgate};
use harness::rocketmq::{Cluster, ClusterSpec};
use harness::{unique_topic, Tmpfs};

/// A poison event (every 53rd of a group, offset 7) is TERMed by its consumer: it must end in the DLQ.
fn is_poison(index: u64) -> bool {
    index % 53 == 7
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum FaultKind {
    PopgateKill9,
    BrokerPause,
    BrokerKill9,
    DiskFull,
    SubscriberDeath,
}

impl FaultKind {
    const ALL: [FaultKind; 5] = [
        FaultKind::PopgateKill9,
        FaultKind::BrokerPause,
        FaultKind::BrokerKill9,
        FaultKind::DiskFull,
        FaultKind::SubscriberDeath,
    ];

    fn name(self) -> &'static str {
        match self {
            FaultKind::PopgateKill9 => "popgate_kill9_restart",
            FaultKind::BrokerPause => "broker_sigstop_sigcont",
            FaultKind::BrokerKill9 => "broker_kill9_restart",
            FaultKind::DiskFull => "state_disk_full_then_freed",
            FaultKind::SubscriberDeath => "subscribers_die_mid_delivery",
        }
    }
}

/// One scheduled fault: wait `gap_ms`, then inject it for `hold_ms`.
#[derive(Clone, Debug)]
struct Fault {
    kind: FaultKind,
    gap_ms: u64,
    hold_ms: u64,
}

struct Settings {
    seed: u64,
    secs: u64,
    interval_secs: f64,
    groups: usize,
    rate: f64,
    json_path: std::path::PathBuf,
    /// Fault kinds to use (`CHAOS_FAULTS`, comma-separated names; default all).
    kinds: Vec<FaultKind>,
}

impl Settings {
    fn from_env() -> Settings {
        let clock_seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(1);
        Settings {
            seed: env_or("CHAOS_SEED", clock_seed),
            secs: env_or("CHAOS_SECS", 60),
            interval_secs: env_or("CHAOS_INTERVAL_SECS", 4.0),
            groups: env_or("CHAOS_GROUPS", 8),
            rate: env_or("CHAOS_RATE", 10.0),
            json_path: std::env::var("CHAOS_JSON")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|_| std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("chaos-report.json")),
            kinds: match std::env::var("CHAOS_FAULTS") {
                Ok(names) => {
                    FaultKind::ALL.into_iter().filter(|k| names.split(',').any(|n| n.trim() == k.name())).collect()
                }
                Err(_) => FaultKind::ALL.to_vec(),
            },
        }
    }

    /// The fault schedule: every kind once in a seeded order, then seeded random kinds until the phase is full.
    /// The estimate of each fault's cost (a broker restart takes ~15 s) keeps the schedule within `secs`.
    fn schedule(&self) -> Vec<Fault> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        if self.kinds.is_empty() {
            return Vec::new();
        }
        let mut kinds: Vec<FaultKind> = self.kinds.clone();
        kinds.shuffle(&mut rng);
        let mut faults = Vec::new();
        let mut spent_ms = 0u64;
        let mut i = 0;
        loop {
            let kind = if i < kinds.len() { kinds[i] } else { self.kinds[rng.random_range(0..self.kinds.len())] };
            i += 1;
            let gap_ms = (self.interval_secs * 1000.0 * rng.random_range(0.5..1.5)) as u64;
            let hold_ms = match kind {
                FaultKind::BrokerPause => rng.random_range(2_000..5_000),
                FaultKind::BrokerKill9 => rng.random_range(500..3_000),
                FaultKind::DiskFull => rng.random_range(5_000..9_000),
                FaultKind::PopgateKill9 | FaultKind::SubscriberDeath => 0,
            };
            let cost = gap_ms + hold_ms + if kind == FaultKind::BrokerKill9 { 15_000 } else { 1_000 };
            if i > kinds.len() && spent_ms + cost > self.secs * 1000 {
                break;
            }
            spent_ms += cost;
            faults.push(Fault { kind, gap_ms, hold_ms });
        }
        faults
    }
}

/// Everything observed, keyed by event (`g<group>-<index>`).
#[derive(Default)]
struct Ledger {
    /// 200-published events: ms (since start) when their publish was sent.
    published: HashMap<String, f64>,
    publish_attempts_failed: u64,
    publish_latency_ms: Vec<f64>,
    /// Receipt times of each event (any subscriber, any attempt).
    receipts: HashMap<String, Vec<f64>>,
    /// Per group: which indexes a consumer started to settle (ACK or TERM sent), and the first index not.
    started: Vec<HashSet<u64>>,
    prefix: Vec<u64>,
    /// Events whose ACK popgate confirmed (or confirmed as already known after an ambiguous first try).
    acked: HashSet<String>,
    acked_ambiguous: u64,
    /// Events whose TERM popgate confirmed.
    termed: HashSet<String>,
    /// Receipts of an event after its ACK/TERM was confirmed.
    duplicated: u64,
    reordered: u64,
    reorder_examples: Vec<String>,
    /// Completion times (ms) of successful publishes and ACKs, for recovery times.
    publish_ok_at: Vec<f64>,
    ack_ok_at: Vec<f64>,
    /// Subscriber deaths: when, and the events they dropped.
    deaths: Vec<(f64, Vec<String>)>,
    /// Broker ACKs that outnumbered what allows them in one `/metrics` sample.
    precedence_violations: u64,
    metric_samples: u64,
}

struct World {
    base: RwLock<String>,
    topic: String,
    group: String,
    t0: Instant,
    http: reqwest::Client,
    stop_publish: AtomicBool,
    stop_consume: AtomicBool,
    /// Subscribers that are to die with their next deliveries in hand.
    deaths_pending: AtomicU32,
    /// Producers send large events (while the disk is full, so the store's writes outrun the space RocksDB
    /// preallocated for its WAL and actually fail).
    heavy: AtomicBool,
    ledger: Mutex<Ledger>,
}

fn key_of(group: usize, index: u64) -> String {
    format!("g{group}-{index}")
}

fn parse_key(key: &str) -> Option<(usize, u64)> {
    let (g, i) = key.strip_prefix('g')?.split_once('-')?;
    Some((g.parse().ok()?, i.parse().ok()?))
}

impl World {
    fn now_ms(&self) -> f64 {
        self.t0.elapsed().as_secs_f64() * 1000.0
    }

    fn base(&self) -> String {
        self.base.read().clone()
    }

    /// A delivery arrived: counts it and checks its group's order. Returns its event key.
    fn receive(&self, delivery: &Value) -> Option<String> {
        let data = delivery["event"]["data"].as_str()?;
        let key = data.split('|').next()?.to_owned();
        let (group, index) = parse_key(&key)?;
        let now = self.now_ms();
        let mut ledger = self.ledger.lock();
        ledger.receipts.entry(key.clone()).or_default().push(now);
        if ledger.acked.contains(&key) || ledger.termed.contains(&key) {
            ledger.duplicated += 1;
            return Some(key);
        }
        if !ledger.started[group].contains(&index) && ledger.prefix[group] < index {
            ledger.reordered += 1;
            let first_open = ledger.prefix[group];
            if ledger.reorder_examples.len() < 20 {
                ledger.reorder_examples.push(format!("{key} handed out while g{group}-{first_open} was unsettled"));
            }
        }
        Some(key)
    }

    /// The consumer is about to ACK or TERM `key` (before the request, so a racing hand-out of the next event
    /// of the group is not mistaken for a reordering).
    fn start_settle(&self, key: &str) {
        let Some((group, index)) = parse_key(key) else { return };
        let mut guard = self.ledger.lock();
        let ledger = &mut *guard;
        ledger.started[group].insert(index);
        while ledger.started[group].contains(&ledger.prefix[group]) {
            ledger.prefix[group] += 1;
        }
    }

    /// The settle did not happen (popgate refused it): the event is open again.
    fn undo_settle(&self, key: &str) {
        let Some((group, index)) = parse_key(key) else { return };
        let mut ledger = self.ledger.lock();
        if ledger.acked.contains(key) || ledger.termed.contains(key) {
            return;
        }
        ledger.started[group].remove(&index);
        if index < ledger.prefix[group] {
            ledger.prefix[group] = index;
        }
    }
}

// === producers ===

async fn producer(world: Arc<World>, group: usize, rate: f64) {
    let pause = Duration::from_secs_f64(1.0 / rate);
    let padding = "x".repeat(96);
    let heavy_padding = "x".repeat(16 * 1024);
    let mut index = 0u64;
    let mut next = tokio::time::Instant::now();
    while !world.stop_publish.load(Ordering::Relaxed) {
        let key = key_of(group, index);
        let sent = world.now_ms();
        let pad = if world.heavy.load(Ordering::Relaxed) { &heavy_padding } else { &padding };
        let body = json!({"topic": world.topic, "data": format!("{key}|{pad}"), "messageGroup": format!("g{group}")});
        let resp = world
            .http
            .post(format!("{}/events/publish", world.base()))
            .json(&body)
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        let ok = resp.is_ok_and(|r| r.status().as_u16() == 200);
        let done = world.now_ms();
        {
            let mut ledger = world.ledger.lock();
            if ok {
                ledger.published.entry(key).or_insert(sent);
                ledger.publish_latency_ms.push(done - sent);
                ledger.publish_ok_at.push(done);
            } else {
                ledger.publish_attempts_failed += 1;
            }
        }
        if ok {
            // The next event of the group only after this one is stored: a group's publish order is known.
            index += 1;
            next += pause;
            tokio::time::sleep_until(next).await;
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            next = tokio::time::Instant::now();
        }
    }
}

// === consumers ===

/// Settles `items` (delivery id, event key, TERM?) with retries until popgate gives a definite answer.
async fn settle(world: &World, items: Vec<(String, String, bool)>) {
    for (_, key, _) in &items {
        world.start_settle(key);
    }
    let mut ambiguous: HashSet<String> = HashSet::new();
    let (terms, acks): (Vec<_>, Vec<_>) = items.into_iter().partition(|(_, _, term)| *term);
    let mut open: Vec<(String, String)> = acks.into_iter().map(|(id, key, _)| (id, key)).collect();
    let deadline = Instant::now() + Duration::from_secs(90);
    while !open.is_empty() && Instant::now() < deadline {
        let ids: Vec<&str> = open.iter().map(|(id, _)| id.as_str()).collect();
        let resp = world
            .http
            .post(format!("{}/events/ack", world.base()))
            .json(&json!({ "deliveryIds": ids }))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        let results: Option<Vec<Value>> = match resp {
            Ok(r) if r.status().as_u16() == 200 => {
                r.json::<Value>().await.ok().and_then(|v| v["results"].as_array().cloned())
            }
            _ => None,
        };
        let Some(results) = results else {
            ambiguous.extend(open.iter().map(|(id, _)| id.clone()));
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        };
        let mut retry = Vec::new();
        for ((id, key), result) in open.into_iter().zip(results) {
            match result["status"].as_str() {
                Some("acked") => confirm(world, &key, false, false),
                // Already recorded by an earlier try whose answer was lost.
                Some("unknown") if ambiguous.contains(&id) => confirm(world, &key, false, true),
                Some("error") => retry.push((id, key)),
                _ => world.undo_settle(&key),
            }
        }
        open = retry;
        if !open.is_empty() {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    for (_, key) in open {
        world.undo_settle(&key);
    }
    for (id, key, _) in terms {
        let mut was_ambiguous = false;
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let resp = world
                .http
                .post(format!("{}/events/term", world.base()))
                .json(&json!({"deliveryId": id, "reason": "poison (chaos)"}))
                .timeout(Duration::from_secs(10))
                .send()
                .await;
            match resp.map(|r| r.status().as_u16()) {
                Ok(200) => {
                    confirm(world, &key, true, false);
                    break;
                }
                Ok(404) if was_ambiguous => {
                    confirm(world, &key, true, true);
                    break;
                }
                Ok(404 | 409) => {
                    world.undo_settle(&key);
                    break;
                }
                Ok(_) => {}
                Err(_) => was_ambiguous = true,
            }
            if Instant::now() > deadline {
                world.undo_settle(&key);
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

fn confirm(world: &World, key: &str, term: bool, ambiguous: bool) {
    let now = world.now_ms();
    let mut ledger = world.ledger.lock();
    if ambiguous {
        ledger.acked_ambiguous += 1;
    }
    if term {
        ledger.termed.insert(key.to_owned());
    } else {
        ledger.acked.insert(key.to_owned());
    }
    ledger.ack_ok_at.push(now);
}

/// Whether this subscriber is to die now (with what it holds).
fn take_death(world: &World) -> bool {
    world.deaths_pending.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok()
}

fn die(world: &World, keys: Vec<String>) {
    let now = world.now_ms();
    world.ledger.lock().deaths.push((now, keys));
}

/// A long-polling subscriber with batch ACKs.
async fn poller(world: Arc<World>) {
    while !world.stop_consume.load(Ordering::Relaxed) {
        let url =
            format!("{}/events/poll?group={}&topic={}&max=32&waitMs=1000", world.base(), world.group, world.topic);
        let resp = world.http.get(url).timeout(Duration::from_secs(10)).send().await;
        let deliveries: Vec<Value> = match resp {
            Ok(r) if r.status().as_u16() == 200 => {
                r.json::<Value>().await.ok().and_then(|v| v["deliveries"].as_array().cloned()).unwrap_or_default()
            }
            _ => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let mut items = Vec::new();
        for d in &deliveries {
            let Some(key) = world.receive(d) else { continue };
            let id = d["deliveryId"].as_str().unwrap_or_default().to_owned();
            let term = parse_key(&key).is_some_and(|(_, i)| is_poison(i));
            items.push((id, key, term));
        }
        if !items.is_empty() && take_death(&world) {
            die(&world, items.into_iter().map(|(_, key, _)| key).collect());
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        }
        settle(&world, items).await;
    }
}

/// An SSE subscriber ACKing each delivery by POST; it reconnects when the stream breaks.
async fn sse_subscriber(world: Arc<World>) {
    let client = reqwest::Client::new();
    while !world.stop_consume.load(Ordering::Relaxed) {
        let url = format!("{}/events/stream?group={}&topic={}&prefetch=16", world.base(), world.group, world.topic);
        let resp = match client.get(url).send().await {
            Ok(r) if r.status().as_u16() == 200 => r,
            _ => {
                tokio::time::sleep(Duration::from_millis(300)).await;
                continue;
            }
        };
        let mut body = resp.bytes_stream();
        let mut buffer = String::new();
        'stream: while !world.stop_consume.load(Ordering::Relaxed) {
            let chunk = match tokio::time::timeout(Duration::from_secs(2), body.next()).await {
                Err(_) => continue,
                Ok(Some(Ok(chunk))) => chunk,
                Ok(_) => break,
            };
            buffer.push_str(&String::from_utf8_lossy(&chunk));
            let mut items = Vec::new();
            while let Some(end) = buffer.find("\n\n") {
                let block: String = buffer.drain(..end + 2).collect();
                if !block.lines().any(|l| l == "event: delivery") {
                    continue;
                }
                let data: String = block.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
                let Ok(d) = serde_json::from_str::<Value>(&data) else { continue };
                let Some(key) = world.receive(&d) else { continue };
                let id = d["deliveryId"].as_str().unwrap_or_default().to_owned();
                let term = parse_key(&key).is_some_and(|(_, i)| is_poison(i));
                items.push((id, key, term));
            }
            if !items.is_empty() && take_death(&world) {
                // Dies mid-stream: the connection drops with these deliveries unACKed.
                die(&world, items.into_iter().map(|(_, key, _)| key).collect());
                break 'stream;
            }
            settle(&world, items).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

// === the ACK-precedence monitor ===

/// Samples `/metrics`: broker ACKs ≤ subscriber ACKs + DLQ writes + ACK intents recovered at boot, per process.
async fn monitor(world: Arc<World>) {
    let series = |text: &str, name: &str| metric_value(text, name);
    while !world.stop_consume.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Ok(resp) = world.http.get(format!("{}/metrics", world.base())).timeout(Duration::from_secs(5)).send().await
        else {
            continue;
        };
        let Ok(text) = resp.text().await else { continue };
        let broker_acks = series(&text, "popgate_broker_acks_total");
        let allowed = series(&text, "popgate_acks_total{result=\"acked\"}")
            + series(&text, &format!("popgate_dlq_messages_total{{group=\"{}\"}}", world.group))
            + series(&text, "popgate_recovered_deliveries_total{outcome=\"ack_pending\"}");
        let mut ledger = world.ledger.lock();
        ledger.metric_samples += 1;
        if broker_acks > allowed {
            ledger.precedence_violations += 1;
            eprintln!("chaos: broker ACKs {broker_acks} > subscriber ACKs + DLQ writes + recovered intents {allowed}");
        }
    }
}

// === faults ===

struct FaultRecord {
    kind: FaultKind,
    at_ms: f64,
    lifted_ms: f64,
    recovery_ms: Option<f64>,
    /// For a full disk: the state-store writes that failed meanwhile (0 would mean the fault did not bite).
    store_write_failures: Option<f64>,
}

struct Rig {
    cluster: Cluster,
    popgate: Popgate,
    disk: Tmpfs,
}

async fn inject(rig: &mut Rig, world: &World, fault: &Fault) -> FaultRecord {
    let at_ms = world.now_ms();
    let hold = Duration::from_millis(fault.hold_ms);
    match fault.kind {
        FaultKind::PopgateKill9 => {
            rig.popgate.restart().await;
            *world.base.write() = rig.popgate.base.clone();
        }
        FaultKind::BrokerPause => {
            rig.cluster.pause_broker("broker-a");
            tokio::time::sleep(hold).await;
            rig.cluster.resume_broker("broker-a");
        }
        FaultKind::BrokerKill9 => {
            rig.cluster.kill_broker("broker-a");
            tokio::time::sleep(hold).await;
            tokio::task::block_in_place(|| rig.cluster.restart_broker("broker-a"));
        }
        FaultKind::DiskFull => {
            let before = rig.popgate.metric("popgate_offset_write_failures_total").await;
            world.heavy.store(true, Ordering::Relaxed);
            let full = rig.disk.keep_full();
            tokio::time::sleep(hold).await;
            let failures = rig.popgate.metric("popgate_offset_write_failures_total").await - before;
            drop(full);
            rig.disk.free();
            world.heavy.store(false, Ordering::Relaxed);
            return FaultRecord {
                kind: fault.kind,
                at_ms,
                lifted_ms: world.now_ms(),
                recovery_ms: None,
                store_write_failures: Some(failures),
            };
        }
        FaultKind::SubscriberDeath => {
            world.deaths_pending.store(2, Ordering::Relaxed);
        }
    }
    FaultRecord { kind: fault.kind, at_ms, lifted_ms: world.now_ms(), recovery_ms: None, store_write_failures: None }
}

/// After a fault is lifted: until a publish and an ACK both succeeded again. After subscriber deaths: until
/// every event a dying subscriber held was handed out again.
fn recovery_ms(ledger: &Ledger, record: &FaultRecord) -> Option<f64> {
    if record.kind == FaultKind::SubscriberDeath {
        let deaths: Vec<&(f64, Vec<String>)> =
            ledger.deaths.iter().filter(|(at, _)| *at >= record.at_ms).take(2).collect();
        let mut worst: Option<f64> = None;
        for (at, keys) in deaths {
            for key in keys {
                let again = ledger.receipts.get(key)?.iter().find(|t| *t > at)?;
                worst = Some(worst.unwrap_or(0.0).max(again - at));
            }
        }
        return worst;
    }
    let first_after = |times: &Vec<f64>| times.iter().copied().filter(|t| *t >= record.lifted_ms).reduce(f64::min);
    let publish = first_after(&ledger.publish_ok_at)?;
    let ack = first_after(&ledger.ack_ok_at)?;
    Some(publish.max(ack) - record.lifted_ms)
}

fn buckets(values: &[f64]) -> BTreeMap<&'static str, usize> {
    let bounds: [(f64, &str); 6] = [
        (1.0, "le_1ms"),
        (5.0, "le_5ms"),
        (10.0, "le_10ms"),
        (100.0, "le_100ms"),
        (1000.0, "le_1s"),
        (3000.0, "le_3s"),
    ];
    let mut out: BTreeMap<&'static str, usize> = bounds.iter().map(|(_, n)| (*n, 0)).collect();
    out.insert("more", 0);
    for v in values {
        let name = bounds.iter().find(|(b, _)| v <= b).map(|(_, n)| *n).unwrap_or("more");
        *out.entry(name).or_default() += 1;
    }
    out
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    values[((values.len() as f64 * p).ceil() as usize).clamp(1, values.len()) - 1]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("runtime");
    let failures = runtime.block_on(run(Settings::from_env()));
    if !failures.is_empty() {
        eprintln!("chaos: FAILED: {}", failures.join("; "));
        std::process::exit(1);
    }
    println!("chaos: passed");
}

async fn run(settings: Settings) -> Vec<String> {
    let schedule = settings.schedule();
    println!(
        "chaos: seed {} ({}s of faults, {} groups x {}/s); replay with CHAOS_SEED={} CHAOS_SECS={} CHAOS_INTERVAL_SECS={}",
        settings.seed, settings.secs, settings.groups, settings.rate, settings.seed, settings.secs, settings.interval_secs
    );
    for f in &schedule {
        println!("chaos:   after {:>5} ms  {:<28} hold {} ms", f.gap_ms, f.kind.name(), f.hold_ms);
    }

    let cluster = tokio::task::block_in_place(|| Cluster::start(&ClusterSpec::brokers(&["broker-a"])));
    let (topic, group) = (unique_topic("chaos"), unique_topic("g_chaos"));
    let broker_addr = format!("127.0.0.1:{}", cluster.broker("broker-a").port);
    // FIFO groups need queues that do not change: the topic is created up front.
    Direct::connect(&cluster.namesrv_addr).await.create_topic(&topic, &[broker_addr]).await;
    let disk = Tmpfs::mount(256 * 1024);
    let config = popgate_config(&disk.path.join("state"));
    let popgate = Popgate::start(&cluster.namesrv_addr, &config).await;
    let (status, answer) = popgate
        .post_json(
            "/events/subscribe",
            &json!({"group": group, "topic": topic, "ordered": true, "ackTimeoutMs": 3000, "maxAttempts": 50,
                "initialBackoffMs": 100, "maxBackoffMs": 1000}),
        )
        .await;
    assert_eq!(status, 200, "subscribe: {answer}");

    let world = Arc::new(World {
        base: RwLock::new(popgate.base.clone()),
        topic: topic.clone(),
        group: group.clone(),
        t0: Instant::now(),
        http: reqwest::Client::new(),
        stop_publish: AtomicBool::new(false),
        stop_consume: AtomicBool::new(false),
        deaths_pending: AtomicU32::new(0),
        heavy: AtomicBool::new(false),
        ledger: Mutex::new(Ledger {
            started: vec![HashSet::new(); settings.groups],
            prefix: vec![0; settings.groups],
            ..Ledger::default()
        }),
    });
    let mut tasks = Vec::new();
    for g in 0..settings.groups {
        tasks.push(tokio::spawn(producer(world.clone(), g, settings.rate)));
    }
    let mut consumers = vec![
        tokio::spawn(poller(world.clone())),
        tokio::spawn(poller(world.clone())),
        tokio::spawn(sse_subscriber(world.clone())),
    ];
    consumers.push(tokio::spawn(monitor(world.clone())));

    let mut rig = Rig { cluster, popgate, disk };
    let mut records = Vec::new();
    for fault in &schedule {
        tokio::time::sleep(Duration::from_millis(fault.gap_ms)).await;
        println!("chaos: {:>8.0} ms  {}", world.now_ms(), fault.kind.name());
        records.push(inject(&mut rig, &world, fault).await);
    }
    // Load goes on until the service came back from every fault (or 90 s), so each recovery time is measured.
    let recovery_deadline = Instant::now() + Duration::from_secs(90);
    tokio::time::sleep(Duration::from_secs(3)).await;
    while Instant::now() < recovery_deadline {
        let all_back = {
            let ledger = world.ledger.lock();
            records.iter().all(|r| recovery_ms(&ledger, r).is_some())
        };
        if all_back {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    world.stop_publish.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = task.await;
    }
    let stopped_ms = world.now_ms();

    // Drain: every published event settled, then popgate holds nothing (broker ACKs and DLQ writes done).
    let drain_deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let open = {
            let ledger = world.ledger.lock();
            ledger.published.keys().filter(|k| !ledger.acked.contains(*k) && !ledger.termed.contains(*k)).count()
        };
        if open == 0 || Instant::now() > drain_deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let drained_ms = world.now_ms();
    let pending_deadline = Instant::now() + Duration::from_secs(60);
    while rig.popgate.metric("popgate_pending_deliveries").await > 0.0 && Instant::now() < pending_deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let pending_left = rig.popgate.metric("popgate_pending_deliveries").await;
    world.stop_consume.store(true, Ordering::Relaxed);
    for task in consumers {
        let _ = task.await;
    }

    // The broker's view: the DLQ's contents, and what the group's consumer progress still holds.
    let direct = Direct::connect(&rig.cluster.namesrv_addr).await;
    let dlq: HashSet<String> = direct
        .read_all(&format!("%DLQ%{group}"))
        .await
        .iter()
        .filter_map(|m| String::from_utf8_lossy(&m.body).split('|').next().map(str::to_owned))
        .collect();
    rig.popgate.kill9();
    let leftover =
        DirectConsumer::connect(&rig.cluster.namesrv_addr).await.drain(&group, &topic, Duration::from_secs(8)).await;

    let ledger = world.ledger.lock();
    for record in &mut records {
        record.recovery_ms = recovery_ms(&ledger, record);
    }
    let lost: Vec<&String> =
        ledger.published.keys().filter(|k| !ledger.acked.contains(*k) && !dlq.contains(*k)).collect();
    let leftover_unsettled = leftover
        .iter()
        .filter_map(|b| b.split('|').next())
        .filter(|k| ledger.published.contains_key(*k) && !ledger.acked.contains(*k) && !ledger.termed.contains(*k))
        .count();
    let received: usize = ledger.receipts.values().map(Vec::len).sum();
    let mut e2e: Vec<f64> =
        ledger.receipts.iter().filter_map(|(k, times)| Some(times.first()? - ledger.published.get(k)?)).collect();
    let mut publish_latency = ledger.publish_latency_ms.clone();
    let faults_json: Vec<Value> = records
        .iter()
        .map(|r| {
            json!({"fault": r.kind.name(), "atMs": r.at_ms.round(), "heldMs": (r.lifted_ms - r.at_ms).round(),
                "recoveryMs": r.recovery_ms.map(f64::round), "storeWriteFailures": r.store_write_failures})
        })
        .collect();
    let report = json!({
        "seed": settings.seed,
        "faultPhaseSecs": settings.secs,
        "groups": settings.groups,
        "ratePerGroup": settings.rate,
        "sent": ledger.published.len(),
        "publishAttemptsFailed": ledger.publish_attempts_failed,
        "acked": ledger.acked.len(),
        "ackedAfterAmbiguousAnswer": ledger.acked_ambiguous,
        "terminated": ledger.termed.len(),
        "deadLettered": dlq.len(),
        "lost": lost.len(),
        "lostExamples": lost.iter().take(20).collect::<Vec<_>>(),
        "received": received,
        "redelivered": received.saturating_sub(ledger.receipts.len()),
        "duplicated": ledger.duplicated,
        "reordered": ledger.reordered,
        "reorderExamples": ledger.reorder_examples,
        "precedenceViolations": ledger.precedence_violations,
        "metricSamples": ledger.metric_samples,
        "brokerLeftoverAfterDrain": leftover.len(),
        "brokerLeftoverUnsettled": leftover_unsettled,
        "pendingAtEnd": pending_left,
        "drainMs": (drained_ms - stopped_ms).round(),
        "faults": faults_json,
        "endToEndLatencyBuckets": buckets(&e2e),
        "endToEndLatencyMs": {"p50": percentile(&mut e2e, 0.5), "p99": percentile(&mut e2e, 0.99), "max": percentile(&mut e2e, 1.0)},
        "publishLatencyBuckets": buckets(&publish_latency),
        "publishLatencyMs": {"p50": percentile(&mut publish_latency, 0.5), "p99": percentile(&mut publish_latency, 0.99)},
    });
    print_report(&report);
    if let Err(error) = std::fs::write(&settings.json_path, serde_json::to_string_pretty(&report).unwrap_or_default()) {
        eprintln!("chaos: cannot write {}: {error}", settings.json_path.display());
    } else {
        println!("chaos: JSON report in {}", settings.json_path.display());
    }

    let mut failures = Vec::new();
    if ledger.published.is_empty() {
        failures.push("nothing was published".to_owned());
    }
    if !lost.is_empty() {
        failures.push(format!("{} lost: {:?}", lost.len(), lost.iter().take(10).collect::<Vec<_>>()));
    }
    if ledger.reordered > 0 {
        failures.push(format!("{} reordered: {:?}", ledger.reordered, ledger.reorder_examples));
    }
    if ledger.precedence_violations > 0 {
        failures.push(format!("{} broker-ACK precedence violations", ledger.precedence_violations));
    }
    let injected: HashSet<FaultKind> = records.iter().map(|r| r.kind).collect();
    if injected.len() < settings.kinds.len() {
        failures.push("not every fault kind was injected".to_owned());
    }
    for record in records.iter().filter(|r| r.recovery_ms.is_none()) {
        failures.push(format!("no recovery after {} at {:.0} ms", record.kind.name(), record.at_ms));
    }
    if !failures.is_empty() || std::env::var("CHAOS_VERBOSE").is_ok() {
        let output = rig.popgate.output();
        let lines: Vec<&str> = output.lines().filter(|l| !l.contains("INFO")).collect();
        eprintln!(
            "--- popgate warnings and errors (last 40) ---\n{}",
            lines[lines.len().saturating_sub(40)..].join("\n")
        );
    }
    failures
}

/// The popgate config of a chaos run (one place, so a setting every instance needs is added once).
fn popgate_config(state_dir: &std::path::Path) -> String {
    // A lease longer than a broker restart (renewed at half), so popgate keeps its deliveries through one.
    format!("[delivery]\nstate_dir = \"{}\"\nlease_ms = 60000\npop_poll_ms = 1000\n", state_dir.display())
}

fn print_report(report: &Value) {
    println!("\nchaos report (seed {})", report["seed"]);
    for field in [
        "sent",
        "publishAttemptsFailed",
        "acked",
        "ackedAfterAmbiguousAnswer",
        "terminated",
        "deadLettered",
        "lost",
        "received",
        "redelivered",
        "duplicated",
        "reordered",
        "precedenceViolations",
        "metricSamples",
        "brokerLeftoverAfterDrain",
        "brokerLeftoverUnsettled",
        "pendingAtEnd",
        "drainMs",
    ] {
        println!("  {field:<28} {}", report[field]);
    }
    println!("  faults (recovery = lifted until publish and ACK work again; deaths: until their events came back):");
    for f in report["faults"].as_array().into_iter().flatten() {
        println!(
            "    {:>8} ms  {:<28} held {:>6} ms  recovery {} ms{}",
            f["atMs"],
            f["fault"].as_str().unwrap_or_default(),
            f["heldMs"],
            f["recoveryMs"],
            f["storeWriteFailures"].as_f64().map(|n| format!("  (state-store writes failed: {n})")).unwrap_or_default()
        );
    }
    println!("  end-to-end latency (publish sent -> first delivery): {}", report["endToEndLatencyBuckets"]);
    println!("    {}", report["endToEndLatencyMs"]);
    println!("  publish latency: {}  {}", report["publishLatencyBuckets"], report["publishLatencyMs"]);
}
