//! The pod lifecycle: every pod the node runs is driven through typed states
//! by its own task ([`krator`]).
//!
//! ```text
//! Registered ─▶ Resources ─▶ ImagePull ─▶ Volumes ─▶ Initializing ─▶ Starting ─▶ Running
//!     │            │            │  ▲         │                          ▲           │
//!     │            │            ▼  │         ▼                          │           ├─▶ CrashLoopBackOff ─┘
//!     │            │       ImagePullBackOff NoProvider                  │           │
//!     ▼            ▼                                                                ├─▶ Completed
//!   Failed ◀── (rejected) ◀──────────── (init failed, restartPolicy Never) ◀────────┴─▶ Failed
//!
//! deleted, from any state ─▶ Terminating ─▶ (done)
//! ```
//!
//! - **Resources** admits the pod (pod count, cpu and memory against
//!   allocatable, extended resources) and allocates its devices, init
//!   containers first.
//! - **Volumes** prepares its volumes, retrying (and saying why in the pod
//!   status) until it can.
//! - **Initializing** runs init containers one at a time, each to success;
//!   restartable init containers (sidecars) are started and left running.
//! - **Starting** starts sidecars and app containers (PreStartContainer just
//!   before each start); **Running** waits for exits and applies the restart
//!   policy; **CrashLoopBackOff** waits out a container's restart backoff.
//! - **Terminating** stops containers within the grace period, tears volumes
//!   down and frees devices; every step runs even if an earlier one failed.

mod admission;
mod backoff;
pub mod cdi;
mod containers;
mod data;
pub mod hooks;
#[cfg(test)]
pub(crate) mod idle_provider;
mod node_files;
pub mod probe;
pub mod relist;
pub mod resize;
pub use kubelet_provider::quantity;
pub(crate) mod run_options;
mod sources;
mod spec;
mod states;
mod status;
mod store;
pub mod sysctls;
pub mod usage;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use krator::{Applied, Deleted, Machine, Outcome, Runtime, State};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use admission::{Allocatable, Rejection};
pub use backoff::BackoffConfig;
pub use data::{ContainerPhase, EVICTED, Eviction, Terminated};
pub use node_files::{MAX_HOSTNAME, pod_hostname, truncate_hostname};
pub use quantity::{QuantityError, parse_milli, parse_units};
pub use sources::{PodSource, SourcesReady};
pub use spec::{DEFAULT_GRACE_PERIOD, PodIdentity, RestartPolicy};
pub use states::{LIFECYCLE_ERROR, NO_PROVIDER_MESSAGE};
pub use status::Stage;
pub use store::PodStore;

use crate::device_manager::DeviceManager;
use crate::provider::{Provider, RunningContainer};
use crate::volume::VolumeManager;
use crate::volume::reconciler::Leftovers;

/// Where a pod's container logs are: `<root>/logs/pods/<namespace>_<name>_<uid>`,
/// one directory per container holding `<restart count>.log` in the CRI log
/// format (as the kubelet's `/var/log/pods`).
pub fn pod_log_dir(root_dir: &std::path::Path, namespace: &str, name: &str, uid: &str) -> PathBuf {
    root_dir.join("logs/pods").join(format!("{namespace}_{name}_{uid}"))
}

/// How the lifecycle runs pods.
#[derive(Clone, Debug)]
pub struct PodConfig {
    /// The node's root dir (volumes under `pods/<uid>`, logs under
    /// `pods/<namespace>_<name>_<uid>`).
    pub root_dir: PathBuf,
    /// What pods may use.
    pub allocatable: Allocatable,
    /// Container restart backoff.
    pub restart_backoff: BackoffConfig,
    /// Image pull backoff (upstream uses the same figures).
    pub image_backoff: BackoffConfig,
    /// Volume preparation retries.
    pub volume_backoff: BackoffConfig,
    /// The node's IPs: every pod's `hostIPs`, and its `podIPs` (pods run in
    /// the node's network). Empty: none reported.
    pub host_ips: Vec<std::net::IpAddr>,
    /// The cluster's DNS domain (`--cluster-domain`), for the fully
    /// qualified name in a pod's `/etc/hosts`; empty: none.
    pub cluster_domain: String,
    /// How often a running pod's configMap, secret, projected and
    /// downwardAPI volumes are written again from the API objects (a
    /// change of the pod's labels or annotations writes them at once).
    pub volume_refresh: std::time::Duration,
    /// Sysctls pods may set beyond the safe ones (`--allowed-unsafe-sysctls`:
    /// names, or prefixes ending in `*`).
    pub allowed_unsafe_sysctls: Vec<String>,
    /// The node's pressure: under it, pods are refused as upstream refuses
    /// them (`The node had condition: [MemoryPressure]. `).
    pub pressure: crate::pressure::Pressure,
    /// Where CDI specs are read from when the provider does not read them
    /// itself ([`cdi`]); upstream's `/etc/cdi` and `/var/run/cdi` by
    /// default.
    pub cdi_spec_dirs: Vec<PathBuf>,
}

