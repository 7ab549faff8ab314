//! The volume reconciler, with real mounts: a CSI driver that bind-mounts
//! what it publishes (as real drivers mount) and an emptyDir of medium
//! Memory (a tmpfs the node mounts), on a standalone node restarted in the
//! same root dir.
//!
//! - A pod removed while the node was down leaves mounted volumes: they are
//!   released once the node is back, the CSI volume only when its driver is
//!   back, through NodeUnpublishVolume failures, retried until done; until
//!   then nothing under the mount is touched and the pod counts as holding
//!   something.
//! - A published volume an earlier run recorded as mounted, found
//!   unmounted after the restart (the actual state from mountinfo), is
//!   published again; one still mounted is adopted with no call.
//!
//! Mounting needs root; without it these tests say so and pass nothing
//! off as checked.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::wait_file;
use k8s_openapi::api::core::v1::Pod;
use kubelet::node::{Node, NodeBuilder, NodeConfig};
use kubelet::pod::Allocatable;
use kubelet::volume::mounts;
use rustlet_sample_plugins::csi_driver::{CsiDriverConfig, RegisteredCsiDriver, VolumeCallBehaviour, VolumeCalls};
use rustlet_sample_plugins::report::Reporter;
use rustlet_testkit::host_provider::HostProcessProvider;
use tokio_util::sync::CancellationToken;

/// A liveness bound for what takes well under a second.
const SOON: Duration = Duration::from_secs(60);
const DRIVER: &str = "mounts.csi.example.com";

/// Whether the test can run here; says why not.
fn can_mount(test: &str) -> bool {
    rustlet_testkit::skip::root(test, "mounting (bind mounts, tmpfs) needs root")
}

const MANIFEST: &str = "apiVersion: storage.k8s.io/v1
kind: CSIDriver
metadata:
  name: mounts.csi.example.com
spec:
  volumeLifecycleModes: [Ephemeral]
---
apiVersion: v1
kind: Pod
metadata:
  name: web
spec:
  containers:
  - name: main
    image: busybox
    command: [sh, -c, 'echo kept > \"$MOUNT_DATA/file\"; echo scratch > \"$MOUNT_SCRATCH/file\"; exec sleep 600']
    volumeMounts:
    - {name: data, mountPath: /data}
    - {name: scratch, mountPath: /scratch}
  volumes:
  - name: data
    csi: {driver: mounts.csi.example.com}
  - name: scratch
    emptyDir: {medium: Memory}
";

struct Fixture {
    root: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        let root = rustlet_testkit::node_root::tempdir("rustlet-reconcile-");
        for dir in ["plugins_registry", "device-plugins", "manifests", "backing"] {
            std::fs::create_dir_all(root.path().join(dir)).expect("mkdir");
        }
        Fixture { root }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.path().join(rel)
    }

    async fn node(&self) -> (Node, CancellationToken) {
        let mut config = NodeConfig::new(self.root.path(), "reconcile-node");
        config.http_address = None;
        config.pods.manifest_dir = Some(self.path("manifests"));
        config.pods.manifest_rescan = Duration::from_secs(3600);
        config.pods.allocatable = Some(Allocatable { cpu_milli: 4000, memory: 8 << 30, pods: 110 });
        config.plugins.initial_backoff = Duration::from_millis(50);
        config.plugins.max_backoff = Duration::from_millis(500);
        let shutdown = CancellationToken::new();
        let node = NodeBuilder::new(config)
            .provider(Arc::new(HostProcessProvider::new()))
            .start(shutdown.clone())
            .await
            .expect("node starts");
        (node, shutdown)
    }

    /// The driver, bind-mounting `backing/<volume id>` at each target.
    fn driver(&self, unpublish: Option<VolumeCallBehaviour>, stop: &CancellationToken) -> VolumeCalls {
        let mut config = CsiDriverConfig {
            name: DRIVER.into(),
            node_id: "reconcile-node".into(),
            bind_mounts_from: Some(self.path("backing")),
            ..CsiDriverConfig::default()
        };
        if let Some(behaviour) = unpublish {
            config.volume_calls.insert("NodeUnpublishVolume".into(), behaviour);
        }
        RegisteredCsiDriver::new(self.path("plugins_registry/mounts-reg.sock"), self.path("mounts-csi.sock"), config)
            .spawn_recorded(Reporter::Discard, stop.child_token())
            .expect("csi driver")
            .0
    }

    fn write_manifest(&self) {
        let temp = self.path("manifests/.web.yaml.tmp");
        std::fs::write(&temp, MANIFEST).expect("write");
        std::fs::rename(&temp, self.path("manifests/web.yaml")).expect("rename");
    }

    fn remove_manifest(&self) {
        std::fs::remove_file(self.path("manifests/web.yaml")).expect("remove manifest");
    }
}

