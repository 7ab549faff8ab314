//! A container's Linux security context for CRI, as the kubelet derives it:
//! the container's `securityContext` over the pod's, upstream's default
//! masked and read-only `/proc` paths for unprivileged containers, and the
//! seccomp profile (`Unconfined` unless one is asked for, as in 1.28 with
//! `SeccompDefault` off).

use k8s_openapi::api::core::v1::{Container, Pod, SeccompProfile};
use kubelet_api::cri::v1 as cri;

/// What an unprivileged container's `/proc` and `/sys` hide (upstream's
/// list for `procMount: Default`).
pub(crate) const DEFAULT_MASKED_PATHS: &[&str] = &[
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
];

/// What an unprivileged container sees read-only.
pub(crate) const DEFAULT_READONLY_PATHS: &[&str] =
    &["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"];

/// Whether any of the pod's containers is privileged (its sandbox must be
/// then, or the runtime refuses the container).
pub(crate) fn has_privileged(pod: &Pod) -> bool {
    pod.spec
        .iter()
        .flat_map(|s| s.init_containers.iter().flatten().chain(s.containers.iter()))
        .any(|c| c.security_context.as_ref().and_then(|s| s.privileged).unwrap_or(false))
}

fn seccomp(profile: Option<&SeccompProfile>) -> cri::SecurityProfile {
    use cri::security_profile::ProfileType;
    let Some(profile) = profile else {
        return cri::SecurityProfile { profile_type: ProfileType::Unconfined as i32, localhost_ref: String::new() };
    };
    match profile.type_.as_str() {
        "RuntimeDefault" => {
            cri::SecurityProfile { profile_type: ProfileType::RuntimeDefault as i32, localhost_ref: String::new() }
        }
        "Localhost" => cri::SecurityProfile {
            profile_type: ProfileType::Localhost as i32,
            localhost_ref: profile.localhost_profile.clone().unwrap_or_default(),
        },
        _ => cri::SecurityProfile { profile_type: ProfileType::Unconfined as i32, localhost_ref: String::new() },
    }
}

/// The container's CRI security context in `pod`, with `namespaces`.
pub(crate) fn security_context(
    pod: &Pod,
    container: &Container,
    namespaces: cri::NamespaceOption,
) -> cri::LinuxContainerSecurityContext {
    let pod_context = pod.spec.as_ref().and_then(|s| s.security_context.clone()).unwrap_or_default();
    let context = container.security_context.clone().unwrap_or_default();
    let privileged = context.privileged.unwrap_or(false);
    let run_as_user = context.run_as_user.or(pod_context.run_as_user);
    let run_as_group = context.run_as_group.or(pod_context.run_as_group);
    let mut supplemental_groups = pod_context.supplemental_groups.clone().unwrap_or_default();
    if let Some(fs_group) = pod_context.fs_group
        && !supplemental_groups.contains(&fs_group)
    {
        supplemental_groups.push(fs_group);
    }
    let capabilities = context.capabilities.as_ref().map(|c| cri::Capability {
        add_capabilities: c.add.clone().unwrap_or_default(),
        drop_capabilities: c.drop.clone().unwrap_or_default(),
        add_ambient_capabilities: Vec::new(),
    });
    let (masked_paths, readonly_paths) = if privileged || context.proc_mount.as_deref() == Some("Unmasked") {
        (Vec::new(), Vec::new())
    } else {
        (
            DEFAULT_MASKED_PATHS.iter().map(|p| (*p).to_owned()).collect(),
            DEFAULT_READONLY_PATHS.iter().map(|p| (*p).to_owned()).collect(),
        )
    };
    cri::LinuxContainerSecurityContext {
        capabilities,
        privileged,
        namespace_options: Some(namespaces),
        run_as_user: run_as_user.map(|value| cri::Int64Value { value }),
        run_as_group: run_as_group.map(|value| cri::Int64Value { value }),
        readonly_rootfs: context.read_only_root_filesystem.unwrap_or(false),
        supplemental_groups,
        no_new_privs: context.allow_privilege_escalation.is_some_and(|allowed| !allowed),
        masked_paths,
        readonly_paths,
        seccomp: Some(seccomp(context.seccomp_profile.as_ref().or(pod_context.seccomp_profile.as_ref()))),
        supplemental_groups_policy: supplemental_groups_policy(pod) as i32,
        ..Default::default()
    }
}

/// The pod's `supplementalGroupsPolicy` as CRI has it (`Merge` unless the
/// pod asks for `Strict`; a node whose runtime cannot honour `Strict`
/// refuses such a pod at admission).
pub(crate) fn supplemental_groups_policy(pod: &Pod) -> cri::SupplementalGroupsPolicy {
    let policy = pod.spec.as_ref().and_then(|s| s.security_context.as_ref()?.supplemental_groups_policy.as_deref());
    if policy == Some("Strict") { cri::SupplementalGroupsPolicy::Strict } else { cri::SupplementalGroupsPolicy::Merge }
}

/// The user an image runs as, as the runtime's `ImageStatus` says it: a
/// numeric uid, or a name; neither means root (upstream's reading).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ImageUser {
    /// A numeric uid.
    Uid(i64),
    /// A user name the runtime did not resolve.
    Name(String),
}

/// Whether the effective security context of `container` asks for
/// `runAsNonRoot` (the image's user is read only then).
pub(crate) fn asks_non_root(pod: &Pod, container: &Container) -> bool {
    let pod_context = pod.spec.as_ref().and_then(|s| s.security_context.as_ref());
    let context = container.security_context.as_ref();
    context.and_then(|c| c.run_as_non_root).or(pod_context.and_then(|c| c.run_as_non_root)) == Some(true)
}

