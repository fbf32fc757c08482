//! popgate-chaos: producers and consumers run through popgate for a while, faults are injected on a seeded
//! random schedule, and then the history is checked (openmessaging/openchaos style):
//!
//! The checker trusts only the broker and the subscribers' own record, never popgate's answers:
//! - **lost = 0**: every publish the broker stored (`SEND_OK`) reached a subscriber or sits in
//!   `%DLQ%<group>`, read back from the broker;
//! - **order**: within a message group no event is handed out while an earlier one is unsettled;
//! - **ACK precedence, per message**: the group's committed offset of each queue is read from the broker all
//!   along; every message below it must have had its ACK (or TERM) sent by a subscriber before that read;
//! - **nothing left at the broker**: after the run popgate is killed, the lease is waited out, and the group
//!   is drained directly at the broker: an event a subscriber had ACKed (200) that comes back is a broker ACK
//!   that never happened, one nobody received is lost, and an event still unsettled is pending at the end;
//! - **every fault bites**: a full disk that failed no state write fails the run;
//! - duplicates, redeliveries and dead letters are counted and reported, with the recovery time after each
//!   fault (p50/max per kind), end-to-end latency buckets, and popgate's RSS and open files every 10 s.
//!
//! Faults: `kill -9` of popgate and restart, SIGSTOP/SIGCONT of the broker, `kill -9` of the broker and
//! restart, the state store's disk filling up and freeing, subscribers dying with deliveries in hand.
//!
//! Run by `cargo test` as a short version (about 3 minutes, every fault kind at least once). Longer runs:
//! `CHAOS_SECS=600 CHAOS_SEED=42 cargo test --release --test chaos`; the one-hour soak is `CHAOS_SOAK=1`
//! (3600 s of faults, one every 30 s on average). Settings (environment):
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
use harness::popgate::Popgate;
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
        let soak = std::env::var("CHAOS_SOAK").is_ok_and(|v| v == "1");
        let clock_seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(1);
        Settings {
            seed: env_or("CHAOS_SEED", clock_seed),
            secs: env_or("CHAOS_SECS", if soak { 3600 } else { 60 }),
            interval_secs: env_or("CHAOS_INTERVAL_SECS", if soak { 30.0 } else { 4.0 }),
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
    /// Where the broker stored each published event: (broker, queue id, queue offset), from its answer.
    placement: HashMap<String, (String, i32, i64)>,
    /// When a subscriber first sent an ACK or TERM for each event (ms since start).
    settle_sent_at: HashMap<String, f64>,
    /// Messages below the broker's committed offset whose ACK no subscriber had sent yet (checked against the
    /// DLQ at the end: exhausted attempts are dead-lettered without a subscriber's word).
    early_broker_acks: HashSet<String>,
    offset_samples: u64,
    publish_attempts_failed: u64,
    publish_latency_ms: Vec<f64>,
    /// Receipt times of each event (any subscriber, any attempt).
    receipts: HashMap<String, Vec<f64>>,
    /// Per group: which indexes a consumer started to settle (ACK or TERM sent), and the first index not.
    started: Vec<HashSet<u64>>,
    prefix: Vec<u64>,
    /// Events whose ACK popgate confirmed with 200.
    acked: HashSet<String>,
    /// Events whose first ACK answer was lost and whose retry was answered "unknown": settled as far as the
    /// subscriber can tell, but not a confirmed ACK (the broker drain at the end tells).
    acked_ambiguous: HashSet<String>,
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
    /// popgate's RSS (KiB) and open file descriptors, sampled every 10 s: (ms since start, rss, fds).
    resources: Vec<(f64, u64, u64)>,
}

impl Ledger {
    /// A subscriber settled `key` as far as it can tell (ACK answered, TERM answered, or an ACK whose answer
    /// was lost and whose retry found nothing left to ACK).
    fn settled(&self, key: &str) -> bool {
        self.acked.contains(key) || self.termed.contains(key) || self.acked_ambiguous.contains(key)
    }

