//! A node killed with `kill -9` and started again: the `test-node` binary
//! (a node with the detached host-process provider, standalone or in
//! cluster mode on either API server) as a real process, a real device
//! plugin and a real CSI driver.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kubelet_api::constants::{DEVICE_PLUGIN_VERSION, DEVICE_PLUGINS_DIR, KUBELET_SOCKET};
use kubelet_api::deviceplugin::v1beta1::DevicePluginOptions;
use rustlet_sample_plugins::csi_driver::{CsiDriverConfig, RegisteredCsiDriver};
use rustlet_sample_plugins::device_plugin::{
    DeviceControl, DevicePluginBehaviour, DeviceSpec, FakeDevicePlugin, register_with_kubelet,
};
use rustlet_sample_plugins::report::Reporter;
use rustlet_testkit::process::PluginProcess;
use rustlet_testkit::report::Report;
use rustlet_testkit::test_api::TestApi;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const GPU: &str = "vendor.example.com/gpu";
const DRIVER: &str = "data.csi.example.com";

fn test_node_bin() -> &'static str {
    env!("CARGO_BIN_EXE_test-node")
}

async fn start_test_node(root: &Path) -> PluginProcess {
    let root = root.display().to_string();
    PluginProcess::spawn(test_node_bin(), ["--root", root.as_str()]).await.expect("start test-node")
}

/// Waits for a status report of pod `name` satisfying `pred`.
async fn wait_pod(node: &mut PluginProcess, name: &str, mut pred: impl FnMut(&str, &[String], i32) -> bool) -> Report {
    node.wait_for(SOON, |r| {
        matches!(r, Report::PodStatus { name: n, phase, running, restarts, .. } if n == name && pred(phase, running, *restarts))
    })
    .await
    .unwrap_or_else(|e| panic!("pod {name}: {e}"))
}

async fn gpu_plugin(root: &Path, socket: &str) -> PluginProcess {
    let socket = root.join("device-plugins").join(socket).display().to_string();
    let mut plugin =
        PluginProcess::spawn(device_plugin_bin(), ["--socket", socket.as_str(), "--resource", GPU, "--count", "2"])
            .await
            .expect("start fake-device-plugin");
    plugin
        .wait_for(SOON, |r| matches!(r, Report::DeviceRegistered { error, .. } if error.is_empty()))
        .await
        .expect("registered");
    plugin
}

/// Kills what the test's containers left running, however the test ends.
struct KillContainers(std::path::PathBuf);

impl Drop for KillContainers {
    fn drop(&mut self) {
        rustlet_testkit::host_provider::kill_detached(&self.0);
    }
}

fn starts(out: &Path) -> usize {
    std::fs::read_to_string(out.join("starts")).map(|s| s.lines().count()).unwrap_or(0)
}

