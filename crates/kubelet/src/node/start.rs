//! The steps of [`NodeBuilder::start`](super::NodeBuilder::start), in the
//! order it takes them: the plugin system, the pod lifecycle, the pods and
//! their sources, the HTTP surfaces, cluster mode.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::{LOCAL_SOCKET, NodeConfig, NodeError, http};
use crate::cluster::capacity::{self, NodeDescription};
use crate::cluster::{self, ApiNodeInfo, ClientReceiver, ClientSender, Cluster, ClusterSettings, VolumesInUse};
use crate::csi::{CsiDriverRegistry, CsiPluginHandler, InMemoryNodeInfo, NodeInfoPublisher};
use crate::device_manager::DeviceManager;
use crate::dra::{DraClaims, DraDrivers};
use crate::events::{EventQueue, EventRecorder};
use crate::health::Healthz;
use crate::plugin_manager::{PluginHandler, PluginManager, PluginManagerHandle, PluginType};
use crate::pod::{Allocatable, PodConfig, PodLifecycle, PodSource, Pods};
use crate::provider::Provider;
use crate::static_pods::{StaticPodConfig, StaticPods};
use crate::supervisor::{Supervision, TaskEnds};
use crate::volume::{CsiDriverObjects, CsiVolumes, VolumeClaims};

/// What every step shares: the configuration, the node's checks, its
/// tasks and their supervision, the shutdown token.
pub(super) struct Wiring<'a> {
    pub(super) config: &'a NodeConfig,
    pub(super) healthz: &'a Healthz,
    pub(super) tasks: &'a TaskTracker,
    pub(super) supervision: &'a Supervision,
    pub(super) shutdown: &'a CancellationToken,
}

/// The node's supervisor, its task ends counted in `metrics`.
pub(super) fn supervision(
    metrics: &mut Registry,
    healthz: &Healthz,
    tasks: &TaskTracker,
    shutdown: &CancellationToken,
) -> Supervision {
    let task_ends = TaskEnds::default();
    metrics.register(
        "rustlet_supervised_task_ends_total",
        "Ends of the node's supervised tasks before shutdown, by task and outcome (panicked, stopped, failed)",
        task_ends.clone(),
    );
    Supervision::new(shutdown.clone(), healthz.clone(), tasks.clone()).counting(task_ends)
}

/// Makes the root dir (with its `pods`, `plugins` and `plugins_registry`)
/// and makes it a shared mount, as the kubelet's start does, so that
/// what a plugin's pod mounts beneath a `Bidirectional` volume of it (a
/// CSI driver's publish target under `<root>/pods`) reaches the host and
/// the other pods. Where that cannot be done (not root), the node runs on
/// and says what will not work; the kubelet would refuse to start.
pub(super) fn share_root_dir(root_dir: &Path) {
    use crate::volume::mounts::{SharedMount, make_rshared};
    if let Err(error) = std::fs::create_dir_all(root_dir) {
        tracing::warn!(root_dir = %root_dir.display(), %error, "cannot make the root dir");
        return;
    }
    make_data_dirs(root_dir);
    match make_rshared(root_dir) {
        Ok(SharedMount::Made) => {
            tracing::info!(root_dir = %root_dir.display(), "root dir bind-mounted on itself with shared propagation")
        }
        Ok(SharedMount::AlreadyShared) => {
            tracing::debug!(root_dir = %root_dir.display(), "root dir is on a shared mount already")
        }
        Err(error) => tracing::warn!(
            root_dir = %root_dir.display(),
            error = %error,
            "the root dir is not a shared mount: volumes under it with mountPropagation Bidirectional or \
             HostToContainer will fail to start"
        ),
    }
}

/// The dirs the kubelet makes under its root dir at start
/// (`setupDataDirs`): plugin pods mount them as hostPath `type: Directory`
/// before any pod of the node has a volume.
fn make_data_dirs(root_dir: &Path) {
    for dir in ["pods", "plugins", "plugins_registry"] {
        let path = root_dir.join(dir);
        if let Err(error) = std::fs::create_dir_all(&path) {
            tracing::warn!(dir = %path.display(), %error, "cannot make a dir of the root dir");
        }
    }
}

