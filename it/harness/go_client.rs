//! Apache's Go RocketMQ client (`github.com/apache/rocketmq-client-go/v2`, at the version
//! `it/go-driver/go.mod` pins), run through the test driver in `it/go-driver`: one scenario per process, its
//! JSON result on stdout, as for the Java clients ([`super::sdk`], [`super::remoting`]). Apps written in Go
//! point it at popgate's remoting front as their name server, as Java apps do.
//!
//! The Go client differs from the Java one on the wire: its JSON headers carry no `serializeTypeCurrentRPC`,
//! it reports version 317 (so popgate gives it a port per broker, as a Java client before 4.9.5), it sends
//! `SEND_MESSAGE` rather than `SEND_MESSAGE_V2`, and its check-back handler only answers a half message whose
//! `PGROUP` is its own group.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

use super::sdk::Scenario;

/// The client version `it/go-driver/go.mod` pins, for messages.
pub const CLIENT: &str = "rocketmq-client-go v2.1.3-0.20251226070945-2173d070fd1b";

/// The driver binary, built by `it/go-driver/build.sh` when missing or stale (idempotent, cached under
/// `$HOME`; `docker/test.sh` builds it up front).
pub fn driver() -> &'static PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/it/go-driver/build.sh");
        let out = Command::new("bash").arg(script).stderr(Stdio::inherit()).output().expect("run build.sh");
        assert!(out.status.success(), "the Go driver did not build");
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
}

/// Starts `scenario` (`produce`, `push-consume`, `transact`) with `args`; see `it/go-driver/README.md`.
pub fn start(scenario: &str, args: &Value) -> Scenario {
    Scenario::start_binary(driver(), CLIENT, scenario, args)
}

/// Runs `scenario` to its end; panics when it fails as a whole.
pub async fn run(scenario: &str, args: &Value, timeout: Duration) -> Value {
    start(scenario, args).finish(timeout).await
}
