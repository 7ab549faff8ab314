//! The standalone node end to end: static pod manifests in a directory, the
//! node built by `NodeBuilder` with the host-process provider, a real device
//! plugin and real CSI driver processes, the HTTP `/pods` endpoint.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kubelet::node::{Node, NodeBuilder, NodeConfig};
use kubelet::pod::{Allocatable, BackoffConfig};
use kubelet::volume::StaticClaims;
use rustlet_testkit::host_provider::HostProcessProvider;
use rustlet_testkit::process::PluginProcess;
use rustlet_testkit::report::Report;
use tempfile::TempDir;
use tokio_util::sync::CancellationToken;

const GPU: &str = "vendor.example.com/gpu";
const DRIVER: &str = "data.csi.example.com";

struct StaticNode {
    root: TempDir,
    manifests: PathBuf,
    node: Node,
    shutdown: CancellationToken,
    _stop_on_drop: tokio_util::sync::DropGuard,
    plugins: Vec<PluginProcess>,
}

/// Node settings for tests: fast backoffs, liveness deadlines, rescans an
/// hour away (so every test proves the event-driven path).
fn test_node_config(root: &Path) -> NodeConfig {
    let mut config = NodeConfig::new(root, "Node-1");
    config.http_address = Some(([127, 0, 0, 1], 0).into());
    config.plugins = test_config(&root.join("plugins_registry"));
    config.devices.call_timeout = LIVENESS_DEADLINE;
    config.csi.node_get_info_timeout = LIVENESS_DEADLINE;
    config.pods.manifest_dir = Some(root.join("manifests"));
    config.pods.manifest_rescan = Duration::from_secs(3600);
    config.pods.allocatable = Some(Allocatable { cpu_milli: 4000, memory: 8 << 30, pods: 110 });
    config.pods.restart_backoff = BackoffConfig {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(400),
        reset_after: Duration::from_secs(600),
    };
    config.pods.csi_timeouts.volume = LIVENESS_DEADLINE;
    config
}

fn new_root() -> TempDir {
    let root = rustlet_testkit::node_root::tempdir("rustlet-static-");
    for dir in ["plugins_registry", "device-plugins", "manifests"] {
        std::fs::create_dir_all(root.path().join(dir)).expect("mkdir");
    }
    root
}

async fn start_node(tweak: impl FnOnce(&mut NodeConfig)) -> StaticNode {
    start_node_in(new_root(), None, tweak).await
}

async fn start_node_in(root: TempDir, claims: Option<StaticClaims>, tweak: impl FnOnce(&mut NodeConfig)) -> StaticNode {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let mut config = test_node_config(root.path());
    tweak(&mut config);
    let mut builder = NodeBuilder::new(config).provider(Arc::new(HostProcessProvider::new()));
    if let Some(claims) = claims {
        builder = builder.volume_claims(Arc::new(claims));
    }
    let shutdown = CancellationToken::new();
    let node = builder.start(shutdown.clone()).await.expect("node starts");
    let manifests = root.path().join("manifests");
    StaticNode { root, manifests, node, _stop_on_drop: shutdown.clone().drop_guard(), shutdown, plugins: Vec::new() }
}

fn phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref().and_then(|s| s.phase.as_deref())
}

fn message(pod: &Pod) -> String {
    pod.status.as_ref().and_then(|s| s.message.clone()).unwrap_or_default()
}

fn running(pod: &Pod) -> bool {
    let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.clone()).unwrap_or_default();
    !statuses.is_empty() && statuses.iter().all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
}

impl StaticNode {
    /// Writes a manifest as editors do: a hidden temp file renamed in place.
    fn write(&self, file: &str, text: &str) {
        let temp = self.manifests.join(format!(".{file}.tmp"));
        std::fs::write(&temp, text).expect("write manifest");
        std::fs::rename(&temp, self.manifests.join(file)).expect("rename manifest");
    }

    fn remove(&self, file: &str) {
        std::fs::remove_file(self.manifests.join(file)).expect("remove manifest");
    }

    /// Waits for the pod called `name` (in `default`) to satisfy `pred`.
    async fn wait_pod(&self, name: &str, what: &str, mut pred: impl FnMut(&Pod) -> bool) -> Pod {
        let named = |p: &&Pod| p.metadata.name.as_deref() == Some(name);
        let found = self.node.pods().store().wait_for(SOON, |pods| pods.values().filter(named).any(&mut pred)).await;
        match found {
            Some(pods) => pods.values().find(|p| named(p) && pred(p)).cloned().expect("found"),
            None => panic!(
                "timed out waiting for {what} of {name}; pods now: {:#?}; manifest errors: {:?}",
                self.node.pods().store().list().iter().map(|p| (&p.metadata.name, &p.status)).collect::<Vec<_>>(),
                self.node.static_pods().map(|s| s.errors())
            ),
        }
    }

