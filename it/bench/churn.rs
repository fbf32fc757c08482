//! Churn (issue #21): a soak with clients coming and going, to show popgate's memory and CPU stay flat.
//!
//! In each of `BENCH_CHURN_ROUNDS` rounds a batch of gRPC client ids never seen before (`x-mq-client-id`) each
//! sends one `Heartbeat` and one `ReceiveMessage` (plaintext, 200 ms long poll, a topic with no messages) as
//! group `churn-g{n % groups}`, and every other one then says goodbye (`NotifyClientTermination`) while the rest
//! just vanish: `BENCH_CHURN_CLIENTS` ids over `BENCH_CHURN_GROUPS` groups in all, at most
//! `BENCH_CHURN_CONCURRENCY` calls in flight. Alongside, one HTTP long poll (`waitMs=100`) per four gRPC
//! clients on groups of its own (`churn-h*`), so both fronts create subscriptions implicitly; and consumers of
//! one group (`churn-filters`) receive with two tag filters in turn. A few subscriptions are made explicitly
//! (`POST /events/subscribe`) before the first round and never used.
//!
//! After each round: popgate's RSS, its CPU (utime + stime) per 1 000 calls of the round, the subscriptions it
//! holds (`GET /admin/subscriptions`), and from `/metrics` the gRPC clients it tracks, its pending deliveries,
//! and (where popgate has them) expired subscriptions and filter conflicts. Then nothing is sent until the idle
//! expiry should have run, and a final sample is taken (with popgate's idle CPU over that wait).
//!
//! popgate runs with `BENCH_CHURN_CONFIG` appended to its config, by default
//! `[delivery] idle_subscription_expiry_secs = BENCH_CHURN_EXPIRY_SECS` (10; 2 in the smoke run). popgate
//! refuses unknown keys, so a popgate without that setting is run with `BENCH_CHURN_CONFIG=""`; left unset, the
//! phase asks a plain popgate first whether it has the setting (`GET /admin/config`) and, when it has not, runs
//! without it under `BENCH_ONLY=churn` and is skipped in a run of every phase.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use popgate::grpc::proto::{self as pb, messaging_service_client::MessagingServiceClient, Code};
use serde_json::{json, Value};
use tonic::transport::Channel;

use crate::harness::env_or;
use crate::harness::popgate::{proc_status_kib, Popgate};
use crate::{cpu_time, Params};

/// The config key of the idle expiry of implicit subscriptions.
const EXPIRY_KEY: &str = "idle_subscription_expiry_secs";
/// Subscriptions made with `POST /events/subscribe` before the rounds: the ones that must stay.
const EXPLICIT: usize = 4;
/// Receives of the two-filter group per round (half with each filter).
const FILTER_RECEIVES: usize = 20;
/// How long a receive waits at popgate for a message that never comes.
const RECEIVE_WAIT: Duration = Duration::from_millis(200);
/// gRPC connections per round; the clients of a round share them (each a stream of its own).
const CHANNELS: usize = 16;
/// No call may take longer than this (it counts as an error then).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

struct Settings {
    clients: usize,
    groups: usize,
    http_groups: usize,
    rounds: usize,
    concurrency: usize,
    /// What the wait before the final sample adds to the expiry in force.
    margin_secs: u64,
}

impl Settings {
    fn from_env(full: bool) -> Settings {
        let clients: usize = env_or("BENCH_CHURN_CLIENTS", if full { 100_000 } else { 400 }).max(1);
        let groups: usize = env_or("BENCH_CHURN_GROUPS", if full { 10_000 } else { 20 }).max(1);
        Settings {
            clients,
            groups,
            http_groups: env_or("BENCH_CHURN_HTTP_GROUPS", (groups / 10).max(1)).max(1),
            rounds: env_or("BENCH_CHURN_ROUNDS", if full { 10 } else { 2 }).clamp(1, clients),
            concurrency: env_or("BENCH_CHURN_CONCURRENCY", 256).max(1),
            margin_secs: if full { 15 } else { 10 },
        }
    }
}

/// Errors the calls met, shared by all their tasks: how many, and per kind (the call and its answer) how many
/// and the first one in full.
#[derive(Default)]
struct Errors {
    count: AtomicU64,
    kinds: parking_lot::Mutex<std::collections::BTreeMap<String, (u64, String)>>,
}

