//! The popgate binary under test, run as a child process with a generated config file, killed on drop.
//! Running the real binary keeps each instance's metrics apart and lets tests `kill -9` it.

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;

use super::free_port;

/// A running popgate; `base` is its `http://127.0.0.1:port`.
pub struct Popgate {
    /// Base URL of the HTTP API.
    pub base: String,
    /// `127.0.0.1:port` of the gRPC front (the endpoint an SDK client is given); empty when it is off.
    pub grpc: String,
    /// The config file it was started with.
    pub config_path: PathBuf,
    /// Its RocksDB state directory.
    pub state_dir: PathBuf,
    child: Child,
    log: PathBuf,
    /// Variables added to the inherited environment, at every (re)start.
    env: Vec<(String, String)>,
    _dir: TempDir,
}

impl Popgate {
    /// Starts popgate against `namesrv_addr` with `extra_toml` appended to a minimal config, and waits for
    /// `/healthz`.
    pub async fn start(namesrv_addr: &str, extra_toml: &str) -> Popgate {
        Popgate::start_with_env(namesrv_addr, extra_toml, &[]).await
    }

    /// [`Popgate::start`] with `env` added to the environment popgate inherits.
    pub async fn start_with_env(namesrv_addr: &str, extra_toml: &str, env: &[(&str, &str)]) -> Popgate {
        let dir = tempfile::Builder::new().prefix("popgate-it-").tempdir().expect("tempdir");
        let config_path = dir.path().join("popgate.toml");
        let state_dir = dir.path().join("state");
        // A test may put the state elsewhere (a small tmpfs) by naming `state_dir` itself.
        let state_dir = match extra_toml.lines().find_map(|l| l.trim().strip_prefix("state_dir = ")) {
            Some(quoted) => PathBuf::from(quoted.trim_matches('"')),
            None => state_dir,
        };
        let state_line = if extra_toml.contains("state_dir") {
            String::new()
        } else {
            format!("state_dir = \"{}\"\n", state_dir.display())
        };
        let config = format!(
            // Port 0: popgate binds a free port itself and logs it, so concurrent tests never share one.
            "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace_secs = 2\n\n[broker]\nnamesrv_addr = \"{namesrv_addr}\"\n\n\
             [delivery]\n{state_line}{extra_toml}\n"
        );
        let config =
            if config.contains("[grpc]") { config } else { format!("{config}\n[grpc]\nlisten = \"127.0.0.1:0\"\n") };
        fs::write(&config_path, merge_sections(&with_webhook_default(&with_auth_default(&config))))
            .expect("write config");
        let log = dir.path().join("popgate.log");
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        let child = spawn(&config_path, &log, &env);
        let mut popgate =
            Popgate { base: String::new(), grpc: String::new(), config_path, state_dir, child, log, env, _dir: dir };
        popgate.wait_healthy(0).await;
        popgate
    }

    /// Starts popgate with its state directory on `disk` (a small tmpfs a test fills), `delivery_toml` added
    /// to its `[delivery]` section.
    pub async fn start_on_disk(namesrv_addr: &str, disk: &super::Tmpfs, delivery_toml: &str) -> Popgate {
        let state_dir = disk.path.join("state");
        let config = format!("[delivery]\nstate_dir = \"{}\"\n{delivery_toml}", state_dir.display());
        Popgate::start(namesrv_addr, &config).await
    }

    /// Waits until `/readyz` answers 200 (the store and the broker are healthy again), at most `timeout`.
    pub async fn wait_ready(&self, timeout: Duration) {
        super::eventually(timeout, "popgate is ready again", || async { self.get_json("/readyz").await.0 == 200 })
            .await;
    }

    /// Runs popgate with a config it must refuse: returns its exit code and what it printed.
    pub async fn expect_exit(namesrv_addr: &str, extra_toml: &str) -> (Option<i32>, String) {
        Popgate::expect_exit_with_env(namesrv_addr, extra_toml, &[]).await
    }

