//! A configurable device plugin (`v1beta1.DevicePlugin`). `Allocate` answers
//! with an env (`FAKE_DEVICES`), a mount, a device node, an annotation and a
//! CDI name per device; `GetPreferredAllocation` prefers the highest IDs.

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
    /// Never answer `Allocate`.
    HangAllocate,
    /// Answer `Allocate` with an error status.
    FailAllocate,
    /// Answer `Allocate` with one container response too many.
    WrongContainerCount,
    /// Answer `GetPreferredAllocation` with unknown and duplicate IDs.
    PreferUnknown,
    /// Never answer `GetPreferredAllocation`.
    HangPreferred,
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
        // Not supervised: a sample plugin's server, returned to its caller (a plugin process or a test).
        Ok(tokio::spawn(async move {
            let router = tonic::transport::Server::builder().add_service(DevicePluginServer::new(self));
            let _ = kubelet_api::uds::serve(router, listener, shutdown.cancelled_owned()).await;
        }))
    }
}

/// Why `Register` on the node's `kubelet.sock` failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// The socket could not be dialled.
    #[error(transparent)]
    Dial(#[from] kubelet_api::uds::UdsError),
    /// The node refused the registration: its message.
    #[error("{0}")]
    Refused(String),
}

/// Calls `Register` on the node's `kubelet.sock`.
pub async fn register_with_kubelet(
    kubelet_socket: &Path,
    version: &str,
    endpoint: &str,
    resource: &str,
    options: DevicePluginOptions,
) -> Result<(), RegisterError> {
    let channel = kubelet_api::uds::dial(kubelet_socket, Duration::from_secs(10)).await?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: version.to_owned(),
            endpoint: endpoint.to_owned(),
            resource_name: resource.to_owned(),
            options: Some(options),
        })
        .await
        .map(|_| ())
        .map_err(|status| RegisterError::Refused(status.message().to_owned()))
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
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        if self.behaviour == DevicePluginBehaviour::HangPreferred {
            std::future::pending::<()>().await;
        }
        let container_responses = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| {
                let device_i_ds = if self.behaviour == DevicePluginBehaviour::PreferUnknown {
                    vec!["no-such-device".into(), "no-such-device".into()]
                } else {
                    // Must-include first, then the highest IDs: a choice the
                    // node would not make by itself, so tests can see it used.
                    let mut chosen = c.must_include_device_i_ds.clone();
                    for id in c.available_device_i_ds.iter().rev() {
                        if chosen.len() >= c.allocation_size as usize {
                            break;
                        }
                        if !chosen.contains(id) {
                            chosen.push(id.clone());
                        }
                    }
                    chosen
                };
                ContainerPreferredAllocationResponse { device_i_ds }
            })
            .collect();
        Ok(Response::new(PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(&self, request: Request<AllocateRequest>) -> Result<Response<AllocateResponse>, Status> {
        self.reporter.report(Report::Allocate {
            resource: self.resource.clone(),
            devices: request.get_ref().container_requests.iter().map(|c| c.devices_ids.clone()).collect(),
        });
        match self.behaviour {
            DevicePluginBehaviour::HangAllocate => std::future::pending::<()>().await,
            DevicePluginBehaviour::FailAllocate => {
                return Err(Status::internal("fake device plugin told to fail Allocate"));
            }
            _ => {}
        }
        let mut container_responses: Vec<ContainerAllocateResponse> = request
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| {
                let ids = c.devices_ids;
                ContainerAllocateResponse {
                    envs: [("FAKE_DEVICES".to_owned(), ids.join(","))].into_iter().collect(),
                    mounts: ids
                        .iter()
                        .map(|id| Mount {
                            container_path: format!("/var/run/fake/{id}"),
                            host_path: format!("/run/fake-devices/{id}"),
                            read_only: true,
                        })
                        .collect(),
                    devices: ids
                        .iter()
                        .map(|id| kubelet_api::deviceplugin::v1beta1::DeviceSpec {
                            container_path: format!("/dev/fake-{id}"),
                            host_path: "/dev/null".into(),
                            permissions: "rw".into(),
                        })
                        .collect(),
                    annotations: [(format!("{}/devices", self.resource), ids.join(","))].into_iter().collect(),
                    cdi_devices: ids.iter().map(|id| CdiDevice { name: format!("{}={id}", self.resource) }).collect(),
                }
            })
            .collect();
        if self.behaviour == DevicePluginBehaviour::WrongContainerCount {
            container_responses.push(ContainerAllocateResponse::default());
        }
        Ok(Response::new(AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        request: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        self.reporter.report(Report::PreStartContainer {
            resource: self.resource.clone(),
            devices: request.into_inner().devices_ids,
        });
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// A stream that sends the device list now and again on every change; the
/// guard reports the stream's end when the node hangs up.
fn device_stream(mut devices: watch::Receiver<Vec<DeviceSpec>>, guard: StreamGuard) -> DeviceStream {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    // Not supervised: one ListAndWatch stream of a sample plugin.
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
