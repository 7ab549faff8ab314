//! The pod lifecycle end to end with real processes: a real device plugin
//! (the fake-device-plugin binary on `kubelet.sock`), the host-process
//! provider, real volumes in a temp root dir.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kubelet::device_manager::{DeviceManager, DeviceManagerConfig};
use kubelet::pod::{Allocatable, BackoffConfig, PodConfig, PodLifecycle, Pods};
use kubelet::provider::Provider;
use rustlet_testkit::host_provider::HostProcessProvider;
use rustlet_testkit::process::PluginProcess;
use tempfile::TempDir;
use tokio_util::sync::CancellationToken;

const GPU: &str = "vendor.example.com/gpu";

struct PodNode {
    root: TempDir,
    pods: Pods,
    devices: DeviceManager,
    _plugin: Option<PluginProcess>,
    shutdown: CancellationToken,
}

impl Drop for PodNode {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn allocatable() -> Allocatable {
    Allocatable { cpu_milli: 2000, memory: 4 << 30, pods: 110 }
}

/// A node with `gpus` fake devices and the host-process provider.
async fn pod_node(gpus: u64, tweak: impl FnOnce(&mut PodConfig)) -> PodNode {
    let root = rustlet_testkit::node_root::tempdir("rustlet-pods-");
    let shutdown = CancellationToken::new();
    let device_dir = root.path().join("device-plugins");
    let mut device_config = DeviceManagerConfig::new(&device_dir);
    device_config.call_timeout = LIVENESS_DEADLINE;
    let devices = DeviceManager::start(device_config, shutdown.clone()).expect("device manager");
    let plugin = if gpus > 0 { Some(gpu_plugin(&devices, &device_dir, GPU, gpus).await) } else { None };
    let mut config = PodConfig::new(root.path(), allocatable());
    config.restart_backoff = BackoffConfig {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(400),
        reset_after: Duration::from_secs(600),
    };
    tweak(&mut config);
    let host = HostProcessProvider::new();
    host.failing_images
        .lock()
        .expect("lock")
        .insert("registry.example/broken:1".into(), "manifest unknown: no such image".into());
    let provider: Arc<dyn Provider> = Arc::new(host);
    let lifecycle = PodLifecycle::new(config, Some(provider), Some(devices.clone()));
    let pods = Pods::start(lifecycle, shutdown.clone()).await;
    PodNode { root, pods, devices, _plugin: plugin, shutdown }
}

use rustlet_testkit::pod_state::pod_from as pod;

fn phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref().and_then(|s| s.phase.as_deref())
}

impl PodNode {
    /// Waits until the pod's status satisfies `pred`; returns the pod.
    async fn wait_pod(&self, uid: &str, what: &str, pred: impl FnMut(&Pod) -> bool) -> Pod {
        rustlet_testkit::pod_state::wait_pod(self.pods.store(), uid, what, SOON, pred).await
    }

    async fn wait_gone(&self, uid: &str) {
        rustlet_testkit::pod_state::wait_gone(self.pods.store(), uid, SOON).await;
    }

    fn host_dir(&self, name: &str) -> PathBuf {
        let dir = self.root.path().join("host").join(name);
        std::fs::create_dir_all(&dir).expect("mkdir");
        dir
    }
}