/// The plugin system, started.
pub(super) struct PluginParts {
    pub(super) csi_drivers: CsiDriverRegistry,
    /// The CSI node facts written to the API (in a cluster).
    pub(super) api_node_info: Option<ApiNodeInfo>,
    pub(super) node_info: InMemoryNodeInfo,
    pub(super) devices: DeviceManager,
    pub(super) dra_drivers: DraDrivers,
    pub(super) plugins: PluginManagerHandle,
}

/// Starts the device manager and the plugin manager with the CSI, device
/// plugin and DRA handlers and the embedder's.
pub(super) fn start_plugins(
    wiring: &Wiring<'_>,
    handlers: Vec<(PluginType, Arc<dyn PluginHandler>)>,
    in_cluster: bool,
    metrics: &mut Registry,
) -> Result<PluginParts, NodeError> {
    let Wiring { config, healthz, shutdown, .. } = wiring;
    let root_dir = &config.root_dir;
    let csi_drivers = CsiDriverRegistry::new();
    let (api_node_info, node_info, publisher) = csi_node_info(in_cluster);
    let csi = CsiPluginHandler::new(csi_drivers.clone(), publisher, config.csi);
    let devices = DeviceManager::start(config.devices.clone(), (*shutdown).clone())
        .map_err(|source| NodeError::DeviceManager { root_dir: root_dir.clone(), source })?;
    devices.register_metrics(metrics);
    for (name, check) in devices.health_checks() {
        healthz.add(name, check);
    }
    let plugin_error = |source| NodeError::PluginManager { root_dir: root_dir.clone(), source };
    let mut manager = PluginManager::new(config.plugins.clone());
    manager.add_handler(PluginType::Csi, Arc::new(csi)).map_err(plugin_error)?;
    manager.add_handler(PluginType::DevicePlugin, Arc::new(devices.plugin_handler())).map_err(plugin_error)?;
    let dra_drivers = DraDrivers::new(config.dra, (*shutdown).clone());
    dra_drivers.register_metrics(metrics);
    manager.add_handler(PluginType::Dra, Arc::new(dra_drivers.plugin_handler())).map_err(plugin_error)?;
    for (plugin_type, handler) in handlers {
        manager.add_handler(plugin_type, handler).map_err(plugin_error)?;
    }
    manager.register_metrics(metrics);
    let (plugins, manager_task) = manager.start((*shutdown).clone()).map_err(plugin_error)?;
    healthz.add("plugin-manager", plugins.health());
    wiring.supervision.watch("plugin-manager-task", manager_task);
    Ok(PluginParts { csi_drivers, api_node_info, node_info, devices, dra_drivers, plugins })
}

/// The CSI node-info publisher: the API's in a cluster (with its
/// in-memory table), the in-memory table alone otherwise.
fn csi_node_info(in_cluster: bool) -> (Option<ApiNodeInfo>, InMemoryNodeInfo, Arc<dyn NodeInfoPublisher>) {
    if in_cluster {
        let api = ApiNodeInfo::new();
        (Some(api.clone()), api.memory().clone(), Arc::new(api))
    } else {
        let memory = InMemoryNodeInfo::new();
        (None, memory.clone(), Arc::new(memory))
    }
}

/// What the pod lifecycle was built with that others use too.
pub(super) struct LifecycleParts {
    pub(super) csi_objects: CsiDriverObjects,
    pub(super) dra_claims: DraClaims,
    /// Gets the API client once cluster mode has one (volumes and claims
    /// read through it).
    pub(super) api_client: ClientSender,
    /// Gets the reviews' client (the kubelet API's webhooks).
    pub(super) review_client: ClientSender,
    pub(super) review_client_rx: ClientReceiver,
    pub(super) volumes_in_use: VolumesInUse,
    /// Pod events for the API (in a cluster).
    pub(super) event_queue: Option<EventQueue>,
    pub(super) event_recorder: EventRecorder,
}

