//! Plugins deployed as clusters deploy them: in pods on containerd. A CSI
//! driver runs in a privileged container that mounts the node's
//! `<root>/pods` with `mountPropagation: Bidirectional` and its registration
//! and endpoint sockets through hostPath volumes; what it mounts inside its
//! container must reach the host and, from there, the pod that uses the
//! volume. The driver's pod is then rolled (deleted, a new one started) and
//! the node deregisters and registers it again. A device plugin runs as its
//! DaemonSet runs it, its pod replaced under a pod using its device.
//! hostPath volumes of every type reach a container as the deployment wrote
//! them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kubelet::node::{Node, NodeBuilder, NodeConfig};
use kubelet::pod::Allocatable;
use kubelet::provider::decode_cri_log;
use rustlet_cri::{CriConfig, CriProvider};
use rustlet_testkit::containerd::{Containerd, push_busybox};
use rustlet_testkit::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::{SOON, common, terminated};

const DRIVER: &str = "pod.csi.example.com";

/// A root dir on a private mount (as `/tmp` is here), so that the node has
/// to make it shared itself; its mounts go with it.
struct PrivateRoot(tempfile::TempDir);

impl Drop for PrivateRoot {
    fn drop(&mut self) {
        let mut points: Vec<PathBuf> = mount_points().into_iter().filter(|m| m.starts_with(self.0.path())).collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for point in points {
            let _ = std::process::Command::new("umount").arg("-l").arg(&point).status();
        }
    }
}

/// The host's mount points (this process's mount namespace).
fn mount_points() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    text.lines().filter_map(|l| l.split(' ').nth(4)).map(PathBuf::from).collect()
}

/// Whether `dir` is itself a mount point with shared propagation.
fn is_shared_mount_point(dir: &Path) -> bool {
    let text = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let dir = dir.display().to_string();
    text.lines().any(|l| {
        let fields: Vec<&str> = l.split(' ').collect();
        fields.get(4) == Some(&dir.as_str())
            && fields.iter().skip(6).take_while(|f| **f != "-").any(|f| f.starts_with("shared:"))
    })
}

/// A pod manifest's hostPath volume and the mount of it.
struct HostVolume<'a> {
    name: &'a str,
    host: String,
    kind: &'a str,
    at: String,
    extra: &'a str,
}

impl HostVolume<'_> {
    fn volume(&self) -> String {
        format!("  - {{name: {}, hostPath: {{path: '{}', type: '{}'}}}}\n", self.name, self.host, self.kind)
    }

    fn mount(&self) -> String {
        format!("    - {{name: {}, mountPath: '{}'{}}}\n", self.name, self.at, self.extra)
    }
}

/// The host's libraries, read-only, and `binary` at `/plugin/<name>`: what
/// a test plugin binary needs to run in a busybox container.
fn plugin_binary_volumes<'a>(binary: &str, name: &'a str) -> [HostVolume<'a>; 3] {
    [
        HostVolume {
            name: "lib",
            host: "/lib".into(),
            kind: "Directory",
            at: "/lib".into(),
            extra: ", readOnly: true",
        },
        HostVolume {
            name: "lib64",
            host: "/lib64".into(),
            kind: "Directory",
            at: "/lib64".into(),
            extra: ", readOnly: true",
        },
        HostVolume { name, host: binary.into(), kind: "File", at: format!("/plugin/{name}"), extra: "" },
    ]
}

/// The driver's pod, `name`: the test's CSI driver binary (with the host's
/// libraries, read-only) in a privileged busybox container, as a CSI
/// driver's DaemonSet runs: `<root>/pods` at the same path with
/// Bidirectional propagation, the registration dir and its own socket dir
/// from the host.
fn driver_pod(root: &Path, image: &str, name: &str) -> String {
    let root_str = root.display().to_string();
    let [lib, lib64, binary] = plugin_binary_volumes(common::csi_driver_bin(), "driver");
    let volumes = [
        lib,
        lib64,
        binary,
        HostVolume {
            name: "pods",
            host: format!("{root_str}/pods"),
            kind: "DirectoryOrCreate",
            at: format!("{root_str}/pods"),
            extra: ", mountPropagation: Bidirectional",
        },
        HostVolume {
            name: "registration",
            host: format!("{root_str}/plugins_registry"),
            kind: "Directory",
            at: "/registration".into(),
            extra: "",
        },
        HostVolume {
            name: "socket-dir",
            host: format!("{root_str}/plugins/{DRIVER}"),
            kind: "DirectoryOrCreate",
            at: "/csi".into(),
            extra: "",
        },
        HostVolume {
            name: "data",
            host: format!("{root_str}/driver-data"),
            kind: "DirectoryOrCreate",
            at: "/data".into(),
            extra: "",
        },
    ];
    let mounts: String = volumes.iter().map(HostVolume::mount).collect();
    let volumes: String = volumes.iter().map(HostVolume::volume).collect();
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  terminationGracePeriodSeconds: 10\n  containers:\n  \
         - name: driver\n    image: {image}\n    securityContext: {{privileged: true}}\n    \
         command: [/plugin/driver, --name, {DRIVER}, --node-id, pod-node, --registration-socket, /registration/{DRIVER}-reg.sock, \
         --endpoint, /csi/csi.sock, --kubelet-registration-path, '{root_str}/plugins/{DRIVER}/csi.sock', --bind-mounts-from, /data]\n    \
         volumeMounts:\n{mounts}  volumes:\n{volumes}"
    )
}

