//! A process that embeds the device manager and allocates without pause, for
//! the crash test: it registers an in-process device plugin with `--count`
//! devices on `<dir>/kubelet.sock`, then allocates one device to pod
//! `p<i>` for i = 0, 1, 2, … and prints `allocated p<i> <device>` after each
//! allocation returned (so after its checkpoint is on disk). Kill it with
//! SIGKILL at any moment.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kubelet::device_manager::{ContainerKind, ContainerRequest, DeviceManager, DeviceManagerConfig};
use kubelet_api::deviceplugin::v1beta1::DevicePluginOptions;
use rustlet_testkit::device_plugin::{DevicePluginBehaviour, DeviceSpec, FakeDevicePlugin, register_with_kubelet};
use rustlet_testkit::report::Reporter;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
struct Args {
    /// The device-plugins directory.
    #[arg(long)]
    dir: PathBuf,
    /// Devices of the plugin.
    #[arg(long, default_value_t = 1000)]
    count: usize,
    /// Resource name.
    #[arg(long, default_value = "crash.example.com/dev")]
    resource: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let shutdown = CancellationToken::new();
    let manager = DeviceManager::start(DeviceManagerConfig::new(&args.dir), shutdown.clone())?;
    let devices =
        (0..args.count).map(|i| DeviceSpec { id: format!("d{i:04}"), health: "Healthy".into(), numa: None }).collect();
    let (plugin, _control) = FakeDevicePlugin::new(
        &args.resource,
        devices,
        DevicePluginOptions::default(),
        DevicePluginBehaviour::Normal,
        Reporter::Discard,
    );
    plugin.spawn(&args.dir.join("crash.sock"), shutdown.clone())?;
    register_with_kubelet(
        &manager.socket_path(),
        "v1beta1",
        "crash.sock",
        &args.resource,
        DevicePluginOptions::default(),
    )
    .await?;
    let mut capacity = manager.capacity();
    tokio::time::timeout(
        Duration::from_secs(30),
        capacity.wait_for(|c| c.get(&args.resource).is_some_and(|c| c.allocatable > 0)),
    )
    .await??;
    println!("ready");
    for i in 0.. {
        let pod = format!("p{i}");
        let request = ContainerRequest {
            pod_uid: pod.clone(),
            pod_name: pod.clone(),
            container_name: "c".into(),
            kind: ContainerKind::App,
            limits: [(args.resource.clone(), 1)].into_iter().collect(),
        };
        match manager.allocate(&request).await {
            Ok(_) => {
                let device = manager.allocated(&pod, "c").remove(&args.resource).unwrap_or_default().join(",");
                println!("allocated {pod} {device}");
            }
            Err(e) => {
                println!("failed {pod} {e}");
                break;
            }
        }
    }
    std::future::pending::<()>().await;
    Ok(())
}
