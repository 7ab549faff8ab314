//! The plugins the node has registered, keyed by socket path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use uuid::Uuid;

use super::handler::{PluginHandler, PluginInfo};

/// One registered plugin and the handler that holds it.
#[derive(Clone)]
pub(crate) struct RegisteredPlugin {
    /// The desired-state instance this registration was made for.
    pub(crate) uuid: Uuid,
    pub(crate) info: PluginInfo,
    pub(crate) handler: Arc<dyn PluginHandler>,
}

/// Actual state of the world: socket path → registered plugin.
#[derive(Default)]
pub(crate) struct ActualState {
    plugins: BTreeMap<PathBuf, RegisteredPlugin>,
}

impl ActualState {
    pub(crate) fn add(&mut self, path: PathBuf, plugin: RegisteredPlugin) {
        self.plugins.insert(path, plugin);
    }

    pub(crate) fn remove(&mut self, path: &Path) -> Option<RegisteredPlugin> {
        self.plugins.remove(path)
    }

    pub(crate) fn get(&self, path: &Path) -> Option<&RegisteredPlugin> {
        self.plugins.get(path)
    }

    pub(crate) fn len(&self) -> usize {
        self.plugins.len()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&PathBuf, &RegisteredPlugin)> {
        self.plugins.iter()
    }
}