impl PodConfig {
    /// Upstream's backoffs; `allocatable` as given.
    pub fn new(root_dir: impl Into<PathBuf>, allocatable: Allocatable) -> Self {
        PodConfig {
            root_dir: root_dir.into(),
            allocatable,
            restart_backoff: BackoffConfig::default(),
            image_backoff: BackoffConfig::default(),
            volume_backoff: BackoffConfig::VOLUMES,
            host_ips: Vec::new(),
            cluster_domain: String::new(),
            volume_refresh: std::time::Duration::from_secs(60),
            allowed_unsafe_sysctls: Vec::new(),
            pressure: crate::pressure::Pressure::default(),
            cdi_spec_dirs: cdi::DEFAULT_SPEC_DIRS.iter().map(PathBuf::from).collect(),
        }
    }
}

/// The state machine every pod runs through, with what all pods share.
pub struct PodLifecycle {
    config: PodConfig,
    provider: Option<Arc<dyn Provider>>,
    devices: Option<DeviceManager>,
    volumes: VolumeManager,
    admitted: admission::AdmittedPods,
    store: PodStore,
    /// Containers an earlier run of the node left running, by pod UID and
    /// container name; taken when the pod gets to start them.
    adopted: Mutex<HashMap<(String, String), RunningContainer>>,
    /// Where pod events go.
    events: crate::events::EventRecorder,
    /// Resource claims: prepared through their DRA drivers, resolved
    /// through the API (`None`: pods with claims are refused).
    claims: Option<(crate::dra::DraClaims, Option<Arc<dyn crate::dra::ClaimSource>>)>,
    /// The size of the root dir's file system: the default of an unset
    /// `ephemeral-storage` limit in the downward API.
    ephemeral_storage: u128,
    /// Each pod's event channel, for the node to stop it (eviction); an
    /// entry whose pod is gone is closed and pruned.
    senders: Mutex<HashMap<String, tokio::sync::mpsc::UnboundedSender<data::ContainerEvent>>>,
    /// The lifecycle's series (`kubelet_pod_start_duration_seconds`, …).
    metrics: crate::metrics::PodMetrics,
}

/// The size of the file system holding `path` (what the kubelet reports as
/// `ephemeral-storage` capacity for its root dir).
pub fn file_system_size(path: &std::path::Path) -> Option<u128> {
    let stats = rustix::fs::statvfs(path).ok()?;
    Some(u128::from(stats.f_blocks) * u128::from(stats.f_frsize))
}

impl PodLifecycle {
    /// A lifecycle running containers with `provider` (none: pods wait after
    /// their volumes are ready) and devices from `devices`.
    ///
    /// The provider's pod ceiling ([`Provider::pod_ceiling`]) lowers the
    /// allocatable pod count when it is below it.
    pub fn new(mut config: PodConfig, provider: Option<Arc<dyn Provider>>, devices: Option<DeviceManager>) -> Self {
        if let Some((ceiling, _)) = provider.as_ref().and_then(|p| p.pod_ceiling()) {
            config.allocatable.pods = config.allocatable.pods.min(ceiling);
        }
        let volumes = VolumeManager::new(&config.root_dir);
        let ephemeral_storage = file_system_size(&config.root_dir).unwrap_or_default();
        PodLifecycle {
            config,
            provider,
            devices,
            volumes,
            admitted: admission::AdmittedPods::default(),
            store: PodStore::default(),
            adopted: Mutex::new(HashMap::new()),
            events: crate::events::EventRecorder::log_only(),
            claims: None,
            ephemeral_storage,
            senders: Mutex::default(),
            metrics: crate::metrics::PodMetrics::default(),
        }
    }

