use std::time::Duration;

use super::*;

/// Authentication off, explicitly: the other tests look at other sections.
const AUTH_OFF: &str = "[auth]\nenabled = false\n";

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::from_toml_str(&format!("{AUTH_OFF}{text}"))
}

#[test]
fn empty_file_gives_the_documented_defaults() {
    let config = parse("").expect("defaults are valid");
    assert_eq!(config, Config { auth: AuthConfig { enabled: false, ..AuthConfig::default() }, ..Config::default() });
    assert_eq!(config.publish.retry_times_when_send_failed, 2);
    assert_eq!(config.publish.send_timeout(), Duration::from_secs(3));
    assert!(config.fault_avoidance.enabled);
    assert_eq!(config.fault_avoidance.latency_max_ms, vec![50, 100, 550, 1000, 2000, 3000, 15000]);
    assert_eq!(config.fault_avoidance.not_available_ms, vec![0, 0, 30000, 60000, 120000, 180000, 600000]);
    assert_eq!(config.fault_avoidance.network_error_isolation_ms, 600_000);
    assert_eq!(config.delivery.max_attempts, 6);
    assert_eq!(config.delivery.initial_backoff_ms, 1_000);
    assert_eq!(config.delivery.max_backoff_ms, 16_000);
    assert!((config.delivery.jitter_ratio - 0.2).abs() < f64::EPSILON);
}

#[test]
fn the_annotated_example_file_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("popgate.toml");
    let text = std::fs::read_to_string(&path).expect("popgate.toml is in the repo");
    Config::from_toml_str(&text).expect("the example config is valid");
}

#[test]
fn an_unknown_key_is_named() {
    let err = parse("[publish]\nsend_timout_ms = 10\n").unwrap_err().to_string();
    assert!(err.contains("send_timout_ms"), "{err}");
    assert!(err.contains("publish"), "{err}");
}

#[test]
fn a_wrong_type_is_named_with_its_key() {
    let err = parse("[publish]\nsend_timeout_ms = \"soon\"\n").unwrap_err().to_string();
    assert!(err.contains("publish.send_timeout_ms"), "{err}");
}

#[test]
fn every_out_of_range_value_is_reported_at_once() {
    let text = "[publish]\nretry_times_when_send_failed = 4\n[delivery]\npop_batch = 64\njitter_ratio = 1.5\n";
    let err = parse(text).unwrap_err().to_string();
    for key in ["publish.retry_times_when_send_failed", "delivery.pop_batch", "delivery.jitter_ratio"] {
        assert!(err.contains(key), "{key} missing in {err}");
    }
}

#[test]
fn fault_tables_must_pair_up() {
    let text = "[fault_avoidance]\nlatency_max_ms = [10, 20]\nnot_available_ms = [0]\n";
    let err = parse(text).unwrap_err().to_string();
    assert!(err.contains("fault_avoidance.not_available_ms"), "{err}");
}

#[test]
fn a_bad_name_server_address_is_refused() {
    let err = parse("[broker]\nnamesrv_addr = \"localhost\"\n").unwrap_err().to_string();
    assert!(err.contains("broker.namesrv_addr"), "{err}");
}

#[test]
// figment's Jail scopes the environment and working directory to the closure (its error type is large).
#[allow(clippy::result_large_err)]
fn environment_overrides_the_file_with_double_underscore_nesting() {
    figment::Jail::expect_with(|jail| {
        jail.create_file("popgate.toml", "[auth]\nenabled = false\n[publish]\nsend_timeout_ms = 1000\n")?;
        jail.set_env("POPGATE_PUBLISH__SEND_TIMEOUT_MS", "2500");
        jail.set_env("POPGATE_BROKER__NAMESRV_ADDR", "127.0.0.1:9999");
        let config = Config::load(Some(Path::new("popgate.toml"))).expect("valid").config;
        assert_eq!(config.publish.send_timeout_ms, 2500);
        assert_eq!(config.broker.namesrv_addrs(), vec!["127.0.0.1:9999".to_owned()]);
        Ok(())
    });
}

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

#[test]
#[allow(clippy::result_large_err)]
fn kubernetes_service_links_are_not_config_and_are_named_in_one_warning() {
    figment::Jail::expect_with(|jail| {
        jail.create_file("popgate.toml", AUTH_OFF)?;
        for (name, value) in KUBERNETES_SERVICE_LINKS {
            jail.set_env(name, value);
        }
        jail.set_env("POPGATE_PUBLISH__SEND_TIMEOUT_MS", "2500");
        let loaded = Config::load(Some(Path::new("popgate.toml"))).expect("service links do not stop popgate");
        assert_eq!(loaded.config.publish.send_timeout_ms, 2500, "real overrides still apply");
        assert_eq!(loaded.config.server, ServerConfig::default(), "`POPGATE_PORT` is not `server.*`");
        let mut expected: Vec<String> = KUBERNETES_SERVICE_LINKS.iter().map(|(name, _)| (*name).to_owned()).collect();
        expected.sort();
        assert_eq!(loaded.ignored_env, expected);
        let warning = loaded.ignored_env_warning().expect("one warning");
        for name in &expected {
            assert!(warning.contains(name.as_str()), "{name} missing in {warning}");
        }
        Ok(())
    });
}

