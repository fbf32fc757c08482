//! A tier's cost (issue #35): an ACK settled on the instance that handed the delivery out against the same ACK
//! sent to another instance, which asks the owner over the peer link. Two instances, in two rounds:
//! - latency: `BENCH_TIER_ACKS` deliveries (200; 20 in the smoke run) polled on the first, half ACKed there and
//!   half on the second, one ACK at a time and the paths taking turns, so each latency is the ACK's own;
//! - throughput: as many again, half ACKed on each path in turn with `BENCH_TIER_CONCURRENCY` (16) ACKs in
//!   flight.
//!
//! Printed: each path's ACK latency (p50, p99), its ACKs/s and the CPU both instances spent per ACK (throughput
//! round), and the ratios forwarded / local.

use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use serde_json::{json, Value};

use crate::harness::popgate::Popgate;
use crate::harness::{env_or, free_port};
use crate::{cpu_time, Params};

const SECRET: &str = "bench-tier-secret-0123456789";

fn instance_toml(n: usize, ports: &[u16; 2]) -> String {
    format!(
        "ack_timeout_ms = 120000\n\n[tier]\ninstance_id = \"bench-{n}\"\nlisten = \"127.0.0.1:{}\"\n\
         peers = [\"127.0.0.1:{}\", \"127.0.0.1:{}\"]\nsecret = \"{SECRET}\"\n",
        ports[n], ports[0], ports[1]
    )
}

/// The p-th percentile of `sorted` (ms).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * (sorted.len().saturating_sub(1)) as f64).round() as usize;
    sorted.get(rank).copied().unwrap_or(0.0)
}

/// ACKs `id` at `at`: how long it took (ms).
async fn ack_one(client: &reqwest::Client, at: &Popgate, id: &str) -> f64 {
    let started = Instant::now();
    let answer =
        client.post(format!("{}/events/ack", at.base)).json(&json!({"deliveryId": id})).send().await.expect("ACK");
    assert_eq!(answer.status().as_u16(), 200, "ACK of {id} at {}", at.base);
    started.elapsed().as_secs_f64() * 1000.0
}

/// ACKs `local` at `owner` and `forwarded` at `other`, one at a time and taking turns, so that whatever else
/// the instances or the broker are doing meanwhile falls on both paths alike: each path's latencies (ms, sorted).
async fn ack_taking_turns(
    client: &reqwest::Client,
    (owner, local): (&Popgate, &[String]),
    (other, forwarded): (&Popgate, &[String]),
) -> (Vec<f64>, Vec<f64>) {
    let (mut local_ms, mut forwarded_ms) = (Vec::new(), Vec::new());
    for (local_id, forwarded_id) in local.iter().zip(forwarded) {
        local_ms.push(ack_one(client, owner, local_id).await);
        forwarded_ms.push(ack_one(client, other, forwarded_id).await);
    }
    local_ms.sort_by(f64::total_cmp);
    forwarded_ms.sort_by(f64::total_cmp);
    (local_ms, forwarded_ms)
}

/// ACKs `ids` at `at` with `concurrency` ACKs in flight: ACKs per second, and the CPU `instances` spent.
async fn ack_concurrently(
    client: &reqwest::Client,
    at: &Popgate,
    ids: &[String],
    concurrency: usize,
    instances: &[&Popgate],
) -> (f64, Duration) {
    let cpu_before: Duration = instances.iter().map(|p| cpu_time(p.pid())).sum();
    let started = Instant::now();
    stream::iter(ids)
        .for_each_concurrent(concurrency, |id| async move {
            ack_one(client, at, id).await;
        })
        .await;
    let rate = ids.len() as f64 / started.elapsed().as_secs_f64().max(f64::EPSILON);
    let cpu_after: Duration = instances.iter().map(|p| cpu_time(p.pid())).sum();
    (rate, cpu_after.saturating_sub(cpu_before))
}

/// Publishes `count` events on `owner` and polls them there: their delivery ids.
async fn held_on(owner: &Popgate, topic: &str, group: &str, round: &str, count: usize) -> Vec<String> {
    let bodies: Vec<String> = (0..count).map(|n| format!("tier-{round}-{n}")).collect();
    owner.publish_bodies(topic, &bodies).await;
    let held = owner.poll_until(group, topic, count, Duration::from_secs(60)).await;
    assert_eq!(held.len(), count, "every event of the {round} round handed out by the first instance");
    held.iter().map(crate::harness::popgate::id).collect()
}

