//! Real Apache RocketMQ processes: one name server and any number of brokers, each a `java -cp` child with
//! its own store directory, on 127.0.0.1.
//!
//! Every process is owned by a [`JavaProcess`] guard that SIGKILLs it on drop. For clusters kept in a
//! `static` (which is never dropped), a [`Watchdog`] shell kills them when the test process exits, so a failing
//! or aborted test run leaves nothing behind.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::free_port;

/// Where `docker/rocketmq/rocketmq.sh jars` puts the jars; `ROCKETMQ_JARS_DIR` overrides.
pub fn rocketmq_lib() -> PathBuf {
    if let Ok(dir) = std::env::var("ROCKETMQ_JARS_DIR") {
        return PathBuf::from(dir);
    }
    jar_dir("jars")
}

/// Runs `docker/rocketmq/rocketmq.sh <command>` (`jars`, `proxy-jars`: idempotent, cached under `$HOME`) and
/// returns the lib dir it prints.
fn jar_dir(command: &str) -> PathBuf {
    let output = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("docker/rocketmq/rocketmq.sh"))
        .arg(command)
        .output()
        .expect("run docker/rocketmq/rocketmq.sh");
    assert!(output.status.success(), "rocketmq.sh {command} failed: {}", String::from_utf8_lossy(&output.stderr));
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// A process could not bind a port it was given: between choosing it free and binding it, another process
/// (a concurrent test's broker or popgate) took it. Holds the log's path and tail.
#[derive(Debug)]
struct PortTaken(String);

/// A Java child process, killed on drop.
pub struct JavaProcess {
    child: Child,
    /// The process's stdout/stderr file.
    pub log: PathBuf,
}

impl JavaProcess {
    /// A name server or broker: a small fixed heap and the serial collector, enough for tests on 2 cores.
    fn spawn(lib: &Path, home: &Path, heap_mb: u32, main_class: &str, args: &[&str]) -> JavaProcess {
        let heap = [format!("-Xms{heap_mb}m"), format!("-Xmx{heap_mb}m")];
        // Direct memory: every broker thread that stores messages keeps an encoder of maxMessageSize + 64 KiB
        // (4 MiB + 64 KiB) in it, and a long suite uses many such threads (sends, POP acks and revives, timers,
        // transaction ends and check-backs). 256 MiB ran out during the suite; Apache's runbroker.sh gives 15 GiB.
        let jvm = [&heap[0], &heap[1], "-XX:MaxDirectMemorySize=1g", "-XX:+UseSerialGC"];
        Self::spawn_with(lib, home, &jvm, main_class, args)
    }

    fn spawn_with(lib: &Path, home: &Path, jvm: &[&str], main_class: &str, args: &[&str]) -> JavaProcess {
        fs::create_dir_all(home).expect("process home");
        let log = home.join("console.log");
        let out = fs::File::create(&log).expect("console log");
        let child = Command::new("java")
            .args(jvm)
            // The broker writes scratch files (TLS test certificates) to the temp dir: keep them in the home.
            .arg(format!("-Djava.io.tmpdir={}", home.display()))
            .arg(format!("-Drocketmq.home.dir={}", home.display()))
            .arg(format!("-Duser.home={}", home.display()))
            .arg("-cp")
            .arg(format!("{}/*", lib.display()))
            .arg(main_class)
            .args(args)
            .current_dir(home)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log handle"))
            .stderr(out)
            .spawn()
            .expect("java must be installed");
        JavaProcess { child, log }
    }