impl Errors {
    fn error(&self, kind: String, what: String) {
        self.count.fetch_add(1, Ordering::Relaxed);
        let mut kinds = self.kinds.lock();
        let entry = kinds.entry(kind).or_insert_with(|| (0, what));
        entry.0 += 1;
    }

    fn first(&self) -> Option<String> {
        self.kinds.lock().values().next().map(|(_, what)| what.clone())
    }

    fn by_kind(&self) -> Value {
        let kinds = self.kinds.lock();
        kinds.iter().map(|(kind, (count, first))| (kind.clone(), json!({"count": count, "first": first}))).collect()
    }
}

/// One simulated consumer's calls in a round.
enum Job {
    /// A new gRPC client `n`: Heartbeat, ReceiveMessage, and for even `n` NotifyClientTermination.
    Grpc(usize),
    /// An HTTP long poll of group `churn-h{m % http_groups}`.
    Http(usize),
    /// A receive of the two-filter group by a client of its own, with filter `tag-a` or `tag-b` as `i` is even.
    Filter(usize),
}

/// Whether a popgate has the idle-expiry setting (its effective config, `GET /admin/config`, names it).
async fn expiry_in_force(popgate: &Popgate) -> Option<u64> {
    let (status, config) = popgate.get_json("/admin/config").await;
    assert_eq!(status, 200, "GET /admin/config: {config}");
    config["delivery"][EXPIRY_KEY].as_u64()
}

/// popgate's extra config for the phase, or `None` when the phase is to be skipped.
async fn phase_config(full: bool, namesrv: &str, only_this: bool) -> Option<String> {
    if let Ok(config) = std::env::var("BENCH_CHURN_CONFIG") {
        return Some(config);
    }
    let expiry: u64 = env_or("BENCH_CHURN_EXPIRY_SECS", if full { 10 } else { 2 });
    let probe = Popgate::start(namesrv, "").await;
    let supported = expiry_in_force(&probe).await.is_some();
    drop(probe);
    if supported {
        Some(format!("[delivery]\n{EXPIRY_KEY} = {expiry}\n"))
    } else if only_this {
        println!("churn: this popgate has no `delivery.{EXPIRY_KEY}`; running without it (BENCH_CHURN_CONFIG=\"\")");
        Some(String::new())
    } else {
        None
    }
}

