//! The CRI provider on a real containerd (Debian's containerd 1.6 and runc,
//! a private instance per test binary), images built by the tests from
//! Debian's static busybox and pulled from a loopback registry.
//!
//! Needs root (containerd does); without it, or without containerd, the
//! tests say why and skip, unless `RUSTLET_REQUIRE_CONTAINERD=1`.

mod common;
#[path = "cri/conformance.rs"]
mod conformance;
#[path = "cri/plugin_pods.rs"]
mod plugin_pods;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kubelet::pod::{Allocatable, BackoffConfig, PodConfig, PodLifecycle, Pods};
use kubelet::provider::{Provider, decode_cri_log};
use rustlet_cri::{CriConfig, CriProvider};
use rustlet_testkit::containerd::{Containerd, push_busybox};
use rustlet_testkit::pod_state::{
    container_ready, container_status, every_second, first_container_running as running, pod_ready, restarts,
};
use rustlet_testkit::registry::Registry;
use tokio_util::sync::CancellationToken;

/// A liveness bound: a pull and a start take about a second here.
const SOON: Duration = Duration::from_secs(120);

struct CriNode {
    root: tempfile::TempDir,
    pods: Pods,
    provider: CriProvider,
    image: String,
    registry: Registry,
    /// A device plugin's devices, when the node has them.
    _plugin: Option<rustlet_testkit::process::PluginProcess>,
    shutdown: CancellationToken,
}

const GPU: &str = "vendor.example.com/gpu";

impl Drop for CriNode {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Pods on `containerd`, the busybox image in a registry of this test's.
async fn cri_node(containerd: &Containerd) -> CriNode {
    cri_node_with_gpus(containerd, 0).await
}

/// [`cri_node`] with a device manager and, when `gpus` > 0, the fake
/// device plugin serving that many devices of [`GPU`].
async fn cri_node_with_gpus(containerd: &Containerd, gpus: u64) -> CriNode {
    cri_node_with(containerd, gpus, |_| {}).await
}

/// [`cri_node_with_gpus`], its pod settings changed by `tweak`.
async fn cri_node_with(containerd: &Containerd, gpus: u64, tweak: impl FnOnce(&mut PodConfig)) -> CriNode {
    cri_node_configured(containerd, gpus, tweak, |_| {}).await
}

/// [`cri_node_with`], the provider's settings changed by `tweak_cri`.
async fn cri_node_configured(
    containerd: &Containerd,
    gpus: u64,
    tweak: impl FnOnce(&mut PodConfig),
    tweak_cri: impl FnOnce(&mut CriConfig),
) -> CriNode {
    let root = rustlet_testkit::node_root::tempdir("rustlet-cri-");
    cri_node_in(root, containerd, gpus, tweak, tweak_cri).await
}

/// [`cri_node_configured`] with the root dir `root`.
async fn cri_node_in(
    root: tempfile::TempDir,
    containerd: &Containerd,
    gpus: u64,
    tweak: impl FnOnce(&mut PodConfig),
    tweak_cri: impl FnOnce(&mut CriConfig),
) -> CriNode {
    let registry = Registry::start().await.expect("registry");
    containerd.trust_registry(&registry.host());
    let image = push_busybox(&registry, "test/busybox", "v1", &[], &["sh"]).await.expect("push busybox");
    let shutdown = CancellationToken::new();
    // The node's DNS settings: a cluster DNS and domain, and a resolv.conf
    // of the test's.
    let resolv_conf = root.path().join("resolv.conf");
    std::fs::write(&resolv_conf, "nameserver 192.0.2.53\nsearch corp.example\n").expect("resolv.conf");
    let mut cri_config = CriConfig::new(containerd.endpoint());
    cri_config.dns = rustlet_cri::dns::DnsSettings {
        cluster_dns: vec!["10.96.0.10".into()],
        cluster_domain: "cluster.local".into(),
        resolv_conf: Some(resolv_conf),
    };
    cri_config.memory_capacity = Some(4 << 30);
    tweak_cri(&mut cri_config);
    let provider = CriProvider::new(cri_config);
    let mut config = PodConfig::new(root.path(), Allocatable { cpu_milli: 2000, memory: 4 << 30, pods: 110 });
    config.restart_backoff = BackoffConfig {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(400),
        reset_after: Duration::from_secs(600),
    };
    tweak(&mut config);
    let device_dir = root.path().join("device-plugins");
    let mut device_config = kubelet::device_manager::DeviceManagerConfig::new(&device_dir);
    device_config.call_timeout = common::LIVENESS_DEADLINE;
    let devices = kubelet::device_manager::DeviceManager::start(device_config, shutdown.clone()).expect("devices");
    let plugin = if gpus > 0 { Some(common::gpu_plugin(&devices, &device_dir, GPU, gpus).await) } else { None };
    let dyn_provider: Arc<dyn Provider> = Arc::new(provider.clone());
    let pods = Pods::start(PodLifecycle::new(config, Some(dyn_provider), Some(devices)), shutdown.clone()).await;
    CriNode { root, pods, provider, image, registry, _plugin: plugin, shutdown }
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

impl CriNode {
    /// Applies a pod named `name` (UID `uid`) with one container `main`
    /// running `script` in the busybox image; `extra` is merged into the
    /// pod's spec and `container` into the container's.
    fn run(&self, name: &str, script: &str, extra: serde_json::Value, container: serde_json::Value) -> String {
        let uid = format!("cri-{name}");
        let mut main = serde_json::json!({"name": "main", "image": self.image, "command": ["sh", "-c", script]});
        merge(&mut main, container);
        let mut spec = serde_json::json!({"restartPolicy": "Never", "containers": [main]});
        merge(&mut spec, extra);
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": spec,
        }))
        .expect("pod");
        self.pods.apply(pod);
        uid
    }

    /// Runs an eviction manager over this node until the returned token
    /// is cancelled: one hard threshold, `signal` below `bytes`; a pass
    /// every 200 ms; a condition held 20 s after its threshold was last
    /// met; `kubepods` (the cgroup file system and the group) when pods
    /// have their cgroups; images collected whatever their age.
    fn start_eviction(
        &self,
        pressure: &kubelet::eviction::pressure::Pressure,
        signal: kubelet::eviction::Signal,
        bytes: u128,
        kubepods: Option<(kubelet::cgroups::CgroupFs, String)>,
    ) -> CancellationToken {
        use kubelet::eviction::{Threshold, ThresholdValue};
        let value = ThresholdValue::Quantity(bytes);
        let threshold = Threshold { signal, value, grace_period: Duration::ZERO, min_reclaim: None };
        self.start_eviction_with(pressure, vec![threshold], kubepods)
    }

    /// Starts an eviction manager with hard `thresholds` (none: it checks
    /// the pods' local storage limits only).
    fn start_eviction_with(
        &self,
        pressure: &kubelet::eviction::pressure::Pressure,
        thresholds: Vec<kubelet::eviction::Threshold>,
        kubepods: Option<(kubelet::cgroups::CgroupFs, String)>,
    ) -> CancellationToken {
        use kubelet::eviction::Thresholds;
        use kubelet::eviction::manager::{EvictionManager, EvictionSettings};
        let mut eviction = EvictionSettings::new(self.root.path());
        eviction.thresholds = Thresholds { hard: thresholds, soft: Vec::new() };
        eviction.period = Duration::from_millis(200);
        eviction.pressure_transition_period = Duration::from_secs(20);
        eviction.kubepods = kubepods;
        eviction.image_gc.min_age = Duration::ZERO;
        let provider: Arc<dyn Provider> = Arc::new(self.provider.clone());
        let recorder = kubelet::events::EventRecorder::log_only();
        let manager =
            EvictionManager::new(eviction, self.pods.clone(), Some(provider), pressure.clone(), recorder, "n1");
        let stop = CancellationToken::new();
        tokio::spawn(manager.run(stop.clone()));
        stop
    }

    /// Waits until pod `uid` satisfies `pred`.
    async fn wait(&self, uid: &str, what: &str, pred: impl Fn(&Pod) -> bool) -> Pod {
        let found = self.pods.store().wait_for(SOON, |pods| pods.get(uid).is_some_and(&pred)).await;
        found
            .and_then(|pods| pods.get(uid).cloned())
            .unwrap_or_else(|| panic!("{uid} not {what}: {:#?}", self.pods.store().get(uid).and_then(|p| p.status)))
    }

    /// The lines container `main` of pod `name` (UID `uid`) wrote.
    fn log(&self, name: &str, uid: &str) -> Vec<String> {
        let path = self.root.path().join(format!("logs/pods/default_{name}_{uid}/main/0.log"));
        decode_cri_log(&std::fs::read_to_string(&path).unwrap_or_default())
    }
}

fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
    if let (Some(into), serde_json::Value::Object(from)) = (into.as_object_mut(), from) {
        into.extend(from);
    }
}

fn terminated(pod: &Pod) -> Option<k8s_openapi::api::core::v1::ContainerStateTerminated> {
    pod.status.as_ref()?.container_statuses.as_ref()?.first()?.state.as_ref()?.terminated.clone()
}

