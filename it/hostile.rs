//! Hostile clients on the HTTP, gRPC and peer-link ports (issue #46; the remoting port's are in
//! `remoting_hostile.rs`): floods of connections, slow clients, bad frames and bodies, replays. Each test runs a
//! well-behaved client of the same port meanwhile and asserts it is served in time, that every hostile
//! connection is closed or answered with a clear refusal (counted), and that popgate's memory stays bounded
//! (its RSS printed before and after).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::future::join_all;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use popgate::grpc::proto::{self as pb, messaging_service_client::MessagingServiceClient, Code};
use popgate::tier::proto::{self as peer, peer_client::PeerClient};
use tonic::transport::Channel;

use crate::grpc_raw::{request, resource};
use crate::harness::popgate::Popgate;
use crate::harness::{free_port, unique_topic};
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
/// - 20 connections that send a request's headers a byte a second (slowloris), and 700 that never send a byte:
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
    let began = Instant::now();
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
    // are open: about 120 of them) closed at once, the others after the idle timeout (3 s), all of them.
    // Made together, as a flood comes: made one after another on a loaded machine (CI) they took longer than the
    // idle timeout, the first were closed as idle before the last came, and only 4 went past the bound. Made
    // together, they wait in the port's accept queue: with tokio's backlog of 128 the kernel dropped the
    // handshakes past it, and those connections were never served nor closed (`listen`).
    let connecting = Instant::now();
    let connects = (0..700).map(|_| TcpStream::connect(&addr));
    let mut idle: Vec<TcpStream> = join_all(connects).await.into_iter().map(|made| made.expect("connect")).collect();
    let connect_took = connecting.elapsed();
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
        "idle connections closed: {idle_closed} of 700, made in {connect_took:?} ({refused} at once, past \
         max_connections); slowloris: {slow_open} of 20 still open after {slow_took:?}"
    );
    assert_eq!(idle_closed, 700, "every connection that never sent a byte is closed");
    assert!(refused >= 50.0, "the connections past the bound are refused: {refused} (made in {connect_took:?})");
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
    println!("the test took {:?} after popgate started", began.elapsed());
}

/// The HTTP/2 connection preface a client sends first.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// HTTP/2 frame types and the error code the tests look for.
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const REFUSED_STREAM: u32 = 0x7;
/// `SETTINGS_MAX_CONCURRENT_STREAMS`.
const MAX_CONCURRENT_STREAMS: u16 = 0x3;

/// One HTTP/2 frame.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let length = u32::try_from(payload.len()).expect("a small frame").to_be_bytes();
    let mut frame = length[1..].to_vec();
    frame.extend_from_slice(&[kind, flags]);
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// The HEADERS frame (END_HEADERS, the stream left open) of a gRPC call of `path` on stream `stream`, its
/// header block in HPACK without indexing or Huffman coding.
fn call_headers(stream: u32, path: &str) -> Vec<u8> {
    let literal = |out: &mut Vec<u8>, text: &str| {
        out.push(u8::try_from(text.len()).expect("under 127 bytes"));
        out.extend_from_slice(text.as_bytes());
    };
    // :method POST and :scheme http from the static table; :path (4), :authority (1) and content-type (31)
    // with their names from it; te as a new name.
    let mut block = vec![0x83, 0x86, 0x04];
    literal(&mut block, path);
    block.push(0x01);
    literal(&mut block, "popgate");
    block.extend_from_slice(&[0x0f, 0x10]);
    literal(&mut block, "application/grpc");
    block.push(0x00);
    literal(&mut block, "te");
    literal(&mut block, "trailers");
    frame(HEADERS, 0x4, stream, &block)
}

/// One HTTP/2 frame received: type, flags, stream, payload.
type Frame = (u8, u8, u32, Vec<u8>);

