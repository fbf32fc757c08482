//! Wiring: build every component from a validated [`Config`], serve HTTP on a bound listener until the
//! shutdown future resolves, then drain.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::api::checker::HttpCheckers;
use crate::api::guard::ConnectionLimits;
use crate::api::listener::PlainListener;
use crate::api::server::{serve as serve_http, ConnectionBounds};
use crate::api::tls::{self, TlsError, TlsListener};
use crate::api::webhook::{TargetPolicy, Webhooks};
use crate::api::{self, AppState};
use crate::auth::TokenTable;
use crate::broker::{BrokerClient, BrokerError};
use crate::config::Config;
use crate::delivery::{DeliveryError, Dispatcher, Issuer, LeaseSeal};
use crate::dlq::DlqAdmin;
use crate::publish::dedup::DedupWindow;
use crate::publish::Publisher;
use crate::reliability::ProfileMonitor;
use crate::store::{StateStore, StoreError};
use crate::tier::server::{serve as serve_peer_link, PeerParts, PeerService};
use crate::tier::tls::{PeerTls, PeerTlsError};
use crate::tier::{InstanceId, Tier};
use crate::transaction::Transactions;

/// The producer group popgate's sends are registered under at the broker.
pub const PRODUCER_GROUP: &str = "popgate_producer";

