//! The calls the volume stages make to one CSI driver's Node service:
//! `NodeGetCapabilities`, `NodeStageVolume`, `NodePublishVolume`,
//! `NodeUnpublishVolume` and `NodeUnstageVolume`.
//!
//! Requests and answers are our own types; the generated CSI types are
//! converted here and do not leave this file. Every call has a deadline and
//! fails with a [`CsiNodeError`] that names the driver, the RPC and the
//! volume, and keeps the gRPC code (a caller retries `Aborted` or
//! `Unavailable` differently from `FailedPrecondition` or `NotFound`).
//!
//! As the kubelet does, a caller skips `NodeStageVolume` and
//! `NodeUnstageVolume` when the driver does not report
//! [`NodeCapability::StageUnstageVolume`] ([`NodeCapabilities::stages`]).
//!
//! Secrets are sent to the driver and never logged: the [`Secrets`] type's
//! `Debug` shows only the keys.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use kubelet_api::csi::v1 as api;
use kubelet_api::csi::v1::node_client::NodeClient;
use kubelet_api::uds::{self, UdsChannel};

use super::registry::CsiDriver;

/// Deadlines of the Node calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CsiNodeTimeouts {
    /// Connecting to the driver's endpoint.
    pub dial: Duration,
    /// `NodeGetCapabilities`.
    pub capabilities: Duration,
    /// Each of stage, publish, unpublish and unstage (the kubelet allows its
    /// CSI volume operations 2 minutes).
    pub volume: Duration,
}

impl Default for CsiNodeTimeouts {
    fn default() -> Self {
        CsiNodeTimeouts {
            dial: Duration::from_secs(10),
            capabilities: Duration::from_secs(10),
            volume: Duration::from_secs(2 * 60),
        }
    }
}

/// Why a Node call failed.
#[derive(Debug, thiserror::Error)]
pub enum CsiNodeError {
    /// The driver's endpoint could not be dialed.
    #[error("CSI driver {driver}: {source}")]
    Dial {
        /// The driver's name.
        driver: String,
        /// The transport error.
        #[source]
        source: uds::UdsError,
    },
    /// The driver answered with an error status.
    #[error("CSI driver {driver}: {rpc} for volume {volume_id:?} failed: {code:?}: {message}")]
    Status {
        /// The driver's name.
        driver: String,
        /// The RPC.
        rpc: &'static str,
        /// The volume (empty for `NodeGetCapabilities`).
        volume_id: String,
        /// The gRPC code, for the caller's retry decision.
        code: tonic::Code,
        /// The driver's message.
        message: String,
    },
    /// The driver did not answer within the deadline.
    #[error("CSI driver {driver}: {rpc} for volume {volume_id:?} did not answer within {timeout:?}")]
    Timeout {
        /// The driver's name.
        driver: String,
        /// The RPC.
        rpc: &'static str,
        /// The volume (empty for `NodeGetCapabilities`).
        volume_id: String,
        /// The deadline.
        timeout: Duration,
    },
    /// The request cannot be sent as it is.
    #[error("CSI driver {driver}: {rpc} for volume {volume_id:?}: {reason}")]
    InvalidRequest {
        /// The driver's name.
        driver: String,
        /// The RPC.
        rpc: &'static str,
        /// The volume.
        volume_id: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl CsiNodeError {
    /// The gRPC code the driver answered with, if it answered with an error.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            CsiNodeError::Status { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// A Node service capability a driver reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeCapability {
    /// The driver needs `NodeStageVolume` before `NodePublishVolume`.
    StageUnstageVolume,
    /// `NodeGetVolumeStats` is served.
    GetVolumeStats,
    /// `NodeExpandVolume` is served.
    ExpandVolume,
    /// Volume stats carry the volume's condition.
    VolumeCondition,
    /// The `SINGLE_NODE_*_WRITER` access modes are understood.
    SingleNodeMultiWriter,
    /// `volume_mount_group` is honoured.
    VolumeMountGroup,
}

/// What `NodeGetVolumeStats` reported: `(total, available, used)` in bytes
/// and in inodes, and the volume's condition, each if given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VolumeUsage {
    /// Bytes: total, available, used.
    pub bytes: Option<(u64, u64, u64)>,
    /// Inodes: total, free, used.
    pub inodes: Option<(u64, u64, u64)>,
    /// Whether the driver finds the volume abnormal.
    pub abnormal: Option<bool>,
}

/// The capabilities a driver reported; unknown ones are left out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeCapabilities(pub BTreeSet<NodeCapability>);

impl NodeCapabilities {
    /// Whether the driver reported `capability`.
    pub fn has(&self, capability: NodeCapability) -> bool {
        self.0.contains(&capability)
    }