#[tokio::test]
async fn a_pod_gets_its_device_and_volumes_and_runs_to_completion() {
    let node = pod_node(2, |_| {}).await;
    let out = node.host_dir("out");
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "gpu-job", "namespace": "default", "uid": "uid-1"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "main",
                "image": "busybox",
                "command": ["sh", "-c", "echo \"$FAKE_DEVICES $GREETING\" > \"$MOUNT_OUT/result\"; echo scratch > \"$MOUNT_SCRATCH/file\"; test -f \"$MOUNT_SCRATCH/file\""],
                "env": [{"name": "GREETING", "value": "hello"}],
                "resources": {"limits": {GPU: "1"}},
                "volumeMounts": [{"name": "out", "mountPath": "/out"}, {"name": "scratch", "mountPath": "/scratch"}]
            }],
            "volumes": [
                {"name": "out", "hostPath": {"path": out.display().to_string(), "type": "Directory"}},
                {"name": "scratch", "emptyDir": {}}
            ]
        }
    })));
    let done = node.wait_pod("uid-1", "Succeeded", |p| phase(p) == Some("Succeeded")).await;
    let status = done.status.expect("status");
    let main = &status.container_statuses.expect("statuses")[0];
    let terminated = main.state.as_ref().and_then(|s| s.terminated.as_ref()).expect("terminated");
    assert_eq!((terminated.exit_code, terminated.reason.as_deref()), (0, Some("Completed")));
    // The finished pod's device is free at once; the container saw it.
    assert!(node.devices.allocated("uid-1", "main").is_empty(), "a finished pod holds no device");
    let result = std::fs::read_to_string(out.join("result")).expect("written by the container");
    let (device, greeting) = result.trim_end().split_once(' ').expect("device and greeting");
    assert!(device.starts_with("dev-") || device.starts_with("gpu-"), "one device: {result:?}");
    assert!(!device.contains(','), "one device: {result:?}");
    assert_eq!(greeting, "hello");
    let empty_dir = node.root.path().join("pods/uid-1/volumes/kubernetes.io~empty-dir/scratch");
    assert!(empty_dir.join("file").exists());

    // Removal releases the device and the volume; the host path stays.
    node.pods.delete("uid-1");
    node.wait_gone("uid-1").await;
    assert!(node.devices.allocated("uid-1", "main").is_empty());
    assert!(!node.root.path().join("pods/uid-1").exists());
    assert!(out.join("result").exists());
}

#[tokio::test]
async fn init_containers_run_in_order_before_the_app_containers() {
    let node = pod_node(0, |_| {}).await;
    let out = node.host_dir("order");
    let step = |name: &str| {
        serde_json::json!({
            "name": name, "image": "busybox",
            "command": ["sh", "-c", format!("echo {name} >> \"$MOUNT_OUT/order\"")],
            "volumeMounts": [{"name": "out", "mountPath": "/out"}]
        })
    };
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "ordered", "uid": "uid-2"},
        "spec": {
            "restartPolicy": "Never",
            "initContainers": [step("first"), step("second")],
            "containers": [step("app")],
            "volumes": [{"name": "out", "hostPath": {"path": out.display().to_string()}}]
        }
    })));
    let done = node.wait_pod("uid-2", "Succeeded", |p| phase(p) == Some("Succeeded")).await;
    assert_eq!(std::fs::read_to_string(out.join("order")).expect("order"), "first\nsecond\napp\n");
    let conditions: BTreeMap<String, String> =
        done.status.and_then(|s| s.conditions).into_iter().flatten().map(|c| (c.type_, c.status)).collect();
    assert_eq!(conditions["Initialized"], "True");
    assert_eq!(conditions["PodScheduled"], "True");
}

