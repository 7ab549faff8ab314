//! The WebAssembly provider end to end: real wasm modules (assembled from
//! WAT) run under wasmtime through the pod lifecycle, imported from OCI
//! layouts or pulled from a real registry (`docker-registry` on loopback),
//! with a real device plugin process where devices matter.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kubelet::device_manager::{DeviceManager, DeviceManagerConfig};
use kubelet::pod::{Allocatable, BackoffConfig, PodConfig, PodLifecycle, Pods};
use kubelet::provider::Provider;
use rustlet_testkit::pod_state::{container_ready, container_status, every_second, pod_ready, restarts};
use rustlet_testkit::process::PluginProcess;
use rustlet_testkit::registry::{Registry, registry_or_skip};
use rustlet_wasi::{WasiConfig, WasiProvider, examples};
use tempfile::TempDir;
use tokio_util::sync::CancellationToken;

const GPU: &str = "vendor.example.com/gpu";

struct WasmNode {
    root: TempDir,
    pods: Pods,
    devices: DeviceManager,
    provider: Arc<WasiProvider>,
    _plugin: Option<PluginProcess>,
    shutdown: CancellationToken,
}

impl Drop for WasmNode {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn fast_backoff() -> BackoffConfig {
    BackoffConfig {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(400),
        reset_after: Duration::from_secs(600),
    }
}

/// A node running the wasi provider, with `gpus` fake devices.
async fn wasm_node(gpus: u64) -> WasmNode {
    wasm_node_with(gpus, Allocatable { cpu_milli: 4000, memory: 8 << 30, pods: 500 }, None).await
}

/// A node running the wasi provider, with `gpus` fake devices, offering
/// `allocatable`, its provider seeing `max_map_count` (None: the kernel's).
async fn wasm_node_with(gpus: u64, allocatable: Allocatable, max_map_count: Option<u64>) -> WasmNode {
    wasm_node_config(gpus, allocatable, |wasi| wasi.max_map_count = max_map_count).await
}

/// [`wasm_node_with`], the provider's settings changed by `tweak`.
async fn wasm_node_config(gpus: u64, allocatable: Allocatable, tweak: impl FnOnce(&mut WasiConfig)) -> WasmNode {
    let root = rustlet_testkit::node_root::tempdir("rustlet-wasi-");
    let shutdown = CancellationToken::new();
    let device_dir = root.path().join("device-plugins");
    let devices = DeviceManager::start(DeviceManagerConfig::new(&device_dir), shutdown.clone()).expect("devices");
    let plugin = if gpus > 0 { Some(gpu_plugin(&devices, &device_dir, GPU, gpus).await) } else { None };
    let mut config = PodConfig::new(root.path(), allocatable);
    config.restart_backoff = fast_backoff();
    config.image_backoff = fast_backoff();
    let mut wasi = WasiConfig::new(root.path());
    tweak(&mut wasi);
    let provider = Arc::new(WasiProvider::new(wasi).expect("wasi provider"));
    let dyn_provider: Arc<dyn Provider> = provider.clone();
    let lifecycle = PodLifecycle::new(config, Some(dyn_provider), Some(devices.clone()));
    let pods = Pods::start(lifecycle, shutdown.clone()).await;
    WasmNode { root, pods, devices, provider, _plugin: plugin, shutdown }
}

use rustlet_testkit::pod_state::pod_from as pod;

fn phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref().and_then(|s| s.phase.as_deref())
}

/// The first container's state: (waiting reason, terminated (exit code,
/// reason), every message in its state and last state).
/// (waiting reason, terminated (exit code, reason), messages).
type ContainerState = (Option<String>, Option<(i32, Option<String>)>, Option<String>);

fn container_state(pod: &Pod) -> ContainerState {
    let status = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|s| s.first());
    let state = status.and_then(|s| s.state.as_ref());
    let last = status.and_then(|s| s.last_state.as_ref()).and_then(|s| s.terminated.as_ref());
    let waiting = state.and_then(|s| s.waiting.as_ref());
    let terminated = state.and_then(|s| s.terminated.as_ref());
    let messages: Vec<String> = [
        waiting.and_then(|w| w.message.clone()),
        terminated.and_then(|t| t.message.clone()),
        last.and_then(|t| t.message.clone()),
    ]
    .into_iter()
    .flatten()
    .collect();
    (
        waiting.and_then(|w| w.reason.clone()),
        terminated.map(|t| (t.exit_code, t.reason.clone())),
        (!messages.is_empty()).then(|| messages.join(" | ")),
    )
}

impl WasmNode {
    async fn wait_pod(&self, uid: &str, what: &str, pred: impl FnMut(&Pod) -> bool) -> Pod {
        rustlet_testkit::pod_state::wait_pod(self.pods.store(), uid, what, SOON, pred).await
    }

    async fn wait_gone(&self, uid: &str) {
        rustlet_testkit::pod_state::wait_gone(self.pods.store(), uid, SOON).await;
    }

    fn host_dir(&self, name: &str) -> std::path::PathBuf {
        let dir = self.root.path().join("host").join(name);
        std::fs::create_dir_all(&dir).expect("mkdir");
        dir
    }

    /// Imports the example modules as `example.com/wasm/<name>:v1`.
    fn import_examples(&self) {
        let layout = self.root.path().join("layout");
        let binaries: Vec<(String, Vec<u8>)> = examples::NAMES
            .iter()
            .map(|n| (format!("example.com/wasm/{n}:v1"), examples::binary(n).expect("assemble")))
            .collect();
        let images: Vec<(&str, &[u8])> = binaries.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
        rustlet_wasi::import::write_layout(&layout, &images).expect("layout");
        rustlet_wasi::import::import(self.provider.images(), &layout, None).expect("import");
    }

    /// The text of container `container`'s log (restart `restart`).
    fn log(&self, name: &str, uid: &str, container: &str, restart: u32) -> String {
        let path = kubelet::pod::pod_log_dir(self.root.path(), "default", name, uid)
            .join(container)
            .join(format!("{restart}.log"));
        kubelet::provider::decode_cri_log(&std::fs::read_to_string(&path).unwrap_or_default()).concat()
    }
}

fn simple_pod(name: &str, uid: &str, image: &str, restart_policy: &str) -> Pod {
    pod(serde_json::json!({
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {"restartPolicy": restart_policy, "containers": [{"name": "main", "image": image}]}
    }))
}