    /// Moves the group's first open index past everything started or settled. Settled counts too: a
    /// subscriber's "unknown" answer (a redispatched copy ACKed by another subscriber) can undo a settle just
    /// before the other subscriber's confirmation lands, and that event is settled all the same.
    fn advance_prefix(&mut self, group: usize) {
        while self.started[group].contains(&self.prefix[group]) || self.settled(&key_of(group, self.prefix[group])) {
            self.prefix[group] += 1;
        }
    }
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
    /// The running popgate's process id (it changes at each restart), for the resource sampler.
    popgate_pid: AtomicU32,
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
        if ledger.acked.contains(&key) || ledger.termed.contains(&key) || ledger.acked_ambiguous.contains(&key) {
            ledger.duplicated += 1;
            return Some(key);
        }
        ledger.advance_prefix(group);
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
        let now = self.now_ms();
        let mut guard = self.ledger.lock();
        let ledger = &mut *guard;
        ledger.settle_sent_at.entry(key.to_owned()).or_insert(now);
        ledger.started[group].insert(index);
        ledger.advance_prefix(group);
    }

    /// The settle did not happen (popgate refused it): the event is open again.
    fn undo_settle(&self, key: &str) {
        let Some((group, index)) = parse_key(key) else { return };
        let mut ledger = self.ledger.lock();
        if ledger.acked.contains(key) || ledger.termed.contains(key) || ledger.acked_ambiguous.contains(key) {
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
        let answer = match resp {
            Ok(r) if r.status().as_u16() == 200 => r.json::<Value>().await.ok(),
            _ => None,
        };
        let ok = answer.is_some();
        let done = world.now_ms();
        {
            let mut ledger = world.ledger.lock();
            if let Some(answer) = &answer {
                let placement = (
                    answer["broker"].as_str().unwrap_or_default().to_owned(),
                    answer["queueId"].as_i64().unwrap_or(-1) as i32,
                    answer["queueOffset"].as_i64().unwrap_or(-1),
                );
                ledger.placement.entry(key.clone()).or_insert(placement);
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
    if term {
        ledger.termed.insert(key.to_owned());
    } else if ambiguous {
        // "unknown" after a lost answer is not an ACK: only the broker drain at the end can tell.
        ledger.acked_ambiguous.insert(key.to_owned());
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

// === the ACK-precedence monitor and the resource sampler ===

/// Reads the group's committed offset of each queue from the broker (orderly POP commits on ACK) and checks
/// every message below it against the subscribers' record: its ACK or TERM must have been sent before.
async fn monitor(world: Arc<World>, namesrv_addr: String) {
    let direct = Direct::connect(&namesrv_addr).await;
    while !world.stop_consume.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let asked_at = world.now_ms();
        let Some(offsets) = direct.consumer_offsets(&world.group, &world.topic).await else { continue };
        let mut guard = world.ledger.lock();
        let ledger = &mut *guard;
        ledger.offset_samples += 1;
        for (key, (broker, queue, offset)) in &ledger.placement {
            let committed = offsets.get(&(broker.clone(), *queue)).copied().unwrap_or(0);
            let sent_before = ledger.settle_sent_at.get(key).is_some_and(|at| *at <= asked_at);
            if *offset < committed && !sent_before && ledger.early_broker_acks.insert(key.clone()) {
                eprintln!(
                    "chaos: {key} ({broker} q{queue} @{offset}) is below the committed offset {committed} \
                           but no subscriber had sent its ACK"
                );
            }
        }
    }
}

/// Samples popgate's RSS and open file descriptors every 10 s.
async fn sample_resources(world: Arc<World>) {
    while !world.stop_consume.load(Ordering::Relaxed) {
        let pid = world.popgate_pid.load(Ordering::Relaxed);
        let rss = harness::popgate::proc_status_kib(pid, "VmRSS:");
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count() as u64).unwrap_or(0);
        if rss > 0 {
            world.ledger.lock().resources.push((world.now_ms(), rss, fds));
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
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
            world.popgate_pid.store(rig.popgate.pid(), Ordering::Relaxed);
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
            // The fault must bite: when no write reached the store meanwhile (publishing stalled behind another
            // fault), the disk stays full until one fails, for at most a minute more.
            let bite_deadline = Instant::now() + Duration::from_secs(60);
            while rig.popgate.metric("popgate_offset_write_failures_total").await <= before
                && Instant::now() < bite_deadline
            {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
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
        popgate_pid: AtomicU32::new(popgate.pid()),
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
    consumers.push(tokio::spawn(monitor(world.clone(), cluster.namesrv_addr.clone())));
    consumers.push(tokio::spawn(sample_resources(world.clone())));

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
            ledger.published.keys().filter(|k| !ledger.settled(k)).count()
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
    let popgate_pending_left = rig.popgate.metric("popgate_pending_deliveries").await;
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
    // popgate is stopped; past its lease (and the broker's revive slack) the broker hands a direct consumer
    // of the group whatever it still considers unconsumed.
    rig.popgate.kill9();
    let leftover = DirectConsumer::connect(&rig.cluster.namesrv_addr)
        .await
        .drain_as(&group, &topic, Duration::from_millis(LEASE_MS + 15_000), true)
        .await;

    let ledger = world.ledger.lock();
    for record in &mut records {
        record.recovery_ms = recovery_ms(&ledger, record);
    }
    // Lost: stored by the broker, never received by a subscriber, not in the DLQ.
    let lost: Vec<&String> =
        ledger.published.keys().filter(|k| !ledger.receipts.contains_key(*k) && !dlq.contains(*k)).collect();
    let leftover_keys: Vec<&str> = leftover.iter().filter_map(|b| b.split('|').next()).collect();
    let broker_ack_missing = leftover_keys.iter().filter(|k| ledger.acked.contains(**k)).count();
    let leftover_unsettled = leftover_keys.iter().filter(|k| !ledger.acked.contains(**k)).count();
    let pending_at_end: Vec<&String> = ledger.published.keys().filter(|k| !ledger.settled(k)).collect();
    let early_broker_acks: Vec<&String> = ledger.early_broker_acks.iter().filter(|k| !dlq.contains(*k)).collect();
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
        "ackedAfterAmbiguousAnswer": ledger.acked_ambiguous.len(),
        "terminated": ledger.termed.len(),
        "deadLettered": dlq.len(),
        "lost": lost.len(),
        "lostExamples": lost.iter().take(20).collect::<Vec<_>>(),
        "received": received,
        "redelivered": received.saturating_sub(ledger.receipts.len()),
        "duplicated": ledger.duplicated,
        "reordered": ledger.reordered,
        "reorderExamples": ledger.reorder_examples,
        "precedenceViolations": early_broker_acks.len(),
        "precedenceExamples": early_broker_acks.iter().take(10).collect::<Vec<_>>(),
        "offsetSamples": ledger.offset_samples,
        "brokerLeftoverAfterDrain": leftover.len(),
        "brokerAckMissing": broker_ack_missing,
        "brokerLeftoverUnsettled": leftover_unsettled,
        "pendingAtEnd": pending_at_end.len(),
        "popgatePendingAtEnd": popgate_pending_left,
        "drainMs": (drained_ms - stopped_ms).round(),
        "faults": faults_json,
        "recoveryByKind": recovery_by_kind(&records),
        "resources": resources_json(&ledger.resources),
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
    if !early_broker_acks.is_empty() {
        failures
            .push(format!("{} broker ACKs before a subscriber ACK: {early_broker_acks:?}", early_broker_acks.len()));
    }
    if ledger.offset_samples == 0 {
        failures.push("the broker's consumer offsets were never read".to_owned());
    }
    if broker_ack_missing > 0 {
        failures.push(format!("{broker_ack_missing} events ACKed by a subscriber came back from the broker"));
    }
    if leftover_unsettled > 0 || !pending_at_end.is_empty() {
        failures.push(format!(
            "{leftover_unsettled} unsettled events left at the broker, {} published events unsettled at the end: {:?}",
            pending_at_end.len(),
            pending_at_end.iter().take(10).collect::<Vec<_>>()
        ));
    }
    if popgate_pending_left > 0.0 {
        failures.push(format!("popgate still held {popgate_pending_left} deliveries at the end"));
    }
    for record in records.iter().filter(|r| r.store_write_failures == Some(0.0)) {
        failures.push(format!("{} at {:.0} ms did not bite: no state write failed", record.kind.name(), record.at_ms));
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

/// popgate's broker lease in a chaos run: longer than a broker restart (it is renewed at half), so popgate
/// keeps its deliveries through one; the end of the run waits it out before draining the broker.
const LEASE_MS: u64 = 30_000;

/// The popgate config of a chaos run (one place, so a setting every instance needs is added once).
fn popgate_config(state_dir: &std::path::Path) -> String {
    format!("[delivery]\nstate_dir = \"{}\"\nlease_ms = {LEASE_MS}\npop_poll_ms = 1000\n", state_dir.display())
}

/// Recovery time after each fault kind: how many, p50 and max (ms).
fn recovery_by_kind(records: &[FaultRecord]) -> Value {
    let mut by_kind: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for record in records {
        by_kind.entry(record.kind.name()).or_default().extend(record.recovery_ms);
    }
    let entries: serde_json::Map<String, Value> = by_kind
        .into_iter()
        .map(|(kind, mut times)| {
            let count = times.len();
            let p50 = percentile(&mut times, 0.5).round();
            let max = percentile(&mut times, 1.0).round();
            (kind.to_owned(), json!({"count": count, "p50Ms": p50, "maxMs": max}))
        })
        .collect();
    Value::Object(entries)
}

/// popgate's RSS (MiB) and open files at the start, the end and their maximum.
fn resources_json(samples: &[(f64, u64, u64)]) -> Value {
    let mib = |kib: u64| (kib as f64 / 1024.0 * 10.0).round() / 10.0;
    let (Some(first), Some(last)) = (samples.first(), samples.last()) else { return Value::Null };
    json!({
        "samples": samples.len(),
        "rssMiB": {"start": mib(first.1), "end": mib(last.1), "max": mib(samples.iter().map(|s| s.1).max().unwrap_or(0))},
        "openFiles": {"start": first.2, "end": last.2, "max": samples.iter().map(|s| s.2).max().unwrap_or(0)},
    })
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
        "offsetSamples",
        "brokerLeftoverAfterDrain",
        "brokerAckMissing",
        "brokerLeftoverUnsettled",
        "pendingAtEnd",
        "popgatePendingAtEnd",
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
    println!("  recovery by fault kind: {}", report["recoveryByKind"]);
    println!("  popgate resources: {}", report["resources"]);
    println!("  end-to-end latency (publish sent -> first delivery): {}", report["endToEndLatencyBuckets"]);
    println!("    {}", report["endToEndLatencyMs"]);
    println!("  publish latency: {}  {}", report["publishLatencyBuckets"], report["publishLatencyMs"]);
}
