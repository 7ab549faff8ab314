//! CSI volumes: inline ephemeral `csi:` volumes and persistent volumes
//! (a claim resolved to a CSI `PersistentVolume`), published through the
//! driver registered under the volume's driver name.
//!
//! The sequence is the kubelet's:
//! - the driver is resolved by name in the CSI registry; a driver that is not
//!   registered fails with upstream's text (`driver name X not found in the
//!   list of registered CSI drivers`) and the pod's volume stage retries as
//!   soon as the registry changes ([`CsiVolumes::changes`]);
//! - `NodeGetCapabilities` once per driver registration (cached);
//! - persistent volumes of a driver with `STAGE_UNSTAGE_VOLUME`:
//!   `NodeStageVolume` at the volume's global path
//!   `plugins/kubernetes.io/csi/<driver>/<sha256(volume handle)>/globalmount`,
//!   once for all the pods that use it (counted per pod);
//! - `NodePublishVolume` at `pods/<uid>/volumes/kubernetes.io~csi/<name>/mount`
//!   (`<name>` is the pod's volume name inline, the PV's name otherwise),
//!   with `vol_data.json` beside it; inline volumes get the handle
//!   `csi-<sha256(pod uid + volume name)>` and `csi.storage.k8s.io/ephemeral`;
//!   the pod's name, namespace, UID and service account are added to the
//!   volume context when the driver's CSIDriver asks for `podInfoOnMount`;
//! - on removal `NodeUnpublishVolume`, then `NodeUnstageVolume` once no pod
//!   uses the staged volume.
//!
//! A volume is recorded in the pod's volumes *before* it is staged or
//! published, so a pod removed while a call is in flight still unpublishes
//! (and unstages) it: the CSI calls are idempotent, and nothing is leaked.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod, Volume};
use k8s_openapi::api::storage::v1::CSIDriverSpec;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use super::{PreparedVolume, VolumeError, VolumeKind};
use crate::ApiError;
use crate::csi::{
    AccessMode, AccessType, CsiDriver, CsiDrivers, CsiNodeClient, CsiNodeError, CsiNodeTimeouts, NodeCapabilities,
    PublishVolume, Secrets, StageVolume, VolumeCapability,
};

/// The pod volume plugin directory of CSI volumes.
pub(crate) const CSI_PLUGIN_DIR: &str = "kubernetes.io~csi";

/// The CSIDriver objects the node knows, by driver name: whether a driver
/// wants the pod's info on mount and which lifecycle modes it serves. Static
/// manifests fill it when standalone; cluster mode from the API. Cheap to
/// clone.
#[derive(Clone, Debug, Default)]
pub struct CsiDriverObjects {
    specs: Arc<RwLock<BTreeMap<String, CSIDriverSpec>>>,
}

impl CsiDriverObjects {
    /// No CSIDriver objects.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records (or replaces) the CSIDriver object of `name`.
    pub fn set(&self, name: &str, spec: CSIDriverSpec) {
        self.specs.write().unwrap_or_else(|p| p.into_inner()).insert(name.to_owned(), spec);
    }

    /// Forgets the CSIDriver object of `name`.
    pub fn remove(&self, name: &str) {
        self.specs.write().unwrap_or_else(|p| p.into_inner()).remove(name);
    }

    /// The CSIDriver object of `name`, if any.
    pub fn get(&self, name: &str) -> Option<CSIDriverSpec> {
        self.specs.read().unwrap_or_else(|p| p.into_inner()).get(name).cloned()
    }

    /// The names with a CSIDriver object.
    pub fn names(&self) -> Vec<String> {
        self.specs.read().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect()
    }
}

/// A claim resolved to its bound volume, with the secrets its CSI source
/// names (the resolver fetches them; the node never logs them).
#[derive(Clone, Debug, Default)]
pub struct ClaimedVolume {
    /// The bound `PersistentVolume` (its `spec.csi` is what the node uses).
    pub volume: PersistentVolume,
    /// The claim's `readOnly` in the pod (`persistentVolumeClaim.readOnly`).
    pub claim_read_only: bool,
    /// The node-stage secrets (`nodeStageSecretRef`).
    pub stage_secrets: Secrets,
    /// The node-publish secrets (`nodePublishSecretRef`).
    pub publish_secrets: Secrets,
    /// The node-expand secrets (`nodeExpandSecretRef`).
    pub expand_secrets: Secrets,
    /// The claim itself, as read with the volume; the node writes its
    /// status when it expands the volume (`None`: no expansion).
    pub claim: Option<k8s_openapi::api::core::v1::PersistentVolumeClaim>,
}

/// Finds the volume a pod's `persistentVolumeClaim` is bound to. Cluster
/// mode implements it with the API; embedders and tests with what they have
/// ([`StaticClaims`]).
#[async_trait::async_trait]
pub trait VolumeClaims: Send + Sync + 'static {
    /// The volume bound to claim `claim` in `namespace`, or why there is none.
    async fn resolve(&self, namespace: &str, claim: &str, read_only: bool) -> Result<ClaimedVolume, ApiError>;

    /// For a driver that needs its volumes attached (`attachRequired`):
    /// the attachment metadata of volume `handle` of `driver` once it is
    /// attached to this node (it becomes the publish context), or why the
    /// volume is not attached yet. By default nothing is attached and
    /// volumes are published without a publish context.
    async fn attachment(&self, driver: &str, handle: &str) -> Result<BTreeMap<String, String>, ApiError> {
        let _ = (driver, handle);
        Ok(BTreeMap::new())
    }

    /// Applies `patch` (a strategic merge patch) to claim `claim`'s status
    /// in `namespace`: the node's steps of an online expansion
    /// (`persistentvolumeclaims/status`); returns the claim as written. By
    /// default there is no API to write to, and no claim is expanded (see
    /// [`ClaimedVolume::claim`]).
    async fn patch_claim_status(
        &self,
        namespace: &str,
        claim: &str,
        patch: serde_json::Value,
    ) -> Result<PersistentVolumeClaim, ApiError> {
        let _ = patch;
        Err(ApiError::NotReady(format!("no API to write PersistentVolumeClaim {namespace}/{claim}'s status to")))
    }

    /// A service-account token for `pod` bound to it, for `audience` (the
    /// API server's own when empty), valid `expiration_seconds`, and when it
    /// expires (RFC 3339): what a CSIDriver's `tokenRequests` hand its
    /// driver. By default there is no API to ask.
    async fn pod_token(
        &self,
        pod: &Pod,
        audience: &str,
        expiration_seconds: i64,
    ) -> Result<(String, String), ApiError> {
        let _ = (audience, expiration_seconds);
        Err(ApiError::NotReady(format!(
            "no API to ask for a token of pod {}'s service account",
            pod.metadata.name.as_deref().unwrap_or_default()
        )))
    }
}

/// Claims bound to volumes by the embedder: `(namespace, claim)` → volume.
#[derive(Clone, Debug, Default)]
pub struct StaticClaims {
    bound: Arc<RwLock<HashMap<(String, String), ClaimedVolume>>>,
}

impl StaticClaims {
    /// No claims.
    pub fn new() -> Self {
        Self::default()
    }

    /// Binds claim `claim` in `namespace` to `volume`.
    pub fn bind(&self, namespace: &str, claim: &str, volume: ClaimedVolume) {
        self.bound.write().unwrap_or_else(|p| p.into_inner()).insert((namespace.to_owned(), claim.to_owned()), volume);
    }
}