async fn wait_running(node: &Node) -> Pod {
    let running = |p: &Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|c| c.iter().all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some())))
    };
    let found = node.pods().store().wait_for(SOON, |pods| pods.values().any(running)).await;
    let pods = found.unwrap_or_else(|| panic!("never Running: {:#?}", node.pods().store().list()));
    pods.values().find(|p| running(p)).cloned().expect("running pod")
}

/// Stops a node as a crash would leave its volumes: mounted (the
/// shutdown leaves containers and volumes as they are).
async fn stop(node: Node, shutdown: CancellationToken) {
    shutdown.cancel();
    node.stopped().await;
}

#[tokio::test]
async fn a_removed_pods_mounted_volumes_are_released_once_their_driver_is_back() {
    if !can_mount("a_removed_pods_mounted_volumes_are_released_once_their_driver_is_back") {
        return;
    }
    let fx = Fixture::new();
    let driver_stop = CancellationToken::new();
    let _calls = fx.driver(None, &driver_stop);
    let (node, shutdown) = fx.node().await;
    fx.write_manifest();
    let pod = wait_running(&node).await;
    let uid = pod.metadata.uid.clone().expect("uid");
    let volumes = fx.path("pods").join(&uid).join("volumes");
    let target = volumes.join("kubernetes.io~csi/data/mount");
    let scratch = volumes.join("kubernetes.io~empty-dir/scratch");
    assert_eq!(wait_file(&target.join("file"), |t| !t.is_empty()).await, "kept\n");
    wait_file(&scratch.join("file"), |t| !t.is_empty()).await;
    assert!(mounts::is_mount_point(&target), "the driver mounted the volume");
    assert!(mounts::is_mount_point(&scratch), "the emptyDir is a tmpfs");
    let backing: Vec<PathBuf> =
        std::fs::read_dir(fx.path("backing")).expect("backing").flatten().map(|e| e.path()).collect();
    assert_eq!(backing.len(), 1, "one published volume: {backing:?}");
    let data = backing[0].join("file");
    assert_eq!(std::fs::read_to_string(&data).expect("through the mount"), "kept\n");

    // The node goes down; the pod is removed meanwhile, and its driver is
    // down too when the node comes back.
    stop(node, shutdown).await;
    fx.remove_manifest();
    driver_stop.cancel();
    let (node, shutdown) = fx.node().await;
    let mut leftovers = node.pods().leftovers();
    let seen = tokio::time::timeout(SOON, leftovers.wait_for(|l| l.pending.get(&uid).is_some_and(|e| !e.is_empty())))
        .await
        .expect("an attempt in time")
        .expect("reconciler alive")
        .clone();
    assert!(seen.pending[&uid].contains(DRIVER), "the driver is what it waits for: {seen:?}");
    assert!(!node.pods().released(&uid), "the pod holds a published volume");
    assert!(mounts::is_mount_point(&target), "the published volume stays mounted");
    assert_eq!(
        std::fs::read_to_string(target.join("file")).ok().as_deref(),
        Some("kept\n"),
        "nothing under it removed"
    );
    assert!(!mounts::is_mount_point(&scratch), "the node's own tmpfs is unmounted at once");

    // The driver is back, and fails NodeUnpublishVolume twice: retried
    // until it succeeds, then the directory goes.
    let driver_stop = CancellationToken::new();
    let calls = fx.driver(Some(VolumeCallBehaviour::FailTimes(tonic::Code::Internal, 2)), &driver_stop);
    tokio::time::timeout(SOON, leftovers.wait_for(|l| !l.pending.contains_key(&uid)))
        .await
        .unwrap_or_else(|_| panic!("still pending: {:?}; calls {:?}", node.pods().leftovers().borrow(), calls.all()))
        .expect("reconciler alive");
    let unpublishes = calls.all().iter().filter(|c| c.rpc == "NodeUnpublishVolume").count();
    assert_eq!(unpublishes, 3, "two failures, then the retry that succeeded: {:?}", calls.all());
    assert!(node.pods().released(&uid));
    assert!(!mounts::is_mount_point(&target), "unmounted by the driver");
    assert!(!fx.path("pods").join(&uid).exists(), "the pod's directory is gone");
    assert_eq!(std::fs::read_to_string(&data).ok().as_deref(), Some("kept\n"), "the volume's own data is the driver's");
    stop(node, shutdown).await;
    driver_stop.cancel();
}