    /// Whether volumes must be staged before they are published.
    pub fn stages(&self) -> bool {
        self.has(NodeCapability::StageUnstageVolume)
    }
}

/// How a volume is accessed (`VolumeCapability.AccessMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessMode {
    /// Read-write on one node.
    SingleNodeWriter,
    /// Read-only on one node.
    SingleNodeReaderOnly,
    /// Read-only on many nodes.
    MultiNodeReaderOnly,
    /// Read-only on many nodes, read-write on one.
    MultiNodeSingleWriter,
    /// Read-write on many nodes.
    MultiNodeMultiWriter,
    /// Read-write by one workload on one node (`ReadWriteOncePod`).
    SingleNodeSingleWriter,
    /// Read-write by many workloads on one node.
    SingleNodeMultiWriter,
}

/// Mounted as a file system or handed over as a block device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AccessType {
    /// A file system.
    Mount {
        /// File system type (empty: the driver's default).
        fs_type: String,
        /// Mount options.
        mount_flags: Vec<String>,
        /// The group the volume is mounted for (empty: none).
        volume_mount_group: String,
    },
    /// A raw block device.
    Block,
}

/// `VolumeCapability`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeCapability {
    /// Mount or block.
    pub access_type: AccessType,
    /// The access mode.
    pub access_mode: AccessMode,
}

/// Secrets for a call (node-stage or node-publish secrets). Sent to the
/// driver, never printed: `Debug` shows the keys only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secrets(pub BTreeMap<String, String>);

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.0.keys().map(|k| (k, "<redacted>"))).finish()
    }
}

/// `NodeStageVolume`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageVolume {
    /// The volume's handle (`PV.spec.csi.volumeHandle`).
    pub volume_id: String,
    /// The global mount path of the volume on this node.
    pub staging_target_path: PathBuf,
    /// How the volume is accessed.
    pub capability: VolumeCapability,
    /// From the controller's publish step (empty without one).
    pub publish_context: BTreeMap<String, String>,
    /// `PV.spec.csi.volumeAttributes`.
    pub volume_context: BTreeMap<String, String>,
    /// Node-stage secrets.
    pub secrets: Secrets,
}

/// `NodePublishVolume`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishVolume {
    /// The volume's handle.
    pub volume_id: String,
    /// Where the volume was staged, if the driver stages.
    pub staging_target_path: Option<PathBuf>,
    /// The pod's mount path of the volume.
    pub target_path: PathBuf,
    /// How the volume is accessed.
    pub capability: VolumeCapability,
    /// Published read-only.
    pub read_only: bool,
    /// From the controller's publish step.
    pub publish_context: BTreeMap<String, String>,
    /// Volume attributes (with the pod's info when the driver asks for it).
    pub volume_context: BTreeMap<String, String>,
    /// Node-publish secrets.
    pub secrets: Secrets,
}

/// `NodeExpandVolume`: a published volume grown to `required_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpandVolume {
    /// The volume's handle.
    pub volume_id: String,
    /// Where the volume is published (a raw block volume's device file).
    pub volume_path: PathBuf,
    /// Where it was staged, if the driver stages.
    pub staging_target_path: Option<PathBuf>,
    /// The size it must have now, in bytes.
    pub required_bytes: i64,
    /// How the volume is accessed.
    pub capability: VolumeCapability,
    /// Node-expand secrets.
    pub secrets: Secrets,
}

