//! Upstream's DRA test driver (`test/e2e/dra/test-driver` of the
//! Kubernetes tree, its `kubelet-plugin` command) for tests on a real
//! control plane: built from the same tree as the Kubernetes binaries and
//! found beside them (`RUSTLET_KUBE_BIN_DIR/dra-test-driver`). It is a
//! driver on upstream's `kubeletplugin` helper: it registers
//! `v1beta1.DRAPlugin`, publishes a ResourceSlice of `--num-devices`
//! devices (`device-00`, ...) for its node in `v1beta1`, and prepares a
//! claim by writing one CDI spec per request into `--cdi-dir`, with the
//! env of the claim's opaque config (`user_<key>=<value>`, `admin_...`
//! from a class) and `claim_<claim>_<request>=true`; unprepare removes it.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject};
use kubelet::cluster::claims::ServedVersion;
use kubelet_api::resource::{self as resource_api, ResourceVersion};

use crate::skip::{Need, skip};
use crate::test_api::TestApi;

/// The driver's name (its default).
pub const TEST_DRIVER: &str = "test-driver.cdi.k8s.io";

/// How long the real control plane may take to schedule, allocate and
/// create claims (seconds here; a loaded machine, much more).
pub const SCHEDULED: Duration = Duration::from_secs(180);

/// For `test` on `api`'s real control plane: the driver's binary and the
/// version of `resource.k8s.io` served, with the scheduler and the
/// controller manager started; `None` (after saying why, or failing under
/// `RUSTLET_REQUIRE_KUBE_DRA=1`) where the control plane predates
/// structured DRA or the binary is missing.
pub async fn setting_up(test: &str, api: &TestApi) -> Option<(PathBuf, ResourceVersion)> {
    let plane = api.control_plane().expect("a real control plane");
    if !plane.serves_structured_dra() {
        let why = format!("Kubernetes 1.{} predates structured DRA (1.32+)", plane.minor_version());
        skip(test, Need::KubeDra, &why);
        return None;
    }
    let binary = plane.bin_dir().join("dra-test-driver");
    if !binary.is_file() {
        let why = format!("{} is missing (build test/e2e/dra/test-driver of the same tree there)", binary.display());
        skip(test, Need::KubeDra, &why);
        return None;
    }
    plane.ensure_scheduler().expect("kube-scheduler");
    plane.ensure_controller_manager().expect("kube-controller-manager");
    let version = ServedVersion::default().get(&api.admin).await.expect("discovery").expect("structured DRA served");
    Some((binary, version))
}

/// The driver as a process: `kubelet-plugin` for `node`, its sockets under
/// `root/plugins_registry` and `root/plugins/<driver>`, its CDI specs in
/// `root/cdi`, its log (`-v 6`: each gRPC call, `handling request`, its
/// method, `handling request succeeded`) in `root/<log>`.
pub fn start(binary: &Path, kubeconfig: &Path, node: &str, root: &Path, log: &str) -> tokio::process::Child {
    // The helper binds its socket in `<datadir>/<driver>` and makes only
    // that directory's parent (a deployment mounts the directory).
    std::fs::create_dir_all(root.join("plugins").join(TEST_DRIVER)).expect("the driver's socket directory");
    let log = std::fs::OpenOptions::new().create(true).append(true).open(root.join(log)).expect("driver log");
    tokio::process::Command::new(binary)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["-v", "6", "kubelet-plugin", "--node-name", node, "--num-devices", "4"])
        .arg("--plugin-registration-path")
        .arg(root.join("plugins_registry"))
        .arg("--datadir")
        .arg(root.join("plugins"))
        .arg("--cdi-dir")
        .arg(root.join("cdi"))
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the DRA test driver")
}

/// `kind`/`plural` of `resource.k8s.io` at `version`.
pub fn resource(version: ResourceVersion, kind: &str, plural: &str) -> ApiResource {
    kubelet::cluster::claims::api_resource(version, kind, plural)
}

/// `hub` (an object in `v1`'s shape, with its `kind`) written in `version`.
pub fn in_version(mut hub: serde_json::Value, version: ResourceVersion) -> DynamicObject {
    hub["apiVersion"] = ResourceVersion::V1.api_version().into();
    resource_api::from_hub(&mut hub, version);
    serde_json::from_value(hub).expect("object")
}

/// Waits (watching) until `node`'s ResourceSlices hold `count` devices;
/// their names, read through `v1`'s model.
pub async fn slice_devices(
    slices: Api<DynamicObject>,
    node: &str,
    version: ResourceVersion,
    count: usize,
) -> Vec<String> {
    use futures_util::StreamExt as _;
    use kube::runtime::watcher;
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = watcher(slices, config).boxed();
    let mut by_slice: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    let wait = async {
        loop {
            let (object, deleted) = match events.next().await.expect("watch").expect("watch event") {
                watcher::Event::Apply(o) | watcher::Event::InitApply(o) => (o, false),
                watcher::Event::Delete(o) => (o, true),
                _ => continue,
            };
            let name = object.metadata.name.clone().unwrap_or_default();
            let mut value = serde_json::to_value(object).expect("json");
            value["apiVersion"] = version.api_version().into();
            value["kind"] = "ResourceSlice".into();
            resource_api::to_hub(&mut value);
            let slice: k8s_openapi::api::resource::v1::ResourceSlice =
                serde_json::from_value(value).expect("the v1 model");
            if deleted {
                by_slice.remove(&name);
            } else {
                by_slice.insert(name, slice.spec.devices.unwrap_or_default().into_iter().map(|d| d.name).collect());
            }
            let devices: Vec<String> = by_slice.values().flatten().cloned().collect();
            if devices.len() == count {
                return devices;
            }
        }
    };
    let deadline = SCHEDULED;
    tokio::time::timeout(deadline, wait).await.unwrap_or_else(|_| panic!("{count} devices in {by_slice:?}"))
}

/// Waits (inotify) until `dir` holds `count` entries.
pub async fn wait_entries(dir: &Path, count: usize) {
    use tokio_stream::StreamExt as _;
    std::fs::create_dir_all(dir).expect("mkdir");
    let inotify = inotify::Inotify::init().expect("inotify");
    let mask = inotify::WatchMask::CREATE
        | inotify::WatchMask::DELETE
        | inotify::WatchMask::MOVED_TO
        | inotify::WatchMask::MOVED_FROM;
    inotify.watches().add(dir, mask).expect("watch");
    let mut events = inotify.into_event_stream(vec![0u8; 4096]).expect("stream");
    let entries = || std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
    let wait = async {
        while entries() != count {
            events.next().await.expect("inotify alive").expect("inotify event");
        }
    };
    if tokio::time::timeout(SCHEDULED, wait).await.is_err() {
        panic!("{} holds {} entries, not {count}", dir.display(), entries());
    }
}

/// The last 40 lines of the file at `path` (a log, for a failure message).
pub fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