    /// [`Popgate::expect_exit`] with `env` added to the environment popgate inherits.
    pub async fn expect_exit_with_env(
        namesrv_addr: &str,
        extra_toml: &str,
        env: &[(&str, &str)],
    ) -> (Option<i32>, String) {
        let dir = tempfile::Builder::new().prefix("popgate-it-").tempdir().expect("tempdir");
        let config_path = dir.path().join("popgate.toml");
        let config = format!(
            "[server]\nlisten = \"127.0.0.1:{}\"\n\n[grpc]\nlisten = \"127.0.0.1:0\"\n\n[broker]\n\
             namesrv_addr = \"{namesrv_addr}\"\n\n[delivery]\nstate_dir = \"{}\"\n{extra_toml}\n",
            free_port(),
            dir.path().join("state").display()
        );
        fs::write(&config_path, merge_sections(&with_webhook_default(&with_auth_default(&config))))
            .expect("write config");
        let run = Command::new(popgate_binary())
            .args(["serve", "--config"])
            .arg(&config_path)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output();
        let output = tokio::time::timeout(Duration::from_secs(60), tokio::task::spawn_blocking(move || run))
            .await
            .expect("popgate exits by itself")
            .expect("join")
            .expect("run popgate");
        let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        (output.status.code(), text)
    }

    /// Rewrites one `key = value` line of the config file (for a restart with a new setting).
    pub fn set_config_line(&self, key: &str, value: &str) {
        let text = fs::read_to_string(&self.config_path).expect("read config");
        let replaced: Vec<String> = text
            .lines()
            .map(|line| {
                if line.trim_start().starts_with(&format!("{key} =")) {
                    format!("{key} = {value}")
                } else {
                    line.to_owned()
                }
            })
            .collect();
        assert!(replaced.iter().any(|l| l == &format!("{key} = {value}")), "`{key}` is in the config");
        fs::write(&self.config_path, replaced.join("\n")).expect("write config");
    }

    /// Rewrites `key = value` in `[section]` of the config file.
    pub fn set_section_line(&self, section: &str, key: &str, value: &str) {
        let text = fs::read_to_string(&self.config_path).expect("read config");
        let mut current = String::new();
        let mut replaced = false;
        let lines: Vec<String> = text
            .lines()
            .map(|line| {
                if line.trim_start().starts_with('[') {
                    current = line.trim().trim_matches(['[', ']']).to_owned();
                } else if current == section && line.trim_start().starts_with(&format!("{key} =")) {
                    replaced = true;
                    return format!("{key} = {value}");
                }
                line.to_owned()
            })
            .collect();
        assert!(replaced, "`{key}` is in [{section}] of the config");
        fs::write(&self.config_path, lines.join("\n")).expect("write config");
    }

    /// Starts the process again with the same config and state directory (after [`Popgate::kill9`]).
    pub async fn restart(&mut self) {
        self.kill9();
        // The gRPC port stays: SDK clients reconnect to the endpoint they were given.
        if !self.grpc.is_empty() {
            self.set_section_line("grpc", "listen", &format!("\"{}\"", self.grpc));
        }
        let logged = fs::metadata(&self.log).map(|m| m.len() as usize).unwrap_or(0);
        self.child = spawn(&self.config_path, &self.log, &self.env);
        self.wait_healthy(logged).await;
    }

    /// Waits at most `timeout` for the process to exit by itself; its exit code, or `None` if it is still
    /// running (or was killed by a signal).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// The OS process id (for `/proc/<pid>` readings).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process's resident memory in KiB (`VmRSS`).
    pub fn rss_kib(&self) -> u64 {
        proc_status_kib(self.pid(), "VmRSS:")
    }

