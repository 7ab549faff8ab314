//! The CRI provider on a real containerd (Debian's containerd 1.6 and runc,
//! a private instance per test binary), images built by the tests from
//! Debian's static busybox and pulled from a loopback registry.
//!
//! Needs root (containerd does); without it, or without containerd, the
//! tests say why and skip, unless `RUSTLET_REQUIRE_CONTAINERD=1`.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kubelet::pod::{Allocatable, BackoffConfig, PodConfig, PodLifecycle, Pods};
use kubelet::provider::{Provider, decode_cri_log};
use rustlet_cri::{CriConfig, CriProvider};
use rustlet_testkit::containerd::{Containerd, push_busybox};
use rustlet_testkit::registry::Registry;
use tokio_util::sync::CancellationToken;

/// A liveness bound: a pull and a start take about a second here.
const SOON: Duration = Duration::from_secs(120);

struct CriNode {
    root: tempfile::TempDir,
    pods: Pods,
    provider: CriProvider,
    image: String,
    _registry: Registry,
    shutdown: CancellationToken,
}

impl Drop for CriNode {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Pods on `containerd`, the busybox image in a registry of this test's.
async fn cri_node(containerd: &Containerd) -> CriNode {
    let registry = Registry::start().await.expect("registry");
    containerd.trust_registry(&registry.host());
    let image = push_busybox(&registry, "test/busybox", "v1", &[], &["sh"]).await.expect("push busybox");
    let root = tempfile::Builder::new().prefix("rustlet-cri-").tempdir().expect("tempdir");
    let shutdown = CancellationToken::new();
    let provider = CriProvider::new(CriConfig::new(containerd.endpoint()));
    let mut config = PodConfig::new(root.path(), Allocatable { cpu_milli: 2000, memory: 4 << 30, pods: 110 });
    config.restart_backoff = BackoffConfig {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(400),
        reset_after: Duration::from_secs(600),
    };
    let dyn_provider: Arc<dyn Provider> = Arc::new(provider.clone());
    let pods = Pods::start(PodLifecycle::new(config, Some(dyn_provider), None), shutdown.clone()).await;
    CriNode { root, pods, provider, image, _registry: registry, shutdown }
}

fn phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref().and_then(|s| s.phase.as_deref())
}

#[tokio::test]
async fn the_runtime_answers_with_its_name_and_version() {
    let Some(containerd) = Containerd::shared("the_runtime_answers_with_its_name_and_version") else { return };
    let provider = CriProvider::new(CriConfig::new(containerd.endpoint()));
    let (name, version) = provider.version().await.expect("Version");
    assert_eq!(name, "containerd");
    assert!(version.starts_with("1."), "{version}");
}

/// A pod (in its own network namespace, on the test's bridge) whose
/// container prints, then exits 3 under `restartPolicy: Never`: its image
/// is pulled from the registry, its output is in the kubelet's log layout,
/// the pod ends Failed with the exit code; removing it removes its sandbox.
#[tokio::test]
async fn a_container_runs_to_its_exit_code_and_its_output_is_logged() {
    let Some(containerd) = Containerd::shared("a_container_runs_to_its_exit_code_and_its_output_is_logged") else {
        return;
    };
    let node = cri_node(containerd).await;
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "exits", "namespace": "default", "uid": "cri-exits-1"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "main",
                "image": node.image,
                "command": ["sh", "-c", "echo \"hello from $(hostname)\"; echo \"$GREETING\"; exit 3"],
                "env": [{"name": "GREETING", "value": "env from the spec"}],
            }],
        },
    }))
    .expect("pod");
    node.pods.apply(pod);
    let done = node
        .pods
        .store()
        .wait_for(SOON, |pods| pods.values().any(|p| phase(p) == Some("Failed")))
        .await
        .unwrap_or_else(|| panic!("never Failed: {:#?}\ncontainerd: {}", node.pods.store().list(), containerd.log()));
    let pod = done.values().next().expect("pod");
    let status =
        pod.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|c| c.first()).expect("status");
    let terminated = status.state.as_ref().and_then(|s| s.terminated.as_ref()).expect("terminated");
    assert_eq!(terminated.exit_code, 3, "{status:?}");
    assert!(status.image_id.starts_with("sha256:"), "{status:?}");
    // Its own network namespace, on the test's bridge.
    let pod_ip: std::net::Ipv4Addr =
        pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()).expect("a pod IP").parse().expect("IPv4");
    assert_eq!(pod_ip.octets()[0], 10, "{pod_ip}");
    let log = node.root.path().join("logs/pods/default_exits_cri-exits-1/main/0.log");
    let lines = decode_cri_log(&std::fs::read_to_string(&log).expect("the container's log"));
    assert_eq!(lines, ["hello from exits\n", "env from the spec\n"]);

    node.pods.delete("cri-exits-1");
    let gone = node.pods.store().wait_for(SOON, |pods| pods.is_empty()).await;
    assert!(gone.is_some(), "the pod was removed");
    let left = node.provider.running_containers().await.expect("list");
    assert!(left.iter().all(|c| c.pod_uid != "cri-exits-1"), "{left:?}");
}
