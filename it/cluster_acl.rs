//! RocketMQ's own ACL 2.0, read from the cluster (issue #33): a broker with authentication and authorization
//! on, a user and its ACL made with `mqadmin createUser / createAcl`, and popgate given only a Super user's
//! credentials (`broker.access_key`) and `auth.cluster_acl`: the app's access key and secret work through popgate
//! unchanged, and its ACL allows and denies through popgate as it does straight at the cluster, for Apache's
//! Java remoting client and the 5.x gRPC SDK alike. An ACL changed while popgate runs takes effect within a
//! refresh.

use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::direct::Direct;
use crate::harness::eventually;
use crate::harness::remoting::RemotingClient;
use crate::harness::rocketmq::{Cluster, ClusterSpec};
use crate::harness::sdk::Sdk;
use crate::harness::unique_topic;
use crate::remoting::popgate_with_remoting;

/// How long one driver run may take on a loaded machine (JVM start, client start, the scenario).
const DRIVER_TIMEOUT: Duration = Duration::from_secs(180);

/// The cluster's Super user: the broker creates it at first start, and popgate signs as it.
const ADMIN: (&str, &str) = ("rocketmq", "12345678");
/// An app's user, made with `mqadmin createUser`.
const APP: (&str, &str) = ("acl-app", "acl-app-secret-0123");

/// A broker with ACL 2.0 on (authentication and authorization), as RocketMQ 5.3+ documents it.
fn cluster_with_acl() -> Cluster {
    let mut spec = ClusterSpec::brokers(&["broker-a"]);
    spec.broker_conf.extend(
        [
            "authenticationEnabled=true",
            "authenticationProvider=org.apache.rocketmq.auth.authentication.provider.DefaultAuthenticationProvider",
            "authenticationMetadataProvider=org.apache.rocketmq.auth.authentication.provider.LocalAuthenticationMetadataProvider",
            "authorizationEnabled=true",
            "authorizationProvider=org.apache.rocketmq.auth.authorization.provider.DefaultAuthorizationProvider",
            "authorizationMetadataProvider=org.apache.rocketmq.auth.authorization.provider.LocalAuthorizationMetadataProvider",
            r#"initAuthenticationUser={"username":"rocketmq","password":"12345678"}"#,
            r#"innerClientAuthenticationCredentials={"accessKey":"rocketmq","secretKey":"12345678"}"#,
        ]
        .map(str::to_owned),
    );
    Cluster::start(&spec)
}

/// A remoting driver's arguments, signed as `user`.
fn remoting_args(namesrv: &str, user: (&str, &str), mut extra: Value) -> Value {
    extra["namesrv"] = json!(namesrv);
    extra["accessKey"] = json!(user.0);
    extra["secretKey"] = json!(user.1);
    extra["pollNameServerIntervalMs"] = json!(1000);
    extra["heartbeatBrokerIntervalMs"] = json!(2000);
    extra
}

/// [`remoting_args`] for a producer: one attempt, 30 s for it. The time counts from the client's call, and on a
/// loaded machine a cold client's own preparations (route, connection, signing) once took 8.3 s of 10, leaving
/// 1.7 s for the answer: the refusal, not the client's speed, is what these checks are about.
fn send_args(namesrv: &str, user: (&str, &str), mut extra: Value) -> Value {
    extra["sendTimeoutMs"] = json!(30_000);
    extra["retryTimes"] = json!(0);
    remoting_args(namesrv, user, extra)
}

