//! How cost grows (issue #49): popgate's CPU per message and end-to-end p99 over its HTTP front (long-poll with
//! batch ACK, the throughput phase's subscriber) as the number of active groups grows, and as the number of
//! subscribers per group grows, at one fixed offered load so that CPU per message compares across points.
//!
//! Two sweeps, each point on a fresh popgate and fresh topics (popgate starts a new group at a queue's first
//! message, so a reused topic would hand the new groups the last point's messages):
//! - **groups**: `BENCH_SCALE_GROUPS` (1, 100, 1 000, 10 000) groups, each on a topic of its own, one subscriber
//!   each (1 000 added to the three: in a debug build it is where publishing through popgate broke down);
//! - **subscribers**: one group with `BENCH_SCALE_SUBSCRIBERS` (1, 10, 100) subscribers, each its own connection.
//!
//! Every subscriber is connected and long-polling before the load starts; the publisher then sends
//! `BENCH_SCALE_RATE` msgs/s in all (500) for `BENCH_SECS`, round-robin over the point's topics. Printed per point:
//! how long its topics and groups took to create (both made at the broker first, as an operator makes them),
//! popgate's CPU while everyone waits and nothing is sent (read over 5 s, from `3 + subscribers / 2 000` s after
//! the long polls start, or from `BENCH_SCALE_SETTLE_SECS`), then under the load
//! its CPU per message (publish + hand-out + ACK), end-to-end p50 / p99, msgs/s and what was not ACKed. The table
//! goes into the JSON (`scale`) and is drawn as an SVG (`<target>/tmp/popgate-scale.svg`, `BENCH_SCALE_SVG`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

use crate::harness::popgate::Popgate;
use crate::harness::{env_or, unique_topic};
use crate::{consumers_done, cpu_time, long_poll_subscriber, pct, run_producers, Params, Sample};

/// Topics or groups per list request (see [`create_topics`], [`create_groups`]).
const NAMES_PER_REQUEST: usize = 500;
/// Subscriptions made (`POST /events/subscribe`) at once.
const SUBSCRIBE_CONCURRENCY: usize = 32;
/// A subscriber's long-poll wait: long, so that idle subscribers cost what parked ones cost and not a poll
/// a second each (the tasks are aborted once everything is ACKed, not waited for).
const WAIT_MS: u64 = 10_000;

fn list(name: &str, default: &str) -> Vec<usize> {
    let text = std::env::var(name).unwrap_or_else(|_| default.to_owned());
    text.split(',').filter_map(|n| n.trim().replace('_', "").parse().ok()).filter(|n| *n > 0).collect()
}

/// Runs both sweeps against the cluster at `namesrv` (whose brokers are `broker_addrs`).
pub async fn scale(params: &Params, namesrv: &str, broker_addrs: &[String]) -> Value {
    let groups = list("BENCH_SCALE_GROUPS", if params.full { "1,100,1000,10000" } else { "1,4" });
    let subscribers = list("BENCH_SCALE_SUBSCRIBERS", if params.full { "1,10,100" } else { "1,4" });
    let rate: f64 = env_or("BENCH_SCALE_RATE", if params.full { 500.0 } else { 100.0 });
    let mut points: Vec<(&str, usize, usize)> = groups.iter().map(|g| ("groups", *g, 1)).collect();
    // (1 group, 1 subscriber) is already the first point of the groups sweep when that sweep starts at 1.
    points.extend(subscribers.iter().filter(|s| !(**s == 1 && groups.contains(&1))).map(|s| ("subscribers", 1, *s)));
    let mut rows = Vec::new();
    for (sweep, g, s) in points {
        let row = point(params, namesrv, broker_addrs, g, s, rate).await;
        println!("scale {sweep} ({g} groups × {s} subscribers): {row}");
        rows.push(row);
    }
    let svg_path = std::env::var("BENCH_SCALE_SVG")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("popgate-scale.svg"));
    let svg = svg(&rows, rate);
    let written = match std::fs::write(&svg_path, svg) {
        Ok(()) => Some(svg_path.display().to_string()),
        Err(error) => {
            eprintln!("popgate-bench: cannot write {}: {error}", svg_path.display());
            None
        }
    };
    json!({"offeredMsgsPerSec": rate, "secsPerPoint": params.secs, "points": rows, "svg": written})
}

