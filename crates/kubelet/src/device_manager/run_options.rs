//! What a container gets from its devices: environment, mounts, device
//! nodes, annotations and CDI device names, merged across resources.
//!
//! Upstream merges several resources' `Allocate` answers in map order, so a
//! conflict (two resources setting one env var differently) resolves
//! differently from run to run. Here the answers are merged in resource-name
//! order, the first one wins, and every conflict is reported.

use std::collections::BTreeMap;

use kubelet_api::deviceplugin::v1beta1 as api;

/// A host path mounted into the container.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MountSpec {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// Read-only.
    pub read_only: bool,
}

/// A device node made available in the container.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceNode {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// Any of `r`, `w`, `m`.
    pub permissions: String,
}

/// The run options a container's devices add.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RunOptions {
    /// Environment variables.
    pub envs: BTreeMap<String, String>,
    /// Mounts, by container path order of arrival.
    pub mounts: Vec<MountSpec>,
    /// Device nodes.
    pub devices: Vec<DeviceNode>,
    /// Annotations for the runtime.
    pub annotations: BTreeMap<String, String>,
    /// Fully qualified CDI device names.
    pub cdi_devices: Vec<String>,
    /// Conflicts found while merging resources (the first resource won).
    pub conflicts: Vec<String>,
}

impl From<api::ContainerAllocateResponse> for RunOptions {
    fn from(r: api::ContainerAllocateResponse) -> Self {
        RunOptions {
            envs: r.envs.into_iter().collect(),
            mounts: r
                .mounts
                .into_iter()
                .map(|m| MountSpec { container_path: m.container_path, host_path: m.host_path, read_only: m.read_only })
                .collect(),
            devices: r
                .devices
                .into_iter()
                .map(|d| DeviceNode {
                    container_path: d.container_path,
                    host_path: d.host_path,
                    permissions: d.permissions,
                })
                .collect(),
            annotations: r.annotations.into_iter().collect(),
            cdi_devices: r.cdi_devices.into_iter().map(|c| c.name).collect(),
            conflicts: Vec::new(),
        }
    }
}

impl RunOptions {
    /// Adds `other` (from `resource`) to `self`; on a conflict `self` wins
    /// and the conflict is recorded.
    pub(crate) fn merge(&mut self, resource: &str, other: &RunOptions) {
        for (key, value) in &other.envs {
            match self.envs.get(key) {
                Some(existing) if existing != value => self.conflicts.push(format!(
                    "env {key}: {resource} sets {value:?}, an earlier resource set {existing:?}; keeping {existing:?}"
                )),
                Some(_) => {}
                None => {
                    self.envs.insert(key.clone(), value.clone());
                }
            }
        }
        for mount in &other.mounts {
            match self.mounts.iter().find(|m| m.container_path == mount.container_path) {
                Some(existing) if existing != mount => self.conflicts.push(format!(
                    "mount {}: {resource} mounts {}, an earlier resource mounted {}; keeping the earlier one",
                    mount.container_path, mount.host_path, existing.host_path
                )),
                Some(_) => {}
                None => self.mounts.push(mount.clone()),
            }
        }
        for device in &other.devices {
            match self.devices.iter().find(|d| d.container_path == device.container_path) {
                Some(existing) if existing != device => self.conflicts.push(format!(
                    "device {}: {resource} maps {}, an earlier resource mapped {}; keeping the earlier one",
                    device.container_path, device.host_path, existing.host_path
                )),
                Some(_) => {}
                None => self.devices.push(device.clone()),
            }
        }
        for (key, value) in &other.annotations {
            match self.annotations.get(key) {
                Some(existing) if existing != value => self.conflicts.push(format!(
                    "annotation {key}: {resource} sets {value:?}, an earlier resource set {existing:?}; keeping {existing:?}"
                )),
                Some(_) => {}
                None => {
                    self.annotations.insert(key.clone(), value.clone());
                }
            }
        }
        for name in &other.cdi_devices {
            if !self.cdi_devices.contains(name) {
                self.cdi_devices.push(name.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_keeps_the_first_and_reports_conflicts() {
        let mut a = RunOptions::default();
        a.envs.insert("X".into(), "1".into());
        a.cdi_devices.push("v.com/gpu=0".into());
        let mut b = RunOptions::default();
        b.envs.insert("X".into(), "2".into());
        b.envs.insert("Y".into(), "3".into());
        b.cdi_devices.push("v.com/gpu=0".into());
        let mut merged = RunOptions::default();
        merged.merge("a.com/x", &a);
        merged.merge("b.com/y", &b);
        assert_eq!(merged.envs["X"], "1");
        assert_eq!(merged.envs["Y"], "3");
        assert_eq!(merged.cdi_devices, ["v.com/gpu=0"]);
        assert_eq!(merged.conflicts, [r#"env X: b.com/y sets "2", an earlier resource set "1"; keeping "1""#]);
    }
}