    /// `kill -STOP` / `kill -CONT` the process (a hung instance).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill").arg(format!("-{signal}")).arg(self.child.id().to_string()).status();
        assert!(status.is_ok_and(|s| s.success()), "kill -{signal} popgate");
    }

    /// Waits for the "listening on" line this start logged (after byte `from` of the log), then for `/healthz`.
    async fn wait_healthy(&mut self, from: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        // Only readiness is checked here; the TLS test verifies the certificate with its own client.
        let client = reqwest::Client::builder().danger_accept_invalid_certs(true).build().expect("client");
        self.base.clear();
        self.grpc.clear();
        loop {
            if self.base.is_empty() {
                let text = fs::read_to_string(&self.log).unwrap_or_default();
                if let Some(base) = text.get(from..).and_then(listening_base) {
                    self.base = base;
                }
            }
            if self.grpc.is_empty() && self.grpc_expected() {
                let text = fs::read_to_string(&self.log).unwrap_or_default();
                self.grpc = text.get(from..).and_then(grpc_endpoint).unwrap_or_default();
            }
            // The gRPC front binds after the HTTP server: both must be up.
            if !self.base.is_empty() && (!self.grpc.is_empty() || !self.grpc_expected()) {
                let healthy = client.get(format!("{}/healthz", self.base)).send().await;
                if healthy.is_ok_and(|resp| resp.status().is_success()) {
                    return;
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("popgate exited with {status} before it was healthy:\n{}", self.output());
            }
            assert!(Instant::now() < deadline, "popgate not healthy after 30 s:\n{}", self.output());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether the config switches the gRPC front on (the harness does, unless a test turns it off).
    fn grpc_expected(&self) -> bool {
        let text = fs::read_to_string(&self.config_path).unwrap_or_default();
        !text.replace(' ', "").contains("[grpc]\nlisten=\"\"")
    }

    /// What popgate logged so far (stdout and stderr).
    pub fn output(&self) -> String {
        let out = fs::read_to_string(&self.log).unwrap_or_default();
        let err = fs::read_to_string(self.log.with_extension("err")).unwrap_or_default();
        format!("{out}{err}")
    }

    /// `GET {base}{path}`; returns status and JSON answer.
    pub async fn get_json(&self, path: &str) -> (u16, Value) {
        let resp = reqwest::Client::new().get(format!("{}{path}", self.base)).send().await.expect("request");
        status_and_json(resp).await
    }

    /// Publishes each body (popgate JSON) to `topic`, asserting every answer is 200.
    pub async fn publish_bodies(&self, topic: &str, bodies: &[impl AsRef<str>]) {
        for body in bodies {
            let (status, answer) = self.publish(&serde_json::json!({"topic": topic, "data": body.as_ref()})).await;
            assert_eq!(status, 200, "{answer}");
        }
    }

    /// Long-polls `group`/`topic` once; returns the deliveries.
    pub async fn poll(&self, group: &str, topic: &str, max: usize, wait_ms: u64) -> Vec<Value> {
        let path = format!("/events/poll?group={group}&topic={topic}&max={max}&waitMs={wait_ms}");
        let (status, body) = self.get_json(&path).await;
        assert_eq!(status, 200, "poll: {body}");
        body["deliveries"].as_array().cloned().unwrap_or_default()
    }

    /// Polls until `count` deliveries arrived or `timeout` passed.
    pub async fn poll_until(&self, group: &str, topic: &str, count: usize, timeout: Duration) -> Vec<Value> {
        let deadline = Instant::now() + timeout;
        let mut got = Vec::new();
        while got.len() < count && Instant::now() < deadline {
            // A poll hands out at most 256 (`max` is 1..=256).
            got.extend(self.poll(group, topic, (count - got.len()).min(256), 1_000).await);
        }
        got
    }

    /// ACKs one delivery; returns status and answer.
    pub async fn ack(&self, delivery_id: &str) -> (u16, Value) {
        self.post_json("/events/ack", &serde_json::json!({ "deliveryId": delivery_id })).await
    }

    /// `POST {base}{path}` with a JSON body; returns status and JSON answer.
    pub async fn post_json(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp =
            reqwest::Client::new().post(format!("{}{path}", self.base)).json(body).send().await.expect("request");
        status_and_json(resp).await
    }

    /// Publishes `body` (popgate JSON) and returns status and answer.
    pub async fn publish(&self, body: &Value) -> (u16, Value) {
        self.post_json("/events/publish", body).await
    }

    /// The value of one sample in `/metrics` (`name{labels}` as rendered), or 0 when absent.
    pub async fn metric(&self, series: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.base)).await.expect("metrics").text().await.expect("text");
        metric_value(&text, series)
    }

    /// The raw `/metrics` text.
    pub async fn metrics_text(&self) -> String {
        reqwest::get(format!("{}/metrics", self.base)).await.expect("metrics").text().await.expect("text")
    }

    /// SIGKILLs the process (a crash: nothing is flushed or drained).
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Popgate {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let output = self.output();
            let lines: Vec<&str> = output.lines().collect();
            // IT_LOG_LINES shows more when a failure needs it.
            let shown: usize = super::env_or("IT_LOG_LINES", 60);
            eprintln!("--- popgate {} output (last {shown} lines) ---", self.base);
            eprintln!("{}", lines[lines.len().saturating_sub(shown)..].join("\n"));
        }
        // A stopped process must be continued before it can die.
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill").arg("-CONT").arg(self.child.id().to_string()).status();
        }
        self.kill9();
    }
}

/// The popgate binary the tests and the bench run: this build's, or `POPGATE_BIN` (the bench's before/after
/// figures of a change run one bench build against two popgate binaries).
fn popgate_binary() -> PathBuf {
    std::env::var_os("POPGATE_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_popgate")), PathBuf::from)
}

