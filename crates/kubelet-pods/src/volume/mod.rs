//! Pod volumes: prepared before the pod's containers start, torn down when
//! it is removed.
//!
//! Paths follow the kubelet's layout under the root dir:
//! `pods/<uid>/volumes/<plugin>/<volume>`, with plugin dirs
//! `kubernetes.io~empty-dir` and `kubernetes.io~downward-api`. `hostPath`
//! volumes are the host path itself, checked against their `type`.
//!
//! Volumes that need the API (configMap, secret, projected; see
//! [`api_data`]) are prepared when the node has an [`ApiObjects`] (cluster
//! mode); persistentVolumeClaim when it resolves claims. Otherwise (static
//! pods) they are refused with a clear error, as upstream refuses them.
//!
//! CSI volumes (inline `csi:` and claims bound to CSI volumes) go through
//! [`CsiVolumes`] (see [`csi`] for the sequence).

pub mod api_data;
pub mod atomic_writer;
pub mod csi;
mod downward_api;
mod empty_dir;
mod expansion;
mod host_path;
pub mod mounts;
mod ownership;
pub mod reconciler;
pub mod stats;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Pod, Volume};

pub use api_data::{ApiObjects, EnvObjects, ObjectKind};
pub use csi::{ClaimedVolume, CsiDriverObjects, CsiMount, CsiVolumes, StaticClaims, VolumeClaims};
pub use downward_api::{DownwardContext, DownwardError};
pub(crate) use downward_api::{field_value, resource_value};
pub use host_path::HostPathType;

/// Why a pod volume could not be prepared or torn down.
#[derive(Debug, thiserror::Error)]
pub(crate) enum VolumeError {
    /// A `hostPath` is not of its declared `type` (upstream's text).
    #[error("volume {volume:?}: hostPath type check failed: {} is not a {expected}", path.display())]
    HostPathType {
        /// The volume.
        volume: String,
        /// The host path.
        path: PathBuf,
        /// What the type asked for.
        expected: String,
    },
    /// The volume's spec cannot be used.
    #[error("volume {volume:?}: {reason}")]
    InvalidSpec {
        /// The volume.
        volume: String,
        /// Why.
        reason: String,
    },
    /// The volume type needs something this node does not have.
    #[error("volume {volume:?}: {kind} volumes are not supported {reason}")]
    Unsupported {
        /// The volume.
        volume: String,
        /// Its type (`configMap`, `secret`, …).
        kind: &'static str,
        /// Where or why not.
        reason: &'static str,
    },
    /// A file system operation failed.
    #[error("volume {volume:?}: {}: {source}", path.display())]
    Io {
        /// The volume.
        volume: String,
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The volume's CSI driver is not registered on this node (upstream's
    /// text); the pod retries when the registered drivers change.
    #[error("volume {volume:?}: driver name {driver} not found in the list of registered CSI drivers")]
    DriverNotRegistered {
        /// The volume.
        volume: String,
        /// The driver it names.
        driver: String,
    },
    /// The volume's driver needs it attached (`attachRequired`) and its
    /// VolumeAttachment to this node is missing or not attached yet; the
    /// pod retries with backoff.
    #[error("volume {volume:?} is not attached to this node yet: {reason}")]
    NotAttached {
        /// The volume.
        volume: String,
        /// What the attachment lacks.
        reason: String,
    },
    /// The volume's only access mode is `ReadWriteOncePod` and another pod
    /// of the node uses it (upstream's text); the pod retries.
    #[error("volume {volume:?}: volume uses the ReadWriteOncePod access mode and is already in use by another pod")]
    InUseByAnotherPod {
        /// The volume.
        volume: String,
    },
    /// The driver's CSIDriver asks for service-account tokens
    /// (`tokenRequests`) and the API gave none; the pod retries.
    #[error("volume {volume:?}: cannot get a service account token for its CSI driver: {reason}")]
    Token {
        /// The volume.
        volume: String,
        /// Why.
        reason: String,
    },
    /// A CSI call failed (or did not answer in time).
    #[error("volume {volume:?}: {source}")]
    Csi {
        /// The volume.
        volume: String,
        /// The driver's error.
        #[source]
        source: crate::csi::CsiNodeError,
    },
    /// Tearing the volume down failed.
    #[error("volume {volume:?}: teardown failed: {reason}")]
    Teardown {
        /// The volume.
        volume: String,
        /// Why.
        reason: String,
    },
}

/// What a volume is on the host once prepared.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PreparedVolume {
    /// The host path the container mounts.
    pub host_path: PathBuf,
    /// Its type, for teardown.
    pub kind: VolumeKind,
    /// Whether it is ready for the containers (a CSI volume is recorded
    /// before it is published, so a removal in between unpublishes it).
    pub ready: bool,
    /// A CSI volume's driver, handle and paths.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub csi: Option<CsiMount>,
}