#[async_trait::async_trait]
impl VolumeClaims for StaticClaims {
    async fn resolve(&self, namespace: &str, claim: &str, read_only: bool) -> Result<ClaimedVolume, ApiError> {
        let bound = self.bound.read().unwrap_or_else(|p| p.into_inner());
        let mut volume = bound.get(&(namespace.to_owned(), claim.to_owned())).cloned().ok_or_else(|| {
            ApiError::NotReady(format!("PersistentVolumeClaim {namespace}/{claim} is not bound to a volume"))
        })?;
        volume.claim_read_only |= read_only;
        Ok(volume)
    }
}

/// What a published CSI volume needs for its teardown; kept in the pod's
/// volumes from before the first call.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CsiMount {
    /// The driver's name.
    pub driver_name: String,
    /// The volume handle.
    pub volume_handle: String,
    /// The pod's volume name, or the PV's name.
    pub spec_vol_id: String,
    /// `Ephemeral` (inline) or `Persistent`.
    pub volume_lifecycle_mode: String,
    /// The volume's global staging path, when the driver stages it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging_target_path: Option<PathBuf>,
    /// A raw block volume (`volumeMode: Block`): published to a device
    /// file, [`block_publish_path`], that the pod's containers get as a
    /// device (`volumeDevices`), not a mount.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub block: bool,
}

/// Where a raw block volume `spec_name` (the PV's name) is published for
/// pod `pod_uid`, as the kubelet's CSI block mapper publishes it: a file
/// the driver makes (its parent made by the node, 0750) at
/// `<root>/plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<pod uid>`.
pub(crate) fn block_publish_path(root_dir: &Path, spec_name: &str, pod_uid: &str) -> PathBuf {
    root_dir.join(BLOCK_DIR).join("publish").join(spec_name).join(pod_uid)
}

/// Where a raw block volume is staged:
/// `<root>/plugins/kubernetes.io/csi/volumeDevices/staging/<pv>`.
fn block_staging_path(root_dir: &Path, spec_name: &str) -> PathBuf {
    root_dir.join(BLOCK_DIR).join("staging").join(spec_name)
}

/// The link a pod's containers get a raw block volume through, as the
/// kubelet's `pods/<uid>/volumeDevices/kubernetes.io~csi/<pv>` (pointing at
/// the published device file).
pub(crate) fn block_device_link(root_dir: &Path, pod_uid: &str, spec_name: &str) -> PathBuf {
    root_dir.join("pods").join(pod_uid).join("volumeDevices").join(CSI_PLUGIN_DIR).join(spec_name)
}

/// The CSI plugin's raw block dir under the root dir.
const BLOCK_DIR: &str = "plugins/kubernetes.io/csi/volumeDevices";

/// Everything one NodePublishVolume (and its staging) needs.
struct Plan {
    mount: CsiMount,
    ephemeral: bool,
    read_only: bool,
    /// Whether the volume is written by one node (a PV with
    /// `ReadWriteOnce` or `ReadWriteOncePod`, or an inline volume): the
    /// default fsGroup policy gives such volumes to the pod's fsGroup.
    single_writer: bool,
    /// Whether `ReadWriteOncePod` is the volume's only access mode: then
    /// one pod of the node at a time may use it (with several modes the
    /// node cannot tell which the pod means, and allows it, as upstream).
    one_pod: bool,
    capability: VolumeCapability,
    volume_context: BTreeMap<String, String>,
    publish_context: BTreeMap<String, String>,
    stage_secrets: Secrets,
    publish_secrets: Secrets,
}

/// One staged volume: the pods using it, whether the stage call was made,
/// and whether the volume may be staged on the node (then it is unstaged
/// when no pod uses it): after a transient stage failure (the call may
/// still be under way in the driver) or a failed unstage, it may be, though
/// the next pod stages it again; after a final stage failure it is not.
#[derive(Debug, Default)]
struct Staging {
    users: BTreeSet<String>,
    staged: bool,
    may_be_staged: bool,
}

impl Staging {
    fn mark_staged(&mut self) {
        self.staged = true;
        self.may_be_staged = true;
    }
}

/// The first retry of a failed `NodeUnstageVolume`; doubled up to
/// [`UNSTAGE_RETRY_MAX`].
const UNSTAGE_RETRY: std::time::Duration = std::time::Duration::from_secs(2);
const UNSTAGE_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(120);

/// A connected driver and the capabilities it reported.
#[derive(Clone)]
struct Connected {
    /// The registry's change count when connected: any registration or
    /// removal since (a driver restarted on the same socket) reconnects.
    generation: u64,
    endpoint: String,
    client: CsiNodeClient,
    capabilities: NodeCapabilities,
}

/// Publishes and unpublishes CSI volumes for pods. Cheap to clone.
#[derive(Clone)]
pub struct CsiVolumes {
    root_dir: PathBuf,
    drivers: CsiDrivers,
    objects: CsiDriverObjects,
    claims: Option<Arc<dyn VolumeClaims>>,
    timeouts: CsiNodeTimeouts,
    connected: Arc<Mutex<HashMap<String, Connected>>>,
    staged: Arc<Mutex<HashMap<PathBuf, Arc<tokio::sync::Mutex<Staging>>>>>,
    /// Persistent volumes published on the node, by unique name, with the
    /// pods using each (the Node's `volumesInUse`).
    in_use: Arc<watch::Sender<BTreeMap<String, BTreeSet<String>>>>,
    /// The same, of the volumes whose drivers needed attaching when they
    /// were published: what the Node reports as `volumesInUse` (the
    /// kubelet reports attachable volumes only; a volume of a driver with
    /// `attachRequired: false` is not held from the attach/detach
    /// controller's detach).
    attachable_in_use: Arc<watch::Sender<BTreeMap<String, BTreeSet<String>>>>,
    /// Persistent volumes whose last `NodeExpandVolume` failed for good, by
    /// unique name; forgotten when the volume is expanded or leaves the node.
    expansion_failures: Arc<Mutex<HashMap<String, super::expansion::Failure>>>,
}

/// The unique name of volume `handle` of CSI driver `driver`, as the
/// Node's `volumesInUse` and the attach/detach controller write it.
pub fn unique_volume_name(driver: &str, handle: &str) -> String {
    format!("kubernetes.io/csi/{driver}^{handle}")
}

impl std::fmt::Debug for CsiVolumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CsiVolumes").field("root_dir", &self.root_dir).finish_non_exhaustive()
    }
}

impl CsiVolumes {
    /// CSI volumes under `root_dir`, through the drivers in `drivers`, with
    /// CSIDriver objects from `objects`.
    pub fn new(
        root_dir: impl Into<PathBuf>,
        drivers: CsiDrivers,
        objects: CsiDriverObjects,
        timeouts: CsiNodeTimeouts,
    ) -> Self {
        CsiVolumes {
            root_dir: root_dir.into(),
            drivers,
            objects,
            claims: None,
            timeouts,
            connected: Arc::default(),
            staged: Arc::default(),
            in_use: Arc::new(watch::channel(BTreeMap::new()).0),
            attachable_in_use: Arc::new(watch::channel(BTreeMap::new()).0),
            expansion_failures: Arc::default(),
        }
    }

    /// The persistent volumes published on the node (unique names,
    /// `kubernetes.io/csi/<driver>^<handle>`), as they change: the Node's
    /// `volumesInUse`, which the attach/detach controller reads before it
    /// detaches a volume.
    pub fn volumes_in_use(&self) -> watch::Receiver<BTreeMap<String, BTreeSet<String>>> {
        self.attachable_in_use.subscribe()
    }