#[test]
#[allow(clippy::result_large_err)]
fn a_typo_in_a_known_section_is_still_an_error_beside_the_service_links() {
    figment::Jail::expect_with(|jail| {
        jail.create_file("popgate.toml", AUTH_OFF)?;
        for (name, value) in KUBERNETES_SERVICE_LINKS {
            jail.set_env(name, value);
        }
        jail.set_env("POPGATE_PUBLISH__SEND_TIMEOUT_MZ", "2500");
        let err = Config::load(Some(Path::new("popgate.toml"))).unwrap_err().to_string();
        assert!(err.contains("send_timeout_mz") && err.contains("publish"), "{err}");
        assert!(!err.contains("service_host") && !err.contains("port_8080"), "only the typo is reported: {err}");
        Ok(())
    });
    figment::Jail::expect_with(|jail| {
        jail.create_file("popgate.toml", AUTH_OFF)?;
        // A section's name alone is the section, not a variable to ignore.
        jail.set_env("POPGATE_DELIVERY", "fast");
        let err = Config::load(Some(Path::new("popgate.toml"))).unwrap_err().to_string();
        assert!(err.contains("delivery"), "{err}");
        Ok(())
    });
}

#[test]
fn every_section_of_the_file_is_a_section_the_environment_may_set() {
    let mut sections = section_names();
    sections.sort();
    let expected = [
        "admin",
        "auth",
        "broker",
        "delivery",
        "fault_avoidance",
        "grpc",
        "publish",
        "reliability",
        "remoting",
        "server",
        "tier",
        "transactions",
        "webhook",
    ];
    assert_eq!(sections, expected);
    assert!(names_a_section("PUBLISH.SEND_TIMEOUT_MS", &sections), "the filter sees keys before lowercasing");
    assert!(!names_a_section("PORT_8080_TCP", &sections));
}