#[tokio::test]
async fn a_module_sees_its_args_env_device_and_volume_and_its_output_is_logged() {
    let node = wasm_node(1).await;
    node.import_examples();
    let out = node.host_dir("out");
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "hello", "namespace": "default", "uid": "uid-hello"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "main",
                "image": "example.com/wasm/hello:v1",
                "command": ["hello.wasm", "first"],
                "args": ["second"],
                "env": [{"name": "GREETING", "value": "hi"}],
                "resources": {"limits": {GPU: "1"}},
                "volumeMounts": [{"name": "out", "mountPath": "/out"}]
            }],
            "volumes": [{"name": "out", "hostPath": {"path": out.display().to_string(), "type": "Directory"}}]
        }
    })));
    let done = node.wait_pod("uid-hello", "Succeeded", |p| phase(p) == Some("Succeeded")).await;
    assert_eq!(container_state(&done).1, Some((0, Some("Completed".into()))));
    assert!(node.devices.allocated("uid-hello", "main").is_empty(), "a finished pod holds no device");
    let log = node.log("hello", "uid-hello", "main", 0);
    for line in ["arg: hello.wasm\n", "arg: first\n", "arg: second\n", "env: GREETING=hi\n", "wrote hello.txt"] {
        assert!(log.contains(line), "{line:?} missing from the log:\n{log}");
    }
    let device = log.lines().find_map(|l| l.strip_prefix("env: FAKE_DEVICES=")).unwrap_or_default();
    assert!(!device.is_empty() && !device.contains(','), "one device in the env:\n{log}");
    assert_eq!(std::fs::read_to_string(out.join("hello.txt")).expect("written"), "hello from a WebAssembly module\n");
    let image_id = done.status.and_then(|s| s.container_statuses).expect("statuses")[0].image_id.clone();
    assert!(image_id.starts_with("example.com/wasm/hello:v1@sha256:"), "{image_id}");
    node.pods.delete("uid-hello");
    node.wait_gone("uid-hello").await;
    assert!(node.devices.allocated("uid-hello", "main").is_empty());
}

#[tokio::test]
async fn a_read_only_volume_cannot_be_written() {
    let node = wasm_node(0).await;
    node.import_examples();
    let out = node.host_dir("ro");
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "ro", "namespace": "default", "uid": "uid-ro"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "main", "image": "example.com/wasm/hello:v1",
                "volumeMounts": [{"name": "out", "mountPath": "/out", "readOnly": true}]
            }],
            "volumes": [{"name": "out", "hostPath": {"path": out.display().to_string()}}]
        }
    })));
    let done = node.wait_pod("uid-ro", "Failed", |p| phase(p) == Some("Failed")).await;
    assert_eq!(container_state(&done).1, Some((1, Some("Error".into()))));
    assert!(node.log("ro", "uid-ro", "main", 0).contains("cannot write hello.txt"));
    assert!(!out.join("hello.txt").exists());
}

#[tokio::test]
async fn exit_codes_and_traps_end_the_container() {
    let node = wasm_node(0).await;
    node.import_examples();
    node.pods.apply(simple_pod("exit3", "uid-exit3", "example.com/wasm/exit3:v1", "Never"));
    node.pods.apply(simple_pod("trap", "uid-trap", "example.com/wasm/trap:v1", "Never"));
    let exited = node.wait_pod("uid-exit3", "Failed", |p| phase(p) == Some("Failed")).await;
    assert_eq!(container_state(&exited).1, Some((3, Some("Error".into()))));
    assert!(node.log("exit3", "uid-exit3", "main", 0).contains("exiting with 3"));
    let trapped = node.wait_pod("uid-trap", "Failed", |p| phase(p) == Some("Failed")).await;
    let (_, terminated, message) = container_state(&trapped);
    assert_eq!(terminated, Some((134, Some("Error".into()))));
    assert!(message.as_deref().is_some_and(|m| m.contains("unreachable")), "{message:?}");
    assert!(node.log("trap", "uid-trap", "main", 0).contains("about to trap"));
}

#[tokio::test]
async fn components_run_through_wasi_cli_run() {
    let node = wasm_node(0).await;
    node.import_examples();
    node.pods.apply(simple_pod("ok", "uid-ok", "example.com/wasm/component-ok:v1", "Never"));
    node.pods.apply(simple_pod("err", "uid-err", "example.com/wasm/component-err:v1", "Never"));
    let ok = node.wait_pod("uid-ok", "Succeeded", |p| phase(p) == Some("Succeeded")).await;
    assert_eq!(container_state(&ok).1, Some((0, Some("Completed".into()))));
    let err = node.wait_pod("uid-err", "Failed", |p| phase(p) == Some("Failed")).await;
    assert_eq!(container_state(&err).1, Some((1, Some("Error".into()))));
}

#[tokio::test]
async fn a_module_that_loops_forever_is_stopped_when_its_pod_goes() {
    let node = wasm_node(0).await;
    node.import_examples();
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "spin", "namespace": "default", "uid": "uid-spin"},
        "spec": {"terminationGracePeriodSeconds": 30, "containers": [{"name": "main", "image": "example.com/wasm/spin:v1"}]}
    })));
    node.wait_pod("uid-spin", "Running", |p| phase(p) == Some("Running")).await;
    // The relist sees it (`kubelet_running_pods`): the instance, by pod.
    let listed = node.provider.list_running().await.expect("the provider lists its instances");
    assert_eq!(listed.iter().map(|(uid, _)| uid.as_str()).collect::<Vec<_>>(), ["uid-spin"]);
    // Removal interrupts it at an epoch tick: far sooner than its 30 s
    // grace period, which would otherwise bound SOON.
    node.pods.delete("uid-spin");
    node.wait_gone("uid-spin").await;
    assert!(node.provider.list_running().await.expect("listed").is_empty());
}

#[tokio::test]
async fn a_module_over_its_memory_limit_is_oom_killed() {
    let node = wasm_node(0).await;
    node.import_examples();
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "hog", "namespace": "default", "uid": "uid-hog"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "example.com/wasm/hog:v1", "resources": {"limits": {"memory": "16Mi"}}}]
        }
    })));
    let done = node.wait_pod("uid-hog", "Failed", |p| phase(p) == Some("Failed")).await;
    assert_eq!(container_state(&done).1, Some((137, Some("OOMKilled".into()))));
    assert!(node.log("hog", "uid-hog", "main", 0).contains("allocating"));
}

