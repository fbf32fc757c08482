//! popgate's gRPC front against Apache's own RocketMQ 5 proxy.
//!
//! One broker (a reliability profile of `docker/rocketmq/profiles`), Apache's proxy (`rocketmq-proxy` of the
//! broker's version, cluster mode) and popgate's gRPC front beside each other in front of it, and the same
//! official Java SDK load program (the gRPC test driver's `load` scenario) against each front in turn:
//! Producer sync sends + SimpleConsumer receive/ack, then Producer + PushConsumer. Each front is warmed up
//! first (the proxy's JIT deserves the same chance as popgate's caches). Each mode runs at full speed, then at
//! `BENCH_SDK_CAPPED_RATE` msgs/s (300), below either front's capacity. For each run: send and end-to-end
//! msgs/s, p99s, the front's CPU per message and its peak RSS, then the ratios popgate/Apache.

use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::direct::Direct;
use crate::harness::env_or;
use crate::harness::popgate::{proc_status_kib, Popgate};
use crate::harness::rocketmq::{ApacheProxy, Cluster, ClusterSpec};
use crate::harness::sdk::{Scenario, Sdk};
use crate::harness::unique_topic;
use crate::{cpu_time, Params};

/// The two consumer kinds an SDK application uses.
const MODES: [&str; 2] = ["simple", "push"];

/// One front under test: its name, gRPC endpoint and process.
struct Front {
    name: &'static str,
    endpoint: String,
    pid: u32,
}

/// Runs the comparison on a broker of `profile` and returns its runs and ratios.
pub async fn compare(params: &Params, profile: &str) -> Value {
    let cluster = tokio::task::block_in_place(|| Cluster::start(&ClusterSpec::profile(profile)));
    let broker_addr = vec![format!("127.0.0.1:{}", cluster.broker("broker-a").port)];
    let admin = Direct::connect(&cluster.namesrv_addr).await;
    let proxy = tokio::task::block_in_place(|| ApacheProxy::start(&cluster));
    let popgate = Popgate::start(&cluster.namesrv_addr, &format!("[reliability]\nprofile = \"{profile}\"\n")).await;
    let fronts = [
        Front { name: "apache-proxy", endpoint: proxy.endpoint.clone(), pid: proxy.pid() },
        Front { name: "popgate", endpoint: popgate.grpc.clone(), pid: popgate.pid() },
    ];

    let warm = Params { secs: if params.full { 5.0 } else { 1.0 }, ..params.clone() };
    for front in &fronts {
        let topic = new_topic(&admin, &broker_addr, "warm").await;
        load(&warm, front, &topic, "simple", None).await;
    }
    // Each mode twice: at full speed (throughput; its end-to-end p99 is mostly the backlog a saturated load
    // program builds), then at the same offered rate below either front's capacity (the latency each adds).
    let capped: f64 = env_or("BENCH_SDK_CAPPED_RATE", 300.0);
    let mut runs = Vec::new();
    for (mode, rate) in MODES.iter().map(|m| (*m, None)).chain(MODES.iter().map(|m| (*m, Some(capped)))) {
        for front in &fronts {
            let topic = new_topic(&admin, &broker_addr, mode).await;
            let run = load(params, front, &topic, mode, rate).await;
            println!(
                "{profile} {mode} {}{}: {run}",
                front.name,
                rate.map(|r| format!(" at {r}/s")).unwrap_or_default()
            );
            runs.push(run);
        }
    }
    let ratios: Vec<Value> =
        MODES.iter().flat_map(|mode| [ratios(&runs, mode, None), ratios(&runs, mode, Some(capped))]).collect();
    json!({"profile": profile, "runs": runs, "ratios": ratios})
}

async fn new_topic(admin: &Direct, broker_addr: &[String], what: &str) -> String {
    let topic = unique_topic(&format!("sdk_{what}"));
    admin.create_topic(&topic, broker_addr).await;
    topic
}