    /// Whether persistent volume `mount` is published for a pod other than
    /// `pod_uid` on this node.
    fn used_by_another_pod(&self, mount: &CsiMount, pod_uid: &str) -> bool {
        let name = unique_volume_name(&mount.driver_name, &mount.volume_handle);
        self.in_use.borrow().get(&name).is_some_and(|pods| pods.iter().any(|p| p != pod_uid))
    }

    fn mark_in_use(&self, mount: &CsiMount, pod_uid: &str, used: bool) {
        if mount.volume_lifecycle_mode != "Persistent" {
            return;
        }
        let name = unique_volume_name(&mount.driver_name, &mount.volume_handle);
        let attachable = self.objects.get(&mount.driver_name).is_none_or(|s| s.attach_required.unwrap_or(true));
        let change = |in_use: &mut BTreeMap<String, BTreeSet<String>>| {
            if used {
                in_use.entry(name.clone()).or_default().insert(pod_uid.to_owned())
            } else {
                let Some(pods) = in_use.get_mut(&name) else { return false };
                let removed = pods.remove(pod_uid);
                if pods.is_empty() {
                    in_use.remove(&name);
                }
                removed
            }
        };
        self.in_use.send_if_modified(change);
        // Only an attachable volume is reported; one that stops being used
        // is dropped from the report whatever its driver says now.
        if attachable || !used {
            self.attachable_in_use.send_if_modified(change);
        }
        if !used && !self.in_use.borrow().contains_key(&name) {
            self.expansion_failures.lock().unwrap_or_else(|p| p.into_inner()).remove(&name);
        }
    }

    /// Resolves `persistentVolumeClaim` volumes with `claims`.
    pub fn with_claims(mut self, claims: Arc<dyn VolumeClaims>) -> Self {
        self.claims = Some(claims);
        self
    }

    /// Whether claims can be resolved.
    pub(crate) fn resolves_claims(&self) -> bool {
        self.claims.is_some()
    }

