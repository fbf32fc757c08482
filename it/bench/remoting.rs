//! The remoting front against the cluster itself and against Apache's proxy (issue #49).
//!
//! The same Java program (the remoting driver's `load` scenario: `BENCH_REMOTING_SENDERS` threads doing
//! synchronous `DefaultMQProducer` sends of `BENCH_SIZE` bytes, one `DefaultMQPushConsumer` with
//! `BENCH_SUBSCRIBERS` consumption threads) runs on three paths, one after the other, each on a topic and group of
//! its own:
//! - **direct**: the client's name server is the cluster's;
//! - **popgate**: the client's name server is popgate's remoting port, which answers routes with itself and relays;
//! - **apache-proxy**: the client's name server is Apache's proxy's remoting port (client 5.x only, as issue #49
//!   asks: the proxy of the broker's version is compared with the client of its generation).
//!
//! Under the newest 4.9.x client and the newest 5.x one ([`RemotingClient::V4`], [`RemotingClient::V5`]). Each path
//! runs at full speed (throughput), then, in the full run, at half of the direct path's send rate (the latency a
//! front adds when nothing is saturated). Printed for each: send and end-to-end msgs/s, p50 / p99 of both, the
//! front's CPU per message (`/proc`) and peak RSS; then popgate / direct (throughput, p99 added) and popgate /
//! Apache's proxy (throughput, CPU per message).

use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::direct::Direct;
use crate::harness::popgate::{proc_status_kib, Popgate};
use crate::harness::remoting::RemotingClient;
use crate::harness::rocketmq::{ApacheProxy, Cluster};
use crate::harness::{env_or, free_port, unique_topic};
use crate::{cpu_time, Params};

/// The client versions measured: the newest 4.9.x (what most 4.x apps run) and the newest 5.x.
const CLIENTS: [RemotingClient; 2] = [RemotingClient::V4, RemotingClient::V5];

/// One way to the cluster: its name, the address the client is given as its name server, and the process in
/// between (none for direct).
struct Path {
    name: &'static str,
    namesrv: String,
    pid: Option<u32>,
    /// popgate's HTTP base, whose metrics count the remoting requests each message took.
    metrics: Option<String>,
}

/// Runs the phase on `cluster` and returns, per client version, its runs and ratios.
pub async fn remoting(params: &Params, cluster: &Cluster) -> Value {
    let broker_addr = vec![format!("127.0.0.1:{}", cluster.broker("broker-a").port)];
    let admin = Direct::connect(&cluster.namesrv_addr).await;
    // Every run's topic is made before anything starts: a 5.4.0 push consumer that asked Apache's proxy for a
    // topic made moments before got its first queues 18 s later (its next rebalance), where through popgate or
    // straight at the cluster it took under half a second.
    let runs_per_path = if params.full { 3 } else { 1 };
    // Two paths for a 4.x client, three for 5.x (`paths_of` below).
    let wanted: usize = CLIENTS.iter().map(|c| if *c == RemotingClient::V4 { 2 } else { 3 } * runs_per_path).sum();
    let mut topics = Vec::new();
    for _ in 0..wanted {
        let topic = unique_topic("rm_load");
        admin.create_topic(&topic, &broker_addr).await;
        topics.push(topic);
    }
    let mut next_topic = move || topics.pop().expect("a topic made for each run");
    let proxy = tokio::task::block_in_place(|| ApacheProxy::start(cluster));
    let listen = format!("127.0.0.1:{}", free_port());
    let popgate = Popgate::start(&cluster.namesrv_addr, &format!("[remoting]\nlisten = \"{listen}\"\n")).await;
    let direct = Path { name: "direct", namesrv: cluster.namesrv_addr.clone(), pid: None, metrics: None };
    let through_popgate =
        Path { name: "popgate", namesrv: listen, pid: Some(popgate.pid()), metrics: Some(popgate.base.clone()) };
    let apache = Path { name: "apache-proxy", namesrv: proxy.remoting.clone(), pid: Some(proxy.pid()), metrics: None };

    let paths_of = |client: RemotingClient| -> Vec<&Path> {
        if client == RemotingClient::V4 {
            vec![&direct, &through_popgate]
        } else {
            vec![&direct, &through_popgate, &apache]
        }
    };
    let mut runs_of = Vec::new();
    if params.full {
        for client in CLIENTS {
            let paths = paths_of(client);
            let mut runs = Vec::new();
            // Warm-up of each path (routes, connections, both JVMs' JIT), then one path after another.
            let warm = Params { secs: 5.0, ..params.clone() };
            for path in &paths {
                load(&warm, client, path, &next_topic(), None).await;
            }
            for path in &paths {
                runs.push(load(params, client, path, &next_topic(), None).await);
            }
            // Half of the direct path's send rate, the same for every path.
            let capped = runs[0]["sendMsgsPerSec"].as_f64().unwrap_or(200.0).max(20.0) / 2.0;
            for path in &paths {
                runs.push(load(params, client, path, &next_topic(), Some(capped.round())).await);
            }
            runs_of.push((client, runs));
        }
    } else {
        // The smoke run checks that every path carries every message once; its figures mean nothing, so every
        // client on every path runs at once (each on its own topic and group) to keep it to seconds.
        let mut pairs = Vec::new();
        for client in CLIENTS {
            for path in paths_of(client) {
                pairs.push((client, path, next_topic()));
            }
        }
        let runs =
            futures::future::join_all(pairs.iter().map(|(c, path, topic)| load(params, *c, path, topic, None))).await;
        for client in CLIENTS {
            runs_of.push((client, runs.iter().filter(|r| r["client"] == client.0).cloned().collect()));
        }
    }
    let mut results = Vec::new();
    for (client, runs) in runs_of {
        for run in &runs {
            println!("remoting {} {}: {run}", client.0, run["path"]);
        }
        results.push(json!({"client": client.0, "runs": runs, "ratios": ratios(&runs)}));
    }
    drop((popgate, proxy));
    Value::Array(results)
}