/// One point: `groups` groups (each on a topic of its own) with `per_group` subscribers each.
async fn point(
    params: &Params,
    namesrv: &str,
    broker_addrs: &[String],
    groups: usize,
    per_group: usize,
    rate: f64,
) -> Value {
    let prefix = unique_topic("scale");
    let topics: Vec<String> = (0..groups).map(|i| format!("{prefix}_t{i}")).collect();
    let started = Instant::now();
    if let Err(error) = create_topics(&topics, broker_addrs).await {
        panic!("scale: {groups} topics not created: {error}");
    }
    let group_of = |i: usize| format!("{prefix}_g{i}");
    let group_names: Vec<String> = (0..groups).map(group_of).collect();
    if let Err(error) = create_groups(&group_names, broker_addrs).await {
        panic!("scale: {groups} groups not created: {error}");
    }
    let create_secs = started.elapsed().as_secs_f64();

    let connections = groups * per_group;
    // The per-token limits protect popgate from one runaway client; this one client is every subscriber.
    let limits =
        format!("[server]\nmax_waiters_per_token = {}\nmax_connections = {}\n", connections + 64, connections + 1_024);
    let popgate = Popgate::start(namesrv, &limits).await;
    // One connection per subscriber, as separate applications would have.
    let http = reqwest::Client::builder().pool_max_idle_per_host(connections + 64).build().expect("http client");
    let subscribed = futures::stream::iter(0..groups)
        .map(|i| {
            let (http, base, group, topic) = (http.clone(), popgate.base.clone(), group_of(i), topics[i].clone());
            async move {
                let resp = http
                    .post(format!("{base}/events/subscribe"))
                    .json(&json!({"group": group, "topic": topic}))
                    .send()
                    .await;
                resp.is_ok_and(|r| r.status().as_u16() == 200)
            }
        })
        .buffer_unordered(SUBSCRIBE_CONCURRENCY)
        .filter(|ok| std::future::ready(*ok))
        .count()
        .await;

    let sample = Arc::new(Sample::default());
    let mut tasks = Vec::new();
    for i in 0..connections {
        let (http, sample, base) = (http.clone(), sample.clone(), popgate.base.clone());
        let query = format!("group={}&topic={}", group_of(i / per_group), topics[i / per_group]);
        tasks.push(tokio::spawn(async move { long_poll_subscriber(&http, &base, &query, WAIT_MS, &sample).await }));
    }
    // Every long poll parked (a connection each) before the idle CPU is read and the load starts.
    // `BENCH_SCALE_SETTLE_SECS` waits longer, to tell popgate's start-up of many POP loops from its idle cost.
    let settle = Duration::from_secs_f64(env_or(
        "BENCH_SCALE_SETTLE_SECS",
        if params.full { 3.0 + connections as f64 / 2_000.0 } else { 0.5 },
    ));
    tokio::time::sleep(settle).await;
    let idle = Duration::from_secs(if params.full { 5 } else { 1 });
    let before = cpu_time(popgate.pid());
    tokio::time::sleep(idle).await;
    let idle_cpu_pct = cpu_time(popgate.pid()).saturating_sub(before).as_secs_f64() / idle.as_secs_f64() * 100.0;

    let cpu_before = cpu_time(popgate.pid());
    let started_us = crate::micros();
    let next = Arc::new(AtomicUsize::new(0));
    let (topics_shared, base) = (Arc::new(topics), popgate.base.clone());
    let publisher = http.clone();
    // What the first failed publish was answered (or why it got no answer), for the report.
    let first_failure = Arc::new(parking_lot::Mutex::new(None::<String>));
    let failure = first_failure.clone();
    let send = move |texts: Vec<String>| {
        let (http, base, topics, next) = (publisher.clone(), base.clone(), topics_shared.clone(), next.clone());
        let failure = failure.clone();
        async move {
            let topic = &topics[next.fetch_add(1, Ordering::Relaxed) % topics.len()];
            let text = texts.concat();
            let resp =
                http.post(format!("{base}/events/publish")).json(&json!({"topic": topic, "data": text})).send().await;
            let why = match resp {
                Ok(r) if r.status().as_u16() == 200 => return true,
                Ok(r) => format!("{}: {}", r.status(), r.text().await.unwrap_or_default()),
                Err(error) => error.to_string(),
            };
            failure.lock().get_or_insert(why);
            false
        }
    };
    let per_producer = rate / params.producers.max(1) as f64;
    run_producers(params, sample.clone(), Some(per_producer), params.secs, 1, send).await;
    while !consumers_done(&sample) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cpu = cpu_time(popgate.pid()).saturating_sub(cpu_before);
    for task in tasks {
        task.abort();
    }
    let sent = sample.sent.load(Ordering::Relaxed);
    let acked = sample.acked.load(Ordering::Relaxed);
    let e2e_secs = sample.last_ack_us.load(Ordering::Relaxed).saturating_sub(started_us) as f64 / 1e6;
    let mut e2e = sample.e2e_us.lock().clone();
    json!({
        "groups": groups,
        "topics": groups,
        "subscribersPerGroup": per_group,
        "subscriptionsMade": subscribed,
        "createSecs": (create_secs * 10.0).round() / 10.0,
        "idleCpuPercent": idle_cpu_pct.round(),
        "sent": sent,
        "acked": acked,
        "publishFailures": sample.publish_failures.load(Ordering::Relaxed),
        "firstPublishFailure": first_failure.lock().clone(),
        "notAcked": sent.saturating_sub(acked),
        "endToEndMsgsPerSec": if e2e_secs > 0.0 { (acked as f64 / e2e_secs).round() } else { 0.0 },
        "cpuUsPerMsg": if acked > 0 { (cpu.as_secs_f64() * 1e6 / acked as f64).round() } else { 0.0 },
        "endToEndLatencyMs": {"p50": pct(&mut e2e, 0.5), "p99": pct(&mut e2e, 0.99)},
        "peakRssMib": crate::harness::popgate::proc_status_kib(popgate.pid(), "VmHWM:") / 1024,
    })
}