    /// Bumped whenever the registered drivers change: a pod waiting for a
    /// driver retries then.
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.drivers.changes()
    }

    fn publish_dir(&self, pod_uid: &str, spec_name: &str) -> PathBuf {
        self.root_dir.join("pods").join(pod_uid).join("volumes").join(CSI_PLUGIN_DIR).join(spec_name)
    }

    /// Where `mount` is published for pod `pod_uid`: `<publish dir>/mount`,
    /// or a raw block volume's device file.
    fn target(&self, pod_uid: &str, mount: &CsiMount) -> PathBuf {
        if mount.block {
            block_publish_path(&self.root_dir, &mount.spec_vol_id, pod_uid)
        } else {
            self.publish_dir(pod_uid, &mount.spec_vol_id).join("mount")
        }
    }

    fn staging_path(&self, driver: &str, handle: &str) -> PathBuf {
        self.root_dir
            .join("plugins/kubernetes.io/csi")
            .join(driver)
            .join(sha256_hex(handle.as_bytes()))
            .join("globalmount")
    }

    /// Stages (if needed) and publishes `volume` for `pod`. The volume is in
    /// `prepared` (not ready) from before the first call on.
    pub(super) async fn prepare(
        &self,
        pod: &Pod,
        volume: &Volume,
        prepared: &mut super::PodVolumes,
    ) -> Result<(), VolumeError> {
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        let mut plan = self.plan(pod, volume).await?;
        if self.adopt_published(uid, volume, &plan.mount, prepared).await {
            return Ok(());
        }
        if plan.one_pod && self.used_by_another_pod(&plan.mount, uid) {
            // The scheduler keeps such pods apart; one placed by name is
            // held here until the other pod lets the volume go.
            return Err(VolumeError::InUseByAnotherPod { volume: volume.name.clone() });
        }
        let driver = self.driver(&volume.name, &plan.mount.driver_name)?;
        let connected = self.connect(&volume.name, &driver).await?;
        let dir = self.publish_dir(uid, &plan.mount.spec_vol_id);
        let target = self.target(uid, &plan.mount);
        if connected.capabilities.stages() && !plan.ephemeral {
            plan.mount.staging_target_path = Some(if plan.mount.block {
                block_staging_path(&self.root_dir, &plan.mount.spec_vol_id)
            } else {
                self.staging_path(&driver.name, &plan.mount.volume_handle)
            });
        }
        let fs_group = super::fs_group(pod);
        // A driver with VOLUME_MOUNT_GROUP applies the fsGroup itself
        // (given in NodeStageVolume and NodePublishVolume); the node then
        // changes nothing.
        let delegated = connected.capabilities.has(crate::csi::NodeCapability::VolumeMountGroup);
        if let (true, Some(gid), AccessType::Mount { volume_mount_group, .. }) =
            (delegated, fs_group, &mut plan.capability.access_type)
        {
            *volume_mount_group = gid.to_string();
        }
        let change_ownership = fs_group.filter(|_| !delegated && self.fs_group_applies(&plan));
        let io = |path: &Path, source| VolumeError::Io { volume: volume.name.clone(), path: path.to_owned(), source };
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
        if plan.mount.block {
            // The driver makes the device file; the node its directory.
            let parent = target.parent().unwrap_or(&target);
            make_private_dir(parent).map_err(|e| io(parent, e))?;
        }
        write_json(&dir.join("vol_data.json"), &plan.mount).map_err(|e| io(&dir, e))?;
        // Recorded before any call: a removal from here on unpublishes.
        prepared.insert(
            volume.name.clone(),
            PreparedVolume {
                host_path: target.clone(),
                kind: VolumeKind::Csi,
                ready: false,
                csi: Some(plan.mount.clone()),
            },
        );
        let csi_error = |source| VolumeError::Csi { volume: volume.name.clone(), source };
        if let Some(staging) = &plan.mount.staging_target_path {
            let entry = self.staging_entry(staging);
            let mut state = entry.lock().await;
            state.users.insert(uid.to_owned());
            if !state.staged {
                let parent = staging.parent().unwrap_or(staging);
                std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
                if plan.mount.block {
                    // The block mapper makes the staging dir itself (0750).
                    make_private_dir(staging).map_err(|e| io(staging, e))?;
                } else {
                    write_json(&parent.join("vol_data.json"), &plan.mount).map_err(|e| io(parent, e))?;
                }
                let request = StageVolume {
                    volume_id: plan.mount.volume_handle.clone(),
                    staging_target_path: staging.clone(),
                    capability: plan.capability.clone(),
                    publish_context: plan.publish_context.clone(),
                    volume_context: plan.volume_context.clone(),
                    secrets: plan.stage_secrets.clone(),
                };
                tracing::info!(volume = %volume.name, driver = %driver.name, handle = %plan.mount.volume_handle, "NodeStageVolume");
                let answer =
                    self.forget_on_transport_error(&driver.name, connected.client.stage_volume(&request).await);
                if let Err(error) = &answer
                    && super::expansion::Failure::of(error.code(), matches!(error, CsiNodeError::Timeout { .. }))
                        == super::expansion::Failure::Transient
                {
                    // The driver may still be staging it: unstaged when
                    // unused, as the kubelet's "uncertain" device mount.
                    state.may_be_staged = true;
                }
                answer.map_err(csi_error)?;
                state.mark_staged();
            }
        }
        let request = self.publish_request(pod, &volume.name, &driver.name, &plan, &target).await?;
        tracing::info!(pod.uid = %uid, volume = %volume.name, driver = %driver.name, handle = %request.volume_id, "NodePublishVolume");
        self.forget_on_transport_error(&driver.name, connected.client.publish_volume(&request).await)
            .map_err(csi_error)?;
        // A node restarted from here on finds the volume published, and
        // whether the driver mounted it (then a restart that finds it
        // unmounted publishes it again).
        if let Some(gid) = change_ownership {
            let on_root_mismatch =
                pod.spec.as_ref().and_then(|s| s.security_context.as_ref()?.fs_group_change_policy.as_deref())
                    == Some("OnRootMismatch");
            let changed =
                super::ownership::apply(&target, gid, plan.read_only, on_root_mismatch).map_err(|e| io(&target, e))?;
            tracing::debug!(pod.uid = %uid, volume = %volume.name, gid, changed, "volume given to the pod's fsGroup");
        }
        let mounted = super::mounts::is_mount_point(&target);
        let _ = std::fs::write(dir.join(PUBLISHED_MARK), if mounted { MOUNTED.as_bytes() } else { b"" });
        if plan.mount.block {
            link_block_device(&block_device_link(&self.root_dir, uid, &plan.mount.spec_vol_id), &target)
                .map_err(|e| io(&target, e))?;
        }
        self.mark_in_use(&plan.mount, uid, true);
        if let Some(ready) = prepared.get_mut(&volume.name) {
            ready.ready = true;
        }
        Ok(())
    }

    /// The `NodePublishVolume` request of `plan` at `target`: the volume's
    /// context with the pod's details where the CSIDriver asks for them
    /// (`podInfoOnMount`) and fresh service-account tokens where it asks
    /// for those (`tokenRequests`).
    async fn publish_request(
        &self,
        pod: &Pod,
        volume: &str,
        driver: &str,
        plan: &Plan,
        target: &Path,
    ) -> Result<PublishVolume, VolumeError> {
        let mut volume_context = plan.volume_context.clone();
        if self.objects.get(driver).and_then(|s| s.pod_info_on_mount).unwrap_or(false) {
            volume_context.extend(pod_info(pod, plan.ephemeral));
        }
        if let Some(tokens) = self.service_account_tokens(pod, driver, volume).await? {
            volume_context.insert(SERVICE_ACCOUNT_TOKENS.into(), tokens);
        }
        Ok(PublishVolume {
            volume_id: plan.mount.volume_handle.clone(),
            staging_target_path: plan.mount.staging_target_path.clone(),
            target_path: target.to_owned(),
            capability: plan.capability.clone(),
            read_only: plan.read_only,
            publish_context: plan.publish_context.clone(),
            volume_context,
            secrets: plan.publish_secrets.clone(),
        })
    }

    /// Publishes `volume` (published for `pod` as `prepared`) again when
    /// its driver's CSIDriver says `requiresRepublish`, as the kubelet does
    /// on each of the pod's syncs: the driver gets fresh tokens and may
    /// refresh what it mounted. Returns whether it did.
    pub(super) async fn republish(
        &self,
        pod: &Pod,
        volume: &Volume,
        prepared: &PreparedVolume,
    ) -> Result<bool, VolumeError> {
        let Some(mount) = prepared.csi.as_ref().filter(|_| prepared.ready) else { return Ok(false) };
        if !self.objects.get(&mount.driver_name).and_then(|s| s.requires_republish).unwrap_or(false) {
            return Ok(false);
        }
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        let mut plan = self.plan(pod, volume).await?;
        // What was published: the same handle, staging path and target.
        plan.mount.staging_target_path.clone_from(&mount.staging_target_path);
        let target = self.target(uid, mount);
        let driver = self.driver(&volume.name, &mount.driver_name)?;
        let connected = self.connect(&volume.name, &driver).await?;
        if let (true, Some(gid), AccessType::Mount { volume_mount_group, .. }) = (
            connected.capabilities.has(crate::csi::NodeCapability::VolumeMountGroup),
            super::fs_group(pod),
            &mut plan.capability.access_type,
        ) {
            *volume_mount_group = gid.to_string();
        }
        let request = self.publish_request(pod, &volume.name, &driver.name, &plan, &target).await?;
        tracing::debug!(pod.uid = %uid, volume = %volume.name, driver = %driver.name, handle = %request.volume_id, "NodePublishVolume again (requiresRepublish)");
        self.forget_on_transport_error(&driver.name, connected.client.publish_volume(&request).await)
            .map_err(|source| VolumeError::Csi { volume: volume.name.clone(), source })?;
        Ok(true)
    }

    /// Expands `volume` (a claim's, published for `pod` as `prepared`) when
    /// its claim asks the node to ([`super::expansion`]); returns whether
    /// it did. A driver's refusal is written to the claim and returned; the
    /// next round tries again.
    pub(super) async fn expand(
        &self,
        pod: &Pod,
        volume: &Volume,
        prepared: &PreparedVolume,
    ) -> Result<bool, VolumeError> {
        let (Some(source), Some(mount), Some(claims)) =
            (claim_source(pod, volume), prepared.csi.as_ref(), self.claims.as_ref())
        else {
            return Ok(false);
        };
        if !prepared.ready || mount.volume_lifecycle_mode != "Persistent" {
            return Ok(false);
        }
        let invalid = |reason: String| VolumeError::InvalidSpec { volume: volume.name.clone(), reason };
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        let name = source.claim_name.as_str();
        let claimed = claims.resolve(namespace, name, false).await.map_err(|e| invalid(e.to_string()))?;
        let Some(claim) = &claimed.claim else { return Ok(false) };
        let Some(due) = super::expansion::due(claim, &claimed.volume) else { return Ok(false) };
        let unique = unique_volume_name(&mount.driver_name, &mount.volume_handle);
        let failed_before = self.expansion_failures.lock().unwrap_or_else(|p| p.into_inner()).get(&unique).copied();
        if failed_before == Some(super::expansion::Failure::InUse) {
            // The driver cannot expand it while it is in use: not asked
            // again until the volume leaves the node (the kubelet's rule).
            return Ok(false);
        }
        // The user asked for another size after a final failure: a failure
        // now hands the claim back to the resizer (the kubelet's recovery).
        let asked_otherwise =
            super::expansion::requested_bytes(claim).is_some_and(|asked| i64::try_from(asked).ok() != Some(due.bytes));
        let infeasible_on_failure = failed_before.is_some() && asked_otherwise;
        let write = |patch| claims.patch_claim_status(namespace, name, patch);
        // The finished step is checked against the claim as the in-progress
        // step left it (its resourceVersion).
        let claim = if due.tracked {
            write(super::expansion::in_progress(claim)).await.map_err(|e| invalid(e.to_string()))?
        } else {
            claim.clone()
        };
        let spec = claimed.volume.spec.clone().unwrap_or_default();
        let access_type = if mount.block {
            AccessType::Block
        } else {
            AccessType::Mount {
                fs_type: spec.csi.as_ref().and_then(|c| c.fs_type.clone()).unwrap_or_default(),
                mount_flags: spec.mount_options.clone().unwrap_or_default(),
                volume_mount_group: String::new(),
            }
        };
        let request = crate::csi::ExpandVolume {
            volume_id: mount.volume_handle.clone(),
            volume_path: prepared.host_path.clone(),
            staging_target_path: mount.staging_target_path.clone(),
            required_bytes: due.bytes,
            capability: VolumeCapability {
                access_type,
                access_mode: access_mode(spec.access_modes.as_deref().unwrap_or_default()),
            },
            secrets: claimed.expand_secrets.clone(),
        };
        let driver = self.driver(&volume.name, &mount.driver_name)?;
        let connected = self.connect(&volume.name, &driver).await?;
        let answer = if connected.capabilities.has(crate::csi::NodeCapability::ExpandVolume) {
            tracing::info!(pod.uid = ?pod.metadata.uid, volume = %volume.name, driver = %driver.name, size = %due.size.0, "NodeExpandVolume");
            self.forget_on_transport_error(&driver.name, connected.client.expand_volume(&request).await)
                .map(drop)
                .map_err(|source| VolumeError::Csi { volume: volume.name.clone(), source })
        } else {
            Err(invalid(format!("NodeExpand is not supported by the CSI driver {}", driver.name)))
        };
        if let Err(error) = answer {
            use super::expansion::Failure;
            let failure = match &error {
                VolumeError::Csi { source, .. } => {
                    Failure::of(source.code(), matches!(source, crate::csi::CsiNodeError::Timeout { .. }))
                }
                _ => Failure::Final,
            };
            if failure == Failure::Transient {
                return Err(error);
            }
            self.expansion_failures.lock().unwrap_or_else(|p| p.into_inner()).insert(unique, failure);
            let infeasible = due.tracked && (failure == Failure::Infeasible || infeasible_on_failure);
            let now = jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
            if let Err(write_error) = write(super::expansion::failed(&error.to_string(), &now, infeasible)).await {
                tracing::warn!(volume = %volume.name, error = %write_error, "the claim's NodeResizeError condition was not written");
            } else if infeasible {
                tracing::warn!(volume = %volume.name, claim = %name, size = %due.size.0, "node expansion infeasible; the claim is handed back to its resizer");
            }
            return Err(error);
        }
        self.expansion_failures.lock().unwrap_or_else(|p| p.into_inner()).remove(&unique);
        write(super::expansion::finished(&claim, &due.size, due.tracked)).await.map_err(|e| invalid(e.to_string()))?;
        tracing::info!(volume = %volume.name, claim = %name, size = %due.size.0, "volume expanded on the node");
        Ok(true)
    }

    /// What the driver of `mount` reports of the volume published at
    /// `target` (`NodeGetVolumeStats`); `None` when it does not serve that
    /// call (no `GET_VOLUME_STATS` capability).
    pub(crate) async fn volume_usage(
        &self,
        volume: &str,
        mount: &CsiMount,
        target: &Path,
    ) -> Result<Option<crate::csi::VolumeUsage>, VolumeError> {
        let driver = self.driver(volume, &mount.driver_name)?;
        let connected = self.connect(volume, &driver).await?;
        if !connected.capabilities.has(crate::csi::NodeCapability::GetVolumeStats) {
            return Ok(None);
        }
        let answer =
            connected.client.volume_stats(&mount.volume_handle, target, mount.staging_target_path.as_deref()).await;
        let usage = self
            .forget_on_transport_error(&driver.name, answer)
            .map_err(|source| VolumeError::Csi { volume: volume.to_owned(), source })?;
        Ok(Some(usage))
    }

    /// After a node restart: a volume an earlier run published for this
    /// pod (its `vol_data.json` names the same driver and handle, and the
    /// publish succeeded) is taken as it is, with no call to the driver
    /// (which may not have registered again yet), as the kubelet
    /// reconstructs its mounted volumes. Returns whether it was adopted.
    async fn adopt_published(
        &self,
        uid: &str,
        volume: &Volume,
        planned: &CsiMount,
        prepared: &mut super::PodVolumes,
    ) -> bool {
        if prepared.contains_key(&volume.name) {
            return false;
        }
        let dir = self.publish_dir(uid, &planned.spec_vol_id);
        let Ok(mark) = std::fs::read_to_string(dir.join(PUBLISHED_MARK)) else { return false };
        let Ok(recorded) = std::fs::read(dir.join("vol_data.json")) else { return false };
        let Ok(recorded) = serde_json::from_slice::<CsiMount>(&recorded) else { return false };
        if recorded.driver_name != planned.driver_name || recorded.volume_handle != planned.volume_handle {
            return false;
        }
        let target = self.target(uid, &recorded);
        if mark.trim() == MOUNTED && !super::mounts::is_mount_point(&target) {
            // The actual state disagrees with the record: the driver's
            // mount is gone (unmounted behind the node's back, or the host
            // rebooted). NodePublishVolume is idempotent: publish again.
            tracing::warn!(
                pod.uid = %uid,
                volume = %volume.name,
                driver = %recorded.driver_name,
                path = %target.display(),
                "a volume an earlier run published is no longer mounted: publishing it again"
            );
            return false;
        }
        if let Some(staging) = &recorded.staging_target_path {
            let entry = self.staging_entry(staging);
            let mut state = entry.lock().await;
            state.users.insert(uid.to_owned());
            state.mark_staged();
        }
        tracing::info!(pod.uid = %uid, volume = %volume.name, driver = %recorded.driver_name, "published volume from an earlier run adopted");
        self.mark_in_use(&recorded, uid, true);
        prepared.insert(
            volume.name.clone(),
            PreparedVolume { host_path: target, kind: VolumeKind::Csi, ready: true, csi: Some(recorded) },
        );
        true
    }

    /// Unpublishes a pod's volume, then unstages it if no other pod uses it.
    /// The publish directory is removed once unpublished.
    pub(super) async fn teardown(
        &self,
        pod_uid: &str,
        name: &str,
        prepared: &PreparedVolume,
    ) -> Result<(), VolumeError> {
        let Some(mount) = &prepared.csi else { return Ok(()) };
        let csi_error = |source| VolumeError::Csi { volume: name.to_owned(), source };
        let driver = self.driver(name, &mount.driver_name)?;
        let connected = self.connect(name, &driver).await?;
        tracing::info!(pod.uid = %pod_uid, volume = %name, driver = %driver.name, handle = %mount.volume_handle, "NodeUnpublishVolume");
        self.forget_on_transport_error(
            &driver.name,
            connected.client.unpublish_volume(&mount.volume_handle, &prepared.host_path).await,
        )
        .map_err(csi_error)?;
        if mount.block {
            remove_block_files(name, &self.root_dir, pod_uid, mount, &prepared.host_path)?;
            remove_publish_dir(name, &self.publish_dir(pod_uid, &mount.spec_vol_id))?;
        } else if let Some(dir) = prepared.host_path.parent() {
            remove_publish_dir(name, dir)?;
        }
        self.mark_in_use(mount, pod_uid, false);
        let Some(staging) = &mount.staging_target_path else { return Ok(()) };
        let entry = self.staging_entry(staging);
        let mut state = entry.lock().await;
        state.users.remove(pod_uid);
        if !state.users.is_empty() {
            tracing::debug!(volume = %name, users = state.users.len(), "staged volume still in use");
            return Ok(());
        }
        if !state.may_be_staged {
            // Its stage call failed for good: nothing to unstage.
            tracing::debug!(volume = %name, "volume was never staged; not unstaged");
            drop(state);
            self.forget_staging(staging);
            return Ok(());
        }
        tracing::info!(volume = %name, driver = %driver.name, handle = %mount.volume_handle, "NodeUnstageVolume");
        let unstaged = connected.client.unstage_volume(&mount.volume_handle, staging).await;
        if let Err(error) = self.forget_on_transport_error(&driver.name, unstaged) {
            // This pod is done with the volume either way (its deletion is
            // not held, as the kubelet's is not): the next pod stages it
            // again, and until then the unstage is retried.
            state.staged = false;
            tracing::warn!(volume = %name, driver = %driver.name, %error, "NodeUnstageVolume failed; trying again while no pod uses the volume");
            drop(state);
            self.retry_unstage(driver.name.clone(), mount.volume_handle.clone(), staging.clone());
            return Ok(());
        }
        state.staged = false;
        state.may_be_staged = false;
        drop(state);
        self.forget_staging(staging);
        Ok(())
    }

    /// Drops the record of an unstaged volume and its staging dirs.
    fn forget_staging(&self, staging: &Path) {
        self.staged.lock().unwrap_or_else(|p| p.into_inner()).remove(staging);
        if let Some(parent) = staging.parent() {
            let _ = std::fs::remove_file(parent.join("vol_data.json"));
            let _ = std::fs::remove_dir(staging);
            let _ = std::fs::remove_dir(parent);
        }
    }

    /// Calls `NodeUnstageVolume` again (after 2 s, doubling up to 2 min)
    /// until it succeeds or a pod uses the volume again (that pod stages
    /// it, and unstages it when done), as the kubelet's reconciler retries
    /// the unmount of a device no pod wants.
    fn retry_unstage(&self, driver_name: String, handle: String, staging: PathBuf) {
        let this = self.clone();
        // Not supervised: a bounded retry that ends once the volume is
        // unstaged or used again.
        tokio::spawn(async move {
            let mut delay = UNSTAGE_RETRY;
            loop {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(UNSTAGE_RETRY_MAX);
                let entry = this.staged.lock().unwrap_or_else(|p| p.into_inner()).get(&staging).cloned();
                let Some(entry) = entry else { return };
                let mut state = entry.lock().await;
                if !state.users.is_empty() || !state.may_be_staged {
                    return;
                }
                let Ok(driver) = this.driver(&handle, &driver_name) else { continue };
                let Ok(connected) = this.connect(&handle, &driver).await else { continue };
                tracing::info!(driver = %driver_name, %handle, "NodeUnstageVolume (again)");
                let unstaged = connected.client.unstage_volume(&handle, &staging).await;
                match this.forget_on_transport_error(&driver_name, unstaged) {
                    Ok(()) => {
                        state.may_be_staged = false;
                        drop(state);
                        this.forget_staging(&staging);
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(driver = %driver_name, %handle, %error, retry = ?delay, "NodeUnstageVolume failed again")
                    }
                }
            }
        });
    }

    /// Marks the staged volume of `mount` (if the driver stages it) as used
    /// by pod `uid`, as an earlier run left it: a removed pod that shared
    /// it then never unstages it under a pod that has not adopted its
    /// volume yet.
    pub(crate) async fn hold_staged(&self, uid: &str, mount: &CsiMount) {
        let Some(staging) = &mount.staging_target_path else { return };
        let entry = self.staging_entry(staging);
        let mut state = entry.lock().await;
        state.users.insert(uid.to_owned());
        state.mark_staged();
    }

    fn staging_entry(&self, path: &Path) -> Arc<tokio::sync::Mutex<Staging>> {
        let mut staged = self.staged.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(staged.entry(path.to_owned()).or_default())
    }

    fn driver(&self, volume: &str, name: &str) -> Result<CsiDriver, VolumeError> {
        self.drivers
            .get(name)
            .ok_or_else(|| VolumeError::DriverNotRegistered { volume: volume.to_owned(), driver: name.to_owned() })
    }

    /// The driver's connection and capabilities, asked once per registration.
    async fn connect(&self, volume: &str, driver: &CsiDriver) -> Result<Connected, VolumeError> {
        let generation = *self.drivers.changes().borrow();
        let cached = self.connected.lock().unwrap_or_else(|p| p.into_inner()).get(&driver.name).cloned();
        if let Some(connected) = cached.filter(|c| c.endpoint == driver.endpoint && c.generation == generation) {
            return Ok(connected);
        }
        let csi_error = |source| VolumeError::Csi { volume: volume.to_owned(), source };
        let client = CsiNodeClient::connect(driver, self.timeouts).await.map_err(csi_error)?;
        let capabilities = client.capabilities().await.map_err(csi_error)?;
        tracing::info!(driver = %driver.name, ?capabilities, "CSI driver capabilities");
        let connected = Connected { generation, endpoint: driver.endpoint.clone(), client, capabilities };
        self.connected.lock().unwrap_or_else(|p| p.into_inner()).insert(driver.name.clone(), connected.clone());
        Ok(connected)
    }

    /// A driver that cannot be reached is dialed (and asked its
    /// capabilities) again on the next call.
    fn forget_on_transport_error<T>(&self, driver: &str, result: Result<T, CsiNodeError>) -> Result<T, CsiNodeError> {
        if let Err(error) = &result
            && matches!(error, CsiNodeError::Dial { .. })
                | matches!(error.code(), Some(tonic::Code::Unavailable | tonic::Code::Unknown))
        {
            self.connected.lock().unwrap_or_else(|p| p.into_inner()).remove(driver);
        }
        result
    }

    /// What to publish for `volume`: inline, or the claim's bound volume.
    async fn plan(&self, pod: &Pod, volume: &Volume) -> Result<Plan, VolumeError> {
        if let Some(inline) = &volume.csi {
            return self.plan_inline(pod, &volume.name, inline);
        }
        let Some(claim) = claim_source(pod, volume) else {
            return Err(VolumeError::InvalidSpec { volume: volume.name.clone(), reason: "not a CSI volume".into() });
        };
        self.plan_claimed(pod, &volume.name, &claim, volume.ephemeral.is_some()).await
    }

    /// The plan of an inline (ephemeral) CSI volume: its handle is made
    /// from the pod's UID and the volume's name.
    fn plan_inline(
        &self,
        pod: &Pod,
        name: &str,
        inline: &k8s_openapi::api::core::v1::CSIVolumeSource,
    ) -> Result<Plan, VolumeError> {
        if inline.node_publish_secret_ref.is_some() {
            return Err(VolumeError::Unsupported {
                volume: name.to_owned(),
                kind: "csi with nodePublishSecretRef",
                reason: super::NEEDS_API,
            });
        }
        self.supports_mode(name, &inline.driver, "Ephemeral")?;
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        let mut volume_context: BTreeMap<String, String> =
            inline.volume_attributes.clone().unwrap_or_default().into_iter().collect();
        volume_context.insert("csi.storage.k8s.io/ephemeral".into(), "true".into());
        Ok(Plan {
            mount: CsiMount {
                driver_name: inline.driver.clone(),
                volume_handle: format!("csi-{}", sha256_hex(format!("{uid}{name}").as_bytes())),
                spec_vol_id: name.to_owned(),
                volume_lifecycle_mode: "Ephemeral".into(),
                staging_target_path: None,
                block: false,
            },
            ephemeral: true,
            read_only: inline.read_only.unwrap_or(false),
            single_writer: true,
            one_pod: false,
            capability: VolumeCapability {
                access_type: AccessType::Mount {
                    fs_type: inline.fs_type.clone().unwrap_or_default(),
                    mount_flags: Vec::new(),
                    volume_mount_group: String::new(),
                },
                access_mode: AccessMode::SingleNodeWriter,
            },
            volume_context,
            publish_context: BTreeMap::new(),
            stage_secrets: Secrets::default(),
            publish_secrets: Secrets::default(),
        })
    }

    /// The plan of a `persistentVolumeClaim` volume: the claim's bound
    /// PersistentVolume's CSI source, its secrets, and (when the driver
    /// needs attaching) the attachment's publish context.
    async fn plan_claimed(
        &self,
        pod: &Pod,
        name: &str,
        claim: &k8s_openapi::api::core::v1::PersistentVolumeClaimVolumeSource,
        ephemeral: bool,
    ) -> Result<Plan, VolumeError> {
        let invalid = |reason: String| VolumeError::InvalidSpec { volume: name.to_owned(), reason };
        let Some(claims) = &self.claims else {
            return Err(VolumeError::Unsupported {
                volume: name.to_owned(),
                kind: "persistentVolumeClaim",
                reason: super::NEEDS_API,
            });
        };
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        let claimed = claims
            .resolve(namespace, &claim.claim_name, claim.read_only.unwrap_or(false))
            .await
            .map_err(|e| invalid(e.to_string()))?;
        // A generic ephemeral volume's claim must be the one made for this
        // pod (its controller owner), never another's of the same name.
        if ephemeral && let Some(found) = &claimed.claim {
            let uid = pod.metadata.uid.as_deref().unwrap_or_default();
            let owned =
                found.metadata.owner_references.iter().flatten().any(|o| o.controller == Some(true) && o.uid == uid);
            if !owned {
                return Err(invalid(format!(
                    "PVC {namespace}/{} was not created for pod {namespace}/{} (pod is not owner)",
                    claim.claim_name,
                    pod.metadata.name.as_deref().unwrap_or_default()
                )));
            }
        }
        let pv_name = claimed.volume.metadata.name.clone().unwrap_or_default();
        let spec = claimed.volume.spec.clone().unwrap_or_default();
        let Some(source) = spec.csi else {
            return Err(invalid(format!(
                "PersistentVolume {pv_name} is not a CSI volume (only CSI volumes are supported)"
            )));
        };
        if pv_name.is_empty() {
            return Err(invalid("the bound PersistentVolume has no name".into()));
        }
        self.supports_mode(name, &source.driver, "Persistent")?;
        let block = spec.volume_mode.as_deref() == Some("Block");
        let access_type = if block {
            AccessType::Block
        } else {
            AccessType::Mount {
                fs_type: source.fs_type.clone().unwrap_or_default(),
                mount_flags: spec.mount_options.clone().unwrap_or_default(),
                volume_mount_group: String::new(),
            }
        };
        let access_mode = access_mode(spec.access_modes.as_deref().unwrap_or_default());
        let mut volume_context: BTreeMap<String, String> =
            source.volume_attributes.clone().unwrap_or_default().into_iter().collect();
        if self.objects.get(&source.driver).and_then(|s| s.pod_info_on_mount).unwrap_or(false) {
            volume_context.insert("csi.storage.k8s.io/ephemeral".into(), "false".into());
        }
        // As upstream: attach unless the driver's CSIDriver object says
        // `attachRequired: false` (a driver without one is attached).
        let attach = self.objects.get(&source.driver).is_none_or(|s| s.attach_required.unwrap_or(true));
        let publish_context = if attach {
            claims
                .attachment(&source.driver, &source.volume_handle)
                .await
                .map_err(|e| VolumeError::NotAttached { volume: name.to_owned(), reason: e.to_string() })?
        } else {
            BTreeMap::new()
        };
        Ok(Plan {
            mount: CsiMount {
                driver_name: source.driver.clone(),
                volume_handle: source.volume_handle.clone(),
                spec_vol_id: pv_name,
                volume_lifecycle_mode: "Persistent".into(),
                staging_target_path: None,
                block,
            },
            ephemeral: false,
            read_only: claimed.claim_read_only || source.read_only.unwrap_or(false),
            single_writer: spec.access_modes.iter().flatten().any(|m| m == "ReadWriteOnce" || m == "ReadWriteOncePod"),
            one_pod: spec.access_modes.as_deref().is_some_and(|m| m == ["ReadWriteOncePod"]),
            capability: VolumeCapability { access_type, access_mode },
            volume_context,
            publish_context,
            stage_secrets: claimed.stage_secrets,
            publish_secrets: claimed.publish_secrets,
        })
    }

    /// Whether the node gives a published volume to the pod's fsGroup, by
    /// the driver's `fsGroupPolicy` as the kubelet decides it: `None`
    /// never, `File` always, `ReadWriteOnceWithFSType` (the default) when
    /// the volume has an fsType and one writer; never a read-only volume
    /// or a raw block one.
    fn fs_group_applies(&self, plan: &Plan) -> bool {
        let AccessType::Mount { fs_type, .. } = &plan.capability.access_type else { return false };
        if plan.read_only {
            return false;
        }
        let policy = self.objects.get(&plan.mount.driver_name).and_then(|s| s.fs_group_policy);
        match policy.as_deref() {
            Some("None") => false,
            Some("File") => true,
            _ => !fs_type.is_empty() && plan.single_writer,
        }
    }

    /// Upstream's rule: without a CSIDriver object only `Persistent` volumes
    /// are allowed; with one, the modes it lists (default `Persistent`).
    fn supports_mode(&self, volume: &str, driver: &str, mode: &str) -> Result<(), VolumeError> {
        let refuse = |reason: String| VolumeError::InvalidSpec { volume: volume.to_owned(), reason };
        match self.objects.get(driver) {
            None if mode == "Persistent" => Ok(()),
            None => Err(refuse(format!(
                "volume mode {mode:?} not supported by driver {driver} (no CSIDriver object; add one with \
                 volumeLifecycleModes: [{mode}])"
            ))),
            Some(spec) => {
                let modes = spec.volume_lifecycle_modes.clone().unwrap_or_else(|| vec!["Persistent".into()]);
                if modes.iter().any(|m| m == mode) {
                    Ok(())
                } else {
                    Err(refuse(format!(
                        "volume mode {mode:?} not supported by driver {driver} (only supports {modes:?})"
                    )))
                }
            }
        }
    }
}

