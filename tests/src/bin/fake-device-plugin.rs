//! A device-plugin test plugin. Serves `v1beta1.DevicePlugin` on `--socket`
//! and registers through `kubelet.sock` (default) or through a registration
//! socket in `plugins_registry` (type `DevicePlugin`).
//!
//! Commands on stdin, one per line: `health <id> <Healthy|Unhealthy>`,
//! `devices <id:health[:numa]>...`, `crash` (exit at once, sockets left).
//!
//!   fake-device-plugin --socket /r/device-plugins/gpu.sock --resource vendor.com/gpu \
//!     --device gpu-0:Healthy:0 --device gpu-1:Unhealthy:1

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use kubelet_api::constants::{DEVICE_PLUGIN_TYPE, DEVICE_PLUGIN_VERSION};
use kubelet_api::deviceplugin::v1beta1::DevicePluginOptions;
use rustlet_testkit::device_plugin::{
    DevicePluginBehaviour, DeviceSpec, FakeDevicePlugin, kubelet_socket_beside, register_with_kubelet,
};
use rustlet_testkit::registration::{Behaviour, Identity, RegistrationPlugin};
use rustlet_testkit::report::{Report, Reporter};
use tokio::io::AsyncBufReadExt;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RegisterVia {
    /// `Register` on `kubelet.sock`.
    Kubelet,
    /// A registration socket of type `DevicePlugin` (`--registration-socket`).
    Watcher,
    /// Do not register.
    None,
}

#[derive(Parser)]
struct Args {
    /// The plugin's own socket.
    #[arg(long)]
    socket: PathBuf,
    /// Extended resource name.
    #[arg(long)]
    resource: String,
    /// A device, `id:health[:numa]` (repeatable).
    #[arg(long)]
    device: Vec<DeviceSpec>,
    /// Also announce COUNT healthy devices `dev-<i>`.
    #[arg(long, default_value_t = 0)]
    count: usize,
    /// Ask for PreStartContainer.
    #[arg(long)]
    pre_start: bool,
    /// Offer GetPreferredAllocation.
    #[arg(long)]
    preferred: bool,
    /// How to register.
    #[arg(long, value_enum, default_value = "kubelet")]
    register: RegisterVia,
    /// `kubelet.sock` (default: next to --socket).
    #[arg(long)]
    kubelet_socket: Option<PathBuf>,
    /// Version sent in Register (or, with --register watcher, in GetInfo).
    #[arg(long, default_value = DEVICE_PLUGIN_VERSION)]
    version: String,
    /// Endpoint sent in Register (default: the file name of --socket).
    #[arg(long)]
    endpoint: Option<String>,
    /// Registration socket for --register watcher.
    #[arg(long)]
    registration_socket: Option<PathBuf>,
    /// Misbehaviour.
    #[arg(long, value_enum, default_value = "normal")]
    behaviour: DevicePluginBehaviour,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let mut devices = args.device.clone();
    devices.extend((0..args.count).map(|i| DeviceSpec {
        id: format!("dev-{i}"),
        health: "Healthy".into(),
        numa: None,
    }));
    let options =
        DevicePluginOptions { pre_start_required: args.pre_start, get_preferred_allocation_available: args.preferred };
    let shutdown = CancellationToken::new();
    let (plugin, control) = FakeDevicePlugin::new(&args.resource, devices, options, args.behaviour, Reporter::Stdout);
    let _server = plugin.spawn(&args.socket, shutdown.clone())?;
    match args.register {
        RegisterVia::Kubelet => {
            Reporter::Stdout.report(Report::Listening { sockets: 1 });
            let kubelet = args.kubelet_socket.clone().unwrap_or_else(|| kubelet_socket_beside(&args.socket));
            let endpoint = args.endpoint.clone().unwrap_or_else(|| {
                args.socket.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
            });
            let result = register_with_kubelet(&kubelet, &args.version, &endpoint, &args.resource, options).await;
            Reporter::Stdout.report(Report::DeviceRegistered {
                resource: args.resource.clone(),
                error: result.err().map(|e| e.to_string()).unwrap_or_default(),
            });
        }
        RegisterVia::Watcher => {
            let socket = args.registration_socket.clone().ok_or("--register watcher needs --registration-socket")?;
            let identity = Identity {
                plugin_type: DEVICE_PLUGIN_TYPE.into(),
                name: args.resource.clone(),
                endpoint: args.socket.display().to_string(),
                versions: vec![args.version.clone()],
            };
            RegistrationPlugin::new(socket, identity, Behaviour::Normal, Reporter::Stdout).spawn(shutdown.clone())?;
            Reporter::Stdout.report(Report::Listening { sockets: 1 });
        }
        RegisterVia::None => Reporter::Stdout.report(Report::Listening { sockets: 1 }),
    }
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["health", id, health] => {
                if !control.set_health(id, health) {
                    eprintln!("fake-device-plugin: no device {id}");
                }
            }
            ["devices", specs @ ..] => {
                let devices: Result<Vec<DeviceSpec>, String> = specs.iter().map(|s| s.parse()).collect();
                match devices {
                    Ok(devices) => control.set_devices(devices),
                    Err(e) => eprintln!("fake-device-plugin: {e}"),
                }
            }
            ["crash"] => std::process::exit(1),
            _ => eprintln!("fake-device-plugin: unknown command {line:?}"),
        }
    }
    // Stdin closed: keep serving until killed.
    std::future::pending::<()>().await;
    Ok(())
}