/// The frames `stream` receives until `done` holds for them, it is closed, or `within` passes.
async fn frames_until(stream: &mut TcpStream, within: Duration, done: impl Fn(&[Frame]) -> bool) -> Vec<Frame> {
    let deadline = Instant::now() + within;
    let mut read = Vec::new();
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let frames = parse_frames(&read);
        let left = deadline.saturating_duration_since(Instant::now());
        if done(&frames) || left.is_zero() {
            return frames;
        }
        match tokio::time::timeout(left, stream.read(&mut buffer)).await {
            Ok(Ok(n)) if n > 0 => read.extend_from_slice(&buffer[..n]),
            _ => return parse_frames(&read),
        }
    }
}

/// The whole frames in `read`.
fn parse_frames(read: &[u8]) -> Vec<Frame> {
    let mut frames = Vec::new();
    let mut at = 0;
    while read.len() >= at + 9 {
        let length = usize::from(read[at]) << 16 | usize::from(read[at + 1]) << 8 | usize::from(read[at + 2]);
        if read.len() < at + 9 + length {
            break;
        }
        let stream_id = u32::from_be_bytes([read[at + 5], read[at + 6], read[at + 7], read[at + 8]]) & 0x7fff_ffff;
        frames.push((read[at + 3], read[at + 4], stream_id, read[at + 9..at + 9 + length].to_vec()));
        at += 9 + length;
    }
    frames
}

/// How many streams `frames` refuse (`RST_STREAM` with `REFUSED_STREAM`).
fn refused_streams(frames: &[Frame]) -> usize {
    frames
        .iter()
        .filter(|(kind, _, _, payload)| {
            *kind == RST_STREAM && payload.get(..4) == Some(&REFUSED_STREAM.to_be_bytes()[..])
        })
        .count()
}

/// The `SETTINGS_MAX_CONCURRENT_STREAMS` the server of `stream` (a new connection) advertises in its SETTINGS,
/// once the client's preface and an empty SETTINGS are sent.
async fn advertised_max_streams(stream: &mut TcpStream) -> Option<u32> {
    stream.write_all(PREFACE).await.expect("write");
    stream.write_all(&frame(SETTINGS, 0, 0, &[])).await.expect("write");
    let server_settings =
        |frames: &[Frame]| frames.iter().any(|(kind, flags, _, _)| *kind == SETTINGS && flags & 1 == 0);
    let settings = frames_until(stream, Duration::from_secs(10), server_settings).await;
    settings
        .iter()
        .filter(|(kind, flags, _, _)| *kind == SETTINGS && flags & 1 == 0)
        .flat_map(|(_, _, _, payload)| {
            payload
                .chunks(6)
                .map(|s| (u16::from_be_bytes([s[0], s[1]]), u32::from_be_bytes([s[2], s[3], s[4], s[5]])))
                .collect::<Vec<_>>()
        })
        .find_map(|(id, value)| (id == MAX_CONCURRENT_STREAMS).then_some(value))
}

/// How long after a call of `path` to `addr` announced a 1 MiB message and sent 1 000 bytes of it the server
/// ended the call (answered or reset it); `None` when it did not within 20 s.
async fn stalled_call_ended_after(addr: &str, path: &str) -> Option<Duration> {
    let mut stalled = TcpStream::connect(addr).await.expect("connect");
    let mut opening = PREFACE.to_vec();
    opening.extend(frame(SETTINGS, 0, 0, &[]));
    opening.extend(call_headers(1, path));
    let mut part = vec![0u8, 0x00, 0x10, 0x00, 0x00];
    part.extend_from_slice(&[b'x'; 1000]);
    opening.extend(frame(DATA, 0, 1, &part));
    stalled.write_all(&opening).await.expect("write");
    let started = Instant::now();
    let call_ended = |frames: &[Frame]| {
        frames.iter().any(|(kind, _, stream, _)| *stream == 1 && [HEADERS, RST_STREAM].contains(kind))
    };
    let answered = frames_until(&mut stalled, Duration::from_secs(20), call_ended).await;
    call_ended(&answered).then(|| started.elapsed())
}