    async fn wait_gone(&self, name: &str) {
        let gone = self
            .node
            .pods()
            .store()
            .wait_for(SOON, |pods| pods.values().all(|p| p.metadata.name.as_deref() != Some(name)))
            .await;
        assert!(gone.is_some(), "pod {name} still on the node");
    }

    /// Waits until the static pod source reports an error for `file` that
    /// satisfies `pred` (or, with `None`, no error for it).
    async fn wait_error(&self, file: &str, pred: impl Fn(Option<&String>) -> bool) -> Option<String> {
        let source = self.node.static_pods().expect("static pods");
        let path = self.manifests.join(file);
        let mut changes = source.changes();
        let wait = async {
            loop {
                let errors = source.errors();
                if pred(errors.get(&path)) {
                    return errors.get(&path).cloned();
                }
                changes.changed().await.expect("source alive");
            }
        };
        match tokio::time::timeout(SOON, wait).await {
            Ok(error) => error,
            Err(_) => panic!("timed out waiting on the manifest error of {file}; errors: {:?}", source.errors()),
        }
    }

    /// Starts the fake device plugin with `count` devices of [`GPU`].
    async fn add_gpus(&mut self, count: usize, extra: &[&str]) {
        let socket = self.root.path().join("device-plugins/gpu.sock").display().to_string();
        let count_text = count.to_string();
        let mut args = vec!["--socket", socket.as_str(), "--resource", GPU, "--count", count_text.as_str()];
        args.extend_from_slice(extra);
        let mut plugin = PluginProcess::spawn(device_plugin_bin(), args).await.expect("start fake-device-plugin");
        plugin.wait_for(SOON, |r| matches!(r, Report::DeviceRegistered { .. })).await.expect("registered");
        let mut capacity = self.node.devices().capacity();
        tokio::time::timeout(SOON, capacity.wait_for(|c| c.get(GPU).is_some_and(|c| c.allocatable == count as u64)))
            .await
            .expect("devices advertised in time")
            .expect("device manager alive");
        self.plugins.push(plugin);
    }

    /// Starts the fake CSI driver `DRIVER` with `extra` flags; returns it
    /// once registered.
    async fn start_driver(&self, extra: &[&str]) -> PluginProcess {
        let registration = self.root.path().join("plugins_registry/data-reg.sock").display().to_string();
        let endpoint = self.root.path().join("csi-data.sock").display().to_string();
        let mut args =
            vec!["--registration-socket", registration.as_str(), "--endpoint", endpoint.as_str(), "--name", DRIVER];
        args.extend_from_slice(extra);
        let mut driver = csi_driver(&args).await;
        driver
            .wait_for(SOON, |r| matches!(r, Report::Notified { registered: true, .. }))
            .await
            .expect("driver registered");
        tokio::time::timeout(SOON, async {
            let mut changes = self.node.csi_drivers().view().changes();
            while self.node.csi_drivers().get(DRIVER).is_none() {
                changes.changed().await.expect("registry alive");
            }
        })
        .await
        .expect("driver in the registry");
        driver
    }

    fn pod_dir(&self, uid: &str) -> PathBuf {
        self.root.path().join("pods").join(uid)
    }

    fn checkpoint_mentions(&self, uid: &str) -> bool {
        let checkpoint = std::fs::read_to_string(self.root.path().join("device-plugins/kubelet_internal_checkpoint"))
            .unwrap_or_default();
        checkpoint.contains(uid)
    }
}

/// Waits for the driver's report of `rpc`; returns its fields.
async fn volume_call(driver: &mut PluginProcess, rpc: &str) -> Report {
    driver
        .wait_for(SOON, |r| matches!(r, Report::VolumeCall { rpc: got, .. } if got == rpc))
        .await
        .unwrap_or_else(|e| panic!("no {rpc}: {e}"))
}

const CSI_DRIVER_DOC: &str = "apiVersion: storage.k8s.io/v1
kind: CSIDriver
metadata:
  name: data.csi.example.com
spec:
  podInfoOnMount: true
  volumeLifecycleModes: [Ephemeral, Persistent]
";

