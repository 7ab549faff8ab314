//! The `DevicePlugin` registration handler: device plugins that register
//! through `plugins_registry` instead of `kubelet.sock` (the endpoint is then
//! a full socket path).

use async_trait::async_trait;
use kubelet_api::constants::DEVICE_PLUGIN_VERSION;

use super::DeviceManager;
use super::resource_name::is_extended_resource_name;
use crate::plugin_manager::{HandlerError, PluginHandler, PluginInfo};

/// Hands device plugins found by the plugin watcher to the device manager.
pub struct DevicePluginHandler {
    manager: DeviceManager,
}

impl DevicePluginHandler {
    pub(super) fn new(manager: DeviceManager) -> Self {
        DevicePluginHandler { manager }
    }
}

#[async_trait]
impl PluginHandler for DevicePluginHandler {
    async fn validate(&self, plugin: &PluginInfo) -> Result<(), HandlerError> {
        // Counted as it arrives, before validation, like `Register` on
        // kubelet.sock (upstream counts only those).
        self.manager.inner.metrics.registration(&plugin.name);
        if !plugin.supported_versions.iter().any(|v| v == DEVICE_PLUGIN_VERSION) {
            return Err(format!(
                "manager version, {DEVICE_PLUGIN_VERSION}, is not among plugin supported versions {:?}",
                plugin.supported_versions
            )
            .into());
        }
        if !is_extended_resource_name(&plugin.name) {
            return Err(
                format!("invalid name of device plugin socket: the ResourceName {:?} is invalid", plugin.name).into()
            );
        }
        Ok(())
    }

    async fn register(&self, plugin: &PluginInfo) -> Result<(), HandlerError> {
        let socket = kubelet_api::uds::socket_path_of(&plugin.endpoint);
        self.manager.connect(&plugin.name, socket).await?;
        Ok(())
    }

    async fn deregister(&self, plugin: &PluginInfo) {
        self.manager.disconnect(&plugin.name, kubelet_api::uds::socket_path_of(&plugin.endpoint));
    }
}
