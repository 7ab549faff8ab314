//! End-to-end against a real cluster: runs when `RUSTLET_E2E_KUBECONFIG`
//! names a kubeconfig with rights to create pods, CSIDriver objects and
//! delete nodes (an administrator's); otherwise each test prints why it
//! skips and passes. `RUSTLET_E2E_NODE_KUBECONFIG` (default: the same file)
//! is what the node itself uses: a node identity
//! (`system:node:<name>` in `system:nodes`) checks the Node authorizer and
//! NodeRestriction, and then the node's name must be that `<name>`, given
//! in `RUSTLET_E2E_NODE_NAME` (default: `rustlet-e2e-<pid>`).
//!
//! The node runs on this machine: the cluster's scheduler places pods on
//! it; their WebAssembly images are imported into the node's store (pull
//! policy `Never`), so the cluster needs no registry. See docs/cluster.md.
//!
//! `the_e2e_scenario_passes_against_a_real_control_plane` runs it in CI
//! against a real kube-apiserver, kube-scheduler and
//! kube-controller-manager started on this machine (see
//! `rustlet_testkit::control_plane`).
//! `the_e2e_scenario_passes_against_the_fake_api_server` runs the same
//! scenario against the in-process API server, with a stand-in for
//! the scheduler (it binds pods by their `kubernetes.io/hostname` node
//! selector): a check of the scenario's own code, not of a real cluster.
//!
//! Scenario: the node is Ready; a test device plugin's resource appears in
//! allocatable; a pod requesting it is scheduled by the real scheduler,
//! runs and sees the device env; a pod bound with more than the node has
//! fails admission; a CSI inline volume is published; a restart of the node
//! keeps it Ready and the running pod's device; deleting the pod frees the
//! device; the Node is deleted at the end.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::storage::v1::CSIDriver;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::wait::{Condition, await_condition};
use kubelet_api::constants::{DEVICE_PLUGIN_VERSION, DEVICE_PLUGINS_DIR, KUBELET_SOCKET};
use kubelet_api::deviceplugin::v1beta1::DevicePluginOptions;
use rustlet_sample_plugins::csi_driver::{CsiDriverConfig, RegisteredCsiDriver};
use rustlet_sample_plugins::device_plugin::{
    DeviceControl, DevicePluginBehaviour, DeviceSpec, FakeDevicePlugin, register_with_kubelet,
};
use rustlet_sample_plugins::report::Reporter;
use rustlet_testkit::node_process::{NodeProcess, http_get, local_socket};
use serde_json::json;
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

/// Liveness bound for a real cluster (scheduling, watches over a network).
const DEADLINE: Duration = Duration::from_secs(120);
const RESOURCE: &str = "e2e.rustlet.dev/gpu";
const CSI_DRIVER: &str = "e2e.csi.rustlet.dev";

struct Env {
    admin: kube::Client,
    node_kubeconfig: String,
    node_name: String,
}

async fn env() -> Option<Env> {
    let Ok(admin_path) = std::env::var("RUSTLET_E2E_KUBECONFIG") else {
        rustlet_testkit::skip::skip(
            "the end-to-end scenario on the user's cluster",
            rustlet_testkit::skip::Need::Cluster,
            "RUSTLET_E2E_KUBECONFIG is not set (docs/cluster.md)",
        );
        return None;
    };
    let node_kubeconfig = std::env::var("RUSTLET_E2E_NODE_KUBECONFIG").unwrap_or_else(|_| admin_path.clone());
    let node_name =
        std::env::var("RUSTLET_E2E_NODE_NAME").unwrap_or_else(|_| format!("rustlet-e2e-{}", std::process::id()));
    let admin = kubelet::cluster::from_kubeconfig(Path::new(&admin_path)).await.expect("the admin kubeconfig works");
    Some(Env { admin, node_kubeconfig, node_name })
}

fn start_node(env: &Env, root: &Path) -> NodeProcess {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rustlet"));
    command
        .env("RUSTLET_LOG", "info")
        .env_remove("RUSTLET_ROOT_DIR")
        .args([
            "--kubeconfig",
            &env.node_kubeconfig,
            "--node-name",
            &env.node_name,
            "--healthz-port",
            "0",
            "--port",
            "0",
        ])
        .arg("--root-dir")
        .arg(root);
    NodeProcess::start(command)
}

async fn import_example(root: &Path, name: &str) {
    rustlet_testkit::node_process::import_example(
        Path::new(env!("CARGO_BIN_EXE_rustlet")),
        root,
        "example.com/e2e",
        name,
    )
    .await;
}