/// The CSI access mode of a PV's access modes, as the kubelet maps them.
fn access_mode(modes: &[String]) -> AccessMode {
    let has = |m: &str| modes.iter().any(|x| x == m);
    if has("ReadWriteOncePod") {
        AccessMode::SingleNodeSingleWriter
    } else if has("ReadWriteMany") {
        AccessMode::MultiNodeMultiWriter
    } else if has("ReadOnlyMany") && !has("ReadWriteOnce") {
        AccessMode::MultiNodeReaderOnly
    } else {
        AccessMode::SingleNodeWriter
    }
}

/// The pod attributes upstream adds when the driver asks for pod info.
/// The claim behind `volume` of `pod`: its `persistentVolumeClaim`, or for a
/// generic ephemeral volume the claim its controller makes,
/// `<pod name>-<volume name>` (never read-only, as upstream).
pub(crate) fn claim_source(
    pod: &Pod,
    volume: &Volume,
) -> Option<k8s_openapi::api::core::v1::PersistentVolumeClaimVolumeSource> {
    if let Some(claim) = &volume.persistent_volume_claim {
        return Some(claim.clone());
    }
    volume.ephemeral.as_ref()?;
    Some(k8s_openapi::api::core::v1::PersistentVolumeClaimVolumeSource {
        claim_name: format!("{}-{}", pod.metadata.name.as_deref().unwrap_or_default(), volume.name),
        read_only: None,
    })
}

