//! A configurable device plugin (`v1beta1.DevicePlugin`). Allocation RPCs
//! answer `Unimplemented` until the allocation part of the device manager.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use kubelet_api::deviceplugin::v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use kubelet_api::deviceplugin::v1beta1::registration_client::RegistrationClient;
use kubelet_api::deviceplugin::v1beta1::*;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::report::{Report, Reporter};

/// One device as the plugin announces it, written `id:Healthy[:numa]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSpec {
    /// Device ID.
    pub id: String,
    /// `"Healthy"`, `"Unhealthy"` or anything (it is sent as is).
    pub health: String,
    /// NUMA node, if any.
    pub numa: Option<i64>,
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(':');
        let id = parts.next().unwrap_or_default().to_owned();
        let health = parts.next().unwrap_or("Healthy").to_owned();
        let numa =
            parts.next().map(|n| n.parse().map_err(|_| format!("{s:?}: NUMA node must be a number"))).transpose()?;
        Ok(DeviceSpec { id, health, numa })
    }
}

impl From<&DeviceSpec> for Device {
    fn from(d: &DeviceSpec) -> Self {
        Device {
            id: d.id.clone(),
            health: d.health.clone(),
            topology: d.numa.map(|id| TopologyInfo { nodes: vec![NumaNode { id }] }),
        }
    }
}

/// How the plugin misbehaves, if at all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DevicePluginBehaviour {
    /// Answer everything.
    #[default]
    Normal,
    /// Never answer `GetDevicePluginOptions`.
    HangOptions,
}

/// A device plugin on one socket.
#[derive(Clone)]
pub struct FakeDevicePlugin {
    resource: String,
    options: DevicePluginOptions,
    behaviour: DevicePluginBehaviour,
    devices: watch::Receiver<Vec<DeviceSpec>>,
    reporter: Reporter,
}

/// Changes what a running [`FakeDevicePlugin`] announces.
pub struct DeviceControl {
    devices: watch::Sender<Vec<DeviceSpec>>,
}

impl DeviceControl {
    /// Sets the health of device `id` (sent to every open `ListAndWatch`).
    pub fn set_health(&self, id: &str, health: &str) -> bool {
        self.devices.send_if_modified(|devices| match devices.iter_mut().find(|d| d.id == id) {
            Some(d) => {
                d.health = health.to_owned();
                true
            }
            None => false,
        })
    }

    /// Replaces the whole device list.
    pub fn set_devices(&self, devices: Vec<DeviceSpec>) {
        self.devices.send_replace(devices);
    }
}

impl FakeDevicePlugin {
    /// A plugin for `resource` announcing `devices`.
    pub fn new(
        resource: impl Into<String>,
        devices: Vec<DeviceSpec>,
        options: DevicePluginOptions,
        behaviour: DevicePluginBehaviour,
        reporter: Reporter,
    ) -> (Self, DeviceControl) {
        let (tx, rx) = watch::channel(devices);
        let plugin = FakeDevicePlugin { resource: resource.into(), options, behaviour, devices: rx, reporter };
        (plugin, DeviceControl { devices: tx })
    }

    /// Binds `socket` now and serves until `shutdown`.
    pub fn spawn(self, socket: &Path, shutdown: CancellationToken) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let listener = kubelet_api::uds::bind(socket).map_err(std::io::Error::other)?;
        Ok(tokio::spawn(async move {
            let router = tonic::transport::Server::builder().add_service(DevicePluginServer::new(self));
            let _ = kubelet_api::uds::serve(router, listener, shutdown.cancelled_owned()).await;
        }))
    }
}

/// Calls `Register` on the node's `kubelet.sock`.
pub async fn register_with_kubelet(
    kubelet_socket: &Path,
    version: &str,
    endpoint: &str,
    resource: &str,
    options: DevicePluginOptions,
) -> Result<(), String> {
    let channel = kubelet_api::uds::dial(kubelet_socket, Duration::from_secs(10)).await.map_err(|e| e.to_string())?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: version.to_owned(),
            endpoint: endpoint.to_owned(),
            resource_name: resource.to_owned(),
            options: Some(options),
        })
        .await
        .map(|_| ())
        .map_err(|status| status.message().to_owned())
}

/// Reports `ListAndWatchClosed` when the stream is dropped.
struct StreamGuard {
    resource: String,
    reporter: Reporter,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.reporter.report(Report::ListAndWatchClosed { resource: self.resource.clone() });
    }
}

type DeviceStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for FakeDevicePlugin {
    async fn get_device_plugin_options(&self, _: Request<Empty>) -> Result<Response<DevicePluginOptions>, Status> {
        if self.behaviour == DevicePluginBehaviour::HangOptions {
            std::future::pending::<()>().await;
        }
        Ok(Response::new(self.options))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        self.reporter.report(Report::ListAndWatchOpened { resource: self.resource.clone() });
        let guard = StreamGuard { resource: self.resource.clone(), reporter: self.reporter.clone() };
        Ok(Response::new(device_stream(self.devices.clone(), guard)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("GetPreferredAllocation is not implemented by the fake device plugin yet"))
    }

    async fn allocate(&self, _: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        Err(Status::unimplemented("Allocate is not implemented by the fake device plugin yet"))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// A stream that sends the device list now and again on every change; the
/// guard reports the stream's end when the node hangs up.
fn device_stream(mut devices: watch::Receiver<Vec<DeviceSpec>>, guard: StreamGuard) -> DeviceStream {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        let _guard = guard;
        loop {
            let snapshot: Vec<Device> = devices.borrow_and_update().iter().map(Device::from).collect();
            if tx.send(Ok(ListAndWatchResponse { devices: snapshot })).await.is_err() {
                return;
            }
            tokio::select! {
                () = tx.closed() => return,
                changed = devices.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
            }
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// The default `kubelet.sock` next to a plugin socket.
pub fn kubelet_socket_beside(socket: &Path) -> PathBuf {
    socket.with_file_name(kubelet_api::constants::KUBELET_SOCKET)
}
