//! Hostile clients on the HTTP, gRPC and peer-link ports (issue #46; the remoting port's are in
//! `remoting_hostile.rs`): floods of connections, slow clients, bad frames and bodies, replays. Each test runs a
//! well-behaved client of the same port meanwhile and asserts it is served in time, that every hostile
//! connection is closed or answered with a clear refusal (counted), and that popgate's memory stays bounded
//! (its RSS printed before and after).

use std::time::{Duration, Instant};

use futures::future::join_all;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::harness::popgate::Popgate;
use crate::harness::unique_topic;
use crate::publish::shared_cluster;

/// How much popgate's RSS may grow over a test's floods (the remoting test's bound).
const RSS_BOUND_KIB: u64 = 64 * 1024;

/// Whether the peer closed `stream` (a read returns nothing or fails) within `within`; bytes it sends first
/// (an error answer) are read and dropped.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buffer = [0u8; 4096];
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        match tokio::time::timeout(left, stream.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

/// How many of `streams` the peer closed within `within` (all watched at once).
async fn closed_count(streams: &mut [TcpStream], within: Duration) -> usize {
    join_all(streams.iter_mut().map(|s| closed_within(s, within))).await.into_iter().filter(|c| *c).count()
}

/// `host:port` of a base URL.
fn host_port(base: &str) -> String {
    base.trim_start_matches("http://").trim_start_matches("https://").to_owned()
}

/// Reads one HTTP/1.1 response from `stream` (at most `within`): its status and JSON body (Null when the body
/// is not JSON), or `None` when the connection closed or nothing complete came in time.
async fn read_response(stream: &mut TcpStream, within: Duration) -> Option<(u16, Value)> {
    let deadline = Instant::now() + within;
    let mut read = Vec::new();
    let mut buffer = [0u8; 8192];
    loop {
        if let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&read[..end]).to_string();
            let status = head.split(' ').nth(1)?.parse().ok()?;
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length").then(|| value.trim().parse().ok()).flatten()
                })
                .unwrap_or(0);
            if read.len() >= end + 4 + length {
                let body = serde_json::from_slice(&read[end + 4..end + 4 + length]).unwrap_or(Value::Null);
                return Some((status, body));
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buffer)).await {
            Ok(Ok(n)) if n > 0 => read.extend_from_slice(&buffer[..n]),
            _ => return None,
        }
    }
}

/// What a well-behaved client saw while the hostile ones ran: how many requests it made, the slowest answer,
/// and every answer that was not the one expected.
#[derive(Debug, Default)]
struct Served {
    count: usize,
    slowest: Duration,
    wrong: Vec<String>,
}

impl Served {
    fn note(&mut self, took: Duration, wrong: Option<String>) {
        self.count += 1;
        self.slowest = self.slowest.max(took);
        self.wrong.extend(wrong);
    }

    /// Asserts the client made at least `at_least` requests, each answered as expected within `within`.
    fn assert_served(&self, what: &str, at_least: usize, within: Duration) {
        println!("{what}: {} requests, slowest {:?}", self.count, self.slowest);
        assert!(self.wrong.is_empty(), "{what}: every answer as expected: {:?}", self.wrong);
        assert!(self.count >= at_least, "{what}: at least {at_least} requests served: {self:?}");
        assert!(self.slowest < within, "{what}: each answered within {within:?}: {self:?}");
    }
}

/// A well-behaved HTTP client: publishes `good-<n>` to `topic` every 200 ms until `stop` (on a keep-alive
/// connection, opened again when popgate closes it); and a receiver told when the first publish was answered.
fn good_http_publisher(
    base: String,
    topic: String,
    mut stop: watch::Receiver<bool>,
) -> (tokio::task::JoinHandle<Served>, tokio::sync::oneshot::Receiver<()>) {
    let (first_tx, first_served) = tokio::sync::oneshot::channel();
    let mut first_tx = Some(first_tx);
    let publishing = tokio::spawn(async move {
        let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().expect("client");
        let mut served = Served::default();
        while !*stop.borrow() {
            let started = Instant::now();
            let event = json!({"topic": topic, "data": format!("good-{}", served.count)});
            let answer = client.post(format!("{base}/events/publish")).json(&event).send().await;
            let wrong = match answer {
                Ok(response) if response.status() == 200 => None,
                Ok(response) => Some(format!("{}: {}", response.status(), response.text().await.unwrap_or_default())),
                Err(error) => Some(error.to_string()),
            };
            served.note(started.elapsed(), wrong);
            if let Some(first) = first_tx.take() {
                let _ = first.send(());
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), stop.changed()).await;
        }
        served
    });
    (publishing, first_served)
}