#[tokio::test]
async fn a_module_that_cannot_be_instantiated_fails_alone_and_the_node_runs_on() {
    let node = wasm_node(0).await;
    node.import_examples();
    node.pods.apply(simple_pod("before", "uid-before", "example.com/wasm/sleep:v1", "Always"));
    node.wait_pod("uid-before", "Running", |p| phase(p) == Some("Running")).await;
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "greedy", "namespace": "default", "uid": "uid-greedy"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "example.com/wasm/greedy:v1", "resources": {"limits": {"memory": "16Mi"}}}]
        }
    })));
    let failed = node.wait_pod("uid-greedy", "Failed", |p| phase(p) == Some("Failed")).await;
    let (_, terminated, message) = container_state(&failed);
    assert_eq!(terminated, Some((137, Some("OOMKilled".into()))));
    assert_eq!(
        message.as_deref(),
        Some(
            "the module cannot start: it declares 67108864 bytes of linear memory, over its memory limit of 16777216 bytes"
        )
    );
    // The node runs on: the pod before it still runs, and a new one starts.
    assert_eq!(node.pods.store().get("uid-before").as_ref().and_then(phase), Some("Running"));
    node.pods.apply(simple_pod("after", "uid-after", "example.com/wasm/sleep:v1", "Always"));
    node.wait_pod("uid-after", "Running", |p| phase(p) == Some("Running")).await;
}

/// The pod's rejection: (phase, reason, message).
fn rejection(pod: &Pod) -> (Option<&str>, Option<&str>, Option<&str>) {
    let status = pod.status.as_ref();
    (phase(pod), status.and_then(|s| s.reason.as_deref()), status.and_then(|s| s.message.as_deref()))
}

#[tokio::test]
async fn a_node_at_its_mapping_ceiling_refuses_the_next_pod_as_out_of_pods() {
    // A kernel allowing the node's own mappings and two pods' worth.
    let max_map_count = rustlet_wasi::RESERVED_MAPPINGS + 2 * rustlet_wasi::MAPPINGS_PER_POD;
    let allocatable = Allocatable { cpu_milli: 4000, memory: 8 << 30, pods: 500 };
    let node = wasm_node_with(0, allocatable, Some(max_map_count)).await;
    assert_eq!(node.provider.pod_ceiling().map(|c| c.0), Some(2));
    node.import_examples();
    for i in 0..2 {
        node.pods.apply(simple_pod(&format!("p{i}"), &format!("uid-p{i}"), "example.com/wasm/sleep:v1", "Always"));
        node.wait_pod(&format!("uid-p{i}"), "Running", |p| phase(p) == Some("Running")).await;
    }
    node.pods.apply(simple_pod("p2", "uid-p2", "example.com/wasm/sleep:v1", "Always"));
    let refused = node.wait_pod("uid-p2", "rejected", |p| phase(p) == Some("Failed")).await;
    assert_eq!(
        rejection(&refused),
        (
            Some("Failed"),
            Some("OutOfpods"),
            Some("Pod was rejected: Node didn't have enough resource: pods, requested: 1, used: 2, capacity: 2")
        )
    );
    // A pod gone makes room for the next.
    node.pods.delete("uid-p0");
    node.wait_gone("uid-p0").await;
    node.pods.apply(simple_pod("p3", "uid-p3", "example.com/wasm/sleep:v1", "Always"));
    node.wait_pod("uid-p3", "Running", |p| phase(p) == Some("Running")).await;
}

#[tokio::test]
async fn admission_counts_requests_and_each_instances_overhead_not_the_memory_budget() {
    let overhead = rustlet_wasi::INSTANCE_OVERHEAD;
    let default = u128::from(rustlet_wasi::DEFAULT_MEMORY_LIMIT);
    // Room for a pod requesting 16 MiB and two pods without requests, each
    // with its overhead: far less than one default memory budget.
    let allocatable = Allocatable { cpu_milli: 4000, memory: (16 << 20) + 3 * overhead, pods: 500 };
    assert!(allocatable.memory < default);
    let node = wasm_node_with(0, allocatable, None).await;
    node.import_examples();
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "sized", "namespace": "default", "uid": "uid-sized"},
        "spec": {"containers": [{"name": "main", "image": "example.com/wasm/sleep:v1", "resources": {"limits": {"memory": "16Mi"}}}]}
    })));
    node.wait_pod("uid-sized", "Running", |p| phase(p) == Some("Running")).await;
    for (name, uid) in [("small", "uid-small"), ("also-small", "uid-also-small")] {
        node.pods.apply(simple_pod(name, uid, "example.com/wasm/sleep:v1", "Always"));
        node.wait_pod(uid, "Running", |p| phase(p) == Some("Running")).await;
    }
    // Admitted without its budget counted, but held to it.
    assert_eq!(node.provider.memory_budget("uid-small").map(|(_, limit)| u128::from(limit)), Some(default));
    node.pods.apply(simple_pod("one-more", "uid-one-more", "example.com/wasm/sleep:v1", "Always"));
    let refused = node.wait_pod("uid-one-more", "rejected", |p| phase(p) == Some("Failed")).await;
    let used = (16 << 20) + 3 * overhead;
    let expected = format!(
        "Pod was rejected: Node didn't have enough resource: memory, requested: {overhead}, used: {used}, capacity: {used}"
    );
    assert_eq!(rejection(&refused), (Some("Failed"), Some("OutOfmemory"), Some(expected.as_str())));
}

#[tokio::test]
async fn a_missing_volume_path_is_a_clear_start_error_until_it_exists() {
    let node = wasm_node(0).await;
    node.import_examples();
    let missing = node.root.path().join("host/not-yet");
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "late", "namespace": "default", "uid": "uid-late"},
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [{"name": "main", "image": "example.com/wasm/hello:v1",
                            "volumeMounts": [{"name": "out", "mountPath": "/out"}]}],
            "volumes": [{"name": "out", "hostPath": {"path": missing.display().to_string()}}]
        }
    })));
    let waiting = node
        .wait_pod("uid-late", "a start error naming the path", |p| {
            container_state(p).2.is_some_and(|m| m.contains(&missing.display().to_string()))
        })
        .await;
    // Never ran; restarting (as upstream, a container with a last
    // termination counts as running for the phase).
    assert_ne!(phase(&waiting), Some("Succeeded"));
    std::fs::create_dir_all(&missing).expect("mkdir");
    node.wait_pod("uid-late", "Succeeded once the path exists", |p| phase(p) == Some("Succeeded")).await;
    assert!(missing.join("hello.txt").exists());
}

