//! The standalone node: plugin manager + CSI handler + HTTP endpoint.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use kubelet::csi::{CsiDriverRegistry, CsiHandlerConfig, CsiPluginHandler, InMemoryNodeInfo};
use kubelet::device_manager::{DeviceManager, DeviceManagerConfig};
use kubelet::plugin_manager::{PluginManager, PluginManagerConfig, PluginManagerHandle, PluginType};
use kubelet_api::constants::{DEVICE_PLUGINS_DIR, PLUGINS_REGISTRY_DIR};
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::cli::NodeArgs;

/// A started standalone node.
pub(crate) struct Node {
    pub(crate) plugins: PluginManagerHandle,
    pub(crate) csi_drivers: CsiDriverRegistry,
    pub(crate) node_info: InMemoryNodeInfo,
    pub(crate) devices: DeviceManager,
    pub(crate) http_address: SocketAddr,
    pub(crate) root_dir: PathBuf,
    tasks: Vec<JoinHandle<()>>,
}

impl Node {
    /// Starts every component; returns once they are serving.
    pub(crate) async fn start(args: &NodeArgs, shutdown: CancellationToken) -> anyhow::Result<Node> {
        if !args.standalone {
            bail!("cluster mode is not implemented yet; run with --standalone (see README.md)");
        }
        // Many plugins mean many sockets; the default soft limit (often 1024) is too low.
        if let Err(error) = rlimit::increase_nofile_limit(u64::MAX) {
            tracing::warn!(%error, "cannot raise the open-file limit");
        }
        let node_name = args.node_name.clone().unwrap_or_else(host_name);
        let registration_dir = args.root_dir.join(PLUGINS_REGISTRY_DIR);
        let mut metrics = Registry::default();

        let csi_drivers = CsiDriverRegistry::new();
        let node_info = InMemoryNodeInfo::new();
        let csi = CsiPluginHandler::new(csi_drivers.clone(), Arc::new(node_info.clone()), CsiHandlerConfig::default());

        let devices =
            DeviceManager::start(DeviceManagerConfig::new(args.root_dir.join(DEVICE_PLUGINS_DIR)), shutdown.clone())
                .with_context(|| {
                    format!("cannot start the device manager under root dir {}", args.root_dir.display())
                })?;

        let mut config = PluginManagerConfig::new(&registration_dir);
        config.dial_timeout = args.plugin_dial_timeout;
        config.get_info_timeout = args.plugin_get_info_timeout;
        config.notify_timeout = args.plugin_notify_timeout;
        config.resync_period = args.plugin_resync_period;
        let mut manager = PluginManager::new(config);
        manager.add_handler(PluginType::Csi, Arc::new(csi))?;
        manager.add_handler(PluginType::DevicePlugin, Arc::new(devices.plugin_handler()))?;
        manager.register_metrics(&mut metrics);
        devices.register_metrics(&mut metrics);
        let (plugins, manager_task) = manager
            .start(shutdown.clone())
            .with_context(|| format!("cannot start the plugin manager under root dir {}", args.root_dir.display()))?;

        let state = crate::http::HttpState {
            node_name: node_name.clone(),
            metrics: Arc::new(metrics),
            plugins: plugins.clone(),
            csi_drivers: csi_drivers.clone(),
            node_info: node_info.clone(),
            devices: devices.clone(),
        };
        let (http_address, http_task) =
            crate::http::serve(SocketAddr::new(args.healthz_bind_address, args.healthz_port), state, shutdown).await?;
        tracing::info!(node = %node_name, root_dir = %args.root_dir.display(), "standalone node started");
        Ok(Node {
            plugins,
            csi_drivers,
            node_info,
            devices,
            http_address,
            root_dir: args.root_dir.clone(),
            tasks: vec![manager_task, http_task],
        })
    }

    /// Waits for every component to stop (after shutdown was cancelled).
    pub(crate) async fn stopped(self) {
        let devices = self.devices.clone();
        let all = async move {
            futures_join_all(self.tasks).await;
            devices.stopped().await;
        };
        if tokio::time::timeout(crate::SHUTDOWN_GRACE, all).await.is_err() {
            tracing::warn!(grace = ?crate::SHUTDOWN_GRACE, "components still running after the grace period; exiting anyway");
        }
    }
}

async fn futures_join_all(tasks: Vec<JoinHandle<()>>) {
    for task in tasks {
        if let Err(error) = task.await {
            tracing::error!(%error, "component task failed");
        }
    }
}

/// `rustlet --standalone`: runs until a signal.
pub(crate) async fn run(args: NodeArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    let node = Node::start(&args, shutdown.clone()).await?;
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
