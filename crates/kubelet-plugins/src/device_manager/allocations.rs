//! The allocations index: which container holds which devices, and which
//! devices allocations in progress have reserved.
//!
//! Devices in use are indexed per resource and kept sorted (device → its
//! holders, reserved or not), so a resource's free devices are one walk over
//! its device list alongside its used devices, whatever the number of
//! allocations on the node. Each allocation keeps its checkpoint entry,
//! encoded once when it was made.
//!
//! No I/O and no locking here: the manager holds the index behind one mutex
//! (see `allocate` for the flow that uses it).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::allocate::ContainerKind;
use super::checkpoint::Part;
use super::device_choice::Free;
use super::devices::{Device, Health};
use super::run_options::RunOptions;

/// What a container holds of one resource.
#[derive(Clone, Debug)]
pub(crate) struct Held {
    pub(crate) device_ids: Vec<String>,
    pub(crate) options: RunOptions,
    /// Its checkpoint entry, encoded once.
    pub(crate) encoded: Arc<Part>,
}

/// One container's allocations.
#[derive(Clone, Debug)]
pub(crate) struct ContainerRecord {
    pub(crate) kind: ContainerKind,
    pub(crate) resources: BTreeMap<String, Held>,
}

/// A container holding a device.
#[derive(Debug)]
struct Holder {
    pod: String,
    container: String,
    /// A (non-restartable) init container: its pod's later containers may
    /// reuse the device.
    init: bool,
}

/// Who uses a device: the containers holding it (more than one only when a
/// pod's containers reuse its init containers' devices), and whether an
/// allocation in progress reserved it.
#[derive(Debug, Default)]
struct Use {
    holders: Vec<Holder>,
    reserved: bool,
}

impl Use {
    /// Unavailable to `pod`: reserved, or held by anyone but the pod's init
    /// containers.
    fn taken_for(&self, pod: &str) -> bool {
        self.reserved || self.holders.iter().any(|h| !(h.init && h.pod == pod))
    }
}

/// Every allocation, indexed by device, and devices reserved by allocations
/// in progress. A resource's free devices are found by walking its device
/// list alongside its (sorted) used devices, whatever the number of
/// allocations on the node.
#[derive(Default)]
pub(crate) struct Allocations {
    pods: BTreeMap<String, BTreeMap<String, ContainerRecord>>,
    /// Resource → device → its use; devices nobody uses are absent.
    uses: HashMap<String, BTreeMap<String, Use>>,
}

impl Allocations {
    /// Allocations restored from a checkpoint.
    pub(crate) fn restored(pods: BTreeMap<String, BTreeMap<String, ContainerRecord>>) -> Self {
        let mut allocations = Allocations::default();
        for (pod, containers) in &pods {
            for (container, record) in containers {
                for (resource, held) in &record.resources {
                    allocations.hold(pod, container, record.kind, resource, &held.device_ids);
                }
            }
        }
        allocations.pods = pods;
        allocations
    }

    fn hold(&mut self, pod: &str, container: &str, kind: ContainerKind, resource: &str, ids: &[String]) {
        let devices = self.uses.entry(resource.to_owned()).or_default();
        for id in ids {
            let holders = &mut devices.entry(id.clone()).or_default().holders;
            if !holders.iter().any(|h| h.pod == pod && h.container == container) {
                holders.push(Holder {
                    pod: pod.to_owned(),
                    container: container.to_owned(),
                    init: kind == ContainerKind::Init,
                });
            }
        }
    }

    /// Applies `change` to the use of each of `ids`, dropping uses left empty.
    fn change_uses(&mut self, resource: &str, ids: &[String], change: impl Fn(&mut Use)) {
        let Some(devices) = self.uses.get_mut(resource) else { return };
        for id in ids {
            if let Some(device) = devices.get_mut(id) {
                change(device);
                if device.holders.is_empty() && !device.reserved {
                    devices.remove(id);
                }
            }
        }
    }

    fn unhold(&mut self, pod: &str, container: &str, resource: &str, ids: &[String]) {
        self.change_uses(resource, ids, |u| u.holders.retain(|h| h.pod != pod || h.container != container));
    }

    /// What the container holds of `resource`.
    pub(super) fn held(&self, pod: &str, container: &str, resource: &str) -> Option<&Held> {
        self.container(pod, container)?.resources.get(resource)
    }

    /// What the container holds.
    pub(super) fn container(&self, pod: &str, container: &str) -> Option<&ContainerRecord> {
        self.pods.get(pod)?.get(container)
    }

    /// Records an allocation; its devices are no longer merely reserved. A
    /// container keeps the kind it was first recorded with.
    pub(super) fn insert(&mut self, pod: &str, container: &str, kind: ContainerKind, resource: &str, held: Held) {
        self.unreserve(resource, &held.device_ids);
        let kind = self.container(pod, container).map_or(kind, |r| r.kind);
        // A different count than before is refused earlier; a replacement
        // is kept consistent regardless.
        if let Some(old) = self.held(pod, container, resource).map(|h| h.device_ids.clone()) {
            self.unhold(pod, container, resource, &old);
        }
        self.hold(pod, container, kind, resource, &held.device_ids);
        self.pods
            .entry(pod.to_owned())
            .or_default()
            .entry(container.to_owned())
            .or_insert_with(|| ContainerRecord { kind, resources: BTreeMap::new() })
            .resources
            .insert(resource.to_owned(), held);
    }

