//! `rustlet demo`: the standalone node in a temporary root dir, with demo
//! plugins registering against it over real Unix sockets.
//!
//! Scenario: two CSI drivers (with topology and a volume limit) register; a
//! plugin of a type the node has no handler for is turned down with a reason;
//! a device plugin registers on `kubelet.sock`, one of its devices turns
//! unhealthy, and a pod's container is allocated the healthy ones; then one
//! CSI driver goes away and is deregistered. Without `--once` the node
//! keeps running until Ctrl-C so `/status` and `/metrics` can be explored.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Pod;
use kubelet::device_manager::{ContainerKind, ContainerRequest, ResourceCapacity};
use kubelet::plugin_manager::PluginEvent;
use kubelet_api::constants::{DEVICE_PLUGIN_VERSION, DEVICE_PLUGINS_DIR, PLUGINS_REGISTRY_DIR};
use kubelet_api::deviceplugin::v1beta1::DevicePluginOptions;
use rustlet_sample_plugins::csi_driver::{CsiDriverConfig, RegisteredCsiDriver};
use rustlet_sample_plugins::device_plugin::{
    DeviceControl, DevicePluginBehaviour, DeviceSpec, FakeDevicePlugin, register_with_kubelet,
};
use rustlet_sample_plugins::registration::{Behaviour, Identity, RegistrationPlugin};
use rustlet_sample_plugins::report::Reporter;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use kubelet::health::HealthReporter;
use kubelet::node::Node;

use clap::Parser as _;

use crate::cli::DemoArgs;

const STEP_DEADLINE: Duration = Duration::from_secs(20);

/// The demo's throwaway root dir. The node makes its root dir a shared
/// mount (a bind on itself, when run as root) and leaves it, as the
/// kubelet does; the demo's goes with the dir.
struct DemoRoot(tempfile::TempDir);

impl Drop for DemoRoot {
    fn drop(&mut self) {
        if kubelet::volume::mounts::is_mount_point(self.0.path()) {
            let _ = rustix::mount::unmount(self.0.path(), rustix::mount::UnmountFlags::DETACH);
        }
    }
}

pub(crate) async fn run(args: DemoArgs, signals: HealthReporter, shutdown: CancellationToken) -> anyhow::Result<()> {
    let root = DemoRoot(
        tempfile::Builder::new().prefix("rustlet-demo-").tempdir().context("cannot create a temporary root dir")?,
    );
    let node = start_node(root.0.path(), &signals, &shutdown).await?;
    let mut events = node.plugins().subscribe();
    let plugins = CancellationToken::new();
    let hostpath = demo_csi_drivers(&node, &mut events, &plugins).await?;
    demo_unknown_plugin(&node, &mut events, &plugins).await?;
    let control = demo_device_plugin(&node, &plugins).await?;
    demo_dra_driver(&node, &plugins).await?;
    demo_static_pod(&node).await?;
    drop(control);
    demo_csi_deregistration(&node, &mut events, hostpath).await?;

    let checks: Vec<String> = node
        .healthz()
        .report()
        .into_iter()
        .map(|c| if c.health.is_healthy() { format!("{} ok", c.name) } else { format!("{} FAILING", c.name) })
        .collect();
    println!("\nnode health (/healthz): {}", checks.join(", "));
    if args.once {
        println!("\ndemo complete");
        shutdown.cancel();
    } else {
        println!("\ndemo complete; the node keeps running (Ctrl-C to stop)");
        shutdown.cancelled().await;
    }
    plugins.cancel();
    node.stopped().await;
    Ok(())
}

/// The node, standalone in `root`, with the command line's defaults.
async fn start_node(root: &Path, signals: &HealthReporter, shutdown: &CancellationToken) -> anyhow::Result<Node> {
    let root_dir = root.display().to_string();
    let manifests = root.join("manifests").display().to_string();
    let flags = [
        "rustlet",
        "--standalone",
        "--root-dir",
        &root_dir,
        "--node-name",
        "rustlet-demo",
        "--healthz-port",
        "0",
        "--address",
        "127.0.0.1",
        "--port",
        "0",
        "--pod-manifest-path",
        &manifests,
        // The demo's root dir is temporary: it watches memory only, so that
        // a nearly full disk does not refuse its pods.
        "--eviction-hard",
        "memory.available<100Mi",
    ];
    let node_args = crate::cli::Cli::try_parse_from(flags).context("the demo's node flags")?.node;
    let node = crate::node::start(&node_args, signals, shutdown.clone()).await?;
    let http = node.http_address().context("the demo node serves no HTTP endpoint")?;
    println!("\nRustlet demo: standalone node, root dir {}", node.root_dir().display());
    println!("  status:  curl --unix-socket {} http://localhost/status", node.local_socket().display());
    println!("  metrics: http://{http}/metrics");
    println!("  healthz: http://{http}/healthz?verbose\n");
    Ok(node)
}