/// A pod reading the driver's inline volume: prints the marker the driver
/// wrote inside its own mount, then waits.
fn reader_pod(image: &str, name: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  terminationGracePeriodSeconds: 1\n  containers:\n  \
         - name: main\n    image: {image}\n    \
         command: [sh, -c, 'cat /data/{marker}; echo; exec sleep 3600']\n    volumeMounts: [{{name: data, mountPath: /data}}]\n  \
         volumes:\n  - name: data\n    csi: {{driver: {DRIVER}}}\n",
        marker = rustlet_testkit::csi_driver::PUBLISHED_MARKER,
    )
}

/// A standalone node on `containerd` whose static pods come from
/// `<root>/manifests`, and the busybox image in a registry of its own.
struct PluginNode {
    node: Node,
    image: String,
    stop: CancellationToken,
    _registry: Registry,
}

impl PluginNode {
    async fn start(containerd: &Containerd, root: &Path) -> PluginNode {
        let registry = Registry::start().await.expect("registry");
        containerd.trust_registry(&registry.host());
        let image = push_busybox(&registry, "test/busybox", "v1", &[], &["sh"]).await.expect("push");
        for dir in ["plugins_registry", "manifests"] {
            std::fs::create_dir_all(root.join(dir)).expect("mkdir");
        }
        let stop = CancellationToken::new();
        let mut config = NodeConfig::new(root, "pod-node");
        config.http_address = None;
        config.pods.manifest_dir = Some(root.join("manifests"));
        config.pods.allocatable = Some(Allocatable { cpu_milli: 4000, memory: 8 << 30, pods: 110 });
        let node = NodeBuilder::new(config)
            .provider(Arc::new(CriProvider::new(CriConfig::new(containerd.endpoint()))))
            .start(stop.clone())
            .await
            .expect("node");
        PluginNode { node, image, stop, _registry: registry }
    }
}

/// Waits until `pred` holds of the node's CSI drivers.
async fn wait_drivers(node: &Node, what: &str, pred: impl Fn(Option<kubelet::csi::CsiDriver>) -> bool) {
    let mut changes = node.csi_drivers().view().changes();
    let deadline = Instant::now() + SOON;
    while !pred(node.csi_drivers().get(DRIVER)) {
        let left = deadline.saturating_duration_since(Instant::now());
        if tokio::time::timeout(left, changes.changed()).await.is_err() {
            panic!(
                "{what}: not within {SOON:?}: {:?}; pods: {:#?}",
                node.csi_drivers().list(),
                node.pods().store().list()
            );
        }
    }
}

/// The UID of the pod called `name` (static pods get the node's name).
async fn wait_uid(node: &Node, name: &str) -> String {
    let full = format!("{name}-pod-node");
    let pods = node
        .pods()
        .store()
        .wait_for(SOON, |pods| pods.values().any(|p| p.metadata.name.as_deref() == Some(full.as_str())))
        .await
        .unwrap_or_else(|| panic!("{full} never came: {:#?}", node.pods().store().list()));
    pods.values()
        .find(|p| p.metadata.name.as_deref() == Some(full.as_str()))
        .and_then(|p| p.metadata.uid.clone())
        .expect("uid")
}