/// The pod's and the container's security contexts reach the container:
/// its user and groups, a read-only root file system, dropped privileges.
#[tokio::test]
async fn the_security_context_reaches_the_container() {
    let Some(containerd) = Containerd::shared("the_security_context_reaches_the_container") else { return };
    let node = cri_node(containerd).await;
    let uid = node.run(
        "secure",
        "id -u; id -g; id -G; touch /written 2>/dev/null && echo writable || echo read-only; \
         grep NoNewPrivs /proc/self/status",
        serde_json::json!({"securityContext": {"runAsUser": 1000, "runAsGroup": 3000, "supplementalGroups": [4000]}}),
        serde_json::json!({"securityContext": {"readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false}}),
    );
    let done = node.wait(&uid, "finished", |p| terminated(p).is_some()).await;
    assert_eq!(terminated(&done).map(|t| t.exit_code), Some(0), "{:?}", node.log("secure", &uid));
    let lines = node.log("secure", &uid);
    let lines: Vec<&str> = lines.iter().map(|l| l.trim_end()).collect();
    assert_eq!(lines[..3], ["1000", "3000", "3000 4000"], "{lines:?}");
    assert_eq!(lines[3], "read-only");
    assert!(lines[4].starts_with("NoNewPrivs:") && lines[4].ends_with('1'), "{lines:?}");
}

/// Each container runs with the kubelet's OOM score adjustment for its
/// pod's QoS class, and the pod reports the class: BestEffort 1000,
/// Burstable `1000 - 1000 × request / capacity` (64Mi of 4Gi: 985),
/// Guaranteed the lowest of the three (-997, or what the host and the
/// runtime allow: containerd raises it to its own score).
#[tokio::test]
async fn containers_run_with_the_oom_score_of_their_qos_class() {
    let Some(containerd) = Containerd::shared("containers_run_with_the_oom_score_of_their_qos_class") else { return };
    let node = cri_node(containerd).await;
    let cases = [
        ("besteffort", serde_json::json!({}), "BestEffort"),
        ("burstable", serde_json::json!({"resources": {"requests": {"memory": "64Mi"}}}), "Burstable"),
        ("guaranteed", serde_json::json!({"resources": {"limits": {"cpu": "100m", "memory": "64Mi"}}}), "Guaranteed"),
    ];
    let mut scores = Vec::new();
    for (name, container, class) in cases {
        let uid = node.run(name, "cat /proc/self/oom_score_adj", serde_json::json!({}), container);
        let done = node.wait(&uid, "finished", |p| terminated(p).is_some()).await;
        assert_eq!(terminated(&done).map(|t| t.exit_code), Some(0), "{:?}", node.log(name, &uid));
        assert_eq!(done.status.as_ref().and_then(|s| s.qos_class.as_deref()), Some(class));
        let log = node.log(name, &uid);
        let score: i64 = log.first().map(|l| l.trim()).unwrap_or_default().parse().expect("a score");
        scores.push(score);
    }
    assert_eq!(scores[..2], [1000, 985], "{scores:?}");
    assert!(scores[2] <= 0, "Guaranteed is kept longest: {scores:?}");
}

/// Pods in the kubelet's cgroup hierarchy (under a root of the test's, on
/// the host's real cgroups): Guaranteed directly under `kubepods`,
/// Burstable and BestEffort under their class's group, each in
/// `pod<uid>` with upstream's limits; `kubepods` holds the node's
/// allocatable; the Burstable group's shares are its pods' requests. A
/// group an earlier run left of a pod that is gone is removed at start,
/// and each pod's group goes with the pod.
#[tokio::test]
async fn pods_run_in_the_kubelets_cgroup_hierarchy_with_their_limits() {
    use kubelet::cgroups::{CgroupResources, CgroupVersion, PodCgroups, QosCgroupSettings};
    let test = "pods_run_in_the_kubelets_cgroup_hierarchy_with_their_limits";
    let Some(containerd) = Containerd::shared(test) else { return };
    let Some(root) = rustlet_testkit::cgroups::TestCgroupRoot::new(test) else { return };
    let kubepods = format!("{}/kubepods", root.name);
    // What an earlier run left of a pod that is gone.
    let orphan = format!("{kubepods}/besteffort/podgone-1");
    root.fs.ensure(&orphan, &CgroupResources::default()).expect("an orphan group");
    let settings = QosCgroupSettings {
        root: root.name.clone(),
        kubepods: CgroupResources { memory_limit: Some(3 << 30), cpu_shares: Some(2048), ..Default::default() },
        pod_pids_limit: Some(64),
        ..QosCgroupSettings::new()
    };
    let cgroups = Arc::new(PodCgroups::start(root.fs.clone(), settings).expect("kubepods"));
    let node = cri_node_configured(containerd, 0, |_| {}, |c| c.pod_cgroups = Some(cgroups.clone())).await;
    assert!(!root.fs.exists(&orphan), "the orphan's group was removed at start");

    let cases = [
        ("cg-guaranteed", serde_json::json!({"resources": {"limits": {"cpu": "200m", "memory": "64Mi"}}}), ""),
        ("cg-burstable", serde_json::json!({"resources": {"requests": {"cpu": "100m"}}}), "/burstable"),
        ("cg-besteffort", serde_json::json!({}), "/besteffort"),
    ];
    let mut uids = Vec::new();
    for (name, container, class) in &cases {
        let script = "cat /proc/self/cgroup; echo listed; exec sleep 600";
        let uid = node.run(name, script, serde_json::json!({"terminationGracePeriodSeconds": 1}), container.clone());
        node.wait(&uid, "Running", running).await;
        let log = node.root.path().join(format!("logs/pods/default_{name}_{uid}/main/0.log"));
        let text = common::wait_file(&log, |t| t.contains("listed")).await;
        let group = format!("{kubepods}{class}/pod{uid}");
        let memory_line = text.lines().find(|l| l.contains(":memory:") || l.contains(" 0::/")).unwrap_or_default();
        if root.fs.version() == CgroupVersion::V1 {
            assert!(memory_line.contains(&format!(":memory:{group}/")), "{name} runs in {group}: {text}");
        }
        uids.push((uid, group));
    }
    let read = |controller: &str, group: &str, file: &str| {
        let path = root.fs.dir(controller, group).join(file);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).trim().to_owned()
    };
    if root.fs.version() == CgroupVersion::V1 {
        let (guaranteed, burstable, besteffort) = (&uids[0].1, &uids[1].1, &uids[2].1);
        assert_eq!(read("memory", guaranteed, "memory.limit_in_bytes"), (64 << 20).to_string());
        assert_eq!(read("cpu", guaranteed, "cpu.cfs_quota_us"), "20000");
        assert_eq!(read("cpu", guaranteed, "cpu.shares"), "204");
        assert_eq!(read("cpu", burstable, "cpu.shares"), "102");
        assert_eq!(read("cpu", burstable, "cpu.cfs_quota_us"), "-1", "no cpu limit, no quota");
        assert_eq!(read("cpu", besteffort, "cpu.shares"), "2");
        for (_, group) in &uids {
            assert_eq!(read("pids", group, "pids.max"), "64");
        }
        assert_eq!(read("memory", &kubepods, "memory.limit_in_bytes"), (3_u64 << 30).to_string());
        assert_eq!(read("cpu", &kubepods, "cpu.shares"), "2048");
        assert_eq!(read("cpu", &format!("{kubepods}/burstable"), "cpu.shares"), "102");
        assert_eq!(read("cpu", &format!("{kubepods}/besteffort"), "cpu.shares"), "2");
    }
    for (uid, _) in &uids {
        node.pods.delete(uid);
    }
    let gone = node.pods.store().wait_for(SOON, |pods| pods.is_empty()).await;
    assert!(gone.is_some(), "the pods were removed: {:#?}", node.pods.store().list());
    for (uid, group) in &uids {
        let deadline = tokio::time::Instant::now() + SOON;
        while root.fs.exists(group) {
            assert!(tokio::time::Instant::now() < deadline, "pod {uid}'s group {group} outlived the pod");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A greedy pod is evicted alone, on real memory: the pods' `kubepods`
/// group (a cgroup of the test's) is limited to 1Gi and the node evicts
/// when less than 874Mi of it is left (`allocatableMemory.available`). A
/// quiet pod runs; a hog holds 200 MiB. The hog is evicted (Failed,
/// `Evicted`, upstream's message, a `DisruptionTarget` condition), its
/// neighbour keeps running, the node reports MemoryPressure and refuses a
/// BestEffort pod meanwhile, and the condition turns False after the
/// transition period.
#[tokio::test]
async fn a_greedy_pod_is_evicted_alone_and_the_pressure_passes() {
    use kubelet::cgroups::{CgroupResources, PodCgroups, QosCgroupSettings};
    use kubelet::eviction::Signal;
    use kubelet::eviction::pressure::Pressure;
    let test = "a_greedy_pod_is_evicted_alone_and_the_pressure_passes";
    let Some(containerd) = Containerd::shared(test) else { return };
    let Some(root) = rustlet_testkit::cgroups::TestCgroupRoot::new(test) else { return };
    let settings = QosCgroupSettings {
        root: root.name.clone(),
        kubepods: CgroupResources { memory_limit: Some(1 << 30), ..Default::default() },
        ..QosCgroupSettings::new()
    };
    let cgroups = Arc::new(PodCgroups::start(root.fs.clone(), settings).expect("kubepods"));
    let pressure = Pressure::default();
    let shared = pressure.clone();
    let node =
        cri_node_configured(containerd, 0, move |c| c.pressure = shared, |c| c.pod_cgroups = Some(cgroups.clone()))
            .await;
    let kubepods = Some((root.fs.clone(), format!("{}/kubepods", root.name)));
    let stop = node.start_eviction(&pressure, Signal::AllocatableMemoryAvailable, 874 << 20, kubepods);
    let quiet = node.run(
        "quiet",
        "exec sleep 600",
        serde_json::json!({"terminationGracePeriodSeconds": 1}),
        serde_json::json!({}),
    );
    node.wait(&quiet, "Running", running).await;
    assert!(!pressure.now().memory, "no pressure before the hog");

    let hog = node.run(
        "hog",
        "dd if=/dev/zero bs=200M count=1 2>/dev/null | sleep 600",
        serde_json::json!({"terminationGracePeriodSeconds": 30}),
        serde_json::json!({}),
    );
    let evicted =
        node.wait(&hog, "evicted", |p| p.status.as_ref().and_then(|s| s.reason.as_deref()) == Some("Evicted")).await;
    let status = evicted.status.clone().unwrap_or_default();
    assert_eq!(status.phase.as_deref(), Some("Failed"));
    let message = status.message.clone().unwrap_or_default();
    assert!(
        message.starts_with("The node was low on resource: memory. Threshold quantity: 874Mi, available: "),
        "{message}"
    );
    assert!(
        message.contains("Container main was using ")
            && message.ends_with("request is 0, has larger consumption of memory. "),
        "{message}"
    );
    let disruption = status.conditions.iter().flatten().find(|c| c.type_ == "DisruptionTarget").cloned();
    assert_eq!(
        disruption.map(|c| (c.status, c.reason)),
        Some(("True".to_owned(), Some("TerminationByKubelet".to_owned()))),
        "{status:?}"
    );
    // The hog stopped at once (a hard threshold: no grace), its neighbour runs.
    assert!(terminated(&evicted).is_some(), "{status:?}");
    assert!(node.pods.store().get(&quiet).is_some_and(|p| running(&p)), "the quiet pod runs on");

    // Still under pressure (the transition period): BestEffort pods are refused.
    assert!(pressure.now().memory, "MemoryPressure holds for its transition period");
    let late = node.run("late", "exec sleep 600", serde_json::json!({}), serde_json::json!({}));
    let refused =
        node.wait(&late, "refused", |p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")).await;
    let refused = refused.status.unwrap_or_default();
    assert_eq!(
        (refused.reason.as_deref(), refused.message.as_deref()),
        (Some("Evicted"), Some("Pod was rejected: The node had condition: [MemoryPressure]. "))
    );

    let mut changes = pressure.subscribe();
    let passed = tokio::time::timeout(SOON, changes.wait_for(|p| !p.memory)).await;
    assert!(passed.is_ok(), "MemoryPressure turned False after the transition period");
    assert!(node.pods.store().get(&quiet).is_some_and(|p| running(&p)), "the quiet pod was never evicted");
    stop.cancel();
    for uid in [&quiet, &hog, &late] {
        node.pods.delete(uid);
    }
    let gone = node.pods.store().wait_for(SOON, |pods| pods.is_empty()).await;
    assert!(gone.is_some(), "the pods were removed");
}

/// A container that fills its log stays within max-size × max-files: its
/// log (written by containerd) is rotated at 256Ki, older files compressed,
/// the oldest removed, containerd told to reopen it; the rotated files hold
/// what the container wrote, and the live file goes on after the last one.
#[tokio::test]
async fn a_container_filling_its_log_stays_within_max_size_times_max_files() {
    use kubelet::log_rotation::{LogRotation, run};
    let test = "a_container_filling_its_log_stays_within_max_size_times_max_files";
    let Some(containerd) = Containerd::shared(test) else { return };
    let node = cri_node(containerd).await;
    let rotation = LogRotation { max_size: 256 << 10, max_files: 4, period: Duration::from_millis(100) };
    let provider: Arc<dyn Provider> = Arc::new(node.provider.clone());
    let stop = CancellationToken::new();
    tokio::spawn(run(rotation, node.root.path().to_owned(), node.pods.store().clone(), provider, stop.clone()));
    // About 1.5 MB at about 150 KB/s (six rotations), numbered lines.
    let script = "i=0; while [ $i -lt 300 ]; do printf \"line-%05d %s\\n\" $i $(head -c 5000 /dev/zero | tr '\\0' x); \
                  i=$((i+1)); usleep 30000; done; echo done-writing; exec sleep 600";
    let uid =
        node.run("chatty", script, serde_json::json!({"terminationGracePeriodSeconds": 1}), serde_json::json!({}));
    node.wait(&uid, "Running", running).await;
    let dir = node.root.path().join(format!("logs/pods/default_chatty_{uid}/main"));
    let live = dir.join("0.log");
    let total = || -> u64 {
        std::fs::read_dir(&dir)
            .map(|e| e.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
            .unwrap_or(0)
    };
    let limit = rotation.max_size * rotation.max_files as u64;
    let deadline = tokio::time::Instant::now() + SOON;
    let mut largest = 0;
    loop {
        largest = largest.max(total());
        let text = std::fs::read_to_string(&live).unwrap_or_default();
        if text.contains("done-writing") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the writer never finished");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("the log took {largest} bytes at most (limit {limit})");
    assert!(largest <= limit, "the log took {largest} bytes, over {limit}");
    let names: Vec<String> = std::fs::read_dir(&dir)
        .expect("dir")
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .collect();
    assert!(names.len() <= rotation.max_files, "{names:?}");
    let compressed: Vec<&String> = names.iter().filter(|n| n.ends_with(".gz")).collect();
    assert!(!compressed.is_empty(), "older files are compressed: {names:?}");
    assert_eq!(names.iter().filter(|n| n.starts_with("0.log.") && !n.ends_with(".gz")).count(), 1, "{names:?}");
    // The newest compressed file holds CRI lines of the writer's, in order.
    let mut newest = compressed.clone();
    newest.sort();
    let gz = std::fs::read(dir.join(newest.last().expect("one"))).expect("read gz");
    let mut text = String::new();
    std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&gz[..]), &mut text).expect("gunzip");
    let numbers: Vec<u32> =
        decode_cri_log(&text).iter().filter_map(|l| l.strip_prefix("line-")?.get(..5)?.parse().ok()).collect();
    assert!(!numbers.is_empty() && numbers.windows(2).all(|w| w[1] == w[0] + 1), "{numbers:?}");
    stop.cancel();
    node.pods.delete(&uid);
    let gone = node.pods.store().wait_for(SOON, |pods| pods.is_empty()).await;
    assert!(gone.is_some(), "the pod was removed");
}

/// Garbage, on a containerd of the test's own: a container that failed
/// three times before it ran leaves three exited containers; collection
/// keeps the newest (for `logs --previous`) and removes the others with
/// their log files. Then, with the image file system over a high threshold
/// of 0%, every unused image goes but the one the policy pins, the one a
/// container uses, and containerd's sandbox image.
#[tokio::test]
async fn exited_containers_and_unused_images_are_collected() {
    use kubelet::provider::ImageGcPolicy;
    use rustlet_testkit::containerd::PAUSE_IMAGE;
    let test = "exited_containers_and_unused_images_are_collected";
    let Some(containerd) = Containerd::private(test) else { return };
    let node = cri_node(&containerd).await;
    let script = "n=$(cat /data/n 2>/dev/null || echo 0); echo $((n+1)) > /data/n; echo run $n; \
                  [ $n -ge 3 ] && exec sleep 600; exit 1";
    let uid = node.run(
        "flaky",
        script,
        serde_json::json!({"restartPolicy": "OnFailure", "terminationGracePeriodSeconds": 1, "volumes": [{"name": "data", "emptyDir": {}}]}),
        serde_json::json!({"volumeMounts": [{"name": "data", "mountPath": "/data"}]}),
    );
    let settled = node.wait(&uid, "running after three failures", |p| running(p) && restarts(p, "main") == 3).await;
    assert_eq!(restarts(&settled, "main"), 3);
    let dir = node.root.path().join(format!("logs/pods/default_flaky_{uid}/main"));
    let logs = || {
        let mut names: Vec<String> =
            std::fs::read_dir(&dir).expect("logs").flatten().filter_map(|e| e.file_name().into_string().ok()).collect();
        names.sort();
        names
    };
    assert_eq!(logs(), ["0.log", "1.log", "2.log", "3.log"]);
    let report = node.provider.collect_containers(1).await.expect("collect containers");
    assert_eq!(report.removed.len(), 2, "{report:?}");
    assert_eq!(logs(), ["2.log", "3.log"], "the newest exited container's log stays for --previous");
    assert!(node.provider.collect_containers(1).await.expect("again").removed.is_empty(), "nothing more to remove");

    // Two images nobody uses (distinct configs, so distinct images).
    let mut pulled = Vec::new();
    for name in ["extra-a", "extra-b"] {
        let image = push_busybox(&node.registry, &format!("test/{name}"), "v1", &[], &[name]).await.expect("push");
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "default", "uid": name},
            "spec": {"containers": [{"name": "c", "image": image}]},
        }))
        .expect("pod");
        let container = pod.spec.as_ref().expect("spec").containers[0].clone();
        node.provider.prepare_image(&pod, &container).await.expect("pull");
        pulled.push((pod, container));
    }
    let policy = ImageGcPolicy {
        high_threshold_percent: 0,
        low_threshold_percent: 0,
        min_age: Duration::ZERO,
        pinned: vec![pulled[1].1.image.clone().expect("image")],
    };
    let report = node.provider.collect_images(&policy, false).await.expect("collect images");
    assert_eq!(report.removed.len(), 1, "only extra-a: {report:?}");
    assert!(report.freed > 0 && report.wanted > report.freed, "{report:?}");
    let present = |pod: &Pod, image: &str| {
        let mut container = pod.spec.as_ref().expect("spec").containers[0].clone();
        container.image = Some(image.to_owned());
        container.image_pull_policy = Some("Never".into());
        let provider = node.provider.clone();
        let pod = pod.clone();
        async move { provider.prepare_image(&pod, &container).await.is_ok() }
    };
    let extra_a = pulled[0].1.image.clone().expect("image");
    let extra_b = pulled[1].1.image.clone().expect("image");
    assert!(!present(&pulled[0].0, &extra_a).await, "the unused image was removed");
    assert!(present(&pulled[1].0, &extra_b).await, "the pinned image stays");
    assert!(present(&pulled[0].0, &node.image).await, "the image a container uses stays");
    assert!(present(&pulled[0].0, PAUSE_IMAGE).await, "the sandbox image stays");
    node.pods.delete(&uid);
    let gone = node.pods.store().wait_for(SOON, |pods| pods.is_empty()).await;
    assert!(gone.is_some(), "the pod was removed");
}

/// Disk pressure on a small root dir (a 64Mi tmpfs of the test's, on a
/// containerd of its own): a pod filling an emptyDir past the
/// `nodefs.available<24Mi` threshold is evicted after the node found
/// nothing of its own to reclaim, its emptyDir is released, its neighbour
/// runs on, DiskPressure refuses every new pod meanwhile and passes.
#[tokio::test]
async fn a_pod_filling_the_disk_is_evicted_alone() {
    use kubelet::eviction::Signal;
    use kubelet::eviction::pressure::Pressure;
    let test = "a_pod_filling_the_disk_is_evicted_alone";
    let Some(containerd) = Containerd::private(test) else { return };
    let Some(mut tmpfs) = rustlet_testkit::cgroups::TmpfsDir::new(test, 64 << 20) else { return };
    let pressure = Pressure::default();
    let shared = pressure.clone();
    let node = cri_node_in(tmpfs.take(), &containerd, 0, move |c| c.pressure = shared, |_| {}).await;
    let stop = node.start_eviction(&pressure, Signal::NodefsAvailable, 24 << 20, None);
    let quiet = node.run(
        "quiet",
        "exec sleep 600",
        serde_json::json!({"terminationGracePeriodSeconds": 1}),
        serde_json::json!({}),
    );
    node.wait(&quiet, "Running", running).await;
    assert!(!pressure.now().disk, "no pressure before the filler");
    let filler = node.run(
        "filler",
        "dd if=/dev/zero of=/data/fill bs=1M count=48 2>/dev/null; echo filled; exec sleep 600",
        serde_json::json!({"terminationGracePeriodSeconds": 30, "volumes": [{"name": "data", "emptyDir": {}}]}),
        serde_json::json!({"volumeMounts": [{"name": "data", "mountPath": "/data"}]}),
    );
    let evicted =
        node.wait(&filler, "evicted", |p| p.status.as_ref().and_then(|s| s.reason.as_deref()) == Some("Evicted")).await;
    let message = evicted.status.as_ref().and_then(|s| s.message.clone()).unwrap_or_default();
    assert!(
        message.starts_with("The node was low on resource: ephemeral-storage. Threshold quantity: 24Mi, available: "),
        "{message}"
    );
    assert!(pressure.now().disk, "DiskPressure holds for its transition period");
    let late = node.run(
        "late",
        "exec sleep 600",
        serde_json::json!({}),
        serde_json::json!({"resources": {"requests": {"memory": "1Mi"}}}),
    );
    let refused =
        node.wait(&late, "refused", |p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")).await;
    assert_eq!(
        refused.status.and_then(|s| s.message),
        Some("Pod was rejected: The node had condition: [DiskPressure]. ".to_owned()),
        "every pod is refused under disk pressure"
    );
    let mut changes = pressure.subscribe();
    let passed = tokio::time::timeout(SOON, changes.wait_for(|p| !p.disk)).await;
    assert!(passed.is_ok(), "DiskPressure turned False once the evicted pod's emptyDir was released");
    assert!(node.pods.store().get(&quiet).is_some_and(|p| running(&p)), "the quiet pod was never evicted");
    stop.cancel();
    for uid in [&quiet, &filler, &late] {
        node.pods.delete(uid);
    }
    let gone = node.pods.store().wait_for(SOON, |pods| pods.is_empty()).await;
    assert!(gone.is_some(), "the pods were removed");
}

/// Local ephemeral storage limits, as upstream's eviction manager checks
/// them with no threshold met: a container whose writable layer passes its
/// `ephemeral-storage` limit, a pod whose emptyDir passes its `sizeLimit`,
/// and a pod whose volumes pass its containers' limits together are each
/// evicted at once (`Failed`, `Evicted`, upstream's messages, no
/// `DisruptionTarget`); a pod within its limits runs on.
#[tokio::test]
async fn pods_over_their_local_storage_limits_are_evicted() {
    use kubelet::eviction::pressure::Pressure;
    let Some(containerd) = Containerd::shared("pods_over_their_local_storage_limits_are_evicted") else { return };
    let node = cri_node(containerd).await;
    let pressure = Pressure::default();
    let stop = node.start_eviction_with(&pressure, Vec::new(), None);
    let limit = |size: &str| serde_json::json!({"resources": {"limits": {"ephemeral-storage": size}}});
    let quiet = node.run("quiet", "exec sleep 600", serde_json::json!({}), limit("5Mi"));
    node.wait(&quiet, "Running", running).await;
    // Two containers: the pod's total (25Mi) holds, the writer's own limit
    // does not (a lone container would pass the pod's total first, which
    // upstream checks first).
    let writer = serde_json::json!({"name": "main", "image": node.image, "command": ["sh", "-c",
        "dd if=/dev/zero of=/file bs=1M count=10 2>/dev/null; exec sleep 600"],
        "resources": {"limits": {"ephemeral-storage": "5Mi"}}});
    let idle = serde_json::json!({"name": "idle", "image": node.image, "command": ["sleep", "600"],
        "resources": {"limits": {"ephemeral-storage": "20Mi"}}});
    let layer = node.run(
        "layer",
        "",
        serde_json::json!({"terminationGracePeriodSeconds": 30, "containers": [writer, idle]}),
        serde_json::json!({}),
    );
    let volume = node.run(
        "volume",
        "dd if=/dev/zero of=/data/file bs=1M count=2 2>/dev/null; exec sleep 600",
        serde_json::json!({"volumes": [{"name": "data", "emptyDir": {"sizeLimit": "1Mi"}}]}),
        serde_json::json!({"volumeMounts": [{"name": "data", "mountPath": "/data"}]}),
    );
    let mut within = limit("4Mi");
    within["volumeMounts"] = serde_json::json!([{"name": "data", "mountPath": "/data"}]);
    let total = node.run(
        "total",
        "dd if=/dev/zero of=/data/file bs=1M count=6 2>/dev/null; exec sleep 600",
        serde_json::json!({"volumes": [{"name": "data", "emptyDir": {}}]}),
        within,
    );
    let evicted = |p: &Pod| {
        let status = p.status.as_ref();
        status.and_then(|s| s.phase.as_deref()) == Some("Failed")
            && status.and_then(|s| s.reason.as_deref()) == Some("Evicted")
    };
    let message = |p: Pod| p.status.and_then(|s| s.message).unwrap_or_default();
    let uids = [quiet.clone(), layer.clone(), volume.clone(), total.clone()];
    let layer = node.wait(&layer, "evicted", evicted).await;
    let conditions = layer.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
    assert!(
        !conditions.iter().any(|c| c.type_ == "DisruptionTarget"),
        "no DisruptionTarget for a pod's own limit, as upstream: {conditions:?}"
    );
    assert_eq!(message(layer), "Container main exceeded its local ephemeral storage limit \"5Mi\". ");
    let volume = node.wait(&volume, "evicted", evicted).await;
    assert_eq!(message(volume), "Usage of EmptyDir volume \"data\" exceeds the limit \"1Mi\". ");
    let total = node.wait(&total, "evicted", evicted).await;
    assert_eq!(message(total), "Pod ephemeral local storage usage exceeds the total limit of containers 4Mi. ");
    assert!(node.pods.store().get(&quiet).is_some_and(|p| running(&p)), "the pod within its limit runs on");
    assert!(!pressure.now().disk, "no threshold was met");
    stop.cancel();
    for uid in &uids {
        node.pods.delete(uid);
    }
    let gone = node.pods.store().wait_for(SOON, |pods| pods.is_empty()).await;
    assert!(gone.is_some(), "the pods were removed");
}

/// A container over its 16Mi memory limit is killed by the kernel:
/// `OOMKilled`, exit code 137.
#[tokio::test]
async fn a_container_over_its_memory_limit_is_oom_killed() {
    let Some(containerd) = Containerd::shared("a_container_over_its_memory_limit_is_oom_killed") else { return };
    let node = cri_node(containerd).await;
    let uid = node.run(
        "hungry",
        "a=$(head -c 200000000 /dev/urandom); echo survived",
        serde_json::json!({}),
        serde_json::json!({"resources": {"limits": {"memory": "16Mi"}}}),
    );
    let done = node.wait(&uid, "finished", |p| terminated(p).is_some()).await;
    let end = terminated(&done).expect("terminated");
    assert_eq!((end.exit_code, end.reason.as_deref()), (137, Some("OOMKilled")), "{end:?}");
}

/// Removal stops a container with SIGTERM within its grace period: one
/// that exits on TERM ends at once with its own code; one that ignores
/// TERM is killed when the grace period (1 s) runs out.
#[tokio::test]
async fn removal_stops_containers_with_term_then_kill_after_the_grace_period() {
    let Some(containerd) = Containerd::shared("removal_stops_containers_with_term_then_kill_after_the_grace_period")
    else {
        return;
    };
    let node = cri_node(containerd).await;
    let out = tempfile::tempdir().expect("tempdir");
    let polite = node.run(
        "polite",
        "trap 'echo got TERM > /out/term; exit 0' TERM; echo ready; while :; do sleep 1 & wait $!; done",
        serde_json::json!({
            "terminationGracePeriodSeconds": 30,
            "volumes": [{"name": "out", "hostPath": {"path": out.path().display().to_string(), "type": "Directory"}}],
        }),
        serde_json::json!({"volumeMounts": [{"name": "out", "mountPath": "/out"}]}),
    );
    let stubborn = node.run(
        "stubborn",
        "trap '' TERM; echo ready; while :; do sleep 1; done",
        serde_json::json!({"terminationGracePeriodSeconds": 1}),
        serde_json::json!({}),
    );
    for (name, uid) in [("polite", &polite), ("stubborn", &stubborn)] {
        node.wait(uid, "Running", running).await;
        let log = node.root.path().join(format!("logs/pods/default_{name}_{uid}/main/0.log"));
        common::wait_file(&log, |t| t.contains("ready")).await;
    }
    node.pods.delete(&polite);
    node.pods.delete(&stubborn);
    let gone = node.pods.store().wait_for(SOON, |pods| pods.is_empty()).await;
    assert!(gone.is_some(), "both pods were removed: {:#?}", node.pods.store().list());
    let said = std::fs::read_to_string(out.path().join("term")).unwrap_or_default();
    assert_eq!(said, "got TERM\n", "the polite container handled TERM");
}

/// An image in a registry that wants a password: refused without the pod's
/// pull secret, pulled with it.
#[tokio::test]
async fn pull_secrets_are_the_registry_credentials() {
    use kubelet::provider::PullSecrets;
    let Some(containerd) = Containerd::shared("pull_secrets_are_the_registry_credentials") else { return };
    let registry = Registry::start_with_auth("puller", "s3cret").await.expect("registry");
    containerd.trust_registry(&registry.host());
    let image = push_busybox(&registry, "private/busybox", "v1", &[], &["sh"]).await.expect("push");
    let provider = CriProvider::new(CriConfig::new(containerd.endpoint()));
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "private", "namespace": "default", "uid": "cri-private"},
        "spec": {"containers": [{"name": "main", "image": image, "imagePullPolicy": "Always"}]},
    }))
    .expect("pod");
    let container = pod.spec.as_ref().expect("spec").containers[0].clone();
    let refused = provider.prepare_image(&pod, &container).await.expect_err("no credentials");
    assert!(refused.message.contains("pulling image"), "{refused}");
    let config = serde_json::json!({"auths": {registry.host(): {"username": "puller", "password": "s3cret"}}});
    let secrets = PullSecrets(vec![serde_json::to_vec(&config).expect("json")]);
    let pulled = provider.prepare_image_with_secrets(&pod, &container, &secrets).await.expect("pulled with the secret");
    assert!(pulled.image_id.starts_with("sha256:"), "{pulled:?}");

    // Without a pull secret for the registry (the pod's names another
    // one), the node's config.json is used.
    let dir = tempfile::tempdir().expect("tempdir");
    let docker_config = dir.path().join("config.json");
    let mut config_with_file = CriConfig::new(containerd.endpoint());
    config_with_file.docker_config = Some(docker_config.clone());
    let with_file = CriProvider::new(config_with_file);
    let refused = with_file.prepare_image(&pod, &container).await.expect_err("no config.json yet");
    assert!(refused.message.contains("pulling image"), "{refused}");
    std::fs::write(&docker_config, serde_json::to_vec(&config).expect("json")).expect("write config.json");
    let other = serde_json::json!({"auths": {"other.example:5000": {"username": "x", "password": "y"}}});
    let unrelated = PullSecrets(vec![serde_json::to_vec(&other).expect("json")]);
    let pulled =
        with_file.prepare_image_with_secrets(&pod, &container, &unrelated).await.expect("pulled with config.json");
    assert!(pulled.image_id.starts_with("sha256:"), "{pulled:?}");
}