/// Two CSI drivers register through `plugins_registry/`. Returns the first
/// one's stop and registration socket.
async fn demo_csi_drivers(
    node: &Node,
    events: &mut broadcast::Receiver<PluginEvent>,
    plugins: &CancellationToken,
) -> anyhow::Result<(CancellationToken, PathBuf)> {
    let registry = node.root_dir().join(PLUGINS_REGISTRY_DIR);
    let mut hostpath = None;
    for (name, zone, max_volumes) in [("hostpath.csi.rustlet.dev", "zone-a", 8), ("nfs.csi.rustlet.dev", "zone-a", 0)] {
        let endpoint = node.root_dir().join("plugins").join(name).join("csi.sock");
        let socket = registry.join(format!("{name}-reg.sock"));
        let stop = plugins.child_token();
        let config = CsiDriverConfig {
            name: name.into(),
            node_id: "rustlet-demo".into(),
            max_volumes_per_node: max_volumes,
            topology: HashMap::from([("topology.rustlet.dev/zone".to_owned(), zone.to_owned())]),
            ..Default::default()
        };
        RegisteredCsiDriver::new(&socket, &endpoint, config).spawn(Reporter::Discard, stop.clone())?;
        println!("started CSI driver {name} (registration socket {})", socket.display());
        hostpath.get_or_insert((stop, socket));
    }
    for _ in 0..2 {
        let info = next_event(events, |e| matches!(e, PluginEvent::Registered(_))).await?;
        if let PluginEvent::Registered(info) = info {
            println!("  -> registered {} plugin {} (endpoint {})", info.plugin_type, info.name, info.endpoint);
        }
    }
    hostpath.context("no CSI driver started")
}

/// A plugin of a type the node has no handler for is turned down, and told.
async fn demo_unknown_plugin(
    node: &Node,
    events: &mut broadcast::Receiver<PluginEvent>,
    plugins: &CancellationToken,
) -> anyhow::Result<()> {
    let unknown = node.root_dir().join(PLUGINS_REGISTRY_DIR).join("gadget.sock");
    let identity = Identity {
        plugin_type: "GadgetPlugin".into(),
        name: "gadget.example.com".into(),
        endpoint: String::new(),
        versions: vec!["v1".into()],
    };
    RegistrationPlugin::new(&unknown, identity, Behaviour::Normal, Reporter::Discard).spawn(plugins.child_token())?;
    println!("started a plugin of type GadgetPlugin, which this node has no handler for");
    if let PluginEvent::RegistrationFailed { error, .. } =
        next_event(events, |e| matches!(e, PluginEvent::RegistrationFailed { .. })).await?
    {
        println!("  -> turned down, the plugin was told: {error}");
    }
    Ok(())
}

/// The node's CSI drivers; then the hostpath driver stops and removes its
/// socket, and is deregistered.
async fn demo_csi_deregistration(
    node: &Node,
    events: &mut broadcast::Receiver<PluginEvent>,
    (stop, socket): (CancellationToken, PathBuf),
) -> anyhow::Result<()> {
    println!("\nCSI drivers on this node:");
    for driver in node.csi_drivers().list() {
        println!("  {} v{} at {}", driver.name, driver.version, driver.endpoint);
    }
    println!("Node CSI info (annotation, labels, CSINode drivers):");
    println!("{}", serde_json::to_string_pretty(&node.node_info().snapshot())?);
    stop.cancel();
    std::fs::remove_file(&socket).with_context(|| format!("cannot remove {}", socket.display()))?;
    println!("\nstopped hostpath.csi.rustlet.dev and removed its socket");
    if let PluginEvent::Deregistered(info) = next_event(events, |e| matches!(e, PluginEvent::Deregistered(_))).await? {
        println!("  -> deregistered {} plugin {}", info.plugin_type, info.name);
    }
    let left: Vec<_> = node.csi_drivers().list().into_iter().map(|d| d.name).collect();
    println!("CSI drivers now: {left:?}");
    if left != ["nfs.csi.rustlet.dev"] {
        bail!("unexpected CSI drivers after the demo: {left:?}");
    }
    Ok(())
}

/// The demo's image: the `hello` example module, imported into the node's
/// store from an OCI layout (no registry needed).
const DEMO_IMAGE: &str = "demo.rustlet.dev/wasm/hello:v1";