/// The HTTP port. Meanwhile a well-behaved client publishes every 200 ms and receives what it published:
/// - 20 connections that send a request's headers a byte a second (slowloris), and 600 that never send a byte:
///   each closed once it has not completed a request head for `server.idle_timeout_secs`, those past
///   `server.max_connections` at once;
/// - a publish declaring a 1 GiB body: 413 naming the body and its limit at once, from its headers, without
///   reading the body; one streaming 4 MiB chunked, undeclared: 413 once the limit is read, no more;
/// - a body within the limit sent a byte a second: 408 after `server.body_timeout_secs`;
/// - malformed JSON and fields of the wrong type: 400 naming the field;
/// - 200 publishes at once: each stored (200).
///
/// Every refusal is counted; popgate's RSS grows by less than 64 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_port_closes_idle_and_slow_clients_refuses_bad_bodies_and_serves_a_good_client_meanwhile() {
    let cluster = shared_cluster();
    let limits = "[server]\nidle_timeout_secs = 3\nbody_timeout_secs = 3\nmax_connections = 600\n\
                  [publish]\nmax_message_bytes = 1048576\n";
    let popgate = Popgate::start(&cluster.namesrv_addr, limits).await;
    let (topic, group) = (unique_topic("hostile_http"), unique_topic("g_hostile_http"));
    crate::grpc::create_topic(cluster, &topic).await;
    let addr = host_port(&popgate.base);
    let rss_before = popgate.rss_kib();
    let (stop, stopped) = watch::channel(false);
    let (good, first_served) = good_http_publisher(popgate.base.clone(), topic.clone(), stopped);
    // Its connection is open before the floods take the others.
    first_served.await.expect("the good client's first publish");

    // Slowloris: a request's headers, a byte a second. Never completed: closed as idle.
    let mut slow = Vec::new();
    for _ in 0..20 {
        let mut stream = TcpStream::connect(&addr).await.expect("connect");
        stream.write_all(b"POST /events/publish HTTP/1.1\r\nHost: popgate\r\n").await.expect("write");
        slow.push(stream);
    }
    // Connections that never send: past `server.max_connections` (600; the good client's and the slowloris'
    // are open) closed at once, the others after the idle timeout (3 s), all of them.
    let mut idle = Vec::new();
    for _ in 0..600 {
        idle.push(TcpStream::connect(&addr).await.expect("connect"));
    }
    let trickle = async {
        let started = Instant::now();
        let mut open = slow.len();
        while open > 0 && started.elapsed() < Duration::from_secs(20) {
            open = 0;
            for stream in &mut slow {
                if stream.write_all(b"x").await.is_ok() && !closed_within(stream, Duration::from_millis(10)).await {
                    open += 1;
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        (open, started.elapsed())
    };
    let (idle_closed, (slow_open, slow_took)) = tokio::join!(closed_count(&mut idle, Duration::from_secs(20)), trickle);
    let refused = popgate.metric("popgate_http_connections_refused_total").await;
    println!(
        "idle connections closed: {idle_closed} of 600 ({refused} at once, past max_connections); slowloris: \
         {slow_open} of 20 still open after {slow_took:?}"
    );
    assert_eq!(idle_closed, 600, "every connection that never sent a byte is closed");
    assert!(refused >= 10.0, "the connections past the bound are refused: {refused}");
    assert_eq!(slow_open, 0, "every connection trickling its headers is closed");

    // A body declared larger than the limit: refused from its headers, the body never read.
    let mut huge = TcpStream::connect(&addr).await.expect("connect");
    let head = format!(
        "POST /events/publish?topic={topic} HTTP/1.1\r\nHost: popgate\r\nContent-Type: application/json\r\n\
         Content-Length: 1073741824\r\n\r\n"
    );
    huge.write_all(head.as_bytes()).await.expect("write");
    let _ = huge.write_all(&vec![b' '; 64 * 1024]).await;
    let (status, answer) = read_response(&mut huge, Duration::from_secs(10)).await.expect("answered at once");
    assert_eq!((status, answer["error"]["code"].as_str()), (413, Some("too_large")), "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert_eq!(answer["error"]["field"], "body", "{answer}");
    // The body limit is the message limit (1 MiB) as base64 in JSON, plus 64 KiB.
    assert!(message.contains("1463637"), "the limit is named: {answer}");
    assert!(closed_within(&mut huge, Duration::from_secs(10)).await, "and the rest is not read");

    // A chunked body with no declared length, past the limit: 413 once the limit is read.
    let mut chunked = TcpStream::connect(&addr).await.expect("connect");
    let head = format!(
        "POST /events/publish?topic={topic} HTTP/1.1\r\nHost: popgate\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\n\r\n"
    );
    chunked.write_all(head.as_bytes()).await.expect("write");
    let chunk = format!("{:x}\r\n{}\r\n", 64 * 1024, " ".repeat(64 * 1024));
    let mut written = 0usize;
    for _ in 0..64 {
        if chunked.write_all(chunk.as_bytes()).await.is_err() {
            break;
        }
        written += 64 * 1024;
    }
    let (status, answer) = read_response(&mut chunked, Duration::from_secs(10)).await.expect("answered");
    println!("chunked body: refused after {written} bytes written of 4 MiB");
    assert_eq!(
        (status, answer["error"]["code"].as_str(), answer["error"]["field"].as_str()),
        (413, Some("too_large"), Some("body")),
        "{answer}"
    );

    // A body within the limit, sent a byte a second: answered 408 once the body timeout (3 s) is over.
    let mut dribble = TcpStream::connect(&addr).await.expect("connect");
    let head = format!(
        "POST /events/publish?topic={topic} HTTP/1.1\r\nHost: popgate\r\nContent-Type: application/json\r\n\
         Content-Length: 1000\r\n\r\n{{\"data\": \""
    );
    dribble.write_all(head.as_bytes()).await.expect("write");
    let started = Instant::now();
    let mut answered = None;
    while answered.is_none() && started.elapsed() < Duration::from_secs(20) {
        if dribble.write_all(b"x").await.is_err() {
            break;
        }
        answered = read_response(&mut dribble, Duration::from_secs(1)).await;
    }
    let (status, answer) = answered.expect("a slow body is answered, not waited for forever");
    println!("a body sent a byte a second: {status} after {:?}", started.elapsed());
    assert_eq!(
        (status, answer["error"]["code"].as_str(), answer["error"]["field"].as_str()),
        (408, Some("body_timeout"), Some("body")),
        "{answer}"
    );

    // Malformed JSON, wrong types: 400 naming what is wrong.
    let client = reqwest::Client::new();
    let publish = |body: String| {
        let client = client.clone();
        let url = format!("{}/events/publish", popgate.base);
        async move {
            let response = client.post(url).header("content-type", "application/json").body(body).send().await;
            crate::harness::popgate::status_and_json(response.expect("request")).await
        }
    };
    let (status, answer) = publish(format!("{{\"topic\": \"{topic}\", \"data\": ")).await;
    assert_eq!((status, answer["error"]["code"].as_str()), (400, Some("malformed_body")), "{answer}");
    assert!(answer["error"]["message"].as_str().is_some_and(|m| m.contains("line 1")), "where: {answer}");
    for (body, field) in [
        (json!({"topic": 5, "data": "x"}), "topic"),
        (json!({"topic": topic, "data": "x", "tags": 7}), "tags"),
        (json!({"topic": topic, "data": "x", "delayMs": "soon"}), "delayMs"),
        (json!({"topic": topic, "data": "x", "properties": {"a": {"b": 1}}}), "properties.a"),
    ] {
        let (status, answer) = publish(body.to_string()).await;
        assert_eq!((status, answer["error"]["field"].as_str()), (400, Some(field)), "{body}: {answer}");
    }

    // Many requests at once: every one stored.
    let many = join_all((0..200).map(|n| publish(json!({"topic": topic, "data": format!("many-{n}")}).to_string())));
    let statuses: Vec<u16> = many.await.into_iter().map(|(status, _)| status).collect();
    assert!(statuses.iter().all(|s| *s == 200), "200 publishes at once, each stored: {statuses:?}");

    let _ = stop.send(true);
    let served = good.await.expect("the good client");
    served.assert_served("the well-behaved HTTP client", 20, Duration::from_secs(10));
    let rss_after = popgate.rss_kib();
    println!("popgate RSS {rss_before} KiB before the hostile clients, {rss_after} KiB after");
    assert!(rss_after < rss_before + RSS_BOUND_KIB, "RSS grew by less than 64 MiB: {rss_before} -> {rss_after} KiB");

    // The good client receives everything it published, and the 200.
    let received = popgate.poll_until(&group, &topic, served.count + 200, Duration::from_secs(60)).await;
    let mut bodies: Vec<String> = received.iter().map(crate::harness::popgate::data).collect();
    bodies.sort();
    bodies.dedup();
    assert_eq!(bodies.len(), served.count + 200, "every publish received once");

    for (series, at_least) in [
        ("popgate_http_connections_closed_total{reason=\"idle\"}", 500.0),
        ("popgate_requests_rejected_total{reason=\"body_too_large\"}", 2.0),
        ("popgate_requests_rejected_total{reason=\"body_timeout\"}", 1.0),
    ] {
        let counted = popgate.metric(series).await;
        assert!(counted >= at_least, "{series}: {counted}, at least {at_least}");
    }
}