/// A connection to one driver's Node service.
#[derive(Clone, Debug)]
pub struct CsiNodeClient {
    driver: String,
    client: NodeClient<UdsChannel>,
    timeouts: CsiNodeTimeouts,
}

impl CsiNodeClient {
    /// Dials `driver`'s endpoint within `timeouts.dial`; the connection is
    /// kept for every call made through this client (and its clones).
    pub async fn connect(driver: &CsiDriver, timeouts: CsiNodeTimeouts) -> Result<CsiNodeClient, CsiNodeError> {
        let path = uds::socket_path_of(&driver.endpoint);
        let channel = uds::dial(path, timeouts.dial)
            .await
            .map_err(|source| CsiNodeError::Dial { driver: driver.name.clone(), source })?;
        Ok(CsiNodeClient { driver: driver.name.clone(), client: NodeClient::new(channel), timeouts })
    }

    /// `NodeGetCapabilities`.
    pub async fn capabilities(&self) -> Result<NodeCapabilities, CsiNodeError> {
        let mut client = self.client.clone();
        let call = client.node_get_capabilities(api::NodeGetCapabilitiesRequest {});
        let answer = self.call("NodeGetCapabilities", "", self.timeouts.capabilities, call).await?;
        Ok(NodeCapabilities(answer.capabilities.iter().filter_map(capability_of).collect()))
    }

    /// `NodeStageVolume`.
    pub async fn stage_volume(&self, request: &StageVolume) -> Result<(), CsiNodeError> {
        const RPC: &str = "NodeStageVolume";
        let message = api::NodeStageVolumeRequest {
            volume_id: request.volume_id.clone(),
            publish_context: request.publish_context.clone().into_iter().collect(),
            staging_target_path: self.path(RPC, &request.volume_id, &request.staging_target_path)?,
            volume_capability: Some(capability_to_api(&request.capability)),
            secrets: request.secrets.0.clone().into_iter().collect(),
            volume_context: request.volume_context.clone().into_iter().collect(),
        };
        let mut client = self.client.clone();
        self.call(RPC, &request.volume_id, self.timeouts.volume, client.node_stage_volume(message)).await?;
        Ok(())
    }

    /// `NodeUnstageVolume`.
    pub async fn unstage_volume(&self, volume_id: &str, staging_target_path: &Path) -> Result<(), CsiNodeError> {
        const RPC: &str = "NodeUnstageVolume";
        let message = api::NodeUnstageVolumeRequest {
            volume_id: volume_id.to_owned(),
            staging_target_path: self.path(RPC, volume_id, staging_target_path)?,
        };
        let mut client = self.client.clone();
        self.call(RPC, volume_id, self.timeouts.volume, client.node_unstage_volume(message)).await?;
        Ok(())
    }

    /// `NodePublishVolume`.
    pub async fn publish_volume(&self, request: &PublishVolume) -> Result<(), CsiNodeError> {
        const RPC: &str = "NodePublishVolume";
        let staging_target_path = match &request.staging_target_path {
            Some(path) => self.path(RPC, &request.volume_id, path)?,
            None => String::new(),
        };
        let message = api::NodePublishVolumeRequest {
            volume_id: request.volume_id.clone(),
            publish_context: request.publish_context.clone().into_iter().collect(),
            staging_target_path,
            target_path: self.path(RPC, &request.volume_id, &request.target_path)?,
            volume_capability: Some(capability_to_api(&request.capability)),
            readonly: request.read_only,
            secrets: request.secrets.0.clone().into_iter().collect(),
            volume_context: request.volume_context.clone().into_iter().collect(),
        };
        let mut client = self.client.clone();
        self.call(RPC, &request.volume_id, self.timeouts.volume, client.node_publish_volume(message)).await?;
        Ok(())
    }