/// Creates `topics` (4 queues each, as the harness's `create_topic`) on every broker of `broker_addrs`,
/// [`NAMES_PER_REQUEST`] per `UPDATE_AND_CREATE_TOPIC_LIST` (request code 18, RocketMQ 5.x). One
/// `UPDATE_AND_CREATE_TOPIC` per topic makes the broker rewrite its whole topic table and register at the name
/// server for every topic, each slower as the table grows: 32 in flight timed out (5 s) on this machine before
/// 10 000 were made; a list request does both once per request.
async fn create_topics(topics: &[String], broker_addrs: &[String]) -> Result<(), String> {
    create_listed(broker_addrs, 18, topics, |chunk| {
        let configs: Vec<Value> = chunk
            .iter()
            .map(|topic| {
                json!({"topicName": topic, "readQueueNums": 4, "writeQueueNums": 4, "perm": 6,
                    "topicFilterType": "SINGLE_TAG", "topicSysFlag": 0, "order": false, "attributes": {}})
            })
            .collect();
        json!({ "topicConfigList": configs })
    })
    .await
}

/// Creates the subscription groups `groups` on every broker of `broker_addrs`, [`NAMES_PER_REQUEST`] per
/// `UPDATE_AND_CREATE_SUBSCRIPTIONGROUP_LIST` (request code 225, RocketMQ 5.x), as an operator creates them
/// before their applications start. Left to the broker's `autoCreateSubscriptionGroup`, each group is made by its
/// first POP, and every such creation rewrites the broker's whole group table (`SubscriptionGroupManager`'s
/// `persist()` under one lock): 10 000 new groups were made at about 60 a second, and meanwhile the POPs queued
/// behind them in the broker's pull threads for over 5 s were answered `SYSTEM_BUSY`. The point then measured
/// the broker making groups (minutes), not the cost of 10 000 active groups.
async fn create_groups(groups: &[String], broker_addrs: &[String]) -> Result<(), String> {
    create_listed(broker_addrs, 225, groups, |chunk| {
        let configs: Vec<Value> = chunk.iter().map(|group| json!({"groupName": group})).collect();
        json!({ "groupConfigList": configs })
    })
    .await
}

/// Sends the admin request `code` to every broker of `broker_addrs`, its body made by `body` from
/// [`NAMES_PER_REQUEST`] of `names` at a time, one request after another on one connection.
async fn create_listed(
    broker_addrs: &[String],
    code: i32,
    names: &[String],
    body: impl Fn(&[String]) -> Value,
) -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for addr in broker_addrs {
        let mut stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| format!("connect {addr}: {e}"))?;
        for chunk in names.chunks(NAMES_PER_REQUEST) {
            let body = body(chunk).to_string().into_bytes();
            let request = rocketmq_protocol::protocol::remoting_command::RemotingCommand::create_remoting_command(code)
                .set_body(body);
            let frame = rocketmq_protocol::protocol::encoded_frame::EncodedFrame::from_command(request)
                .map_err(|e| format!("encode: {e}"))?
                .into_bytes();
            stream.write_all(&frame).await.map_err(|e| format!("write to {addr}: {e}"))?;
            // The answer: a 4-byte length, then the frame.
            let answer = tokio::time::timeout(Duration::from_secs(120), async {
                let mut length = [0u8; 4];
                stream.read_exact(&mut length).await?;
                let mut frame = bytes::BytesMut::from(&length[..]);
                frame.resize(4 + u32::from_be_bytes(length) as usize, 0);
                stream.read_exact(&mut frame[4..]).await?;
                Ok::<_, std::io::Error>(frame)
            })
            .await
            .map_err(|_| format!("{addr} did not answer within 120 s"))?
            .map_err(|e| format!("read from {addr}: {e}"))?;
            let mut answer = answer;
            let answer = rocketmq_protocol::protocol::remoting_command::RemotingCommand::decode(&mut answer)
                .map_err(|e| format!("decode: {e}"))?
                .ok_or("a partial frame")?;
            if answer.code() != 0 {
                return Err(format!("{addr} answered request {code} with {}: {:?}", answer.code(), answer.remark()));
            }
        }
    }
    Ok(())
}

