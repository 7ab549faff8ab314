//! A CSI driver test plugin: serves CSI Identity + Node on `--endpoint` and,
//! like the node-driver-registrar sidecar, a registration socket of type
//! `CSIPlugin` pointing at that endpoint.
//!
//!   fake-csi-driver --registration-socket /r/plugins_registry/hostpath.sock \
//!     --endpoint /r/plugins/hostpath/csi.sock --name hostpath.csi.example.com --node-id node-1

use std::collections::HashMap;
use std::path::PathBuf;

use clap::Parser;
use rustlet_testkit::csi_driver::{CsiDriverConfig, NodeGetInfoBehaviour, RegisteredCsiDriver, VolumeCallBehaviour};
use rustlet_testkit::registration::Behaviour;
use rustlet_testkit::report::{Report, Reporter};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
struct Args {
    /// Registration socket (usually in `<root-dir>/plugins_registry`).
    #[arg(long)]
    registration_socket: PathBuf,
    /// CSI endpoint socket.
    #[arg(long)]
    endpoint: PathBuf,
    /// The endpoint the node is told (the node's path of `--endpoint`,
    /// for a driver in a container); defaults to `--endpoint`.
    #[arg(long)]
    kubelet_registration_path: Option<PathBuf>,
    /// Driver name.
    #[arg(long)]
    name: String,
    /// Node ID returned by NodeGetInfo.
    #[arg(long, default_value = "node-1")]
    node_id: String,
    /// max_volumes_per_node returned by NodeGetInfo.
    #[arg(long, default_value_t = 0)]
    max_volumes: i64,
    /// Topology segment `key=value` (repeatable).
    #[arg(long, value_parser = parse_segment)]
    topology: Vec<(String, String)>,
    /// Supported versions, comma-separated.
    #[arg(long, default_value = "1.0.0")]
    versions: String,
    /// How NodeGetInfo behaves.
    #[arg(long, value_enum, default_value = "normal")]
    node_get_info: NodeGetInfoBehaviour,
    /// Exit when told `plugin_registered=false`, leaving the sockets behind.
    #[arg(long)]
    exit_on_rejection: bool,
    /// Report STAGE_UNSTAGE_VOLUME (and require staging before publishing).
    #[arg(long)]
    stage_unstage: bool,
    /// Publish with real mounts: `DIR/<volume id>` bind-mounted at the
    /// target (needs root).
    #[arg(long, value_name = "DIR")]
    bind_mounts_from: Option<std::path::PathBuf>,
    /// Report EXPAND_VOLUME and serve NodeExpandVolume.
    #[arg(long)]
    expand: bool,
    /// Report VOLUME_MOUNT_GROUP (the driver applies a pod's fsGroup).
    #[arg(long)]
    volume_mount_group: bool,
    /// A volume call's misbehaviour: `RPC=hang` or `RPC=<gRPC code number>`
    /// (repeatable), e.g. `NodePublishVolume=10` answers ABORTED.
    #[arg(long, value_parser = parse_volume_call)]
    volume_call: Vec<(String, VolumeCallBehaviour)>,
}

fn parse_volume_call(s: &str) -> Result<(String, VolumeCallBehaviour), String> {
    let (rpc, behaviour) = parse_segment(s)?;
    let behaviour = match behaviour.as_str() {
        "hang" => VolumeCallBehaviour::Hang,
        code => VolumeCallBehaviour::Fail(tonic::Code::from_i32(
            code.parse().map_err(|_| format!("{code:?} is neither `hang` nor a gRPC code number"))?,
        )),
    };
    Ok((rpc, behaviour))
}

fn parse_segment(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())).ok_or_else(|| format!("{s:?} is not key=value"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let shutdown = CancellationToken::new();
    let config = CsiDriverConfig {
        name: args.name,
        node_id: args.node_id,
        max_volumes_per_node: args.max_volumes,
        topology: args.topology.into_iter().collect::<HashMap<_, _>>(),
        node_get_info: args.node_get_info,
        stage_unstage: args.stage_unstage,
        volume_calls: args.volume_call.into_iter().collect(),
        bind_mounts_from: args.bind_mounts_from,
        volume_mount_group: args.volume_mount_group,
        expand: args.expand,
    };
    let registration_socket = args.registration_socket.clone();
    let mut driver = RegisteredCsiDriver::new(args.registration_socket, args.endpoint, config);
    driver.advertised_endpoint = args.kubelet_registration_path;
    driver.versions = args.versions.split(',').map(str::trim).filter(|v| !v.is_empty()).map(str::to_owned).collect();
    let (exits, mut exit_requests) = tokio::sync::mpsc::unbounded_channel();
    if args.exit_on_rejection {
        driver.behaviour = Behaviour::ExitOnRejection;
        driver.exit_requests = Some(exits);
    }
    let tasks = driver.spawn(Reporter::Stdout, shutdown.clone())?;
    Reporter::Stdout.report(Report::Listening { sockets: 1 });
    // SIGTERM too: a container is stopped with it (and as PID 1 nothing
    // else would end the driver before the runtime's kill).
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        signal = tokio::signal::ctrl_c() => signal?,
        _ = terminate.recv() => {}
        // Told it was turned down: die on the spot, sockets left behind.
        Some(code) = exit_requests.recv() => std::process::exit(code),
    }
    // Stopped: the registration socket goes, as the node-driver-registrar
    // removes its own, and the node deregisters the driver.
    let _ = std::fs::remove_file(&registration_socket);
    shutdown.cancel();
    for task in tasks {
        let _ = task.await;
    }
    Ok(())
}
