//! A plugin-registration test plugin on one or many sockets.
//!
//! Reports what the node does to it as JSON lines on stdout (see
//! `rustlet_testkit::report`). Examples:
//!   fake-registration-plugin --socket /r/plugins_registry/a.sock --type CSIPlugin --name a.csi --versions 1.0.0
//!   fake-registration-plugin --dir /r/plugins_registry --count 1000 --name 'p-{i}' --type Example

use std::path::PathBuf;

use clap::Parser;
use rustlet_testkit::registration::{Behaviour, Identity, RegistrationPlugin};
use rustlet_testkit::report::{Report, Reporter};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
struct Args {
    /// Registration socket to serve (repeatable).
    #[arg(long)]
    socket: Vec<PathBuf>,
    /// Serve COUNT sockets named `plugin-<i>.sock` in this directory.
    #[arg(long, requires = "count")]
    dir: Option<PathBuf>,
    /// How many sockets to create in --dir.
    #[arg(long)]
    count: Option<usize>,
    /// `PluginInfo.type`.
    #[arg(long = "type", default_value = "CSIPlugin")]
    plugin_type: String,
    /// `PluginInfo.name`; `{i}` is replaced by the socket's index.
    #[arg(long, default_value = "test-plugin-{i}")]
    name: String,
    /// `PluginInfo.endpoint`; `{i}` is replaced by the socket's index.
    #[arg(long, default_value = "")]
    endpoint: String,
    /// `PluginInfo.supported_versions`, comma-separated (empty for none).
    #[arg(long, default_value = "1.0.0")]
    versions: String,
    /// How the plugin misbehaves.
    #[arg(long, value_enum, default_value = "normal")]
    behaviour: Behaviour,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let mut sockets = args.socket.clone();
    if let (Some(dir), Some(count)) = (&args.dir, args.count) {
        sockets.extend((0..count).map(|i| dir.join(format!("plugin-{i}.sock"))));
    }
    if sockets.is_empty() {
        return Err("give --socket or --dir with --count".into());
    }
    let versions: Vec<String> =
        args.versions.split(',').map(str::trim).filter(|v| !v.is_empty()).map(str::to_owned).collect();
    let shutdown = CancellationToken::new();
    let (exits, mut exit_requests) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::with_capacity(sockets.len());
    for (i, socket) in sockets.iter().enumerate() {
        let identity = Identity {
            plugin_type: args.plugin_type.clone(),
            name: args.name.replace("{i}", &i.to_string()),
            endpoint: args.endpoint.replace("{i}", &i.to_string()),
            versions: versions.clone(),
        };
        let plugin =
            RegistrationPlugin::new(socket, identity, args.behaviour, Reporter::Stdout).exit_requests(exits.clone());
        tasks.push(plugin.spawn(shutdown.clone())?);
    }
    Reporter::Stdout.report(Report::Listening { sockets: sockets.len() });
    tokio::select! {
        signal = tokio::signal::ctrl_c() => signal?,
        // A misbehaviour asked the process to die on the spot.
        Some(code) = exit_requests.recv() => std::process::exit(code),
    }
    shutdown.cancel();
    for task in tasks {
        let _ = task.await;
    }
    Ok(())
}