    /// What the downward API reads of `data`'s pod besides its spec: its
    /// IPs (the node's when it has none of its own) and the node's
    /// allocatable resources.
    pub(crate) fn downward_context(&self, data: &data::PodData) -> crate::volume::DownwardContext {
        let pod_ips = if data.pod_ips.is_empty() { self.config.host_ips.clone() } else { data.pod_ips.clone() };
        crate::volume::DownwardContext {
            pod_ips,
            host_ips: self.config.host_ips.clone(),
            allocatable_cpu_milli: self.config.allocatable.cpu_milli,
            allocatable_memory: self.config.allocatable.memory,
            allocatable_ephemeral_storage: self.ephemeral_storage,
        }
    }

    /// Where a lifecycle hook without a `host` goes: the pod's own IP, else
    /// the node's (the pod is in the host's network), else loopback.
    pub(crate) fn hook_address(&self, data: &data::PodData) -> std::net::IpAddr {
        data.pod_ips.first().or(self.config.host_ips.first()).copied().unwrap_or(std::net::Ipv4Addr::LOCALHOST.into())
    }

    /// Prepares pods' resource claims with `claims`, resolving them with
    /// `source` (the API; without one, pods with claims are refused).
    pub fn with_claims(
        mut self,
        claims: crate::dra::DraClaims,
        source: Option<Arc<dyn crate::dra::ClaimSource>>,
    ) -> Self {
        self.claims = Some((claims, source));
        self
    }

    /// Records the lifecycle's series in `metrics` (by default, in series
    /// no registry shows).
    pub fn with_metrics(mut self, metrics: crate::metrics::PodMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Records pod events with `events` (by default they are only logged).
    pub fn with_events(mut self, events: crate::events::EventRecorder) -> Self {
        self.events = events;
        self
    }

    /// Reads the ConfigMaps, Secrets and service-account tokens pods
    /// reference (their volumes and env) from `objects`.
    pub fn with_objects(mut self, objects: Arc<dyn crate::volume::ApiObjects>) -> Self {
        self.volumes = self.volumes.with_objects(objects);
        self
    }

    /// Publishes CSI volumes (inline, and claims if `csi` resolves them)
    /// through `csi`.
    pub fn with_csi(mut self, csi: crate::volume::CsiVolumes) -> Self {
        self.volumes = self.volumes.with_csi(csi);
        self
    }

    fn take_adopted(&self, pod_uid: &str, container: &str) -> Option<RunningContainer> {
        self.adopted.lock().unwrap_or_else(|p| p.into_inner()).remove(&(pod_uid.to_owned(), container.to_owned()))
    }

    fn adopted_contains(&self, pod_uid: &str, container: &str) -> bool {
        self.adopted.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&(pod_uid.to_owned(), container.to_owned()))
    }

    fn has_adopted(&self, pod_uid: &str) -> bool {
        self.adopted.lock().unwrap_or_else(|p| p.into_inner()).keys().any(|(uid, _)| uid == pod_uid)
    }
}

impl Machine for PodLifecycle {
    type Key = String;
    type Manifest = Arc<Pod>;
    type Data = data::PodData;
    type Status = PodStatus;
    type Error = String;

    fn start(&self, key: &String, manifest: &Arc<Pod>) -> (data::PodData, Box<dyn State<Self>>) {
        // A resize an earlier run of the node allocated is kept; one it had
        // not is judged again once the containers run.
        let pod = match resize::read_checkpoint(&self.config.root_dir, key) {
            Some(allocation) => Arc::new(resize::with_allocation(manifest, &allocation)),
            None => Arc::clone(manifest),
        };
        let mut data = data::PodData::new(pod);
        data.recorder = self.events.clone();
        data.probe_metrics = self.metrics.probes().clone();
        let mut senders = self.senders.lock().unwrap_or_else(|p| p.into_inner());
        // Pruned when the map doubles: each start costs the same on average.
        if senders.len() >= 64 && senders.len().is_power_of_two() {
            senders.retain(|_, sender| !sender.is_closed());
        }
        senders.insert(key.clone(), data.event_sender.clone());
        (data, Box::new(states::Registered))
    }

