//! Test harness: real processes, owned by guards that kill them on drop.
//!
//! - [`rocketmq`]: Java name server + brokers (`java -cp`, jars fetched by `docker/rocketmq/rocketmq.sh jars`).
//! - [`popgate`]: the popgate binary under test, with a generated config.
//! - [`sdk`], [`remoting`]: Apache's Java clients (gRPC SDK, remoting client) run by the test drivers.
//! - [`go_client`]: Apache's Go client (`rocketmq-client-go`, remoting) run by the Go test driver.
//! - [`direct`]: a direct RocketMQ client, to check what reached the broker without trusting popgate.

pub mod balancer;
pub mod direct;
pub mod go_client;
pub mod popgate;
pub mod push;
pub mod remoting;
pub mod rocketmq;
pub mod sdk;

use std::net::TcpListener;
use std::time::{Duration, Instant};

/// A port to listen on that was free a moment ago on every interface. It is taken below Linux's ephemeral
/// range (32768 and up), where the kernel picks the local ports of outgoing connections: a port asked of the
/// kernel with `bind(:0)` comes from that range, and a loaded suite's many client sockets took one between
/// this choice and the name server's bind ("Address already in use"; the name server then never booted).
pub fn free_port() -> u16 {
    loop {
        let port: u16 = rand::random_range(20_000..32_000);
        if TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
}

/// Polls `check` every 100 ms until it holds or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// A setting from the environment (a bench, chaos or fuzz knob), or `default` when unset or unparsable.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A topic name no other test uses.
pub fn unique_topic(prefix: &str) -> String {
    format!("{prefix}_{}", rand_suffix())
}

fn rand_suffix() -> String {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{}_{nanos:x}", std::process::id())
}

/// A small tmpfs mounted for a test (root can mount one here), unmounted on drop: a real disk that fills up.
pub struct Tmpfs {
    /// The mount point.
    pub path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size_kib` KiB.
    pub fn mount(size_kib: u32) -> Tmpfs {
        let dir = tempfile::Builder::new().prefix("popgate-tmpfs-").tempdir().expect("tempdir");
        let path = dir.path().to_path_buf();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size_kib}k"), "tmpfs"])
            .arg(&path)
            .status()
            .expect("run mount");
        assert!(status.success(), "mounting a tmpfs needs root");
        Tmpfs { path, _dir: dir }
    }

    /// Fills the file system to the last byte with a filler file.
    pub fn fill(&self) {
        fill(&self.path);
    }

    /// Keeps the file system full until the guard is dropped: fills it again every 100 ms, since RocksDB frees
    /// space of its own (an old WAL) when it reopens after a failed write.
    pub fn keep_full(&self) -> KeepFull {
        self.fill();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (path, flag) = (self.path.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                fill(&path);
            }
        });
        KeepFull { stop, thread: Some(thread) }
    }

    /// Frees what [`Tmpfs::fill`] took.
    pub fn free(&self) {
        std::fs::remove_file(self.path.join("filler")).expect("remove filler");
    }
}

/// Fills the file system at `dir` with `dir/filler` (appended to, so what it already holds stays).
fn fill(dir: &std::path::Path) {
    let _ = std::process::Command::new("dd")
        .args(["if=/dev/zero", "bs=4k", "oflag=append", "conv=notrunc"])
        .arg(format!("of={}", dir.join("filler").display()))
        .stderr(std::process::Stdio::null())
        .status();
}

/// See [`Tmpfs::keep_full`]; dropping it stops the refilling (the filler stays until [`Tmpfs::free`]).
pub struct KeepFull {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for KeepFull {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.path).status();
    }
}