/// The response code a refused remoting send ended with (`None`: it was not refused).
async fn remoting_send_refusal(client: RemotingClient, namesrv: &str, user: (&str, &str), topic: &str) -> Option<i64> {
    let args = send_args(namesrv, user, json!({"topic": topic, "group": "acl_p", "count": 1, "bodyPrefix": "x"}));
    let result = client.start("produce", &args).finish_allowing_error(DRIVER_TIMEOUT).await;
    if result["errors"] == json!([]) {
        return None;
    }
    let code =
        result.to_string().split("\"code\":").nth(1).and_then(|rest| {
            rest.chars().take_while(|c| c.is_ascii_digit() || *c == '-').collect::<String>().parse().ok()
        });
    Some(code.unwrap_or_else(|| panic!("a refusal names its code: {result}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apps_cluster_credentials_and_acl_work_through_popgate_as_straight_at_the_cluster() {
    let cluster = cluster_with_acl();
    let (allowed, denied, later) = (unique_topic("acl_ok"), unique_topic("acl_no"), unique_topic("acl_later"));
    let group = unique_topic("acl_g");
    let on_cluster = ["-c", cluster.name()];
    for topic in [&allowed, &denied, &later] {
        cluster.mqadmin(ADMIN, "updateTopic", &[&on_cluster[..], &["-t", topic]].concat());
    }
    cluster.mqadmin(ADMIN, "createUser", &[&on_cluster[..], &["-u", APP.0, "-p", APP.1, "-t", "Normal"]].concat());
    let resources = format!("Topic:{allowed},Group:{group},Group:acl_p");
    let subject = format!("User:{}", APP.0);
    let grant = ["-s", &subject, "-r", &resources, "-a", "Pub,Sub", "-d", "Allow"];
    cluster.mqadmin(ADMIN, "createAcl", &[&on_cluster[..], &grant].concat());

    // popgate knows no token: only the Super user it signs with, and the cluster's users and ACLs.
    let config = format!(
        "[broker]\naccess_key = \"{}\"\nsecret_key = \"{}\"\n\n[auth]\nenabled = true\ncluster_acl = true\n\
         cluster_acl_refresh_secs = 1\n",
        ADMIN.0, ADMIN.1
    );
    let (popgate, namesrv) = popgate_with_remoting(&cluster, &config).await;
    let client = RemotingClient::V5;

    // The same client, the same credentials: allowed straight at the cluster and through popgate.
    for (path, at) in [("straight", cluster.namesrv_addr.as_str()), ("popgate", namesrv.as_str())] {
        let args = send_args(at, APP, json!({"topic": allowed, "group": "acl_p", "count": 1, "bodyPrefix": path}));
        let sent = client.run("produce", &args, DRIVER_TIMEOUT).await;
        assert_eq!(sent["errors"], json!([]), "{path}: the app's ACL allows it: {sent}");
        // Denied the same way: the broker's and popgate's NO_PERMISSION.
        let refused = remoting_send_refusal(client, at, APP, &denied).await;
        assert_eq!(refused, Some(16), "{path}: no entry of the app's ACL covers {denied}");
        let forged = remoting_send_refusal(client, at, (APP.0, "not-the-app-secret"), &allowed).await;
        assert!(forged.is_some(), "{path}: a wrong secret is refused");
    }

    // The 5.x SDK with the same credentials, through popgate's gRPC front.
    let sdk = Sdk::NEWEST;
    let creds = |topic: &str| {
        json!({"endpoint": popgate.grpc, "accessKey": APP.0, "secretKey": APP.1, "topic": topic, "count": 1,
               "prefix": "grpc"})
    };
    let sent = sdk.run("produce", &creds(&allowed), DRIVER_TIMEOUT).await;
    assert_eq!(sent["errors"], json!([]), "gRPC: the app's ACL allows it: {sent}");
    // Neither Pub nor Sub on the topic: its route is refused (QueryRoute, as by Apache's ACL 2.0), so the SDK
    // does not start and sends nothing.
    let refused = sdk.start("produce", &creds(&denied)).finish_allowing_error(DRIVER_TIMEOUT).await;
    assert!(refused.get("cause").is_some(), "gRPC: the app's ACL denies it: {refused}");

    // A consumer of the app reads what was allowed, through popgate, as the group its ACL names.
    let consume = remoting_args(&namesrv, APP, json!({"topic": allowed, "group": group, "expect": 3}));
    let received = client.run("push-consume", &consume, DRIVER_TIMEOUT).await;
    assert_eq!(received["received"].as_array().map(Vec::len), Some(3), "{received}");
    let other_group = remoting_args(
        &namesrv,
        APP,
        json!({"topic": allowed, "group": "acl_not_granted", "expect": 1, "timeoutMs": 8000}),
    );
    let refused = client.start("push-consume", &other_group).finish_allowing_error(DRIVER_TIMEOUT).await;
    assert!(refused["received"].as_array().is_none_or(Vec::is_empty), "a group the ACL does not name: {refused}");

    // An ACL changed while popgate runs: within a refresh, popgate allows what the cluster now allows.
    assert_eq!(remoting_send_refusal(client, &namesrv, APP, &later).await, Some(16));
    let later_resource = format!("Topic:{later}");
    let more = ["-s", &subject, "-r", &later_resource, "-a", "Pub", "-d", "Allow"];
    cluster.mqadmin(ADMIN, "updateAcl", &[&on_cluster[..], &more].concat());
    eventually(Duration::from_secs(90), "the new ACL entry is read", || async {
        remoting_send_refusal(client, &namesrv, APP, &later).await.is_none()
    })
    .await;

    let direct = Direct::connect_as(&cluster.namesrv_addr, ADMIN.0, ADMIN.1).await;
    assert_eq!(direct.read_all(&allowed).await.len(), 3, "straight, through remoting and through gRPC");
    assert!(direct.try_read_all(&denied).await.unwrap_or_default().is_empty(), "nothing denied was stored");
    assert!(popgate.metric("popgate_cluster_acl_reads_total{result=\"ok\"}").await >= 2.0);
    assert_eq!(popgate.metric("popgate_cluster_acl_reads_total{result=\"failed\"}").await, 0.0);
}