/// A well-behaved gRPC client: sends `good-<n>` to `topic` every 200 ms until `stop`, each answered OK.
fn good_grpc_sender(
    popgate: &Popgate,
    topic: String,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Served> {
    let endpoint = format!("http://{}", popgate.grpc);
    tokio::spawn(async move {
        let mut client = MessagingServiceClient::connect(endpoint).await.expect("a gRPC connection");
        let mut served = Served::default();
        while !*stop.borrow() {
            let started = Instant::now();
            let message = pb::Message {
                topic: resource(&topic),
                user_properties: Default::default(),
                system_properties: Some(pb::SystemProperties {
                    message_id: format!("01{:030X}", rand::random::<u64>()),
                    ..Default::default()
                }),
                body: format!("good-{}", served.count).into_bytes().into(),
            };
            let send = tokio::time::timeout(
                Duration::from_secs(30),
                client.send_message(request(pb::SendMessageRequest { messages: vec![message] }, None)),
            )
            .await;
            let wrong = match send {
                Ok(Ok(answer)) => {
                    let code = answer.get_ref().status.as_ref().map_or(0, |s| s.code);
                    (code != Code::Ok as i32).then(|| format!("{:?}", answer.get_ref()))
                }
                Ok(Err(status)) => Some(format!("{status:?}")),
                Err(_) => Some("no answer in 30 s".to_owned()),
            };
            served.note(started.elapsed(), wrong);
            let _ = tokio::time::timeout(Duration::from_millis(200), stop.changed()).await;
        }
        served
    })
}

/// The gRPC port. Meanwhile a well-behaved gRPC client sends a message every 200 ms, each answered OK:
/// - 300 TCP connections that send nothing, and 50 that send part of the HTTP/2 preface: closed within the 10 s
///   a client has to open its connection;
/// - the preface, then garbage: closed;
/// - 300 streams opened at once on one connection: at most `grpc.max_concurrent_streams` (100 here, advertised
///   in the server's SETTINGS) taken, the others refused (`REFUSED_STREAM`);
/// - a call whose request message never finishes: ended after `grpc.call_timeout_secs`;
/// - a message over the 16 MiB gRPC limit: `RESOURCE_EXHAUSTED` (grpc-go's and gRPC C core's code; Apache's
///   proxy resets such a stream without a status), without reading it in; one within it but over the broker's
///   body limit: `MESSAGE_BODY_TOO_LARGE` in the answer's status;
/// - 1 000 made-up client ids: `grpc.max_clients` (300) tracked, the others refused `TOO_MANY_REQUESTS`.
///
/// popgate's RSS grows by less than 64 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_port_closes_half_open_connections_bounds_streams_messages_and_clients_and_serves_a_good_client() {
    let cluster = shared_cluster();
    let config =
        "[grpc]\nlisten = \"127.0.0.1:0\"\nmax_clients = 300\nmax_concurrent_streams = 100\ncall_timeout_secs = 3\n\
         max_connections = 400\n";
    let popgate = Popgate::start(&cluster.namesrv_addr, config).await;
    let began = Instant::now();
    let (topic, group) = (unique_topic("hostile_grpc"), unique_topic("g_hostile_grpc"));
    crate::grpc::create_topic(cluster, &topic).await;
    let rss_before = popgate.rss_kib();
    let (stop, stopped) = watch::channel(false);
    let good = good_grpc_sender(&popgate, topic.clone(), stopped);

    // Connections that send nothing, or a part of the preface: closed, all of them.
    let mut half_open = Vec::new();
    for n in 0..350 {
        let mut stream = TcpStream::connect(&popgate.grpc).await.expect("connect");
        if n >= 300 {
            stream.write_all(&PREFACE[..16]).await.expect("write");
        }
        half_open.push(stream);
    }
    // Past grpc.max_connections (400; the good client's and these 350 are open), a new connection is closed at
    // once, before anything is read from it.
    let mut past_bound = Vec::new();
    for _ in 0..60 {
        past_bound.push(TcpStream::connect(&popgate.grpc).await.expect("connect"));
    }
    let closed_at_once = closed_count(&mut past_bound, Duration::from_secs(2)).await;
    println!("60 connections past the 351 open, with grpc.max_connections 400: {closed_at_once} closed at once");
    assert!((5..=20).contains(&closed_at_once), "about 11 closed at once: {closed_at_once}");
    assert!(popgate.metric("popgate_grpc_connections_refused_total").await >= 5.0);
    drop(past_bound);
    // The preface, then garbage: a protocol error, the connection closed. (Until popgate has seen the closes
    // above, the bound may still be reached and a new connection closed at once: tried again then.)
    let mut garbage = connected_past_the_bound(&popgate.grpc, &[PREFACE, &[0xff; 64]]).await;
    assert!(
        closed_within(&mut garbage, Duration::from_secs(10)).await,
        "garbage after the preface closes the connection"
    );
    let started = Instant::now();
    let closed = closed_count(&mut half_open[..300], Duration::from_secs(25)).await;
    let half_closed = closed_count(&mut half_open[300..], Duration::from_secs(25)).await;
    println!(
        "connections that sent nothing: {closed} of 300 closed; part of the preface: {half_closed} of 50, in {:?}",
        started.elapsed()
    );
    assert_eq!((closed, half_closed), (300, 50), "every half-open connection is closed");

    // A flood of streams on one connection: the server's bound is advertised, and past it streams are refused.
    let mut flood = TcpStream::connect(&popgate.grpc).await.expect("connect");
    let advertised = advertised_max_streams(&mut flood).await;
    assert_eq!(advertised, Some(100), "the server's SETTINGS bound the streams");
    let mut streams = frame(SETTINGS, 1, 0, &[]);
    for n in 0..300u32 {
        streams.extend(call_headers(2 * n + 1, "/apache.rocketmq.v2.MessagingService/Telemetry"));
    }
    flood.write_all(&streams).await.expect("write");
    let answered = frames_until(&mut flood, Duration::from_secs(10), |f| refused_streams(f) >= 200).await;
    let refused = refused_streams(&answered);
    println!("300 streams opened at once on one connection: {refused} refused");
    assert!(refused >= 200, "the streams past the bound are refused: {refused}");
    drop(flood);

    // A call whose message is announced (1 MiB) and never finished: ended after grpc.call_timeout_secs (3 s).
    let ended = stalled_call_ended_after(&popgate.grpc, "/apache.rocketmq.v2.MessagingService/SendMessage").await;
    println!("a message announced and never finished: call ended after {ended:?}");
    assert!(ended.is_some_and(|after| after < Duration::from_secs(10)), "the stalled call is ended: {ended:?}");

    // A message over gRPC's limit: refused from its length prefix, with gRPC's usual code.
    let mut client = MessagingServiceClient::connect(format!("http://{}", popgate.grpc)).await.expect("connect");
    let message = |body: Vec<u8>| pb::Message {
        topic: resource(&topic),
        user_properties: Default::default(),
        system_properties: Some(pb::SystemProperties { message_id: "01AB".into(), ..Default::default() }),
        body: body.into(),
    };
    let huge = pb::SendMessageRequest { messages: vec![message(vec![b'x'; 17 * 1024 * 1024])] };
    let refused = client.send_message(request(huge, None)).await.expect_err("over the limit");
    println!("a 17 MiB message: {:?} {}", refused.code(), refused.message());
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
    let large = pb::SendMessageRequest { messages: vec![message(vec![b'x'; 5 * 1024 * 1024])] };
    let answer = client.send_message(request(large, None)).await.expect("answered").into_inner();
    assert_eq!(answer.status.as_ref().map(|s| s.code), Some(Code::MessageBodyTooLarge as i32), "{answer:?}");

    // Made-up client ids: tracked up to grpc.max_clients, the rest refused.
    let mut taken = 0;
    let mut too_many = 0;
    for n in 0..1000 {
        let mut heartbeat =
            request(pb::HeartbeatRequest { group: None, client_type: pb::ClientType::Producer as i32 }, None);
        heartbeat.metadata_mut().insert("x-mq-client-id", format!("made-up@{n}").parse().expect("ascii"));
        let code = client.heartbeat(heartbeat).await.expect("answered").into_inner().status.map_or(0, |s| s.code);
        match code {
            c if c == Code::Ok as i32 => taken += 1,
            c if c == Code::TooManyRequests as i32 => too_many += 1,
            other => panic!("a heartbeat answered {other}"),
        }
    }
    let mut tracked = 0.0;
    for kind in ["producer", "push_consumer", "simple_consumer", "other"] {
        tracked += popgate.metric(&format!("popgate_grpc_clients{{kind=\"{kind}\"}}")).await;
    }
    println!("1000 made-up client ids: {taken} taken, {too_many} refused; {tracked} clients tracked");
    assert!(taken <= 299 && too_many >= 701, "{taken} taken, {too_many} refused");
    assert!(tracked <= 300.0, "{tracked} tracked");

    let _ = stop.send(true);
    let served = good.await.expect("the good client");
    served.assert_served("the well-behaved gRPC client", 20, Duration::from_secs(10));
    let rss_after = popgate.rss_kib();
    println!("popgate RSS {rss_before} KiB before the hostile clients, {rss_after} KiB after");
    assert!(rss_after < rss_before + RSS_BOUND_KIB, "RSS grew by less than 64 MiB: {rss_before} -> {rss_after} KiB");
    let received = popgate.poll_until(&group, &topic, served.count, Duration::from_secs(60)).await;
    assert_eq!(received.len(), served.count, "every message sent is stored once");

    for (series, at_least) in [
        ("popgate_tls_handshake_failures_total", 350.0),
        ("popgate_requests_rejected_total{reason=\"too_many_clients\"}", 701.0),
        ("popgate_requests_rejected_total{reason=\"body_too_large\"}", 1.0),
    ] {
        let counted = popgate.metric(series).await;
        assert!(counted >= at_least, "{series}: {counted}, at least {at_least}");
    }
    println!("the test took {:?} after popgate started", began.elapsed());
}

