//! Pod lifecycle benchmark: prints figures, asserts nothing about time.
//!
//! In one process: the node as a provider embeds it (`NodeBuilder`, static
//! pods from a manifest directory, the host-process test provider running
//! each container as a real `sleep` process), a device plugin and a CSI
//! driver served on real Unix sockets and registered the way real ones are.
//! Every pod asks for one device and has one inline CSI volume. Measures:
//! - manifest written → pod Running (its device allocated, its volume
//!   published, its process started), one pod at a time;
//! - manifest removed → everything released (process stopped, volume
//!   unpublished, device freed and checkpointed, pod gone);
//! - 500 manifests written at once → all Running; the node's RSS then;
//!   and all removed at once → all released;
//! - the floor: spawning and stopping the same process with nothing else.
//!
//! Run: `cargo bench -p rustlet --bench pods`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kubelet::node::{Node, NodeBuilder, NodeConfig};
use kubelet::pod::Allocatable;
use kubelet_api::deviceplugin::v1beta1::DevicePluginOptions;
use rustlet_testkit::csi_driver::{CsiDriverConfig, RegisteredCsiDriver};
use rustlet_testkit::device_plugin::{DevicePluginBehaviour, DeviceSpec, FakeDevicePlugin, register_with_kubelet};
use rustlet_testkit::host_provider::HostProcessProvider;
use rustlet_testkit::report::Reporter;
use tokio_util::sync::CancellationToken;

use common::figures;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
const GPU: &str = "bench.example.com/gpu";
const DRIVER: &str = "bench.csi.example.com";
const SEQUENTIAL: usize = 50;
const AT_ONCE: usize = 500;
const DEADLINE: Duration = Duration::from_secs(120);

fn manifest(name: &str) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:
  terminationGracePeriodSeconds: 5
  containers:
  - name: main
    image: busybox
    command: [sleep, '600']
    resources:
      limits: {{\"{GPU}\": 1}}
    volumeMounts: [{{name: data, mountPath: /data}}]
  volumes:
  - {{name: data, csi: {{driver: {DRIVER}, volumeAttributes: {{size: 1Mi}}}}}}
"
    )
}

/// Writes a manifest as editors do: a temp file renamed in place.
fn write_manifest(dir: &Path, name: &str) -> std::io::Result<()> {
    let temp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&temp, manifest(name))?;
    std::fs::rename(temp, dir.join(format!("{name}.yaml")))
}

struct Bench {
    node: Node,
    manifests: PathBuf,
    _root: tempfile::TempDir,
}

async fn start(shutdown: &CancellationToken) -> Result<Bench, BoxError> {
    let root = rustlet_testkit::node_root::tempdir("rustlet-bench-pods-");
    let manifests = root.path().join("manifests");
    for dir in ["manifests", "plugins_registry", "device-plugins"] {
        std::fs::create_dir_all(root.path().join(dir))?;
    }
    let mut config = NodeConfig::new(root.path(), "bench");
    config.http_address = None;
    config.pods.manifest_dir = Some(manifests.clone());
    config.pods.allocatable = Some(Allocatable { cpu_milli: 64_000, memory: 64 << 30, pods: 1000 });
    let node = NodeBuilder::new(config).provider(Arc::new(HostProcessProvider::new())).start(shutdown.clone()).await?;

    let devices = (0..AT_ONCE + SEQUENTIAL)
        .map(|i| DeviceSpec { id: format!("gpu-{i:04}"), health: "Healthy".into(), numa: None })
        .collect();
    let (plugin, control) = FakeDevicePlugin::new(
        GPU,
        devices,
        DevicePluginOptions::default(),
        DevicePluginBehaviour::Normal,
        Reporter::Discard,
    );
    plugin.spawn(&root.path().join("device-plugins/gpu.sock"), shutdown.clone())?;
    register_with_kubelet(&node.devices().socket_path(), "v1beta1", "gpu.sock", GPU, DevicePluginOptions::default())
        .await?;
    // The device stream ends with the control: keep it for the whole run.
    std::mem::forget(control);
    let mut capacity = node.devices().capacity();
    capacity.wait_for(|c| c.get(GPU).is_some_and(|c| c.allocatable == (AT_ONCE + SEQUENTIAL) as u64)).await?;

    let driver_config = CsiDriverConfig { name: DRIVER.into(), node_id: "bench".into(), ..Default::default() };
    let driver = RegisteredCsiDriver::new(
        root.path().join("plugins_registry/bench-reg.sock"),
        root.path().join("bench-csi.sock"),
        driver_config,
    );
    driver.spawn(Reporter::Discard, shutdown.clone())?;
    let drivers = node.csi_drivers().view();
    drivers.wait_for(DRIVER, DEADLINE).await.ok_or("the CSI driver did not register")?;
    std::fs::write(
        manifests.join("csidriver.yaml"),
        format!(
            "apiVersion: storage.k8s.io/v1\nkind: CSIDriver\nmetadata: {{name: {DRIVER}}}\nspec: {{podInfoOnMount: true, volumeLifecycleModes: [Ephemeral]}}\n"
        ),
    )?;
    let mut changes = node.static_pods().ok_or("no static pods")?.changes();
    while node.csi_driver_objects().get(DRIVER).is_none() {
        changes.changed().await?;
    }
    Ok(Bench { node, manifests, _root: root })
}

