//! Apache's remoting Java client (`org.apache.rocketmq:rocketmq-client`: `DefaultMQProducer`,
//! `DefaultMQPushConsumer`, `DefaultLitePullConsumer`, `TransactionMQProducer`), run through the test driver
//! in `it/remoting-driver`: one scenario per process, its JSON result on stdout, as for the gRPC SDK
//! ([`super::sdk`]). Each scenario runs under [`RemotingClient::ALL`]: two 4.9.x clients (the apps most
//! deployed), one before 4.9.5 and the newest, and the newest 5.x one; they differ in what they send (4.9.5
//! started naming the broker in its requests; 5.x sends `LITE_PULL_MESSAGE` for lite pull consumers). Consumers that consume by POP are 5.x
//! only: their scenarios run under [`RemotingClient::POP`], the oldest client that keeps popgate's handle
//! (5.1.0) and the newest.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

use super::sdk::Scenario;

/// The JVM options every driver process runs with: small and quick to start, many run at once.
const DRIVER_JVM: [&str; 3] = ["-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"];

/// One version of the remoting client the driver is built against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemotingClient(pub &'static str);

impl RemotingClient {
    /// The client Apache's own end-to-end tests pin: it does not name the broker in its requests (4.9.5 began
    /// to), so popgate gives it a port per broker.
    pub const V4_9_3: RemotingClient = RemotingClient("4.9.3");
    /// The newest 4.x client that resolves here.
    pub const V4: RemotingClient = RemotingClient("4.9.8");
    /// The newest 5.x client that resolves here.
    pub const V5: RemotingClient = RemotingClient("5.4.0");
    /// The oldest client whose POP consumer keeps the handle popgate puts in a message (`POP_CK`).
    pub const V5_1: RemotingClient = RemotingClient("5.1.0");
    /// Every version each scenario runs under.
    pub const ALL: [RemotingClient; 3] = [RemotingClient::V4_9_3, RemotingClient::V4, RemotingClient::V5];
    /// Every version each POP consumer scenario runs under (4.x clients cannot consume by POP).
    pub const POP: [RemotingClient; 2] = [RemotingClient::V5_1, RemotingClient::V5];

    /// The driver jar for this version, built by `it/remoting-driver/build.sh <version>` when missing or stale
    /// (idempotent, cached under `$HOME`; `docker/test.sh` builds every version up front).
    pub fn driver_jar(self) -> &'static PathBuf {
        static JARS: OnceLock<Vec<(RemotingClient, PathBuf)>> = OnceLock::new();
        let jars = JARS.get_or_init(|| {
            let mut every: Vec<RemotingClient> = RemotingClient::ALL.into_iter().chain(RemotingClient::POP).collect();
            every.dedup();
            every.sort_by_key(|c| c.0);
            every.dedup();
            every.into_iter().map(|c| (c, c.build())).collect()
        });
        &jars.iter().find(|(client, _)| *client == self).expect("a tested client version").1
    }

    /// Starts `scenario` with `args` on this client version.
    pub fn start(self, scenario: &str, args: &Value) -> Scenario {
        Scenario::start_jar(self.driver_jar(), &format!("rocketmq-client {}", self.0), &DRIVER_JVM, scenario, args)
    }

    /// As [`RemotingClient::start`], in a JVM with the options `jvm` (a load program wants the optimising
    /// compiler and a heap that never limits it).
    #[allow(dead_code)] // only the benchmark uses it
    pub fn start_in(self, jvm: &[&str], scenario: &str, args: &Value) -> Scenario {
        Scenario::start_jar(self.driver_jar(), &format!("rocketmq-client {}", self.0), jvm, scenario, args)
    }

    /// As [`RemotingClient::start`], with the client logging at info (on stderr, see
    /// [`Scenario::finish_with_log`]): its rebalances, heartbeats and what failed in them.
    pub fn start_logging(self, scenario: &str, args: &Value) -> Scenario {
        let jvm = [&DRIVER_JVM[..], &["-Drocketmq.log.level=info"]].concat();
        Scenario::start_jar(self.driver_jar(), &format!("rocketmq-client {}", self.0), &jvm, scenario, args)
    }

    /// Runs `scenario` on this version to its end; panics when it fails as a whole.
    pub async fn run(self, scenario: &str, args: &Value, timeout: Duration) -> Value {
        self.start(scenario, args).finish(timeout).await
    }

    fn build(self) -> PathBuf {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/it/remoting-driver/build.sh");
        let out = Command::new("bash").arg(script).arg(self.0).stderr(Stdio::inherit()).output().expect("run build.sh");
        assert!(out.status.success(), "the remoting driver did not build against rocketmq-client {}", self.0);
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    }
}