/// The pod lifecycle: `provider` runs containers, devices and CSI volumes
/// come from the plugin system, and in a cluster claims, API objects and
/// events go through the API.
pub(super) fn pod_lifecycle(
    config: &NodeConfig,
    allocatable: Allocatable,
    provider: Option<Arc<dyn Provider>>,
    claims: Option<Arc<dyn VolumeClaims>>,
    in_cluster: bool,
    plugins: &PluginParts,
) -> (PodLifecycle, LifecycleParts) {
    let csi_objects = CsiDriverObjects::new();
    let mut csi_volumes =
        CsiVolumes::new(&config.root_dir, plugins.csi_drivers.view(), csi_objects.clone(), config.pods.csi_timeouts);
    let (api_client, api_client_rx) = tokio::sync::watch::channel(None);
    let (review_client, review_client_rx) = tokio::sync::watch::channel(None);
    let api_volumes =
        in_cluster.then(|| Arc::new(cluster::volumes::ApiVolumes::new(api_client_rx.clone(), &config.node_name)));
    if let Some(claims) = claims.or_else(|| api_volumes.clone().map(|v| v as Arc<dyn VolumeClaims>)) {
        csi_volumes = csi_volumes.with_claims(claims);
    }
    if provider.is_none() {
        tracing::warn!("no provider: pods are admitted and get their devices and volumes, but their containers wait");
    }
    let volumes_in_use = csi_volumes.volumes_in_use();
    let mut lifecycle = PodLifecycle::new(pod_config(config, allocatable), provider, Some(plugins.devices.clone()))
        .with_csi(csi_volumes);
    // Resource claims: resolved through the API in a cluster; a
    // standalone node refuses pods with claims.
    let dra_claims = DraClaims::load(&config.root_dir, plugins.dra_drivers.clone());
    let claim_source = in_cluster
        .then(|| Arc::new(cluster::claims::ApiClaims::new(api_client_rx.clone())) as Arc<dyn crate::dra::ClaimSource>);
    lifecycle = lifecycle.with_claims(dra_claims.clone(), claim_source);
    if let Some(api_volumes) = api_volumes {
        lifecycle = lifecycle.with_objects(api_volumes);
    }
    // In a cluster, pod events go to the API too.
    let (mut event_queue, mut event_recorder) = (None, EventRecorder::log_only());
    if in_cluster {
        let (recorder, queue) = EventRecorder::queued();
        lifecycle = lifecycle.with_events(recorder.clone());
        (event_queue, event_recorder) = (Some(queue), recorder);
    }
    let parts = LifecycleParts {
        csi_objects,
        dra_claims,
        api_client,
        review_client,
        review_client_rx,
        volumes_in_use,
        event_queue,
        event_recorder,
    };
    (lifecycle, parts)
}

/// The lifecycle's configuration from the node's.
fn pod_config(config: &NodeConfig, allocatable: Allocatable) -> PodConfig {
    let mut pod_config = PodConfig::new(&config.root_dir, allocatable);
    pod_config.restart_backoff = config.pods.restart_backoff;
    pod_config.image_backoff = config.pods.image_backoff;
    pod_config.volume_backoff = config.pods.volume_backoff;
    pod_config.host_ips = config.node_ips.clone();
    pod_config.cluster_domain = config.pods.cluster_domain.clone();
    pod_config.allowed_unsafe_sysctls = config.pods.allowed_unsafe_sysctls.clone();
    pod_config.volume_refresh = config.pods.volume_refresh;
    pod_config.pressure = config.pods.pressure.clone();
    pod_config.cdi_spec_dirs = config.pods.cdi_spec_dirs.clone();
    pod_config
}