/// The provider's share: the same process spawned and stopped the same way,
/// nothing else.
async fn floor() -> Result<(Vec<Duration>, Vec<Duration>), BoxError> {
    let (mut starts, mut stops) = (Vec::new(), Vec::new());
    for _ in 0..SEQUENTIAL {
        let began = Instant::now();
        let mut child = tokio::process::Command::new("sleep").arg("600").kill_on_drop(true).spawn()?;
        starts.push(began.elapsed());
        let pid = child.id().unwrap_or_default().to_string();
        let began = Instant::now();
        tokio::process::Command::new("kill").args(["-TERM", &pid]).status().await?;
        child.wait().await?;
        stops.push(began.elapsed());
    }
    Ok((starts, stops))
}

async fn run() -> Result<(), BoxError> {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let shutdown = CancellationToken::new();
    let bench = start(&shutdown).await?;
    let store = bench.node.pods().store().clone();
    println!(
        "pods benchmark: NodeBuilder + static pods + host-process provider; one device and one inline CSI volume per pod"
    );

    let (floor_start, floor_stop) = floor().await?;
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for i in 0..SEQUENTIAL {
        let name = format!("seq{i}");
        let began = Instant::now();
        write_manifest(&bench.manifests, &name)?;
        common::wait_pods(&store, &format!("{name}-"), 1, common::is_running, DEADLINE).await?;
        up.push(began.elapsed());
        let began = Instant::now();
        std::fs::remove_file(bench.manifests.join(format!("{name}.yaml")))?;
        common::wait_pods(&store, &format!("{name}-"), 0, |_| true, DEADLINE).await?;
        down.push(began.elapsed());
    }
    println!("\none pod at a time ({SEQUENTIAL} pods):");
    println!("  manifest → Running      {}   (target p50 ≤ 20 ms; kubelet 1.28 here: p50 732 ms)", figures(up).in_ms());
    println!("  removed → released      {}   (target p50 ≤ 50 ms; kubelet 1.28 here: ~650 ms)", figures(down).in_ms());
    println!("  floor: spawn the process {}", figures(floor_start).in_ms());
    println!("  floor: SIGTERM and reap  {}", figures(floor_stop).in_ms());

    let rss_before = common::rss_mib();
    let began = Instant::now();
    for i in 0..AT_ONCE {
        write_manifest(&bench.manifests, &format!("many{i}"))?;
    }
    let written = began.elapsed();
    common::wait_pods(&store, "many", AT_ONCE, common::is_running, DEADLINE).await?;
    let all_up = began.elapsed();
    let rss = common::rss_mib();
    println!("\n{AT_ONCE} pods at once:");
    println!(
        "  manifests written in {:.0} ms; all Running after {:.0} ms   (target ≤ 10 s; kubelet 1.28 here: 20 pods in 2.6–3.2 s)",
        written.as_secs_f64() * 1e3,
        all_up.as_secs_f64() * 1e3
    );
    println!(
        "  node RSS with {AT_ONCE} running pods: {rss:.1} MiB (before them: {rss_before:.1} MiB)   (target ≤ 100 MB; this process also serves the plugins)"
    );
    let began = Instant::now();
    for i in 0..AT_ONCE {
        std::fs::remove_file(bench.manifests.join(format!("many{i}.yaml")))?;
    }
    common::wait_pods(&store, "many", 0, |_| true, DEADLINE).await?;
    println!("  all removed → all released after {:.0} ms", began.elapsed().as_secs_f64() * 1e3);
    tokio::time::timeout(DEADLINE, bench.node.devices().persisted()).await??;
    let held: usize = bench.node.devices().capacity().borrow().get(GPU).map_or(0, |c| c.allocatable as usize);
    println!("  devices advertised after the run: {held} (of {})", AT_ONCE + SEQUENTIAL);
    shutdown.cancel();
    bench.node.stopped().await;
    Ok(())
}

fn main() -> Result<(), BoxError> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run())
}