fn gpu_pod_with_csi(name: &str) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  serviceAccountName: reader
  containers:
  - name: main
    image: busybox
    command: [sh, -c, '{{ echo \"devices=$FAKE_DEVICES\"; cat \"$MOUNT_DATA/PUBLISHED\"; }} > \"$MOUNT_OUT/.{name}\" && mv \"$MOUNT_OUT/.{name}\" \"$MOUNT_OUT/{name}\"; exec sleep 600']
    resources:
      limits: {{\"{GPU}\": 1}}
    volumeMounts:
    - {{name: data, mountPath: /data}}
    - {{name: out, mountPath: /out}}
  volumes:
  - name: data
    csi:
      driver: {DRIVER}
      fsType: ext4
      volumeAttributes: {{size: 1Gi}}
  - name: out
    hostPath: {{path: OUT_DIR, type: Directory}}
"
    )
    .replace("PUBLISHED", rustlet_testkit::csi_driver::PUBLISHED_MARKER)
}

#[tokio::test]
async fn a_static_pod_gets_a_device_and_an_inline_csi_volume_and_removal_releases_both() {
    let mut node = start_node(|_| {}).await;
    node.add_gpus(2, &[]).await;
    let mut driver = node.start_driver(&[]).await;
    let out = node.root.path().join("out");
    std::fs::create_dir_all(&out).expect("mkdir");
    let manifest =
        format!("{CSI_DRIVER_DOC}---\n{}", gpu_pod_with_csi("web").replace("OUT_DIR", &out.display().to_string()));
    node.write("web.yaml", &manifest);

    let pod = node.wait_pod("web-node-1", "Running", running).await;
    let uid = pod.metadata.uid.clone().expect("uid");
    assert_eq!(uid.len(), 32, "a static pod's UID is a hash");
    assert_eq!(pod.metadata.namespace.as_deref(), Some("default"));

    // What the driver was asked.
    let Report::VolumeCall { volume_id, target_path, staging_target_path, volume_context, access_mode, .. } =
        volume_call(&mut driver, "NodePublishVolume").await
    else {
        unreachable!()
    };
    assert!(volume_id.starts_with("csi-") && volume_id.len() == 4 + 64, "inline handle: {volume_id}");
    let expected_target = node.pod_dir(&uid).join("volumes/kubernetes.io~csi/data/mount");
    assert_eq!(Path::new(&target_path), expected_target);
    assert!(staging_target_path.is_empty(), "inline volumes are not staged");
    assert_eq!(access_mode, 1, "SINGLE_NODE_WRITER");
    let context: BTreeMap<String, String> = volume_context.into_iter().collect();
    assert_eq!(context.get("size").map(String::as_str), Some("1Gi"));
    assert_eq!(context.get("csi.storage.k8s.io/ephemeral").map(String::as_str), Some("true"));
    assert_eq!(context.get("csi.storage.k8s.io/pod.name").map(String::as_str), Some("web-node-1"));
    assert_eq!(context.get("csi.storage.k8s.io/pod.namespace").map(String::as_str), Some("default"));
    assert_eq!(context.get("csi.storage.k8s.io/pod.uid"), Some(&uid));
    assert_eq!(context.get("csi.storage.k8s.io/serviceAccount.name").map(String::as_str), Some("reader"));
    let vol_data = std::fs::read_to_string(expected_target.with_file_name("vol_data.json")).expect("vol_data.json");
    assert!(vol_data.contains(DRIVER) && vol_data.contains("Ephemeral"), "{vol_data}");

    // The container saw its volume (the driver's marker) and its device.
    let written = tokio::time::timeout(SOON, async {
        loop {
            if let Ok(text) = std::fs::read_to_string(out.join("web")) {
                return text;
            }
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the container wrote no file; its log: {:?}", container_logs(node.root.path())));
    assert!(written.contains(&volume_id), "the container read the published volume: {written:?}");
    let devices = written.lines().next().and_then(|l| l.strip_prefix("devices=")).unwrap_or_default();
    assert!(!devices.is_empty(), "the container got its device env: {written:?}");
    assert_eq!(node.node.devices().allocated(&uid, "main").get(GPU).map(Vec::len), Some(1));
    assert!(node.checkpoint_mentions(&uid), "allocation checkpointed");

    // /pods lists it, Running.
    let body = http_get(&node.node.local_socket(), "/pods").await;
    let list: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(list["kind"], "PodList");
    let listed = list["items"].as_array().expect("items").iter().find(|p| p["metadata"]["uid"] == uid.as_str());
    assert_eq!(listed.expect("listed")["status"]["phase"], "Running");

    // Removing the manifest releases everything.
    node.remove("web.yaml");
    let Report::VolumeCall { target_path: unpublished, .. } = volume_call(&mut driver, "NodeUnpublishVolume").await
    else {
        unreachable!()
    };
    assert_eq!(Path::new(&unpublished), expected_target);
    node.wait_gone("web-node-1").await;
    assert!(node.node.devices().allocated(&uid, "main").is_empty(), "device freed");
    tokio::time::timeout(SOON, node.node.devices().persisted()).await.expect("in time").expect("checkpoint written");
    assert!(!node.checkpoint_mentions(&uid), "checkpoint clean");
    assert!(!node.pod_dir(&uid).exists(), "pod dir removed");
    assert!(node.node.csi_driver_objects().get(DRIVER).is_none(), "the CSIDriver left with its file");
}

/// Every container log under the root dir (for failure messages).
fn container_logs(root: &Path) -> Vec<(PathBuf, String)> {
    let mut found = Vec::new();
    let mut dirs = vec![root.join("logs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                found.push((path.clone(), std::fs::read_to_string(&path).unwrap_or_default()));
            }
        }
    }
    found
}

/// A GET on the node's local socket (HTTP/1.0, read to the end).
async fn http_get(socket: &Path, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::UnixStream::connect(socket).await.expect("connect");
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes()).await.expect("send");
    let mut raw = String::new();
    tokio::time::timeout(SOON, stream.read_to_string(&mut raw)).await.expect("in time").expect("read");
    let (head, body) = raw.split_once("\r\n\r\n").expect("http");
    assert!(head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"), "{head}\n{body}");
    body.to_owned()
}

const SLEEPER: &str = "apiVersion: v1
kind: Pod
metadata:
  name: NAME
spec:
  containers:
  - name: main
    image: IMAGE
    command: [sleep, '600']
";

fn sleeper(name: &str, image: &str) -> String {
    SLEEPER.replace("NAME", name).replace("IMAGE", image)
}

#[tokio::test]
async fn manifests_are_followed_and_bad_ones_never_stop_the_others() {
    let node = start_node(|_| {}).await;
    node.write("a.yaml", &sleeper("a", "v1"));
    let first = node.wait_pod("a-node-1", "Running", running).await;
    let first_uid = first.metadata.uid.clone().expect("uid");

    // A changed manifest is a new pod (new UID); the old one goes.
    node.write("a.yaml", &sleeper("a", "v2"));
    let second = node
        .wait_pod("a-node-1", "the new version Running", |p| {
            running(p) && p.metadata.uid.as_deref() != Some(first_uid.as_str())
        })
        .await;
    let second_uid = second.metadata.uid.clone().expect("uid");
    let gone = node.node.pods().store().wait_for(SOON, |pods| !pods.contains_key(&first_uid)).await;
    assert!(gone.is_some(), "the old version was removed");

    // Garbage: an error naming the file; pod a keeps running.
    node.write("junk.yaml", "kind: Pod\nmetadata: [unclosed\n");
    let error = node.wait_error("junk.yaml", |e| e.is_some()).await.expect("error");
    assert!(error.contains("not valid YAML"), "{error}");
    node.write("svc.json", r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}}"#);
    let error = node.wait_error("svc.json", |e| e.is_some()).await.expect("error");
    assert!(error.contains("is a Service, not a Pod"), "{error}");

    // A broken save of a.yaml leaves its pod as it was.
    node.write("a.yaml", "{ not json");
    node.wait_error("a.yaml", |e| e.is_some()).await;
    assert!(node.node.pods().store().get(&second_uid).is_some_and(|p| running(&p)), "a still runs");

    // The same pod name from another file is refused, naming the first file.
    node.write("a.yaml", &sleeper("a", "v2"));
    node.wait_error("a.yaml", |e| e.is_none()).await;
    node.write("b.yaml", &sleeper("a", "v3"));
    let error = node.wait_error("b.yaml", |e| e.is_some()).await.expect("error");
    assert!(error.contains("default/a-node-1 is already defined in") && error.contains("a.yaml"), "{error}");
    assert_eq!(node.node.pods().uids(), vec![second_uid.clone()], "only the first a runs");

    // A dot file (an editor's swap file) is not read.
    node.write(".a.yaml.swp", "garbage");
    node.write("c.yaml", &sleeper("c", "v1"));
    node.wait_pod("c-node-1", "Running", running).await;
    assert!(node.node.static_pods().expect("source").errors().keys().all(|p| !p.ends_with(".a.yaml.swp")));

    // Removing the file removes its pod.
    node.remove("a.yaml");
    node.wait_gone("a-node-1").await;
    node.remove("c.yaml");
    node.wait_gone("c-node-1").await;
}

#[tokio::test]
async fn a_manifest_dir_read_at_start_keeps_uids_across_a_restart() {
    let root = new_root();
    std::fs::write(root.path().join("manifests/a.yaml"), sleeper("a", "v1")).expect("write");
    let node = start_node_in(root, None, |_| {}).await;
    // Applied before `start` returned.
    let uid = node.node.pods().uids().pop().expect("the pod is there at start");
    node.wait_pod("a-node-1", "Running", running).await;
    node.shutdown.cancel();
    let StaticNode { root, node: running_node, .. } = node;
    running_node.stopped().await;
    let again = start_node_in(root, None, |_| {}).await;
    assert_eq!(again.node.pods().uids(), vec![uid], "same manifest, same UID after a restart");
}

#[tokio::test]
async fn a_missing_csi_driver_is_a_clear_condition_and_the_pod_goes_on_when_it_registers() {
    let mut node = start_node(|_| {}).await;
    node.add_gpus(1, &[]).await;
    let out = node.root.path().join("out");
    std::fs::create_dir_all(&out).expect("mkdir");
    node.write(
        "web.yaml",
        &format!("{CSI_DRIVER_DOC}---\n{}", gpu_pod_with_csi("web").replace("OUT_DIR", &out.display().to_string())),
    );
    let waiting = node
        .wait_pod("web-node-1", "the missing driver in its status", |p| {
            message(p).contains("not found in the list of registered CSI drivers")
        })
        .await;
    assert_eq!(phase(&waiting), Some("Pending"));
    assert!(message(&waiting).contains(DRIVER), "{}", message(&waiting));
    // The pod re-checks on its own only after a minute: getting to Running
    // within the deadline means the registration woke it.
    let _driver = node.start_driver(&[]).await;
    node.wait_pod("web-node-1", "Running once the driver registered", running).await;
}

#[tokio::test]
async fn failing_and_hanging_node_publish_keep_the_pod_pending_and_removal_still_unpublishes() {
    let mut node = start_node(|c| c.pods.csi_timeouts.volume = Duration::from_secs(1)).await;
    node.add_gpus(1, &[]).await;
    let mut driver = node.start_driver(&["--volume-call", "NodePublishVolume=13"]).await;
    let out = node.root.path().join("out");
    std::fs::create_dir_all(&out).expect("mkdir");
    node.write(
        "web.yaml",
        &format!("{CSI_DRIVER_DOC}---\n{}", gpu_pod_with_csi("web").replace("OUT_DIR", &out.display().to_string())),
    );
    let failing = node.wait_pod("web-node-1", "the publish error", |p| message(p).contains("NodePublishVolume")).await;
    assert!(message(&failing).contains("Internal"), "{}", message(&failing));
    assert_eq!(phase(&failing), Some("Pending"));
    let uid = failing.metadata.uid.clone().expect("uid");
    node.remove("web.yaml");
    volume_call(&mut driver, "NodeUnpublishVolume").await;
    node.wait_gone("web-node-1").await;
    assert!(node.node.devices().allocated(&uid, "main").is_empty());
    drop(driver);

    // A driver that never answers: the deadline, then the same.
    let mut hanging = node.start_driver(&["--volume-call", "NodePublishVolume=hang"]).await;
    node.write(
        "web.yaml",
        &format!("{CSI_DRIVER_DOC}---\n{}", gpu_pod_with_csi("web").replace("OUT_DIR", &out.display().to_string())),
    );
    let hung = node.wait_pod("web-node-1", "the deadline", |p| message(p).contains("did not answer within")).await;
    assert_eq!(phase(&hung), Some("Pending"));
    node.remove("web.yaml");
    volume_call(&mut hanging, "NodeUnpublishVolume").await;
    node.wait_gone("web-node-1").await;
}

#[tokio::test]
async fn a_pod_removed_while_its_volume_is_being_published_leaks_nothing() {
    let mut node = start_node(|c| c.pods.csi_timeouts.volume = Duration::from_secs(600)).await;
    node.add_gpus(1, &[]).await;
    let mut driver = node.start_driver(&["--volume-call", "NodePublishVolume=hang"]).await;
    let out = node.root.path().join("out");
    std::fs::create_dir_all(&out).expect("mkdir");
    node.write(
        "web.yaml",
        &format!("{CSI_DRIVER_DOC}---\n{}", gpu_pod_with_csi("web").replace("OUT_DIR", &out.display().to_string())),
    );
    let Report::VolumeCall { volume_id, .. } = volume_call(&mut driver, "NodePublishVolume").await else {
        unreachable!()
    };
    let uid = node.node.pods().uids().pop().expect("pod");
    assert_eq!(node.node.devices().allocated(&uid, "main").get(GPU).map(Vec::len), Some(1));
    node.remove("web.yaml");
    let Report::VolumeCall { volume_id: unpublished, .. } = volume_call(&mut driver, "NodeUnpublishVolume").await
    else {
        unreachable!()
    };
    assert_eq!(unpublished, volume_id);
    node.wait_gone("web-node-1").await;
    assert!(node.node.devices().allocated(&uid, "main").is_empty(), "device freed");
    tokio::time::timeout(SOON, node.node.devices().persisted()).await.expect("in time").expect("checkpoint written");
    assert!(!node.checkpoint_mentions(&uid), "checkpoint clean");
    assert!(!node.pod_dir(&uid).exists(), "pod dir removed");
}

#[tokio::test]
async fn a_pod_removed_while_its_devices_are_being_allocated_leaks_nothing() {
    let mut node = start_node(|c| c.devices.call_timeout = Duration::from_secs(600)).await;
    node.add_gpus(2, &["--behaviour", "hang-allocate"]).await;
    let out = node.root.path().join("out");
    std::fs::create_dir_all(&out).expect("mkdir");
    node.write("web.yaml", &gpu_pod_with_csi("web").replace("OUT_DIR", &out.display().to_string()));
    let plugin = node.plugins.last_mut().expect("plugin");
    plugin.wait_for(SOON, |r| matches!(r, Report::Allocate { .. })).await.expect("Allocate called");
    let uid = node.node.pods().uids().pop().expect("pod");
    node.remove("web.yaml");
    node.wait_gone("web-node-1").await;
    assert!(node.node.devices().allocated(&uid, "main").is_empty(), "nothing allocated");
    tokio::time::timeout(SOON, node.node.devices().persisted()).await.expect("in time").expect("checkpoint written");
    assert!(!node.checkpoint_mentions(&uid), "checkpoint clean");
    let mut capacity = node.node.devices().capacity();
    let free = capacity.borrow_and_update().get(GPU).map(|c| c.allocatable);
    assert_eq!(free, Some(2), "both devices still healthy and advertised");
}

#[tokio::test]
async fn a_persistent_csi_volume_is_staged_once_published_per_pod_and_unstaged_when_unused() {
    let claims = StaticClaims::new();
    let volume: k8s_openapi::api::core::v1::PersistentVolume = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "pv-data"},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "mountOptions": ["noatime"],
            "csi": {"driver": DRIVER, "volumeHandle": "vol-42", "fsType": "xfs", "volumeAttributes": {"tier": "gold"}}
        }
    }))
    .expect("pv");
    bind_data_claim(&claims, volume);
    let node = start_node_in(new_root(), Some(claims), |_| {}).await;
    let mut driver = node.start_driver(&["--stage-unstage"]).await;
    node.write("driver.yaml", CSI_DRIVER_DOC);
    let pod_with_claim = |name: &str| {
        format!(
            "{}    volumeMounts: [{{name: data, mountPath: /data}}]\n  volumes:\n  - name: data\n    persistentVolumeClaim: {{claimName: data, readOnly: {}}}\n",
            sleeper(name, "v1"),
            name == "reader"
        )
    };
    node.write("writer.yaml", &pod_with_claim("writer"));
    let writer = node.wait_pod("writer-node-1", "Running", running).await;
    let Report::VolumeCall { rpc, staging_target_path, access_mode, volume_context, .. } =
        next_volume_call(&mut driver).await
    else {
        unreachable!()
    };
    assert_eq!(rpc, "NodeStageVolume");
    let expected_staging = node
        .root
        .path()
        .join("plugins/kubernetes.io/csi")
        .join(DRIVER)
        .join(kubelet::volume::csi::sha256_hex(b"vol-42"))
        .join("globalmount");
    assert_eq!(Path::new(&staging_target_path), expected_staging);
    assert_eq!(access_mode, 5, "MULTI_NODE_MULTI_WRITER for ReadWriteMany");
    assert!(volume_context.contains(&("tier".to_owned(), "gold".to_owned())));
    assert!(
        volume_context.contains(&("csi.storage.k8s.io/ephemeral".to_owned(), "false".to_owned())),
        "pod info on mount: {volume_context:?}"
    );
    let Report::VolumeCall { rpc, target_path, staging_target_path: publish_staging, read_only, .. } =
        next_volume_call(&mut driver).await
    else {
        unreachable!()
    };
    assert_eq!(rpc, "NodePublishVolume");
    let writer_uid = writer.metadata.uid.clone().expect("uid");
    assert_eq!(Path::new(&target_path), node.pod_dir(&writer_uid).join("volumes/kubernetes.io~csi/pv-data/mount"));
    assert_eq!(publish_staging, staging_target_path);
    assert!(!read_only);

    // A second pod: published again, not staged again (the very next call
    // is its publish).
    node.write("reader.yaml", &pod_with_claim("reader"));
    node.wait_pod("reader-node-1", "Running", running).await;
    let Report::VolumeCall { rpc, read_only, .. } = next_volume_call(&mut driver).await else { unreachable!() };
    assert_eq!(rpc, "NodePublishVolume");
    assert!(read_only, "the claim is read-only in this pod");

    // The first pod goes: unpublished, still staged.
    node.remove("writer.yaml");
    node.wait_gone("writer-node-1").await;
    let Report::VolumeCall { rpc, .. } = next_volume_call(&mut driver).await else { unreachable!() };
    assert_eq!(rpc, "NodeUnpublishVolume");
    // The last pod goes: unpublished, then unstaged.
    node.remove("reader.yaml");
    node.wait_gone("reader-node-1").await;
    let Report::VolumeCall { rpc, .. } = next_volume_call(&mut driver).await else { unreachable!() };
    assert_eq!(rpc, "NodeUnpublishVolume");
    let Report::VolumeCall { rpc, staging_target_path: unstaged, .. } = next_volume_call(&mut driver).await else {
        unreachable!()
    };
    assert_eq!((rpc.as_str(), unstaged.as_str()), ("NodeUnstageVolume", staging_target_path.as_str()));
    assert!(!expected_staging.exists(), "the staging dir is removed");
}

