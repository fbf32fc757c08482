//! The `popgate` binary: parse the CLI, load and validate the config, bind, serve until SIGINT/SIGTERM.

// The RocketMQ client's futures nest deeply; the serve future's layout needs more than the default 128.
#![recursion_limit = "256"]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use popgate::Config;
use tracing_subscriber::EnvFilter;

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
            Ok(config) => {
                println!("{}", toml::to_string_pretty(&config).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
    }
}

fn load(path: Option<PathBuf>) -> Result<Config, ExitCode> {
    Config::load(path.as_deref()).map_err(|error| {
        eprintln!("popgate: {error}");
        ExitCode::from(EXIT_CONFIG)
    })
}

fn serve(path: Option<PathBuf>) -> ExitCode {
    let config = match load(path) {
        Ok(config) => config,
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
        let listener = match tokio::net::TcpListener::bind(config.server.listen).await {
            Ok(listener) => listener,
            Err(error) => {
                eprintln!("popgate: cannot listen on {}: {error}", config.server.listen);
                return ExitCode::FAILURE;
            }
        };
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "popgate listening on http://{addr}");
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