async fn device_plugin(root: &Path, stop: &CancellationToken) -> DeviceControl {
    let devices: Vec<DeviceSpec> =
        ["dev-0:Healthy:0", "dev-1:Healthy:0"].iter().map(|d| d.parse().expect("device")).collect();
    let options = DevicePluginOptions::default();
    let (plugin, control) =
        FakeDevicePlugin::new(RESOURCE, devices, options, DevicePluginBehaviour::Normal, Reporter::Discard);
    plugin.spawn(&root.join(DEVICE_PLUGINS_DIR).join("e2e.sock"), stop.child_token()).expect("plugin");
    register_with_kubelet(
        &root.join(DEVICE_PLUGINS_DIR).join(KUBELET_SOCKET),
        DEVICE_PLUGIN_VERSION,
        "e2e.sock",
        RESOURCE,
        options,
    )
    .await
    .expect("register");
    control
}

async fn wait<K>(api: &Api<K>, name: &str, what: &str, cond: impl Condition<K>) -> K
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    tokio::time::timeout(DEADLINE, await_condition(api.clone(), name, cond))
        .await
        .unwrap_or_else(|_| panic!("{name}: not {what} within {DEADLINE:?}"))
        .unwrap_or_else(|e| panic!("{name}: watch failed: {e}"))
        .unwrap_or_else(|| panic!("{name}: deleted while waiting for {what}"))
}