#[tokio::test]
async fn a_node_killed_with_running_pods_adopts_them_when_it_comes_back() {
    let root = rustlet_testkit::node_root::tempdir("rustlet-restart-");
    let out = root.path().join("out");
    for dir in ["manifests", "plugins_registry", "device-plugins", "out"] {
        std::fs::create_dir_all(root.path().join(dir)).expect("mkdir");
    }
    let _cleanup = KillContainers(root.path().join("host-provider"));
    let mut node = start_test_node(root.path()).await;
    let _gpus = gpu_plugin(root.path(), "gpu.sock").await;
    let registration = root.path().join("plugins_registry/data-reg.sock").display().to_string();
    let endpoint = root.path().join("csi-data.sock").display().to_string();
    let mut driver =
        csi_driver(&["--registration-socket", &registration, "--endpoint", &endpoint, "--name", DRIVER]).await;
    driver.wait_for(SOON, |r| matches!(r, Report::Notified { registered: true, .. })).await.expect("driver registered");

    let manifest = format!(
        "apiVersion: storage.k8s.io/v1
kind: CSIDriver
metadata: {{name: {DRIVER}}}
spec: {{volumeLifecycleModes: [Ephemeral]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: web}}
spec:
  containers:
  - name: main
    image: busybox
    command: [sh, -c, 'echo \"$FAKE_DEVICES\" >> \"$MOUNT_OUT/starts\"; exec sleep 600']
    resources:
      limits: {{\"{GPU}\": 1}}
    volumeMounts: [{{name: data, mountPath: /data}}, {{name: out, mountPath: /out}}]
  volumes:
  - {{name: data, csi: {{driver: {DRIVER}}}}}
  - {{name: out, hostPath: {{path: {}, type: Directory}}}}
",
        out.display()
    );
    let manifest_path = root.path().join("manifests/web.yaml");
    std::fs::write(&manifest_path, &manifest).expect("write manifest");
    let Report::PodStatus { uid, .. } = wait_pod(&mut node, "web-node-1", |_, running, _| running == ["main"]).await
    else {
        unreachable!()
    };
    driver
        .wait_for(SOON, |r| matches!(r, Report::VolumeCall { rpc, .. } if rpc == "NodePublishVolume"))
        .await
        .expect("published");
    let first_devices = wait_file(&out.join("starts"), |text| !text.is_empty()).await;

    // kill -9: no shutdown of any kind. The container runs on under its shim.
    node.kill().await;
    node.wait_exit(SOON).await.expect("node gone");

    let mut node = start_test_node(root.path()).await;
    // The device plugin re-registers, as real plugins do when kubelet.sock
    // comes back (this one on a new socket, with the same devices).
    let mut gpus = gpu_plugin(root.path(), "gpu-again.sock").await;
    let Report::PodStatus { uid: again, restarts, .. } =
        wait_pod(&mut node, "web-node-1", |_, running, _| running == ["main"]).await
    else {
        unreachable!()
    };
    assert_eq!(again, uid, "same manifest, same UID");
    assert_eq!(restarts, 0, "adopted, not restarted");
    assert_eq!(starts(&out), 1, "the container was not started again");
    assert_eq!(std::fs::read_to_string(out.join("starts")).expect("starts"), first_devices);
    let checkpoint =
        std::fs::read_to_string(root.path().join("device-plugins/kubelet_internal_checkpoint")).expect("checkpoint");
    assert!(checkpoint.contains(&uid), "the allocation survived: {checkpoint}");

    // Killed again, and the manifest removed while the node is down: the
    // next node stops the container, unpublishes the volume, frees the device.
    node.kill().await;
    node.wait_exit(SOON).await.expect("node gone");
    std::fs::remove_file(&manifest_path).expect("remove manifest");
    let node = start_test_node(root.path()).await;
    // Listening is printed once orphans are stopped and the checkpoint is written.
    let checkpoint =
        std::fs::read_to_string(root.path().join("device-plugins/kubelet_internal_checkpoint")).expect("checkpoint");
    assert!(!checkpoint.contains(&uid), "the removed pod's devices are freed: {checkpoint}");
    assert!(!root.path().join("host-provider").join(&uid).exists(), "the container's state is gone");
    driver
        .wait_for(SOON, |r| matches!(r, Report::VolumeCall { rpc, .. } if rpc == "NodeUnpublishVolume"))
        .await
        .expect("the removed pod's volume is unpublished");
    // No Allocate reached the plugin for the adopted pod.
    let allocated = gpus.wait_for(std::time::Duration::from_millis(1), |r| matches!(r, Report::Allocate { .. })).await;
    assert!(allocated.is_err(), "devices were reused, not allocated again: {allocated:?}");
    drop(node);
}

/// `test-node` in cluster mode on `api`.
async fn start_cluster_test_node(root: &Path, api: &TestApi) -> PluginProcess {
    let root = root.display().to_string();
    let kubeconfig = api.node_kubeconfig.display().to_string();
    let args = ["--root", root.as_str(), "--kubeconfig", kubeconfig.as_str(), "--node-name", api.node.as_str()];
    PluginProcess::spawn(test_node_bin(), args).await.expect("start test-node")
}

/// A device plugin in the test process with two devices of [`GPU`],
/// registered on the node's `kubelet.sock`; it serves until `stop`, its
/// device stream as long as the returned control lives.
async fn registered_gpus(root: &Path, socket: &str, stop: &CancellationToken) -> DeviceControl {
    let devices: Vec<DeviceSpec> =
        ["gpu-0:Healthy:0", "gpu-1:Healthy:0"].iter().map(|d| d.parse().expect("device")).collect();
    let options = DevicePluginOptions::default();
    let (plugin, control) =
        FakeDevicePlugin::new(GPU, devices, options, DevicePluginBehaviour::Normal, Reporter::Discard);
    let device_dir = root.join(DEVICE_PLUGINS_DIR);
    plugin.spawn(&device_dir.join(socket), stop.child_token()).expect("device plugin");
    register_with_kubelet(&device_dir.join(KUBELET_SOCKET), DEVICE_PLUGIN_VERSION, socket, GPU, options)
        .await
        .expect("registered");
    control
}

/// Every phase the API showed for pod `name`, as a watch sees them.
fn record_phases(pods: Api<Pod>, name: &str) -> Arc<Mutex<Vec<String>>> {
    use futures_util::StreamExt as _;
    let phases = Arc::new(Mutex::new(Vec::new()));
    let seen = phases.clone();
    let config = kube::runtime::watcher::Config::default().fields(&format!("metadata.name={name}"));
    tokio::spawn(async move {
        let mut events = kube::runtime::watcher(pods, config).boxed();
        while let Some(event) = events.next().await {
            if let Ok(kube::runtime::watcher::Event::Apply(pod) | kube::runtime::watcher::Event::InitApply(pod)) = event
                && let Some(phase) = pod.status.and_then(|s| s.phase)
            {
                seen.lock().expect("lock").push(phase);
            }
        }
    });
    phases
}

fn container_state(pod: &Pod) -> (Option<String>, Option<String>, i32) {
    let status = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|c| c.first());
    let started = status.and_then(|c| c.state.as_ref()?.running.as_ref()?.started_at.as_ref()).map(|t| t.0.to_string());
    (status.and_then(|c| c.container_id.clone()), started, status.map_or(-1, |c| c.restart_count))
}

/// A node in cluster mode killed with `kill -9` while an API pod runs with
/// a device, an inline CSI volume and an emptyDir holding data; its device
/// plugin is down when it comes back (and, the second time, its CSI driver
/// too). The pod stays Running in the API throughout, never Failed: the
/// same container (adopted), its device from the checkpoint, its volume
/// neither unpublished nor published again, its data kept.
async fn a_killed_cluster_node_keeps_its_api_pods_running(api: TestApi) {
    let root = rustlet_testkit::node_root::tempdir("rustlet-restart-");
    for dir in ["plugins_registry", "device-plugins"] {
        std::fs::create_dir_all(root.path().join(dir)).expect("mkdir");
    }
    let _cleanup = KillContainers(root.path().join("host-provider"));
    api.csi_driver_object(DRIVER, json!({"attachRequired": false, "volumeLifecycleModes": ["Ephemeral"]})).await;
    let csi = |stop: &CancellationToken| {
        let config = CsiDriverConfig { name: DRIVER.into(), node_id: "n".into(), ..CsiDriverConfig::default() };
        RegisteredCsiDriver::new(
            root.path().join("plugins_registry/data-reg.sock"),
            root.path().join("csi-data.sock"),
            config,
        )
        .spawn_recorded(Reporter::Discard, stop.child_token())
        .expect("csi driver")
        .0
    };
    let mut node = start_cluster_test_node(root.path(), &api).await;
    let gpus_stop = CancellationToken::new();
    let gpus = registered_gpus(root.path(), "gpu.sock", &gpus_stop).await;
    let csi_stop = CancellationToken::new();
    let calls = csi(&csi_stop);
    // Bound only once the Node shows the devices, as a scheduler would.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(api.admin.clone());
    api.wait_for(&nodes, &api.node, "showing the GPUs", SOON, |n| {
        n.and_then(|n| n.status.as_ref()?.allocatable.as_ref()?.get(GPU)).is_some_and(|q| q.0 == "2")
    })
    .await;

    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    let web: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {
            "nodeName": api.node,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "main",
                "image": "busybox",
                "command": ["sh", "-c", "echo kept > \"$MOUNT_SCRATCH/file\"; exec sleep 600"],
                "resources": {"limits": {GPU: "1"}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"}, {"name": "scratch", "mountPath": "/scratch"}],
            }],
            "volumes": [{"name": "data", "csi": {"driver": DRIVER}}, {"name": "scratch", "emptyDir": {}}],
        },
    }))
    .expect("pod");
    let phases = record_phases(pods.clone(), "web");
    pods.create(&PostParams::default(), &web).await.expect("create");
    let running = |p: Option<&Pod>| {
        p.and_then(|p| p.status.as_ref()?.container_statuses.as_ref()?.first()?.state.as_ref()?.running.as_ref())
            .is_some()
    };
    let first = api.wait_for(&pods, "web", "Running", SOON, running).await.expect("pod");
    let uid = first.metadata.uid.clone().expect("uid");
    let before = container_state(&first);
    let pod_dir = root.path().join("pods").join(&uid).join("volumes");
    let kept = wait_file(&pod_dir.join("kubernetes.io~empty-dir/scratch/file"), |t| !t.is_empty()).await;
    let published = pod_dir.join("kubernetes.io~csi/data/mount");
    assert!(published.read_dir().expect("published dir").next().is_some(), "the driver published into it");
    let volume_calls = calls.all().len();

    drop(gpus);
    for round in ["device plugin down", "device plugin and CSI driver down"] {
        gpus_stop.cancel();
        if round.contains("CSI") {
            csi_stop.cancel();
        }
        node.kill().await;
        node.wait_exit(SOON).await.expect("node gone");
        node = start_cluster_test_node(root.path(), &api).await;
        let Report::PodStatus { restarts, .. } = wait_pod(&mut node, "web", |_, running, _| running == ["main"]).await
        else {
            unreachable!()
        };
        assert_eq!(restarts, 0, "{round}: adopted, not restarted");
        // The API agrees: the same container, never restarted.
        let now = api
            .wait_for(&pods, "web", "Running", SOON, |p| running(p) && p.is_some_and(|p| container_state(p) == before))
            .await
            .expect("pod");
        assert_eq!(now.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Running"), "{round}");
        let checkpoint = std::fs::read_to_string(root.path().join("device-plugins/kubelet_internal_checkpoint"))
            .expect("checkpoint");
        assert!(checkpoint.contains(&uid), "{round}: the pod keeps its device: {checkpoint}");
        assert_eq!(
            std::fs::read_to_string(pod_dir.join("kubernetes.io~empty-dir/scratch/file")).ok(),
            Some(kept.clone())
        );
        assert!(published.read_dir().expect("published dir").next().is_some(), "{round}: the volume's data stays");
        assert_eq!(calls.all().len(), volume_calls, "{round}: no NodeUnpublish/NodePublish: {:?}", calls.all());
    }
    let seen = phases.lock().expect("lock").clone();
    assert!(!seen.iter().any(|p| p == "Failed"), "never Failed in the API: {seen:?}");

    // The plugins come back; the pod is deleted: released for good.
    let gpus_stop = CancellationToken::new();
    let _gpus = registered_gpus(root.path(), "gpu-again.sock", &gpus_stop).await;
    let csi_stop = CancellationToken::new();
    let calls = csi(&csi_stop);
    pods.delete("web", &DeleteParams::default()).await.expect("delete");
    api.wait_for(&pods, "web", "gone", SOON, |p| p.is_none()).await;
    assert!(calls.all().iter().any(|c| c.rpc == "NodeUnpublishVolume"), "{:?}", calls.all());
    drop(node);
    gpus_stop.cancel();
    csi_stop.cancel();
}
rustlet_testkit::on_both_api_servers!(
    a_killed_cluster_node_keeps_its_api_pods_running_on,
    a_killed_cluster_node_keeps_its_api_pods_running
);