/// A device plugin's allocation reaches the container: its env, its device
/// node (`/dev/fake-dev-0`, the host's `/dev/null`) and its mount.
#[tokio::test]
async fn a_device_plugins_device_env_and_mount_reach_the_container() {
    let Some(containerd) = Containerd::shared("a_device_plugins_device_env_and_mount_reach_the_container") else {
        return;
    };
    let node = cri_node_with_gpus(containerd, 1).await;
    // The fake plugin mounts `/run/fake-devices/<id>` from the host.
    let host_mount = std::path::Path::new("/run/fake-devices/dev-0");
    std::fs::create_dir_all(host_mount).expect("the plugin's mount source");
    let uid = node.run(
        "gpu",
        "echo \"$FAKE_DEVICES\"; test -c /dev/fake-dev-0 && echo char-device; test -d /var/run/fake/dev-0 && echo mounted",
        serde_json::json!({}),
        serde_json::json!({"resources": {"limits": {GPU: "1"}}}),
    );
    let done = node.wait(&uid, "finished", |p| terminated(p).is_some()).await;
    let lines = node.log("gpu", &uid);
    assert_eq!(terminated(&done).map(|t| t.exit_code), Some(0), "{lines:?}");
    let lines: Vec<&str> = lines.iter().map(|l| l.trim_end()).collect();
    assert_eq!(lines, ["dev-0", "char-device", "mounted"]);
    let _ = std::fs::remove_dir(host_mount);
}