/// `runAsNonRoot`, checked as the kubelet checks it before creating a
/// container: the effective context asks for it, and the container would
/// run as root (its own or the pod's `runAsUser: 0`, or no `runAsUser` and
/// an image that runs as root), or as a user name that cannot be checked.
/// The messages are upstream's.
pub(crate) fn verify_run_as_non_root(pod: &Pod, container: &Container, image_user: &ImageUser) -> Result<(), String> {
    let pod_context = pod.spec.as_ref().and_then(|s| s.security_context.as_ref());
    let context = container.security_context.as_ref();
    let non_root = context.and_then(|c| c.run_as_non_root).or(pod_context.and_then(|c| c.run_as_non_root));
    if non_root != Some(true) {
        return Ok(());
    }
    let meta = &pod.metadata;
    let pod_name = format!(
        "{}_{}({})",
        meta.name.as_deref().unwrap_or_default(),
        meta.namespace.as_deref().unwrap_or("default"),
        meta.uid.as_deref().unwrap_or_default()
    );
    let container_name = &container.name;
    match context.and_then(|c| c.run_as_user).or(pod_context.and_then(|c| c.run_as_user)) {
        Some(0) => Err(format!(
            "container's runAsUser breaks non-root policy (pod: {pod_name:?}, container: {container_name})"
        )),
        Some(_) => Ok(()),
        None => match image_user {
            ImageUser::Uid(0) => Err(format!(
                "container has runAsNonRoot and image will run as root (pod: {pod_name:?}, container: {container_name})"
            )),
            ImageUser::Uid(_) => Ok(()),
            ImageUser::Name(name) => Err(format!(
                "container has runAsNonRoot and image has non-numeric user ({name}), cannot verify user is non-root (pod: {pod_name:?}, container: {container_name})"
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_as_non_root_refuses_root_as_upstream() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"securityContext": {"runAsNonRoot": true}, "containers": [{"name": "c"}]},
        }))
        .expect("pod");
        let container = |context: serde_json::Value| -> Container {
            serde_json::from_value(serde_json::json!({"name": "c", "securityContext": context})).expect("container")
        };
        let explicit_root =
            verify_run_as_non_root(&pod, &container(serde_json::json!({"runAsUser": 0})), &ImageUser::Uid(1234));
        assert_eq!(
            explicit_root,
            Err("container's runAsUser breaks non-root policy (pod: \"p_ns(u1)\", container: c)".to_owned())
        );
        let image_root = verify_run_as_non_root(&pod, &container(serde_json::json!({})), &ImageUser::Uid(0));
        assert_eq!(
            image_root,
            Err("container has runAsNonRoot and image will run as root (pod: \"p_ns(u1)\", container: c)".to_owned())
        );
        let named = verify_run_as_non_root(&pod, &container(serde_json::json!({})), &ImageUser::Name("app".into()));
        assert!(named.expect_err("unverifiable").contains("image has non-numeric user (app)"));
        assert_eq!(verify_run_as_non_root(&pod, &container(serde_json::json!({})), &ImageUser::Uid(1234)), Ok(()));
        assert_eq!(
            verify_run_as_non_root(&pod, &container(serde_json::json!({"runAsUser": 1000})), &ImageUser::Uid(0)),
            Ok(())
        );
        // The container's own context wins over the pod's.
        let allowed = container(serde_json::json!({"runAsNonRoot": false}));
        assert_eq!(verify_run_as_non_root(&pod, &allowed, &ImageUser::Uid(0)), Ok(()));
    }

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}, "spec": spec})).expect("pod")
    }

    #[test]
    fn the_containers_context_wins_over_the_pods() {
        let pod = pod(serde_json::json!({
            "securityContext": {"runAsUser": 1000, "runAsGroup": 3000, "fsGroup": 2000, "supplementalGroups": [4000],
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"runAsUser": 1001, "allowPrivilegeEscalation": false,
                            "readOnlyRootFilesystem": true, "capabilities": {"add": ["NET_ADMIN"], "drop": ["ALL"]}}}],
        }));
        let container = &pod.spec.as_ref().expect("spec").containers[0];
        let context = security_context(&pod, container, cri::NamespaceOption::default());
        assert_eq!(context.run_as_user.map(|v| v.value), Some(1001));
        assert_eq!(context.run_as_group.map(|v| v.value), Some(3000));
        assert_eq!(context.supplemental_groups, [4000, 2000]);
        assert!(context.no_new_privs && context.readonly_rootfs && !context.privileged);
        let capabilities = context.capabilities.expect("capabilities");
        assert_eq!(
            (capabilities.add_capabilities, capabilities.drop_capabilities),
            (vec!["NET_ADMIN".to_owned()], vec!["ALL".to_owned()])
        );
        assert_eq!(
            context.seccomp.map(|s| s.profile_type),
            Some(cri::security_profile::ProfileType::RuntimeDefault as i32)
        );
        assert_eq!(context.masked_paths.len(), DEFAULT_MASKED_PATHS.len());
        assert!(!has_privileged(&pod));
    }

    #[test]
    fn a_privileged_container_has_no_masked_paths_and_no_seccomp_unless_asked() {
        let pod = pod(serde_json::json!({"containers": [{"name": "c", "securityContext": {"privileged": true}}]}));
        let container = &pod.spec.as_ref().expect("spec").containers[0];
        let context = security_context(&pod, container, cri::NamespaceOption::default());
        assert!(context.privileged && context.masked_paths.is_empty() && context.readonly_paths.is_empty());
        assert!(!context.no_new_privs);
        assert_eq!(
            context.seccomp.map(|s| s.profile_type),
            Some(cri::security_profile::ProfileType::Unconfined as i32)
        );
        assert!(has_privileged(&pod));
    }
}
