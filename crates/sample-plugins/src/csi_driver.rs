//! A CSI driver serving Identity and Node, with a configurable `NodeGetInfo`
//! and the volume calls a node makes: `NodeGetCapabilities`,
//! `NodeStageVolume`, `NodePublishVolume`, `NodeUnpublishVolume`,
//! `NodeUnstageVolume`.
//!
//! Like a host-path driver, staging and publishing make the directory (with
//! a marker file naming the volume) and unpublishing and unstaging remove
//! it; every call is idempotent, as the CSI spec requires. Each call can be
//! told to hang or to fail with a gRPC code, and every request the driver
//! got is recorded ([`FakeCsiDriver::calls`]), so a test checks what the
//! driver received.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kubelet_api::csi::v1::identity_server::{Identity, IdentityServer};
use kubelet_api::csi::v1::node_server::{Node, NodeServer};
use kubelet_api::csi::v1::*;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::registration::{self, Behaviour, RegistrationPlugin};
use crate::report::{Report, Reporter};

/// How the driver answers `NodeGetInfo`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum NodeGetInfoBehaviour {
    /// Answer with the configured node facts.
    #[default]
    Normal,
    /// Never answer.
    Hang,
    /// Answer with an error status.
    Fail,
}

/// What the driver says about itself and the node.
#[derive(Clone, Debug, Default)]
pub struct CsiDriverConfig {
    /// Driver name (`GetPluginInfo.name`).
    pub name: String,
    /// Node ID returned by `NodeGetInfo`.
    pub node_id: String,
    /// `max_volumes_per_node` (0: no limit).
    pub max_volumes_per_node: i64,
    /// Topology segments.
    pub topology: HashMap<String, String>,
    /// How `NodeGetInfo` behaves.
    pub node_get_info: NodeGetInfoBehaviour,
    /// Report the `STAGE_UNSTAGE_VOLUME` capability (and require staging
    /// before publishing).
    pub stage_unstage: bool,
    /// Misbehaviours of volume calls, by RPC name (`NodePublishVolume`, …).
    pub volume_calls: HashMap<String, VolumeCallBehaviour>,
    /// Publish as a real driver does, with a mount: `<dir>/<volume id>` is
    /// bind-mounted at the target (and unmounted by NodeUnpublishVolume).
    /// Needs the privilege to mount (root); without it publishing fails.
    pub bind_mounts_from: Option<PathBuf>,
    /// Report the `EXPAND_VOLUME` capability and serve `NodeExpandVolume`
    /// (recorded with its `required_bytes`).
    pub expand: bool,
    /// Report the `VOLUME_MOUNT_GROUP` capability: the driver applies a
    /// pod's fsGroup itself (given as `volume_mount_group`), and the node
    /// changes no ownership.
    pub volume_mount_group: bool,
}

/// How one volume RPC misbehaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VolumeCallBehaviour {
    /// Never answer.
    Hang,
    /// Answer with this gRPC code.
    Fail(tonic::Code),
    /// Answer the first `n` calls with this gRPC code, then normally.
    FailTimes(tonic::Code, usize),
    /// Answer with this gRPC code when the call asks for more than these
    /// bytes (`NodeExpandVolume`'s `required_bytes`), normally otherwise.
    FailAbove(tonic::Code, i64),
}

/// A volume request the driver received. Secrets are kept as sent: this is
/// a test driver, and tests check them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeCall {
    /// The RPC (`NodeStageVolume`, …).
    pub rpc: &'static str,
    /// `volume_id`.
    pub volume_id: String,
    /// `staging_target_path` (empty when not sent).
    pub staging_target_path: String,
    /// `target_path` (publish and unpublish).
    pub target_path: String,
    /// The capability's file system type, or `block`.
    pub access_type: String,
    /// The capability's mount flags.
    pub mount_flags: Vec<String>,
    /// The capability's access mode, as its wire number.
    pub access_mode: i32,
    /// `readonly` (publish).
    pub read_only: bool,
    /// `secrets`, sorted.
    pub secrets: Vec<(String, String)>,
    /// `volume_context`, sorted.
    pub volume_context: Vec<(String, String)>,
    /// `publish_context`, sorted.
    pub publish_context: Vec<(String, String)>,
    /// A mount capability's `volume_mount_group` (the pod's fsGroup, when
    /// the node delegates it).
    pub volume_mount_group: String,
    /// `NodeExpandVolume`'s `capacity_range.required_bytes`.
    pub required_bytes: i64,
}