#[tokio::test]
async fn a_second_pod_of_an_image_does_not_compile_it_again() {
    let node = wasm_node(0).await;
    node.import_examples();
    node.pods.apply(simple_pod("a", "uid-a", "example.com/wasm/sleep:v1", "Always"));
    node.wait_pod("uid-a", "Running", |p| phase(p) == Some("Running")).await;
    let compiled = node.provider.compilations();
    node.pods.apply(simple_pod("b", "uid-b", "example.com/wasm/sleep:v1", "Always"));
    node.wait_pod("uid-b", "Running", |p| phase(p) == Some("Running")).await;
    assert_eq!(node.provider.compilations(), compiled, "the second pod compiled the module again");
    assert_eq!(compiled, 1);
}

#[tokio::test]
async fn an_image_never_pulled_under_policy_never_waits_with_upstreams_message() {
    let node = wasm_node(0).await;
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "never", "namespace": "default", "uid": "uid-never"},
        "spec": {"containers": [{"name": "main", "image": "example.com/wasm/absent:v1", "imagePullPolicy": "Never"}]}
    })));
    let waiting = node
        .wait_pod("uid-never", "ErrImageNeverPull", |p| container_state(p).2.is_some_and(|m| m.contains("Never")))
        .await;
    let (reason, _, message) = container_state(&waiting);
    assert_eq!(reason.as_deref(), Some("ErrImageNeverPull"), "upstream's reason, kept through the retries");
    assert!(message.unwrap_or_default().contains("is not present with pull policy of Never"));
}

// --- pulls from a real registry --------------------------------------------

async fn registry_node(test: &str, credentials: Option<(&str, &str)>) -> Option<(WasmNode, Registry)> {
    let registry = registry_or_skip(test, credentials).await?;
    Some((wasm_node(0).await, registry))
}

#[tokio::test]
async fn images_in_every_accepted_layout_are_pulled_and_run() {
    let Some((node, registry)) = registry_node("layouts", None).await else { return };
    let hello = examples::binary("hello").expect("assemble");
    registry.push_wasm("wasm/cncf", "v1", &hello).await.expect("push cncf");
    registry.push_wasm_to_oci("wasm/wasm-to-oci", "v1", &hello).await.expect("push wasm-to-oci");
    registry
        .push_image("wasm/plain", "v1", "wasip1", "wasm", &[("app/hello.wasm", &hello)], &["/app/hello.wasm"])
        .await
        .expect("push plain image");
    let out = node.host_dir("out");
    for (n, repository) in ["wasm/cncf", "wasm/wasm-to-oci", "wasm/plain"].iter().enumerate() {
        let uid = format!("uid-{n}");
        let dir = out.join(n.to_string());
        std::fs::create_dir_all(&dir).expect("mkdir");
        node.pods.apply(pod(serde_json::json!({
            "metadata": {"name": format!("p{n}"), "namespace": "default", "uid": uid},
            "spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": registry.reference(repository, "v1"),
                                "volumeMounts": [{"name": "out", "mountPath": "/out"}]}],
                "volumes": [{"name": "out", "hostPath": {"path": dir.display().to_string()}}]
            }
        })));
        node.wait_pod(&uid, &format!("{repository} Succeeded"), |p| phase(p) == Some("Succeeded")).await;
        assert!(dir.join("hello.txt").exists(), "{repository}");
    }
    // The plain image runs its entrypoint as argv[0].
    assert!(node.log("p2", "uid-2", "main", 0).contains("arg: /app/hello.wasm\n"));
}

#[tokio::test]
async fn a_linux_image_and_a_non_wasm_layer_are_refused_with_a_reason() {
    let Some((node, registry)) = registry_node("linux image", None).await else { return };
    registry
        .push_image(
            "library/busybox",
            "1",
            "linux",
            "amd64",
            &[("bin/busybox", b"\x7fELF\x02\x01\x01\0")],
            &["/bin/sh"],
        )
        .await
        .expect("push linux image");
    registry.push_wasm("wasm/elf", "v1", b"\x7fELF\x02\x01\x01\0 not wasm").await.expect("push");
    node.pods.apply(simple_pod("linux", "uid-linux", &registry.reference("library/busybox", "1"), "Never"));
    node.pods.apply(simple_pod("elf", "uid-elf", &registry.reference("wasm/elf", "v1"), "Never"));
    let linux = node
        .wait_pod("uid-linux", "a pull error", |p| container_state(p).2.is_some_and(|m| m.contains("linux/amd64")))
        .await;
    let message = container_state(&linux).2.unwrap_or_default();
    assert!(message.contains("not a WebAssembly image"), "{message}");
    let elf = node
        .wait_pod("uid-elf", "a pull error", |p| {
            container_state(p).2.is_some_and(|m| m.contains("not a WebAssembly binary"))
        })
        .await;
    assert!(matches!(container_state(&elf).0.as_deref(), Some("ErrImagePull" | "ImagePullBackOff")));
}

#[tokio::test]
async fn pull_errors_back_off_and_recover() {
    let Some((node, mut registry)) = registry_node("pull errors", None).await else { return };
    let hello = examples::binary("hello").expect("assemble");
    // Unknown repository.
    node.pods.apply(simple_pod("unknown", "uid-unknown", &registry.reference("wasm/nothing", "v1"), "Never"));
    let unknown = node
        .wait_pod("uid-unknown", "ImagePullBackOff", |p| container_state(p).0.as_deref() == Some("ImagePullBackOff"))
        .await;
    assert!(container_state(&unknown).2.is_some_and(|m| m.contains("Back-off")));
    let seen = node
        .wait_pod("uid-unknown", "ErrImagePull naming not found", |p| {
            container_state(p).2.is_some_and(|m| m.contains("not found"))
        })
        .await;
    assert_eq!(container_state(&seen).0.as_deref(), Some("ErrImagePull"));
    // Pushed later: the backoff's next try pulls it.
    registry.push_wasm("wasm/nothing", "v1", &hello).await.expect("push");
    node.wait_pod("uid-unknown", "the module ran once pushed", |p| container_state(p).1.is_some()).await;

    // Registry down, then back.
    registry.push_wasm("wasm/later", "v1", &hello).await.expect("push");
    registry.stop().await;
    node.pods.apply(simple_pod("down", "uid-down", &registry.reference("wasm/later", "v1"), "Never"));
    node.wait_pod("uid-down", "unreachable", |p| container_state(p).2.is_some_and(|m| m.contains("cannot be reached")))
        .await;
    registry.restart().await.expect("registry back");
    node.wait_pod("uid-down", "the module ran once the registry is back", |p| container_state(p).1.is_some()).await;
}

