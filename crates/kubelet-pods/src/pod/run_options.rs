//! One container's run options: the spec's command, env and volume mounts,
//! merged with what its devices add.
//!
//! Env as upstream builds it: the services' link variables first (when
//! `enableServiceLinks`; the API server's own `kubernetes` service always),
//! then `envFrom`, then `env` (each value's `$(VAR)` references expanded
//! against what came before; `fieldRef` and `resourceFieldRef` from the
//! downward API). `command` and `args` have their `$(VAR)` references
//! expanded against the container's env, and so has a mount's
//! `subPathExpr`.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Container, Pod, Service};

use crate::device_manager::RunOptions;
use crate::provider::{ContainerRunOptions, DeviceNode, EnvVar, Mount, MountPropagation};
use crate::volume::{DownwardContext, EnvObjects, ObjectKind, PodVolumes, VolumeKind, field_value, resource_value};

/// Why a container's configuration cannot be run
/// (`CreateContainerConfigError`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct ConfigError(pub String);

/// What a container's env reads besides its spec.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EnvSources<'a> {
    /// The ConfigMaps and Secrets it references (`None`: no API).
    pub objects: Option<&'a EnvObjects>,
    /// The services whose link variables it gets (already chosen: the
    /// pod's namespace's when it enables service links, and the API
    /// server's own).
    pub services: &'a [Service],
    /// The downward API's pod IPs and node resources.
    pub downward: &'a DownwardContext,
}

/// Builds the run options of `container`.
pub(crate) fn build(
    pod: &Pod,
    container: &Container,
    volumes: &PodVolumes,
    devices: &RunOptions,
    sources: EnvSources<'_>,
) -> Result<ContainerRunOptions, ConfigError> {
    let mut env: Vec<EnvVar> = service_env(sources.services);
    // envFrom first: env entries override what it brings.
    env_from(container, sources.objects, &mut env)?;
    for var in container.env.iter().flatten() {
        if let Some(value) = env_value(pod, container, var, &sources, &env)? {
            set(&mut env, &var.name, value);
        }
    }
    for (name, value) in &devices.envs {
        set(&mut env, name, value.clone());
    }
    let mut mounts = volume_mounts(pod, container, volumes, &env)?;
    for mount in &devices.mounts {
        mounts.push(Mount {
            container_path: mount.container_path.clone(),
            host_path: PathBuf::from(&mount.host_path),
            read_only: mount.read_only,
            volume: None,
            propagation: Default::default(),
        });
    }
    let mut device_nodes = volume_devices(pod, container, volumes)?;
    device_nodes.extend(devices.devices.iter().cloned());
    let expand_all =
        |list: &Option<Vec<String>>| list.iter().flatten().map(|item| expand(item, &env)).collect::<Vec<String>>();
    let (command, args) = (expand_all(&container.command), expand_all(&container.args));
    Ok(ContainerRunOptions {
        command,
        args,
        working_dir: container.working_dir.clone(),
        env,
        mounts,
        devices: device_nodes,
        annotations: devices.annotations.clone(),
        cdi_devices: devices.cdi_devices.clone(),
    })
}

/// The variables `envFrom` brings (each ConfigMap's or Secret's keys,
/// prefixed), into `env`.
fn env_from(container: &Container, objects: Option<&EnvObjects>, env: &mut Vec<EnvVar>) -> Result<(), ConfigError> {
    for from in container.env_from.iter().flatten() {
        let Some(objects) = objects else {
            return Err(ConfigError("envFrom needs the API server (static pods cannot use it)".into()));
        };
        let (kind, name, optional) = match (&from.config_map_ref, &from.secret_ref) {
            (Some(r), _) => (ObjectKind::ConfigMap, r.name.as_str(), r.optional.unwrap_or(false)),
            (None, Some(r)) => (ObjectKind::Secret, r.name.as_str(), r.optional.unwrap_or(false)),
            (None, None) => continue,
        };
        match objects.get(&(kind, name.to_owned())).cloned().flatten() {
            Some(data) => {
                let prefix = from.prefix.clone().unwrap_or_default();
                for (key, value) in data {
                    set(env, &format!("{prefix}{key}"), value);
                }
            }
            None if optional => {}
            None => return Err(ConfigError(format!("{} \"{name}\" not found", kind.noun()))),
        }
    }
    Ok(())
}