/// The static pod's manifest (and its CSI driver's object).
fn demo_manifest() -> String {
    format!(
        "apiVersion: storage.k8s.io/v1
kind: CSIDriver
metadata: {{name: hostpath.csi.rustlet.dev}}
spec: {{podInfoOnMount: true, volumeLifecycleModes: [Persistent, Ephemeral]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: demo}}
spec:
  restartPolicy: Never
  tolerations: [{{key: kubernetes.io/arch, value: wasm32-wasi}}]
  containers:
  - name: app
    image: {DEMO_IMAGE}
    imagePullPolicy: IfNotPresent
    args: [--greeting, hello]
    env: [{{name: POD_PURPOSE, value: demo}}]
    resources:
      requests: {{cpu: 100m, memory: 64Mi}}
      limits: {{gpu.rustlet.dev/demo: 1, memory: 64Mi}}
    volumeMounts: [{{name: data, mountPath: /data}}, {{name: scratch, mountPath: /scratch}}]
  volumes:
  - {{name: data, csi: {{driver: hostpath.csi.rustlet.dev, volumeAttributes: {{size: 1Gi}}}}}}
  - {{name: scratch, emptyDir: {{}}}}
"
    )
}

/// Imports the `hello` module into the node's store from an OCI layout, as
/// `rustlet images import` does.
fn import_demo_image(node: &Node) -> anyhow::Result<()> {
    let layout = node.root_dir().join("demo-layout");
    let module = rustlet_wasi::examples::binary("hello").map_err(anyhow::Error::msg)?;
    rustlet_wasi::import::write_layout(&layout, &[(DEMO_IMAGE, &module)]).map_err(anyhow::Error::msg)?;
    let store = rustlet_wasi::store::ImageStore::open(node.root_dir())?;
    let imported = rustlet_wasi::import::import(&store, &layout, None).map_err(anyhow::Error::msg)?;
    println!(
        "\nimported image {DEMO_IMAGE} ({} bytes of wasm) into the node's store, as `rustlet images import` does",
        imported.first().map_or(0, |i| i.size)
    );
    Ok(())
}

