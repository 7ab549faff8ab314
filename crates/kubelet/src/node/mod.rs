//! The node: every component composed and running, in one entry point.
//!
//! [`NodeBuilder`] takes a [`NodeConfig`] and starts, in order, the device
//! manager (`device-plugins/kubelet.sock` and its checkpoint), the plugin
//! registration service (`plugins_registry/`) with the `CSIPlugin` and
//! `DevicePlugin` handlers and any handler an embedder adds, the pod
//! lifecycle with the embedder's [`Provider`] (if any), the static pods of
//! the manifest directory (if set), the health port (`/healthz`,
//! `/metrics`; its address is written to `<root>/rustlet-endpoint`) and the
//! local socket `<root>/rustlet.sock` (those and `/status`, `/pods`,
//! `/node`, `/containerLogs`, for root and the node's user only), through
//! which `rustlet get` and `rustlet logs` read the node. [`Node`] hands out the
//! components' handles and runs until the cancellation token given to
//! [`NodeBuilder::start`] fires; [`Node::stopped`] then waits for every
//! component to finish within the shutdown grace.
//!
//! ```no_run
//! # async fn run() -> Result<(), kubelet::node::NodeError> {
//! use kubelet::node::{NodeBuilder, NodeConfig};
//! use tokio_util::sync::CancellationToken;
//!
//! let shutdown = CancellationToken::new();
//! let node = NodeBuilder::new(NodeConfig::new("/tmp/rustlet", "node-1")).start(shutdown.clone()).await?;
//! println!("healthz on {:?}", node.http_address());
//! shutdown.cancelled().await;
//! node.stopped().await;
//! # Ok(()) }
//! ```
//!
//! # Health
//! Each long-running component reports its health ([`crate::health`]); the
//! node also watches the tasks it spawned, and one that ends before shutdown
//! (a panic, say) turns its check to failing with the reason. `/healthz`
//! answers 500 naming the failing checks; `/healthz/<check>` answers for one.

pub mod labels;

use crate::cluster::capacity::{self, NodeDescription};
pub use crate::cluster::capacity::{DEFAULT_MAX_PODS, measure};
use crate::server::plain as http;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kubelet_api::constants::{DEVICE_PLUGINS_DIR, PLUGINS_REGISTRY_DIR};
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::cluster::{self, ApiNodeInfo, Cluster, ClusterSettings};
use crate::csi::{
    CsiDriverRegistry, CsiHandlerConfig, CsiNodeTimeouts, CsiPluginHandler, InMemoryNodeInfo, NodeInfoPublisher,
};
use crate::device_manager::{DeviceManager, DeviceManagerConfig, DeviceManagerError};
use crate::health::{HealthReporter, Healthz};
use crate::plugin_manager::{
    PluginHandler, PluginManager, PluginManagerConfig, PluginManagerError, PluginManagerHandle, PluginType,
};
use crate::pod::{Allocatable, BackoffConfig, PodConfig, PodLifecycle, PodSource, Pods};
use crate::provider::Provider;
use crate::static_pods::{StaticPodConfig, StaticPods};
use crate::volume::{CsiDriverObjects, CsiVolumes, VolumeClaims};

/// Streaming sessions served at once by default.
pub const DEFAULT_MAX_STREAMING_SESSIONS: usize = 1024;

/// The file in the root dir that names the running node's health port.
pub const ENDPOINT_FILE: &str = "rustlet-endpoint";

/// The node's local socket in its root dir: every view of the node
/// (`/status`, `/pods`, `/node`, `/containerLogs`, with `/healthz` and
/// `/metrics`), for root and the node's own user only (mode 0600, peers
/// checked with `SO_PEERCRED`). `rustlet get` and `rustlet logs` use it.
pub const LOCAL_SOCKET: &str = "rustlet.sock";

