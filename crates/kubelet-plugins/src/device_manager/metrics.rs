//! Prometheus metrics of the device manager.
//!
//! Upstream's names, labels and buckets:
//! - `kubelet_device_plugin_registration_total{resource_name}`: registration
//!   requests, counted as they arrive (before validation), on `kubelet.sock`
//!   and, unlike upstream, through `plugins_registry` too;
//! - `kubelet_device_plugin_alloc_duration_seconds{resource_name}`: the
//!   `Allocate` call to the plugin, failed or not.
//!
//! And ours: `rustlet_device_checkpoint_write_duration_seconds`, one durable
//! write of the checkpoint (fsync included), which every allocation waits for.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Prometheus' default buckets, as upstream uses for the allocation time.
const DEFAULT_BUCKETS: [f64; 11] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Checkpoint writes take 0.05–5 ms on a healthy disk; a slow disk shows in
/// the upper buckets.
const WRITE_BUCKETS: [f64; 12] = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource_name: String,
}

impl ResourceLabels {
    /// A plugin names its resource before it is validated: escaped, so
    /// that no name breaks the page.
    fn of(resource: &str) -> ResourceLabels {
        ResourceLabels { resource_name: kubelet_support::metrics::escape_label(resource).into_owned() }
    }
}

/// The device manager's metric families; clones share their values.
#[derive(Clone)]
pub(crate) struct Metrics {
    registrations: Family<ResourceLabels, Counter>,
    allocate_duration: Family<ResourceLabels, Histogram>,
    checkpoint_write: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            registrations: Family::default(),
            allocate_duration: Family::new_with_constructor(|| Histogram::new(DEFAULT_BUCKETS)),
            checkpoint_write: Histogram::new(WRITE_BUCKETS),
        }
    }
}

impl Metrics {
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "kubelet_device_plugin_registration_total",
            "Cumulative number of device plugin registrations. Broken down by resource name",
            self.registrations.clone(),
        );
        registry.register(
            "kubelet_device_plugin_alloc_duration_seconds",
            "Duration in seconds to serve a device plugin Allocation request. Broken down by resource name",
            self.allocate_duration.clone(),
        );
        registry.register(
            "rustlet_device_checkpoint_write_duration_seconds",
            "Duration in seconds of one durable write of the device checkpoint (fsync included)",
            self.checkpoint_write.clone(),
        );
    }

    pub(crate) fn registration(&self, resource: &str) {
        self.registrations.get_or_create(&ResourceLabels::of(resource)).inc();
    }

    pub(crate) fn allocate_call(&self, resource: &str, took: std::time::Duration) {
        self.allocate_duration.get_or_create(&ResourceLabels::of(resource)).observe(took.as_secs_f64());
    }

    pub(crate) fn checkpoint_written(&self, took: std::time::Duration) {
        self.checkpoint_write.observe(took.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plugins_resource_name_cannot_break_the_page() {
        let metrics = Metrics::default();
        metrics.registration("evil\"} 1\nfake_series 9");
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let text = kubelet_support::metrics::encode_text(&registry).expect("encodes");
        assert!(
            text.contains(
                "kubelet_device_plugin_registration_total{resource_name=\"evil\\\"} 1\\nfake_series 9\"} 1\n"
            ),
            "{text}"
        );
        assert!(!text.lines().any(|l| l.starts_with("fake_series")), "{text}");
    }
}
