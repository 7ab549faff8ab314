//! The `CSIPlugin` registration handler.
//!
//! validate: the version list (see [`highest_supported_version`]) and the
//! one-driver-per-name rule. register: record the driver, call `NodeGetInfo`
//! (deadline), publish the node's CSI facts; any failure undoes the earlier
//! steps. deregister: drop the driver (only if this socket registered it) and
//! its published facts.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::client::node_get_info;
use super::error::CsiError;
use super::node_info::{CsiNodeDriver, NodeInfoPublisher};
use super::registry::{CsiDriver, CsiDriverRegistry};
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
                self.registry.remove(&plugin.name, &plugin.socket_path);
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
        if let Err(e) = self.publisher.add_driver(driver).await {
            self.registry.remove(&plugin.name, &plugin.socket_path);
            return Err(CsiError::from(e).into());
        }
        tracing::debug!(driver = %plugin.name, endpoint = %plugin.endpoint, %version, "CSI driver registered");
        Ok(())
    }

    async fn deregister(&self, plugin: &PluginInfo) {
        if self.registry.remove(&plugin.name, &plugin.socket_path) {
            self.publisher.remove_driver(&plugin.name).await;
            tracing::debug!(driver = %plugin.name, "CSI driver deregistered");
        }
    }
}
