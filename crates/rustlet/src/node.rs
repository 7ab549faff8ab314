//! `rustlet --standalone`: the flags become a [`NodeConfig`], the library
//! runs the node until a signal.

use std::net::SocketAddr;

use anyhow::bail;
use kubelet::health::HealthReporter;
use kubelet::node::{Node, NodeBuilder, NodeConfig};
use tokio_util::sync::CancellationToken;

use crate::cli::NodeArgs;

/// The node's configuration from the command line.
pub(crate) fn config(args: &NodeArgs) -> NodeConfig {
    let node_name = args.node_name.clone().unwrap_or_else(host_name);
    let mut config = NodeConfig::new(&args.root_dir, node_name);
    config.http_address = Some(SocketAddr::new(args.healthz_bind_address, args.healthz_port));
    config.plugins.dial_timeout = args.plugin_dial_timeout;
    config.plugins.get_info_timeout = args.plugin_get_info_timeout;
    config.plugins.notify_timeout = args.plugin_notify_timeout;
    config.plugins.resync_period = args.plugin_resync_period;
    config.pods.manifest_dir = args.pod_manifest_path.clone();
    config.pods.max_pods = args.max_pods;
    config
}

/// Starts the node described by `args`.
pub(crate) async fn start(
    args: &NodeArgs,
    signals: &HealthReporter,
    shutdown: CancellationToken,
) -> anyhow::Result<Node> {
    if !args.standalone {
        bail!("cluster mode is not implemented yet; run with --standalone (see README.md)");
    }
    // Many plugins mean many sockets; the default soft limit (often 1024) is too low.
    if let Err(error) = rlimit::increase_nofile_limit(u64::MAX) {
        tracing::warn!(%error, "cannot raise the open-file limit");
    }
    let provider = rustlet_wasi::WasiProvider::new(rustlet_wasi::WasiConfig::new(&args.root_dir))
        .map_err(|e| anyhow::anyhow!("the WebAssembly provider cannot start: {e}"))?;
    let node = NodeBuilder::new(config(args))
        .provider(std::sync::Arc::new(provider))
        .health_check("signal-handler", signals)
        .start(shutdown)
        .await?;
    Ok(node)
}

/// `rustlet --standalone`: runs until a signal.
pub(crate) async fn run(args: NodeArgs, signals: HealthReporter, shutdown: CancellationToken) -> anyhow::Result<()> {
    let node = start(&args, &signals, shutdown.clone()).await?;
    shutdown.cancelled().await;
    node.stopped().await;
    Ok(())
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "rustlet".to_owned())
}