/// The value of the `env` entry `var` (`$(VAR)` expanded against `env`
/// so far); `None`: an optional reference that is missing, so the
/// variable is not set.
fn env_value(
    pod: &Pod,
    container: &Container,
    var: &k8s_openapi::api::core::v1::EnvVar,
    sources: &EnvSources<'_>,
    env: &[EnvVar],
) -> Result<Option<String>, ConfigError> {
    let from = match (&var.value, &var.value_from) {
        (_, Some(from)) => from,
        (Some(value), None) => return Ok(Some(expand(value, env))),
        (None, None) => return Ok(Some(String::new())),
    };
    let failed = |e: &dyn std::fmt::Display| ConfigError(format!("env {:?}: {e}", var.name));
    if let Some(field) = &from.field_ref {
        return field_value(pod, &field.field_path, sources.downward).map(Some).map_err(|e| failed(&e));
    }
    if let Some(resource) = &from.resource_field_ref {
        return resource_value(pod, Some(&container.name), resource, sources.downward)
            .map(Some)
            .map_err(|e| failed(&e));
    }
    let (kind, name, key, optional) = match (&from.config_map_key_ref, &from.secret_key_ref) {
        (Some(r), _) => (ObjectKind::ConfigMap, r.name.as_str(), r.key.as_str(), r.optional.unwrap_or(false)),
        (None, Some(r)) => (ObjectKind::Secret, r.name.as_str(), r.key.as_str(), r.optional.unwrap_or(false)),
        (None, None) => return Err(failed(&"unsupported valueFrom")),
    };
    let Some(objects) = sources.objects else {
        return Err(failed(&"configMap and secret references need the API server (static pods cannot use them)"));
    };
    match objects.get(&(kind, name.to_owned())).cloned().flatten() {
        None if optional => Ok(None),
        None => Err(ConfigError(format!("{} \"{name}\" not found", kind.noun()))),
        Some(data) => match data.get(key) {
            Some(value) => Ok(Some(value.clone())),
            None if optional => Ok(None),
            None => {
                let what = if kind == ObjectKind::Secret { "Secret" } else { "ConfigMap" };
                let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
                Err(ConfigError(format!("couldn't find key {key} in {what} {namespace}/{name}")))
            }
        },
    }
}

/// The container's `volumeDevices`: each a raw block volume's published
/// device file, read-write (`mrw`) or, for a read-only claim, `r`, as the
/// kubelet passes them (its link to the same file under the pod's
/// `volumeDevices/` dir; the runtime resolves either to the device).
fn volume_devices(pod: &Pod, container: &Container, volumes: &PodVolumes) -> Result<Vec<DeviceNode>, ConfigError> {
    let mut nodes = Vec::new();
    for device in container.volume_devices.iter().flatten() {
        if !device.device_path.starts_with('/') {
            return Err(ConfigError(format!("error DevicePath `{}` must be an absolute path", device.device_path)));
        }
        let Some(volume) = volumes.get(&device.name) else {
            return Err(ConfigError(format!(
                "cannot find volume {:?} to pass into container {:?}",
                device.name, container.name
            )));
        };
        if !volume.csi.as_ref().is_some_and(|c| c.block) {
            return Err(ConfigError(format!(
                "volume {} has volumeMode Filesystem, but is specified in volumeDevices",
                device.name
            )));
        }
        let read_only = pod
            .spec
            .iter()
            .flat_map(|s| s.volumes.iter().flatten())
            .find(|v| v.name == device.name)
            .and_then(|v| v.persistent_volume_claim.as_ref()?.read_only)
            .unwrap_or(false);
        nodes.push(DeviceNode {
            container_path: device.device_path.clone(),
            host_path: volume.host_path.display().to_string(),
            permissions: if read_only { "r" } else { "mrw" }.to_owned(),
        });
    }
    Ok(nodes)
}