    fn deleted(&self, _key: &String, _data: &data::PodData) -> Box<dyn State<Self>> {
        Box::new(states::Terminating::removed())
    }

    fn panicked(&self, _key: &String, _data: &data::PodData, message: &str) -> Box<dyn State<Self>> {
        Box::new(states::Terminating::after_panic(message))
    }

    fn status(&self, key: &String, mut status: PodStatus) {
        status::add_ips(&mut status, &self.config.host_ips);
        self.store.put_status(key, status);
    }

    fn finished(&self, key: &String, outcome: &Outcome<String>) {
        if !matches!(outcome, Outcome::ShutDown) {
            self.store.remove(key);
        }
    }
}

/// The node's pods: apply, delete, list. Cheap to clone.
#[derive(Clone)]
pub struct Pods {
    runtime: Runtime<PodLifecycle>,
    sources: SourcesReady,
    housekeeping: Arc<Housekeeping>,
}

/// Where the release of what an earlier run left behind stands.
#[derive(Debug)]
struct Housekeeping {
    /// The first release (once every source listed) has run, and the
    /// leftovers it found on disk are in `leftovers`.
    listed: watch::Sender<bool>,
    /// Pods whose leftovers (volumes, their directory) the volume
    /// reconciler is still releasing.
    leftovers: watch::Sender<Leftovers>,
}

impl Default for Housekeeping {
    fn default() -> Self {
        // Nothing to release until a release is scheduled.
        Housekeeping { listed: watch::channel(true).0, leftovers: watch::channel(Leftovers::default()).0 }
    }
}

impl Pods {
    /// Starts the lifecycle. Asks the provider which containers still run
    /// (to adopt them when their pods come back); stops with `shutdown`,
    /// leaving containers running.
    pub async fn start(lifecycle: PodLifecycle, shutdown: CancellationToken) -> Pods {
        if let Some(provider) = &lifecycle.provider {
            match provider.running_containers().await {
                Ok(running) => {
                    let mut adopted = lifecycle.adopted.lock().unwrap_or_else(|p| p.into_inner());
                    for container in running {
                        tracing::info!(
                            pod.uid = %container.pod_uid,
                            container = %container.container_name,
                            id = %container.id,
                            "a container from an earlier run still runs"
                        );
                        adopted.insert((container.pod_uid.clone(), container.container_name.clone()), container);
                    }
                }
                Err(error) => tracing::warn!(%error, "the provider could not list its running containers"),
            }
        }
        Pods {
            runtime: Runtime::new(Arc::new(lifecycle), shutdown),
            sources: SourcesReady::default(),
            housekeeping: Arc::default(),
        }
    }

    /// Runs `pod` (a new UID) or updates it.
    pub fn apply(&self, pod: Pod) -> Applied {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        self.runtime.machine().store.put_spec(&uid, &pod);
        let applied = self.runtime.apply(uid.clone(), Arc::new(pod));
        tracing::debug!(pod.uid = %uid, ?applied, "pod applied");
        applied
    }

    /// The API marked `pod` for deletion: it is removed (as
    /// [`Pods::delete`]) within the deletion's grace period
    /// (`metadata.deletionGracePeriodSeconds`); a later, shorter one given
    /// the same way cuts a running removal short.
    pub fn remove(&self, pod: Pod) -> Deleted {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        if !self.runtime.contains(&uid) {
            // Never run by this node (deleted while the node was down):
            // what an earlier run left of it is released as an orphan.
            return Deleted::NotFound;
        }
        self.runtime.machine().store.put_spec(&uid, &pod);
        self.runtime.update(&uid, Arc::new(pod));
        self.delete(&uid)
    }

    /// Whether pod `uid`, which the node no longer runs (its lifecycle
    /// released it, or it never ran here), holds nothing on the node: what
    /// an earlier run left behind was released once every source listed,
    /// and none of it is still being released for this pod. Until then,
    /// its deletion must not be finished in the API.
    pub fn released(&self, uid: &str) -> bool {
        *self.housekeeping.listed.borrow() && !self.housekeeping.leftovers.borrow().pending.contains_key(uid)
    }