pub async fn churn(params: &Params, namesrv: &str, topics: [&str; 2], only_this: bool) -> Value {
    let settings = Settings::from_env(params.full);
    let Some(extra) = phase_config(params.full, namesrv, only_this).await else {
        let why = format!("this popgate has no `delivery.{EXPIRY_KEY}` (run BENCH_ONLY=churn BENCH_CHURN_CONFIG=\"\")");
        println!("churn: skipped: {why}");
        return json!({"skipped": why});
    };
    let [grpc_topic, http_topic] = topics;
    // The per-token waiter bound protects popgate from one runaway client; here one client is all consumers.
    let limits = format!("[server]\nmax_waiters_per_token = {}\n", settings.concurrency + 16);
    let popgate = Popgate::start(namesrv, &format!("{limits}{extra}")).await;
    let expiry = expiry_in_force(&popgate).await;
    let pid = popgate.pid();
    let mut explicit = Vec::new();
    for i in 0..EXPLICIT {
        let group = format!("churn-explicit{i}");
        let (status, answer) =
            popgate.post_json("/events/subscribe", &json!({"group": group, "topic": grpc_topic})).await;
        assert_eq!(status, 200, "{answer}");
        explicit.push(format!("{group}:{grpc_topic}"));
    }

    let errors = Arc::new(Errors::default());
    let http = reqwest::Client::builder().pool_max_idle_per_host(settings.concurrency).build().expect("http client");
    let per_round = settings.clients.div_ceil(settings.rounds);
    let mut samples = Vec::new();
    let mut total_calls = 0u64;
    for round in 0..settings.rounds {
        let first = round * per_round;
        let last = ((round + 1) * per_round).min(settings.clients);
        if first >= last {
            break;
        }
        let jobs = round_jobs(first..last, round);
        let mut channels = Vec::new();
        for _ in 0..CHANNELS {
            let channel = MessagingServiceClient::connect(format!("http://{}", popgate.grpc)).await;
            channels.push(channel.expect("plaintext gRPC connection"));
        }
        let errors_before = errors.count.load(Ordering::Relaxed);
        let (cpu_before, started) = (cpu_time(pid), Instant::now());
        let calls: u64 = futures::stream::iter(jobs.into_iter().enumerate())
            .map(|(i, job)| {
                let client = channels[i % CHANNELS].clone();
                let (http, errors, base) = (http.clone(), errors.clone(), popgate.base.clone());
                let (settings, topics) = (&settings, (grpc_topic, http_topic));
                async move { run_job(job, client, &http, &base, topics, settings, &errors).await }
            })
            .buffer_unordered(settings.concurrency)
            .fold(0, |sum, calls| async move { sum + calls })
            .await;
        let (cpu, secs) = (cpu_time(pid).saturating_sub(cpu_before), started.elapsed().as_secs_f64());
        drop(channels);
        total_calls += calls;
        let mut sample = sample(&popgate, &explicit).await;
        sample["round"] = json!(round + 1);
        sample["newGrpcClients"] = json!(last - first);
        sample["calls"] = json!(calls);
        sample["secs"] = json!(round2(secs));
        sample["errors"] = json!(errors.count.load(Ordering::Relaxed) - errors_before);
        sample["cpuMsPer1kCalls"] = json!(round2(cpu.as_secs_f64() * 1e6 / calls.max(1) as f64));
        println!("churn: {sample}");
        samples.push(sample);
    }

    // Nothing is sent now until the expiry in force (if any) should have run. The smoke run stops waiting as
    // soon as only the explicit subscriptions are left; the full run waits it out, to measure the idle CPU.
    // Without an expiry the smoke run has nothing to wait for.
    let default_settle = match expiry {
        Some(secs) => secs + settings.margin_secs,
        None if params.full => settings.margin_secs,
        None => 1,
    };
    let settle = Duration::from_secs(env_or("BENCH_CHURN_SETTLE_SECS", default_settle));
    let (cpu_before, started) = (cpu_time(pid), Instant::now());
    while started.elapsed() < settle {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if !params.full && expiry.is_some() && held(&popgate).await.iter().all(|id| explicit.contains(id)) {
            break;
        }
    }
    let waited = started.elapsed();
    let idle_cpu = cpu_time(pid).saturating_sub(cpu_before).as_secs_f64() * 100.0 / waited.as_secs_f64();
    let mut last = sample(&popgate, &explicit).await;
    last["afterIdleSecs"] = json!(round2(waited.as_secs_f64()));
    last["idleCpuPercent"] = json!(round2(idle_cpu));
    println!("churn: final {last}");
    // The expiry is checked when it is in force and the wait was long enough for it, or ended by its success.
    let expiry_checked =
        expiry.is_some_and(|e| waited >= Duration::from_secs(e) || last["onlyExplicitLeft"] == json!(true));

    let first = samples.first().cloned().unwrap_or(Value::Null);
    let last_round = samples.last().cloned().unwrap_or(Value::Null);
    let (rss_first, rss_end) = (first["rssKib"].as_u64().unwrap_or(0), last["rssKib"].as_u64().unwrap_or(0));
    let rss_growth = rss_end as i64 - rss_first as i64;
    let rss_growth_pct = if rss_first > 0 { rss_growth as f64 * 100.0 / rss_first as f64 } else { 0.0 };
    let cpu_ratio = match (last_round["cpuMsPer1kCalls"].as_f64(), first["cpuMsPer1kCalls"].as_f64()) {
        (Some(l), Some(f)) if f > 0.0 => Some(round2(l / f)),
        _ => None,
    };
    let held_at_end = last["subscriptions"].as_u64().unwrap_or(0);
    json!({
        "parameters": {
            "clients": settings.clients, "groups": settings.groups, "httpGroups": settings.http_groups,
            "rounds": settings.rounds, "concurrency": settings.concurrency, "explicitSubscriptions": EXPLICIT,
            "filterReceivesPerRound": FILTER_RECEIVES, "receiveWaitMs": RECEIVE_WAIT.as_millis() as u64,
            "config": extra, "expirySecsInForce": expiry,
        },
        "calls": total_calls,
        "errors": errors.count.load(Ordering::Relaxed),
        "firstError": errors.first(),
        "errorsByKind": errors.by_kind(),
        "rounds": samples,
        "final": last,
        "expiryChecked": expiry_checked,
        // Verdicts, not assertions: from the first round's sample to the final one.
        "flat": {
            "rssGrowthKib": rss_growth,
            "rssGrowthPercent": round2(rss_growth_pct),
            "cpuPer1kCallsLastOverFirstRound": cpu_ratio,
            "subscriptionsHeldAtEnd": held_at_end,
            "explicitSubscriptions": EXPLICIT,
            // Flat: RSS grew by at most 10 % (and 16 MiB) of the first round's; CPU per call by at most half.
            "rssFlat": rss_growth <= (rss_first as i64 / 10).max(16 * 1024),
            "cpuFlat": cpu_ratio.is_some_and(|r| r <= 1.5),
            "subscriptionsBackToExplicit": last["onlyExplicitLeft"],
        },
    })
}