/// The container's volume mounts as host paths (a `subPath` resolved
/// inside its volume, or copied out of an atomically written one).
fn volume_mounts(
    pod: &Pod,
    container: &Container,
    volumes: &PodVolumes,
    env: &[EnvVar],
) -> Result<Vec<Mount>, ConfigError> {
    // A volume the pod uses read-only (a claim or an inline CSI volume with
    // `readOnly: true`) is mounted read-only in every container, whatever
    // the mount says (the kubelet's `mustMountRO`).
    let read_only_volume = |name: &str| {
        pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()).find(|v| v.name == name).is_some_and(|v| {
            v.persistent_volume_claim.as_ref().and_then(|c| c.read_only).unwrap_or(false)
                || v.csi.as_ref().and_then(|c| c.read_only).unwrap_or(false)
        })
    };
    let mut mounts = Vec::new();
    for (index, mount) in container.volume_mounts.iter().flatten().enumerate() {
        let Some(volume) = volumes.get(&mount.name) else {
            // Volumes are set up when the pod starts, for the containers
            // it has then: one only a later ephemeral container uses is not.
            return Err(ConfigError(format!(
                "volumeMount {:?}: no such volume is set up for the pod (volumes are set up at its start for the containers that use them)",
                mount.name
            )));
        };
        if volume.csi.as_ref().is_some_and(|c| c.block) {
            return Err(ConfigError(format!(
                "volume {} has volumeMode Block, but is specified in volumeMounts",
                mount.name
            )));
        }
        let mut host_path: PathBuf = volume.host_path.clone();
        let expanded = mount.sub_path_expr.as_deref().filter(|s| !s.is_empty()).map(|e| expand(e, env));
        if let Some(sub) = expanded.as_deref().or(mount.sub_path.as_deref()).filter(|s| !s.is_empty()) {
            let failed = |why: String| ConfigError(format!("volumeMount {:?}: subPath {sub:?}: {why}", mount.name));
            if sub.starts_with('/') || sub.split('/').any(|p| p == "..") {
                return Err(failed("must stay inside the volume".into()));
            }
            let atomic = matches!(volume.kind, VolumeKind::ApiData | VolumeKind::DownwardApi);
            host_path = if atomic {
                subpath_copy(&volume.host_path, sub, &mount.name, &container.name, index).map_err(failed)?
            } else {
                subpath_inside(&volume.host_path, sub).map_err(failed)?
            };
        }
        mounts.push(Mount {
            container_path: mount.mount_path.clone(),
            host_path,
            read_only: mount.read_only.unwrap_or(false) || read_only_volume(&mount.name),
            volume: Some(mount.name.clone()),
            propagation: propagation(container, mount.mount_propagation.as_deref())
                .map_err(|why| ConfigError(format!("volumeMount {:?}: {why}", mount.name)))?,
        });
    }
    Ok(mounts)
}

/// A volume mount's `mountPropagation` as the runtime is told it, checked
/// as the API server's validation checks it (the node checks again: a
/// static pod or an API server without that validation reaches it too).
pub(crate) fn propagation(container: &Container, mode: Option<&str>) -> Result<MountPropagation, String> {
    match mode {
        None | Some("None") => Ok(MountPropagation::Private),
        Some("HostToContainer") => Ok(MountPropagation::HostToContainer),
        Some("Bidirectional") if crate::pod::spec::privileged(container) => Ok(MountPropagation::Bidirectional),
        Some("Bidirectional") => Err(
            "mountPropagation: Forbidden: Bidirectional mount propagation is available only to privileged containers"
                .into(),
        ),
        Some(other) => Err(format!(
            "mountPropagation: Unsupported value: {other:?}: supported values: \"Bidirectional\", \"HostToContainer\", \"None\""
        )),
    }
}

/// `sub` inside the volume at `root`, resolved without leaving it: every
/// part that exists is followed (symlinks too) and must stay inside the
/// volume; the parts that do not exist yet are made as directories with
/// the volume's own mode (an emptyDir's 0777, so the container's user can
/// write them), as upstream makes a subPath.
fn subpath_inside(root: &std::path::Path, sub: &str) -> Result<PathBuf, String> {
    let root = std::fs::canonicalize(root).map_err(|e| format!("{}: {e}", root.display()))?;
    let mode = std::fs::metadata(&root).map(|m| m.permissions()).ok();
    let mut current = root.clone();
    let parts: Vec<&str> = sub.split('/').filter(|p| !p.is_empty() && *p != ".").collect();
    for (i, part) in parts.iter().enumerate() {
        let next = current.join(part);
        match std::fs::symlink_metadata(&next) {
            Ok(_) => {
                let real = std::fs::canonicalize(&next).map_err(|e| format!("{}: {e}", next.display()))?;
                if !real.starts_with(&root) {
                    return Err(format!("leads out of the volume (to {})", real.display()));
                }
                current = real;
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                for missing in &parts[i..] {
                    current = current.join(missing);
                    std::fs::create_dir(&current).map_err(|e| format!("{}: {e}", current.display()))?;
                    if let Some(mode) = &mode {
                        let _ = std::fs::set_permissions(&current, mode.clone());
                    }
                }
                return Ok(current);
            }
            Err(error) => return Err(format!("{}: {error}", next.display())),
        }
    }
    Ok(current)
}