#[tokio::test]
async fn a_digest_mismatch_is_refused_and_nothing_is_stored() {
    let Some((node, registry)) = registry_node("digest mismatch", None).await else { return };
    let hello = examples::binary("hello").expect("assemble");
    let (_, layer) = registry.push_wasm("wasm/tampered", "v1", &hello).await.expect("push");
    let mut tampered = hello.clone();
    tampered.extend_from_slice(b"extra");
    std::fs::write(registry.blob_data(&layer), &tampered).expect("tamper");
    node.pods.apply(simple_pod("t", "uid-t", &registry.reference("wasm/tampered", "v1"), "Never"));
    let failed = node
        .wait_pod("uid-t", "a digest mismatch", |p| container_state(p).2.is_some_and(|m| m.contains("digest mismatch")))
        .await;
    assert_eq!(phase(&failed), Some("Pending"));
    assert!(!node.provider.images().has_blob(&layer));
    let leftovers = std::fs::read_dir(node.provider.images().dir().join("tmp")).expect("tmp").count();
    assert_eq!(leftovers, 0, "a partial download was left behind");
}

#[tokio::test]
async fn a_registry_that_requires_auth_is_pulled_with_the_nodes_credentials() {
    let Some((node, registry)) = registry_node("auth", Some(("puller", "s3cret"))).await else { return };
    let hello = examples::binary("hello").expect("assemble");
    registry.push_wasm("wasm/private", "v1", &hello).await.expect("push");
    node.pods.apply(simple_pod("private", "uid-p", &registry.reference("wasm/private", "v1"), "Never"));
    node.wait_pod("uid-p", "refused access", |p| container_state(p).2.is_some_and(|m| m.contains("refused access")))
        .await;
    // The kubelet reads <root-dir>/config.json (docker's format).
    let config = serde_json::json!({"auths": {registry.host(): {"username": "puller", "password": "s3cret"}}});
    std::fs::write(node.root.path().join("config.json"), config.to_string()).expect("config.json");
    // Pulled and run (hello exits 1 here: it has no volume to write to).
    node.wait_pod("uid-p", "the module ran with credentials", |p| container_state(p).1.is_some()).await;
    assert!(node.log("private", "uid-p", "main", 0).contains("hello"), "the module's output");
}

#[tokio::test]
async fn pods_pulling_one_image_at_once_make_one_pull() {
    let Some((node, registry)) = registry_node("concurrent pulls", None).await else { return };
    let sleep = examples::binary("sleep").expect("assemble");
    let (_, layer) = registry.push_wasm("wasm/shared", "v1", &sleep).await.expect("push");
    let image = registry.reference("wasm/shared", "v1");
    for n in 0..5 {
        node.pods.apply(simple_pod(&format!("s{n}"), &format!("uid-s{n}"), &image, "Always"));
    }
    for n in 0..5 {
        node.wait_pod(&format!("uid-s{n}"), "Running", |p| phase(p) == Some("Running")).await;
    }
    assert_eq!(registry.blob_downloads(&layer), 1, "registry log:\n{}", registry.log());
    assert_eq!(node.provider.pull_count(), 1);
    assert_eq!(node.provider.compilations(), 1);
}

/// A pod deleted while its image is being pulled (from a registry that
/// accepts the connection and never answers) goes at once: the pull does
/// not hold the removal, and nothing of the pod stays (no image, no pod
/// directory).
#[tokio::test]
async fn a_pod_deleted_while_its_image_is_being_pulled_goes_at_once() {
    let node = wasm_node(0).await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = silent.local_addr().expect("address");
    let (accepted_tx, mut accepted) = tokio::sync::mpsc::unbounded_channel();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
            let _ = accepted_tx.send(());
        }
    });
    let image = format!("{address}/wasm/slow:v1");
    node.pods.apply(simple_pod("slow", "uid-slow", &image, "Always"));
    // The pull is under way: the registry got its connection.
    tokio::time::timeout(SOON, accepted.recv()).await.expect("the pull connects in time").expect("holder alive");
    node.pods.delete("uid-slow");
    node.wait_gone("uid-slow").await;
    let pod_dir = node.root.path().join("pods").join("uid-slow");
    assert!(!pod_dir.exists(), "the pod's directory is gone");
    let images = node.provider.images().list().expect("list");
    assert!(images.iter().all(|i| !i.name.contains("wasm/slow")), "no image stored: {images:?}");
    holder.abort();
}

/// Probes settle within a few periods of one second; this bounds that
/// generously on a busy machine.
const PROBE_DEADLINE: Duration = Duration::from_secs(60);

impl WasmNode {
    async fn wait_probe(&self, uid: &str, what: &str, pred: impl Fn(&Pod) -> bool) -> Pod {
        let found = self.pods.store().wait_for(PROBE_DEADLINE, |pods| pods.get(uid).is_some_and(&pred)).await;
        found.and_then(|pods| pods.get(uid).cloned()).unwrap_or_else(|| {
            panic!("{uid}: timed out waiting for {what}; now: {:#?}", self.pods.store().get(uid).map(|p| p.status))
        })
    }
}

/// A pod of the `check` module with `probes` (exec probes running `check
/// now`: a fresh instance that looks for `healthy` in `dir`), each with
/// its failure threshold.
fn check_pod(name: &str, dir: &std::path::Path, probes: &[(&str, i32)]) -> Pod {
    let mut container = serde_json::json!({
        "name": "main",
        "image": "example.com/wasm/check:v1",
        "volumeMounts": [{"name": "ctl", "mountPath": "/ctl"}],
    });
    for (probe, failure_threshold) in probes {
        container[*probe] = serde_json::json!({"exec": {"command": ["check", "now"]}, "periodSeconds": 1, "failureThreshold": failure_threshold});
    }
    pod(serde_json::json!({
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": {
            "containers": [container],
            "volumes": [{"name": "ctl", "hostPath": {"path": dir.display().to_string(), "type": "Directory"}}]
        }
    }))
}

