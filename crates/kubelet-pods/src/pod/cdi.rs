//! Container Device Interface (CDI) specs, resolved by the node for
//! runtimes that do not read them.
//!
//! A DRA driver (or a device plugin) names the devices a container gets
//! by fully qualified CDI name (`vendor.com/class=device`) and writes a
//! spec file saying what each means: env, device nodes, mounts. Upstream
//! hands the names to the runtime in the CRI field `CDIDevices`, and a
//! runtime with CDI on applies the spec. containerd 1.6 ignores the field
//! and the WebAssembly provider has no CDI at all; for those
//! ([`kubelet_provider::Provider::reads_cdi`] false) the node reads the
//! specs itself and adds their edits to the container's run options, so a
//! claim works on any runtime.
//!
//! Specs are the `*.json`, `*.yaml` and `*.yml` files of the spec
//! directories (upstream's: `/etc/cdi`, then `/var/run/cdi`; a later
//! directory's spec of the same kind and device wins), read at each
//! container start (drivers write them while preparing a claim). A name no
//! spec defines is left to the runtime (the CRI field still carries it) and
//! logged as a warning: a CDI runtime would refuse the container
//! (`unresolvable CDI devices ...`), but the Go kubelet on containerd 1.6
//! runs it without the device's edits, and so does the node here. Hooks (`createRuntime`, ...) and
//! `intelRdt` need the runtime and are not run; a spec that has them is
//! still applied for the rest, with a warning.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kubelet_provider::{ContainerRunOptions, DeviceNode, EnvVar, Mount};
use serde::Deserialize;

/// Upstream's spec directories, in increasing priority.
pub const DEFAULT_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

#[derive(Debug, Deserialize, Default, Clone)]
#[serde(rename_all = "camelCase")]
struct Spec {
    #[serde(default)]
    kind: String,
    #[serde(default)]
    devices: Vec<Device>,
    #[serde(default)]
    container_edits: Edits,
}

#[derive(Debug, Deserialize, Default, Clone)]
#[serde(rename_all = "camelCase")]
struct Device {
    name: String,
    #[serde(default)]
    container_edits: Edits,
}

#[derive(Debug, Deserialize, Default, Clone)]
#[serde(rename_all = "camelCase")]
struct Edits {
    #[serde(default)]
    env: Vec<String>,
    #[serde(default)]
    device_nodes: Vec<NodeEdit>,
    #[serde(default)]
    mounts: Vec<MountEdit>,
    #[serde(default)]
    hooks: Vec<serde_json::Value>,
}

#[derive(Debug, Deserialize, Default, Clone)]
#[serde(rename_all = "camelCase")]
struct NodeEdit {
    path: String,
    #[serde(default)]
    host_path: Option<String>,
    #[serde(default)]
    permissions: Option<String>,
}

#[derive(Debug, Deserialize, Default, Clone)]
#[serde(rename_all = "camelCase")]
struct MountEdit {
    host_path: String,
    container_path: String,
    #[serde(default)]
    options: Vec<String>,
}

/// The spec directories' devices by fully qualified name, each with its
/// spec's edits and its own.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    devices: BTreeMap<String, (Edits, Edits, PathBuf)>,
    /// Files that could not be read or parsed, with why.
    pub problems: Vec<String>,
}

impl Registry {
    /// Reads every spec in `dirs` (a missing directory holds none).
    pub(crate) fn read(dirs: &[PathBuf]) -> Registry {
        let mut registry = Registry::default();
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(dir) else { continue };
            let mut files: Vec<PathBuf> = entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("json" | "yaml" | "yml")))
                .collect();
            files.sort();
            for file in files {
                match read_spec(&file) {
                    Ok(spec) => registry.add(spec, &file),
                    Err(why) => registry.problems.push(format!("{}: {why}", file.display())),
                }
            }
        }
        registry
    }

    fn add(&mut self, spec: Spec, file: &Path) {
        if !spec.kind.contains('/') {
            self.problems.push(format!("{}: kind {:?} is not vendor/class", file.display(), spec.kind));
            return;
        }
        for device in spec.devices {
            let name = format!("{}={}", spec.kind, device.name);
            self.devices.insert(name, (spec.container_edits.clone(), device.container_edits, file.to_owned()));
        }
    }

    /// Adds the edits of the devices `names` to `options`: env (replacing
    /// a variable of the same name), device nodes, mounts. Returns, in
    /// upstream's words, what no spec defines (`unresolvable CDI devices
    /// ...`, with the specs that could not be read), if any.
    pub(crate) fn apply(&self, names: &[String], options: &mut ContainerRunOptions) -> Option<String> {
        // A spec's own edits once, however many of its devices are named.
        let mut applied_specs = std::collections::BTreeSet::new();
        let mut missing = Vec::new();
        for name in names {
            let Some((spec_edits, device_edits, file)) = self.devices.get(name.as_str()) else {
                missing.push(name.as_str());
                continue;
            };
            if applied_specs.insert(file.clone()) {
                apply_edits(spec_edits, options, name, file);
            }
            apply_edits(device_edits, options, name, file);
        }
        if missing.is_empty() {
            return None;
        }
        let mut message = format!("unresolvable CDI devices {}", missing.join(", "));
        if !self.problems.is_empty() {
            message.push_str(&format!(" (unreadable specs: {})", self.problems.join("; ")));
        }
        Some(message)
    }
}

