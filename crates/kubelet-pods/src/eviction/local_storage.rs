//! Local ephemeral storage limits, checked at every eviction pass before
//! the node's thresholds, as upstream's eviction manager does with local
//! storage capacity isolation (on by default). A pod is evicted at once
//! (grace 0), `Evicted` with upstream's message, when
//!
//! 1. one of its `emptyDir` volumes with a `sizeLimit` holds more than it
//!    (`Usage of EmptyDir volume "cache" exceeds the limit "10Mi". `);
//! 2. else its ephemeral storage (its containers' writable layers, their
//!    logs and its disk-backed emptyDirs) exceeds the sum of its
//!    containers' `ephemeral-storage` limits (`Pod ephemeral local storage
//!    usage exceeds the total limit of containers 5Mi. `);
//! 3. else one container's writable layer and logs exceed its own limit
//!    (`Container bar exceeded its local ephemeral storage limit "5Mi". `).
//!
//! A writable layer counts only when the runtime keeps it on the root
//! dir's file system (no dedicated image file system), as upstream. Its
//! size is what the runtime reports (CRI `ContainerStats`, which
//! containerd refreshes every 10 s); a provider that reports none counts
//! logs and volumes only.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Container, Pod};
use kubelet_provider::Provider;
use kubelet_provider::quantity::parse_units;

/// Upstream's `eviction_signal` label of each kind of limit.
pub(crate) const EMPTY_DIR_SIGNAL: &str = "emptydirfs.limit";
/// … of a pod's total.
pub(crate) const POD_SIGNAL: &str = "ephemeralpodfs.limit";
/// … of one container's.
pub(crate) const CONTAINER_SIGNAL: &str = "ephemeralcontainerfs.limit";

/// A pod over one of its limits: what to say and which label to count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Exceeded {
    /// The eviction message.
    pub message: String,
    /// The metric's signal label.
    pub signal: &'static str,
}

/// What one pod holds on the node's disk, as measured now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PodStorage {
    /// Bytes in each emptyDir with a size limit, by volume name (any
    /// medium: a memory-backed one is measured too).
    pub empty_dirs: BTreeMap<String, u128>,
    /// Bytes of the pod's disk-backed emptyDirs and logs.
    pub volumes_and_logs: u128,
    /// Bytes of its running containers' writable layers (counted ones).
    pub layers: u128,
    /// Each running container's writable layer (counted ones only) and
    /// logs, by name.
    pub containers: BTreeMap<String, u128>,
}

fn limit_of(container: &Container) -> Option<(u128, String)> {
    let quantity = container.resources.as_ref()?.limits.as_ref()?.get("ephemeral-storage")?;
    let bytes = parse_units(&quantity.0).ok().filter(|b| *b > 0)?;
    Some((bytes, quantity.0.clone()))
}

/// The pod's total `ephemeral-storage` limit as upstream's `PodLimits`
/// sums it: app containers and sidecars, or the largest of what a
/// run-to-completion init container holds beside the sidecars started
/// before it; `None` when no container has one.
pub(crate) fn pod_limit(pod: &Pod) -> Option<u128> {
    let spec = pod.spec.as_ref()?;
    let value = |c: &Container| limit_of(c).map_or(0, |(b, _)| b);
    let any = spec.containers.iter().chain(spec.init_containers.iter().flatten()).any(|c| limit_of(c).is_some());
    if !any {
        return None;
    }
    let mut total: u128 = spec.containers.iter().map(value).sum();
    let mut sidecars = 0;
    let mut largest_init = 0;
    for init in spec.init_containers.iter().flatten() {
        if init.restart_policy.as_deref() == Some("Always") {
            sidecars += value(init);
            total += value(init);
            largest_init = largest_init.max(sidecars);
        } else {
            largest_init = largest_init.max(sidecars + value(init));
        }
    }
    Some(total.max(largest_init))
}

/// Whether `pod` has any limit this module checks.
pub(crate) fn has_limits(pod: &Pod) -> bool {
    let Some(spec) = pod.spec.as_ref() else { return false };
    let sized = spec.volumes.iter().flatten().any(|v| {
        v.empty_dir.as_ref().and_then(|e| e.size_limit.as_ref()).is_some_and(|q| parse_units(&q.0).unwrap_or(0) > 0)
    });
    sized || pod_limit(pod).is_some()
}