/// Exec probes of a WebAssembly container run a fresh instance of its
/// module, with the container's volumes, and the probe's command as its
/// arguments: readiness follows it both ways, a failing liveness probe
/// restarts the container with the reason in its last state.
#[tokio::test]
async fn exec_probes_run_a_fresh_instance_of_the_module() {
    let node = wasm_node(0).await;
    node.import_examples();
    let readiness_dir = node.host_dir("readiness");
    let liveness_dir = node.host_dir("liveness");
    std::fs::write(readiness_dir.join("healthy"), "").expect("write");
    std::fs::write(liveness_dir.join("healthy"), "").expect("write");
    node.pods.apply(check_pod("readiness", &readiness_dir, &[("readinessProbe", 1)]));
    // Readiness too: "ready" then means a probe of the instance passed.
    node.pods.apply(check_pod("liveness", &liveness_dir, &[("livenessProbe", 2), ("readinessProbe", 1)]));

    node.wait_probe("uid-readiness", "Ready", |p| container_ready(p, "main") && pod_ready(p)).await;
    std::fs::remove_file(readiness_dir.join("healthy")).expect("rm");
    let unready = node.wait_probe("uid-readiness", "not Ready", |p| !container_ready(p, "main") && !pod_ready(p)).await;
    assert_eq!(phase(&unready), Some("Running"), "an unready container keeps running");
    assert_eq!(restarts(&unready, "main"), 0, "readiness never restarts");
    std::fs::write(readiness_dir.join("healthy"), "").expect("write");
    node.wait_probe("uid-readiness", "Ready again", |p| container_ready(p, "main") && pod_ready(p)).await;

    node.wait_probe("uid-liveness", "probed ready", |p| container_ready(p, "main")).await;
    std::fs::remove_file(liveness_dir.join("healthy")).expect("rm");
    let restarted = node.wait_probe("uid-liveness", "restarted", |p| restarts(p, "main") >= 1).await;
    let last =
        container_status(&restarted, "main").and_then(|c| c.last_state.as_ref()).and_then(|s| s.terminated.clone());
    let message = last.and_then(|t| t.message).unwrap_or_default();
    assert!(message.contains("Liveness probe failed: not healthy"), "{message:?}");
    // Healthy again: the restarted instance stays.
    std::fs::write(liveness_dir.join("healthy"), "").expect("write");
    node.wait_probe("uid-liveness", "ready after its restart", |p| container_ready(p, "main")).await;
}

/// Streaming into a container that is not running is `NotFound`, attach
/// with stdin and port-forward are refused with a reason (`kubectl exec`
/// and `attach` themselves are tested through the API server in
/// `tests/cri.rs`).
#[tokio::test]
async fn streaming_requests_are_refused_with_a_reason() {
    use kubelet::provider::{ContainerId, ProviderErrorKind, StreamRequest};
    let node = wasm_node(0).await;
    let id = ContainerId("wasm-any".into());
    let exec = node.provider.exec(&id, &StreamRequest::default()).await.expect_err("not running");
    let attach = node.provider.attach(&id, &StreamRequest::default()).await.expect_err("not running");
    for error in [&exec, &attach] {
        assert_eq!(error.kind, ProviderErrorKind::NotFound, "{error}");
    }
    let with_stdin = StreamRequest { stdin: true, ..StreamRequest::default() };
    let attach = node.provider.attach(&id, &with_stdin).await.expect_err("no stdin");
    assert_eq!(attach.kind, ProviderErrorKind::Unsupported);
    assert!(attach.message.contains("no stdin to attach to"), "{attach}");
    let forward = node.provider.port_forward("uid", &[80]).await.expect_err("unsupported");
    assert_eq!(forward.kind, ProviderErrorKind::Unsupported, "{forward}");
    assert!(forward.message.contains("no network namespace of their own"), "{forward}");
    let gone = node.provider.exec_sync(&id, &["check".into()], Duration::from_secs(1)).await.expect_err("not running");
    assert_eq!(gone.kind, ProviderErrorKind::NotFound);
}

/// What the test's HTTP server answers and saw.
#[derive(Default)]
struct HttpProbes {
    /// The status code for each path (404 when unset).
    answers: std::sync::Mutex<std::collections::HashMap<String, u16>>,
    /// Requests per path.
    hits: std::sync::Mutex<std::collections::HashMap<String, u32>>,
    /// The last User-Agent seen.
    user_agent: std::sync::Mutex<Option<String>>,
    /// Every request, counted (to wait on).
    requests: tokio::sync::watch::Sender<u32>,
}

impl HttpProbes {
    fn answer(&self, path: &str, code: u16) {
        self.answers.lock().expect("lock").insert(path.to_owned(), code);
    }

    fn hits(&self, path: &str) -> u32 {
        self.hits.lock().expect("lock").get(path).copied().unwrap_or(0)
    }
}

