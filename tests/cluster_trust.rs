//! Cluster semantics a real cluster can trust, each test run against the
//! real kube-apiserver (NodeRestriction, a node identity) and the in-process
//! one: a whole node (`NodeBuilder` in cluster mode, the host-process
//! provider, a real device plugin and CSI driver on their sockets) runs pods
//! the API binds to it.
//!
//! - the status manager: conditions other writers own survive the node's
//!   writes, Ready waits for readiness gates, transition times hold, a
//!   cleared message leaves the API;
//! - finished pods free their admission slot and devices at once, and are
//!   not run again by a restarted node;
//! - `deletionGracePeriodSeconds` is the grace period, and a shorter one
//!   (or a forced deletion) cuts a stop short;
//! - a provider that panics releases everything the pod held;
//! - a CSI volume whose NodeUnpublishVolume fails keeps its pod in the API
//!   until the retry succeeds.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Pod, PodCondition};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kubelet::cluster::{ApiSource, ClusterSettings};
use kubelet::node::{Node, NodeBuilder, NodeConfig};
use kubelet::pod::{Allocatable, BackoffConfig};
use kubelet::provider::{
    ContainerExit, ContainerId, ContainerLaunch, PreparedImage, Provider, ProviderError, RunningContainer,
};
use rustlet_sample_plugins::csi_driver::{CsiDriverConfig, RegisteredCsiDriver, VolumeCallBehaviour, VolumeCalls};
use rustlet_sample_plugins::report::Reporter;
use rustlet_testkit::host_provider::HostProcessProvider;
use rustlet_testkit::process::PluginProcess;
use rustlet_testkit::test_api::TestApi;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// A liveness bound for what takes a second or two (a real API server
/// on a loaded 2-core machine included).
const DEADLINE: Duration = Duration::from_secs(60);
const GPU: &str = "trust.example.com/gpu";
const DRIVER: &str = "trust.csi.example.com";

/// A node in cluster mode on `api`, with the host-process provider.
struct ClusterNode {
    node: Node,
    /// Stops the node when the test ends, however it ends.
    stop: tokio_util::sync::DropGuard,
    root: PathBuf,
    _dir: tempfile::TempDir,
    _plugins: Vec<PluginProcess>,
}

async fn start_node(
    api: &TestApi,
    root: &Path,
    max_pods: usize,
    provider: Arc<dyn Provider>,
) -> (Node, CancellationToken) {
    let mut config = NodeConfig::new(root, api.node.clone());
    config.http_address = None;
    config.pods.max_pods = max_pods;
    config.pods.allocatable = Some(Allocatable { cpu_milli: 4000, memory: 8 << 30, pods: max_pods });
    config.pods.restart_backoff = BackoffConfig {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(400),
        reset_after: Duration::from_secs(600),
    };
    config.plugins.initial_backoff = Duration::from_millis(50);
    config.plugins.max_backoff = Duration::from_millis(500);
    let mut settings = ClusterSettings::new(ApiSource::Client(api.node_client.clone()));
    settings.pod_sync.retry_initial = Duration::from_millis(50);
    settings.pod_sync.retry_max = Duration::from_millis(500);
    let shutdown = CancellationToken::new();
    let node =
        NodeBuilder::new(config).provider(provider).cluster(settings).start(shutdown.clone()).await.expect("node");
    (node, shutdown)
}

impl ClusterNode {
    async fn start(api: &TestApi, max_pods: usize) -> ClusterNode {
        Self::start_with(api, max_pods, Arc::new(HostProcessProvider::new())).await
    }

    async fn start_with(api: &TestApi, max_pods: usize, provider: Arc<dyn Provider>) -> ClusterNode {
        let dir = rustlet_testkit::node_root::tempdir("rustlet-trust-");
        let root = dir.path().to_owned();
        let (node, shutdown) = start_node(api, &root, max_pods, provider).await;
        ClusterNode { node, stop: shutdown.drop_guard(), root, _dir: dir, _plugins: Vec::new() }
    }

    /// A real device plugin with two devices of [`GPU`].
    async fn with_gpus(mut self) -> ClusterNode {
        let plugin = common::gpu_plugin(self.node.devices(), &self.root.join("device-plugins"), GPU, 2).await;
        self._plugins.push(plugin);
        self
    }

    fn pods(&self) -> Vec<Pod> {
        self.node.pods().store().list()
    }

    fn devices_of(&self, uid: &str) -> usize {
        self.node.devices().allocated(uid, "main").values().map(Vec::len).sum()
    }
}

/// A pod bound to `node` running `script` (the host provider runs it with
/// `sh -c`); `extra` is merged into its spec.
fn pod(name: &str, node: &str, script: &str, extra: serde_json::Value) -> Pod {
    let mut spec = json!({
        "automountServiceAccountToken": false,
        "terminationGracePeriodSeconds": 5,
        "containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", script]}],
    });
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        spec.extend(extra.clone());
    }
    // Each volume mounted (the node sets up no volume a container does not use).
    let mounts: Vec<serde_json::Value> = spec["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| json!({"name": v["name"], "mountPath": format!("/mnt/{}", v["name"].as_str().unwrap_or_default())}))
        .collect();
    if !mounts.is_empty() && spec["containers"][0].get("volumeMounts").is_none() {
        spec["containers"][0]["volumeMounts"] = json!(mounts);
    }
    rustlet_testkit::pod_state::bound_pod(name, node, spec)
}

fn with_gpus(mut pod: Pod, count: u32) -> Pod {
    let container = &mut pod.spec.as_mut().expect("spec").containers[0];
    container.resources = Some(serde_json::from_value(json!({"limits": {GPU: count.to_string()}})).expect("resources"));
    pod
}

fn phase(pod: Option<&Pod>) -> Option<&str> {
    pod?.status.as_ref()?.phase.as_deref()
}

fn condition<'a>(pod: &'a Pod, kind: &str) -> Option<&'a PodCondition> {
    pod.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == kind)
}

fn running(pod: Option<&Pod>) -> bool {
    phase(pod) == Some("Running")
        && pod
            .and_then(|p| p.status.as_ref()?.container_statuses.as_ref()?.first()?.state.as_ref()?.running.as_ref())
            .is_some()
}

fn pods_api(api: &TestApi) -> Api<Pod> {
    Api::namespaced(api.admin.clone(), "default")
}

