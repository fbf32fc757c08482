//! Apache's official RocketMQ 5 Java SDK (`rocketmq-client-java`), run through the test driver in
//! `it/grpc-driver`: one scenario per process, its JSON result on stdout. No SDK behaviour is re-implemented
//! here; the tests only start scenarios and read what the SDK saw.
//!
//! Apps in production run every SDK version since 5.0, and the versions differ in what they send (5.0.x sends
//! no `long_polling_timeout`, for one), so each scenario runs under [`Sdk::ALL`]: the oldest 5.0.x that
//! resolves from Maven Central here, and the newest.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

/// One version of the Java SDK the driver is built against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sdk(pub &'static str);

impl Sdk {
    /// The oldest 5.0.x SDK that resolves here.
    pub const OLDEST: Sdk = Sdk("5.0.3");
    /// The newest SDK that resolves here.
    pub const NEWEST: Sdk = Sdk("5.2.0");
    /// Every version each scenario runs under.
    pub const ALL: [Sdk; 2] = [Sdk::OLDEST, Sdk::NEWEST];

    /// The driver jar for this version, built by `it/grpc-driver/build.sh <version>` when missing or stale
    /// (idempotent, cached under `$HOME`; `docker/test.sh` builds both up front).
    pub fn driver_jar(self) -> &'static PathBuf {
        static JARS: OnceLock<Vec<(Sdk, PathBuf)>> = OnceLock::new();
        let jars = JARS.get_or_init(|| Sdk::ALL.iter().map(|sdk| (*sdk, sdk.build())).collect());
        &jars.iter().find(|(sdk, _)| *sdk == self).expect("a tested SDK version").1
    }

    /// Starts `scenario` on this version (see [`Scenario::start_on`]).
    pub fn start(self, scenario: &str, args: &Value) -> Scenario {
        Scenario::start_on(self, scenario, args)
    }

    /// Runs `scenario` on this version to its end (see [`run`]).
    pub async fn run(self, scenario: &str, args: &Value, timeout: Duration) -> Value {
        self.start(scenario, args).finish(timeout).await
    }

    fn build(self) -> PathBuf {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/it/grpc-driver/build.sh");
        let out = Command::new("bash").arg(script).arg(self.0).stderr(Stdio::inherit()).output().expect("run build.sh");
        assert!(out.status.success(), "the gRPC driver did not build against SDK {}", self.0);
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    }
}

/// One running scenario; killed on drop.
pub struct Scenario {
    child: Option<Child>,
    what: String,
}

impl Scenario {
    /// Starts `scenario` with `args` (the endpoint is the caller's to put in) on the newest SDK, in a JVM tuned
    /// to start fast.
    pub fn start(scenario: &str, args: &Value) -> Scenario {
        Self::start_on(Sdk::NEWEST, scenario, args)
    }

    /// As [`Scenario::start`], on the SDK version `sdk`.
    pub fn start_on(sdk: Sdk, scenario: &str, args: &Value) -> Scenario {
        Self::start_in(sdk, &["-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"], scenario, args)
    }

    /// As [`Scenario::start_on`], with the JVM options `jvm` (a load program wants the optimising compiler).
    pub fn start_in(sdk: Sdk, jvm: &[&str], scenario: &str, args: &Value) -> Scenario {
        Self::start_jar(sdk.driver_jar(), &format!("SDK {}", sdk.0), jvm, scenario, args)
    }

    /// Starts `scenario` of the driver jar `jar` (a gRPC or a remoting driver; `client` says which client
    /// version, for messages).
    pub fn start_jar(jar: &std::path::Path, client: &str, jvm: &[&str], scenario: &str, args: &Value) -> Scenario {
        let mut java = Command::new("java");
        java.args(jvm).arg("-jar").arg(jar);
        Self::spawn(java, client, scenario, args)
    }

    /// Starts `scenario` of the driver executable `binary` (the Go driver), which takes its arguments as the
    /// jars do: `<scenario> <json args>`.
    pub fn start_binary(binary: &std::path::Path, client: &str, scenario: &str, args: &Value) -> Scenario {
        Self::spawn(Command::new(binary), client, scenario, args)
    }

    /// Runs `driver` with `<scenario> <json args>`, its stdout and stderr kept for [`Scenario::finish`].
    fn spawn(mut driver: Command, client: &str, scenario: &str, args: &Value) -> Scenario {
        let child = driver
            .arg(scenario)
            .arg(ascii_json(args))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the driver");
        Scenario { child: Some(child), what: format!("{scenario} on {client} {args}") }
    }

    /// Waits (at most `timeout`) for the driver to create `path` (the file a scenario names `readyFile` or
    /// `startedFile`), and hands the still-running scenario back. A driver that ends first fails the test with
    /// its own result and log, not with a missing file.
    pub async fn once_file_exists(mut self, path: &std::path::Path, timeout: Duration) -> Scenario {
        let deadline = std::time::Instant::now() + timeout;
        while !path.exists() {
            let ended = self.child.as_mut().is_some_and(|child| matches!(child.try_wait(), Ok(Some(_))));
            if ended {
                let what = self.what.clone();
                let result = self.finish(Duration::from_secs(10)).await;
                panic!("the driver ({what}) ended without creating {}: {result}", path.display());
            }
            assert!(std::time::Instant::now() < deadline, "{} never appeared ({})", path.display(), self.what);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self
    }

    /// Waits (at most `timeout`) for the scenario's JSON result, which must not be an error. Panics with the
    /// driver's stderr otherwise.
    pub async fn finish(self, timeout: Duration) -> Value {
        let what = self.what.clone();
        let (result, stderr) = self.output(timeout).await;
        assert!(
            result.get("error").is_none(),
            "the driver failed ({what}): {result}\nstderr (last 4000 bytes): {}",
            &stderr[stderr.len().saturating_sub(4000)..]
        );
        result
    }

    /// As [`Scenario::finish`], with the driver's stderr (the client's own log), for a test that shows it when
    /// a timing it checks was not met.
    pub async fn finish_with_log(self, timeout: Duration) -> (Value, String) {
        let what = self.what.clone();
        let (result, stderr) = self.output(timeout).await;
        assert!(result.get("error").is_none(), "the driver failed ({what}): {result}\nstderr: {stderr}");
        (result, stderr)
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
                panic!("the driver ({}) did not finish within {timeout:?}", self.what);
            }
        };
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let result: Value = stdout
            .lines()
            .rev()
            .find_map(|line| serde_json::from_str(line).ok())
            .unwrap_or_else(|| panic!("no JSON from the driver ({}): {stdout}\n{stderr}", self.what));
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

/// The bodies in a result list (`sent`, `received`).
pub fn bodies(result: &Value, list: &str) -> Vec<String> {
    result[list]
        .as_array()
        .map(|items| items.iter().filter_map(|i| i["body"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}