/// A stage call that fails for good (`INVALID_ARGUMENT`) leaves nothing
/// staged: the pod removed before it ever ran is not unstaged (the
/// kubelet's rule; a transient failure would be). A failing unstage does
/// not hold the pod's removal, and is tried again while no pod uses the
/// volume.
#[tokio::test]
async fn a_failed_stage_is_not_unstaged_and_a_failed_unstage_holds_no_pod() {
    let claims = StaticClaims::new();
    let volume: k8s_openapi::api::core::v1::PersistentVolume = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "pv-data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "csi": {"driver": DRIVER, "volumeHandle": "vol-7", "fsType": "ext4"}}
    }))
    .expect("pv");
    bind_data_claim(&claims, volume);
    let node = start_node_in(new_root(), Some(claims), |_| {}).await;
    node.write("driver.yaml", CSI_DRIVER_DOC);
    let pod = |name: &str| {
        format!(
            "{}    volumeMounts: [{{name: data, mountPath: /data}}]\n  volumes:\n  - name: data\n    persistentVolumeClaim: {{claimName: data}}\n",
            sleeper(name, "v1")
        )
    };
    let is_call = |rpc: &'static str| move |r: &Report| matches!(r, Report::VolumeCall { rpc: r, .. } if r == rpc);

    // 1. Staging fails for good: removed, the pod is not unstaged. The next
    // pod's stage call comes after anything the removal sent.
    let mut driver = node.start_driver(&["--stage-unstage", "--volume-call", "NodeStageVolume=3"]).await;
    node.write("first.yaml", &pod("first"));
    driver.wait_for(SOON, is_call("NodeStageVolume")).await.expect("a stage call");
    node.remove("first.yaml");
    node.wait_gone("first-node-1").await;
    node.write("second.yaml", &pod("second"));
    let mut seen = Vec::new();
    driver
        .wait_for(SOON, |r| {
            if let Report::VolumeCall { rpc, volume_id, .. } = r {
                // The removal's teardown (its unpublish) comes first; a
                // stage call after it is the second pod's.
                let after_removal = seen.iter().any(|c| c == "NodeUnpublishVolume");
                seen.push(rpc.clone());
                return rpc == "NodeStageVolume" && volume_id == "vol-7" && after_removal;
            }
            false
        })
        .await
        .expect("the second pod's stage call");
    assert!(!seen.iter().any(|rpc| rpc == "NodeUnstageVolume"), "never staged, never unstaged: {seen:?}");
    node.remove("second.yaml");
    node.wait_gone("second-node-1").await;
    drop(driver);

    // 2. Unstaging fails: the pod goes anyway, and the unstage is retried.
    let mut driver = node.start_driver(&["--stage-unstage", "--volume-call", "NodeUnstageVolume=3"]).await;
    node.write("third.yaml", &pod("third"));
    node.wait_pod("third-node-1", "Running", running).await;
    node.remove("third.yaml");
    driver.wait_for(SOON, is_call("NodeUnstageVolume")).await.expect("an unstage call");
    node.wait_gone("third-node-1").await;
    driver.wait_for(SOON, is_call("NodeUnstageVolume")).await.expect("the unstage tried again");
}