impl PreparedVolume {
    pub(crate) fn ready(host_path: PathBuf, kind: VolumeKind) -> Self {
        PreparedVolume { host_path, kind, ready: true, csi: None }
    }
}

/// The volume types this node prepares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub(crate) enum VolumeKind {
    /// `hostPath`: nothing to tear down.
    HostPath,
    /// `emptyDir`: removed with the pod.
    EmptyDir,
    /// `downwardAPI`: removed with the pod.
    DownwardApi,
    /// `configMap`, `secret`, `projected`: removed with the pod.
    ApiData,
    /// CSI (inline or persistent): unpublished, and unstaged when unused.
    Csi,
}

/// A pod's prepared volumes, by volume name.
pub(crate) type PodVolumes = BTreeMap<String, PreparedVolume>;

/// Prepares and tears down pod volumes under a root dir.
#[derive(Clone)]
pub(crate) struct VolumeManager {
    root_dir: PathBuf,
    csi: Option<CsiVolumes>,
    objects: Option<Arc<dyn ApiObjects>>,
    stats: stats::VolumeStats,
}

impl std::fmt::Debug for VolumeManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumeManager")
            .field("root_dir", &self.root_dir)
            .field("csi", &self.csi)
            .field("objects", &self.objects.is_some())
            .finish()
    }
}

/// The oldest copy of an object a running pod's volume is rewritten from
/// (half the rewrite period, at most this).
pub(crate) const OBJECT_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(10);

/// Why API-backed volumes are refused in static pods.
pub(crate) const NEEDS_API: &str = "in static pods (they need the API server; upstream refuses them too)";

impl VolumeManager {
    /// Volumes under `<root_dir>/pods`; no CSI volumes.
    pub(crate) fn new(root_dir: impl Into<PathBuf>) -> Self {
        VolumeManager { root_dir: root_dir.into(), csi: None, objects: None, stats: stats::VolumeStats::default() }
    }

    /// Prepares configMap, secret and projected volumes from `objects`.
    pub(crate) fn with_objects(mut self, objects: Arc<dyn ApiObjects>) -> Self {
        self.objects = Some(objects);
        self
    }

    /// Where API objects come from, if the node has them.
    pub(crate) fn objects(&self) -> Option<&Arc<dyn ApiObjects>> {
        self.objects.as_ref()
    }

    /// Publishes CSI volumes through `csi`.
    pub(crate) fn with_csi(mut self, csi: CsiVolumes) -> Self {
        self.csi = Some(csi);
        self
    }

    /// The pods' claim volumes and their figures.
    pub(crate) fn stats(&self) -> &stats::VolumeStats {
        &self.stats
    }

    /// The CSI volumes, if the node has them.
    pub(crate) fn csi(&self) -> Option<&CsiVolumes> {
        self.csi.as_ref()
    }