    /// Removes the container's allocation of `resource`; a container left
    /// with nothing is forgotten, and so is a pod left with no container.
    pub(super) fn remove(&mut self, pod: &str, container: &str, resource: &str) {
        let Some(containers) = self.pods.get_mut(pod) else { return };
        let Some(record) = containers.get_mut(container) else { return };
        let Some(held) = record.resources.remove(resource) else { return };
        if record.resources.is_empty() {
            containers.remove(container);
            if containers.is_empty() {
                self.pods.remove(pod);
            }
        }
        self.unhold(pod, container, resource, &held.device_ids);
    }

    /// Removes every allocation of the pod; returns how many devices it held.
    pub(super) fn remove_pod(&mut self, pod: &str) -> usize {
        let Some(containers) = self.pods.remove(pod) else { return 0 };
        let mut freed = 0;
        for (container, record) in &containers {
            for (resource, held) in &record.resources {
                self.unhold(pod, container, resource, &held.device_ids);
                freed += held.device_ids.len();
            }
        }
        freed
    }

    /// Removes every pod not in `live`; returns the pods removed with how
    /// many devices each held.
    pub(super) fn retain_pods(&mut self, live: &std::collections::HashSet<&str>) -> BTreeMap<String, usize> {
        let orphans: Vec<String> = self.pods.keys().filter(|pod| !live.contains(pod.as_str())).cloned().collect();
        orphans
            .into_iter()
            .map(|pod| {
                let freed = self.remove_pod(&pod);
                (pod, freed)
            })
            .collect()
    }

    /// Whether device `id` of `resource` is unavailable to `pod`: reserved,
    /// or held by anyone but the pod's init containers.
    fn is_taken(&self, resource: &str, pod: &str, id: &str) -> bool {
        self.uses.get(resource).and_then(|d| d.get(id)).is_some_and(|u| u.taken_for(pod))
    }