/// `restartPolicy: Always` with a container that exits 1: restarted with
/// backoff (CrashLoopBackOff), its last run's exit code kept.
#[tokio::test]
async fn a_failing_container_is_restarted_with_backoff() {
    let Some(containerd) = Containerd::shared("a_failing_container_is_restarted_with_backoff") else { return };
    let node = cri_node(containerd).await;
    let uid =
        node.run("crashy", "echo once; exit 1", serde_json::json!({"restartPolicy": "Always"}), serde_json::json!({}));
    let restarted = node
        .wait(&uid, "restarted twice", |p| {
            p.status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|c| c.first())
                .is_some_and(|c| c.restart_count >= 2)
        })
        .await;
    let status =
        restarted.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|c| c.first()).expect("status");
    let last = status.last_state.as_ref().and_then(|s| s.terminated.as_ref()).expect("the last run");
    assert_eq!(last.exit_code, 1, "{status:?}");
    assert_eq!(phase(&restarted), Some("Running"), "a crash-looping pod is Running, as upstream");
}

/// An image the registry does not have: `ErrImagePull`, then
/// `ImagePullBackOff` naming the image, and the pod stays Pending.
#[tokio::test]
async fn a_missing_image_backs_off() {
    let Some(containerd) = Containerd::shared("a_missing_image_backs_off") else { return };
    let node = cri_node(containerd).await;
    let missing = node.registry.reference("test/missing", "v1");
    let uid = node.run("missing", "true", serde_json::json!({}), serde_json::json!({"image": missing}));
    let waiting = |p: &Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .and_then(|c| c.state.as_ref())
            .and_then(|s| s.waiting.clone())
    };
    let backing_off = node
        .wait(&uid, "in ImagePullBackOff", |p| {
            waiting(p).is_some_and(|w| w.reason.as_deref() == Some("ImagePullBackOff"))
        })
        .await;
    let message = waiting(&backing_off).and_then(|w| w.message).unwrap_or_default();
    assert!(message.contains(&missing), "{message}");
    assert_eq!(phase(&backing_off), Some("Pending"));
}