/// One `load` run of `client` on `path` (at `rate` msgs/s in all, or as fast as it goes): the driver's figures
/// plus the front's CPU per message and peak RSS.
async fn load(params: &Params, client: RemotingClient, path: &Path, topic: &str, rate: Option<f64>) -> Value {
    let senders: usize = if params.full { env_or("BENCH_REMOTING_SENDERS", 16) } else { 2 };
    let args = json!({
        "namesrv": path.namesrv,
        "topic": topic,
        "group": format!("{topic}_group"),
        "seconds": params.secs,
        "senders": senders,
        "rate": rate.map_or(0.0, |r| r / senders as f64),
        "consumers": params.subscribers,
        "size": params.size,
        "warmupSeconds": if params.full { 2 } else { 1 },
        "drainSeconds": 15,
        // A first send asks for the route and opens connections: seconds on a loaded machine.
        "sendTimeoutMs": 10_000,
        // A 5.x consumer that skipped its first heartbeat is told "subscription not latest" until the next one
        // (README of it/remoting-driver): every 2 s instead of 30.
        "heartbeatBrokerIntervalMs": 2_000,
        "timeoutMs": ((params.secs + 60.0) * 1000.0) as u64,
    });
    let cpu_before = path.pid.map(cpu_time);
    let requests_before = requests_by_code(path).await;
    // The optimising compiler and a heap that never limits the load program: it must not be the bottleneck.
    let scenario = client.start_in(&["-Xms512m", "-Xmx512m"], "load", &args);
    let result = scenario.finish(Duration::from_secs_f64(params.secs + 120.0)).await;
    let consumed = result["consumed"].as_u64().unwrap_or(0);
    let cpu_us_per_msg = match (path.pid, cpu_before) {
        (Some(pid), Some(before)) if consumed > 0 => {
            json!((cpu_time(pid).saturating_sub(before).as_secs_f64() * 1e6 / consumed as f64).round())
        }
        _ => Value::Null,
    };
    // Every request the client made of popgate per message consumed, by request code: the hops a message costs.
    let requests_per_msg: serde_json::Map<String, Value> = requests_by_code(path)
        .await
        .into_iter()
        .map(|(code, after)| (code.clone(), after - requests_before.get(&code).copied().unwrap_or(0.0)))
        .filter(|(_, made)| *made > 0.0)
        .map(|(code, made)| (code, json!((made / consumed.max(1) as f64 * 1000.0).round() / 1000.0)))
        .collect();
    json!({
        "client": client.0,
        "path": path.name,
        "offeredMsgsPerSec": rate,
        "sent": result["sent"],
        "consumed": consumed,
        "lost": result["lost"],
        "duplicates": result["duplicates"],
        "sendErrors": result["sendErrors"],
        "sendMsgsPerSec": result["sendMsgsPerSec"],
        "endToEndMsgsPerSec": result["endToEndMsgsPerSec"],
        "sendLatencyMs": result["sendLatencyMs"],
        "endToEndLatencyMs": result["endToEndLatencyMs"],
        "frontCpuUsPerMsg": cpu_us_per_msg,
        "frontRequestsPerMsg": Value::Object(requests_per_msg),
        // The high-water mark since the front started: warm-up and earlier runs included.
        "frontPeakRssMib": path.pid.map(|pid| proc_status_kib(pid, "VmHWM:") / 1024),
        "firstErrors": result["firstErrors"],
        // From the consumer's start to its first queues (-1: none within 30 s); sends start after it.
        "consumerAssignedMs": result["assignedMs"],
        "driverCloseMs": result["closeMs"],
    })
}