/// Serves `probes` on loopback; returns the port.
async fn serve_http(probes: Arc<HttpProbes>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let app = axum::Router::new().fallback(move |request: axum::extract::Request| {
        let probes = Arc::clone(&probes);
        async move {
            let path = request.uri().path().to_owned();
            *probes.hits.lock().expect("lock").entry(path.clone()).or_default() += 1;
            probes.requests.send_modify(|n| *n += 1);
            let agent = request.headers().get("user-agent").and_then(|v| v.to_str().ok()).map(str::to_owned);
            *probes.user_agent.lock().expect("lock") = agent;
            let code = probes.answers.lock().expect("lock").get(&path).copied().unwrap_or(404);
            http::StatusCode::from_u16(code).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR)
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    port
}

/// A gRPC health server whose answer the test sets.
#[derive(Default)]
struct Health(std::sync::atomic::AtomicBool);

#[tonic::async_trait]
impl kubelet_api::health::v1::health_server::Health for Health {
    async fn check(
        &self,
        _: tonic::Request<kubelet_api::health::v1::HealthCheckRequest>,
    ) -> Result<tonic::Response<kubelet_api::health::v1::HealthCheckResponse>, tonic::Status> {
        use kubelet_api::health::v1::health_check_response::ServingStatus;
        let serving = self.0.load(std::sync::atomic::Ordering::SeqCst);
        let status = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
        Ok(tonic::Response::new(kubelet_api::health::v1::HealthCheckResponse { status: status.into() }))
    }
}

/// httpGet, tcpSocket and grpc probes of a WebAssembly pod go to loopback
/// (it shares the node's network), here to servers of the test: each
/// drives its container as the server answers.
#[tokio::test]
async fn http_tcp_and_grpc_probes_reach_the_pod_on_loopback() {
    let node = wasm_node(0).await;
    node.import_examples();
    let http_probes = Arc::new(HttpProbes::default());
    http_probes.answer("/ready", 200);
    let http_port = serve_http(Arc::clone(&http_probes)).await;
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let tcp_port = tcp.local_addr().expect("addr").port();
    let health = Arc::new(Health(std::sync::atomic::AtomicBool::new(true)));
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let grpc_port = grpc.local_addr().expect("addr").port();
    let service = kubelet_api::health::v1::health_server::HealthServer::from_arc(Arc::clone(&health));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(grpc)),
    );
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "probed", "namespace": "default", "uid": "uid-probed"},
        "spec": {"containers": [
            {
                "name": "web", "image": "example.com/wasm/sleep:v1",
                "ports": [{"name": "http", "containerPort": http_port}],
                "readinessProbe": every_second(serde_json::json!({"httpGet": {"port": "http", "path": "/ready"}})),
            },
            {
                "name": "tcp", "image": "example.com/wasm/sleep:v1",
                "readinessProbe": every_second(serde_json::json!({"tcpSocket": {"port": tcp_port}})),
            },
            {
                "name": "grpc", "image": "example.com/wasm/sleep:v1",
                "livenessProbe": every_second(serde_json::json!({
                    "grpc": {"port": grpc_port}, "terminationGracePeriodSeconds": 1
                })),
            },
        ]}
    })));
    let all = |p: &Pod| ["web", "tcp", "grpc"].iter().all(|c| container_ready(p, c)) && pod_ready(p);
    node.wait_probe("uid-probed", "every container ready", all).await;
    assert_eq!(http_probes.user_agent.lock().expect("lock").as_deref(), Some(kubelet::pod::probe::USER_AGENT));

    http_probes.answer("/ready", 503);
    node.wait_probe("uid-probed", "web unready", |p| {
        !container_ready(p, "web") && !pod_ready(p) && container_ready(p, "tcp")
    })
    .await;
    http_probes.answer("/ready", 302);
    node.wait_probe("uid-probed", "web ready on a redirect", |p| container_ready(p, "web")).await;

    drop(tcp);
    node.wait_probe("uid-probed", "tcp unready", |p| !container_ready(p, "tcp") && container_ready(p, "web")).await;

    health.0.store(false, std::sync::atomic::Ordering::SeqCst);
    let restarted = node.wait_probe("uid-probed", "grpc restarted", |p| restarts(p, "grpc") >= 1).await;
    health.0.store(true, std::sync::atomic::Ordering::SeqCst);
    let last =
        container_status(&restarted, "grpc").and_then(|c| c.last_state.as_ref()).and_then(|s| s.terminated.clone());
    let message = last.and_then(|t| t.message).unwrap_or_default();
    assert!(
        message.contains("Liveness probe failed: service unhealthy (responded with \"NOT_SERVING\")"),
        "{message:?}"
    );
    assert_eq!(restarts(&restarted, "web"), 0, "readiness never restarts");
}

/// A startup probe holds liveness and readiness: until it passes neither
/// runs (a liveness probe failing meanwhile would restart the container),
/// and the container is neither started nor ready.
#[tokio::test]
async fn a_startup_probe_holds_liveness_and_readiness_until_it_passes() {
    let node = wasm_node(0).await;
    node.import_examples();
    let probes = Arc::new(HttpProbes::default());
    probes.answer("/started", 503);
    probes.answer("/live", 500);
    let port = serve_http(Arc::clone(&probes)).await;
    let get = |path: &str, failure_threshold: i32| serde_json::json!({"httpGet": {"port": port, "path": path}, "periodSeconds": 1, "failureThreshold": failure_threshold});
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "slow", "namespace": "default", "uid": "uid-slow"},
        "spec": {"containers": [{
            "name": "main", "image": "example.com/wasm/sleep:v1",
            "startupProbe": get("/started", 1000),
            "livenessProbe": get("/live", 1),
            "readinessProbe": get("/live", 1),
        }]}
    })));
    let starting = node.wait_probe("uid-slow", "Running", |p| phase(p) == Some("Running")).await;
    let status = container_status(&starting, "main").expect("status");
    assert_eq!((status.started, status.ready), (Some(false), false), "{status:?}");
    // Three startup attempts: liveness would have failed three times.
    let mut requests = probes.requests.subscribe();
    // (The watch's guard is dropped at once: the server's next request
    // needs the lock.)
    let three = tokio::time::timeout(PROBE_DEADLINE, requests.wait_for(|_| probes.hits("/started") >= 3))
        .await
        .is_ok_and(|seen| seen.is_ok());
    assert!(three, "the startup probe never ran three times");
    assert_eq!(probes.hits("/live"), 0, "liveness and readiness wait for startup");
    probes.answer("/live", 200);
    probes.answer("/started", 200);
    let started =
        node.wait_probe("uid-slow", "started and ready", |p| container_ready(p, "main") && pod_ready(p)).await;
    let status = container_status(&started, "main").expect("status");
    assert_eq!((status.started, status.restart_count), (Some(true), 0), "{status:?}");
    assert!(probes.hits("/live") >= 1);
}