/// The tier's forwarded ACK against the local one.
pub async fn tier(params: &Params, namesrv: &str, topic: &str) -> Value {
    let acks: usize = env_or("BENCH_TIER_ACKS", if params.full { 200 } else { 20 });
    let ports = [free_port(), free_port()];
    let configs = [instance_toml(0, &ports), instance_toml(1, &ports)];
    let (owner, other) = tokio::join!(Popgate::start(namesrv, &configs[0]), Popgate::start(namesrv, &configs[1]));
    let concurrency: usize = env_or("BENCH_TIER_CONCURRENCY", 16);
    let group = format!("{topic}_g");
    let ids = held_on(&owner, topic, &group, "latency", acks).await;
    let (local_ids, forwarded_ids) = ids.split_at(acks / 2);
    let client = reqwest::Client::new();
    let both = [&owner, &other];
    // A first ACK on each path opens the client's connection (and, forwarded, finds the peer and opens the
    // link); neither is counted.
    ack_taking_turns(&client, (&owner, &local_ids[..1]), (&other, &forwarded_ids[..1])).await;
    let (local, forwarded) = ack_taking_turns(&client, (&owner, &local_ids[1..]), (&other, &forwarded_ids[1..])).await;
    let ids = held_on(&owner, topic, &group, "throughput", acks).await;
    let (local_ids, forwarded_ids) = ids.split_at(acks / 2);
    let (local_rate, local_cpu) = ack_concurrently(&client, &owner, local_ids, concurrency, &both).await;
    let (forwarded_rate, forwarded_cpu) = ack_concurrently(&client, &other, forwarded_ids, concurrency, &both).await;
    let cpu_per_ack_us = |cpu: Duration, acked: &[String]| cpu.as_micros() as f64 / acked.len().max(1) as f64;
    let (local_cpu_us, forwarded_cpu_us) =
        (cpu_per_ack_us(local_cpu, local_ids), cpu_per_ack_us(forwarded_cpu, forwarded_ids));
    let summary = |latencies: &[f64], cpu_us: f64, acks_per_sec: f64| {
        json!({"acks": latencies.len(), "p50Ms": percentile(latencies, 50.0), "p99Ms": percentile(latencies, 99.0),
               "cpuUsPerAck": cpu_us.round(), "acksPerSec": acks_per_sec.round(), "concurrency": concurrency})
    };
    let ratio = |a: f64, b: f64| if b > 0.0 { ((a / b) * 100.0).round() / 100.0 } else { 0.0 };
    let forwarded_metric = other.metric(r#"popgate_tier_settlements_forwarded_total{action="ack",result="ok"}"#).await;
    json!({
        "local": summary(&local, local_cpu_us, local_rate),
        "forwarded": summary(&forwarded, forwarded_cpu_us, forwarded_rate),
        "forwardedOverLocal": {
            "acksPerSec": ratio(forwarded_rate, local_rate),
            "p50": ratio(percentile(&forwarded, 50.0), percentile(&local, 50.0)),
            "p99": ratio(percentile(&forwarded, 99.0), percentile(&local, 99.0)),
            "cpuPerAck": ratio(forwarded_cpu_us, local_cpu_us),
        },
        "forwardedCounted": forwarded_metric,
    })
}

/// What the smoke run checks: every ACK landed on both paths, and the forwarded ones were asked of the owner.
pub fn check_smoke(report: &Value) {
    if report.is_null() {
        return;
    }
    let local = report["local"]["acks"].as_u64().unwrap_or(0);
    let forwarded = report["forwarded"]["acks"].as_u64().unwrap_or(0);
    assert!(local > 0 && forwarded > 0, "smoke: tier ACKs on both paths: {report}");
    // Each round sends the second half of its deliveries to the other instance; the latency round leaves its
    // first forwarded ACK out of the figures (it opens the link).
    let forwarded_per_round = forwarded + 1;
    let forwarded_in_all = 2 * forwarded_per_round;
    assert_eq!(report["forwardedCounted"].as_f64(), Some(forwarded_in_all as f64), "smoke: tier forwarded: {report}");
    for path in ["local", "forwarded"] {
        assert!(report[path]["acksPerSec"].as_f64().unwrap_or(0.0) > 0.0, "smoke: tier {path} ACKs/s: {report}");
    }
}
