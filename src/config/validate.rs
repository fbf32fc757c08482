//! Range and cross-field checks, each problem reported with its key.

use super::{Config, MAX_RETRY_TIMES_WHEN_SEND_FAILED};

/// RocketMQ's POP refuses batches larger than 32 (`maxMsgNums`).
const MAX_POP_BATCH: u32 = 32;
/// The longest broker lease: 12 h, the longest invisible time Apache's proxy lets a client ask for.
const MAX_BROKER_LEASE_MS: u64 = 12 * 3600 * 1000;

/// Every problem in `config`, one line each, naming the key. Empty when the configuration is usable.
pub(super) fn problems(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |ok: bool, key: &str, reason: &str| {
        if !ok {
            out.push(format!("config key `{key}`: {reason}"));
        }
    };

    let addrs = config.broker.namesrv_addrs();
    check(!addrs.is_empty(), "broker.namesrv_addr", "must name at least one host:port");
    for addr in &addrs {
        check(
            addr.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok()),
            "broker.namesrv_addr",
            &format!("`{addr}` is not host:port"),
        );
    }
    check(config.broker.route_ttl_ms > 0, "broker.route_ttl_ms", "must be > 0");
    check(config.broker.request_timeout_ms > 0, "broker.request_timeout_ms", "must be > 0");

    let publish = &config.publish;
    check(
        publish.retry_times_when_send_failed <= MAX_RETRY_TIMES_WHEN_SEND_FAILED,
        "publish.retry_times_when_send_failed",
        &format!("must be at most {MAX_RETRY_TIMES_WHEN_SEND_FAILED} (RocketMQ's maximum)"),
    );
    check(
        publish.retry_times_when_send_async_failed <= MAX_RETRY_TIMES_WHEN_SEND_FAILED,
        "publish.retry_times_when_send_async_failed",
        &format!("must be at most {MAX_RETRY_TIMES_WHEN_SEND_FAILED}"),
    );
    check(publish.send_timeout_ms > 0, "publish.send_timeout_ms", "must be > 0");
    check(publish.max_message_bytes > 0, "publish.max_message_bytes", "must be > 0");
    check(publish.max_batch_messages > 0, "publish.max_batch_messages", "must be > 0");
    check(publish.dedup_window_secs <= 7 * 24 * 3600, "publish.dedup_window_secs", "must be at most 604800 (7 days)");

    let fault = &config.fault_avoidance;
    check(
        !fault.latency_max_ms.is_empty() && fault.latency_max_ms.len() == fault.not_available_ms.len(),
        "fault_avoidance.not_available_ms",
        "must have one entry per fault_avoidance.latency_max_ms entry",
    );
    check(
        fault.latency_max_ms.windows(2).all(|w| w[0] < w[1]),
        "fault_avoidance.latency_max_ms",
        "must be strictly ascending",
    );
    check(
        fault.not_available_ms.windows(2).all(|w| w[0] <= w[1]),
        "fault_avoidance.not_available_ms",
        "must not decrease",
    );

    let delivery = &config.delivery;
    check(!delivery.state_dir.as_os_str().is_empty(), "delivery.state_dir", "must be a directory path");
    // The defaults of every subscription: the bounds each subscription is checked against, too.
    for (setting, reason) in super::bounds::check(
        delivery.ack_timeout_ms,
        delivery.max_attempts,
        delivery.initial_backoff_ms,
        delivery.max_backoff_ms,
    ) {
        check(false, setting.config_key(), &reason);
    }
    check((0.0..1.0).contains(&delivery.jitter_ratio), "delivery.jitter_ratio", "must be in [0, 1)");
    check(delivery.lease_ms >= 1_000, "delivery.lease_ms", "must be >= 1000");
    check(
        (delivery.lease_ms..=MAX_BROKER_LEASE_MS).contains(&delivery.max_lease_ms),
        "delivery.max_lease_ms",
        &format!("must be in delivery.lease_ms..={MAX_BROKER_LEASE_MS} (12 h)"),
    );
    check(delivery.lease_renewals_per_sec >= 1, "delivery.lease_renewals_per_sec", "must be >= 1");
    check(delivery.idle_subscription_expiry_secs >= 1, "delivery.idle_subscription_expiry_secs", "must be >= 1");
    check(
        (1..=MAX_POP_BATCH).contains(&delivery.pop_batch),
        "delivery.pop_batch",
        &format!("must be in 1..={MAX_POP_BATCH} (the broker's POP limit)"),
    );
    check(delivery.pop_poll_ms > 0, "delivery.pop_poll_ms", "must be > 0");
    check(delivery.pop_polls_per_sec >= 1, "delivery.pop_polls_per_sec", "must be >= 1");
    check(
        super::bounds::PREFETCH.contains(&delivery.prefetch),
        "delivery.prefetch",
        &format!("must be in {}..={}", super::bounds::PREFETCH.start(), super::bounds::PREFETCH.end()),
    );
    check(delivery.max_in_flight >= 1, "delivery.max_in_flight", "must be >= 1");
    check(
        (1..=delivery.max_in_flight).contains(&delivery.max_in_flight_per_subscription),
        "delivery.max_in_flight_per_subscription",
        "must be in 1..=delivery.max_in_flight",
    );
    check(
        delivery.gauge_refresh_ms >= super::MIN_GAUGE_REFRESH_MS,
        "delivery.gauge_refresh_ms",
        &format!("must be >= {}", super::MIN_GAUGE_REFRESH_MS),
    );
    check(delivery.gauge_requests_per_sec >= 1, "delivery.gauge_requests_per_sec", "must be >= 1");

    let reliability = &config.reliability;
    check(
        (1..=10_000).contains(&reliability.group_commit_interval_ms),
        "reliability.group_commit_interval_ms",
        "must be in 1..=10000 (it bounds how much acknowledged state a power loss can take)",
    );
    check(reliability.broker_check_interval_secs > 0, "reliability.broker_check_interval_secs", "must be > 0");

    let server = &config.server;
    check(
        server.tls_cert_path.is_some() == server.tls_key_path.is_some(),
        "server.tls_key_path",
        "give both server.tls_cert_path and server.tls_key_path, or neither",
    );
    let grpc = &config.grpc;
    check(
        grpc.listen.trim().is_empty() || grpc.listen_addr().is_some(),
        "grpc.listen",
        &format!("`{}` is not host:port (leave it empty to switch the gRPC front off)", grpc.listen),
    );
    check(
        grpc.tls_cert_path.is_some() == grpc.tls_key_path.is_some(),
        "grpc.tls_cert_path",
        "give both grpc.tls_cert_path and grpc.tls_key_path, or neither",
    );
    check(
        grpc.min_invisible_ms <= grpc.max_invisible_ms,
        "grpc.min_invisible_ms",
        "must not be more than grpc.max_invisible_ms",
    );
    for (key, value) in [
        ("grpc.max_receives_per_token", grpc.max_receives_per_token),
        ("grpc.max_streams_per_token", grpc.max_streams_per_token),
        ("grpc.max_clients", grpc.max_clients),
    ] {
        check(value > 0, key, "must be > 0");
    }
    let remoting = &config.remoting;
    check(
        remoting.listen.trim().is_empty() || remoting.listen_addr().is_some(),
        "remoting.listen",
        &format!("`{}` is not host:port (leave it empty to switch the remoting front off)", remoting.listen),
    );
    let unreachable = remoting.listen_addr().is_some_and(|a| a.ip().is_unspecified());
    check(
        !unreachable || !remoting.advertised_addr.trim().is_empty(),
        "remoting.advertised_addr",
        "must name the host:port clients reach popgate at when remoting.listen is an unspecified address",
    );
    let advertised = remoting.advertised_addr.trim();
    check(
        advertised.is_empty()
            || advertised.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()),
        "remoting.advertised_addr",
        &format!("`{advertised}` is not host:port"),
    );
    check(
        (64 * 1024..=1024 * 1024 * 1024).contains(&remoting.max_frame_bytes),
        "remoting.max_frame_bytes",
        "must be in 65536..=1073741824",
    );
    check(
        remoting.max_frame_bytes_in_flight >= remoting.max_frame_bytes
            && u32::try_from(remoting.max_frame_bytes_in_flight).is_ok(),
        "remoting.max_frame_bytes_in_flight",
        "must be at least remoting.max_frame_bytes, and under 4 GiB",
    );
    check(remoting.max_connections > 0, "remoting.max_connections", "must be > 0");
    check(remoting.idle_timeout_secs > 0, "remoting.idle_timeout_secs", "must be > 0");
    check(remoting.max_requests_per_connection > 0, "remoting.max_requests_per_connection", "must be > 0");
    check(remoting.max_clients > 0, "remoting.max_clients", "must be > 0");
    check(
        remoting.client_expiry_secs >= 30,
        "remoting.client_expiry_secs",
        "must be >= 30 (clients heartbeat every 30 s)",
    );
    for (key, path) in [("server.tls_cert_path", &server.tls_cert_path), ("server.tls_key_path", &server.tls_key_path)]
    {
        if let Some(path) = path {
            check(path.is_file(), key, &format!("{} is not a readable file", path.display()));
        }
    }
    check(server.max_uri_bytes >= 256, "server.max_uri_bytes", "must be >= 256");
    check(server.max_header_bytes >= 1024, "server.max_header_bytes", "must be >= 1024");
    check(server.max_waiters_per_token >= 1, "server.max_waiters_per_token", "must be >= 1");
    check(server.max_streams_per_token >= 1, "server.max_streams_per_token", "must be >= 1");
    check(server.max_ack_batch >= 1, "server.max_ack_batch", "must be >= 1");
    check(server.max_connections > 0, "server.max_connections", "must be > 0");
    check(config.grpc.max_concurrent_streams > 0, "grpc.max_concurrent_streams", "must be > 0");
    check(config.grpc.max_connections > 0, "grpc.max_connections", "must be > 0");
    check(config.grpc.call_timeout_secs > 0, "grpc.call_timeout_secs", "must be > 0");
    check(server.idle_timeout_secs > 0, "server.idle_timeout_secs", "must be > 0");
    check(server.body_timeout_secs > 0, "server.body_timeout_secs", "must be > 0");
    check(
        (1..=10_000).contains(&config.admin.replay_rate_per_sec),
        "admin.replay_rate_per_sec",
        "must be in 1..=10000",
    );
    let transactions = &config.transactions;
    check(
        super::names::is_valid_name(&transactions.producer_group),
        "transactions.producer_group",
        "must be a RocketMQ group name (letters, digits, `%`, `|`, `-`, `_`; at most 127 characters)",
    );
    check(
        transactions.record_retention_secs >= 60,
        "transactions.record_retention_secs",
        "must be >= 60 (the broker checks a transaction back after 6 s, then every 30 s)",
    );
    for (group, checker) in &transactions.checkers {
        let key = format!("transactions.checkers.{group}");
        check(
            super::names::is_valid_name(group),
            &key,
            "the producer group must be a RocketMQ group name (letters, digits, `%`, `|`, `-`, `_`)",
        );
        let url = reqwest::Url::parse(&checker.url).ok();
        check(
            url.is_some_and(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some()),
            &format!("{key}.url"),
            "must be an http or https URL with a host",
        );
        check(
            checker.secret.len() >= MIN_TOKEN_LEN,
            &format!("{key}.secret"),
            &format!("must be at least {MIN_TOKEN_LEN} characters"),
        );
        check((100..=60_000).contains(&checker.timeout_ms), &format!("{key}.timeout_ms"), "must be in 100..=60000");
    }
    out.extend(auth_problems(&config.auth));
    out.extend(cluster_acl_problems(config));
    out.extend(tier_problems(&config.tier));
    out
}

