//! What tests ask of a pod's status, and the waits for it.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kubelet::pod::PodStore;

/// A Pod from a test's manifest (JSON).
pub fn pod_from(value: serde_json::Value) -> Pod {
    serde_json::from_value(value).expect("a valid Pod")
}

/// A pod in `default` named `name`, bound to `node`, with `spec`'s fields
/// (its containers at least) beside `nodeName`: the tests' one pod builder.
pub fn bound_pod(name: &str, node: &str, spec: serde_json::Value) -> Pod {
    let mut full = serde_json::Map::new();
    full.insert("nodeName".to_owned(), node.into());
    full.extend(spec.as_object().cloned().unwrap_or_default());
    pod_from(serde_json::json!({"metadata": {"name": name, "namespace": "default"}, "spec": full}))
}

/// Waits up to `within` until pod `uid` in `store` satisfies `pred`, and
/// returns it; else panics naming `what` and the pod's status.
pub async fn wait_pod(
    store: &PodStore,
    uid: &str,
    what: &str,
    within: Duration,
    mut pred: impl FnMut(&Pod) -> bool,
) -> Pod {
    match store.wait_for(within, |pods| pods.get(uid).is_some_and(&mut pred)).await {
        Some(pods) => pods[uid].clone(),
        None => panic!("timed out waiting for {what}; pod now: {:#?}", store.get(uid).map(|p| p.status)),
    }
}

/// Waits up to `within` until pod `uid` is gone from `store`; else panics
/// with its status.
pub async fn wait_gone(store: &PodStore, uid: &str, within: Duration) {
    let gone = store.wait_for(within, |pods| !pods.contains_key(uid)).await;
    assert!(gone.is_some(), "pod {uid} still present: {:#?}", store.get(uid).map(|p| p.status));
}

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
