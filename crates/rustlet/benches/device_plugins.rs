//! Device-plugin benchmark: prints figures, asserts nothing about time.
//!
//! The node is the release `rustlet --standalone` binary in its own process;
//! this program plays device plugins (the test plugins) and measures:
//! - `Register` call started → the node opened `ListAndWatch` (plugin side);
//! - a health flip sent on `ListAndWatch` → the node published the new
//!   capacity (the node's debug log line, read from its stderr);
//! - many plugins registering at once.
//!
//! Run: `cargo bench -p rustlet --bench device_plugins`.

use std::process::Stdio;
mod common;

use std::time::{Duration, Instant};

use kubelet_api::constants::DEVICE_PLUGIN_VERSION;
use kubelet_api::deviceplugin::v1beta1::DevicePluginOptions;
use rustlet_testkit::device_plugin::{DevicePluginBehaviour, DeviceSpec, FakeDevicePlugin, register_with_kubelet};
use rustlet_testkit::report::{Report, Reporter};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use common::figures;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
const WAIT: Duration = Duration::from_secs(15);

async fn run() -> Result<(), BoxError> {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let root = tempfile::Builder::new().prefix("rustlet-bench-dp-").tempdir()?;
    let dir = root.path().join("device-plugins");
    let mut node = tokio::process::Command::new(env!("CARGO_BIN_EXE_rustlet"))
        .args(["--standalone", "--log-format", "json", "--healthz-port", "0", "--port", "0", "--root-dir"])
        .arg(root.path())
        .env("RUSTLET_LOG", "info,kubelet_plugins::device_manager=debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    // Node log: "devices updated" lines -> (resource, allocatable) with the time read.
    let (log_tx, mut updates) = mpsc::unbounded_channel::<(Instant, String, u64)>();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let stderr = node.stderr.take().ok_or("no stderr")?;
    tokio::spawn(async move {
        let mut ready = Some(ready_tx);
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let Some(event) = common::NodeLog::parse(&line) else { continue };
            match event.message() {
                "node started" => {
                    if let Some(r) = ready.take() {
                        let _ = r.send(());
                    }
                }
                "devices updated" => {
                    if let (Some(resource), Some(allocatable)) = (event.field("resource"), event.field("allocatable"))
                        && let Ok(allocatable) = allocatable.parse()
                    {
                        let _ = log_tx.send((Instant::now(), resource, allocatable));
                    }
                }
                _ => {}
            }
        }
    });
    tokio::time::timeout(WAIT, ready_rx).await??;
    let kubelet_sock = dir.join("kubelet.sock");
    println!(
        "Rustlet device-plugin benchmark (2 cores; node: release rustlet --standalone, pid {})\n",
        node.id().unwrap_or(0)
    );

    // 1. Register -> ListAndWatch opened, one plugin at a time.
    let (tx, mut reports) = mpsc::unbounded_channel();
    let mut opened = Vec::new();
    let mut controls = Vec::new();
    let shutdown = CancellationToken::new();
    for i in 0..200 {
        let resource = format!("bench.example.com/dev{i}");
        let devices = vec![DeviceSpec { id: "d0".into(), health: "Healthy".into(), numa: Some(0) }];
        let (plugin, control) = FakeDevicePlugin::new(
            &resource,
            devices,
            DevicePluginOptions::default(),
            DevicePluginBehaviour::Normal,
            Reporter::Timed(tx.clone()),
        );
        let name = format!("dev{i}.sock");
        plugin.spawn(&dir.join(&name), shutdown.clone())?;
        let started = Instant::now();
        register_with_kubelet(&kubelet_sock, DEVICE_PLUGIN_VERSION, &name, &resource, DevicePluginOptions::default())
            .await
            .map_err(|e| format!("register: {e}"))?;
        loop {
            match tokio::time::timeout(WAIT, reports.recv()).await? {
                Some((at, Report::ListAndWatchOpened { resource: r })) if r == resource => {
                    opened.push(at - started);
                    break;
                }
                Some(_) => {}
                None => return Err("reports ended".into()),
            }
        }
        controls.push((resource, control));
    }
    println!("[register] Register call started -> node opened ListAndWatch, 200 plugins one at a time");
    println!("  {}", figures(opened).in_ms());
    println!("  target p50 <= 2 ms; reference: Go kubelet ~7 ms (and capacity reaches its Node 1-2 s later)\n");

    // Drain the initial "devices updated" lines.
    while updates.try_recv().is_ok() {}
    tokio::task::yield_now().await;

    // 2. Health flip -> capacity published, one at a time.
    let mut published = Vec::new();
    for (round, (resource, control)) in controls.iter().enumerate() {
        let (health, want) = if round % 2 == 0 { ("Unhealthy", 0) } else { ("Healthy", 1) };
        // Odd rounds flip back a device that an even round made unhealthy.
        let (resource, control) = if round % 2 == 0 {
            (resource, control)
        } else {
            let p = &controls[round - 1];
            (&p.0, &p.1)
        };
        let started = Instant::now();
        control.set_health("d0", health);
        loop {
            match tokio::time::timeout(WAIT, updates.recv()).await? {
                Some((at, r, allocatable)) if &r == resource && allocatable == want => {
                    published.push(at - started);
                    break;
                }
                Some(_) => {}
                None => return Err("node log ended".into()),
            }
        }
    }
    println!("[health] ListAndWatch health flip -> node published the new capacity (its debug log line)");
    println!("  {}", figures(published).in_ms());
    println!("  target p99 <= 5 ms\n");

    // 3. 100 plugins registering at once.
    let started = Instant::now();
    let mut calls = tokio::task::JoinSet::new();
    // Dropping a control would end that plugin's device stream.
    let mut keep = Vec::new();
    for i in 0..100 {
        let resource = format!("burst.example.com/dev{i}");
        let devices = vec![DeviceSpec { id: "d0".into(), health: "Healthy".into(), numa: None }];
        let (plugin, control) = FakeDevicePlugin::new(
            &resource,
            devices,
            DevicePluginOptions::default(),
            DevicePluginBehaviour::Normal,
            Reporter::Discard,
        );
        let name = format!("burst{i}.sock");
        plugin.spawn(&dir.join(&name), shutdown.clone())?;
        keep.push(control);
        let sock = kubelet_sock.clone();
        calls.spawn(async move {
            let t = Instant::now();
            register_with_kubelet(&sock, DEVICE_PLUGIN_VERSION, &name, &resource, DevicePluginOptions::default())
                .await
                .map(|()| t.elapsed())
        });
    }
    let mut took = Vec::new();
    while let Some(result) = calls.join_next().await {
        took.push(result?.map_err(|e| format!("register: {e}"))?);
    }
    println!(
        "[burst] 100 plugins calling Register at once: all registered in {:.3} ms",
        started.elapsed().as_secs_f64() * 1000.0
    );
    println!("  Register round trip: {}", figures(took).in_ms());
    shutdown.cancel();
    drop(keep);
    Ok(())
}

fn main() -> Result<(), BoxError> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?.block_on(run())
}