/// Starts a reader, checks that it reads what the driver mounted inside its
/// own container (the host sees the mount at the publish target), removes
/// it, and checks that the mount is gone from the host.
async fn read_through_the_driver(node: &Node, root: &Path, image: &str, name: &str) {
    let manifest = root.join(format!("manifests/{name}.yaml"));
    std::fs::write(&manifest, reader_pod(image, name)).expect("reader manifest");
    let uid = wait_uid(node, name).await;
    let log = root.join(format!("logs/pods/default_{name}-pod-node_{uid}/main/0.log"));
    let text = rustlet_testkit::wait_file(&log, |t| !decode_cri_log(t).is_empty(), SOON).await;
    let line = decode_cri_log(&text).first().map(|l| l.trim_end().to_owned()).unwrap_or_default();
    let target = root.join(format!("pods/{uid}/volumes/kubernetes.io~csi/data/mount"));
    assert!(line.starts_with("csi-"), "{name} read {line:?}, not the driver's volume ID");
    assert!(
        mount_points().contains(&target),
        "the driver's mount in its container reached the host at {}",
        target.display()
    );
    // The data is the driver's: under its source dir, not in the target.
    assert_eq!(
        std::fs::read_to_string(root.join(format!("driver-data/{line}/published-volume"))).ok().as_deref(),
        Some(line.as_str())
    );

    std::fs::remove_file(&manifest).expect("rm reader");
    node.pods()
        .store()
        .wait_for(SOON, |pods| !pods.contains_key(&uid))
        .await
        .unwrap_or_else(|| panic!("{name} never went: {:#?}", node.pods().store().get(&uid)));
    assert!(!mount_points().contains(&target), "unpublished inside the driver's container: gone from the host too");
    assert!(!target.exists(), "the target dir is removed with the pod");
}

#[tokio::test]
async fn a_csi_driver_in_a_privileged_pod_mounts_volumes_other_pods_read_and_survives_a_roll() {
    let test = "a_csi_driver_in_a_privileged_pod_mounts_volumes_other_pods_read_and_survives_a_roll";
    let Some(containerd) = Containerd::private(test) else { return };
    let root = PrivateRoot(tempfile::Builder::new().prefix("rustlet-plugin-pods-").tempdir().expect("tempdir"));
    let root_path = root.0.path().to_owned();
    let PluginNode { node, image, stop, _registry } = PluginNode::start(&containerd, &root_path).await;
    let _stop = stop.clone().drop_guard();
    assert!(is_shared_mount_point(&root_path), "the node made its root dir a shared mount");

    let driver_object = format!(
        "apiVersion: storage.k8s.io/v1\nkind: CSIDriver\nmetadata: {{name: {DRIVER}}}\nspec: {{volumeLifecycleModes: [Ephemeral]}}\n"
    );
    std::fs::write(root_path.join("manifests/csidriver.yaml"), driver_object).expect("CSIDriver");
    std::fs::write(root_path.join("manifests/driver.yaml"), driver_pod(&root_path, &image, "csi-driver"))
        .expect("driver");
    wait_drivers(&node, "the driver in its pod registers", |d| d.is_some()).await;
    let registered = node.csi_drivers().get(DRIVER).expect("driver");
    assert_eq!(registered.endpoint, root_path.join(format!("plugins/{DRIVER}/csi.sock")).display().to_string());
    read_through_the_driver(&node, &root_path, &image, "reader").await;

    // Rolled: the old pod goes (its registration socket with it), a new one
    // comes and registers again.
    let socket = root_path.join(format!("plugins_registry/{DRIVER}-reg.sock"));
    std::fs::remove_file(root_path.join("manifests/driver.yaml")).expect("rm driver");
    wait_drivers(&node, "the deleted driver pod deregisters", |d| d.is_none()).await;
    assert!(!socket.exists(), "the stopped driver removed its registration socket");
    std::fs::write(root_path.join("manifests/driver-v2.yaml"), driver_pod(&root_path, &image, "csi-driver-v2"))
        .expect("driver v2");
    wait_drivers(&node, "the new driver pod registers", |d| d.is_some()).await;
    read_through_the_driver(&node, &root_path, &image, "reader-2").await;

    std::fs::remove_file(root_path.join("manifests/driver-v2.yaml")).expect("rm driver v2");
    wait_drivers(&node, "the second driver pod deregisters", |d| d.is_none()).await;
    stop.cancel();
    node.stopped().await;
}