#[tokio::test]
async fn a_volume_found_unmounted_after_a_restart_is_published_again() {
    if !can_mount("a_volume_found_unmounted_after_a_restart_is_published_again") {
        return;
    }
    let fx = Fixture::new();
    let driver_stop = CancellationToken::new();
    let calls = fx.driver(None, &driver_stop);
    let (node, shutdown) = fx.node().await;
    fx.write_manifest();
    let uid = wait_running(&node).await.metadata.uid.expect("uid");
    let target = fx.path("pods").join(&uid).join("volumes/kubernetes.io~csi/data/mount");
    wait_file(&target.join("file"), |t| !t.is_empty()).await;
    let publishes = |calls: &VolumeCalls| calls.all().iter().filter(|c| c.rpc == "NodePublishVolume").count();
    assert_eq!(publishes(&calls), 1);

    // A restart with the volume still mounted: adopted, no call.
    stop(node, shutdown).await;
    let (node, shutdown) = fx.node().await;
    wait_running(&node).await;
    assert_eq!(publishes(&calls), 1, "adopted as it is: {:?}", calls.all());

    // A restart that finds it unmounted: published again.
    stop(node, shutdown).await;
    let output = std::process::Command::new("umount").arg(&target).output().expect("umount");
    assert!(output.status.success(), "umount: {}", String::from_utf8_lossy(&output.stderr));
    assert!(!mounts::is_mount_point(&target));
    // Something only the volume's own storage holds (the container may run
    // again and rewrite its file, so that proves nothing).
    let backing: Vec<PathBuf> =
        std::fs::read_dir(fx.path("backing")).expect("backing").flatten().map(|e| e.path()).collect();
    assert_eq!(backing.len(), 1, "one published volume: {backing:?}");
    std::fs::write(backing[0].join("only-in-the-volume"), "yes").expect("write");
    assert!(!target.join("only-in-the-volume").exists(), "not visible while unmounted");
    let (node, shutdown) = fx.node().await;
    wait_running(&node).await;
    assert_eq!(publishes(&calls), 2, "published again: {:?}", calls.all());
    assert!(mounts::is_mount_point(&target), "mounted again");
    assert_eq!(
        std::fs::read_to_string(target.join("only-in-the-volume")).ok().as_deref(),
        Some("yes"),
        "the volume's data is back in place"
    );

    // Removal releases it all.
    fx.remove_manifest();
    let gone = node.pods().store().wait_for(SOON, |pods| pods.is_empty()).await;
    assert!(gone.is_some(), "the pod was removed");
    assert!(!mounts::is_mount_point(&target));
    assert!(!fx.path("pods").join(&uid).exists());
    stop(node, shutdown).await;
    driver_stop.cancel();
}