/// Adds (or changes) a condition as another controller would: a strategic
/// merge patch of the status, merged by type.
async fn set_condition(pods: &Api<Pod>, name: &str, kind: &str, status: &str) {
    let patch = json!({"status": {"conditions": [{"type": kind, "status": status, "reason": "ByTheTest"}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch)).await.expect("condition patched");
}

// ---------------------------------------------------------------------------

async fn others_conditions_survive_and_ready_waits_for_gates(api: TestApi) {
    let node = ClusterNode::start(&api, 110).await;
    let pods = pods_api(&api);
    // Its host path is missing at first: the pod waits with a message,
    // which must leave the API once the volume is ready.
    let host_dir = node.root.join("later");
    let spec = json!({
        "readinessGates": [{"conditionType": "example.com/gate"}],
        "volumes": [{"name": "data", "hostPath": {"path": host_dir.display().to_string(), "type": "Directory"}}],
    });
    pods.create(&PostParams::default(), &pod("gated", &api.node, "exec sleep 600", spec)).await.expect("create");
    let waiting = api
        .wait_for(&pods, "gated", "showing why its volume waits", DEADLINE, |p| {
            p.and_then(|p| p.status.as_ref()?.message.as_deref()).is_some_and(|m| m.contains("volumes not ready"))
        })
        .await
        .expect("pod");
    assert_eq!(phase(Some(&waiting)), Some("Pending"));
    std::fs::create_dir_all(&host_dir).expect("mkdir");

    // Running, but not Ready: its gate's condition does not exist.
    let gated = api.wait_for(&pods, "gated", "Running", DEADLINE, running).await.expect("pod");
    let status = gated.status.as_ref().expect("status");
    assert_eq!(status.message, None, "the cleared message left the API: {status:?}");
    let ready = condition(&gated, "Ready").expect("Ready");
    assert_eq!(ready.status, "False", "{ready:?}");
    assert_eq!(ready.reason.as_deref(), Some("ReadinessGatesNotReady"));
    assert_eq!(
        ready.message.as_deref(),
        Some("corresponding condition of pod readiness gate \"example.com/gate\" does not exist.")
    );
    assert_eq!(condition(&gated, "ContainersReady").map(|c| c.status.as_str()), Some("True"));
    let initialized_at = condition(&gated, "Initialized").and_then(|c| c.last_transition_time.clone());

    // Another controller adds DisruptionTarget, then the gate's condition:
    // the node's writes keep both, and Ready follows the gate.
    set_condition(&pods, "gated", "DisruptionTarget", "False").await;
    set_condition(&pods, "gated", "example.com/gate", "True").await;
    let ready = api
        .wait_for(&pods, "gated", "Ready once its gate is True", DEADLINE, |p| {
            p.and_then(|p| condition(p, "Ready")).is_some_and(|c| c.status == "True")
        })
        .await
        .expect("pod");
    assert_eq!(condition(&ready, "example.com/gate").map(|c| c.status.as_str()), Some("True"));
    let ready_condition = condition(&ready, "Ready").expect("Ready");
    assert_eq!(
        (ready_condition.reason.as_deref(), ready_condition.message.as_deref()),
        (None, None),
        "a True Ready keeps no stale reason"
    );
    assert_eq!(condition(&ready, "DisruptionTarget").map(|c| c.status.as_str()), Some("False"));
    assert_eq!(
        condition(&ready, "Initialized").and_then(|c| c.last_transition_time.clone()),
        initialized_at,
        "an unchanged condition keeps its transition time"
    );
    // The gate goes False again: Ready follows, the others stay.
    set_condition(&pods, "gated", "example.com/gate", "False").await;
    let unready = api
        .wait_for(&pods, "gated", "not Ready once its gate is False", DEADLINE, |p| {
            p.and_then(|p| condition(p, "Ready")).is_some_and(|c| c.status == "False")
        })
        .await
        .expect("pod");
    assert_eq!(
        condition(&unready, "Ready").and_then(|c| c.message.as_deref()),
        Some("the status of pod readiness gate \"example.com/gate\" is not \"True\", but False")
    );
    assert!(condition(&unready, "DisruptionTarget").is_some());
    drop(node);
}
rustlet_testkit::on_both_api_servers!(
    others_conditions_survive_and_ready_waits_for_gates_on,
    others_conditions_survive_and_ready_waits_for_gates
);

// ---------------------------------------------------------------------------

async fn finished_pods_free_their_slot_and_devices(api: TestApi) {
    // The kubelet's default --max-pods, every slot taken by a finished pod.
    const MAX_PODS: usize = 110;
    let node = ClusterNode::start(&api, MAX_PODS).await.with_gpus().await;
    let pods = pods_api(&api);
    let runs = node.root.join("runs");
    std::fs::create_dir_all(&runs).expect("mkdir");
    {
        use futures_util::StreamExt as _;
        let created: Vec<Result<Pod, kube::Error>> = futures_util::stream::iter(0..MAX_PODS)
            .map(|i| {
                let name = format!("job-{i}");
                let record = format!("echo run >> {}/{name}", runs.display());
                let job = pod(&name, &api.node, &record, json!({"restartPolicy": "Never"}));
                // Two of them each hold a device while they run.
                let job = if i < 2 { with_gpus(job, 1) } else { job };
                let pods = pods.clone();
                async move { pods.create(&PostParams::default(), &job).await }
            })
            .buffer_unordered(16)
            .collect()
            .await;
        for result in created {
            result.expect("create");
        }
    }
    node.node
        .pods()
        .store()
        .wait_for(DEADLINE * 3, |all| {
            all.len() == MAX_PODS
                && all.values().all(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded"))
        })
        .await
        .expect("every job Succeeded");
    for i in 0..MAX_PODS {
        let name = format!("job-{i}");
        api.wait_for(&pods, &name, "Succeeded in the API", DEADLINE, |p| phase(p) == Some("Succeeded")).await;
    }
    for job in node.pods() {
        assert_eq!(node.devices_of(job.metadata.uid.as_deref().expect("uid")), 0, "a finished pod's device is free");
    }
    // A pod that needs both devices, on a node whose every slot held a
    // finished pod: admitted, runs.
    let big = with_gpus(pod("big", &api.node, "exec sleep 600", json!({})), 2);
    pods.create(&PostParams::default(), &big).await.expect("create");
    let big = api.wait_for(&pods, "big", "Running", DEADLINE, running).await.expect("pod");
    assert_eq!(node.devices_of(big.metadata.uid.as_deref().expect("uid")), 2);
    let finished =
        node.pods().iter().filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded")).count();
    assert_eq!(finished, MAX_PODS, "the finished pods keep their status on the node");

    // The node restarts (same root, same API): the finished pods are not
    // run again; the running one keeps its devices.
    let ClusterNode { node: old, stop, root, _dir, _plugins } = node;
    drop(stop);
    old.stopped().await;
    let (again, shutdown) = start_node(&api, &root, MAX_PODS, Arc::new(HostProcessProvider::new())).await;
    let restarted = ClusterNode { node: again, stop: shutdown.drop_guard(), root, _dir, _plugins };
    restarted
        .node
        .pods()
        .store()
        .wait_for(DEADLINE, |pods| pods.len() == MAX_PODS + 1)
        .await
        .expect("every API pod known again");
    api.wait_for(&pods, "big", "Running after the restart", DEADLINE, running).await;
    for i in 0..MAX_PODS {
        let name = format!("job-{i}");
        let job = pods.get(&name).await.expect("pod");
        assert_eq!(phase(Some(&job)), Some("Succeeded"), "{name} stays Succeeded");
        let count = std::fs::read_to_string(runs.join(&name)).expect("run record").lines().count();
        assert_eq!(count, 1, "{name} ran once, not again after the restart");
    }
    // Deleted by the API, finished pods go.
    pods.delete("job-0", &DeleteParams::default()).await.expect("delete");
    api.wait_for(&pods, "job-0", "gone", DEADLINE, |p| p.is_none()).await;
}
rustlet_testkit::on_both_api_servers!(
    finished_pods_free_their_slot_and_devices_on,
    finished_pods_free_their_slot_and_devices
);

// ---------------------------------------------------------------------------

/// A container that ignores SIGTERM: only the grace period's end stops it.
const STUBBORN: &str = "trap '' TERM; exec sleep 600";

async fn the_deletion_grace_period_is_the_grace_period(api: TestApi) {
    let node = ClusterNode::start(&api, 110).await;
    let pods = pods_api(&api);
    for name in ["short", "forced"] {
        let stubborn = pod(name, &api.node, STUBBORN, json!({"terminationGracePeriodSeconds": 600}));
        pods.create(&PostParams::default(), &stubborn).await.expect("create");
        api.wait_for(&pods, name, "Running", DEADLINE, running).await;
    }
    // `kubectl delete --grace-period=1`: gone long before the spec's 600 s.
    let started = std::time::Instant::now();
    pods.delete("short", &DeleteParams { grace_period_seconds: Some(1), ..DeleteParams::default() })
        .await
        .expect("delete");
    api.wait_for(&pods, "short", "gone", DEADLINE, |p| p.is_none()).await;
    assert!(started.elapsed() < Duration::from_secs(600));

    // A deletion with the spec's 600 s under way, then `--force
    // --grace-period=0`: the stop is cut short, the pod goes.
    pods.delete("forced", &DeleteParams::default()).await.expect("delete");
    api.wait_for(&pods, "forced", "terminating", DEADLINE, |p| {
        p.is_some_and(|p| p.metadata.deletion_timestamp.is_some())
    })
    .await;
    let uid = node
        .pods()
        .into_iter()
        .find(|p| p.metadata.name.as_deref() == Some("forced"))
        .and_then(|p| p.metadata.uid)
        .expect("the node has it");
    pods.delete("forced", &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() })
        .await
        .expect("force delete");
    node.node
        .pods()
        .store()
        .wait_for(DEADLINE, |pods| !pods.contains_key(&uid))
        .await
        .expect("the node released the forced pod without waiting out its 600 s");
}
rustlet_testkit::on_both_api_servers!(
    the_deletion_grace_period_is_the_grace_period_on,
    the_deletion_grace_period_is_the_grace_period
);

// ---------------------------------------------------------------------------

/// Runs containers with the host provider, but panics when asked to start
/// one named `boom`.
struct PanickingProvider(HostProcessProvider);

#[async_trait]
impl Provider for PanickingProvider {
    async fn prepare_image(
        &self,
        pod: &Pod,
        container: &k8s_openapi::api::core::v1::Container,
    ) -> Result<PreparedImage, ProviderError> {
        self.0.prepare_image(pod, container).await
    }

    async fn start_container(&self, launch: &ContainerLaunch) -> Result<ContainerId, ProviderError> {
        if launch.container.name == "boom" {
            panic!("the provider broke while starting {}", launch.container.name);
        }
        self.0.start_container(launch).await
    }

    async fn wait_container(&self, id: &ContainerId) -> Result<ContainerExit, ProviderError> {
        self.0.wait_container(id).await
    }

    async fn stop_container(&self, id: &ContainerId, grace: Duration) -> Result<(), ProviderError> {
        self.0.stop_container(id, grace).await
    }

    async fn running_containers(&self) -> Result<Vec<RunningContainer>, ProviderError> {
        self.0.running_containers().await
    }
}

async fn a_provider_panic_releases_everything_the_pod_held(api: TestApi) {
    let node = ClusterNode::start_with(&api, 1, Arc::new(PanickingProvider(HostProcessProvider::new())))
        .await
        .with_gpus()
        .await;
    let pods = pods_api(&api);
    let mut broken = with_gpus(
        pod("broken", &api.node, "exec sleep 600", json!({"volumes": [{"name": "scratch", "emptyDir": {}}]})),
        2,
    );
    let spec = broken.spec.as_mut().expect("spec");
    spec.containers[0].volume_mounts =
        Some(vec![serde_json::from_value(json!({"name": "scratch", "mountPath": "/scratch"})).expect("mount")]);
    // A sidecar-free pod with two containers: `main` starts, `boom` panics.
    let mut boom = spec.containers[0].clone();
    boom.name = "boom".into();
    boom.resources = None;
    spec.containers.push(boom);
    let created = pods.create(&PostParams::default(), &broken).await.expect("create");
    let uid = created.metadata.uid.clone().expect("uid");
    let failed = api.wait_for(&pods, "broken", "Failed", DEADLINE, |p| phase(p) == Some("Failed")).await.expect("pod");
    let status = failed.status.as_ref().expect("status");
    assert_eq!(status.reason.as_deref(), Some("PodLifecycleError"), "{status:?}");
    let message = status.message.as_deref().unwrap_or_default();
    assert!(message.contains("the provider broke while starting boom"), "{message}");
    // Its devices are free, its volumes gone, its container stopped, and
    // its slot (the node takes one pod) free for the next pod.
    assert_eq!(node.devices_of(&uid), 0);
    assert!(!node.root.join("pods").join(&uid).exists(), "its volumes were torn down");
    let next = with_gpus(pod("next", &api.node, "exec sleep 600", json!({})), 2);
    pods.create(&PostParams::default(), &next).await.expect("create");
    api.wait_for(&pods, "next", "Running", DEADLINE, running).await;
}
rustlet_testkit::on_both_api_servers!(
    a_provider_panic_releases_everything_the_pod_held_on,
    a_provider_panic_releases_everything_the_pod_held
);

// ---------------------------------------------------------------------------

/// A CSI driver registered on the node's `plugins_registry`.
fn csi_driver(root: &Path, behaviour: Option<(&str, VolumeCallBehaviour)>, stop: &CancellationToken) -> VolumeCalls {
    let mut config =
        CsiDriverConfig { name: DRIVER.into(), node_id: "trust-node".into(), ..CsiDriverConfig::default() };
    if let Some((rpc, behaviour)) = behaviour {
        config.volume_calls.insert(rpc.to_owned(), behaviour);
    }
    let (calls, _) = RegisteredCsiDriver::new(
        root.join("plugins_registry").join("trust-csi.sock"),
        root.join("plugins").join("trust-csi").join("csi.sock"),
        config,
    )
    .spawn_recorded(Reporter::Discard, stop.child_token())
    .expect("csi driver");
    calls
}

async fn inline_csi_driver_object(api: &TestApi) {
    let spec = json!({"attachRequired": false, "podInfoOnMount": true, "volumeLifecycleModes": ["Ephemeral"]});
    api.csi_driver_object(DRIVER, spec).await;
}

async fn a_pod_stays_in_the_api_until_its_volume_is_unpublished(api: TestApi) {
    inline_csi_driver_object(&api).await;
    let node = ClusterNode::start(&api, 110).await;
    let stop = CancellationToken::new();
    let fail_twice = ("NodeUnpublishVolume", VolumeCallBehaviour::FailTimes(tonic::Code::Internal, 2));
    let calls = csi_driver(&node.root, Some(fail_twice), &stop);
    let pods = pods_api(&api);
    let mut with_volume = pod(
        "published",
        &api.node,
        "exec sleep 600",
        json!({"volumes": [{"name": "data", "csi": {"driver": DRIVER}}]}),
    );
    with_volume.spec.as_mut().expect("spec").containers[0].volume_mounts =
        Some(vec![serde_json::from_value(json!({"name": "data", "mountPath": "/data"})).expect("mount")]);
    pods.create(&PostParams::default(), &with_volume).await.expect("create");
    api.wait_for(&pods, "published", "Running", DEADLINE, running).await;
    pods.delete("published", &DeleteParams::default()).await.expect("delete");
    // Two NodeUnpublishVolume calls fail, the third succeeds: the pod
    // leaves the API only after it (the count is read as soon as the pod
    // is gone).
    api.wait_for(&pods, "published", "gone", DEADLINE, |p| p.is_none()).await;
    let unpublishes = calls.all().iter().filter(|c| c.rpc == "NodeUnpublishVolume").count();
    assert_eq!(unpublishes, 3, "two failures, then the retry that succeeded, all before the pod left the API");
    stop.cancel();
}
rustlet_testkit::on_both_api_servers!(
    a_pod_stays_in_the_api_until_its_volume_is_unpublished_on,
    a_pod_stays_in_the_api_until_its_volume_is_unpublished
);

// ---------------------------------------------------------------------------

/// Claim `claim` (in `default`) bound to a new CSI PersistentVolume `pv` of
/// `driver` with `handle`, as the PV controller would leave them (the PV's
/// `claimRef` is what relates it to the node for the Node authorizer).
async fn bound_claim(api: &TestApi, claim: &str, pv: &str, driver: &str, handle: &str) {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    let volume: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": pv},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "claimRef": {"namespace": "default", "name": claim},
            "csi": {"driver": driver, "volumeHandle": handle},
        },
    }))
    .expect("pv");
    Api::<PersistentVolume>::all(api.admin.clone()).create(&PostParams::default(), &volume).await.expect("pv");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(api.admin.clone(), "default");
    let object: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": claim, "namespace": "default"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "",
            "volumeName": pv,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }))
    .expect("pvc");
    claims.create(&PostParams::default(), &object).await.expect("pvc");
    let bound = json!({"status": {"phase": "Bound"}});
    claims.patch_status(claim, &PatchParams::default(), &Patch::Merge(&bound)).await.expect("bound");
}