#[tokio::test]
async fn host_path_volumes_of_every_type_reach_the_container() {
    let test = "host_path_volumes_of_every_type_reach_the_container";
    let Some(containerd) = Containerd::shared(test) else { return };
    let node = super::cri_node(containerd).await;
    let dir = node.root.path().join("host");
    std::fs::create_dir_all(dir.join("existing-dir")).expect("dir");
    std::fs::write(dir.join("existing-file"), "file contents").expect("file");
    let socket = dir.join("plugin.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).expect("socket");
    // A block device node of the test's own (loop device numbers): a
    // BlockDevice hostPath is checked by the node's type, not opened.
    let block = dir.join("block");
    let made = std::process::Command::new("mknod").arg(&block).args(["b", "7", "200"]).status().expect("mknod");
    assert!(made.success(), "mknod");
    let d = dir.display();
    let pod = serde_json::json!({
        "metadata": {"name": "hostpaths", "namespace": "default", "uid": "hostpaths-1"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "main", "image": node.image,
                "command": ["sh", "-c", "ls /made-dir >/dev/null && cat /existing-file && echo && test -S /plugin.sock \
                    && test -c /null && test -b /block && test -d /existing-dir && test -f /made-file && echo ok"],
                "volumeMounts": [
                    {"name": "made-dir", "mountPath": "/made-dir"},
                    {"name": "existing-dir", "mountPath": "/existing-dir"},
                    {"name": "made-file", "mountPath": "/made-file"},
                    {"name": "existing-file", "mountPath": "/existing-file"},
                    {"name": "socket", "mountPath": "/plugin.sock"},
                    {"name": "null", "mountPath": "/null"},
                    {"name": "block", "mountPath": "/block"},
                ],
            }],
            "volumes": [
                {"name": "made-dir", "hostPath": {"path": format!("{d}/made/dir"), "type": "DirectoryOrCreate"}},
                {"name": "existing-dir", "hostPath": {"path": format!("{d}/existing-dir"), "type": "Directory"}},
                {"name": "made-file", "hostPath": {"path": format!("{d}/made-file"), "type": "FileOrCreate"}},
                {"name": "existing-file", "hostPath": {"path": format!("{d}/existing-file"), "type": "File"}},
                {"name": "socket", "hostPath": {"path": socket.display().to_string(), "type": "Socket"}},
                {"name": "null", "hostPath": {"path": "/dev/null", "type": "CharDevice"}},
                {"name": "block", "hostPath": {"path": block.display().to_string(), "type": "BlockDevice"}},
            ],
        },
    });
    node.pods.apply(serde_json::from_value(pod).expect("pod"));
    let done = node
        .pods
        .store()
        .wait_for(SOON, |pods| pods.get("hostpaths-1").and_then(terminated).is_some())
        .await
        .unwrap_or_else(|| panic!("never finished: {:#?}", node.pods.store().get("hostpaths-1")));
    let pod = &done["hostpaths-1"];
    let log = node.root.path().join("logs/pods/default_hostpaths_hostpaths-1/main/0.log");
    let lines = decode_cri_log(&std::fs::read_to_string(&log).unwrap_or_default());
    assert_eq!(terminated(pod).map(|t| t.exit_code), Some(0), "{lines:?} {:?}", pod.status);
    assert_eq!(lines.iter().map(|l| l.trim_end()).collect::<Vec<_>>(), ["file contents", "ok"]);
    assert!(dir.join("made/dir").is_dir(), "DirectoryOrCreate made the dir, parents too");
    assert!(dir.join("made-file").is_file(), "FileOrCreate made the file");

    // Each type refused on the wrong kind of file, in upstream's words.
    for (uid, kind, path, what) in [
        ("wrong-1", "Directory", dir.join("existing-file"), "is not a directory"),
        ("wrong-2", "File", dir.join("existing-dir"), "is not a file"),
        ("wrong-3", "Socket", dir.join("existing-file"), "is not a socket file"),
        ("wrong-4", "CharDevice", block.clone(), "is not a character device"),
        ("wrong-5", "BlockDevice", PathBuf::from("/dev/null"), "is not a block device"),
        ("wrong-6", "FileOrCreate", dir.join("existing-dir"), "is not a file"),
        ("wrong-7", "DirectoryOrCreate", dir.join("existing-file"), "is not a directory"),
    ] {
        let pod = serde_json::json!({
            "metadata": {"name": uid, "namespace": "default", "uid": uid},
            "spec": {
                "containers": [{"name": "main", "image": node.image, "command": ["true"],
                                "volumeMounts": [{"name": "v", "mountPath": "/v"}]}],
                "volumes": [{"name": "v", "hostPath": {"path": path.display().to_string(), "type": kind}}],
            },
        });
        node.pods.apply(serde_json::from_value(pod).expect("pod"));
        let expected = format!("hostPath type check failed: {} {what}", path.display());
        let pending = node
            .pods
            .store()
            .wait_for(SOON, |pods| {
                pods.get(uid).and_then(|p| p.status.as_ref()?.message.clone()).is_some_and(|m| m.contains(&expected))
            })
            .await
            .unwrap_or_else(|| panic!("{kind}: no {expected:?}: {:#?}", node.pods.store().get(uid)));
        assert_eq!(super::phase(&pending[uid]), Some("Pending"), "{kind}");
        node.pods.delete(uid);
    }
}