    /// The OS process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until the process's log contains `needle`, failing at once with the log when the process exits
    /// (a JVM killed by a signal prints nothing: its log alone would keep the wait going until the timeout).
    /// `Err` when a port it was given had been taken meanwhile (the caller may start it on others).
    fn wait_for_log(&mut self, needle: &str) -> Result<(), PortTaken> {
        let deadline = Instant::now() + BOOT_TIMEOUT;
        loop {
            let text = fs::read_to_string(&self.log).unwrap_or_default();
            if text.contains(needle) {
                return Ok(());
            }
            if text.contains("Address already in use") {
                return Err(PortTaken(format!("{}:\n{}", self.log.display(), tail(&text))));
            }
            let failed = ["Exception in thread \"main\"", "Error: Could not"];
            if failed.iter().any(|sign| text.contains(sign)) {
                panic!("RocketMQ process failed to start; {}:\n{}", self.log.display(), tail(&text));
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "RocketMQ process {} before `{needle}`; {}:\n{}",
                    exited(status),
                    self.log.display(),
                    tail(&text)
                );
            }
            assert!(
                Instant::now() < deadline,
                "`{needle}` not in {} after {BOOT_TIMEOUT:?}:\n{}",
                self.log.display(),
                tail(&text)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Sends a signal (`STOP`, `CONT`, `KILL`) to the process.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill").arg(format!("-{signal}")).arg(self.pid().to_string()).status();
        assert!(status.is_ok_and(|s| s.success()), "kill -{signal} {}", self.pid());
    }
}

impl Drop for JavaProcess {
    fn drop(&mut self) {
        // A stopped process cannot die of SIGKILL until continued on some kernels' job control: wake it first.
        let _ = Command::new("kill").arg("-CONT").arg(self.child.id().to_string()).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One broker of a [`Cluster`].
pub struct Broker {
    /// `brokerName`.
    pub name: String,
    /// Remoting port (`listenPort`).
    pub port: u16,
    conf: PathBuf,
    home: PathBuf,
    /// `None` while stopped by [`Cluster::kill_broker`].
    process: Option<JavaProcess>,
}

/// What the broker logs each time it has registered with the name server (its routes are then served).
const REGISTERED: &str = "Registering current broker to name server completed";

/// How long a name server or broker may take to boot (and a broker to register). A JVM's boot is mostly JIT
/// work: on 2 cores shared with builds and other tests it has taken over 90 s. Each wait polls the process's
/// log and fails at once when the process died, so the bound costs nothing when all is well.
const BOOT_TIMEOUT: Duration = Duration::from_secs(300);

impl Broker {
    fn broker_log(&self) -> PathBuf {
        self.home.join("logs/rocketmqlogs/broker.log")
    }

    /// How many registrations with the name server the broker has logged so far.
    fn registrations(&self) -> usize {
        fs::read_to_string(self.broker_log()).map(|t| t.matches(REGISTERED).count()).unwrap_or(0)
    }

    /// Waits until the broker logged at least `count` registrations, so the name server routes to it.
    fn wait_registered(&self, count: usize) {
        let deadline = Instant::now() + BOOT_TIMEOUT;
        while self.registrations() < count {
            assert!(Instant::now() < deadline, "{} never registered with the name server", self.name);
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Apache's own RocketMQ 5 gRPC proxy (`rocketmq-proxy` of the broker's version, cluster mode) in front of a
/// [`Cluster`]: what the benchmark compares popgate's gRPC front with, and what `it/apache_parity.rs` checks
/// popgate's choices against. Killed on drop.
#[allow(dead_code)] // `pid` and `remoting` only the benchmark uses
pub struct ApacheProxy {
    /// `127.0.0.1:port` of its gRPC endpoint (TLS and plaintext on one port, like popgate's).
    pub endpoint: String,
    /// `127.0.0.1:port` of its remoting port, which a remoting client (5.x) is given as its name server.
    pub remoting: String,
    process: JavaProcess,
    lib: PathBuf,
    /// Its config file (`-pc`).
    args: String,
    home: TempDir,
}

#[allow(dead_code)]
impl ApacheProxy {
    /// Starts the proxy for `cluster` and waits until it says it started. It runs with the collector and JVM
    /// options of Apache's `runserver.sh` (G1), but a 1 GiB heap instead of its 4 GiB: this machine runs a
    /// broker, a load program and popgate beside it.
    pub fn start(cluster: &Cluster) -> ApacheProxy {
        let lib = jar_dir("proxy-jars");
        let home = tempfile::Builder::new().prefix("popgate-apache-proxy-").tempdir().expect("tempdir");
        let (grpc_port, remoting_port) = (free_port(), free_port());
        let conf = home.path().join("rmq-proxy.json");
        let settings = serde_json::json!({
            "rocketMQClusterName": CLUSTER_NAME,
            "namesrvAddr": cluster.namesrv_addr,
            "proxyMode": "cluster",
            "grpcServerPort": grpc_port,
            "remotingListenPort": remoting_port,
        });
        fs::write(&conf, settings.to_string()).expect("proxy conf");
        let conf = conf.to_string_lossy();
        let process = Self::spawn(&lib, home.path(), &conf);
        let proxy = ApacheProxy {
            endpoint: format!("127.0.0.1:{grpc_port}"),
            remoting: format!("127.0.0.1:{remoting_port}"),
            process,
            lib,
            args: conf.into_owned(),
            home,
        };
        proxy.wait_started(1);
        proxy
    }

    /// The proxy's JVM options: Apache's `runserver.sh` (G1), with a 1 GiB heap instead of its 4 GiB.
    const JVM: [&'static str; 8] = [
        "-Xms1g",
        "-Xmx1g",
        "-XX:+UseG1GC",
        "-XX:G1HeapRegionSize=16m",
        "-XX:G1ReservePercent=25",
        "-XX:InitiatingHeapOccupancyPercent=30",
        "-XX:SoftRefLRUPolicyMSPerMB=0",
        "-XX:-OmitStackTraceInFastThrow",
    ];

    fn spawn(lib: &Path, home: &Path, conf: &str) -> JavaProcess {
        let args = ["-pc", conf, "-pm", "cluster"];
        JavaProcess::spawn_with(lib, home, &Self::JVM, "org.apache.rocketmq.proxy.ProxyStartup", &args)
    }

    /// Waits until the proxy's log says it started `count` times.
    fn wait_started(&self, count: usize) {
        let log = self.home.path().join("logs/rocketmqlogs/proxy.log");
        let deadline = Instant::now() + BOOT_TIMEOUT;
        loop {
            let started = fs::read_to_string(&log).map(|t| t.matches("rocketmq-proxy startup successfully").count());
            if started.unwrap_or(0) >= count {
                return;
            }
            assert!(Instant::now() < deadline, "Apache's proxy did not start; see {}", log.display());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `kill -9` of the proxy, then the same proxy started again on the same ports (what a crash and a
    /// supervisor's restart do); returns once it says it started.
    pub fn kill9_and_restart(&mut self) {
        self.process.signal("KILL");
        let restarts = fs::read_to_string(self.home.path().join("logs/rocketmqlogs/proxy.log"))
            .map(|t| t.matches("rocketmq-proxy startup successfully").count())
            .unwrap_or(0);
        self.process = Self::spawn(&self.lib, self.home.path(), &self.args);
        self.wait_started(restarts + 1);
    }

    /// The proxy's process id (for its CPU time and RSS).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }
}

/// `brokerClusterName` of every test broker.
const CLUSTER_NAME: &str = "PopgateTestCluster";

/// What a cluster is made of.
#[derive(Clone)]
pub struct ClusterSpec {
    /// Broker names; each is a master with brokerId 0.
    pub brokers: Vec<String>,
    /// Extra `key=value` lines for every broker's config (short revive intervals, flush mode, …).
    pub broker_conf: Vec<String>,
    /// Whether each master also gets a slave (brokerId 1) replicating from it.
    pub with_slaves: bool,
    /// Masters replicate synchronously (`SYNC_MASTER`): a send is stored only once the slave has it.
    pub sync_replication: bool,
}

impl ClusterSpec {
    /// Masters with the given names and the default broker config.
    pub fn brokers(names: &[&str]) -> ClusterSpec {
        ClusterSpec {
            brokers: names.iter().map(|n| (*n).to_owned()).collect(),
            broker_conf: Vec::new(),
            with_slaves: false,
            sync_replication: false,
        }
    }

    /// One master named `broker-a` configured by a reliability profile of `docker/rocketmq/profiles`
    /// (`financial`, `durable`, `balanced`, `throughput`): its flush mode, and a slave replicated
    /// synchronously when the profile is a `SYNC_MASTER` one (as `rocketmq.sh start` does).
    pub fn profile(name: &str) -> ClusterSpec {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("docker/rocketmq/profiles/{name}.conf"));
        let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("profile {}: {e}", path.display()));
        let mut spec = ClusterSpec::brokers(&["broker-a"]);
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            match line.split_once('=') {
                Some(("brokerRole", role)) => spec.sync_replication = role == "SYNC_MASTER",
                // The harness sets the in-sync replica count of a SYNC_MASTER itself.
                Some(("inSyncReplicas", _)) => {}
                _ => spec.broker_conf.push(line.to_owned()),
            }
        }
        spec.with_slaves = spec.sync_replication;
        spec
    }
}

/// A name server and its brokers, all stopped on drop.
pub struct Cluster {
    /// `127.0.0.1:port` of the name server.
    pub namesrv_addr: String,
    /// The brokers, masters first, in spec order.
    pub brokers: Vec<Broker>,
    lib: PathBuf,
    _namesrv: JavaProcess,
    _watchdog: Option<Watchdog>,
    dir: TempDir,
}

/// Three consecutive-ish ports a broker needs: fast port (listen - 2), listen, HA (listen + 1).
///
/// Chosen below the kernel's ephemeral range (32768 and up): a broker a test stops and restarts must get its
/// ports back, and an outgoing connection of any process on the machine (an SDK client, popgate, another
/// broker) can take an ephemeral port while the broker is down. That happened: a restarted broker failed with
/// "Address already in use" on its HA port.
fn broker_port() -> u16 {
    loop {
        let port: u16 = rand::random_range(10_002..32_000);
        let ports = [port - 2, port, port + 1];
        if ports.iter().all(|p| std::net::TcpListener::bind(("0.0.0.0", *p)).is_ok()) {
            return port;
        }
    }
}

impl Cluster {
    /// Starts a name server and the brokers of `spec`, and waits until every broker has registered.
    pub fn start(spec: &ClusterSpec) -> Cluster {
        let lib = rocketmq_lib();
        let dir = tempfile::Builder::new().prefix("popgate-rmq-").tempdir().expect("tempdir");
        let (namesrv, namesrv_addr) = on_free_ports(|| Self::start_namesrv(&lib, dir.path()));

        // Masters first, each booted and registered before anything else starts: a slave learns its master's
        // HA address from its own registration with the name server, and the next one is 30 s away.
        let master_role = if spec.sync_replication { "SYNC_MASTER" } else { "ASYNC_MASTER" };
        let roles: &[&str] = if spec.with_slaves { &[master_role, "SLAVE"] } else { &[master_role] };
        let mut brokers = Vec::new();
        for role in roles {
            let new_broker =
                |name: &str| Self::new_broker(&lib, dir.path(), &namesrv_addr, name, role, &spec.broker_conf);
            let spawned: Vec<Broker> = spec.brokers.iter().map(|name| new_broker(name)).collect();
            brokers.extend(Self::wait_started(spawned, new_broker));
        }
        let mut cluster = Cluster { namesrv_addr, brokers, lib, _namesrv: namesrv, _watchdog: None, dir };
        cluster.arm_watchdog();
        cluster
    }

    fn start_namesrv(lib: &Path, root: &Path) -> Result<(JavaProcess, String), PortTaken> {
        let port = free_port();
        let home = root.join("namesrv");
        fs::create_dir_all(&home).expect("namesrv home");
        let conf = home.join("namesrv.conf");
        fs::write(&conf, format!("listenPort={port}\nbindAddress=127.0.0.1\n")).expect("namesrv conf");
        let mut namesrv = JavaProcess::spawn(
            lib,
            &home,
            256,
            "org.apache.rocketmq.namesrv.NamesrvStartup",
            &["-c", &conf.to_string_lossy()],
        );
        namesrv.wait_for_log("boot success")?;
        Ok((namesrv, format!("127.0.0.1:{port}")))
    }

    /// Waits until each broker booted and registered with the name server; one whose port was taken meanwhile
    /// is started again on new ports (`new_broker`).
    fn wait_started(spawned: Vec<Broker>, new_broker: impl Fn(&str) -> Broker) -> Vec<Broker> {
        let mut started = Vec::with_capacity(spawned.len());
        for broker in spawned {
            let name = broker.name.clone();
            let mut first = Some(broker);
            let broker = on_free_ports(|| {
                let mut broker = first.take().unwrap_or_else(|| new_broker(&name));
                broker.process.as_mut().expect("started").wait_for_log("boot success")?;
                Ok(broker)
            });
            broker.wait_registered(1);
            started.push(broker);
        }
        started
    }

    fn new_broker(lib: &Path, root: &Path, namesrv: &str, name: &str, role: &str, extra: &[String]) -> Broker {
        let port = broker_port();
        let id = if role == "SLAVE" { 1 } else { 0 };
        let home = root.join(format!("{name}-{id}"));
        fs::create_dir_all(&home).expect("broker home");
        let store = home.join("store");
        let mut conf = format!(
            "brokerClusterName={CLUSTER_NAME}\nbrokerName={name}\nbrokerId={id}\nbrokerRole={role}\n\
             brokerIP1=127.0.0.1\nbrokerIP2=127.0.0.1\nbindAddress=127.0.0.1\nlistenPort={port}\nnamesrvAddr={namesrv}\n\
             storePathRootDir={store}\nstorePathCommitLog={store}/commitlog\nautoCreateTopicEnable=true\n\
             autoCreateSubscriptionGroup=true\nmappedFileSizeCommitLog=67108864\nmappedFileSizeConsumeQueue=300000\n\
             enableConsumeQueueExt=false\nwaitTimeMillsInSendQueue=1000\n",
            store = store.display()
        );
        if role == "SYNC_MASTER" {
            // In 5.x a SYNC_MASTER waits for `inSyncReplicas` copies, and the default of 1 is the master alone:
            // 2 makes it wait for its slave, as SYNC_MASTER did in 4.x. A short slaveTimeout keeps tests quick.
            // (The slave learns the master's HA address, brokerIP2:listenPort+1, from the name server; a fixed
            // haMasterAddress is dropped by 5.x's master-offline handling at start and never restored.)
            conf.push_str("inSyncReplicas=2\nslaveTimeout=1000\n");
        }
        for line in extra {
            conf.push_str(line);
            conf.push('\n');
        }
        let conf_path = home.join("broker.conf");
        fs::write(&conf_path, conf).expect("broker conf");
        let process = JavaProcess::spawn(
            lib,
            &home,
            512,
            "org.apache.rocketmq.broker.BrokerStartup",
            &["-c", &conf_path.to_string_lossy()],
        );
        Broker { name: name.to_owned(), port, conf: conf_path, home, process: Some(process) }
    }

    /// Kills every process of this cluster when the test process exits, even if the cluster is never dropped.
    /// Armed again whenever a process is killed or started, so it never names a process that has gone (the
    /// previous watchdog is killed as it is replaced).
    fn arm_watchdog(&mut self) {
        let pids: Vec<u32> = std::iter::once(self._namesrv.pid())
            .chain(self.brokers.iter().filter_map(|b| b.process.as_ref().map(JavaProcess::pid)))
            .collect();
        self._watchdog = Watchdog::arm(&pids, self.dir.path());
    }

    /// Runs `mqadmin <command> <args…> -n <name server>` (Apache's `MQAdminStartup`) signed with `credentials`
    /// (an access key and secret, through `conf/tools.yml` as mqadmin reads them) and returns what it printed.
    /// Panics when it exits with an error. `-c` in `args` may name [`Cluster::name`].
    #[allow(dead_code)]
    pub fn mqadmin(&self, credentials: (&str, &str), command: &str, args: &[&str]) -> String {
        let home = self.dir.path().join("mqadmin");
        fs::create_dir_all(home.join("conf")).expect("mqadmin home");
        let (access_key, secret_key) = credentials;
        fs::write(home.join("conf/tools.yml"), format!("accessKey: {access_key}\nsecretKey: {secret_key}\n"))
            .expect("tools.yml");
        let output = Command::new("java")
            .args(["-Xms64m", "-Xmx128m", "-XX:+UseSerialGC"])
            .arg(format!("-Drocketmq.home.dir={}", home.display()))
            .arg(format!("-Duser.home={}", home.display()))
            .arg("-cp")
            .arg(format!("{}/*", self.lib.display()))
            .arg("org.apache.rocketmq.tools.command.MQAdminStartup")
            .arg(command)
            .args(args)
            .args(["-n", &self.namesrv_addr])
            .current_dir(&home)
            .stdin(Stdio::null())
            .output()
            .expect("java must be installed");
        let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        let failed = !output.status.success() || printed.contains("Exception") || printed.contains("failed");
        assert!(!failed, "mqadmin {command} {args:?}: {printed}");
        printed
    }

    /// The cluster's name (`brokerClusterName`).
    #[allow(dead_code)]
    pub fn name(&self) -> &'static str {
        CLUSTER_NAME
    }

    /// The broker named `name` (its master).
    pub fn broker(&self, name: &str) -> &Broker {
        self.brokers.iter().find(|b| b.name == name).expect("broker in the cluster")
    }

    /// `kill -9` the slave of `name`.
    pub fn kill_slave(&mut self, name: &str) {
        let slave = self.brokers.iter_mut().filter(|b| b.name == name).nth(1).expect("a slave");
        slave.process = None;
        self.arm_watchdog();
    }

    /// `kill -STOP` the broker: it keeps its sockets but answers nothing (a hung broker).
    pub fn pause_broker(&self, name: &str) {
        self.broker(name).process.as_ref().expect("running").signal("STOP");
    }

    /// `kill -CONT` a paused broker.
    pub fn resume_broker(&self, name: &str) {
        self.broker(name).process.as_ref().expect("running").signal("CONT");
    }

    /// `kill -9` the broker.
    pub fn kill_broker(&mut self, name: &str) {
        let broker = self.brokers.iter_mut().find(|b| b.name == name).expect("broker");
        broker.process = None;
        self.arm_watchdog();
    }

    /// Starts a killed broker again on the same port and store.
    pub fn restart_broker(&mut self, name: &str) {
        let lib = self.lib.clone();
        let broker = self.brokers.iter_mut().find(|b| b.name == name).expect("broker");
        assert!(broker.process.is_none(), "restart_broker needs a killed broker");
        let conf = broker.conf.to_string_lossy().into_owned();
        let registrations = broker.registrations();
        let process = broker.process.insert(JavaProcess::spawn(
            &lib,
            &broker.home,
            512,
            "org.apache.rocketmq.broker.BrokerStartup",
            &["-c", &conf],
        ));
        // The console log is recreated by each spawn, so "boot success" in it is this start's. Its ports are
        // the test's (clients know them): no others are tried.
        if let Err(PortTaken(log)) = process.wait_for_log("boot success") {
            panic!("the restarted broker's ports were taken while it was down; {log}");
        }
        broker.wait_registered(registrations + 1);
        self.arm_watchdog();
    }
}

/// Runs `start` until it is not refused a port, a few times: ports are chosen free, then bound by another
/// process, and in between a concurrent test may take one.
fn on_free_ports<T>(mut start: impl FnMut() -> Result<T, PortTaken>) -> T {
    const TRIES: usize = 5;
    for attempt in 1.. {
        match start() {
            Ok(started) => return started,
            Err(PortTaken(log)) if attempt < TRIES => eprintln!("harness: a port was taken, trying others; {log}"),
            Err(PortTaken(log)) => panic!("RocketMQ process failed to start {TRIES} times, its ports taken; {log}"),
        }
    }
    unreachable!("the loop returns or panics")
}

/// How a child process ended, for a panic message.
fn exited(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status.signal() {
        Some(signal) => format!("was killed by signal {signal}"),
        None => format!("exited with {status}"),
    }
}

/// Kills a cluster's processes and removes its directory once the test process has exited, however it exits.
///
/// A shell blocked reading a pipe whose write end only this process holds (std's pipes are close-on-exec, so
/// no child inherits it): the pipe closes when this process exits, and the shell wakes. It forks nothing while
/// it waits. (A shell polling the parent with `sleep 1` forked a process a second per cluster, wrapped the
/// machine's 32768 pids within a suite, and at exit SIGKILLed pids that had gone to other processes: the
/// bench's name server, started right after the it suite, died silently.)
struct Watchdog {
    shell: Child,
}

impl Watchdog {
    fn arm(pids: &[u32], dir: &Path) -> Option<Watchdog> {
        let pids = pids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
        let script = format!(
            "read _; kill -CONT {pids} 2>/dev/null; kill -9 {pids} 2>/dev/null; sleep 1; rm -rf '{}'",
            dir.display()
        );
        let shell = Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        Some(Watchdog { shell })
    }
}

impl Drop for Watchdog {
    /// The cluster is being dropped or re-armed: the processes it names are killed by their own guards, and
    /// their pids may soon be other processes'. Killed before its pipe closes, the shell kills nothing.
    fn drop(&mut self) {
        let _ = self.shell.kill();
        let _ = self.shell.wait();
    }
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