    /// `NodeExpandVolume`; the capacity the driver reports, if it did.
    pub async fn expand_volume(&self, request: &ExpandVolume) -> Result<Option<i64>, CsiNodeError> {
        const RPC: &str = "NodeExpandVolume";
        let staging_target_path = match &request.staging_target_path {
            Some(path) => self.path(RPC, &request.volume_id, path)?,
            None => String::new(),
        };
        let message = api::NodeExpandVolumeRequest {
            volume_id: request.volume_id.clone(),
            volume_path: self.path(RPC, &request.volume_id, &request.volume_path)?,
            capacity_range: Some(api::CapacityRange { required_bytes: request.required_bytes, limit_bytes: 0 }),
            staging_target_path,
            volume_capability: Some(capability_to_api(&request.capability)),
            secrets: request.secrets.0.clone().into_iter().collect(),
        };
        let mut client = self.client.clone();
        let answer =
            self.call(RPC, &request.volume_id, self.timeouts.volume, client.node_expand_volume(message)).await?;
        Ok(Some(answer.capacity_bytes).filter(|bytes| *bytes > 0))
    }

    /// `NodeUnpublishVolume`.
    pub async fn unpublish_volume(&self, volume_id: &str, target_path: &Path) -> Result<(), CsiNodeError> {
        const RPC: &str = "NodeUnpublishVolume";
        let message = api::NodeUnpublishVolumeRequest {
            volume_id: volume_id.to_owned(),
            target_path: self.path(RPC, volume_id, target_path)?,
        };
        let mut client = self.client.clone();
        self.call(RPC, volume_id, self.timeouts.volume, client.node_unpublish_volume(message)).await?;
        Ok(())
    }

    /// `NodeGetVolumeStats` of the volume published at `volume_path`.
    pub async fn volume_stats(
        &self,
        volume_id: &str,
        volume_path: &Path,
        staging_target_path: Option<&Path>,
    ) -> Result<VolumeUsage, CsiNodeError> {
        const RPC: &str = "NodeGetVolumeStats";
        let message = api::NodeGetVolumeStatsRequest {
            volume_id: volume_id.to_owned(),
            volume_path: self.path(RPC, volume_id, volume_path)?,
            staging_target_path: match staging_target_path {
                Some(path) => self.path(RPC, volume_id, path)?,
                None => String::new(),
            },
        };
        let mut client = self.client.clone();
        let answer =
            self.call(RPC, volume_id, self.timeouts.capabilities, client.node_get_volume_stats(message)).await?;
        let mut usage = VolumeUsage { abnormal: answer.volume_condition.map(|c| c.abnormal), ..VolumeUsage::default() };
        let unsigned = |v: i64| u64::try_from(v).unwrap_or(0);
        for one in answer.usage {
            match api::volume_usage::Unit::try_from(one.unit) {
                Ok(api::volume_usage::Unit::Bytes) => {
                    usage.bytes = Some((unsigned(one.total), unsigned(one.available), unsigned(one.used)));
                }
                Ok(api::volume_usage::Unit::Inodes) => {
                    usage.inodes = Some((unsigned(one.total), unsigned(one.available), unsigned(one.used)));
                }
                _ => {}
            }
        }
        Ok(usage)
    }

    /// Paths go over the wire as UTF-8 strings.
    fn path(&self, rpc: &'static str, volume_id: &str, path: &Path) -> Result<String, CsiNodeError> {
        path.to_str().map(str::to_owned).ok_or_else(|| CsiNodeError::InvalidRequest {
            driver: self.driver.clone(),
            rpc,
            volume_id: volume_id.to_owned(),
            reason: format!("path {} is not UTF-8", path.display()),
        })
    }