/// popgate's remoting requests answered so far, by request code (`popgate_remoting_requests_total`, every
/// result); empty for a path that is not popgate.
async fn requests_by_code(path: &Path) -> std::collections::BTreeMap<String, f64> {
    let mut by_code = std::collections::BTreeMap::new();
    let Some(base) = &path.metrics else { return by_code };
    let Ok(text) = reqwest::get(format!("{base}/metrics")).await.and_then(|r| r.error_for_status()) else {
        return by_code;
    };
    let text = text.text().await.unwrap_or_default();
    for line in text.lines().filter(|l| l.starts_with("popgate_remoting_requests_total{")) {
        let code = line.split("code=\"").nth(1).and_then(|rest| rest.split('"').next());
        let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let (Some(code), Some(value)) = (code, value) {
            *by_code.entry(code.to_owned()).or_insert(0.0) += value;
        }
    }
    by_code
}

/// popgate against direct (throughput at full speed, p99 added at the capped rate, or at full speed in the smoke
/// run) and against Apache's proxy (throughput and CPU per message at full speed), where those runs exist.
fn ratios(runs: &[Value]) -> Value {
    let find = |path: &str, capped: bool| {
        runs.iter().find(|r| r["path"] == path && r["offeredMsgsPerSec"].is_null() != capped)
    };
    let get = |run: Option<&Value>, keys: &[&str]| run.and_then(|r| keys.iter().fold(r, |v, k| &v[*k]).as_f64());
    let ratio = |b: Option<f64>, a: Option<f64>| match (b, a) {
        (Some(b), Some(a)) if a > 0.0 => json!((b / a * 100.0).round() / 100.0),
        _ => Value::Null,
    };
    let added = |b: Option<f64>, a: Option<f64>| match (b, a) {
        (Some(b), Some(a)) => json!(((b - a) * 100.0).round() / 100.0),
        _ => Value::Null,
    };
    let (direct, popgate, apache) = (find("direct", false), find("popgate", false), find("apache-proxy", false));
    let (direct_capped, popgate_capped) = match (find("direct", true), find("popgate", true)) {
        (Some(d), Some(p)) => (Some(d), Some(p)),
        _ => (direct, popgate),
    };
    let send_p99 = ["sendLatencyMs", "p99"];
    let e2e_p99 = ["endToEndLatencyMs", "p99"];
    json!({
        "popgateOverDirect": {
            "sendThroughput": ratio(get(popgate, &["sendMsgsPerSec"]), get(direct, &["sendMsgsPerSec"])),
            "endToEndThroughput": ratio(get(popgate, &["endToEndMsgsPerSec"]), get(direct, &["endToEndMsgsPerSec"])),
            "p99AddedAtMsgsPerSec": popgate_capped.map(|r| r["offeredMsgsPerSec"].clone()),
            "sendP99AddedMs": added(get(popgate_capped, &send_p99), get(direct_capped, &send_p99)),
            "endToEndP99AddedMs": added(get(popgate_capped, &e2e_p99), get(direct_capped, &e2e_p99)),
        },
        "popgateOverApache": apache.map(|apache| json!({
            "sendThroughput": ratio(get(popgate, &["sendMsgsPerSec"]), get(Some(apache), &["sendMsgsPerSec"])),
            "endToEndThroughput":
                ratio(get(popgate, &["endToEndMsgsPerSec"]), get(Some(apache), &["endToEndMsgsPerSec"])),
            "cpuPerMsg": ratio(get(popgate, &["frontCpuUsPerMsg"]), get(Some(apache), &["frontCpuUsPerMsg"])),
        })),
    })
}