/// The volume-context key of the tokens a CSIDriver's `tokenRequests`
/// ask for (upstream's name).
const SERVICE_ACCOUNT_TOKENS: &str = "csi.storage.k8s.io/serviceAccount.tokens";

/// The token lifetime asked for when a `tokenRequests` entry names none
/// (the API server's default for a TokenRequest).
const DEFAULT_TOKEN_SECONDS: i64 = 3600;

impl CsiVolumes {
    /// What `csi.storage.k8s.io/serviceAccount.tokens` holds for `pod`'s
    /// volume of `driver`, as the kubelet writes it: a JSON object, one
    /// entry per `tokenRequests` audience, `{"token", "expirationTimestamp"}`;
    /// `None` when the driver's CSIDriver asks for none.
    async fn service_account_tokens(
        &self,
        pod: &Pod,
        driver: &str,
        volume: &str,
    ) -> Result<Option<String>, VolumeError> {
        let requests = self.objects.get(driver).and_then(|s| s.token_requests).unwrap_or_default();
        if requests.is_empty() {
            return Ok(None);
        }
        let failed = |reason: String| VolumeError::Token { volume: volume.to_owned(), reason };
        let claims = self.claims.as_ref().ok_or_else(|| failed("this node has no API to ask".into()))?;
        let mut tokens = serde_json::Map::new();
        for request in &requests {
            let seconds = request.expiration_seconds.unwrap_or(DEFAULT_TOKEN_SECONDS);
            let (token, expires) =
                claims.pod_token(pod, &request.audience, seconds).await.map_err(|e| failed(e.to_string()))?;
            tokens
                .insert(request.audience.clone(), serde_json::json!({"token": token, "expirationTimestamp": expires}));
        }
        tracing::debug!(pod = ?pod.metadata.name, driver, audiences = requests.len(), "service account tokens for the driver");
        Ok(Some(serde_json::Value::Object(tokens).to_string()))
    }
}