fn tier_problems(tier: &super::TierConfig) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |ok: bool, key: &str, reason: &str| {
        if !ok {
            out.push(format!("config key `tier.{key}`: {reason}"));
        }
    };
    if let Some(id) = &tier.instance_id {
        check(
            super::is_valid_instance_id(id),
            "instance_id",
            "must be 1 to 40 lowercase letters, digits and `-`, starting with a letter or digit",
        );
    }
    let is_host_port =
        |addr: &str| addr.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    for addr in tier.peers.iter().chain([&tier.peer_dns].into_iter().filter(|d| !d.is_empty())) {
        check(is_host_port(addr), "peers", &format!("`{addr}` is not host:port"));
    }
    let tls_files = [
        ("tls_cert_path", &tier.tls_cert_path),
        ("tls_key_path", &tier.tls_key_path),
        ("tls_ca_path", &tier.tls_ca_path),
    ];
    let tls = tls_files.iter().any(|(_, path)| path.is_some());
    for (key, path) in tls_files {
        match path {
            Some(path) => check(path.is_file(), key, &format!("{} is not a readable file", path.display())),
            None => check(
                !tls,
                key,
                "missing: the peer link's TLS needs tier.tls_cert_path, tier.tls_key_path and tier.tls_ca_path \
                 together (or none of them, for a plaintext link)",
            ),
        }
    }
    if let Some(name) = &tier.tls_server_name {
        check(
            tls,
            "tls_server_name",
            "is checked only on a TLS peer link: set tier.tls_cert_path, tls_key_path and tls_ca_path",
        );
        check(
            rustls::pki_types::ServerName::try_from(name.as_str()).is_ok(),
            "tls_server_name",
            &format!("`{name}` is not a DNS name or an IP address"),
        );
    }
    if tier.listen.is_empty() {
        check(tier.peers.is_empty() && tier.peer_dns.is_empty(), "listen", "peers need a peer link to answer on");
        check(!tls, "listen", "the peer link's TLS files are set, but there is no peer link (tier.listen is empty)");
        return out;
    }
    check(is_host_port(&tier.listen), "listen", "must be host:port");
    check(tier.secret.len() >= 16, "secret", "the peer link needs a shared secret of at least 16 characters");
    check((1..=3600).contains(&tier.refresh_secs), "refresh_secs", "must be in 1..=3600");
    check((100..=60_000).contains(&tier.forward_timeout_ms), "forward_timeout_ms", "must be in 100..=60000");
    check(tier.max_connections > 0, "max_connections", "must be > 0");
    check(
        (1_000..=3_600_000).contains(&tier.give_back_unclaimed_ms),
        "give_back_unclaimed_ms",
        "must be in 1000..=3600000",
    );
    check((1..=10_000).contains(&tier.max_ends_asked_at_once), "max_ends_asked_at_once", "must be in 1..=10000");
    out
}

