//! The real binary's configuration from its environment: in a Kubernetes pod, next to a Service named
//! `popgate`, it starts and becomes ready, saying once which variables it ignored; a typo in a config key still
//! stops it.

use std::time::Duration;

use crate::harness::popgate::Popgate;
use crate::publish::shared_cluster;

/// What Kubernetes sets in every pod of a namespace that has a Service named `popgate`.
const KUBERNETES_SERVICE_LINKS: [(&str, &str); 7] = [
    ("POPGATE_SERVICE_HOST", "10.96.0.12"),
    ("POPGATE_SERVICE_PORT", "8080"),
    ("POPGATE_PORT", "tcp://10.96.0.12:8080"),
    ("POPGATE_PORT_8080_TCP", "tcp://10.96.0.12:8080"),
    ("POPGATE_PORT_8080_TCP_ADDR", "10.96.0.12"),
    ("POPGATE_PORT_8080_TCP_PORT", "8080"),
    ("POPGATE_PORT_8080_TCP_PROTO", "tcp"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_service_links_in_the_environment_are_ignored_with_one_warning() {
    let cluster = shared_cluster();
    let popgate = Popgate::start_with_env(&cluster.namesrv_addr, "", &KUBERNETES_SERVICE_LINKS).await;
    popgate.wait_ready(Duration::from_secs(30)).await;

    let output = popgate.output();
    let warnings: Vec<&str> = output.lines().filter(|l| l.contains("WARN") && l.contains("POPGATE_")).collect();
    assert_eq!(warnings.len(), 1, "one warning names them all:\n{output}");
    for (name, _) in KUBERNETES_SERVICE_LINKS {
        assert!(warnings[0].contains(name), "{name} missing in {}", warnings[0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typo_in_a_config_key_from_the_environment_still_stops_popgate() {
    let cluster = shared_cluster();
    let mut env = KUBERNETES_SERVICE_LINKS.to_vec();
    env.push(("POPGATE_PUBLISH__SEND_TIMEOUT_MZ", "5000"));
    let (code, output) = Popgate::expect_exit_with_env(&cluster.namesrv_addr, "", &env).await;
    assert_eq!(code, Some(64), "{output}");
    assert!(output.contains("send_timeout_mz"), "the key is named: {output}");
}