/// A static pod: a WebAssembly module that requests a device and mounts an
/// inline CSI volume is admitted, gets its device and its volume, runs and
/// prints what it sees; removing its manifest releases everything.
async fn demo_static_pod(node: &Node) -> anyhow::Result<()> {
    import_demo_image(node)?;
    let manifest = node.root_dir().join("manifests").join("demo.yaml");
    std::fs::write(&manifest, demo_manifest()).with_context(|| format!("cannot write {}", manifest.display()))?;
    println!("wrote static pod manifest {}", manifest.display());
    let done = node
        .pods()
        .store()
        .wait_for(STEP_DEADLINE, |pods| {
            pods.values()
                .any(|p| matches!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")))
        })
        .await
        .context("the static pod did not run to completion in time")?;
    let pod = done.values().next().context("no pod")?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let published = show_demo_pod(node, pod)?;
    std::fs::remove_file(&manifest).context("cannot remove the manifest")?;
    node.pods()
        .store()
        .wait_for(STEP_DEADLINE, |pods| pods.is_empty())
        .await
        .context("the static pod was not released in time")?;
    let free = node.devices().allocated(&uid, "app").is_empty() && !published.exists();
    println!("  -> manifest removed: volume unpublished and device freed: {free}");
    if !free {
        bail!("the removed pod still holds its device or volume");
    }
    Ok(())
}

/// What the finished demo pod got and did: its device, its CSI volume, its
/// exit, its output and the file it wrote. Returns where its volume was
/// published.
fn show_demo_pod(node: &Node, pod: &Pod) -> anyhow::Result<PathBuf> {
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let status = pod.status.clone().unwrap_or_default();
    println!("  -> pod {name} (UID {uid}) admitted");
    let held = node.devices().allocated(&uid, "app").remove("gpu.rustlet.dev/demo").unwrap_or_default();
    println!("  -> device allocated: {held:?}");
    let published = node.root_dir().join("pods").join(&uid).join("volumes/kubernetes.io~csi/data/mount");
    println!("  -> CSI volume published by hostpath.csi.rustlet.dev at {}", published.display());
    let app = status.container_statuses.unwrap_or_default().into_iter().next().context("no container status")?;
    println!("  -> image ready: {}", app.image_id);
    let exit = app.state.and_then(|s| s.terminated).context("the container did not end")?;
    println!(
        "  -> module ran under wasmtime and exited {} ({}); pod {}",
        exit.exit_code,
        exit.reason.unwrap_or_default(),
        status.phase.unwrap_or_default()
    );
    let log_path = kubelet::pod::pod_log_dir(node.root_dir(), "default", &name, &uid).join("app/0.log");
    let log = std::fs::read_to_string(&log_path).with_context(|| format!("cannot read {}", log_path.display()))?;
    println!("  -> its output (rustlet logs {name} --root-dir {}):", node.root_dir().display());
    for line in kubelet::provider::decode_cri_log(&log) {
        print!("       {line}");
    }
    let written = std::fs::read_to_string(published.join("hello.txt"))
        .context("the module did not write hello.txt into its CSI volume")?;
    println!("  -> the file it wrote into the CSI volume says: {}", written.trim_end());
    println!("     (from another terminal: rustlet get pods --root-dir {})", node.root_dir().display());
    if exit.exit_code != 0 || !log.contains("env: FAKE_DEVICES=") {
        bail!("the demo module did not run as expected (exit {}):\n{log}", exit.exit_code);
    }
    Ok(published)
}

/// A device plugin registers on kubelet.sock; one device turns unhealthy.
/// Returns the plugin's control (its device stream ends when it is dropped).
async fn demo_device_plugin(node: &Node, plugins: &CancellationToken) -> anyhow::Result<DeviceControl> {
    const RESOURCE: &str = "gpu.rustlet.dev/demo";
    let socket = node.root_dir().join(DEVICE_PLUGINS_DIR).join("demo-gpu.sock");
    let devices = ["gpu-0:Healthy:0", "gpu-1:Healthy:0", "gpu-2:Healthy:1"]
        .iter()
        .map(|d| d.parse::<DeviceSpec>().map_err(anyhow::Error::msg))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let options = DevicePluginOptions::default();
    let (plugin, control) =
        FakeDevicePlugin::new(RESOURCE, devices, options, DevicePluginBehaviour::Normal, Reporter::Discard);
    plugin.spawn(&socket, plugins.child_token())?;
    println!("\nstarted device plugin for {RESOURCE} with 3 devices");
    register_with_kubelet(&node.devices().socket_path(), DEVICE_PLUGIN_VERSION, "demo-gpu.sock", RESOURCE, options)
        .await
        .map_err(|e| anyhow::anyhow!("device plugin registration failed: {e}"))?;
    let capacity = node.devices().capacity();
    let wait = |want: ResourceCapacity| {
        let mut capacity = capacity.clone();
        async move {
            tokio::time::timeout(STEP_DEADLINE, capacity.wait_for(|c| c.get(RESOURCE) == Some(&want)))
                .await
                .context("device capacity did not change in time")?
                .context("the device manager stopped")?;
            anyhow::Ok(())
        }
    };
    wait(ResourceCapacity { capacity: 3, allocatable: 3 }).await?;
    println!("  -> registered on kubelet.sock: capacity 3, allocatable 3");
    control.set_health("gpu-1", "Unhealthy");
    wait(ResourceCapacity { capacity: 3, allocatable: 2 }).await?;
    println!("  -> gpu-1 reported unhealthy: capacity 3, allocatable 2");
    let request = ContainerRequest {
        pod_uid: "demo-pod-uid".into(),
        pod_name: "demo-pod".into(),
        container_name: "app".into(),
        kind: ContainerKind::App,
        limits: [(RESOURCE.to_owned(), 2)].into_iter().collect(),
    };
    let options = node.devices().allocate(&request).await.context("device allocation failed")?;
    let held = node.devices().allocated("demo-pod-uid", "app").remove(RESOURCE).unwrap_or_default();
    println!("  -> pod demo-pod container app allocated {held:?} (the healthy ones); run options:");
    println!("     env {:?}, CDI devices {:?}", options.envs, options.cdi_devices);
    let freed = node.devices().free_pod("demo-pod-uid");
    println!("  -> pod removed: {freed} devices freed");
    Ok(control)
}

/// A DRA driver upgraded without a gap: two instances of one driver side
/// by side, the claim prepared by the newest, the old one stopped; the
/// claim released. A pod's claim comes from the API server, so the
/// standalone demo prepares one the way the node does for such a pod.
async fn demo_dra_driver(node: &Node, plugins: &CancellationToken) -> anyhow::Result<()> {
    use rustlet_sample_plugins::dra_driver::{DraDriver, DraDriverConfig};
    const DRIVER: &str = "gpu.dra.rustlet.dev";
    let devices = vec!["gpu-0".to_owned(), "gpu-1".to_owned()];
    let drivers = node.dra_drivers();
    let connected = |n: usize| {
        let drivers = drivers.clone();
        async move {
            if drivers.wait_until(STEP_DEADLINE, |i| i.iter().filter(|i| i.connected).count() == n).await {
                anyhow::Ok(())
            } else {
                bail!("the DRA driver's instances did not connect in time: {:?}", drivers.list())
            }
        }
    };
    let old = plugins.child_token();
    let config = DraDriverConfig::new(DRIVER, "v1-0", node.root_dir(), node.name(), devices.clone());
    let (old_reports, mut old_calls) = tokio::sync::mpsc::unbounded_channel();
    DraDriver::new(config, Reporter::Channel(old_reports)).spawn(old.clone())?;
    connected(1).await?;
    println!(
        "
started DRA driver {DRIVER} (instance v1-0, devices {devices:?})"
    );
    let config = DraDriverConfig::new(DRIVER, "v1-1", node.root_dir(), node.name(), devices.clone());
    let (new_reports, mut new_calls) = tokio::sync::mpsc::unbounded_channel();
    DraDriver::new(config, Reporter::Channel(new_reports)).spawn(plugins.child_token())?;
    connected(2).await?;
    for instance in drivers.list() {
        println!("  -> instance at {} registered ({}), connected", instance.endpoint, instance.version);
    }
    let claim =
        kubelet::dra::ClaimRef { namespace: "default".into(), uid: "demo-claim-uid".into(), name: "demo-gpu".into() };
    let prepared = drivers.prepare(DRIVER, std::slice::from_ref(&claim)).await?;
    let devices = prepared.get(&claim.uid).cloned().unwrap_or_else(|| Err("no answer".into()));
    let devices = devices.map_err(|e| anyhow::anyhow!("the claim was not prepared: {e}"))?;
    let cdi: Vec<&String> = devices.iter().flat_map(|d| d.cdi_device_ids.iter()).collect();
    // Each instance reports a prepare before answering it.
    let prepared_by = |calls: &mut tokio::sync::mpsc::UnboundedReceiver<rustlet_sample_plugins::report::Report>| {
        std::iter::from_fn(|| calls.try_recv().ok())
            .any(|r| matches!(r, rustlet_sample_plugins::report::Report::DraPrepare { .. }))
    };
    let by = match (prepared_by(&mut old_calls), prepared_by(&mut new_calls)) {
        (false, true) => "the newest instance (v1-1)",
        (true, false) => "the old instance (v1-0)",
        _ => bail!("expected exactly one instance to prepare the claim"),
    };
    println!("  -> claim default/demo-gpu prepared by {by}: CDI devices {cdi:?}");
    println!("     (in a cluster the node prepares a pod's allocated claims this way; static pods cannot have claims)");
    old.cancel();
    connected(1).await?;
    println!("  -> the old instance stopped: the driver stays usable ({})", drivers.usable(DRIVER));
    let released = drivers.unprepare(DRIVER, std::slice::from_ref(&claim)).await?;
    if let Some(Err(error)) = released.get(&claim.uid) {
        bail!("the claim was not released: {error}");
    }
    println!("  -> claim released");

    // What a monitoring agent reads.
    use kubelet_api::podresources::v1 as podresources;
    let socket = node.root_dir().join("pod-resources").join("kubelet.sock");
    let channel = kubelet_api::uds::dial(&socket, STEP_DEADLINE).await?;
    let mut lister = podresources::pod_resources_lister_client::PodResourcesListerClient::new(channel);
    let allocatable =
        lister.get_allocatable_resources(podresources::AllocatableResourcesRequest {}).await?.into_inner();
    let devices: Vec<String> = allocatable
        .devices
        .iter()
        .map(|d| {
            let numa: Vec<i64> = d.topology.iter().flat_map(|t| t.nodes.iter().map(|n| n.id)).collect();
            format!("{} {} (NUMA {numa:?})", d.resource_name, d.device_ids.join(","))
        })
        .collect();
    println!("\nPodResources API ({}): allocatable devices: {}", socket.display(), devices.join("; "));
    Ok(())
}

async fn next_event(
    events: &mut broadcast::Receiver<PluginEvent>,
    mut pred: impl FnMut(&PluginEvent) -> bool,
) -> anyhow::Result<PluginEvent> {
    let wait = async {
        loop {
            match events.recv().await {
                Ok(event) if pred(&event) => return Ok(event),
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => bail!("the plugin manager stopped"),
            }
        }
    };
    tokio::time::timeout(STEP_DEADLINE, wait).await.context("the demo step did not happen in time")?
}