    /// Evicts pod `uid` (the eviction manager's order): its containers stop
    /// within `eviction.grace`, it ends Failed with reason `Evicted`, and a
    /// Warning event says why. `false` if the node does not run it.
    pub(crate) fn evict(&self, uid: &str, eviction: Eviction) -> bool {
        let senders = self.runtime.machine().senders.lock().unwrap_or_else(|p| p.into_inner());
        senders.get(uid).is_some_and(|sender| sender.send(data::ContainerEvent::Evict(eviction)).is_ok())
    }

    /// Removes the pod at once: a removal under way stops its containers
    /// without waiting out the rest of its grace period (the API deleted
    /// the pod outright, as `--force --grace-period=0` does).
    pub fn remove_now(&self, uid: &str) -> Deleted {
        if let Some(mut pod) = self.store().get(uid) {
            pod.metadata.deletion_grace_period_seconds = Some(0);
            self.runtime.update(&uid.to_owned(), Arc::new(pod));
        }
        self.delete(uid)
    }

    /// Removes the pod: its containers are stopped, volumes torn down and
    /// devices freed.
    pub fn delete(&self, uid: &str) -> Deleted {
        let deleted = self.runtime.delete(&uid.to_owned());
        if matches!(deleted, Deleted::Deleting) {
            self.store().mark_deleting(uid);
        }
        deleted
    }

    /// The node's pod sources: each says when it has listed its pods.
    pub fn sources(&self) -> &SourcesReady {
        &self.sources
    }

    /// Releases what an earlier run of the node left for pods no source
    /// knows (`Pods::release_orphans`) once every pod source has
    /// delivered its first full list (at once if they all have), when the
    /// returned future runs. From this call until then, no pod the node
    /// does not run counts as [`released`](Pods::released).
    pub fn release_orphans_when_sources_ready(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        self.housekeeping.listed.send_replace(false);
        let pods = self.clone();
        async move {
            pods.sources.wait().await;
            tracing::info!("every pod source has listed its pods: releasing what unknown pods left behind");
            pods.release_orphans().await;
        }
    }

