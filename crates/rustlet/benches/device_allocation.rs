//! Device allocation benchmark: prints figures, asserts nothing about time.
//!
//! In-process: the device manager (the library, as a provider embeds it) and
//! a fake device plugin on real Unix sockets. Measures:
//! - per-container allocation latency, interleaved with the plugin's share
//!   of it (the same `Allocate` call made directly on an open connection) and
//!   with the floor of making it durable (the checkpoint's bytes written with
//!   plain std calls: temporary file, fsync, rename, fsync of the directory);
//!   once on disk and once on tmpfs, where fsync costs nothing and what is
//!   left is the node's own work;
//! - 1,000 and 10,000 pods asking for one device each at once;
//! - start-up with those 10,000 allocations in the checkpoint.
//!
//! Run: `cargo bench -p rustlet --bench device_allocation`.

mod common;

use std::time::{Duration, Instant};

use kubelet::device_manager::{ContainerKind, ContainerRequest, DeviceManager, DeviceManagerConfig};
use kubelet_api::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use kubelet_api::deviceplugin::v1beta1::{AllocateRequest, ContainerAllocateRequest, DevicePluginOptions};
use rustlet_testkit::device_plugin::{
    DeviceControl, DevicePluginBehaviour, DeviceSpec, FakeDevicePlugin, register_with_kubelet,
};
use rustlet_testkit::report::Reporter;
use tokio_util::sync::CancellationToken;

use common::figures;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
const RESOURCE: &str = "alloc.example.com/dev";

fn request(pod: usize) -> ContainerRequest {
    ContainerRequest {
        pod_uid: format!("uid-{pod}"),
        pod_name: format!("pod-{pod}"),
        container_name: "c".into(),
        kind: ContainerKind::App,
        limits: [(RESOURCE.to_owned(), 1)].into_iter().collect(),
    }
}

async fn node_with_devices(
    dir: &std::path::Path,
    count: usize,
    shutdown: &CancellationToken,
) -> Result<(DeviceManager, DeviceControl), BoxError> {
    let mut config = DeviceManagerConfig::new(dir);
    config.call_timeout = Duration::from_secs(30);
    let manager = DeviceManager::start(config, shutdown.clone())?;
    let devices = (0..count)
        .map(|i| DeviceSpec { id: format!("d{i:05}"), health: "Healthy".into(), numa: Some((i % 2) as i64) })
        .collect();
    let (plugin, control) = FakeDevicePlugin::new(
        RESOURCE,
        devices,
        DevicePluginOptions::default(),
        DevicePluginBehaviour::Normal,
        Reporter::Discard,
    );
    plugin.spawn(&dir.join("alloc.sock"), shutdown.clone())?;
    register_with_kubelet(&manager.socket_path(), "v1beta1", "alloc.sock", RESOURCE, DevicePluginOptions::default())
        .await?;
    let mut capacity = manager.capacity();
    capacity.wait_for(|c| c.get(RESOURCE).is_some_and(|c| c.allocatable == count as u64)).await?;
    // The control is returned: dropping it would end the plugin's device stream.
    Ok((manager, control))
}

/// The physics under an allocation's durability: the same bytes written the
/// same way (temporary file, fsync, rename, fsync of the directory) with
/// plain std calls and no node logic.
fn floor_write(dir: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = dir.join("floor.tmp");
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, dir.join("floor"))?;
    std::fs::File::open(dir)?.sync_all()
}

/// A plain thread doing [`floor_write`] for an async caller: the floor of a
/// program that keeps fsync off its async workers (one wake-up there, one
/// back), with no node logic.
struct FloorThread {
    jobs: std::sync::mpsc::Sender<(Vec<u8>, tokio::sync::oneshot::Sender<std::io::Result<()>>)>,
}

impl FloorThread {
    fn start(dir: std::path::PathBuf) -> FloorThread {
        let (jobs, rx) = std::sync::mpsc::channel::<(Vec<u8>, tokio::sync::oneshot::Sender<std::io::Result<()>>)>();
        std::thread::spawn(move || {
            for (bytes, done) in rx {
                let _ = done.send(floor_write(&dir, &bytes));
            }
        });
        FloorThread { jobs }
    }

    async fn write(&self, bytes: Vec<u8>) -> Result<(), BoxError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.jobs.send((bytes, tx)).map_err(|_| "floor thread gone")?;
        Ok(rx.await??)
    }
}