/// Binds claim `default/data` to `volume`.
fn bind_data_claim(claims: &StaticClaims, volume: k8s_openapi::api::core::v1::PersistentVolume) {
    claims.bind(
        "default",
        "data",
        kubelet::volume::ClaimedVolume { volume, ..kubelet::volume::ClaimedVolume::default() },
    );
}

/// The driver's next volume call, whichever it is.
async fn next_volume_call(driver: &mut PluginProcess) -> Report {
    driver.wait_for(SOON, |r| matches!(r, Report::VolumeCall { .. })).await.expect("a volume call")
}

/// The pod's fsGroup on a published CSI volume, by the driver's
/// `fsGroupPolicy` as the kubelet applies it, and handed to a driver with
/// VOLUME_MOUNT_GROUP instead of applied by the node.
#[tokio::test]
async fn a_csi_volume_is_given_to_the_pods_fs_group_by_the_drivers_policy() {
    use rustlet_testkit::csi_driver::{CsiDriverConfig, RegisteredCsiDriver};
    use rustlet_testkit::report::Reporter;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let node = start_node(|_| {}).await;
    // Our own group: the node may give files to it without privileges.
    let gid = std::fs::metadata(node.root.path()).expect("meta").gid();
    let mut calls = Vec::new();
    for (driver, delegates) in [("plain.csi.example.com", false), ("group.csi.example.com", true)] {
        let config = CsiDriverConfig {
            name: driver.into(),
            node_id: "node-1".into(),
            volume_mount_group: delegates,
            ..CsiDriverConfig::default()
        };
        let (recorded, _) = RegisteredCsiDriver::new(
            node.root.path().join(format!("plugins_registry/{driver}-reg.sock")),
            node.root.path().join(format!("{driver}.sock")),
            config,
        )
        .spawn_recorded(Reporter::Discard, node.shutdown.child_token())
        .expect("csi driver");
        node.node.csi_drivers().view().wait_for(driver, SOON).await.expect("registered");
        calls.push(recorded);
    }
    let pod = |name: &str, driver: &str, fs_type: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  securityContext: {{fsGroup: {gid}}}\n  \
             containers:\n  - name: main\n    image: host\n    command: [sleep, '600']\n    \
             volumeMounts: [{{name: data, mountPath: /data}}]\n  volumes:\n  - name: data\n    \
             csi: {{driver: {driver}, fsType: '{fs_type}'}}\n"
        )
    };
    let driver_doc = |driver: &str, policy: Option<&str>| {
        let policy = policy.map(|p| format!(", fsGroupPolicy: {p}")).unwrap_or_default();
        format!(
            "apiVersion: storage.k8s.io/v1\nkind: CSIDriver\nmetadata: {{name: {driver}}}\n\
             spec: {{volumeLifecycleModes: [Ephemeral]{policy}}}\n---\n"
        )
    };
    // (pod, driver, CSIDriver policy, fsType, whether the node changes the group)
    let cases = [
        ("file", "plain.csi.example.com", Some("File"), "", true),
        ("rwo-typed", "plain.csi.example.com", None, "ext4", true),
        ("rwo-untyped", "plain.csi.example.com", None, "", false),
        ("none", "plain.csi.example.com", Some("None"), "ext4", false),
        ("delegated", "group.csi.example.com", Some("File"), "", false),
    ];
    for (name, driver, policy, fs_type, changed) in cases {
        node.write("driver.yaml", &format!("{}{}", driver_doc(driver, policy), pod(name, driver, fs_type)));
        let running_pod = node.wait_pod(&format!("{name}-node-1"), "Running", running).await;
        let uid = running_pod.metadata.uid.clone().expect("uid");
        let target = node.root.path().join(format!("pods/{uid}/volumes/kubernetes.io~csi/data/mount"));
        let meta = std::fs::metadata(&target).expect("published");
        let setgid = meta.permissions().mode() & 0o2000 != 0;
        assert_eq!(setgid, changed, "{name}: the published dir's setgid bit");
        if changed {
            assert_eq!(meta.gid(), gid, "{name}");
            let marker = std::fs::metadata(target.join(rustlet_testkit::csi_driver::PUBLISHED_MARKER)).expect("marker");
            assert_eq!(marker.permissions().mode() & 0o060, 0o060, "{name}: the group reads and writes the files");
        }
        let publish = calls
            .iter()
            .flat_map(|c| c.all())
            .rfind(|c| c.rpc == "NodePublishVolume" && Path::new(&c.target_path) == target)
            .expect("published");
        let expected = if name == "delegated" { gid.to_string() } else { String::new() };
        assert_eq!(
            publish.volume_mount_group, expected,
            "{name}: the fsGroup goes to the driver only when it takes it"
        );
        std::fs::remove_file(node.manifests.join("driver.yaml")).expect("rm");
        node.node
            .pods()
            .store()
            .wait_for(SOON, |pods| !pods.contains_key(&uid))
            .await
            .unwrap_or_else(|| panic!("{name} never went"));
    }
}