/// A whole node (`NodeBuilder` with the CRI provider) and a real CSI
/// driver on its `plugins_registry`: an inline CSI volume is published and
/// the container reads the driver's file in it; removal unpublishes it.
#[tokio::test]
async fn a_containers_inline_csi_volume_is_published_and_read_inside() {
    use kubelet::node::{NodeBuilder, NodeConfig};
    use rustlet_sample_plugins::csi_driver::{CsiDriverConfig, PUBLISHED_MARKER, RegisteredCsiDriver};
    use rustlet_sample_plugins::report::Reporter;
    let Some(containerd) = Containerd::shared("a_containers_inline_csi_volume_is_published_and_read_inside") else {
        return;
    };
    const DRIVER: &str = "cri.csi.example.com";
    let registry = Registry::start().await.expect("registry");
    containerd.trust_registry(&registry.host());
    let image = push_busybox(&registry, "test/busybox", "v1", &[], &["sh"]).await.expect("push");
    let root = rustlet_testkit::node_root::tempdir("rustlet-cri-csi-");
    for dir in ["plugins_registry", "manifests"] {
        std::fs::create_dir_all(root.path().join(dir)).expect("mkdir");
    }
    let stop = CancellationToken::new();
    let config = CsiDriverConfig { name: DRIVER.into(), node_id: "cri-node".into(), ..CsiDriverConfig::default() };
    let (calls, _) = RegisteredCsiDriver::new(
        root.path().join("plugins_registry/cri-csi-reg.sock"),
        root.path().join("cri-csi.sock"),
        config,
    )
    .spawn_recorded(Reporter::Discard, stop.child_token())
    .expect("csi driver");
    let mut node_config = NodeConfig::new(root.path(), "cri-node");
    node_config.http_address = None;
    node_config.pods.manifest_dir = Some(root.path().join("manifests"));
    node_config.pods.allocatable = Some(Allocatable { cpu_milli: 4000, memory: 8 << 30, pods: 110 });
    let node = NodeBuilder::new(node_config)
        .provider(Arc::new(CriProvider::new(CriConfig::new(containerd.endpoint()))))
        .start(stop.clone())
        .await
        .expect("node");
    let _stop = stop.clone().drop_guard();
    let manifest = format!(
        "apiVersion: storage.k8s.io/v1\nkind: CSIDriver\nmetadata: {{name: {DRIVER}}}\nspec: {{volumeLifecycleModes: [Ephemeral]}}\n---\n\
         apiVersion: v1\nkind: Pod\nmetadata: {{name: reader}}\nspec:\n  restartPolicy: Never\n  containers:\n  - name: main\n    image: {image}\n    \
         command: [sh, -c, 'cat /data/{PUBLISHED_MARKER}; echo']\n    volumeMounts: [{{name: data, mountPath: /data}}]\n  volumes:\n  - name: data\n    csi: {{driver: {DRIVER}}}\n"
    );
    std::fs::write(root.path().join("manifests/reader.yaml"), manifest).expect("manifest");
    let done = node
        .pods()
        .store()
        .wait_for(SOON, |pods| pods.values().any(|p| terminated(p).is_some()))
        .await
        .unwrap_or_else(|| panic!("never finished: {:#?}", node.pods().store().list()));
    let pod = done.values().next().expect("pod").clone();
    let uid = pod.metadata.uid.clone().expect("uid");
    assert_eq!(terminated(&pod).map(|t| t.exit_code), Some(0), "{:?}", pod.status);
    let published = calls.all().into_iter().find(|c| c.rpc == "NodePublishVolume").expect("published");
    let log = root.path().join(format!("logs/pods/default_reader-cri-node_{uid}/main/0.log"));
    let lines = decode_cri_log(&std::fs::read_to_string(&log).expect("log"));
    assert_eq!(
        lines.first().map(|l| l.trim_end()),
        Some(published.volume_id.as_str()),
        "the driver's file, read inside"
    );

    std::fs::remove_file(root.path().join("manifests/reader.yaml")).expect("rm");
    let unpublished = calls.wait_for(2, SOON).await;
    assert!(unpublished.iter().any(|c| c.rpc == "NodeUnpublishVolume"), "{unpublished:?}");
}

/// Probes of real containers, each driven by a file the test writes into
/// a hostPath volume: an httpGet readiness probe to busybox httpd at the
/// pod's IP, a tcpSocket readiness probe to a port that opens later, an
/// exec liveness probe (ExecSync) that restarts its container when it
/// fails, and a startup probe that holds the pod unready until it passes.
#[tokio::test]
async fn probes_drive_readiness_and_liveness_restarts() {
    let Some(containerd) = Containerd::shared("probes_drive_readiness_and_liveness_restarts") else { return };
    let node = cri_node(containerd).await;
    let ctl = node.root.path().join("ctl");
    std::fs::create_dir_all(&ctl).expect("mkdir");
    for file in ["ready", "alive"] {
        std::fs::write(ctl.join(file), "ok\n").expect("write");
    }
    let mount = serde_json::json!([{"name": "ctl", "mountPath": "/ctl"}]);
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "probed", "namespace": "default", "uid": "cri-probed"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "volumes": [{"name": "ctl", "hostPath": {"path": ctl.display().to_string(), "type": "Directory"}}],
            "containers": [
                {
                    "name": "web", "image": node.image, "command": ["httpd", "-f", "-p", "8080", "-h", "/ctl"],
                    "volumeMounts": mount,
                    "readinessProbe": every_second(serde_json::json!({"httpGet": {"port": 8080, "path": "/ready"}})),
                },
                {
                    "name": "tcp", "image": node.image, "volumeMounts": mount,
                    "command": ["sh", "-c", "until test -e /ctl/listen; do sleep 0.1; done; exec httpd -f -p 9000 -h /ctl"],
                    "readinessProbe": every_second(serde_json::json!({"tcpSocket": {"port": 9000}})),
                },
                {
                    "name": "live", "image": node.image, "command": ["sleep", "3600"], "volumeMounts": mount,
                    "livenessProbe": every_second(serde_json::json!({
                        "exec": {"command": ["cat", "/ctl/alive"]}, "failureThreshold": 2,
                        "terminationGracePeriodSeconds": 1,
                    })),
                    // Ready only while its probe passes: after the restart,
                    // ready means the new instance was probed healthy.
                    "readinessProbe": every_second(serde_json::json!({"exec": {"command": ["cat", "/ctl/alive"]}})),
                },
                {
                    "name": "slow", "image": node.image, "command": ["sleep", "3600"], "volumeMounts": mount,
                    "startupProbe": every_second(serde_json::json!({
                        "exec": {"command": ["test", "-e", "/ctl/started"]}, "failureThreshold": 1000,
                    })),
                    "readinessProbe": every_second(serde_json::json!({"exec": {"command": ["true"]}})),
                },
            ],
        },
    }))
    .expect("pod");
    node.pods.apply(pod);
    let uid = "cri-probed";
    let first = node
        .wait(uid, "web and live ready", |p| {
            container_ready(p, "web") && container_ready(p, "live") && phase(p) == Some("Running")
        })
        .await;
    assert!(!container_ready(&first, "tcp") && !pod_ready(&first), "nothing listens on 9000 yet");
    let slow = container_status(&first, "slow").expect("slow");
    assert_eq!((slow.started, slow.ready), (Some(false), false), "the startup probe has not passed: {slow:?}");

    std::fs::write(ctl.join("listen"), "").expect("write");
    node.wait(uid, "tcp ready", |p| container_ready(p, "tcp")).await;
    std::fs::write(ctl.join("started"), "").expect("write");
    let all = node.wait(uid, "every container ready", pod_ready).await;
    assert_eq!(container_status(&all, "slow").and_then(|c| c.started), Some(true));

    std::fs::remove_file(ctl.join("ready")).expect("rm");
    let unready = node.wait(uid, "web unready", |p| !container_ready(p, "web") && !pod_ready(p)).await;
    assert_eq!(restarts(&unready, "web"), 0, "readiness never restarts");
    std::fs::write(ctl.join("ready"), "ok\n").expect("write");
    node.wait(uid, "ready again", pod_ready).await;

    std::fs::remove_file(ctl.join("alive")).expect("rm");
    let restarted = node.wait(uid, "live restarted", |p| restarts(p, "live") >= 1).await;
    std::fs::write(ctl.join("alive"), "ok\n").expect("write");
    let last =
        container_status(&restarted, "live").and_then(|c| c.last_state.as_ref()).and_then(|s| s.terminated.clone());
    let last = last.expect("the killed run");
    let message = last.message.clone().unwrap_or_default();
    assert!(message.contains("Liveness probe failed: cat: can't open '/ctl/alive'"), "{last:?}");
    assert_eq!(last.exit_code, 137, "killed after its 1 s grace (sleep ignores TERM as PID 1): {last:?}");
    node.wait(uid, "live ready after its restart", |p| container_ready(p, "live")).await;
    assert_eq!(restarts(&restarted, "web") + restarts(&restarted, "tcp") + restarts(&restarted, "slow"), 0);
}

/// Containers on `containerd` (handler `runc`) beside WebAssembly
/// (handler `wasmtime`) with the example module `example` imported as
/// `example.com/wasm/<example>:v1`.
fn containerd_and_wasm(
    containerd: &Containerd,
    root: &std::path::Path,
    example: &str,
) -> kubelet::runtime_class::RuntimeClasses {
    let wasi = rustlet_wasi::WasiProvider::new(rustlet_wasi::WasiConfig::new(root)).expect("wasi");
    let layout = root.join("layout");
    let module = rustlet_wasi::examples::binary(example).expect("module");
    let reference = format!("example.com/wasm/{example}:v1");
    rustlet_wasi::import::write_layout(&layout, &[(reference.as_str(), &module)]).expect("layout");
    rustlet_wasi::import::import(wasi.images(), &layout, None).expect("import");
    kubelet::runtime_class::RuntimeClasses::new(
        "runc",
        Arc::new(CriProvider::new(CriConfig::new(containerd.endpoint()))),
    )
    .with_handler("wasmtime", Arc::new(wasi))
}

/// Cluster mode with two runtimes, through the API server (the real
/// kube-apiserver, and the in-process one): RuntimeClass objects are read
/// from the API, so a pod of class `wasm-<node>` (handler `wasmtime`) runs
/// as WebAssembly and a pod without one as a container on containerd, each
/// with its status (pod IP, readiness from an exec probe, container IDs
/// with their runtime) in the API; a pod naming a class the API lacks is
/// refused by admission; deletion is finished by the node.
async fn a_cluster_runs_pods_on_the_runtime_of_their_class(api: rustlet_testkit::test_api::TestApi) {
    use k8s_openapi::api::node::v1::RuntimeClass;
    use kube::api::{Api, DeleteParams, PostParams};
    let Some(cluster) = CriCluster::start(&api, "cluster_runtime_class").await else { return };
    let image = cluster.image.clone();

    let class = format!("wasm-{}", api.node);
    let runtime_classes: Api<RuntimeClass> = Api::all(api.admin.clone());
    let object: RuntimeClass =
        serde_json::from_value(serde_json::json!({"metadata": {"name": class}, "handler": "wasmtime"})).expect("class");
    match runtime_classes.create(&PostParams::default(), &object).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(error) => panic!("RuntimeClass {class}: {error}"),
    }
    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    let pod = |name: &str, class: Option<&str>, container: serde_json::Value| -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "nodeName": api.node, "runtimeClassName": class, "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 1, "containers": [container],
            },
        }))
        .expect("pod")
    };
    let refused = pods
        .create(
            &PostParams::default(),
            &pod("no-class", Some("no-such-class"), serde_json::json!({"name": "main", "image": image})),
        )
        .await
        .expect_err("admission refuses a missing RuntimeClass");
    assert!(refused.to_string().contains("RuntimeClass \"no-such-class\" not found"), "{refused}");
    // Validation: Bidirectional propagation only for a privileged container.
    let mount = serde_json::json!([{"name": "h", "mountPath": "/h", "mountPropagation": "Bidirectional"}]);
    let refused = pods
        .create(
            &PostParams::default(),
            &pod("bidirectional", None, serde_json::json!({"name": "main", "image": image, "volumeMounts": mount})),
        )
        .await
        .expect_err("validation refuses Bidirectional in an unprivileged container");
    assert!(
        refused.to_string().contains(
            "spec.containers[0].volumeMounts.mountPropagation: Forbidden: Bidirectional mount propagation is \
             available only to privileged containers"
        ),
        "{refused}"
    );

    let (box_pod, wasm_pod) = (format!("box-{}", api.node), format!("wasm-{}", api.node));
    let container = serde_json::json!({
        "name": "main", "image": image, "command": ["sh", "-c", "touch /tmp/ready; exec sleep 600"],
        "readinessProbe": {"exec": {"command": ["test", "-e", "/tmp/ready"]}, "periodSeconds": 1},
    });
    pods.create(&PostParams::default(), &pod(&box_pod, None, container)).await.expect("create box");
    let module = serde_json::json!({"name": "main", "image": "example.com/wasm/sleep:v1", "imagePullPolicy": "Never"});
    pods.create(&PostParams::default(), &pod(&wasm_pod, Some(&class), module)).await.expect("create wasm");

    let status_of = |p: Option<&Pod>| p.and_then(|p| p.status.clone()).unwrap_or_default();
    let first = |p: Option<&Pod>| status_of(p).container_statuses.and_then(|c| c.into_iter().next());
    let running = api
        .wait_for(&pods, &box_pod, "Running and ready on containerd", SOON, |p| {
            first(p).is_some_and(|c| c.ready && c.container_id.is_some_and(|id| id.starts_with("containerd://")))
        })
        .await;
    let ip = status_of(running.as_ref()).pod_ip.unwrap_or_default();
    assert!(ip.starts_with("10."), "the sandbox's IP is the pod's: {ip:?}");
    api.wait_for(&pods, &wasm_pod, "Running on wasmtime", SOON, |p| {
        first(p).is_some_and(|c| c.ready && c.container_id.is_some_and(|id| id.starts_with("wasmtime://")))
    })
    .await;

    for name in [&box_pod, &wasm_pod] {
        pods.delete(name, &DeleteParams::default()).await.expect("delete");
    }
    for name in [&box_pod, &wasm_pod] {
        api.wait_for(&pods, name, "gone", SOON, |p| p.is_none()).await;
    }
}
rustlet_testkit::on_both_api_servers!(
    a_cluster_runs_pods_on_the_runtime_of_their_class_on,
    a_cluster_runs_pods_on_the_runtime_of_their_class
);

