//! `rustlet`: a Kubernetes node agent.
//!
//! `rustlet --standalone --root-dir DIR` runs the node of the `kubelet`
//! library without an API server (see [`kubelet::node`]); `rustlet demo`
//! runs the same node in a temporary root dir with demo plugins.

mod cli;
mod client;
mod config_file;
mod demo;
mod get;
mod images;
mod node;

use std::process::ExitCode;

use clap::Parser;
use kubelet::health::HealthReporter;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use cli::{Cli, Command, LogFormat};

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(version) = kubelet_version_line(&args) {
        println!("{version}");
        return ExitCode::SUCCESS;
    }
    let (mut cli, config_report) = match parse_command_line(&args) {
        Ok(parsed) => parsed,
        Err(exit) => return exit,
    };
    // Commands that talk to a running node need no runtime and print to stdout.
    let command = match cli.command.take() {
        Some(Command::Get(args)) => return client_exit(get::get(&args)),
        Some(Command::Logs(args)) => return client_exit(get::logs(&args)),
        Some(Command::Images(command)) => return client_exit(images::run(command)),
        other => other,
    };
    // The demo tells its story on stdout; the node's log would bury it, so
    // it goes to a file unless asked for (`--verbose`, `RUSTLET_LOG`).
    let demo_log = match &command {
        Some(Command::Demo(args)) if !args.verbose && std::env::var_os("RUSTLET_LOG").is_none() => demo_log_file(),
        _ => None,
    };
    match &demo_log {
        Some((path, _)) => println!(
            "Rustlet demo: the node's log goes to {} (`demo --verbose`, or RUSTLET_LOG=info, shows it here)",
            path.display()
        ),
        None if matches!(command, Some(Command::Demo(_))) => {
            println!("Rustlet demo: the node's log is on stderr, beside the story");
        }
        None => {}
    }
    init_logging(cli.log_format, demo_log.map(|(_, file)| file));
    if let Some(report) = config_report {
        report.log();
    }
    // One TLS crypto provider for every client (the API server's, registries').
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        let signals = spawn_signal_handler(shutdown.clone());
        match command {
            Some(Command::Demo(args)) => demo::run(args, signals, shutdown).await,
            Some(Command::Get(args)) => get::get(&args),
            Some(Command::Logs(args)) => get::logs(&args),
            Some(Command::Images(command)) => images::run(command),
            None => node::run(cli.node, signals, shutdown).await,
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

/// What `--config` did, said once logging is up.
struct ConfigReport {
    path: std::path::PathBuf,
    applied: Vec<String>,
    overridden: Vec<String>,
    ignored: Vec<String>,
}

impl ConfigReport {
    fn log(&self) {
        tracing::info!(
            file = %self.path.display(),
            applied = %self.applied.join(" "),
            overridden_by_flags = %self.overridden.join(" "),
            "settings from the configuration file (flags given on the command line win)"
        );
        if !self.ignored.is_empty() {
            tracing::warn!(
                file = %self.path.display(),
                fields = %self.ignored.join(", "),
                "KubeletConfiguration fields that Rustlet does not implement are ignored"
            );
        }
    }
}

/// The command line, with `--config`'s file under it: clap's own exit
/// (usage errors: 2) or a configuration file that cannot be read (1).
/// Installed as `kubelet` (a kubelet replacement), `kubelet --version`
/// answers as the kubelet does, `Kubernetes v1.33.3+rustlet.<version>`:
/// kubeadm's preflight parses that line and holds it to its skew policy.
/// The release is the newest Rustlet conforms to, or the one of
/// `RUSTLET_KUBERNETES_VERSION` (`1.28`, `v1.28.7`: the newest conformed
/// release not newer than it) for an older control plane.
fn kubelet_version_line(args: &[std::ffi::OsString]) -> Option<String> {
    let invoked = args.first().map(std::path::Path::new).and_then(|p| p.file_name())?;
    if invoked != "kubelet" || args.len() != 2 || args[1] != "--version" {
        return None;
    }
    let version = match std::env::var("RUSTLET_KUBERNETES_VERSION") {
        Ok(wanted) => {
            let mut parts = wanted.trim().trim_start_matches('v').split('.');
            let (major, minor) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
            kubelet::cluster::kubelet_version_for(major, minor)
        }
        Err(_) => kubelet::VERSION.to_owned(),
    };
    Some(format!("Kubernetes {version}"))
}

fn parse_command_line(args: &[std::ffi::OsString]) -> Result<(Cli, Option<ConfigReport>), ExitCode> {
    use clap::{CommandFactory as _, FromArgMatches as _, parser::ValueSource};
    let matches = Cli::command().try_get_matches_from(args).unwrap_or_else(|e| e.exit());
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let Some(path) = cli.node.config.clone().filter(|_| cli.command.is_none()) else { return Ok((cli, None)) };
    let settings = config_file::read(&path).map_err(|e| {
        eprintln!("error: --config {e}");
        ExitCode::FAILURE
    })?;
    let explicit =
        |id: &str| matches!(matches.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable));
    let (merged, applied, overridden) = config_file::merged_args(args, &settings, explicit);
    let cli = Cli::try_parse_from(&merged).map_err(|e| {
        let said = e.to_string();
        eprintln!("error: --config {}: {}", path.display(), said.trim_start_matches("error: ").trim_end());
        ExitCode::from(2)
    })?;
    Ok((cli, Some(ConfigReport { path, applied, overridden, ignored: settings.ignored })))
}

fn client_exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// A new file for the demo's node log, in the temporary directory, made
/// new (never through a link someone left) and readable by its owner only;
/// `None` (the log stays on stderr) if it cannot be made.
fn demo_log_file() -> Option<(std::path::PathBuf, std::fs::File)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = std::env::temp_dir().join(format!("rustlet-demo-{}.log", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&path)
        .map_err(|error| eprintln!("cannot make the demo's log file {}: {error}; logging to stderr", path.display()))
        .ok()?;
    Some((path, file))
}

fn init_logging(format: LogFormat, file: Option<std::fs::File>) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("RUSTLET_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    if let Some(file) = file {
        let builder =
            tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::sync::Mutex::new(file)).with_ansi(false);
        match format {
            LogFormat::Text => builder.init(),
            LogFormat::Json => builder.json().with_current_span(true).with_span_list(false).init(),
        }
        return;
    }
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init(),
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(false).init(),
    }
}

/// First SIGINT/SIGTERM starts a graceful shutdown; a second one exits at
/// once. If the handlers cannot be installed the node still runs, but it
/// says so: in the log, and as a failing `signal-handler` health check.
fn spawn_signal_handler(shutdown: CancellationToken) -> HealthReporter {
    let health = HealthReporter::new();
    let (term, int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(term), Ok(int)) => (term, int),
        (Err(error), _) | (_, Err(error)) => {
            tracing::error!(%error, "cannot install the SIGTERM/SIGINT handlers; the node cannot stop gracefully");
            health.failing(format!("cannot install the SIGTERM/SIGINT handlers: {error}"));
            return health;
        }
    };
    tokio::spawn(wait_for_signals(term, int, shutdown));
    health
}

async fn wait_for_signals(
    mut term: tokio::signal::unix::Signal,
    mut int: tokio::signal::unix::Signal,
    shutdown: CancellationToken,
) {
    for count in 0.. {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        if count == 0 {
            tracing::info!("shutting down (signal again to force)");
            shutdown.cancel();
        } else {
            tracing::warn!("second signal: exiting now");
            std::process::exit(130);
        }
    }
}