/// A sidecar's startup probe holds what comes after it: the app container
/// starts only once the sidecar has started, as upstream.
#[tokio::test]
async fn a_sidecars_startup_probe_holds_the_app_containers() {
    let node = wasm_node(0).await;
    node.import_examples();
    let probes = Arc::new(HttpProbes::default());
    probes.answer("/sidecar", 503);
    let port = serve_http(Arc::clone(&probes)).await;
    node.pods.apply(pod(serde_json::json!({
        "metadata": {"name": "sidecar", "namespace": "default", "uid": "uid-sidecar"},
        "spec": {
            "initContainers": [{
                "name": "proxy", "image": "example.com/wasm/sleep:v1", "restartPolicy": "Always",
                "startupProbe": every_second(serde_json::json!({"httpGet": {"port": port, "path": "/sidecar"}, "failureThreshold": 1000})),
            }],
            "containers": [{"name": "main", "image": "example.com/wasm/sleep:v1"}],
        }
    })));
    // Three startup attempts failed: the app container has not started.
    let mut requests = probes.requests.subscribe();
    let three = tokio::time::timeout(PROBE_DEADLINE, requests.wait_for(|_| probes.hits("/sidecar") >= 3))
        .await
        .is_ok_and(|seen| seen.is_ok());
    assert!(three, "the sidecar's startup probe never ran three times");
    let held = node.pods.store().get("uid-sidecar").expect("pod");
    let main = container_status(&held, "main").and_then(|c| c.state.clone()).unwrap_or_default();
    assert!(main.running.is_none(), "the app container waits for the sidecar: {main:?}");
    probes.answer("/sidecar", 200);
    let running = node
        .wait_probe("uid-sidecar", "app running", |p| {
            container_status(p, "main").and_then(|c| c.state.as_ref()).is_some_and(|s| s.running.is_some())
        })
        .await;
    assert_eq!(restarts(&running, "main"), 0);
}

/// One WebAssembly pod cannot take the node's memory: a module that grows
/// its linear memory 1 MiB at a time without a memory limit is OOMKilled
/// at the default limit (64 MiB here), and one that grows a table without
/// end is too (tables count); a neighbour pod runs on throughout, and
/// what the ended pods held is given back to their budgets.
#[tokio::test]
async fn a_module_growing_without_a_limit_is_oomkilled_alone() {
    let default: u64 = 64 << 20;
    let allocatable = Allocatable { cpu_milli: 4000, memory: 8 << 30, pods: 500 };
    let node = wasm_node_config(0, allocatable, |wasi| wasi.default_memory_limit = default).await;
    node.import_examples();
    let memory = wat::parse_str(
        r#"(module
             (import "wasi_snapshot_preview1" "sched_yield" (func $yield (result i32)))
             (memory (export "memory") 1)
             (func (export "_start")
               (loop $more
                 (if (i32.eq (memory.grow (i32.const 16)) (i32.const -1)) (then unreachable))
                 (drop (call $yield))
                 (br $more))))"#,
    )
    .expect("wat");
    let table = wat::parse_str(
        r#"(module
             (table 1 funcref)
             (func (export "_start")
               (loop $more
                 (if (i32.eq (table.grow (ref.null func) (i32.const 65536)) (i32.const -1)) (then unreachable))
                 (br $more))))"#,
    )
    .expect("wat");
    let layout = node.root.path().join("growers");
    rustlet_wasi::import::write_layout(
        &layout,
        &[("example.com/wasm/grow-memory:v1", &memory), ("example.com/wasm/grow-table:v1", &table)],
    )
    .expect("layout");
    rustlet_wasi::import::import(node.provider.images(), &layout, None).expect("import");
    node.pods.apply(simple_pod("neighbour", "uid-neighbour", "example.com/wasm/sleep:v1", "Always"));
    node.wait_pod("uid-neighbour", "Running", |p| phase(p) == Some("Running")).await;
    for (name, image) in [("memory", "example.com/wasm/grow-memory:v1"), ("table", "example.com/wasm/grow-table:v1")] {
        let uid = format!("uid-grow-{name}");
        node.pods.apply(simple_pod(&format!("grow-{name}"), &uid, image, "Never"));
        let ended = node.wait_pod(&uid, "OOMKilled", |p| phase(p) == Some("Failed")).await;
        let (_, terminated, message) = container_state(&ended);
        assert_eq!(terminated, Some((137, Some("OOMKilled".into()))), "{message:?}");
        let message = message.unwrap_or_default();
        assert!(message.contains(&format!("the limit is {default}")), "{message}");
        let (used, budget) = node.provider.memory_budget(&uid).expect("the pod's budget");
        assert_eq!((used, budget), (0, default), "what the ended instance held is given back");
    }
    let neighbour = node.pods.store().get("uid-neighbour").expect("neighbour");
    assert_eq!(phase(&neighbour), Some("Running"), "the neighbour runs on");
}

/// In-place resize on the WebAssembly provider: a new memory limit in the
/// spec raises the running instance's limit and its pod's memory budget
/// without a restart, and the status reports the new size once done.
#[tokio::test]
async fn a_resize_raises_a_running_modules_memory_limit_and_its_pods_budget() {
    let node = wasm_node(0).await;
    node.import_examples();
    let sized = |memory: &str| {
        pod(serde_json::json!({
            "metadata": {"name": "resizable", "namespace": "default", "uid": "uid-resizable"},
            "spec": {
                "restartPolicy": "Always",
                "containers": [{
                    "name": "main",
                    "image": "example.com/wasm/sleep:v1",
                    "resources": {"requests": {"memory": "8Mi"}, "limits": {"memory": memory}},
                }]
            }
        }))
    };
    node.pods.apply(sized("16Mi"));
    node.wait_pod("uid-resizable", "Running", |p| phase(p) == Some("Running")).await;
    assert_eq!(node.provider.memory_budget("uid-resizable").map(|b| b.1), Some(16 << 20));
    node.pods.apply(sized("48Mi"));
    let limit = |p: &Pod| {
        let status = p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|s| s.first());
        let resources = status.and_then(|s| s.resources.as_ref()).and_then(|r| r.limits.as_ref());
        resources.and_then(|l| l.get("memory")).map(|q| q.0.clone())
    };
    let resized = node
        .wait_pod("uid-resizable", "resized", |p| {
            let conditions = p.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
            limit(p).as_deref() == Some("48Mi") && !conditions.iter().any(|c| c.type_.starts_with("PodResize"))
        })
        .await;
    let status = resized.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|s| s.first()).cloned();
    assert_eq!(status.map(|s| s.restart_count), Some(0), "resized in place");
    assert_eq!(node.provider.memory_budget("uid-resizable").map(|b| b.1), Some(48 << 20), "the pod's budget grew");
}