/// A subPath of a volume whose contents are swapped while the pod runs
/// (configMap, secret, projected, downwardAPI): as upstream, it does not
/// follow later versions; it is a copy of what the path holds now, under
/// `<pod dir>/volume-subpaths/<volume>/<container>/<mount index>`, so that
/// removing an old version never pulls a file from under a container. A
/// path the volume does not have is an empty directory.
fn subpath_copy(
    root: &std::path::Path,
    sub: &str,
    volume: &str,
    container: &str,
    index: usize,
) -> Result<PathBuf, String> {
    // `<pod dir>/volumes/<plugin>/<volume>`.
    let pod_dir = root.ancestors().nth(3).ok_or_else(|| format!("{} is not a pod volume", root.display()))?;
    let target = pod_dir.join("volume-subpaths").join(volume).join(container).join(index.to_string());
    let io = |path: &std::path::Path, e: std::io::Error| format!("{}: {e}", path.display());
    match std::fs::symlink_metadata(&target) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(&target).map_err(|e| io(&target, e))?,
        Ok(_) => std::fs::remove_file(&target).map_err(|e| io(&target, e))?,
        Err(_) => {}
    }
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    }
    let canonical_root = std::fs::canonicalize(root).map_err(|e| io(root, e))?;
    let source = match std::fs::canonicalize(root.join(sub)) {
        Ok(source) if source.starts_with(&canonical_root) => source,
        Ok(source) => return Err(format!("leads out of the volume (to {})", source.display())),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir(&target).map_err(|e| io(&target, e))?;
            return Ok(target);
        }
        Err(error) => return Err(io(&root.join(sub), error)),
    };
    copy_tree(&source, &target).map_err(|e| io(&source, e))?;
    Ok(target)
}

/// Copies a file (with its mode) or a directory tree.
fn copy_tree(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
    let meta = std::fs::metadata(from)?;
    if !meta.is_dir() {
        std::fs::copy(from, to)?;
    } else {
        std::fs::create_dir(to)?;
        std::fs::set_permissions(to, meta.permissions())?;
    }
    // Its group too (a pod's fsGroup); the node's own user may not change it.
    let _ = std::os::unix::fs::chown(to, None, Some(std::os::unix::fs::MetadataExt::gid(&meta)));
    if !meta.is_dir() {
        return Ok(());
    }
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        copy_tree(&entry.path(), &to.join(entry.file_name()))?;
    }
    Ok(())
}

/// The link variables of `services`, as upstream names them
/// (`<NAME>_SERVICE_HOST`, `<NAME>_SERVICE_PORT[_<PORT NAME>]`, and the
/// docker-link `<NAME>_PORT…` family). Services without a cluster IP (and
/// headless ones) have none.
pub(crate) fn service_env(services: &[Service]) -> Vec<EnvVar> {
    let mut env = Vec::new();
    let name_of = |text: &str| text.replace('-', "_").to_uppercase();
    let mut push = |name: String, value: String| env.push(EnvVar { name, value });
    for service in services {
        let Some(spec) = service.spec.as_ref() else { continue };
        let Some(ip) = spec.cluster_ip.as_deref().filter(|ip| !ip.is_empty() && *ip != "None") else { continue };
        let prefix = name_of(service.metadata.name.as_deref().unwrap_or_default());
        let ports = spec.ports.as_deref().unwrap_or_default();
        push(format!("{prefix}_SERVICE_HOST"), ip.to_owned());
        if let Some(first) = ports.first() {
            push(format!("{prefix}_SERVICE_PORT"), first.port.to_string());
        }
        for port in ports {
            if let Some(port_name) = port.name.as_deref().filter(|n| !n.is_empty()) {
                push(format!("{prefix}_SERVICE_PORT_{}", name_of(port_name)), port.port.to_string());
            }
        }
        let host = match ip.parse::<std::net::IpAddr>() {
            Ok(std::net::IpAddr::V6(v6)) => format!("[{v6}]"),
            _ => ip.to_owned(),
        };
        for (i, port) in ports.iter().enumerate() {
            let protocol = port.protocol.as_deref().unwrap_or("TCP");
            let url = format!("{}://{host}:{}", protocol.to_lowercase(), port.port);
            if i == 0 {
                push(format!("{prefix}_PORT"), url.clone());
            }
            let port_prefix = format!("{prefix}_PORT_{}_{}", port.port, protocol.to_uppercase());
            push(port_prefix.clone(), url);
            push(format!("{port_prefix}_PROTO"), protocol.to_lowercase());
            push(format!("{port_prefix}_PORT"), port.port.to_string());
            push(format!("{port_prefix}_ADDR"), ip.to_owned());
        }
    }
    env
}