fn read_spec(file: &Path) -> Result<Spec, String> {
    let text = std::fs::read_to_string(file).map_err(|e| e.to_string())?;
    if file.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text).map_err(|e| e.to_string())
    } else {
        serde_saphyr::from_str(&text).map_err(|e| e.to_string())
    }
}

fn apply_edits(edits: &Edits, options: &mut ContainerRunOptions, device: &str, file: &Path) {
    for entry in &edits.env {
        let (name, value) = entry.split_once('=').unwrap_or((entry.as_str(), ""));
        options.env.retain(|e| e.name != name);
        options.env.push(EnvVar { name: name.to_owned(), value: value.to_owned() });
    }
    for node in &edits.device_nodes {
        let host_path = node.host_path.clone().unwrap_or_else(|| node.path.clone());
        if !options.devices.iter().any(|d| d.container_path == node.path) {
            options.devices.push(DeviceNode {
                container_path: node.path.clone(),
                host_path,
                permissions: node.permissions.clone().unwrap_or_else(|| "rwm".to_owned()),
            });
        }
    }
    for mount in &edits.mounts {
        if !options.mounts.iter().any(|m| m.container_path == mount.container_path) {
            options.mounts.push(Mount {
                container_path: mount.container_path.clone(),
                host_path: PathBuf::from(&mount.host_path),
                read_only: mount.options.iter().any(|o| o == "ro"),
                volume: None,
                propagation: Default::default(),
            });
        }
    }
    if !edits.hooks.is_empty() {
        tracing::warn!(device, spec = %file.display(), "CDI hooks need a runtime with CDI; not run");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claims_device_adds_its_env_nodes_and_mounts_and_an_unknown_one_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (early, late) = (dir.path().join("etc"), dir.path().join("run"));
        std::fs::create_dir_all(&early).expect("mkdir");
        std::fs::create_dir_all(&late).expect("mkdir");
        std::fs::write(
            early.join("gpu.yaml"),
            "cdiVersion: 0.6.0\nkind: gpu.example.com/gpu\ndevices:\n- name: gpu-0\n  containerEdits:\n    env: [OLD=1]\n",
        )
        .expect("spec");
        std::fs::write(
            late.join("gpu.json"),
            serde_json::json!({
                "cdiVersion": "0.3.0", "kind": "gpu.example.com/gpu",
                "containerEdits": {"env": ["VENDOR=example"]},
                "devices": [
                    {"name": "gpu-0", "containerEdits": {
                        "env": ["GPU=0", "SHARED=from-device"],
                        "deviceNodes": [{"path": "/dev/gpu0", "hostPath": "/dev/null"}],
                        "mounts": [{"hostPath": "/opt/gpu", "containerPath": "/usr/lib/gpu", "options": ["ro", "bind"]}],
                    }},
                    {"name": "gpu-1", "containerEdits": {"env": ["GPU=1"]}},
                ],
            })
            .to_string(),
        )
        .expect("spec");
        std::fs::write(late.join("broken.json"), "{").expect("spec");
        let registry = Registry::read(&[early, late, dir.path().join("absent")]);
        assert_eq!(registry.problems.len(), 1, "{:?}", registry.problems);

        let mut options = ContainerRunOptions::default();
        options.env.push(EnvVar { name: "SHARED".into(), value: "from-spec".into() });
        assert_eq!(registry.apply(&["gpu.example.com/gpu=gpu-0".to_owned()], &mut options), None);
        let env: Vec<(&str, &str)> = options.env.iter().map(|e| (e.name.as_str(), e.value.as_str())).collect();
        assert_eq!(env, [("VENDOR", "example"), ("GPU", "0"), ("SHARED", "from-device")], "the later directory wins");
        assert_eq!(options.devices[0].container_path, "/dev/gpu0");
        assert_eq!(options.devices[0].host_path, "/dev/null");
        assert_eq!(options.devices[0].permissions, "rwm");
        assert!(options.mounts[0].read_only && options.mounts[0].container_path == "/usr/lib/gpu");

        let error = registry
            .apply(&["gpu.example.com/gpu=gpu-1".to_owned(), "gpu.example.com/gpu=gpu-9".to_owned()], &mut options)
            .expect("gpu-9 is defined nowhere");
        assert_eq!(options.env_value("GPU"), Some("1"), "what is defined is applied");
        assert!(error.contains("unresolvable CDI devices gpu.example.com/gpu=gpu-9"), "{error}");
        assert!(error.contains("broken.json"), "{error}");
    }
}