    /// Changes that may let a failed preparation succeed (a CSI driver
    /// registering); `None` when nothing but a retry can help.
    pub(crate) fn changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.csi.as_ref().map(CsiVolumes::changes)
    }

    /// `<root>/pods/<uid>`.
    pub(crate) fn pod_dir(&self, pod_uid: &str) -> PathBuf {
        self.root_dir.join("pods").join(pod_uid)
    }

    fn plugin_dir(&self, pod_uid: &str, plugin: &str, volume: &str) -> PathBuf {
        self.pod_dir(pod_uid).join("volumes").join(plugin).join(volume)
    }

    /// Prepares every volume of `pod`. What was prepared before an error is
    /// in `prepared` (for [`teardown`](Self::teardown)); calling again after
    /// an error prepares the rest. `context` is what downward API items
    /// read besides the pod.
    pub(crate) async fn prepare(
        &self,
        pod: &Pod,
        prepared: &mut PodVolumes,
        context: &DownwardContext,
    ) -> Result<(), VolumeError> {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let fs_group = fs_group(pod);
        let used = used_volumes(pod);
        for volume in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
            if prepared.get(&volume.name).is_some_and(|v| v.ready) {
                continue;
            }
            if !used.contains(volume.name.as_str()) {
                // As the kubelet: a volume no container mounts or maps is
                // neither checked nor set up (nor published, for CSI).
                tracing::debug!(pod.uid = %uid, volume = %volume.name, "volume unused by every container; skipped");
                continue;
            }
            if let Some(csi) = self.csi_for(volume)? {
                csi.prepare(pod, volume, prepared).await?;
                continue;
            }
            let plugin = if volume.config_map.is_some() {
                Some("kubernetes.io~configmap")
            } else if volume.secret.is_some() {
                Some("kubernetes.io~secret")
            } else if volume.projected.is_some() {
                Some("kubernetes.io~projected")
            } else {
                None
            };
            if let (Some(plugin), Some(objects)) = (plugin, &self.objects) {
                let dir = self.plugin_dir(&uid, plugin, &volume.name);
                let objects = api_data::ReadObjects { objects: Arc::clone(objects), read: api_data::Read::Start };
                let host_path = api_data::prepare(&objects, pod, volume, &dir, context, fs_group).await?;
                prepared.insert(volume.name.clone(), PreparedVolume::ready(host_path, VolumeKind::ApiData));
                continue;
            }
            let ready = self.prepare_one(&uid, pod, volume, context, fs_group)?;
            tracing::debug!(pod.uid = %uid, volume = %volume.name, path = %ready.host_path.display(), "volume ready");
            prepared.insert(volume.name.clone(), ready);
        }
        self.stats.mounted(pod, prepared);
        Ok(())
    }

    /// The CSI publisher for `volume`, if it is a CSI volume (inline, or a
    /// claim the node can resolve).
    fn csi_for(&self, volume: &Volume) -> Result<Option<&CsiVolumes>, VolumeError> {
        let is_csi = volume.csi.is_some();
        let is_claim = volume.persistent_volume_claim.is_some() || volume.ephemeral.is_some();
        match &self.csi {
            Some(csi) if is_csi || (is_claim && csi.resolves_claims()) => Ok(Some(csi)),
            None if is_csi => Err(VolumeError::Unsupported {
                volume: volume.name.clone(),
                kind: "csi",
                reason: "on this node (it has no CSI driver registry)",
            }),
            _ => Ok(None),
        }
    }

    /// Expands the pod's claimed CSI volumes whose claims ask the node to
    /// (an online expansion's node step); returns how many it expanded, or
    /// every error (after the others were tried).
    pub(crate) async fn expand(&self, pod: &Pod, prepared: &PodVolumes) -> Result<usize, Vec<VolumeError>> {
        let Some(csi) = &self.csi else { return Ok(0) };
        let (mut expanded, mut errors) = (0, Vec::new());
        for volume in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
            let Some(ready) = prepared.get(&volume.name) else { continue };
            match csi.expand(pod, volume, ready).await {
                Ok(true) => expanded += 1,
                Ok(false) => {}
                Err(error) => errors.push(error),
            }
        }
        if errors.is_empty() { Ok(expanded) } else { Err(errors) }
    }

    /// Publishes the pod's CSI volumes again whose drivers ask for it
    /// (`requiresRepublish`); returns how many, or every error (after the
    /// others were tried).
    pub(crate) async fn republish(&self, pod: &Pod, prepared: &PodVolumes) -> Result<usize, Vec<VolumeError>> {
        let Some(csi) = &self.csi else { return Ok(0) };
        let (mut republished, mut errors) = (0, Vec::new());
        for volume in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
            let Some(ready) = prepared.get(&volume.name).filter(|v| v.kind == VolumeKind::Csi) else { continue };
            match csi.republish(pod, volume, ready).await {
                Ok(true) => republished += 1,
                Ok(false) => {}
                Err(error) => errors.push(error),
            }
        }
        if errors.is_empty() { Ok(republished) } else { Err(errors) }
    }

    /// Writes the volumes whose contents follow the API and the pod
    /// (configMap, secret, projected, downwardAPI) again from what the
    /// objects and `pod` hold now: a changed object or label, or an
    /// optional object created later, reaches the running containers.
    /// Objects are read through [`ApiObjects::data_cached`]: a copy at
    /// most `max_age` old will do. Returns how many volumes changed; a
    /// volume that cannot be written keeps its last contents (the error is
    /// returned after the others were tried).
    pub(crate) async fn refresh(
        &self,
        pod: &Pod,
        prepared: &PodVolumes,
        context: &DownwardContext,
        max_age: std::time::Duration,
    ) -> Result<usize, Vec<VolumeError>> {
        let fs_group = fs_group(pod);
        let mut changed = 0;
        let mut errors = Vec::new();
        for volume in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
            let Some(ready) = prepared.get(&volume.name).filter(|v| v.ready) else { continue };
            let result = match (ready.kind, &volume.downward_api, &self.objects) {
                (VolumeKind::DownwardApi, Some(source), _) => {
                    let default_mode = source.default_mode.map_or(0o644, |m| m as u32);
                    let items = source.items.as_deref().unwrap_or_default();
                    downward_api::files(&volume.name, items, pod, context, default_mode)
                        .and_then(|files| atomic_writer::write(&volume.name, &ready.host_path, &files, fs_group))
                }
                (VolumeKind::ApiData, _, Some(objects)) => {
                    let before = std::fs::read_link(ready.host_path.join(atomic_writer::DATA_LINK)).ok();
                    // Objects many pods share are read once per `max_age`,
                    // not once per pod.
                    let cached =
                        api_data::ReadObjects { objects: Arc::clone(objects), read: api_data::Read::Rewrite(max_age) };
                    api_data::prepare(&cached, pod, volume, &ready.host_path, context, fs_group)
                        .await
                        .map(|_| std::fs::read_link(ready.host_path.join(atomic_writer::DATA_LINK)).ok() != before)
                }
                _ => continue,
            };
            match result {
                Ok(true) => {
                    changed += 1;
                    tracing::info!(pod.uid = ?pod.metadata.uid, volume = %volume.name, "volume contents updated");
                }
                Ok(false) => {}
                Err(error) => errors.push(error),
            }
        }
        if errors.is_empty() { Ok(changed) } else { Err(errors) }
    }

    fn prepare_one(
        &self,
        uid: &str,
        pod: &Pod,
        volume: &Volume,
        context: &DownwardContext,
        fs_group: Option<u32>,
    ) -> Result<PreparedVolume, VolumeError> {
        let name = volume.name.as_str();
        if let Some(host) = &volume.host_path {
            let host_path = host_path::prepare(name, &host.path, host.type_.as_deref())?;
            return Ok(PreparedVolume::ready(host_path, VolumeKind::HostPath));
        }
        if let Some(empty) = &volume.empty_dir {
            let dir = self.plugin_dir(uid, "kubernetes.io~empty-dir", name);
            let memory = empty.medium.as_deref() == Some("Memory");
            let limit = empty.size_limit.as_ref().map(|q| q.0.as_str());
            let size = memory.then(|| empty_dir::memory_size(pod, context.allocatable_memory, limit)).flatten();
            let host_path = empty_dir::prepare(name, &dir, memory, size, fs_group)?;
            return Ok(PreparedVolume::ready(host_path, VolumeKind::EmptyDir));
        }
        if let Some(downward) = &volume.downward_api {
            let dir = self.plugin_dir(uid, "kubernetes.io~downward-api", name);
            let host_path = downward_api::prepare(name, &dir, downward, pod, context, fs_group)?;
            return Ok(PreparedVolume::ready(host_path, VolumeKind::DownwardApi));
        }
        let unsupported = |kind: &'static str, reason: &'static str| VolumeError::Unsupported {
            volume: name.to_owned(),
            kind,
            reason,
        };
        Err(if volume.config_map.is_some() {
            unsupported("configMap", NEEDS_API)
        } else if volume.secret.is_some() {
            unsupported("secret", NEEDS_API)
        } else if volume.projected.is_some() {
            unsupported("projected", NEEDS_API)
        } else if volume.persistent_volume_claim.is_some() {
            unsupported("persistentVolumeClaim", NEEDS_API)
        } else if volume.ephemeral.is_some() {
            unsupported("ephemeral", NEEDS_API)
        } else {
            unsupported("this kind of", "on this node")
        })
    }

    /// Tears down every prepared volume (all of them, even when one fails)
    /// and removes the pod's directory; returns every failure.
    pub(crate) async fn teardown(&self, pod_uid: &str, prepared: &mut PodVolumes) -> Vec<VolumeError> {
        self.stats.unmounted(pod_uid);
        let mut errors = Vec::new();
        let names: Vec<String> = prepared.keys().cloned().collect();
        for name in names {
            let Some(volume) = prepared.get(&name) else { continue };
            let result = match volume.kind {
                VolumeKind::HostPath => Ok(()),
                VolumeKind::EmptyDir | VolumeKind::DownwardApi | VolumeKind::ApiData => {
                    empty_dir::teardown(&name, &volume.host_path)
                }
                VolumeKind::Csi => match &self.csi {
                    Some(csi) => csi.teardown(pod_uid, &name, volume).await,
                    None => Err(VolumeError::Teardown {
                        volume: name.clone(),
                        reason: "a CSI volume, and this node has no CSI driver registry".into(),
                    }),
                },
            };
            match result {
                Ok(()) => {
                    prepared.remove(&name);
                }
                Err(error) => errors.push(error),
            }
        }
        if errors.is_empty() {
            let dir = self.pod_dir(pod_uid);
            if let Err(source) = remove_pod_dir(&dir) {
                errors.push(VolumeError::Io { volume: String::new(), path: dir, source });
            }
        }
        errors
    }
}

