//! The `popgate` binary: parse the CLI, load and validate the config, bind, serve until SIGINT/SIGTERM.

// The RocketMQ client's futures nest deeply; the serve future's layout needs more than the default 128.
#![recursion_limit = "256"]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use popgate::cli::Endpoint;
use popgate::config::LoadedConfig;
use popgate::Config;
use tracing_subscriber::EnvFilter;

// mimalloc instead of glibc's malloc: a `perf` profile of the bench put about 9 % of popgate's CPU in glibc's
// allocator (malloc, free, consolidation).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// sysexits' EX_USAGE: the configuration is wrong, do not restart in a loop.
const EXIT_CONFIG: u8 = 64;

#[derive(Parser)]
#[command(name = "popgate", version, about = "At-least-once HTTP delivery in front of Apache RocketMQ 5.x")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the HTTP API.
    Serve {
        /// The TOML config file; `POPGATE_*` environment variables override it.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Load and validate the config, print the effective values as TOML, and exit.
    CheckConfig {
        /// The TOML config file.
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Browse or replay a dead-letter queue through a running popgate's admin API.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// List in-flight deliveries of a running popgate.
    Deliveries {
        /// Only this consumer group.
        #[arg(long)]
        group: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        max: usize,
        #[command(flatten)]
        endpoint: Endpoint,
    },
}

/// Which DLQ: `--group` or `--topic %DLQ%<group>`.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
struct DlqName {
    /// The consumer group whose DLQ it is.
    #[arg(long)]
    group: Option<String>,
    /// The DLQ topic, `%DLQ%<group>`.
    #[arg(long)]
    topic: Option<String>,
}

impl DlqName {
    fn query(&self) -> Vec<(&'static str, String)> {
        match (&self.group, &self.topic) {
            (Some(group), _) => vec![("group", group.clone())],
            (None, Some(topic)) => vec![("topic", topic.clone())],
            (None, None) => Vec::new(),
        }
    }
}

#[derive(Subcommand)]
enum DlqCommand {
    /// List dead-lettered events without consuming them.
    Browse {
        #[command(flatten)]
        dlq: DlqName,
        /// Page size.
        #[arg(long, default_value_t = 32)]
        max: usize,
        /// The previous page's `nextCursor`.
        #[arg(long)]
        cursor: Option<String>,
        /// Only events from this topic.
        #[arg(long)]
        origin_topic: Option<String>,
        #[command(flatten)]
        endpoint: Endpoint,
    },
    /// Re-publish dead-lettered events to their origin topics.
    Replay {
        #[command(flatten)]
        dlq: DlqName,
        /// At most this many.
        #[arg(long, default_value_t = 32)]
        max: usize,
        /// Messages per second (default: the server's admin.replay_rate_per_sec).
        #[arg(long)]
        rate: Option<u32>,
        /// Only these message ids, comma-separated.
        #[arg(long)]
        ids: Option<String>,
        #[command(flatten)]
        endpoint: Endpoint,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("info,rocketmq_client_rust=warn,rocketmq_transport=warn")),
        )
        // Colours only for a person at a terminal, never in log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    match cli.command {
        Command::Serve { config } => serve(config),
        Command::CheckConfig { config } => match load(config) {
            Ok(loaded) => {
                // On stderr: stdout is the effective config, which a script may keep as a file.
                if let Some(warning) = loaded.ignored_env_warning() {
                    eprintln!("popgate: warning: {warning}");
                }
                println!("{}", toml::to_string_pretty(&loaded.config).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Command::Dlq { command } => admin_call(dlq_call(command)),
        Command::Deliveries { group, max, endpoint } => {
            let mut query = vec![("max", max.to_string())];
            query.extend(group.map(|g| ("group", g)));
            admin_call((endpoint, reqwest::Method::GET, "/admin/deliveries", query))
        }
    }
}

type AdminCall = (Endpoint, reqwest::Method, &'static str, Vec<(&'static str, String)>);

fn dlq_call(command: DlqCommand) -> AdminCall {
    match command {
        DlqCommand::Browse { dlq, max, cursor, origin_topic, endpoint } => {
            let mut query = dlq.query();
            query.push(("max", max.to_string()));
            query.extend(cursor.map(|c| ("cursor", c)));
            query.extend(origin_topic.map(|t| ("originTopic", t)));
            (endpoint, reqwest::Method::GET, "/admin/dlq/browse", query)
        }
        DlqCommand::Replay { dlq, max, rate, ids, endpoint } => {
            let mut query = dlq.query();
            query.push(("max", max.to_string()));
            query.extend(rate.map(|r| ("rate", r.to_string())));
            query.extend(ids.map(|i| ("ids", i)));
            (endpoint, reqwest::Method::POST, "/admin/dlq/replay", query)
        }
    }
}

/// Runs one admin API call and prints the answer: JSON on stdout, or the error on stderr with exit code 1.
fn admin_call((endpoint, method, path, query): AdminCall) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("popgate: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(popgate::cli::call(&endpoint, method, path, &query)) {
        Ok(answer) => {
            println!("{}", serde_json::to_string_pretty(&answer).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("popgate: {error}");
            ExitCode::FAILURE
        }
    }
}

fn load(path: Option<PathBuf>) -> Result<LoadedConfig, ExitCode> {
    Config::load(path.as_deref()).map_err(|error| {
        eprintln!("popgate: {error}");
        ExitCode::from(EXIT_CONFIG)
    })
}

fn serve(path: Option<PathBuf>) -> ExitCode {
    let config = match load(path) {
        Ok(loaded) => {
            // Logged here, not while loading: tracing is set up by now, so the warning is seen.
            if let Some(warning) = loaded.ignored_env_warning() {
                tracing::warn!("{warning}");
            }
            loaded.config
        }
        Err(code) => return code,
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("popgate: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let listener = match popgate::listen::bind(config.server.listen).await {
            Ok(listener) => listener,
            Err(error) => {
                eprintln!("popgate: cannot listen on {}: {error}", config.server.listen);
                return ExitCode::FAILURE;
            }
        };
        if let Ok(addr) = listener.local_addr() {
            let scheme = if config.server.tls_cert_path.is_some() { "https" } else { "http" };
            tracing::info!(%addr, "popgate listening on {scheme}://{addr}");
        }
        match popgate::serve(config, listener, shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                tracing::error!(%error, "popgate stopped.");
                ExitCode::FAILURE
            }
        }
    })
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("Shutdown requested.");
}
