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
#[serde(rename_all = "camelCase")]
pub struct MountSpec {
    /// Path in the container.
    pub container_path: String,
    /// Path on the host.
    pub host_path: String,
    /// Read-only.
    pub read_only: bool,
}

pub use kubelet_provider::DeviceNode;

/// The run options a container's devices add.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
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
    pub conflicts: Vec<RunOptionConflict>,
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

/// What kind of run option two resources disagreed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum RunOptionKind {
    /// An environment variable (keyed by name).
    Env,
    /// An annotation for the runtime (keyed by name).
    Annotation,
    /// A mount (keyed by container path; the value is the host path).
    Mount,
    /// A device node (keyed by container path; the value is the host path).
    Device,
}

impl std::fmt::Display for RunOptionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RunOptionKind::Env => "env",
            RunOptionKind::Annotation => "annotation",
            RunOptionKind::Mount => "mount",
            RunOptionKind::Device => "device",
        })
    }
}

/// Two resources gave a container different values for one run option; the
/// first resource (in name order) won.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunOptionConflict {
    /// What kind of option.
    pub what: RunOptionKind,
    /// Its key: the variable or annotation name, or the container path.
    pub key: String,
    /// The value kept (for mounts and devices, the host path).
    pub kept: String,
    /// The resource whose value was kept.
    pub kept_from: String,
    /// The value dropped (for mounts and devices, the host path).
    pub dropped: String,
    /// The resource whose value was dropped.
    pub dropped_from: String,
}

impl std::fmt::Display for RunOptionConflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let RunOptionConflict { what, key, kept, dropped, dropped_from, .. } = self;
        match what {
            RunOptionKind::Env | RunOptionKind::Annotation => write!(
                f,
                "{what} {key}: {dropped_from} sets {dropped:?}, an earlier resource set {kept:?}; keeping {kept:?}"
            ),
            RunOptionKind::Mount | RunOptionKind::Device => write!(
                f,
                "{what} {key}: {dropped_from} uses {dropped}, an earlier resource used {kept}; keeping the earlier one"
            ),
        }
    }
}

impl RunOptions {
    /// Merges the run options of several resources, in the order given (the
    /// callers give resource-name order): on a conflict the first resource's
    /// value wins and the conflict is recorded.
    pub(crate) fn merged<'a>(parts: impl IntoIterator<Item = (&'a str, &'a RunOptions)>) -> RunOptions {
        let mut merged = RunOptions::default();
        // Which resource set each key first, to name it in conflicts.
        let mut origins: BTreeMap<(RunOptionKind, &'a str), &'a str> = BTreeMap::new();
        for (resource, options) in parts {
            let mut conflicts = Vec::new();
            let mut merge = Merge { resource, origins: &mut origins, conflicts: &mut conflicts };
            merge.map(RunOptionKind::Env, &mut merged.envs, &options.envs);
            merge.map(RunOptionKind::Annotation, &mut merged.annotations, &options.annotations);
            merge.by_path(RunOptionKind::Mount, &mut merged.mounts, &options.mounts, |m| {
                (&m.container_path, &m.host_path)
            });
            merge.by_path(RunOptionKind::Device, &mut merged.devices, &options.devices, |d| {
                (&d.container_path, &d.host_path)
            });
            merged.conflicts.append(&mut conflicts);
            for name in &options.cdi_devices {
                if !merged.cdi_devices.contains(name) {
                    merged.cdi_devices.push(name.clone());
                }
            }
        }
        merged
    }
}

/// One resource's options being merged into the container's.
struct Merge<'m, 'a> {
    resource: &'a str,
    origins: &'m mut BTreeMap<(RunOptionKind, &'a str), &'a str>,
    conflicts: &'m mut Vec<RunOptionConflict>,
}