impl VolumeCall {
    /// A request for `volume_id` with nothing else set.
    fn new(rpc: &'static str, volume_id: &str) -> VolumeCall {
        VolumeCall {
            rpc,
            volume_id: volume_id.to_owned(),
            staging_target_path: String::new(),
            target_path: String::new(),
            access_type: String::new(),
            mount_flags: Vec::new(),
            access_mode: 0,
            read_only: false,
            secrets: Vec::new(),
            volume_context: Vec::new(),
            publish_context: Vec::new(),
            volume_mount_group: String::new(),
            required_bytes: 0,
        }
    }
}

/// The requests a driver received, in order; cheap to clone and wait on.
#[derive(Clone, Debug, Default)]
pub struct VolumeCalls {
    calls: Arc<Mutex<Vec<VolumeCall>>>,
    count: Arc<tokio::sync::watch::Sender<usize>>,
}

impl VolumeCalls {
    /// Every request so far.
    pub fn all(&self) -> Vec<VolumeCall> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits until at least `n` requests arrived (or `timeout` passes) and
    /// returns them.
    pub async fn wait_for(&self, n: usize, timeout: std::time::Duration) -> Vec<VolumeCall> {
        let mut count = self.count.subscribe();
        let _ = tokio::time::timeout(timeout, count.wait_for(|c| *c >= n)).await;
        self.all()
    }

    fn record(&self, call: VolumeCall) {
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        calls.push(call);
        self.count.send_replace(calls.len());
    }
}

/// A fake CSI driver on one endpoint socket.
#[derive(Clone)]
pub struct FakeCsiDriver {
    endpoint: PathBuf,
    config: Arc<CsiDriverConfig>,
    reporter: Reporter,
    calls: VolumeCalls,
}

impl FakeCsiDriver {
    /// A driver serving on `endpoint`.
    pub fn new(endpoint: impl Into<PathBuf>, config: CsiDriverConfig, reporter: Reporter) -> Self {
        FakeCsiDriver { endpoint: endpoint.into(), config: Arc::new(config), reporter, calls: VolumeCalls::default() }
    }

    /// The volume requests this driver receives (take it before `spawn`).
    pub fn calls(&self) -> VolumeCalls {
        self.calls.clone()
    }

    /// Records the request, then answers as configured: `None` to go on.
    async fn misbehave(&self, call: VolumeCall) -> Option<Status> {
        let rpc = call.rpc;
        self.reporter.report(Report::VolumeCall {
            rpc: rpc.to_owned(),
            volume_id: call.volume_id.clone(),
            target_path: call.target_path.clone(),
            staging_target_path: call.staging_target_path.clone(),
            access_mode: call.access_mode,
            read_only: call.read_only,
            required_bytes: call.required_bytes,
            volume_context: call.volume_context.clone(),
        });
        let required_bytes = call.required_bytes;
        self.calls.record(call);
        match self.config.volume_calls.get(rpc) {
            None => None,
            Some(VolumeCallBehaviour::Hang) => std::future::pending().await,
            Some(VolumeCallBehaviour::Fail(code)) => {
                Some(Status::new(*code, format!("fake CSI driver told to fail {rpc}")))
            }
            Some(VolumeCallBehaviour::FailTimes(code, times)) => {
                let seen = self.calls.all().iter().filter(|c| c.rpc == rpc).count();
                (seen <= *times)
                    .then(|| Status::new(*code, format!("fake CSI driver told to fail {rpc} {times} times")))
            }
            Some(VolumeCallBehaviour::FailAbove(code, bytes)) => (required_bytes > *bytes)
                .then(|| Status::new(*code, format!("fake CSI driver told to fail {rpc} above {bytes} bytes"))),
        }
    }