const POD_GPU: &str = "example.com/pod-gpu";

/// A device plugin as its DaemonSet runs it: the test's device plugin
/// binary in a container with `<root>/device-plugins` from the host,
/// registering on the node's `kubelet.sock` there.
fn device_plugin_pod(root: &Path, image: &str, name: &str) -> String {
    let [lib, lib64, binary] = plugin_binary_volumes(common::device_plugin_bin(), "device-plugin");
    let volumes = [
        lib,
        lib64,
        binary,
        HostVolume {
            name: "device-plugins",
            host: format!("{}/device-plugins", root.display()),
            kind: "Directory",
            at: "/var/lib/kubelet/device-plugins".into(),
            extra: "",
        },
    ];
    let mounts: String = volumes.iter().map(HostVolume::mount).collect();
    let volumes: String = volumes.iter().map(HostVolume::volume).collect();
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  terminationGracePeriodSeconds: 1\n  containers:\n  \
         - name: plugin\n    image: {image}\n    \
         command: [/plugin/device-plugin, --socket, /var/lib/kubelet/device-plugins/{name}.sock, --resource, {POD_GPU}, --count, '2']\n    \
         volumeMounts:\n{mounts}  volumes:\n{volumes}"
    )
}

/// Waits until the node advertises `allocatable` devices of [`POD_GPU`].
async fn wait_pod_gpus(node: &Node, allocatable: u64) {
    let mut capacity = node.devices().capacity();
    let reached = capacity.wait_for(|c| c.get(POD_GPU).map_or(0, |c| c.allocatable) == allocatable);
    if !matches!(tokio::time::timeout(SOON, reached).await, Ok(Ok(_))) {
        panic!("{POD_GPU}: not {allocatable} within {SOON:?}: {:?}", *node.devices().capacity().borrow());
    }
}

#[tokio::test]
async fn a_device_plugin_in_a_pod_serves_pods_and_comes_back_when_its_pod_is_replaced() {
    let test = "a_device_plugin_in_a_pod_serves_pods_and_comes_back_when_its_pod_is_replaced";
    let Some(containerd) = Containerd::private(test) else { return };
    let root = rustlet_testkit::node_root::tempdir("rustlet-device-pods-");
    let root_path = root.path().to_owned();
    let PluginNode { node, image, stop, _registry } = PluginNode::start(&containerd, &root_path).await;
    let _stop = stop.clone().drop_guard();

    std::fs::write(root_path.join("manifests/plugin.yaml"), device_plugin_pod(&root_path, &image, "gpu-plugin"))
        .expect("plugin");
    wait_pod_gpus(&node, 2).await;
    let consumer = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: consumer}}\nspec:\n  containers:\n  - name: main\n    image: {image}\n    \
         command: [sh, -c, 'echo started; exec sleep 3600']\n    resources: {{limits: {{{POD_GPU}: 1}}}}\n"
    );
    std::fs::write(root_path.join("manifests/consumer.yaml"), &consumer).expect("consumer");
    let uid = wait_uid(&node, "consumer").await;
    let log = root_path.join(format!("logs/pods/default_consumer-pod-node_{uid}/main/0.log"));
    rustlet_testkit::wait_file(&log, |t| decode_cri_log(t).iter().any(|l| l.trim_end() == "started"), SOON).await;
    assert_eq!(node.devices().allocated(&uid, "main").get(POD_GPU).map(Vec::len), Some(1), "one device allocated");

    // The plugin's pod replaced: its devices go unhealthy, then the new pod
    // registers the resource again.
    std::fs::remove_file(root_path.join("manifests/plugin.yaml")).expect("rm plugin");
    wait_pod_gpus(&node, 0).await;
    std::fs::write(root_path.join("manifests/plugin-v2.yaml"), device_plugin_pod(&root_path, &image, "gpu-plugin-v2"))
        .expect("plugin v2");
    wait_pod_gpus(&node, 2).await;
    assert_eq!(
        node.devices().allocated(&uid, "main").get(POD_GPU).map(Vec::len),
        Some(1),
        "the running pod keeps its device across the plugin's replacement"
    );
    for name in ["consumer", "plugin-v2"] {
        std::fs::remove_file(root_path.join(format!("manifests/{name}.yaml"))).expect("rm");
    }
    wait_pod_gpus(&node, 0).await;
    stop.cancel();
    node.stopped().await;
}

