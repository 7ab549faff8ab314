//! The downward API: a pod's own fields (`fieldRef`) and its containers'
//! resources (`resourceFieldRef`), for env, `downwardAPI` volumes and
//! projections, as upstream computes them:
//!
//! - labels and annotations as sorted `key="value"` lines;
//! - `status.podIP(s)` and `status.hostIP(s)` from the pod's sandbox and the
//!   node (the plural forms comma-separated);
//! - `limits.*` and `requests.*` of a container, divided by the item's
//!   `divisor` (default 1) and rounded up; a limit the container does not
//!   set is the node's allocatable (cpu, memory, ephemeral-storage).

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{DownwardAPIVolumeFile, DownwardAPIVolumeSource, Pod, ResourceFieldSelector};

use super::VolumeError;

/// What the downward API reads besides the pod's spec: its addresses and
/// the node's allocatable resources (the default of an unset limit).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DownwardContext {
    /// The pod's IPs (the node's for a pod in the host network).
    pub pod_ips: Vec<std::net::IpAddr>,
    /// The node's IPs.
    pub host_ips: Vec<std::net::IpAddr>,
    /// Allocatable cpu, in millicores.
    pub allocatable_cpu_milli: u128,
    /// Allocatable memory, in bytes.
    pub allocatable_memory: u128,
    /// Allocatable ephemeral storage, in bytes.
    pub allocatable_ephemeral_storage: u128,
}

/// Why a downward API value cannot be had.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DownwardError {
    /// A `fieldRef` path the API does not define.
    #[error("unsupported fieldRef {0:?}")]
    UnsupportedField(String),
    /// A `resourceFieldRef` resource the API does not define.
    #[error("unsupported resourceFieldRef resource {0:?}")]
    UnsupportedResource(String),
    /// The `resourceFieldRef` names a container the pod does not have.
    #[error("resourceFieldRef: the pod has no container {0:?}")]
    NoSuchContainer(String),
    /// A quantity (a resource's value or the divisor) cannot be read.
    #[error("resourceFieldRef {resource:?}: invalid quantity {quantity:?}")]
    Quantity {
        /// The resource.
        resource: String,
        /// The quantity's text.
        quantity: String,
    },
}

/// Writes the volume's files into `dir` (atomically, see
/// [`super::atomic_writer`]) and returns it.
pub(crate) fn prepare(
    volume: &str,
    dir: &Path,
    source: &DownwardAPIVolumeSource,
    pod: &Pod,
    context: &DownwardContext,
    fs_group: Option<u32>,
) -> Result<PathBuf, VolumeError> {
    let default_mode = source.default_mode.map_or(0o644, |m| m as u32);
    let files = files(volume, source.items.as_deref().unwrap_or_default(), pod, context, default_mode)?;
    super::atomic_writer::write(volume, dir, &files, fs_group)?;
    Ok(dir.to_owned())
}

/// The files of downward API `items` (a volume's, or a projection's).
pub(crate) fn files(
    volume: &str,
    items: &[DownwardAPIVolumeFile],
    pod: &Pod,
    context: &DownwardContext,
    default_mode: u32,
) -> Result<super::atomic_writer::Payload, VolumeError> {
    let invalid = |reason: String| VolumeError::InvalidSpec { volume: volume.to_owned(), reason };
    let mut files = super::atomic_writer::Payload::new();
    for item in items {
        let value = match (&item.field_ref, &item.resource_field_ref) {
            (Some(field), _) => field_value(pod, &field.field_path, context).map_err(|e| invalid(e.to_string()))?,
            (None, Some(resource)) => resource_value(pod, None, resource, context)
                .map_err(|e| invalid(format!("item {:?}: {e}", item.path)))?,
            (None, None) => {
                return Err(invalid(format!("item {:?} has neither fieldRef nor resourceFieldRef", item.path)));
            }
        };
        let mode = item.mode.map_or(default_mode, |m| m as u32);
        files.insert(item.path.clone(), super::atomic_writer::FileData { content: value.into_bytes(), mode });
    }
    Ok(files)
}

