//! Embedding the plugin registration service with a handler for a new kind
//! of plugin. Run it, then start a plugin of type `GadgetPlugin`:
//!
//! ```sh
//! cargo run -p kubelet --example custom_handler -- /tmp/gadget-root
//! cargo run -p rustlet-testkit --bin fake-registration-plugin -- \
//!     --socket /tmp/gadget-root/plugins_registry/g.sock --type GadgetPlugin --name g1 --versions v1
//! ```

use std::sync::Arc;

use async_trait::async_trait;
use kubelet::plugin_manager::{
    HandlerError, PluginEvent, PluginHandler, PluginInfo, PluginManager, PluginManagerConfig, PluginType,
};
use tokio_util::sync::CancellationToken;

/// Accepts gadgets that speak `v1`.
struct GadgetHandler;

#[async_trait]
impl PluginHandler for GadgetHandler {
    async fn validate(&self, plugin: &PluginInfo) -> Result<(), HandlerError> {
        if plugin.supported_versions.iter().any(|v| v == "v1") {
            Ok(())
        } else {
            Err(format!("gadget {} must support v1, offers {:?}", plugin.name, plugin.supported_versions).into())
        }
    }

    async fn register(&self, plugin: &PluginInfo) -> Result<(), HandlerError> {
        println!("gadget {} is at {}", plugin.name, plugin.endpoint);
        Ok(())
    }

    async fn deregister(&self, plugin: &PluginInfo) {
        println!("gadget {} is gone", plugin.name);
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::env::args().nth(1).unwrap_or_else(|| "/tmp/gadget-root".into());
    let mut manager = PluginManager::new(PluginManagerConfig::new(format!("{root}/plugins_registry")));
    manager.add_handler(PluginType::Other("GadgetPlugin".into()), Arc::new(GadgetHandler))?;
    let shutdown = CancellationToken::new();
    let (handle, task) = manager.start(shutdown.clone())?;
    let mut events = handle.subscribe();
    println!("watching {root}/plugins_registry; Ctrl-C to stop");
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            Ok(event) = events.recv() => {
                if let PluginEvent::RegistrationFailed { socket_path, error, .. } = event {
                    println!("{} was turned down: {error}", socket_path.display());
                }
            }
        }
    }
    shutdown.cancel();
    task.await?;
    Ok(())
}
