//! Which sysctls a pod may set (`spec.securityContext.sysctls`), as the
//! kubelet's admission decides: the namespaced sysctls upstream deems safe,
//! and those `--allowed-unsafe-sysctls` allows (names, or prefixes ending
//! in `*`); none of the network's with `hostNetwork`, none of IPC's with
//! `hostIPC`. Anything else rejects the pod (`SysctlForbidden`).

use k8s_openapi::api::core::v1::Pod;

/// The sysctls upstream 1.28 allows every pod (the TCP keepalive and
/// `tcp_fin_timeout` ones came in 1.29: allow them with
/// `--allowed-unsafe-sysctls`).
pub const SAFE_SYSCTLS: &[&str] = &[
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.ip_local_reserved_ports",
];

/// The reason of a pod rejected for its sysctls.
pub const SYSCTL_FORBIDDEN: &str = "SysctlForbidden";

/// Checks `pod`'s sysctls against the safe ones and `allowed_unsafe`;
/// returns upstream's message for the first one refused.
pub fn check(pod: &Pod, allowed_unsafe: &[String]) -> Result<(), String> {
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
            return Err(format!("forbidden sysctl: \"{}\" not allowlisted", sysctl.name));
        }
        if spec.host_network.unwrap_or(false) && name.starts_with("net.") {
            return Err(format!("forbidden sysctl: \"{}\" not allowed with host net enabled", sysctl.name));
        }
        let ipc = name.starts_with("kernel.shm") || name.starts_with("kernel.msg") || name == "kernel.sem";
        if spec.host_ipc.unwrap_or(false) && (ipc || name.starts_with("fs.mqueue.")) {
            return Err(format!("forbidden sysctl: \"{}\" not allowed with host ipc enabled", sysctl.name));
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
            check(&pod(&["kernel.msgmax"], false), &[]),
            Err("forbidden sysctl: \"kernel.msgmax\" not allowlisted".into())
        );
        assert_eq!(check(&pod(&["kernel.msgmax"], false), &["kernel.msg*".into()]), Ok(()));
        assert_eq!(check(&pod(&["kernel.msgmax"], false), &["kernel.msgmax".into()]), Ok(()));
        assert_eq!(
            check(&pod(&["net.ipv4.tcp_syncookies"], true), &[]),
            Err("forbidden sysctl: \"net.ipv4.tcp_syncookies\" not allowed with host net enabled".into())
        );
    }
}
