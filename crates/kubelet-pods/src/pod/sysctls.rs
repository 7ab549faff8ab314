//! Which sysctls a pod may set (`spec.securityContext.sysctls`), as the
//! kubelet's admission decides: the namespaced sysctls upstream deems safe,
//! and those `--allowed-unsafe-sysctls` allows (names, or prefixes ending
//! in `*`); none of the network's with `hostNetwork`, none of IPC's with
//! `hostIPC`. Anything else rejects the pod (`SysctlForbidden`).

use k8s_openapi::api::core::v1::Pod;

/// The sysctls upstream 1.28 allows every pod (the TCP keepalive and
/// `tcp_fin_timeout` ones came in 1.29: allow them with
/// `--allowed-unsafe-sysctls`).
pub(crate) const SAFE_SYSCTLS: &[&str] = &[
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.ip_local_reserved_ports",
];

/// The reason of a pod rejected for its sysctls.
pub(crate) const SYSCTL_FORBIDDEN: &str = "SysctlForbidden";

/// A sysctl a pod may not set; its text is upstream's message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("forbidden sysctl: \"{sysctl}\" {why}")]
pub(crate) struct SysctlForbidden {
    /// The sysctl as the pod names it.
    pub sysctl: String,
    /// Why it is refused.
    pub why: SysctlRefusal,
}

/// Why a sysctl is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SysctlRefusal {
    /// Neither safe nor in `--allowed-unsafe-sysctls`.
    #[error("not allowlisted")]
    NotAllowlisted,
    /// A network sysctl in a pod on the host's network.
    #[error("not allowed with host net enabled")]
    HostNetwork,
    /// An IPC sysctl in a pod in the host's IPC namespace.
    #[error("not allowed with host ipc enabled")]
    HostIpc,
}

/// Checks `pod`'s sysctls against the safe ones and `allowed_unsafe`;
/// the first one refused is the error.
pub(crate) fn check(pod: &Pod, allowed_unsafe: &[String]) -> Result<(), SysctlForbidden> {
    let Some(spec) = pod.spec.as_ref() else { return Ok(()) };
    let sysctls = spec.security_context.as_ref().and_then(|c| c.sysctls.as_deref()).unwrap_or_default();
    for sysctl in sysctls {
        // Either separator is allowed (`net/ipv4/...`).
        let name = sysctl.name.replace('/', ".");
        let allowed = SAFE_SYSCTLS.contains(&name.as_str())
            || allowed_unsafe.iter().any(|pattern| match pattern.strip_suffix('*') {
                Some(prefix) => name.starts_with(&prefix.replace('/', ".")),
                None => name == pattern.replace('/', "."),
            });
        if !allowed {
            return Err(SysctlForbidden { sysctl: sysctl.name.clone(), why: SysctlRefusal::NotAllowlisted });
        }
        if spec.host_network.unwrap_or(false) && name.starts_with("net.") {
            return Err(SysctlForbidden { sysctl: sysctl.name.clone(), why: SysctlRefusal::HostNetwork });
        }
        let ipc = name.starts_with("kernel.shm") || name.starts_with("kernel.msg") || name == "kernel.sem";
        if spec.host_ipc.unwrap_or(false) && (ipc || name.starts_with("fs.mqueue.")) {
            return Err(SysctlForbidden { sysctl: sysctl.name.clone(), why: SysctlRefusal::HostIpc });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(sysctls: &[&str], host_network: bool) -> Pod {
        let sysctls: Vec<serde_json::Value> =
            sysctls.iter().map(|n| serde_json::json!({"name": n, "value": "1"})).collect();
        serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}, "spec": {
            "hostNetwork": host_network, "securityContext": {"sysctls": sysctls}, "containers": [{"name": "c"}],
        }}))
        .expect("pod")
    }

    #[test]
    fn safe_sysctls_pass_and_unsafe_ones_need_the_allow_list() {
        assert_eq!(check(&pod(&["kernel.shm_rmid_forced", "net/ipv4/ip_local_port_range"], false), &[]), Ok(()));
        assert_eq!(
            check(&pod(&["kernel.msgmax"], false), &[]).map_err(|e| e.to_string()),
            Err("forbidden sysctl: \"kernel.msgmax\" not allowlisted".into())
        );
        assert_eq!(check(&pod(&["kernel.msgmax"], false), &["kernel.msg*".into()]), Ok(()));
        assert_eq!(check(&pod(&["kernel.msgmax"], false), &["kernel.msgmax".into()]), Ok(()));
        assert_eq!(
            check(&pod(&["net.ipv4.tcp_syncookies"], true), &[]).map_err(|e| e.to_string()),
            Err("forbidden sysctl: \"net.ipv4.tcp_syncookies\" not allowed with host net enabled".into())
        );
    }
}
