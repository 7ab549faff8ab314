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

/// The status of container `name`.
pub fn container_status<'a>(pod: &'a Pod, name: &str) -> Option<&'a k8s_openapi::api::core::v1::ContainerStatus> {
    pod.status.as_ref()?.container_statuses.as_ref()?.iter().find(|c| c.name == name)
}

/// Whether container `name` is ready.
pub fn container_ready(pod: &Pod, name: &str) -> bool {
    container_status(pod, name).is_some_and(|c| c.ready)
}

/// Whether the pod's `Ready` condition is `True`.
pub fn pod_ready(pod: &Pod) -> bool {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.into_iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Container `name`'s restart count.
pub fn restarts(pod: &Pod, name: &str) -> i32 {
    container_status(pod, name).map_or(0, |c| c.restart_count)
}

/// A probe that runs every second and counts its first failure, with
/// `handler` (and any other field) merged in.
pub fn every_second(handler: serde_json::Value) -> serde_json::Value {
    let mut probe = serde_json::json!({"periodSeconds": 1, "failureThreshold": 1});
    if let (Some(probe), serde_json::Value::Object(handler)) = (probe.as_object_mut(), handler) {
        probe.extend(handler);
    }
    probe
}
