//! One container's run options: the spec's command, env and volume mounts,
//! merged with what its devices add.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::device_manager::RunOptions;
use crate::provider::{ContainerRunOptions, EnvVar, Mount};
use crate::volume::{EnvObjects, ObjectKind, PodVolumes, field_value};

/// Why a container's configuration cannot be run
/// (`CreateContainerConfigError`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// Builds the run options of `container`.
pub fn build(
    pod: &Pod,
    container: &Container,
    volumes: &PodVolumes,
    devices: &RunOptions,
    objects: Option<&EnvObjects>,
) -> Result<ContainerRunOptions, ConfigError> {
    let mut env: Vec<EnvVar> = Vec::new();
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    // envFrom first: env entries override what it brings.
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
                    set(&mut env, &format!("{prefix}{key}"), value);
                }
            }
            None if optional => {}
            None => return Err(ConfigError(format!("{} \"{name}\" not found", kind.noun()))),
        }
    }
    for var in container.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (_, Some(from)) => {
                let key_ref = match (&from.config_map_key_ref, &from.secret_key_ref) {
                    (Some(r), _) => Some((ObjectKind::ConfigMap, r.name.as_str(), r.key.as_str(), r.optional)),
                    (None, Some(r)) => Some((ObjectKind::Secret, r.name.as_str(), r.key.as_str(), r.optional)),
                    (None, None) => None,
                };
                if let Some(field) = &from.field_ref {
                    field_value(pod, &field.field_path).ok_or_else(|| {
                        ConfigError(format!("env {:?}: unsupported fieldRef {:?}", var.name, field.field_path))
                    })?
                } else if let Some((kind, name, key, optional)) = key_ref {
                    let Some(objects) = objects else {
                        return Err(ConfigError(format!(
                            "env {:?}: configMap and secret references need the API server (static pods cannot use them)",
                            var.name
                        )));
                    };
                    let optional = optional.unwrap_or(false);
                    match objects.get(&(kind, name.to_owned())).cloned().flatten() {
                        None if optional => continue,
                        None => return Err(ConfigError(format!("{} \"{name}\" not found", kind.noun()))),
                        Some(data) => match data.get(key) {
                            Some(value) => value.clone(),
                            None if optional => continue,
                            None => {
                                let what = if kind == ObjectKind::Secret { "Secret" } else { "ConfigMap" };
                                return Err(ConfigError(format!(
                                    "couldn't find key {key} in {what} {namespace}/{name}"
                                )));
                            }
                        },
                    }
                } else {
                    return Err(ConfigError(format!("env {:?}: unsupported valueFrom", var.name)));
                }
            }
            (Some(value), None) => expand(value, &env),
            (None, None) => String::new(),
        };
        set(&mut env, &var.name, value);
    }
    for (name, value) in &devices.envs {
        set(&mut env, name, value.clone());
    }
    let mut mounts = Vec::new();
    for mount in container.volume_mounts.iter().flatten() {
        let Some(volume) = volumes.get(&mount.name) else {
            return Err(ConfigError(format!("volumeMount {:?}: the pod has no such volume", mount.name)));
        };
        let mut host_path: PathBuf = volume.host_path.clone();
        if let Some(sub) = mount.sub_path.as_deref().filter(|s| !s.is_empty()) {
            if sub.starts_with('/') || sub.split('/').any(|p| p == "..") {
                return Err(ConfigError(format!(
                    "volumeMount {:?}: subPath {sub:?} must stay inside the volume",
                    mount.name
                )));
            }
            host_path = host_path.join(sub);
            if !host_path.exists() {
                std::fs::create_dir_all(&host_path)
                    .map_err(|e| ConfigError(format!("volumeMount {:?}: subPath {sub:?}: {e}", mount.name)))?;
            }
        }
        mounts.push(Mount {
            container_path: mount.mount_path.clone(),
            host_path,
            read_only: mount.read_only.unwrap_or(false),
            volume: Some(mount.name.clone()),
        });
    }
    for mount in &devices.mounts {
        mounts.push(Mount {
            container_path: mount.container_path.clone(),
            host_path: PathBuf::from(&mount.host_path),
            read_only: mount.read_only,
            volume: None,
        });
    }
    Ok(ContainerRunOptions {
        command: container.command.clone().unwrap_or_default(),
        args: container.args.clone().unwrap_or_default(),
        working_dir: container.working_dir.clone(),
        env,
        mounts,
        devices: devices.devices.clone(),
        annotations: devices.annotations.clone(),
        cdi_devices: devices.cdi_devices.clone(),
    })
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
}