/// How the node runs pods.
#[derive(Clone, Debug)]
pub struct PodSettings {
    /// The static pod manifest directory (`--pod-manifest-path`).
    pub manifest_dir: Option<PathBuf>,
    /// Period of its full rescan (upstream: 20 s).
    pub manifest_rescan: Duration,
    /// Pods at most (`--max-pods`).
    pub max_pods: usize,
    /// What pods may use; `None` measures the machine ([`measure`]).
    pub allocatable: Option<Allocatable>,
    /// Container restart backoff (upstream: 10 s doubling to 5 min).
    pub restart_backoff: BackoffConfig,
    /// Image pull backoff.
    pub image_backoff: BackoffConfig,
    /// Deadlines of the CSI volume calls.
    pub csi_timeouts: CsiNodeTimeouts,
    /// The cluster's DNS domain (`--cluster-domain`), for pods' `/etc/hosts`.
    pub cluster_domain: String,
    /// Sysctls pods may set beyond the safe ones (`--allowed-unsafe-sysctls`).
    pub allowed_unsafe_sysctls: Vec<String>,
    /// How often running pods' configMap, secret, projected and downwardAPI
    /// volumes are written again from the API (60 s, upstream's sync period;
    /// each pod's first a little later, so that pods started together do
    /// not read together).
    pub volume_refresh: Duration,
}

impl Default for PodSettings {
    fn default() -> Self {
        PodSettings {
            manifest_dir: None,
            manifest_rescan: Duration::from_secs(20),
            max_pods: DEFAULT_MAX_PODS,
            allocatable: None,
            restart_backoff: BackoffConfig::default(),
            image_backoff: BackoffConfig::default(),
            csi_timeouts: CsiNodeTimeouts::default(),
            cluster_domain: String::new(),
            allowed_unsafe_sysctls: Vec::new(),
            volume_refresh: Duration::from_secs(60),
        }
    }
}

/// Settings of a node. [`NodeConfig::new`] gives the kubelet's defaults for
/// a root dir; every part can be changed before [`NodeBuilder::start`].
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The node's directory (the kubelet's `--root-dir`).
    pub root_dir: PathBuf,
    /// The node's name.
    pub node_name: String,
    /// Where the HTTP endpoint listens (port 0 picks a free port); `None`
    /// serves no endpoint.
    pub http_address: Option<SocketAddr>,
    /// The plugin registration service; its directory defaults to
    /// `<root_dir>/plugins_registry`.
    pub plugins: PluginManagerConfig,
    /// The device manager; its directory defaults to `<root_dir>/device-plugins`.
    pub devices: DeviceManagerConfig,
    /// The `CSIPlugin` handler.
    pub csi: CsiHandlerConfig,
    /// The `DRAPlugin` handler and its calls.
    pub dra: crate::dra::DraConfig,
    /// Pods.
    pub pods: PodSettings,
    /// How long [`Node::stopped`] waits for the components after shutdown.
    pub shutdown_grace: Duration,
    /// Streaming sessions (log follows, exec, attach, port-forward) served
    /// at once at most; more are answered 429 (`--max-streaming-sessions`).
    pub max_streaming_sessions: usize,
    /// The node's IPs (`--node-ip`): the Node's `InternalIP` addresses and
    /// the pods' `hostIP`/`podIP` (the WebAssembly provider runs modules in
    /// the node's network, as host-network pods). Empty: none reported.
    pub node_ips: Vec<IpAddr>,
    /// The kubelet API (HTTPS, `:10250`); `None` serves none.
    pub kubelet_api: Option<crate::server::KubeletApiConfig>,
    /// The PodResources API (`<root_dir>/pod-resources/kubelet.sock`);
    /// `None` serves none.
    pub pod_resources: Option<crate::pod_resources::PodResourcesConfig>,
    /// What `/configz` shows besides the kubelet API's own settings (the
    /// binary puts its flags here, in `KubeletConfiguration`'s names).
    pub configz: serde_json::Map<String, serde_json::Value>,
}