    /// The volume reconciler ([`crate::volume::reconciler`]): once the
    /// first release has listed what is left on disk, it releases the
    /// volumes and directories of pods no source knows, retrying until
    /// each is released, and runs until `shutdown`.
    pub fn reconcile_volumes(
        &self,
        metrics: crate::volume::reconciler::ReconcilerMetrics,
        shutdown: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let pods = self.clone();
        async move {
            let mut listed = pods.housekeeping.listed.subscribe();
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = listed.wait_for(|listed| *listed) => {}
            }
            let reconciler = pods.volume_reconciler(metrics);
            let live = || pods.runtime.keys().into_iter().collect::<std::collections::HashSet<String>>();
            let housekeeping = Arc::clone(&pods.housekeeping);
            let store = pods.store().clone();
            let pending = move |left: &std::collections::BTreeMap<String, String>| {
                let mut released = false;
                housekeeping.leftovers.send_modify(|leftovers| {
                    released = leftovers.pending.keys().any(|uid| !left.contains_key(uid));
                    leftovers.pending.clone_from(left);
                    leftovers.passes += 1;
                });
                if released {
                    // The pod sync finishes the deletions that waited.
                    store.touch();
                }
            };
            reconciler.run(live, pending, shutdown).await;
        }
    }

    /// What the volume reconciler still has to release of pods no source
    /// knows, as it changes.
    pub fn leftovers(&self) -> watch::Receiver<Leftovers> {
        self.housekeeping.leftovers.subscribe()
    }

    /// The pods and their statuses.
    pub fn store(&self) -> &PodStore {
        &self.runtime.machine().store
    }

    /// The pods' claim volumes and their figures.
    pub fn volume_stats(&self) -> &crate::volume::stats::VolumeStats {
        self.runtime.machine().volumes.stats()
    }

    /// Refreshes the claim volumes' figures every `period` until
    /// `shutdown` (see [`crate::volume::stats`]).
    pub fn refresh_volume_stats(
        &self,
        period: std::time::Duration,
        shutdown: CancellationToken,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let volumes = &self.runtime.machine().volumes;
        volumes.stats().clone().run(volumes.csi().cloned(), period, shutdown)
    }

    /// The lifecycle's series.
    pub fn metrics(&self) -> &crate::metrics::PodMetrics {
        &self.runtime.machine().metrics
    }

    /// The UIDs of the pods the node runs (or is removing).
    pub fn uids(&self) -> Vec<String> {
        self.runtime.keys()
    }

    /// Stops what an earlier run of the node left behind for pods it no
    /// longer has: containers still running and devices still allocated.
    /// Call only once every pod source has applied its pods (see
    /// [`Pods::release_orphans_when_sources_ready`]): a pod not applied yet
    /// would lose its containers, devices and volumes.
    pub(crate) async fn release_orphans(&self) {
        let lifecycle = self.runtime.machine();
        let live: Vec<String> = self.runtime.keys();
        let orphans: Vec<RunningContainer> = {
            let mut adopted = lifecycle.adopted.lock().unwrap_or_else(|p| p.into_inner());
            let keys: Vec<(String, String)> = adopted.keys().filter(|(uid, _)| !live.contains(uid)).cloned().collect();
            keys.into_iter().filter_map(|k| adopted.remove(&k)).collect()
        };
        if let Some(provider) = &lifecycle.provider {
            for orphan in orphans {
                tracing::info!(pod.uid = %orphan.pod_uid, container = %orphan.container_name, "stopping a container of a pod no longer on the node");
                if let Err(error) = provider.stop_container(&orphan.id, DEFAULT_GRACE_PERIOD).await {
                    tracing::warn!(%error, id = %orphan.id, "could not stop an orphaned container");
                }
                let _ = provider.remove_pod(&orphan.pod_uid).await;
            }
        }
        if let Some((claims, _)) = &lifecycle.claims
            && let Err(error) = claims.retain_pods(&live)
        {
            tracing::warn!(%error, "releasing the resource claims of pods no longer on the node");
        }
        if let Some(devices) = &lifecycle.devices {
            devices.retain_pods(live.iter().map(String::as_str));
            if let Err(error) = devices.persisted().await {
                tracing::warn!(%error, "device checkpoint after releasing orphans");
            }
        }
        self.list_orphan_volumes(&live).await;
        self.housekeeping.listed.send_replace(true);
        self.store().touch();
    }

    /// A volume reconciler over this node's volumes, retrying with the
    /// volume backoff.
    fn volume_reconciler(
        &self,
        metrics: crate::volume::reconciler::ReconcilerMetrics,
    ) -> crate::volume::reconciler::Reconciler {
        let lifecycle = self.runtime.machine();
        let backoff = lifecycle.config.volume_backoff;
        crate::volume::reconciler::Reconciler::new(
            lifecycle.volumes.clone(),
            lifecycle.config.root_dir.clone(),
            backoff.initial,
            backoff.max,
            metrics,
        )
    }

    /// Finds the pods no source knows whose directory (volumes) is still
    /// on disk: they count as holding something until the volume
    /// reconciler ([`Pods::reconcile_volumes`]) has released it. The staged
    /// CSI volumes the running pods use are held for them first.
    async fn list_orphan_volumes(&self, live: &[String]) {
        let reconciler = self.volume_reconciler(crate::volume::reconciler::ReconcilerMetrics::default());
        let live: std::collections::HashSet<String> = live.iter().cloned().collect();
        reconciler.hold_staged_for(&live).await;
        let orphans = reconciler.orphans(|| self.runtime.keys().into_iter().collect());
        if !orphans.is_empty() {
            tracing::info!(
                pods = orphans.len(),
                "pods no source knows left volumes or directories; the volume reconciler releases them"
            );
        }
        self.housekeeping.leftovers.send_modify(|leftovers| {
            leftovers.pending = orphans.into_iter().map(|uid| (uid, String::new())).collect();
        });
    }

    /// Waits until every pod task stopped after shutdown.
    pub async fn stopped(&self) {
        self.runtime.stopped().await;
    }
}