/// Starts container log rotation, when asked for and a provider runs
/// containers.
pub(super) fn start_log_rotation(wiring: &Wiring<'_>, pods: &Pods, provider: Option<Arc<dyn Provider>>) {
    let (Some(rotation), Some(provider)) = (wiring.config.pods.log_rotation, provider) else { return };
    let task = crate::log_rotation::run(
        rotation,
        wiring.config.root_dir.clone(),
        pods.store().clone(),
        provider,
        (*wiring.shutdown).clone(),
    );
    wiring.supervision.watch("log-rotation", tokio::spawn(task));
}

/// Starts garbage collection, when asked for and a provider runs
/// containers.
pub(super) fn start_gc(wiring: &Wiring<'_>, provider: Option<Arc<dyn Provider>>, recorder: &EventRecorder) {
    let (Some(settings), Some(provider)) = (wiring.config.pods.gc.clone(), provider) else { return };
    let node = wiring.config.node_name.clone();
    let task = crate::gc::run(settings, provider, recorder.clone(), node, (*wiring.shutdown).clone());
    wiring.supervision.watch("garbage-collection", tokio::spawn(task));
}

/// Starts the relist of the runtime's containers (the PLEG series,
/// `kubelet_running_pods`), when a provider runs containers.
pub(super) fn start_relist(wiring: &Wiring<'_>, pods: &Pods, provider: Option<Arc<dyn Provider>>) {
    let Some(provider) = provider else { return };
    let task = kubelet_pods::pod::relist::relist(
        provider,
        pods.store().clone(),
        pods.metrics().clone(),
        (*wiring.shutdown).clone(),
    );
    wiring.supervision.watch("relist", tokio::spawn(task));
}

/// Starts the eviction manager, when the node has one.
pub(super) fn start_eviction(
    wiring: &Wiring<'_>,
    pods: &Pods,
    provider: Option<Arc<dyn Provider>>,
    recorder: &EventRecorder,
) {
    let Some(settings) = wiring.config.pods.eviction.clone() else { return };
    let manager = crate::eviction::manager::EvictionManager::new(
        settings,
        pods.clone(),
        provider,
        wiring.config.pods.pressure.clone(),
        recorder.clone(),
        &wiring.config.node_name,
    );
    let shutdown = (*wiring.shutdown).clone();
    wiring.supervision.watch("eviction-manager", tokio::spawn(manager.run(shutdown)));
}

/// Starts the pods: the lifecycle, the release of claims and of what an
/// earlier run left, the PodResources API, the static pods, the volume
/// reconciler. Returns once the static pods are applied (and, when every
/// source is listed, once housekeeping is done).
pub(super) async fn start_pods(
    wiring: &Wiring<'_>,
    lifecycle: PodLifecycle,
    parts: &LifecycleParts,
    plugins: &PluginParts,
    cluster: Option<&ClusterSettings>,
    metrics: &mut Registry,
) -> Result<(Pods, Option<StaticPods>), NodeError> {
    let Wiring { config, tasks, supervision, shutdown, .. } = wiring;
    let pods = Pods::start(lifecycle, (*shutdown).clone()).await;
    let store = pods.store().clone();
    pods.metrics().register(metrics, move || kubelet_pods::pod::relist::exited_containers(&store));
    pods.volume_stats().register(metrics);
    let refresher = pods.refresh_volume_stats(config.pods.volume_stats_period, (*shutdown).clone());
    supervision.watch("volume-stats", tokio::spawn(refresher));
    // Claims their drivers did not release yet are released in the background.
    let releasing = tokio::spawn(parts.dra_claims.clone().keep_releasing(Duration::from_secs(30), (*shutdown).clone()));
    supervision.watch("dra-claim-release", releasing);
    if let Some(pod_resources) = &config.pod_resources {
        serve_pod_resources(pod_resources, &pods, &plugins.devices, &parts.dra_claims, supervision);
    }
    let static_pods = match &config.pods.manifest_dir {
        None => None,
        Some(dir) => Some(start_static_pods(config, dir, &pods, &parts.csi_objects, supervision).await?),
    };
    // What an earlier run left for pods that are gone (containers,
    // devices, volumes) is released once every pod source has listed its
    // pods: the static pods are applied by now; the API's are once cluster
    // mode has listed them.
    if cluster.is_some() {
        pods.sources().expect(PodSource::Api);
    }
    let housekeeping = pods.release_orphans_when_sources_ready();
    if let Some(settings) = cluster {
        settings.pod_sync.metrics.register(metrics);
        settings.metrics.register(metrics);
    }
    let reconciler_metrics = crate::volume::reconciler::ReconcilerMetrics::default();
    reconciler_metrics.register(metrics);
    let reconciler = tokio::spawn(
        pods.reconcile_volumes(reconciler_metrics, (*shutdown).clone())
            .instrument(tracing::info_span!("volume-reconciler")),
    );
    supervision.watch("volume-reconciler", reconciler);
    let stop = (*shutdown).clone();
    // Not supervised: one job, awaited below once every pod source is ready.
    let sources_ready = tasks.spawn(
        async move {
            tokio::select! {
                () = stop.cancelled() => {}
                () = housekeeping => {}
            }
        }
        .instrument(tracing::info_span!("housekeeping")),
    );
    if pods.sources().all_ready() {
        let _ = sources_ready.await;
    }
    Ok((pods, static_pods))
}