/// A loop device over a file of the test's, detached at the end.
struct LoopDevice(String);

impl LoopDevice {
    fn over(file: &Path) -> LoopDevice {
        let out = std::process::Command::new("losetup").args(["-f", "--show"]).arg(file).output().expect("losetup");
        assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
        LoopDevice(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

#[tokio::test]
async fn a_raw_block_volume_is_staged_published_to_a_device_file_and_reaches_the_container_as_a_device() {
    use kubelet::volume::{ClaimedVolume, StaticClaims};
    use rustlet_testkit::csi_driver::{CsiDriverConfig, RegisteredCsiDriver};
    use rustlet_testkit::report::Reporter;
    let test = "a_raw_block_volume_is_staged_published_to_a_device_file_and_reaches_the_container_as_a_device";
    let Some(containerd) = Containerd::private(test) else { return };
    const BLOCK_DRIVER: &str = "block.csi.example.com";
    let root = rustlet_testkit::node_root::tempdir("rustlet-block-");
    let root_path = root.path().to_owned();
    // The driver's devices: `<dir>/<handle>` links to a loop device over a
    // file that starts with a known text.
    let devices = root_path.join("driver-devices");
    std::fs::create_dir_all(&devices).expect("mkdir");
    let backing = root_path.join("backing.img");
    let mut data = b"block-data".to_vec();
    data.resize(1 << 20, 0);
    std::fs::write(&backing, data).expect("backing file");
    let device = LoopDevice::over(&backing);
    std::os::unix::fs::symlink(&device.0, devices.join("vol-block")).expect("link");

    let claims = StaticClaims::new();
    let volume: k8s_openapi::api::core::v1::PersistentVolume = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "pv-block"},
        "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Block",
                 "csi": {"driver": BLOCK_DRIVER, "volumeHandle": "vol-block"}},
    }))
    .expect("pv");
    let claimed = ClaimedVolume { volume, ..ClaimedVolume::default() };
    claims.bind("default", "block", claimed);
    std::fs::create_dir_all(root_path.join("plugins_registry")).expect("mkdir");
    let stop = CancellationToken::new();
    let config = CsiDriverConfig {
        name: BLOCK_DRIVER.into(),
        node_id: "pod-node".into(),
        stage_unstage: true,
        bind_mounts_from: Some(devices.clone()),
        ..CsiDriverConfig::default()
    };
    let (calls, _) = RegisteredCsiDriver::new(
        root_path.join("plugins_registry/block-reg.sock"),
        root_path.join("block-csi.sock"),
        config,
    )
    .spawn_recorded(Reporter::Discard, stop.child_token())
    .expect("csi driver");
    let registry = Registry::start().await.expect("registry");
    containerd.trust_registry(&registry.host());
    let image = push_busybox(&registry, "test/busybox", "v1", &[], &["sh"]).await.expect("push");
    std::fs::create_dir_all(root_path.join("manifests")).expect("mkdir");
    let mut config = NodeConfig::new(&root_path, "pod-node");
    config.http_address = None;
    config.pods.manifest_dir = Some(root_path.join("manifests"));
    config.pods.allocatable = Some(Allocatable { cpu_milli: 4000, memory: 8 << 30, pods: 110 });
    let node = NodeBuilder::new(config)
        .provider(Arc::new(CriProvider::new(CriConfig::new(containerd.endpoint()))))
        .volume_claims(Arc::new(claims))
        .start(stop.clone())
        .await
        .expect("node");
    let _stop = stop.clone().drop_guard();
    node.csi_drivers().view().wait_for(BLOCK_DRIVER, SOON).await.expect("the driver registers");

    let pod = |name: &str, use_as: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  terminationGracePeriodSeconds: 1\n  containers:\n  \
             - name: main\n    image: {image}\n    command: [sh, -c, 'test -b /dev/xvda && head -c 10 /dev/xvda; echo; exec sleep 3600']\n    \
             {use_as}\n  volumes:\n  - name: data\n    persistentVolumeClaim: {{claimName: block}}\n"
        )
    };
    std::fs::write(
        root_path.join("manifests/reader.yaml"),
        pod("reader", "volumeDevices: [{name: data, devicePath: /dev/xvda}]"),
    )
    .expect("reader");
    let uid = wait_uid(&node, "reader").await;
    let log = root_path.join(format!("logs/pods/default_reader-pod-node_{uid}/main/0.log"));
    let text = rustlet_testkit::wait_file(&log, |t| !decode_cri_log(t).is_empty(), SOON).await;
    assert_eq!(decode_cri_log(&text).first().map(|l| l.trim_end()), Some("block-data"), "the device, read inside");
    let block_dir = root_path.join("plugins/kubernetes.io/csi/volumeDevices");
    let target = block_dir.join(format!("publish/pv-block/{uid}"));
    let staging = block_dir.join("staging/pv-block");
    let published = calls.all();
    let stage = published.iter().find(|c| c.rpc == "NodeStageVolume").expect("staged");
    assert_eq!((stage.access_type.as_str(), Path::new(&stage.staging_target_path)), ("block", staging.as_path()));
    let publish = published.iter().find(|c| c.rpc == "NodePublishVolume").expect("published");
    assert_eq!(Path::new(&publish.target_path), target, "published to a file named by the pod's UID");
    assert!(mount_points().contains(&target), "the driver's device is bind-mounted on the target file");
    let link = root_path.join(format!("pods/{uid}/volumeDevices/kubernetes.io~csi/pv-block"));
    assert_eq!(std::fs::read_link(&link).ok(), Some(target.clone()), "the pod's device link");

    // The same block volume as a mount: refused with upstream's reason.
    std::fs::write(
        root_path.join("manifests/wrong.yaml"),
        pod("wrong", "volumeMounts: [{name: data, mountPath: /data}]"),
    )
    .expect("wrong");
    let wrong = wait_uid(&node, "wrong").await;
    node.pods()
        .store()
        .wait_for(SOON, |pods| {
            pods.get(&wrong)
                .and_then(|p| rustlet_testkit::pod_state::container_status(p, "main"))
                .and_then(|s| s.state.as_ref()?.waiting.as_ref()?.message.clone())
                .is_some_and(|m| m.contains("volume data has volumeMode Block, but is specified in volumeMounts"))
        })
        .await
        .unwrap_or_else(|| panic!("no volumeMode mismatch: {:#?}", node.pods().store().get(&wrong)));

    for name in ["reader", "wrong"] {
        std::fs::remove_file(root_path.join(format!("manifests/{name}.yaml"))).expect("rm");
    }
    node.pods()
        .store()
        .wait_for(SOON, |pods| !pods.contains_key(&uid) && !pods.contains_key(&wrong))
        .await
        .unwrap_or_else(|| panic!("never went: {:#?}", node.pods().store().list()));
    assert!(!mount_points().contains(&target), "unpublished");
    assert!(!target.exists() && std::fs::symlink_metadata(&link).is_err(), "the device file and link are gone");
    // Stage, two publishes (the refused pod's too), two unpublishes, unstage.
    let unstaged = calls.wait_for(6, SOON).await;
    assert!(unstaged.iter().any(|c| c.rpc == "NodeUnstageVolume"), "{unstaged:?}");
    assert_eq!(std::fs::read(&backing).expect("backing")[..10], *b"block-data", "the data stays");
    stop.cancel();
    node.stopped().await;
}