const ATTACHED_DRIVER: &str = "attach.csi.example.com";

async fn a_volume_that_needs_attaching_waits_for_its_volume_attachment(api: TestApi) {
    use k8s_openapi::api::storage::v1::VolumeAttachment;
    api.csi_driver_object(ATTACHED_DRIVER, json!({"attachRequired": true, "volumeLifecycleModes": ["Persistent"]}))
        .await;
    let node = ClusterNode::start(&api, 110).await;
    let stop = CancellationToken::new();
    let config =
        CsiDriverConfig { name: ATTACHED_DRIVER.into(), node_id: api.node.clone(), ..CsiDriverConfig::default() };
    let (calls, _) = RegisteredCsiDriver::new(
        node.root.join("plugins_registry").join("attach-csi.sock"),
        node.root.join("plugins").join("attach-csi").join("csi.sock"),
        config,
    )
    .spawn_recorded(Reporter::Discard, stop.child_token())
    .expect("csi driver");

    // A claim bound to a CSI volume of that driver.
    let pv_name = format!("pv-attach-{}", api.node);
    let handle = format!("vol-{}", api.node);
    bound_claim(&api, "attached", &pv_name, ATTACHED_DRIVER, &handle).await;

    let pods = pods_api(&api);
    let mut with_claim = pod(
        "attached",
        &api.node,
        "exec sleep 600",
        json!({"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "attached"}}]}),
    );
    with_claim.spec.as_mut().expect("spec").containers[0].volume_mounts =
        Some(vec![serde_json::from_value(json!({"name": "data", "mountPath": "/data"})).expect("mount")]);
    pods.create(&PostParams::default(), &with_claim).await.expect("create");
    let attachment_name = kubelet::cluster::volumes::attachment_name(&handle, ATTACHED_DRIVER, &api.node);
    let unique = format!("kubernetes.io/csi/{ATTACHED_DRIVER}^{handle}");
    // Nothing attached: the pod waits for the attach/detach controller's
    // word on the Node, as the kubelet does.
    let waiting = api
        .wait_for(&pods, "attached", "waiting for the Node's volumesAttached", DEADLINE, |p| {
            p.and_then(|p| p.status.as_ref()?.message.as_deref())
                .is_some_and(|m| m.contains(&format!("volume {unique} not attached according to node status")))
        })
        .await
        .expect("pod");
    assert_eq!(phase(Some(&waiting)), Some("Pending"));
    // The controller lists it on the Node; no VolumeAttachment yet: the
    // pod waits, saying for which.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(api.admin.clone());
    let listed = json!({"status": {"volumesAttached": [{"name": unique, "devicePath": ""}]}});
    nodes.patch_status(&api.node, &PatchParams::default(), &Patch::Merge(&listed)).await.expect("volumesAttached");
    api.wait_for(&pods, "attached", "waiting for its VolumeAttachment", DEADLINE, |p| {
        p.and_then(|p| p.status.as_ref()?.message.as_deref())
            .is_some_and(|m| m.contains(&format!("waiting for VolumeAttachment {attachment_name}")))
    })
    .await;
    assert!(calls.all().iter().all(|c| c.rpc != "NodePublishVolume"), "not published before it is attached");

    // The attacher's work: the VolumeAttachment, not attached yet, then attached.
    let attachments: Api<VolumeAttachment> = Api::all(api.admin.clone());
    let attachment: VolumeAttachment = serde_json::from_value(json!({
        "metadata": {"name": attachment_name},
        "spec": {"attacher": ATTACHED_DRIVER, "nodeName": api.node, "source": {"persistentVolumeName": pv_name}},
    }))
    .expect("volumeattachment");
    attachments.create(&PostParams::default(), &attachment).await.expect("volumeattachment");
    api.wait_for(&pods, "attached", "waiting for the attacher", DEADLINE, |p| {
        p.and_then(|p| p.status.as_ref()?.message.as_deref()).is_some_and(|m| m.contains("is not attached yet"))
    })
    .await;
    let attached = json!({"status": {"attached": true, "attachmentMetadata": {"devicePath": "/dev/xvdf"}}});
    attachments
        .patch_status(&attachment_name, &PatchParams::default(), &Patch::Merge(&attached))
        .await
        .expect("attached");

    // Then it is published with the attachment's metadata as its publish context.
    api.wait_for(&pods, "attached", "Running", DEADLINE, running).await;
    let publish = calls.all().into_iter().find(|c| c.rpc == "NodePublishVolume").expect("published");
    assert_eq!(publish.volume_id, handle);
    assert_eq!(publish.publish_context, [("devicePath".to_owned(), "/dev/xvdf".to_owned())]);
    // An attached volume in use is reported as such (the controller does
    // not detach it under the pod).
    api.wait_for(&nodes, &api.node, "reporting the volume in use", DEADLINE, |n| {
        n.and_then(|n| n.status.as_ref()?.volumes_in_use.as_ref()).is_some_and(|v| v.contains(&unique))
    })
    .await;
    drop(node);
    stop.cancel();
}
rustlet_testkit::on_both_api_servers!(
    a_volume_that_needs_attaching_waits_for_its_volume_attachment_on,
    a_volume_that_needs_attaching_waits_for_its_volume_attachment
);

// ---------------------------------------------------------------------------

/// A driver of this test's own (a real API server is shared by the tests).
const IN_USE_DRIVER: &str = "in-use.csi.example.com";

/// A condition another writer put on the Node (NetworkUnavailable, as a
/// network plugin does) survives the node's status writes; a persistent
/// volume in use shows in `volumesInUse` while a pod uses it.
async fn the_nodes_status_writes_keep_others_conditions_and_report_volumes_in_use(api: TestApi) {
    use k8s_openapi::api::core::v1::Node;
    let node = ClusterNode::start(&api, 110).await;
    let nodes: Api<Node> = Api::all(api.admin.clone());
    api.wait_for(&nodes, &api.node, "registered", DEADLINE, |n| n.is_some()).await;
    let network = json!({"status": {"conditions": [{
        "type": "NetworkUnavailable", "status": "False", "reason": "RouteCreated", "message": "by the test",
    }]}});
    nodes.patch_status(&api.node, &PatchParams::default(), &Patch::Strategic(&network)).await.expect("condition");

    // A persistent CSI volume in use by a pod (attached: the kubelet
    // reports attachable volumes only).
    api.csi_driver_object(IN_USE_DRIVER, json!({"attachRequired": true, "volumeLifecycleModes": ["Persistent"]})).await;
    let stop = CancellationToken::new();
    let config =
        CsiDriverConfig { name: IN_USE_DRIVER.into(), node_id: api.node.clone(), ..CsiDriverConfig::default() };
    RegisteredCsiDriver::new(
        node.root.join("plugins_registry").join("in-use-csi.sock"),
        node.root.join("plugins").join("in-use-csi").join("csi.sock"),
        config,
    )
    .spawn(Reporter::Discard, stop.child_token())
    .expect("csi driver");
    let pv_name = format!("pv-inuse-{}", api.node);
    let handle = format!("in-use-{}", api.node);
    bound_claim(&api, "in-use", &pv_name, IN_USE_DRIVER, &handle).await;
    let pods = pods_api(&api);
    let mut user = pod(
        "in-use",
        &api.node,
        "exec sleep 600",
        json!({"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "in-use"}}]}),
    );
    user.spec.as_mut().expect("spec").containers[0].volume_mounts =
        Some(vec![serde_json::from_value(json!({"name": "data", "mountPath": "/data"})).expect("mount")]);
    pods.create(&PostParams::default(), &user).await.expect("create");
    // The attach/detach controller's and the attacher's work, by hand.
    let unique = format!("kubernetes.io/csi/{IN_USE_DRIVER}^{handle}");
    let listed = json!({"status": {"volumesAttached": [{"name": unique, "devicePath": ""}]}});
    nodes.patch_status(&api.node, &PatchParams::default(), &Patch::Merge(&listed)).await.expect("volumesAttached");
    let attachment_name = kubelet::cluster::volumes::attachment_name(&handle, IN_USE_DRIVER, &api.node);
    let attachments: Api<k8s_openapi::api::storage::v1::VolumeAttachment> = Api::all(api.admin.clone());
    let attachment = serde_json::from_value(json!({
        "metadata": {"name": attachment_name},
        "spec": {"attacher": IN_USE_DRIVER, "nodeName": api.node, "source": {"persistentVolumeName": pv_name}},
    }))
    .expect("volumeattachment");
    attachments.create(&PostParams::default(), &attachment).await.expect("volumeattachment");
    let attached = json!({"status": {"attached": true}});
    attachments
        .patch_status(&attachment_name, &PatchParams::default(), &Patch::Merge(&attached))
        .await
        .expect("attached");
    api.wait_for(&pods, "in-use", "Running", DEADLINE, running).await;
    let in_use = api
        .wait_for(&nodes, &api.node, "reporting the volume in use", DEADLINE, |n| {
            n.and_then(|n| n.status.as_ref()?.volumes_in_use.as_ref()).is_some_and(|v| v.contains(&unique))
        })
        .await
        .expect("node");
    let conditions = in_use.status.as_ref().and_then(|s| s.conditions.as_ref()).expect("conditions");
    let network = conditions.iter().find(|c| c.type_ == "NetworkUnavailable").expect("another writer's condition kept");
    assert_eq!(network.reason.as_deref(), Some("RouteCreated"));
    assert!(conditions.iter().any(|c| c.type_ == "Ready"), "{conditions:?}");

    // The pod goes: the volume is no longer in use.
    pods.delete("in-use", &DeleteParams::default()).await.expect("delete");
    let released = api
        .wait_for(&nodes, &api.node, "no longer reporting the volume", DEADLINE, |n| {
            n.and_then(|n| n.status.as_ref())
                .is_some_and(|s| !s.volumes_in_use.as_ref().is_some_and(|v| v.contains(&unique)))
        })
        .await
        .expect("node");
    let conditions = released.status.and_then(|s| s.conditions).unwrap_or_default();
    assert!(conditions.iter().any(|c| c.type_ == "NetworkUnavailable"), "{conditions:?}");
    stop.cancel();
}
rustlet_testkit::on_both_api_servers!(
    the_nodes_status_writes_keep_others_conditions_and_report_volumes_in_use_on,
    the_nodes_status_writes_keep_others_conditions_and_report_volumes_in_use
);

/// TLS bootstrap end to end on the real control plane, as a kubeadm
/// cluster joins a kubelet: a bootstrap token (a Secret in kube-system),
/// upstream's RBAC bindings for `system:bootstrappers` and `system:nodes`,
/// kube-controller-manager approving and signing. The node gets its client
/// certificate with the token, writes the kubeconfig, registers under the
/// issued identity and runs a pod; its serving certificate is requested
/// (and approved by the test, as an administrator would); both are
/// renewed before they expire (the signer issues them for a minute) with
/// the node's own identity, and the node keeps working across the switch.
/// A restart reuses what it has.
#[tokio::test]
async fn a_node_joins_by_tls_bootstrap_and_rotates_its_certificates() {
    use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::core::v1::{Node as NodeObject, Secret};
    use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
    use kubelet::cluster::certificates::BootstrapSettings;
    use kubelet::server::{KubeletApiConfig, ServingCertSource};
    let test = "a_node_joins_by_tls_bootstrap_and_rotates_its_certificates";
    let Some(api) = TestApi::real(test).await else { return };
    let plane = api.control_plane().expect("real");
    plane.ensure_controller_manager().expect("kube-controller-manager");
    let admin = api.admin.clone();

    // What kubeadm sets up: who may ask, and whose requests are approved.
    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    for (name, role, group) in [
        ("rustlet:kubelet-bootstrap", "system:node-bootstrapper", "system:bootstrappers"),
        (
            "rustlet:node-autoapprove-bootstrap",
            "system:certificates.k8s.io:certificatesigningrequests:nodeclient",
            "system:bootstrappers",
        ),
        (
            "rustlet:node-autoapprove-certificate-rotation",
            "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient",
            "system:nodes",
        ),
    ] {
        let binding: ClusterRoleBinding = serde_json::from_value(json!({
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": group}],
        }))
        .expect("binding");
        match bindings.create(&PostParams::default(), &binding).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(error) => panic!("ClusterRoleBinding {name}: {error}"),
        }
    }
    // A bootstrap token.
    let id: String = uuid::Uuid::new_v4().simple().to_string()[..6].to_owned();
    let secret: String = uuid::Uuid::new_v4().simple().to_string()[..16].to_owned();
    let token: Secret = serde_json::from_value(json!({
        "metadata": {"name": format!("bootstrap-token-{id}"), "namespace": "kube-system"},
        "type": "bootstrap.kubernetes.io/token",
        "stringData": {"token-id": id, "token-secret": secret, "usage-bootstrap-authentication": "true"},
    }))
    .expect("secret");
    Api::<Secret>::namespaced(admin.clone(), "kube-system")
        .create(&PostParams::default(), &token)
        .await
        .expect("token");

    let dir = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let root = dir.path().join("root");
    let bootstrap_kubeconfig = dir.path().join("bootstrap.kubeconfig");
    plane.write_kubeconfig(&bootstrap_kubeconfig, &format!("{id}.{secret}")).expect("bootstrap kubeconfig");
    let kubeconfig = dir.path().join("kubelet.kubeconfig");
    let cert_dir = root.join("pki");
    let node_name = format!("joined-{id}");
    let start = || {
        let mut config = NodeConfig::new(&root, node_name.clone());
        config.http_address = None;
        let ip = rustlet_testkit::control_plane::host_ip().unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
        config.node_ips = vec![ip];
        let mut kubelet_api = KubeletApiConfig::new(&root);
        kubelet_api.address = std::net::SocketAddr::new(ip, 0);
        kubelet_api.client_ca = Some(plane.ca_file());
        kubelet_api.serving = ServingCertSource::Requested;
        config.kubelet_api = Some(kubelet_api);
        let settings = ClusterSettings::new(ApiSource::Bootstrap(BootstrapSettings {
            kubeconfig: kubeconfig.clone(),
            bootstrap_kubeconfig: Some(bootstrap_kubeconfig.clone()),
            cert_dir: cert_dir.clone(),
            rotate: true,
        }));
        let shutdown = CancellationToken::new();
        let node = NodeBuilder::new(config)
            .provider(Arc::new(HostProcessProvider::new()))
            .cluster(settings)
            .start(shutdown.clone());
        (node, shutdown)
    };
    let (node, shutdown) = start();
    let node = node.await.expect("node");
    let stop = shutdown.clone().drop_guard();
    let address = node.kubelet_api_address().expect("kubelet API");

    // The client certificate: asked for with the token, approved by the
    // controller, and the Node registered under it.
    let nodes: Api<NodeObject> = Api::all(admin.clone());
    api.wait_for(&nodes, &node_name, "registered", DEADLINE, |n| n.is_some()).await;
    let csrs: Api<CertificateSigningRequest> = Api::all(admin.clone());
    let requests = csrs.list(&Default::default()).await.expect("list CSRs").items;
    let client_csr = requests
        .iter()
        .find(|c| c.spec.username.as_deref() == Some(&format!("system:bootstrap:{id}")))
        .expect("the bootstrap CSR");
    assert_eq!(client_csr.spec.signer_name, "kubernetes.io/kube-apiserver-client-kubelet");
    let conditions = client_csr.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
    assert!(conditions.iter().any(|c| c.type_ == "Approved" && c.reason.as_deref() == Some("AutoApproved")));
    let written = std::fs::read_to_string(&kubeconfig).expect("the kubeconfig is written");
    assert!(written.contains("kubelet-client-current.pem"), "{written}");
    let client_cert = || {
        let pem = std::fs::read(cert_dir.join("kubelet-client-current.pem")).expect("client certificate");
        use rustls::pki_types::pem::PemObject as _;
        let leaf = rustls::pki_types::CertificateDer::pem_slice_iter(&pem).next().expect("a cert").expect("pem");
        kubelet::pki::x509::certificate_facts(&leaf).expect("facts")
    };
    let first = client_cert();
    assert_eq!(first.common_name.as_deref(), Some(format!("system:node:{node_name}").as_str()));
    assert_eq!(first.organizations, ["system:nodes"]);

    // The serving certificate: requested by the node, approved here.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let serving = loop {
        assert!(tokio::time::Instant::now() < deadline, "the node asked for no serving certificate");
        let requests = csrs.list(&Default::default()).await.expect("list CSRs").items;
        let pending = requests.into_iter().find(|c| {
            c.spec.signer_name == "kubernetes.io/kubelet-serving"
                && c.spec.username.as_deref() == Some(&format!("system:node:{node_name}"))
        });
        if let Some(pending) = pending {
            break pending;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let approval = Patch::Merge(json!({"status": {"conditions": [
        {"type": "Approved", "status": "True", "reason": "TestApproved", "message": "approved by the test"}
    ]}}));
    let name = serving.metadata.name.clone().expect("name");
    csrs.patch_approval(&name, &PatchParams::default(), &approval).await.expect("approve");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let served = loop {
        if let Ok(der) = rustlet_testkit::https::server_certificate(address).await {
            break kubelet::pki::x509::certificate_facts(&der).expect("facts");
        }
        assert!(tokio::time::Instant::now() < deadline, "no serving certificate after approval");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(served.common_name.as_deref(), Some(format!("system:node:{node_name}").as_str()));

    // Rotation: both certificates are renewed before they expire, the
    // client one by the node's own identity (auto-approved), the serving
    // one approved here again.
    let rotation_deadline =
        tokio::time::Instant::now() + rustlet_testkit::control_plane::SIGNED_CERTIFICATE_LIFETIME * 3;
    let mut approved = std::collections::BTreeSet::from([name]);
    loop {
        let client_rotated = client_cert().not_after > first.not_after;
        let serving_rotated = rustlet_testkit::https::server_certificate(address)
            .await
            .ok()
            .and_then(|der| kubelet::pki::x509::certificate_facts(&der).ok())
            .is_some_and(|f| f.not_after > served.not_after);
        if client_rotated && serving_rotated {
            break;
        }
        for csr in csrs.list(&Default::default()).await.expect("list CSRs").items {
            let name = csr.metadata.name.clone().unwrap_or_default();
            if csr.spec.signer_name == "kubernetes.io/kubelet-serving"
                && csr.spec.username.as_deref() == Some(&format!("system:node:{node_name}"))
                && approved.insert(name.clone())
            {
                csrs.patch_approval(&name, &PatchParams::default(), &approval).await.expect("approve");
            }
        }
        assert!(
            tokio::time::Instant::now() < rotation_deadline,
            "not rotated in time: client {client_rotated}, serving {serving_rotated}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let renewals = csrs.list(&Default::default()).await.expect("list CSRs").items;
    assert!(
        renewals.iter().any(|c| c.spec.signer_name == "kubernetes.io/kube-apiserver-client-kubelet"
            && c.spec.username.as_deref() == Some(&format!("system:node:{node_name}"))),
        "the renewal is asked for by the node itself"
    );
    // The node keeps working after the switch: its Lease is renewed and a
    // pod runs with its status in the API.
    let leases: Api<Lease> = Api::namespaced(admin.clone(), "kube-node-lease");
    let switched = jiff::Timestamp::now();
    api.wait_for(&leases, &node_name, "renewed after the rotation", DEADLINE, |l| {
        l.and_then(|l| l.spec.as_ref()?.renew_time.as_ref()).is_some_and(|t| t.0 > switched)
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let pod_name = format!("after-rotation-{id}");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": pod_name, "namespace": "default"},
        "spec": {"nodeName": node_name, "automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "main", "image": "busybox", "command": ["sleep", "600"]}]},
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod).await.expect("create");
    api.wait_for(&pods, &pod_name, "running", DEADLINE, |p| {
        p.and_then(|p| p.status.as_ref()?.phase.clone()).as_deref() == Some("Running")
    })
    .await;
    pods.delete(&pod_name, &DeleteParams::default()).await.expect("delete");
    api.wait_for(&pods, &pod_name, "gone", DEADLINE, |p| p.is_none()).await;

    // A restart uses what the node has: no new bootstrap request.
    drop(stop);
    node.stopped().await;
    let before: std::collections::BTreeSet<String> = csrs
        .list(&Default::default())
        .await
        .expect("list CSRs")
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .collect();
    let (node, shutdown) = start();
    let node = node.await.expect("node again");
    let _stop = shutdown.clone().drop_guard();
    let leases_again = jiff::Timestamp::now();
    api.wait_for(&leases, &node_name, "renewed after the restart", DEADLINE, |l| {
        l.and_then(|l| l.spec.as_ref()?.renew_time.as_ref()).is_some_and(|t| t.0 > leases_again)
    })
    .await;
    let after = csrs.list(&Default::default()).await.expect("list CSRs").items;
    assert!(
        !after.iter().any(|c| {
            c.metadata.name.as_ref().is_some_and(|n| !before.contains(n))
                && c.spec.username.as_deref() == Some(&format!("system:bootstrap:{id}"))
        }),
        "the restarted node did not bootstrap again"
    );
    drop(node);
}

/// The Lease never waits behind the kubelet API's callers. Every request
/// with a new bearer token makes the node send a TokenReview; here 48
/// clients send random tokens as fast as they are answered while the API
/// server takes half a second per TokenReview, and the node's request
/// bucket is small (5 a second). The Lease and status go through a client
/// of their own (no bucket), the reviews through theirs (bounded: at most
/// 16 at once, the rest answered 429 after a wait), so the Lease is
/// renewed throughout: no gap between renewals comes near the lease's
/// duration. A token the API refused is remembered as refused, and the
/// administrator's token still works after the flood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_random_tokens_never_holds_the_lease_back() {
    use kubelet::cluster::node_sync::NodeSyncConfig;
    use kubelet::server::KubeletApiConfig;
    use rustlet_testkit::apiserver::{ApiServer, Fault};
    use rustlet_testkit::https::{Credentials, request};
    let server = ApiServer::start().await.expect("api server");
    let dir = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig, &server.node_token("flooded")).expect("kubeconfig");
    let root = dir.path().join("root");
    let mut config = NodeConfig::new(&root, "flooded");
    config.http_address = None;
    let mut api = KubeletApiConfig::new(&root);
    api.address = ([127, 0, 0, 1], 0).into();
    config.kubelet_api = Some(api);
    let mut settings = ClusterSettings::new(ApiSource::Kubeconfig(kubeconfig));
    settings.api_qps = 5.0;
    settings.api_burst = 5;
    let lease_duration = Duration::from_secs(8);
    settings.node_sync =
        NodeSyncConfig { lease_duration, renew_interval: Duration::from_millis(500), ..NodeSyncConfig::new("flooded") };
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let node = NodeBuilder::new(config).cluster(settings).start(shutdown.clone()).await.expect("node");
    let address = node.kubelet_api_address().expect("kubelet API");
    let lease_writes = |requests: &[rustlet_testkit::apiserver::Logged]| -> Vec<std::time::Instant> {
        requests
            .iter()
            .filter(|r| {
                r.uri.contains("/namespaces/kube-node-lease/leases")
                    && (r.method == http::Method::PUT || r.method == http::Method::POST)
                    && r.status < 300
            })
            .map(|r| r.received)
            .collect()
    };
    server.wait_requests(DEADLINE, |requests| !lease_writes(requests).is_empty()).await.expect("the lease is created");

    server.inject(Fault::slow(Some(http::Method::POST), "tokenreviews", Duration::from_millis(500), usize::MAX));
    let flood_start = std::time::Instant::now();
    let flood_for = Duration::from_secs(10);
    let mut clients = Vec::new();
    for _ in 0..48 {
        clients.push(tokio::spawn(async move {
            let mut answers = std::collections::BTreeMap::<u16, usize>::new();
            while flood_start.elapsed() < flood_for {
                let token = uuid::Uuid::new_v4().to_string();
                if let Ok((code, _)) = request(address, "GET", "/pods", Credentials::Token(&token)).await {
                    *answers.entry(code).or_default() += 1;
                }
            }
            answers
        }));
    }
    let mut answers = std::collections::BTreeMap::<u16, usize>::new();
    for client in clients {
        for (code, count) in client.await.expect("client") {
            *answers.entry(code).or_default() += count;
        }
    }
    let flood_end = std::time::Instant::now();
    let requests = server.requests();
    let reviews = requests.iter().filter(|r| r.uri.contains("tokenreviews")).count();
    assert!(reviews > 0, "the flood made TokenReviews: {answers:?}");
    assert!(answers.keys().all(|code| [401, 429, 503].contains(code)), "random tokens are refused: {answers:?}");
    let mut renewals: Vec<std::time::Instant> =
        lease_writes(&requests).into_iter().filter(|t| *t >= flood_start && *t <= flood_end).collect();
    renewals.insert(0, flood_start);
    renewals.push(flood_end);
    let longest = renewals.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default();
    eprintln!(
        "flood: {answers:?}, {reviews} TokenReviews, {} renewals in {:?}, longest gap {longest:?}",
        renewals.len() - 2,
        flood_end - flood_start
    );
    assert!(
        longest < lease_duration,
        "the Lease waited {longest:?} between renewals during the flood (lease duration {lease_duration:?})"
    );

    // A refused token is remembered as refused: asking again sends no
    // second TokenReview.
    server.clear_faults();
    let bad = uuid::Uuid::new_v4().to_string();
    let count_reviews =
        |server: &ApiServer| server.requests().iter().filter(|r| r.uri.contains("tokenreviews")).count();
    let before = count_reviews(&server);
    for _ in 0..3 {
        let (code, _) = request(address, "GET", "/pods", Credentials::Token(&bad)).await.expect("request");
        assert_eq!(code, 401);
    }
    assert_eq!(count_reviews(&server), before + 1, "one TokenReview for a token asked three times");
    // The administrator still gets in.
    let (code, body) =
        request(address, "GET", "/pods", Credentials::Token(server.admin_token())).await.expect("request");
    assert_eq!(code, 200, "{body}");
}

/// A refused client certificate is visible: the failed handshake is
/// logged with its reason and counted by reason in
/// `kubelet_api_tls_handshake_failures_total` (the handshake failed
/// silently before). A certificate from another CA is `unknown_authority`,
/// an expired one from the right CA `expired`, a client that closes before
/// the handshake `closed`; a good certificate still gets in.
#[tokio::test]
async fn refused_client_certificates_are_counted_by_reason() {
    use kubelet::server::{AuthSettings, AuthorizationMode, KubeletApiConfig};
    use rustlet_testkit::https::{Credentials, get};
    let dir = rustlet_testkit::node_root::tempdir("rustlet-node-");
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, "test-ca");
    let ca = ca_params.self_signed(&ca_key).expect("ca");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).expect("write ca");
    let client_cert = |name: &str, expired: bool, signed: bool| {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let cert = if signed { params.signed_by(&key, &ca, &ca_key) } else { params.self_signed(&key) };
        (cert.expect("cert").pem(), key.serialize_pem())
    };
    let root = dir.path().join("root");
    let mut config = NodeConfig::new(&root, "tls-node");
    config.http_address = Some(([127, 0, 0, 1], 0).into());
    let mut api = KubeletApiConfig::new(&root);
    api.address = ([127, 0, 0, 1], 0).into();
    api.client_ca = Some(ca_file);
    api.auth = AuthSettings { authorization: AuthorizationMode::AlwaysAllow, ..AuthSettings::default() };
    config.kubelet_api = Some(api);
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let node = NodeBuilder::new(config).start(shutdown.clone()).await.expect("node");
    let address = node.kubelet_api_address().expect("kubelet API");
    let health = node.http_address().expect("health port").to_string();
    let failures = |reason: &'static str| {
        let health = health.clone();
        async move {
            let (_, metrics) = rustlet_testkit::node_process::http_get(&health, "/metrics").await;
            let series = format!("kubelet_api_tls_handshake_failures_total{{reason=\"{reason}\"}} ");
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(&series))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        }
    };

    let (cert, key) = client_cert("stranger", false, false);
    let refused = get(address, "/pods", Credentials::Certificate { cert_pem: &cert, key_pem: &key }).await;
    assert!(refused.is_err(), "{refused:?}");
    let (cert, key) = client_cert("late", true, true);
    let refused = get(address, "/pods", Credentials::Certificate { cert_pem: &cert, key_pem: &key }).await;
    assert!(refused.is_err(), "{refused:?}");
    drop(tokio::net::TcpStream::connect(address).await.expect("connect"));
    let (cert, key) = client_cert("admin", false, true);
    let (code, body) =
        get(address, "/pods", Credentials::Certificate { cert_pem: &cert, key_pem: &key }).await.expect("request");
    assert_eq!(code, 200, "{body}");
    // The server side of a handshake ends after the client's: wait for
    // the counts (the closed connection is counted when the node sees EOF).
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let counted = (failures("unknown_authority").await, failures("expired").await, failures("closed").await);
        if counted == (1, 1, 1) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "failures counted (unknown_authority, expired, closed): {counted:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