impl<'a> Merge<'_, 'a> {
    fn conflict(&mut self, what: RunOptionKind, key: &'a str, kept: &str, dropped: &str) {
        self.conflicts.push(RunOptionConflict {
            what,
            key: key.to_owned(),
            kept: kept.to_owned(),
            kept_from: self.origins.get(&(what, key)).copied().unwrap_or_default().to_owned(),
            dropped: dropped.to_owned(),
            dropped_from: self.resource.to_owned(),
        });
    }

    fn map(&mut self, what: RunOptionKind, ours: &mut BTreeMap<String, String>, theirs: &'a BTreeMap<String, String>) {
        for (key, value) in theirs {
            match ours.get(key) {
                Some(existing) if existing != value => {
                    let existing = existing.clone();
                    self.conflict(what, key, &existing, value);
                }
                Some(_) => {}
                None => {
                    ours.insert(key.clone(), value.clone());
                    self.origins.insert((what, key), self.resource);
                }
            }
        }
    }

    /// Merges items keyed by their container path; `paths` gives an item's
    /// container path and host path.
    fn by_path<T: Clone + PartialEq>(
        &mut self,
        what: RunOptionKind,
        ours: &mut Vec<T>,
        theirs: &'a [T],
        paths: impl Fn(&T) -> (&String, &String),
    ) {
        for item in theirs {
            let (key, source) = paths(item);
            match ours.iter().find(|o| paths(o).0 == key) {
                Some(existing) if existing != item => {
                    let kept = paths(existing).1.clone();
                    self.conflict(what, key, &kept, source);
                }
                Some(_) => {}
                None => {
                    ours.push(item.clone());
                    self.origins.insert((what, key), self.resource);
                }
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
        a.mounts.push(MountSpec { container_path: "/m".into(), host_path: "/host/a".into(), read_only: true });
        b.mounts.push(MountSpec { container_path: "/m".into(), host_path: "/host/b".into(), read_only: true });
        let merged = RunOptions::merged([("a.com/x", &a), ("b.com/y", &b)]);
        assert_eq!(merged.envs["X"], "1");
        assert_eq!(merged.envs["Y"], "3");
        assert_eq!(merged.cdi_devices, ["v.com/gpu=0"]);
        assert_eq!(merged.mounts.len(), 1);
        assert_eq!(
            merged.conflicts,
            [
                RunOptionConflict {
                    what: RunOptionKind::Env,
                    key: "X".into(),
                    kept: "1".into(),
                    kept_from: "a.com/x".into(),
                    dropped: "2".into(),
                    dropped_from: "b.com/y".into(),
                },
                RunOptionConflict {
                    what: RunOptionKind::Mount,
                    key: "/m".into(),
                    kept: "/host/a".into(),
                    kept_from: "a.com/x".into(),
                    dropped: "/host/b".into(),
                    dropped_from: "b.com/y".into(),
                },
            ]
        );
        let texts: Vec<String> = merged.conflicts.iter().map(ToString::to_string).collect();
        assert_eq!(
            texts,
            [
                r#"env X: b.com/y sets "2", an earlier resource set "1"; keeping "1""#,
                "mount /m: b.com/y uses /host/b, an earlier resource used /host/a; keeping the earlier one",
            ]
        );
    }

    /// Fuzz target: a device plugin's Allocate answers (protobuf bytes):
    /// decoded or refused, then turned into run options and merged; never
    /// a panic.
    #[test]
    fn fuzz_allocate_answers() {
        use prost::Message as _;
        let container = api::ContainerAllocateResponse {
            envs: [("FAKE_DEVICES".to_owned(), "a,b".to_owned())].into_iter().collect(),
            mounts: vec![api::Mount { container_path: "/dev/shm".into(), host_path: "/tmp".into(), read_only: true }],
            devices: vec![api::DeviceSpec {
                container_path: "/dev/gpu0".into(),
                host_path: "/dev/null".into(),
                permissions: "rw".into(),
            }],
            annotations: [("a".to_owned(), "b".to_owned())].into_iter().collect(),
            cdi_devices: vec![api::CdiDevice { name: "v.com/gpu=a".into() }],
        };
        let seed = api::AllocateResponse { container_responses: vec![container.clone(), container] }.encode_to_vec();
        let ran = crate::fuzz::Fuzz::new("allocate").seed(seed).run(|input| {
            let Ok(response) = api::AllocateResponse::decode(input) else { return };
            let options: Vec<RunOptions> = response.container_responses.into_iter().map(RunOptions::from).collect();
            let _ = RunOptions::merged(options.iter().map(|o| ("fuzz.example.com/gpu", o)));
        });
        assert!(ran > 1);
    }
}