/// A pod network as clusters install it: the runtime starts with no CNI
/// configuration (its `NetworkReady` condition false), and a host-network
/// pod's init container writes one into the runtime's configuration dir
/// through a hostPath, as a network plugin's DaemonSet does. Meanwhile the
/// node reports the runtime's reason (upstream's `container runtime network
/// not ready: NetworkReady=false reason:NetworkPluginNotReady ...`), a pod
/// that needs the pod network waits in `ContainerCreating` without asking
/// the runtime for a sandbox (no restart counted), the host-network pod
/// runs, and once the runtime reads the configuration the waiting pod
/// starts on the new network.
#[tokio::test]
async fn pods_wait_for_the_pod_network_a_host_network_plugin_pod_installs() {
    use kubelet::health::ComponentHealth;
    let test = "pods_wait_for_the_pod_network_a_host_network_plugin_pod_installs";
    let Some(containerd) = Containerd::private_without_network(test) else { return };
    let node = super::cri_node(&containerd).await;
    let reporter = kubelet::health::HealthReporter::new();
    let mut health = reporter.check().watch();
    let _watching =
        node.provider.watch_health(reporter.clone(), std::time::Duration::from_millis(100), node.shutdown.clone());
    let not_ready = tokio::time::timeout(
        SOON,
        health.wait_for(|h| matches!(h, ComponentHealth::Failing { reason } if reason.contains("NetworkReady=false"))),
    )
    .await
    .expect("the runtime's network is reported not ready")
    .expect("health")
    .clone();
    let ComponentHealth::Failing { reason } = not_ready else { unreachable!("matched above") };
    assert!(
        reason.starts_with("container runtime network not ready: NetworkReady=false reason:NetworkPluginNotReady"),
        "{reason}"
    );

    // A pod on the pod network: it waits.
    let app = serde_json::json!({
        "metadata": {"name": "app", "namespace": "default", "uid": "app-1"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": node.image, "command": ["sh", "-c", "echo up; exec sleep 3600"]}],
        },
    });
    node.pods.apply(serde_json::from_value(app).expect("pod"));
    let waiting = node
        .pods
        .store()
        .wait_for(SOON, |pods| {
            pods.get("app-1")
                .and_then(|p| p.status.as_ref()?.container_statuses.as_ref()?.first().cloned())
                .is_some_and(|c| {
                    c.state.and_then(|s| s.waiting).and_then(|w| w.reason).as_deref() == Some("ContainerCreating")
                })
        })
        .await
        .unwrap_or_else(|| panic!("app never waited: {:#?}", node.pods.store().get("app-1")));
    let status = waiting["app-1"].status.clone().unwrap_or_default();
    assert_eq!(status.phase.as_deref(), Some("Pending"));
    assert_eq!(status.pod_ip, None);

    // The network plugin: host network, privileged, an init container that
    // writes the CNI configuration into the runtime's dir.
    let plugin = serde_json::json!({
        "metadata": {"name": "net-plugin", "namespace": "kube-system", "uid": "net-plugin-1"},
        "spec": {
            "hostNetwork": true,
            "terminationGracePeriodSeconds": 1,
            "initContainers": [{
                "name": "install-cni", "image": node.image,
                "command": ["sh", "-c", "echo \"$CONF\" > /host/cni/10-net.conflist"],
                "env": [{"name": "CONF", "value": containerd.network_config()}],
                "securityContext": {"privileged": true},
                "volumeMounts": [{"name": "cni", "mountPath": "/host/cni"}],
            }],
            "containers": [{"name": "agent", "image": node.image, "command": ["sh", "-c", "exec sleep 3600"]}],
            "volumes": [{"name": "cni", "hostPath": {"path": containerd.cni_dir().display().to_string(), "type": "Directory"}}],
        },
    });
    node.pods.apply(serde_json::from_value(plugin).expect("pod"));
    let running = node
        .pods
        .store()
        .wait_for(SOON, |pods| {
            pods.get("app-1").and_then(|p| p.status.as_ref()?.pod_ip.clone()).is_some()
                && pods.get("app-1").and_then(|p| super::phase(p).map(str::to_owned)).as_deref() == Some("Running")
        })
        .await
        .unwrap_or_else(|| {
            panic!("app never ran: {:#?}; containerd: {}", node.pods.store().get("app-1"), containerd.log())
        });
    let app = &running["app-1"];
    let ip: std::net::Ipv4Addr =
        app.status.as_ref().and_then(|s| s.pod_ip.as_deref()).expect("ip").parse().expect("v4");
    assert_eq!(ip.octets()[0], 10, "{ip}");
    let statuses = app.status.as_ref().and_then(|s| s.container_statuses.clone()).unwrap_or_default();
    assert_eq!(statuses.first().map(|c| c.restart_count), Some(0), "{statuses:?}");
    assert!(std::fs::read_to_string(containerd.cni_dir().join("10-net.conflist")).is_ok_and(|t| t.contains("bridge")));
    let plugin = node.pods.store().get("net-plugin-1").expect("the plugin's pod");
    assert_eq!(super::phase(&plugin), Some("Running"), "{:?}", plugin.status);
    tokio::time::timeout(SOON, health.wait_for(|h| *h == ComponentHealth::Healthy))
        .await
        .expect("the runtime is reported ready once its network is")
        .expect("health");
    // The node never asked the runtime for the waiting pod's sandbox while
    // the network was not there (it would have failed on it).
    let log = containerd.log();
    assert!(!log.lines().any(|l| l.contains("RunPodSandbox") && l.contains("cni plugin not initialized")), "{log}");
}