#[tokio::test]
async fn a_failing_container_is_restarted_with_backoff_under_on_failure() {
    let node = pod_node(0, |_| {}).await;
    let out = node.host_dir("count");
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "flaky", "uid": "uid-3"},
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [{
                "name": "main", "image": "busybox",
                // Fails twice, then succeeds.
                "command": ["sh", "-c", "echo x >> \"$MOUNT_OUT/runs\"; test $(wc -l < \"$MOUNT_OUT/runs\") -ge 3"],
                "volumeMounts": [{"name": "out", "mountPath": "/out"}]
            }],
            "volumes": [{"name": "out", "hostPath": {"path": out.display().to_string()}}]
        }
    })));
    let backing_off = node
        .wait_pod("uid-3", "CrashLoopBackOff", |p| {
            p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).is_some_and(|cs| {
                cs[0].state.as_ref().and_then(|s| s.waiting.as_ref()).and_then(|w| w.reason.as_deref())
                    == Some("CrashLoopBackOff")
            })
        })
        .await;
    let status = &backing_off.status.expect("status").container_statuses.expect("statuses")[0];
    let last = status.last_state.as_ref().and_then(|s| s.terminated.as_ref()).expect("last state");
    assert_eq!((last.exit_code, last.reason.as_deref()), (1, Some("Error")));
    let done = node.wait_pod("uid-3", "Succeeded", |p| phase(p) == Some("Succeeded")).await;
    let status = &done.status.expect("status").container_statuses.expect("statuses")[0];
    assert_eq!(status.restart_count, 2);
    assert_eq!(std::fs::read_to_string(out.join("runs")).expect("runs").lines().count(), 3);
}

#[tokio::test]
async fn admission_rejects_what_the_node_cannot_give() {
    let node = pod_node(1, |_| {}).await;
    let container = |resources: serde_json::Value| serde_json::json!([{"name": "main", "image": "busybox", "command": ["true"], "resources": resources}]);
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "greedy", "uid": "uid-cpu"},
        "spec": {"containers": container(serde_json::json!({"requests": {"cpu": "3"}}))}
    })));
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "unknown", "uid": "uid-ext"},
        "spec": {"containers": container(serde_json::json!({"limits": {"example.com/none": "1"}}))}
    })));
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "two-gpus", "uid": "uid-gpu"},
        "spec": {"containers": container(serde_json::json!({"limits": {GPU: "2"}}))}
    })));
    assert_eq!(
        rejection(&node, "uid-cpu").await,
        (
            "OutOfcpu".into(),
            "Pod was rejected: Node didn't have enough resource: cpu, requested: 3000, used: 0, capacity: 2000".into()
        )
    );
    assert_eq!(
        rejection(&node, "uid-ext").await,
        (
            "OutOfexample.com/none".into(),
            "Pod was rejected: Node didn't have enough resource: example.com/none, requested: 1, used: 0, capacity: 0"
                .into()
        )
    );
    assert_eq!(
        rejection(&node, "uid-gpu").await,
        (
            "UnexpectedAdmissionError".into(),
            format!(
                "Pod was rejected: Allocate failed due to requested number of devices unavailable for {GPU}. Requested: 2, Available: 1, which is unexpected"
            )
        )
    );
    assert!(node.devices.allocated("uid-gpu", "main").is_empty(), "nothing held by a rejected pod");
}

/// Waits until the pod failed; returns its reason and message.
async fn rejection(node: &PodNode, uid: &str) -> (String, String) {
    let pod = node.wait_pod(uid, "Failed", |p| phase(p) == Some("Failed")).await;
    let status = pod.status.expect("status");
    (status.reason.unwrap_or_default(), status.message.unwrap_or_default())
}