    async fn call<T>(
        &self,
        rpc: &'static str,
        volume_id: &str,
        timeout: Duration,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, CsiNodeError> {
        let span = tracing::debug_span!("csi_node_call", driver = %self.driver, rpc, volume_id);
        match tokio::time::timeout(timeout, tracing::Instrument::instrument(call, span)).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(CsiNodeError::Status {
                driver: self.driver.clone(),
                rpc,
                volume_id: volume_id.to_owned(),
                code: status.code(),
                message: status.message().to_owned(),
            }),
            Err(_) => Err(CsiNodeError::Timeout {
                driver: self.driver.clone(),
                rpc,
                volume_id: volume_id.to_owned(),
                timeout,
            }),
        }
    }
}

fn capability_of(capability: &api::NodeServiceCapability) -> Option<NodeCapability> {
    use api::node_service_capability::rpc::Type;
    let api::node_service_capability::Type::Rpc(rpc) = capability.r#type.as_ref()?;
    match Type::try_from(rpc.r#type).ok()? {
        Type::StageUnstageVolume => Some(NodeCapability::StageUnstageVolume),
        Type::GetVolumeStats => Some(NodeCapability::GetVolumeStats),
        Type::ExpandVolume => Some(NodeCapability::ExpandVolume),
        Type::VolumeCondition => Some(NodeCapability::VolumeCondition),
        Type::SingleNodeMultiWriter => Some(NodeCapability::SingleNodeMultiWriter),
        Type::VolumeMountGroup => Some(NodeCapability::VolumeMountGroup),
        Type::Unknown => None,
    }
}

fn capability_to_api(capability: &VolumeCapability) -> api::VolumeCapability {
    use api::volume_capability::access_mode::Mode;
    let access_type = match &capability.access_type {
        AccessType::Mount { fs_type, mount_flags, volume_mount_group } => {
            api::volume_capability::AccessType::Mount(api::volume_capability::MountVolume {
                fs_type: fs_type.clone(),
                mount_flags: mount_flags.clone(),
                volume_mount_group: volume_mount_group.clone(),
            })
        }
        AccessType::Block => api::volume_capability::AccessType::Block(api::volume_capability::BlockVolume {}),
    };
    let mode = match capability.access_mode {
        AccessMode::SingleNodeWriter => Mode::SingleNodeWriter,
        AccessMode::SingleNodeReaderOnly => Mode::SingleNodeReaderOnly,
        AccessMode::MultiNodeReaderOnly => Mode::MultiNodeReaderOnly,
        AccessMode::MultiNodeSingleWriter => Mode::MultiNodeSingleWriter,
        AccessMode::MultiNodeMultiWriter => Mode::MultiNodeMultiWriter,
        AccessMode::SingleNodeSingleWriter => Mode::SingleNodeSingleWriter,
        AccessMode::SingleNodeMultiWriter => Mode::SingleNodeMultiWriter,
    };
    api::VolumeCapability {
        access_type: Some(access_type),
        access_mode: Some(api::volume_capability::AccessMode { mode: mode as i32 }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_never_printed() {
        let secrets = Secrets([("password".to_owned(), "hunter2".to_owned())].into_iter().collect());
        let request = StageVolume {
            volume_id: "v1".into(),
            staging_target_path: "/stage".into(),
            capability: VolumeCapability { access_type: AccessType::Block, access_mode: AccessMode::SingleNodeWriter },
            publish_context: BTreeMap::new(),
            volume_context: BTreeMap::new(),
            secrets,
        };
        let printed = format!("{request:?}");
        assert!(printed.contains("password") && !printed.contains("hunter2"), "{printed}");
    }

    #[test]
    fn unknown_capabilities_are_left_out() {
        use api::node_service_capability::rpc::Type;
        let rpc = |t: i32| api::NodeServiceCapability {
            r#type: Some(api::node_service_capability::Type::Rpc(api::node_service_capability::Rpc { r#type: t })),
        };
        assert_eq!(capability_of(&rpc(Type::StageUnstageVolume as i32)), Some(NodeCapability::StageUnstageVolume));
        assert_eq!(capability_of(&rpc(0)), None);
        assert_eq!(capability_of(&rpc(99)), None, "a newer spec's capability");
        assert_eq!(capability_of(&api::NodeServiceCapability { r#type: None }), None);
    }
}