impl NodeConfig {
    /// Defaults for a node called `node_name` in `root_dir`, with the HTTP
    /// endpoint on the kubelet's healthz address, `127.0.0.1:10248`.
    pub fn new(root_dir: impl Into<PathBuf>, node_name: impl Into<String>) -> Self {
        let root_dir = root_dir.into();
        NodeConfig {
            plugins: PluginManagerConfig::new(root_dir.join(PLUGINS_REGISTRY_DIR)),
            devices: DeviceManagerConfig::new(root_dir.join(DEVICE_PLUGINS_DIR)),
            csi: CsiHandlerConfig::default(),
            dra: crate::dra::DraConfig::default(),
            pods: PodSettings::default(),
            node_name: node_name.into(),
            http_address: Some(SocketAddr::from(([127, 0, 0, 1], 10248))),
            shutdown_grace: Duration::from_secs(10),
            max_streaming_sessions: DEFAULT_MAX_STREAMING_SESSIONS,
            node_ips: Vec::new(),
            kubelet_api: None,
            pod_resources: Some(crate::pod_resources::PodResourcesConfig::new(&root_dir)),
            configz: serde_json::Map::new(),
            root_dir,
        }
    }
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The device manager could not start.
    #[error("cannot start the device manager under root dir {root_dir}: {source}")]
    DeviceManager {
        /// The node's root dir.
        root_dir: PathBuf,
        /// What went wrong.
        #[source]
        source: DeviceManagerError,
    },
    /// The plugin registration service could not start, or a handler was
    /// added twice for one type.
    #[error("cannot start the plugin manager under root dir {root_dir}: {source}")]
    PluginManager {
        /// The node's root dir.
        root_dir: PathBuf,
        /// What went wrong.
        #[source]
        source: PluginManagerError,
    },
    /// The static pod directory could not be read or watched.
    #[error("cannot follow the static pod directory {dir}: {source}")]
    StaticPods {
        /// The directory.
        dir: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// The kubelet API could not start.
    #[error(transparent)]
    KubeletApi(#[from] crate::server::KubeletApiError),
    /// The health port or the local socket could not be served.
    #[error(transparent)]
    Endpoint(#[from] crate::server::plain::EndpointError),
}

/// Assembles a node: configuration, extra plugin handlers, extra metrics.
pub struct NodeBuilder {
    config: NodeConfig,
    handlers: Vec<(PluginType, Arc<dyn PluginHandler>)>,
    metrics: Registry,
    healthz: Healthz,
    provider: Option<Arc<dyn Provider>>,
    claims: Option<Arc<dyn VolumeClaims>>,
    cluster: Option<ClusterSettings>,
}

impl NodeBuilder {
    /// A builder for a node with `config`.
    pub fn new(config: NodeConfig) -> Self {
        NodeBuilder {
            config,
            handlers: Vec::new(),
            metrics: Registry::default(),
            healthz: Healthz::new(),
            provider: None,
            claims: None,
            cluster: None,
        }
    }

    /// Joins a cluster (see [`crate::cluster`]): registers the Node and its
    /// Lease, runs the pods bound to it, writes CSI node info. Without it
    /// the node is standalone.
    pub fn cluster(mut self, settings: ClusterSettings) -> Self {
        self.cluster = Some(settings);
        self
    }

    /// Runs pods' containers with `provider`. Without one, pods are
    /// admitted, get their devices and volumes, and wait.
    pub fn provider(mut self, provider: Arc<dyn Provider>) -> Self {
        self.provider = Some(provider);
        self
    }

    /// Resolves pods' `persistentVolumeClaim` volumes with `claims` (CSI
    /// volumes only). Without it, claims are refused as needing the API.
    pub fn volume_claims(mut self, claims: Arc<dyn VolumeClaims>) -> Self {
        self.claims = Some(claims);
        self
    }

    /// Routes plugins of `plugin_type` to `handler` (in addition to the
    /// node's own `CSIPlugin` and `DevicePlugin` handlers).
    pub fn plugin_handler(mut self, plugin_type: PluginType, handler: Arc<dyn PluginHandler>) -> Self {
        self.handlers.push((plugin_type, handler));
        self
    }

    /// Lets the embedder add its own metrics to the node's `/metrics`.
    pub fn metrics(mut self, register: impl FnOnce(&mut Registry)) -> Self {
        register(&mut self.metrics);
        self
    }

    /// Adds an embedder's health check to the node's `/healthz`.
    pub fn health_check(self, name: impl Into<String>, reporter: &HealthReporter) -> Self {
        self.healthz.add(name, reporter.check());
        self
    }

    /// Starts every component; returns once they all serve. Everything stops
    /// when `shutdown` is cancelled; await [`Node::stopped`] afterwards.
    pub async fn start(self, shutdown: CancellationToken) -> Result<Node, NodeError> {
        let NodeBuilder { config, handlers, mut metrics, healthz, provider, claims, cluster } = self;
        let created = jiff::Timestamp::now();
        let root_dir = config.root_dir.clone();
        let tasks = TaskTracker::new();

        let csi_drivers = CsiDriverRegistry::new();
        let (api_node_info, node_info, publisher) = csi_node_info(cluster.is_some());
        let csi = CsiPluginHandler::new(csi_drivers.clone(), publisher, config.csi);

        let devices = DeviceManager::start(config.devices.clone(), shutdown.clone())
            .map_err(|source| NodeError::DeviceManager { root_dir: root_dir.clone(), source })?;
        devices.register_metrics(&mut metrics);
        for (name, check) in devices.health_checks() {
            healthz.add(name, check);
        }

        let plugin_error = |source| NodeError::PluginManager { root_dir: root_dir.clone(), source };
        let mut manager = PluginManager::new(config.plugins.clone());
        manager.add_handler(PluginType::Csi, Arc::new(csi)).map_err(plugin_error)?;
        manager.add_handler(PluginType::DevicePlugin, Arc::new(devices.plugin_handler())).map_err(plugin_error)?;
        let dra_drivers = crate::dra::DraDrivers::new(config.dra, shutdown.clone());
        manager.add_handler(PluginType::Dra, Arc::new(dra_drivers.plugin_handler())).map_err(plugin_error)?;
        for (plugin_type, handler) in handlers {
            manager.add_handler(plugin_type, handler).map_err(plugin_error)?;
        }
        manager.register_metrics(&mut metrics);
        let (plugins, manager_task) = manager.start(shutdown.clone()).map_err(plugin_error)?;
        healthz.add("plugin-manager", plugins.health());
        supervise(&tasks, &healthz, "plugin-manager-task", manager_task, shutdown.clone());

        let allocatable = node_allocatable(&config, provider.as_deref());
        let mut pod_config = PodConfig::new(&root_dir, allocatable);
        pod_config.restart_backoff = config.pods.restart_backoff;
        pod_config.image_backoff = config.pods.image_backoff;
        pod_config.host_ips = config.node_ips.clone();
        pod_config.cluster_domain = config.pods.cluster_domain.clone();
        pod_config.allowed_unsafe_sysctls = config.pods.allowed_unsafe_sysctls.clone();
        pod_config.volume_refresh = config.pods.volume_refresh;
        let csi_objects = CsiDriverObjects::new();
        let mut csi_volumes =
            CsiVolumes::new(&root_dir, csi_drivers.view(), csi_objects.clone(), config.pods.csi_timeouts);
        // In a cluster, claims resolve through the API once it is connected.
        let (api_client, api_client_rx) = tokio::sync::watch::channel(None);
        let (review_client, review_client_rx) = tokio::sync::watch::channel(None);
        let api_volumes = cluster
            .as_ref()
            .map(|_| Arc::new(cluster::volumes::ApiVolumes::new(api_client_rx.clone(), &config.node_name)));
        let claims = claims.or_else(|| api_volumes.clone().map(|v| v as Arc<dyn VolumeClaims>));
        if let Some(claims) = claims {
            csi_volumes = csi_volumes.with_claims(claims);
        }
        let provider_labels = provider.as_ref().map(|p| p.node_labels()).unwrap_or_default();
        let provider_taints = provider.as_ref().map(|p| p.node_taints()).unwrap_or_default();
        if provider.is_none() {
            tracing::warn!(
                "no provider: pods are admitted and get their devices and volumes, but their containers wait"
            );
        }
        let volumes_in_use = csi_volumes.volumes_in_use();
        let api_provider = provider.clone();
        let provider_runtime = provider.clone();
        let mut lifecycle = PodLifecycle::new(pod_config, provider, Some(devices.clone())).with_csi(csi_volumes);
        // Resource claims: resolved through the API in a cluster; a
        // standalone node refuses pods with claims.
        let dra_claims = crate::dra::DraClaims::load(&root_dir, dra_drivers.clone());
        let claim_source = cluster.as_ref().map(|_| {
            Arc::new(cluster::claims::ApiClaims::new(api_client_rx.clone())) as Arc<dyn crate::dra::ClaimSource>
        });
        lifecycle = lifecycle.with_claims(dra_claims.clone(), claim_source);
        if let Some(api_volumes) = api_volumes {
            lifecycle = lifecycle.with_objects(api_volumes);
        }
        // In a cluster, pod events go to the API too.
        let (mut event_queue, mut event_recorder) = (None, crate::events::EventRecorder::log_only());
        if cluster.is_some() {
            let (recorder, queue) = crate::events::EventRecorder::queued();
            lifecycle = lifecycle.with_events(recorder.clone());
            (event_queue, event_recorder) = (Some(queue), recorder);
        }
        let pods = Pods::start(lifecycle, shutdown.clone()).await;
        // Claims their drivers did not release yet are released in the
        // background.
        tasks.spawn(dra_claims.clone().keep_releasing(Duration::from_secs(30), shutdown.clone()));
        // A node that cannot serve the PodResources API (a root dir whose
        // socket path is too long, say) still runs its pods.
        if let Some(pod_resources) = &config.pod_resources {
            serve_pod_resources(pod_resources, &pods, &devices, &dra_claims, &tasks, &healthz, &shutdown);
        }
        let static_pods = match &config.pods.manifest_dir {
            None => None,
            Some(dir) => Some(start_static_pods(&config, dir, &pods, &csi_objects, &tasks, &healthz, &shutdown).await?),
        };
        // What an earlier run left for pods that are gone (containers,
        // devices, volumes) is released once every pod source has listed
        // its pods: the static pods are applied by now; the API's are once
        // cluster mode has listed them.
        if cluster.is_some() {
            pods.sources().expect(PodSource::Api);
        }
        let housekeeping = pods.release_orphans_when_sources_ready();
        if let Some(settings) = &cluster {
            settings.pod_sync.metrics.register(&mut metrics);
        }
        let reconciler_metrics = crate::volume::reconciler::ReconcilerMetrics::default();
        reconciler_metrics.register(&mut metrics);
        let reconciler = tokio::spawn(
            pods.reconcile_volumes(reconciler_metrics, shutdown.clone())
                .instrument(tracing::info_span!("volume-reconciler")),
        );
        supervise(&tasks, &healthz, "volume-reconciler", reconciler, shutdown.clone());
        let stop = shutdown.clone();
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

        // The kubelet API is bound first: the Node advertises its port.
        let kubelet_api = match &config.kubelet_api {
            None => None,
            Some(api) => Some(
                crate::server::bind(api, &config.node_name, &config.node_ips, review_client_rx, cluster.is_none())
                    .await?,
            ),
        };
        let description = NodeDescription {
            name: config.node_name.clone(),
            allocatable,
            created,
            labels: provider_labels,
            taints: provider_taints,
            addresses: config.node_ips.clone(),
            root_dir: root_dir.clone(),
            kubelet_port: kubelet_api.as_ref().map(|api| api.address.port()),
            runtime_version: capacity::RuntimeVersion(provider_runtime),
        };
        let views = http::NodeViews {
            node_name: config.node_name.clone(),
            plugins: plugins.clone(),
            csi_drivers: csi_drivers.clone(),
            node_info: node_info.clone(),
            devices: devices.clone(),
            healthz: healthz.clone(),
            pods: pods.clone(),
            static_pods: static_pods.clone(),
            description: description.clone(),
            root_dir: root_dir.clone(),
        };
        let http_state = http::HttpState::new(views, metrics, config.max_streaming_sessions, &shutdown, &tasks);
        let kubelet_api_address = match (kubelet_api, &config.kubelet_api) {
            (Some(bound), Some(api)) => {
                let address = bound.address;
                let configz = configz(&config, api, address);
                let task = bound.serve(http_state.clone(), api_provider, configz, shutdown.clone());
                supervise(&tasks, &healthz, "kubelet-api", task, shutdown.clone());
                Some(address)
            }
            _ => None,
        };
        let local_socket = root_dir.join(LOCAL_SOCKET);
        let local = http::serve_local(&local_socket, http_state.clone(), shutdown.clone())?;
        supervise(&tasks, &healthz, "local-endpoint", local, shutdown.clone());
        let http_address = match config.http_address {
            None => None,
            Some(address) => {
                let (bound, task) = http::serve(address, http_state, shutdown.clone()).await?;
                supervise(&tasks, &healthz, "http-endpoint", task, shutdown.clone());
                write_endpoint_file(&root_dir, bound);
                Some(bound)
            }
        };
        let cluster = match (cluster, api_node_info) {
            (Some(settings), Some(csi)) => {
                let parts = cluster::NodeParts {
                    description,
                    devices: devices.clone(),
                    healthz: healthz.clone(),
                    pods: pods.clone(),
                    csi,
                    csi_objects: csi_objects.clone(),
                    client: api_client,
                    review_client,
                    tasks: tasks.clone(),
                    volumes_in_use,
                    events: event_queue,
                    recorder: event_recorder,
                    dra: dra_drivers.clone(),
                };
                Some(cluster::start(settings, parts, shutdown.clone()))
            }
            _ => None,
        };
        tracing::info!(node = %config.node_name, root_dir = %root_dir.display(), ?allocatable, cluster = cluster.is_some(), "node started");
        Ok(Node {
            config,
            plugins,
            csi_drivers,
            dra_drivers,
            dra_claims,
            csi_objects,
            node_info,
            devices,
            healthz,
            http_address,
            kubelet_api_address,
            tasks,
            pods,
            static_pods,
            allocatable,
            cluster,
        })
    }
}

/// Allocatable from the settings (or measured from the machine), its pods
/// lowered to what the provider's process can hold.
fn node_allocatable(config: &NodeConfig, provider: Option<&dyn Provider>) -> Allocatable {
    let mut allocatable = config.pods.allocatable.unwrap_or_else(|| measure(config.pods.max_pods));
    if let Some((ceiling, why)) = provider.and_then(|p| p.pod_ceiling()) {
        if ceiling < allocatable.pods {
            tracing::warn!(
                max_pods = allocatable.pods,
                ceiling,
                reason = %why,
                "the node's process holds fewer pods than --max-pods: allocatable pods lowered"
            );
            allocatable.pods = ceiling;
        } else {
            tracing::info!(ceiling, reason = %why, "pods the node's process can hold");
        }
    }
    allocatable
}

/// Where the CSI node info goes: in memory, and (in a cluster) the API too.
fn csi_node_info(in_cluster: bool) -> (Option<ApiNodeInfo>, InMemoryNodeInfo, Arc<dyn NodeInfoPublisher>) {
    if in_cluster {
        let api = ApiNodeInfo::new();
        (Some(api.clone()), api.memory().clone(), Arc::new(api))
    } else {
        let memory = InMemoryNodeInfo::new();
        (None, memory.clone(), Arc::new(memory))
    }
}

/// Serves the PodResources API; a node that cannot (a root dir whose socket
/// path is too long, say) runs its pods without it.
fn serve_pod_resources(
    config: &crate::pod_resources::PodResourcesConfig,
    pods: &Pods,
    devices: &DeviceManager,
    claims: &crate::dra::DraClaims,
    tasks: &TaskTracker,
    healthz: &Healthz,
    shutdown: &CancellationToken,
) {
    match crate::pod_resources::serve(config, pods.clone(), devices.clone(), Some(claims.clone()), shutdown.clone()) {
        Ok(task) => supervise(tasks, healthz, "pod-resources", task, shutdown.clone()),
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
    tasks: &TaskTracker,
    healthz: &Healthz,
    shutdown: &CancellationToken,
) -> Result<StaticPods, NodeError> {
    let mut source = StaticPodConfig::new(dir, &config.node_name);
    source.rescan_period = config.pods.manifest_rescan;
    let (static_pods, task) = StaticPods::start(source, pods.clone(), csi_objects.clone(), shutdown.clone())
        .await
        .map_err(|source| NodeError::StaticPods { dir: dir.to_path_buf(), source })?;
    supervise(tasks, healthz, "static-pods", task, shutdown.clone());
    Ok(static_pods)
}

/// What `/configz` shows: the node's settings in `KubeletConfiguration`'s
/// names.
fn configz(config: &NodeConfig, api: &crate::server::KubeletApiConfig, address: SocketAddr) -> serde_json::Value {
    use crate::server::{AuthorizationMode, ServingCertSource};
    let seconds = |d: Duration| format!("{}s", d.as_secs());
    let mut kubelet = serde_json::json!({
        "kind": "KubeletConfiguration",
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "address": address.ip().to_string(),
        "port": address.port(),
        "maxPods": config.pods.max_pods,
        "staticPodPath": config.pods.manifest_dir.as_ref().map(|d| d.display().to_string()).unwrap_or_default(),
        "healthzBindAddress": config.http_address.map(|a| a.ip().to_string()).unwrap_or_default(),
        "healthzPort": config.http_address.map_or(0, |a| a.port()),
        "tlsCertFile": match &api.serving { ServingCertSource::Files { cert, .. } => cert.display().to_string(), _ => String::new() },
        "tlsPrivateKeyFile": match &api.serving { ServingCertSource::Files { key, .. } => key.display().to_string(), _ => String::new() },
        "serverTLSBootstrap": api.serving == ServingCertSource::Requested,
        "authentication": {
            "x509": {"clientCAFile": api.client_ca.as_ref().map(|p| p.display().to_string()).unwrap_or_default()},
            "webhook": {"enabled": api.auth.token_webhook, "cacheTTL": seconds(api.auth.token_cache_ttl)},
            "anonymous": {"enabled": api.auth.anonymous},
        },
        "authorization": {
            "mode": match api.auth.authorization { AuthorizationMode::AlwaysAllow => "AlwaysAllow", AuthorizationMode::Webhook => "Webhook" },
            "webhook": {
                "cacheAuthorizedTTL": seconds(api.auth.authorized_ttl),
                "cacheUnauthorizedTTL": seconds(api.auth.unauthorized_ttl),
            },
        },
    });
    if let Some(map) = kubelet.as_object_mut() {
        for (key, value) in &config.configz {
            map.insert(key.clone(), value.clone());
        }
    }
    kubelet
}

/// Writes the endpoint's address where `rustlet get`/`logs` look for it.
fn write_endpoint_file(root_dir: &Path, address: SocketAddr) {
    let path = root_dir.join(ENDPOINT_FILE);
    let temp = root_dir.join(format!(".{ENDPOINT_FILE}.tmp"));
    let written = std::fs::write(&temp, format!("http://{address}\n")).and_then(|()| std::fs::rename(&temp, &path));
    if let Err(error) = written {
        tracing::warn!(%error, path = %path.display(), "cannot write the endpoint file; `rustlet get` will not find this node");
    }
}

/// Watches a component's task: if it ends before shutdown (it returned or
/// panicked), the component's check turns failing with the reason.
fn supervise(
    tasks: &TaskTracker,
    healthz: &Healthz,
    name: &'static str,
    task: JoinHandle<()>,
    shutdown: CancellationToken,
) {
    let reporter = HealthReporter::new();
    healthz.add(name, reporter.check());
    tasks.spawn(
        async move {
            let result = task.await;
            if shutdown.is_cancelled() {
                if let Err(error) = result {
                    tracing::error!(%error, "component failed while stopping");
                }
                return;
            }
            let reason = match result {
                Ok(()) => "stopped unexpectedly".to_owned(),
                Err(error) if error.is_panic() => {
                    format!("panicked: {}", crate::health::panic_message(&*error.into_panic()))
                }
                Err(error) => format!("failed: {error}"),
            };
            tracing::error!(reason, "node component is down");
            reporter.failing(reason);
        }
        .instrument(tracing::info_span!("supervise", component = name)),
    );
}

/// A running node: the components' handles. Cheap to share by reference;
/// the handles themselves are cheap to clone.
pub struct Node {
    config: NodeConfig,
    plugins: PluginManagerHandle,
    csi_drivers: CsiDriverRegistry,
    dra_drivers: crate::dra::DraDrivers,
    dra_claims: crate::dra::DraClaims,
    csi_objects: CsiDriverObjects,
    node_info: InMemoryNodeInfo,
    devices: DeviceManager,
    healthz: Healthz,
    http_address: Option<SocketAddr>,
    kubelet_api_address: Option<SocketAddr>,
    tasks: TaskTracker,
    pods: Pods,
    static_pods: Option<StaticPods>,
    allocatable: Allocatable,
    cluster: Option<Cluster>,
}

impl Node {
    /// Cluster mode, if the node joined a cluster.
    pub fn cluster(&self) -> Option<&Cluster> {
        self.cluster.as_ref()
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.config.node_name
    }

    /// The node's root dir.
    pub fn root_dir(&self) -> &Path {
        &self.config.root_dir
    }

    /// The plugin registration service.
    pub fn plugins(&self) -> &PluginManagerHandle {
        &self.plugins
    }

    /// The CSI drivers registered on this node.
    pub fn csi_drivers(&self) -> &CsiDriverRegistry {
        &self.csi_drivers
    }

    /// The DRA drivers registered on the node, and their calls.
    pub fn dra_drivers(&self) -> &crate::dra::DraDrivers {
        &self.dra_drivers
    }

    /// The resource claims prepared on the node.
    pub fn dra_claims(&self) -> &crate::dra::DraClaims {
        &self.dra_claims
    }

    /// The node's CSI facts (annotation, topology labels, CSINode drivers).
    pub fn node_info(&self) -> &InMemoryNodeInfo {
        &self.node_info
    }

    /// The CSIDriver objects the node knows (from static manifests when
    /// standalone).
    pub fn csi_driver_objects(&self) -> &CsiDriverObjects {
        &self.csi_objects
    }

    /// The node's pods.
    pub fn pods(&self) -> &Pods {
        &self.pods
    }

    /// The static pod source, if the node has a manifest directory.
    pub fn static_pods(&self) -> Option<&StaticPods> {
        self.static_pods.as_ref()
    }

    /// What pods may use (cpu, memory, pod count; devices come from the
    /// device manager).
    pub fn allocatable(&self) -> Allocatable {
        self.allocatable
    }

    /// The device manager.
    pub fn devices(&self) -> &DeviceManager {
        &self.devices
    }

    /// The node's health checks.
    pub fn healthz(&self) -> &Healthz {
        &self.healthz
    }

    /// The bound address of the HTTP endpoint, if it serves one.
    pub fn http_address(&self) -> Option<SocketAddr> {
        self.http_address
    }

    /// The local socket (`<root>/rustlet.sock`): every view of the node,
    /// for root and the node's own user.
    pub fn local_socket(&self) -> PathBuf {
        self.config.root_dir.join(LOCAL_SOCKET)
    }

    /// Where the kubelet API (HTTPS) listens, if it is served.
    pub fn kubelet_api_address(&self) -> Option<SocketAddr> {
        self.kubelet_api_address
    }

    /// Waits for every component to stop (after shutdown was cancelled), at
    /// most the shutdown grace; past it, logs what is still running.
    pub async fn stopped(self) {
        let grace = self.config.shutdown_grace;
        let devices = self.devices.clone();
        let tasks = self.tasks.clone();
        let pods = self.pods.clone();
        let all = async move {
            tasks.close();
            tasks.wait().await;
            pods.stopped().await;
            devices.stopped().await;
        };
        let _ = std::fs::remove_file(self.config.root_dir.join(ENDPOINT_FILE));
        let _ = std::fs::remove_file(self.config.root_dir.join(LOCAL_SOCKET));
        if tokio::time::timeout(grace, all).await.is_err() {
            tracing::warn!(?grace, "components still running after the shutdown grace; not waiting any longer");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::ComponentHealth;

    /// A component task that panics before shutdown turns its check to
    /// failing with the panic's message; one that ends at shutdown does not.
    #[tokio::test]
    async fn a_component_that_dies_fails_its_check() {
        let tasks = TaskTracker::new();
        let healthz = Healthz::new();
        let shutdown = CancellationToken::new();
        let gate = Arc::new(tokio::sync::Notify::new());
        let wait = gate.clone();
        let doomed = tokio::spawn(async move {
            wait.notified().await;
            panic!("boom");
        });
        supervise(&tasks, &healthz, "doomed", doomed, shutdown.clone());
        assert_eq!(healthz.get("doomed"), Some(ComponentHealth::Healthy));
        let fine = tokio::spawn(shutdown.clone().cancelled_owned());
        supervise(&tasks, &healthz, "fine", fine, shutdown.clone());
        let mut changes = healthz.watch("doomed").expect("check exists");
        gate.notify_one();
        tokio::time::timeout(Duration::from_secs(20), changes.wait_for(|h| !h.is_healthy()))
            .await
            .expect("in time")
            .expect("reporter alive");
        assert_eq!(healthz.get("doomed"), Some(ComponentHealth::Failing { reason: "panicked: boom".into() }));
        shutdown.cancel();
        tasks.close();
        tokio::time::timeout(Duration::from_secs(20), tasks.wait()).await.expect("supervisors end");
        assert_eq!(healthz.get("fine"), Some(ComponentHealth::Healthy), "ending at shutdown is not a failure");
    }
}