/// The phase as a table: one line per client, path and offered load, then the ratios.
pub fn print_table(results: &Value) {
    if results.is_null() {
        return;
    }
    println!("\nremoting front (Apache's remoting Java client: DefaultMQProducer sync sends, DefaultMQPushConsumer)");
    println!(
        "{:<7} {:<13} {:>8} {:>8} {:>8} {:>15} {:>15} {:>10} {:>9} {:>5} {:>4}",
        "client",
        "path",
        "offered",
        "send/s",
        "e2e/s",
        "send p50/p99",
        "e2e p50/p99",
        "cpu µs/msg",
        "peak RSS",
        "lost",
        "dup"
    );
    let num = |v: &Value| v.as_f64().unwrap_or(0.0);
    for result in results.as_array().into_iter().flatten() {
        for run in result["runs"].as_array().into_iter().flatten() {
            let lat = |v: &Value| format!("{:.1}/{:.1}", num(&v["p50"]), num(&v["p99"]));
            println!(
                "{:<7} {:<13} {:>8} {:>8.0} {:>8.0} {:>15} {:>15} {:>10} {:>9} {:>5} {:>4}",
                result["client"].as_str().unwrap_or_default(),
                run["path"].as_str().unwrap_or_default(),
                run["offeredMsgsPerSec"].as_f64().map_or("max".to_owned(), |r| format!("{r:.0}/s")),
                num(&run["sendMsgsPerSec"]),
                num(&run["endToEndMsgsPerSec"]),
                lat(&run["sendLatencyMs"]),
                lat(&run["endToEndLatencyMs"]),
                run["frontCpuUsPerMsg"].as_f64().map_or("-".to_owned(), |c| format!("{c:.0}")),
                run["frontPeakRssMib"].as_u64().map_or("-".to_owned(), |m| format!("{m} MiB")),
                run["lost"].as_i64().map_or("?".to_owned(), |n| n.to_string()),
                run["duplicates"].as_u64().map_or("?".to_owned(), |n| n.to_string()),
            );
        }
        let r = &result["ratios"];
        println!(
            "  {}: popgate/direct send {} e2e {} (target ≥ 0.9); p99 added at {} msgs/s: send {} ms, e2e {} ms \
             (target ≤ 2); popgate/apache {}",
            result["client"].as_str().unwrap_or_default(),
            r["popgateOverDirect"]["sendThroughput"],
            r["popgateOverDirect"]["endToEndThroughput"],
            r["popgateOverDirect"]["p99AddedAtMsgsPerSec"].as_f64().map_or("max".to_owned(), |v| format!("{v:.0}")),
            r["popgateOverDirect"]["sendP99AddedMs"],
            r["popgateOverDirect"]["endToEndP99AddedMs"],
            r["popgateOverApache"],
        );
    }
}

/// The smoke run's check: every path sent something and consumed every message it sent, once.
pub fn check_smoke(results: &Value) {
    for result in results.as_array().into_iter().flatten() {
        for run in result["runs"].as_array().into_iter().flatten() {
            let what = format!("remoting {} {}", result["client"], run["path"]);
            assert!(run["sent"].as_u64().unwrap_or(0) > 0, "smoke: {what} sent nothing: {run}");
            // A send the client saw fail may still have been stored: more consumed than sent is no loss.
            assert!(run["lost"].as_i64().is_some_and(|l| l <= 0), "smoke: {what} lost messages: {run}");
            assert_eq!(run["duplicates"].as_u64(), Some(0), "smoke: {what} consumed a message twice: {run}");
        }
    }
}
