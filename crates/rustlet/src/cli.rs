//! Command-line flags. Names follow the kubelet's where one exists.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// Rustlet: a Kubernetes node agent in Rust.
#[derive(Parser)]
#[command(version, about, args_conflicts_with_subcommands = true)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    #[command(flatten)]
    pub(crate) node: NodeArgs,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Run a standalone node in a temporary root dir with demo plugins.
    Demo(DemoArgs),
}

/// Flags of the node itself.
#[derive(Args, Clone)]
pub(crate) struct NodeArgs {
    /// Run without an API server (the only mode implemented so far).
    #[arg(long)]
    pub(crate) standalone: bool,
    /// Directory for the node's files; plugins register under
    /// `<root-dir>/plugins_registry`.
    #[arg(long, env = "RUSTLET_ROOT_DIR", default_value = kubelet_api::constants::DEFAULT_ROOT_DIR)]
    pub(crate) root_dir: PathBuf,
    /// Node name (default: the host name).
    #[arg(long)]
    pub(crate) node_name: Option<String>,
    /// Address of the HTTP endpoint serving /healthz, /metrics and /status.
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) healthz_bind_address: IpAddr,
    /// Port of the HTTP endpoint; 0 picks a free port (logged at start-up).
    #[arg(long, default_value_t = 10248)]
    pub(crate) healthz_port: u16,
    /// Deadline for connecting to a plugin socket.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) plugin_dial_timeout: Duration,
    /// Deadline for a plugin's GetInfo.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) plugin_get_info_timeout: Duration,
    /// Deadline for a plugin's NotifyRegistrationStatus.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub(crate) plugin_notify_timeout: Duration,
    /// Period of the full rescan of plugins_registry (a safety net; events
    /// drive registration).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub(crate) plugin_resync_period: Duration,
}

/// Flags of `rustlet demo`.
#[derive(Args)]
pub(crate) struct DemoArgs {
    /// Exit after the demo's scenario instead of running until Ctrl-C.
    #[arg(long)]
    pub(crate) once: bool,
}

/// Parses `250ms`, `10s`, `2m` or a bare number of seconds.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, unit) = s.find(|c: char| !c.is_ascii_digit() && c != '.').map_or((s, "s"), |i| s.split_at(i));
    let value: f64 = number.parse().map_err(|_| format!("{s:?} is not a duration such as 500ms, 10s or 2m"))?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "s" => value,
        "m" => value * 60.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s or m)")),
    };
    if !(0.001..=86_400.0).contains(&seconds) {
        return Err(format!("{s:?} must be between 1ms and 24h"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert!(parse_duration("0s").expect_err("zero").contains("between 1ms and 24h"));
        assert!(parse_duration("0.0001ms").expect_err("rounds to zero").contains("between 1ms and 24h"));
        assert!(parse_duration("1000000000m").expect_err("huge").contains("between 1ms and 24h"));
        assert!(parse_duration("5h").expect_err("unit").contains("unknown unit"));
        assert!(parse_duration("soon").expect_err("garbage").contains("not a duration"));
    }
}