/// The table: one line per point.
pub fn print_table(scale: &Value) {
    if scale.is_null() {
        return;
    }
    println!(
        "\nhow cost grows (HTTP long-poll + batch ACK, {} msgs/s offered, {} s per point)",
        scale["offeredMsgsPerSec"], scale["secsPerPoint"]
    );
    println!(
        "{:>7} {:>12} {:>11} {:>9} {:>8} {:>10} {:>14} {:>8} {:>9}",
        "groups", "subs/group", "create s", "idle cpu", "e2e/s", "cpu µs/msg", "e2e p50/p99", "not ACKed", "peak RSS"
    );
    let num = |v: &Value| v.as_f64().unwrap_or(0.0);
    for p in scale["points"].as_array().into_iter().flatten() {
        println!(
            "{:>7} {:>12} {:>11.1} {:>8.0}% {:>8.0} {:>10.0} {:>14} {:>8} {:>5} MiB",
            p["groups"].as_u64().unwrap_or(0),
            p["subscribersPerGroup"].as_u64().unwrap_or(0),
            num(&p["createSecs"]),
            num(&p["idleCpuPercent"]),
            num(&p["endToEndMsgsPerSec"]),
            num(&p["cpuUsPerMsg"]),
            format!("{:.1}/{:.1}", num(&p["endToEndLatencyMs"]["p50"]), num(&p["endToEndLatencyMs"]["p99"])),
            p["notAcked"].as_u64().unwrap_or(0),
            p["peakRssMib"].as_u64().unwrap_or(0),
        );
    }
    for p in scale["points"].as_array().into_iter().flatten() {
        if let Some(failure) = p["firstPublishFailure"].as_str() {
            println!("  {} groups: {} publishes failed, the first: {failure}", p["groups"], p["publishFailures"]);
        }
    }
    if let Some(svg) = scale["svg"].as_str() {
        println!("plot: {svg}");
    }
}

/// The smoke run's check: every point made its subscriptions and ACKed everything it sent.
pub fn check_smoke(scale: &Value) {
    for p in scale["points"].as_array().into_iter().flatten() {
        assert_eq!(p["subscriptionsMade"], p["groups"], "smoke: scale subscriptions: {p}");
        assert!(p["sent"].as_u64().unwrap_or(0) > 0, "smoke: scale sent nothing: {p}");
        assert_eq!(p["notAcked"].as_u64(), Some(0), "smoke: scale lost messages: {p}");
    }
}

// === the plot ===