/// A cluster node on a containerd of its own (and the WebAssembly provider
/// for class handler `wasmtime`), with a busybox image in a loopback
/// registry; stopped when dropped.
struct CriCluster {
    image: String,
    _stop: tokio_util::sync::DropGuard,
    node: kubelet::node::Node,
    _root: tempfile::TempDir,
    _registry: Registry,
    _containerd: Containerd,
}

impl CriCluster {
    /// `None` when containerd cannot run here (the skip is recorded).
    async fn start(api: &rustlet_testkit::test_api::TestApi, test: &str) -> Option<CriCluster> {
        Self::start_with(api, &format!("{test}_{}", api.kind()), "sleep", |_| {}).await
    }

    /// The same with a containerd named `containerd_name`, the sample
    /// WebAssembly module `module`, and `configure` applied to the node's
    /// configuration.
    async fn start_with(
        api: &rustlet_testkit::test_api::TestApi,
        containerd_name: &str,
        module: &str,
        configure: impl FnOnce(&mut kubelet::node::NodeConfig),
    ) -> Option<CriCluster> {
        use kubelet::cluster::{ApiSource, ClusterSettings};
        use kubelet::node::{NodeBuilder, NodeConfig};
        let containerd = Containerd::private(containerd_name)?;
        let registry = Registry::start().await.expect("registry");
        containerd.trust_registry(&registry.host());
        let image = push_busybox(&registry, "test/busybox", "v1", &[], &["sh"]).await.expect("push busybox");
        let root = rustlet_testkit::node_root::tempdir("rustlet-cri-cluster-");
        let classes = containerd_and_wasm(&containerd, root.path(), module);
        let mut settings = ClusterSettings::new(ApiSource::Client(api.node_client.clone()));
        settings.runtime_classes = Some(classes.class_handlers());
        let mut config = NodeConfig::new(root.path(), api.node.clone());
        config.http_address = None;
        configure(&mut config);
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone().drop_guard();
        let node = NodeBuilder::new(config)
            .provider(Arc::new(classes))
            .cluster(settings)
            .start(shutdown.clone())
            .await
            .expect("node");
        Some(CriCluster { image, _stop: stop, node, _root: root, _registry: registry, _containerd: containerd })
    }
}

/// Upstream's "Pods Extended Pod Container Status" specs on containerd
/// ("should never report success for a pending container", "should never
/// report container start when an init container fails"): pods whose
/// container or init container exits 1, deleted at each point of their
/// lives, never show a status those specs refuse (`pod_deletion`).
async fn a_deleted_containers_pods_statuses_keep_upstreams_rules(api: rustlet_testkit::test_api::TestApi) {
    use kube::api::Api;
    let Some(cluster) = CriCluster::start(&api, "cluster_pod_deletion").await else { return };
    let image = cluster.image.clone();
    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    let errors = rustlet_testkit::pod_deletion::run_scenarios(&pods, &api.node, &image, SOON).await;
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}
rustlet_testkit::on_both_api_servers!(
    a_deleted_containers_pods_statuses_keep_upstreams_rules_on,
    a_deleted_containers_pods_statuses_keep_upstreams_rules
);

/// The sandbox's resolv.conf follows the pod's dnsPolicy and dnsConfig:
/// ClusterFirst gets the cluster's DNS and searches, Default the node's
/// resolv.conf, None only its dnsConfig.
#[tokio::test]
async fn a_pods_resolv_conf_follows_its_dns_policy() {
    let Some(containerd) = Containerd::shared("a_pods_resolv_conf_follows_its_dns_policy") else { return };
    let node = cri_node(containerd).await;
    let cat = "cat /etc/resolv.conf";
    let cases = [
        ("dns-cluster", serde_json::json!({})),
        ("dns-default", serde_json::json!({"dnsPolicy": "Default"})),
        (
            "dns-none",
            serde_json::json!({"dnsPolicy": "None", "dnsConfig": {
                "nameservers": ["198.51.100.1"], "searches": ["only.example"], "options": [{"name": "ndots", "value": "1"}]
            }}),
        ),
    ];
    let uids: Vec<(String, String)> = cases
        .into_iter()
        .map(|(name, extra)| (name.to_owned(), node.run(name, cat, extra, serde_json::json!({}))))
        .collect();
    let mut seen = Vec::new();
    for (name, uid) in &uids {
        node.wait(uid, "Succeeded", |p| phase(p) == Some("Succeeded")).await;
        let lines: Vec<String> =
            node.log(name, uid).iter().map(|l| l.trim().to_owned()).filter(|l| !l.is_empty()).collect();
        seen.push(lines);
    }
    let has = |lines: &[String], line: &str| lines.iter().any(|l| l == line);
    assert!(has(&seen[0], "nameserver 10.96.0.10"), "{:?}", seen[0]);
    assert!(
        has(&seen[0], "search default.svc.cluster.local svc.cluster.local cluster.local corp.example"),
        "{:?}",
        seen[0]
    );
    assert!(has(&seen[0], "options ndots:5"), "{:?}", seen[0]);
    assert!(has(&seen[1], "nameserver 192.0.2.53") && has(&seen[1], "search corp.example"), "{:?}", seen[1]);
    assert!(!seen[1].iter().any(|l| l.contains("10.96.0.10")), "{:?}", seen[1]);
    assert!(has(&seen[2], "nameserver 198.51.100.1") && has(&seen[2], "search only.example"), "{:?}", seen[2]);
    assert!(has(&seen[2], "options ndots:1"), "{:?}", seen[2]);
}

/// The streaming seam: `Exec`, `Attach` and `PortForward` answer the
/// runtime's streaming URLs (the kubelet API will send clients there).
#[tokio::test]
async fn exec_attach_and_port_forward_answer_the_runtimes_streaming_urls() {
    use kubelet::provider::{ContainerId, StreamRequest, StreamingEndpoint};
    let Some(containerd) = Containerd::shared("exec_attach_and_port_forward_answer_the_runtimes_streaming_urls") else {
        return;
    };
    let node = cri_node(containerd).await;
    let uid = node.run(
        "streams",
        "exec sleep 600",
        serde_json::json!({"terminationGracePeriodSeconds": 1}),
        serde_json::json!({}),
    );
    let pod = node.wait(&uid, "Running", running).await;
    let shown = container_status(&pod, "main").and_then(|c| c.container_id.clone()).expect("a container ID");
    let id = ContainerId(shown.strip_prefix("containerd://").expect("the runtime's scheme").to_owned());
    let interactive = StreamRequest { command: vec!["sh".into()], tty: true, stdin: true, stdout: true, stderr: false };
    let url = |endpoint: Result<StreamingEndpoint, kubelet::provider::ProviderError>| {
        let StreamingEndpoint::Url(url) = endpoint.expect("a streaming endpoint") else { panic!("not a URL") };
        url
    };
    let exec = url(node.provider.exec(&id, &interactive).await);
    let attach =
        url(node.provider.attach(&id, &StreamRequest { stdout: true, stderr: true, ..StreamRequest::default() }).await);
    let forward = url(node.provider.port_forward(&uid, &[8080]).await);
    for (url, path) in [(&exec, "/exec/"), (&attach, "/attach/"), (&forward, "/portforward/")] {
        assert!(url.starts_with("http://127.0.0.1:") && url.contains(path), "{url}");
    }
    let unknown = node.provider.port_forward("no-such-pod", &[80]).await.expect_err("no sandbox");
    assert_eq!(unknown.kind, kubelet::provider::ProviderErrorKind::NotFound);
}

/// Probes stop when the pod is being removed: a container whose liveness
/// probe fails once it got TERM (it cleans up for 3 s) still ends on its
/// own within the grace period instead of being killed by the probe.
#[tokio::test]
async fn a_liveness_probe_does_not_cut_a_graceful_stop_short() {
    let Some(containerd) = Containerd::shared("a_liveness_probe_does_not_cut_a_graceful_stop_short") else { return };
    let node = cri_node(containerd).await;
    let ctl = node.root.path().join("ctl-graceful");
    std::fs::create_dir_all(&ctl).expect("mkdir");
    std::fs::write(ctl.join("alive"), "ok\n").expect("write");
    let script = "trap 'rm -f /ctl/alive; sleep 3; touch /ctl/clean; exit 0' TERM; while :; do sleep 1 & wait $!; done";
    let uid = node.run(
        "graceful",
        script,
        serde_json::json!({
            "terminationGracePeriodSeconds": 30,
            "volumes": [{"name": "ctl", "hostPath": {"path": ctl.display().to_string(), "type": "Directory"}}],
        }),
        serde_json::json!({
            "volumeMounts": [{"name": "ctl", "mountPath": "/ctl"}],
            "livenessProbe": every_second(serde_json::json!({
                "exec": {"command": ["cat", "/ctl/alive"]}, "terminationGracePeriodSeconds": 1,
            })),
            // Ready once its liveness file is read: the probes run.
            "readinessProbe": every_second(serde_json::json!({"exec": {"command": ["cat", "/ctl/alive"]}})),
        }),
    );
    node.wait(&uid, "probed ready", |p| container_ready(p, "main")).await;
    node.pods.delete(&uid);
    let gone = node.pods.store().wait_for(SOON, |pods| !pods.contains_key(&uid)).await;
    assert!(gone.is_some(), "the pod was removed");
    assert!(ctl.join("clean").exists(), "the container finished its cleanup: no probe killed it");
}

