//! A real load balancer in front of several popgate instances: HAProxy from Debian's packages (installed by
//! `docker/setup.sh`), run as a child process with a generated config, round-robin without stickiness, killed
//! on drop. It checks each instance's `GET /readyz` every 500 ms, as the README's tier section configures it, and
//! sends nothing to an instance that failed two checks in a row. Its runtime API (a UNIX socket) cuts the connections of one instance, as draining a node or a
//! balancer that rebalances does: the clients connect again, to the next instance in turn.

use std::fmt::Write as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::free_port;

/// One instance behind the balancer: the address traffic goes to, and its HTTP port, whose `/readyz` is checked.
pub struct Backend {
    /// `host:port` of the front balanced (HTTP, gRPC or remoting).
    pub address: String,
    /// Its instance's HTTP port.
    pub http_port: u16,
}

impl Backend {
    /// `popgate`'s front at `address` (its HTTP port checked).
    pub fn of(popgate: &super::popgate::Popgate, address: &str) -> Backend {
        let http_port = popgate.base.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port in the base URL");
        Backend { address: address.to_owned(), http_port }
    }
}

/// A running HAProxy; `address` is its `127.0.0.1:port`.
pub struct Balancer {
    /// `127.0.0.1:port` of its front end.
    pub address: String,
    child: Child,
    /// Its runtime API's UNIX socket.
    admin: std::path::PathBuf,
    _dir: TempDir,
}

impl Balancer {
    /// HAProxy balancing HTTP requests, each one to the next of `backends` (`host:port`) in turn: every request
    /// is balanced on its own (`http-server-close`), so a client's poll and its ACK reach different instances.
    pub async fn http(backends: &[Backend]) -> Balancer {
        Balancer::start("http", "option http-server-close\n", backends).await
    }

    /// HAProxy balancing TCP connections (gRPC, remoting: TLS or not, passed through), each new one to the next
    /// of `backends` in turn, listening on `port` (a remoting front must advertise it before it starts).
    pub async fn tcp_on(port: u16, backends: &[Backend]) -> Balancer {
        Balancer::start_on(port, "tcp", "", backends).await
    }

    async fn start(mode: &str, options: &str, backends: &[Backend]) -> Balancer {
        Balancer::start_on(free_port(), mode, options, backends).await
    }

    async fn start_on(port: u16, mode: &str, options: &str, backends: &[Backend]) -> Balancer {
        let dir = tempfile::Builder::new().prefix("popgate-it-haproxy-").tempdir().expect("tempdir");
        let admin = dir.path().join("admin.sock");
        let mut config = format!(
            "global\n  maxconn 4096\n  stats socket {} mode 600 level admin\n\ndefaults\n  mode {mode}\n  \
             timeout connect 2s\n  timeout client 120s\n  timeout server 120s\n  {options}\nfrontend popgates\n  \
             bind 127.0.0.1:{port}\n  default_backend instances\n\nbackend instances\n  balance roundrobin\n  \
             option httpchk GET /readyz\n  http-check expect status 200\n  \
             default-server inter 500ms fall 2 rise 2\n",
            admin.display()
        );
        for (n, backend) in backends.iter().enumerate() {
            let (address, http_port) = (&backend.address, backend.http_port);
            writeln!(config, "  server popgate{n} {address} check port {http_port}").expect("string");
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
        let balancer = Balancer { address: format!("127.0.0.1:{port}"), child, admin, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(&balancer.address).await.is_err() {
            assert!(Instant::now() < deadline, "haproxy did not listen on {}", balancer.address);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        balancer
    }

    /// Closes every connection the balancer holds to backend `n` (`shutdown sessions server`): its clients
    /// connect again, through the balancer, to the next instances in turn. Returns HAProxy's answer (empty
    /// when it did it).
    pub async fn cut_connections_to(&self, n: usize) -> String {
        self.runtime(&format!("shutdown sessions server instances/popgate{n}\n")).await.trim().to_owned()
    }

    /// Whether HAProxy's checks have taken backend `n` out (`show stat`: its status is `DOWN`).
    pub async fn is_down(&self, n: usize) -> bool {
        let stats = self.runtime("show stat\n").await;
        let mut lines = stats.lines();
        let header: Vec<&str> = lines.next().unwrap_or_default().trim_start_matches("# ").split(',').collect();
        let status = header.iter().position(|c| *c == "status").expect("a status column");
        let server = format!("popgate{n}");
        lines
            .map(|l| l.split(',').collect::<Vec<_>>())
            .any(|row| row.get(1) == Some(&server.as_str()) && row.get(status).is_some_and(|s| s.starts_with("DOWN")))
    }

    async fn runtime(&self, command: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut socket = tokio::net::UnixStream::connect(&self.admin).await.expect("haproxy's runtime API socket");
        socket.write_all(command.as_bytes()).await.expect("write to haproxy's runtime API");
        let mut answer = String::new();
        socket.read_to_string(&mut answer).await.expect("read haproxy's runtime API");
        answer
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