/// A pod field by its downward-API path, as upstream formats it.
pub(crate) fn field_value(pod: &Pod, path: &str, context: &DownwardContext) -> Result<String, DownwardError> {
    let meta = &pod.metadata;
    let pairs = |map: Option<&std::collections::BTreeMap<String, String>>| {
        map.into_iter().flatten().map(|(k, v)| format!("{k}={}", go_quote(v))).collect::<Vec<_>>().join("\n")
    };
    let joined = |ips: &[std::net::IpAddr]| ips.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
    let first = |ips: &[std::net::IpAddr]| ips.first().map(ToString::to_string).unwrap_or_default();
    let spec = pod.spec.as_ref();
    Ok(match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_else(|| "default".into()),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" => pairs(meta.labels.as_ref()),
        "metadata.annotations" => pairs(meta.annotations.as_ref()),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()).unwrap_or_default(),
        "status.podIP" => first(&context.pod_ips),
        "status.podIPs" => joined(&context.pod_ips),
        "status.hostIP" => first(&context.host_ips),
        "status.hostIPs" => joined(&context.host_ips),
        _ => {
            if let Some(key) = path.strip_prefix("metadata.labels['").and_then(|k| k.strip_suffix("']")) {
                meta.labels.as_ref().and_then(|l| l.get(key)).cloned().unwrap_or_default()
            } else if let Some(key) = path.strip_prefix("metadata.annotations['").and_then(|k| k.strip_suffix("']")) {
                meta.annotations.as_ref().and_then(|a| a.get(key)).cloned().unwrap_or_default()
            } else {
                return Err(DownwardError::UnsupportedField(path.to_owned()));
            }
        }
    })
}