/// The jobs of one round: the new gRPC clients `ids`, one HTTP poll per four of them, and the two-filter
/// group's receives, interleaved so every kind runs through the whole round.
fn round_jobs(ids: std::ops::Range<usize>, round: usize) -> Vec<Job> {
    let count = ids.len();
    let http = count / 4;
    let mut jobs = Vec::with_capacity(count + http + FILTER_RECEIVES);
    let (mut next_http, mut next_filter) = (0, 0);
    for (k, n) in ids.clone().enumerate() {
        jobs.push(Job::Grpc(n));
        while next_http < http && next_http * count <= k * http {
            jobs.push(Job::Http(ids.start / 4 + next_http));
            next_http += 1;
        }
        while next_filter < FILTER_RECEIVES && next_filter * count <= k * FILTER_RECEIVES {
            jobs.push(Job::Filter(round * FILTER_RECEIVES + next_filter));
            next_filter += 1;
        }
    }
    jobs
}

/// Runs one job; returns how many calls it made (each failed call is counted in `errors`).
async fn run_job(
    job: Job,
    mut client: MessagingServiceClient<Channel>,
    http: &reqwest::Client,
    base: &str,
    (grpc_topic, http_topic): (&str, &str),
    settings: &Settings,
    errors: &Errors,
) -> u64 {
    let pid = std::process::id();
    match job {
        Job::Grpc(n) => {
            let id = format!("churn{n}@{pid}@0@bench");
            let group = format!("churn-g{}", n % settings.groups);
            heartbeat(&mut client, &id, &group, errors).await;
            receive(&mut client, &id, &group, grpc_topic, "*", errors).await;
            if n % 2 == 0 {
                terminate(&mut client, &id, &group, errors).await;
                3
            } else {
                2
            }
        }
        Job::Filter(i) => {
            let id = format!("churn-filter{i}@{pid}@0@bench");
            let filter = if i % 2 == 0 { "tag-a" } else { "tag-b" };
            heartbeat(&mut client, &id, "churn-filters", errors).await;
            receive(&mut client, &id, "churn-filters", grpc_topic, filter, errors).await;
            2
        }
        Job::Http(m) => {
            let group = format!("churn-h{}", m % settings.http_groups);
            let url = format!("{base}/events/poll?group={group}&topic={http_topic}&waitMs=100");
            match tokio::time::timeout(CALL_TIMEOUT, http.get(url).send()).await {
                Ok(Ok(resp)) if resp.status().as_u16() == 200 => {
                    let _ = resp.bytes().await;
                }
                Ok(Ok(resp)) => {
                    let status = resp.status();
                    let body = resp.text().await.unwrap_or_default();
                    errors.error(format!("poll: HTTP {}", status.as_u16()), format!("poll {group}: {status} {body}"));
                }
                Ok(Err(error)) => errors.error("poll: failed".into(), format!("poll {group} failed: {error}")),
                Err(_) => errors.error("poll: timeout".into(), format!("poll {group} took over {CALL_TIMEOUT:?}")),
            }
            1
        }
    }
}

fn resource(name: &str) -> Option<pb::Resource> {
    Some(pb::Resource { resource_namespace: String::new(), name: name.to_owned() })
}

fn request<T>(message: T, client_id: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert("x-mq-client-id", client_id.parse().expect("ascii client id"));
    request
}

fn code_name(code: i32) -> String {
    Code::try_from(code).map_or_else(|_| code.to_string(), |c| c.as_str_name().to_owned())
}