fn set(env: &mut Vec<EnvVar>, name: &str, value: String) {
    match env.iter_mut().find(|e| e.name == name) {
        Some(existing) => existing.value = value,
        None => env.push(EnvVar { name: name.to_owned(), value }),
    }
}

/// Expands `$(NAME)` references to variables defined earlier; `$$` escapes
/// `$`; unknown references stay as written (upstream's rules).
fn expand(value: &str, env: &[EnvVar]) -> String {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if let Some(after) = tail.strip_prefix("$$") {
            out.push('$');
            rest = after;
        } else if let Some(inner) = tail.strip_prefix("$(")
            && let Some(end) = inner.find(')')
        {
            let name = &inner[..end];
            match env.iter().find(|e| e.name == name) {
                Some(var) => out.push_str(&var.value),
                None => out.push_str(&tail[..end + 3]),
            }
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_to_earlier_variables_expand() {
        let env = vec![EnvVar { name: "A".into(), value: "x".into() }];
        assert_eq!(expand("$(A)-$(B)-$$(A)-$", &env), "x-$(B)-$(A)-$");
    }

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(
            serde_json::json!({"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": spec}),
        )
        .expect("pod")
    }

    fn options(pod: &Pod, services: &[Service]) -> Result<ContainerRunOptions, ConfigError> {
        let context = DownwardContext {
            pod_ips: vec!["10.1.2.3".parse().expect("ip")],
            host_ips: vec!["192.0.2.7".parse().expect("ip")],
            allocatable_cpu_milli: 4000,
            allocatable_memory: 8 << 30,
            allocatable_ephemeral_storage: 0,
        };
        let container = &pod.spec.as_ref().expect("spec").containers[0];
        let sources = EnvSources { objects: None, services, downward: &context };
        build(pod, container, &PodVolumes::new(), &RunOptions::default(), sources)
    }

    #[test]
    fn a_subpath_cannot_leave_its_volume_through_a_symlink() {
        let dir = tempfile::tempdir().expect("tempdir");
        let volume = dir.path().join("v");
        std::fs::create_dir(&volume).expect("volume");
        std::os::unix::fs::symlink(dir.path(), volume.join("escape")).expect("symlink");
        let error = subpath_inside(&volume, "escape/made").expect_err("outside");
        assert!(error.starts_with("leads out of the volume"), "{error}");
        assert!(!dir.path().join("made").exists(), "nothing is made outside the volume");
        let made = subpath_inside(&volume, "a/b").expect("inside");
        assert!(made.is_dir() && made.ends_with("v/a/b"), "{}", made.display());
    }

    #[test]
    fn a_subpath_of_an_atomic_volume_is_a_copy_that_outlives_its_version() {
        let dir = tempfile::tempdir().expect("tempdir");
        let volume = dir.path().join("pod/volumes/kubernetes.io~configmap/conf");
        let file = |content: &str| crate::volume::atomic_writer::FileData { content: content.into(), mode: 0o600 };
        let payload = crate::volume::atomic_writer::Payload::from([("app.conf".to_owned(), file("v1"))]);
        crate::volume::atomic_writer::write("conf", &volume, &payload, None).expect("write");
        let copy = subpath_copy(&volume, "app.conf", "conf", "main", 2).expect("copy");
        assert!(copy.ends_with("pod/volume-subpaths/conf/main/2"), "{}", copy.display());
        // A new version removes the old one: the copy stays as it was.
        let payload = crate::volume::atomic_writer::Payload::from([("app.conf".to_owned(), file("v2"))]);
        crate::volume::atomic_writer::write("conf", &volume, &payload, None).expect("write");
        assert_eq!(std::fs::read_to_string(&copy).expect("copy"), "v1");
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&copy).expect("meta").permissions());
        assert_eq!(mode & 0o777, 0o600);
        let missing = subpath_copy(&volume, "absent", "conf", "main", 3).expect("an empty dir");
        assert!(missing.is_dir());
    }

    #[test]
    fn mount_propagation_is_translated_as_the_kubelet_sends_it() {
        let mut container = Container { name: "c".into(), ..Default::default() };
        assert_eq!(propagation(&container, None), Ok(MountPropagation::Private));
        assert_eq!(propagation(&container, Some("None")), Ok(MountPropagation::Private));
        assert_eq!(propagation(&container, Some("HostToContainer")), Ok(MountPropagation::HostToContainer));
        let refused = propagation(&container, Some("Bidirectional")).expect_err("unprivileged");
        assert!(refused.ends_with("Bidirectional mount propagation is available only to privileged containers"));
        container.security_context =
            Some(k8s_openapi::api::core::v1::SecurityContext { privileged: Some(true), ..Default::default() });
        assert_eq!(propagation(&container, Some("Bidirectional")), Ok(MountPropagation::Bidirectional));
        let unknown = propagation(&container, Some("rshared")).expect_err("not a mode");
        assert!(unknown.starts_with("mountPropagation: Unsupported value: \"rshared\""), "{unknown}");
    }

    #[test]
    fn volume_devices_need_block_volumes_and_block_volumes_are_not_mounted() {
        use crate::volume::{CsiMount, PreparedVolume, VolumeKind};
        let csi = |block: bool| CsiMount {
            driver_name: "d".into(),
            volume_handle: "h".into(),
            spec_vol_id: "pv".into(),
            volume_lifecycle_mode: "Persistent".into(),
            staging_target_path: None,
            block,
        };
        let prepared = |block: bool| PreparedVolume {
            host_path: PathBuf::from("/root/plugins/kubernetes.io/csi/volumeDevices/publish/pv/u"),
            kind: VolumeKind::Csi,
            ready: true,
            csi: Some(csi(block)),
        };
        let pod = pod(serde_json::json!({
            "containers": [{"name": "c", "volumeDevices": [{"name": "data", "devicePath": "/dev/xvda"}]}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c", "readOnly": true}}],
        }));
        let container = &pod.spec.as_ref().expect("spec").containers[0];
        let block = PodVolumes::from([("data".to_owned(), prepared(true))]);
        let nodes = volume_devices(&pod, container, &block).expect("a device");
        assert_eq!(nodes.len(), 1);
        assert_eq!(nodes[0].container_path, "/dev/xvda");
        assert_eq!(nodes[0].permissions, "r", "a read-only claim");
        let filesystem = PodVolumes::from([("data".to_owned(), prepared(false))]);
        let error = volume_devices(&pod, container, &filesystem).expect_err("a filesystem volume");
        assert_eq!(error.0, "volume data has volumeMode Filesystem, but is specified in volumeDevices");
        let error = volume_devices(&pod, container, &PodVolumes::new()).expect_err("no volume");
        assert_eq!(error.0, "cannot find volume \"data\" to pass into container \"c\"");
    }

    #[test]
    fn a_volume_the_pod_uses_read_only_is_mounted_read_only_in_every_container() {
        use crate::volume::{PreparedVolume, VolumeKind};
        let pod = pod(serde_json::json!({
            "containers": [{"name": "c", "volumeMounts": [
                {"name": "claim", "mountPath": "/claim", "subPath": "dir"},
                {"name": "inline", "mountPath": "/inline"},
                {"name": "scratch", "mountPath": "/scratch"},
                {"name": "asked", "mountPath": "/asked", "readOnly": true},
            ]}],
            "volumes": [
                {"name": "claim", "persistentVolumeClaim": {"claimName": "c", "readOnly": true}},
                {"name": "inline", "csi": {"driver": "d", "readOnly": true}},
                {"name": "scratch", "emptyDir": {}},
                {"name": "asked", "emptyDir": {}},
            ],
        }));
        let dir = tempfile::tempdir().expect("dir");
        std::fs::create_dir(dir.path().join("dir")).expect("subdir");
        let volumes: PodVolumes = ["claim", "inline", "scratch", "asked"]
            .into_iter()
            .map(|n| (n.to_owned(), PreparedVolume::ready(dir.path().to_owned(), VolumeKind::EmptyDir)))
            .collect();
        let container = &pod.spec.as_ref().expect("spec").containers[0];
        let mounts = volume_mounts(&pod, container, &volumes, &[]).expect("mounts");
        let read_only: Vec<(&str, bool)> = mounts.iter().map(|m| (m.container_path.as_str(), m.read_only)).collect();
        assert_eq!(read_only, [("/claim", true), ("/inline", true), ("/scratch", false), ("/asked", true)]);
    }

    #[test]
    fn command_and_args_expand_the_containers_env() {
        let pod = pod(serde_json::json!({"containers": [{
            "name": "c", "command": ["sh", "-c", "echo $(TEST_VAR)"], "args": ["$(TEST_VAR)", "$$(TEST_VAR)", "$(NONE)"],
            "env": [{"name": "TEST_VAR", "value": "test-value"}],
        }]}));
        let options = options(&pod, &[]).expect("options");
        assert_eq!(options.command, ["sh", "-c", "echo test-value"]);
        assert_eq!(options.args, ["test-value", "$(TEST_VAR)", "$(NONE)"]);
    }

    #[test]
    fn env_reads_pod_and_host_ips_and_resources() {
        let pod = pod(serde_json::json!({"containers": [{
            "name": "c",
            "resources": {"limits": {"memory": "64Mi"}, "requests": {"cpu": "250m"}},
            "env": [
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
                {"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
                {"name": "CPU_REQUEST_M", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}}},
                {"name": "MEMORY_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory"}}},
                {"name": "BAD", "valueFrom": {"fieldRef": {"fieldPath": "status.phase"}}},
            ],
        }]}));
        let error = options(&pod, &[]).expect_err("status.phase is refused");
        assert_eq!(error.to_string(), "env \"BAD\": unsupported fieldRef \"status.phase\"");
        let mut pod = pod;
        pod.spec.as_mut().expect("spec").containers[0].env.as_mut().expect("env").pop();
        let options = options(&pod, &[]).expect("options");
        let value = |name| options.env_value(name).map(str::to_owned);
        assert_eq!(value("POD_IP").as_deref(), Some("10.1.2.3"));
        assert_eq!(value("HOST_IP").as_deref(), Some("192.0.2.7"));
        assert_eq!(value("CPU_LIMIT").as_deref(), Some("4"), "an unset limit is the node's allocatable");
        assert_eq!(value("CPU_REQUEST_M").as_deref(), Some("250"));
        assert_eq!(value("MEMORY_LIMIT").as_deref(), Some("67108864"));
    }

    #[test]
    fn services_give_link_variables_that_env_overrides() {
        let service: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "fooservice", "namespace": "ns"},
            "spec": {"clusterIP": "10.0.0.11", "ports": [{"port": 8765, "protocol": "TCP", "name": "http-port"}]},
        }))
        .expect("service");
        let headless: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "headless"}, "spec": {"clusterIP": "None", "ports": [{"port": 1}]},
        }))
        .expect("service");
        let pod = pod(serde_json::json!({"containers": [{
            "name": "c", "env": [{"name": "FOOSERVICE_SERVICE_PORT", "value": "own"},
                                 {"name": "URL", "value": "$(FOOSERVICE_PORT)"}],
        }]}));
        let options = options(&pod, &[service, headless]).expect("options");
        let value = |name| options.env_value(name).map(str::to_owned);
        assert_eq!(value("FOOSERVICE_SERVICE_HOST").as_deref(), Some("10.0.0.11"));
        assert_eq!(value("FOOSERVICE_SERVICE_PORT").as_deref(), Some("own"));
        assert_eq!(value("FOOSERVICE_SERVICE_PORT_HTTP_PORT").as_deref(), Some("8765"));
        assert_eq!(value("FOOSERVICE_PORT_8765_TCP").as_deref(), Some("tcp://10.0.0.11:8765"));
        assert_eq!(value("FOOSERVICE_PORT_8765_TCP_PROTO").as_deref(), Some("tcp"));
        assert_eq!(value("FOOSERVICE_PORT_8765_TCP_ADDR").as_deref(), Some("10.0.0.11"));
        assert_eq!(value("URL").as_deref(), Some("tcp://10.0.0.11:8765"));
        assert!(value("HEADLESS_SERVICE_HOST").is_none());
    }
}