/// A value quoted as Go's `%q` quotes it (upstream formats label and
/// annotation values so): `"` and `\` escaped, control characters as
/// escapes, everything else as is.
fn go_quote(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A container's resource by its downward-API name (`limits.cpu`,
/// `requests.memory`, …), divided by the selector's divisor and rounded
/// up. The container is the selector's `containerName`, else `current`
/// (env's default).
pub(crate) fn resource_value(
    pod: &Pod,
    current: Option<&str>,
    selector: &ResourceFieldSelector,
    context: &DownwardContext,
) -> Result<String, DownwardError> {
    let name = selector.container_name.as_deref().filter(|n| !n.is_empty()).or(current).unwrap_or_default();
    let spec = pod.spec.as_ref();
    let container = spec
        .into_iter()
        .flat_map(|s| s.containers.iter().chain(s.init_containers.iter().flatten()))
        .find(|c| c.name == name)
        .ok_or_else(|| DownwardError::NoSuchContainer(name.to_owned()))?;
    let resource = selector.resource.as_str();
    let (which, what) = resource.split_once('.').ok_or_else(|| DownwardError::UnsupportedResource(resource.into()))?;
    let known = matches!(what, "cpu" | "memory" | "ephemeral-storage") || what.starts_with("hugepages-");
    if !matches!(which, "limits" | "requests") || !known {
        return Err(DownwardError::UnsupportedResource(resource.to_owned()));
    }
    let bad = |quantity: &str| DownwardError::Quantity { resource: resource.to_owned(), quantity: quantity.to_owned() };
    let requirements = container.resources.as_ref();
    let set = if which == "limits" {
        requirements.and_then(|r| r.limits.as_ref())
    } else {
        requirements.and_then(|r| r.requests.as_ref())
    };
    let quantity = set.and_then(|s| s.get(what)).map(|q| q.0.as_str());
    let divisor = selector.divisor.as_ref().map(|q| q.0.as_str()).filter(|d| !d.is_empty() && *d != "0");
    if what == "cpu" {
        let value = match quantity {
            Some(q) => kubelet_provider::quantity::parse_milli(q).map_err(|_| bad(q))?,
            None if which == "limits" => context.allocatable_cpu_milli,
            None => 0,
        };
        let divisor = match divisor {
            Some(d) => kubelet_provider::quantity::parse_milli(d).map_err(|_| bad(d))?.max(1),
            None => 1000,
        };
        return Ok(value.div_ceil(divisor).to_string());
    }
    let value = match quantity {
        Some(q) => kubelet_provider::quantity::parse_units(q).map_err(|_| bad(q))?,
        None if which == "limits" && what == "memory" => context.allocatable_memory,
        None if which == "limits" && what == "ephemeral-storage" => context.allocatable_ephemeral_storage,
        None => 0,
    };
    let divisor = match divisor {
        Some(d) => kubelet_provider::quantity::parse_units(d).map_err(|_| bad(d))?.max(1),
        None => 1,
    };
    Ok(value.div_ceil(divisor).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u",
                         "labels": {"b": "two", "a": "o\"ne"}, "annotations": {"k": "v"}},
            "spec": {"nodeName": "n1", "serviceAccountName": "sa", "containers": [
                {"name": "limited", "resources": {"limits": {"cpu": "1250m", "memory": "64Mi"},
                                                   "requests": {"cpu": "250m", "memory": "32Mi"}}},
                {"name": "bare"},
            ]},
        }))
        .expect("pod")
    }

    fn context() -> DownwardContext {
        DownwardContext {
            pod_ips: vec!["10.0.0.5".parse().expect("ip"), "fd00::5".parse().expect("ip")],
            host_ips: vec!["192.0.2.1".parse().expect("ip")],
            allocatable_cpu_milli: 2000,
            allocatable_memory: 4 << 30,
            allocatable_ephemeral_storage: 10 << 30,
        }
    }

    fn selector(container: Option<&str>, resource: &str, divisor: Option<&str>) -> ResourceFieldSelector {
        ResourceFieldSelector {
            container_name: container.map(str::to_owned),
            resource: resource.to_owned(),
            divisor: divisor.map(|d| k8s_openapi::apimachinery::pkg::api::resource::Quantity(d.to_owned())),
        }
    }

    #[test]
    fn fields_read_as_upstream_formats_them() {
        let (pod, context) = (pod(), context());
        let field = |path: &str| field_value(&pod, path, &context).expect(path);
        assert_eq!(field("metadata.labels"), "a=\"o\\\"ne\"\nb=\"two\"");
        assert_eq!(field("metadata.annotations['k']"), "v");
        assert_eq!(field("status.podIP"), "10.0.0.5");
        assert_eq!(field("status.podIPs"), "10.0.0.5,fd00::5");
        assert_eq!(field("status.hostIP"), "192.0.2.1");
        assert_eq!(field("spec.nodeName"), "n1");
        assert_eq!(field("spec.serviceAccountName"), "sa");
        assert_eq!(
            field_value(&pod, "status.phase", &context),
            Err(DownwardError::UnsupportedField("status.phase".into()))
        );
    }

    #[test]
    fn resources_are_divided_and_rounded_up_and_unset_limits_are_allocatable() {
        let (pod, context) = (pod(), context());
        let value = |container: Option<&str>, resource: &str, divisor: Option<&str>| {
            resource_value(&pod, Some("limited"), &selector(container, resource, divisor), &context).expect(resource)
        };
        assert_eq!(value(None, "limits.cpu", None), "2");
        assert_eq!(value(None, "limits.cpu", Some("1m")), "1250");
        assert_eq!(value(None, "requests.cpu", None), "1");
        assert_eq!(value(None, "limits.memory", None), "67108864");
        assert_eq!(value(None, "requests.memory", Some("1Mi")), "32");
        assert_eq!(value(Some("bare"), "limits.cpu", None), "2");
        assert_eq!(value(Some("bare"), "limits.memory", None), (4u128 << 30).to_string());
        assert_eq!(value(Some("bare"), "requests.memory", None), "0");
        assert_eq!(value(Some("bare"), "limits.ephemeral-storage", Some("1Gi")), "10");
        let missing = resource_value(&pod, None, &selector(Some("nope"), "limits.cpu", None), &context);
        assert_eq!(missing, Err(DownwardError::NoSuchContainer("nope".into())));
        let unknown = resource_value(&pod, Some("limited"), &selector(None, "limits.gpu", None), &context);
        assert_eq!(unknown, Err(DownwardError::UnsupportedResource("limits.gpu".into())));
    }
}