/// A signed peer request as the tier signs one, carrying `signature` (see `tier::peer_signature`).
fn signed_settle(delivery_id: &str) -> peer::SettleRequest {
    peer::SettleRequest {
        caller: crate::tier::APP.0.into(),
        source_ip: "127.0.0.1".into(),
        delivery_id: delivery_id.into(),
        hand_out: None,
        group: None,
        action: Some(peer::settle_request::Action::Ack(peer::Ack {})),
    }
}

/// What the peer link answered a flood of requests: how many with each gRPC code.
async fn flood_peer(
    client: &PeerClient<Channel>,
    requests: Vec<tonic::Request<peer::SettleRequest>>,
) -> BTreeMap<String, usize> {
    let answers = futures::stream::iter(requests)
        .map(|request| {
            let mut client = client.clone();
            async move {
                match client.settle(request).await {
                    Ok(_) => "OK".to_owned(),
                    Err(status) => format!("{:?}", status.code()),
                }
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<String>>()
        .await;
    let mut counted = BTreeMap::new();
    for code in answers {
        *counted.entry(code).or_insert(0) += 1;
    }
    counted
}

/// The peer link (`tier.listen`) of one instance of a two-instance tier. Meanwhile the other instance settles
/// 20 of this one's deliveries over it (an app's ACKs that reached the wrong instance), each in time:
/// - 100 connections that send nothing and 20 that send part of the HTTP/2 preface: closed within 10 s;
///   garbage instead of the preface, or after it: closed;
/// - unsigned requests (one naming no action either), requests signed with another secret, and 10 000 signed
///   for made-up instances with made-up nonces: each `UNAUTHENTICATED` and counted, none remembered (nonces
///   are taken only from requests the tier's secret signed for this instance);
/// - a signed request sent again: taken once, refused as a replay the second time;
/// - 2 000 signed requests with fresh nonces: each taken (the nonce cache holds them, bounded at 500 000);
/// - at most 1 000 calls open on a connection (advertised), and a call whose request never finishes ended after
///   `tier.forward_timeout_ms`.
///
/// The instance's RSS grows by less than 64 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_link_refuses_garbage_unsigned_forged_and_replayed_requests_while_a_peer_settles_in_time() {
    use crate::tier::{assert_acked_at, hand_out, id_of, peer_signature, peer_toml, with_signature, APP};
    let cluster = shared_cluster();
    let (port_a, port_b) = (free_port(), free_port());
    let (toml_a, toml_b) = (peer_toml(0, port_a, &[port_b], "", ""), peer_toml(1, port_b, &[port_a], "", ""));
    let (a, b) =
        tokio::join!(Popgate::start(&cluster.namesrv_addr, &toml_a), Popgate::start(&cluster.namesrv_addr, &toml_b));
    // The other instance asks this one over the peer link only once it knows it: on a loaded machine its first
    // look-up can come after the first ACKs below, which it then makes at the broker itself (as designed, but
    // not what this test is about; a clean-clone run under load saw 9 of 20 so).
    crate::harness::eventually(Duration::from_secs(20), "the other instance knows this one", || async {
        b.metric("popgate_tier_peers").await == 1.0
    })
    .await;
    let began = Instant::now();
    let (topic, group) = (unique_topic("tier_hostile"), unique_topic("tier_g_hostile"));
    crate::grpc::create_topic(cluster, &topic).await;
    let http = reqwest::Client::new();
    for n in 0..20 {
        let event = json!({"topic": topic, "data": format!("settled-{n}")});
        let sent = http.post(format!("{}/events/publish", a.base)).bearer_auth(APP.1).json(&event).send().await;
        assert_eq!(sent.expect("publish").status(), 200);
    }
    let held = hand_out(&a, &group, &topic, 20).await;
    let peer_addr = format!("127.0.0.1:{port_a}");
    let rss_before = a.rss_kib();

    // Connections that never open as HTTP/2, or open with garbage: closed.
    let mut half_open = Vec::new();
    for n in 0..120 {
        let mut stream = TcpStream::connect(&peer_addr).await.expect("connect");
        if n >= 100 {
            stream.write_all(&PREFACE[..16]).await.expect("write");
        }
        half_open.push(stream);
    }
    for garbage in [vec![0x16, 0x03, 0x01, 0x00, 0xff, 0xff], [PREFACE, &[0xff; 64]].concat()] {
        let mut stream = TcpStream::connect(&peer_addr).await.expect("connect");
        stream.write_all(&garbage).await.expect("write");
        assert!(closed_within(&mut stream, Duration::from_secs(10)).await, "garbage closes the connection");
    }

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{peer_addr}"))
        .expect("an address")
        .connect()
        .await
        .expect("the peer port");
    let client = PeerClient::new(channel);

    // The hostile requests run while the other instance settles this one's deliveries over the same port.
    let hostile = {
        let client = client.clone();
        tokio::spawn(async move {
            let mut requests = Vec::new();
            // Unsigned, one naming no action at all.
            requests.push(tonic::Request::new(peer::SettleRequest { action: None, ..signed_settle("it-tier-0~00") }));
            requests.push(tonic::Request::new(signed_settle("it-tier-0~00")));
            // Signed with another secret: the tier's signature of another request.
            let forged = peer_signature("settle", "it-tier-0", &signed_settle("it-tier-0~01"));
            requests.push(with_signature(signed_settle("it-tier-0~02"), &forged));
            // Signed for made-up instances, each with a nonce of its own.
            for n in 0..10_000 {
                let request = signed_settle(&format!("it-tier-0~{n:04x}"));
                let signature = peer_signature("settle", &format!("made-up-{n}"), &request);
                requests.push(with_signature(request, &signature));
            }
            let refused = flood_peer(&client, requests).await;
            // Signed for this instance with fresh nonces: each taken (none is this instance's delivery).
            let taken = (0..2_000)
                .map(|n| {
                    let request = signed_settle(&format!("it-tier-0~f{n:04x}"));
                    let signature = peer_signature("settle", "it-tier-0", &request);
                    with_signature(request, &signature)
                })
                .collect();
            let taken = flood_peer(&client, taken).await;
            (refused, taken)
        })
    };
    let mut slowest = Duration::ZERO;
    for delivery in &held {
        let started = Instant::now();
        assert_acked_at(&b, &id_of(delivery)).await;
        slowest = slowest.max(started.elapsed());
    }
    let (refused, taken) = hostile.await.expect("the hostile client");
    println!("the other instance's 20 ACKs over the peer link: slowest {slowest:?}");
    println!("unsigned, forged and made-up requests: {refused:?}; signed with fresh nonces: {taken:?}");
    assert_eq!(refused.get("Unauthenticated"), Some(&10_003), "every one refused as unauthenticated: {refused:?}");
    assert_eq!(taken.get("OK"), Some(&2_000), "{taken:?}");
    assert!(slowest < Duration::from_secs(10), "each settled in time: {slowest:?}");

    // A connection's calls are bounded, and a call whose request never finishes is ended after the deadline the
    // instances give their calls (tier.forward_timeout_ms, 3 s).
    let mut streams = TcpStream::connect(&peer_addr).await.expect("connect");
    assert_eq!(advertised_max_streams(&mut streams).await, Some(1000), "the peer link's SETTINGS bound the streams");
    let ended = stalled_call_ended_after(&peer_addr, "/popgate.peer.v1.Peer/Settle").await;
    println!("a peer request announced and never finished: call ended after {ended:?}");
    assert!(ended.is_some_and(|after| after < Duration::from_secs(10)), "the stalled call is ended: {ended:?}");

    // A signed request sent twice: taken once.
    let request = signed_settle("it-tier-0~ff");
    let signature = peer_signature("settle", "it-tier-0", &request);
    let mut again = client.clone();
    again.settle(with_signature(request.clone(), &signature)).await.expect("taken once");
    let replayed = again.settle(with_signature(request, &signature)).await.expect_err("not twice");
    assert_eq!(replayed.code(), tonic::Code::Unauthenticated, "{replayed:?}");
    assert!(replayed.message().contains("replayed"), "{replayed:?}");

    let closed = closed_count(&mut half_open, Duration::from_secs(25)).await;
    println!("peer-link connections that never sent the HTTP/2 preface: {closed} of 120 closed");
    assert_eq!(closed, 120, "every half-open connection is closed");
    let rss_after = a.rss_kib();
    println!("popgate RSS {rss_before} KiB before the hostile peer clients, {rss_after} KiB after");
    assert!(rss_after < rss_before + RSS_BOUND_KIB, "RSS grew by less than 64 MiB: {rss_before} -> {rss_after} KiB");

    let served = |action: &str, result: &str| {
        format!("popgate_tier_settlements_served_total{{action=\"{action}\",result=\"{result}\"}}")
    };
    for (series, at_least) in [
        (served("ack", "unauthenticated"), 10_002.0),
        (served("unknown", "unauthenticated"), 1.0),
        (served("ack", "replayed"), 1.0),
        (served("ack", "ok"), 20.0),
        ("popgate_tier_settlements_forwarded_total{action=\"ack\",result=\"ok\"}".to_owned(), 20.0),
    ] {
        let instance = if series.contains("forwarded") { &b } else { &a };
        let counted = instance.metric(&series).await;
        assert!(counted >= at_least, "{series}: {counted}, at least {at_least}");
    }
    let logged = a.output().matches("A peer request was refused").count();
    assert!(logged < 100, "the refusals are counted, not each logged at warn: {logged} lines");
    println!("the test took {:?} after popgate started", began.elapsed());
}

/// A connection to `addr` that took every one of `writes`: a connection closed at once (a bound on open
/// connections still reached while the server notices closes made just before) is opened again, for 20 s.
async fn connected_past_the_bound(addr: &str, writes: &[&[u8]]) -> TcpStream {
    let started = Instant::now();
    loop {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let mut took_all = true;
        for bytes in writes {
            took_all = took_all && stream.write_all(bytes).await.is_ok();
        }
        if took_all {
            return stream;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "no connection to {addr} took the writes in 20 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