async fn heartbeat(client: &mut MessagingServiceClient<Channel>, id: &str, group: &str, errors: &Errors) {
    let beat = pb::HeartbeatRequest { group: resource(group), client_type: pb::ClientType::SimpleConsumer as i32 };
    match tokio::time::timeout(CALL_TIMEOUT, client.heartbeat(request(beat, id))).await {
        Ok(Ok(answer)) => answered(errors, "Heartbeat", id, answer.into_inner().status),
        Ok(Err(status)) => errors.error("Heartbeat: failed".into(), format!("Heartbeat of {id} failed: {status}")),
        Err(_) => errors.error("Heartbeat: timeout".into(), format!("Heartbeat of {id} took over {CALL_TIMEOUT:?}")),
    }
}

async fn terminate(client: &mut MessagingServiceClient<Channel>, id: &str, group: &str, errors: &Errors) {
    let bye = pb::NotifyClientTerminationRequest { group: resource(group) };
    match tokio::time::timeout(CALL_TIMEOUT, client.notify_client_termination(request(bye, id))).await {
        Ok(Ok(answer)) => answered(errors, "NotifyClientTermination", id, answer.into_inner().status),
        Ok(Err(status)) => {
            errors.error("NotifyClientTermination: failed".into(), format!("termination of {id} failed: {status}"));
        }
        Err(_) => {
            let what = format!("termination of {id} took over {CALL_TIMEOUT:?}");
            errors.error("NotifyClientTermination: timeout".into(), what);
        }
    }
}