fn pod_info(pod: &Pod, ephemeral: bool) -> BTreeMap<String, String> {
    let meta = &pod.metadata;
    let service_account =
        pod.spec.as_ref().and_then(|s| s.service_account_name.clone()).unwrap_or_else(|| "default".into());
    BTreeMap::from([
        ("csi.storage.k8s.io/pod.name".into(), meta.name.clone().unwrap_or_default()),
        ("csi.storage.k8s.io/pod.namespace".into(), meta.namespace.clone().unwrap_or_else(|| "default".into())),
        ("csi.storage.k8s.io/pod.uid".into(), meta.uid.clone().unwrap_or_default()),
        ("csi.storage.k8s.io/serviceAccount.name".into(), service_account),
        ("csi.storage.k8s.io/ephemeral".into(), ephemeral.to_string()),
    ])
}

/// Beside `vol_data.json`: NodePublishVolume succeeded (until the volume
/// is unpublished and its directory removed). It holds [`MOUNTED`] when the
/// target was a mount point after the publish.
const PUBLISHED_MARK: &str = ".rustlet-published";

/// What [`PUBLISHED_MARK`] holds for a volume the driver mounted.
const MOUNTED: &str = "mounted";

/// Lower-case hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `vol_data.json` durably (a temporary file synced, then renamed,
/// the directory synced): a node restarted after a crash rebuilds the
/// volume from it, so it is never half written.
fn write_json(path: &Path, value: &CsiMount) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    kubelet_support::durable::write(path, &bytes, 0o644)
}

