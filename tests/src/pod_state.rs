//! What tests ask of a pod's status.

use k8s_openapi::api::core::v1::Pod;

/// Whether the pod's first container is running.
pub fn first_container_running(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.state.as_ref())
        .is_some_and(|s| s.running.is_some())
}
