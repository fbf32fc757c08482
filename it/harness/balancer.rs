//! A real load balancer in front of several popgate instances: HAProxy from Debian's packages (installed by
//! `docker/setup.sh`), run as a child process with a generated config, round-robin without stickiness, killed
//! on drop.

use std::fmt::Write as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::free_port;

/// A running HAProxy; `address` is its `127.0.0.1:port`.
pub struct Balancer {
    /// `127.0.0.1:port` of its front end.
    pub address: String,
    child: Child,
    _dir: TempDir,
}

impl Balancer {
    /// HAProxy balancing HTTP requests, each one to the next of `backends` (`host:port`) in turn: every request
    /// is balanced on its own (`http-server-close`), so a client's poll and its ACK reach different instances.
    pub async fn http(backends: &[String]) -> Balancer {
        Balancer::start("http", "option http-server-close\n", backends).await
    }

    async fn start(mode: &str, options: &str, backends: &[String]) -> Balancer {
        let dir = tempfile::Builder::new().prefix("popgate-it-haproxy-").tempdir().expect("tempdir");
        let port = free_port();
        let mut config = format!(
            "global\n  maxconn 4096\n\ndefaults\n  mode {mode}\n  timeout connect 2s\n  timeout client 120s\n  \
             timeout server 120s\n  {options}\nfrontend popgates\n  bind 127.0.0.1:{port}\n  default_backend instances\n\n\
             backend instances\n  balance roundrobin\n"
        );
        for (n, backend) in backends.iter().enumerate() {
            writeln!(config, "  server popgate{n} {backend}").expect("string");
        }
        let path = dir.path().join("haproxy.cfg");
        std::fs::write(&path, config).expect("write haproxy.cfg");
        let log = std::fs::File::create(dir.path().join("haproxy.log")).expect("log");
        // `-db`: in the foreground, so dropping the child stops it.
        let child = Command::new(haproxy())
            .arg("-db")
            .arg("-f")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start haproxy (docker/setup.sh installs it)");
        let balancer = Balancer { address: format!("127.0.0.1:{port}"), child, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(&balancer.address).await.is_err() {
            assert!(Instant::now() < deadline, "haproxy did not listen on {}", balancer.address);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        balancer
    }

    /// `http://` and the address, for HTTP clients.
    pub fn base(&self) -> String {
        format!("http://{}", self.address)
    }
}

/// HAProxy's binary: on the PATH, or where Debian puts it (`/usr/sbin`, not on every user's PATH).
fn haproxy() -> &'static str {
    if std::path::Path::new("/usr/sbin/haproxy").exists() {
        "/usr/sbin/haproxy"
    } else {
        "haproxy"
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