fn cluster_acl_problems(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    let broker = &config.broker;
    if broker.access_key.is_empty() != broker.secret_key.is_empty() {
        out.push("config key `broker.secret_key`: give `broker.access_key` and `broker.secret_key` together".into());
    }
    if config.auth.cluster_acl {
        if !config.auth.enabled {
            out.push(
                "config key `auth.cluster_acl`: needs auth.enabled (with auth off every caller may do everything)"
                    .into(),
            );
        }
        if broker.access_key.is_empty() {
            out.push(
                "config key `auth.cluster_acl`: needs broker.access_key and broker.secret_key to read them".into(),
            );
        }
        if !(1..=3600).contains(&config.auth.cluster_acl_refresh_secs) {
            out.push("config key `auth.cluster_acl_refresh_secs`: must be in 1..=3600".into());
        }
    }
    out
}

/// Shortest accepted secret: 16 characters is 96 bits of base64 entropy at least.
const MIN_TOKEN_LEN: usize = 16;

fn auth_problems(auth: &super::AuthConfig) -> Vec<String> {
    let mut out = Vec::new();
    if auth.enabled && auth.tokens.is_empty() && !auth.cluster_acl {
        out.push(
            "config key `auth.tokens`: authentication is on and no token is configured; add [[auth.tokens]] or set \
             auth.enabled = false explicitly (every caller may then do everything)"
                .to_owned(),
        );
    }
    let mut names = std::collections::HashSet::new();
    for (i, token) in auth.tokens.iter().enumerate() {
        let key = format!("auth.tokens[{i}]");
        if token.name.is_empty() {
            out.push(format!("config key `{key}.name`: must not be empty"));
        } else if !names.insert(token.name.as_str()) {
            out.push(format!("config key `{key}.name`: `{}` is used twice", token.name));
        }
        match (&token.token, &token.sha256) {
            (Some(secret), None) if secret.len() < MIN_TOKEN_LEN => {
                out.push(format!("config key `{key}.token`: must be at least {MIN_TOKEN_LEN} characters"));
            }
            (None, Some(hash)) if hash.len() != 64 || hex::decode(hash).is_err() => {
                out.push(format!("config key `{key}.sha256`: must be 64 hex digits"));
            }
            (Some(_), None) | (None, Some(_)) => {}
            _ => out.push(format!("config key `{key}.token`: give exactly one of `token` and `sha256`")),
        }
        for pattern in token.publish.iter().chain(&token.consume).chain(token.subscribe.iter().flatten()) {
            if !super::names::is_valid_pattern(pattern) {
                out.push(format!("config key `{key}`: pattern `{pattern}` is not a topic/group name with `*`"));
            }
        }
        for (j, entry) in token.acl.iter().enumerate() {
            if let Err(why) = super::names::AclEntry::parse(entry) {
                out.push(format!("config key `{key}.acl[{j}]`: {why}"));
            }
        }
    }
    out
}