/// An in-place resize across a `kill -9` of the node: what the node had
/// allocated (checkpointed in the pod's directory) is what it runs the
/// adopted container with when it comes back, and a resize it had found
/// infeasible is judged again, still infeasible: the spec's size is never
/// taken on by the restart alone. On a control plane older than 1.33 the
/// `resize` subresource is refused.
async fn an_allocated_resize_survives_a_kill_9_and_an_infeasible_one_stays_pending(api: TestApi) {
    use kube::api::{Patch, PatchParams};
    let root = rustlet_testkit::node_root::tempdir("rustlet-restart-");
    let _cleanup = KillContainers(root.path().join("host-provider"));
    let mut node = start_cluster_test_node(root.path(), &api).await;
    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    let sized = |cpu_request: &str, cpu_limit: &str| json!({"requests": {"cpu": cpu_request, "memory": "32Mi"}, "limits": {"cpu": cpu_limit, "memory": "64Mi"}});
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "sized", "namespace": "default"},
        "spec": {
            "nodeName": api.node,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"],
                            "resources": sized("100m", "200m")}],
        },
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod).await.expect("create");
    let limit = |p: &Pod| {
        let status = p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|c| c.first());
        status.and_then(|c| c.resources.as_ref()?.limits.as_ref()?.get("cpu")).map(|q| q.0.clone()).unwrap_or_default()
    };
    let pending = |p: &Pod| {
        let conditions = p.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
        conditions.into_iter().find(|c| c.type_ == "PodResizePending").map(|c| (c.reason, c.message))
    };
    let first = api.wait_for(&pods, "sized", "Running", SOON, |p| p.is_some_and(|p| limit(p) == "200m")).await;
    let first = first.expect("pod");
    let resize = |cpu_request: &'static str, cpu_limit: &'static str| {
        let pods = pods.clone();
        async move {
            let patch = json!({"spec": {"containers": [{"name": "main", "resources": sized(cpu_request, cpu_limit)}]}});
            pods.patch_subresource("resize", "sized", &PatchParams::default(), &Patch::Strategic(patch)).await
        }
    };
    if api.control_plane().is_some_and(|plane| plane.minor_version() < 33) {
        let refused = resize("300m", "400m").await;
        assert!(matches!(refused, Err(kube::Error::Api(ref e)) if e.code == 404), "{refused:?}");
        return;
    }
    let uid = first.metadata.uid.clone().expect("uid");
    resize("300m", "400m").await.expect("resize");
    let resized = api
        .wait_for(&pods, "sized", "resized", SOON, |p| p.is_some_and(|p| limit(p) == "400m" && pending(p).is_none()))
        .await
        .expect("pod");
    let before = container_state(&resized);
    let checkpoint = root.path().join("pods").join(&uid).join("allocated_resources.json");
    let recorded = std::fs::read_to_string(&checkpoint).expect("the allocation is checkpointed");
    assert!(recorded.contains("400m"), "{recorded}");
    // More than the node has: infeasible, the allocation unchanged.
    resize("8", "8").await.expect("resize");
    let infeasible = |p: &Pod| pending(p).is_some_and(|(reason, _)| reason.as_deref() == Some("Infeasible"));
    api.wait_for(&pods, "sized", "infeasible", SOON, |p| p.is_some_and(infeasible)).await.expect("pod");

    node.kill().await;
    node.wait_exit(SOON).await.expect("node gone");
    let _node = start_cluster_test_node(root.path(), &api).await;
    // Adopted (the same container, no restart) at its allocated size, the
    // spec's size judged again.
    let back = api
        .wait_for(&pods, "sized", "adopted, still infeasible", SOON, |p| {
            p.is_some_and(|p| container_state(p) == before && limit(p) == "400m" && infeasible(p))
        })
        .await
        .expect("pod");
    let (_, message) = pending(&back).expect("pending");
    assert_eq!(message.as_deref(), Some("Node didn't have enough capacity: cpu, requested: 8000, capacity: 4000"));
}
rustlet_testkit::on_both_api_servers!(
    an_allocated_resize_survives_a_kill_9_and_an_infeasible_one_stays_pending_on,
    an_allocated_resize_survives_a_kill_9_and_an_infeasible_one_stays_pending
);
