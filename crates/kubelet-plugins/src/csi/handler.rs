//! The `CSIPlugin` registration handler.
//!
//! validate: the version list (see [`highest_supported_version`]) and the
//! one-driver-per-name rule. register: record the driver, call `NodeGetInfo`
//! (deadline), publish the node's CSI facts; any failure undoes the earlier
//! steps. deregister: drop the driver (only if this socket registered it) and
//! its published facts, or fall back to the registration it had replaced.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::client::node_get_info;
use super::error::CsiError;
use super::node_info::{CsiNodeDriver, NodeInfoPublisher};
use super::registry::{CsiDriver, CsiDriverRegistry, Removal};
use super::version::{CsiVersion, highest_supported_version};
use crate::plugin_manager::{HandlerError, PluginHandler, PluginInfo};

/// Settings of the CSI handler.
#[derive(Clone, Copy, Debug)]
pub struct CsiHandlerConfig {
    /// Deadline for dialing the driver and for `NodeGetInfo`.
    pub node_get_info_timeout: Duration,
}

impl Default for CsiHandlerConfig {
    fn default() -> Self {
        CsiHandlerConfig { node_get_info_timeout: Duration::from_secs(10) }
    }
}

/// Handles plugins of type `CSIPlugin`.
pub struct CsiPluginHandler {
    registry: CsiDriverRegistry,
    publisher: Arc<dyn NodeInfoPublisher>,
    config: CsiHandlerConfig,
}

impl CsiPluginHandler {
    /// A handler recording drivers in `registry` and publishing node facts
    /// through `publisher`.
    pub fn new(registry: CsiDriverRegistry, publisher: Arc<dyn NodeInfoPublisher>, config: CsiHandlerConfig) -> Self {
        CsiPluginHandler { registry, publisher, config }
    }

    fn version(plugin: &PluginInfo) -> Result<CsiVersion, CsiError> {
        highest_supported_version(&plugin.supported_versions).map_err(|source| CsiError::Versions {
            name: plugin.name.clone(),
            endpoint: plugin.endpoint.clone(),
            source,
        })
    }
}

#[async_trait]
impl PluginHandler for CsiPluginHandler {
    async fn validate(&self, plugin: &PluginInfo) -> Result<(), HandlerError> {
        let version = Self::version(plugin)?;
        self.registry.check_newer(&plugin.name, version)?;
        Ok(())
    }

    async fn register(&self, plugin: &PluginInfo) -> Result<(), HandlerError> {
        let version = Self::version(plugin)?;
        self.registry.insert(CsiDriver {
            name: plugin.name.clone(),
            endpoint: plugin.endpoint.clone(),
            version,
            socket_path: plugin.socket_path.clone(),
        })?;
        let info = match node_get_info(&plugin.endpoint, self.config.node_get_info_timeout).await {
            Ok(info) => info,
            Err(source) => {
                self.retire(plugin).await;
                return Err(CsiError::NodeGetInfo { name: plugin.name.clone(), source }.into());
            }
        };
        let driver = CsiNodeDriver {
            name: plugin.name.clone(),
            node_id: info.node_id,
            topology_keys: info.accessible_topology.keys().cloned().collect(),
            allocatable_count: info.max_volumes_per_node,
            topology: info.accessible_topology,
        };
        self.registry.set_node_info(&plugin.name, &plugin.socket_path, driver.clone());
        if let Err(e) = self.publisher.add_driver(driver).await {
            self.retire(plugin).await;
            return Err(CsiError::from(e).into());
        }
        tracing::debug!(driver = %plugin.name, endpoint = %plugin.endpoint, %version, "CSI driver registered");
        Ok(())
    }

    async fn deregister(&self, plugin: &PluginInfo) {
        self.retire(plugin).await;
    }
}

impl CsiPluginHandler {
    /// Removes the registration `plugin` made and publishes what that changes:
    /// nothing if it was a replaced one, the previous driver's facts if an
    /// older registration of the name becomes active again, or the removal of
    /// the driver from the node.
    async fn retire(&self, plugin: &PluginInfo) {
        let fallback = match self.registry.remove(&plugin.name, &plugin.socket_path) {
            None | Some(Removal::Inactive) => return,
            Some(Removal::FellBack(fallback)) => Some(*fallback),
            Some(Removal::Gone) => None,
        };
        match fallback {
            Some((previous, Some(node))) => {
                tracing::info!(
                    driver = %plugin.name,
                    socket = %previous.socket_path.display(),
                    version = %previous.version,
                    "CSI driver falls back to its earlier registration"
                );
                if let Err(error) = self.publisher.add_driver(node).await {
                    tracing::warn!(%error, driver = %plugin.name, "cannot publish the earlier registration's node info");
                }
            }
            // No registration left, or the one left has not reported its node
            // facts yet (it publishes them when its registration completes).
            Some((_, None)) | None => {
                self.publisher.remove_driver(&plugin.name).await;
                tracing::debug!(driver = %plugin.name, "CSI driver deregistered");
            }
        }
    }
}