    /// Binds the endpoint now and serves until `shutdown`.
    pub fn spawn(self, shutdown: CancellationToken) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let listener = kubelet_api::uds::bind(&self.endpoint).map_err(std::io::Error::other)?;
        let endpoint = self.endpoint.clone();
        // Not supervised: a sample plugin's server, returned to its caller (a plugin process or a test).
        Ok(tokio::spawn(async move {
            let router = tonic::transport::Server::builder()
                .add_service(IdentityServer::new(self.clone()))
                .add_service(NodeServer::new(self));
            if let Err(error) = kubelet_api::uds::serve(router, listener, shutdown.cancelled_owned()).await {
                tracing::warn!(endpoint = %endpoint.display(), %error, "fake CSI driver stopped");
            }
        }))
    }
}

/// A fake CSI driver together with its registration socket, as a driver with
/// the node-driver-registrar sidecar presents itself: type `CSIPlugin`, the
/// driver's name, `endpoint` pointing at the driver.
pub struct RegisteredCsiDriver {
    /// Registration socket (usually in `<root-dir>/plugins_registry`).
    pub registration: PathBuf,
    /// The driver's CSI endpoint.
    pub endpoint: PathBuf,
    /// The driver's configuration (its name is also the registered name).
    pub config: CsiDriverConfig,
    /// Versions sent in `GetInfo` (default `["1.0.0"]`).
    pub versions: Vec<String>,
    /// How the registration side behaves.
    pub behaviour: Behaviour,
    /// Where an exit behaviour sends its exit code (see
    /// [`RegistrationPlugin::exit_requests`]).
    pub exit_requests: Option<tokio::sync::mpsc::UnboundedSender<i32>>,
    /// The endpoint the node is told, when it differs from where the
    /// driver listens: a driver in a pod listens at a path inside its
    /// container and names the node's path of the same socket (the
    /// node-driver-registrar's `--kubelet-registration-path`).
    pub advertised_endpoint: Option<PathBuf>,
}

impl RegisteredCsiDriver {
    /// A well-behaved driver speaking CSI 1.0.0.
    pub fn new(registration: impl Into<PathBuf>, endpoint: impl Into<PathBuf>, config: CsiDriverConfig) -> Self {
        RegisteredCsiDriver {
            registration: registration.into(),
            endpoint: endpoint.into(),
            config,
            versions: vec!["1.0.0".into()],
            behaviour: Behaviour::Normal,
            exit_requests: None,
            advertised_endpoint: None,
        }
    }

    /// Binds the endpoint, then the registration socket (so the driver is
    /// ready when the node learns of it), and serves both until `shutdown`.
    pub fn spawn(
        self,
        reporter: Reporter,
        shutdown: CancellationToken,
    ) -> std::io::Result<[tokio::task::JoinHandle<()>; 2]> {
        self.spawn_recorded(reporter, shutdown).map(|(_, tasks)| tasks)
    }

    /// As [`RegisteredCsiDriver::spawn`], with the volume requests the
    /// driver receives.
    pub fn spawn_recorded(
        self,
        reporter: Reporter,
        shutdown: CancellationToken,
    ) -> std::io::Result<(VolumeCalls, [tokio::task::JoinHandle<()>; 2])> {
        let identity = registration::Identity {
            plugin_type: kubelet_api::constants::CSI_PLUGIN_TYPE.into(),
            name: self.config.name.clone(),
            endpoint: self.advertised_endpoint.as_ref().unwrap_or(&self.endpoint).display().to_string(),
            versions: self.versions,
        };
        let driver = FakeCsiDriver::new(&self.endpoint, self.config, reporter.clone());
        let calls = driver.calls();
        let driver = driver.spawn(shutdown.clone())?;
        let mut registration = RegistrationPlugin::new(&self.registration, identity, self.behaviour, reporter);
        if let Some(exits) = self.exit_requests {
            registration = registration.exit_requests(exits);
        }
        let registration = registration.spawn(shutdown)?;
        Ok((calls, [driver, registration]))
    }
}

#[tonic::async_trait]
impl Identity for FakeCsiDriver {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.config.name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_owned(),
            manifest: HashMap::new(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(GetPluginCapabilitiesResponse { capabilities: vec![] }))
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}

fn unimplemented<T>(rpc: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!("{rpc} is not implemented by the fake CSI driver")))
}

fn sorted(map: &HashMap<String, String>) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = map.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    pairs.sort();
    pairs
}

