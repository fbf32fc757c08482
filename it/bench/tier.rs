//! A tier's cost (issue #35): an ACK settled on the instance that handed the delivery out against the same ACK
//! sent to another instance, which asks the owner over the peer link. Two instances, in two rounds:
//! - latency: `BENCH_TIER_ACKS` deliveries (200; 20 in the smoke run) polled on the first, half ACKed there and
//!   half on the second, one ACK at a time so each latency is the ACK's own;
//! - throughput: as many again, half ACKed on each path with `BENCH_TIER_CONCURRENCY` (16) ACKs in flight.
//!
//! Printed: each path's ACK latency (p50, p99), its ACKs/s, the CPU both instances spent per ACK, and the ratios
//! forwarded / local.

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

/// ACKs each of `ids` at `at`, one at a time: the latencies (ms, sorted) and the CPU both instances spent.
async fn ack_each(
    client: &reqwest::Client,
    at: &Popgate,
    ids: &[String],
    instances: &[&Popgate],
) -> (Vec<f64>, Duration) {
    let cpu_before: Duration = instances.iter().map(|p| cpu_time(p.pid())).sum();
    let mut latencies = Vec::with_capacity(ids.len());
    for id in ids {
        let started = Instant::now();
        let answer =
            client.post(format!("{}/events/ack", at.base)).json(&json!({"deliveryId": id})).send().await.expect("ACK");
        assert_eq!(answer.status().as_u16(), 200, "ACK of {id} at {}", at.base);
        latencies.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    let cpu_after: Duration = instances.iter().map(|p| cpu_time(p.pid())).sum();
    latencies.sort_by(f64::total_cmp);
    (latencies, cpu_after.saturating_sub(cpu_before))
}

/// ACKs `ids` at `at` with `concurrency` ACKs in flight: ACKs per second.
async fn ack_concurrently(client: &reqwest::Client, at: &Popgate, ids: &[String], concurrency: usize) -> f64 {
    let started = Instant::now();
    stream::iter(ids)
        .for_each_concurrent(concurrency, |id| async move {
            let answer = client
                .post(format!("{}/events/ack", at.base))
                .json(&json!({"deliveryId": id}))
                .send()
                .await
                .expect("ACK");
            assert_eq!(answer.status().as_u16(), 200, "ACK of {id} at {}", at.base);
        })
        .await;
    ids.len() as f64 / started.elapsed().as_secs_f64().max(f64::EPSILON)
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
    // A first forwarded ACK finds the peer and opens the link; it is not counted.
    let (warm, rest) = forwarded_ids.split_at(1);
    ack_each(&client, &other, warm, &both).await;
    let (local, local_cpu) = ack_each(&client, &owner, local_ids, &both).await;
    let (forwarded, forwarded_cpu) = ack_each(&client, &other, rest, &both).await;
    let ids = held_on(&owner, topic, &group, "throughput", acks).await;
    let (local_ids, forwarded_ids) = ids.split_at(acks / 2);
    let local_rate = ack_concurrently(&client, &owner, local_ids, concurrency).await;
    let forwarded_rate = ack_concurrently(&client, &other, forwarded_ids, concurrency).await;
    let summary = |latencies: &[f64], cpu: Duration, acks_per_sec: f64| {
        let per_ack_us = cpu.as_micros() as f64 / latencies.len().max(1) as f64;
        json!({"acks": latencies.len(), "p50Ms": percentile(latencies, 50.0), "p99Ms": percentile(latencies, 99.0),
               "cpuUsPerAck": per_ack_us.round(), "acksPerSec": acks_per_sec.round(), "concurrency": concurrency})
    };
    let ratio = |a: f64, b: f64| if b > 0.0 { ((a / b) * 100.0).round() / 100.0 } else { 0.0 };
    let forwarded_metric = other.metric(r#"popgate_tier_settlements_forwarded_total{action="ack",result="ok"}"#).await;
    json!({
        "local": summary(&local, local_cpu, local_rate),
        "forwarded": summary(&forwarded, forwarded_cpu, forwarded_rate),
        "forwardedOverLocal": {
            "acksPerSec": ratio(forwarded_rate, local_rate),
            "p50": ratio(percentile(&forwarded, 50.0), percentile(&local, 50.0)),
            "p99": ratio(percentile(&forwarded, 99.0), percentile(&local, 99.0)),
            "cpuPerAck": ratio(forwarded_cpu.as_secs_f64() / forwarded.len().max(1) as f64,
                               local_cpu.as_secs_f64() / local.len().max(1) as f64),
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
