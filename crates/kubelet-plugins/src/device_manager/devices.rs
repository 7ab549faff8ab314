//! Devices and capacity, in our own types. Generated device-plugin types are
//! converted here and nowhere else.

use std::collections::{BTreeMap, HashSet};

use kubelet_api::deviceplugin::v1beta1 as api;

/// A device's health as the plugin reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Health {
    /// `"Healthy"`.
    Healthy,
    /// Anything else, or the plugin is gone.
    Unhealthy,
}

/// One device of a resource.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    /// The plugin's device ID.
    pub id: String,
    /// Its health.
    pub health: Health,
    /// NUMA nodes it is attached to (empty: no topology).
    pub numa_nodes: Vec<i64>,
}

/// What a resource offers the node: `capacity` counts every device,
/// `allocatable` the healthy ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceCapacity {
    /// All devices.
    pub capacity: u64,
    /// Healthy devices.
    pub allocatable: u64,
}

/// Capacity of every device-plugin resource the node has known; a removed
/// resource stays listed at zero so the node status can clear it.
pub type Capacities = BTreeMap<String, ResourceCapacity>;

/// One change of a resource's capacity, as recorded by
/// `DeviceManager::capacity_changes`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CapacityChange {
    /// The resource.
    pub resource: String,
    /// Its capacity from this change on.
    pub capacity: ResourceCapacity,
}

/// Options the plugin announced in `GetDevicePluginOptions`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PluginOptions {
    /// `PreStartContainer` must be called before a container starts.
    pub pre_start_required: bool,
    /// The plugin implements `GetPreferredAllocation`.
    pub get_preferred_allocation_available: bool,
}

impl From<api::DevicePluginOptions> for PluginOptions {
    fn from(o: api::DevicePluginOptions) -> Self {
        PluginOptions {
            pre_start_required: o.pre_start_required,
            get_preferred_allocation_available: o.get_preferred_allocation_available,
        }
    }
}

/// What was wrong with a `ListAndWatch` message (reported, then dropped).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Rejected {
    pub(crate) empty_ids: usize,
    pub(crate) duplicate_ids: Vec<String>,
}

/// Converts one `ListAndWatch` message into the resource's device set:
/// devices with an empty ID are dropped, and of duplicate IDs the first wins.
pub(crate) fn device_set(response: api::ListAndWatchResponse) -> (BTreeMap<String, Device>, Rejected) {
    let mut devices = BTreeMap::new();
    let mut rejected = Rejected::default();
    let mut seen = HashSet::with_capacity(response.devices.len());
    for device in response.devices {
        if device.id.is_empty() {
            rejected.empty_ids += 1;
            continue;
        }
        if !seen.insert(device.id.clone()) {
            rejected.duplicate_ids.push(device.id);
            continue;
        }
        let health = if device.health == "Healthy" { Health::Healthy } else { Health::Unhealthy };
        let numa_nodes = device.topology.map(|t| t.nodes.into_iter().map(|n| n.id).collect()).unwrap_or_default();
        devices.insert(device.id.clone(), Device { id: device.id, health, numa_nodes });
    }
    (devices, rejected)
}

/// Capacity of a device set.
pub(crate) fn capacity_of<'a>(devices: impl Iterator<Item = &'a Device>) -> ResourceCapacity {
    let mut c = ResourceCapacity::default();
    for d in devices {
        c.capacity += 1;
        if d.health == Health::Healthy {
            c.allocatable += 1;
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(id: &str, health: &str, numa: &[i64]) -> api::Device {
        api::Device {
            id: id.into(),
            health: health.into(),
            topology: (!numa.is_empty())
                .then(|| api::TopologyInfo { nodes: numa.iter().map(|n| api::NumaNode { id: *n }).collect() }),
        }
    }

    #[test]
    fn empty_and_duplicate_ids_are_dropped_and_reported() {
        let (devices, rejected) = device_set(api::ListAndWatchResponse {
            devices: vec![
                dev("a", "Healthy", &[0]),
                dev("", "Healthy", &[]),
                dev("a", "Unhealthy", &[]),
                dev("b", "sick", &[1]),
            ],
        });
        assert_eq!(devices.len(), 2);
        assert_eq!(devices["a"].health, Health::Healthy, "the first of duplicates wins");
        assert_eq!(devices["a"].numa_nodes, vec![0]);
        assert_eq!(devices["b"].health, Health::Unhealthy, "anything but Healthy is unhealthy");
        assert_eq!(rejected, Rejected { empty_ids: 1, duplicate_ids: vec!["a".into()] });
        assert_eq!(capacity_of(devices.values()), ResourceCapacity { capacity: 2, allocatable: 1 });
    }

    /// Fuzz target: a device plugin's ListAndWatch answers (protobuf bytes
    /// as they come off the wire): decoded or refused, then turned into the
    /// resource's devices and capacity; never a panic, and never more
    /// healthy devices than devices.
    #[test]
    fn fuzz_list_and_watch_answers() {
        use prost::Message as _;
        let seed = api::ListAndWatchResponse {
            devices: vec![dev("gpu-0", "Healthy", &[0]), dev("gpu-1", "Unhealthy", &[1, 2]), dev("", "Healthy", &[])],
        }
        .encode_to_vec();
        let ran = crate::fuzz::Fuzz::new("list-and-watch").seed(seed).run(|input| {
            let Ok(response) = api::ListAndWatchResponse::decode(input) else { return };
            let (devices, _) = device_set(response);
            let capacity = capacity_of(devices.values());
            assert!(capacity.allocatable <= capacity.capacity);
        });
        assert!(ran > 1);
    }
}