/// `pods` allocations of one device out of `devices`, one at a time, each
/// followed by the plugin's own `Allocate` on an open connection and by the
/// floor write of the checkpoint as it now is.
async fn per_container(
    base: &std::path::Path,
    label: &str,
    devices: usize,
    pods: usize,
    rounds: usize,
) -> Result<(), BoxError> {
    let root = tempfile::tempdir_in(base)?;
    let dir = root.path().join("device-plugins");
    let floor_dir = root.path().join("floor");
    std::fs::create_dir(&floor_dir)?;
    let shutdown = CancellationToken::new();
    let (manager, _control) = node_with_devices(&dir, devices, &shutdown).await?;
    let channel = kubelet_api::uds::dial(dir.join("alloc.sock"), Duration::from_secs(5)).await?;
    let mut direct = DevicePluginClient::new(channel);
    let floor_thread = FloorThread::start(floor_dir.clone());
    let (mut total, mut plugin_only, mut floor, mut floor_async) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let checkpoint = dir.join(kubelet::device_manager::CHECKPOINT_FILE);
    let mut size = 0;
    for _ in 0..rounds {
        for pod in 0..pods {
            let t = Instant::now();
            manager.allocate(&request(pod)).await?;
            total.push(t.elapsed());
            let t = Instant::now();
            direct
                .allocate(AllocateRequest {
                    container_requests: vec![ContainerAllocateRequest {
                        devices_ids: vec![format!("d{:05}", devices - 1 - pod)],
                    }],
                })
                .await?;
            plugin_only.push(t.elapsed());
            let bytes = std::fs::read(&checkpoint)?;
            let t = Instant::now();
            floor_write(&floor_dir, &bytes)?;
            floor.push(t.elapsed());
            let t = Instant::now();
            floor_thread.write(bytes).await?;
            floor_async.push(t.elapsed());
        }
        size = size.max(std::fs::metadata(&checkpoint)?.len());
        for pod in 0..pods {
            manager.free_pod(&format!("uid-{pod}"));
        }
        manager.persisted().await?;
    }
    let (total, plugin_only) = (figures(total), figures(plugin_only));
    let (floor, floor_async) = (figures(floor), figures(floor_async));
    println!(
        "[per container, {label}] {rounds} x {pods} allocations of 1 device out of {devices}, one at a time, \
         the pods freed after each round (checkpoint up to {} KB)",
        size / 1000
    );
    println!("  allocate()                      {}", total.in_us());
    println!("  plugin Allocate alone           {}", plugin_only.in_us());
    println!("  floor: same bytes, std + fsync  {}", floor.in_us());
    println!("  floor, handed to a thread       {}", floor_async.in_us());
    let node = |pick: fn(&common::Figures) -> Duration| pick(&total).saturating_sub(pick(&plugin_only));
    let beyond = |pick: fn(&common::Figures) -> Duration, floor: &common::Figures| {
        common::us(node(pick).saturating_sub(pick(floor)))
    };
    println!(
        "  node overhead (allocate - plugin): p50 {}, p99 {}",
        common::us(node(|f| f.p50)),
        common::us(node(|f| f.p99))
    );
    println!(
        "    beyond the floor write: p50 {}, p99 {}; beyond the handed-off floor: p50 {}, p99 {}",
        beyond(|f| f.p50, &floor),
        beyond(|f| f.p99, &floor),
        beyond(|f| f.p50, &floor_async),
        beyond(|f| f.p99, &floor_async)
    );
    println!("  target: overhead p99 <= 200 µs\n");
    shutdown.cancel();
    manager.stopped().await;
    Ok(())
}

/// `pods` pods asking for one device each, all at once.
async fn at_once(pods: usize) -> Result<(), BoxError> {
    let root = tempfile::tempdir()?;
    let dir = root.path().join("device-plugins");
    let shutdown = CancellationToken::new();
    let (manager, _control) = node_with_devices(&dir, pods, &shutdown).await?;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for pod in 0..pods {
        let manager = manager.clone();
        tasks.spawn(async move { manager.allocate(&request(pod)).await });
    }
    let mut failed = 0;
    while let Some(result) = tasks.join_next().await {
        if !matches!(result, Ok(Ok(_))) {
            failed += 1;
        }
    }
    let elapsed = started.elapsed();
    let cpu = common::process_cpu();
    println!(
        "[concurrent] {pods} pods x 1 device at once: {:.1} ms, {failed} failed (process CPU so far {:.1} s)",
        elapsed.as_secs_f64() * 1000.0,
        cpu.as_secs_f64()
    );
    if pods == 1000 {
        println!("  target: within 1 s");
    }
    if pods < 10_000 {
        println!();
        shutdown.cancel();
        manager.stopped().await;
        return Ok(());
    }
    // The 10,000 allocations are now checkpointed: restart from them.
    shutdown.cancel();
    manager.stopped().await;
    let size = std::fs::metadata(dir.join(kubelet::device_manager::CHECKPOINT_FILE))?.len();
    let mut restarts = Vec::new();
    for _ in 0..5 {
        let shutdown = CancellationToken::new();
        let t = Instant::now();
        let restarted = DeviceManager::start(DeviceManagerConfig::new(&dir), shutdown.clone())?;
        restarts.push(t.elapsed());
        assert_eq!(restarted.allocated(&format!("uid-{}", pods - 1), "c").len(), 1, "restored");
        shutdown.cancel();
        restarted.stopped().await;
    }
    println!("\n[restart] start-up with {pods} allocations in a {:.1} MB checkpoint (5 starts)", size as f64 / 1e6);
    println!("  {}", figures(restarts).in_us());
    println!("  target: restored within 100 ms");
    Ok(())
}

async fn run() -> Result<(), BoxError> {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    println!("Rustlet device allocation benchmark (2 cores; device manager in-process, plugin on a Unix socket)\n");
    let shm = std::path::Path::new("/dev/shm");
    // Kubelet scale (110 pods is its default limit), then a stress setting.
    for (devices, pods, rounds) in [(128, 110, 10), (2000, 1000, 1)] {
        per_container(&std::env::temp_dir(), "disk (ext4)", devices, pods, rounds).await?;
        if shm.is_dir() {
            per_container(shm, "tmpfs (fsync costs nothing)", devices, pods, rounds).await?;
        } else {
            println!("[per container, tmpfs] skipped: no /dev/shm\n");
        }
    }
    at_once(1000).await?;
    at_once(10_000).await?;
    Ok(())
}

fn main() -> Result<(), BoxError> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?.block_on(run())
}