#[tokio::test]
async fn removal_stops_a_running_container_within_its_grace_period() {
    let node = pod_node(1, |_| {}).await;
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "server", "uid": "uid-4"},
        "spec": {
            "terminationGracePeriodSeconds": 60,
            "containers": [{
                "name": "main", "image": "busybox",
                "command": ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.1; done"],
                "resources": {"limits": {GPU: "1"}},
                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]
            }],
            "volumes": [{"name": "scratch", "emptyDir": {}}]
        }
    })));
    let running = node
        .wait_pod("uid-4", "Running and Ready", |p| {
            phase(p) == Some("Running")
                && p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .await;
    assert!(running.status.is_some());
    assert_eq!(node.devices.allocated("uid-4", "main")[GPU].len(), 1);
    node.pods.delete("uid-4");
    node.wait_gone("uid-4").await;
    assert!(node.devices.allocated("uid-4", "main").is_empty());
    assert!(!node.root.path().join("pods/uid-4").exists());
}

#[tokio::test]
async fn a_host_path_of_the_wrong_type_keeps_the_pod_pending_with_the_reason() {
    let node = pod_node(0, |_| {}).await;
    let file = node.root.path().join("not-a-dir");
    std::fs::write(&file, "x").expect("write");
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "wrong", "uid": "uid-5"},
        "spec": {
            "containers": [{"name": "main", "image": "busybox", "command": ["true"],
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
            "volumes": [{"name": "data", "hostPath": {"path": file.display().to_string(), "type": "Directory"}}]
        }
    })));
    let pending = node
        .wait_pod("uid-5", "a volume message", |p| {
            p.status
                .as_ref()
                .and_then(|s| s.message.as_deref())
                .is_some_and(|m| m.contains("hostPath type check failed"))
        })
        .await;
    let status = pending.status.expect("status");
    assert_eq!(status.phase.as_deref(), Some("Pending"));
    assert_eq!(
        status.message.as_deref(),
        Some(
            format!(
                "volumes not ready: volume \"data\": hostPath type check failed: {} is not a directory",
                file.display()
            )
            .as_str()
        )
    );
    node.pods.delete("uid-5");
    node.wait_gone("uid-5").await;
}

fn waiting_reason(pod: &Pod, container: usize) -> Option<String> {
    let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
    statuses.get(container)?.state.as_ref()?.waiting.as_ref()?.reason.clone()
}

fn waiting_message(pod: &Pod, container: usize) -> String {
    let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.clone()).unwrap_or_default();
    statuses.get(container).and_then(|c| c.state.as_ref()?.waiting.as_ref()?.message.clone()).unwrap_or_default()
}

#[tokio::test]
async fn a_container_the_provider_cannot_start_backs_off_and_the_pod_keeps_trying() {
    let node = pod_node(0, |_| {}).await;
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "broken-start", "uid": "uid-start"},
        "spec": {"containers": [{"name": "main", "image": "busybox", "command": ["/nonexistent/program"]}]}
    })));
    let failed = node
        .wait_pod("uid-start", "CrashLoopBackOff", |p| waiting_reason(p, 0).as_deref() == Some("CrashLoopBackOff"))
        .await;
    assert!(waiting_message(&failed, 0).contains("/nonexistent/program"), "{:?}", failed.status);
    assert_eq!(phase(&failed), Some("Running"), "upstream: a container that ended and will restart");
    let status = &failed.status.clone().expect("status").container_statuses.expect("statuses")[0];
    let last = status.last_state.as_ref().and_then(|s| s.terminated.as_ref()).expect("last state");
    assert_eq!((last.exit_code, last.reason.as_deref()), (128, Some("StartError")));
    // It is tried again after each backoff and fails again; the pod is not
    // given up on.
    let again = node
        .wait_pod("uid-start", "more tries", |p| {
            p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).is_some_and(|c| c[0].restart_count >= 3)
        })
        .await;
    assert_ne!(phase(&again), Some("Failed"));
    node.pods.delete("uid-start");
    node.wait_gone("uid-start").await;
}

#[tokio::test]
async fn an_image_that_cannot_be_pulled_backs_off_with_the_reason() {
    let node = pod_node(0, |_| {}).await;
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "bad-image", "uid": "uid-image"},
        "spec": {"containers": [{"name": "main", "image": "registry.example/broken:1", "command": ["true"]}]}
    })));
    let backing_off = node
        .wait_pod("uid-image", "ImagePullBackOff", |p| waiting_reason(p, 0).as_deref() == Some("ImagePullBackOff"))
        .await;
    let message = waiting_message(&backing_off, 0);
    assert!(message.contains("Back-off") && message.contains("registry.example/broken:1"), "{message}");
    assert_eq!(phase(&backing_off), Some("Pending"));
    node.pods.delete("uid-image");
    node.wait_gone("uid-image").await;
}