/// One load run of `mode` through `front` (at `rate` msgs/s in all, or as fast as it goes): the driver's figures
/// plus the front's CPU and RSS.
async fn load(params: &Params, front: &Front, topic: &str, mode: &str, rate: Option<f64>) -> Value {
    let senders: usize = env_or("BENCH_SDK_SENDERS", 16);
    let args = json!({
        "endpoint": front.endpoint,
        "topic": topic,
        "group": format!("{topic}_group"),
        "mode": mode,
        "seconds": params.secs,
        "senders": senders,
        "rate": rate.map_or(0.0, |r| r / senders as f64),
        "consumers": params.subscribers,
        "size": params.size,
        "drainSeconds": 15,
    });
    let cpu_before = cpu_time(front.pid);
    // The optimising compiler and a heap that never limits the load program: it must not be the bottleneck.
    let scenario = Scenario::start_in(Sdk::NEWEST, &["-Xms512m", "-Xmx512m"], "load", &args);
    let result = scenario.finish(Duration::from_secs_f64(params.secs + 120.0)).await;
    let cpu = cpu_time(front.pid).saturating_sub(cpu_before);
    let consumed = result["consumed"].as_u64().unwrap_or(0);
    let cpu_us_per_msg = if consumed > 0 { (cpu.as_secs_f64() * 1e6 / consumed as f64).round() } else { 0.0 };
    json!({
        "front": front.name,
        "mode": mode,
        "offeredMsgsPerSec": rate,
        "sent": result["sent"],
        "consumed": consumed,
        "lost": result["lost"],
        "duplicates": result["duplicates"],
        "errors": {"send": result["sendErrors"], "receive": result["receiveErrors"], "ack": result["ackErrors"]},
        "sendMsgsPerSec": result["sendMsgsPerSec"],
        "endToEndMsgsPerSec": result["endToEndMsgsPerSec"],
        "sendLatencyMs": result["sendLatencyMs"],
        "endToEndLatencyMs": result["endToEndLatencyMs"],
        "frontCpuUsPerMsg": cpu_us_per_msg,
        // The high-water mark since the front started: warm-up and earlier runs included, the same for both.
        "frontPeakRssMib": proc_status_kib(front.pid, "VmHWM:") / 1024,
        "firstErrors": result["firstErrors"],
    })
}

/// popgate's figure over Apache's for each compared quantity of `mode` (above 1 is better for throughput,
/// below 1 is better for latency, CPU and memory).
fn ratios(runs: &[Value], mode: &str, rate: Option<f64>) -> Value {
    let run = |front: &str| {
        runs.iter()
            .find(|r| r["front"] == front && r["mode"] == mode && r["offeredMsgsPerSec"].as_f64() == rate)
            .cloned()
    };
    let (Some(apache), Some(popgate)) = (run("apache-proxy"), run("popgate")) else { return Value::Null };
    let ratio = |path: &[&str]| {
        let get = |v: &Value| path.iter().fold(v, |v, k| &v[*k]).as_f64().unwrap_or(0.0);
        let (a, b) = (get(&apache), get(&popgate));
        if a > 0.0 {
            json!((b / a * 100.0).round() / 100.0)
        } else {
            Value::Null
        }
    };
    json!({
        "mode": mode,
        "offeredMsgsPerSec": rate,
        "endToEndThroughput": ratio(&["endToEndMsgsPerSec"]),
        "sendThroughput": ratio(&["sendMsgsPerSec"]),
        "sendP99": ratio(&["sendLatencyMs", "p99"]),
        "endToEndP99": ratio(&["endToEndLatencyMs", "p99"]),
        "cpuPerMsg": ratio(&["frontCpuUsPerMsg"]),
        // Messages per CPU-second, popgate over Apache: how much more the same cores carry through popgate
        // when the proxy's CPU, not the load program or the broker, is what runs out.
        "messagesPerCpuSecond": ratio(&["frontCpuUsPerMsg"]).as_f64().filter(|r| *r > 0.0).map(|r| ((1.0 / r) * 100.0).round() / 100.0),
        "peakRss": ratio(&["frontPeakRssMib"]),
    })
}

/// The comparison as a table: one line per profile, mode and front, then the ratios.
pub fn print_table(comparisons: &Value) {
    println!("\nagainst Apache's RocketMQ 5 proxy (official Java SDK, same broker, same load)");
    println!(
        "{:<11} {:<7} {:>7} {:<13} {:>8} {:>8} {:>11} {:>11} {:>10} {:>9} {:>6}",
        "profile",
        "mode",
        "offered",
        "front",
        "send/s",
        "e2e/s",
        "send p99 ms",
        "e2e p99 ms",
        "cpu µs/msg",
        "peak RSS",
        "lost"
    );
    for comparison in comparisons.as_array().into_iter().flatten() {
        for run in comparison["runs"].as_array().into_iter().flatten() {
            let num = |v: &Value| v.as_f64().unwrap_or(0.0);
            println!(
                "{:<11} {:<7} {:>7} {:<13} {:>8.0} {:>8.0} {:>11.1} {:>11.1} {:>10.0} {:>5} MiB {:>6}",
                comparison["profile"].as_str().unwrap_or_default(),
                run["mode"].as_str().unwrap_or_default(),
                run["offeredMsgsPerSec"].as_f64().map_or("max".to_owned(), |r| format!("{r:.0}/s")),
                run["front"].as_str().unwrap_or_default(),
                num(&run["sendMsgsPerSec"]),
                num(&run["endToEndMsgsPerSec"]),
                num(&run["sendLatencyMs"]["p99"]),
                num(&run["endToEndLatencyMs"]["p99"]),
                num(&run["frontCpuUsPerMsg"]),
                run["frontPeakRssMib"],
                run["lost"],
            );
        }
        for ratio in comparison["ratios"].as_array().into_iter().flatten() {
            println!("ratios popgate/apache ({}): {ratio}", comparison["profile"].as_str().unwrap_or_default());
        }
    }
}