/// Makes `dir` and its parents, `dir` itself 0750 (the kubelet's block
/// mapper's mode).
fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o750).create(dir)
}

/// Points the pod's device link at the published device file (replacing
/// a link an earlier run left).
fn link_block_device(link: &Path, target: &Path) -> std::io::Result<()> {
    if let Some(parent) = link.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::remove_file(link) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::os::unix::fs::symlink(target, link)
}

/// After a raw block volume's NodeUnpublishVolume: the pod's device link
/// goes, and the device file if the driver left it (never while something
/// is still mounted on it).
fn remove_block_files(
    volume: &str,
    root_dir: &Path,
    pod_uid: &str,
    mount: &CsiMount,
    target: &Path,
) -> Result<(), VolumeError> {
    let io = |path: &Path, source| VolumeError::Io { volume: volume.to_owned(), path: path.to_owned(), source };
    if super::mounts::is_mount_point(target) {
        return Err(VolumeError::Teardown {
            volume: volume.to_owned(),
            reason: format!("{} is still mounted after NodeUnpublishVolume", target.display()),
        });
    }
    let link = block_device_link(root_dir, pod_uid, &mount.spec_vol_id);
    for file in [&link, &target.to_path_buf()] {
        match std::fs::remove_file(file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(file, e)),
            _ => {}
        }
    }
    // The volume's publish dir goes with its last pod.
    if let Some(dir) = target.parent() {
        let _ = std::fs::remove_dir(dir);
    }
    Ok(())
}

/// Removes `<name>/` (vol_data.json and the unpublished mount dir); refuses
/// to remove a directory that is still a mount.
fn remove_publish_dir(volume: &str, dir: &Path) -> Result<(), VolumeError> {
    let target = dir.join("mount");
    if super::empty_dir::is_mount_point(&target) {
        return Err(VolumeError::Teardown {
            volume: volume.to_owned(),
            reason: format!("{} is still mounted after NodeUnpublishVolume", target.display()),
        });
    }
    super::mounts::remove_dir_all_unmounted(dir).map_err(|source| VolumeError::Io {
        volume: volume.to_owned(),
        path: dir.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_modes_map_as_upstream() {
        let modes = |m: &[&str]| m.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(access_mode(&modes(&["ReadWriteOnce"])), AccessMode::SingleNodeWriter);
        assert_eq!(access_mode(&modes(&["ReadOnlyMany"])), AccessMode::MultiNodeReaderOnly);
        assert_eq!(access_mode(&modes(&["ReadWriteMany"])), AccessMode::MultiNodeMultiWriter);
        assert_eq!(access_mode(&modes(&["ReadWriteOncePod"])), AccessMode::SingleNodeSingleWriter);
        assert_eq!(access_mode(&[]), AccessMode::SingleNodeWriter);
    }

    #[test]
    fn only_volumes_of_drivers_that_attach_are_reported_in_use() {
        let objects = CsiDriverObjects::new();
        let no_attach: CSIDriverSpec =
            serde_json::from_value(serde_json::json!({"attachRequired": false})).expect("spec");
        objects.set("local.csi", no_attach);
        let volumes = CsiVolumes::new(
            "/nonexistent",
            crate::csi::CsiDriverRegistry::new().view(),
            objects,
            CsiNodeTimeouts::default(),
        );
        let mount = |driver: &str| CsiMount {
            driver_name: driver.into(),
            volume_handle: "h".into(),
            spec_vol_id: "pv".into(),
            volume_lifecycle_mode: "Persistent".into(),
            staging_target_path: None,
            block: false,
        };
        // No CSIDriver object: attaching is required (the API's default).
        for driver in ["local.csi", "remote.csi"] {
            volumes.mark_in_use(&mount(driver), "pod-1", true);
        }
        let reported: Vec<String> = volumes.volumes_in_use().borrow().keys().cloned().collect();
        assert_eq!(reported, ["kubernetes.io/csi/remote.csi^h"]);
        assert!(volumes.used_by_another_pod(&mount("local.csi"), "pod-2"), "still known in use on the node");
        for driver in ["local.csi", "remote.csi"] {
            volumes.mark_in_use(&mount(driver), "pod-1", false);
        }
        assert!(volumes.volumes_in_use().borrow().is_empty());
        assert!(!volumes.used_by_another_pod(&mount("local.csi"), "pod-2"));
    }

    #[test]
    fn inline_handles_are_sha256_of_uid_and_name() {
        // sha256("abc") is a well-known vector.
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
