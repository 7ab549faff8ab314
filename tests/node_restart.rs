//! A node killed with `kill -9` and started again: the `test-node` binary
//! (a standalone node with the detached host-process provider) as a real
//! process, a real device plugin and a real CSI driver.

mod common;

use std::path::Path;

use common::*;
use rustlet_testkit::process::PluginProcess;
use rustlet_testkit::report::Report;

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
    let root = tempfile::Builder::new().prefix("rustlet-restart-").tempdir().expect("tempdir");
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