/// Why popgate could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The metrics recorder could not be installed.
    #[error("metrics: {0}")]
    Metrics(String),
    /// The RocketMQ client could not be created.
    #[error("broker client: {0}")]
    Broker(#[from] BrokerError),
    /// The HTTP server failed.
    #[error("http server: {0}")]
    Io(#[from] std::io::Error),
    /// The state store could not be opened.
    #[error("{0}")]
    Store(#[from] StoreError),
    /// A broker is weaker than the reliability profile and `reliability.fail_on_mismatch` is set.
    #[error("brokers weaker than the reliability profile: {0}")]
    ProfileMismatch(String),
    /// The TLS certificate or key cannot be used.
    #[error("{0}")]
    Tls(#[from] TlsError),
    /// Boot recovery failed.
    #[error("recovery: {0}")]
    Recovery(#[from] DeliveryError),
    /// The HTTP client of the transaction checkers cannot be built.
    #[error("transaction checkers: {0}")]
    Checker(String),
    /// The gRPC front's certificate cannot be used.
    #[error("{0}")]
    GrpcTls(#[from] crate::grpc::GrpcTlsError),
    /// The remoting front's certificate cannot be used.
    #[error("remoting TLS: {0}")]
    RemotingTls(#[from] crate::tls::TlsError),
    /// The peer link's certificate, key or CA cannot be used (`tier.tls_*`).
    #[error("{0}")]
    PeerTls(#[from] PeerTlsError),
    /// This instance's id cannot be settled (see `tier.instance_id`).
    #[error("instance id: {0}")]
    Identity(#[from] crate::tier::IdentityError),
}

/// Runs popgate on `listener` until `shutdown` resolves; in-flight requests then get
/// `server.shutdown_grace_secs` to finish.
///
/// # Errors
/// [`AppError`] when a component cannot start or the server fails.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    let metrics = crate::metrics::install().map_err(AppError::Metrics)?;
    // TLS files are read before anything else starts, so a bad certificate stops popgate at once.
    let tls = match (&config.server.tls_cert_path, &config.server.tls_key_path) {
        (Some(cert), Some(key)) => Some(tls::server_config(cert, key)?),
        _ => None,
    };
    // The gRPC front's certificate too, and its port is bound before anything starts.
    let grpc = bind_grpc(&config).await?;
    let remoting = bind_remoting(&config).await?;
    let peer_link = bind_peer_link(&config).await?;
    if !config.auth.enabled {
        tracing::warn!("Authentication is switched off (auth.enabled = false): every caller may do everything.");
    }
    for token in config.auth.tokens.iter().filter(|t| !t.consume.is_empty() && t.subscribe.is_none()) {
        tracing::warn!(
            token = %token.name,
            "This token may read every topic as its consumer groups (it has no `subscribe`); list the topics it may \
             read in `subscribe` (or ACL entries) to scope it."
        );
    }
    let broker = Arc::new(BrokerClient::connect(&config.broker, PRODUCER_GROUP).await?);
    let profile = config.reliability.profile;
    std::fs::create_dir_all(&config.delivery.state_dir)?;
    // Every delivery id starts with this instance's id, so any instance of a tier can tell whose it is.
    let instance = InstanceId::resolve(config.tier.instance_id.as_deref(), &config.delivery.state_dir)?;
    tracing::info!(instance = %instance, "popgate instance {instance}");
    // Sync-flush profiles sync every state write, as the broker syncs every message; async ones group-commit.
    let sync_writes = profile.sync_flush();
    let store = Arc::new(StateStore::open(&config.delivery.state_dir, sync_writes)?);
    let mut publisher = Publisher::new(broker.clone(), config.publish.clone(), &config.fault_avoidance, profile);
    if config.publish.dedup_window_secs > 0 {
        let window = Duration::from_secs(config.publish.dedup_window_secs);
        publisher = publisher.with_dedup(DedupWindow::start(store.clone(), window));
    }
    let publisher = Arc::new(publisher);
    let group_commit = (!sync_writes).then(|| Duration::from_millis(config.reliability.group_commit_interval_ms));
    let (dispatcher, recovered) = Dispatcher::start(
        store.clone(),
        broker.clone(),
        publisher.clone(),
        config.delivery.clone(),
        group_commit,
        Issuer {
            instance: instance.as_str(),
            // In a tier, each hand-out carries its broker lease sealed with the tier's secret: a peer ACKs it at
            // the broker with it when this instance cannot be reached.
            lease_seal: (!config.tier.listen.is_empty()).then(|| LeaseSeal::new(config.tier.secret.as_bytes())),
            // In a tier, another instance may have the group's consumers: what nobody here waits for goes back.
            give_back_unclaimed: (!config.tier.listen.is_empty())
                .then(|| Duration::from_millis(config.tier.give_back_unclaimed_ms)),
        },
    )
    .await?;
    // The fronts' one handle of the delivery core: reads checked, settlements through the gateway.
    let deliveries = crate::gateway::Deliveries::new(dispatcher.clone());
    // Webhook push, the HTTP front's push transport beside SSE and WebSocket: a pusher per subscription with a
    // `push`, started for each one recovered and as they change.
    let webhooks = Webhooks::new(deliveries.clone(), TargetPolicy::new(config.webhook.allowed_networks.clone()));
    if dispatcher.watch_subscriptions(webhooks.clone()).is_err() {
        tracing::warn!("The delivery core already had a subscription watcher; webhook pushes are not started.");
    }
    tracing::info!(?recovered, state_dir = %config.delivery.state_dir.display(), "Delivery state recovered.");
    let transactions = Transactions::start(store.clone(), broker.clone(), config.transactions.clone()).await?;
    // Registered before the gRPC front's producers: a check-back whose HTTP producer named a checker goes there.
    let _checkers = HttpCheckers::register(&config.transactions.checkers, &transactions)
        .map_err(|e| AppError::Checker(e.to_string()))?;
    let grace = Duration::from_secs(config.server.shutdown_grace_secs);
    let monitor = Arc::new(ProfileMonitor::new(profile, broker.clone()));
    check_profile_at_start(&monitor, config.reliability.fail_on_mismatch).await?;
    let check_every = Duration::from_secs(config.reliability.broker_check_interval_secs);
    let tokens = Arc::new(TokenTable::new(&config.auth));
    // The cluster's users and ACLs are read before the fronts take requests, and again every refresh.
    let cluster_acl = if config.auth.cluster_acl {
        crate::auth::cluster::read_into(&tokens, &broker).await;
        let every = Duration::from_secs(config.auth.cluster_acl_refresh_secs);
        Some(tokio::spawn(crate::auth::cluster::keep_reading(tokens.clone(), broker.clone(), every)))
    } else {
        None
    };
    let config = Arc::new(config);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // The peer link: deliveries another instance handed out are settled there, and this one settles its own
    // for the others.
    let (owners, peer_server) = match peer_link {
        Some((listener, tls)) => {
            let tier = Tier::new(&config.tier, instance.clone(), Some(deliveries.clone()), tls.clone());
            // Subscription changes and renewed leases are told to the peers from now on; the first look-up takes
            // the tier's subscriptions before this instance serves anyone.
            tier.start_telling();
            tier.look_up().await;
            tokio::spawn(Tier::keep_looking_up(Arc::downgrade(&tier)));
            let parts = PeerParts {
                deliveries: deliveries.clone(),
                transactions: transactions.clone(),
                tokens: tokens.clone(),
            };
            let service = PeerService::new(instance, &config.tier.secret, parts);
            let call_timeout = Duration::from_millis(config.tier.forward_timeout_ms);
            let serving = serve_peer_link(
                listener,
                service,
                tls,
                call_timeout,
                config.tier.max_connections,
                stop_asked(&stop_rx),
            );
            let server = spawn_front("peer link", serving);
            (Some(tier as Arc<dyn crate::gateway::Owners>), Some(server))
        }
        None => (None, None),
    };
    // Whose each client id is, one registry for the gRPC and the remoting front.
    let client_owners = crate::gateway::ClientOwners::default();
    let grpc_server = grpc.map(|(listener, tls)| {
        let parts = crate::grpc::Parts {
            publisher: publisher.clone(),
            deliveries: deliveries.clone(),
            transactions: transactions.clone(),
            tokens: tokens.clone(),
            owners: owners.clone(),
            client_owners: client_owners.clone(),
        };
        let front = crate::grpc::serve(listener, tls, parts, config.clone(), stop_asked(&stop_rx));
        spawn_front("gRPC", front)
    });
    let remoting_server = match remoting {
        Some((listener, advertised, tls)) => {
            let parts = crate::remoting::Parts {
                publisher: publisher.clone(),
                broker: crate::gateway::Relay::new(broker.clone()),
                deliveries: deliveries.clone(),
                tokens: tokens.clone(),
                transactions: transactions.clone(),
                tls,
                owners: owners.clone(),
                client_owners: client_owners.clone(),
            };
            // Its brokers' ports are open again before the HTTP server answers /healthz.
            let front = crate::remoting::start(listener, advertised, parts, config.clone(), stop_asked(&stop_rx)).await;
            Some(spawn_front("remoting", front))
        }
        None => None,
    };
    let state = AppState {
        dlq: Arc::new(DlqAdmin::new(broker.clone(), publisher.clone(), store)),
        tokens,
        limits: ConnectionLimits::new(config.server.max_waiters_per_token, config.server.max_streams_per_token),
        profile: monitor.clone(),
        config,
        publisher: publisher.clone(),
        deliveries: deliveries.clone(),
        transactions: transactions.clone(),
        metrics,
        owners,
        webhooks,
    };

    let gauges = tokio::spawn(refresh_gauges(publisher.clone()));
    let profile_checks = tokio::spawn(monitor.run(check_every));
    let stop_signal = async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    };
    let bounds = ConnectionBounds {
        max_connections: state.config.server.max_connections,
        idle_timeout: Duration::from_secs(state.config.server.idle_timeout_secs),
    };
    // Each request knows its peer's address (the server sets it): ACL entries may be limited to source networks.
    let router = api::router(state);
    let server = async move {
        match tls {
            Some(tls) => serve_http(TlsListener::new(listener, tls)?, router, bounds, stop_signal).await,
            None => serve_http(PlainListener::new(listener), router, bounds, stop_signal).await,
        }
        Ok::<(), std::io::Error>(())
    };
    // The grace period starts when shutdown is asked for; a request still running after it is dropped.
    let grace_over = grace_elapsed(stop_rx, grace);
    tokio::pin!(grace_over);
    let (result, mut grace_spent) = tokio::select! {
        result = server => (result, false),
        () = &mut grace_over => (Ok(()), true),
    };
    if let Some(mut grpc_server) = grpc_server {
        // The gRPC front drains within the same grace period: it answers its open receives at once, sends
        // HTTP/2 GOAWAY and finishes the calls in flight; only what is left when the period is over is dropped.
        if !grace_spent {
            grace_spent = tokio::select! {
                _ = &mut grpc_server => false,
                () = &mut grace_over => true,
            };
        }
        if grace_spent {
            grpc_server.abort();
        }
    }
    if let Some(peer_server) = peer_server {
        // Settlements other instances ask are answered until here; after, they fail over to a retry.
        peer_server.abort();
    }
    if let Some(remoting_server) = remoting_server {
        // Its connections close with the listener; a request still being served is dropped with them.
        remoting_server.abort();
    }
    gauges.abort();
    profile_checks.abort();
    if let Some(cluster_acl) = cluster_acl {
        cluster_acl.abort();
        let _ = cluster_acl.await;
    }
    dispatcher.shutdown().await;
    transactions.shutdown().await;
    drop(transactions);
    drop(dispatcher);
    drop(publisher);
    if let Ok(broker) = Arc::try_unwrap(broker) {
        broker.shutdown().await;
    }
    result.map_err(AppError::from)
}

/// Resolves once shutdown is asked for.
fn stop_asked(stop: &tokio::sync::watch::Receiver<bool>) -> impl Future<Output = ()> + Send + 'static {
    let mut stop = stop.clone();
    async move {
        let _ = stop.wait_for(|stop| *stop).await;
    }
}

/// Runs a front's server on a task of its own; a failure is logged, and the other fronts go on.
fn spawn_front<E: std::fmt::Display>(
    name: &'static str,
    front: impl Future<Output = Result<(), E>> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if let Err(error) = front.await {
            tracing::error!(%error, "The {name} front stopped.");
        }
    })
}

/// Binds the gRPC front's port and loads (or generates) its certificate, when the front is on.
async fn bind_grpc(config: &Config) -> Result<Option<(TcpListener, Arc<rustls::ServerConfig>)>, AppError> {
    let Some(addr) = config.grpc.listen_addr() else { return Ok(None) };
    let cert_and_key = config.grpc.tls_cert_path.as_deref().zip(config.grpc.tls_key_path.as_deref());
    let tls = crate::grpc::tls_config(cert_and_key)?;
    let listener = crate::listen::bind(addr).await?;
    let bound = listener.local_addr()?;
    tracing::info!(addr = %bound, "popgate gRPC listening on {bound} (TLS and plaintext)");
    Ok(Some((listener, tls)))
}

/// Binds the peer link's port, when this instance is in a tier (`tier.listen`), and loads its TLS files
/// (`tier.tls_*`; none: plaintext, with a warning when the tier has peers).
async fn bind_peer_link(config: &Config) -> Result<Option<(TcpListener, Option<Arc<PeerTls>>)>, AppError> {
    let tier = &config.tier;
    if tier.listen.is_empty() {
        return Ok(None);
    }
    let tls = PeerTls::load(tier)?;
    let listener = crate::listen::bind(tier.listen.as_str()).await?;
    let bound = listener.local_addr()?;
    let security = if tls.is_some() { "mutual TLS" } else { "plaintext" };
    tracing::info!(addr = %bound, "popgate peer link listening on {bound} ({security})");
    if tls.is_none() && (!tier.peers.is_empty() || !tier.peer_dns.is_empty()) {
        tracing::warn!(
            "The peer link is plaintext: its requests are signed, but what they carry (delivery ids, callers, \
             transaction ends) can be read on the network. Set tier.tls_cert_path, tier.tls_key_path and \
             tier.tls_ca_path for mutual TLS, or keep the peer port on a network only the tier reaches."
        );
    }
    Ok(Some((listener, tls)))
}

/// Binds the remoting front's port, when the front is on; with the address clients are given for it and its
/// TLS configuration (a client with `useTLS` speaks TLS, the others plaintext, on the same port).
async fn bind_remoting(config: &Config) -> Result<Option<(TcpListener, String, Arc<rustls::ServerConfig>)>, AppError> {
    let Some(addr) = config.remoting.listen_addr() else { return Ok(None) };
    let cert_and_key = config.remoting.tls_cert_path.as_deref().zip(config.remoting.tls_key_path.as_deref());
    let tls = crate::tls::server_config(cert_and_key, &[])?;
    let listener = crate::listen::bind(addr).await?;
    let bound = listener.local_addr()?;
    let advertised = config.remoting.advertised(bound);
    tracing::info!(addr = %bound, %advertised, "popgate remoting listening on {bound} (TLS and plaintext; clients are given {advertised})");
    Ok(Some((listener, advertised, tls)))
}

/// Checks the brokers once before serving: a mismatch is a warning, or fatal when configured so. A cluster
/// that cannot be asked yet is not a mismatch (the periodic check catches up).
async fn check_profile_at_start(monitor: &ProfileMonitor, fail_on_mismatch: bool) -> Result<(), AppError> {
    match monitor.check().await {
        Ok(reports) => {
            let weaker: Vec<String> = reports
                .iter()
                .filter(|r| !r.shortfalls.is_empty())
                .map(|r| format!("{}: {}", r.broker, r.shortfalls.join("; ")))
                .collect();
            if fail_on_mismatch && !weaker.is_empty() {
                return Err(AppError::ProfileMismatch(weaker.join(" | ")));
            }
        }
        Err(error) => tracing::warn!(%error, "Cannot check the brokers against the reliability profile yet."),
    }
    Ok(())
}

async fn grace_elapsed(mut stop: tokio::sync::watch::Receiver<bool>, grace: Duration) {
    if stop.wait_for(|stopping| *stopping).await.is_err() {
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(grace).await;
    tracing::warn!(?grace, "Shutdown grace period over; dropping unfinished requests.");
}

/// Keeps `popgate_broker_isolated` true to the table when no send touches it (an isolation that ends).
async fn refresh_gauges(publisher: Arc<Publisher>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        publisher.refresh_isolation_gauges();
    }
}