#[test]
fn a_missing_file_is_an_error_not_defaults() {
    let err = Config::load_from(Some(Path::new("/nonexistent/popgate.toml")), Env::prefixed("POPGATE_TEST_NONE_"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not exist"), "{err}");
}

#[test]
fn each_profile_maps_to_the_seed_combination() {
    let table: Vec<(Profile, bool, bool)> =
        Profile::ALL.iter().map(|p| (*p, p.sync_flush(), p.sync_replication())).collect();
    assert_eq!(
        table,
        vec![
            (Profile::Financial, true, true),
            (Profile::Durable, true, false),
            (Profile::Balanced, false, true),
            (Profile::Throughput, false, false),
        ]
    );
    assert_eq!(Config::default().reliability.profile, Profile::Balanced, "the seed's recommended default");
}

#[test]
fn a_profile_is_chosen_by_name_and_an_unknown_name_is_refused() {
    let config = parse("[reliability]\nprofile = \"financial\"\n").expect("valid");
    assert_eq!(config.reliability.profile, Profile::Financial);
    let err = parse("[reliability]\nprofile = \"paranoid\"\n").unwrap_err().to_string();
    assert!(err.contains("reliability.profile"), "{err}");
}

#[test]
fn authentication_is_on_unless_switched_off_explicitly() {
    assert!(Config::default().auth.enabled);
    let err = Config::from_toml_str("").unwrap_err().to_string();
    assert!(err.contains("auth.tokens") && err.contains("auth.enabled = false"), "{err}");
}

#[test]
fn tokens_are_checked_one_by_one() {
    let text = r#"
[[auth.tokens]]
name = "short"
token = "abc"
[[auth.tokens]]
name = "both"
token = "0123456789abcdef"
sha256 = "00"
[[auth.tokens]]
name = "short"
sha256 = "zz"
publish = ["orders.*"]
"#;
    let err = Config::from_toml_str(text).unwrap_err().to_string();
    for expected in [
        "auth.tokens[0].token`: must be at least 16",
        "auth.tokens[1].token`: give exactly one",
        "auth.tokens[2].name`: `short` is used twice",
        "auth.tokens[2].sha256`: must be 64 hex",
        "pattern `orders.*`",
    ] {
        assert!(err.contains(expected), "{expected} missing in {err}");
    }
}

#[test]
fn acl_entries_and_subscribe_patterns_are_checked_with_the_token() {
    let text = r#"
[[auth.tokens]]
name = "app"
token = "0123456789abcdef"
subscribe = ["orders.*"]
acl = [
  { resource = "Topic:orders", actions = ["Pub"], source_ips = ["10.0.0.0/8"] },
  { resource = "Queue:q", actions = ["Sub"] },
  { resource = "Group:g", actions = ["Create"] },
  { resource = "Topic:t", actions = ["Sub"], decision = "Perhaps" },
]
"#;
    let err = Config::from_toml_str(text).unwrap_err().to_string();
    for expected in [
        "pattern `orders.*`",
        "auth.tokens[0].acl[1]`: resource `Queue:q`",
        "auth.tokens[0].acl[2]`: action `Create`",
        "auth.tokens[0].acl[3]`: decision `perhaps`",
    ] {
        assert!(err.contains(expected), "{expected} missing in {err}");
    }
    assert!(!err.contains("acl[0]"), "{err}");
    let bad_network = "[[auth.tokens]]\nname = \"a\"\ntoken = \"0123456789abcdef\"\n\
                       acl = [{ resource = \"*\", actions = [\"All\"], source_ips = [\"10.0.0.300\"] }]\n";
    let err = Config::from_toml_str(bad_network).unwrap_err().to_string();
    assert!(err.contains("10.0.0.300"), "{err}");
}

#[test]
fn tls_needs_both_files() {
    let err = parse("[server]\ntls_cert_path = \"/nonexistent/cert.pem\"\n").unwrap_err().to_string();
    assert!(err.contains("server.tls_key_path") && err.contains("server.tls_cert_path"), "{err}");
}

#[test]
fn webhooks_reach_public_addresses_only_unless_networks_are_allowed() {
    assert!(parse("").expect("defaults").webhook.allowed_networks.is_empty(), "nothing internal by default");
    let config =
        parse("[webhook]\nallowed_networks = [\"10.1.0.0/16\", \"127.0.0.1\", \"fd00:1::/64\", \"10.2.3.4/8\"]\n")
            .expect("CIDRs and single addresses");
    let written: Vec<String> = config.webhook.allowed_networks.iter().map(ToString::to_string).collect();
    assert_eq!(written, ["10.1.0.0/16", "127.0.0.1/32", "fd00:1::/64", "10.0.0.0/8"], "host bits cut off");
    for bad in ["10.1.0.0/33", "localhost", "", "10.1.0.0/16 "] {
        let text = format!("[webhook]\nallowed_networks = [\"{bad}\"]\n");
        match parse(&text) {
            Err(err) => {
                let err = err.to_string();
                assert!(err.contains("webhook.allowed_networks") && err.contains("not a network"), "{bad}: {err}");
            }
            // A trailing space is trimmed, not an error.
            Ok(config) => assert_eq!(bad.trim(), "10.1.0.0/16", "{bad:?} accepted: {:?}", config.webhook),
        }
    }
}

#[test]
fn the_remoting_front_is_off_by_default_and_its_bad_keys_are_named() {
    let config = parse("").expect("defaults are valid");
    assert_eq!(config.remoting.listen_addr(), None, "off unless switched on");
    let on = parse("[remoting]\nlisten = \"127.0.0.1:9876\"\n").expect("valid");
    let bound: std::net::SocketAddr = "127.0.0.1:9876".parse().expect("addr");
    assert_eq!(on.remoting.advertised(bound), "127.0.0.1:9876", "clients are given the listen address");
    for (text, key) in [
        ("[remoting]\nlisten = \"nine-eight\"\n", "remoting.listen"),
        // Clients cannot connect to 0.0.0.0: the address they are given must be said.
        ("[remoting]\nlisten = \"0.0.0.0:9876\"\n", "remoting.advertised_addr"),
        ("[remoting]\nadvertised_addr = \"popgate\"\n", "remoting.advertised_addr"),
        ("[remoting]\nmax_frame_bytes = 100\n", "remoting.max_frame_bytes"),
        ("[remoting]\nmax_connections = 0\n", "remoting.max_connections"),
        ("[grpc]\nmax_connections = 0\n", "grpc.max_connections"),
        ("[remoting]\nclient_expiry_secs = 5\n", "remoting.client_expiry_secs"),
    ] {
        let err = parse(text).unwrap_err().to_string();
        assert!(err.contains(key), "{text}: {err}");
    }
    let behind =
        parse("[remoting]\nlisten = \"0.0.0.0:9876\"\nadvertised_addr = \"popgate.internal:9876\"\n").expect("valid");
    assert_eq!(behind.remoting.advertised(bound), "popgate.internal:9876");
}

#[test]
fn a_tier_needs_a_peer_link_with_a_secret_and_a_valid_instance_id() {
    let error = |text: &str| parse(text).expect_err("refused").to_string();
    let tier = "[tier]\nlisten = \"127.0.0.1:8090\"\npeers = [\"127.0.0.1:8091\"]\n";
    assert!(error(tier).contains("tier.secret"), "{}", error(tier));
    let with_secret = format!("{tier}secret = \"tier-secret-0123456789\"\n");
    let config = parse(&with_secret).expect("a tier");
    assert_eq!((config.tier.refresh_secs, config.tier.forward_timeout_ms), (10, 3_000));
    assert_eq!(config.tier.give_back_unclaimed_ms, 20_000);
    assert!(error(&format!("{with_secret}give_back_unclaimed_ms = 10\n")).contains("tier.give_back_unclaimed_ms"));
    assert_eq!(config.tier.max_ends_asked_at_once, 64);
    assert!(error(&format!("{with_secret}max_ends_asked_at_once = 0\n")).contains("tier.max_ends_asked_at_once"));
    assert!(error("[tier]\npeers = [\"127.0.0.1:8091\"]\n").contains("tier.listen"));
    assert!(error(&format!("{with_secret}instance_id = \"Popgate_0\"\n")).contains("tier.instance_id"));
    assert!(error(&format!("{with_secret}instance_id = \"{}\"\n", "a".repeat(41))).contains("tier.instance_id"));
    assert!(error("[tier]\nlisten = \"127.0.0.1:8090\"\nsecret = \"short\"\n").contains("tier.secret"));
    assert!(
        error(&format!("{tier}secret = \"tier-secret-0123456789\"\npeer_dns = \"no-port\"\n")).contains("tier.peers")
    );
}

#[test]
fn the_peer_links_tls_needs_its_three_files_together_and_readable() {
    let error = |text: &str| parse(text).expect_err("refused").to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let [cert, key, ca] = ["cert.pem", "key.pem", "ca.pem"].map(|name| {
        let path = dir.path().join(name);
        std::fs::write(&path, "read at start, not here").expect("write");
        path.display().to_string()
    });
    let tier =
        "[tier]\nlisten = \"127.0.0.1:8090\"\npeers = [\"127.0.0.1:8091\"]\nsecret = \"tier-secret-0123456789\"\n";
    let config = parse(tier).expect("plaintext by default");
    assert_eq!(config.tier.tls_files(), None);
    assert_eq!(config.tier.tls_server_name, None);

    let all = format!("{tier}tls_cert_path = \"{cert}\"\ntls_key_path = \"{key}\"\ntls_ca_path = \"{ca}\"\n");
    let config = parse(&all).expect("mutual TLS");
    assert_eq!(
        config.tier.tls_files(),
        Some((Path::new(&cert), Path::new(&key), Path::new(&ca))),
        "all three are kept"
    );
    let named = parse(&format!("{all}tls_server_name = \"popgate-peer.tier.internal\"\n")).expect("a name");
    assert_eq!(named.tier.tls_server_name.as_deref(), Some("popgate-peer.tier.internal"));

    // Two of three: the missing one is named.
    let without_ca = format!("{tier}tls_cert_path = \"{cert}\"\ntls_key_path = \"{key}\"\n");
    let text = error(&without_ca);
    assert!(text.contains("`tier.tls_ca_path`: missing"), "{text}");
    assert!(!text.contains("`tier.tls_cert_path`") && !text.contains("`tier.tls_key_path`"), "{text}");
    let text = error(&format!("{tier}tls_ca_path = \"{ca}\"\n"));
    assert!(text.contains("`tier.tls_cert_path`: missing") && text.contains("`tier.tls_key_path`: missing"), "{text}");

    // A file that is not there is named with its key.
    let gone = dir.path().join("gone.pem").display().to_string();
    let text = error(&all.replace(&key, &gone));
    assert!(text.contains("tier.tls_key_path") && text.contains(&gone), "{text}");

    // A server name only with TLS, and only a name.
    let text = error(&format!("{tier}tls_server_name = \"peer.internal\"\n"));
    assert!(text.contains("tier.tls_server_name"), "{text}");
    let text = error(&format!("{all}tls_server_name = \"not a name\"\n"));
    assert!(text.contains("tier.tls_server_name") && text.contains("not a name"), "{text}");
    // TLS files with no peer link to use them.
    let text =
        error(&format!("[tier]\ntls_cert_path = \"{cert}\"\ntls_key_path = \"{key}\"\ntls_ca_path = \"{ca}\"\n"));
    assert!(text.contains("tier.listen"), "{text}");
}