/// The first limit `pod` exceeds with `storage`, in upstream's order.
pub(crate) fn exceeded(pod: &Pod, storage: &PodStorage) -> Option<Exceeded> {
    let spec = pod.spec.as_ref()?;
    for volume in spec.volumes.iter().flatten() {
        let Some(limit) = volume.empty_dir.as_ref().and_then(|e| e.size_limit.as_ref()) else { continue };
        let Ok(bytes) = parse_units(&limit.0) else { continue };
        let used = storage.empty_dirs.get(&volume.name).copied();
        if bytes > 0 && used.is_some_and(|u| u > bytes) {
            return Some(Exceeded {
                message: format!("Usage of EmptyDir volume {:?} exceeds the limit {:?}. ", volume.name, limit.0),
                signal: EMPTY_DIR_SIGNAL,
            });
        }
    }
    if let Some(limit) = pod_limit(pod) {
        let used = storage.volumes_and_logs + storage.layers;
        if used > limit {
            return Some(Exceeded {
                message: format!(
                    "Pod ephemeral local storage usage exceeds the total limit of containers {}. ",
                    super::manager::binary_quantity(limit)
                ),
                signal: POD_SIGNAL,
            });
        }
    }
    for container in &spec.containers {
        let Some((bytes, text)) = limit_of(container) else { continue };
        if storage.containers.get(&container.name).is_some_and(|used| *used > bytes) {
            return Some(Exceeded {
                message: format!("Container {} exceeded its local ephemeral storage limit {text:?}. ", container.name),
                signal: CONTAINER_SIGNAL,
            });
        }
    }
    None
}

/// Measures what each of `pods` holds under `root_dir`, the writable
/// layers from `provider` when `layers_count` (no dedicated image file
/// system).
pub(crate) async fn measure(
    root_dir: &Path,
    pods: &[Pod],
    provider: Option<&Arc<dyn Provider>>,
    layers_count: bool,
) -> Vec<PodStorage> {
    let (usage, _) = crate::pod::usage::pod_usage(pods.to_vec(), if layers_count { provider } else { None }).await;
    let device = super::manager::device_of(root_dir);
    pods.iter()
        .zip(usage)
        .map(|(pod, usage)| {
            let (logs, empty_dir_root) = super::manager::storage_dirs(root_dir, pod);
            let mut empty_dirs = BTreeMap::new();
            for volume in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
                if volume.empty_dir.as_ref().is_some_and(|e| e.size_limit.is_some()) {
                    empty_dirs.insert(
                        volume.name.clone(),
                        super::manager::disk_usage(&empty_dir_root.join(&volume.name), None),
                    );
                }
            }
            let volumes_and_logs =
                super::manager::disk_usage(&logs, device) + super::manager::disk_usage(&empty_dir_root, device);
            let mut containers = BTreeMap::new();
            let mut layers = 0;
            for container in &usage.containers {
                let layer = u128::from(container.stats.fs_used_bytes.unwrap_or(0));
                let own_logs = super::manager::disk_usage(&logs.join(&container.name), device);
                layers += layer;
                containers.insert(container.name.clone(), layer + own_logs);
            }
            PodStorage { empty_dirs, volumes_and_logs, layers, containers }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).expect("pod")
    }

    #[test]
    fn the_pod_limit_sums_apps_and_sidecars_and_covers_the_largest_init_container() {
        let limited = |name: &str, limit: &str| serde_json::json!({"name": name, "resources": {"limits": {"ephemeral-storage": limit}}});
        let p = pod(serde_json::json!({"spec": {
            "containers": [limited("a", "5Mi"), {"name": "b"}],
            "initContainers": [
                {"name": "side", "restartPolicy": "Always", "resources": {"limits": {"ephemeral-storage": "1Mi"}}},
                limited("big", "20Mi"),
            ],
        }}));
        assert_eq!(pod_limit(&p), Some(21 << 20), "the init container beside the sidecar is the largest");
        let p = pod(serde_json::json!({"spec": {"containers": [{"name": "a"}]}}));
        assert_eq!(pod_limit(&p), None);
        assert!(!has_limits(&p));
    }

    #[test]
    fn limits_are_judged_in_upstreams_order_with_its_messages() {
        let p = pod(serde_json::json!({"spec": {
            "containers": [
                {"name": "bar", "resources": {"limits": {"ephemeral-storage": "5Mi"}}},
                {"name": "baz", "resources": {"limits": {"ephemeral-storage": "5Mi"}}},
            ],
            "volumes": [{"name": "cache", "emptyDir": {"sizeLimit": "1Mi"}}],
        }}));
        assert!(has_limits(&p));
        let mut storage = PodStorage::default();
        storage.empty_dirs.insert("cache".into(), 1 << 20);
        storage.containers.insert("bar".into(), 5 << 20);
        assert_eq!(exceeded(&p, &storage), None, "at a limit is not over it");

        storage.containers.insert("bar".into(), 6 << 20);
        let over = exceeded(&p, &storage).expect("the container is over");
        assert_eq!(over.message, "Container bar exceeded its local ephemeral storage limit \"5Mi\". ");
        assert_eq!(over.signal, CONTAINER_SIGNAL);

        storage.volumes_and_logs = 4 << 20;
        storage.layers = (6 << 20) + 1;
        let over = exceeded(&p, &storage).expect("the pod is over");
        assert_eq!(over.message, "Pod ephemeral local storage usage exceeds the total limit of containers 10Mi. ");

        storage.empty_dirs.insert("cache".into(), (1 << 20) + 1);
        let over = exceeded(&p, &storage).expect("the volume is over");
        assert_eq!(over.message, "Usage of EmptyDir volume \"cache\" exceeds the limit \"1Mi\". ");
        assert_eq!(over.signal, EMPTY_DIR_SIGNAL);
    }
}