/// Spawns the binary with `env` added; output is appended to `log` (and `log.err`), so a restart keeps the
/// earlier output.
fn spawn(config_path: &std::path::Path, log: &std::path::Path, env: &[(String, String)]) -> Child {
    let append = |path: PathBuf| fs::OpenOptions::new().create(true).append(true).open(path).expect("log file");
    Command::new(popgate_binary())
        .args(["serve", "--config"])
        .arg(config_path)
        // IT_RUST_LOG replaces the filter when a run needs more (the crate's transport at debug, say).
        .env(
            "RUST_LOG",
            std::env::var("IT_RUST_LOG")
                .unwrap_or_else(|_| "info,rocketmq_client_rust=warn,rocketmq_transport=warn".to_owned()),
        )
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(append(log.to_path_buf()))
        .stderr(append(log.with_extension("err")))
        .spawn()
        .expect("spawn popgate")
}

/// The base URL in popgate's "popgate listening on http(s)://ADDR" log line.
fn listening_base(log: &str) -> Option<String> {
    let start = log.find("popgate listening on ")? + "popgate listening on ".len();
    let rest = &log[start..];
    let scheme = if rest.starts_with("https://") { "https://" } else { "http://" };
    let addr: String =
        rest.strip_prefix(scheme)?.chars().take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':').collect();
    (!addr.is_empty()).then(|| format!("{scheme}{addr}"))
}

/// The address in popgate's "popgate gRPC listening on ADDR" log line (logged before the HTTP one).
fn grpc_endpoint(log: &str) -> Option<String> {
    let start = log.find("gRPC listening on ")? + "gRPC listening on ".len();
    let addr: String = log[start..].chars().take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':').collect();
    (!addr.is_empty()).then_some(addr)
}

/// A delivery's event data, as text.
pub fn data(delivery: &Value) -> String {
    delivery["event"]["data"].as_str().unwrap_or_default().to_owned()
}

/// A delivery's id.
pub fn id(delivery: &Value) -> String {
    delivery["deliveryId"].as_str().unwrap_or_default().to_owned()
}

/// Status and JSON body (Null when the body is not JSON).
pub async fn status_and_json(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let body = resp.json::<Value>().await.unwrap_or(Value::Null);
    (status, body)
}

/// Finds `series` (e.g. `popgate_send_attempts_total{broker="broker-a"}`) in Prometheus text.
pub fn metric_value(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

/// Tests that are not about authentication run with it switched off, explicitly (as popgate demands); a test
/// that configures `[auth]` or `[[auth.tokens]]` gets exactly what it wrote.
fn with_auth_default(config: &str) -> String {
    if config.contains("[auth") {
        config.to_owned()
    } else {
        format!("{config}\n[auth]\nenabled = false\n")
    }
}

/// The tests' webhook receivers listen on 127.0.0.1, which popgate refuses by default (SSRF guard), so tests
/// allow the loopback networks; a test that configures `[webhook]` gets exactly what it wrote.
fn with_webhook_default(config: &str) -> String {
    if config.contains("[webhook]") {
        config.to_owned()
    } else {
        format!("{config}\n[webhook]\nallowed_networks = [\"127.0.0.0/8\", \"::1/128\"]\n")
    }
}

/// Later `[section]` blocks of the same name are merged into the first, so a test's extra TOML may repeat
/// `[delivery]` or `[broker]` from the minimal config.
fn merge_sections(text: &str) -> String {
    let mut order: Vec<String> = Vec::new();
    let mut sections: std::collections::HashMap<String, Vec<String>> = std::collections::HashMap::new();
    let mut current = String::new();
    order.push(current.clone());
    for (number, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if trimmed.starts_with('[') && trimmed.ends_with(']') {
            // Each `[[array]]` entry is its own table: never merged (the suffix is cut off below).
            current = if trimmed.starts_with("[[") { format!("{trimmed}\u{0}{number}") } else { trimmed.to_owned() };
            if !order.contains(&current) {
                order.push(current.clone());
            }
            continue;
        }
        sections.entry(current.clone()).or_default().push(line.to_owned());
    }
    order
        .iter()
        .map(|name| {
            let body = sections.get(name).map(|l| l.join("\n")).unwrap_or_default();
            let header = name.split('\u{0}').next().unwrap_or_default();
            if name.is_empty() {
                body
            } else {
                format!("{header}\n{body}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:`), 0 when unreadable.
pub fn proc_status_kib(pid: u32, field: &str) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// `POST /events/subscribe` with `body`, which must be taken (200).
pub async fn subscribe(popgate: &Popgate, body: Value) {
    let (status, answer) = popgate.post_json("/events/subscribe", &body).await;
    assert_eq!(status, 200, "{answer}");
}