/// `kubectl exec`, `attach` and `port-forward` through the real
/// kube-apiserver to a container on containerd: the node's kubelet API
/// joins the API server's upgraded connection to containerd's streaming
/// server. Output, stderr, the exit code and stdin reach kubectl; attach
/// talks to the running process; a forwarded port reaches the container's
/// server (on loopback). A WebAssembly container's exec runs a fresh
/// instance of its module with kubectl's stdin, stdout, stderr and exit
/// code; attach follows the running module's output.
#[tokio::test]
async fn kubectl_exec_attach_and_port_forward_reach_a_container() {
    use kube::api::{Api, DeleteParams, PostParams};
    use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
    let test = "kubectl_exec_attach_and_port_forward_reach_a_container";
    let Some(api) = rustlet_testkit::test_api::TestApi::real(test).await else { return };
    let plane = api.control_plane().expect("real");
    let ip = rustlet_testkit::control_plane::host_ip().unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
    let configure = |config: &mut kubelet::node::NodeConfig| {
        config.node_ips = vec![ip];
        let mut kubelet_api = kubelet::server::KubeletApiConfig::new(&config.root_dir);
        kubelet_api.address = std::net::SocketAddr::new(ip, 0);
        kubelet_api.client_ca = Some(plane.ca_file());
        config.kubelet_api = Some(kubelet_api);
    };
    let Some(cluster) = CriCluster::start_with(&api, test, "talk", configure).await else { return };
    let (image, node) = (cluster.image.clone(), &cluster.node);
    let class = format!("wasm-{}", api.node);
    let runtime_classes: Api<k8s_openapi::api::node::v1::RuntimeClass> = Api::all(api.admin.clone());
    let object =
        serde_json::from_value(serde_json::json!({"metadata": {"name": class}, "handler": "wasmtime"})).expect("class");
    match runtime_classes.create(&PostParams::default(), &object).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(error) => panic!("RuntimeClass {class}: {error}"),
    }
    let (shell, wasm) = (format!("shell-{}", api.node), format!("wasm-{}", api.node));
    let script = "mkdir -p /www && echo hello-from-pod > /www/index.html && httpd -p 8080 -h /www \
                  && while read line; do echo \"got $line\"; done; exec sleep 600";
    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    for (name, class, container) in [
        (
            &shell,
            None,
            serde_json::json!({"name": "main", "image": image, "stdin": true, "command": ["sh", "-c", script]}),
        ),
        (
            &wasm,
            Some(class.as_str()),
            serde_json::json!({"name": "main", "image": "example.com/wasm/talk:v1", "imagePullPolicy": "Never"}),
        ),
    ] {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": api.node, "runtimeClassName": class, "automountServiceAccountToken": false,
                     "terminationGracePeriodSeconds": 1, "containers": [container]},
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod).await.expect("create");
    }
    for name in [&shell, &wasm] {
        api.wait_for(&pods, name, "running", SOON, |p| {
            p.and_then(|p| p.status.as_ref()?.container_statuses.as_ref()?.first()?.state.clone())
                .is_some_and(|s| s.running.is_some())
        })
        .await;
    }
    let kubectl = || tokio::process::Command::from(plane.kubectl());

    // exec: stdout, stderr and the exit code.
    let output = kubectl()
        .args(["exec", &shell, "--", "sh", "-c", "echo out; echo err >&2; exit 3"])
        .output()
        .await
        .expect("kubectl exec");
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert_eq!(stdout, "out\n", "{stderr}");
    assert!(stderr.contains("err"), "{stderr}");
    assert_eq!(output.status.code(), Some(3), "the command's exit code: {stderr}");
    // exec -i: stdin reaches the command.
    let mut cat = kubectl()
        .args(["exec", "-i", &shell, "--", "cat"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl exec -i");
    let mut stdin = cat.stdin.take().expect("stdin");
    stdin.write_all(b"piped input\n").await.expect("write");
    drop(stdin);
    let output = tokio::time::timeout(SOON, cat.wait_with_output()).await.expect("cat ends").expect("output");
    assert_eq!(String::from_utf8_lossy(&output.stdout), "piped input\n", "{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success());

    // attach: the running process reads what is typed and answers.
    let mut attach = kubectl()
        .args(["attach", "-i", &shell, "-c", "main"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("kubectl attach");
    let mut stdin = attach.stdin.take().expect("stdin");
    let mut out = tokio::io::BufReader::new(attach.stdout.take().expect("stdout"));
    let answered = async {
        // Typed until the session is up and the answer comes back.
        let mut line = String::new();
        loop {
            stdin.write_all(b"ping\n").await.expect("write");
            line.clear();
            if out.read_line(&mut line).await.expect("read") == 0 {
                panic!("attach ended without an answer");
            }
            if line.trim() == "got ping" {
                return;
            }
        }
    };
    tokio::time::timeout(SOON, answered).await.expect("the attached process answers");
    drop(attach);

    // port-forward: a local port reaches the container's server.
    let mut forward = kubectl()
        .args(["port-forward", &format!("pod/{shell}"), ":8080"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("kubectl port-forward");
    let mut out = tokio::io::BufReader::new(forward.stdout.take().expect("stdout"));
    let mut line = String::new();
    tokio::time::timeout(SOON, out.read_line(&mut line)).await.expect("forwarding").expect("read");
    // "Forwarding from 127.0.0.1:NNNNN -> 8080"
    let local = line
        .split_whitespace()
        .find(|w| w.starts_with("127.0.0.1:"))
        .unwrap_or_else(|| panic!("no local address in {line:?}"))
        .to_owned();
    let mut stream = tokio::net::TcpStream::connect(&local).await.expect("connect to the forwarded port");
    stream.write_all(b"GET /index.html HTTP/1.0\r\nHost: pod\r\n\r\n").await.expect("request");
    let mut answer = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut stream, &mut answer).await.expect("answer");
    assert!(answer.starts_with("HTTP/1.") && answer.ends_with("hello-from-pod\n"), "{answer}");
    drop(forward);

    // A WebAssembly container: exec runs a fresh instance of its module
    // with the command as its arguments, stdin, stdout, stderr and the
    // exit code as a process's.
    let mut talk = kubectl()
        .args(["exec", "-i", &wasm, "--", "talk", "x"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl exec -i");
    let mut stdin = talk.stdin.take().expect("stdin");
    stdin.write_all(b"hello wasm\nsecond line\n").await.expect("write");
    drop(stdin);
    let output = tokio::time::timeout(SOON, talk.wait_with_output()).await.expect("exec ends").expect("output");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(String::from_utf8_lossy(&output.stdout), "hello wasm\nsecond line\n", "{stderr}");
    assert!(stderr.contains("done"), "{stderr}");
    assert!(output.status.success(), "{stderr}");
    let output = kubectl().args(["exec", &wasm, "--", "talk", "a", "b", "c"]).output().await.expect("kubectl exec");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "the module's exit code: {stderr}");
    assert!(stderr.contains("command terminated with exit code 2"), "{stderr}");
    // attach: the running module's output as it writes it.
    let mut attach = kubectl()
        .args(["attach", &wasm, "-c", "main"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("kubectl attach");
    let mut out = tokio::io::BufReader::new(attach.stdout.take().expect("stdout"));
    let mut line = String::new();
    let ticked = async {
        loop {
            line.clear();
            if out.read_line(&mut line).await.expect("read") == 0 {
                panic!("attach ended without output");
            }
            if line.trim() == "tick" {
                return;
            }
        }
    };
    tokio::time::timeout(SOON, ticked).await.expect("the attached module's output arrives");
    drop(attach);
    // A direct client over WebSocket (v5.channel.k8s.io), with a client
    // certificate the cluster's CA signed.
    let address = node.kubelet_api_address().expect("kubelet API");
    let (cert_pem, key_pem) = plane.issue_client_certificate("ws-client", "system:masters").expect("certificate");
    let path = format!("/exec/default/{wasm}/main?command=talk&command=x&command=y&input=1&output=1&error=1");
    let output = rustlet_testkit::https::websocket_session(
        address,
        &path,
        rustlet_testkit::https::Credentials::Certificate { cert_pem: &cert_pem, key_pem: &key_pem },
        b"over websocket\n",
    )
    .await
    .expect("a WebSocket session");
    assert_eq!(String::from_utf8_lossy(&output.stdout), "over websocket\n", "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stderr), "done\n");
    let status: serde_json::Value = serde_json::from_str(&output.status).expect("a v1.Status");
    assert_eq!(status["reason"], "NonZeroExitCode", "{status}");
    assert_eq!(status["details"]["causes"][0]["message"], "1", "three arguments less 2: {status}");
    // A client that goes away in the middle of an exec leaves nothing
    // behind: the session ends, and the instance with it.
    let cert = || rustlet_testkit::https::Credentials::Certificate { cert_pem: &cert_pem, key_pem: &key_pem };
    let sessions = async || {
        rustlet_testkit::https::metric(address, "kubelet_api_streaming_sessions", cert()).await.expect("the gauge")
    };
    let mut talk = kubectl()
        .args(["exec", "-i", &wasm, "--", "talk", "x"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("kubectl exec -i");
    let mut stdin = talk.stdin.take().expect("stdin");
    let mut out = tokio::io::BufReader::new(talk.stdout.take().expect("stdout"));
    stdin.write_all(b"are you there\n").await.expect("write");
    let mut line = String::new();
    tokio::time::timeout(SOON, out.read_line(&mut line)).await.expect("an echo").expect("read");
    assert_eq!(line, "are you there\n");
    assert_eq!(sessions().await, 1.0, "the exec is a session");
    drop((stdin, out, talk));
    let deadline = tokio::time::Instant::now() + SOON;
    while sessions().await != 0.0 {
        assert!(tokio::time::Instant::now() < deadline, "the exec of a client that left did not end");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // /metrics/resource as metrics-server reads it: non-zero CPU and
    // memory for the running containers of both runtimes.
    let (code, metrics) = rustlet_testkit::https::get(address, "/metrics/resource", cert()).await.expect("metrics");
    assert_eq!(code, 200, "{metrics}");
    let sample = |series: &str, pod: &str| -> f64 {
        let prefix = format!("{series}{{container=\"main\",namespace=\"default\",pod=\"{pod}\"}} ");
        let line = metrics.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("{prefix} in {metrics}"));
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields.len(), 3, "value and timestamp: {line}");
        assert!(fields[2].parse::<i64>().is_ok_and(|ms| ms > 0), "a millisecond timestamp: {line}");
        fields[1].parse().unwrap_or_else(|_| panic!("a number: {line}"))
    };
    for pod in [&shell, &wasm] {
        assert!(sample("container_cpu_usage_seconds_total", pod) > 0.0, "{pod}: {metrics}");
        assert!(sample("container_memory_working_set_bytes", pod) > 0.0, "{pod}: {metrics}");
        assert!(sample("container_start_time_seconds", pod) > 1.7e9, "{pod}: {metrics}");
    }
    // Attaching stdin is refused with the reason; port-forward too.
    let output = kubectl().args(["attach", "-i", &wasm, "-c", "main"]).output().await.expect("kubectl attach -i");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("no stdin to attach to"), "{stderr}");
    let output = kubectl().args(["port-forward", &format!("pod/{wasm}"), ":8080"]).output().await.expect("pf");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("not supported for WebAssembly pods"), "{stderr}");

    for name in [&shell, &wasm] {
        pods.delete(name, &DeleteParams::default()).await.expect("delete");
    }
    for name in [&shell, &wasm] {
        api.wait_for(&pods, name, "gone", SOON, |p| p.is_none()).await;
    }
}

/// A container on containerd with a claim, on a real control plane with
/// upstream's DRA test driver (1.32+): the real scheduler allocates a
/// device of the driver's ResourceSlice to the pod's template claim, the
/// node prepares it and, containerd 1.6 ignoring the CRI's CDI field, adds
/// the env of the driver's CDI spec to the container itself (the Go
/// kubelet's container sees nothing of the claim on this runtime); the
/// pod's deletion unprepares it (the driver removes its spec).
#[tokio::test]
async fn a_container_on_containerd_sees_its_claims_cdi_env_from_upstreams_driver() {
    use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
    use kubelet::cluster::{ApiSource, ClusterSettings};
    use kubelet::node::{NodeBuilder, NodeConfig};
    use rustlet_testkit::dra_test_driver::{self as upstream, SCHEDULED, TEST_DRIVER, in_version, resource};
    let test = "a_container_on_containerd_sees_its_claims_cdi_env_from_upstreams_driver";
    let Some(api) = rustlet_testkit::test_api::TestApi::real(test).await else { return };
    let Some((binary, version)) = upstream::setting_up(test, &api).await else { return };
    let Some(containerd) = Containerd::shared(test) else { return };
    let plane = api.control_plane().expect("real");
    let registry = Registry::start().await.expect("registry");
    containerd.trust_registry(&registry.host());
    let image = push_busybox(&registry, "test/busybox", "v1", &[], &["sh"]).await.expect("push busybox");
    let root = rustlet_testkit::node_root::tempdir("rustlet-cri-dra-");
    let mut config = NodeConfig::new(root.path(), api.node.clone());
    config.http_address = None;
    config.pods.cdi_spec_dirs = vec![root.path().join("cdi")];
    config.plugins = common::test_config(&root.path().join("plugins_registry"));
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let provider = Arc::new(CriProvider::new(CriConfig::new(containerd.endpoint())));
    let node = NodeBuilder::new(config)
        .provider(provider)
        .cluster(ClusterSettings::new(ApiSource::Client(api.node_client.clone())))
        .start(shutdown.clone())
        .await
        .expect("node");
    let _driver = upstream::start(&binary, plane.admin_kubeconfig(), &api.node, root.path(), "driver.log");
    let connected = node.dra_drivers().wait_until(SOON, |i| i.iter().any(|i| i.driver == TEST_DRIVER && i.connected));
    assert!(connected.await, "{}", upstream::tail(&root.path().join("driver.log")));
    let slices: Api<DynamicObject> =
        Api::all_with(api.admin.clone(), &resource(version, "ResourceSlice", "resourceslices"));
    upstream::slice_devices(slices, &api.node, version, 4).await;

    let tag = std::process::id();
    let class = format!("rustlet-cri-{tag}");
    let classes: Api<DynamicObject> =
        Api::all_with(api.admin.clone(), &resource(version, "DeviceClass", "deviceclasses"));
    let device_class = serde_json::json!({"kind": "DeviceClass", "metadata": {"name": class},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{TEST_DRIVER}\"")}}]}});
    classes.create(&PostParams::default(), &in_version(device_class, version)).await.expect("DeviceClass");
    let template = format!("rustlet-cri-{tag}");
    let templates: Api<DynamicObject> = Api::namespaced_with(
        api.admin.clone(),
        "default",
        &resource(version, "ResourceClaimTemplate", "resourceclaimtemplates"),
    );
    let claim_template = serde_json::json!({"kind": "ResourceClaimTemplate",
    "metadata": {"name": template, "namespace": "default"},
    "spec": {"spec": {"devices": {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}],
        "config": [{"opaque": {"driver": TEST_DRIVER, "parameters": {"a": "b"}}}],
    }}}});
    templates.create(&PostParams::default(), &in_version(claim_template, version)).await.expect("template");
    let name = format!("cri-dra-{tag}");
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": api.node},
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [{"name": "main", "image": image, "command": ["sh", "-c", "env | sort; exec sleep 600"],
                            "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }))
    .expect("pod");
    let pods: Api<Pod> = Api::namespaced(api.admin.clone(), "default");
    pods.create(&PostParams::default(), &pod).await.expect("pod");
    let running = api
        .wait_for(&pods, &name, "Running", SCHEDULED, |p| {
            p.and_then(|p| p.status.as_ref()?.phase.clone()).is_some_and(|phase| phase == "Running")
        })
        .await
        .unwrap_or_else(|| {
            panic!("not Running; the driver's log:\n{}", upstream::tail(&root.path().join("driver.log")))
        });
    let uid = running.metadata.uid.clone().expect("uid");
    let claim = running
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|c| c.first()?.resource_claim_name.clone())
        .expect("the controller's claim");
    let marker = format!("claim_{}_gpu=true", claim.replace(|c: char| !c.is_ascii_alphanumeric(), "_"));
    let log = root.path().join(format!("logs/pods/default_{name}_{uid}/main/0.log"));
    let shown = rustlet_testkit::wait_file(&log, |t| t.contains("PATH="), SOON).await;
    let shown = decode_cri_log(&shown).join("\n");
    assert!(shown.contains("user_a=b") && shown.contains(&marker), "{marker} in {shown}");

    pods.delete(&name, &DeleteParams::default()).await.expect("delete");
    api.wait_for(&pods, &name, "deleted", SCHEDULED, |p| p.is_none()).await;
    upstream::wait_entries(&root.path().join("cdi"), 0).await;
}

/// In-place resize on containerd, checked as upstream's "Pod InPlace Resize
/// Container" specs check it: a Burstable pod in the kubelet's cgroup
/// hierarchy is given more cpu and memory by a new spec; its container
/// keeps running (same ID, no restart), reports the new size in its
/// status once the resize is done (no resize condition left), and reads
/// the new figures in its own cgroup (`cat` inside it, as the e2e specs
/// do: cpu shares or weight, cfs quota, memory limit); the pod's group
/// has the new limits too.
#[tokio::test]
async fn a_resize_reaches_the_running_containers_cgroup_on_containerd() {
    use kubelet::cgroups::{CgroupVersion, PodCgroups, QosCgroupSettings};
    use kubelet::provider::ContainerId;
    let test = "a_resize_reaches_the_running_containers_cgroup_on_containerd";
    let Some(containerd) = Containerd::shared(test) else { return };
    let Some(root) = rustlet_testkit::cgroups::TestCgroupRoot::new(test) else { return };
    let settings = QosCgroupSettings { root: root.name.clone(), ..QosCgroupSettings::new() };
    let cgroups = Arc::new(PodCgroups::start(root.fs.clone(), settings).expect("kubepods"));
    let node = cri_node_configured(containerd, 0, |_| {}, |c| c.pod_cgroups = Some(cgroups.clone())).await;
    let sized = |requests: (&str, &str), limits: (&str, &str)| {
        serde_json::json!({
            "resources": {
                "requests": {"cpu": requests.0, "memory": requests.1},
                "limits": {"cpu": limits.0, "memory": limits.1},
            },
            "resizePolicy": [
                {"resourceName": "cpu", "restartPolicy": "NotRequired"},
                {"resourceName": "memory", "restartPolicy": "NotRequired"},
            ],
        })
    };
    let extra = serde_json::json!({"restartPolicy": "Always", "terminationGracePeriodSeconds": 1});
    let uid = node.run("resize", "exec sleep 600", extra.clone(), sized(("100m", "32Mi"), ("200m", "64Mi")));
    let before = node.wait(&uid, "Running", running).await;
    let status = container_status(&before, "main").expect("status").clone();
    let id = status.container_id.clone().expect("id");
    let quantity = |pod: &Pod, list: &str, resource: &str| {
        let status = container_status(pod, "main").and_then(|c| c.resources.clone()).unwrap_or_default();
        let list = if list == "requests" { status.requests } else { status.limits };
        list.and_then(|l| l.get(resource).map(|q| q.0.clone())).unwrap_or_default()
    };
    assert_eq!(quantity(&before, "limits", "cpu"), "200m", "the status reports the size: {status:?}");
    assert_eq!(quantity(&before, "requests", "memory"), "32Mi");
    let bare = ContainerId(id.trim_start_matches("containerd://").to_owned());
    let cat = |path: &'static str| {
        let (provider, bare) = (node.provider.clone(), bare.clone());
        async move {
            let out = provider
                .exec_sync(&bare, &["cat".into(), path.into()], Duration::from_secs(30))
                .await
                .unwrap_or_else(|e| panic!("cat {path}: {e}"));
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        }
    };
    let v2 = root.fs.version() == CgroupVersion::V2;
    // Upstream's expectations: shares from the request (1024 per cpu),
    // their v2 weight, quota over a 100 ms period, the limit in bytes.
    let expect = |shares: u64, quota: u64, memory: u64| {
        if v2 {
            [
                ("/sys/fs/cgroup/cpu.weight", (1 + (shares - 2) * 9999 / 262_142).to_string()),
                ("/sys/fs/cgroup/cpu.max", format!("{quota} 100000")),
                ("/sys/fs/cgroup/memory.max", memory.to_string()),
            ]
        } else {
            [
                ("/sys/fs/cgroup/cpu/cpu.shares", shares.to_string()),
                ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", quota.to_string()),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", memory.to_string()),
            ]
        }
    };
    for (path, want) in expect(102, 20_000, 64 << 20) {
        assert_eq!(cat(path).await, want, "{path} before the resize");
    }

    // The new size, as the `resize` subresource writes it into the spec.
    node.run("resize", "exec sleep 600", extra, sized(("300m", "48Mi"), ("400m", "128Mi")));
    let resized = node
        .wait(&uid, "resized", |pod| {
            let conditions = pod.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
            quantity(pod, "limits", "memory") == "128Mi"
                && quantity(pod, "requests", "cpu") == "300m"
                && !conditions.iter().any(|c| c.type_.starts_with("PodResize"))
        })
        .await;
    let after = container_status(&resized, "main").expect("status");
    assert_eq!(after.container_id.as_deref(), Some(id.as_str()), "resized in place");
    assert_eq!(after.restart_count, 0);
    assert!(after.state.as_ref().is_some_and(|s| s.running.is_some()), "{after:?}");
    for (path, want) in expect(307, 40_000, 128 << 20) {
        assert_eq!(cat(path).await, want, "{path} after the resize");
    }
    let group = cgroups.pod_group(&resized);
    let pod_value = |controller: &str, file: &str| {
        let path = root.fs.dir(controller, &group).join(file);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).trim().to_owned()
    };
    if v2 {
        assert_eq!(pod_value("", "cpu.max"), "40000 100000");
        assert_eq!(pod_value("", "memory.max"), (128_u64 << 20).to_string());
    } else {
        assert_eq!(pod_value("cpu", "cpu.cfs_quota_us"), "40000");
        assert_eq!(pod_value("memory", "memory.limit_in_bytes"), (128_u64 << 20).to_string());
    }

    // A memory limit below what the pod uses now (40 MiB in its /dev/shm,
    // which the kernel cannot reclaim) is not set, as upstream: the resize
    // stays in progress with upstream's error, the limits are unchanged.
    let fill = ["sh".to_owned(), "-c".to_owned(), "dd if=/dev/zero of=/dev/shm/fill bs=1M count=40 2>&1".to_owned()];
    let filled = node.provider.exec_sync(&bare, &fill, Duration::from_secs(30)).await.expect("fill /dev/shm");
    assert_eq!(filled.exit_code, 0, "{}", String::from_utf8_lossy(&filled.stdout));
    node.run(
        "resize",
        "exec sleep 600",
        serde_json::json!({"restartPolicy": "Always", "terminationGracePeriodSeconds": 1}),
        sized(("300m", "16Mi"), ("400m", "32Mi")),
    );
    let refused = node
        .wait(&uid, "the resize in progress with its error", |pod| {
            let conditions = pod.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
            conditions.iter().any(|c| c.type_ == "PodResizeInProgress" && c.reason.as_deref() == Some("Error"))
        })
        .await;
    let conditions = refused.status.and_then(|s| s.conditions).unwrap_or_default();
    let message = conditions.iter().find(|c| c.type_ == "PodResizeInProgress").and_then(|c| c.message.clone());
    assert_eq!(
        message.as_deref(),
        Some("aborting attempt to set pod memory limit less than current memory usage for pod resize")
    );
    for (path, want) in expect(307, 40_000, 128 << 20) {
        assert_eq!(cat(path).await, want, "{path} after the refused resize");
    }
    node.pods.delete(&uid);
    let gone = node.pods.store().wait_for(SOON, |pods| pods.is_empty()).await;
    assert!(gone.is_some(), "the pod was removed");
}