/// The names of the volumes some container of `pod` (init, regular or
/// ephemeral) mounts (`volumeMounts`) or maps (`volumeDevices`).
pub(crate) fn used_volumes(pod: &Pod) -> std::collections::BTreeSet<&str> {
    let Some(spec) = &pod.spec else { return Default::default() };
    let mut used = std::collections::BTreeSet::new();
    for c in spec.init_containers.iter().flatten().chain(&spec.containers) {
        used.extend(c.volume_mounts.iter().flatten().map(|m| m.name.as_str()));
        used.extend(c.volume_devices.iter().flatten().map(|d| d.name.as_str()));
    }
    for c in spec.ephemeral_containers.iter().flatten() {
        used.extend(c.volume_mounts.iter().flatten().map(|m| m.name.as_str()));
        used.extend(c.volume_devices.iter().flatten().map(|d| d.name.as_str()));
    }
    used
}

/// The pod's `fsGroup`: the group its volumes' files belong to.
pub(crate) fn fs_group(pod: &Pod) -> Option<u32> {
    pod.spec
        .as_ref()
        .and_then(|s| s.security_context.as_ref())
        .and_then(|c| c.fs_group)
        .and_then(|g| u32::try_from(g).ok())
}

/// Removes a pod's directory, refusing to cross into a mount left behind
/// (anything mounted under it, by `/proc/self/mountinfo`).
fn remove_pod_dir(dir: &Path) -> std::io::Result<()> {
    mounts::remove_dir_all_unmounted(dir)
}