fn node_ready(node: Option<&Node>) -> bool {
    node.and_then(|n| n.status.as_ref()?.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn phase(pod: Option<&Pod>) -> Option<String> {
    pod.and_then(|p| p.status.as_ref()?.phase.clone())
}

/// A pod for the node: tolerates the WebAssembly taints, selects the node
/// by host name (the scheduler places it) unless `bind` binds it directly.
fn pod(node: &str, name: &str, image: &str, gpus: u32, bind: bool) -> Pod {
    let mut spec = json!({
        "terminationGracePeriodSeconds": 5,
        "nodeSelector": {"kubernetes.io/hostname": node},
        "tolerations": [{"key": "kubernetes.io/arch", "operator": "Equal", "value": "wasm32-wasi"}],
        "containers": [{
            "name": "main",
            "image": image,
            "imagePullPolicy": "Never",
            "resources": {"limits": {RESOURCE: gpus.to_string()}},
        }],
    });
    if bind {
        spec["nodeName"] = json!(node);
    }
    serde_json::from_value(json!({"metadata": {"name": name, "namespace": "default"}, "spec": spec})).expect("pod")
}

#[tokio::test]
async fn a_real_cluster_runs_pods_on_the_node() {
    let Some(env) = env().await else { return };
    scenario(env).await;
}

/// The scenario on a real control plane started here: etcd,
/// kube-apiserver (Node,RBAC and NodeRestriction, the node's own identity),
/// the real kube-scheduler placing the pods that request the device
/// resource, and kube-controller-manager (its node lifecycle controller
/// lifts the not-ready taint once the node is Ready). Skips with the reason
/// where the Kubernetes binaries are missing (`RUSTLET_KUBE_BIN_DIR`),
/// unless `RUSTLET_REQUIRE_KUBE=1`.
#[tokio::test]
async fn the_e2e_scenario_passes_against_a_real_control_plane() {
    use rustlet_testkit::control_plane::ControlPlane;
    let Some(plane) = ControlPlane::shared("the_e2e_scenario_passes_against_a_real_control_plane") else { return };
    plane.ensure_scheduler().expect("kube-scheduler");
    plane.ensure_controller_manager().expect("kube-controller-manager");
    let identity = plane.node();
    let dir = tempfile::tempdir().expect("tempdir");
    let node_kubeconfig = dir.path().join("node.kubeconfig");
    plane.write_kubeconfig(&node_kubeconfig, &identity.token).expect("kubeconfig");
    let admin = plane.admin_client().await.expect("admin");
    let env = Env { admin, node_kubeconfig: node_kubeconfig.display().to_string(), node_name: identity.name };
    scenario(env).await;
}

#[tokio::test]
async fn the_e2e_scenario_passes_against_the_fake_api_server() {
    use rustlet_testkit::apiserver::ApiServer;
    let server = ApiServer::start().await.expect("api server");
    let dir = tempfile::tempdir().expect("tempdir");
    let node_kubeconfig = dir.path().join("node.kubeconfig");
    server.write_kubeconfig(&node_kubeconfig, &server.node_token("e2e-node")).expect("kubeconfig");
    let admin = server.client(server.admin_token()).await.expect("admin");
    let scheduler = tokio::spawn(schedule(admin.clone(), server.changes()));
    let env = Env { admin, node_kubeconfig: node_kubeconfig.display().to_string(), node_name: "e2e-node".into() };
    scenario(env).await;
    scheduler.abort();
}

/// A stand-in for the scheduler: binds each new unbound pod to the node
/// its `kubernetes.io/hostname` selector names.
async fn schedule(
    admin: kube::Client,
    mut changes: tokio::sync::broadcast::Receiver<rustlet_testkit::apiserver::store::Change>,
) {
    use kube::api::{Patch, PatchParams};
    while let Ok(change) = changes.recv().await {
        let object = &change.object;
        if change.key.plural != "pods" || object.pointer("/spec/nodeName").is_some() {
            continue;
        }
        let Some(node) = object.pointer("/spec/nodeSelector/kubernetes.io~1hostname").and_then(|v| v.as_str()) else {
            continue;
        };
        let name = object.pointer("/metadata/name").and_then(|v| v.as_str()).unwrap_or_default();
        let namespace = object.pointer("/metadata/namespace").and_then(|v| v.as_str()).unwrap_or("default");
        let pods: Api<Pod> = Api::namespaced(admin.clone(), namespace);
        let patch = json!({"spec": {"nodeName": node}});
        let _ = pods.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await;
    }
}

async fn scenario(env: Env) {
    let root = tempfile::tempdir().expect("tempdir");
    import_example(root.path(), "sleep").await;
    import_example(root.path(), "hello").await;
    let nodes: Api<Node> = Api::all(env.admin.clone());
    let pods: Api<Pod> = Api::namespaced(env.admin.clone(), "default");
    let mut node = start_node(&env, root.path());
    node.http_address().await;
    node.line_with("node started").await;
    let plugins = CancellationToken::new();
    let _devices = device_plugin(root.path(), &plugins).await;

    // Ready, with the device resource.
    wait(&nodes, &env.node_name, "Ready", node_ready).await;
    let resource = RESOURCE.to_owned();
    wait(&nodes, &env.node_name, "showing the devices", move |n: Option<&Node>| {
        n.and_then(|n| n.status.as_ref()?.allocatable.as_ref()?.get(&resource).map(|q| q.0 == "2")).unwrap_or(false)
    })
    .await;

    // Scheduled by the real scheduler; runs; sees its device's env.
    let tag = std::process::id();
    let runner = format!("e2e-device-{tag}");
    pods.create(&PostParams::default(), &pod(&env.node_name, &runner, "example.com/e2e/sleep:v1", 1, false))
        .await
        .expect("create");
    let running = wait(&pods, &runner, "Running", |p: Option<&Pod>| phase(p).as_deref() == Some("Running")).await;
    let uid = running.metadata.uid.clone().expect("uid");
    let hello = format!("e2e-hello-{tag}");
    let mut hello_pod = pod(&env.node_name, &hello, "example.com/e2e/hello:v1", 1, false);
    // The module writes into its first volume.
    let spec = hello_pod.spec.as_mut().expect("spec");
    spec.restart_policy = Some("Never".into());
    spec.volumes = Some(vec![serde_json::from_value(json!({"name": "out", "emptyDir": {}})).expect("volume")]);
    spec.containers[0].volume_mounts =
        Some(vec![serde_json::from_value(json!({"name": "out", "mountPath": "/out"})).expect("mount")]);
    pods.create(&PostParams::default(), &hello_pod).await.expect("create");
    wait(&pods, &hello, "Succeeded", |p: Option<&Pod>| phase(p).as_deref() == Some("Succeeded")).await;
    let logs = Command::new(env!("CARGO_BIN_EXE_rustlet"))
        .args(["logs", &hello, "--root-dir"])
        .arg(root.path())
        .output()
        .await
        .expect("logs");
    let logs = String::from_utf8_lossy(&logs.stdout).to_string();
    assert!(logs.contains("FAKE_DEVICES=dev-"), "the module sees its device's env: {logs}");
    pods.delete(&hello, &DeleteParams::default()).await.expect("delete");

    // More than the node has, bound directly: admission fails it.
    let greedy = format!("e2e-greedy-{tag}");
    pods.create(&PostParams::default(), &pod(&env.node_name, &greedy, "example.com/e2e/sleep:v1", 3, true))
        .await
        .expect("create");
    let failed = wait(&pods, &greedy, "Failed", |p: Option<&Pod>| phase(p).as_deref() == Some("Failed")).await;
    let reason = failed.status.and_then(|s| s.reason).unwrap_or_default();
    assert!(reason.starts_with("OutOf") || reason == "UnexpectedAdmissionError", "reason {reason}");
    pods.delete(&greedy, &DeleteParams::default()).await.expect("delete");

    // A CSI inline volume is published.
    let csi_stop = plugins.child_token();
    let config =
        CsiDriverConfig { name: CSI_DRIVER.into(), node_id: env.node_name.clone(), ..CsiDriverConfig::default() };
    RegisteredCsiDriver::new(
        root.path().join("plugins_registry").join("e2e-csi.sock"),
        root.path().join("plugins").join("e2e-csi").join("csi.sock"),
        config,
    )
    .spawn(Reporter::Discard, csi_stop)
    .expect("csi driver");
    let drivers: Api<CSIDriver> = Api::all(env.admin.clone());
    let driver: CSIDriver = serde_json::from_value(json!({
        "metadata": {"name": CSI_DRIVER},
        "spec": {"attachRequired": false, "podInfoOnMount": true, "volumeLifecycleModes": ["Ephemeral"]},
    }))
    .expect("csidriver");
    let _ = drivers.create(&PostParams::default(), &driver).await;
    let inline = format!("e2e-inline-{tag}");
    let mut with_volume = pod(&env.node_name, &inline, "example.com/e2e/sleep:v1", 0, false);
    let spec = with_volume.spec.as_mut().expect("spec");
    spec.containers[0].resources = None;
    spec.volumes =
        Some(vec![serde_json::from_value(json!({"name": "scratch", "csi": {"driver": CSI_DRIVER}})).expect("volume")]);
    spec.containers[0].volume_mounts =
        Some(vec![serde_json::from_value(json!({"name": "scratch", "mountPath": "/scratch"})).expect("mount")]);
    pods.create(&PostParams::default(), &with_volume).await.expect("create");
    wait(&pods, &inline, "Running", |p: Option<&Pod>| phase(p).as_deref() == Some("Running")).await;
    pods.delete(&inline, &DeleteParams::default()).await.expect("delete");

    // A restart keeps the node Ready and the running pod's device.
    let (_, before) = http_get(&local_socket(root.path()), "/status").await;
    drop(node);
    let node = start_node(&env, root.path());
    wait(&nodes, &env.node_name, "Ready after the restart", node_ready).await;
    let still = pods.get(&runner).await.expect("pod");
    assert_eq!(still.metadata.uid.as_deref(), Some(uid.as_str()));
    assert_eq!(phase(Some(&still)).as_deref(), Some("Running"));
    // Its WebAssembly module died with the node: it runs again as a
    // restart, the lost run its last state.
    let restarted = wait(&pods, &runner, "running again as restart 1", |p: Option<&Pod>| {
        p.and_then(|p| p.status.as_ref()?.container_statuses.as_ref()?.first().cloned())
            .is_some_and(|c| c.restart_count == 1 && c.state.as_ref().is_some_and(|s| s.running.is_some()))
    })
    .await;
    let main = &restarted.status.as_ref().and_then(|s| s.container_statuses.clone()).expect("statuses")[0];
    let last = main.last_state.as_ref().and_then(|s| s.terminated.as_ref()).expect("the lost run as last state");
    assert_eq!(last.reason.as_deref(), Some("ContainerStatusUnknown"));
    assert_eq!(phase(Some(&restarted)).as_deref(), Some("Running"));
    let checkpoint = std::fs::read_to_string(root.path().join(DEVICE_PLUGINS_DIR).join("kubelet_internal_checkpoint"))
        .expect("device checkpoint");
    assert!(checkpoint.contains(&uid), "the pod keeps its device across the restart");
    assert!(before.contains(RESOURCE));

    // Deletion frees the device and removes the pod.
    pods.delete(&runner, &DeleteParams::default()).await.expect("delete");
    tokio::time::timeout(DEADLINE, await_condition(pods.clone(), &runner, |p: Option<&Pod>| p.is_none()))
        .await
        .expect("pod deleted in time")
        .expect("watch");
    let checkpoint = std::fs::read_to_string(root.path().join(DEVICE_PLUGINS_DIR).join("kubelet_internal_checkpoint"))
        .expect("device checkpoint");
    assert!(!checkpoint.contains(&uid), "the device is freed");

    drop(node);
    plugins.cancel();
    let _ = drivers.delete(CSI_DRIVER, &DeleteParams::default()).await;
    let _ = nodes.delete(&env.node_name, &DeleteParams::default()).await;
}
