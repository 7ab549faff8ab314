//! `downwardAPI` volumes: files holding the pod's own fields.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{DownwardAPIVolumeSource, Pod};

use super::VolumeError;

/// Writes the volume's files into `dir` and returns it.
pub fn prepare(volume: &str, dir: &Path, source: &DownwardAPIVolumeSource, pod: &Pod) -> Result<PathBuf, VolumeError> {
    let io = |path: &Path, source: std::io::Error| VolumeError::Io {
        volume: volume.to_owned(),
        path: path.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    for item in source.items.iter().flatten() {
        if item.path.split('/').any(|part| part == ".." || part.is_empty()) {
            return Err(VolumeError::InvalidSpec {
                volume: volume.to_owned(),
                reason: format!("item path {:?} must be relative and must not contain '..'", item.path),
            });
        }
        let value = match (&item.field_ref, &item.resource_field_ref) {
            (Some(field), _) => field_value(pod, &field.field_path).ok_or_else(|| VolumeError::InvalidSpec {
                volume: volume.to_owned(),
                reason: format!("unsupported fieldRef {:?}", field.field_path),
            })?,
            (None, Some(resource)) => {
                return Err(VolumeError::InvalidSpec {
                    volume: volume.to_owned(),
                    reason: format!("resourceFieldRef {:?} is not supported yet", resource.resource),
                });
            }
            (None, None) => {
                return Err(VolumeError::InvalidSpec {
                    volume: volume.to_owned(),
                    reason: format!("item {:?} has neither fieldRef nor resourceFieldRef", item.path),
                });
            }
        };
        let file = dir.join(&item.path);
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
        }
        // Written whole, then renamed: a reader never sees half a value.
        let partial = file.with_extension("partial");
        std::fs::write(&partial, value).map_err(|e| io(&partial, e))?;
        std::fs::rename(&partial, &file).map_err(|e| io(&file, e))?;
    }
    Ok(dir.to_owned())
}

/// A pod field by its downward-API path, as upstream formats it (labels
/// and annotations as sorted `key="value"` lines).
pub fn field_value(pod: &Pod, path: &str) -> Option<String> {
    let meta = &pod.metadata;
    let pairs = |map: Option<&std::collections::BTreeMap<String, String>>| {
        map.into_iter().flatten().map(|(k, v)| format!("{k}={v:?}")).collect::<Vec<_>>().join("\n")
    };
    Some(match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_else(|| "default".into()),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" => pairs(meta.labels.as_ref()),
        "metadata.annotations" => pairs(meta.annotations.as_ref()),
        "spec.nodeName" => pod.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "spec.serviceAccountName" => pod.spec.as_ref().and_then(|s| s.service_account_name.clone()).unwrap_or_default(),
        _ => {
            if let Some(key) = path.strip_prefix("metadata.labels['").and_then(|k| k.strip_suffix("']")) {
                meta.labels.as_ref().and_then(|l| l.get(key)).cloned().unwrap_or_default()
            } else if let Some(key) = path.strip_prefix("metadata.annotations['").and_then(|k| k.strip_suffix("']")) {
                meta.annotations.as_ref().and_then(|a| a.get(key)).cloned().unwrap_or_default()
            } else {
                return None;
            }
        }
    })
}