    /// Devices of `resource` the pod's init containers hold and nobody else
    /// does: its later containers must reuse them.
    pub(super) fn reusable(&self, resource: &str, pod: &str) -> Vec<String> {
        let Some(containers) = self.pods.get(pod) else { return Vec::new() };
        let mut ids: Vec<String> = containers
            .values()
            .filter(|r| r.kind == ContainerKind::Init)
            .filter_map(|r| r.resources.get(resource))
            .flat_map(|h| h.device_ids.iter())
            .filter(|id| !self.is_taken(resource, pod, id))
            .cloned()
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    pub(super) fn reserve(&mut self, resource: &str, ids: &[String]) {
        let devices = self.uses.entry(resource.to_owned()).or_default();
        for id in ids {
            devices.entry(id.clone()).or_default().reserved = true;
        }
    }

    pub(super) fn unreserve(&mut self, resource: &str, ids: &[String]) {
        self.change_uses(resource, ids, |u| u.reserved = false);
    }

    /// Container → resource → device IDs of `pod`.
    pub(crate) fn held_by_pod(&self, pod: &str) -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
        self.pods
            .get(pod)
            .map(|containers| {
                containers
                    .iter()
                    .map(|(name, record)| {
                        let held = record.resources.iter().map(|(r, h)| (r.clone(), h.device_ids.clone())).collect();
                        (name.clone(), held)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The checkpoint entries, in pod, container, resource order.
    pub(crate) fn parts(&self) -> Vec<Arc<Part>> {
        self.pods
            .values()
            .flat_map(|containers| containers.values())
            .flat_map(|record| record.resources.values())
            .map(|held| held.encoded.clone())
            .collect()
    }
}

/// The free healthy devices of a resource for `pod`, sorted by ID: the
/// device list and the used devices are both sorted, so one walk over the
/// two finds them.
pub(super) fn free_devices<'a>(
    devices: &'a BTreeMap<String, Device>,
    allocations: &Allocations,
    resource: &str,
    pod: &str,
) -> Vec<Free<'a>> {
    let mut used = allocations.uses.get(resource).into_iter().flatten().peekable();
    let mut free = Vec::with_capacity(devices.len());
    for device in devices.values() {
        while used.next_if(|(id, _)| id.as_str() < device.id.as_str()).is_some() {}
        let taken = used.peek().is_some_and(|(id, u)| **id == device.id && u.taken_for(pod));
        if device.health == Health::Healthy && !taken {
            free.push(Free { id: &device.id, numa: &device.numa_nodes });
        }
    }
    free
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The old way: walk every allocation.
    fn brute_force_taken(a: &Allocations, resource: &str, pod: &str, id: &str) -> bool {
        a.uses.get(resource).and_then(|d| d.get(id)).is_some_and(|u| u.reserved)
            || a.pods.iter().any(|(uid, containers)| {
                containers.values().any(|record| {
                    record.resources.get(resource).is_some_and(|held| {
                        held.device_ids.iter().any(|d| d == id) && !(uid == pod && record.kind == ContainerKind::Init)
                    })
                })
            })
    }

    fn held(pod: &str, container: &str, resource: &str, kind: ContainerKind, ids: &[String]) -> Held {
        let devices: Vec<(String, i64)> = ids.iter().map(|id| (id.clone(), 0)).collect();
        let options = RunOptions::default();
        let encoded = Arc::new(Part::entry(pod, container, resource, kind, &devices, &options).expect("encode"));
        Held { device_ids: ids.to_vec(), options, encoded }
    }

    /// Random inserts, removals, pod frees, reservations and a restore: the
    /// index always answers as a walk over every allocation would.
    #[test]
    fn the_device_index_agrees_with_a_full_scan() {
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let kinds = [ContainerKind::Init, ContainerKind::RestartableInit, ContainerKind::App];
        let resources = ["r/a", "r/b"];
        let devices: BTreeMap<String, Device> = (0..12)
            .map(|d| {
                let health = if d % 5 == 3 { Health::Unhealthy } else { Health::Healthy };
                (format!("d{d}"), Device { id: format!("d{d}"), health, numa_nodes: vec![d % 2] })
            })
            .collect();
        let mut a = Allocations::default();
        for step in 0..3000 {
            let pod = format!("p{}", next(6));
            let container = format!("c{}", next(3));
            let resource = resources[next(2) as usize];
            match next(10) {
                0..=4 => {
                    let ids: Vec<String> = (0..1 + next(3)).map(|_| format!("d{}", next(12))).collect();
                    let kind = kinds[next(3) as usize];
                    let held = held(&pod, &container, resource, kind, &ids);
                    a.insert(&pod, &container, kind, resource, held);
                }
                5 | 6 => a.remove(&pod, &container, resource),
                7 if step % 2 == 0 => {
                    a.remove_pod(&pod);
                }
                7 => {
                    let others: Vec<String> = (0..6).map(|p| format!("p{p}")).filter(|p| *p != pod).collect();
                    let live: std::collections::HashSet<&str> = others.iter().map(String::as_str).collect();
                    let freed = a.retain_pods(&live);
                    assert!(freed.keys().all(|p| *p == pod), "step {step}: only {pod} is an orphan: {freed:?}");
                    assert!(!a.pods.contains_key(&pod));
                }
                8 => a.reserve(resource, &[format!("d{}", next(12))]),
                _ => a.unreserve(resource, &[format!("d{}", next(12))]),
            }
            if step == 1500 {
                let reserved: Vec<(String, Vec<String>)> = a
                    .uses
                    .iter()
                    .map(|(r, d)| (r.clone(), d.iter().filter(|(_, u)| u.reserved).map(|(id, _)| id.clone()).collect()))
                    .collect();
                a = Allocations::restored(std::mem::take(&mut a.pods));
                for (resource, ids) in reserved {
                    a.reserve(&resource, &ids);
                }
            }
            for resource in resources {
                for pod in (0..6).map(|p| format!("p{p}")) {
                    let mut reusable: Vec<String> = a
                        .pods
                        .get(&pod)
                        .into_iter()
                        .flat_map(|c| c.values())
                        .filter(|r| r.kind == ContainerKind::Init)
                        .filter_map(|r| r.resources.get(resource))
                        .flat_map(|h| h.device_ids.iter().cloned())
                        .filter(|id| !brute_force_taken(&a, resource, &pod, id))
                        .collect();
                    reusable.sort();
                    reusable.dedup();
                    assert_eq!(a.reusable(resource, &pod), reusable, "step {step}: reusable {resource} for {pod}");
                    let free: Vec<&str> =
                        free_devices(&devices, &a, resource, &pod).into_iter().map(|f| f.id).collect();
                    let expected: Vec<&str> = devices
                        .values()
                        .filter(|d| d.health == Health::Healthy && !brute_force_taken(&a, resource, &pod, &d.id))
                        .map(|d| d.id.as_str())
                        .collect();
                    assert_eq!(free, expected, "step {step}: free {resource} for {pod}");
                    for id in (0..12).map(|d| format!("d{d}")) {
                        assert_eq!(
                            a.is_taken(resource, &pod, &id),
                            brute_force_taken(&a, resource, &pod, &id),
                            "step {step}: {resource} {id} for {pod}"
                        );
                    }
                }
            }
        }
        // Every holder entry belongs to a recorded allocation.
        let held_total: usize = a.uses.values().flat_map(|d| d.values()).map(|u| u.holders.len()).sum();
        let recorded: usize = a
            .pods
            .values()
            .flat_map(|c| c.values())
            .flat_map(|r| r.resources.values())
            .map(|h| h.device_ids.iter().collect::<std::collections::BTreeSet<_>>().len())
            .sum();
        assert_eq!(held_total, recorded, "no stale holders");
    }
}
