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

impl From<&RunOptions> for api::ContainerAllocateResponse {
    fn from(o: &RunOptions) -> Self {
        api::ContainerAllocateResponse {
            envs: o.envs.clone().into_iter().collect(),
            mounts: o
                .mounts
                .iter()
                .map(|m| api::Mount {
                    container_path: m.container_path.clone(),
                    host_path: m.host_path.clone(),
                    read_only: m.read_only,
                })
                .collect(),
            devices: o
                .devices
                .iter()
                .map(|d| api::DeviceSpec {
                    container_path: d.container_path.clone(),
                    host_path: d.host_path.clone(),
                    permissions: d.permissions.clone(),
                })
                .collect(),
            annotations: o.annotations.clone().into_iter().collect(),
            cdi_devices: o.cdi_devices.iter().map(|name| api::CdiDevice { name: name.clone() }).collect(),
        }
    }
}

impl RunOptions {
    /// Adds `other` (from `resource`) to `self`; on a conflict `self` wins
    /// and the conflict is recorded.
    pub(crate) fn merge(&mut self, resource: &str, other: &RunOptions) {
        merge_map("env", &mut self.envs, &other.envs, resource, &mut self.conflicts);
        merge_map("annotation", &mut self.annotations, &other.annotations, resource, &mut self.conflicts);
        merge_by(
            &mut self.mounts,
            &other.mounts,
            |m| &m.container_path,
            |m| &m.host_path,
            "mount",
            resource,
            &mut self.conflicts,
        );
        merge_by(
            &mut self.devices,
            &other.devices,
            |d| &d.container_path,
            |d| &d.host_path,
            "device",
            resource,
            &mut self.conflicts,
        );
        for name in &other.cdi_devices {
            if !self.cdi_devices.contains(name) {
                self.cdi_devices.push(name.clone());
            }
        }
    }
}

fn merge_map(
    what: &str,
    ours: &mut BTreeMap<String, String>,
    theirs: &BTreeMap<String, String>,
    resource: &str,
    conflicts: &mut Vec<String>,
) {
    for (key, value) in theirs {
        match ours.get(key) {
            Some(existing) if existing != value => conflicts.push(format!(
                "{what} {key}: {resource} sets {value:?}, an earlier resource set {existing:?}; keeping {existing:?}"
            )),
            Some(_) => {}
            None => {
                ours.insert(key.clone(), value.clone());
            }
        }
    }
}

/// Merges items keyed by their container path.
fn merge_by<T: Clone + PartialEq>(
    ours: &mut Vec<T>,
    theirs: &[T],
    key: impl Fn(&T) -> &String,
    source: impl Fn(&T) -> &String,
    what: &str,
    resource: &str,
    conflicts: &mut Vec<String>,
) {
    for item in theirs {
        match ours.iter().find(|o| key(o) == key(item)) {
            Some(existing) if existing != item => conflicts.push(format!(
                "{what} {}: {resource} uses {}, an earlier resource used {}; keeping the earlier one",
                key(item),
                source(item),
                source(existing)
            )),
            Some(_) => {}
            None => ours.push(item.clone()),
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