/// The request's capability as the record shows it, and a check the spec
/// asks for: a capability must be given.
fn capability(capability: Option<&VolumeCapability>) -> Result<(String, Vec<String>, i32), Status> {
    let capability = capability.ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
    let mode = capability.access_mode.as_ref().map_or(0, |m| m.mode);
    match &capability.access_type {
        Some(volume_capability::AccessType::Mount(mount)) => {
            Ok((mount.fs_type.clone(), mount.mount_flags.clone(), mode))
        }
        Some(volume_capability::AccessType::Block(_)) => Ok(("block".into(), Vec::new(), mode)),
        None => Err(Status::invalid_argument("volume_capability needs mount or block")),
    }
}

fn required<'a>(what: &str, value: &'a str) -> Result<&'a str, Status> {
    if value.is_empty() { Err(Status::invalid_argument(format!("{what} is required"))) } else { Ok(value) }
}

/// Makes `dir` with a marker file naming the volume (idempotent).
fn mark(dir: &Path, marker: &str, volume_id: &str) -> Result<(), Status> {
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(dir.join(marker), volume_id))
        .map_err(|e| Status::internal(format!("cannot prepare {}: {e}", dir.display())))
}

/// Removes `dir` and what is in it; a missing one is fine (idempotent).
fn unmark(dir: &Path) -> Result<(), Status> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Status::internal(format!("cannot remove {}: {e}", dir.display())))
        }
        _ => Ok(()),
    }
}

/// Whether `path` is a mount point (listed in `/proc/self/mountinfo`).
fn is_mounted(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return false };
    let wanted = path.to_string_lossy().replace(' ', "\\040");
    info.lines().any(|line| line.split(' ').nth(4) == Some(wanted.as_str()))
}

/// Bind-mounts `source` (made if missing) at `target` (idempotent).
fn bind_mount(source: &Path, target: &Path) -> Result<(), Status> {
    let internal = |what: &str, e: String| Status::internal(format!("{what}: {e}"));
    std::fs::create_dir_all(source)
        .map_err(|e| internal(&format!("cannot make {}", source.display()), e.to_string()))?;
    std::fs::create_dir_all(target)
        .map_err(|e| internal(&format!("cannot make {}", target.display()), e.to_string()))?;
    if is_mounted(target) {
        return Ok(());
    }
    run_mount(std::process::Command::new("mount").arg("--bind").arg(source).arg(target))
}

/// A mount capability's `volume_mount_group` (empty for none, or block).
fn mount_group(capability: Option<&VolumeCapability>) -> String {
    match capability.and_then(|c| c.access_type.as_ref()) {
        Some(volume_capability::AccessType::Mount(mount)) => mount.volume_mount_group.clone(),
        _ => String::new(),
    }
}

/// Whether a request's capability asks for a raw block volume.
fn call_is_block(capability: &Option<VolumeCapability>) -> bool {
    matches!(capability.as_ref().and_then(|c| c.access_type.as_ref()), Some(volume_capability::AccessType::Block(_)))
}

/// Makes the empty file `path` (its parent must exist), if missing.
fn make_file(path: &Path) -> Result<(), Status> {
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map(drop)
        .map_err(|e| Status::internal(format!("cannot make {}: {e}", path.display())))
}

/// Bind-mounts the file or device `source` on the file `target`
/// (idempotent).
fn bind_mount_file(source: &Path, target: &Path) -> Result<(), Status> {
    if is_mounted(target) {
        return Ok(());
    }
    if !source.exists() {
        return Err(Status::not_found(format!("no device at {}", source.display())));
    }
    run_mount(std::process::Command::new("mount").arg("--bind").arg(source).arg(target))
}

/// Unmounts `target` if it is mounted (idempotent).
fn unmount(target: &Path) -> Result<(), Status> {
    if !is_mounted(target) {
        return Ok(());
    }
    run_mount(std::process::Command::new("umount").arg(target))
}