/// One receive on a topic without messages: `MESSAGE_NOT_FOUND` (or OK) is a success, any other status not.
async fn receive(
    client: &mut MessagingServiceClient<Channel>,
    id: &str,
    group: &str,
    topic: &str,
    filter: &str,
    errors: &Errors,
) {
    let receive = pb::ReceiveMessageRequest {
        group: resource(group),
        message_queue: Some(pb::MessageQueue { topic: resource(topic), id: -1, ..Default::default() }),
        filter_expression: Some(pb::FilterExpression { r#type: pb::FilterType::Tag as i32, expression: filter.into() }),
        batch_size: 16,
        invisible_duration: Some(prost_types::Duration { seconds: 30, nanos: 0 }),
        auto_renew: false,
        long_polling_timeout: Some(prost_types::Duration { seconds: 0, nanos: RECEIVE_WAIT.as_nanos() as i32 }),
        attempt_id: None,
    };
    let call = async {
        let mut stream = client.receive_message(request(receive, id)).await?.into_inner();
        let mut first = None;
        while let Some(item) = stream.message().await? {
            if let Some(pb::receive_message_response::Content::Status(status)) = item.content {
                first.get_or_insert(status);
            }
        }
        Ok::<_, tonic::Status>(first)
    };
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(Ok(Some(status))) if status.code == Code::MessageNotFound as i32 => {}
        Ok(Ok(status)) => answered(errors, "ReceiveMessage", &format!("{id} ({group})"), status),
        Ok(Err(status)) => {
            errors.error("ReceiveMessage: failed".into(), format!("receive of {id} ({group}) failed: {status}"));
        }
        Err(_) => {
            let what = format!("receive of {id} ({group}) took over {CALL_TIMEOUT:?}");
            errors.error("ReceiveMessage: timeout".into(), what);
        }
    }
}

/// Counts an answer other than OK as an error (a missing status too).
fn answered(errors: &Errors, rpc: &str, who: &str, status: Option<pb::Status>) {
    match status {
        Some(status) if status.code == Code::Ok as i32 => {}
        Some(status) => {
            let code = code_name(status.code);
            errors.error(format!("{rpc}: {code}"), format!("{rpc} of {who} answered {code}: {}", status.message));
        }
        None => errors.error(format!("{rpc}: no status"), format!("{rpc} of {who} answered no status")),
    }
}

/// The ids (`<group>:<topic>`) of the subscriptions popgate holds.
async fn held(popgate: &Popgate) -> Vec<String> {
    let (status, answer) = popgate.get_json("/admin/subscriptions").await;
    assert_eq!(status, 200, "GET /admin/subscriptions: {answer}");
    let subs = answer["subscriptions"].as_array().cloned().unwrap_or_default();
    subs.iter()
        .map(|s| match s["id"].as_str() {
            Some(id) => id.to_owned(),
            None => format!("{}:{}", s["group"].as_str().unwrap_or_default(), s["topic"].as_str().unwrap_or_default()),
        })
        .collect()
}

/// What popgate holds now.
async fn sample(popgate: &Popgate, explicit: &[String]) -> Value {
    let held = held(popgate).await;
    let metrics = popgate.metrics_text().await;
    let unexpected: Vec<&String> = held.iter().filter(|id| !explicit.contains(id)).collect();
    json!({
        "rssKib": proc_status_kib(popgate.pid(), "VmRSS:"),
        "subscriptions": held.len(),
        "onlyExplicitLeft": unexpected.is_empty(),
        "someNotExplicit": unexpected.iter().take(3).collect::<Vec<_>>(),
        "grpcClients": metric_sum(&metrics, "popgate_grpc_clients"),
        "pendingDeliveries": metric_sum(&metrics, "popgate_pending_deliveries"),
        "subscriptionsExpired": metric_sum(&metrics, "popgate_subscriptions_expired_total"),
        "filterConflicts": metric_sum(&metrics, "popgate_subscription_filter_conflicts_total"),
    })
}

/// The sum of every series of metric `name` in Prometheus text, or `None` when it has none.
fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let metric = series.split('{').next()?;
            (metric == name).then(|| value.parse::<f64>().ok()).flatten()
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// The per-round table of a churn report.
pub fn print_table(churn: &Value) {
    if churn.is_null() {
        return;
    }
    if let Some(why) = churn["skipped"].as_str() {
        println!("churn: skipped: {why}");
        return;
    }
    println!("\nchurn ({})", churn["parameters"]);
    println!(
        "{:>6} {:>8} {:>7} {:>6} {:>9} {:>13} {:>6} {:>8} {:>8} {:>8} {:>10}",
        "round",
        "calls",
        "secs",
        "errors",
        "RSS MiB",
        "cpu ms/1k",
        "subs",
        "clients",
        "pending",
        "expired",
        "conflicts"
    );
    let opt = |v: &Value| if v.is_null() { "-".to_owned() } else { v.to_string() };
    let rounds = churn["rounds"].as_array().cloned().unwrap_or_default();
    for row in rounds.iter().chain(std::iter::once(&churn["final"])) {
        let label = row["round"].as_u64().map_or_else(|| "final".to_owned(), |r| r.to_string());
        println!(
            "{:>6} {:>8} {:>7} {:>6} {:>9.1} {:>13} {:>6} {:>8} {:>8} {:>8} {:>10}",
            label,
            opt(&row["calls"]),
            opt(&row["secs"]),
            opt(&row["errors"]),
            row["rssKib"].as_f64().unwrap_or(0.0) / 1024.0,
            opt(&row["cpuMsPer1kCalls"]),
            opt(&row["subscriptions"]),
            opt(&row["grpcClients"]),
            opt(&row["pendingDeliveries"]),
            opt(&row["subscriptionsExpired"]),
            opt(&row["filterConflicts"]),
        );
    }
    println!(
        "churn: final after {} s idle, idle CPU {} %; flat: {}",
        churn["final"]["afterIdleSecs"], churn["final"]["idleCpuPercent"], churn["flat"]
    );
}

/// The smoke run's checks of a churn report (none of its figures): every call succeeded, implicit
/// subscriptions were made, and with the idle expiry in force only the explicit ones are left at the end.
pub fn check_smoke(churn: &Value) {
    if churn.is_null() || !churn["skipped"].is_null() {
        return;
    }
    assert!(churn["calls"].as_u64().unwrap_or(0) > 0, "smoke: churn made no call: {churn}");
    assert_eq!(churn["errors"].as_u64(), Some(0), "smoke: churn calls failed: {}", churn["firstError"]);
    let most = churn["rounds"].as_array().into_iter().flatten().filter_map(|r| r["subscriptions"].as_u64()).max();
    assert!(most > Some(EXPLICIT as u64), "smoke: churn's receives and polls made no subscription: {churn}");
    if churn["expiryChecked"] == json!(true) {
        let end = &churn["final"];
        assert_eq!(end["onlyExplicitLeft"], json!(true), "smoke: idle implicit subscriptions are expired: {end}");
    } else {
        println!("churn: idle expiry not checked (not in force: {})", churn["parameters"]["config"]);
    }
}