/// Two panels side by side (groups, subscribers per group), each with a log-scale x axis and two series on their
/// own y axes: CPU per message (left axis) and end-to-end p99 (right axis). Hand-written SVG: a few lines and
/// labels need no plotting crate.
fn svg(rows: &[Value], rate: f64) -> String {
    let num = |v: &Value| v.as_f64().unwrap_or(0.0);
    // A point where nothing was delivered has no CPU per message nor p99: it is named under the plot instead.
    let (delivered, failed): (Vec<&Value>, Vec<&Value>) = rows.iter().partition(|r| num(&r["acked"]) > 0.0);
    let series = |by_groups: bool| -> Vec<(f64, f64, f64)> {
        let mut points: Vec<(f64, f64, f64)> = delivered
            .iter()
            .filter(|r| if by_groups { r["subscribersPerGroup"] == 1 } else { r["groups"] == 1 })
            .map(|r| {
                let x = num(if by_groups { &r["groups"] } else { &r["subscribersPerGroup"] });
                (x, num(&r["cpuUsPerMsg"]), num(&r["endToEndLatencyMs"]["p99"]))
            })
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        points
    };
    let (w, h) = (960.0, 420.0);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">popgate: how cost grows \
         (HTTP long-poll, {rate:.0} msgs/s offered)</text>\n",
        w / 2.0
    );
    // Both y axes are log10 from 1 to the same power of ten (at or above the largest value of either), so a
    // point two decades up (10 000 groups) does not flatten the others onto the axis.
    let largest = delivered
        .iter()
        .flat_map(|r| [num(&r["cpuUsPerMsg"]), num(&r["endToEndLatencyMs"]["p99"])])
        .fold(10.0, f64::max);
    let decades = largest.log10().ceil();
    for (panel, (by_groups, title)) in
        [(true, "active groups (1 subscriber each, a topic each)"), (false, "subscribers per group (1 group)")]
            .into_iter()
            .enumerate()
    {
        let (x0, y0, pw, ph) = (70.0 + panel as f64 * 470.0, 50.0, 340.0, 300.0);
        let points = series(by_groups);
        // The axis ends at the power of ten at or above the largest point.
        let max_x = 10f64.powf(points.iter().map(|p| p.0).fold(10.0, f64::max).log10().ceil());
        // log10 x from 1 to the largest point.
        let sx = |x: f64| x0 + x.max(1.0).log10() / max_x.log10() * pw;
        let sy = |v: f64| y0 + ph - v.max(1.0).log10() / decades * ph;
        out.push_str(&format!(
            "<rect x=\"{x0}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>\n\
             <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{title}</text>\n",
            x0 + pw / 2.0,
            y0 + ph + 36.0
        ));
        // x ticks at every power of ten.
        let mut tick = 1.0;
        while tick <= max_x * 1.001 {
            out.push_str(&format!(
                "<line x1=\"{x:.1}\" y1=\"{y}\" x2=\"{x:.1}\" y2=\"{y2}\" stroke=\"#999\"/>\
                 <text x=\"{x:.1}\" y=\"{ty}\" text-anchor=\"middle\">{tick}</text>\n",
                x = sx(tick),
                y = y0 + ph,
                y2 = y0 + ph + 5.0,
                ty = y0 + ph + 18.0
            ));
            tick *= 10.0;
        }
        // y ticks at every power of ten, the same on both axes.
        for decade in 0..=decades as i32 {
            let (y, label) = (sy(10f64.powi(decade)), 10f64.powi(decade));
            out.push_str(&format!(
                "<text x=\"{}\" y=\"{}\" text-anchor=\"end\" fill=\"#1f77b4\">{label:.0}</text>\
                 <text x=\"{}\" y=\"{}\" fill=\"#d62728\">{label:.0}</text>\n",
                x0 - 6.0,
                y + 4.0,
                x0 + pw + 6.0,
                y + 4.0,
            ));
        }
        out.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" fill=\"#1f77b4\" transform=\"rotate(-90 {} {})\" text-anchor=\"middle\">\
             CPU per message (µs, log)</text>\n<text x=\"{}\" y=\"{}\" fill=\"#d62728\" transform=\"rotate(90 {} {})\" \
             text-anchor=\"middle\">end-to-end p99 (ms, log)</text>\n",
            x0 - 45.0,
            y0 + ph / 2.0,
            x0 - 45.0,
            y0 + ph / 2.0,
            x0 + pw + 45.0,
            y0 + ph / 2.0,
            x0 + pw + 45.0,
            y0 + ph / 2.0
        ));
        for (color, value) in [("#1f77b4", 1usize), ("#d62728", 2usize)] {
            let pick = |p: &(f64, f64, f64)| if value == 1 { p.1 } else { p.2 };
            let path: Vec<String> = points.iter().map(|p| format!("{:.1},{:.1}", sx(p.0), sy(pick(p)))).collect();
            out.push_str(&format!(
                "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"/>\n",
                path.join(" ")
            ));
            for p in &points {
                out.push_str(&format!(
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3.5\" fill=\"{color}\"/>\n",
                    sx(p.0),
                    sy(pick(p))
                ));
            }
        }
    }
    if !failed.is_empty() {
        let names: Vec<String> = failed
            .iter()
            .map(|r| format!("{} groups × {} subscribers", r["groups"], r["subscribersPerGroup"]))
            .collect();
        out.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#555\">nothing delivered (not plotted): {}</text>\n",
            w / 2.0,
            h - 8.0,
            names.join(", ")
        ));
    }
    out.push_str("</svg>\n");
    out
}
