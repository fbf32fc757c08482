//! The real binary's configuration from its environment: in a Kubernetes pod, next to a Service named
//! `popgate`, it starts and becomes ready, saying once which variables it ignored; a typo in a config key still
//! stops it. The Kubernetes manifests shipped in `docker/k8s/` are valid, and so is the config they give a pod.

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

/// The Kubernetes manifests (`docker/k8s/`) are valid for Kubernetes 1.30 (`kubernetes-validate`, from PyPI,
/// installed by docker/setup.sh: `KUBERNETES_VALIDATE` names it), strictly (no unknown field), and the
/// `popgate.toml` their ConfigMap carries loads, with the environment their StatefulSet gives each pod.
#[test]
fn the_kubernetes_manifests_validate_and_their_config_loads_as_a_pod_gets_it() {
    let manifests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docker/k8s");
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(&manifests)
        .expect("docker/k8s")
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "the manifests: {files:?}");
    let tool =
        std::env::var("KUBERNETES_VALIDATE").expect("KUBERNETES_VALIDATE names kubernetes-validate (docker/setup.sh)");
    let checked = std::process::Command::new(tool)
        .args(["--strict", "--kubernetes-version", "1.30.0"])
        .args(&files)
        .output()
        .expect("run kubernetes-validate");
    let said = format!("{}{}", String::from_utf8_lossy(&checked.stdout), String::from_utf8_lossy(&checked.stderr));
    assert!(checked.status.success(), "{said}");
    assert_eq!(said.matches("passed").count(), 6, "each resource checked: {said}");

    // The ConfigMap's popgate.toml, as the pod mounts it.
    let configmap = std::fs::read_to_string(manifests.join("configmap.yaml")).expect("configmap.yaml");
    let toml: String = configmap
        .lines()
        .skip_while(|line| line.trim() != "popgate.toml: |")
        .skip(1)
        .map(|line| line.strip_prefix("    ").unwrap_or(line.trim()))
        .map(|line| format!("{line}\n"))
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("popgate.toml");
    std::fs::write(&path, toml).expect("write");
    let loaded = std::process::Command::new(env!("CARGO_BIN_EXE_popgate"))
        .args(["check-config", "--config"])
        .arg(&path)
        .env("POPGATE_TIER__INSTANCE_ID", "popgate-0")
        .env("POPGATE_TIER__PEER_DNS", "popgate-peers:8090")
        .env("POPGATE_TIER__SECRET", "a-secret-from-the-popgate-tier-secret")
        .output()
        .expect("run popgate check-config");
    let effective = String::from_utf8_lossy(&loaded.stdout);
    assert!(loaded.status.success(), "{effective}{}", String::from_utf8_lossy(&loaded.stderr));
    for line in ["instance_id = \"popgate-0\"", "listen = \"0.0.0.0:8090\"", "peer_dns = \"popgate-peers:8090\""] {
        assert!(effective.contains(line), "{line} in {effective}");
    }
}
