//! Prometheus metrics of the plugin manager.
//!
//! `plugin_manager_total_plugins{socket_path, state}` carries the upstream
//! kubelet's name and labels: one series per socket and state, with `state`
//! `desired_state_of_world` or `actual_state_of_world`, valued 1.

use std::path::Path;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Which world a socket is counted in.
#[derive(Clone, Copy, Debug)]
pub(crate) enum World {
    Desired,
    Actual,
}

impl World {
    fn label(self) -> &'static str {
        match self {
            World::Desired => "desired_state_of_world",
            World::Actual => "actual_state_of_world",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginLabels {
    socket_path: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation: &'static str,
    result: &'static str,
}

/// The plugin manager's metric families.
#[derive(Clone, Default)]
pub(crate) struct Metrics {
    total_plugins: Family<PluginLabels, Gauge>,
    operations: Family<OperationLabels, Counter>,
}

impl Metrics {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "plugin_manager_total_plugins",
            "Number of plugins in Plugin Manager",
            self.total_plugins.clone(),
        );
        registry.register(
            "rustlet_plugin_manager_operations_total",
            "Plugin register and unregister operations by result",
            self.operations.clone(),
        );
    }

    pub(crate) fn set(&self, world: World, socket: &Path, present: bool) {
        // A socket's name is anyone's to choose: escaped, so that no name
        // breaks the page (prometheus_client writes label values as given).
        let socket_path = kubelet_support::metrics::escape_label(&socket.display().to_string()).into_owned();
        let labels = PluginLabels { socket_path, state: world.label() };
        if present {
            self.total_plugins.get_or_create(&labels).set(1);
        } else {
            self.total_plugins.remove(&labels);
        }
    }

    pub(crate) fn operation(&self, operation: &'static str, ok: bool) {
        let result = if ok { "success" } else { "failure" };
        self.operations.get_or_create(&OperationLabels { operation, result }).inc();
    }
}
