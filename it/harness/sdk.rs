//! Apache's official RocketMQ 5 Java SDK (`rocketmq-client-java` 5.2.0), run through the test driver in
//! `it/grpc-driver`: one scenario per process, its JSON result on stdout. No SDK behaviour is re-implemented
//! here; the tests only start scenarios and read what the SDK saw.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

/// The driver jar: `SDK_DRIVER_JAR` (set by `docker/test.sh`), or built now by `it/grpc-driver/build.sh`
/// (idempotent, cached under `$HOME`).
pub fn driver_jar() -> &'static PathBuf {
    static JAR: OnceLock<PathBuf> = OnceLock::new();
    JAR.get_or_init(|| {
        if let Some(jar) = std::env::var_os("SDK_DRIVER_JAR").map(PathBuf::from).filter(|p| p.exists()) {
            return jar;
        }
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/it/grpc-driver/build.sh");
        let out = Command::new("bash").arg(script).stderr(Stdio::inherit()).output().expect("run build.sh");
        assert!(out.status.success(), "the gRPC driver did not build");
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
}

/// One running scenario; killed on drop.
pub struct Scenario {
    child: Option<Child>,
    what: String,
}

impl Scenario {
    /// Starts `scenario` with `args` (the endpoint is the caller's to put in), in a JVM tuned to start fast.
    pub fn start(scenario: &str, args: &Value) -> Scenario {
        Self::start_in(&["-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"], scenario, args)
    }

    /// As [`Scenario::start`], with the JVM options `jvm` (a load program wants the optimising compiler).
    pub fn start_in(jvm: &[&str], scenario: &str, args: &Value) -> Scenario {
        let child = Command::new("java")
            .args(jvm)
            .arg("-jar")
            .arg(driver_jar())
            .arg(scenario)
            .arg(ascii_json(args))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the gRPC driver");
        Scenario { child: Some(child), what: format!("{scenario} {args}") }
    }

    /// Waits (at most `timeout`) for the scenario's JSON result, which must not be an error. Panics with the
    /// driver's stderr otherwise.
    pub async fn finish(self, timeout: Duration) -> Value {
        let what = self.what.clone();
        let (result, stderr) = self.output(timeout).await;
        assert!(
            result.get("error").is_none(),
            "the gRPC driver failed ({what}): {result}\nstderr (last 4000 bytes): {}",
            &stderr[stderr.len().saturating_sub(4000)..]
        );
        result
    }

    /// As [`Scenario::finish`], for a scenario expected to fail as a whole (a client refused at start).
    pub async fn finish_allowing_error(self, timeout: Duration) -> Value {
        self.output(timeout).await.0
    }

    async fn output(mut self, timeout: Duration) -> (Value, String) {
        let Some(child) = self.child.take() else { panic!("finished twice") };
        let pid = child.id();
        let waited = tokio::task::spawn_blocking(move || child.wait_with_output());
        let output = match tokio::time::timeout(timeout, waited).await {
            Ok(joined) => joined.expect("join").expect("driver output"),
            Err(_) => {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
                panic!("the gRPC driver ({}) did not finish within {timeout:?}", self.what);
            }
        };
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let result: Value = stdout
            .lines()
            .rev()
            .find_map(|line| serde_json::from_str(line).ok())
            .unwrap_or_else(|| panic!("no JSON from the gRPC driver ({}): {stdout}\n{stderr}", self.what));
        (result, stderr.into_owned())
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `args` as JSON text in ASCII, anything else as `\uXXXX` escapes (which only occur inside strings): the JVM
/// decodes its command line with the locale's charset, so under a non-UTF-8 locale a message group such as
/// `订单-1` would reach the SDK as `??-1`.
fn ascii_json(args: &Value) -> String {
    let mut text = String::new();
    for c in args.to_string().chars() {
        if c.is_ascii() {
            text.push(c);
        } else {
            for unit in c.encode_utf16(&mut [0; 2]) {
                text.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    text
}

/// Runs `scenario` to its end and returns its result (see [`Scenario::finish`]).
pub async fn run(scenario: &str, args: &Value, timeout: Duration) -> Value {
    Scenario::start(scenario, args).finish(timeout).await
}

/// The bodies in a result list (`sent`, `received`).
pub fn bodies(result: &Value, list: &str) -> Vec<String> {
    result[list]
        .as_array()
        .map(|items| items.iter().filter_map(|i| i["body"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}
