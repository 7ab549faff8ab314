//! The files the node itself gives a container, as the kubelet does, where
//! the provider can mount single files ([`Provider::mounts_files`]):
//!
//! - `/etc/hosts`, written for the pod (`<pod dir>/etc-hosts`): in the
//!   pod's own network, the kubelet-managed file (localhost entries, the
//!   pod's IPs with its hostname, fully qualified under a `subdomain`);
//!   in the host's network, the node's own `/etc/hosts`; either way
//!   followed by the pod's `hostAliases`. A container that mounts
//!   something at `/etc/hosts` itself keeps it.
//! - the termination-message file, an empty world-writable file per
//!   container instance (`<pod dir>/containers/<name>/<id>`) mounted at
//!   `terminationMessagePath`, read when the instance ends.
//!
//! [`Provider::mounts_files`]: crate::provider::Provider::mounts_files

use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Container, Pod};

use super::PodLifecycle;
use super::data::PodData;
use crate::provider::Mount;
use crate::volume::DownwardContext;

/// What [`prepare`] made for one container instance.
pub(crate) struct NodeFiles {
    /// The mounts to add.
    pub mounts: Vec<Mount>,
    /// The termination-message file, if the container has a path for it.
    pub termination_message: Option<PathBuf>,
}

/// Where upstream's node takes its own hosts file from.
const NODE_HOSTS_FILE: &str = "/etc/hosts";

pub use kubelet_provider::hostname::{MAX_HOSTNAME, pod_hostname, truncate_hostname};

/// The pod's domain under a `subdomain`: `<subdomain>.<namespace>.svc.<cluster domain>`.
fn pod_domain(pod: &Pod, cluster_domain: &str) -> Option<String> {
    let subdomain = pod.spec.as_ref()?.subdomain.clone().filter(|s| !s.is_empty())?;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    if cluster_domain.is_empty() {
        Some(format!("{subdomain}.{namespace}.svc"))
    } else {
        Some(format!("{subdomain}.{namespace}.svc.{cluster_domain}"))
    }
}

/// The `/etc/hosts` of `pod` (in its own network, with `pod_ips`), as the
/// kubelet writes it.
pub(crate) fn hosts_file(pod: &Pod, pod_ips: &[std::net::IpAddr], cluster_domain: &str) -> String {
    let host_network = pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false);
    let mut text = if host_network {
        std::fs::read_to_string(NODE_HOSTS_FILE).unwrap_or_default()
    } else {
        let mut text = String::from(
            "# Kubernetes-managed hosts file.\n\
             127.0.0.1\tlocalhost\n\
             ::1\tlocalhost ip6-localhost ip6-loopback\n\
             fe00::0\tip6-localnet\n\
             fe00::0\tip6-mcastprefix\n\
             fe00::1\tip6-allnodes\n\
             fe00::2\tip6-allrouters\n",
        );
        let hostname = pod_hostname(pod);
        let domain = pod_domain(pod, cluster_domain);
        for ip in pod_ips {
            match &domain {
                Some(domain) => text.push_str(&format!("{ip}\t{hostname}.{domain}\t{hostname}\n")),
                None => text.push_str(&format!("{ip}\t{hostname}\n")),
            }
        }
        text
    };
    let aliases = pod.spec.as_ref().and_then(|s| s.host_aliases.as_deref()).unwrap_or_default();
    if !aliases.is_empty() {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str("\n# Entries added by HostAliases.\n");
        for alias in aliases {
            let names = alias.hostnames.as_deref().unwrap_or_default().join("\t");
            text.push_str(&format!("{}\t{names}\n", alias.ip));
        }
    }
    text
}

/// Writes `data`'s pod's `/etc/hosts` and makes `container`'s termination
/// message file; returns the mounts.
pub(crate) fn prepare(
    lifecycle: &PodLifecycle,
    data: &PodData,
    container: &Container,
    downward: &DownwardContext,
) -> Result<NodeFiles, String> {
    let pod_dir = lifecycle.volumes.pod_dir(&data.id.uid);
    let mut mounts = Vec::new();
    let mounts_hosts =
        container.volume_mounts.iter().flatten().any(|m| m.mount_path.trim_end_matches('/') == "/etc/hosts");
    if !mounts_hosts {
        let path = pod_dir.join("etc-hosts");
        let text = hosts_file(&data.pod, &downward.pod_ips, &lifecycle.config.cluster_domain);
        std::fs::create_dir_all(&pod_dir).map_err(|e| format!("{}: {e}", pod_dir.display()))?;
        // Replaced whole: a container mounting it sees the old file or the new.
        kubelet_support::durable::write(&path, text.as_bytes(), 0o644)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        mounts.push(Mount {
            container_path: "/etc/hosts".into(),
            host_path: path,
            read_only: false,
            volume: None,
            propagation: Default::default(),
        });
    }
    let mut termination_message = None;
    if let Some(target) = container.termination_message_path.as_deref().filter(|p| !p.is_empty()) {
        let dir = pod_dir.join("containers").join(&container.name);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let file = dir.join(&uuid::Uuid::new_v4().simple().to_string()[..8]);
        std::fs::File::create(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        // Any user the container runs as may write it.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666))
            .map_err(|e| format!("{}: {e}", file.display()))?;
        mounts.push(Mount {
            container_path: target.to_owned(),
            host_path: file.clone(),
            read_only: false,
            volume: None,
            propagation: Default::default(),
        });
        termination_message = Some(file);
    }
    Ok(NodeFiles { mounts, termination_message })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": "web-0", "namespace": "ns"}, "spec": spec}))
            .expect("pod")
    }

    #[test]
    fn long_names_are_cut_to_63_without_a_trailing_dash_or_dot() {
        let long = format!("{}-.x", "a".repeat(62));
        assert_eq!(truncate_hostname(&long), "a".repeat(62));
        assert_eq!(truncate_hostname(&"b".repeat(70)).len(), 63);
        assert_eq!(truncate_hostname("short"), "short");
    }

    #[test]
    fn the_managed_hosts_file_names_the_pod_and_its_aliases() {
        let pod = pod(serde_json::json!({
            "hostname": "web", "subdomain": "svc1",
            "hostAliases": [{"ip": "123.45.67.89", "hostnames": ["foo", "bar"]}],
            "containers": [],
        }));
        let text = hosts_file(&pod, &["10.0.0.9".parse().expect("ip")], "cluster.local");
        assert!(text.starts_with("# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n"), "{text}");
        assert!(text.contains("10.0.0.9\tweb.svc1.ns.svc.cluster.local\tweb\n"), "{text}");
        assert!(text.ends_with("\n# Entries added by HostAliases.\n123.45.67.89\tfoo\tbar\n"), "{text}");
        let plain =
            hosts_file(&self::pod(serde_json::json!({"containers": []})), &["10.0.0.9".parse().expect("ip")], "");
        assert!(plain.ends_with("fe00::2\tip6-allrouters\n10.0.0.9\tweb-0\n"), "{plain}");
    }

    #[test]
    fn a_host_network_pod_gets_the_nodes_hosts_file() {
        let pod = pod(serde_json::json!({"hostNetwork": true, "containers": []}));
        let text = hosts_file(&pod, &[], "cluster.local");
        assert!(!text.contains("Kubernetes-managed"), "{text}");
        assert_eq!(text, std::fs::read_to_string(NODE_HOSTS_FILE).unwrap_or_default());
    }
}