/// Serves the PodResources API; a node that cannot (a root dir whose socket
/// path is too long, say) runs its pods without it.
fn serve_pod_resources(
    config: &crate::pod_resources::PodResourcesConfig,
    pods: &Pods,
    devices: &DeviceManager,
    claims: &DraClaims,
    supervision: &Supervision,
) {
    let shutdown = supervision.shutdown().clone();
    match crate::pod_resources::serve(config, pods.clone(), devices.clone(), Some(claims.clone()), shutdown) {
        Ok(task) => supervision.watch("pod-resources", task),
        Err(error) => tracing::error!(
            socket = %config.socket.display(),
            %error,
            "cannot serve the PodResources API; the node runs without it"
        ),
    }
}

/// Follows the static pod manifests of `dir`.
async fn start_static_pods(
    config: &NodeConfig,
    dir: &Path,
    pods: &Pods,
    csi_objects: &CsiDriverObjects,
    supervision: &Supervision,
) -> Result<StaticPods, NodeError> {
    let mut source = StaticPodConfig::new(dir, &config.node_name);
    source.rescan_period = config.pods.manifest_rescan;
    let shutdown = supervision.shutdown().clone();
    let (static_pods, task) = StaticPods::start(source, pods.clone(), csi_objects.clone(), shutdown)
        .await
        .map_err(|source| NodeError::StaticPods { dir: dir.to_path_buf(), source })?;
    supervision.watch("static-pods", task);
    Ok(static_pods)
}

/// Where the HTTP surfaces listen.
pub(super) struct Endpoints {
    pub(super) kubelet_api: Option<SocketAddr>,
    pub(super) http: Option<SocketAddr>,
}

/// The node's facts that describe it, as the HTTP surfaces and cluster mode
/// report them.
pub(super) struct Described {
    pub(super) created: jiff::Timestamp,
    pub(super) capacity: Allocatable,
    pub(super) allocatable: Allocatable,
    pub(super) provider: Option<Arc<dyn Provider>>,
}

/// Binds the kubelet API, when the node serves one (first: the Node
/// advertises its port).
pub(super) async fn bind_kubelet_api(
    wiring: &Wiring<'_>,
    plugins: &PluginParts,
    parts: &LifecycleParts,
) -> Result<Option<crate::server::BoundApi>, NodeError> {
    let config = wiring.config;
    let Some(api) = &config.kubelet_api else { return Ok(None) };
    let standalone = plugins.api_node_info.is_none();
    let reviews = parts.review_client_rx.clone();
    Ok(Some(crate::server::bind(api, &config.node_name, &config.node_ips, reviews, standalone).await?))
}