fn run_mount(command: &mut std::process::Command) -> Result<(), Status> {
    let output = command.output().map_err(|e| Status::internal(format!("{command:?}: {e}")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(Status::internal(format!("{command:?}: {}", String::from_utf8_lossy(&output.stderr).trim())))
    }
}

/// The marker file a staged volume's directory holds.
pub const STAGED_MARKER: &str = "staged-volume";
/// The marker file a published volume's directory holds.
pub const PUBLISHED_MARKER: &str = "published-volume";

#[tonic::async_trait]
impl Node for FakeCsiDriver {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let r = request.into_inner();
        let (access_type, mount_flags, access_mode) = capability(r.volume_capability.as_ref())?;
        let call = VolumeCall {
            staging_target_path: r.staging_target_path.clone(),
            access_type,
            mount_flags,
            access_mode,
            secrets: sorted(&r.secrets),
            volume_context: sorted(&r.volume_context),
            publish_context: sorted(&r.publish_context),
            volume_mount_group: mount_group(r.volume_capability.as_ref()),
            ..VolumeCall::new("NodeStageVolume", &r.volume_id)
        };
        if let Some(status) = self.misbehave(call).await {
            return Err(status);
        }
        if !self.config.stage_unstage {
            return Err(Status::unimplemented("this driver does not stage volumes (no STAGE_UNSTAGE_VOLUME)"));
        }
        required("volume_id", &r.volume_id)?;
        mark(Path::new(required("staging_target_path", &r.staging_target_path)?), STAGED_MARKER, &r.volume_id)?;
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let r = request.into_inner();
        let call = VolumeCall {
            staging_target_path: r.staging_target_path.clone(),
            ..VolumeCall::new("NodeUnstageVolume", &r.volume_id)
        };
        if let Some(status) = self.misbehave(call).await {
            return Err(status);
        }
        required("volume_id", &r.volume_id)?;
        unmark(Path::new(required("staging_target_path", &r.staging_target_path)?))?;
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let r = request.into_inner();
        let (access_type, mount_flags, access_mode) = capability(r.volume_capability.as_ref())?;
        let call = VolumeCall {
            staging_target_path: r.staging_target_path.clone(),
            target_path: r.target_path.clone(),
            access_type,
            mount_flags,
            access_mode,
            read_only: r.readonly,
            secrets: sorted(&r.secrets),
            volume_context: sorted(&r.volume_context),
            publish_context: sorted(&r.publish_context),
            volume_mount_group: mount_group(r.volume_capability.as_ref()),
            ..VolumeCall::new("NodePublishVolume", &r.volume_id)
        };
        if let Some(status) = self.misbehave(call).await {
            return Err(status);
        }
        required("volume_id", &r.volume_id)?;
        if self.config.stage_unstage {
            let staging = required("staging_target_path", &r.staging_target_path)?;
            if !Path::new(staging).join(STAGED_MARKER).exists() {
                return Err(Status::failed_precondition(format!("volume {} is not staged at {staging}", r.volume_id)));
            }
        }
        let target = Path::new(required("target_path", &r.target_path)?);
        if call_is_block(&r.volume_capability) {
            // A raw block volume: the target is a file the driver makes,
            // with `<dir>/<volume id>` (a device, or a link to one)
            // bind-mounted on it.
            make_file(target)?;
            if let Some(from) = &self.config.bind_mounts_from {
                bind_mount_file(&from.join(&r.volume_id), target)?;
            }
            return Ok(Response::new(NodePublishVolumeResponse {}));
        }
        if let Some(from) = &self.config.bind_mounts_from {
            bind_mount(&from.join(&r.volume_id), target)?;
        }
        mark(target, PUBLISHED_MARKER, &r.volume_id)?;
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let r = request.into_inner();
        let call =
            VolumeCall { target_path: r.target_path.clone(), ..VolumeCall::new("NodeUnpublishVolume", &r.volume_id) };
        if let Some(status) = self.misbehave(call).await {
            return Err(status);
        }
        required("volume_id", &r.volume_id)?;
        let target = Path::new(required("target_path", &r.target_path)?);
        if target.is_file() || std::fs::metadata(target).is_ok_and(|m| !m.is_dir()) {
            // A raw block volume's device file.
            unmount(target)?;
            return match std::fs::remove_file(target) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(Status::internal(format!("cannot remove {}: {e}", target.display())))
                }
                _ => Ok(Response::new(NodeUnpublishVolumeResponse {})),
            };
        }
        if self.config.bind_mounts_from.is_some() {
            unmount(target)?;
            // The data stays in the source; the empty target goes.
            return match std::fs::remove_dir(target) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(Status::internal(format!("cannot remove {}: {e}", target.display())))
                }
                _ => Ok(Response::new(NodeUnpublishVolumeResponse {})),
            };
        }
        unmark(target)?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    /// The file system holding the published volume, as `statvfs` gives
    /// it (bytes and inodes).
    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let r = request.into_inner();
        required("volume_id", &r.volume_id)?;
        let path = Path::new(required("volume_path", &r.volume_path)?);
        if !path.exists() {
            return Err(Status::not_found(format!("volume {} is not at {}", r.volume_id, path.display())));
        }
        let stats =
            rustix::fs::statvfs(path).map_err(|e| Status::internal(format!("statvfs {}: {e}", path.display())))?;
        let size = stats.f_frsize;
        let signed = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let usage = vec![
            VolumeUsage {
                available: signed(stats.f_bavail.saturating_mul(size)),
                total: signed(stats.f_blocks.saturating_mul(size)),
                used: signed(stats.f_blocks.saturating_sub(stats.f_bfree).saturating_mul(size)),
                unit: volume_usage::Unit::Bytes as i32,
            },
            VolumeUsage {
                available: signed(stats.f_ffree),
                total: signed(stats.f_files),
                used: signed(stats.f_files.saturating_sub(stats.f_ffree)),
                unit: volume_usage::Unit::Inodes as i32,
            },
        ];
        Ok(Response::new(NodeGetVolumeStatsResponse { usage, volume_condition: None }))
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let r = request.into_inner();
        let required_bytes = r.capacity_range.as_ref().map_or(0, |c| c.required_bytes);
        let call = VolumeCall {
            staging_target_path: r.staging_target_path.clone(),
            target_path: r.volume_path.clone(),
            access_type: r
                .volume_capability
                .as_ref()
                .map(|c| capability(Some(c)))
                .transpose()?
                .map(|c| c.0)
                .unwrap_or_default(),
            secrets: sorted(&r.secrets),
            required_bytes,
            ..VolumeCall::new("NodeExpandVolume", &r.volume_id)
        };
        if let Some(status) = self.misbehave(call).await {
            return Err(status);
        }
        if !self.config.expand {
            return unimplemented("NodeExpandVolume");
        }
        required("volume_id", &r.volume_id)?;
        required("volume_path", &r.volume_path)?;
        Ok(Response::new(NodeExpandVolumeResponse { capacity_bytes: required_bytes }))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        let stage = self.config.stage_unstage.then(|| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(node_service_capability::Rpc {
                r#type: node_service_capability::rpc::Type::StageUnstageVolume as i32,
            })),
        });
        let stats = NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(node_service_capability::Rpc {
                r#type: node_service_capability::rpc::Type::GetVolumeStats as i32,
            })),
        };
        let expand = self.config.expand.then(|| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(node_service_capability::Rpc {
                r#type: node_service_capability::rpc::Type::ExpandVolume as i32,
            })),
        });
        let mount_group = self.config.volume_mount_group.then(|| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(node_service_capability::Rpc {
                r#type: node_service_capability::rpc::Type::VolumeMountGroup as i32,
            })),
        });
        let capabilities = stage.into_iter().chain([stats]).chain(expand).chain(mount_group).collect();
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(&self, _: Request<NodeGetInfoRequest>) -> Result<Response<NodeGetInfoResponse>, Status> {
        self.reporter.report(Report::NodeGetInfo { endpoint: self.endpoint.clone() });
        match self.config.node_get_info {
            NodeGetInfoBehaviour::Hang => std::future::pending().await,
            NodeGetInfoBehaviour::Fail => Err(Status::internal("fake CSI driver told to fail NodeGetInfo")),
            NodeGetInfoBehaviour::Normal => Ok(Response::new(NodeGetInfoResponse {
                node_id: self.config.node_id.clone(),
                max_volumes_per_node: self.config.max_volumes_per_node,
                accessible_topology: (!self.config.topology.is_empty())
                    .then(|| Topology { segments: self.config.topology.clone() }),
            })),
        }
    }
}
