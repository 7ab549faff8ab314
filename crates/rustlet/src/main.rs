//! `rustlet`: a Kubernetes node agent.
//!
//! `rustlet --standalone --root-dir DIR` runs the node without an API server:
//! the plugin registration service on `DIR/plugins_registry` with the CSI
//! handler, and an HTTP endpoint with `/healthz`, `/metrics` and `/status`.
//! `rustlet demo` runs the same node in a temporary root dir with demo plugins.

mod cli;
mod demo;
mod http;
mod node;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        spawn_signal_handler(shutdown.clone());
        match cli.command {
            Some(Command::Demo(args)) => demo::run(args, shutdown).await,
            None => node::run(cli.node, shutdown).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error:#}");
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("RUSTLET_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).init();
}

/// First SIGINT/SIGTERM starts a graceful shutdown; a second one exits at once.
fn spawn_signal_handler(shutdown: CancellationToken) {
    tokio::spawn(async move {
        let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
            return;
        };
        for count in 0.. {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            if count == 0 {
                tracing::info!("shutting down (signal again to force)");
                shutdown.cancel();
            } else {
                tracing::warn!("second signal: exiting now");
                std::process::exit(130);
            }
        }
    });
}

/// How long shutdown may take before the process stops waiting.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