/// Serves the kubelet API bound before, the local socket and the health
/// port, each showing `description`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn start_endpoints(
    wiring: &Wiring<'_>,
    kubelet_api: Option<crate::server::BoundApi>,
    description: NodeDescription,
    provider: Option<Arc<dyn Provider>>,
    plugins: &PluginParts,
    pods: &Pods,
    static_pods: Option<StaticPods>,
    metrics: Registry,
) -> Result<Endpoints, NodeError> {
    let Wiring { config, tasks, supervision, shutdown, .. } = wiring;
    let views = http::NodeViews {
        node_name: config.node_name.clone(),
        plugins: plugins.plugins.clone(),
        csi_drivers: plugins.csi_drivers.clone(),
        node_info: plugins.node_info.clone(),
        devices: plugins.devices.clone(),
        healthz: wiring.healthz.clone(),
        pods: pods.clone(),
        static_pods,
        description,
        root_dir: config.root_dir.clone(),
    };
    let state = http::HttpState::new(views, metrics, config.max_streaming_sessions, shutdown, tasks);
    let kubelet_api_address = match (kubelet_api, &config.kubelet_api) {
        (Some(bound), Some(api)) => {
            let address = bound.address;
            let configz = super::configz(config, api, address);
            supervision.watch("kubelet-api", bound.serve(state.clone(), provider, configz, supervision));
            Some(address)
        }
        _ => None,
    };
    let local = http::serve_local(&config.root_dir.join(LOCAL_SOCKET), state.clone(), (*shutdown).clone())?;
    supervision.watch("local-endpoint", local);
    let http_address = match config.http_address {
        None => None,
        Some(address) => {
            let (bound, task) = http::serve(address, state, (*shutdown).clone()).await?;
            supervision.watch("http-endpoint", task);
            super::write_endpoint_file(&config.root_dir, bound);
            Some(bound)
        }
    };
    Ok(Endpoints { kubelet_api: kubelet_api_address, http: http_address })
}

/// What describes the Node: the node's facts, the provider's labels,
/// taints and runtime, the kubelet API's port.
pub(super) fn describe(config: &NodeConfig, described: Described, kubelet_port: Option<u16>) -> NodeDescription {
    let provider = described.provider;
    NodeDescription {
        name: config.node_name.clone(),
        capacity: described.capacity,
        allocatable: described.allocatable,
        reservation: config.pods.reservation.clone(),
        pressure: config.pods.pressure.clone(),
        created: described.created,
        labels: provider.as_ref().map(|p| p.node_labels()).unwrap_or_default(),
        taints: provider.as_ref().map(|p| p.node_taints()).unwrap_or_default(),
        addresses: config.node_ips.clone(),
        root_dir: config.root_dir.clone(),
        kubelet_port,
        runtime: capacity::RuntimeFacts(provider),
        kubelet_version: cluster::VERSION.to_owned(),
    }
}

/// Starts cluster mode, when the node joins one.
pub(super) fn start_cluster(
    wiring: &Wiring<'_>,
    settings: Option<ClusterSettings>,
    description: NodeDescription,
    parts: LifecycleParts,
    plugins: &PluginParts,
    pods: &Pods,
) -> Option<Cluster> {
    let (settings, csi) = (settings?, plugins.api_node_info.clone()?);
    let node = cluster::NodeParts {
        supervision: wiring.supervision.clone(),
        description,
        devices: plugins.devices.clone(),
        healthz: wiring.healthz.clone(),
        pods: pods.clone(),
        csi,
        csi_objects: parts.csi_objects,
        client: parts.api_client,
        review_client: parts.review_client,
        volumes_in_use: parts.volumes_in_use,
        events: parts.event_queue,
        recorder: parts.event_recorder,
        dra: plugins.dra_drivers.clone(),
    };
    Some(cluster::start(settings, node, wiring.shutdown.clone()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_root_dir_has_the_kubelets_data_dirs_from_the_start() {
        let root = tempfile::tempdir().expect("root");
        super::make_data_dirs(root.path());
        for dir in ["pods", "plugins", "plugins_registry"] {
            assert!(root.path().join(dir).is_dir(), "{dir}");
        }
    }
}
