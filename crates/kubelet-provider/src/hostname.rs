//! A pod's hostname as the kubelet gives it.

use k8s_openapi::api::core::v1::Pod;

/// The longest hostname a pod gets (the kernel's limit, and upstream's).
pub const MAX_HOSTNAME: usize = 63;

/// The hostname of `pod`: its `hostname`, else its name, cut to 63
/// characters without a trailing `-` or `.` (as upstream truncates it).
pub fn pod_hostname(pod: &Pod) -> String {
    let spec = pod.spec.as_ref();
    let name = spec
        .and_then(|s| s.hostname.clone())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| pod.metadata.name.clone().unwrap_or_default());
    truncate_hostname(&name)
}

/// `name` cut to [`MAX_HOSTNAME`] characters, without a trailing `-` or `.`.
pub fn truncate_hostname(name: &str) -> String {
    if name.len() <= MAX_HOSTNAME {
        return name.to_owned();
    }
    let mut end = MAX_HOSTNAME;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name[..end].trim_end_matches(['-', '.']).to_owned()
}
